"""Trace sessions across collector replicas: a stop handed to the session's home, every replica's
sessions listed, and the sessions of a home replica that is gone ended.

    homes = TraceHomes(trace_store, replica, timing, stop_here=book.stop_for_home)
    stored = await homes.session("t-1a2b3c4d")   # (TraceSession, home replica) as stored, or None
    s = await homes.stop(session, home, "user:alice")   # on the replica the user called
    ended = await homes.end_orphans()            # from the trace book's tick

A session lives at its home, the replica the user called to start it (collector/traces.py): the
policy, the audit, the trace_sessions row (its `home` column names the replica), the deadline and the
end are the home's. A `trace stop` may reach any replica. That replica checks the caller's
authorization and the policy against the session as stored and audits the stop, as it would for a
start; then it hands the stop to the home as a replica command addressed to the home itself
(`@HOME`, collector/replica_commands.py), and the home stops the session as if it had been called:
its tracers are told to stop, their last batches waited for, the session ended as stopped by the
caller. The home answers with the session as it ended. The home's handler does not audit again.

A home that is gone (SIGKILLed, its node failed) leaves its running sessions' rows running: nobody
else ends them, and the WatchTrace followers on the other replicas (collector/trace_follow.py)
would wait for ever. So each replica, every `home_gone_check_s` (collector/trace_commands.py
TraceTiming), reads the running sessions of other homes and ends those past their deadline by more
than the end grace and HOME_GONE_GRACE_S, as node lost, "home replica X gone", with an audit row.
Every replica may find the same session: the claim is `UPDATE trace_sessions ... WHERE id = ? AND
ended_unix_ns = 0`, whose row lock makes the other replicas' UPDATEs see the row ended (PostgreSQL's
READ COMMITTED re-checks the WHERE on the row as committed), so exactly one of them ends it and
audits. The claim also makes that replica the row's home, so the old home, if it was only cut off
and comes back, writes the row no more (collector/trace_store.py). The tracers stop at the deadline
themselves, and the guests on the replicas serving the nodes forget their parts past it
(collector/trace_guests.py): nothing else is left to end.

A stop whose home does not take it within a sweep (hop_s) fails at once, naming the home: the
session then ends at its deadline, or HOME_GONE_GRACE_S after it by any replica.

Everything here runs on the collector's event loop; the SQL runs on the store's writer thread. Only
with a shared PostgreSQL store: with SQLite one collector is every session's home.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TypeVar

import grpc
from ghostgpu.collector.db import Conn, db_errors
from ghostgpu.collector.notices import TRACE_CHANNEL, encode_trace
from ghostgpu.collector.replica_commands import ReplicaCommand, ReplicaCommandError, ReplicaCommands
from ghostgpu.collector.store import StoreError
from ghostgpu.collector.trace_commands import TraceTiming, line_error
from ghostgpu.collector.trace_scope import TraceError
from ghostgpu.collector.trace_store import TraceStore

from ghostgpu.common.model.trace import TraceSession, TraceStatus
from ghostgpu.common.wire.convert_trace import session_from_proto, session_to_proto
from ghostgpu.v1 import trace_pb2

log = logging.getLogger(__name__)

HOME_STOP = "trace_home_stop"  # the replica command: stop a session at its home
# Past a session's deadline and the end grace (when its home ends it at the latest), how long the
# other replicas wait before ending it for a home that is gone. Generous: a home whose store was out
# of reach for a while ends its sessions once it is back, and a session ended here for a home that was
# only slow would end as node lost rather than completed.
HOME_GONE_GRACE_S = 30.0
StoredSession = tuple[TraceSession, str]  # the session as stored, its home replica ("" before schema 3)
_STORE_ERRORS: tuple[type[BaseException], ...] = (*db_errors(), StoreError)
_T = TypeVar("_T")


def _decode(blob: bytes) -> TraceSession:
    return session_from_proto(trace_pb2.TraceSession.FromString(bytes(blob)))


# ---- the SQL (Store.read / Store.read_write functions; portable) ------------------------------------------


def select_session(conn: Conn, sid: str) -> StoredSession | None:
    row = conn.execute("SELECT session, home FROM trace_sessions WHERE id = ?", (sid,)).fetchone()
    return (_decode(row[0]), row[1]) if row is not None else None


def select_sessions(conn: Conn) -> list[TraceSession]:
    """Every replica's sessions, running and kept (decoded here, on the writer thread)."""
    return [_decode(blob) for (blob,) in conn.execute("SELECT session FROM trace_sessions")]


def end_orphans(conn: Conn, replica: str, after_deadline_ns: int, now_unix_ns: int) -> list[StoredSession]:
    """End, in one transaction, the running sessions of other homes whose deadline is more than
    `after_deadline_ns` past: node lost, claimed by a conditional UPDATE (this replica becomes the
    row's home), a trace_audit row and a ghostgpu_trace notice each. The sessions ended here, with the
    home each had."""
    rows = conn.execute("SELECT id, session, home FROM trace_sessions WHERE ended_unix_ns = 0 AND home <> ? "
                        "AND started_unix_ns <= ?", (replica, now_unix_ns - after_deadline_ns)).fetchall()
    out = []
    for sid, blob, home in rows:
        s = _decode(blob)
        if s.status.ended or s.deadline_unix_ns + after_deadline_ns > now_unix_ns:
            continue
        gone = home or "(unknown: a row of an older schema)"
        detail = (f"home replica {gone} gone: no end {after_deadline_ns / 1e9:g} s past the deadline, "
                  f"ended by replica {replica}; records so far are kept")
        ended = s.ended(TraceStatus.NODE_LOST, detail, now_unix_ns)
        claimed = conn.execute(
            "UPDATE trace_sessions SET ended_unix_ns = ?, session = ?, home = ? "
            "WHERE id = ? AND ended_unix_ns = 0",
            (now_unix_ns, session_to_proto(ended).SerializeToString(), replica, sid)).rowcount == 1
        if not claimed:
            continue  # another replica ended it (or its home did) since the SELECT
        conn.execute("INSERT INTO trace_audit (ts_unix_ns, session, action, who, detail) "
                     "VALUES (?, ?, ?, ?, ?)", (now_unix_ns, sid, "node-lost", "collector", detail))
        if not isinstance(conn, sqlite3.Connection):  # WatchTrace followers everywhere: it ended
            conn.execute("SELECT pg_notify(?, ?)", (TRACE_CHANNEL, encode_trace(replica, sid)))
        out.append((ended, home))
    return out


# ---- the replicas' side ------------------------------------------------------------------------------


class TraceHomes:
    """See the module docstring. `stop_here(session, who)`: the trace book's stop of a session it is
    the home of, without its audit row (the caller's replica wrote it); TraceError when it is not."""

    def __init__(self, store: TraceStore, replica: ReplicaCommands, timing: TraceTiming,
                 stop_here: Callable[[str, str], Awaitable[TraceSession]]) -> None:
        self.store = store
        self.replica = replica
        self.timing = timing
        self.stop_here = stop_here
        replica.handle(HOME_STOP, self._stop_request)

    async def session(self, sid: str) -> StoredSession | None:
        """The session and its home as stored now; None when there is no such session."""
        return await self._read(partial(select_session, sid=sid))

    async def sessions(self) -> list[TraceSession]:
        """Every replica's sessions as stored."""
        return await self._read(select_sessions)

    async def _read(self, fn: Callable[[Conn], _T]) -> _T:
        """A store read; UNAVAILABLE (TraceError) while the database is out of reach."""
        try:
            return await asyncio.wrap_future(self.store.store.read(fn))
        except _STORE_ERRORS as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TraceError(grpc.StatusCode.UNAVAILABLE, f"cannot read the trace sessions from "
                             f"{self.store.store.url.flag} ({first}); try again") from None

    # ---- a stop ---------------------------------------------------------------------------------------

    async def stop(self, s: TraceSession, home: str, who: str) -> TraceSession:
        """On the replica the user called: the stop of a running session whose home is `home`, handed
        to it; the session as it ended there. TraceError naming the home when it did not."""
        me, t, hop_s = self.replica.replica_id, self.timing, self.replica.timing.hop_s
        # The home's stop: its tracers' answers (each maybe through another replica), then their last
        # batches; two hops more for the row and its answer.
        wait_s = t.command_timeout_s + t.end_grace_s + 3 * hop_s
        try:
            raw = await self.replica.send(f"@{home}", HOME_STOP, b"", wait_s, {"session": s.id, "who": who},
                                          claim_s=hop_s)
        except ReplicaCommandError as e:
            why = line_error(e.line)
            self.store.audit(s.id, "error", who, f"stop by {who} at replica {me} not done: {why.line}")
            if e.answered is None:  # nobody took it: the home is gone or cut off
                raise TraceError(why.code, f"trace session {s.id}: {why.line}; it is the session's home: the "
                                 f"session ends at its deadline, or {HOME_GONE_GRACE_S:g} s after it by any "
                                 "replica") from None
            raise why from None
        # Committed before the answer (the caller may read the audit through any replica next), unless
        # the database went away meanwhile: the row is still queued, the answer is not held for it.
        audited = self.store.audit(s.id, "stop", who,
                                   f"stopped by {who} at replica {me}, ended by its home {home}")
        await asyncio.wait([asyncio.wrap_future(audited)], timeout=wait_s)
        return session_from_proto(trace_pb2.TraceSession.FromString(raw))

    async def _stop_request(self, cmd: ReplicaCommand) -> bytes:
        """At the home: another replica's stop of one of its sessions (the caller checked and audited)."""
        sid, who = str(cmd.meta.get("session", "")), str(cmd.meta.get("who", ""))
        if not sid or not who:
            raise ReplicaCommandError(f"invalid: replica {cmd.from_replica} sent a {HOME_STOP} without a "
                                      "session or a caller")
        try:
            s = await self.stop_here(sid, who)
        except TraceError as e:
            prefix = "not found: " if e.code == grpc.StatusCode.NOT_FOUND else ""
            raise ReplicaCommandError(prefix + e.line) from None
        return session_to_proto(s).SerializeToString()

    # ---- sessions of a home that is gone ------------------------------------------------------------------

    async def end_orphans(self) -> list[TraceSession]:
        """End the sessions whose home is gone (see the module docstring); the ones this replica ended."""
        after_ns = int((self.timing.end_grace_s + HOME_GONE_GRACE_S) * 1e9)
        ended = await asyncio.wrap_future(self.store.store.read_write(partial(
            end_orphans, replica=self.replica.replica_id, after_deadline_ns=after_ns,
            now_unix_ns=time.time_ns())))
        for s, home in ended:
            log.warning("trace session %s: its home replica %s is gone; ended here as node lost",
                        s.id, home or "(unknown)")
            if self.store.on_audit is not None:  # the collector's audit log; trace_audit has its row
                self.store.on_audit(s.id, "node-lost", "collector", s.status_detail)
        return [s for s, _ in ended]
