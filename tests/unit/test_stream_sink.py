"""StreamSink against a scripted NodeStream collector on real sockets (loopback TCP and unix).

The protocol as the collector sees it: Hello, Snapshot at the last seq, the unacknowledged events
exactly once after Welcome.acked_seq, batches by size and by time, acks trimming the spool, a
collector restart on the same port, spool overflow reported, version refusal survived, commands
answered.
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from ghostgpu.tracer import records
from ghostgpu.tracer import stream as stream_module
from ghostgpu.tracer.cri_relay import CriRelay
from ghostgpu.tracer.stream import FLUSH_S, WINDOW_BATCHES, StreamOptions, StreamSink

from ghostgpu import __version__
from ghostgpu.common.model.consumers import Consumer, ConsumerClass
from ghostgpu.common.model.records import InfoRecord, ReadyRecord
from ghostgpu.k8s import cri_runtime_v1_pb2 as cri
from ghostgpu.v1 import stream_pb2
from tests.helpers.fake_collector import FakeCollector
from tests.helpers.polling import wait_until
from tests.unit.test_cri_relay import RawRuntime

NODE = "node-a"
FAST = StreamOptions(backoff_min_s=0.01, backoff_max_s=0.2, info_wait_s=0.0, heartbeat_s=30.0)
INFO = InfoRecord.from_json({
    "event": "info", "ts": 1_767_000_000.5, "node": NODE, "bpf": True, "nvml": True, "nvml_error": "",
    "driver_version": "550.54.15", "gpus": [{"index": 0, "uuid": "GPU-0", "name": "H100", "minor": 0,
                                             "memory_total_bytes": 80 << 30}]})


def consumer(pid: int, cls: ConsumerClass = ConsumerClass.HIDDEN) -> Consumer:
    return Consumer(node=NODE, pid=pid, ns_pid=1, comm="python3", gpu=0, gpu_uuid="GPU-0", gpu_minor=0,
                    devices=["/dev/nvidia0"], container_id="c" * 64, pod_uid="p", runtime="containerd",
                    cls=cls, reason="holds /dev/nvidia0", gpu_memory_bytes=None)


def finding(pid: int) -> dict[str, Any]:
    return records.consumer_record("finding", consumer(pid))


def resolved(pid: int) -> dict[str, Any]:
    return records.consumer_record("resolved", consumer(pid))


def notice(i: int) -> dict[str, Any]:
    return records.notice_record(NODE, "test", f"event {i}")


@pytest.fixture(params=["tcp", "unix"])
def collector(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FakeCollector]:
    address = "127.0.0.1:0" if request.param == "tcp" else f"unix://{tmp_path}/collector.sock"
    with FakeCollector(address) as c:
        yield c


@pytest.fixture
def tcp_collector() -> Iterator[FakeCollector]:
    with FakeCollector() as c:
        yield c


class Sinks:
    """Every sink a test makes is closed at its end, pass or fail."""

    def __init__(self) -> None:
        self.made: list[StreamSink] = []

    def __call__(self, target: str, options: StreamOptions = FAST, **kw: Any) -> StreamSink:
        sink = StreamSink(target, NODE, options=options, boot_id=kw.pop("boot_id", None), **kw)
        self.made.append(sink)
        return sink


class WatchedWake(threading.Event):
    """The sender thread's wake-up event (StreamSink._wake), logging each wait it starts and ends, so
    a test can tell when the sender has looked at its state again instead of sleeping and hoping."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []  # "enter" / "return"; list.append is atomic under the GIL

    def wait(self, timeout: float | None = None) -> bool:
        self.log.append("enter")
        try:
            return super().wait(timeout)
        finally:
            self.log.append("return")

    def mark(self) -> int:
        return len(self.log)

    def looked_again_since(self, mark: int) -> bool:
        """The sender returned from a wait after `mark` and has started its next one: it evaluated its
        state (the pump reads the clock after each wake) entirely after `mark`, and acted on it."""
        tail = self.log[mark:]
        return "return" in tail and "enter" in tail[tail.index("return"):]


def watched_sink(sinks: Sinks, monkeypatch: pytest.MonkeyPatch,
                 target: str) -> tuple[StreamSink, WatchedWake]:
    """A sink whose wake-up event is a WatchedWake (put in while it is made: its thread starts at once)."""
    with monkeypatch.context() as m:
        m.setattr(stream_module, "threading",
                  types.SimpleNamespace(Lock=threading.Lock, Thread=threading.Thread, Event=WatchedWake))
        sink = sinks(target)
    assert isinstance(sink._wake, WatchedWake)
    return sink, sink._wake


@pytest.fixture
def sinks() -> Iterator[Sinks]:
    s = Sinks()
    yield s
    for sink in s.made:
        sink.close()


def test_handshake_snapshot_and_events(collector: FakeCollector, sinks: Sinks) -> None:
    collector.gate.clear()
    sink = sinks(collector.target, StreamOptions(info_wait_s=5.0), relay=CriRelay(None, candidates=()),
                 capabilities=["podresources"])
    sink.emit(INFO)  # the sender waits for it: bpf and nvml go into Hello
    wait_until(lambda: collector.messages("hello"), "Hello")
    sink.emit(ReadyRecord(1.0, NODE, True, True, 0.1, 0))  # local only: no seq
    for rec in (finding(10), finding(11), resolved(10), notice(1)):
        sink.emit(rec)
    collector.gate.set()
    wait_until(lambda: collector.seqs() == [1, 2, 3, 4, 5], "events 1..5")
    hello = collector.messages("hello")[0].msg.hello
    assert (hello.api_version, hello.node, hello.tracer_version) == (1, NODE, __version__)
    assert re.fullmatch(r"[0-9a-f]{32}", hello.instance_id)
    assert hello.boot_id == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert list(hello.capabilities) == ["bpf", "nvml", "trace", "trace-confine", "cri-relay", "podresources"]
    assert collector.connections[0].metadata["ghostgpu-api-version"] == "1"
    snap = collector.messages("snapshot")[0].msg.snapshot
    assert snap.seq == 5
    assert [c.process.pid for c in snap.consumers] == [11], "finding 10 was resolved at seq 4"
    assert snap.info.driver_version == "550.54.15" and snap.info.gpus[0].uuid == "GPU-0"
    assert not snap.HasField("allocations")
    kinds = [ev.WhichOneof("body") for ev in collector.events()]
    assert kinds == ["info", "finding", "finding", "resolved", "notice"]
    order = [r.msg.WhichOneof("msg") for r in collector.received]
    assert order[:3] == ["hello", "snapshot", "events"]
    wait_until(lambda: sink.stats()["spooled"] == 0, "acks trimming the spool")
    assert sink.stats()["acked_seq"] == 5 and sink.stats()["connected"] is True


def test_welcome_acked_seq_drops_the_spool(tcp_collector: FakeCollector, sinks: Sinks) -> None:
    tcp_collector.gate.clear()
    tcp_collector.welcome_acked_seq = 6
    sink = sinks(tcp_collector.target)
    for i in range(10):
        sink.emit(notice(i))
    wait_until(lambda: tcp_collector.messages("hello"), "Hello")
    tcp_collector.gate.set()
    wait_until(lambda: sink.stats()["acked_seq"] == 10, "everything acknowledged")
    assert tcp_collector.seqs() == [7, 8, 9, 10]
    assert tcp_collector.messages("snapshot")[0].msg.snapshot.seq == 10


def test_batches_by_size(tcp_collector: FakeCollector, sinks: Sinks) -> None:
    tcp_collector.max_batch_events = 10
    sink = sinks(tcp_collector.target)
    wait_until(lambda: sink.stats()["connected"], "connected")
    for i in range(95):
        sink.emit(notice(i))
    wait_until(lambda: len(tcp_collector.seqs()) == 95, "95 events")
    sizes = [len(r.msg.events.events) for r in tcp_collector.messages("events")]
    assert tcp_collector.seqs() == list(range(1, 96))
    assert max(sizes) == 10 and sizes.count(10) >= 5, sizes


def test_an_idle_link_sends_a_lone_event_at_once(tcp_collector: FakeCollector, sinks: Sinks) -> None:
    sink = sinks(tcp_collector.target)
    wait_until(lambda: sink.stats()["connected"], "connected")
    latencies = []
    for round_ in range(5):
        wait_until(lambda: sink.stats()["spooled"] == 0, "everything acknowledged: the link is idle")
        start = time.monotonic()
        sink.emit(notice(round_))
        wait_until(lambda r=round_: len(tcp_collector.seqs()) == r + 1, "the event")
        latencies.append(tcp_collector.messages("events")[-1].at_s - start)
    assert [len(r.msg.events.events) for r in tcp_collector.messages("events")] == [1] * 5
    # Detection latency: nothing in flight, so no 10 ms wait for company (at least once, even when
    # this 2-core machine is loaded).
    assert min(latencies) < 0.009, latencies


def test_a_partial_batch_leaves_within_10_ms_while_acks_are_pending(tcp_collector: FakeCollector,
                                                                     sinks: Sinks) -> None:
    tcp_collector.ack_limit = 0  # nothing is acknowledged: a batch is always in flight
    sink = sinks(tcp_collector.target)
    wait_until(lambda: sink.stats()["connected"], "connected")
    sink.emit(notice(0))
    wait_until(lambda: len(tcp_collector.seqs()) == 1, "the first event, sent alone on an idle link")
    latencies = []
    rounds = WINDOW_BATCHES - 1  # the window holds this many more unacknowledged batches
    for round_ in range(rounds):
        start = time.monotonic()
        for i in range(3):
            sink.emit(notice(1 + round_ * 3 + i))
        wait_until(lambda r=round_: len(tcp_collector.seqs()) == 1 + 3 * (r + 1), "three more events")
        latencies.append(tcp_collector.messages("events")[-1].at_s - start)
    sizes = [len(r.msg.events.events) for r in tcp_collector.messages("events")]
    assert sizes == [1] + [3] * rounds, "three events emitted together travel as one batch"
    # The flush timer is 10 ms; allow for a loaded 2-core machine, but not for a lost timer.
    assert sorted(latencies)[2] < 0.1, latencies
    assert min(latencies) >= 0.009, "while acks are pending, a partial batch waits for company up to 10 ms"


def test_a_full_window_gathers_events_until_an_ack_frees_it(tcp_collector: FakeCollector, sinks: Sinks,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A collector that falls behind gets fewer, larger batches: they cost it less per event."""
    tcp_collector.ack_limit = 0
    sink, wake = watched_sink(sinks, monkeypatch, tcp_collector.target)
    wait_until(lambda: sink.stats()["connected"], "connected")
    for seq in range(1, WINDOW_BATCHES + 1):
        sink.emit(notice(seq))
        wait_until(lambda s=seq: len(tcp_collector.seqs()) == s, f"batch {seq}")
    assert sink.stats()["batches_sent"] == WINDOW_BATCHES  # the window is full
    for i in range(5):
        sink.emit(notice(WINDOW_BATCHES + 1 + i))
    # The 10 ms flush timer lapses by the sink's own clock; then the sender is woken and must look at
    # the held events again, past their flush time: with the window full, nothing may leave.
    wait_until(lambda: time.monotonic() >= sink._out.first_pending_s + FLUSH_S, "the flush timer to lapse")
    mark = wake.mark()
    wake.set()
    wait_until(lambda: wake.looked_again_since(mark), "the sender to look at the held events again")
    for i in range(5):
        sink.emit(notice(WINDOW_BATCHES + 6 + i))
    assert len(tcp_collector.seqs()) == WINDOW_BATCHES and sink.stats()["batches_sent"] == WINDOW_BATCHES
    tcp_collector.ack(WINDOW_BATCHES)
    wait_until(lambda: len(tcp_collector.seqs()) == WINDOW_BATCHES + 10, "the gathered events")
    sizes = [len(r.msg.events.events) for r in tcp_collector.messages("events")]
    assert sizes == [1] * WINDOW_BATCHES + [10], "the ten events waited for the ack and left as one batch"


def test_acks_trim_the_spool(tcp_collector: FakeCollector, sinks: Sinks) -> None:
    tcp_collector.ack_limit = 0
    sink = sinks(tcp_collector.target)
    for i in range(20):
        sink.emit(notice(i))
    wait_until(lambda: len(tcp_collector.seqs()) == 20, "20 events")
    assert sink.stats()["spooled"] == 20 and sink.stats()["acked_seq"] == 0
    tcp_collector.ack_limit = 12
    sink.emit(notice(20))
    wait_until(lambda: sink.stats()["acked_seq"] == 12, "ack 12")
    assert sink.stats()["spooled"] == 9
    tcp_collector.ack_limit = None
    sink.emit(notice(21))
    wait_until(lambda: sink.stats()["spooled"] == 0, "everything acknowledged")
    assert tcp_collector.seqs() == list(range(1, 23)), "nothing was sent twice on one stream"


def test_collector_restart_on_the_same_port_loses_nothing(sinks: Sinks) -> None:
    first = FakeCollector().start()
    first.ack_limit = 5
    sink = sinks(first.target)
    sink.emit(finding(1))
    sink.emit(finding(2))
    for i in range(6):
        sink.emit(notice(i))
    wait_until(lambda: first.seqs() == list(range(1, 9)), "events 1..8 on the first collector")
    wait_until(lambda: sink.stats()["acked_seq"] == 5, "ack 5")
    instance = first.messages("hello")[0].msg.hello.instance_id
    first.stop()
    wait_until(lambda: not sink.stats()["connected"], "the sink noticing")
    sink.emit(resolved(1))
    for i in range(3):
        sink.emit(notice(100 + i))
    second = FakeCollector(first.target)
    second.welcome_acked_seq = 5  # what the first one stored
    with second.start():
        wait_until(lambda: second.seqs() == list(range(6, 13)), "exactly the unacknowledged events 6..12")
        hello = second.messages("hello")[0].msg.hello
        assert hello.instance_id == instance
        snap = second.messages("snapshot")[0].msg.snapshot
        assert snap.seq == 12 and [c.process.pid for c in snap.consumers] == [2]
        assert snap.stats.reconnects_total == 1
        order = [r.msg.WhichOneof("msg") for r in second.received]
        assert order[:3] == ["hello", "snapshot", "events"]
        wait_until(lambda: sink.stats()["spooled"] == 0, "the spool drained")
        assert sink.stats()["reconnects"] == 1 and sink.stats()["dropped"] == 0


def test_spool_overflow_is_counted_and_reported(sinks: Sinks) -> None:
    away = FakeCollector().start()
    target = away.target
    away.stop()
    sink = sinks(target, StreamOptions(spool_events=50, backoff_min_s=0.01, backoff_max_s=0.1, info_wait_s=0,
                                       heartbeat_s=0.2))
    for i in range(80):
        sink.emit(notice(i))
    stats = sink.stats()
    assert (stats["spooled"], stats["dropped"], stats["connected"]) == (50, 30, False)
    back = FakeCollector(target)
    with back.start():
        wait_until(lambda: len(back.seqs()) == 51, "the 50 kept events and the overflow notice")
        assert back.seqs() == list(range(31, 82))
        snap = back.messages("snapshot")[0].msg.snapshot
        assert snap.stats.spool_dropped_total == 30
        last = back.events()[-1]
        assert last.notice.what == "stream.spool_overflow"
        assert last.notice.message == (f"spool overflow: 30 events lost while the collector at {target} "
                                       f"was away")
        wait_until(lambda: back.messages("heartbeat"), "a heartbeat")
        hb = back.messages("heartbeat")[-1].msg.heartbeat
        assert hb.last_seq == 81 and hb.stats.spool_dropped_total == 30 and hb.stats.spool_events == 0
        assert sink.stats()["dropped"] == 30


def test_version_refusal_is_one_line_and_retried_at_max_backoff(tcp_collector: FakeCollector, sinks: Sinks,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    tcp_collector.refuse = ("tracer on node node-a speaks ghostgpu API v1, this collector (ghostgpu 9.0.0) "
                            "speaks v2; run matching versions of ghostgpu")
    options = StreamOptions(backoff_min_s=0.01, backoff_max_s=0.3, info_wait_s=0)
    with caplog.at_level(logging.INFO, logger="ghostgpu.stream"):
        sink = sinks(tcp_collector.target, options)
        sink.emit(notice(0))
        wait_until(lambda: len(tcp_collector.messages("hello")) >= 4, "four attempts")
        assert not sink.stats()["connected"]
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1, errors
        assert f"refused this tracer (ghostgpu {__version__}, API v1)" in errors[0]
        assert "this collector (ghostgpu 9.0.0) speaks v2" in errors[0]
    hellos = [r.at_s for r in tcp_collector.messages("hello")]
    gaps = [b - a for a, b in itertools.pairwise(hellos)]
    assert min(gaps) >= 0.15 - 0.01, f"retried faster than the max backoff with jitter: {gaps}"
    tcp_collector.refuse = None
    wait_until(lambda: sink.stats()["connected"], "connected once the versions match")
    wait_until(lambda: tcp_collector.seqs() == [1], "the spooled event")


def test_commands_are_answered_on_the_stream(tcp_collector: FakeCollector, sinks: Sinks,
                                             tmp_path: Path) -> None:
    runtime = RawRuntime(str(tmp_path / "containerd.sock"))
    try:
        sink = sinks(tcp_collector.target, relay=CriRelay(runtime.path, node=NODE))
        wait_until(lambda: sink.stats()["connected"], "connected")
        tcp_collector.send_command(stream_pb2.Command(id=1, cri=stream_pb2.CriRequest(
            method="Version", request=cri.VersionRequest(version="v1").SerializeToString(), timeout_ms=2000)))
        refused = stream_pb2.CriRequest(method="RemoveContainer")
        tcp_collector.send_command(stream_pb2.Command(id=2, cri=refused))
        tcp_collector.send_command(stream_pb2.Command(id=3))
        wait_until(lambda: len(tcp_collector.messages("result")) == 3, "three results")
        results = {r.msg.result.id: r.msg.result.cri for r in tcp_collector.messages("result")}
        assert results[1].code == 0 and results[1].endpoint == runtime.path
        assert cri.VersionResponse.FromString(results[1].response).runtime_name == "fakecri"
        assert results[2].code == grpc.StatusCode.PERMISSION_DENIED.value[0]
        assert results[3].code == grpc.StatusCode.UNIMPLEMENTED.value[0]
        assert [name for name, _ in runtime.calls] == ["Version"], "the refused method never reached CRI"
    finally:
        runtime.stop()


def test_close_flushes_within_its_deadline(tcp_collector: FakeCollector, sinks: Sinks) -> None:
    sink = sinks(tcp_collector.target)
    wait_until(lambda: sink.stats()["connected"], "connected")
    for i in range(500):
        sink.emit(notice(i))
    start = time.monotonic()
    sink.close()
    assert time.monotonic() - start < 3.0
    assert tcp_collector.seqs() == list(range(1, 501))
    assert sink.stats()["spooled"] == 0


def test_close_without_a_collector_returns_at_its_deadline(sinks: Sinks) -> None:
    away = FakeCollector().start()
    target = away.target
    away.stop()
    sink = sinks(target, StreamOptions(info_wait_s=0, close_deadline_s=0.3))
    sink.emit(notice(0))
    start = time.monotonic()
    sink.close()
    assert time.monotonic() - start < 2.0
    assert sink.stats()["spooled"] == 1


def test_emit_never_waits_for_the_network(tcp_collector: FakeCollector, sinks: Sinks) -> None:
    tcp_collector.gate.clear()  # the collector takes the connection but never answers
    sink = sinks(tcp_collector.target)
    wait_until(lambda: tcp_collector.messages("hello"), "Hello")
    start = time.monotonic()
    for i in range(20_000):
        sink.emit(notice(i))
    assert time.monotonic() - start < 2.0
    assert sink.stats()["spooled"] == 20_000
    tcp_collector.gate.set()
    wait_until(lambda: sink.stats()["spooled"] == 0, "all 20000 acknowledged", timeout_s=20)
    assert tcp_collector.seqs() == list(range(1, 20_001))


def test_a_trace_batch_never_overtakes_the_events_emitted_before_it(collector: FakeCollector,
                                                                   sinks: Sinks) -> None:
    """Attribution first: a TraceBatch queued after events leaves after every one of them, even
    while the collector holds the connection back."""
    from ghostgpu.v1 import trace_pb2

    collector.gate.clear()
    sink = sinks(collector.target, StreamOptions(info_wait_s=5.0))
    sink.emit(INFO)
    for i in range(50):
        sink.emit(notice(i))
    batch = stream_pb2.TracerMessage(trace=trace_pb2.TraceBatch(session="t-1", records_total=1))
    assert sink.emit_trace(batch)
    sink.emit(notice(99))
    collector.gate.set()
    wait_until(lambda: collector.messages("trace"), "the trace batch")
    wait_until(lambda: collector.seqs()[-1:] == [52], "every event")
    order = [(r.msg.WhichOneof("msg"), r.msg.events.events[-1].seq if r.msg.HasField("events") else 0)
             for r in collector.received if r.msg.WhichOneof("msg") in ("events", "trace")]
    at = next(i for i, (kind, _) in enumerate(order) if kind == "trace")
    assert max(seq for kind, seq in order[:at]) >= 51, "all 51 events emitted before it went first"


def test_trace_batches_wait_in_a_bounded_queue_while_the_collector_is_away(sinks: Sinks) -> None:
    from ghostgpu.v1 import trace_pb2

    sink = sinks("127.0.0.1:1", StreamOptions(info_wait_s=0.0))  # nothing listens there
    batch = stream_pb2.TracerMessage(trace=trace_pb2.TraceBatch(session="t-1"))
    queued = [sink.emit_trace(batch) for _ in range(stream_module.TRACE_QUEUE_MAX + 3)]
    assert queued == [True] * stream_module.TRACE_QUEUE_MAX + [False] * 3  # the caller counts the loss


def test_the_snapshot_carries_the_agents_counters(collector: FakeCollector, sinks: Sinks) -> None:
    """TracerStats has the agent's own counters (RM objects the memory accountant could not keep,
    kernel log lines that did not parse) beside the stream's; a counter read that fails is 0, never a
    broken stream."""
    sink = sinks(collector.target, StreamOptions(info_wait_s=0.0))
    sink.counters = lambda: {"memory_objects_dropped_total": 7, "kmsg_unparsed_total": 2,
                             "faults_dropped_total": 3, "kmsg_records_lost_total": 4, "not_a_field": 1}
    sink.emit(INFO)
    wait_until(lambda: collector.messages("snapshot"), "a snapshot")
    stats = collector.messages("snapshot")[0].msg.snapshot.stats
    assert (stats.memory_objects_dropped_total, stats.kmsg_unparsed_total, stats.faults_dropped_total,
            stats.kmsg_records_lost_total) == (7, 2, 3, 4)

    def broken() -> dict[str, int]:
        raise RuntimeError("the agent is gone")

    sink.counters = broken
    assert sink._tracer_stats().memory_objects_dropped_total == 0
