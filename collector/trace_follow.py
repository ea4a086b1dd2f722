"""WatchTrace of a session this replica does not run: its records and its end, read from the store.

    follow = TraceFollow(store, notifier)         # subscribes to ghostgpu_trace
    s = await follow.session("t-1a2b3c4d")        # the TraceSession as stored, or None
    async for msg in follow.watch("t-1a2b3c4d", follow=True): ...

With replicas sharing a PostgreSQL store, a trace session runs on one replica (the one that started
it; its records come in on the streams of the nodes it traces), and its watchers on that replica are
fed from memory (collector/trace_watch.py). A WatchTrace that reaches any other replica is answered
here, and on the replica that runs it too (its nodes' records may be stored by other replicas:
collector/trace_guests.py): the session's trace_records rows not sent yet, then, following, the same
again at each ghostgpu_trace notification naming the session (collector/trace_store.py sends one in
the transaction of each batch and of each change of the session's row), until the session's row says
it ended. A node's rows are inserted by the one replica its stream is on, from that replica's one
writer thread, so per node their ids grow in commit order, and "after the last id sent of that node"
misses none (ids of different replicas' transactions need not commit in order). Each message
carries the session's row as read with its records; the last one carries the end.

A follower that reads slowly only reads later (nothing queues here), so, unlike a live watcher, it is
never dropped. A notification lost while the listener reconnects is made up for by the resync the
notifier sends afterwards, and a read every POLL_S whatever happens. Runs on the collector's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping

import grpc
from ghostgpu.collector.db import Conn
from ghostgpu.collector.notices import TRACE_CHANNEL, NoticeError, decode_trace
from ghostgpu.collector.notify import Notifications
from ghostgpu.collector.store import Store
from ghostgpu.collector.trace_scope import TraceError
from ghostgpu.collector.trace_store import decode_records
from ghostgpu.collector.trace_watch import CHUNK_RECORDS, ROWS_PER_DECODE

from ghostgpu.common.model.trace import TraceSession
from ghostgpu.common.wire.convert_trace import session_from_proto
from ghostgpu.v1 import trace_pb2

ROWS_PER_READ = 256  # stored batches per read: a long session is sent in steps, never held whole
POLL_S = 5.0  # read again this often without a notification (a safety net, not the path)
StoredRow = tuple[int, str, int, bytes]  # id, node, codec, blob


def select_after(session: str, after: Mapping[str, int],
                 limit: int) -> Callable[[Conn], tuple[bytes | None, list[StoredRow]]]:
    """A read for Store.read(): the session's row (None once it is gone), then its record rows not
    sent yet, the first `limit` of them by id: of each node in `after` those after its last id sent,
    of every other node all. The row first: records committed before an end it shows are all in the
    second read."""
    where = "session = ?"
    args: list[str | int] = [session]
    if after:
        nodes = sorted(after)
        where += (f" AND (node NOT IN ({', '.join('?' * len(nodes))})"
                  + " OR (node = ? AND id > ?)" * len(nodes) + ")")
        args += [*nodes, *(x for n in nodes for x in (n, after[n]))]
    sql = f"SELECT id, node, codec, blob FROM trace_records WHERE {where} ORDER BY id LIMIT ?"

    def run(conn: Conn) -> tuple[bytes | None, list[StoredRow]]:
        row = conn.execute("SELECT session FROM trace_sessions WHERE id = ?", (session,)).fetchone()
        if row is None:
            return None, []
        rows = conn.execute(sql, (*args, limit)).fetchall()
        return bytes(row[0]), [(i, node, codec, bytes(blob)) for i, node, codec, blob in rows]

    return run


class TraceFollow:
    """See the module docstring; every method runs on the collector's event loop."""

    def __init__(self, store: Store, notifier: Notifications) -> None:
        self.store = store
        self._wakers: dict[str, set[asyncio.Event]] = {}
        self._closing = False
        self._unsubscribe = notifier.subscribe(TRACE_CHANNEL, self._on_notice)

    def close(self) -> None:
        """The collector stops: every follower ends with UNAVAILABLE."""
        self._closing = True
        self._unsubscribe()
        for wakers in self._wakers.values():
            for w in wakers:
                w.set()

    def _on_notice(self, payload: str | None) -> None:
        if payload is None:  # the listener reconnected: every follower reads again
            sessions = list(self._wakers)
        else:
            try:
                sessions = [decode_trace(payload).session]
            except NoticeError:
                return  # another version's notice: the POLL_S read makes up for it
        for sid in sessions:
            for w in self._wakers.get(sid, ()):
                w.set()

    async def _read(self, sid: str, after: Mapping[str, int],
                    limit: int = ROWS_PER_READ) -> tuple[bytes | None, list[StoredRow]]:
        return await asyncio.wrap_future(self.store.read(select_after(sid, after, limit)))

    async def session(self, sid: str) -> TraceSession | None:
        """The session as stored now, None when there is no such session."""
        blob, _ = await self._read(sid, {}, 0)
        return session_from_proto(trace_pb2.TraceSession.FromString(blob)) if blob is not None else None

    async def watch(self, sid: str, follow: bool) -> AsyncIterator[trace_pb2.TraceWatchMessage]:
        """The stored records, then (following a running session) the new ones until it ends."""
        waker = asyncio.Event()
        if follow:
            self._wakers.setdefault(sid, set()).add(waker)
        try:
            async for msg in self._messages(sid, follow, waker):
                yield msg
        finally:
            if follow and (wakers := self._wakers.get(sid)) is not None:
                wakers.discard(waker)
                if not wakers:
                    del self._wakers[sid]

    async def _messages(self, sid: str, follow: bool,
                        waker: asyncio.Event) -> AsyncIterator[trace_pb2.TraceWatchMessage]:
        last_id: dict[str, int] = {}  # per node: the last row sent
        last_seq: dict[str, int] = {}
        sent_any = False
        while True:
            if self._closing:
                raise TraceError(grpc.StatusCode.UNAVAILABLE, "collector shutting down; watch again later "
                                 "(ghostgpu trace show ID shows what was stored)")
            waker.clear()  # before the read: a notification from here on means "read again"
            blob, rows = await self._read(sid, last_id)
            if blob is None:
                if not sent_any:
                    raise TraceError(grpc.StatusCode.NOT_FOUND,
                                     f"trace session {sid} not found (ghostgpu trace list)")
                return  # deleted meanwhile (retention, or room for a running session)
            current = trace_pb2.TraceSession.FromString(blob)
            sent = False
            if rows:
                for row_id, node, _, _ in rows:
                    last_id[node] = row_id
                async for msg in self._chunks(rows, current, last_seq):
                    sent = sent_any = True
                    yield msg
            if len(rows) == ROWS_PER_READ:
                continue  # more stored: read on before deciding anything
            ended = current.status != trace_pb2.TRACE_STATUS_RUNNING
            if not sent and (not sent_any or ended):  # the session's state at once, and its end
                sent_any = True
                yield trace_pb2.TraceWatchMessage(session=current)
            if ended or not follow:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waker.wait(), POLL_S)

    @staticmethod
    async def _chunks(rows: list[StoredRow], current: trace_pb2.TraceSession,
                      last_seq: dict[str, int]) -> AsyncIterator[trace_pb2.TraceWatchMessage]:
        for i in range(0, len(rows), ROWS_PER_DECODE):
            part = [(node, codec, blob) for _, node, codec, blob in rows[i:i + ROWS_PER_DECODE]]
            records = await asyncio.to_thread(decode_records, part)
            fresh = [r for r in records if r.seq > last_seq.get(r.node, 0)]
            for r in fresh:
                last_seq[r.node] = r.seq
            for j in range(0, len(fresh), CHUNK_RECORDS):
                yield trace_pb2.TraceWatchMessage(records=fresh[j:j + CHUNK_RECORDS], session=current)
