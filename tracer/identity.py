"""Who a host PID is, and whether it still lives: the agent's /proc questions about one process.

Kept apart from the loop because both the holder table (tracer/state.py) and the classifier call
them, and because each answer must tolerate the process vanishing mid-read: on a busy node that
happens at every moment.
"""

from __future__ import annotations

from tracer.bpf_source import group_dead  # a pure /proc parser: bcc loads only in BpfSource.start()
from tracer.cgroup import CgroupIdResolver
from tracer.events import ProcessInfo
from tracer.procfs import parse_stat, read_process


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
        """Does the thread group still have a live task? A zombie whose last thread is gone holds
        nothing any more, though /proc/PID stays until its parent reaps it: under churn a scan
        lands in that window often, and reading it as alive turned exits into closes."""
        return not group_dead(self._stat(pid))

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
