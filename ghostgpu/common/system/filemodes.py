"""Files at rest that only their owner may read: the collector's store (and its WAL and SHM), the
audit file, and the state directory they live in (docs/SECURITY.md, "Data at rest").

The store holds every finding and the admin-only audit trail, so `ghostgpu audit --db` by another
local user must fail on the file's mode, not on a policy nobody consults there. Modes are set
exactly (fchmod/chmod after creating), never left to the umask, and files that an older ghostgpu
(or a copy) left looser are tightened at start, with one line saying so.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable

STATE_DIR = "/var/lib/ghostgpu"  # `ghostgpu up`'s and the collector's default state directory
DIR_MODE = 0o700
FILE_MODE = 0o600

log = logging.getLogger("ghostgpu.files")


def _say(line: str) -> None:
    log.warning("%s", line)


def make_private_dirs(directory: str) -> None:
    """mkdir -p `directory`, every level created here 0700 (whatever the umask); levels that exist
    are left as they are (a shared parent such as /tmp is not ours to change)."""
    directory = os.path.abspath(directory)
    missing: list[str] = []
    at = directory
    while not os.path.isdir(at):
        missing.append(at)
        parent = os.path.dirname(at)
        if parent == at:
            break
        at = parent
    for path in reversed(missing):
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            continue  # made meanwhile by someone else: not ours to change
        os.chmod(path, DIR_MODE)


def tighten(path: str, mode: int, say: Callable[[str], None] = _say) -> bool:
    """chmod `path` to `mode` when it grants more than `mode` (group or other bits), saying so in one
    line; True when it changed. A missing file, or one this uid does not own, is left alone."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    now = stat.S_IMODE(st.st_mode)
    if not now & ~mode & 0o777 or st.st_uid != os.geteuid():
        return False
    try:
        os.chmod(path, mode)
    except OSError as e:
        say(f"{path} is mode {now:04o}, readable by others, and cannot be made {mode:04o} ({e.strerror})")
        return False
    say(f"{path} was mode {now:04o}, open to other local users: now {mode:04o}")
    return True


def private_file(path: str, say: Callable[[str], None] = _say) -> None:
    """Before a file is opened for writing: its directory made (new levels 0700), the file created
    0600 if missing, tightened to 0600 if looser."""
    make_private_dirs(os.path.dirname(os.path.abspath(path)))
    if os.path.abspath(os.path.dirname(path)) == STATE_DIR:
        tighten(STATE_DIR, DIR_MODE, say)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    except FileExistsError:
        tighten(path, FILE_MODE, say)
        return
    try:
        os.fchmod(fd, FILE_MODE)  # exactly, whatever the umask
    finally:
        os.close(fd)
