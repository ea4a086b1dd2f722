"""collector/node_state.py on SQLite (the table and the fence are the same on both engines): each
owned node's rows and status written only when changed and fenced by its lease, the readers' filters,
order and `connected` rule, the last status of a node whose stream ended, pruning, and QueryService
answering from the store for the nodes it does not own. The same across two replicas on PostgreSQL:
tests/integration/test_node_state_pg.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from ghostgpu.collector.cluster import ClusterTable
from ghostgpu.collector.leases import Leases
from ghostgpu.collector.node_state import (
    NodeStateRow,
    NodeStateWriter,
    merged_consumers,
    merged_statuses,
    select_node_states,
    stored_status,
)
from ghostgpu.collector.nodes import NodeView
from ghostgpu.collector.query import QueryService
from ghostgpu.collector.store import Position, Store

from ghostgpu.common.model.consumers import ConsumerClass, K8sInfo
from ghostgpu.common.wire.convert import cluster_consumer_to_proto, consumer_to_proto
from ghostgpu.v1 import node_pb2, query_pb2, stream_pb2
from tests.helpers.sim_tracer import make_consumer

CID_A, CID_B = "aa" * 32, "bb" * 32
NAMES = {CID_A: K8sInfo("resolved", "team-a", "train-0", "uid-a", "trainer", "img:1"),
         CID_B: K8sInfo("resolved", "team-b", "infer-0", "uid-b", "server", "img:2")}


def resolve(node: str, container_id: str) -> K8sInfo:
    return NAMES.get(container_id, K8sInfo("unresolved", error="CRI lookup pending"))


class Replica:
    """What one collector replica holds: its nodes, cluster table, leases and node_state writer."""

    def __init__(self, store: Store, owner: str, ttl_s: float = 30.0) -> None:
        self.store = store
        self.nodes: dict[str, NodeView] = {}
        self.cluster = ClusterTable(self.nodes, resolve, None)
        self.leases = Leases(store, owner, ttl_s)
        self.writer = NodeStateWriter(store, self.leases, self.nodes, self.cluster)
        self.query = QueryService(self.nodes, self.cluster, store)
        self.query.owned_nodes = self.writer.owned

    def connect(self, node: str, consumers: list[Any]) -> NodeView:
        """A stream of `node` opened here: its lease taken, its snapshot applied."""
        self.leases.adopt(self.leases.take(node).result(10))
        view = self.nodes.setdefault(node, NodeView(node))
        view.begin(stream_pb2.Hello(node=node, boot_id="b", instance_id="i", tracer_version="t-1"),
                   Position(node, "b", "i"))
        self.snapshot(node, consumers)
        return view

    def snapshot(self, node: str, consumers: list[Any], seq: int = 1) -> None:
        view = self.nodes[node]
        snap = stream_pb2.Snapshot(seq=seq, consumers=[consumer_to_proto(c) for c in consumers])
        self.cluster.update(view, view.apply_snapshot(snap))

    def disconnect(self, node: str) -> None:
        """What ingest does when the stream ends: the view says so, the lease is no longer held."""
        self.nodes[node].end()
        self.leases.drop(node)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(str(tmp_path / "c.db"), 10_000, 7.0)
    yield s
    s.close()


def stored(store: Store, node: str = "") -> list[NodeStateRow]:
    return store.read(select_node_states(node)).result(10)


def stored_consumers(store: Store, node: str) -> list[query_pb2.ClusterConsumer]:
    (row,) = stored(store, node)
    return list(query_pb2.ListConsumersResponse.FromString(row.consumers).consumers)


class Context:
    """What a handler gets as grpc.aio's ServicerContext, as far as these handlers use it."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AssertionError(f"aborted: {code.name}: {details}")


def ask(replica: Replica, method: str, request: Any) -> Any:
    return asyncio.run(getattr(replica.query, method)(request, Context()))


# ---- writing -------------------------------------------------------------------------------------------


def test_an_owned_node_is_written_as_list_consumers_sends_it(store: Store) -> None:
    a = Replica(store, "a")
    a.connect("n1", [make_consumer("n1", 7, container_id=CID_A), make_consumer("n1", 3, gpu=1)])
    assert a.writer.tick(now_mono=100.0) == 1
    (row,) = stored(store)
    assert (row.node, row.owner, row.token, row.lease_token) == ("n1", "a", 1, 1)
    want = [cluster_consumer_to_proto(c) for c in a.cluster.consumers("n1")]
    assert stored_consumers(store, "n1") == want
    assert [c.consumer.process.pid for c in want] == [7, 3]  # GPU 0 before GPU 1: ListConsumers' order
    assert want[0].k8s.pod == "train-0"  # enriched: CRI's names
    status = query_pb2.TracerStatus.FromString(row.status)
    assert status == a.nodes["n1"].status() and status.connected and status.consumers == 2


def test_only_what_changed_is_written_and_at_most_every_row_write_s(store: Store) -> None:
    a = Replica(store, "a")
    view = a.connect("n1", [make_consumer("n1", 7, container_id=CID_A)])
    assert a.writer.tick(now_mono=100.0) == 1
    assert a.writer.tick(now_mono=101.0) == 0  # nothing changed
    a.snapshot("n1", [make_consumer("n1", 7, container_id=CID_A), make_consumer("n1", 8)], seq=2)
    assert a.writer.tick(now_mono=100.2) == 0  # changed, but written 0.2 s ago
    assert a.writer.tick(now_mono=100.6) == 1
    assert [c.consumer.process.pid for c in stored_consumers(store, "n1")] == [7, 8]
    # Counters alone (a batch, a heartbeat): a status-only update, at most every STATUS_REFRESH_S.
    before = stored(store, "n1")[0]
    view.last_heartbeat_unix_ns += 1
    assert a.writer.tick(now_mono=101.0) == 0
    assert a.writer.tick(now_mono=106.0) == 1
    after = stored(store, "n1")[0]
    assert after.consumers == before.consumers and after.status != before.status
    heard_ns = query_pb2.TracerStatus.FromString(after.status).last_heartbeat_unix_ns
    assert heard_ns == view.last_heartbeat_unix_ns


def test_a_node_another_replica_took_is_not_overwritten(store: Store) -> None:
    a, b = Replica(store, "a"), Replica(store, "b")
    a.connect("n1", [make_consumer("n1", 7)])
    a.writer.tick(now_mono=100.0)
    b.connect("n1", [make_consumer("n1", 9)])  # the tracer moved: b's token is 2
    b.writer.tick(now_mono=100.0)
    a.snapshot("n1", [make_consumer("n1", 5)], seq=2)  # a still thinks it holds token 1
    assert a.writer.tick(now_mono=101.0) == 1  # submitted; the store's fence refuses it
    (row,) = stored(store)
    assert (row.owner, row.token) == ("b", 2)
    assert [c.consumer.process.pid for c in stored_consumers(store, "n1")] == [9]


def test_a_stream_that_ended_leaves_its_last_status_not_connected(store: Store) -> None:
    a = Replica(store, "a")
    a.connect("n1", [make_consumer("n1", 7)])
    a.writer.tick(now_mono=100.0)
    a.disconnect("n1")
    assert a.writer.tick(now_mono=100.1) == 1  # at once: the row would say connected until the ttl
    assert a.writer.tick(now_mono=101.0) == 0  # once
    (row,) = stored(store)
    assert not query_pb2.TracerStatus.FromString(row.status).connected
    assert [c.consumer.process.pid for c in stored_consumers(store, "n1")] == [7]  # its last rows, as ps had


def test_rows_gone_past_the_retention_with_no_live_lease_are_pruned(store: Store) -> None:
    a = Replica(store, "a")
    for node in ("old", "held"):
        a.connect(node, [])
    a.writer.tick(now_mono=100.0)
    eight_days_ns = 8 * 86400 * 10**9

    def age(conn: Any) -> None:
        conn.execute("UPDATE node_state SET updated_unix_ns = updated_unix_ns - ?", (eight_days_ns,))
        conn.execute("UPDATE node_leases SET expires_unix_ns = 0 WHERE node = 'old'")

    store.read_write(age).result(10)
    a.writer.tick(now_mono=100.0 + a.writer.prune_s)
    assert [r.node for r in stored(store)] == ["held"]


# ---- reading -------------------------------------------------------------------------------------------


def row(status: query_pb2.TracerStatus, token: int, lease: int | None, expires_ns: int) -> NodeStateRow:
    return NodeStateRow(status.node, "a", token, 1, b"", status.SerializeToString(), lease, expires_ns)


def test_a_stored_status_is_connected_only_while_its_lease_is_live() -> None:
    now = time.time_ns()
    up = query_pb2.TracerStatus(node="n1", connected=True)
    down = query_pb2.TracerStatus(node="n1", connected=False)
    assert stored_status(row(up, 3, 3, now + 10**9), now).connected
    assert not stored_status(row(up, 3, 3, now - 1), now).connected  # its replica died: the lease ran out
    assert not stored_status(row(up, 3, None, 0), now).connected
    assert not stored_status(row(down, 3, 3, now + 10**9), now).connected  # its stream ended
    assert stored_status(row(down, 3, 4, now + 10**9), now).connected  # taken by a replica not yet written


def test_merged_statuses_take_owned_nodes_from_memory_and_the_rest_from_the_store() -> None:
    now = time.time_ns()
    mine = query_pb2.TracerStatus(node="n2", connected=True, last_seq=99)
    old_mine = query_pb2.TracerStatus(node="n2", connected=True, last_seq=5)
    gone_here = query_pb2.TracerStatus(node="n3", connected=False, last_seq=1)  # ended here; moved since
    elsewhere = query_pb2.TracerStatus(node="n3", connected=True, last_seq=40)
    only_memory = query_pb2.TracerStatus(node="n4")
    rows = [row(old_mine, 1, 1, now + 10**9), row(elsewhere, 2, 2, now + 10**9)]
    out = merged_statuses(rows, [mine, gone_here, only_memory], {"n2"}, now)
    assert [(s.node, s.last_seq, s.connected) for s in out] == [("n2", 99, True), ("n3", 40, True),
                                                                ("n4", 0, False)]


def test_merged_consumers_filter_as_list_consumers_does_in_its_order() -> None:
    def cc(node: str, pid: int, gpu: int, ns: str, pod: str, cls: ConsumerClass) -> query_pb2.ClusterConsumer:
        m = query_pb2.ClusterConsumer(consumer=consumer_to_proto(make_consumer(node, pid, gpu=gpu, cls=cls)))
        m.k8s.namespace, m.k8s.pod = ns, pod
        return m

    n1 = [cc("n1", 5, 0, "team-a", "p1", ConsumerClass.HIDDEN),
          cc("n1", 2, 1, "team-b", "p2", ConsumerClass.VISIBLE)]
    n3 = [cc("n3", 1, 0, "team-a", "p3", ConsumerClass.VISIBLE)]
    rows = [NodeStateRow(n, "b", 1, 1, query_pb2.ListConsumersResponse(consumers=c).SerializeToString(), b"",
                         1, 0) for n, c in (("n1", n1), ("n3", n3))]
    mine = [cc("n2", 9, 0, "team-a", "p9", ConsumerClass.HIDDEN)]
    assert [c.consumer.node for c in merged_consumers(mine, rows)] == ["n1", "n1", "n2", "n3"]
    assert [c.k8s.pod for c in merged_consumers([], rows, namespace="team-a")] == ["p1", "p3"]
    assert [c.k8s.pod for c in merged_consumers([], rows, pod="p2")] == ["p2"]
    visible = merged_consumers([], rows, classes=[str(ConsumerClass.VISIBLE)])
    assert [getattr(c.consumer, "class") for c in visible] == [node_pb2.CONSUMER_CLASS_VISIBLE] * 2


# ---- QueryService --------------------------------------------------------------------------------------


def test_each_replica_answers_ps_and_node_status_for_every_node(store: Store) -> None:
    a, b = Replica(store, "a"), Replica(store, "b")
    a.connect("n1", [make_consumer("n1", 7, container_id=CID_A)])
    b.connect("n2", [make_consumer("n2", 8, container_id=CID_B)])
    a.writer.tick(now_mono=100.0)
    b.writer.tick(now_mono=100.0)
    for replica in (a, b):
        answer = ask(replica, "ListConsumers", query_pb2.ListConsumersRequest())
        pods = [(c.consumer.node, c.k8s.pod) for c in answer.consumers]
        assert pods == [("n1", "train-0"), ("n2", "infer-0")]
        only = ask(replica, "ListConsumers", query_pb2.ListConsumersRequest(namespace="team-b"))
        assert [c.consumer.node for c in only.consumers] == ["n2"]
        nodes = ask(replica, "NodeStatus", query_pb2.NodeStatusRequest()).nodes
        assert [(s.node, s.connected, s.consumers) for s in nodes] == [("n1", True, 1), ("n2", True, 1)]
    # Its own nodes from memory: a change not yet written shows on the owner at once.
    a.snapshot("n1", [make_consumer("n1", 7, container_id=CID_A), make_consumer("n1", 6)], seq=2)
    mine = ask(a, "ListConsumers", query_pb2.ListConsumersRequest(node="n1")).consumers
    assert [c.consumer.process.pid for c in mine] == [6, 7]
    assert [c.consumer.process.pid for c in ask(b, "ListConsumers", query_pb2.ListConsumersRequest(
        node="n1")).consumers] == [7]
    b.disconnect("n2")
    b.writer.tick(now_mono=101.0)
    (st,) = ask(a, "NodeStatus", query_pb2.NodeStatusRequest(node="n2")).nodes
    assert not st.connected and st.tracer_version == "t-1"


def test_without_owned_nodes_the_answer_is_memory_alone(store: Store) -> None:
    a, b = Replica(store, "a"), Replica(store, "b")
    b.connect("n2", [make_consumer("n2", 8)])
    b.writer.tick(now_mono=100.0)
    a.query.owned_nodes = None  # one collector (SQLite): today's path, the store is not read
    assert list(ask(a, "ListConsumers", query_pb2.ListConsumersRequest()).consumers) == []
    assert list(ask(a, "NodeStatus", query_pb2.NodeStatusRequest()).nodes) == []


def test_a_node_that_left_before_its_first_write_is_answered_from_memory(store: Store) -> None:
    a = Replica(store, "a")
    a.connect("n3", [make_consumer("n3", 4)])
    a.disconnect("n3")  # no tick ran: the store has no row of n3
    answer = ask(a, "ListConsumers", query_pb2.ListConsumersRequest())
    assert [c.consumer.node for c in answer.consumers] == ["n3"]
    (st,) = ask(a, "NodeStatus", query_pb2.NodeStatusRequest(node="n3")).nodes
    assert not st.connected
