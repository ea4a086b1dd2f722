"""The agent's /proc side: the periodic rescan (incremental, or the full reconcile: tracer/rescan.py),
the rescan of a process after its FORK or EXEC, and reading the kernel's ioctl counters.

`AgentScans` is owned by `Tracer` (tracer/agent.py) and runs on the agent thread like the rest of the
loop. What a scan finds goes back through the agent (`ScanHost`): its ring buffer is drained around
the /proc read, and the events and exits it reports are the agent's.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import TYPE_CHECKING, Protocol

from ghostgpu.tracer.containment import Containment, HealthReport
from ghostgpu.tracer.events import EventKind, Holder, ProcView, SourceEvent, boot_ns
from ghostgpu.tracer.holders import HolderTable
from ghostgpu.tracer.identity import ALIVE, EXITING, Identities
from ghostgpu.tracer.procfs import ProcScanner, ticks_to_boot_ns
from ghostgpu.tracer.rescan import RescanPlanner

if TYPE_CHECKING:
    from ghostgpu.tracer.bpf_source import BpfSource  # imports bcc: only where BPF runs

EXIT_WAIT_S = 1.0  # how long a dead holder the kernel knows waits for its EXIT before /proc settles it

IoctlCounts = dict[tuple[str, int], int]  # (device path, ioctl cmd) -> count


class ScanHost(Protocol):
    """The agent, as its scans see it: the kernel side it attached (None: BPF off), and what it does
    with the kernel's queued events and with the events and exits a scan finds."""

    @property
    def bpf(self) -> BpfSource | None: ...

    def _drain(self, timeout_ms: int) -> None: ...

    def _emit_event(self, ev: SourceEvent, holder: Holder | None,
                    counts: IoctlCounts | None = None) -> None: ...

    def _forget(self, pid: int, exit_ns: int | None = None) -> None: ...

    def _sweep_memory(self) -> None: ...

    def _note_for_faults(self, ev: SourceEvent, holder: Holder) -> None: ...

    def _settle_exit(self, pid: int) -> None: ...

    def _settle_if_gone(self, pid: int) -> None: ...


class AgentScans:
    """The agent's /proc scans and ioctl counter reads, with the state only they keep."""

    def __init__(self, agent: ScanHost, scanner: ProcScanner, rescans: RescanPlanner, state: HolderTable,
                 identities: Identities, errors: Containment, health: HealthReport | None, *,
                 exit_due: dict[int, float], alive_ns: dict[int, int]) -> None:
        self.agent = agent
        self.scanner = scanner
        self.rescans = rescans
        self.state = state
        self.identities = identities
        self.errors = errors
        self.health = health
        self.exit_due = exit_due  # the agent's: pid -> when /proc settles it if its EXIT never came
        self.alive_ns = alive_ns  # the agent's: holder pid -> boot ns it was last seen alive
        self.ioctls: dict[int, IoctlCounts] = {}  # pid -> its counts as last read
        self.full_scan_ns = 0  # boot ns when the last full /proc scan began (classify: holders_complete_ns)
        self._outer_scan_ns: int | None = None  # start of the periodic or full scan under way, if any

    def rescan(self) -> bool:
        """The periodic rescan: the holders and the processes whose fd table changed since the last
        one, or every process when the full reconcile is due, the kernel side lost events, or BPF is
        off (tracer/rescan.py). False when there was nothing to read."""
        bpf = self.agent.bpf
        stats = bpf.stats() if bpf is not None else None
        pids = self.rescans.plan(bpf is not None, stats, self.state.holders)
        if pids is None:
            self.scan()
        elif pids:
            self.scan(pids=pids, periodic=True)
        else:
            return False
        return True

    def scan(self, initial: bool = False, pids: set[int] | None = None, periodic: bool = False) -> None:
        """A full /proc scan (pids None); a periodic rescan of the pids whose fd table changed; or,
        inside a batch of events, the rescan of a pid after its FORK or EXEC. A partial scan costs
        O(those pids): no copy of the whole table, no full counter read."""
        bpf = self.agent.bpf
        full = pids is None
        if full:
            self.rescans.full_scan_starting(bpf.stats() if bpf is not None else None, bpf is not None)
        if bpf is not None and (full or periodic):
            # Apply what the kernel already reported before looking at /proc, so that a scan
            # does not race the ring buffer for the same close or exit.
            self.agent._drain(0)
        ts_ns = boot_ns()
        if full:
            self.full_scan_ns = ts_ns
        holders = self.state.holders
        before = dict(holders) if pids is None else {p: holders[p] for p in pids if p in holders}
        view, events = self._read_and_reconcile(pids, ts_ns, full=full, periodic=periodic)
        for pid in view.keys() & self.state.holders.keys():
            self.alive_ns[pid] = max(self.alive_ns.get(pid, 0), ts_ns)  # its fds were read: alive then
        # Seeded before the records go out: a holder the scan reports is known to the kernel by
        # then, so whatever it does after its open record (exit, close, exec) is the kernel's.
        created = self._seed(view, pids, periodic, before)
        self._report(events, view, pids, before)
        if initial:
            self._backdate_start_holders()
        self._settle_unseeded(created, view, set() if periodic else (pids or set()))
        self._await_kernel_exits(pids or ())
        if full and bpf is not None:
            self.errors.run("sweep", bpf.sweep, self.identities.alive)
        if full:
            self.errors.run("memory", self.agent._sweep_memory)

    def _read_and_reconcile(self, pids: set[int] | None, ts_ns: int, *, full: bool, periodic: bool,
                            ) -> tuple[ProcView, list[SourceEvent]]:
        """Read /proc and reconcile the holder table with it, the kernel's news applied first."""
        bpf = self.agent.bpf
        # A FORK/EXEC rescan run by the drain below reconciles before this scan does: it must keep
        # the marks of what the kernel said since this scan began, or this older view undoes them.
        own = full or periodic  # never run inside another scan (only FORK/EXEC rescans are)
        if own:
            self._outer_scan_ns = ts_ns
        try:
            scan_start_s = time.monotonic()
            view = self.scanner.scan(sorted(pids) if pids is not None else None)
            if full and self.health is not None:
                self.health.scan_observed(time.monotonic() - scan_start_s)
            if bpf is not None and own:
                # And what the kernel said while /proc was read: do_exit fires the exit tracepoint
                # before exit_files() closes the fds the scan then missed, so the exact EXIT wins
                # (reconcile skips what newer events touched). Not in a FORK/EXEC rescan: it runs
                # inside a batch.
                self.agent._drain(0)
            events = self.state.reconcile(view, ts_ns, scanned_pids=pids,
                                          exit_reported=pids if bpf is not None else None,
                                          keep_since_ns=None if own else self._outer_scan_ns)
        finally:
            if own:  # also when the scan failed: a stale start would keep every later mark
                self._outer_scan_ns = None
        return view, events

    def _seed(self, view: ProcView, pids: set[int] | None, periodic: bool, before: dict[int, Holder],
              ) -> set[int]:
        """Tell the kernel what the scan saw; the pids whose procs entry the seed created."""
        bpf = self.agent.bpf
        if bpf is None:
            return set()
        # A rescanned pid found holding nothing has its kernel count set to 0: after a FORK or EXEC
        # (an exec that dropped its close-on-exec fds), or a holder a periodic rescan found empty
        # (fds closed by close_range, which the kernel does not trace). Not any other process a
        # periodic rescan read: one that opens a device meanwhile would lose its count.
        zero = (pids & before.keys()) if periodic and pids else pids
        return bpf.seed_view(view, zero)

    def _report(self, events: list[SourceEvent], view: ProcView, pids: set[int] | None,
                before: dict[int, Holder]) -> None:
        """The scan's events as records, with the ioctl counts of each close and exit."""
        if events and self.agent.bpf is not None:
            if pids is None:
                self.read_ioctls()
            else:
                for pid in {ev.pid for ev in events}:
                    self.read_ioctls(pid)
        for ev in events:
            holder = self.state.holders.get(ev.pid) or before.get(ev.pid)
            counts = self.ioctls.get(ev.pid) if ev.kind in (EventKind.CLOSE, EventKind.EXIT) else None
            self.agent._emit_event(ev, holder, counts=counts)
            if holder is not None:
                self.agent._note_for_faults(ev, holder)
            if ev.kind is EventKind.EXIT and ev.pid not in view:
                self.agent._forget(ev.pid)  # gone for good: its kernel EXIT, if still queued, finds nothing

    def _backdate_start_holders(self) -> None:
        """Holders found at start opened before we were watching: their grace period runs from the
        process start, not from our first look."""
        for holder in self.state.holders.values():
            if holder.process.start_ticks is not None:
                started_ns = ticks_to_boot_ns(holder.process.start_ticks)
                for hold in holder.holds.values():
                    hold.first_seen_ns = min(hold.first_seen_ns, started_ns)

    def _await_kernel_exits(self, pids: Collection[int]) -> None:
        """A pid rescanned after its FORK or EXEC had a procs entry all along (the child inherits it
        at fork, an exec keeps it), and so does a holder a periodic rescan found gone: the kernel
        reports its exit, with exact time. Wait for that EXIT (often already queued) and settle from
        /proc only if it never comes."""
        now_s = time.monotonic()
        for pid in sorted(pids):
            if pid in self.state.holders and not self.identities.alive(pid):
                self.exit_due.setdefault(pid, now_s + EXIT_WAIT_S)

    def _settle_unseeded(self, created: set[int], view: ProcView, forked: set[int]) -> None:
        """Settle from /proc the exits the kernel will not report, and only those: of a process that
        died before the seed made its procs entry (the exit tracepoint reports only tgids in procs),
        and of a holder whose identity, re-read after its fds, says zombie (else it reads as
        orphaned until its EXIT). Dead now is not dead before the seed: a process that exits just
        after it, or a known holder that turned zombie after the scan's last drain, is reported by
        the tracepoint like any holder, and a /proc guess first would shadow that exact EXIT (it
        then finds no holder and is dropped). `forked`: a FORK/EXEC rescan's pids, whose kernel
        entry was there all along (see scan)."""
        # How far each exit is, read before the drain: what that drain does not bring, the
        # tracepoint of a DEAD process (behind it) never will.
        stages = {pid: self.identities.exit_stage(pid) for pid in sorted(created - forked)}
        dying = {pid: stage for pid, stage in stages.items() if stage != ALIVE}
        zombies = [pid for pid in sorted(view.keys() - created - forked)
                   if (held := self.state.holders.get(pid)) is not None and held.process.state in ("Z", "X")]
        if (dying or zombies) and self.agent.bpf is not None:
            # Inside a periodic or full scan, or at start: never within a batch of events (a
            # FORK/EXEC rescan's view is its forked pids, so both are empty there).
            self.agent._drain(0)
        now_s = time.monotonic()
        for pid, stage in dying.items():
            if stage == EXITING and pid in self.state.holders:
                # Inside do_exit, its tracepoint maybe still ahead and sure to find the seeded
                # entry: wait for that EXIT, settle from /proc only if it never comes.
                self.exit_due.setdefault(pid, now_s + EXIT_WAIT_S)
            else:
                self.agent._settle_exit(pid)  # or, if the kernel's EXIT came first, forget its entries
        for pid in zombies:
            self.agent._settle_if_gone(pid)

    def read_ioctls_of(self, pid: int) -> IoctlCounts:
        """One process's counters now: at its close or exit, not as the last periodic read left them."""
        self.read_ioctls(pid)
        return self.ioctls.get(pid, {})

    def read_ioctls(self, pid: int | None = None) -> None:
        """All processes' counters (the periodic read), or one process's at its close or exit."""
        bpf = self.agent.bpf
        assert bpf is not None, "ioctl counters read with BPF off"
        fresh = bpf.ioctl_counts(pid)
        if pid is None:
            self.ioctls = fresh
        else:
            self.ioctls[pid] = fresh.get(pid, {})
        for holder_pid, counts in fresh.items():
            per_cmd: dict[int, int] = {}
            for (_path, cmd), n in counts.items():
                per_cmd[cmd] = per_cmd.get(cmd, 0) + n
            self.state.set_ioctl_counts(holder_pid, per_cmd)
