"""Who a host PID is, and whether it still lives: the agent's /proc questions about one process.

Kept apart from the loop because both the holder table (tracer/holders.py) and the classifier call
them, and because each answer must tolerate the process vanishing mid-read: on a busy node that
happens at every moment.
"""

from __future__ import annotations

from ghostgpu.tracer.cgroup import CgroupIdResolver
from ghostgpu.tracer.events import ProcessInfo
from ghostgpu.tracer.procfs import parse_stat, read_process

PF_EXITING = 0x00000004  # include/linux/sched.h; /proc/PID/stat field 9 is task->flags (proc(5))


def _group_fields(stat_text: str) -> tuple[str, int, str] | None:
    """(state, num_threads, flags as written) of /proc/<tgid>/stat; None when gone or unreadable.
    Fields after comm, which sits between the first '(' and the LAST ')': state is field 3, flags 9,
    num_threads 20 (proc(5))."""
    fields = stat_text.rpartition(")")[2].split()
    if len(fields) < 18 or not fields[17].isdigit():
        return None
    return fields[0], int(fields[17]), fields[6]


def group_dead(stat_text: str) -> bool:
    """From /proc/<tgid>/stat ("" once reaped): no live task is left in the thread group. A zombie
    leader counts itself in num_threads (field 20) until the last other thread is gone."""
    group = _group_fields(stat_text)
    return group is None or (group[0] in ("Z", "X") and group[1] <= 1)


ALIVE, EXITING, DEAD = "alive", "exiting", "dead"


def exit_stage(stat_text: str) -> str:
    """How far the thread group is through its exit, from /proc/<tgid>/stat ("" once reaped):
    ALIVE; EXITING, its last task inside do_exit (PF_EXITING) but not a zombie yet, so the exit
    tracepoint may still be ahead of it; DEAD, a zombie or reaped (or unreadable): exit_notify() ran,
    so the exit tracepoint, which do_exit fires before it, is behind it. A multi-threaded group
    whose leader alone exits keeps num_threads above 1: alive."""
    group = _group_fields(stat_text)
    if group is None or not group[2].isdigit():
        return DEAD
    state, threads, flags = group
    if threads > 1:
        return ALIVE
    if state in ("Z", "X"):
        return DEAD
    return EXITING if int(flags) & PF_EXITING else ALIVE


def group_gone(stat_text: str) -> bool:
    """group_dead, or its last task is inside do_exit (PF_EXITING): the thread group holds nothing
    any more. exit_files() has closed its fds by then, or is about to, so a rescan that finds none
    must read it as an exit, not a close."""
    return exit_stage(stat_text) != ALIVE


class Identities:
    def __init__(self, proc_root: str, cgroups: CgroupIdResolver) -> None:
        self.proc_root, self.cgroups = proc_root, cgroups

    def identify(self, pid: int, cgroup_id: int) -> ProcessInfo | None:
        info = read_process(pid, self.proc_root)
        if info is None:
            # Gone before we could read /proc (a 20 ms job): the kernel's cgroup id still says
            # which container it ran in.
            info = ProcessInfo(pid=pid, alive=False)
        if not info.container_id and cgroup_id:
            ident = self.cgroups.identity_for(cgroup_id)
            if ident is not None:
                info.cgroup_path = info.cgroup_path or ident.path
                info.container_id, info.pod_uid, info.runtime = (
                    ident.container_id, ident.pod_uid, ident.runtime)
        return info

    def alive(self, pid: int) -> bool:
        """Is the thread group alive and not exiting (see group_gone)? A zombie whose last thread is
        gone holds nothing any more, though /proc/PID stays until its parent reaps it: under churn a
        scan lands in that window often, and reading it as alive turned exits into closes."""
        return not group_gone(self._stat(pid))

    def exit_stage(self, pid: int) -> str:
        """ALIVE, EXITING or DEAD (see exit_stage): whether the kernel's exit tracepoint may still
        be ahead of a process /proc no longer shows alive."""
        return exit_stage(self._stat(pid))

    def start_ticks(self, pid: int) -> int | None:
        """The PID's start time (clock ticks since boot) while it exists, else None."""
        stat = parse_stat(self._stat(pid))
        return stat.start_ticks if stat else None

    def _stat(self, pid: int) -> str:
        try:
            with open(f"{self.proc_root}/{pid}/stat") as f:
                return f.read()
        except OSError:  # gone (or never there): "" reads as dead
            return ""
