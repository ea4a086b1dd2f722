"""The tracer's trace-session manager against a fake kernel: commands, limits, deadlines without a
collector, batches, the --gpu filter and records shared by two sessions. No root, no BPF."""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from ghostgpu.tracer.cgroup import CgroupIdResolver
from ghostgpu.tracer.config import TracerConfig
from ghostgpu.tracer.trace_kernel import TREC
from ghostgpu.tracer.trace_records import RecordMaker, bit_names, open_flags
from ghostgpu.tracer.trace_sessions import LIMIT_PREFIX, NodeTraceLimits, TraceSessions

from ghostgpu.common.model.consumers import DeviceKind, DeviceRef
from ghostgpu.common.wire.convert_trace import record_from_proto
from ghostgpu.v1 import stream_pb2, trace_pb2
from tests.helpers.polling import wait_until

LIMITS = NodeTraceLimits.of(TracerConfig(node_name="n1"))  # the tracer's defaults

RM_CONTROL = 0xC020462A
CTL, GPU0, GPU1 = 1, 2, 3
PATHS = {CTL: "/dev/nvidiactl", GPU0: "/dev/nvidia0", GPU1: "/dev/nvidia1"}


class FakeTraceKernel:
    def __init__(self) -> None:
        self.slots: dict[int, list[int]] = {}
        self.tgids: dict[int, int] = {}
        self.cgroups: dict[int, set[int]] = {}
        self.layouts: dict[int, tuple[int, int]] = {}
        self.queued: list[bytes] = []
        self.ready = threading.Condition()

    def set_layouts(self, layouts: dict[int, tuple[int, int]]) -> None:
        self.layouts.update(layouts)

    def open_slot(self, slot: int, max_records: int) -> None:
        self.slots[slot] = [0, 0, 0, max_records]

    def close_slot(self, slot: int) -> None:
        self.slots.pop(slot, None)

    def add_tgid(self, slot: int, tgid: int) -> None:
        self.tgids[tgid] = self.tgids.get(tgid, 0) | 1 << slot

    def set_cgroups(self, slot: int, ids: set[int]) -> None:
        self.cgroups[slot] = set(ids)

    def slot_counts(self, slot: int) -> tuple[int, int, int]:
        return tuple(self.slots.get(slot, [0, 0, 0])[:3])  # type: ignore[return-value]

    def dev_paths(self) -> dict[int, str]:
        return dict(PATHS)

    def push(self, *records: bytes) -> None:
        with self.ready:
            self.queued.extend(records)
            self.ready.notify_all()

    def poll(self, timeout_ms: int) -> list[bytes]:
        with self.ready:
            if not self.queued and timeout_ms:
                self.ready.wait(timeout_ms / 1000)
            out, self.queued = self.queued, []
        return out


def ioctl_record(tgid: int, tid: int, dev_id: int, slots: int = 1, status: int = 0, cmd: int = 0x20800101,
                 ) -> bytes:
    block = struct.pack("<IIIIQII", 0xC1D00001, 0x5C000001, cmd, 0, 0, 8, status)
    return TREC.pack(1000, 2500, 0, 0, 0, 0, -25, 1, slots, tgid, tid, 3, dev_id, RM_CONTROL, status, 0, 0, 2,
                     len(block), block.ljust(56, b"\0"))


def device_ref(path: str) -> DeviceRef:
    if path.endswith("ctl"):
        return DeviceRef(path, DeviceKind.CONTROL)
    return DeviceRef(path, DeviceKind.GPU, int(path[-1]))


def fake_proc(root: Path, parents: dict[int, int]) -> None:
    for pid, ppid in parents.items():
        (root / str(pid)).mkdir(exist_ok=True)
        fields = ["S", str(ppid), *["0"] * 15, "1", "0", "100"]  # fields 3..22 (20: threads, 22: start)
        (root / str(pid) / "stat").write_text(f"{pid} (w x) {' '.join(fields)}\n")


class Node:
    def __init__(self, tmp: Path, limits: NodeTraceLimits | None = None) -> None:
        fake_proc(tmp, {4242: 1, 4300: 4242, 4301: 4300, 5000: 1})  # 4242 has a child and a grandchild
        self.kernel = FakeTraceKernel()
        self.batches: list[trace_pb2.TraceBatch] = []
        self.collector_up = True
        cgroups = CgroupIdResolver(str(tmp))
        maker = RecordMaker("n1", str(tmp), cgroups, device_ref, self.kernel.dev_paths,
                            lambda minor: (str(minor), f"GPU-{minor}"))
        self.sessions = TraceSessions(self.kernel, "n1", limits or LIMITS, maker, cgroups, self.emit,  # type: ignore[arg-type]
                                      lambda: "550.54.15")

    def emit(self, msg: stream_pb2.TracerMessage) -> bool:
        if not self.collector_up:
            return False
        self.batches.append(msg.trace)
        return True

    def start(self, session: str, pid: int = 4242, seconds: float = 60.0, gpu: str = "",
              max_records: int = 0) -> trace_pb2.TraceCommandResult:
        cmd = stream_pb2.Command(id=1, trace_start=trace_pb2.TraceStart(
            session=session, pid=pid, gpu=gpu, deadline_unix_ns=time.time_ns() + int(seconds * 1e9),
            max_records=max_records))
        return self.sessions.handle(cmd)

    def records(self, session: str) -> list:
        return [record_from_proto(r, session) for b in self.batches if b.session == session
                for r in b.records]

    def ended(self, session: str) -> trace_pb2.TraceBatch | None:
        return next((b for b in self.batches if b.session == session and b.ended), None)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    yield n
    n.sessions.close()


def test_a_session_decodes_and_batches_its_records(node: Node) -> None:
    assert node.start("t-1").error == ""
    # the pid and what it forked before the start; the kernel adds later forks itself
    assert node.kernel.tgids == {4242: 1, 4300: 1, 4301: 1} and node.kernel.slots[0][3] == 100_000
    assert node.kernel.layouts, "the driver's layouts were written to the kernel at the first start"
    node.kernel.push(ioctl_record(4242, 4243, CTL, status=0x1F), ioctl_record(4242, 4242, GPU0))
    wait_until(lambda: len(node.records("t-1")) == 2, what="two records in a batch")
    first, second = node.records("t-1")
    assert (first.seq, first.tid, first.call, first.cmd, first.nv_status, first.duration_ns) == (
        1, 4243, "RM_CONTROL", 0x20800101, 0x1F, 2500)
    assert first.nv_status_name and first.ret == -25 and first.device == "/dev/nvidiactl" and first.gpu == ""
    assert (second.seq, second.device, second.gpu) == (2, "/dev/nvidia0", "0")


def test_the_tracer_ends_a_session_at_its_deadline_with_no_collector(node: Node) -> None:
    node.collector_up = False
    node.start("t-1", seconds=0.05)
    node.kernel.push(ioctl_record(4242, 4242, CTL))
    wait_until(lambda: not node.sessions.active(), what="the session ended at its deadline")
    assert 0 not in node.kernel.slots  # the kernel stopped recording
    node.collector_up = True
    node.start("t-2", seconds=0.05)
    wait_until(lambda: node.ended("t-2") is not None, what="the next session's last batch")
    assert node.ended("t-2").end_reason == "deadline"


def test_records_lost_to_a_full_stream_queue_are_counted(node: Node) -> None:
    node.start("t-1")
    node.collector_up = False
    node.kernel.push(ioctl_record(4242, 4242, CTL), ioctl_record(4242, 4242, CTL))
    wait_until(lambda: node.sessions._sessions["t-1"].transport_dropped == 2, what="2 counted lost")
    node.collector_up = True
    node.sessions.handle(stream_pb2.Command(trace_stop=trace_pb2.TraceStop(session="t-1")))
    wait_until(lambda: node.ended("t-1") is not None, what="stopped")
    end = node.ended("t-1")
    assert (end.end_reason, end.dropped_transport_total, end.records_total) == ("stopped", 2, 2)


def test_limits_are_refused_naming_them(tmp_path: Path) -> None:
    n = Node(tmp_path, NodeTraceLimits(max_sessions=2, max_duration_s=60, max_records=10))
    try:
        assert n.start("a").error == "" and n.start("b").error == ""
        refused = n.start("c").error
        assert refused.startswith(LIMIT_PREFIX) and "--trace-max-sessions 2" in refused
        too_long = n.start("d", seconds=3600).error
        assert too_long.startswith(LIMIT_PREFIX) and "--trace-max-duration" in too_long
        assert n.start("a").error == ""  # a retried start of a running session is not a new one
        n.sessions.handle(stream_pb2.Command(trace_stop=trace_pb2.TraceStop(session="a")))
        wait_until(lambda: n.sessions.active() == 1, what="a ended")
        assert n.start("e", max_records=1_000_000).error == ""
        assert n.kernel.slots[2][3] == 10  # the node's record limit wins over the collector's ask
        # slot 2, not the freed 0: a call still in flight from "a" must not land in "e"
    finally:
        n.sessions.close()


def test_gpu_filter_keeps_that_gpu_and_the_control_device(node: Node) -> None:
    node.start("t-1", gpu="1")
    node.kernel.push(ioctl_record(4242, 4242, GPU0), ioctl_record(4242, 4242, GPU1),
                     ioctl_record(4242, 4242, CTL))
    wait_until(lambda: len(node.records("t-1")) == 2, what="two records kept")
    assert [r.device for r in node.records("t-1")] == ["/dev/nvidia1", "/dev/nvidiactl"]


def test_a_record_in_two_sessions_is_in_both(node: Node) -> None:
    node.start("t-1")
    node.start("t-2")
    node.kernel.push(ioctl_record(4242, 4242, CTL, slots=0b11))
    wait_until(lambda: node.records("t-1") and node.records("t-2"), what="both sessions got it")
    assert node.records("t-1")[0].seq == node.records("t-2")[0].seq == 1


def test_what_is_not_on_the_node_is_refused_as_not_found(node: Node) -> None:
    assert node.start("t-1", pid=999).error == "not found: no process 999 on node n1"
    cmd = stream_pb2.Command(trace_start=trace_pb2.TraceStart(
        session="t-2", container_ids=["ab" * 32], deadline_unix_ns=time.time_ns() + 10**10))
    assert node.sessions.handle(cmd).error.startswith("not found: no cgroup of container abababababab")
    assert not node.kernel.slots, "nothing written to the kernel for a refused start"


def test_a_start_after_its_own_stop_is_refused(node: Node) -> None:
    node.sessions.handle(stream_pb2.Command(trace_stop=trace_pb2.TraceStop(session="t-late")))
    assert "already stopped" in node.start("t-late").error and not node.kernel.slots


def test_a_start_that_fails_midway_leaves_no_slot_recording(node: Node) -> None:
    def full(slot: int, tgid: int) -> None:
        raise OSError("trace_tgids is full")

    node.kernel.add_tgid = full  # type: ignore[method-assign]
    assert "trace_tgids is full" in node.start("t-1").error
    assert not node.kernel.slots and not node.sessions.active()


def test_a_gpu_filtered_session_keeps_its_own_limit_exactly(tmp_path: Path) -> None:
    n = Node(tmp_path, replace(LIMITS, max_records=2))
    try:
        n.start("t-1", gpu="1")
        assert n.kernel.slots[0][3] == 2 * 16  # room in the kernel for the calls the filter drops
        n.kernel.push(*(ioctl_record(4242, 4242, dev) for dev in (GPU0, GPU1, CTL, GPU1, GPU0, CTL)))
        wait_until(lambda: len(n.records("t-1")) == 2, what="two kept")
        n.sessions.handle(stream_pb2.Command(trace_stop=trace_pb2.TraceStop(session="t-1")))
        wait_until(lambda: n.ended("t-1") is not None, what="stopped")
        assert n.ended("t-1").dropped_limit_total == 2  # GPU1 and CTL past the limit; GPU0's not counted
    finally:
        n.sessions.close()


def test_flag_names() -> None:
    import os

    assert open_flags(os.O_RDWR | os.O_CLOEXEC) == "O_RDWR|O_CLOEXEC"
    assert bit_names(3, [(1, "PROT_READ"), (2, "PROT_WRITE")], "PROT_NONE") == "PROT_READ|PROT_WRITE"
    assert bit_names(0, [(1, "PROT_READ")], "PROT_NONE") == "PROT_NONE"
    assert bit_names(0x81, [(1, "A")], "0") == "A|0x80"


def test_a_process_gone_before_its_records_are_read_keeps_the_identity_the_agent_saw(tmp_path: Path) -> None:
    from ghostgpu.tracer.trace_kernel import unpack_trace

    maker = RecordMaker("n1", str(tmp_path), CgroupIdResolver(str(tmp_path)), device_ref,
                        lambda: dict(PATHS), lambda minor: (str(minor), ""),
                        known_identity=lambda pid: (7, "trainer") if pid == 4242 else None)
    raw = unpack_trace(ioctl_record(4242, 4242, CTL))
    assert raw is not None
    rec = maker.make(raw, "t-1", 1, 0)
    assert rec is not None and (rec.ns_pid, rec.comm) == (7, "trainer")
    other = maker.make(raw._replace(tgid=99), "t-1", 2, 0)
    assert other is not None and (other.ns_pid, other.comm) == (None, "")


def test_a_flood_read_in_one_poll_leaves_in_bounded_batches(node: Node) -> None:
    """One ring-buffer poll can hold 100,000 records: a batch of them all would pass gRPC's 8 MiB
    message limit and cost the stream (seen at 200k ioctls/s)."""
    from ghostgpu.tracer.trace_sessions import BATCH_RECORDS

    node.start("t-1")
    node.kernel.push(*(ioctl_record(4242, 4242, CTL) for _ in range(3 * BATCH_RECORDS + 7)))
    wait_until(lambda: len(node.records("t-1")) == 3 * BATCH_RECORDS + 7, what="every record")
    assert max(len(b.records) for b in node.batches) <= BATCH_RECORDS
