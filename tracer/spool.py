"""The stream's spool: every event the collector has not acknowledged, oldest first, bounded.

An event passes three stages, all counted against one capacity:

    pending   (seq, record)   a typed record emitted by the tracer, not yet encoded: emit() appends here
    unsent    (seq, bytes)    encoded NodeEvent, not yet written on the current connection
    inflight  (seq, bytes)    written, waiting for the collector's cumulative Ack

Encoding happens on the sender thread, off the tracer's hot path, straight from the typed record,
and shrinks an event from Python objects (the record and its strings) to its wire bytes (~300 B),
which is what lets a million events fit. After a reconnect the inflight events go back to the head
of unsent and are written again. When the spool is full the oldest event goes (inflight first, then
unsent, then pending): the newest say most about the node now, and the snapshot sent on reconnect
carries the state regardless.

Not thread-safe: it lives in a stream's Outbox (tracer/stream_sender.py), used under its lock. Seqs
in the spool are contiguous except where events were dropped (always from the oldest end), so the
stages stay sorted.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from ghostgpu.common.model.records import Record
from ghostgpu.common.wire.convert import record_to_event
from ghostgpu.v1 import stream_pb2

log = logging.getLogger("ghostgpu.stream")

MAX_EVENT_BYTES = 1 << 20


def encode_event(seq: int, rec: Record) -> bytes:
    """A record's NodeEvent bytes, straight from the typed record. One that cannot be encoded (a value
    the proto cannot hold, a kind it does not know) becomes a notice with the same seq, so the stream
    keeps no hole where the collector would count events as lost."""
    try:
        ev = record_to_event(rec, seq)
        if ev is None:
            raise ValueError("kind is not streamed")
        data = ev.SerializeToString()
        if len(data) <= MAX_EVENT_BYTES:
            return data
        why = f"{len(data)} bytes, over the {MAX_EVENT_BYTES}-byte limit"
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        why = f"{type(exc).__name__}: {exc}"
    message = f"{rec.event!r} record seq {seq} could not be streamed ({why}); dropped"
    log.warning("%s", message)
    ev = stream_pb2.NodeEvent(seq=seq, ts_unix_ns=time.time_ns())
    ev.notice.what, ev.notice.message = "stream", message
    return ev.SerializeToString()


def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_events_message(events: list[bytes]) -> bytes:
    """A serialized TracerMessage{events: EventBatch{events: [...]}} from serialized NodeEvents.

    A protobuf message field is its tag, its length and its bytes, so a batch is built by
    concatenation: no event is parsed again to be resent. Tags: EventBatch.events = 1 and
    TracerMessage.events = 2, both length-delimited (wire type 2), from stream.proto.
    """
    inner = b"".join(b"\x0a" + varint(len(e)) + e for e in events)
    return b"\x12" + varint(len(inner)) + inner


class Spool:
    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"--spool-events: must be a positive number of events, got {capacity}")
        self.capacity = capacity
        self.pending: deque[tuple[int, Record]] = deque()
        self.unsent: deque[tuple[int, bytes]] = deque()
        self.inflight: deque[tuple[int, bytes]] = deque()
        self.encoding = 0  # records taken out by take_pending() and not yet back from put_encoded()
        self._drop_on_return = 0  # of those, how many overflow already counted as dropped
        self.acked = 0  # every seq <= acked is stored by the collector
        self.dropped_total = 0
        self.size = 0  # events held in all stages (kept as a counter: add() is on the hot path)

    def __len__(self) -> int:
        return self.size

    def add(self, seq: int, rec: Record, bounded: bool = True) -> int:
        """Append a new record; returns how many of the oldest events overflow dropped (0 or 1).

        bounded=False lets one record in over capacity: the notice that reports an overflow must
        not itself push out another event."""
        self.pending.append((seq, rec))
        self.size += 1
        if bounded and self.size > self.capacity:
            self._drop_oldest()
            return 1
        return 0

    def _drop_oldest(self) -> None:
        self.dropped_total += 1
        self.size -= 1
        if self.inflight:
            self.inflight.popleft()
        elif self.unsent:
            self.unsent.popleft()
        elif self.encoding > self._drop_on_return:
            self._drop_on_return += 1  # the oldest is being encoded: dropped when it comes back
        else:
            self.pending.popleft()

    def take_pending(self, max_n: int) -> list[tuple[int, Record]]:
        """Up to max_n of the oldest records, to encode outside the lock (put_encoded brings them back)."""
        n = min(max_n, len(self.pending))
        out = [self.pending.popleft() for _ in range(n)]
        self.encoding += n
        return out

    def put_encoded(self, taken: int, encoded: list[tuple[int, bytes]]) -> None:
        """Return `taken` records as their encodings (the same seqs, in order)."""
        self.encoding -= taken
        skip, self._drop_on_return = min(self._drop_on_return, taken), max(0, self._drop_on_return - taken)
        for seq, data in encoded[skip:]:
            if seq > self.acked:
                self.unsent.append((seq, data))
            else:  # acknowledged (Welcome.acked_seq) while it was being encoded
                self.size -= 1

    def take_unsent(self, max_n: int, max_bytes: int) -> list[tuple[int, bytes]]:
        """The next events to write (at least one if any), moved to inflight."""
        out: list[tuple[int, bytes]] = []
        size = 0
        while self.unsent and len(out) < max_n:
            seq, data = self.unsent[0]
            if out and size + len(data) + 8 > max_bytes:
                break
            self.unsent.popleft()
            out.append((seq, data))
            size += len(data) + 8  # tag and length prefix, generously
        self.inflight.extend(out)
        return out

    def ack(self, seq: int) -> int:
        """The collector stored every event up to seq (cumulative); returns how many left the spool."""
        if seq <= self.acked:
            return 0
        self.acked = seq
        removed = 0
        for stage in (self.inflight, self.unsent, self.pending):
            while stage and stage[0][0] <= seq:
                stage.popleft()
                removed += 1
        self.size -= removed
        return removed

    def requeue(self) -> None:
        """The connection is gone: what was written but not acknowledged is written again, first."""
        if self.inflight:
            self.inflight.extend(self.unsent)
            self.unsent, self.inflight = self.inflight, deque()
