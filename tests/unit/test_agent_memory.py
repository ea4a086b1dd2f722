"""The agent feeds the driver's memory calls to the accountant and puts the figures on its consumers.

The agent runs against a fake /proc (a directory tree) and a fake kernel (tests/helpers/fake_kmaps.py)
whose ring buffer is two lists the test fills: the holder events and the accepted memory calls, as
BpfSource.poll() and take_memcalls() hand them out. What is checked: the calls reach the accountant
in order around the events (a process's calls before its exit), an exec frees the clients of the fds
it closed, a call queued behind an exit settled from /proc is dropped, a lost call makes the figure
unknown, and the consumers' allocated_bytes and reasons. No root, no sleeps.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.tracer.agent import MEMCALLS_LOST, SHARES_PARENT, Tracer
from ghostgpu.tracer.bpf_source import BpfSource
from ghostgpu.tracer.classify import BEFORE_START
from ghostgpu.tracer.config import TracerConfig
from ghostgpu.tracer.events import EventKind, NvmlView, SourceEvent, boot_ns
from ghostgpu.tracer.memcalls import MemCall, MemCallKind
from ghostgpu.tracer.sinks import CallbackSink

from ghostgpu.common.model.consumers import Consumer
from tests.helpers.fake_kmaps import fake_tables

PID, OTHER = 100, 200
MIB = 1 << 20
CLIENT, DEVICE, SUBDEVICE, VIDMEM = 0x41, 0x80, 0x2080, 0x40
H_CLIENT = 0xC1D00001


class ScriptedBpf(BpfSource):
    """BpfSource with the fake kernel's tables, and a ring buffer of events and memory calls."""

    def __init__(self, prefix: str) -> None:
        super().__init__((prefix,))
        self.tables, self.kernel = fake_tables()
        self.queued: list[SourceEvent] = []
        self.calls: list[MemCall] = []
        self.counters: dict[str, int] = {}

    def poll(self, timeout_ms: int) -> list[SourceEvent]:
        out, self.queued = self.queued, []
        return out

    def take_memcalls(self) -> list[MemCall]:
        out, self.calls = self.calls, []
        return out

    def stats(self) -> dict[str, int]:
        return {**super().stats(), **self.counters}


class NoNvml:
    def read(self) -> NvmlView:
        return NvmlView(available=False, error="NVML: no library (test)")

    def close(self) -> None:
        pass


class Node:
    def __init__(self, tmp: Path) -> None:
        self.proc = tmp / "proc"
        self.gpu0, self.gpu1, self.ctl = tmp / "nvidia0", tmp / "nvidia1", tmp / "nvidiactl"
        self.proc.mkdir()
        for dev in (self.gpu0, self.gpu1, self.ctl):
            dev.write_bytes(b"")  # prefixes match by name: a plain file stands for the device node
        self.records: list[dict[str, Any]] = []
        cfg = TracerConfig(node_name="n1", proc_root=str(self.proc), device_prefixes=[str(tmp / "nvidia")],
                           bpf="off", grace_s=60.0)
        self.tracer = Tracer(cfg, CallbackSink(self.records.append))
        self.tracer.nvml_source = NoNvml()  # type: ignore[assignment]
        self.bpf = ScriptedBpf(cfg.prefixes[0])
        self.tracer.bpf = self.bpf  # attached "before" start(): --bpf off leaves it alone
        self.handle = 0x5C000000

    def spawn(self, pid: int, fds: dict[int, Path]) -> None:
        base = self.proc / str(pid)
        shutil.rmtree(base / "fd", ignore_errors=True)
        (base / "fd").mkdir(parents=True)
        for fd, dev in fds.items():
            os.symlink(dev, base / "fd" / str(fd))
        fields = ["S", "1", "0", "0", "0", "0", "0", *["0"] * 10, "1", "0", str(1000 + pid)]  # fields 3..22
        (base / "stat").write_text(f"{pid} (worker) {' '.join(fields)}\n")

    def die(self, pid: int) -> None:
        shutil.rmtree(self.proc / str(pid), ignore_errors=True)

    def kernel_opens(self, pid: int, fd: int, dev: Path) -> None:
        """The process opens a device under the kernel's watch (its /proc shows the fd too)."""
        current = {int(p.name): Path(os.readlink(p)) for p in (self.proc / str(pid) / "fd").iterdir()} \
            if (self.proc / str(pid) / "fd").is_dir() else {}
        self.spawn(pid, {**current, fd: dev})
        self.bpf.queued.append(SourceEvent(EventKind.OPEN, "bpf", boot_ns(), pid, tid=pid, fd=fd,
                                           device=self.tracer.catalog.ref_for(str(dev))))

    def kernel_says(self, kind: EventKind, pid: int) -> None:
        self.bpf.queued.append(SourceEvent(kind, "bpf", boot_ns(), pid, tid=pid))

    def call(self, kind: MemCallKind, pid: int, fd: int, h_root: int, h_parent: int, h_object: int,
             **fields: Any) -> int:
        self.bpf.calls.append(MemCall(kind, boot_ns(), pid, fd, h_root, h_parent, h_object, **fields))
        return h_object

    def client(self, pid: int, fd: int, h_client: int = H_CLIENT) -> int:
        return self.call(MemCallKind.ALLOC, pid, fd, h_client, h_client, h_client, h_class=CLIENT)

    def device(self, pid: int, fd: int, h_client: int, instance: int) -> int:
        self.handle += 1
        return self.call(MemCallKind.ALLOC, pid, fd, h_client, h_client, self.handle, h_class=DEVICE,
                         instance=instance)

    def vidmem(self, pid: int, fd: int, h_client: int, parent: int, size_bytes: int) -> int:
        self.handle += 1
        return self.call(MemCallKind.ALLOC, pid, fd, h_client, parent, self.handle, h_class=VIDMEM,
                         size_bytes=size_bytes)

    def consumers(self, pid: int) -> dict[int | None, Consumer]:
        """The process's consumers by GPU device minor (None: node-wide), as the agent classifies now."""
        return {c.gpu_minor: c for c in self.tracer.current_consumers() if c.pid == pid}


@pytest.fixture
def node() -> Iterator[Node]:
    tmp = Path(tempfile.mkdtemp(prefix="gg-mem-", dir="/tmp"))  # prefixes are at most 40 bytes
    n = Node(tmp)
    n.spawn(OTHER, {3: n.gpu0})  # held since before the tracer started: the start scan finds it
    n.tracer.start()
    yield n
    assert n.tracer.errors.counts == dict.fromkeys(n.tracer.errors.counts, 0), n.tracer.errors.last
    n.tracer.close()
    shutil.rmtree(tmp)


def test_each_gpu_gets_what_its_device_instance_holds(node: Node) -> None:
    """Device instance N is the GPU of device minor N; memory freed is gone; a subtree goes with its
    device."""
    node.kernel_opens(PID, 3, node.ctl)
    node.kernel_opens(PID, 4, node.gpu0)
    node.kernel_opens(PID, 5, node.gpu1)
    client = node.client(PID, 3)
    dev0, dev1 = node.device(PID, 3, client, 0), node.device(PID, 3, client, 1)
    node.vidmem(PID, 3, client, dev0, 64 * MIB)
    gone = node.vidmem(PID, 3, client, dev0, 32 * MIB)
    node.vidmem(PID, 3, client, dev1, 2 * MIB)
    node.call(MemCallKind.FREE, PID, 3, client, dev0, gone)
    node.tracer.step(0)
    by_gpu = node.consumers(PID)
    assert {minor: c.allocated_bytes for minor, c in by_gpu.items()} == {0: 64 * MIB, 1: 2 * MIB}
    assert by_gpu[0].allocated_reason == ""
    assert by_gpu[0].reason.endswith("; it holds 64.0 MiB on GPU 0 (from the driver calls ghostgpu saw)")
    node.call(MemCallKind.FREE, PID, 3, client, client, dev1)  # the device and everything under it
    node.tracer.step(0)
    assert {minor: c.allocated_bytes for minor, c in node.consumers(PID).items()} == {0: 64 * MIB, 1: 0}


def test_unknown_is_not_zero(node: Node) -> None:
    """A holder the start scan found opened its device before the tracer watched: unknown, with the
    reason. One the kernel saw from its first open that allocated nothing holds 0."""
    node.kernel_opens(PID, 4, node.gpu0)
    node.tracer.step(0)
    seen, before = node.consumers(PID)[0], node.consumers(OTHER)[0]
    assert (seen.allocated_bytes, seen.allocated_reason) == (0, "")
    assert (before.allocated_bytes, before.allocated_reason) == (None, BEFORE_START)
    assert "it holds" not in seen.reason


def test_calls_are_applied_before_the_exit_behind_them(node: Node) -> None:
    """The calls and the exit arrive in one batch: the calls first (else the exit would free
    nothing and the memory would stay on a dead pid)."""
    node.kernel_opens(PID, 3, node.gpu0)
    node.tracer.step(0)
    client = node.client(PID, 3)
    node.vidmem(PID, 3, client, node.device(PID, 3, client, 0), 8 * MIB)
    node.die(PID)
    node.kernel_says(EventKind.EXIT, PID)
    node.tracer.step(0)
    assert node.tracer.memory.held(PID) == {} and node.tracer.memory.objects == 0
    assert node.consumers(PID) == {}


def test_a_call_queued_behind_an_exit_settled_from_proc_is_dropped(node: Node) -> None:
    node.kernel_opens(PID, 3, node.gpu0)
    client = node.client(PID, 3)
    node.tracer.step(0)
    late = MemCall(MemCallKind.ALLOC, boot_ns(), PID, 3, client, client, 0x77, h_class=DEVICE, instance=0)
    node.die(PID)
    node.tracer._settle_exit(PID)  # /proc says it is gone before the kernel's records are read
    assert node.tracer.memory.objects == 0
    node.bpf.calls.append(late)
    node.tracer.step(0)
    assert node.tracer.memory.objects == 0, "a dead process's call must not bring its client back"


def test_an_exec_frees_the_clients_of_the_fds_it_closed(node: Node) -> None:
    """CUDA opens nvidiactl with O_CLOEXEC: the exec closes it without a close call to trace. The
    exec's rescan says which fds remain; the clients of the others are freed."""
    node.kernel_opens(PID, 3, node.ctl)
    node.kernel_opens(PID, 4, node.gpu0)
    kept, closed = node.client(PID, 4, 0xC1D00004), node.client(PID, 3, 0xC1D00003)
    node.vidmem(PID, 4, kept, node.device(PID, 4, kept, 0), 4 * MIB)
    node.vidmem(PID, 3, closed, node.device(PID, 3, closed, 0), 16 * MIB)
    node.tracer.step(0)
    assert node.tracer.memory.held(PID) == {0: 20 * MIB}
    node.spawn(PID, {4: node.gpu0})  # the exec'd image: fd 3 is gone
    node.kernel_says(EventKind.EXEC, PID)
    node.tracer.step(0)
    assert node.tracer.memory.held(PID) == {0: 4 * MIB}


def test_a_close_of_the_clients_fd_frees_it(node: Node) -> None:
    node.kernel_opens(PID, 3, node.gpu0)
    client = node.client(PID, 3)
    node.vidmem(PID, 3, client, node.device(PID, 3, client, 0), 6 * MIB)
    node.tracer.step(0)
    assert node.tracer.memory.held(PID) == {0: 6 * MIB}
    node.call(MemCallKind.CLOSE, PID, 3, 0, 0, 0)
    node.tracer.step(0)
    assert node.tracer.memory.held(PID) == {}


def test_a_lost_call_makes_the_figure_unknown(node: Node) -> None:
    """The kernel counted a memory call it could not deliver: the figure of every process that held
    a device then may be short, so it is unknown, with the reason."""
    node.kernel_opens(PID, 3, node.gpu0)
    node.tracer.step(0)
    node.bpf.counters["mem_drops"] = 1
    node.tracer._report_bpf_stats()
    consumer = node.consumers(PID)[0]
    assert (consumer.allocated_bytes, consumer.allocated_reason) == (None, MEMCALLS_LOST)


def test_memory_calls_reclassify_at_most_once_per_nvml_refresh(node: Node) -> None:
    """A process allocating all the time makes a finding per NVML refresh, not one per call."""
    # Past its grace period: a pending consumer is re-classified on a clock of its own.
    node.tracer._classify_settings = replace(node.tracer._classify_settings, grace_ns=0)
    node.kernel_opens(PID, 3, node.gpu0)
    client = node.client(PID, 3)
    device = node.device(PID, 3, client, 0)
    node.tracer.step(0)

    def findings() -> list[int | None]:
        return [r["allocated_bytes"] for r in node.records if r["event"] == "finding" and r["pid"] == PID]

    assert findings() == [0]
    node.tracer._due["memory"] = 0.0  # the last re-classification for memory is a refresh ago
    node.vidmem(PID, 3, client, device, 2 * MIB)
    node.tracer.step(0)
    assert findings() == [0, 2 * MIB]
    node.vidmem(PID, 3, client, device, 2 * MIB)
    node.tracer.step(0)
    assert findings() == [0, 2 * MIB], "within the refresh: no new finding yet"
    node.tracer._due["memory"] = 0.0  # the refresh is over
    node.tracer.step(0)
    assert findings() == [0, 2 * MIB, 4 * MIB]


def full_scan_step(node: Node) -> None:
    """One loop step with the periodic full /proc scan due (as its clock makes it every few minutes)."""
    node.tracer._due["scan"] = 0.0
    node.tracer.rescans.full_due_s = 0.0
    node.tracer.step(0)
    assert node.tracer.rescans.last == "full"


def test_the_full_scan_frees_what_a_process_never_reported_gone_held(node: Node) -> None:
    """Calls on an fd a process received (not opened: the kernel never counted it a holder, so no
    EXIT comes for it): once it is gone at two periodic full scans in a row, its clients are freed."""
    node.spawn(PID, {})
    client = node.client(PID, 7)
    node.vidmem(PID, 7, client, node.device(PID, 7, client, 0), 2 * MIB)
    node.tracer.step(0)
    assert node.tracer.memory.held(PID) == {0: 2 * MIB}
    full_scan_step(node)
    assert node.tracer.memory.held(PID) == {0: 2 * MIB}, "alive: kept"
    node.die(PID)
    full_scan_step(node)
    assert node.tracer.memory.held(PID) == {0: 2 * MIB}, "dead at one sweep: its EXIT may still be queued"
    late = MemCall(MemCallKind.ALLOC, boot_ns(), PID, 7, client, client, 0x77, h_class=DEVICE, instance=0)
    full_scan_step(node)
    assert node.tracer.memory.held(PID) == {} and node.tracer.memory.objects == 0
    node.bpf.calls.append(late)
    node.tracer.step(0)
    assert node.tracer.memory.objects == 0, "a call from before the sweep is dropped"


def test_the_sweep_leaves_a_holder_waiting_for_its_kernel_exit(node: Node) -> None:
    """A dead holder still waiting for its kernel EXIT keeps its memory (and its kernel entries, for
    the EXIT's counters) however many sweeps pass: the EXIT, or /proc after the wait, settles it."""
    node.kernel_opens(PID, 3, node.gpu0)
    client = node.client(PID, 3)
    node.vidmem(PID, 3, client, node.device(PID, 3, client, 0), 2 * MIB)
    node.tracer.step(0)
    node.die(PID)
    node.tracer._exit_due[PID] = float("inf")  # its EXIT is awaited
    for _ in range(3):
        node.tracer._sweep_memory()  # as a full scan's (which would also settle the holder itself)
    assert PID in node.tracer._exit_due and PID in node.tracer._memory_fds
    node.kernel_says(EventKind.EXIT, PID)
    node.tracer.step(0)
    assert node.tracer.memory.held(PID) == {} and PID not in node.tracer._exit_due


def test_an_exit_is_dated_by_its_event_for_the_calls_behind_it(node: Node) -> None:
    """A call the kernel made after the EXIT's time (a reused pid) is kept; one from before it, dropped."""
    node.kernel_opens(PID, 3, node.gpu0)
    client = node.client(PID, 3)
    node.tracer.step(0)
    exit_ns = boot_ns()
    node.die(PID)
    node.bpf.queued.append(SourceEvent(EventKind.EXIT, "bpf", exit_ns, PID, tid=PID))
    node.tracer.step(0)
    assert node.tracer._memory_gone[PID] == exit_ns
    node.bpf.calls.append(MemCall(MemCallKind.ALLOC, exit_ns - 1, PID, 3, client, client, 0x77,
                                  h_class=DEVICE, instance=0))
    node.tracer.step(0)
    assert node.tracer.memory.objects == 0, "made before the exit: dropped"
    node.bpf.calls.append(MemCall(MemCallKind.ALLOC, exit_ns + 1, PID, 3, client, client, client,
                                  h_class=CLIENT))
    node.tracer.step(0)
    assert node.tracer.memory.objects == 1, "made after the exit (the pid reused): kept"


# --- a file a fork shares -------------------------------------------------------------------------------

CHILD = 300


def fork(node: Node, parent: int, child: int, fds: dict[int, Path]) -> None:
    """The parent forks: the child's /proc shows the fds it inherited."""
    node.spawn(child, fds)
    node.bpf.queued.append(SourceEvent(EventKind.FORK, "bpf", boot_ns(), parent, tid=parent, child_pid=child))


def test_a_fork_shares_its_parents_memory_and_inherits_it_at_the_parents_exit(node: Node) -> None:
    """A worker forked after CUDA started holds the parent's open file: while the parent lives, the
    parent's figure counts the memory and the child's is unknown (never an exact 0); at the parent's
    exit RM keeps the file's clients (the child still holds the file), and they are the child's."""
    node.kernel_opens(PID, 3, node.gpu0)
    client = node.client(PID, 3)
    node.vidmem(PID, 3, client, node.device(PID, 3, client, 0), 8 * MIB)
    node.tracer.step(0)
    fork(node, PID, CHILD, {3: node.gpu0})
    node.tracer.step(0)
    child = node.consumers(CHILD)[0]
    assert (child.allocated_bytes, child.allocated_reason) == (None, SHARES_PARENT.format(parent=PID))
    assert node.consumers(PID)[0].allocated_bytes == 8 * MIB
    node.die(PID)
    node.kernel_says(EventKind.EXIT, PID)
    node.tracer.step(0)
    child = node.consumers(CHILD)[0]
    assert (child.allocated_bytes, child.allocated_reason) == (8 * MIB, "")
    node.die(CHILD)
    node.kernel_says(EventKind.EXIT, CHILD)
    node.tracer.step(0)
    assert node.tracer.memory.objects == 0


def test_a_close_by_the_parent_moves_the_clients_to_the_fork_still_holding_the_file(node: Node) -> None:
    node.kernel_opens(PID, 3, node.gpu0)
    client = node.client(PID, 3)
    node.vidmem(PID, 3, client, node.device(PID, 3, client, 0), 4 * MIB)
    node.tracer.step(0)
    fork(node, PID, CHILD, {3: node.gpu0})
    node.tracer.step(0)
    node.call(MemCallKind.CLOSE, PID, 3, 0, 0, 0)
    node.tracer.step(0)
    assert node.tracer.memory.held(PID) == {} and node.tracer.memory.held(CHILD) == {0: 4 * MIB}


def test_a_fork_that_let_the_file_go_inherits_nothing(node: Node) -> None:
    """The child closed its copy of the fd (a fork that does not use the GPU): the parent's exit frees
    the clients, as RM does when the file's last holder lets it go."""
    node.kernel_opens(PID, 3, node.gpu0)
    node.kernel_opens(PID, 4, node.ctl)
    client = node.client(PID, 3)
    node.vidmem(PID, 3, client, node.device(PID, 3, client, 0), 4 * MIB)
    node.tracer.step(0)
    fork(node, PID, CHILD, {4: node.ctl})  # fd 3 closed before the child held anything of it
    node.tracer.step(0)
    assert node.consumers(CHILD)[None].allocated_reason == ""
    node.die(PID)
    node.kernel_says(EventKind.EXIT, PID)
    node.tracer.step(0)
    assert node.tracer.memory.objects == 0 and node.tracer.memory.held(CHILD) == {}


# --- exits and closes kept for the fault join (tracer/faults.py) ----------------------------------------

def test_an_exit_settled_from_proc_is_dated_when_last_seen_alive(node: Node) -> None:
    """/proc finds an exit late: the fault join's look-back runs from when the process was last seen
    alive (here its OPEN), not from the moment /proc noticed."""
    node.kernel_opens(PID, 3, node.gpu0)
    open_ns = node.bpf.queued[-1].ts_ns
    node.tracer.step(0)
    node.die(PID)
    node.tracer._settle_exit(PID)
    (gone,) = [e for e in node.tracer.faults.exits if e.pid == PID]
    assert (gone.exit_ns, gone.exited) == (open_ns, True)


def test_a_full_scan_that_finds_a_holder_gone_notes_its_exit(node: Node) -> None:
    """OTHER was found by the start scan; a later full scan reads its fds (alive then), the next finds
    it gone: its exit is kept for the look-back, dated by that last scan."""
    full_scan_step(node)
    seen_ns = node.tracer._alive_ns[OTHER]
    node.die(OTHER)
    full_scan_step(node)
    (gone,) = [e for e in node.tracer.faults.exits if e.pid == OTHER]
    assert (gone.exit_ns, gone.exited, gone.held_since_ns.keys()) == (seen_ns, True, {0})


def test_an_exec_that_closed_a_gpu_is_noted_as_a_close(node: Node) -> None:
    node.kernel_opens(PID, 3, node.ctl)
    node.kernel_opens(PID, 4, node.gpu0)
    node.tracer.step(0)
    node.spawn(PID, {3: node.ctl})  # the exec'd image: the GPU's fd was close-on-exec
    node.kernel_says(EventKind.EXEC, PID)
    node.tracer.step(0)
    (closed,) = [e for e in node.tracer.faults.exits if e.pid == PID]
    assert (closed.exited, closed.held_since_ns.keys()) == (False, {0})
