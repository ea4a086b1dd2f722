"""GPU faults at the collector: stored once with the batch that carried them (a resend is a duplicate,
a restart keeps them), each hit named through CRI (late names rewrite the row; a container gone says
so), bounded with the drops counted, listed by ListFaults with its filters, the viewer role, and offered
to the Alertmanager push again by a restarted collector while their alerts last."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.collector.cluster import Watcher
from ghostgpu.collector.faults import FaultBook, fault_row, select_faults
from ghostgpu.collector.policy import Policy
from ghostgpu.collector.store import Store

from ghostgpu.common.transport.principal import Principal
from ghostgpu.v1 import query_pb2
from tests.helpers.collector_env import QueryClient, running_collector
from tests.helpers.fault_events import EVAL, GONE, PENDING, TRAIN, Names, fault_event, fault_record, hit, k8s
from tests.helpers.polling import wait_until
from tests.helpers.sim_tracer import SimTracer


def _list(q: QueryClient, **filters: Any) -> list[query_pb2.ClusterFault]:
    req = query_pb2.ListFaultsRequest(**filters)
    return list(q.stub.ListFaults(req, metadata=q.metadata, timeout=10).faults)


# ---- through a real collector --------------------------------------------------------------------------


def test_a_fault_is_stored_once_with_its_pods_and_kept_across_a_restart(tmp_path: Path) -> None:
    xid = fault_record(affected=(hit(4242, TRAIN, named=True), hit(99, GONE, exited=True), hit(7)))
    with running_collector(tmp_path, resolver_factory=Names) as c, QueryClient(c.address) as q:
        t = SimTracer(c.address, "gpu-node-1", instance_id="i1")
        t.connect()
        t.wait_acked(t.send_events([fault_event(1, xid)]))
        t.send_events([fault_event(1, xid), fault_event(2, xid, ts_unix_ns=1)])  # 1 again: a resend
        t.wait_acked(2)
        t.stop()
        assert sorted(f.id for f in _list(q)) == [1, 2]  # the resent seq 1 is a duplicate: stored once
    with running_collector(tmp_path, resolver_factory=Names) as c, QueryClient(c.address) as q:
        faults = _list(q)
        assert [f.id for f in faults] == [2, 1]  # oldest first by when it was read: seq 2 carried ts 1
        (f,) = [f for f in faults if f.id == 1]
        assert (f.node, f.fault.xid, f.fault.gpu, f.fault.severity) == ("gpu-node-1", 79, 1, "critical")
        assert [h.consumer.process.pid for h in f.hits] == [4242, 99, 7]  # the named process first
        named, gone, host = f.hits
        assert named.consumer.named and (named.k8s.namespace, named.k8s.pod, named.k8s.container) == (
            "ml", "train-7", "trainer")
        assert gone.consumer.exited and gone.k8s.resolution == "not_found"  # its container is gone: said so
        assert host.k8s.resolution == "none" and not host.k8s.pod
        assert c.call(lambda: c.faults.count_rows()) == [(("gpu-node-1", "1", "79"), 2)]


def test_names_that_come_later_rewrite_the_fault(tmp_path: Path) -> None:
    Names.made.clear()
    with running_collector(tmp_path, resolver_factory=Names) as c, QueryClient(c.address) as q:
        with SimTracer(c.address, "gpu-node-1") as t:
            t.connect()
            t.wait_acked(t.send_events([fault_event(1, fault_record(affected=(hit(5, EVAL),)))]))
        (before,) = _list(q)
        assert before.hits[0].k8s.resolution == "unresolved" and not before.hits[0].k8s.pod
        names = Names.made[-1]
        exited = k8s("research", "eval-2", "eval", "CONTAINER_EXITED")
        c.call(lambda: names.answer("gpu-node-1", EVAL, exited))
        wait_until(lambda: _list(q)[0].hits[0].k8s.pod == "eval-2", "the late names in the stored fault")
        (after,) = _list(q, namespace="research")
        assert after.hits[0].k8s.container_state == "CONTAINER_EXITED"
        assert c.call(lambda: list(c.faults.pending_ids())) == []


def test_list_faults_filters_by_since_node_and_namespace_newest_limit(tmp_path: Path) -> None:
    with running_collector(tmp_path, resolver_factory=Names) as c, QueryClient(c.address) as q:
        for node, seq_ts in (("n1", (100, 200, 300)), ("n2", (150,))):
            with SimTracer(c.address, node) as t:
                t.connect()
                events = [fault_event(i + 1, fault_record(node=node, affected=(hit(4, TRAIN),) if ts == 200
                                                          else ()), ts_unix_ns=ts)
                          for i, ts in enumerate(seq_ts)]
                t.wait_acked(t.send_events(events))
        assert [f.ts_unix_ns for f in _list(q)] == [100, 150, 200, 300]
        assert [f.ts_unix_ns for f in _list(q, since_unix_ns=150)] == [150, 200, 300]
        assert [f.ts_unix_ns for f in _list(q, node="n1")] == [100, 200, 300]
        assert [f.ts_unix_ns for f in _list(q, namespace="ml")] == [200]
        assert _list(q, namespace="m_") == [] and _list(q, namespace="%") == []  # LIKE wildcards: literal
        assert [f.ts_unix_ns for f in _list(q, limit=2)] == [200, 300]


def test_the_store_keeps_faults_max_and_counts_the_dropped(tmp_path: Path) -> None:
    with running_collector(tmp_path, resolver_factory=Names, faults_max=3) as c, QueryClient(c.address) as q:
        with SimTracer(c.address, "n1") as t:
            t.connect()
            t.wait_acked(t.send_events([fault_event(s, fault_record(node="n1", xid=s + 10), ts_unix_ns=s)
                                        for s in range(1, 6)]))
        assert [f.fault.xid for f in _list(q)] == [13, 14, 15]
        assert c.call(lambda: (c.faults.kept, c.faults.dropped_total)) == (3, 2)
        assert len(c.call(lambda: c.faults.count_rows())) == 5  # the counter counts every fault stored
    with running_collector(tmp_path, resolver_factory=Names, faults_max=3) as c:
        # A restart reads the counts back whole: the dropped faults still count (a counter never goes back).
        assert c.call(lambda: c.faults.count_rows()) == [(("n1", "1", str(x)), 1) for x in range(11, 16)]
        assert c.call(lambda: (c.faults.kept, c.faults.dropped_total)) == (3, 0)


# ---- the book and the store's read, without a collector ------------------------------------------------


def _book(tmp_path: Path, max_kept: int = 10) -> tuple[FaultBook, Store]:
    store = Store(str(tmp_path / "f.db"), event_log_max=0, retention_days=1)
    book = FaultBook(store, lambda node, cid: k8s("ml", "train-7", "trainer") if cid == TRAIN else PENDING,
                     max_kept)
    store.load(book.load)
    return book, store


def test_take_resolves_hits_counts_and_waits_for_pending_names(tmp_path: Path) -> None:
    book, store = _book(tmp_path)
    told: list[query_pb2.ClusterFault] = []
    book.listeners.append(told.append)
    op = book.take("n1", fault_event(1, fault_record(node="n1", affected=(hit(1, TRAIN), hit(2, EVAL)))))
    store.submit([op])
    assert [h.k8s.pod for h in told[0].hits] == ["train-7", ""]
    assert list(book.pending_ids()) == [1]
    book.on_cri_change("n1", "containerd://" + TRAIN.upper())  # a change the pending hit does not wait on
    assert len(told) == 1
    book.on_cri_change("n2", EVAL)  # another node's container of that ID
    assert len(told) == 1
    store.barrier().result(5)
    store.close()


def test_faults_max_below_one_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match=r"^--faults-max 0: must be 1 or more$"):
        FaultBook(None, None, 0)


def _row(fid: int, node: str, ts: int, namespaces: tuple[str, ...]) -> query_pb2.ClusterFault:
    cf = query_pb2.ClusterFault(id=fid, node=node, ts_unix_ns=ts)
    cf.fault.xid, cf.fault.gpu = 79, 0
    for ns in namespaces:
        cf.hits.add().k8s.namespace = ns
    return cf


ROWS = [_row(1, "n1", 10, ("ml",)), _row(2, "n1", 20, ("ml", "research")), _row(3, "n2", 30, ()),
        _row(4, "n2", 40, ("ml_x",))]


@pytest.mark.parametrize(("since", "node", "namespace", "limit", "ids"), [
    (0, "", "", 10, [1, 2, 3, 4]),
    (20, "", "", 10, [2, 3, 4]),
    (0, "n2", "", 10, [3, 4]),
    (0, "", "research", 10, [2]),
    (0, "", "ml", 10, [1, 2]),  # "ml" is not "ml_x": whole items only
    (0, "", "ml_", 10, []),
    (0, "", "", 2, [3, 4]),  # the newest two, oldest first
])
def test_select_faults(since: int, node: str, namespace: str, limit: int, ids: list[int]) -> None:
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE faults (id INTEGER PRIMARY KEY, node TEXT, ts_unix_ns INTEGER, gpu TEXT, "
                 "xid TEXT, namespaces TEXT, fault BLOB)")
    conn.executemany("INSERT INTO faults VALUES (?, ?, ?, ?, ?, ?, ?)", [fault_row(cf) for cf in ROWS])
    assert [cf.id for cf in select_faults(since, node, namespace, limit)(conn)] == ids


def test_a_viewer_may_list_faults_and_nobody_else_without_a_role() -> None:
    policy = Policy.parse("rules:\n  - role: viewer\n    subjects: [user:alice]\n", "test")
    method = "/ghostgpu.v1.Query/ListFaults"
    assert policy.check(Principal("user", "alice", via="mtls"), method) is None
    assert policy.check(Principal("user", "bob", via="mtls"), method) == "role viewer"


class Offered:
    """A stand-in AlertPusher that records the faults offered to it."""

    made: list[Offered] = []

    def __init__(self, urls: list[str], **kw: Any) -> None:
        self.watcher = Watcher("", "", ())
        self.faults: list[query_pb2.ClusterFault] = []
        Offered.made.append(self)

    def offer_fault(self, fault: query_pb2.ClusterFault) -> None:
        self.faults.append(fault)

    def start(self) -> None:
        pass

    def stop(self, timeout_s: float = 2.0) -> None:
        pass


def test_a_restarted_collector_offers_the_faults_whose_alerts_have_not_ended(tmp_path: Path) -> None:
    now = time.time_ns()
    with running_collector(tmp_path, resolver_factory=Names) as c, SimTracer(c.address, "n1") as t:
        t.connect()
        old, recent = fault_record(node="n1", xid=48), fault_record(node="n1", xid=79)
        t.wait_acked(t.send_events([fault_event(1, old, ts_unix_ns=now - 2 * 3600 * 10**9),
                                    fault_event(2, recent, ts_unix_ns=now - 60 * 10**9)]))
    Offered.made.clear()
    with running_collector(tmp_path, resolver_factory=Names, alertmanager=["http://127.0.0.1:9093"],
                           pusher_factory=Offered):
        (pusher,) = Offered.made
        assert [(f.id, f.fault.xid) for f in pusher.faults] == [(2, 79)]  # the 2 h old one ended (1 h hold)
