"""Any replica answers for the whole cluster: each node's rows and status in the shared store.

    writer = NodeStateWriter(store, leases, nodes, cluster, cri_failures)
    writer.tick()                                   # the collector's loop, every second
    rows = await asyncio.wrap_future(store.read(select_node_states(node)))      # any replica
    consumers = merged_consumers(mine, [r for r in rows if r.node not in owned], namespace, pod, classes)
    statuses = merged_statuses(rows, statuses_in_memory, owned, time.time_ns())

With replicas sharing a PostgreSQL store (docs/REPLICAS.md), a replica holds in memory only the nodes
whose streams it applies (their leases, collector/leases.py). So that `ghostgpu ps` (ListConsumers) and
NodeStatus answer the same for the whole cluster whichever replica serves them, each replica writes, for
every node it owns, one row of the `node_state` table (collector/migrations.py): the node's cluster rows
as ListConsumers sends them (enriched: CRI's names, PodResources, the final class; a serialized
ListConsumersResponse), and its TracerStatus. Every write is fenced by the owner's lease token (the
store checks it in the write's transaction), so a replica that lost a node can never overwrite what the
new owner wrote. collector/query.py reads these rows for every node this replica does not own, and its
own nodes from memory (fresher).

When a node is written (`tick`, at most every ROW_WRITE_S per node): when its rows changed (told by
the ClusterConsumer objects themselves: ClusterTable keeps a row's object while nothing in it changed)
or what the status says the node is (connected, its tracer instance, info, allocations, consumer
count). Counters and the last-heard time alone move with every batch, so they are written at most every
STATUS_REFRESH_S, and as a status-only UPDATE: PostgreSQL keeps an unchanged TOASTed consumers value
without rewriting it. A row's serialized consumer is kept while the row's object is, and the node's
ListConsumersResponse is their concatenation: protobuf parses concatenated messages as one message
with the repeated fields appended (the encoding's documented merge rule), so a changed row costs one
conversion, not the node's. Once a node's stream ends here (its lease dropped), its last status
(not connected) is written once more with the token this replica held: the fence lets it through only
while no other replica took the node since.

A stored status reads `connected` only while the node's lease is live (not expired): a replica that
died leaves its rows saying connected, and its leases run out within --lease-ttl. A lease newer than
the row (another replica took the node and has not written yet) counts as connected: taking a lease
is what a tracer's Hello does.

Rows of nodes gone longer than the store's retention (--retention-days, as their stream positions) and
held by no live lease are deleted every PRUNE_S, by whichever replica; deleting them twice is harmless.

Runs on the collector's event loop; the SQL on the store's writer thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ghostgpu.collector.cluster import ClusterTable
from ghostgpu.collector.db import Conn, upsert_sql
from ghostgpu.collector.nodes import NodeView
from ghostgpu.collector.store import Store

from ghostgpu.common.model.consumers import ClusterConsumer, ConsumerKey, consumer_order
from ghostgpu.common.wire.convert import class_from_proto, cluster_consumer_to_proto
from ghostgpu.v1 import query_pb2

log = logging.getLogger(__name__)

ROW_WRITE_S = 0.5  # a node's changed rows reach the store at most this often (and this late, plus a tick)
STATUS_REFRESH_S = 5.0  # its counters and last-heard time alone, at most this often
PRUNE_S = 600.0  # how often the rows of nodes gone past the retention are deleted

_COLUMNS = ("node", "owner", "token", "updated_unix_ns", "consumers", "status")
_UPSERT = upsert_sql("node_state", _COLUMNS, ("node",))
_UPDATE_STATUS = "UPDATE node_state SET owner = ?, token = ?, updated_unix_ns = ?, status = ? WHERE node = ?"
_SELECT = ("SELECT s.node, s.owner, s.token, s.updated_unix_ns, s.consumers, s.status, l.token, "
           "l.expires_unix_ns FROM node_state s LEFT JOIN node_leases l ON l.node = s.node")
_PRUNE = ("DELETE FROM node_state WHERE updated_unix_ns < ? AND node NOT IN "
          "(SELECT node FROM node_leases WHERE expires_unix_ns > ?)")


class LeaseHolder(Protocol):
    """What the writer needs of collector/leases.py's Leases."""

    owner: str
    held: dict[str, int]  # node -> the token this replica holds its lease with


# ---- reading (any replica) ---------------------------------------------------------------------------

@dataclass(frozen=True)
class NodeStateRow:
    """One node's stored rows, and its lease as it stands now."""

    node: str
    owner: str  # the replica that wrote it
    token: int  # the lease token it wrote with
    updated_unix_ns: int
    consumers: bytes  # a serialized ListConsumersResponse
    status: bytes  # a serialized TracerStatus
    lease_token: int | None  # the node's lease now; None: no lease row
    lease_expires_unix_ns: int

    def live(self, now_unix_ns: int) -> bool:
        """A replica holds the node's lease now (renewed within the ttl)."""
        return self.lease_token is not None and self.lease_expires_unix_ns > now_unix_ns


def select_node_states(node: str = "") -> Callable[[Conn], list[NodeStateRow]]:
    """A read for Store.read(): every node's row (or `node`'s), by node, with its lease. The blobs are
    parsed by the caller, off the writer thread (merged_consumers, merged_statuses)."""
    sql = _SELECT + (" WHERE s.node = ?" if node else "") + " ORDER BY s.node"

    def run(conn: Conn) -> list[NodeStateRow]:
        rows = conn.execute(sql, (node,) if node else ()).fetchall()
        return [NodeStateRow(n, owner, int(token), int(updated), bytes(consumers), bytes(status),
                             None if lease is None else int(lease), int(expires or 0))
                for n, owner, token, updated, consumers, status, lease, expires in rows]

    return run


def _proto_order(cc: query_pb2.ClusterConsumer) -> tuple[str, int, int, str]:
    # consumer_order() on the wire form: node, GPU (-1: none, first), pid, UUID
    c = cc.consumer
    return (c.node, c.gpu, c.process.pid, c.gpu_uuid)


def merged_consumers(mine: Iterable[query_pb2.ClusterConsumer], stored: Iterable[NodeStateRow],
                     namespace: str = "", pod: str = "",
                     classes: Iterable[str] = ()) -> list[query_pb2.ClusterConsumer]:
    """ListConsumers' answer: `mine` (the nodes answered from memory, already filtered) and the stored
    rows of the other nodes filtered as ClusterTable.consumers filters, in its order."""
    wanted = frozenset(classes)
    out = list(mine)
    for row in stored:
        for cc in query_pb2.ListConsumersResponse.FromString(row.consumers).consumers:
            if namespace and cc.k8s.namespace != namespace:
                continue
            if pod and cc.k8s.pod != pod:
                continue
            if wanted and str(class_from_proto(getattr(cc.consumer, "class"))) not in wanted:
                continue
            out.append(cc)
    out.sort(key=_proto_order)
    return out


def stored_status(row: NodeStateRow, now_unix_ns: int) -> query_pb2.TracerStatus:
    """The node's last written status; connected only while its lease is live (see the module doc)."""
    st = query_pb2.TracerStatus.FromString(row.status)
    newer_owner = row.lease_token is not None and row.lease_token > row.token
    st.connected = row.live(now_unix_ns) and (st.connected or newer_owner)
    return st


def merged_statuses(stored: Iterable[NodeStateRow], memory: Iterable[query_pb2.TracerStatus],
                    owned: Collection[str], now_unix_ns: int) -> list[query_pb2.TracerStatus]:
    """NodeStatus' answer, by node: from memory for the nodes this replica owns, the stored row for
    every other node; a node memory knows and the store does not (never written yet) as memory has it."""
    memory = list(memory)
    out = {st.node: st for st in memory if st.node in owned}
    for row in stored:
        if row.node not in out:
            out[row.node] = stored_status(row, now_unix_ns)
    for st in memory:
        out.setdefault(st.node, st)
    return [out[n] for n in sorted(out)]


# ---- writing (each node's owner) ---------------------------------------------------------------------

@dataclass
class _Written:
    """What was last written of one node, to tell what changed since."""

    token: int
    rows: dict[ConsumerKey, tuple[ClusterConsumer, bytes]]  # each row's object and its serialized form
    consumers: bytes
    marks: tuple[Any, ...]
    counters: tuple[Any, ...]
    written_mono: float
    status_mono: float


def _rows_changed(current: Mapping[ConsumerKey, ClusterConsumer],
                  written: Mapping[ConsumerKey, tuple[ClusterConsumer, bytes]]) -> bool:
    if len(current) != len(written):
        return True
    for key, cc in current.items():
        hit = written.get(key)
        if hit is None or hit[0] is not cc:
            return True
    return False


def _marks(view: NodeView) -> tuple[Any, ...]:
    """What the status says the node is. The messages themselves, not copies: NodeView replaces a
    message when it changes, and `==` on a protobuf message compares its fields."""
    return (view.connected, view.connected_unix_ns, view.hello, view.info, view.allocations_pb,
            len(view.consumers))


def _counters(view: NodeView, cri_failures: int) -> tuple[Any, ...]:
    pos = view.position
    return (view.last_heartbeat_unix_ns, pos.delivered_seq if pos is not None else 0, view.totals(),
            view.stats, cri_failures)


class NodeStateWriter:
    """Writes this replica's nodes into node_state (see the module doc). Methods run on the loop."""

    def __init__(self, store: Store, leases: LeaseHolder, nodes: Mapping[str, NodeView],
                 cluster: ClusterTable, cri_failures: Callable[[str], int] | None = None, *,
                 row_write_s: float = ROW_WRITE_S, status_refresh_s: float = STATUS_REFRESH_S,
                 prune_s: float = PRUNE_S) -> None:
        self.store = store
        self.leases = leases
        self.nodes = nodes
        self.cluster = cluster
        self.cri_failures = cri_failures
        self.row_write_s, self.status_refresh_s, self.prune_s = row_write_s, status_refresh_s, prune_s
        self._written: dict[str, _Written] = {}
        self._next_prune_mono = 0.0
        self._task: asyncio.Task[None] | None = None
        self.writes_total = 0  # rows written (upserts and status-only updates), for tests and logs

    def start_ticking(self) -> None:
        """tick() every row_write_s on the running loop, until stop()."""
        self._task = asyncio.get_running_loop().create_task(self._tick_loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.row_write_s)
            try:
                self.tick()
            except Exception:  # a bug in one round must not end the writes for good
                log.exception("node_state: writing the nodes' rows failed; trying again next round")

    def tick(self, now_mono: float | None = None) -> int:
        """Write the owned nodes whose rows or status changed (and are due), the last status of nodes
        no longer owned, and now and then delete rows long gone; how many nodes were written."""
        now = time.monotonic() if now_mono is None else now_mono
        held = self.leases.held
        written = 0
        for node, token in held.items():
            view = self.nodes.get(node)
            if view is not None and self._write_if_due(node, token, view, now):
                written += 1
        for node in [n for n in self._written if n not in held]:
            last = self._written[node]
            view = self.nodes.get(node)
            # Its stream ended here: the status says so (once), under the token this replica held.
            if view is not None and _marks(view) != last.marks:
                self._write(node, last.token, view, now, last, status_only=True)
                written += 1
            del self._written[node]
        if now >= self._next_prune_mono:
            self._next_prune_mono = now + self.prune_s
            self._prune()
        return written

    def _write_if_due(self, node: str, token: int, view: NodeView, now: float) -> bool:
        last = self._written.get(node)
        if last is None or last.token != token:
            self._write(node, token, view, now, last, status_only=False)
            return True
        rows_changed = _rows_changed(self.cluster.rows.get(node, {}), last.rows)
        if rows_changed or _marks(view) != last.marks:
            if now - last.written_mono < self.row_write_s:
                return False
            self._write(node, token, view, now, last, status_only=not rows_changed)
            return True
        if now - last.status_mono < self.status_refresh_s:
            return False
        if _counters(view, self._failures(node)) == last.counters:
            return False
        self._write(node, token, view, now, last, status_only=True)
        return True

    def _failures(self, node: str) -> int:
        return self.cri_failures(node) if self.cri_failures is not None else 0

    def _write(self, node: str, token: int, view: NodeView, now: float, last: _Written | None, *,
               status_only: bool) -> None:
        failures = self._failures(node)
        status = view.status(cri_failures_total=failures).SerializeToString()
        updated_ns = time.time_ns()
        owner = self.leases.owner
        params: tuple[str | int | bytes, ...]
        if status_only and last is not None:
            row_cache, consumers = last.rows, last.consumers
            sql, params = _UPDATE_STATUS, (owner, token, updated_ns, status, node)
        else:
            row_cache, consumers = self._consumers(node, last.rows if last is not None else {})
            sql, params = _UPSERT, (node, owner, token, updated_ns, consumers, status)
        self._written[node] = _Written(token, row_cache, consumers, _marks(view), _counters(view, failures),
                                       now, now)

        def run(conn: Conn) -> None:
            conn.execute(sql, params)

        # Fenced: the store commits it only while `token` still holds the node's lease (else LeaseLost,
        # which needs no answer here: the lease's loss reaches ingest through its own writes and renewals).
        self.store.submit([Store.op_call(run)], fence=(node, token))
        self.writes_total += 1

    def _consumers(self, node: str, cache: Mapping[ConsumerKey, tuple[ClusterConsumer, bytes]],
                   ) -> tuple[dict[ConsumerKey, tuple[ClusterConsumer, bytes]], bytes]:
        """The node's rows as one serialized ListConsumersResponse, in ListConsumers' order; each row's
        bytes reused while its object is the one serialized before."""
        rows = sorted(self.cluster.rows.get(node, {}).items(), key=lambda kv: consumer_order(kv[1].consumer))
        out: dict[ConsumerKey, tuple[ClusterConsumer, bytes]] = {}
        parts: list[bytes] = []
        for key, cc in rows:
            hit = cache.get(key)
            if hit is None or hit[0] is not cc:
                one = query_pb2.ListConsumersResponse(consumers=[cluster_consumer_to_proto(cc)])
                hit = (cc, one.SerializeToString())
            out[key] = hit
            parts.append(hit[1])
        parts.append(query_pb2.ListConsumersResponse(ts_unix_ns=time.time_ns()).SerializeToString())
        return out, b"".join(parts)

    def _prune(self) -> None:
        now_ns = time.time_ns()
        cutoff_ns = now_ns - int(self.store.retention_s * 1e9)

        def run(conn: Conn) -> None:
            conn.execute(_PRUNE, (cutoff_ns, now_ns))

        self.store.submit([Store.op_call(run)])

    def owned(self) -> Collection[str]:
        """The nodes this replica answers from memory (query.py's owned_nodes)."""
        return self.leases.held.keys()
