"""Whether files changed since the last look: the one check behind every reload on a file change
(the collector's TLS certificates, a web config and the files it names, the policy).

A look stats each file (following symlinks, as its readers do) and compares the signature with the
last one: cheap enough for every TLS handshake (a few microseconds a file), so nothing is read
until something moved. A file's signature is (path, mtime_ns, size, inode, device): a rewrite
moves the mtime or the size, and a swap of a mounted Secret or ConfigMap (kubelet replaces a
symlink) or a copy over the file by rename moves the inode. ctime is left out: it moves on a chmod
or chown too, which would reload (and audit) files whose content did not change. A file that cannot
be stat'ed has (path, -1, errno): its going, coming back, or failing another way is a change too,
so a reader tries it and reports once, never once per look.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

FileSignature = tuple[str, int, int, int, int] | tuple[str, int, int]
Signature = tuple[FileSignature, ...]


def file_signature(paths: Iterable[str | None]) -> Signature:
    """The signature of `paths` now; an empty path (None or "") names no file and is skipped."""
    out: list[FileSignature] = []
    for path in paths:
        if not path:
            continue
        try:
            st = os.stat(path)
        except OSError as exc:
            out.append((path, -1, exc.errno or 0))
            continue
        out.append((path, st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev))
    return tuple(out)


class FileWatch:
    """A fixed set of files and their signature at the last look. Not locked: a caller that looks
    from several threads holds its own lock around `poll`."""

    def __init__(self, paths: Iterable[str | None]) -> None:
        self.paths = tuple(path for path in paths if path)
        self.signature = file_signature(self.paths)

    def poll(self) -> bool:
        """Look now: True when a file changed since the last look, which this one then becomes."""
        signature = file_signature(self.paths)
        if signature == self.signature:
            return False
        self.signature = signature
        return True
