"""The agent's /proc side: the periodic rescan (incremental, or the full reconcile: tracer/rescan.py),
the rescan of a process after its FORK or EXEC, and reading the kernel's ioctl counters.

A mixin of `Tracer` (tracer/agent.py), run on the agent thread like the rest of the loop.
"""

from __future__ import annotations

import time
from typing import Any

from ghostgpu.tracer.config import TracerConfig
from ghostgpu.tracer.containment import Containment, HealthReport
from ghostgpu.tracer.events import EventKind, SourceEvent, boot_ns
from ghostgpu.tracer.holders import HolderTable
from ghostgpu.tracer.identity import Identities
from ghostgpu.tracer.procfs import ProcScanner, ticks_to_boot_ns
from ghostgpu.tracer.rescan import RescanPlanner

EXIT_WAIT_S = 1.0  # how long a dead holder the kernel knows waits for its EXIT before /proc settles it


class ScanDuties:
    """Tracer's scans. The attributes below are Tracer's; the methods it calls back are at the end."""

    cfg: TracerConfig
    scanner: ProcScanner
    rescans: RescanPlanner
    state: HolderTable
    identities: Identities
    health: HealthReport | None
    errors: Containment
    bpf: Any
    ioctls: dict[int, dict[tuple[str, int], int]]
    _due: dict[str, float]
    _exit_due: dict[int, float]
    _dirty: bool
    _full_scan_ns: int

    def _rescan(self) -> None:
        """The periodic rescan: the holders and the processes whose fd table changed since the last
        one, or every process when the full reconcile is due, the kernel side lost events, or BPF is
        off (tracer/rescan.py)."""
        stats = self.bpf.stats() if self.bpf is not None else None
        pids = self.rescans.plan(self.bpf is not None, stats, self.state.holders)
        if pids is None:
            self._scan()
        elif pids:
            self._scan(pids=pids, periodic=True)

    def _take_touched(self) -> set[int]:
        """The processes the kernel saw release an fd since the last rescan (none without BPF)."""
        return self.bpf.take_touched() if self.bpf is not None else set()

    def _scan(self, initial: bool = False, pids: set[int] | None = None, periodic: bool = False) -> None:
        """A full /proc scan (pids None); a periodic rescan of the pids whose fd table changed; or,
        inside a batch of events, the rescan of a pid after its FORK or EXEC. A partial scan costs
        O(those pids): no copy of the whole table, no full counter read."""
        full = pids is None
        if full:
            bpf_on = self.bpf is not None
            self.rescans.full_scan_starting(self.bpf.stats() if bpf_on else None, bpf_on)
        if self.bpf is not None and (full or periodic):
            # Apply what the kernel already reported before looking at /proc, so that a scan
            # does not race the ring buffer for the same close or exit.
            self._drain(0)
        ts_ns = boot_ns()
        if full:
            self._full_scan_ns = ts_ns
        holders = self.state.holders
        before = dict(holders) if pids is None else {p: holders[p] for p in pids if p in holders}
        scan_start_s = time.monotonic()
        view = self.scanner.scan(sorted(pids) if pids is not None else None)
        if full and self.health is not None:
            self.health.scan_observed(time.monotonic() - scan_start_s)
        if self.bpf is not None and (full or periodic):
            # And what the kernel said while /proc was read: do_exit fires the exit tracepoint before
            # exit_files() closes the fds the scan then missed, so the exact EXIT wins (reconcile
            # skips what newer events touched). Not in a FORK/EXEC rescan: it runs inside a batch.
            self._drain(0)
        events = self.state.reconcile(view, ts_ns, scanned_pids=pids,
                                      exit_reported=pids if self.bpf is not None else None)
        if events and self.bpf is not None:
            if pids is None:
                self._read_ioctls()
            else:
                for pid in {ev.pid for ev in events}:
                    self._read_ioctls(pid)
        for ev in events:
            holder = self.state.holders.get(ev.pid) or before.get(ev.pid)
            counts = self.ioctls.get(ev.pid) if ev.kind in (EventKind.CLOSE, EventKind.EXIT) else None
            self._emit_event(ev, holder, counts=counts)
            if ev.kind is EventKind.EXIT and ev.pid not in view:
                self._forget(ev.pid)  # gone for good: its kernel EXIT, if still queued, finds nothing
        if initial:
            # Holders found at start opened before we were watching: their grace period runs
            # from the process start, not from our first look.
            for holder in self.state.holders.values():
                if holder.process.start_ticks is not None:
                    started_ns = ticks_to_boot_ns(holder.process.start_ticks)
                    for hold in holder.holds.values():
                        hold.first_seen_ns = min(hold.first_seen_ns, started_ns)
            self._due["scan"] = time.monotonic() + self.cfg.scan_interval_s
        # A rescanned pid found holding nothing has its kernel count set to 0: after a FORK or EXEC
        # (an exec that dropped its close-on-exec fds), or a holder a periodic rescan found empty
        # (fds closed by close_range, which the kernel does not trace). Not any other process a
        # periodic rescan read: one that opens a device meanwhile would lose its count.
        zero = (pids & before.keys()) if periodic and pids else pids
        created = self.bpf.seed_view(view, zero) if self.bpf is not None else set()
        # A process that died between the /proc read and the seed exited while the kernel had no
        # entry for it (it reports EXIT only for a tgid in procs): nobody else will report it, so
        # it is settled here at once. So is a holder whose identity, re-read after its fds, says
        # zombie: it died during the scan, and would otherwise read as orphaned until its EXIT.
        forked = set() if periodic else (pids or set())
        for pid in sorted(created - forked):
            if not self.identities.alive(pid):
                self._settle_exit(pid)
        for pid in sorted(view.keys() - created - forked):
            self._settle_if_gone(pid)
        # A pid rescanned after its FORK or EXEC had a procs entry all along (the child inherits
        # it at fork, an exec keeps it), and so does a holder a periodic rescan found gone: the
        # kernel reports its exit, with exact time. Wait for that EXIT (often already queued) and
        # settle from /proc only if it never comes.
        now_s = time.monotonic()
        for pid in sorted(pids or ()):
            if pid in self.state.holders and not self.identities.alive(pid):
                self._exit_due.setdefault(pid, now_s + EXIT_WAIT_S)
        if full and self.bpf is not None:
            self.errors.run("sweep", self.bpf.sweep, self.identities.alive)
        # A scan also refreshes identities (a parent that died, a leader turned zombie) without
        # any hold changing: re-classify after every one.
        self._dirty = True

    def _read_ioctls(self, pid: int | None = None) -> None:
        """All processes' counters (the periodic read), or one process's at its close or exit."""
        fresh = self.bpf.ioctl_counts(pid)
        if pid is None:
            self.ioctls = fresh
        else:
            self.ioctls[pid] = fresh.get(pid, {})
        for holder_pid, counts in fresh.items():
            per_cmd: dict[int, int] = {}
            for (_path, cmd), n in counts.items():
                per_cmd[cmd] = per_cmd.get(cmd, 0) + n
            self.state.set_ioctl_counts(holder_pid, per_cmd)

    # --- Tracer's, called back ------------------------------------------------------------

    def _drain(self, timeout_ms: int) -> None:
        raise NotImplementedError

    def _emit_event(self, ev: SourceEvent, holder: Any, counts: dict[tuple[str, int], int] | None = None,
                    ) -> None:
        raise NotImplementedError

    def _forget(self, pid: int) -> None:
        raise NotImplementedError

    def _settle_exit(self, pid: int) -> None:
        raise NotImplementedError

    def _settle_if_gone(self, pid: int) -> None:
        raise NotImplementedError
