"""Process churn leaves nothing behind in the collector: short-lived consumers, each a new PID in a
new container, whose findings open and resolve, are stored and then forgotten in memory. Per
structure: the cluster table's rows, container index and open findings; the CRI answers of
containers nobody holds a GPU in any more; the reference cycle a failed relayed CRI call made; pod
names in /metrics' label writing; the HTTP server's logged failures; the Alertmanager alert book."""

from __future__ import annotations

import gc
import sys
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from ghostgpu.collector import alertbook
from ghostgpu.collector.alertbook import AlertBook
from ghostgpu.collector.cluster import Watcher
from ghostgpu.collector.cri_fetch import CriCallError
from ghostgpu.collector.main import Collector
from ghostgpu.collector.metrics_render import NodeConsumers

from ghostgpu.common.model.consumers import ClusterConsumer, K8sInfo
from ghostgpu.common.web.httpserve import MAX_LOGGED_FAILURES, HttpServer, Request
from ghostgpu.k8s import cri_runtime_v1_pb2 as cri
from ghostgpu.v1 import node_pb2
from tests.helpers.alertpush_env import FindingTable, k8s
from tests.helpers.collector_env import QueryClient, running_collector
from tests.helpers.cri_fake import exited_runtime
from tests.helpers.polling import wait_until
from tests.helpers.sim_tracer import SimTracer, finding, holder, make_consumer, resolved

NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
EXIT = node_pb2.HolderEvent.KIND_EXIT


def cid_of(i: int) -> str:
    return f"{i:064x}"


class Forgotten(list[tuple[str, str]]):
    """The cluster table's forget() calls, in order."""

    def __call__(self, node: str, container_id: str) -> None:
        self.append((node, container_id))


@pytest.fixture
def forgotten() -> Forgotten:
    return Forgotten()


@pytest.fixture
def table(forgotten: Forgotten) -> FindingTable:
    t = FindingTable("n1")
    t.table.forget = forgotten
    return t


# ---- the cluster table --------------------------------------------------------------------------


def test_a_containers_cri_answer_is_forgotten_a_while_after_its_last_consumer(
        table: FindingTable, forgotten: Forgotten) -> None:
    a1, a2 = (make_consumer("n1", pid, container_id=cid_of(1)) for pid in (1, 2))
    b = make_consumer("n1", 3, container_id=cid_of(2))
    table.add(a1, a2, b)
    table.remove(a1)
    assert table.table.release_unused(time.monotonic() + 3600) == 0  # a2 still holds a GPU in it
    table.remove(a2)
    gone_at = time.monotonic()
    keep_s = table.table.unused_keep_s
    assert table.table.release_unused(gone_at + keep_s - 1) == 0 and forgotten == []
    assert table.table.release_unused(gone_at + keep_s + 1) == 1
    assert forgotten == [("n1", cid_of(1))]
    assert table.table.release_unused(time.monotonic() + 10 * keep_s) == 0  # b is in use: never
    assert table.table.by_cid == {"n1": {cid_of(2): {b.key}}}


def test_a_container_in_use_again_keeps_its_answer(table: FindingTable, forgotten: Forgotten) -> None:
    first, second = (make_consumer("n1", pid, container_id=cid_of(1)) for pid in (1, 2))
    table.add(first)
    table.remove(first)
    table.add(second)  # the job's next process, in the same container
    assert table.table.release_unused(time.monotonic() + 3600) == 0 and forgotten == []
    table.remove(second)
    assert table.table.release_unused(time.monotonic() + 3600) == 1


def test_5000_short_lived_containers_keep_at_most_unused_max_answers(
        table: FindingTable, forgotten: Forgotten) -> None:
    table.table.unused_max = 50
    for i in range(5000):
        c = make_consumer("n1", 10_000 + i, container_id=cid_of(i))
        table.add(c)
        table.remove(c)
    t = table.table
    assert len(t._unused) == 50
    assert forgotten == [("n1", cid_of(i)) for i in range(4950)]  # the oldest first
    assert (t.rows, t.by_cid, t.open, t._dirty) == ({"n1": {}}, {"n1": {}}, {"n1": {}}, {})
    assert t.findings_opened == t.findings_resolved == {("n1", "hidden"): 5000}
    assert t.release_unused(time.monotonic() + t.unused_keep_s) == 50 and not t._unused


def test_without_a_forget_nothing_is_kept_for_it() -> None:
    t = FindingTable("n1")
    for i in range(100):
        c = make_consumer("n1", 10_000 + i, container_id=cid_of(i))
        t.add(c)
        t.remove(c)
    assert not t.table._unused and t.table.release_unused() == 0


# ---- the whole collector, over real gRPC ------------------------------------------------------------


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[Collector]:
    with running_collector(tmp_path) as c:  # the real CriResolver, through the sim tracer's relay
        yield c


def test_5000_short_lived_consumers_leave_only_their_history(collector: Collector) -> None:
    c = collector
    c.cluster.unused_max = 100
    with QueryClient(c.address) as q, SimTracer(c.address, "n1", cri=exited_runtime) as t:
        t.connect()
        t.send_snapshot([], seq=0)
        seq = 0
        for r in range(50):  # 100 consumers come, then go, each time
            batch = range(r * 100, (r + 1) * 100)
            pool = [make_consumer("n1", 100_000 + i, container_id=cid_of(i)) for i in batch]
            opens = [e for p in pool for e in (holder(0, p.pid, p.container_id), finding(0, p))]
            ends = [e for p in pool for e in (holder(0, p.pid, p.container_id, kind=EXIT), resolved(0, p))]
            for events in (opens, ends):
                for e in events:
                    seq += 1
                    e.seq = seq
                t.send_events(events)
            t.wait_acked(seq, 30)
        wait_until(lambda: c.resolver.stats().pending == 0, "the CRI lookups to drain", timeout_s=60)

        def sizes() -> dict[str, int]:
            cl, ns = c.cluster, c.nodes["n1"]
            return {"consumers": len(ns.consumers), "rows": len(cl.rows["n1"]),
                    "by_cid": len(cl.by_cid["n1"]), "open": len(cl.open["n1"]), "dirty": len(cl._dirty),
                    "positions": len(ns.positions), "unused": len(cl._unused),
                    "sessions": len(c.ingest.sessions)}

        assert c.call(sizes) == {"consumers": 0, "rows": 0, "by_cid": 0, "open": 0, "dirty": 0,
                                 "positions": 1, "unused": 100, "sessions": 1}
        stats = c.resolver.stats()
        assert stats.cache_misses_total == 5000 and stats.fetches_total > 0  # each container asked for once
        assert stats.cached <= 100
        opened = c.call(lambda: sum(c.cluster.findings_opened.values()))
        assert opened >= 5000 and opened == c.call(lambda: sum(c.cluster.findings_resolved.values()))
        stored = c.store.read(lambda db: db.execute(
            "SELECT COUNT(*) FROM findings WHERE resolved_unix_ns > 0").fetchone()[0]).result(10)
        assert stored == opened  # settled and stored: the history has every one
        assert q.findings(limit=1)  # and serves it
        assert c.call(lambda: c.cluster.release_unused(time.monotonic() + c.cluster.unused_keep_s)) == 100
        assert c.resolver.stats().cached == 0


def test_a_failed_relayed_cri_call_leaves_no_reference_cycle(collector: Collector) -> None:
    request = cri.PodSandboxStatusRequest(pod_sandbox_id="gone").SerializeToString()
    with SimTracer(collector.address, "n1", cri=exited_runtime) as t:
        t.connect()
        gc.disable()  # a cycle, if one is made, stays until the check below
        try:
            try:
                collector.relay.call("n1", "PodSandboxStatus", request, 2.0)
            except CriCallError as e:
                assert e.code == grpc.StatusCode.NOT_FOUND
                error = weakref.ref(e)
            else:
                pytest.fail("the relay answered a sandbox the runtime does not know")
            assert error() is None, "the error (its traceback, the waiting frame, the future) is a cycle"
        finally:
            gc.enable()


# ---- /metrics, the HTTP server, the alert book --------------------------------------------------------


def test_a_pod_name_is_not_kept_once_its_row_is_gone() -> None:
    pod = "".join(["job-", "7f3a9c"])  # a string of its own: its references are all counted below
    base = sys.getrefcount(pod)
    c = make_consumer("n1", 4242, container_id=cid_of(1))
    cc = ClusterConsumer(c, K8sInfo("resolved", "batch", pod, "uid", "step"))
    rows = NodeConsumers("n1").apply([(c.key, cc)])
    assert b'pod="job-7f3a9c"' in rows.text[0]
    rows.apply([(c.key, None)])
    del cc
    assert sys.getrefcount(pod) == base


def test_the_http_server_remembers_a_bounded_number_of_failures() -> None:
    def fail(request: Request) -> Any:
        raise KeyError(f"no row for pid {request.query['pid'][0]}")  # a text of its own per process

    server = HttpServer("127.0.0.1:0", {"/metrics": fail}, name="metrics")  # never started: handle() only
    for pid in range(MAX_LOGGED_FAILURES + 50):
        assert server.handle(Request("/metrics", {"pid": [str(pid)]}, {})).status == 500
    assert len(server._logged) == MAX_LOGGED_FAILURES


def _alert_book_after(findings: int, take: bool) -> AlertBook:
    """The book after `findings` findings, each in a container of its own, opened then resolved."""
    table = FindingTable("n1")
    watcher = Watcher("", "", (), max_queue=10 * findings)
    table.table.watch(watcher, include_open=False)
    book = AlertBook(["am"], {}, resend_s=60.0, resolved_keep_s=300.0, settle_s=0.0)
    now = 1000.0
    for i in range(findings):
        c = make_consumer("n1", 10_000 + i, container_id=cid_of(i))
        table.names[c.container_id] = k8s("batch", f"job-{i}", "step")
        table.add(c)
        table.remove(c)
        book.apply(watcher.items, now)
        watcher.items.clear()
        batch, _ = book.due("am", now, 500)
        if take:
            book.taken("am", [(key, version) for key, version, _ in batch], now)
        now += 0.01
    book.apply([], now + 300.0)
    return book


def test_the_alert_book_forgets_resolved_alerts_its_alertmanager_took() -> None:
    book = _alert_book_after(5000, take=True)
    assert (book.alerts, book.findings, book.held, book.resolved) == ({}, {}, {}, {})
    assert (book.unsent, book.taken_by) == ({"am": {}}, {"am": {}})


def test_the_alert_book_keeps_at_most_max_resolved_alerts_for_an_alertmanager_that_is_away(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(alertbook, "MAX_RESOLVED_ALERTS", 100)
    book = _alert_book_after(2000, take=False)
    assert len(book.resolved) == len(book.alerts) == len(book.unsent["am"]) == 100
    assert book.findings == {} and book.taken_by == {"am": {}}
