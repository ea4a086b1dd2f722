"""The trace tables (collector/trace_store.py): sessions, records and audit rows through the Store's
writer thread; the per-session and total bounds, room made from ended sessions, retention, and
what a collector finds at start."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ghostgpu.collector.store import Store
from ghostgpu.collector.trace_store import RESTARTED, TraceStore, decode_records

from ghostgpu.common.model.trace import TraceScope, TraceSession, TraceStatus
from ghostgpu.v1 import trace_pb2
from tests.helpers.sim_tracer import trace_record

HOUR_NS = 3600 * 10**9
MAX_TOTAL, RETENTION_S = 1_000_000, 24 * 3600.0  # as a collector without the flags keeps them
LIMITS = (MAX_TOTAL, RETENTION_S)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(str(tmp_path / "c.db"), event_log_max=1000, retention_days=7)
    yield s
    s.close()


def session(sid: str, status: TraceStatus = TraceStatus.RUNNING, ended: int = 0) -> TraceSession:
    return TraceSession(id=sid, scope=TraceScope(namespace="ml"), requested_by="uid 0 (claimed)",
                        started_unix_ns=time.time_ns(), deadline_unix_ns=time.time_ns() + HOUR_NS,
                        status=status, ended_unix_ns=ended, max_records=100)


def batch(sid: str, first_seq: int, n: int) -> bytes:
    records = [trace_record(seq=first_seq + i, node="n1", container_id="ab" * 32) for i in range(n)]
    return trace_pb2.TraceBatch(session=sid, records=records).SerializeToString()


def add(ts: TraceStore, sid: str, first_seq: int, n: int) -> None:
    ts.add(sid, "n1", first_seq, first_seq + n - 1, n, batch(sid, first_seq, n))


def test_records_come_back_in_order_compressed_on_the_writer(store: Store) -> None:
    ts = TraceStore(store, *LIMITS)
    ts.save(session("t-1"))
    add(ts, "t-1", 1, 3)
    add(ts, "t-1", 4, 2)
    rows = ts.records("t-1").result(5)
    assert [r[1] for r in rows] == [1, 1]  # zlib
    assert [r.seq for r in decode_records(rows)] == [1, 2, 3, 4, 5]
    assert ts.records("t-2").result(5) == []
    assert (ts.counts, ts.total) == ({"t-1": 5}, 5)


def test_fit_keeps_within_the_session_and_the_total_bound(store: Store) -> None:
    ts = TraceStore(store, 10, RETENTION_S)
    add(ts, "a", 1, 6)
    assert ts.fit("a", 10, session_max=8) == 2  # the session's own bound
    assert ts.fit("b", 10, session_max=100) == 4  # the total's
    add(ts, "b", 1, 4)
    assert ts.fit("b", 1, session_max=100) == 0


def test_room_comes_from_the_oldest_ended_sessions_whole(store: Store) -> None:
    ts = TraceStore(store, 10, RETENTION_S)
    for sid, n in (("old", 3), ("older", 3), ("run", 4)):
        ts.save(session(sid))
        add(ts, sid, 1, n)
    ended = [("old", 2_000), ("older", 1_000)]
    assert ts.make_room("run", 2, session_max=100, ended=ended) == ["older"]
    assert (ts.total, "older" in ts.counts, ts.fit("run", 2, 100)) == (7, False, 2)
    assert ts.records("older").result(5) == []
    assert ts.make_room("run", 1, session_max=100, ended=[]) == []  # room already


def test_retention_and_the_kept_count(store: Store) -> None:
    ts = TraceStore(store, MAX_TOTAL, 3600)
    now = 100 * HOUR_NS
    ended = [("a", now - 2 * HOUR_NS), ("b", now - 60 * 10**9), ("c", now - 30 * 10**9), ("d", now)]
    assert ts.expired(ended, now, keep_max=10) == ["a"]
    assert ts.expired(ended, now, keep_max=2) == ["a", "b"]


def test_a_running_session_found_at_start_ended_as_node_lost(tmp_path: Path) -> None:
    db = str(tmp_path / "c.db")
    first = Store(db, 1000, 7)
    ts = TraceStore(first, *LIMITS)
    ts.save(session("t-run"))
    ts.save(session("t-done", TraceStatus.COMPLETED, ended=time.time_ns()))
    add(ts, "t-run", 1, 4)
    first.close()  # as a crash leaves it: nobody ended t-run
    again = Store(db, 1000, 7)
    try:
        ts2 = TraceStore(again, *LIMITS)
        loaded = {s.id: s for s in ts2.load()}
        assert (loaded["t-run"].status, loaded["t-run"].status_detail) == (TraceStatus.NODE_LOST, RESTARTED)
        assert loaded["t-run"].ended_unix_ns > 0 and loaded["t-done"].status is TraceStatus.COMPLETED
        assert (ts2.counts, ts2.total) == ({"t-run": 4}, 4)
        audit = ts2.audit_rows("t-run").result(5)
        assert [(e.action, e.who, e.detail) for e in audit] == [("node-lost", "collector", RESTARTED)]
        assert {s.id: s.status for s in ts2.load()}["t-run"] is TraceStatus.NODE_LOST  # written
    finally:
        again.close()


def test_audit_rows_filter_and_order(store: Store) -> None:
    ts = TraceStore(store, *LIMITS)
    ts.audit("", "refused", "ipv4:127.0.0.1:1", "ml: namespace ml not found", ts_unix_ns=10)
    ts.audit("t-1", "start", "uid 0 (claimed)", "ml for 30s on n1", ts_unix_ns=20)
    ts.audit("t-1", "stop", "uid 0 (claimed)", "stopped by uid 0 (claimed)", ts_unix_ns=30)
    assert [e.action for e in ts.audit_rows().result(5)] == ["refused", "start", "stop"]
    assert [e.action for e in ts.audit_rows("t-1").result(5)] == ["start", "stop"]
    assert [e.action for e in ts.audit_rows(limit=1).result(5)] == ["stop"]
    assert [e.ts_unix_ns for e in ts.audit_rows(since_unix_ns=15).result(5)] == [20, 30]
    ts.prune_audit(before_unix_ns=25)
    assert [e.action for e in ts.audit_rows().result(5)] == ["stop"]


def test_deleting_sessions_frees_the_bound_and_the_rows(store: Store) -> None:
    ts = TraceStore(store, 5, RETENTION_S)
    ts.save(session("t-1"))
    add(ts, "t-1", 1, 5)
    ts.delete(["t-1"])
    assert (ts.total, ts.fit("t-2", 5, 100)) == (0, 5)
    assert ts.load() == [] and store.read(
        lambda c: c.execute("SELECT COUNT(*) FROM trace_records").fetchone()[0]).result(5) == 0


def test_a_failing_write_function_does_not_stop_the_writer(store: Store) -> None:
    def broken(conn: object) -> None:
        raise RuntimeError("a bug")

    store.submit([Store.op_call(broken)])
    ts = TraceStore(store, *LIMITS)
    ts.save(session("t-1"))
    assert [s.id for s in ts.load()] == ["t-1"] and store.failed is None
