"""Bad input the other collector tests leave out: data before Hello, a snapshot older than what was
already received, a message kind from a newer tracer, malformed and oversized query requests, a
client version that is not a number, and event pages that would outgrow what a client can receive.
Real gRPC on loopback; each bad message gets a gRPC status and changes nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from ghostgpu.collector.main import Collector
from ghostgpu.collector.query import EVENTS_RESPONSE_BYTES

from ghostgpu.common.wire.protocol import API_VERSION_METADATA, MAX_MESSAGE_BYTES, channel_options
from ghostgpu.v1 import node_pb2, query_pb2, stream_pb2
from tests.helpers.collector_env import QueryClient, running_collector
from tests.helpers.sim_tracer import (
    SimTracer,
    StreamEnded,
    batch_bytes,
    finding,
    holder,
    make_consumer,
    message_bytes,
)

LIST_CONSUMERS = "/ghostgpu.v1.Query/ListConsumers"


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[Collector]:
    with running_collector(tmp_path) as c:
        yield c


@pytest.fixture
def q(collector: Collector) -> Iterator[QueryClient]:
    with QueryClient(collector.address) as client:
        yield client


@pytest.mark.parametrize("first", [
    batch_bytes([holder(1, 100)]),
    message_bytes(snapshot=stream_pb2.Snapshot(seq=1)),
    message_bytes(result=stream_pb2.CommandResult(id=1)),
], ids=["events", "snapshot", "command result"])
def test_data_before_hello_is_refused_and_stores_nothing(collector: Collector, q: QueryClient,
                                                         first: bytes) -> None:
    with SimTracer(collector.address, "n1") as t, pytest.raises(StreamEnded) as err:
        t.connect(hello=first)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "stream must start with Hello" in err.value.details
    assert q.status() == [] and q.consumers() == [] and q.events() == []


def test_a_snapshot_behind_the_events_already_received_is_refused(collector: Collector,
                                                                   q: QueryClient) -> None:
    a, b = make_consumer("n1", 1), make_consumer("n1", 2)
    with SimTracer(collector.address, "n1") as t:
        t.connect()
        t.send_events([finding(1, a), finding(2, b), holder(3, 2)])
        t.wait_acked(3)
        before = ([r.consumer for r in q.consumers()], q.events(node="n1"),
                  q.node("n1").events_ingested_total)
        t.send_snapshot([], seq=2)  # out of order: it reflects less than the stream already delivered
        code, details = t.wait_ended()
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "Snapshot seq 2 is behind seq 3" in details
        after = ([r.consumer for r in q.consumers()], q.events(node="n1"),
                 q.node("n1").events_ingested_total)
        assert after == before and [r.consumer.process.pid for r in q.consumers()] == [1, 2]
    with SimTracer(collector.address, "n1", instance_id=t.instance_id) as again:
        assert again.connect().acked_seq == 3
        again.send_snapshot([b], seq=3)  # current again: accepted, and it replaces the table
        again.send_events([holder(4, 2)])
        again.wait_acked(4)
        assert [r.consumer.process.pid for r in q.consumers()] == [2]


def test_a_message_kind_from_a_newer_tracer_is_skipped_not_fatal(collector: Collector,
                                                                  q: QueryClient) -> None:
    # TracerMessage field 15 (length-delimited): a oneof member this collector does not know yet.
    future = bytes([15 << 3 | 2, 3]) + b"new"
    with SimTracer(collector.address, "n1") as t:
        t.connect()
        t.send(future)
        t.send_events([holder(1, 100)])
        t.wait_acked(1)
        assert t.status is None
        st = q.node("n1")
        assert st.connected and (st.events_ingested_total, st.last_seq) == (1, 1)


def test_malformed_and_oversized_query_requests_get_status_errors(collector: Collector,
                                                                  q: QueryClient) -> None:
    options = [o for o in channel_options() if o[0] != "grpc.max_send_message_length"]
    options.append(("grpc.max_send_message_length", 4 * MAX_MESSAGE_BYTES))
    with grpc.insecure_channel(collector.address, options=options) as channel:
        raw = channel.unary_unary(LIST_CONSUMERS, request_serializer=None,
                                  response_deserializer=query_pb2.ListConsumersResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            raw(b"\x0a\x05ab", timeout=10)  # field 1 claims 5 bytes, 2 follow
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed ListConsumers request (4 bytes)" in err.value.details()
        huge = query_pb2.ListConsumersRequest(node="x" * (MAX_MESSAGE_BYTES + 1)).SerializeToString()
        with pytest.raises(grpc.RpcError) as err:
            raw(huge, timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with SimTracer(collector.address, "n1") as t:  # the collector serves on, unharmed
        t.connect()
        t.send_events([finding(1, make_consumer("n1", 7))])
        t.wait_acked(1)
    assert [r.consumer.process.pid for r in q.consumers()] == [7]


def test_a_client_version_that_is_not_a_number_is_failed_precondition(collector: Collector) -> None:
    with grpc.insecure_channel(collector.address) as channel:
        call = channel.unary_unary(LIST_CONSUMERS,
                                   request_serializer=query_pb2.ListConsumersRequest.SerializeToString,
                                   response_deserializer=query_pb2.ListConsumersResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            call(query_pb2.ListConsumersRequest(), metadata=[(API_VERSION_METADATA, "one")], timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"{API_VERSION_METADATA} 'one', not a number" in err.value.details()


def _long_holder(seq: int) -> stream_pb2.NodeEvent:
    ev = holder(seq, 100)
    ev.holder.process.cmdline = "python3 train.py " + "--flag=value " * 1500  # ~20 KB, like a long argv
    return ev


def test_event_pages_stay_within_what_a_client_receives(collector: Collector, q: QueryClient) -> None:
    n = 1000  # the default page: 1,000 events of 20 KB would be a 20 MB answer
    with SimTracer(collector.address, "n1") as t:
        t.connect()
        for first in range(1, n + 1, 200):
            t.send_events([_long_holder(s) for s in range(first, first + 200)])
        t.wait_acked(n)
        seqs: list[int] = []
        while page := q.events(node="n1", instance_id=t.instance_id, after_seq=seqs[-1] if seqs else 0):
            assert sum(e.ByteSize() for e in page) <= EVENTS_RESPONSE_BYTES
            seqs.extend(e.event.seq for e in page)
        assert seqs == list(range(1, n + 1))
        newest = q.events(node="n1")  # no instance: the newest events that fit
        assert newest and newest[-1].event.seq == n
        assert [e.event.seq for e in newest] == list(range(n - len(newest) + 1, n + 1))
        assert all(e.event.holder.kind == node_pb2.HolderEvent.KIND_OPEN for e in newest)
