"""The cluster-wide consumer table and the findings lifecycle.

For each node consumer: CRI's answer for its container (`resolve(node, container_id)`, which
never blocks) and the node's PodResources allocations go through `collector.enrich.enrich` to the
final class. When CRI's answer for a container changes, `on_cri_change` re-enriches that
container's consumers.

A cluster consumer whose final class is in ghostgpu.common.model.classes.FINDING_CLASSES is an open
finding, keyed by (node, consumer key). A class change or the consumer's disappearance resolves it (and a new
class may open another). Every change is written to the store (history) and pushed to watchers.
A watcher has a bounded queue: one that falls behind is dropped (its RPC ends with
RESOURCE_EXHAUSTED) rather than ever slowing ingest. Runs on the collector's event-loop thread.

Nothing here is kept per consumer once it is gone: its row, index entry and open finding go with
it (the history is in the store), and `release_unused()` hands the CRI resolver the containers
whose last consumer left more than `unused_keep_s` ago, so that short-lived jobs, each in a
container of its own, leave no answer behind in the resolver's cache.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ghostgpu.collector.cri_fetch import normalize_container_id
from ghostgpu.collector.enrich import NO_CONTAINER, enrich
from ghostgpu.collector.nodes import Changes, ConsumerKey, NodeView
from ghostgpu.collector.notify import finding_announcer
from ghostgpu.collector.store import FindingRow, Store

from ghostgpu.common.model.classes import FINDING_CLASSES
from ghostgpu.common.model.consumers import ClusterConsumer, K8sInfo, consumer_order
from ghostgpu.common.wire.convert import cluster_consumer_from_proto, cluster_consumer_to_proto
from ghostgpu.v1 import query_pb2

Resolve = Callable[[str, str], K8sInfo]
WATCH_QUEUE_MAX = 10_000
# changed_rows[node] when more keys changed than are worth tracking one by one: every row of the node.
ALL_ROWS: frozenset[ConsumerKey] = frozenset()
# A node's changed keys are tracked while fewer than this plus twice its rows; past that (short-lived
# processes and no scrape for a while), the renderer rewrites the whole node, which costs the same.
CHANGED_ROWS_SLACK = 64
# How long CRI's answer for a container outlives its last consumer on the node, and for how many such
# containers at most (the oldest go first): processes run one after another in one container (a
# job's steps, the demo's re-runs) keep their names without a new lookup each, while nodes that start
# a container per short-lived job do not keep an answer (about 1 KB) for every container they ever
# ran; the resolver's own LRU cap alone would let 100,000 of them pile up.
UNUSED_CONTAINER_KEEP_S = 300.0
UNUSED_CONTAINERS_MAX = 1000


@dataclass
class FindingRec:
    id: int
    node: str
    key: ConsumerKey
    cls: str
    opened_unix_ns: int
    consumer: ClusterConsumer  # its latest state while open
    resolved_unix_ns: int = 0

    def to_proto(self) -> query_pb2.Finding:
        return query_pb2.Finding(id=self.id, node=self.node,
                                 consumer=cluster_consumer_to_proto(self.consumer),
                                 opened_unix_ns=self.opened_unix_ns, resolved_unix_ns=self.resolved_unix_ns)

    def row(self) -> FindingRow:
        pid, gpu, uuid = self.key
        return FindingRow(self.id, self.node, self.consumer.k8s.namespace, self.cls, f"{pid}/{gpu}/{uuid}",
                          self.opened_unix_ns, self.resolved_unix_ns,
                          cluster_consumer_to_proto(self.consumer).SerializeToString())


class Watcher:
    """One WatchFindings call: its filter, its bounded queue, and a wake-up for its handler."""

    def __init__(self, node: str, namespace: str, classes: Iterable[str], max_queue: int | None = None):
        self.node, self.namespace, self.classes = node, namespace, frozenset(classes)
        self.max_queue = max_queue or WATCH_QUEUE_MAX
        self.items: deque[query_pb2.FindingEvent] = deque()
        self.wake = asyncio.Event()
        self.dropped = False
        # This replica's own findings only, none that other replicas announce (collector/findings_remote.py):
        # the Alertmanager pusher, as each replica pushes its own nodes' alerts.
        self.local_only = False

    def matches(self, rec: FindingRec) -> bool:
        return ((not self.node or rec.node == self.node)
                and (not self.namespace or rec.consumer.k8s.namespace == self.namespace)
                and (not self.classes or rec.cls in self.classes))

    def push(self, event: query_pb2.FindingEvent) -> None:
        if self.dropped:
            return
        if len(self.items) >= self.max_queue:
            self.dropped = True
            self.items.clear()
        else:
            self.items.append(event)
        self.wake.set()


def _mark_changed(changed: dict[str, set[ConsumerKey] | frozenset[ConsumerKey]], node: str,
                  key: ConsumerKey, rows: int) -> None:
    keys = changed.get(node)
    if keys is None:
        changed[node] = {key}
    elif isinstance(keys, set):  # not ALL_ROWS
        keys.add(key)
        if len(keys) > CHANGED_ROWS_SLACK + 2 * rows:
            changed[node] = ALL_ROWS


def _same(a: ClusterConsumer, b: ClusterConsumer) -> bool:
    # node_class counts too: enrich() gives the same final consumer (class and reason) to a holder the
    # node calls pending and, a moment later, hidden when CRI makes it orphaned.
    return (a.consumer == b.consumer and a.k8s == b.k8s and a.allocated == b.allocated
            and a.node_class == b.node_class)


class ClusterTable:
    def __init__(self, nodes: dict[str, NodeView], resolve: Resolve | None, store: Store | None,
                 next_finding_id: int = 1, open_findings: Iterable[FindingRow] = (), *,
                 forget: Callable[[str, str], None] | None = None,
                 keep: Callable[[str, str], None] | None = None,
                 unused_keep_s: float = UNUSED_CONTAINER_KEEP_S, unused_max: int = UNUSED_CONTAINERS_MAX,
                 ) -> None:
        self.nodes = nodes
        self.resolve = resolve
        self.store = store
        # The resolver's forget(node, container_id); (node, container ID) -> monotonic time its last
        # consumer went, oldest first. Kept only with a forget to hand them to, else nothing drains it.
        self.forget = forget
        # The resolver's keep(node, container_id), for a container's first consumer: its answer is
        # then refreshed every ttl by the resolver itself, so a container that stops under a holder
        # that outlives it is seen (orphaned) though nothing on the node changes (on_cri_change).
        self.keep = keep
        self.unused_keep_s, self.unused_max = unused_keep_s, unused_max
        self._unused: dict[tuple[str, str], float] = {}
        self.rows: dict[str, dict[ConsumerKey, ClusterConsumer]] = {}
        self.by_cid: dict[str, dict[str, set[ConsumerKey]]] = {}
        self.open: dict[str, dict[ConsumerKey, FindingRec]] = {}
        self.watchers: set[Watcher] = set()
        self._next_id = next_finding_id
        self.id_source: Callable[[], int] | None = None  # set by the Collector: the store's finding ids
        # (node) -> the lease fence its writes carry (collector/leases.py); None: unfenced (tests)
        self.fence_for: Callable[[str], tuple[str, int] | None] | None = None
        # A shared PostgreSQL store: each write of a finding row carries a NOTIFY naming its id and
        # change (collector/notify.py) for the other replicas' watchers (collector/findings_remote.py),
        # which also give the findings they hold open (also_open) to a watch with include_open. A
        # change is then written at once rather than at the next flush_changed(), so that it reaches
        # them within milliseconds.
        self.announce: Callable[[Sequence[tuple[int, int]]], tuple] | None = None
        if store is not None and store.engine == "postgresql":
            self.announce = finding_announcer(store.replica_id)
        self.also_open: Callable[[], Iterable[FindingRec]] | None = None
        self.on_forget: list[Callable[[list[int]], None]] = []  # finding ids of a node that moved away
        # Called with each finding opened, changed or resolved here (the remediation engine's nudge:
        # collector/remediation.py); cheap, on the loop, never raising.
        self.on_finding: list[Callable[[FindingRec], None]] = []
        self._changes: list[tuple[str, int, int]] = []  # (node, id, kind) written since the last _flush
        self._ops: list[tuple] = []
        self._dirty: dict[int, FindingRec] = {}  # changed open findings not yet written
        # For /metrics (collector/metrics.py): the rows changed since its renderer last took this dict,
        # by node (None until track_changed_rows(): without a reader every key ever seen would pile up
        # here), and the findings opened/resolved per (node, class) since the collector started.
        self.changed_rows: dict[str, set[ConsumerKey] | frozenset[ConsumerKey]] | None = None
        self.findings_opened: dict[tuple[str, str], int] = {}
        self.findings_resolved: dict[tuple[str, str], int] = {}
        by_node: dict[str, list[FindingRow]] = {}
        for row in open_findings:  # still open when the collector stopped: the node's snapshot decides
            by_node.setdefault(row.node, []).append(row)
        for node, rows in by_node.items():
            self.adopt_open(node, rows)

    # ---- updates -----------------------------------------------------------------------------

    def update(self, ns: NodeView, changes: Changes) -> None:
        """Re-enrich the consumers `changes` names (every one of the node when `full`)."""
        rows = self.rows.setdefault(ns.node, {})
        keys: Iterable[ConsumerKey] = changes.keys
        if changes.full:
            keys = dict.fromkeys([*rows, *ns.consumers, *self.open.get(ns.node, ())])
        now = time.time_ns()
        for key in keys:
            self._refresh(ns, rows, key, now)
        self._flush()

    def on_cri_change(self, node: str, container_id: str) -> None:
        """CRI's answer for a container changed: re-enrich its consumers on that node."""
        ns = self.nodes.get(node)
        keys = self.by_cid.get(node, {}).get(normalize_container_id(container_id))
        if ns is None or not keys:
            return
        rows = self.rows.setdefault(node, {})
        now = time.time_ns()
        for key in list(keys):
            self._refresh(ns, rows, key, now)
        self._flush()

    def _refresh(self, ns: NodeView, rows: dict[ConsumerKey, ClusterConsumer], key: ConsumerKey,
                 now: int) -> None:
        node = ns.node
        c = ns.consumers.get(key)
        old = rows.get(key)
        new: ClusterConsumer | None = None
        if c is not None:
            k8s = self.resolve(node, c.container_id) if c.container_id and self.resolve else NO_CONTAINER
            final, allocated = enrich(c, k8s, ns.allocations)
            if old is None:
                rec = self.open.get(node, {}).get(key)
                since = rec.consumer.since_unix_ns if rec is not None and rec.consumer.since_unix_ns else now
            else:
                since = old.since_unix_ns
            new = ClusterConsumer(final, k8s, allocated, node_class=c.cls, since_unix_ns=since,
                                  updated_unix_ns=now)
            if old is not None and _same(old, new):
                new = old
        if new is old and old is not None:
            return
        self._index(node, key, old, new)
        if (changed := self.changed_rows) is not None:
            _mark_changed(changed, node, key, len(rows))
        if new is None:
            rows.pop(key, None)
        else:
            rows[key] = new
        self._lifecycle(node, key, new, now)

    def track_changed_rows(self) -> None:
        """Keep changed_rows from now on (the /metrics renderer takes it at every scrape)."""
        if self.changed_rows is None:
            self.changed_rows = {}

    def _index(self, node: str, key: ConsumerKey, old: ClusterConsumer | None,
               new: ClusterConsumer | None) -> None:
        by_cid = self.by_cid.setdefault(node, {})
        old_cid = normalize_container_id(old.consumer.container_id) if old else ""
        new_cid = normalize_container_id(new.consumer.container_id) if new else ""
        if old_cid == new_cid:
            return
        if old_cid and (keys := by_cid.get(old_cid)) is not None:
            keys.discard(key)
            if not keys:
                del by_cid[old_cid]
                if self.forget is not None:
                    self._unused_from_now(node, old_cid, self.forget)
        if new_cid:
            if new_cid not in by_cid and self.keep is not None:
                self.keep(node, new_cid)
            by_cid.setdefault(new_cid, set()).add(key)
            if self._unused:
                self._unused.pop((node, new_cid), None)  # in use again: its answer stays

    def _unused_from_now(self, node: str, cid: str, forget: Callable[[str, str], None]) -> None:
        """The container's last consumer on the node is gone: its answer goes unused_keep_s from now,
        or at once if unused_max other containers waited longer."""
        unused = self._unused
        unused.pop((node, cid), None)  # re-inserted last: the dict stays oldest first
        unused[node, cid] = time.monotonic()
        if len(unused) > self.unused_max:
            oldest = next(iter(unused))
            del unused[oldest]
            forget(*oldest)

    def release_unused(self, now_mono: float | None = None) -> int:
        """Hand forget() the containers with no consumer on their node for unused_keep_s; how many.
        The collector calls it every second: it looks at the oldest entries only."""
        if not self._unused or self.forget is None:
            return 0
        cutoff = (time.monotonic() if now_mono is None else now_mono) - self.unused_keep_s
        due = list(itertools.takewhile(lambda item: item[1] <= cutoff, self._unused.items()))
        for key, _ in due:
            del self._unused[key]
            self.forget(*key)
        return len(due)

    def _lifecycle(self, node: str, key: ConsumerKey, cc: ClusterConsumer | None, now: int) -> None:
        opens = self.open.setdefault(node, {})
        rec = opens.get(key)
        cls = str(cc.consumer.cls) if cc is not None else ""
        is_finding = cls in FINDING_CLASSES
        if rec is not None and (not is_finding or rec.cls != cls):
            rec.resolved_unix_ns = now
            self.findings_resolved[node, rec.cls] = self.findings_resolved.get((node, rec.cls), 0) + 1
            del opens[key]
            self._dirty.pop(rec.id, None)
            self._emit(query_pb2.FindingEvent.KIND_RESOLVED, rec)
            rec = None
        if not is_finding or cc is None:
            return
        if rec is None:
            if self.id_source is not None:  # ids no other replica hands out (Store.next_finding_id)
                fid = self.id_source()
            else:
                fid = self._next_id
                self._next_id += 1
            rec = FindingRec(fid, node, key, cls, now, cc)
            opens[key] = rec
            self.findings_opened[node, cls] = self.findings_opened.get((node, cls), 0) + 1
            self._emit(query_pb2.FindingEvent.KIND_OPENED, rec)
        elif rec.consumer is not cc and not _same(rec.consumer, cc):
            rec.consumer = cc
            self._emit(query_pb2.FindingEvent.KIND_CHANGED, rec, write=self.announce is not None)
            if self.announce is None:
                self._dirty[rec.id] = rec
        else:
            rec.consumer = cc

    def _emit(self, kind: query_pb2.FindingEvent.Kind, rec: FindingRec, write: bool = True) -> None:
        for hook in self.on_finding:
            hook(rec)
        if write:
            self._ops.append(Store.op_finding(rec.row()))
            if self.announce is not None:
                self._changes.append((rec.node, rec.id, kind))
        event = None
        for w in self.watchers:
            if w.matches(rec):
                if event is None:
                    event = query_pb2.FindingEvent(kind=kind, finding=rec.to_proto())
                w.push(event)

    def flush_changed(self) -> None:
        """Write the open findings that changed since the last call. A finding that only changed
        (memory, names) is written at most once per call, not at every batch that touched it;
        opening and resolving are written at once. The collector calls this every second and
        before reading the history."""
        self._ops.extend(Store.op_finding(rec.row()) for rec in self._dirty.values())
        if self.announce is not None:
            self._changes.extend((rec.node, rec.id, query_pb2.FindingEvent.KIND_CHANGED)
                                 for rec in self._dirty.values())
        self._dirty.clear()
        self._flush()

    def _flush(self) -> None:
        if self._ops and self.store is not None:
            if self.fence_for is None:
                self.store.submit(self._ops + self._announcements(self._changes))
            else:  # one job per node, each fenced by its lease: a node that moved writes nothing here
                by_node: dict[str, list[tuple]] = {}
                for op in self._ops:
                    by_node.setdefault(op[1][1], []).append(op)  # ("finding", FindingRow): row.node
                for node, ops in by_node.items():
                    changes = [c for c in self._changes if c[0] == node]
                    self.store.submit(ops + self._announcements(changes), fence=self.fence_for(node))
        self._ops = []
        self._changes = []

    def _announcements(self, changes: list[tuple[str, int, int]]) -> list[tuple]:
        """The NOTIFY op for the job that writes these rows: in its transaction, refused with it."""
        if self.announce is None or not changes:
            return []
        return [self.announce([(fid, kind) for _, fid, kind in changes])]

    # ---- nodes moving between replicas (collector/leases.py) --------------------------------------

    def forget_node(self, node: str) -> None:
        """Another replica applies `node` now: drop its rows and open findings from memory without
        resolving them (the new owner adopts the open ones from the store)."""
        self.rows.pop(node, None)
        self.by_cid.pop(node, None)
        released = []
        for rec in self.open.pop(node, {}).values():
            self._dirty.pop(rec.id, None)
            released.append(rec.id)
        self._ops = [op for op in self._ops if op[1][1] != node]
        self._changes = [c for c in self._changes if c[0] != node]
        for hook in self.on_forget:  # the Alertmanager pusher stops re-sending them (the owner does)
            hook(released)

    def adopt_open(self, node: str, open_findings: Iterable[FindingRow]) -> None:
        """Take over `node`'s open findings as the store holds them (its previous owner's)."""
        opens: dict[ConsumerKey, FindingRec] = {}
        for row in open_findings:
            cc = cluster_consumer_from_proto(query_pb2.ClusterConsumer.FromString(row.consumer))
            rec = FindingRec(row.id, row.node, cc.consumer.key, row.cls, row.opened_unix_ns, cc)
            opens[rec.key] = rec
        self.open[node] = opens
        # The Alertmanager pusher (a local_only watcher) sends this replica's nodes' alerts: the adopted
        # findings are this replica's to keep firing now. Other watchers heard of them from the
        # replica that opened them (collector/findings_remote.py): not told twice.
        for rec in opens.values():
            event = query_pb2.FindingEvent(kind=query_pb2.FindingEvent.KIND_OPENED, finding=rec.to_proto())
            for w in self.watchers:
                if w.local_only and w.matches(rec):
                    w.push(event)

    # ---- reads ---------------------------------------------------------------------------------

    def consumers(self, node: str = "", namespace: str = "", pod: str = "",
                  classes: Iterable[str] = ()) -> list[ClusterConsumer]:
        wanted = frozenset(classes)
        out = []
        for n in ([node] if node else sorted(self.rows)):
            for cc in self.rows.get(n, {}).values():
                if namespace and cc.k8s.namespace != namespace:
                    continue
                if pod and cc.k8s.pod != pod:
                    continue
                if wanted and str(cc.consumer.cls) not in wanted:
                    continue
                out.append(cc)
        out.sort(key=lambda cc: consumer_order(cc.consumer))
        return out

    def open_findings(self) -> list[FindingRec]:
        return sorted((r for opens in self.open.values() for r in opens.values()), key=lambda r: r.id)

    def watch(self, watcher: Watcher, include_open: bool) -> None:
        """Register a watcher; with include_open, first queue the open findings it matches as OPENED
        (with replicas, those other replicas hold open after this one's: also_open)."""
        if include_open:
            recs = self.open_findings()
            if self.also_open is not None and not watcher.local_only:
                recs.extend(self.also_open())
            for rec in recs:
                if watcher.matches(rec):
                    watcher.push(query_pb2.FindingEvent(kind=query_pb2.FindingEvent.KIND_OPENED,
                                                        finding=rec.to_proto()))
        self.watchers.add(watcher)

    def unwatch(self, watcher: Watcher) -> None:
        self.watchers.discard(watcher)
