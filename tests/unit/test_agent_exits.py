"""Every holder's exit is reported exactly once, whatever the order of exec, rescan and exit.

The agent runs against a fake /proc (a directory tree) and the kernel tables of a fake kernel
(tests/helpers/fake_kmaps.py); the ring buffer is a list the test fills. Each test puts the
process's death at one of the moments the real kernel can: before the EXEC is handled, between
the rescan's /proc read and its seed, after the seed. No root, no sleeps.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.tracer.agent import Tracer
from ghostgpu.tracer.bpf_source import BpfSource
from ghostgpu.tracer.config import TracerConfig
from ghostgpu.tracer.events import EventKind, NvmlView, SourceEvent, boot_ns
from ghostgpu.tracer.identity import PF_EXITING
from ghostgpu.tracer.sinks import CallbackSink

from tests.helpers.fake_kmaps import FdKey, IoctlKey, fake_tables

HOLDER, NEWCOMER = 100, 200
RM_CONTROL = 0xC020462A


class ScriptedBpf(BpfSource):
    """BpfSource with the fake kernel's tables and a ring buffer the test writes."""

    def __init__(self, prefix: str) -> None:
        super().__init__((prefix,))
        self.tables, self.kernel = fake_tables()
        self.queued: list[SourceEvent] = []

    def poll(self, timeout_ms: int) -> list[SourceEvent]:
        out, self.queued = self.queued, []
        return out


class NoNvml:
    def read(self) -> NvmlView:
        return NvmlView(available=False, error="NVML: no library (test)")

    def close(self) -> None:
        pass


class Node:
    def __init__(self, tmp: Path) -> None:
        self.proc, self.gpu = tmp / "proc", str(tmp / "nvidia0")
        self.proc.mkdir()
        Path(self.gpu).write_bytes(b"")  # prefixes match by name: a plain file stands for the node
        self.records: list[dict[str, Any]] = []
        cfg = TracerConfig(node_name="n1", proc_root=str(self.proc), device_prefixes=[str(tmp / "nvidia")],
                           bpf="off", grace_s=60.0)
        self.tracer = Tracer(cfg, CallbackSink(self.records.append))
        self.tracer.nvml_source = NoNvml()  # type: ignore[assignment]
        self.bpf = ScriptedBpf(cfg.prefixes[0])
        self.tracer.bpf = self.bpf  # attached "before" start(): --bpf off leaves it alone

    def spawn(self, pid: int, state: str = "S", threads: int = 1, flags: int = 0, fd: bool = True) -> None:
        base = self.proc / str(pid)
        (base / "fd").mkdir(parents=True, exist_ok=True)
        if fd and not (base / "fd" / "3").is_symlink():
            os.symlink(self.gpu, base / "fd" / "3")
        if not fd:
            (base / "fd" / "3").unlink(missing_ok=True)
        fields = [state, "1", "0", "0", "0", "0", str(flags), *["0"] * 10, str(threads), "0",
                  str(1000 + pid)]  # fields 3..22
        (base / "stat").write_text(f"{pid} (worker) {' '.join(fields)}\n")

    def die(self, pid: int) -> None:
        shutil.rmtree(self.proc / str(pid), ignore_errors=True)

    def kernel_says(self, kind: EventKind, pid: int) -> None:
        self.bpf.queued.append(SourceEvent(kind, "bpf", boot_ns(), pid, tid=pid))

    def events(self, pid: int) -> list[str]:
        return [r["event"] for r in self.records if r.get("pid") == pid and r["event"] not in
                ("finding", "resolved")]

    def sources(self, pid: int, event: str) -> list[str]:
        return [r["source"] for r in self.records if r.get("pid") == pid and r["event"] == event]

    def kernel_entries(self, pid: int) -> int:
        k = self.bpf.kernel
        return (sum(FdKey.from_buffer_copy(raw).tgid == pid for raw in k.map("fds"))
                + sum(IoctlKey.from_buffer_copy(raw).tgid == pid for raw in k.map("ioctls"))
                + (k.get("procs", ctypes.c_uint32(pid)) is not None))


@pytest.fixture
def node() -> Iterator[Node]:
    tmp = Path(tempfile.mkdtemp(prefix="gg-exits-", dir="/tmp"))  # prefixes are at most 40 bytes
    n = Node(tmp)
    n.spawn(HOLDER)
    n.tracer.start()
    yield n
    assert n.tracer.errors.counts == dict.fromkeys(n.tracer.errors.counts, 0), n.tracer.errors.last
    n.tracer.close()
    shutil.rmtree(tmp)


def test_the_start_scan_makes_the_holder_known_to_the_kernel(node: Node) -> None:
    assert node.events(HOLDER) == ["open"]
    assert node.bpf.kernel.get("procs", ctypes.c_uint32(HOLDER)) is not None
    assert node.tracer.bpf.tables.holder_bytes[HOLDER] == 1  # type: ignore[union-attr]


@pytest.mark.parametrize("how", ["reaped", "zombie"])
def test_exit_before_the_exec_is_handled(node: Node, how: str) -> None:
    """Exec, then exit, both queued before the agent looks: the rescan after the EXEC finds the
    process gone (or a zombie, which holds nothing) and leaves it to the kernel, which knew it all
    along; its EXIT, handled next, is the one exit record, after the exec record."""
    node.kernel_says(EventKind.EXEC, HOLDER)
    if how == "reaped":
        node.die(HOLDER)
    else:
        node.spawn(HOLDER, state="Z", threads=1)
    node.kernel_says(EventKind.EXIT, HOLDER)
    node.tracer.step(0)
    assert node.events(HOLDER) == ["open", "exec", "exit"]
    assert node.sources(HOLDER, "exit") == ["bpf"]
    assert HOLDER not in node.tracer.state.holders and node.kernel_entries(HOLDER) == 0


def test_exit_during_the_rescan_waits_for_the_kernel_exit(node: Node) -> None:
    """The rescan after the EXEC lands inside do_exit: exit_files() already closed fd 3, the task
    is not a zombie yet (PF_EXITING set). That is the process exiting, not closing the GPU, and
    the kernel, which kept its procs entry through the exec, reports that exit with exact time:
    no close, no /proc guess first, and no finding for the dying holder meanwhile."""
    node.kernel_says(EventKind.EXEC, HOLDER)
    node.spawn(HOLDER, state="R", flags=PF_EXITING, fd=False)
    node.tracer.step(0)
    assert node.events(HOLDER) == ["open", "exec"]
    assert HOLDER not in {c.pid for c in node.tracer.current_consumers()}
    node.kernel_says(EventKind.EXIT, HOLDER)
    node.tracer.step(0)
    assert node.events(HOLDER) == ["open", "exec", "exit"] and node.sources(HOLDER, "exit") == ["bpf"]
    assert node.kernel_entries(HOLDER) == 0 and not node.tracer._exit_due


def test_a_lost_kernel_exit_is_settled_from_proc_after_the_wait(node: Node) -> None:
    """The kernel's EXIT never comes (its ring buffer was full): once the wait is over, the
    next step settles the exit from /proc, once."""
    node.kernel_says(EventKind.EXEC, HOLDER)
    node.die(HOLDER)
    node.tracer.step(0)
    assert node.events(HOLDER) == ["open", "exec"] and HOLDER in node.tracer._exit_due
    node.tracer.step(0)  # still within the wait
    assert node.events(HOLDER) == ["open", "exec"]
    node.tracer._exit_due[HOLDER] = 0.0  # the wait is over
    node.tracer.step(0)
    node.tracer.step(0)
    assert node.events(HOLDER) == ["open", "exec", "exit"] and node.sources(HOLDER, "exit") == ["procfs"]
    assert HOLDER not in node.tracer.state.holders and node.kernel_entries(HOLDER) == 0


def test_holder_turning_zombie_during_a_full_scan_is_settled_not_orphaned(node: Node) -> None:
    """A full scan reads a holder's fds, then its identity, by which time it is a zombie: it is
    settled as exited by that scan, never classified orphaned in between."""
    node.spawn(NEWCOMER)
    node.tracer._scan()
    node.tracer._classify()
    real_identify = node.tracer.state._identify

    def zombie_by_now(pid: int, cgroup_id: int) -> Any:
        if pid == NEWCOMER:
            node.spawn(NEWCOMER, state="Z")
        return real_identify(pid, cgroup_id)

    node.tracer.state._identify = zombie_by_now
    node.tracer._scan()
    node.tracer._classify()
    assert node.events(NEWCOMER) == ["open", "exit"]
    # (Without NVML the holder was `pending` from its first classification: unknown waits out the grace
    # period like every class. Not ours here.)
    findings = [r["class"] for r in node.records if r["event"] == "finding" and r["pid"] == NEWCOMER]
    assert findings == ["pending"]


def test_open_handled_after_the_holder_died_is_settled_not_orphaned(node: Node) -> None:
    """A 10 ms job: by the time the agent handles its OPEN (and reads who it is) it is a zombie,
    with its EXEC and EXIT still queued. Open, then exit at once; no orphaned finding, and the
    queued EXEC and EXIT add nothing (an exec after the exit would read as a resurrection)."""
    node.spawn(NEWCOMER, state="Z", fd=False)
    device = node.tracer.catalog.ref_for(node.gpu)
    node.bpf.queued.append(SourceEvent(EventKind.OPEN, "bpf", boot_ns(), NEWCOMER, tid=NEWCOMER, fd=3,
                                       device=device))
    node.kernel_says(EventKind.EXEC, NEWCOMER)
    node.kernel_says(EventKind.EXIT, NEWCOMER)
    node.tracer.step(0)
    assert node.events(NEWCOMER) == ["open", "exit"]
    assert not [r for r in node.records if r["event"] == "finding" and r["class"] == "orphaned"]
    assert NEWCOMER not in node.tracer.state.holders and node.kernel_entries(NEWCOMER) == 0


def test_exit_after_the_rescan_is_reported_by_the_kernel(node: Node) -> None:
    """The exec'd image keeps fd 3; its procs entry was never dropped, so the kernel's EXIT
    comes whenever it exits, with the counters of both images."""
    tables = node.bpf.tables
    node.kernel_says(EventKind.EXEC, HOLDER)
    node.tracer.step(0)
    assert node.events(HOLDER) == ["open", "exec"] and HOLDER in node.tracer.state.holders
    assert node.bpf.kernel.get("procs", ctypes.c_uint32(HOLDER)) is not None
    gpu_id = tables.intern(node.gpu)
    node.bpf.kernel.put("ioctls", IoctlKey(HOLDER, 3, gpu_id, RM_CONTROL), ctypes.c_uint64(9))
    tables.note_ioctl_key(HOLDER, 3, gpu_id, RM_CONTROL)  # type: ignore[arg-type]
    node.die(HOLDER)
    node.kernel_says(EventKind.EXIT, HOLDER)
    node.tracer.step(0)
    assert node.events(HOLDER) == ["open", "exec", "exit"]
    exit_rec = next(r for r in node.records if r["event"] == "exit")
    [counted] = exit_rec["ioctls"]
    assert (counted["device"], counted["cmd"], counted["count"]) == (node.gpu, hex(RM_CONTROL), 9)
    assert node.kernel_entries(HOLDER) == 0


def test_exit_between_the_scan_and_the_seed_is_settled_at_once(node: Node) -> None:
    """A holder the scan read alive dies before the seed made it known to the kernel: no kernel
    EXIT will ever come. It is settled by the same scan, not 30 s later by the next one."""
    node.spawn(NEWCOMER)

    def dies_before_the_seed(name: str, raw_key: bytes, found: bool) -> None:
        if name == "holds" and raw_key[:4] == bytes(ctypes.c_uint32(NEWCOMER)):
            node.die(NEWCOMER)  # seed() counts the holds it wrote

    node.bpf.kernel.after_lookup = dies_before_the_seed
    node.tracer._scan()
    assert node.events(NEWCOMER) == ["open", "exit"]
    assert NEWCOMER not in node.tracer.state.holders and node.kernel_entries(NEWCOMER) == 0


@pytest.mark.parametrize("scan", ["incremental", "full"])
def test_exit_right_after_the_seed_is_the_kernels(node: Node, scan: str) -> None:
    """A rescan finds a holder the kernel never saw open its device (a relative path, an fd passed
    over a socket) and seeds it; the process exits right after that seed, before the agent checks
    whether it still lives (test_rescan.py's relative-path holder is released as soon as its open
    record is out). The seed's procs entry made the kernel's exit hook report that exit: its EXIT,
    exact, is the one exit record, not a /proc guess that shadows it (the queued EXIT would then
    find no holder and be dropped)."""
    node.spawn(NEWCOMER)
    seed_view = node.bpf.seed_view
    tables = node.bpf.tables
    assert tables is not None

    def exits_after_the_seed(view: Any, pids: Any) -> set[int]:
        created = seed_view(view, pids)
        if NEWCOMER in created:  # do_exit now: the exit hook finds the entry (bpf/sched.bpf.c)
            node.die(NEWCOMER)
            del node.bpf.kernel.map("procs")[bytes(ctypes.c_uint32(NEWCOMER))]
            tables.holder_bytes[NEWCOMER] = 0
            node.kernel_says(EventKind.EXIT, NEWCOMER)
        return created

    node.bpf.seed_view = exits_after_the_seed  # type: ignore[method-assign]
    if scan == "incremental":
        node.tracer._scan(pids={HOLDER, NEWCOMER}, periodic=True)
    else:
        node.tracer._scan()
    node.tracer.step(0)
    assert node.events(NEWCOMER) == ["open", "exit"]
    assert node.sources(NEWCOMER, "exit") == ["bpf"]
    assert NEWCOMER not in node.tracer.state.holders and node.kernel_entries(NEWCOMER) == 0
    assert node.events(HOLDER) == ["open"]  # the live holder beside it is untouched


def test_a_holder_a_rescan_reports_is_known_to_the_kernel_by_its_open_record(node: Node) -> None:
    """Whoever acts on a rescan's open record (test_rescan.py releases the holder to exit) finds
    the process seeded already: what it does next is the kernel's to report."""
    node.spawn(NEWCOMER)
    known_at_open: list[bool] = []

    def record(rec: dict[str, Any]) -> None:
        if rec["event"] == "open" and rec["pid"] == NEWCOMER:
            known_at_open.append(node.bpf.kernel.get("procs", ctypes.c_uint32(NEWCOMER)) is not None)
        node.records.append(rec)

    node.tracer.sink = CallbackSink(record)
    node.tracer._scan(pids={HOLDER, NEWCOMER}, periodic=True)
    assert known_at_open == [True]


def test_exit_with_its_tracepoint_still_ahead_waits_for_the_kernel(node: Node) -> None:
    """The process seeded by the rescan is inside do_exit when the agent looks (PF_EXITING, not a
    zombie yet), its exit tracepoint still ahead: it will find the seeded entry and report the exit.
    The agent waits for that EXIT instead of settling from /proc, and does not classify the dying
    holder meanwhile."""
    node.spawn(NEWCOMER)
    seed_view = node.bpf.seed_view

    def exiting_after_the_seed(view: Any, pids: Any) -> set[int]:
        created = seed_view(view, pids)
        if NEWCOMER in created:
            node.spawn(NEWCOMER, state="R", flags=PF_EXITING, fd=False)
        return created

    node.bpf.seed_view = exiting_after_the_seed  # type: ignore[method-assign]
    node.tracer._scan(pids={HOLDER, NEWCOMER}, periodic=True)
    assert node.events(NEWCOMER) == ["open"] and NEWCOMER in node.tracer._exit_due
    assert NEWCOMER not in {c.pid for c in node.tracer.current_consumers()}
    node.die(NEWCOMER)  # the tracepoint: the seeded entry is there, so the kernel says EXIT
    del node.bpf.kernel.map("procs")[bytes(ctypes.c_uint32(NEWCOMER))]
    node.kernel_says(EventKind.EXIT, NEWCOMER)
    node.tracer.step(0)
    assert node.events(NEWCOMER) == ["open", "exit"] and node.sources(NEWCOMER, "exit") == ["bpf"]
    assert node.kernel_entries(NEWCOMER) == 0 and not node.tracer._exit_due


def test_known_holder_turning_zombie_during_a_rescan_is_the_kernels_exit(node: Node) -> None:
    """A holder the kernel knows exits after the rescan's last drain: the scan read its fds, then
    its identity says zombie. Its exit hook already ran, so its EXIT is queued: that is the exit
    record, not a /proc settlement that would shadow it."""
    node.spawn(NEWCOMER)
    node.tracer._scan()
    assert node.bpf.kernel.get("procs", ctypes.c_uint32(NEWCOMER)) is not None
    real_identify = node.tracer.state._identify

    def zombie_by_now(pid: int, cgroup_id: int) -> Any:
        if pid == NEWCOMER and node.bpf.kernel.get("procs", ctypes.c_uint32(NEWCOMER)) is not None:
            node.spawn(NEWCOMER, state="Z")  # do_exit ran: the hook deleted the entry and said EXIT
            del node.bpf.kernel.map("procs")[bytes(ctypes.c_uint32(NEWCOMER))]
            node.kernel_says(EventKind.EXIT, NEWCOMER)
        return real_identify(pid, cgroup_id)

    node.tracer.state._identify = zombie_by_now
    node.tracer._scan(pids={HOLDER, NEWCOMER}, periodic=True)
    node.tracer.step(0)
    assert node.events(NEWCOMER) == ["open", "exit"] and node.sources(NEWCOMER, "exit") == ["bpf"]
    assert NEWCOMER not in node.tracer.state.holders and node.kernel_entries(NEWCOMER) == 0


def test_fork_child_gone_before_its_rescan(node: Node) -> None:
    """A holder forks; the child exits before the agent rescans it. The kernel had marked the
    child a holder at fork, and reported its EXIT: that EXIT settles it, once."""
    node.bpf.queued.append(SourceEvent(EventKind.FORK, "bpf", boot_ns(), HOLDER, tid=HOLDER,
                                       child_pid=NEWCOMER))
    node.bpf.kernel.put("procs", ctypes.c_uint32(NEWCOMER), ctypes.c_uint32(1))
    node.kernel_says(EventKind.EXIT, NEWCOMER)
    node.tracer.step(0)
    assert node.events(NEWCOMER) == ["exit"] and node.sources(NEWCOMER, "exit") == ["bpf"]
    assert NEWCOMER not in node.tracer.state.holders and node.kernel_entries(NEWCOMER) == 0


def test_a_rename_read_after_the_exit_is_not_an_orphan(node: Node) -> None:
    """Exec renames the process (task_rename, then the EXEC record); by the time the agent handles
    the RENAME and re-reads who it is, the 10 ms job is a zombie, its EXEC and EXIT still to be
    polled. The classification in between must not call that exit in progress orphaned: the holder
    waits for its EXIT, and that EXIT is the one exit record."""
    node.kernel_says(EventKind.RENAME, HOLDER)
    node.spawn(HOLDER, state="Z", fd=False)
    node.tracer.step(0)
    assert HOLDER not in {c.pid for c in node.tracer.current_consumers()}
    node.kernel_says(EventKind.EXEC, HOLDER)
    node.kernel_says(EventKind.EXIT, HOLDER)
    node.tracer.step(0)
    assert node.events(HOLDER) == ["open", "exec", "exit"] and node.sources(HOLDER, "exit") == ["bpf"]
    classes = [r["class"] for r in node.records if r["event"] == "finding" and r["pid"] == HOLDER]
    assert "orphaned" not in classes, classes
    assert HOLDER not in node.tracer.state.holders and not node.tracer._exit_due


@pytest.mark.parametrize("kernel_saw", ["exit", "close"])
def test_a_nested_rescan_keeps_what_the_kernel_said_meanwhile(node: Node, kernel_saw: str) -> None:
    """A periodic rescan reads a holder's fds; before it reconciles, its drain applies the holder's
    EXIT (or the CLOSE of its last fd) and then another holder's EXEC, whose rescan reconciles
    first. That inner rescan must not forget the EXIT's (CLOSE's) mark: the outer scan's older view
    would bring the holder back from the dead (the hold back to a process that closed it)."""
    node.spawn(NEWCOMER)
    node.tracer._scan()
    device = node.tracer.catalog.ref_for(node.gpu)
    scan = node.tracer.scanner.scan

    def read_then_the_kernel_speaks(pids: Any = None) -> Any:
        view = scan(pids)
        if pids is not None and NEWCOMER in pids:
            if kernel_saw == "exit":
                node.die(NEWCOMER)
                node.kernel_says(EventKind.EXIT, NEWCOMER)
            else:
                node.spawn(NEWCOMER, fd=False)
                node.bpf.queued.append(SourceEvent(EventKind.CLOSE, "bpf", boot_ns(), NEWCOMER, tid=NEWCOMER,
                                                   fd=3, device=device))
            node.kernel_says(EventKind.EXEC, HOLDER)  # its rescan runs inside the drain
        return view

    node.tracer.scanner.scan = read_then_the_kernel_speaks  # type: ignore[method-assign]
    node.tracer._scan(pids={HOLDER, NEWCOMER}, periodic=True)
    assert node.events(NEWCOMER) == ["open", kernel_saw]
    assert NEWCOMER not in node.tracer.state.holders
    assert node.events(HOLDER) == ["open", "exec"] and HOLDER in node.tracer.state.holders


def test_a_failed_scan_leaves_no_outer_start_behind(node: Node) -> None:
    """A periodic scan that raises (a /proc read gone wrong) still clears the start it set for the
    FORK/EXEC rescans nested in it: kept, it would stop every later rescan from pruning its marks."""
    node.spawn(NEWCOMER)
    node.tracer._scan()

    def broken(pids: Any = None) -> Any:
        raise OSError("a /proc read failed")

    node.tracer.scanner.scan = broken  # type: ignore[method-assign]
    with pytest.raises(OSError):
        node.tracer._scan(pids={NEWCOMER}, periodic=True)
    assert node.tracer.scans._outer_scan_ns is None
