"""StreamSink: the tracer's records, streamed to the collector over NodeStream.Connect.

`emit()` sits on the tracer's hot path and never touches the network: under one lock it assigns
the next seq, keeps the node's state for the next Snapshot (the consumer table from finding and
resolved records, the latest info and allocations), and appends the typed record to the spool
(tracer/spool.py). One sender thread (`StreamSender`, tracer/stream_sender.py) does the rest: it
encodes each record straight to its NodeEvent bytes, batches, sends, resends after a reconnect and
answers the collector's commands. The sink and its sender share one `Outbox`: the spool, the seq
counter and the counters, under its lock.

The snapshot is taken under the lock that assigns seqs, so it reflects exactly the events up to its
seq; with the spool, a collector restart loses nothing. A spool overflow is counted, sent in
TracerStats and reported as a notice.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ghostgpu.tracer.cri_relay import CommandRunner, CriRelay
from ghostgpu.tracer.stream_sender import FLUSH_S, WINDOW_BATCHES, Outbox, StreamOptions, StreamSender
from ghostgpu.tracer.stream_session import read_boot_id

from ghostgpu.common.model.records import (
    STREAMED_KINDS,
    AllocationsRecord,
    ConsumerRecord,
    InfoRecord,
    Record,
)
from ghostgpu.common.wire.convert import snapshot_to_proto
from ghostgpu.v1 import stream_pb2

__all__ = ["FLUSH_S", "WINDOW_BATCHES", "StreamOptions", "StreamSink"]

log = logging.getLogger("ghostgpu.stream")

TRACE_QUEUE_MAX = 256  # trace batches waiting for the stream (~512 records each): then they are counted lost
_STATE_KINDS = frozenset(("finding", "resolved", "info", "allocations"))  # what a Snapshot is made of
# TracerStats fields the agent counts itself (StreamSink.counters)
_AGENT_COUNTERS = frozenset(("memory_objects_dropped_total", "kmsg_unparsed_total", "faults_dropped_total",
                             "kmsg_records_lost_total"))


class StreamSink:
    """A Sink (emit/close) streaming to the collector at `target`: HOST:PORT, unix:///path, or
    replicas (a DNS name, HOST:PORT,HOST:PORT,...; ghostgpu/common/transport/collector_target.py). A lost
    stream is retried on a fresh channel, where gRPC's pick_first takes the next live replica."""

    def __init__(self, target: str, node: str, *, relay: CriRelay | None = None,
                 capabilities: Iterable[str] = (), options: StreamOptions | None = None,
                 boot_id: str | None = None, ringbuf_dropped: Callable[[], int] | None = None,
                 counters: Callable[[], Mapping[str, int]] | None = None,
                 remediate: Callable[[stream_pb2.RemediateCommand], stream_pb2.RemediateResult] | None = None,
                 ) -> None:
        self.target = target
        self.node = node
        self.options = opts = options or StreamOptions()
        self.instance_id = uuid.uuid4().hex
        self.boot_id = read_boot_id() if boot_id is None else boot_id
        self.ringbuf_dropped = ringbuf_dropped  # BPF ring-buffer drops for TracerStats; settable later
        # The agent's own counters for TracerStats, by field name (memory_objects_dropped_total, ...);
        # settable later. A name TracerStats does not have is ignored.
        self.counters = counters
        self._out = Outbox(opts.spool_events)
        self._wake = threading.Event()  # the sender's: set once per batch by emit, by acks and by close()
        self._commands = CommandRunner(relay, node)
        # Remediation's act (tracer/remediate.py); the Hello's "remediation" capability is the
        # caller's to offer (tracer --remediation on).
        self._commands.remediate_handler = remediate
        capabilities = [*(["cri-relay"] if relay is not None else []), *capabilities]
        self._sender = StreamSender(target, node, opts, self._out, wake=self._wake, commands=self._commands,
                                    instance_id=self.instance_id, boot_id=self.boot_id,
                                    capabilities=capabilities, snapshot=self._snapshot,
                                    tracer_stats=self._tracer_stats, report=self._emit_unbounded)
        self._thread = threading.Thread(target=self._sender.run, name="ghostgpu-stream", daemon=True)
        self._thread.start()

    # --- the Sink side (any thread) ---------------------------------------------------------

    def emit(self, record: Record, _bounded: bool = True) -> None:
        kind = record.event
        if kind not in STREAMED_KINDS:
            return
        # acquire/release rather than `with`: measurably cheaper on CPython 3.11, and this is per event.
        out = self._out
        out.lock.acquire()
        try:
            if out.closed:
                return
            seq = out.seq = out.seq + 1
            if kind in _STATE_KINDS:
                _track(out, kind, record)
            spool = out.spool
            wake = not spool.pending
            if wake:
                out.first_pending_s = time.monotonic()
            first_drop = False
            if spool.add(seq, record, _bounded):
                out.dropped_unreported += 1
                first_drop, out.overflowing = not out.overflowing, True
            if len(spool.pending) == out.max_batch:
                wake = True
        finally:
            out.lock.release()
        if wake:
            self._wake.set()  # once per batch, not per event: Event.set() takes a lock of its own
        if first_drop:
            log.warning("spool full (%d events): dropping the oldest until the collector at %s acknowledges",
                        spool.capacity, self.target)

    def _emit_unbounded(self, record: Record) -> None:
        """The sender's own notices (a spool overflow): spooled past the bound, never dropped for room."""
        self.emit(record, _bounded=False)

    def emit_trace(self, message: stream_pb2.TracerMessage) -> bool:
        """Queue a trace session's batch; False when the queue is full (the caller counts the loss).
        It leaves only once every event emitted before it is on the stream (StreamSender._pump)."""
        data = message.SerializeToString()
        out = self._out
        with out.lock:
            # A session's last batch is taken past the bound: it carries the end and the final counts.
            full = len(out.trace_out) >= TRACE_QUEUE_MAX and not message.trace.ended
            if out.closed or full:
                return False
            out.trace_out.append(data)
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
        self._sender.on_reconnect = hook

    def _snapshot(self) -> stream_pb2.Snapshot:
        out = self._out
        with out.lock:  # the same lock as seq assignment: the table reflects exactly seq
            seq, consumers = out.seq, list(out.consumers.values())
            info, allocations = out.info, out.allocations
        return snapshot_to_proto(seq, consumers, info, allocations, self._tracer_stats())

    def close(self) -> None:
        """Flush what the collector will take within close_deadline_s, then stop the sender."""
        if self._sender.stopping.is_set():
            return
        self._sender.stop(time.monotonic() + self.options.close_deadline_s)
        self._thread.join(self.options.close_deadline_s + 2.0)
        self._commands.close()
        out = self._out
        with out.lock:
            out.closed = True
            left = len(out.spool)
        if left:
            log.warning("closing with %d events the collector at %s has not acknowledged; they are lost",
                        left, self.target)

    def stats(self) -> dict[str, Any]:
        out = self._out
        with out.lock:
            return {
                "last_seq": out.seq, "acked_seq": out.spool.acked, "spooled": len(out.spool),
                "dropped": out.spool.dropped_total, "reconnects": max(0, out.welcomes - 1),
                "connected": out.connected, "connect_failures": out.connect_failures,
                "events_sent": out.events_sent, "batches_sent": out.batches_sent,
                "commands_running": self._commands.running,
            }

    def _tracer_stats(self) -> stream_pb2.TracerStats:
        try:
            ringbuf = int(self.ringbuf_dropped()) if self.ringbuf_dropped is not None else 0
        except Exception:  # a stats read must never break the stream
            ringbuf = 0
        try:
            counters = {name: int(value) for name, value in (self.counters() if self.counters else {}).items()
                        if name in _AGENT_COUNTERS}
        except Exception:  # likewise
            counters = {}
        out = self._out
        with out.lock:
            return stream_pb2.TracerStats(spool_events=len(out.spool),
                                          spool_dropped_total=out.spool.dropped_total,
                                          ringbuf_dropped_total=ringbuf,
                                          reconnects_total=max(0, out.welcomes - 1), **counters)


def _track(out: Outbox, kind: str, record: Record) -> None:
    """What a Snapshot needs, kept as records are emitted (under the outbox's lock, so it matches seq)."""
    if isinstance(record, ConsumerRecord):
        consumer = record.consumer
        if kind == "finding":
            out.consumers[consumer.key] = consumer
        else:  # resolved
            out.consumers.pop(consumer.key, None)
    elif isinstance(record, InfoRecord):
        out.info = record
    elif isinstance(record, AllocationsRecord):
        out.allocations = record
