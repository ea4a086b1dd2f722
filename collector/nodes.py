"""One node's state as the collector keeps it: the tracer's consumer table, its GPUs, the
PodResources allocations, and where its stream stands (seq positions and counters).

Everything here runs on the collector's event-loop thread; nothing locks. The work is per batch
where it can be: validation reads each event's seq and body once, duplicates are cut off with one
bisection, and the consumer table is touched once per consumer a batch changed (the last finding
or resolved event of each consumer wins), not once per event.
"""

from __future__ import annotations

import operator
import time
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from ghostgpu.collector.enrich import NO_ALLOCATIONS, Allocations, allocations_from
from ghostgpu.collector.store import Position

from ghostgpu.common.model.consumers import Consumer, ConsumerKey
from ghostgpu.common.wire.convert import consumer_from_proto, proto_consumer_key
from ghostgpu.v1 import node_pb2, query_pb2, stream_pb2

# Stored in the event log, never change the consumer table (a fault goes to collector/faults.py).
_PASSIVE_BODIES = ("holder", "notice", "fault")


class BatchError(ValueError):
    """An EventBatch that breaks the stream rules: the stream ends with INVALID_ARGUMENT."""


def validate_batch(events: Sequence[stream_pb2.NodeEvent], max_events: int) -> tuple[list[int], list[str]]:
    """(seqs, body names) of a batch that is non-empty, within max_events, with seqs > 0 strictly
    increasing and a body on every event; else BatchError naming the first fault."""
    n = len(events)
    if n == 0:
        raise BatchError("EventBatch has no events")
    if n > max_events:
        raise BatchError(f"EventBatch has {n} events, more than max_batch_events {max_events} from Welcome")
    seqs = [e.seq for e in events]
    if seqs[0] <= 0:
        raise BatchError("EventBatch event 0 has seq 0: seqs start at 1")
    if not all(map(operator.lt, seqs, islice(seqs, 1, None))):
        i = next(i for i in range(1, n) if seqs[i] <= seqs[i - 1])
        raise BatchError(f"EventBatch seqs must strictly increase: event {i} has seq {seqs[i]} "
                         f"after {seqs[i - 1]}")
    bodies = [e.WhichOneof("body") for e in events]
    if None in bodies:
        i = bodies.index(None)
        raise BatchError(f"EventBatch event {i} (seq {seqs[i]}) has no body (or one this collector "
                         "does not know: upgrade the collector)")
    return seqs, bodies


def _copy(msg: Any) -> Any:
    # A sub-message keeps its whole parent batch alive (they share one upb arena): keep a copy.
    return type(msg).FromString(msg.SerializeToString())


@dataclass
class Changes:
    keys: list[ConsumerKey] = field(default_factory=list)  # in event order: findings open in that order
    full: bool = False  # every consumer of the node may have changed (snapshot, allocations)


class NodeView:
    def __init__(self, node: str) -> None:
        self.node = node
        self.hello: stream_pb2.Hello | None = None
        self.connected = False
        self.connected_unix_ns = 0
        self.last_heartbeat_unix_ns = 0
        self.position: Position | None = None
        self.positions: dict[tuple[str, str, str], Position] = {}  # every instance seen, for totals
        # The counters of instances forget_instances() dropped (gaps_total holds their lost_total less
        # ringbuf drops): /metrics adds them, as a Prometheus counter must never go down.
        self.forgotten = Position(node, "", "")
        self.consumers: dict[ConsumerKey, Consumer] = {}
        self.info: stream_pb2.NodeInfo | None = None
        self.allocations_pb: stream_pb2.Allocations | None = None
        self.allocations: Allocations = NO_ALLOCATIONS
        self.state_seq = 0
        self.stats = stream_pb2.TracerStats()

    def begin(self, hello: stream_pb2.Hello, position: Position) -> None:
        """A stream of this node opened (a new Hello): from now on its seqs are `position`'s."""
        self.hello = hello
        self.connected = True
        self.connected_unix_ns = self.last_heartbeat_unix_ns = time.time_ns()
        if self.position is None or self.position.key != position.key:
            self.state_seq = 0  # the snapshot that follows is the new instance's
        self.position = self.positions[position.key] = position

    def end(self) -> None:
        self.connected = False

    def forget_instances(self, keep: tuple[str, str, str], before_unix_ns: int) -> list[tuple[str, str, str]]:
        """Drop the positions of tracer instances other than `keep` last updated before
        `before_unix_ns`, as the store's retention drops their rows (else every tracer restart would
        add one for good); their keys."""
        gone = [k for k, p in self.positions.items() if k != keep and p.updated_unix_ns < before_unix_ns]
        f = self.forgotten
        for k in gone:
            p = self.positions.pop(k)
            f.ingested_total += p.ingested_total
            f.duplicates_total += p.duplicates_total
            f.gaps_total += max(p.gaps_total, p.spool_dropped_total)
            f.ringbuf_dropped_total += p.ringbuf_dropped_total
        return gone

    def accept(self, seqs: list[int]) -> int:
        """Count a validated batch against the position (new, duplicate, missing events); the index
        of its first new event (len(seqs) when every one is a duplicate)."""
        pos = self.position
        assert pos is not None
        delivered, last, n = pos.delivered_seq, seqs[-1], len(seqs)
        if last <= delivered:
            pos.duplicates_total += n
            return n
        start = 0 if seqs[0] > delivered else bisect_right(seqs, delivered)
        first, new = seqs[start], n - start
        gaps = (last - first + 1 - new) + (first - delivered - 1)  # inside the batch, and before it
        pos.delivered_seq = last
        pos.ingested_total += new
        pos.duplicates_total += start
        pos.gaps_total += gaps
        pos.updated_unix_ns = time.time_ns()
        return start

    def apply_events(self, events: Sequence[stream_pb2.NodeEvent], seqs: list[int], bodies: list[str],
                     start: int) -> Changes:
        """Apply new events (from index `start`) newer than the last snapshot to the consumer table."""
        changes = Changes()
        n = len(bodies)
        if sum(bodies.count(b) for b in _PASSIVE_BODIES) == n:
            return changes
        state_seq = self.state_seq
        latest: dict[ConsumerKey, node_pb2.Consumer | None] = {}
        for i in range(start, n):
            body = bodies[i]
            if body in _PASSIVE_BODIES or seqs[i] <= state_seq:
                continue
            ev = events[i]
            if body == "finding":
                latest[proto_consumer_key(ev.finding)] = ev.finding
            elif body == "resolved":
                latest[proto_consumer_key(ev.resolved)] = None
            elif body == "allocations":
                self.set_allocations(ev.allocations)
                changes.full = True
            elif body == "info":
                self.info = _copy(ev.info)
        for key, msg in latest.items():
            if msg is None:
                self.consumers.pop(key, None)
            else:
                self.consumers[key] = self._consumer(msg)
        changes.keys = list(latest)
        self.state_seq = max(state_seq, seqs[-1])
        return changes

    def apply_snapshot(self, snap: stream_pb2.Snapshot) -> Changes:
        """Replace the consumer table, info and allocations with the tracer's whole state."""
        self.consumers = {}
        for msg in snap.consumers:
            c = self._consumer(msg)
            self.consumers[c.key] = c
        if snap.HasField("info"):
            self.info = _copy(snap.info)
        if snap.HasField("allocations"):
            self.set_allocations(snap.allocations)
        if snap.HasField("stats"):
            self.set_stats(snap.stats)
        self.state_seq = snap.seq
        return Changes(full=True)  # ClusterTable.update refreshes every key, old and new, when full

    def set_allocations(self, msg: stream_pb2.Allocations) -> None:
        self.allocations_pb = _copy(msg)
        rows = [(c.namespace, c.pod, c.container, list(c.device_ids)) for c in msg.containers]
        self.allocations = allocations_from(rows, available=msg.available, error=msg.error)

    def set_stats(self, stats: stream_pb2.TracerStats) -> None:
        self.stats = _copy(stats)
        if self.position is not None:
            self.position.spool_dropped_total = stats.spool_dropped_total
            self.position.ringbuf_dropped_total = stats.ringbuf_dropped_total
            self.position.updated_unix_ns = time.time_ns()

    def _consumer(self, msg: node_pb2.Consumer) -> Consumer:
        c = consumer_from_proto(msg)
        if not c.node:
            c.node = self.node
        return c

    def counters(self) -> tuple[int, int, int, int]:
        """(ingested, lost to spool overflows, lost to ring-buffer drops, duplicates) over every instance
        of this node's tracer, the ones forget_instances() dropped included, so that they only ever grow
        (the Prometheus counters); totals() is NodeStatus's view, of the instances still remembered."""
        f = self.forgotten
        ingested, spool, ringbuf, duplicates = (f.ingested_total, f.gaps_total, f.ringbuf_dropped_total,
                                                f.duplicates_total)
        for p in self.positions.values():
            ingested += p.ingested_total
            spool += max(p.gaps_total, p.spool_dropped_total)  # one overflow, counted once (lost_total)
            ringbuf += p.ringbuf_dropped_total
            duplicates += p.duplicates_total
        return ingested, spool, ringbuf, duplicates

    def totals(self) -> tuple[int, int, int]:
        """(ingested, lost, duplicates) over every instance of this node's tracer still remembered."""
        ps = self.positions.values()
        return (sum(p.ingested_total for p in ps), sum(p.lost_total for p in ps),
                sum(p.duplicates_total for p in ps))

    def status(self, cri_failures_total: int = 0) -> query_pb2.TracerStatus:
        ingested, lost, duplicates = self.totals()
        st = query_pb2.TracerStatus(
            node=self.node, connected=self.connected, connected_unix_ns=self.connected_unix_ns,
            last_heartbeat_unix_ns=self.last_heartbeat_unix_ns,
            last_seq=self.position.delivered_seq if self.position else 0,
            events_ingested_total=ingested, events_lost_total=lost, duplicates_total=duplicates,
            consumers=len(self.consumers), cri_failures_total=cri_failures_total, stats=self.stats,
        )
        if self.hello is not None:
            h = self.hello
            st.boot_id, st.instance_id, st.tracer_version = h.boot_id, h.instance_id, h.tracer_version
            st.capabilities.extend(h.capabilities)
        elif self.positions:  # known from the database only: its latest instance
            latest = max(self.positions.values(), key=lambda p: p.updated_unix_ns)
            st.boot_id, st.instance_id, st.last_seq = latest.boot_id, latest.instance_id, latest.delivered_seq
        if self.info is not None:
            st.info.CopyFrom(self.info)
        if self.allocations_pb is not None:
            st.allocations.CopyFrom(self.allocations_pb)
        return st
