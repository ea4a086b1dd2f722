"""A running session's live side: its part on each node, its watchers; and WatchTrace, which sends
a session's stored records, then its live ones, each message carrying the session.

The book (collector/traces.py) registers a `TraceWatcher` on a running session and queues the
read of the stored records in the same step of the event loop, so every batch is in one or the
other. The Store runs a read after the writes of its group, which may include batches queued
after the read: the overlap is cut by seq, which runs 1, 2, 3, ... per (session, node). A watcher
has a bounded queue: one that falls more than `max_records` behind is dropped (RESOURCE_EXHAUSTED)
rather than hold records for ever; the session goes on either way, as it does when a client
disconnects.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from ghostgpu.collector.trace_scope import Names, TraceError
from ghostgpu.collector.trace_store import RecordRow, decode_records

from ghostgpu.common.model.trace import TraceSession
from ghostgpu.v1 import trace_pb2

WATCH_MAX_RECORDS = 200_000  # queued per watcher before it is dropped
CHUNK_RECORDS = 1000  # records per message of the stored part (~0.5 MB)
ROWS_PER_DECODE = 64  # stored rows parsed per worker-thread hop


class TraceWatcher:
    """One following WatchTrace call: (records, session) items, newest last, and a wake-up."""

    def __init__(self, max_records: int = WATCH_MAX_RECORDS) -> None:
        self.max_records = max_records
        self.items: deque[tuple[Sequence[trace_pb2.TraceRecord], trace_pb2.TraceSession]] = deque()
        self.queued = 0
        self.wake = asyncio.Event()
        self.dropped = False
        self.closing = False

    def push(self, records: Sequence[trace_pb2.TraceRecord], session: trace_pb2.TraceSession) -> None:
        if self.dropped:
            return
        if self.queued + len(records) > self.max_records:
            self.dropped = True
            self.items.clear()
        else:
            self.items.append((records, session))
            self.queued += len(records)
        self.wake.set()

    def close(self) -> None:
        self.closing = True
        self.wake.set()


@dataclass
class NodePart:
    """A session on one node."""

    stream: Any  # the IngestSession it was started on (its end is this part's end); None once ended
    container_ids: frozenset[str]
    started: bool = False
    ended: bool = False
    end_reason: str = ""
    dropped_limit: int = 0  # the tracer's running totals, from its latest batch
    dropped_ringbuf: int = 0
    dropped_transport: int = 0
    stored: int = 0  # on a node another replica serves: what it stored and kept out, as it last said
    dropped_store: int = 0


@dataclass
class LiveSession:
    """A session started by this collector: its parts, names, watchers."""

    session: TraceSession
    names: dict[str, Names] = field(default_factory=dict)  # container id -> namespace, pod, container
    parts: dict[str, NodePart] = field(default_factory=dict)
    watchers: set[TraceWatcher] = field(default_factory=set)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    notes: dict[str, TraceError] = field(default_factory=dict)  # node -> why it is not in the session
    stopping_by: str = ""
    resolving: bool = False
    next_resolve: float = 0.0  # monotonic


async def watch_messages(rows: list[RecordRow], watcher: TraceWatcher | None,
                         session: Callable[[], trace_pb2.TraceSession],
                         ) -> AsyncIterator[trace_pb2.TraceWatchMessage]:
    """The stored rows in chunks, then (with a watcher) the live items until the session ends.
    `session()` is the session now; raises TraceError for a dropped watcher or a stopping collector."""
    last_seq: dict[str, int] = {}
    sent = False
    for i in range(0, len(rows), ROWS_PER_DECODE):
        records = await asyncio.to_thread(decode_records, rows[i:i + ROWS_PER_DECODE])
        for j in range(0, len(records), CHUNK_RECORDS):
            chunk = records[j:j + CHUNK_RECORDS]
            for r in chunk:
                last_seq[r.node] = max(last_seq.get(r.node, 0), r.seq)
            sent = True
            yield trace_pb2.TraceWatchMessage(records=chunk, session=session())
    if not sent:  # nothing stored yet: the client learns the session's state at once all the same
        yield trace_pb2.TraceWatchMessage(session=session())
    if watcher is None:
        return
    while True:
        if watcher.dropped:
            raise TraceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"this watch fell {watcher.max_records} records behind and was dropped; "
                             "the session goes on: ghostgpu trace show ID")
        if not watcher.items:
            if watcher.closing:
                raise TraceError(grpc.StatusCode.UNAVAILABLE, "collector shutting down; watch again later "
                                 "(ghostgpu trace show ID shows what was stored)")
            watcher.wake.clear()
            await watcher.wake.wait()
            continue
        live, current = watcher.items.popleft()
        watcher.queued -= len(live)
        fresh = [r for r in live if r.seq > last_seq.get(r.node, 0)]
        for r in fresh:
            last_seq[r.node] = r.seq
        ended = current.status != trace_pb2.TRACE_STATUS_RUNNING
        if fresh or ended:
            yield trace_pb2.TraceWatchMessage(records=fresh, session=current)
        if ended:
            return
