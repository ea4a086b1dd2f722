"""`ghostgpu collector`, and the Collector class that `ghostgpu up` and the tests embed.

    c = Collector(CollectorConfig(listen=("127.0.0.1:0", "unix:///run/ghostgpu.sock"), db_path="/tmp/c.db"))
    c.start()                 # binds, loads the database; raises ListenError / StoreError
    c.addresses               # ["127.0.0.1:41234", "unix:///run/ghostgpu.sock"]
    c.metrics_address         # "127.0.0.1:9400" with metrics_listen="127.0.0.1:9400", else None
    ...                       # tracers connect to c.address; clients query it
    c.stop(grace_s=1.0)       # ends streams (UNAVAILABLE), commits what was accepted, closes

Threads: one asyncio loop owns every piece of in-memory state (nodes, the cluster table,
findings, watchers) and serves gRPC; one writer thread owns SQLite (collector/store.py); the CRI
resolver's workers (collector/cri.py) call CRI through a tracer's relay or a local socket and
hand their answers back to the loop. /metrics (metrics_listen) is served by its own HTTP threads
(collector/metrics.py), which read the loop's state through call(); the Alertmanager pusher
(alertmanager URLs, collector/alertpush.py) watches findings like any WatchFindings client and posts
from its own thread, so a down Alertmanager never holds up ingest. Trace sessions (collector/traces.py)
live on the loop too, their tables in the same SQLite file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from ghostgpu.collector.cluster import ClusterTable
from ghostgpu.collector.config import CollectorConfig
from ghostgpu.collector.faults import FaultBook, select_unended
from ghostgpu.collector.findings_remote import RemoteFindings
from ghostgpu.collector.heap import HeapPolicy
from ghostgpu.collector.ingest import Ingest, IngestSession
from ghostgpu.collector.isolation import Isolator
from ghostgpu.collector.kube_api import KubeApi, NodeLabels
from ghostgpu.collector.leases import Leases
from ghostgpu.collector.node_state import NodeStateWriter
from ghostgpu.collector.nodes import NodeView
from ghostgpu.collector.notify import Notifications, Notifier, notifier_for
from ghostgpu.collector.policy import ADMIN
from ghostgpu.collector.query import QueryService
from ghostgpu.collector.remediation_config import RemediationConfig
from ghostgpu.collector.replica_commands import ReplicaCommands
from ghostgpu.collector.security import Security, SecurityOptions
from ghostgpu.collector.server import ListenError, start_server
from ghostgpu.collector.store import Store
from ghostgpu.collector.tickets import TicketDesk
from ghostgpu.collector.trace_commands import TraceTiming
from ghostgpu.collector.trace_follow import TraceFollow
from ghostgpu.collector.trace_store import TraceStore
from ghostgpu.collector.traces import TraceBook

from ghostgpu.common.model.consumers import K8sInfo
from ghostgpu.common.transport.addresses import dial_address, is_unix, port_of
from ghostgpu.common.web.httpserve import HttpServer, Unavailable

log = logging.getLogger(__name__)

FINDINGS_FLUSH_S = 1.0  # changed open findings reach the history at most this late
FAULT_COUNTS_PRUNE_S = 600.0  # how often the fault counts of nodes gone past the retention are dropped
T = TypeVar("T")


class MetricsUnavailable(Unavailable):
    """A scrape came while the collector's loop is not running: 503, as Prometheus retries next scrape."""


class Resolver(Protocol):
    def get(self, node: str, container_id: str) -> K8sInfo: ...


ResolverFactory = Callable[[Callable[[str], Any], Callable[[str, str], None]], Resolver]


class Collector:
    """The collector in this process: `config` holds every setting (collector/config.py); the keywords
    are collaborators, not settings: stand-ins the tests pass, the long-running commands' gc policy."""

    def __init__(self, config: CollectorConfig, *, resolver_factory: ResolverFactory | None = None,
                 pusher_factory: Callable[..., Any] | None = None, heap: HeapPolicy | None = None,
                 trace_timing: TraceTiming | None = None, security: SecurityOptions | None = None,
                 remediation_timing: Any = None) -> None:
        """resolver_factory, pusher_factory: stand-ins for the CRI resolver and the Alertmanager pusher;
        heap: the commands' gc policy (collector/heap.py), ticked by the loop; trace_timing: the trace
        sessions' waits and ticks (tests shorten them); security: SecurityOptions already built (tests
        with their own TLS files), else the config's; remediation_timing: the remediation engine's
        RemediationTiming (tests shorten it)."""
        self.config = config
        self._resolver_factory = resolver_factory
        self._pusher_factory = pusher_factory
        self.heap = heap
        self._remediation_timing = remediation_timing
        self.trace_limits = config.trace_limits(trace_timing)  # collector/traces.py: trace sessions
        self.security_options = security or config.security_options()  # collector/security.py
        # The remediation policy in force (--config's remediation section; a bad one: ConfigError here),
        # re-read when the file changes (the loop's tick) and on SIGHUP (collector/run.py).
        self.remediation_config = RemediationConfig(config.config_path)
        self._init_loop_state()
        self._init_components()

    def _init_loop_state(self) -> None:
        """The loop thread and its start/stop signals."""
        self.addresses: list[str] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self._start_error: BaseException | None = None
        self._stop_event: asyncio.Event | None = None
        self._grace_s = 1.0

    def _init_components(self) -> None:
        """What start() builds (_build), None until then or when not configured."""
        self.security: Security | None = None
        self._direct: Any = None  # the local CRI socket's transport (cri_endpoint)
        self.resolver: Any = None
        self.metrics: Any = None  # collector.metrics.CollectorMetrics with metrics_listen
        self._metrics_server: HttpServer | None = None
        self.health: Any = None  # collector.health.CollectorHealth with metrics_listen
        self.pusher: Any = None  # collector.alertpush.AlertPusher with alertmanager URLs
        self.node_state: NodeStateWriter | None = None  # with a PostgreSQL store: this replica's nodes' rows
        self._pusher_started = False

    @property
    def db_path(self) -> str:
        """Where the store is, as logs show it (a PostgreSQL URL without its password)."""
        store = getattr(self, "store", None)
        return store.path if store is not None else self.config.store_location()

    # ---- life cycle ------------------------------------------------------------------------------

    def start(self) -> Collector:
        """Open the database, bind every address, serve; raises ListenError or StoreError."""
        try:
            self._build()
        except BaseException:
            self._close_helpers()  # what was opened before the failure (the CRI channel, the store)
            raise
        self._thread = threading.Thread(target=self._run, name="collector-loop", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._close_helpers()
            raise self._start_error
        if self.pusher is not None:
            self.pusher.start()  # its watcher is registered on the loop already (_serve)
            self._pusher_started = True
        return self

    def _build(self) -> None:
        """Every component, in the order each needs the ones before it."""
        self._open_local_cri()
        self._open_store_and_security()
        self._build_cluster()
        self._build_traces()
        self._build_ingest()
        self._build_query()
        self._build_pusher()
        self._build_remediation()
        self._serve_metrics()

    def _open_local_cri(self) -> None:
        if self.config.cri_endpoint:
            from ghostgpu.collector.cri import direct_transport

            try:
                self._direct = direct_transport(self.config.cri_endpoint)
            except ValueError as e:  # a malformed endpoint: name the flag, as every other bad value does
                raise ValueError(f"--collector-cri-endpoint: {e}") from None

    def _open_store_and_security(self) -> None:
        cfg = self.config
        self.store = Store(cfg.store_location(), cfg.event_log_max, cfg.retention_days,
                           password_file=cfg.store_password_file, replica_id=cfg.replica_name())
        self.leases = Leases(self.store, self.store.replica_id, cfg.lease_ttl_s)
        # What the other replicas change, heard through PostgreSQL's LISTEN (collector/notify.py); a
        # NullNotifier with SQLite. Started on the loop (_serve), stopped after it.
        self.notifier: Notifications = notifier_for(self.store, cfg.store_password_file)
        # The audit file beside a SQLite file by default; with a shared PostgreSQL store the chain is the
        # database's (docs/SECURITY.md), and a file only where --audit-log names one.
        beside = self.store.url.target if self.store.engine == "sqlite" else ""
        self.security = Security(self.security_options, self.store, beside)
        self.security.check_listen(list(cfg.listen))

    def _build_cluster(self) -> None:
        """The nodes, the CRI resolver and the cluster table."""
        self.nodes: dict[str, NodeView] = {}
        if self._resolver_factory is not None:
            self.resolver = self._resolver_factory(self.transport_for, self._on_cri_change)
        else:
            from ghostgpu.collector.cri import CriResolver

            self.resolver = CriResolver(self.transport_for, self._on_cri_change, ttl_s=self.config.cri_ttl_s)
        # A shared store's open findings are adopted node by node, with each node's lease (ingest).
        shared = self.store.engine != "sqlite"
        self.cluster = ClusterTable(self.nodes, self.resolver.get, self.store, 1,
                                    () if shared else self.store.load_open_findings(),
                                    forget=getattr(self.resolver, "forget", None),
                                    keep=getattr(self.resolver, "keep", None))
        self.cluster.id_source = self.store.next_finding_id
        self.cluster.fence_for = self.leases.fence
        # Replicas: the findings other replicas write, to this replica's WatchFindings watchers
        self.remote_findings = (RemoteFindings(self.cluster, self.store, self.notifier)
                                if self.store.engine == "postgresql" else None)
        # GPU faults (collector/faults.py): their hits named through the same resolver
        self.faults = FaultBook(self.store, self.resolver.get, self.config.faults_max)
        self.store.load(self.faults.load)

    def _build_traces(self) -> None:
        """Trace sessions: their store (audited) and the book, which reads the connected streams."""
        assert self.security is not None
        self.trace_store = TraceStore(self.store, self.config.trace_store_max_records,
                                      self.config.trace_retention_h * 3600)
        # Trace starts, stops, expiries and refusals go to the audit log too (the trace_audit table
        # keeps the per-session view `trace show` prints).
        audit = self.security.audit
        self.trace_store.on_audit = lambda sid, action, who, detail: audit(
            f"trace.{action}", who, "ok" if action in ("start", "stop", "expire") else action,
            session=sid, detail=detail)
        self.streams: dict[str, IngestSession] = {}  # by node: filled by Ingest, read by the book
        self.replica: ReplicaCommands | None = None
        if self.store.engine == "postgresql":  # replicas: trace and CRI commands for each other's nodes
            self.replica = ReplicaCommands(self.store, self.notifier, self.store.replica_id, self.streams,
                                           fence=self.leases.fence)
        self.traces = TraceBook(self.streams, self.trace_store, self.trace_limits,
                                transport_for=self.transport_for, nodes=self.nodes,
                                cluster_rows=self.cluster.rows,
                                resolve_names=getattr(self.resolver, "get", None), replica=self.replica)
        if self.store.engine == "postgresql":  # WatchTrace reads every replica's records from the store
            self.traces.follow = TraceFollow(self.store, self.notifier)

    def _build_ingest(self) -> None:
        """The stream servicer, feeding the cluster table and the trace book."""
        assert self.security is not None
        # the local node: its uid peers are this node's tracer (docs/SECURITY.md)
        self.ingest = Ingest(self.nodes, self.cluster, self.store, self.config.event_log_max,
                             sessions=self.streams, traces=self.traces, audit=self.security.audit,
                             local_node=self.config.node_name, faults=self.faults, leases=self.leases)
        self.relay = self.ingest.relay  # CRI calls through the tracers' streams (collector/relay.py)
        if self.replica is not None:  # other replicas' CRI calls for this replica's nodes
            self.replica.serve_cri(self._own_transport)

    def _build_query(self) -> None:
        """The Query service, audited, its trace rules read from the current policy."""
        assert self.security is not None
        failures = getattr(self.resolver, "node_failures", None)
        self.query = QueryService(self.nodes, self.cluster, self.store, failures, traces=self.traces)
        self.query.audit = self.security.audit
        policy = self.security.policy
        self.query.trace_denial = lambda who, ns, duration_s: policy.policy.trace_denial(who, ns, duration_s)
        self.query.is_admin = lambda who: ADMIN in policy.policy.roles(who)  # reads and stops any session
        if self.store.engine == "postgresql":  # replicas: ps and NodeStatus answer for every node
            self.node_state = NodeStateWriter(self.store, self.leases, self.nodes, self.cluster, failures)
            self.query.owned_nodes = self.node_state.owned

    def _build_pusher(self) -> None:
        """The Alertmanager pusher, with alertmanager URLs only."""
        cfg = self.config
        if not cfg.alertmanager:
            return
        if self._pusher_factory is not None:
            factory = self._pusher_factory
        else:
            from ghostgpu.collector.alertpush import AlertPusher as factory  # only with --alertmanager
        # ValueError naming --alertmanager or --alert-label on a bad URL or label
        self.pusher = factory(list(cfg.alertmanager), extra_labels=dict(cfg.alert_labels),
                              resend_s=cfg.alert_resend_s, fault_hold_s=cfg.alert_fault_hold_s)
        self.faults.listeners.append(self.pusher.offer_fault)  # one alert per GPU fault

    def _build_remediation(self) -> None:
        """The remediation engine (collector/remediation.py): Remediate and RemediationControl, and a tick
        on the loop; off until the config's remediation section (or `ghostgpu remediate mode`) says so."""
        from ghostgpu.collector.remediation import REPLICA_KIND, Remediator, replica_forward, replica_handler

        assert self.security is not None
        shared = self.store.engine != "sqlite"
        leases, replica = self.leases, self.replica

        def owner_of(node: str) -> str | None:
            remote = replica.remote_stream(node) if replica is not None else None
            return remote.owner if remote is not None else None

        # Action 2 (collector/isolation.py, through the Kubernetes API: its client made at the first
        # act) and action 3 (collector/tickets.py), each off until the remediation section turns it on.
        # The nodes' labels (the opt-out label), read through the Kubernetes API off the loop and cached:
        # for the kill engine and isolation alike; without an API they are unknown (no label opt-out).
        node_labels = NodeLabels(lambda: KubeApi(self.remediation_config().isolation.kubeconfig))
        # The desk first: both engines file their incidents' tickets on it.
        self.tickets = tickets = TicketDesk(lambda: self.remediation_config().ticket)
        self.isolator = isolator = Isolator(self.store, self.remediation_config, nodes=self.nodes,
                                            audit=self.security.audit, view=lambda: self.remediator.view,
                                            refresh=lambda: self.remediator.fresh_view(),
                                            replica_id=self.store.replica_id, labels=node_labels,
                                            ticket=tickets.submit)
        self.faults.listeners.append(isolator.on_fault)  # a critical Xid isolates its node
        self.remediator = Remediator(
            self.store, self.cluster, self.streams, policy=self.remediation_config,
            replica_id=self.store.replica_id, audit=self.security.audit,
            applies=(lambda node: leases.fence(node) is not None) if shared else None, owner_of=owner_of,
            alerts=self.pusher if hasattr(self.pusher, "offer_remediation") else None,
            isolate=isolator.isolate_unkillable, ticket=tickets.submit,
            forward=replica_forward(replica) if replica is not None else None,
            timing=self._remediation_timing, labels=node_labels.labels, labels_now=node_labels.labels_now)
        if replica is not None:  # Remediate calls other replicas hand over for this replica's nodes
            replica.handle(REPLICA_KIND, replica_handler(self.remediator))
        self.ingest.remediation = self.remediator.calls  # the tracers' RemediateResults
        self.remediation_config.on_change.append(self.remediator.config_changed)  # audited
        self.remediation_config.on_refused.append(self.remediator.config_refused)
        self.query.remediator = self.remediator

    def _serve_metrics(self) -> None:
        """/metrics, with metrics_listen only. Bound before the loop runs (a taken port fails start()
        at once); a scrape that comes before the loop is up is answered 503 by _call_for_scrape."""
        cfg = self.config
        if cfg.metrics_listen is None:
            return
        assert self.security is not None
        from ghostgpu.collector.health import PROBE_PATHS, CollectorHealth
        from ghostgpu.collector.metrics import CollectorMetrics

        self.metrics = CollectorMetrics(
            self.nodes, self.cluster, call=self._call_for_scrape,
            cri_stats=getattr(self.resolver, "stats", None),
            push_stats=self.pusher.stats if self.pusher is not None else None,
            audit_head=self.security.audit_head, max_process_series=cfg.metrics_max_process_series,
            faults=self.faults, store=self.store, leases=self.leases,
            notifier=self.notifier if isinstance(self.notifier, Notifier) else None,  # PostgreSQL's
            replica=self.replica.stats if self.replica is not None else None, remediation=self.remediator,
            tickets=self.tickets.stats, isolations=lambda: dict(self.isolator.outcomes_total))
        # /healthz and /readyz beside /metrics (collector/health.py), open to kubelet's probes
        self.health = CollectorHealth(self.store, loop=lambda: self.loop, serving=self._serving,
                                      leases=self.leases)
        self._metrics_server = HttpServer(cfg.metrics_listen, {"/metrics": self.metrics.handle,
                                                               **self.health.routes()},
                                          flag="--metrics-listen", name="metrics", open_paths=PROBE_PATHS,
                                          web_config=cfg.web_config_file,
                                          insecure=self.security_options.insecure,  # as gRPC's rule
                                          **cfg.http_caps()).start()

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        finally:
            self._stopped.set()
            self._ready.set()

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        security = self.security
        assert security is not None  # built by start() before the loop runs
        self.ingest.serve_on(self.loop)
        self._stop_event = asyncio.Event()
        try:
            server, self.addresses = await start_server(self.ingest.connect, self.query,
                                                        list(self.config.listen), security)
        except (ListenError, OSError) as e:
            self._start_error = e if isinstance(e, ListenError) else ListenError(f"--listen: {e}")
            return
        if self.pusher is not None:
            self.pusher.watcher.local_only = True  # each replica pushes the alerts of its own nodes
            release = getattr(self.pusher, "release_findings", None)  # tests' stand-in pushers lack it
            if release is not None:
                self.cluster.on_forget.append(release)
            self.cluster.watch(self.pusher.watcher, include_open=True)
            await self._offer_recent_faults()
        self.traces.start_ticking()
        self.cluster.on_finding.append(self.remediator.on_finding)  # an orphan opened: a tick now
        self.remediator.start_ticking()
        self.notifier.start(self.loop)
        if self.remote_findings is not None:
            self.remote_findings.start()
        if self.replica is not None:
            self.replica.start()
        renewals = asyncio.create_task(self.ingest.keep_leases())
        if self.node_state is not None:
            self.node_state.start_ticking()
        self._ready.set()
        next_prune_mono = 0.0
        while True:
            try:
                await asyncio.wait_for(self._stop_event.wait(), FINDINGS_FLUSH_S)
                break
            except TimeoutError:
                if time.monotonic() >= next_prune_mono:
                    next_prune_mono = time.monotonic() + FAULT_COUNTS_PRUNE_S
                    self._prune_fault_counts()
                self.cluster.flush_changed()
                self.cluster.release_unused()
                security.tick()  # a changed policy file is reloaded (a bad one keeps the old)
                self.remediation_config.maybe_reload()  # and so is a changed remediation section
                try:
                    self.isolator.check_memory()  # memory no process owns, for too long: isolation
                except Exception:  # a bug there must not end the collector's loop: logged, next second
                    log.exception("remediation: the unaccounted-memory check failed")
                if self.heap is not None:
                    self.heap.tick()
        renewals.cancel()
        self.remediator.shutdown()
        self.isolator.close()
        self.tickets.close()
        if self.node_state is not None:
            self.node_state.stop()
        self.cluster.flush_changed()
        self.traces.shutdown()  # before the streams end: sessions end naming the collector, not a node
        if self.replica is not None:
            self.replica.close()
        self.ingest.shutdown()
        self.query.shutdown()
        if self.remote_findings is not None:
            self.remote_findings.close()
        await server.stop(self._grace_s)
        await asyncio.to_thread(self.notifier.stop)
        security.stopping()  # the audit chain's collector.stop, while the store still takes it
        await asyncio.to_thread(self.store.close)  # commits what was accepted; acks no longer matter

    def _node_last_seen_unix_ns(self, node: str) -> int:
        """When the collector last heard from `node`: now while its stream is open; 0 for a node it
        no longer knows (its stream positions, last updated longer ago than --retention-days, pruned)."""
        view = self.nodes.get(node)
        if view is None:
            return 0
        if view.connected:
            return time.time_ns()
        return max([view.last_heartbeat_unix_ns, *(p.updated_unix_ns for p in view.positions.values())])

    def _prune_fault_counts(self) -> None:
        """ghostgpu_xid_errors_total of the nodes gone longer than --retention-days: dropped, as their
        stream positions are (collector/store.py), so the series of nodes long gone do not pile up."""
        before_ns = time.time_ns() - int(self.store.retention_s * 1e9)
        gone = self.faults.prune_gone(self._node_last_seen_unix_ns, before_ns)
        if gone:
            log.info("GPU fault counts of %d node(s) gone over %g days dropped: %s", len(gone),
                     self.config.retention_days, ", ".join(gone[:10]) + (" ..." if len(gone) > 10 else ""))

    async def _offer_recent_faults(self) -> None:
        """The stored faults whose pushed alerts have not ended (--alert-fault-hold): offered again, as
        the open findings are, so an Alertmanager that lost its alerts while this collector was
        stopped gets them back (the same labels: one that kept them sees no new alert)."""
        from ghostgpu.collector.alertbook import MAX_FAULT_ALERTS  # only with --alertmanager

        assert self.pusher is not None
        since_ns = time.time_ns() - int(self.config.alert_fault_hold_s * 1e9)
        recent = await asyncio.wrap_future(self.store.read(select_unended(since_ns, MAX_FAULT_ALERTS)))
        for cf in recent:
            self.pusher.offer_fault(cf)

    def stop(self, grace_s: float = 1.0) -> None:
        """End every stream and watch, commit what was accepted, close. Idempotent."""
        if self._thread is None:
            return
        if self._metrics_server is not None:
            self._metrics_server.stop()  # no scrape waits on a loop that is going away
        self._grace_s = grace_s
        loop, event = self.loop, self._stop_event
        if loop is not None and event is not None and not self._stopped.is_set():
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(event.set)
        self._thread.join(grace_s + 30.0)
        self._close_helpers()

    def _close_helpers(self) -> None:
        server, self._metrics_server = self._metrics_server, None
        if server is not None:
            server.stop()
        if self.pusher is not None and self._pusher_started:
            self._pusher_started = False
            self.pusher.stop()  # one last, bounded attempt to deliver what is pending
        close = getattr(self.resolver, "close", None)
        if close is not None:
            close()
        channel = getattr(self._direct, "channel", None)
        if channel is not None:
            channel.close()
        security, self.security = self.security, None
        if security is not None:
            security.close()
        notifier = getattr(self, "notifier", None)
        if notifier is not None:
            notifier.stop()  # idempotent: after the loop's own stop, nothing is left to do
        store = getattr(self, "store", None)  # absent when start() failed before opening it
        if store is not None:
            store.close()  # idempotent: after the loop's own close, only the connection is closed again

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the collector has stopped; False on timeout."""
        return self._stopped.wait(timeout_s)

    @property
    def address(self) -> str:
        """The first bound address, as a client dials it (0.0.0.0 and [::] become loopback)."""
        return dial_address(self.addresses[0])

    @property
    def metrics_address(self) -> str | None:
        """HOST:PORT of /metrics as a client dials it, None without metrics_listen."""
        return self._metrics_server.address if self._metrics_server is not None else None

    @property
    def metrics_url(self) -> str | None:
        """http(s)://HOST:PORT/metrics (https when the web config sets TLS); None without metrics_listen."""
        return f"{self._metrics_server.url}/metrics" if self._metrics_server is not None else None

    @property
    def port(self) -> int | None:
        """The TCP port of the first TCP address (the chosen one for HOST:0), None if only unix."""
        return next((port_of(addr) for addr in self.addresses if not is_unix(addr)), None)

    @property
    def failed(self) -> BaseException | None:
        """The store's sticky write failure, if any: the collector then refuses every stream."""
        return self.store.failed

    # ---- glue between the loop and other threads ---------------------------------------------------

    def call(self, fn: Callable[[], T], timeout_s: float = 10.0) -> T:
        """Run fn on the collector's loop (where its state lives) and return what it returns."""
        assert self.loop is not None
        fut: Future[T] = Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except Exception as e:
                fut.set_exception(e)

        self.loop.call_soon_threadsafe(run)
        return fut.result(timeout_s)

    def trace_audit(self, session: str = "", since_unix_ns: int = 0, limit: int = 1000) -> list[Any]:
        """The trace_audit rows (ghostgpu.v1.TraceAuditEntry), oldest first; from any thread."""
        return self.traces.audit(session, since_unix_ns, limit).result(10.0)

    def _serving(self) -> bool:
        """Started and not stopping: /readyz's first check (read from the HTTP server's thread)."""
        event = self._stop_event
        return self._ready.is_set() and self._start_error is None and event is not None and not event.is_set()

    def _call_for_scrape(self, fn: Callable[[], T]) -> T:
        loop = self.loop
        if loop is None or loop.is_closed() or self._stopped.is_set():
            raise MetricsUnavailable("the collector is not serving (starting or stopping); scrape again")
        return self.call(fn)

    def transport_for(self, node: str) -> Any:
        """The CRI transport for a node: the local socket for the collector's own node, else the
        node's tracer relay, else through the replica whose stream the node is on (replicas sharing
        a PostgreSQL store, collector/replica_commands.py), else the local socket
        (--collector-cri-endpoint), else None."""
        node_name = self.config.node_name
        if self._direct is not None and node_name and node == node_name:
            return self._direct
        remote = self.replica.transport(node) if self.replica is not None else None
        return self.relay.transport(node) or remote or self._direct

    def _own_transport(self, node: str) -> Any:
        """transport_for without the other replicas: what this replica answers their CRI calls with."""
        node_name = self.config.node_name
        if self._direct is not None and node_name and node == node_name:
            return self._direct
        return self.relay.transport(node) or self._direct

    def _on_cri_change(self, node: str, container_id: str) -> None:
        loop = self.loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # stopping: nobody reads the table any more
                loop.call_soon_threadsafe(self._cri_changed, node, container_id)

    def _cri_changed(self, node: str, container_id: str) -> None:
        """On the loop: CRI's answer for a container changed; its consumers and faults take it."""
        self.cluster.on_cri_change(node, container_id)
        self.faults.on_cri_change(node, container_id)
