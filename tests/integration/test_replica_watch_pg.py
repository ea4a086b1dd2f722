"""WatchFindings and WatchTrace see what other collector replicas write, through PostgreSQL LISTEN/NOTIFY
(collector/notify.py), on the real server (tests/helpers/postgres.py).

Two Collectors share one database: a tracer streams to replica A, and a WatchFindings client on
replica B gets the same events, kinds, ids and filters as one on A; a watch with include_open on B
replays the findings open on A. A trace session started on A, with its tracer on A, is followed
from B until its end. At the Notifier's level: a NOTIFY goes out with its transaction's commit and
never with a fenced-out job, and after PostgreSQL restarts the listener reconnects, tells its
subscribers to resync, and hears what is committed from then on."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.collector.main import Collector
from ghostgpu.collector.notices import FINDINGS_CHANNEL, OPENED, decode_findings
from ghostgpu.collector.notify import Notifier, finding_announcer
from ghostgpu.collector.store import LeaseLost, Store

from ghostgpu.common.model.consumers import K8sInfo
from ghostgpu.v1 import query_pb2, trace_pb2
from tests.helpers.collector_env import QueryClient
from tests.helpers.cri_fake import FakeCri
from tests.helpers.polling import wait_until
from tests.helpers.postgres import PostgresServer
from tests.helpers.replicas import replica as shared_replica
from tests.helpers.sim_tracer import SimTracer, finding, make_consumer, resolved, trace_record
from tests.helpers.trace_env import FAST, TRACE_CAPS, TraceClient, cri_via

pytestmark = pytest.mark.postgres

CID_A, CID_B = "a1" * 32, "b2" * 32
DEADLINE_S = 20.0  # milliseconds on an idle machine; generous for a loaded 2-core VM
K = query_pb2.FindingEvent
S = trace_pb2.TraceStatus


class NamesResolver:
    """CRI's answers for CID_A (team-a) and CID_B (team-b), known at once."""

    def __init__(self, transport_for: Any, on_change: Any) -> None:
        pass

    def get(self, node: str, container_id: str) -> K8sInfo:
        ns = {CID_A: "team-a", CID_B: "team-b"}.get(container_id)
        if ns is None:
            return K8sInfo("unresolved", error="CRI lookup pending")
        return K8sInfo("resolved", ns, f"pod-{ns}", f"uid-{ns}", "main", "img:1")


def replica(tmp_path: Path, dsn: str, name: str,
            **kw: Any) -> contextlib.AbstractContextManager[Collector]:
    return shared_replica(tmp_path, dsn, name, listening_s=DEADLINE_S, **kw)


class Reader:
    """A streaming call read on a thread into a list."""

    def __init__(self, call: Any, what: str) -> None:
        self.call, self.what, self.got = call, what, []  # type: ignore[var-annotated]
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for item in self.call:
                self.got.append(item)
        except Exception as e:  # a cancelled call ends the read
            self.error = e

    def wait(self, n: int) -> list[Any]:
        wait_until(lambda: len(self.got) >= n, f"{n} items on {self.what}", DEADLINE_S)
        return self.got

    def stop(self) -> None:
        self.call.cancel()
        self.thread.join(5)


def _events(items: list[query_pb2.FindingEvent]) -> list[tuple[int, int, int, str]]:
    return [(e.kind, e.finding.id, e.finding.consumer.consumer.process.pid, e.finding.consumer.k8s.namespace)
            for e in items]


def _watchers(c: Collector) -> int:
    return int(c.call(lambda: len(c.cluster.watchers)))


def test_a_finding_written_on_one_replica_reaches_watchers_on_another(tmp_path: Path,
                                                                     postgres_dsn: str) -> None:
    with replica(tmp_path, postgres_dsn, "a", resolver_factory=NamesResolver) as a, \
            replica(tmp_path, postgres_dsn, "b", resolver_factory=NamesResolver) as b, \
            QueryClient(a.address) as qa, QueryClient(b.address) as qb:
        on_a, on_b = Reader(qa.watch(), "a's watch"), Reader(qb.watch(), "b's watch")
        team_b = Reader(qb.watch(namespace="team-b"), "b's team-b watch")
        wait_until(lambda: _watchers(a) == 1 and _watchers(b) == 2, "the watchers registered", DEADLINE_S)
        x, y = make_consumer("n1", 1, container_id=CID_A), make_consumer("n1", 2, container_id=CID_B)
        with SimTracer(a.address, "n1") as t:
            t.connect()
            t.send_events([finding(1, x)])
            t.send_events([finding(2, y)])
            t.send_events([finding(3, make_consumer("n1", 2, container_id=CID_B, gpu_memory_bytes=5))])
            t.send_events([resolved(4, x)])
            t.wait_acked(4)
            want = on_a.wait(4)[:4]
            assert [e[0] for e in _events(want)] == [K.KIND_OPENED, K.KIND_OPENED, K.KIND_CHANGED,
                                                     K.KIND_RESOLVED]
            assert _events(on_b.wait(4)) == _events(want)  # the same kinds, ids, consumers, in order
            assert on_b.got[3].finding.resolved_unix_ns == want[3].finding.resolved_unix_ns > 0
            assert on_b.got[2].finding.consumer.consumer.gpu_memory_bytes == 5
            assert _events(team_b.wait(2)) == [e for e in _events(want) if e[3] == "team-b"]
            # include_open on B: what A holds open now, as OPENED, first
            replay = Reader(qb.watch(include_open=True), "b's replay")
            assert _events(replay.wait(1)) == [(K.KIND_OPENED, want[1].finding.id, 2, "team-b")]
            for r in (on_a, on_b, team_b, replay):
                r.stop()


def test_a_trace_session_on_one_replica_is_followed_from_another(tmp_path: Path, postgres_dsn: str) -> None:
    fake = FakeCri().start()
    fake.add_sandbox("sb-ml-trainer", "trainer-0", "ml", "uid-trainer")
    fake.add_container(CID_A, "sb-ml-trainer", "train")
    try:
        with replica(tmp_path, postgres_dsn, "a", trace_timing=FAST) as a, \
                replica(tmp_path, postgres_dsn, "b", trace_timing=FAST) as b, \
                TraceClient(a.address) as qa, TraceClient(b.address) as qb, \
                SimTracer(a.address, "n1", cri=cri_via(fake), capabilities=TRACE_CAPS) as t:
            t.connect()
            s = qa.start(namespace="ml", pod="trainer-0")
            t.wait_trace_command("trace_start")
            t.send_trace(s.id, [trace_record(container_id=CID_A) for _ in range(3)])
            follow_b = Reader(qb.watch(s.id), "b's WatchTrace")
            follow_a = Reader(qa.watch(s.id), "a's WatchTrace")
            wait_until(lambda: sum(len(m.records) for m in follow_b.got) == 3, "the stored records on b",
                       DEADLINE_S)
            t.send_trace(s.id, [trace_record(container_id=CID_A, pid=9)])
            wait_until(lambda: sum(len(m.records) for m in follow_b.got) == 4, "the live batch on b",
                       DEADLINE_S)
            t.end_trace(s.id)
            for r in (follow_a, follow_b):
                r.thread.join(DEADLINE_S)
                assert not r.thread.is_alive() and r.error is None, f"{r.what} ends with the session"
                assert [x.seq for m in r.got for x in m.records] == [1, 2, 3, 4]
                assert r.got[-1].session.status == S.TRACE_STATUS_COMPLETED
                rec = next(x for m in r.got for x in m.records)
                assert (rec.node, rec.namespace, rec.pod, rec.container) == ("n1", "ml", "trainer-0", "train")
            assert follow_b.got[-1].session.records_total == 4
            records, final = qb.show(s.id)  # after the end, from any replica
            assert [x.seq for x in records] == [1, 2, 3, 4] and final.status == S.TRACE_STATUS_COMPLETED
    finally:
        fake.close()


# ---- the Notifier with two Stores -------------------------------------------------------------------


class Heard:
    """A Notifier on its own loop thread, recording what its subscribers got."""

    def __init__(self, store: Store) -> None:
        self.got: list[str | None] = []
        self.notifier = Notifier(store.url, None, "listener", wait_s=0.05)
        self.notifier.subscribe(FINDINGS_CHANNEL, self.got.append)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.notifier.start(self.loop)

    def close(self) -> None:
        self.notifier.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    def payloads(self) -> list[str]:
        return [p for p in list(self.got) if p is not None]


def _write_finding_notice(store: Store, fid: int, fence: tuple[str, int] | None = None) -> list[Any]:
    """A job carrying only the announcement of finding `fid` opened; its done() outcome."""
    outcome: list[Any] = []
    store.submit([finding_announcer(store.replica_id)([(fid, OPENED)])], outcome.append, fence=fence)
    return outcome


def test_notify_goes_with_its_commit_and_never_with_a_fenced_out_job(postgres_dsn: str) -> None:
    store = Store(postgres_dsn, 1000, 7, replica_id="a")
    heard = Heard(store)
    try:
        assert heard.notifier.wait_listening(DEADLINE_S)
        wait_until(lambda: heard.got[:1] == [None], "the first resync", DEADLINE_S)
        refused = _write_finding_notice(store, 1, fence=("n-nobody-holds", 7))
        committed = _write_finding_notice(store, 2)
        wait_until(lambda: len(heard.payloads()) >= 1, "the committed job's notification", DEADLINE_S)
        assert isinstance(refused[0], LeaseLost) and committed == [None]
        assert [decode_findings(p).changes for p in heard.payloads()] == [[(2, OPENED)]]
        assert decode_findings(heard.payloads()[0]).source == "a"
    finally:
        heard.close()
        store.close()


def test_the_listener_comes_back_after_a_restart_and_asks_for_a_resync(own_postgres: PostgresServer) -> None:
    dsn = own_postgres.create_database("n")
    store = Store(dsn, 1000, 7, replica_id="a")
    heard = Heard(store)
    try:
        assert heard.notifier.wait_listening(DEADLINE_S)
        own_postgres.restart()
        wait_until(lambda: heard.got.count(None) >= 2, "the resync after the reconnect", DEADLINE_S)
        assert heard.notifier.reconnects_total >= 1
        outcome = _write_finding_notice(store, 3)  # the store's writer reconnects on its own
        wait_until(lambda: len(heard.payloads()) == 1, "a notification after the restart", DEADLINE_S)
        assert outcome == [None]
    finally:
        heard.close()
        store.close()
