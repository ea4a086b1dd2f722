"""GPU faults (Xid) at the collector: each one stored once, its hits named through CRI, listed, counted.

A tracer reads the driver's Xid lines from its kernel log and sends each one as a NodeEvent `fault`
(tracer/faults.py): the GPU, the Xid and its catalogue meaning and severity, and the processes that
held that GPU then (`affected`, the one the driver named first). Here each fault becomes a
ClusterFault (proto/ghostgpu/v1/query.proto): a collector ID, and every affected process's container
resolved through CRI as any consumer's is (`resolve(node, container_id)`, which never blocks).

Exactly once: a fault is the kernel log record it came from, (node, boot, kmsg_seq, kernel log time):
the row's natural key (`fault_key`), which the alert's identity is made of too. `take()` returns the
store write of the fault (INSERT OR IGNORE on that key, in the writer's transaction), which ingest
(collector/ingest.py) commits with the stream position that acknowledges its event; nothing else
changes until `committed()` hears that commit succeeded and the row is new: then the counter moves,
the row counts as kept, and the listeners (the Alertmanager push) are told. A commit that failed
changes nothing here, and the tracer's resend is stored and told once; a fault the tracer sends again
(the same record under another seq, another stream) finds its row and is neither stored, counted nor
told again. The key holds for the rows kept: one dropped by the bound is not remembered.

A hit whose CRI lookup was still running is written as it stood ("CRI lookup pending") and written
again when CRI answers (`on_cri_change`), within PENDING_KEEP_S; a container CRI no longer knows, or
reports exited, says so in its K8sIdentity (resolution not_found, container_state), as a finding's
consumer does. Every change is handed to the listeners.

Bounded: the table keeps the newest `max_kept` faults (CollectorConfig.faults_max); a fault past it
drops the oldest, counted in `dropped_total`. Per (node, gpu, xid), `counts` holds how many faults
the collector has ever stored (the `fault_counts` table, which the bound does not touch, read back at
start): ghostgpu_xid_errors_total, which a restart never lowers. Not per origin (a line user space
wrote to /dev/kmsg counts too): the table's key is (node, gpu, xid), and the alert push and ListFaults
carry each fault's origin. A node gone (no stream, nothing heard)
longer than the store's retention (--retention-days, as its stream positions) has its counts dropped
(`prune_gone`): its series ends, as a node's does; a node still heard from keeps them. Runs on the
collector's event loop; the store's reads and writes run on its writer thread.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import NamedTuple

from ghostgpu.collector.cri import PENDING_ERROR
from ghostgpu.collector.cri_fetch import normalize_container_id
from ghostgpu.collector.db import Conn, serialize_writers
from ghostgpu.collector.enrich import NO_CONTAINER
from ghostgpu.collector.store import CallOp, Store

from ghostgpu.common.model.consumers import K8sInfo
from ghostgpu.common.model.display import fault_id, hit_pods
from ghostgpu.common.wire.convert import k8s_to_proto
from ghostgpu.v1 import query_pb2, stream_pb2

Resolve = Callable[[str, str], K8sInfo]
Listener = Callable[[query_pb2.ClusterFault], None]
# How long a fault waits for CRI's names of a hit whose lookup was still running; and how many such
# faults are kept waiting at most (the oldest stop waiting first): an Xid storm on a node whose CRI is
# slow must not keep every fault in memory.
FAULT_ID_LOCK = 0x67686F7374786964  # "ghostxid": the next fault id, one replica at a time
PENDING_KEEP_S = 60.0
PENDING_MAX = 1000
# (node, gpu label, xid label): gpu is "" (no GPU matched the PCI bus id) or the NVML index; xid is ""
# for a line that did not parse, else the number.
CountKey = tuple[str, str, str]


class FaultRow(NamedTuple):
    """One row of the store's `faults` table, in column order (collector/store.py)."""

    id: int
    node: str
    ts_unix_ns: int
    gpu: str
    xid: str
    namespaces: str  # "|ml|research|": the namespaces of its hits, for ListFaults' filter
    fault: bytes  # a serialized ghostgpu.v1.ClusterFault
    boot_id: str  # with node, kmsg_seq and log_ts_ns: the natural key (one row per kernel log record)
    kmsg_seq: int
    log_ts_ns: int  # the kernel log's time of the line (since boot): tells apart records without a seq
    stored_unix_ns: int


def gpu_label(fault: stream_pb2.Fault) -> str:
    return "" if fault.gpu < 0 else str(fault.gpu)


def xid_label(fault: stream_pb2.Fault) -> str:
    return "" if fault.xid < 0 else str(fault.xid)


def names_pending(k8s: query_pb2.K8sIdentity) -> bool:
    """CRI's lookup for the hit's container was running: its names may come a moment later."""
    return k8s.resolution == "unresolved" and not k8s.pod and k8s.error == PENDING_ERROR


def hit_namespaces(cf: query_pb2.ClusterFault) -> list[str]:
    """The namespaces of the pods a fault hit, each once, in hit order."""
    return list(dict.fromkeys(ns for ns, _ in hit_pods((h.k8s.namespace, h.k8s.pod) for h in cf.hits)))


def fault_key(cf: query_pb2.ClusterFault) -> str:
    """The fault's identity within its node, from its natural key (model/display.py fault_id): the
    alert's fault_id label (collector/alertbook.py), `fault_id` in `ghostgpu faults -o json`."""
    return fault_id(cf.boot_id, cf.fault.kmsg_seq, cf.fault.ts_ns)


def fault_row(cf: query_pb2.ClusterFault) -> FaultRow:
    namespaces = hit_namespaces(cf)
    return FaultRow(cf.id, cf.node, cf.ts_unix_ns, gpu_label(cf.fault), xid_label(cf.fault),
                    f"|{'|'.join(namespaces)}|" if namespaces else "", cf.SerializeToString(), cf.boot_id,
                    cf.fault.kmsg_seq, cf.fault.ts_ns, cf.stored_unix_ns)


class Taken:
    """A fault handed to the store by `take()`: `stored` says, once the write ran, whether its row is
    new (False: a fault already stored, or a write not run or rolled back)."""

    __slots__ = ("cf", "op", "stored")

    def __init__(self, cf: query_pb2.ClusterFault, max_kept: int) -> None:
        self.cf = cf
        self.stored = False
        self.op: CallOp = Store.op_call(self._write(max_kept))

    def _write(self, max_kept: int) -> Callable[[Conn], None]:
        def run(conn: Conn) -> None:
            self.stored = False  # a group retried after a rollback runs this again
            cf = self.cf
            # IDs are handed out here, on the writer, in commit order: one per row, never reused
            # (replicas sharing PostgreSQL take them one transaction at a time).
            serialize_writers(conn, FAULT_ID_LOCK)
            cf.id = conn.execute("SELECT COALESCE(MAX(id), 0) + 1 FROM faults").fetchone()[0]
            cf.stored_unix_ns = time.time_ns()
            row = fault_row(cf)
            if conn.execute("INSERT INTO faults VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                            "ON CONFLICT (node, boot_id, kmsg_seq, log_ts_ns) DO NOTHING", row).rowcount == 0:
                return  # this kernel log record is stored already (natural key): not a new fault
            # The newest max_kept are the ids above this (dense: each is the one before plus one).
            conn.execute("DELETE FROM faults WHERE id <= ?", (row.id - max_kept,))
            # Counted apart from the rows, which the bound drops: the counter never goes back at a
            # restart (Prometheus would read a lower value as a reset, and increase() as new faults).
            conn.execute("INSERT INTO fault_counts VALUES (?, ?, ?, 1) ON CONFLICT (node, gpu, xid) "
                         "DO UPDATE SET count = fault_counts.count + 1", (row.node, row.gpu, row.xid))
            self.stored = True

        return run


def _rewrite(row: FaultRow) -> Callable[[Conn], None]:
    def run(conn: Conn) -> None:
        # UPDATE, not INSERT: a fault the bound dropped meanwhile stays dropped.
        conn.execute("UPDATE faults SET namespaces = ?, fault = ? WHERE id = ?",
                     (row.namespaces, row.fault, row.id))

    return run


def _forget_counts(nodes: list[str]) -> Callable[[Conn], None]:
    def run(conn: Conn) -> None:
        conn.executemany("DELETE FROM fault_counts WHERE node = ?", [(n,) for n in nodes])

    return run


def select_unended(since_unix_ns: int,
                   limit: int) -> Callable[[Conn], list[query_pb2.ClusterFault]]:
    """A read for Store.read(): the faults read or stored at or after `since` (their alerts, held from
    the later of the two, have not ended), the newest `limit` stored, oldest first."""
    sql = ("SELECT fault FROM faults WHERE ts_unix_ns >= ? OR stored_unix_ns >= ? "
           "ORDER BY id DESC LIMIT ?")

    def run(conn: Conn) -> list[query_pb2.ClusterFault]:
        rows = conn.execute(sql, (since_unix_ns, since_unix_ns, limit)).fetchall()
        return [query_pb2.ClusterFault.FromString(blob) for (blob,) in reversed(rows)]

    return run


def select_faults(since_unix_ns: int, node: str, namespace: str,
                  limit: int) -> Callable[[Conn], list[query_pb2.ClusterFault]]:
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

    def run(conn: Conn) -> list[query_pb2.ClusterFault]:
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
        # fault ID -> (the fault, monotonic deadline) while a hit's names are pending; oldest first
        self._pending: OrderedDict[int, tuple[query_pb2.ClusterFault, float]] = OrderedDict()

    def load(self, conn: Conn) -> None:
        """Read how many faults are kept and the per-(node, gpu, xid) counts from the tables (at start,
        on the store's connection before its writer runs, as findings are loaded)."""
        self.kept = conn.execute("SELECT COUNT(*) FROM faults").fetchone()[0]
        rows = conn.execute("SELECT node, gpu, xid, count FROM fault_counts")
        self.counts = {(node, gpu, xid): n for node, gpu, xid, n in rows}

    # ---- in: the node's fault events (ingest) ---------------------------------------------------------

    def take(self, node: str, boot_id: str, event: stream_pb2.NodeEvent) -> Taken:
        """A new fault event of `node` (a stream of boot `boot_id`): its store write (`.op`), to be
        committed with the batch that carried it; hand it to `committed()` once that commit succeeded."""
        cf = query_pb2.ClusterFault(node=node, fault=event.fault, boot_id=boot_id,
                                    ts_unix_ns=event.ts_unix_ns or time.time_ns())
        self._resolve_hits(cf)
        return Taken(cf, self.max_kept)

    def committed(self, taken: Iterable[Taken]) -> None:
        """The batch that carried these faults committed: the new ones count, and are told."""
        for t in taken:
            if not t.stored:
                continue  # a fault stored before: counted and told then
            cf = t.cf
            key = (cf.node, gpu_label(cf.fault), xid_label(cf.fault))
            self.counts[key] = self.counts.get(key, 0) + 1
            if self.kept >= self.max_kept:
                self.dropped_total += 1
            else:
                self.kept += 1
            if any(names_pending(h.k8s) for h in cf.hits):
                self._wait(cf)
            self._tell(cf)

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

    # ---- nodes gone -----------------------------------------------------------------------------------

    def prune_gone(self, last_seen_unix_ns: Callable[[str], int], before_unix_ns: int) -> list[str]:
        """Drop the counts of the nodes last seen (`last_seen_unix_ns(node)`: now for a connected one, 0
        for one the collector no longer knows) before `before_unix_ns`, here and in the table; the
        nodes dropped. A node seen since keeps its counts: a live counter never goes down."""
        gone = sorted({node for node, _, _ in self.counts if last_seen_unix_ns(node) < before_unix_ns})
        if not gone:
            return []
        dropped = set(gone)
        self.counts = {k: n for k, n in self.counts.items() if k[0] not in dropped}
        if self.store is not None:
            self.store.submit([Store.op_call(_forget_counts(gone))])
        return gone

    # ---- out ------------------------------------------------------------------------------------------

    def count_rows(self) -> list[tuple[CountKey, int]]:
        """(node, gpu, xid) -> faults stored, sorted: the counter's series (copied on the loop)."""
        return sorted(self.counts.items())

    def pending_ids(self) -> Iterable[int]:
        return self._pending.keys()
