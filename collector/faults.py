"""GPU faults (Xid) at the collector: each one stored once, its hits named through CRI, listed, counted.

A tracer reads the driver's Xid lines from its kernel log and sends each one as a NodeEvent `fault`
(tracer/faults.py): the GPU, the Xid and its catalogue meaning and severity, and the processes that
held that GPU then (`affected`, the one the driver named first). Here each fault becomes a
ClusterFault (proto/ghostgpu/v1/query.proto): a collector ID, and every affected process's container
resolved through CRI as any consumer's is (`resolve(node, container_id)`, which never blocks).

Exactly once: `take()` returns the store write of the fault, which ingest (collector/ingest.py)
commits in the same transaction as the stream position that acknowledges its event. A collector
that stops before that commit never acked the event, so the tracer sends it again; one that stopped
after it has the row, and the tracer's resent event is a duplicate seq that never reaches `take()`.

A hit whose CRI lookup was still running is written as it stood ("CRI lookup pending") and written
again when CRI answers (`on_cri_change`), within PENDING_KEEP_S; a container CRI no longer knows, or
reports exited, says so in its K8sIdentity (resolution not_found, container_state), as a finding's
consumer does. Every change is handed to the listeners (the Alertmanager push).

Bounded: the table keeps the newest `max_kept` faults (CollectorConfig.faults_max); a fault past it
drops the oldest, counted in `dropped_total`. Per (node, gpu, xid), `counts` holds how many faults
the collector has ever stored (the `fault_counts` table, which the bound does not touch, read back at
start): ghostgpu_xid_errors_total, which a restart never lowers. Runs on
the collector's event loop; the store's reads and writes run on its writer thread.
"""

from __future__ import annotations

import sqlite3
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import NamedTuple

from ghostgpu.collector.cri import PENDING_ERROR
from ghostgpu.collector.cri_fetch import normalize_container_id
from ghostgpu.collector.enrich import NO_CONTAINER
from ghostgpu.collector.store import CallOp, Store

from ghostgpu.common.model.consumers import K8sInfo
from ghostgpu.common.wire.convert import k8s_to_proto
from ghostgpu.v1 import query_pb2, stream_pb2

Resolve = Callable[[str, str], K8sInfo]
Listener = Callable[[query_pb2.ClusterFault], None]
# How long a fault waits for CRI's names of a hit whose lookup was still running; and how many such
# faults are kept waiting at most (the oldest stop waiting first): an Xid storm on a node whose CRI is
# slow must not keep every fault in memory.
PENDING_KEEP_S = 60.0
PENDING_MAX = 1000
# (node, gpu label, xid label): gpu is "" (no GPU matched the PCI bus id) or the NVML index; xid is ""
# for a line that did not parse, else the number.
CountKey = tuple[str, str, str]


class FaultRow(NamedTuple):
    id: int
    node: str
    ts_unix_ns: int
    gpu: str
    xid: str
    namespaces: str  # "|ml|research|": the namespaces of its hits, for ListFaults' filter
    fault: bytes  # a serialized ghostgpu.v1.ClusterFault


def gpu_label(fault: stream_pb2.Fault) -> str:
    return "" if fault.gpu < 0 else str(fault.gpu)


def xid_label(fault: stream_pb2.Fault) -> str:
    return "" if fault.xid < 0 else str(fault.xid)


def names_pending(k8s: query_pb2.K8sIdentity) -> bool:
    """CRI's lookup for the hit's container was running: its names may come a moment later."""
    return k8s.resolution == "unresolved" and not k8s.pod and k8s.error == PENDING_ERROR


def hit_namespaces(cf: query_pb2.ClusterFault) -> list[str]:
    """The namespaces of the pods a fault hit, each once, in hit order."""
    return list(dict.fromkeys(h.k8s.namespace for h in cf.hits if h.k8s.namespace))


def fault_row(cf: query_pb2.ClusterFault) -> FaultRow:
    namespaces = hit_namespaces(cf)
    return FaultRow(cf.id, cf.node, cf.ts_unix_ns, gpu_label(cf.fault), xid_label(cf.fault),
                    f"|{'|'.join(namespaces)}|" if namespaces else "", cf.SerializeToString())


def _write(row: FaultRow, max_kept: int) -> Callable[[sqlite3.Connection], None]:
    def run(conn: sqlite3.Connection) -> None:
        conn.execute("INSERT OR REPLACE INTO faults VALUES (?, ?, ?, ?, ?, ?, ?)", row)
        # IDs are handed out one by one and never reused: the newest max_kept are the ids above this.
        conn.execute("DELETE FROM faults WHERE id <= ?", (row.id - max_kept,))
        # Counted apart from the rows, which the bound drops: the counter never goes back at a restart
        # (Prometheus would read a lower value as a reset, and increase() as new faults).
        conn.execute("INSERT INTO fault_counts VALUES (?, ?, ?, 1) ON CONFLICT (node, gpu, xid) "
                     "DO UPDATE SET count = count + 1", (row.node, row.gpu, row.xid))

    return run


def _rewrite(row: FaultRow) -> Callable[[sqlite3.Connection], None]:
    def run(conn: sqlite3.Connection) -> None:
        # UPDATE, not INSERT: a fault the bound dropped meanwhile stays dropped.
        conn.execute("UPDATE faults SET namespaces = ?, fault = ? WHERE id = ?",
                     (row.namespaces, row.fault, row.id))

    return run


def select_faults(since_unix_ns: int, node: str, namespace: str,
                  limit: int) -> Callable[[sqlite3.Connection], list[query_pb2.ClusterFault]]:
    """A read for Store.read(): faults read at or after `since` (of `node`, that hit a pod of
    `namespace`), the newest `limit` of them, oldest first."""
    where = ["ts_unix_ns >= ?"]
    args: list[int | str] = [since_unix_ns]
    if node:
        where.append("node = ?")
        args.append(node)
    if namespace:
        # The namespace as one |-delimited item; LIKE's wildcards in it are taken literally.
        escaped = namespace.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        where.append("namespaces LIKE ? ESCAPE '\\'")
        args.append(f"%|{escaped}|%")
    sql = f"SELECT fault FROM faults WHERE {' AND '.join(where)} ORDER BY ts_unix_ns DESC, id DESC LIMIT ?"

    def run(conn: sqlite3.Connection) -> list[query_pb2.ClusterFault]:
        rows = conn.execute(sql, (*args, limit)).fetchall()
        return [query_pb2.ClusterFault.FromString(blob) for (blob,) in reversed(rows)]

    return run


class FaultBook:
    """See the module docstring. `load()` once before the first `take()`."""

    def __init__(self, store: Store | None, resolve: Resolve | None, max_kept: int) -> None:
        if max_kept < 1:
            raise ValueError(f"--faults-max {max_kept}: must be 1 or more")
        self.store, self.resolve, self.max_kept = store, resolve, max_kept
        self.listeners: list[Listener] = []
        self.counts: dict[CountKey, int] = {}
        self.kept = 0  # faults in the table now
        self.dropped_total = 0  # faults the bound dropped since this collector started
        self._next_id = 1
        # fault ID -> (the fault, monotonic deadline) while a hit's names are pending; oldest first
        self._pending: OrderedDict[int, tuple[query_pb2.ClusterFault, float]] = OrderedDict()

    def load(self, conn: sqlite3.Connection) -> None:
        """Read the next ID, how many faults are kept and the per-(node, gpu, xid) counts from the table
        (at start, on the store's connection before its writer runs, as findings are loaded)."""
        self._next_id = conn.execute("SELECT COALESCE(MAX(id), 0) FROM faults").fetchone()[0] + 1
        self.kept = conn.execute("SELECT COUNT(*) FROM faults").fetchone()[0]
        rows = conn.execute("SELECT node, gpu, xid, count FROM fault_counts")
        self.counts = {(node, gpu, xid): n for node, gpu, xid, n in rows}

    # ---- in: the node's fault events (ingest) ---------------------------------------------------------

    def take(self, node: str, event: stream_pb2.NodeEvent) -> CallOp:
        """A new fault event of `node`: the ClusterFault, told to the listeners; its store write, to be
        committed with the batch that carried it."""
        cf = query_pb2.ClusterFault(id=self._next_id, node=node, fault=event.fault,
                                    ts_unix_ns=event.ts_unix_ns or time.time_ns())
        self._next_id += 1
        self._resolve_hits(cf)
        key = (node, gpu_label(cf.fault), xid_label(cf.fault))
        self.counts[key] = self.counts.get(key, 0) + 1
        if self.kept >= self.max_kept:
            self.dropped_total += 1
        else:
            self.kept += 1
        if any(names_pending(h.k8s) for h in cf.hits):
            self._wait(cf)
        self._tell(cf)
        return Store.op_call(_write(fault_row(cf), self.max_kept))

    def _resolve_hits(self, cf: query_pb2.ClusterFault) -> None:
        del cf.hits[:]
        for consumer in cf.fault.affected:
            k8s = self._k8s(cf.node, consumer.process.container_id)
            cf.hits.add(consumer=consumer, k8s=k8s_to_proto(k8s))

    def _k8s(self, node: str, container_id: str) -> K8sInfo:
        if not container_id or self.resolve is None:
            return NO_CONTAINER
        return self.resolve(node, container_id)

    def _wait(self, cf: query_pb2.ClusterFault) -> None:
        self._pending[cf.id] = (cf, time.monotonic() + PENDING_KEEP_S)
        while len(self._pending) > PENDING_MAX:
            self._pending.popitem(last=False)

    # ---- CRI answers ----------------------------------------------------------------------------------

    def on_cri_change(self, node: str, container_id: str) -> None:
        """CRI's answer for a container changed: the faults waiting for its names get them."""
        if not self._pending:
            return
        now = time.monotonic()
        while self._pending and next(iter(self._pending.values()))[1] <= now:
            self._pending.popitem(last=False)  # waited PENDING_KEEP_S: the row keeps what it has
        cid = normalize_container_id(container_id)
        for fid, (cf, _) in list(self._pending.items()):
            if cf.node != node or not any(normalize_container_id(h.consumer.process.container_id) == cid
                                          for h in cf.hits):
                continue
            before = cf.SerializeToString()
            self._resolve_hits(cf)
            if not any(names_pending(h.k8s) for h in cf.hits):
                del self._pending[fid]
            if cf.SerializeToString() == before:
                continue
            if self.store is not None:
                self.store.submit([Store.op_call(_rewrite(fault_row(cf)))])
            self._tell(cf)

    def _tell(self, cf: query_pb2.ClusterFault) -> None:
        for listener in self.listeners:
            listener(cf)

    # ---- out ------------------------------------------------------------------------------------------

    def count_rows(self) -> list[tuple[CountKey, int]]:
        """(node, gpu, xid) -> faults stored, sorted: the counter's series (copied on the loop)."""
        return sorted(self.counts.items())

    def pending_ids(self) -> Iterable[int]:
        return self._pending.keys()
