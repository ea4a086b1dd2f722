"""The periodic /proc rescan reads only the processes whose fd table changed (tracer/rescan.py), and
every process at the full reconcile, after the kernel side lost events, or with BPF off.

The marks (inode, fd count of /proc/PID/fd) are tabled here; the agent-level tests run the real
Tracer against a fake /proc and fake kernel tables (tests/unit/test_agent_exits.py's Node), with the
marks computed from the fake tree, and check which processes each rescan reads.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.tracer.rescan import (
    LOSS_COUNTERS,
    Mark,
    RescanPlanner,
    changed_pids,
    lost_events,
    read_marks,
    take_marked,
)

OLD, NEW, HOLDER = 100, 200, 300


@pytest.mark.parametrize(("before", "after", "holders", "want"), [
    ({OLD: (7, 10)}, {OLD: (7, 10)}, (), set()),  # nothing changed: nothing read
    ({OLD: (7, 10)}, {OLD: (7, 10), NEW: (9, 3)}, (), {NEW}),  # a new process
    ({OLD: (7, 10)}, {OLD: (7, 11)}, (), {OLD}),  # received an fd (SCM_RIGHTS, a relative open)
    ({OLD: (7, 10)}, {OLD: (7, 9)}, (), {OLD}),  # closed one
    ({OLD: (7, 10)}, {OLD: (8, 10)}, (), {OLD}),  # the PID reused: another /proc inode
    ({OLD: None}, {OLD: None}, (), set()),  # unreadable both times (a zombie leader)
    ({OLD: (7, 10)}, {OLD: None}, (), {OLD}),  # turned unreadable: read it (it may be dying)
    ({OLD: (7, 10), HOLDER: (5, 4)}, {OLD: (7, 10), HOLDER: (5, 4)}, (HOLDER,), {HOLDER}),  # holders: always
    ({OLD: (7, 10), HOLDER: (5, 4)}, {OLD: (7, 10)}, (HOLDER,), {HOLDER}),  # a holder vanished
    ({OLD: (7, 10)}, {}, (), set()),  # a non-holder vanished: nothing to settle
    ({}, {OLD: (7, 10)}, (), {OLD}),  # no marks yet: everything is new
])
def test_changed_pids(before: dict[int, Mark], after: dict[int, Mark], holders: tuple[int, ...],
                      want: set[int]) -> None:
    assert changed_pids(before, after, holders) == want


def test_read_marks_counts_this_process_fds() -> None:
    """Linux 6.2+: st_size of /proc/PID/fd is the number of open fds; one more open, one more."""
    before = read_marks()[os.getpid()]
    assert before is not None
    fd = os.open("/dev/null", os.O_RDONLY)
    try:
        after = read_marks()[os.getpid()]
    finally:
        os.close(fd)
    assert after is not None and after[0] == before[0]
    if before[1] == 0:
        pytest.skip("this kernel predates 6.2: /proc/PID/fd has no fd count (only new processes show)")
    assert after[1] == before[1] + 1


def test_read_marks_of_a_missing_proc_root() -> None:
    assert read_marks("/nonexistent-proc") == {}


def test_only_attribution_losses_count() -> None:
    stats = dict.fromkeys(LOSS_COUNTERS, 1) | {"ioctls_full": 50, "allocs_full": 50}
    assert lost_events(stats) == len(LOSS_COUNTERS)
    assert lost_events(None) == 0 and lost_events({}) == 0


def test_take_marked_returns_and_clears_the_set_bytes() -> None:
    buf = bytearray(3 * 4096)
    for tgid in (0, 5, 4095, 4096, 3 * 4096 - 1):
        buf[tgid] = 1
    assert take_marked(buf) == {0, 5, 4095, 4096, 3 * 4096 - 1}
    assert buf == bytearray(3 * 4096) and take_marked(buf) == set()


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def planner() -> tuple[RescanPlanner, dict[int, Mark], Clock]:
    marks: dict[int, Mark] = {OLD: (7, 10)}
    clock = Clock()
    return RescanPlanner(600.0, clock=clock, read=lambda _root: dict(marks)), marks, clock


def test_full_first_then_only_changes(planner: tuple[RescanPlanner, dict[int, Mark], Clock]) -> None:
    plan, marks, clock = planner
    assert plan.plan(True, {}, ()) is None  # never scanned: the full scan first
    plan.full_scan_starting({})
    assert plan.plan(True, {}, ()) == set()
    marks[NEW] = (9, 3)
    marks[OLD] = (7, 11)
    assert plan.plan(True, {}, ()) == {NEW, OLD}
    assert plan.plan(True, {}, ()) == set()  # compared with the last rescan's marks
    clock.now_s += 600.0
    assert plan.plan(True, {}, ()) is None  # the reconcile is due


def test_what_the_kernel_saw_released_is_read_too() -> None:
    """A table whose count came back (a socket closed, a device fd received): the close marked it."""
    touched = [{OLD}, set(), {NEW}]
    plan = RescanPlanner(600.0, clock=Clock(), read=lambda _root: {OLD: (7, 10)},
                         take_touched=lambda: touched.pop(0))
    plan.full_scan_starting({})  # takes (and drops) the first marks: the full scan reads everything
    assert plan.plan(True, {}, ()) == set()
    assert plan.plan(True, {}, ()) == {NEW}


def test_lost_events_make_the_next_rescan_full(planner: tuple[RescanPlanner, dict[int, Mark], Clock]) -> None:
    plan, _marks, _clock = planner
    plan.full_scan_starting({"ringbuf_drops": 3})
    assert plan.plan(True, {"ringbuf_drops": 3}, ()) == set()
    assert plan.plan(True, {"ringbuf_drops": 3, "ioctls_full": 9}, ()) == set()  # counts only: no scan helps
    assert plan.plan(True, {"ringbuf_drops": 4}, ()) is None
    plan.full_scan_starting({"ringbuf_drops": 4})
    assert plan.plan(True, {"ringbuf_drops": 4}, ()) == set()


def test_without_bpf_every_rescan_is_full(planner: tuple[RescanPlanner, dict[int, Mark], Clock]) -> None:
    plan, _marks, _clock = planner
    plan.full_scan_starting(None)
    assert plan.plan(False, None, ()) is None


# --- the agent: which processes a periodic rescan reads -------------------------------------------

def fake_marks(root: str) -> dict[int, Mark]:
    """What read_marks gives on a real /proc, from the fake tree: (inode, entries) of PID/fd."""
    out: dict[int, Mark] = {}
    for name in filter(str.isdigit, os.listdir(root)):
        fd_dir = Path(root, name, "fd")
        out[int(name)] = (fd_dir.stat().st_ino, len(os.listdir(fd_dir))) if fd_dir.is_dir() else None
    return out


@pytest.fixture
def node() -> Iterator[Any]:
    from tests.unit.test_agent_exits import Node  # the fake node of the exit tests

    tmp = Path(tempfile.mkdtemp(prefix="gg-rescan-", dir="/tmp"))  # prefixes are at most 40 bytes
    n = Node(tmp)
    n.tracer.rescans.read = fake_marks
    n.spawn(OLD, fd=False)  # a process that holds no device yet
    n.spawn(HOLDER)
    read: list[list[int] | None] = []
    real_scan = n.tracer.scanner.scan

    def spy(pids: list[int] | None = None) -> object:
        read.append(None if pids is None else sorted(pids))
        return real_scan(pids)

    n.tracer.scanner.scan = spy  # type: ignore[method-assign]
    n.read = read  # type: ignore[attr-defined]
    n.tracer.start()
    yield n
    assert n.tracer.errors.counts == dict.fromkeys(n.tracer.errors.counts, 0), n.tracer.errors.last
    n.tracer.close()
    shutil.rmtree(tmp)


def test_a_process_the_kernel_could_not_see_is_found_by_the_next_rescan(node: Any) -> None:
    """OLD gets a device fd the kernel never saw open (passed over a socket): its table grew, so
    the periodic rescan reads it, and only it, and reports the hold from /proc."""
    n = node
    assert n.read == [None]  # the start scan is full
    assert n.events(HOLDER) == ["open"] and n.events(OLD) == []
    n.tracer._rescan()
    assert n.read == [None, [HOLDER]]  # nothing changed: only the holder is read
    n.spawn(OLD)  # fd 3 now names the device
    n.tracer._rescan()
    assert n.read[-1] == [OLD, HOLDER]
    assert n.events(OLD) == ["open"] and n.sources(OLD, "open") == ["procfs"]
    assert n.tracer.bpf.tables.holder_bytes[OLD] == 1  # seeded: the kernel tracks it from now on


def test_a_new_process_is_read_and_an_unchanged_one_is_not(node: Any) -> None:
    n = node
    n.spawn(NEW)
    n.tracer._rescan()
    assert n.read[-1] == [NEW, HOLDER] and n.events(NEW) == ["open"]
    n.tracer._rescan()
    assert n.read[-1] == [NEW, HOLDER]  # NEW is a holder now; OLD was never read again


def test_a_table_changed_at_the_same_count_is_read_once_the_kernel_saw_a_close(node: Any) -> None:
    """OLD closes an fd and receives a device fd: same count, same inode. Only the kernel's touched
    mark (the close) makes the rescan read it."""
    n = node
    spare = Path(n.proc, str(OLD), "fd", "4")
    os.symlink("/dev/null", spare)
    n.tracer.rescans.full_due_s = 0.0
    n.tracer._rescan()  # the reconcile: marks now include fd 4
    spare.unlink()
    n.spawn(OLD)  # fd 3 names the device now: still one entry
    n.tracer._rescan()
    assert n.read[-1] == [HOLDER] and n.events(OLD) == []  # nothing told the rescan
    n.bpf.take_touched = lambda: {OLD}  # type: ignore[method-assign]
    n.tracer._rescan()
    assert n.read[-1] == [OLD, HOLDER] and n.events(OLD) == ["open"]


def test_the_reconcile_and_lost_events_read_everything(node: Any) -> None:
    n = node
    n.tracer.rescans.full_due_s = 0.0  # the full_scan_interval_s has passed
    n.tracer._rescan()
    assert n.read == [None, None]
    n.tracer._rescan()
    assert n.read[-1] == [HOLDER]  # incremental, and nothing changed
    n.bpf.stats = lambda: {"ringbuf_drops": 1}  # type: ignore[method-assign]
    n.tracer._rescan()
    assert n.read[-1] is None
