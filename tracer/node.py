"""`ghostgpu tracer`: the node agent with its sinks, CRI relay and PodResources poller.

Without --collector it writes JSON lines (stdout, or --jsonl PATH), as it always has. With
--collector it streams to the collector (StreamSink), also writing JSON lines if --jsonl is given,
relays the collector's CRI calls to this node's runtime socket, and reports PodResources
allocations (the poller also runs without a collector when --podresources-endpoint is given,
writing `allocations` records to the JSON lines).

With --health-listen HOST:PORT (config health_listen) it serves /healthz, /readyz and /metrics
(tracer/health.py). That server binds first, before the stream or BPF, so a bad or busy address
is one line and exit 2 with nothing loaded, and a slow start answers 503 on /readyz rather than
refusing connections; stderr gets "ghostgpu: health: serving on HOST:PORT" with the bound port.

SIGTERM/SIGINT stop it in order: the tracer loop first (no new records), then the health server,
the poller, then the sinks, the stream flushing what the collector will still acknowledge within
its deadline.
`ghostgpu up` runs this same command as a subprocess, so everything is reachable from flags.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ghostgpu.tracer.agent import Tracer
from ghostgpu.tracer.capabilities import check_capabilities
from ghostgpu.tracer.config import TracerConfig
from ghostgpu.tracer.cri_relay import CriRelay
from ghostgpu.tracer.devices import DeviceCatalog
from ghostgpu.tracer.podresources import PodResourcesPoller
from ghostgpu.tracer.remediate import Remediator, cap_kill_note
from ghostgpu.tracer.sinks import FanOut, JsonlSink, Sink
from ghostgpu.tracer.stream import StreamOptions, StreamSink

from ghostgpu.common.model.remediation import CAPABILITY as REMEDIATION_CAPABILITY
from ghostgpu.common.system.fdlimit import raise_fd_limit
from ghostgpu.common.transport.collector_target import collector_address
from ghostgpu.common.transport.tls import TlsFiles, check_client

if TYPE_CHECKING:
    from ghostgpu.tracer.health import AgentHealth
    from ghostgpu.tracer.trace_sessions import TraceSessions

    from ghostgpu.common.web.httpserve import HttpServer

log = logging.getLogger("ghostgpu.tracer")

PODRESOURCES_INTERVAL_S = 10.0


def _ringbuf_drops(tracer: Tracer) -> Callable[[], int]:
    """The kernel ring buffer's drop count for TracerStats, as the agent last read it on its own
    thread (no syscall on the stream's thread)."""
    return lambda: int(tracer.bpf_stats().get("ringbuf_drops", 0))


def build_sinks(cfg: TracerConfig, args: argparse.Namespace, poller_runs: bool,
                ) -> tuple[list[Sink], StreamSink | None, CriRelay | None]:
    """(sinks, the stream sink or None, the CRI relay or None) for the command line in `args`."""
    collector = getattr(args, "collector", None)
    jsonl = getattr(args, "jsonl", None)
    sinks: list[Sink] = []
    if jsonl or not collector:
        sinks.append(JsonlSink(jsonl or "-"))
    if not collector:
        return sinks, None, None
    target = collector_address(collector)
    tls = tracer_tls(cfg)
    trusted = cfg.collector_uid if cfg.collector_uid >= 0 else None  # a plaintext collector's other uid
    options = StreamOptions(spool_events=cfg.spool_events, tls=tls, collector_uid=trusted)
    # The spool checks its bound (a one-line ValueError naming --spool-events) before any thread starts.
    relay = CriRelay(getattr(args, "cri_endpoint", None), node=cfg.node_name)
    remediator = build_remediator(cfg, relay)
    capabilities = [*(["podresources"] if poller_runs else []),
                    *([REMEDIATION_CAPABILITY] if remediator.enabled else [])]
    stream = StreamSink(target, cfg.node_name, relay=relay, capabilities=capabilities, options=options,
                        remediate=remediator.handle)
    sinks.append(stream)
    return sinks, stream, relay


def build_remediator(cfg: TracerConfig, relay: CriRelay | None) -> Remediator:
    """The act of remediation (tracer/remediate.py): on, or opted out with --remediation off."""
    catalog = DeviceCatalog(cfg.prefixes, cfg.proc_root)  # its own: the agent's is its thread's
    return Remediator(cfg.node_name, catalog, relay, enabled=cfg.remediation == "on", proc_root=cfg.proc_root)


def tracer_tls(cfg: TracerConfig) -> TlsFiles | None:
    """This node's mTLS files (tls_cert/tls_key/tls_ca, GHOSTGPU_TLS_*), checked now: a tracer needs
    its certificate, which names its node (TlsError, one line naming the file or the mismatch)."""
    files = TlsFiles(cfg.tls_cert or None, cfg.tls_key or None, cfg.tls_ca or None, cfg.tls_trust_domain)
    if not files.enabled:
        return None
    check_client(files, require_cert=True)
    return files


def start_trace_sessions(cfg: TracerConfig, tracer: Tracer, stream: StreamSink) -> TraceSessions | None:
    """Trace sessions (docs/TRACE.md) run where the kernel side runs and a collector can ask for them."""
    bpf = tracer.bpf
    if bpf is None or bpf.trace is None:
        stream.set_trace_handler(None, bpf.trace_error if bpf is not None else "BPF is off on this node")
        return None
    from ghostgpu.tracer.call_decode import read_driver_version
    from ghostgpu.tracer.cgroup import CgroupIdResolver
    from ghostgpu.tracer.trace_records import RecordMaker
    from ghostgpu.tracer.trace_sessions import NodeTraceLimits, TraceSessions

    def gpu_names(minor: int) -> tuple[str, str]:
        gpu = tracer.nvml.gpu_by_minor(minor)  # the view is replaced whole by the agent: safe to read
        return (str(gpu.index), gpu.uuid) if gpu is not None else (str(minor), "")

    def driver_version() -> str | None:
        return read_driver_version(cfg.proc_root) or tracer.nvml.driver_version or None

    cgroups = CgroupIdResolver(cfg.cgroup_root)  # the session thread's own: no cache shared across threads
    def known_identity(pid: int) -> tuple[int | None, str] | None:
        holder = tracer.state.holders.get(pid)  # one dict read: safe beside the agent's thread
        return (holder.process.ns_pid, holder.process.comm) if holder is not None else None

    maker = RecordMaker(cfg.node_name, cfg.proc_root, cgroups, tracer.catalog.ref_for, bpf.trace.dev_paths,
                        gpu_names, known_identity)
    limits = NodeTraceLimits.of(cfg)
    sessions = TraceSessions(bpf.trace, cfg.node_name, limits, maker, cgroups, stream.emit_trace,
                             driver_version)
    stream.set_trace_handler(sessions.handle)
    stream.set_reconnect_hook(lambda: sessions.end_all("the stream to the collector was lost"))
    return sessions


def start_health(cfg: TracerConfig, args: argparse.Namespace,
                 ) -> tuple[AgentHealth | None, HttpServer | None]:
    """(AgentHealth, HttpServer) serving --health-listen, or (None, None) when it is not set."""
    listen = cfg.health_listen  # --health-listen, already merged into cfg
    if not listen:
        return None, None
    from ghostgpu.tracer.health import AgentHealth, start_health_server  # prometheus_client: only when asked

    health = AgentHealth()
    # HttpListenError names --health-listen, WebConfigError the web config file: exit 2
    server = start_health_server(listen, health, web_config=cfg.web_config_file or None,
                                 insecure=bool(getattr(args, "insecure", False)),
                                 max_connections=getattr(args, "http_max_connections", None),
                                 max_connections_per_source=getattr(args, "http_max_connections_per_source",
                                                                    None))
    tls = " over TLS" if server.tls else ""
    print(f"ghostgpu: health: serving on {server.address}{tls} (/healthz, /readyz, /metrics)",
          file=sys.stderr, flush=True)
    return health, server


def run_tracer(cfg: TracerConfig, args: argparse.Namespace,
               install_signals: Callable[[Callable[[], None]], None]) -> int:
    raise_fd_limit()  # before the health port listens: a flood of connections takes descriptors
    health, health_server = start_health(cfg, args)
    try:
        return _run(cfg, args, install_signals, health, health_server)
    finally:
        if health_server is not None:
            health_server.stop()  # a second stop is a no-op; this one covers a failed build_sinks


def _run(cfg: TracerConfig, args: argparse.Namespace, install_signals: Callable[[Callable[[], None]], None],
         health: AgentHealth | None, health_server: HttpServer | None) -> int:
    collector = getattr(args, "collector", None)
    pr_endpoint = getattr(args, "podresources_endpoint", None)
    poller_runs = bool(collector or pr_endpoint)
    if getattr(args, "cri_endpoint", None) and not collector:
        log.warning("--cri-endpoint is used by the CRI relay, which runs only with --collector")
    sinks, stream, relay = build_sinks(cfg, args, poller_runs)
    sink: Any = sinks[0] if len(sinks) == 1 else FanOut(sinks)
    poller: PodResourcesPoller | None = None
    tracer: Tracer | None = None
    sessions: TraceSessions | None = None
    try:
        if poller_runs:
            poller = PodResourcesPoller(pr_endpoint, sink.emit, PODRESOURCES_INTERVAL_S, node=cfg.node_name)
        for line in check_capabilities(bpf=cfg.bpf != "off"):  # one line per missing capability
            log.warning("%s", line)
        if stream is not None and cfg.remediation == "on" and (note := cap_kill_note()):
            log.info("%s", note)
        tracer = Tracer(cfg, sink, health=health)
        if stream is not None:
            stream.ringbuf_dropped = _ringbuf_drops(tracer)
            stream.counters = tracer.stream_counters
            if health is not None:
                health.stream = stream
        install_signals(tracer.stop)
        tracer.start()
        if stream is not None:
            sessions = start_trace_sessions(cfg, tracer, stream)
        if poller is not None:
            poller.start()
        while not tracer.stop_event.is_set():
            tracer.step()
    finally:
        if sessions is not None:
            sessions.close()  # ends every session with a last batch, before BPF goes away
        if tracer is not None:
            tracer.close()
        if health_server is not None:
            health_server.stop()  # the port is free before the stream's flush (up to 2 s)
        if poller is not None:
            poller.stop()
        sink.close()
        if relay is not None:
            relay.close()
    return 0
