"""Trace sessions in SQLite: the sessions, their records and the audit trail, bounded.

Three tables (schema in collector/store.py): `trace_sessions` (one row per session: its
ghostgpu.v1.TraceSession serialized), `trace_records` (one row per TraceBatch as it came, names
filled in, zlib-compressed: the records of one session on one node repeat their names, paths and
comms) and `trace_audit` (who started, stopped, lost or was refused what, and when).

Writes go through the collector's Store (one writer thread, group commit) as `Store.op_call`
functions, so compression runs on the writer thread, not on the event loop. The bounds are kept
here, in memory, on the event loop: how many records each session has stored and how many all
have together. `fit()` says how many of a batch's records may be stored; the rest are counted by
the caller (collector/traces.py) in the session's dropped_store_total, never lost silently.
Ended sessions go `retention_s` after their end, or earlier, oldest first, when the total bound
needs room for a running session (the session and its records go whole; the audit rows stay, and
live as long as the findings history: the Store's retention).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future

from ghostgpu.collector.db import Conn, upsert_sql
from ghostgpu.collector.notify import trace_announcer
from ghostgpu.collector.store import CallOp, Store, decode_blob, encode_blob

from ghostgpu.common.model.trace import TraceSession, TraceStatus
from ghostgpu.common.wire.convert_trace import session_from_proto, session_to_proto
from ghostgpu.v1 import trace_pb2

log = logging.getLogger(__name__)

# A session's row is its home's to write. A replica that ended the session of a home that was gone
# took the row over (home = itself: collector/trace_homes.py), and the old home, if it comes back,
# leaves it alone. "" is SQLite's one collector, and rows written before schema 3 (anyone's).
_UPSERT_SESSION = (upsert_sql("trace_sessions", ("id", "started_unix_ns", "ended_unix_ns", "session", "home"),
                              ("id",))
                   + " WHERE trace_sessions.home = excluded.home OR trace_sessions.home = ''")
RESTARTED = "collector restarted while it ran; records so far are kept"
RecordRow = tuple[str, int, bytes]  # node, codec, blob (a serialized TraceBatch)


def _records_sql(session: str) -> Callable[[Conn], list[RecordRow]]:
    def run(conn: Conn) -> list[RecordRow]:
        rows: list[RecordRow] = conn.execute("SELECT node, codec, blob FROM trace_records WHERE session = ? "
                                             "ORDER BY id", (session,)).fetchall()
        return rows

    return run


def decode_records(rows: Iterable[RecordRow]) -> list[trace_pb2.TraceRecord]:
    """The records of stored rows, in stored order (per node, by seq). Off the loop: it parses."""
    out: list[trace_pb2.TraceRecord] = []
    for _node, codec, blob in rows:
        out.extend(trace_pb2.TraceBatch.FromString(decode_blob(codec, blob)).records)
    return out


def select_audit(session: str = "", since_unix_ns: int = 0,
                 limit: int = 1000) -> Callable[[Conn], list[trace_pb2.TraceAuditEntry]]:
    """A read for Store.read(): audit rows (of one session, or all), at or after `since`, the newest
    `limit` of them, oldest first. What a future `ghostgpu trace audit` would print."""
    where = ["ts_unix_ns >= ?"]
    args: list[int | str] = [since_unix_ns]
    if session:
        where.append("session = ?")
        args.append(session)
    sql = (f"SELECT ts_unix_ns, session, action, who, detail FROM trace_audit WHERE {' AND '.join(where)} "
           "ORDER BY id DESC LIMIT ?")

    def run(conn: Conn) -> list[trace_pb2.TraceAuditEntry]:
        rows = conn.execute(sql, (*args, limit)).fetchall()
        return [trace_pb2.TraceAuditEntry(ts_unix_ns=ts, session=s, action=a, who=w, detail=d)
                for ts, s, a, w, d in reversed(rows)]

    return run


class TraceStore:
    """The trace tables and their bounds; every method but the loaders runs on the event loop."""

    def __init__(self, store: Store, max_total: int, retention_s: float) -> None:
        """max_total: records of all sessions together (--trace-store-max-records); retention_s: how
        long an ended session is kept (--trace-retention-h); collector/config.py holds both defaults."""
        if max_total < 0 or retention_s <= 0:
            raise ValueError("TraceStore: max_total must be 0 or more, retention_s more than 0")
        self.store = store
        self.max_total = max_total
        self.retention_s = retention_s
        self.counts: dict[str, int] = {}  # session -> records stored
        self.total = 0
        # Also told of every audit row (the collector's audit log, collector/audit.py): session,
        # action, who, detail.
        self.on_audit: Callable[[str, str, str, str], object] | None = None
        # A shared PostgreSQL store: a session's row and records are announced on ghostgpu_trace in
        # their transaction (collector/notify.py), so a WatchTrace on any replica reads them at once
        # (collector/trace_follow.py).
        self.announce: Callable[[str], CallOp] | None = (
            trace_announcer(store.replica_id) if store.engine == "postgresql" else None)
        # The replica whose sessions these are ("" with SQLite: one collector runs them all).
        self.home = store.replica_id if store.engine == "postgresql" else ""

    # ---- start-up ------------------------------------------------------------------------------

    def load(self) -> list[TraceSession]:
        """The kept sessions (blocking: call before serving). A session of this collector's still
        running in the table ran when it stopped: nobody received its end, so it ends now as node
        lost, with an audit row, and its records are kept. Another replica's running session is its
        home's to end: not loaded (WatchTrace and `trace show` read it from the store)."""
        rows, counts = self.store.read(_load).result()
        self.counts = counts
        self.total = sum(counts.values())
        now = time.time_ns()
        out = []
        for blob, home in rows:
            s = session_from_proto(trace_pb2.TraceSession.FromString(blob))
            if not s.status.ended and home not in ("", self.home):
                continue
            if not s.status.ended:
                s = s.ended(TraceStatus.NODE_LOST, RESTARTED, now)
                self.save(s)
                self.audit(s.id, "node-lost", "collector", RESTARTED, now)
            out.append(s)
        return out

    # ---- writes --------------------------------------------------------------------------------

    def save(self, s: TraceSession) -> None:
        row = (s.id, s.started_unix_ns, s.ended_unix_ns, session_to_proto(s).SerializeToString(), self.home)

        def run(conn: Conn) -> None:
            conn.execute(_UPSERT_SESSION, row)

        self.store.submit([Store.op_call(run), *self._announced(s.id)])

    def _announced(self, session: str) -> list[CallOp]:
        return [self.announce(session)] if self.announce is not None else []

    def audit(self, session: str, action: str, who: str, detail: str, ts_unix_ns: int = 0) -> Future[None]:
        """Queue a trace_audit row; the future is done once it is committed (or failed: the store logs
        and counts that), for a caller whose answer must not outrun its audit row."""
        row = (ts_unix_ns or time.time_ns(), session, action, who, detail)
        if self.on_audit is not None:
            self.on_audit(session, action, who, detail)

        def run(conn: Conn) -> None:
            conn.execute("INSERT INTO trace_audit (ts_unix_ns, session, action, who, detail) "
                         "VALUES (?, ?, ?, ?, ?)", row)

        committed: Future[None] = Future()
        self.store.submit([Store.op_call(run)], done=lambda _error: committed.set_result(None))
        return committed

    def fit(self, session: str, n: int, session_max: int) -> int:
        """How many of n new records of `session` the per-session and total bounds let in."""
        room = min(session_max - self.counts.get(session, 0), self.max_total - self.total)
        return max(0, min(n, room))

    def add(self, session: str, node: str, first_seq: int, last_seq: int, count: int, blob: bytes) -> None:
        """Store `count` records (a serialized TraceBatch); the caller asked fit() first."""
        self.counts[session] = self.counts.get(session, 0) + count
        self.total += count

        def run(conn: Conn) -> None:
            conn.execute("INSERT INTO trace_records (session, node, first_seq, last_seq, count, codec, blob) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?)",
                         (session, node, first_seq, last_seq, count, *encode_blob(blob)))

        self.store.submit([Store.op_call(run), *self._announced(session)], size_bytes=len(blob))

    def make_room(self, session: str, n: int, session_max: int,
                  ended: Iterable[tuple[str, int]]) -> list[str]:
        """When the total bound alone keeps n records of a running session out: delete the oldest
        ended sessions (`ended`: (id, ended_unix_ns)) until they fit; the ids deleted."""
        need = self.total + min(n, session_max - self.counts.get(session, 0)) - self.max_total
        gone: list[str] = []
        for sid, _ in sorted(ended, key=lambda e: e[1]):
            if need <= 0:
                break
            if count := self.counts.get(sid, 0):
                need -= count
                gone.append(sid)
        self.delete(gone)
        return gone

    def expired(self, ended: Iterable[tuple[str, int]], now_unix_ns: int, keep_max: int) -> list[str]:
        """The ended sessions past retention, and the oldest past `keep_max` kept ones."""
        by_end = sorted(ended, key=lambda e: e[1])
        cutoff = now_unix_ns - int(self.retention_s * 1e9)
        old = [sid for sid, at in by_end if at < cutoff]
        rest = by_end[len(old):]
        return old + [sid for sid, _ in rest[:max(0, len(rest) - keep_max)]]

    def delete(self, sessions: Iterable[str]) -> None:
        """Forget sessions and their records (retention, or room for a running session)."""
        ids = [(sid,) for sid in sessions]
        for (sid,) in ids:
            self.total -= self.counts.pop(sid, 0)
        if not ids:
            return

        def run(conn: Conn) -> None:
            conn.executemany("DELETE FROM trace_records WHERE session = ?", ids)
            conn.executemany("DELETE FROM trace_sessions WHERE id = ?", ids)

        self.store.submit([Store.op_call(run)])

    def prune_audit(self, before_unix_ns: int) -> None:
        def run(conn: Conn) -> None:
            conn.execute("DELETE FROM trace_audit WHERE ts_unix_ns < ?", (before_unix_ns,))

        self.store.submit([Store.op_call(run)])

    # ---- reads ---------------------------------------------------------------------------------

    def records(self, session: str) -> Future[list[RecordRow]]:
        """The stored rows of a session (after every write queued before this call)."""
        return self.store.read(_records_sql(session))

    def audit_rows(self, session: str = "", since_unix_ns: int = 0,
                   limit: int = 1000) -> Future[list[trace_pb2.TraceAuditEntry]]:
        return self.store.read(select_audit(session, since_unix_ns, limit))


def _load(conn: Conn) -> tuple[list[tuple[bytes, str]], dict[str, int]]:
    # Records whose session row is gone (none should be: both go in one transaction) would hold
    # room in the total bound for nobody: drop them.
    conn.execute("DELETE FROM trace_records WHERE session NOT IN (SELECT id FROM trace_sessions)")
    rows = [(r[0], r[1]) for r in conn.execute("SELECT session, home FROM trace_sessions "
                                               "ORDER BY started_unix_ns")]
    counts = dict(conn.execute("SELECT session, SUM(count) FROM trace_records GROUP BY session").fetchall())
    return rows, counts
