"""Which processes the periodic /proc rescan reads: the few whose fd table changed, or all of them.

A full /proc scan reads every fd link on the node (1,000 processes x 100 fds: 100,000 readlinks,
~0.3 s of kernel time on Linux 6.18), yet with BPF on the kernel side already reports every open of
a device path, every dup, close, mmap, fork, exec and exit of a holder. What it cannot see is a
device fd that arrives some other way: passed over a unix socket (SCM_RIGHTS), opened by a path
that does not start with a device prefix (relative to a directory fd or the cwd, a symlink such as
/dev/char/195:0, a bind mount or a node made elsewhere with mknod), or taken with pidfd_getfd.
Each of those adds an fd to the process's table, and since Linux 6.2 the st_size of /proc/PID/fd
is the number of open fds: one stat per process tells which tables changed.

A count can come back to where it was (a socket closed, a device fd received): the kernel marks
every tgid that releases an fd (close, dup2/dup3 over another; bpf/fd.bpf.c gg_touch, one byte per
tgid, set at most once per rescan period), and user space takes and clears those marks.

So a periodic rescan (every `scan_interval_s`) stats /proc/PID/fd of every process and reads only
the holders and the processes whose mark (inode, fd count) differs from the last rescan's or that
released an fd meanwhile: new processes (a reused PID is a new /proc inode), tables that grew or
shrank or changed. A full scan (the reconcile) runs every `full_scan_interval_s`, at the next
rescan after the kernel side lost state (a full ring buffer or a full map: its loss counters grew),
and every time when BPF is off.

What only the full reconcile finds: a device fd that arrived unseen in a process whose count came
back through close_range(2) or an exec's close-on-exec alone (neither is traced), or, on kernels
before 6.2 (st_size of /proc/PID/fd is 0 there), in a process that released no fd since.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

Mark = tuple[int, int] | None  # (st_ino, st_size) of /proc/PID/fd; None when it cannot be read

# Kernel counters (tracer/bpf_source.py STAT_NAMES) whose growth means attribution state was lost:
# a record dropped by the ring buffer, or an fd, hold, holder, device id, pending open or fork that
# did not fit its map. (ioctls_full loses only counts, which no scan restores.)
LOSS_COUNTERS = ("ringbuf_drops", "fds_full", "holds_full", "procs_full", "dev_ids_full", "pending_full",
                 "forking_full")


def read_marks(proc_root: str = "/proc") -> dict[int, Mark]:
    """PID -> (inode, fd count) of /proc/PID/fd for every process: one stat each, no fd link read."""
    try:
        names = os.listdir(proc_root)
    except OSError:
        return {}
    stat = os.stat
    marks: dict[int, Mark] = {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            st = stat(f"{proc_root}/{name}/fd")
            marks[int(name)] = (st.st_ino, st.st_size)
        except OSError:  # gone, or a fd directory we may not read: compared as it is
            marks[int(name)] = None
    return marks


def changed_pids(before: Mapping[int, Mark], after: Mapping[int, Mark], holders: Iterable[int]) -> set[int]:
    """The processes an incremental rescan reads: new or changed marks, and every holder.

    Holders are few and always read: a rescan also refreshes their identity (a parent that died, a
    shim gone, a leader turned zombie), and settles the exit of one that vanished should the
    kernel's EXIT never come (a holder found by a scan whose kernel entry could not be made).
    """
    changed = {pid for pid, mark in after.items() if before.get(pid, ()) != mark}
    changed.update(holders)
    return changed


def take_marked(buf: bytearray | mmap.mmap) -> set[int]:
    """The ids whose byte is set in a byte-per-id map (the kernel's touched_bytes), each cleared
    before it is returned: a mark the kernel sets again after that is for the next rescan."""
    taken: set[int] = set()
    pos = buf.find(b"\x01")
    while pos >= 0:
        buf[pos] = 0
        taken.add(pos)
        pos = buf.find(b"\x01", pos + 1)
    return taken


def lost_events(stats: Mapping[str, int] | None) -> int:
    """The kernel side's loss counters summed; grows whenever attribution state was lost."""
    return sum(stats.get(name, 0) for name in LOSS_COUNTERS) if stats else 0


@dataclass
class RescanPlanner:
    """Decides, at each periodic rescan, between an incremental rescan and the full reconcile."""

    full_interval_s: float
    proc_root: str = "/proc"
    clock: Callable[[], float] = time.monotonic
    read: Callable[[str], dict[int, Mark]] = read_marks  # tests give a fake /proc's marks
    # the tgids the kernel saw release an fd since the last call (BpfSource.take_touched), cleared
    take_touched: Callable[[], set[int]] = set
    marks: dict[int, Mark] = field(default_factory=dict)
    full_due_s: float = 0.0
    losses_seen: int = 0
    last: str = ""  # "full" or "incremental": what the last plan was, for logs and tests
    last_pids: int = 0  # how many processes the last plan read

    def plan(self, bpf_on: bool, stats: Mapping[str, int] | None, holders: Iterable[int]) -> set[int] | None:
        """The PIDs to rescan now, or None for a full scan (then call `full_scan_starting` first)."""
        if not bpf_on or self.clock() >= self.full_due_s or lost_events(stats) > self.losses_seen:
            return None
        # Both are taken before the processes are read: a change made while they are read shows
        # at the next rescan.
        marks = self.read(self.proc_root)
        pids = changed_pids(self.marks, marks, holders) | self.take_touched()
        self.marks, self.last, self.last_pids = marks, "incremental", len(pids)
        return pids

    def full_scan_starting(self, stats: Mapping[str, int] | None, bpf_on: bool = True) -> None:
        """Record what a full scan starts from: every mark, the loss counters, the next reconcile.
        Without BPF every rescan is full: no marks are kept."""
        self.marks = self.read(self.proc_root) if bpf_on else {}
        self.take_touched()  # the full scan reads every table
        self.losses_seen = lost_events(stats)
        self.full_due_s = self.clock() + self.full_interval_s
        self.last, self.last_pids = "full", len(self.marks)
