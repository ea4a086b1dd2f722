"""Trace sessions and their home replica, the SQL on SQLite (collector/trace_homes.py): the sessions of a
home that is gone ended once, past their deadline, by the replica that claims them, which becomes the
row's home; the old home's later writes leave such a row alone (collector/trace_store.py). Replicas on
a real PostgreSQL, the stop handed to the home and a follower that ends:
tests/integration/test_trace_homes_pg.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.collector.store import Store
from ghostgpu.collector.trace_homes import end_orphans, select_session, select_sessions
from ghostgpu.collector.trace_store import TraceStore

from ghostgpu.common.model.trace import TraceScope, TraceSession, TraceStatus

NOW = 1_700_000_000 * 10**9
AFTER_NS = 35 * 10**9  # the end grace and HOME_GONE_GRACE_S, as TraceHomes passes them


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(str(tmp_path / "c.db"), event_log_max=1000, retention_days=7)
    yield s
    s.close()


def _session(sid: str, deadline_unix_ns: int, ended: bool = False) -> TraceSession:
    s = TraceSession(id=sid, scope=TraceScope(namespace="ml"), requested_by="user:alice",
                     started_unix_ns=deadline_unix_ns - 60 * 10**9, deadline_unix_ns=deadline_unix_ns,
                     status=TraceStatus.RUNNING, max_records=100)
    return s.ended(TraceStatus.COMPLETED, "deadline", deadline_unix_ns) if ended else s


def _save(store: Store, s: TraceSession, home: str) -> None:
    """The row as the replica `home` writes it (SQLite's TraceStore is every session's home, "")."""
    trace_store = TraceStore(store, 1000, 3600)
    trace_store.home = home
    trace_store.save(s)
    store.barrier().result(5)


def _rw(store: Store, fn: Any, **kw: Any) -> Any:
    return store.read_write(lambda conn: fn(conn, **kw)).result(5)


def test_only_other_homes_running_sessions_past_their_deadline_are_ended_once(store: Store) -> None:
    old, recent = NOW - AFTER_NS - 1, NOW - AFTER_NS + 10**9
    _save(store, _session("t-gone", old), "x")
    _save(store, _session("t-mine", old), "me")  # this replica's own: its tick ends it
    _save(store, _session("t-young", recent), "x")  # its home may still end it
    _save(store, _session("t-over", old, ended=True), "x")
    _save(store, _session("t-legacy", old), "")  # written before schema 3: its home unknown

    ended = _rw(store, end_orphans, replica="me", after_deadline_ns=AFTER_NS, now_unix_ns=NOW)
    assert sorted((s.id, home) for s, home in ended) == [("t-gone", "x"), ("t-legacy", "")]
    s, home = store.read(lambda conn: select_session(conn, "t-gone")).result(5)
    assert (s.status, s.ended_unix_ns, home) == (TraceStatus.NODE_LOST, NOW, "me")  # the row is now "me"'s
    assert s.status_detail == ("home replica x gone: no end 35 s past the deadline, ended by replica me; "
                               "records so far are kept")
    legacy, _ = store.read(lambda conn: select_session(conn, "t-legacy")).result(5)
    assert "home replica (unknown: a row of an older schema) gone" in legacy.status_detail
    by_id = {s.id: s for s in store.read(select_sessions).result(5)}
    assert {sid: s.status for sid, s in by_id.items()} == {
        "t-gone": TraceStatus.NODE_LOST, "t-mine": TraceStatus.RUNNING, "t-young": TraceStatus.RUNNING,
        "t-over": TraceStatus.COMPLETED, "t-legacy": TraceStatus.NODE_LOST}
    audit = store.read(lambda conn: conn.execute(
        "SELECT session, action, who, detail FROM trace_audit ORDER BY id").fetchall()).result(5)
    assert [(sid, action, who) for sid, action, who, _ in audit] == [
        ("t-gone", "node-lost", "collector"), ("t-legacy", "node-lost", "collector")]
    assert audit[0][3] == s.status_detail

    # looked for again: nothing more to end, and the audit rows stay one per session
    assert _rw(store, end_orphans, replica="me", after_deadline_ns=AFTER_NS, now_unix_ns=NOW + 1) == []
    count = store.read(lambda conn: conn.execute("SELECT COUNT(*) FROM trace_audit").fetchone()[0])
    assert count.result(5) == 2


def test_the_old_home_coming_back_writes_a_row_taken_over_no_more(store: Store) -> None:
    running = _session("t-1", NOW - AFTER_NS - 1)
    _save(store, running, "x")
    _rw(store, end_orphans, replica="me", after_deadline_ns=AFTER_NS, now_unix_ns=NOW)
    _save(store, running, "x")  # x was only cut off: its counters flushed, then its own end
    _save(store, running.ended(TraceStatus.COMPLETED, "deadline", NOW + 5), "x")
    s, home = store.read(lambda conn: select_session(conn, "t-1")).result(5)
    assert (s.status, home) == (TraceStatus.NODE_LOST, "me")
    _save(store, s.ended(TraceStatus.NODE_LOST, "kept here", NOW), "me")  # its new home writes it
    assert store.read(lambda conn: select_session(conn, "t-1")).result(5)[0].status_detail == "kept here"
    _save(store, _session("t-2", NOW), "")  # SQLite's one collector, its rows "": as ever
    _save(store, _session("t-2", NOW, ended=True), "")
    assert store.read(lambda conn: select_session(conn, "t-2")).result(5)[0].status == TraceStatus.COMPLETED
