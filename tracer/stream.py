"""StreamSink: the tracer's records, streamed to the collector over NodeStream.Connect.

`emit()` sits on the tracer's hot path and never touches the network: under one lock it assigns
the next seq, keeps the node's state for the next Snapshot (the consumer table from finding and
resolved records, the latest info and allocations), and appends the typed record to the spool
(tracer/spool.py). One sender thread (tracer/stream_sender.py) does the rest: it encodes each record
straight to its NodeEvent bytes, batches, sends, resends after a reconnect and answers the
collector's commands.

The snapshot is taken under the lock that assigns seqs, so it reflects exactly the events up to its
seq; with the spool, a collector restart loses nothing. A spool overflow is counted, sent in
TracerStats and reported as a notice.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from ghostgpu.tracer.cri_relay import CommandRunner, CriRelay
from ghostgpu.tracer.spool import Spool
from ghostgpu.tracer.stream_sender import FLUSH_S, WINDOW_BATCHES, StreamOptions, StreamSender
from ghostgpu.tracer.stream_session import read_boot_id

from ghostgpu.common.model.consumers import Consumer, ConsumerKey
from ghostgpu.common.model.records import (
    STREAMED_KINDS,
    AllocationsRecord,
    AnyRecord,
    InfoRecord,
    JsonRecord,
    Record,
    record_from_json,
)
from ghostgpu.common.wire import protocol
from ghostgpu.common.wire.convert import snapshot_to_proto
from ghostgpu.v1 import stream_pb2

__all__ = ["FLUSH_S", "WINDOW_BATCHES", "StreamOptions", "StreamSink"]

log = logging.getLogger("ghostgpu.stream")

TRACE_QUEUE_MAX = 256  # trace batches waiting for the stream (~512 records each): then they are counted lost
_STATE_KINDS = frozenset(("finding", "resolved", "info", "allocations"))  # what a Snapshot is made of


def _read_json(record: JsonRecord) -> AnyRecord:
    """A JSON record from a source that still writes JSON (the PodResources poller), read once here.
    One that cannot be read stays JSON and is spooled as it is: encode_event turns it into a notice
    that says why and keeps its seq."""
    try:
        return record_from_json(record)
    except (KeyError, TypeError, ValueError):
        return record


class StreamSink(StreamSender):
    """A Sink (emit/close) streaming to the collector at `target` (HOST:PORT or unix:///path)."""

    def __init__(self, target: str, node: str, *, relay: CriRelay | None = None,
                 capabilities: Iterable[str] = (), options: StreamOptions | None = None,
                 boot_id: str | None = None, ringbuf_dropped: Callable[[], int] | None = None) -> None:
        self.target = target
        self.node = node
        self.options = opts = options or StreamOptions()
        self.instance_id = uuid.uuid4().hex
        self.boot_id = read_boot_id() if boot_id is None else boot_id
        self._capabilities = [*(["cri-relay"] if relay is not None else []), *capabilities]
        self._backoff_s = opts.backoff_min_s
        self.ringbuf_dropped = ringbuf_dropped  # BPF ring-buffer drops for TracerStats; settable later
        # Everything below is guarded by _lock (emit, the sender, the receiver and stats()).
        self._lock = threading.Lock()
        self._seq = 0
        self._spool = Spool(opts.spool_events)
        self._first_pending_s = 0.0
        self._consumers: dict[ConsumerKey, Consumer] = {}
        self._info: InfoRecord | None = None
        self._allocations: AllocationsRecord | None = None
        self._max_batch = protocol.MAX_BATCH_EVENTS
        self._dropped_unreported = 0
        self._overflowing = self._connected = self._closed = False
        self._welcomes = self._connect_failures = self._events_sent = self._batches_sent = 0
        # Sender-thread state.
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._deadline_s = float("inf")
        self._down_logged = False
        self._refusal_logged = ""
        self._commands = CommandRunner(relay, node)
        self._trace_out: deque[bytes] = deque()  # TraceBatch messages, sent after the events before them
        self.on_reconnect: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._run, name="ghostgpu-stream", daemon=True)
        self._thread.start()

    # --- the Sink side (any thread) ---------------------------------------------------------

    def emit(self, record: AnyRecord, _bounded: bool = True) -> None:
        try:
            kind = record.event  # type: ignore[union-attr]
        except AttributeError:  # a JSON record: the typed records' hot path pays nothing for it
            kind = record.get("event")  # type: ignore[union-attr]
            if kind in STREAMED_KINDS:
                record = _read_json(record)  # type: ignore[arg-type]
        if kind not in STREAMED_KINDS:
            return
        # acquire/release rather than `with`: measurably cheaper on CPython 3.11, and this is per event.
        self._lock.acquire()
        try:
            if self._closed:
                return
            seq = self._seq = self._seq + 1
            if kind in _STATE_KINDS and type(record) is not dict:
                self._track(kind, record)  # type: ignore[arg-type]
            spool = self._spool
            wake = not spool.pending
            if wake:
                self._first_pending_s = time.monotonic()
            first_drop = False
            if spool.add(seq, record, _bounded):
                self._dropped_unreported += 1
                first_drop, self._overflowing = not self._overflowing, True
            if len(spool.pending) == self._max_batch:
                wake = True
        finally:
            self._lock.release()
        if wake:
            self._wake.set()  # once per batch, not per event: Event.set() takes a lock of its own
        if first_drop:
            log.warning("spool full (%d events): dropping the oldest until the collector at %s acknowledges",
                        spool.capacity, self.target)

    def emit_trace(self, message: stream_pb2.TracerMessage) -> bool:
        """Queue a trace session's batch; False when the queue is full (the caller counts the loss).
        It leaves only once every event emitted before it is on the stream (stream_sender._pump)."""
        data = message.SerializeToString()
        with self._lock:
            # A session's last batch is taken past the bound: it carries the end and the final counts.
            full = len(self._trace_out) >= TRACE_QUEUE_MAX and not message.trace.ended
            if self._closed or full:
                return False
            self._trace_out.append(data)
        self._wake.set()
        return True

    def set_trace_handler(self, handler: Callable[[stream_pb2.Command], Any] | None, unavailable: str = "",
                          ) -> None:
        """Who answers the collector's trace commands (None: they are answered with `unavailable`)."""
        self._commands.trace_handler = handler
        if unavailable:
            self._commands.trace_unavailable = unavailable
        self._commands.trace_ready.set()

    def set_reconnect_hook(self, hook: Callable[[], None]) -> None:
        """Called on the sender thread when a stream replaces a lost one (not for the first)."""
        self.on_reconnect = hook

    def _track(self, kind: str, record: Record) -> None:
        """What a Snapshot needs, kept as records arrive (under _lock, so it matches the seq)."""
        if kind == "finding":
            consumer = record.consumer  # type: ignore[union-attr]
            self._consumers[consumer.key] = consumer
        elif kind == "resolved":
            self._consumers.pop(record.consumer.key, None)  # type: ignore[union-attr]
        elif kind == "info":
            self._info = record  # type: ignore[assignment]
        else:
            self._allocations = record  # type: ignore[assignment]

    def _snapshot(self) -> stream_pb2.Snapshot:
        with self._lock:  # the same lock as seq assignment: the table reflects exactly seq
            seq, consumers = self._seq, list(self._consumers.values())
            info, allocations = self._info, self._allocations
        return snapshot_to_proto(seq, consumers, info, allocations, self._tracer_stats())

    def close(self) -> None:
        """Flush what the collector will take within close_deadline_s, then stop the sender."""
        if self._stopping.is_set():
            return
        self._deadline_s = time.monotonic() + self.options.close_deadline_s
        self._stopping.set()
        self._wake.set()
        self._thread.join(self.options.close_deadline_s + 2.0)
        self._commands.close()
        with self._lock:
            self._closed = True
            left = len(self._spool)
        if left:
            log.warning("closing with %d events the collector at %s has not acknowledged; they are lost",
                        left, self.target)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "last_seq": self._seq, "acked_seq": self._spool.acked, "spooled": len(self._spool),
                "dropped": self._spool.dropped_total, "reconnects": max(0, self._welcomes - 1),
                "connected": self._connected, "connect_failures": self._connect_failures,
                "events_sent": self._events_sent, "batches_sent": self._batches_sent,
                "commands_running": self._commands.running,
            }

    def _tracer_stats(self) -> stream_pb2.TracerStats:
        try:
            ringbuf = int(self.ringbuf_dropped()) if self.ringbuf_dropped is not None else 0
        except Exception:  # a stats read must never break the stream
            ringbuf = 0
        with self._lock:
            return stream_pb2.TracerStats(spool_events=len(self._spool),
                                          spool_dropped_total=self._spool.dropped_total,
                                          ringbuf_dropped_total=ringbuf,
                                          reconnects_total=max(0, self._welcomes - 1))

