"""GPU faults at the collector: stored once with the batch that carried them (a resend is a duplicate,
the same kernel log record again is no new fault, a failed commit changes nothing and its resend is
stored, told and counted once, a restart keeps them), each hit named through CRI (late names rewrite
the row; a container gone says so), bounded with the drops counted, listed by ListFaults with its
filters, the viewer role, offered to the Alertmanager push again by a restarted collector while their
alerts last, and the counts of nodes gone past the retention dropped."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from ghostgpu.collector.cluster import Watcher
from ghostgpu.collector.faults import FaultBook, FaultRow, fault_row, select_faults
from ghostgpu.collector.migrations import migrate
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
    other = fault_record()  # the same Xid on the same GPU: another kernel log record, another fault
    with running_collector(tmp_path, resolver_factory=Names) as c, QueryClient(c.address) as q:
        t = SimTracer(c.address, "gpu-node-1", instance_id="i1")
        t.connect()
        t.wait_acked(t.send_events([fault_event(1, xid)]))
        t.send_events([fault_event(1, xid), fault_event(2, other, ts_unix_ns=1)])  # 1 again: a resend
        t.wait_acked(2)
        t.wait_acked(t.send_events([fault_event(3, xid)]))  # the same record under a new seq: no new fault
        t.stop()
        assert sorted(f.id for f in _list(q)) == [1, 2]  # the resent seq 1 is a duplicate: stored once
    with running_collector(tmp_path, resolver_factory=Names) as c, QueryClient(c.address) as q:
        faults = _list(q)
        assert [f.id for f in faults] == [2, 1]  # oldest first by when it was read: seq 2 carried ts 1
        (f,) = [f for f in faults if f.id == 1]
        assert (f.node, f.fault.xid, f.fault.gpu, f.fault.severity) == ("gpu-node-1", 79, 1, "critical")
        assert (f.boot_id, f.fault.kmsg_seq) == ("sim-boot", xid.kmsg_seq)  # its natural key
        assert [h.consumer.process.pid for h in f.hits] == [4242, 99, 7]  # the named process first
        named, gone, host = f.hits
        assert named.consumer.named and (named.k8s.namespace, named.k8s.pod, named.k8s.container) == (
            "ml", "train-7", "trainer")
        assert gone.consumer.exited and gone.k8s.resolution == "not_found"  # its container is gone: said so
        assert host.k8s.resolution == "none" and not host.k8s.pod
        assert c.call(lambda: c.faults.count_rows()) == [(("gpu-node-1", "1", "79"), 2)]


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


def test_a_fault_whose_commit_failed_is_stored_told_and_counted_once_when_resent(tmp_path: Path) -> None:
    """A failed commit changes nothing: no alert, no count ahead of the store; the tracer's resend to
    the restarted collector is stored, pushed and counted once, and a second resend is none of these."""
    Store(str(tmp_path / "collector.db"), event_log_max=100, retention_days=1).close()  # the schema
    with sqlite3.connect(tmp_path / "collector.db") as conn:  # the disk refuses the fault's row
        conn.execute("CREATE TRIGGER refuse BEFORE INSERT ON faults BEGIN SELECT RAISE(ABORT, 'disk'); END")
    xid = fault_record(node="n1", affected=(hit(4242, TRAIN, named=True),))
    am = dict(resolver_factory=Names, alertmanager=["http://127.0.0.1:9093"], pusher_factory=Offered)
    Offered.made.clear()
    with running_collector(tmp_path, **am) as c, SimTracer(c.address, "n1", instance_id="i1") as t:
        t.connect()
        t.send_events([fault_event(1, xid)])
        code, _ = t.wait_ended()
        assert code == grpc.StatusCode.UNAVAILABLE  # not acked: the tracer keeps it to send again
        assert Offered.made[-1].faults == []  # nothing pushed for a fault not stored
        assert c.call(lambda: (c.faults.count_rows(), c.faults.kept)) == ([], 0)
    with sqlite3.connect(tmp_path / "collector.db") as conn:  # the disk is fixed; the collector restarts
        conn.execute("DROP TRIGGER refuse")
    with running_collector(tmp_path, **am) as c, QueryClient(c.address) as q:
        with SimTracer(c.address, "n1", instance_id="i1") as t:
            t.connect()
            t.wait_acked(t.send_events([fault_event(1, xid)]))  # the resend
        with SimTracer(c.address, "n1", instance_id="i2") as t:  # a new tracer instance sends it again
            t.connect()
            t.wait_acked(t.send_events([fault_event(1, xid)]))
        (stored,) = _list(q)
        pushed = Offered.made[-1].faults
        assert [(f.id, f.fault.kmsg_seq) for f in pushed] == [(stored.id, xid.kmsg_seq)]  # told once
        assert pushed[0].hits[0].k8s.pod == "train-7"
        assert c.call(lambda: (c.faults.count_rows(), c.faults.kept)) == ([(("n1", "1", "79"), 1)], 1)


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
        every = [(("n1", "1", str(x)), 1) for x in range(11, 16)]
        assert c.call(lambda: c.faults.count_rows()) == every  # the counter counts every fault stored
    with running_collector(tmp_path, resolver_factory=Names, faults_max=3) as c:
        # A restart reads the counts back whole: the dropped faults still count (a counter never goes back).
        assert c.call(lambda: c.faults.count_rows()) == every
        assert c.call(lambda: (c.faults.kept, c.faults.dropped_total)) == (3, 0)


# ---- the book and the store's read, without a collector ------------------------------------------------


def _book(tmp_path: Path, max_kept: int = 10) -> tuple[FaultBook, Store]:
    store = Store(str(tmp_path / "f.db"), event_log_max=0, retention_days=1)
    book = FaultBook(store, lambda node, cid: k8s("ml", "train-7", "trainer") if cid == TRAIN else PENDING,
                     max_kept)
    store.load(book.load)
    return book, store


def _rows(store: Store) -> list[tuple[int, str, str, int]]:
    return store.read(lambda conn: conn.execute(
        "SELECT id, node, boot_id, kmsg_seq FROM faults ORDER BY id").fetchall()).result(5)


def test_take_resolves_hits_counts_and_waits_for_pending_names(tmp_path: Path) -> None:
    book, store = _book(tmp_path)
    told: list[query_pb2.ClusterFault] = []
    book.listeners.append(told.append)
    rec = fault_record(node="n1", affected=(hit(1, TRAIN), hit(2, EVAL)))
    taken = book.take("n1", "boot-1", fault_event(1, rec))
    assert told == [] and book.count_rows() == []  # nothing changes before the commit
    store.submit([taken.op])
    assert _rows(store) == [(1, "n1", "boot-1", rec.kmsg_seq)]  # the row is written
    book.committed([taken])
    assert [h.k8s.pod for h in told[0].hits] == ["train-7", ""]
    assert book.count_rows() == [(("n1", "1", "79"), 1)]
    assert list(book.pending_ids()) == [1]
    book.on_cri_change("n1", "containerd://" + TRAIN.upper())  # a change the pending hit does not wait on
    book.on_cri_change("n2", EVAL)  # another node's container of that ID
    assert len(told) == 1 and list(book.pending_ids()) == [1]  # neither told it again nor let it go
    again = book.take("n1", "boot-1", fault_event(7, rec))  # the same kernel log record: not a new fault
    store.submit([again.op])
    assert len(_rows(store)) == 1
    book.committed([again])
    assert len(told) == 1 and book.count_rows() == [(("n1", "1", "79"), 1)]
    store.close()


def test_a_commit_that_failed_changes_nothing(tmp_path: Path) -> None:
    book, store = _book(tmp_path)
    told: list[query_pb2.ClusterFault] = []
    book.listeners.append(told.append)
    taken = book.take("n1", "boot-1", fault_event(1, fault_record(node="n1", affected=(hit(2, EVAL),))))
    # The ingest hands committed() only the faults of a batch whose commit succeeded; a failed one is
    # never handed over, and a write that did not run leaves stored False even if it were.
    book.committed([taken])
    assert (told, book.count_rows(), book.kept, list(book.pending_ids())) == ([], [], 0, [])
    store.close()


def test_prune_gone_drops_the_counts_of_nodes_gone_past_the_retention_only(tmp_path: Path) -> None:
    book, store = _book(tmp_path)
    for node in ("live", "quiet", "gone"):
        taken = book.take(node, "b", fault_event(1, fault_record(node=node)))
        store.submit([taken.op])
        store.barrier().result(5)
        book.committed([taken])
    seen = {"live": 10_000, "quiet": 500}  # "gone": a node the collector no longer knows (0)
    assert book.prune_gone(lambda node: seen.get(node, 0), before_unix_ns=500) == ["gone"]
    assert [k[0] for k, _ in book.count_rows()] == ["live", "quiet"]  # seen at the cutoff: kept
    counted = store.read(lambda conn: conn.execute("SELECT node FROM fault_counts ORDER BY node").fetchall())
    assert counted.result(5) == [("live",), ("quiet",)]
    assert book.prune_gone(lambda node: seen.get(node, 0), before_unix_ns=500) == []
    store.close()
    store = Store(str(tmp_path / "f.db"), event_log_max=0, retention_days=1)
    again = FaultBook(store, None, 10)
    store.load(again.load)
    assert [k[0] for k, _ in again.count_rows()] == ["live", "quiet"]  # the table forgot it too
    store.close()


def test_faults_max_below_one_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match=r"^--faults-max 0: must be 1 or more$"):
        FaultBook(None, None, 0)


def _row(fid: int, node: str, ts: int, namespaces: tuple[str, ...]) -> query_pb2.ClusterFault:
    cf = query_pb2.ClusterFault(id=fid, node=node, ts_unix_ns=ts, boot_id="b", stored_unix_ns=ts)
    cf.fault.xid, cf.fault.gpu, cf.fault.kmsg_seq = 79, 0, fid
    for ns in namespaces:
        h = cf.hits.add()
        h.k8s.namespace, h.k8s.pod = ns, f"{ns}-pod"
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
    conn = sqlite3.connect(":memory:", isolation_level=None)
    migrate(conn, "sqlite", ":memory:")
    marks = ", ".join("?" * len(FaultRow._fields))
    conn.executemany(f"INSERT INTO faults VALUES ({marks})", [fault_row(cf) for cf in ROWS])
    assert [cf.id for cf in select_faults(since, node, namespace, limit)(conn)] == ids


def test_a_viewer_may_list_faults_and_nobody_else_without_a_role() -> None:
    policy = Policy.parse("rules:\n  - role: viewer\n    subjects: [user:alice]\n", "test")
    method = "/ghostgpu.v1.Query/ListFaults"
    assert policy.check(Principal("user", "alice", via="mtls"), method) is None
    assert policy.check(Principal("user", "bob", via="mtls"), method) == "role viewer"


def test_a_restarted_collector_offers_the_faults_whose_alerts_have_not_ended(tmp_path: Path) -> None:
    now = time.time_ns()
    with running_collector(tmp_path, resolver_factory=Names) as c, SimTracer(c.address, "n1") as t:
        t.connect()
        old, recent = fault_record(node="n1", xid=48), fault_record(node="n1", xid=79)
        t.wait_acked(t.send_events([fault_event(1, old, ts_unix_ns=now - 2 * 3600 * 10**9),
                                    fault_event(2, recent, ts_unix_ns=now - 60 * 10**9)]))
    am = dict(resolver_factory=Names, alertmanager=["http://127.0.0.1:9093"], pusher_factory=Offered)
    Offered.made.clear()
    with running_collector(tmp_path, **am):
        (pusher,) = Offered.made
        # The 2 h old one came late (stored now): its alert is held from its storing, so it lasts too.
        assert [(f.id, f.fault.xid) for f in pusher.faults] == [(1, 48), (2, 79)]
    with sqlite3.connect(tmp_path / "collector.db") as conn:  # as if each had been stored when read
        conn.execute("UPDATE faults SET stored_unix_ns = ts_unix_ns")
    Offered.made.clear()
    with running_collector(tmp_path, **am):
        (pusher,) = Offered.made
        assert [(f.id, f.fault.xid) for f in pusher.faults] == [(2, 79)]  # the 2 h old one ended (1 h hold)


def test_a_collector_drops_the_fault_counts_of_nodes_gone_past_its_retention(tmp_path: Path) -> None:
    with running_collector(tmp_path, resolver_factory=Names) as c:
        for node in ("gone", "back"):
            with SimTracer(c.address, node) as t:
                t.connect()
                t.wait_acked(t.send_events([fault_event(1, fault_record(node=node))]))
        assert [k[0] for k, _ in c.call(lambda: c.faults.count_rows())] == ["back", "gone"]
    with sqlite3.connect(tmp_path / "collector.db") as conn:  # one not heard from for 30 days
        conn.execute("UPDATE positions SET updated_unix_ns = ? WHERE node = 'gone'",
                     (time.time_ns() - 30 * 86400 * 10**9,))
    with running_collector(tmp_path, resolver_factory=Names, retention_days=7) as c:
        wait_until(lambda: [k[0] for k, _ in c.call(lambda: c.faults.count_rows())] == ["back"],
                   "the gone node's counts dropped")
        assert c.call(lambda: c.faults.count_rows()) == [(("back", "1", "79"), 1)]  # a live one's: kept
    with running_collector(tmp_path, resolver_factory=Names) as c:
        assert [k[0] for k, _ in c.call(lambda: c.faults.count_rows())] == ["back"]  # the table too
