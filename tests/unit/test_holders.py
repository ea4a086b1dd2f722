"""Table tests for HolderTable: events in, holder table and changes out; scans reconciled."""

from __future__ import annotations

import pytest
from ghostgpu.tracer.events import DeviceHold, EventKind, ProcessInfo, ProcView, SourceEvent
from ghostgpu.tracer.holders import Change, HolderTable

from ghostgpu.common.model.consumers import DeviceKind, DeviceRef

E = EventKind
NV0 = DeviceRef("/dev/nvidia0", DeviceKind.GPU, 0, 195, 0)
NV1 = DeviceRef("/dev/nvidia1", DeviceKind.GPU, 1, 195, 1)
CTL = DeviceRef("/dev/nvidiactl", DeviceKind.CONTROL, None, 195, 255)
DEVS = {"nv0": NV0, "nv1": NV1, "ctl": CTL}


class Host:
    """A fake host: who each PID is, and a log of identify() calls."""

    def __init__(self, *pids: int) -> None:
        self.procs = {pid: ProcessInfo(pid, start_ticks=1000, comm="python3") for pid in pids}
        self.calls: list[int] = []

    def identify(self, pid: int, cgroup_id: int) -> ProcessInfo | None:
        self.calls.append(pid)
        info = self.procs.get(pid)
        return ProcessInfo(**vars(info)) if info is not None else None

    def exists(self, pid: int) -> bool:
        return pid in self.procs

    def state(self) -> HolderTable:
        return HolderTable(self.identify, exists=self.exists)


def ev(kind: EventKind, pid: int, dev: str | None = None, fd: int = -1, ts: int = 10, src: str = "bpf",
       mapped: bool = False, child: int = 0) -> SourceEvent:
    return SourceEvent(kind, src, ts, pid, fd=fd, device=DEVS[dev] if dev else None, mapped=mapped,
                       child_pid=child)


def table(state: HolderTable) -> dict[int, dict[str, tuple[list[int], bool]]]:
    """The holder table as plain data: pid -> device path -> (sorted fds, mapped)."""
    return {pid: {path: (sorted(hold.fds), hold.mapped) for path, hold in holder.holds.items()}
            for pid, holder in state.holders.items()}


def kinds(changes: list[Change]) -> list[tuple[str, int, str | None]]:
    return [(c.kind, c.pid, c.device_path) for c in changes]


P0, P1, PC = "/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl"
OPEN5 = ev(E.OPEN, 100, "nv0", 5)

# (id, events, table after all, changes of the last event)
APPLY = [
    ("open", [OPEN5], {100: {P0: ([5], False)}}, [("holder_added", 100, P0), ("device_added", 100, P0)]),
    ("second-fd-same-device", [OPEN5, ev(E.OPEN, 100, "nv0", 6)], {100: {P0: ([5, 6], False)}},
     [("device_updated", 100, P0)]),
    ("double-open-two-sources", [OPEN5, ev(E.OPEN, 100, "nv0", 5, src="procfs")],
     {100: {P0: ([5], False)}}, []),
    ("second-device", [OPEN5, ev(E.OPEN, 100, "ctl", 3)], {100: {P0: ([5], False), PC: ([3], False)}},
     [("device_added", 100, PC)]),
    ("close-last", [OPEN5, ev(E.CLOSE, 100, "nv0")], {},
     [("device_removed", 100, P0), ("holder_removed", 100, P0)]),
    ("close-one-of-two", [OPEN5, ev(E.OPEN, 100, "ctl", 3), ev(E.CLOSE, 100, "ctl")],
     {100: {P0: ([5], False)}}, [("device_removed", 100, PC)]),
    ("close-mapped-keeps", [OPEN5, ev(E.CLOSE, 100, "nv0", mapped=True)], {100: {P0: ([], True)}},
     [("device_updated", 100, P0)]),
    ("close-mapped-twice", [OPEN5] + [ev(E.CLOSE, 100, "nv0", mapped=True)] * 2, {100: {P0: ([], True)}}, []),
    ("mmap-sets-mapped", [OPEN5, ev(E.MMAP, 100, "nv0", 5)], {100: {P0: ([5], True)}},
     [("device_updated", 100, P0)]),
    ("mmap-new-holder", [ev(E.MMAP, 100, "nv0")], {100: {P0: ([], True)}},
     [("holder_added", 100, P0), ("device_added", 100, P0)]),
    ("unmap-with-fds", [OPEN5, ev(E.MMAP, 100, "nv0"), ev(E.UNMAP, 100, "nv0")], {100: {P0: ([5], False)}},
     [("device_updated", 100, P0)]),
    ("unmap-after-close", [OPEN5, ev(E.CLOSE, 100, "nv0", mapped=True), ev(E.UNMAP, 100, "nv0")], {},
     [("device_removed", 100, P0), ("holder_removed", 100, P0)]),
    ("close-unknown-pid", [ev(E.CLOSE, 100, "nv0")], {}, []),
    ("close-unheld-device", [OPEN5, ev(E.CLOSE, 100, "nv1")], {100: {P0: ([5], False)}}, []),
    ("exec-unknown-pid", [ev(E.EXEC, 100)], {}, []),
    ("exit-unknown-pid", [ev(E.EXIT, 100)], {}, []),
    ("fork-unknown-parent", [ev(E.FORK, 100, child=101)], {}, []),
    ("exit", [OPEN5, ev(E.OPEN, 100, "ctl", 3), ev(E.EXIT, 100)], {},
     [("device_removed", 100, P0), ("device_removed", 100, PC), ("holder_removed", 100, None)]),
    ("exit-twice", [OPEN5, ev(E.EXIT, 100), ev(E.EXIT, 100)], {}, []),
    ("fork-copies", [OPEN5, ev(E.MMAP, 100, "nv0"), ev(E.FORK, 100, child=101, ts=20)],
     {100: {P0: ([5], True)}, 101: {P0: ([5], True)}},
     [("holder_added", 101, None), ("device_added", 101, P0)]),
    ("fork-over-stale-child", [ev(E.OPEN, 101, "nv1", 4), OPEN5, ev(E.FORK, 100, child=101)],
     {100: {P0: ([5], False)}, 101: {P0: ([5], False)}},
     [("device_removed", 101, P1), ("holder_removed", 101, None), ("holder_added", 101, None),
      ("device_added", 101, P0)]),
]


@pytest.mark.parametrize(("events", "expected", "last"), [a[1:] for a in APPLY], ids=[a[0] for a in APPLY])
def test_apply_table(events: list[SourceEvent], expected: dict[int, object], last: list[object]) -> None:
    state = Host(100, 101).state()
    changes: list[Change] = []
    for event in events:
        changes = state.apply(event)
    assert table(state) == expected
    assert kinds(changes) == last


def test_first_seen_and_source_come_from_the_first_event() -> None:
    state = Host(100).state()
    state.apply(ev(E.OPEN, 100, "nv0", 5, ts=10, src="bpf"))
    state.apply(ev(E.OPEN, 100, "nv0", 6, ts=30, src="procfs"))
    state.apply(ev(E.FORK, 100, child=101, ts=40))
    hold = state.holders[100].holds[P0]
    assert (hold.first_seen_ns, hold.source) == (10, "bpf")
    assert state.holders[101].holds[P0].first_seen_ns == 40


def test_identify_once_per_new_holder_and_again_on_exec() -> None:
    host = Host(100)
    state = host.state()
    state.apply(OPEN5)
    state.apply(ev(E.CLOSE, 100, "nv0", mapped=True))
    assert host.calls == [100]
    host.procs[100].comm = "trainer"
    assert state.apply(ev(E.EXEC, 100)) == []
    assert host.calls == [100, 100]
    assert state.holders[100].process.comm == "trainer"


def test_refresh_rereads_the_name_of_the_same_process_only() -> None:
    host = Host(100)
    state = host.state()
    state.apply(OPEN5)
    host.procs[100].comm = "sleep"  # busybox: exec'd as "exe", then prctl(PR_SET_NAME)
    assert state.refresh(100) is True
    assert state.holders[100].process.comm == "sleep"
    host.procs[100] = ProcessInfo(100, start_ticks=2000, comm="other")  # the PID was reused
    assert state.refresh(100) is False
    assert state.holders[100].process.comm == "sleep"
    del host.procs[100]  # gone mid-read
    assert state.refresh(100) is False
    assert state.refresh(999) is False  # not a holder: no identity read
    assert host.calls == [100, 100, 100, 100]


def test_pid_reuse_finishes_the_old_holder() -> None:
    host = Host(100)
    state = host.state()
    state.apply(OPEN5)
    host.procs[100] = ProcessInfo(100, start_ticks=2000, comm="other")
    changes = state.apply(ev(E.OPEN, 100, "nv1", 7, ts=50))
    assert kinds(changes) == [("device_removed", 100, P0), ("holder_removed", 100, None),
                              ("holder_added", 100, P1), ("device_added", 100, P1)]
    assert changes[1].holder.process.start_ticks == 1000  # the removed one is the old process
    assert table(state) == {100: {P1: ([7], False)}}
    assert state.holders[100].process.comm == "other"
    assert host.calls == [100, 100]  # the identity read for the check is reused by the new holder


def test_pid_reuse_on_exec_drops_the_holder() -> None:
    host = Host(100)
    state = host.state()
    state.apply(OPEN5)
    host.procs[100] = ProcessInfo(100, start_ticks=2000)
    assert kinds(state.apply(ev(E.EXEC, 100))) == [("device_removed", 100, P0), ("holder_removed", 100, None)]
    assert state.holders == {}


@pytest.mark.parametrize("failure", [None, OSError(3, "No such process"), ValueError("bad stat")])
def test_identity_failure_still_tracks_the_hold(failure: Exception | None) -> None:
    def identify(pid: int, cgroup_id: int) -> ProcessInfo | None:
        if failure is not None:
            raise failure
        return None

    state = HolderTable(identify, exists=lambda pid: False)
    state.apply(OPEN5)
    assert state.holders[100].process == ProcessInfo(100, alive=False)
    state.apply(ev(E.EXEC, 100))  # keeps the identity it has rather than raising
    assert table(state) == {100: {P0: ([5], False)}}


def test_snapshots_are_copies() -> None:
    state = Host(100).state()
    added = state.apply(OPEN5)
    state.set_ioctl_counts(100, {0xC020462A: 7})
    state.set_ioctl_counts(555, {1: 1})  # not a holder: ignored
    [snap] = state.holders_snapshot()
    snap.holds[P0].fds.add(99)
    snap.process.comm = "changed"
    snap.ioctl_counts[1] = 1
    assert state.holders[100].holds[P0].fds == {5} and state.holders[100].process.comm == "python3"
    assert state.holders[100].ioctl_counts == {0xC020462A: 7} and list(state.holders) == [100]
    state.apply(ev(E.OPEN, 100, "nv0", 6))
    assert added[1].holder.holds[P0].fds == {5}  # a change keeps the state it reported
    removed = state.apply(ev(E.EXIT, 100))
    assert removed[-1].holder.holds[P0].fds == {5, 6}


# --- reconcile ------------------------------------------------------------------------------


def seen(*fds: int, dev: DeviceRef = NV0, mapped: bool = False, tasks: bool = False) -> DeviceHold:
    return DeviceHold(dev, set(fds), mapped, 0, "procfs", tasks)


def view(**pids: list[DeviceHold]) -> ProcView:
    """view(p100=[seen(5)]) -> {100: {"/dev/nvidia0": hold}}"""
    return {int(name[1:]): {h.device.path: h for h in holds} for name, holds in pids.items()}


SCAN_TS = 100
CLOSE_CTL_LATE = ev(E.CLOSE, 100, "ctl", ts=150)

# (id, events before, view, scanned pids, events it yields, table after)
RECONCILE = [
    ("adds-unknown", [], view(p100=[seen(5, 6)]), None, [(E.OPEN, 100, P0)], {100: {P0: ([5, 6], False)}}),
    ("adds-mapped-only", [], view(p100=[seen(mapped=True)]), None, [(E.MMAP, 100, P0)],
     {100: {P0: ([], True)}}),
    ("adds-fds-and-mapping", [], view(p100=[seen(5, mapped=True), seen(3, dev=CTL)]), None,
     [(E.OPEN, 100, P0), (E.MMAP, 100, P0), (E.OPEN, 100, PC)],
     {100: {P0: ([5], True), PC: ([3], False)}}),
    ("ignores-unheld", [], view(p100=[seen()]), None, [], {}),
    ("fds-moved-no-event", [OPEN5], view(p100=[seen(7, 8)]), None, [], {100: {P0: ([7, 8], False)}}),
    ("in-line-no-event", [OPEN5], view(p100=[seen(5)]), None, [], {100: {P0: ([5], False)}}),
    ("mapping-found", [OPEN5], view(p100=[seen(5, mapped=True)]), None, [(E.MMAP, 100, P0)],
     {100: {P0: ([5], True)}}),
    ("mapping-gone-fds-stay", [OPEN5, ev(E.MMAP, 100, "nv0")], view(p100=[seen(5)]), None,
     [(E.UNMAP, 100, P0)], {100: {P0: ([5], False)}}),
    ("mapped-only-stays", [OPEN5, ev(E.CLOSE, 100, "nv0", mapped=True)], view(p100=[seen(mapped=True)]), None,
     [], {100: {P0: ([], True)}}),
    ("mapped-only-reopened", [OPEN5, ev(E.CLOSE, 100, "nv0", mapped=True)], view(p100=[seen(6)]), None,
     [(E.UNMAP, 100, P0)], {100: {P0: ([6], False)}}),
    ("device-gone", [OPEN5, ev(E.OPEN, 100, "ctl", 3)], view(p100=[seen(5)]), None, [(E.CLOSE, 100, PC)],
     {100: {P0: ([5], False)}}),
    ("holder-gone-process-exists", [OPEN5, ev(E.OPEN, 100, "ctl", 3)], {}, None,
     [(E.CLOSE, 100, P0), (E.CLOSE, 100, PC)], {}),
    ("holder-gone-process-gone", [ev(E.OPEN, 200, "nv0", 5)], {}, None, [(E.EXIT, 200, None)], {}),
    ("keeps-bpf-open-after-scan-start", [ev(E.OPEN, 100, "nv0", 5, ts=150)], {}, None, [],
     {100: {P0: ([5], False)}}),
    ("keeps-bpf-open-other-device", [OPEN5, ev(E.OPEN, 100, "ctl", 3, ts=150)], view(p100=[seen(5)]), None,
     [], {100: {P0: ([5], False), PC: ([3], False)}}),
    ("bpf-close-after-scan-start-stays", [OPEN5, ev(E.OPEN, 100, "ctl", 3), CLOSE_CTL_LATE],
     view(p100=[seen(5), seen(3, dev=CTL)]), None, [], {100: {P0: ([5], False)}}),
    ("bpf-exit-after-scan-start-stays", [OPEN5, ev(E.EXIT, 100, ts=150)], view(p100=[seen(5)]), None, [], {}),
    ("bpf-mmap-after-scan-start-stays", [OPEN5, ev(E.MMAP, 100, "nv0", ts=150)], view(p100=[seen(5)]), None,
     [], {100: {P0: ([5], True)}}),
    ("bpf-touch-after-scan-start-not-closed", [OPEN5, ev(E.MMAP, 100, "nv0", ts=150)], {}, None, [],
     {100: {P0: ([5], True)}}),
    ("scanned-pids-limit-removal", [OPEN5, ev(E.OPEN, 200, "nv0", 5)], {}, {200}, [(E.EXIT, 200, None)],
     {100: {P0: ([5], False)}}),
    ("targeted-rescan-after-fork", [OPEN5, ev(E.OPEN, 100, "ctl", 3), ev(E.FORK, 100, child=101, ts=20)],
     view(p101=[seen(5)]), {101}, [(E.CLOSE, 101, PC)], {100: {P0: ([5], False), PC: ([3], False)},
                                                         101: {P0: ([5], False)}}),
]


@pytest.mark.parametrize(("before", "found", "pids", "want", "after"),
                         [r[1:] for r in RECONCILE], ids=[r[0] for r in RECONCILE])
def test_reconcile_table(before: list[SourceEvent], found: ProcView, pids: set[int] | None,
                         want: list[tuple[EventKind, int, str | None]], after: dict[int, object]) -> None:
    state = Host(100, 101).state()  # PID 200 does not exist
    for event in before:
        state.apply(event)
    events = state.reconcile(found, SCAN_TS, scanned_pids=pids)
    assert [(e.kind, e.pid, e.device.path if e.device else None) for e in events] == want
    assert all(e.source == "procfs" and e.ts_ns == SCAN_TS for e in events)
    assert table(state) == after
    assert state.reconcile(found, SCAN_TS + 1, scanned_pids=pids) == []  # idempotent


def test_reconcile_is_idempotent_and_reports_changes() -> None:
    state = Host(100).state()
    changes: list[Change] = []
    found = view(p100=[seen(5, 6, mapped=True, tasks=True)])
    assert len(state.reconcile(found, SCAN_TS, changes=changes)) == 2
    assert kinds(changes) == [
        ("holder_added", 100, P0), ("device_added", 100, P0), ("device_updated", 100, P0)]
    assert changes[1].holder.holds[P0].fds == {5, 6}
    assert state.holders[100].holds[P0].via_tasks
    assert state.reconcile(found, SCAN_TS + 10) == []
    assert state.reconcile(found, SCAN_TS + 20) == []
    assert table(state) == {100: {P0: ([5, 6], True)}}


def test_reconcile_refreshes_identity_and_catches_pid_reuse() -> None:
    host = Host(100, 101)
    state = host.state()
    state.apply(OPEN5)
    state.apply(ev(E.OPEN, 101, "nv0", 5))
    host.procs[101].ppid = 1  # its shim went away: reparented
    host.procs[100] = ProcessInfo(100, start_ticks=2000, comm="new")
    events = state.reconcile(view(p100=[seen(5)], p101=[seen(5)]), SCAN_TS)
    assert [(e.kind, e.pid) for e in events] == [(E.EXIT, 100), (E.OPEN, 100)]
    assert state.holders[100].process.comm == "new"
    assert state.holders[100].holds[P0].first_seen_ns == SCAN_TS
    assert state.holders[101].process.ppid == 1


def test_reconcile_absent_holder_with_reused_pid_exits() -> None:
    host = Host(100)
    state = host.state()
    state.apply(OPEN5)
    host.procs[100] = ProcessInfo(100, start_ticks=2000)
    assert [(e.kind, e.pid) for e in state.reconcile({}, SCAN_TS)] == [(E.EXIT, 100)]
    assert state.holders == {}


def test_reconcile_later_scan_undoes_stale_bpf_state() -> None:
    """A hold the BPF side added stays through the scan that raced it, and goes with the next."""
    state = Host(100).state()
    state.apply(ev(E.OPEN, 100, "nv0", 5, ts=150))
    assert state.reconcile({}, SCAN_TS) == []
    assert [e.kind for e in state.reconcile({}, 200)] == [E.CLOSE]
    assert state.holders == {}
