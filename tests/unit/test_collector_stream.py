"""The tracer <-> collector stream, collector side: handshake, version skew, acks, duplicates and
gaps, bad messages, stream replacement, disconnects, many tracers. Real gRPC, real sockets."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from ghostgpu.collector.main import Collector

from ghostgpu.common.wire.protocol import MAX_BATCH_EVENTS, MAX_MESSAGE_BYTES
from ghostgpu.v1 import stream_pb2
from tests.helpers.collector_env import QueryClient, running_collector
from tests.helpers.polling import wait_until
from tests.helpers.sim_tracer import (
    SimTracer,
    StreamEnded,
    batch_bytes,
    finding,
    holder,
    make_consumer,
    message_bytes,
)


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[Collector]:
    with running_collector(tmp_path, unix=True) as c:
        yield c


def test_welcome_then_acks_after_commit_over_tcp_and_unix(collector: Collector) -> None:
    assert collector.addresses[0].startswith("127.0.0.1:") and collector.port
    for target, node in ((collector.address, "tcp-node"), (collector.addresses[1], "unix-node")):
        with SimTracer(target, node) as t:
            welcome = t.connect()
            assert welcome.api_version == 1 and welcome.acked_seq == 0
            assert welcome.max_batch_events == MAX_BATCH_EVENTS
            assert welcome.collector_version
            t.send_events([holder(1, 100), holder(2, 100), holder(3, 101)])
            t.wait_acked(3)
            assert t.close() == (grpc.StatusCode.OK, "")
    with QueryClient(collector.address) as q:
        assert {s.node: s.events_ingested_total for s in q.status()} == {"tcp-node": 3, "unix-node": 3}


def test_tracer_of_another_api_version_gets_failed_precondition(collector: Collector) -> None:
    with SimTracer(collector.address, "skewed", api_version=99) as t, pytest.raises(StreamEnded) as err:
        t.connect()
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "tracer on node skewed speaks ghostgpu API v99" in err.value.details
    assert "speaks v1" in err.value.details
    with SimTracer(collector.address, "current") as t:  # the collector is unharmed
        assert t.connect().api_version == 1


def test_client_of_another_api_version_gets_failed_precondition(collector: Collector) -> None:
    with QueryClient(collector.address, api_version=2) as q:
        for call in (q.consumers, q.status, q.findings, q.events):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            details = err.value.details()
            assert "client speaks ghostgpu API v2" in details and "speaks v1" in details
        with pytest.raises(grpc.RpcError) as err:
            next(iter(q.watch()))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with QueryClient(collector.address, api_version=None) as q:  # no metadata: v1
        assert q.consumers() == []


@pytest.mark.parametrize(("first", "code", "text"), [
    (message_bytes(heartbeat=stream_pb2.Heartbeat(last_seq=1)), grpc.StatusCode.FAILED_PRECONDITION,
     "stream must start with Hello"),
    (message_bytes(hello=stream_pb2.Hello(api_version=1, node="")), grpc.StatusCode.INVALID_ARGUMENT,
     "Hello.node is empty"),
    (b"\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT, "malformed TracerMessage"),
])
def test_stream_must_open_with_a_valid_hello(collector: Collector, first: bytes, code: grpc.StatusCode,
                                             text: str) -> None:
    with SimTracer(collector.address, "n1") as t, pytest.raises(StreamEnded) as err:
        t.connect(hello=first)
    assert err.value.code == code and text in err.value.details


def _bad_batches() -> list[tuple[str, bytes, grpc.StatusCode, str]]:
    huge = stream_pb2.Notice(what="x", message="y" * MAX_MESSAGE_BYTES)
    big_notice = stream_pb2.NodeEvent(seq=4, notice=huge)
    return [
        ("out of order", batch_bytes([holder(5, 1), holder(4, 1)]), grpc.StatusCode.INVALID_ARGUMENT,
         "event 1 has seq 4 after 5"),
        ("repeated seq", batch_bytes([holder(4, 1), holder(4, 1)]), grpc.StatusCode.INVALID_ARGUMENT,
         "strictly increase"),
        ("seq 0", batch_bytes([holder(0, 1)]), grpc.StatusCode.INVALID_ARGUMENT, "seq 0"),
        ("empty", batch_bytes([]), grpc.StatusCode.INVALID_ARGUMENT, "no events"),
        ("no body", batch_bytes([holder(4, 1), stream_pb2.NodeEvent(seq=5)]),
         grpc.StatusCode.INVALID_ARGUMENT, "(seq 5) has no body"),
        ("too many", batch_bytes([holder(s, 1) for s in range(4, 5 + MAX_BATCH_EVENTS)]),
         grpc.StatusCode.INVALID_ARGUMENT, f"more than max_batch_events {MAX_BATCH_EVENTS}"),
        ("malformed", b"\x12\x05\x0a\x03\x08", grpc.StatusCode.INVALID_ARGUMENT, "malformed TracerMessage"),
        ("oversized", batch_bytes([big_notice]), grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
        ("second hello", message_bytes(hello=stream_pb2.Hello(api_version=1, node="n1")),
         grpc.StatusCode.FAILED_PRECONDITION, "Hello sent twice"),
    ]


@pytest.mark.parametrize(("name", "bad", "code", "text"), _bad_batches(), ids=[b[0] for b in _bad_batches()])
def test_bad_message_ends_the_stream_and_changes_nothing(collector: Collector, name: str, bad: bytes,
                                                         code: grpc.StatusCode, text: str) -> None:
    c = make_consumer("n1", 100, container_id="ab" * 32)
    with SimTracer(collector.address, "n1", max_send_bytes=4 * MAX_MESSAGE_BYTES) as t, \
            QueryClient(collector.address) as q:
        t.connect()
        t.send_events([finding(1, c), holder(2, 100), holder(3, 100)])
        t.wait_acked(3)
        # CRI resolution of the consumer goes on meanwhile: compare the node's consumers, not k8s names.
        before = (q.node("n1"), [r.consumer for r in q.consumers()], q.events(node="n1"))
        t.send(bad)
        got_code, details = t.wait_ended()
        assert got_code == code and text in details
        wait_until(lambda: not q.node("n1").connected, "node n1 to show disconnected")
        after = (q.node("n1"), [r.consumer for r in q.consumers()], q.events(node="n1"))
        assert after[0].events_ingested_total == before[0].events_ingested_total == 3
        assert after[0].last_seq == 3 and after[1] == before[1] and after[2] == before[2]


def test_duplicates_are_counted_once_and_gaps_as_lost(collector: Collector) -> None:
    with SimTracer(collector.address, "n1") as t, QueryClient(collector.address) as q:
        t.connect()
        t.send_events([holder(s, 100) for s in range(1, 11)])
        t.send_events([holder(s, 100) for s in range(5, 16)])  # 5..10 again, 11..15 new
        t.wait_acked(15)
        t.send_events([holder(s, 100) for s in (20, 21, 23)])  # 16..19 and 22 never came
        t.wait_acked(23)
        st = q.node("n1")
        counts = (st.events_ingested_total, st.duplicates_total, st.events_lost_total, st.last_seq)
        assert counts == (18, 6, 5, 23)
        seqs = [e.event.seq for e in q.events(node="n1", instance_id=t.instance_id)]
        assert seqs == [*range(1, 16), 20, 21, 23]


def test_a_new_hello_replaces_the_nodes_older_stream(collector: Collector) -> None:
    with SimTracer(collector.address, "n1") as old, QueryClient(collector.address) as q:
        old.connect()
        old.send_events([holder(1, 100), holder(2, 100)])
        old.wait_acked(2)
        with SimTracer(collector.address, "n1", instance_id=old.instance_id) as new:
            assert new.connect().acked_seq == 2  # what the old stream stored counts
            code, details = old.wait_ended()
            assert code == grpc.StatusCode.ABORTED and "replaced by a newer stream from node n1" in details
            new.send_events([holder(2, 100), holder(3, 100)])
            new.wait_acked(3)
            st = q.node("n1")
            assert st.connected and (st.events_ingested_total, st.duplicates_total) == (3, 1)


def test_a_tracer_that_drops_its_stream_shows_disconnected(collector: Collector) -> None:
    with SimTracer(collector.address, "n1", capabilities=("bpf", "cri-relay")) as t, \
            QueryClient(collector.address) as q:
        t.connect()
        st = q.node("n1")
        assert st.connected and st.instance_id == t.instance_id
        assert list(st.capabilities) == ["bpf", "cri-relay"]
        t.cancel()
        wait_until(lambda: not q.node("n1").connected, "node n1 to show disconnected")
    with pytest.raises(grpc.RpcError) as err, QueryClient(collector.address) as q:
        q.status("never-seen")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_several_tracers_at_once_keep_their_own_nodes(collector: Collector) -> None:
    nodes = [f"gpu-node-{i}" for i in range(6)]
    errors: list[BaseException] = []

    def run(node: str) -> None:
        try:
            t = SimTracer(collector.address, node)
            t.connect()
            t.send_snapshot([make_consumer(node, 100 + j, gpu=j, container_id=f"{j:02x}" * 32)
                             for j in range(3)])
            for start in range(1, 400, 100):
                t.send_events([holder(s, 100, "00" * 32) for s in range(start, start + 100)])
            t.wait_acked(400)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(n,)) for n in nodes]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors
    with QueryClient(collector.address) as q:
        status = {s.node: s for s in q.status()}
        assert sorted(status) == nodes
        assert all(s.connected and s.events_ingested_total == 400 for s in status.values())
        assert all(s.consumers == 3 for s in status.values())
        rows = q.consumers()
        assert sorted({r.consumer.node for r in rows}) == nodes and len(rows) == 18
        assert [r.consumer.process.pid for r in q.consumers(node="gpu-node-3")] == [100, 101, 102]


def test_a_tracer_gone_before_its_welcome_leaves_no_session(collector: Collector) -> None:
    """The Welcome write fails (the tracer hung up right after its Hello): the session is closed at
    once, not left registered, its node connected, until that node's next Hello."""
    import asyncio

    hello = stream_pb2.TracerMessage(hello=stream_pb2.Hello(
        api_version=1, node="gone-early", boot_id="b1", instance_id="i1")).SerializeToString()

    async def requests():  # type: ignore[no-untyped-def]
        yield hello

    class HungUp:
        async def write(self, _message: object) -> None:
            raise ConnectionResetError("the tracer hung up")

        async def abort(self, code: grpc.StatusCode, details: str) -> None:
            raise AssertionError(f"abort({code}, {details})")

    async def as_local_tracer() -> None:  # as collector/authz.py admits the host's own tracer (root)
        from ghostgpu.collector.authz import _CURRENT

        from ghostgpu.common.transport.principal import Principal

        _CURRENT.set(Principal("uid", str(os.getuid()), via="loopback"))
        await collector.ingest.connect(requests(), HungUp())

    assert collector.loop is not None
    done = asyncio.run_coroutine_threadsafe(as_local_tracer(), collector.loop)
    with pytest.raises(ConnectionResetError):
        done.result(timeout=10)
    assert collector.call(lambda: "gone-early" in collector.ingest.sessions) is False
    assert collector.call(lambda: collector.nodes["gone-early"].connected) is False
