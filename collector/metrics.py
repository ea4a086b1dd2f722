"""The collector's Prometheus /metrics (`ghostgpu collector --metrics-listen HOST:PORT`).

    metrics = CollectorMetrics(nodes, cluster, call=collector.call, cri_stats=resolver.stats,
                               max_process_series=config.metrics_max_process_series)
    server = HttpServer(listen, {"/metrics": metrics.handle}, flag="--metrics-listen").start()

A scrape runs on the HTTP server's thread. The collector's state lives on its event loop, so one
Collector.call() copies there what changed (the rows of the nodes ClusterTable marked changed, every
node's counters: references and integers, no formatting); the lines are then written off the loop
(collector/metrics_render.py), cached per node, and only changed nodes are written again. The global
families come from a prometheus_client CollectorRegistry owned by this object (never the global
REGISTRY: tests run several collectors in one process), with the process, platform and GC collectors,
appended to the page. Scrapes are serialized by a lock: the cache is theirs alone.

With collector replicas sharing a PostgreSQL store (docs/REPLICAS.md) each replica writes the per-node
series of the nodes whose lease it holds only (Leases.held, read on the loop), so Prometheus, which
scrapes every replica, never counts a node twice; the store's own families (ghostgpu_store_*), the
leases', the listener's (collector/notify.py) and the replica commands' (collector/replica_commands.py)
(ghostgpu_collector_*) come from the objects handed in, read at scrape time.
"""

from __future__ import annotations

import platform
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from ghostgpu.collector.cluster import ALL_ROWS, ClusterTable
from ghostgpu.collector.cri import CALL_LATENCY_BUCKETS_S, CriStats
from ghostgpu.collector.faults import CountKey, FaultBook
from ghostgpu.collector.metrics_render import (
    ALERTMANAGER_METRICS,
    COLLECTOR_METRICS,
    REPLICA_METRICS,
    SHARED_STORE_METRICS,
    STORE_METRICS,
    NodeConsumers,
    NodeStatus,
    assemble,
    render_consumers,
    render_info,
    render_status,
    render_xid_errors,
    tracer_stats_values,
)
from ghostgpu.collector.nodes import NodeView
from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from ghostgpu import __version__
from ghostgpu.common.model.consumers import ClusterConsumer, ConsumerKey
from ghostgpu.common.model.remediation import (
    DONE,
    FAILED,
    ISOLATION_TRIGGERS,
    KILL_ORPHAN,
    MODE_DRY_RUN,
    MODE_MANUAL,
    MODE_ON,
    MODES,
    PROPOSED,
    SKIPPED,
    STATES,
)
from ghostgpu.common.web.httpserve import PROMETHEUS_TEXT, Request, Response
from ghostgpu.common.wire.protocol import API_VERSION
from ghostgpu.v1 import stream_pb2

if TYPE_CHECKING:
    from ghostgpu.collector.alertpush import AlertPushStats  # imported only with --alertmanager
    from ghostgpu.collector.remediation import RemediationView

__all__ = ["ALERTMANAGER_METRICS", "COLLECTOR_METRICS", "REPLICA_METRICS", "SHARED_STORE_METRICS",
           "STORE_METRICS", "CollectorMetrics"]

T = TypeVar("T")
# Group commits: ~1 ms on a local SQLite file, a network round trip or more on PostgreSQL; seconds
# mean a stalled disk or database.
COMMIT_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _run_here(fn: Callable[[], T]) -> T:
    return fn()


class StoreStats(Protocol):
    """What /metrics reads of the store (collector/store.py's Store), from the scraping thread."""

    commit_seconds: list[float]  # appended by the writer thread; taken and cleared here
    errors_total: int
    db_down_since: float | None  # time.monotonic() the database went out of reach

    @property
    def engine(self) -> str: ...  # sqlite, postgresql

    @property
    def replica_id(self) -> str: ...

    @property
    def pending_bytes(self) -> int: ...

    @property
    def failed(self) -> BaseException | None: ...


class RemediationStats(Protocol):
    """What /metrics reads of the remediation engine (collector/remediation.py's Remediator)."""

    incidents_total: dict[tuple[str, str, str], int]  # (action, state, mode) -> incidents that reached it

    @property
    def view(self) -> RemediationView: ...


class LeaseStats(Protocol):
    """What /metrics reads of this replica's leases (collector/leases.py's Leases)."""

    steals_total: int

    @property
    def held(self) -> Mapping[str, int]: ...  # node -> token; read on the collector's loop


class NotifierStats(Protocol):
    """What /metrics reads of this replica's listener (collector/notify.py's Notifier)."""

    notifications_by_channel: dict[str, int]  # written by the listener thread; copied here
    reconnects_total: int
    down_since: float | None  # time.monotonic() the listener lost its connection

    @property
    def listening(self) -> bool: ...


class ReplicaCommandStats(Protocol):
    """What /metrics reads of the replica commands (collector/replica_commands.py's ReplicaCommands.stats)."""

    counts: dict[tuple[str, str, str], int]  # (role, kind, result); written on the loop, copied here


class RunOnLoop(Protocol):
    """Runs `fn` where the collector's tables live (Collector.call: on its loop) and returns its result."""

    def __call__(self, fn: Callable[[], T]) -> T: ...


@dataclass
class _Taken:
    """What one scrape copied on the loop."""

    rows: dict[str, list[tuple[ConsumerKey, ClusterConsumer | None]]]  # changed rows by node (all if new)
    fresh: set[str]  # nodes whose rows are all of them: written from scratch
    status: list[NodeStatus]  # every node, sorted by name
    identity: dict[str, tuple[str | None, stream_pb2.NodeInfo | None]]  # node -> (tracer version, NodeInfo)
    tracers_connected: int
    xid_errors: list[tuple[CountKey, int]]  # (node, gpu, xid) -> GPU faults stored
    faults_dropped: int
    owned_nodes: int | None  # nodes whose lease this replica holds; None without leases


@dataclass
class _InfoCache:
    version: str | None
    info: stream_pb2.NodeInfo | None  # held, so its id is never reused while cached: compared with `is`
    text: tuple[bytes, ...]


class CollectorMetrics:
    def __init__(self, nodes: dict[str, NodeView], cluster: ClusterTable, *,
                 call: RunOnLoop = _run_here,
                 cri_stats: Callable[[], CriStats] | None = None,
                 push_stats: Callable[[], AlertPushStats] | None = None,
                 audit_head: Callable[[], tuple[int, int]] | None = None,
                 max_process_series: int, faults: FaultBook | None = None,
                 store: StoreStats | None = None, leases: LeaseStats | None = None,
                 notifier: NotifierStats | None = None, replica: ReplicaCommandStats | None = None,
                 remediation: RemediationStats | None = None,
                 tickets: Callable[[], Mapping[str, int]] | None = None,
                 isolations: Callable[[], Mapping[tuple[str, str], int]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """audit_head: (the audit chain's newest seq, records this run appended), Security.audit_head;
        max_process_series: CollectorConfig.metrics_max_process_series (checked there); faults: the GPU
        faults' book (collector/faults.py), for ghostgpu_xid_errors_total; store: the Store, for
        ghostgpu_store_*; leases: this replica's Leases, for ghostgpu_collector_* and, with a
        PostgreSQL store, to write per-node series for the nodes this replica holds only; notifier and
        replica (PostgreSQL only): the listener and ReplicaCommands.stats, for ghostgpu_collector_*;
        remediation: the remediation engine, for ghostgpu_remediation_*; tickets: TicketDesk.stats
        (collector/tickets.py); isolations: the Isolator's outcome counts (collector/isolation.py)."""
        self.nodes, self.cluster = nodes, cluster
        self.call = call
        self.cri_stats, self.push_stats = cri_stats, push_stats
        self.audit_head = audit_head
        self.max_process_series = max_process_series
        self.faults = faults
        self.faults_dropped = 0
        self.store, self.leases, self.clock = store, leases, clock
        self.notifier, self.replica = notifier, replica
        self.remediation, self.tickets, self.isolations = remediation, tickets, isolations
        # Only with a shared store: one SQLite collector writes every node it knows, as before.
        self.owned_only = leases is not None and store is not None and store.engine == "postgresql"
        self.owned_nodes: int | None = None
        # ghostgpu_store_commit_seconds, cumulative since start: per-bucket counts (the last one +Inf),
        # their sum. Touched under _lock only (the scrape's).
        self.commit_buckets = [0] * (len(COMMIT_BUCKETS_S) + 1)
        self.commit_sum_s = 0.0
        self._lock = threading.Lock()
        self._consumers: dict[str, NodeConsumers] = {}
        self._info: dict[str, _InfoCache] = {}
        self.tracers_connected = 0
        self.capped = 0
        self.cri = CriStats()  # as read at the latest scrape
        cluster.track_changed_rows()
        self.registry = CollectorRegistry()
        self.registry.register(_GlobalCollector(self))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)

    # ---- on the collector's loop ------------------------------------------------------------------

    def _take(self) -> _Taken:
        cluster = self.cluster
        changed, cluster.changed_rows = cluster.changed_rows or {}, {}
        names = sorted(self.nodes.keys() | cluster.rows.keys())
        leases = self.leases
        held = leases.held if leases is not None else None
        if held is not None and self.owned_only:
            # Another replica writes the rest. A node dropped here is written from scratch (fresh)
            # when this replica takes it again: its cached chunks go with it below.
            names = [n for n in names if n in held]
        rows: dict[str, list[tuple[ConsumerKey, ClusterConsumer | None]]] = {}
        fresh: set[str] = set()
        for n in names:
            node_rows = cluster.rows.get(n, {})
            keys = changed.get(n)
            if n not in self._consumers or keys is ALL_ROWS:
                rows[n] = list(node_rows.items())
                fresh.add(n)
            elif keys is not None:
                rows[n] = [(k, node_rows.get(k)) for k in keys]
        opened: dict[str, list[tuple[str, int]]] = {}
        resolved: dict[str, list[tuple[str, int]]] = {}
        for counts, into in ((cluster.findings_opened, opened), (cluster.findings_resolved, resolved)):
            for (node, cls), count in sorted(counts.items()):
                into.setdefault(node, []).append((cls, count))
        status, identity, connected = [], {}, 0
        for name in names:
            ns = self.nodes.get(name)
            if ns is None:
                ns = NodeView(name)
            ingested, spool, ringbuf, duplicates = ns.counters()
            connected += ns.connected
            # The tracer's counts are known once it reported them: a node known only from the database
            # (before its tracer reconnects) has none, and a 0 there would read as a counter reset.
            stats = ns.stats
            known = stats.ByteSize() > 0 or ns.state_seq > 0
            status.append(NodeStatus(name, ns.connected, ns.last_heartbeat_unix_ns, ingested, spool, ringbuf,
                                     duplicates, opened.get(name, ()), resolved.get(name, ()),
                                     tracer_stats_values(stats) if known else None))
            identity[name] = (ns.hello.tracer_version if ns.hello is not None else None, ns.info)
        faults = self.faults
        xid_errors = faults.count_rows() if faults is not None else []
        if held is not None and self.owned_only:
            xid_errors = [row for row in xid_errors if row[0][0] in held]
            connected = sum(ns.connected for ns in self.nodes.values())  # this replica's streams, all
        return _Taken(rows, fresh, status, identity, connected, xid_errors,
                      faults.dropped_total if faults is not None else 0,
                      len(held) if held is not None else None)

    # ---- on the scraping thread --------------------------------------------------------------------

    def render_nodes(self) -> str:
        """The per-node families (ghostgpu_* from the collector's tables), cached per node."""
        with self._lock:
            return b"".join(self._render_nodes_safe()).decode()

    def page(self) -> bytes:
        """The whole /metrics body: per-node families, then the registry's."""
        with self._lock:
            parts = self._render_nodes_safe()
            parts.append(generate_latest(self.registry))
            return b"".join(parts)

    def _render_nodes_safe(self) -> list[bytes]:
        self.cri = self.cri_stats() if self.cri_stats is not None else CriStats()  # off the loop: it locks
        try:
            return self._render_nodes()
        except BaseException:
            self._consumers.clear()  # what the failed scrape took from the loop is gone: start over
            self._info.clear()
            raise

    def _render_nodes(self) -> list[bytes]:
        taken: _Taken = self.call(self._take)
        for node, rows in taken.rows.items():
            chunk = self._consumers.get(node)
            if chunk is None or node in taken.fresh:
                self._consumers[node] = render_consumers(node, rows)
            else:
                chunk.apply(rows)
        chunks = []
        failures = self.cri.failures_by_node
        for s in taken.status:
            version, info = taken.identity[s.node]
            cached = self._info.get(s.node)
            if cached is None or cached.info is not info or cached.version != version:
                cached = self._info[s.node] = _InfoCache(version, info, render_info(s.node, version, info))
            chunks.append((self._consumers[s.node], cached.text, render_status(s, failures.get(s.node, 0))))
        alive = set(taken.identity)
        for cache in (self._consumers, self._info):
            for gone in cache.keys() - alive:
                del cache[gone]
        text, self.capped = assemble(chunks, self.max_process_series)
        text.append(render_xid_errors(taken.xid_errors))  # a few series: one per kind of fault seen
        self.tracers_connected = taken.tracers_connected
        self.faults_dropped = taken.faults_dropped
        self.owned_nodes = taken.owned_nodes
        self._take_commit_seconds()
        return text

    def _take_commit_seconds(self) -> None:
        """Fold the group commit durations the store measured since the last scrape into the histogram.
        The writer thread only appends to the list (and trims its head when nobody scrapes for 65,536
        commits); a slice copy and a slice delete of the same length are each atomic under the GIL
        (CPython 3.11), so a duration appended between them stays for the next scrape."""
        store = self.store
        if store is None:
            return
        durations = store.commit_seconds
        n = len(durations)
        if not n:
            return
        taken = durations[:n]
        del durations[:n]
        buckets = self.commit_buckets
        for d in taken:
            slot = next((i for i, le in enumerate(COMMIT_BUCKETS_S) if d <= le), len(COMMIT_BUCKETS_S))
            buckets[slot] += 1
        self.commit_sum_s += sum(taken)

    def handle(self, request: Request) -> Response:
        return Response(200, self.page(), PROMETHEUS_TEXT)


def _help(name: str) -> str:
    return COLLECTOR_METRICS[name][1]


class _GlobalCollector:
    """The small global families, read when the registry is rendered (prometheus_client collector)."""

    def __init__(self, metrics: CollectorMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        build = GaugeMetricFamily("ghostgpu_build_info", _help("ghostgpu_build_info"),
                                  labels=["version", "api_version", "python_version"])
        build.add_metric([__version__, str(API_VERSION), platform.python_version()], 1)
        yield build
        yield GaugeMetricFamily("ghostgpu_tracers_connected", _help("ghostgpu_tracers_connected"),
                                value=m.tracers_connected)
        cri = m.cri
        yield CounterMetricFamily("ghostgpu_cri_calls_total", _help("ghostgpu_cri_calls_total"),
                                  value=cri.calls_total)
        buckets = [(repr(le), n) for le, n in zip(CALL_LATENCY_BUCKETS_S, cri.call_latency_bucket_counts,
                                                   strict=True)]
        buckets.append(("+Inf", cri.calls_total))
        yield HistogramMetricFamily("ghostgpu_cri_call_duration_seconds",
                                    _help("ghostgpu_cri_call_duration_seconds"), buckets=buckets,
                                    sum_value=cri.call_seconds_total)
        yield GaugeMetricFamily("ghostgpu_cri_cache_entries", _help("ghostgpu_cri_cache_entries"),
                                value=cri.cached)
        yield GaugeMetricFamily("ghostgpu_cri_lookups_pending", _help("ghostgpu_cri_lookups_pending"),
                                value=cri.pending)
        yield CounterMetricFamily("ghostgpu_faults_dropped_total", _help("ghostgpu_faults_dropped_total"),
                                  value=m.faults_dropped)
        yield GaugeMetricFamily("ghostgpu_metrics_process_series_capped",
                                _help("ghostgpu_metrics_process_series_capped"), value=m.capped)
        if m.audit_head is not None:
            # A witness outside the collector: Prometheus keeps the head, so a chain cut back while the
            # collector was stopped shows as the head going back (alert GhostGPUAuditRewound).
            head_seq, records = m.audit_head()
            name = "ghostgpu_audit_head_seq"
            yield GaugeMetricFamily(name, _help(name), value=head_seq)
            yield CounterMetricFamily("ghostgpu_audit_records_total", _help("ghostgpu_audit_records_total"),
                                      value=records)
        if m.store is not None:
            yield from _store(m, m.store)
        if m.leases is not None:
            name = "ghostgpu_collector_owned_nodes"
            yield GaugeMetricFamily(name, _help(name), value=m.owned_nodes or 0)
            name = "ghostgpu_collector_lease_takeovers_total"
            yield CounterMetricFamily(name, _help(name), value=m.leases.steals_total)
        if m.notifier is not None:
            yield from _listener(m, m.notifier)
        if m.replica is not None:
            name = "ghostgpu_collector_replica_commands_total"
            commands = CounterMetricFamily(name, _help(name), labels=["role", "kind", "result"])
            for (role, kind, result), n in sorted(dict(m.replica.counts).items()):
                commands.add_metric([role, kind, result], n)
            yield commands
        if m.push_stats is not None:
            yield from _alertmanager(m.push_stats())
        if m.remediation is not None:
            yield from _remediation(m.remediation)
        if m.tickets is not None:
            yield from _tickets(m.tickets())
        if m.isolations is not None:
            yield from _isolations(m.isolations())


def _tickets(stats: Mapping[str, int]) -> Iterator[Metric]:
    name = "ghostgpu_remediation_tickets_total"
    tickets = CounterMetricFamily(name, _help(name), labels=["result"])
    for result in ("sent", "failed", "dropped"):
        tickets.add_metric([result], stats.get(result, 0))
    yield tickets
    name = "ghostgpu_remediation_ticket_retries_total"
    yield CounterMetricFamily(name, _help(name), value=stats.get("retries", 0))


def _isolations(outcomes: Mapping[tuple[str, str], int]) -> Iterator[Metric]:
    name = "ghostgpu_remediation_isolations_total"
    family = CounterMetricFamily(name, _help(name), labels=["trigger", "state"])
    # every trigger's end states from 0, as for the incidents (collector/isolation.py's triggers)
    counts = {(trigger, state): 0 for trigger in ISOLATION_TRIGGERS
              for state in (PROPOSED, SKIPPED, DONE, FAILED)}
    counts.update(dict(outcomes))
    for (trigger, state), n in sorted(counts.items()):
        family.add_metric([trigger, state], n)
    yield family


def _remediation(r: RemediationStats) -> Iterator[Metric]:
    """ghostgpu_remediation_*: the engine's incidents and switches, as its last tick saw them (read from
    the scraping thread: a copy of a dict the loop only adds to, and a view it replaces whole)."""
    view = r.view
    name = "ghostgpu_remediation_incidents_total"
    incidents = CounterMetricFamily(name, _help(name), labels=["action", "state", "mode"])
    # Every state and mode of action 1 from 0 (Prometheus' advice for known label sets: rate() and
    # increase() see the first incident), then whatever else the engine counted.
    counts = {(KILL_ORPHAN, state, mode): 0 for state in STATES
              for mode in (MODE_DRY_RUN, MODE_ON, MODE_MANUAL)}
    counts.update(dict(r.incidents_total))
    for (action, state, decided_in), n in sorted(counts.items()):
        incidents.add_metric([action, state, decided_in], n)
    yield incidents
    yield GaugeMetricFamily("ghostgpu_remediation_paused", _help("ghostgpu_remediation_paused"),
                            value=int(view.paused))
    yield GaugeMetricFamily("ghostgpu_remediation_breaker_open", _help("ghostgpu_remediation_breaker_open"),
                            value=int(view.breaker_open or bool(view.nodes_over)))
    mode = GaugeMetricFamily("ghostgpu_remediation_mode", _help("ghostgpu_remediation_mode"), labels=["mode"])
    for each in MODES:
        mode.add_metric([each], int(view.mode == each))
    yield mode


def _store(m: CollectorMetrics, store: StoreStats) -> Iterator[Metric]:
    """ghostgpu_store_*: the store's engine, reach, errors, back-pressure and commit times."""
    name = "ghostgpu_store_info"
    info = GaugeMetricFamily(name, _help(name), labels=["engine", "replica"])
    info.add_metric([store.engine, store.replica_id], 1)
    yield info
    down_since = store.db_down_since
    up = down_since is None and store.failed is None
    yield GaugeMetricFamily("ghostgpu_store_up", _help("ghostgpu_store_up"), value=int(up))
    down_s = max(0.0, m.clock() - down_since) if down_since is not None else 0.0
    yield GaugeMetricFamily("ghostgpu_store_down_seconds", _help("ghostgpu_store_down_seconds"), value=down_s)
    yield CounterMetricFamily("ghostgpu_store_errors_total", _help("ghostgpu_store_errors_total"),
                              value=store.errors_total)
    yield GaugeMetricFamily("ghostgpu_store_pending_bytes", _help("ghostgpu_store_pending_bytes"),
                            value=store.pending_bytes)
    cumulative, buckets = 0, []
    for le, count in zip((*(repr(b) for b in COMMIT_BUCKETS_S), "+Inf"), m.commit_buckets, strict=True):
        cumulative += count
        buckets.append((le, cumulative))
    name = "ghostgpu_store_commit_seconds"
    yield HistogramMetricFamily(name, _help(name), buckets=buckets, sum_value=m.commit_sum_s)


def _listener(m: CollectorMetrics, notifier: NotifierStats) -> Iterator[Metric]:
    """ghostgpu_collector_notif*: the LISTEN connection's notifications and reach."""
    name = "ghostgpu_collector_notifications_total"
    received = CounterMetricFamily(name, _help(name), labels=["channel"])
    for channel, n in sorted(dict(notifier.notifications_by_channel).items()):
        received.add_metric([channel], n)
    yield received
    name = "ghostgpu_collector_notify_reconnects_total"
    yield CounterMetricFamily(name, _help(name), value=notifier.reconnects_total)
    name = "ghostgpu_collector_notify_up"
    yield GaugeMetricFamily(name, _help(name), value=int(notifier.listening))
    down_since = notifier.down_since
    down_s = max(0.0, m.clock() - down_since) if down_since is not None else 0.0
    name = "ghostgpu_collector_notify_down_seconds"
    yield GaugeMetricFamily(name, _help(name), value=down_s)


def _alertmanager(st: AlertPushStats) -> Iterator[Metric]:
    """ghostgpu_alertmanager_* from collector.alertpush.AlertPushStats."""
    name = "ghostgpu_alertmanager_posts_total"
    posts = CounterMetricFamily(name, _help(name), labels=["result"])
    posts.add_metric(["ok"], st.posts_ok_total)
    posts.add_metric(["error"], st.posts_failed_total)
    yield posts
    yield CounterMetricFamily("ghostgpu_alertmanager_alerts_sent_total",
                              _help("ghostgpu_alertmanager_alerts_sent_total"), value=st.alerts_sent_total)
    name = "ghostgpu_alertmanager_pending_alerts"
    yield GaugeMetricFamily(name, _help(name), value=st.pending)
    yield GaugeMetricFamily("ghostgpu_alertmanager_last_success_timestamp_seconds",
                            _help("ghostgpu_alertmanager_last_success_timestamp_seconds"),
                            value=st.last_success_unix_s or 0.0)
