"""The tracer's own health: liveness, readiness and self-metrics on `--health-listen HOST:PORT`.

    health = AgentHealth()                         # before anything slow, so probes get answers
    server = start_health_server("0.0.0.0:9401", health)
    tracer = Tracer(cfg, sink, health=health)      # the agent reports into it; attach the stream
    ...
    server.stop()

The agent thread writes plain attributes (a monotonic clock read per loop step, a tuple replaced
whole after each full /proc scan): no lock and no syscall on its path. Everything else (holders,
consumers, NVML, the kernel counters, the stream's stats) is read from the agent at scrape time
by the HTTP thread; each of those is a value the agent replaces whole, so a reader never sees one
half-built.

- /healthz: 200 while the agent loop completed a step within LIVE_WINDOW_S (or, before the first
  step, while start() is within START_DEADLINE_S); 503 naming how long ago it last ran. A loop
  wedged in a stuck NVML call or /proc read fails it, and the kubelet restarts the pod. Errors the
  loop contained (tracer/containment.py) make it "degraded", still 200: a restart would lose the
  holder table and cure nothing.
- /readyz: 200 once start() finished (BPF attached or knowingly off, first /proc scan done);
  503 before. Plain text, one line per check.
- /metrics: a registry of this process's own (never prometheus_client's global REGISTRY).
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ghostgpu.tracer.bpf_source import OUTCOME_STATS, STAT_NAMES
from ghostgpu.tracer.containment import STAGES
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from ghostgpu import __version__
from ghostgpu.common.model.consumers import ConsumerClass
from ghostgpu.common.web.httpserve import (
    PROMETHEUS_TEXT,
    HttpServer,
    Request,
    Response,
    given_caps,
    probe_routes,
)
from ghostgpu.common.wire import protocol

if TYPE_CHECKING:
    from ghostgpu.tracer.agent import Tracer

LIVE_WINDOW_S = 30.0  # a loop step is at most ~0.25 s plus a scan; 30 s without one is a wedged loop
START_DEADLINE_S = 180.0  # start() compiles BPF with bcc: 1.3 s to ready measured here (bcc 0.26, 2 cores)
SCAN_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
FLAG = "--health-listen"
PROBE_PATHS = ("/healthz", "/readyz")  # kubelet probes: no credentials needed (TLS still applies)

TRACER_METRICS: dict[str, tuple[str, str]] = {
    "ghostgpu_agent_ready": ("gauge", "1 once the tracer finished starting (BPF attached or off, first /proc "
                             "scan done), else 0"),
    "ghostgpu_agent_bpf_programs_attached": ("gauge", "BPF tracepoint programs attached (0 with BPF off)"),
    "ghostgpu_agent_ringbuf_drops_total": ("counter", "Kernel ring-buffer records dropped because the "
                                           "buffer was full"),
    "ghostgpu_agent_bpf_errors_total": ("counter", "Other kernel-side failures by kind (a full BPF map "
                                        "refused an insert); the next /proc scan reconciles"),
    "ghostgpu_agent_errors_total": ("counter", "Unexpected errors the agent loop contained and went on "
                                    "after, by stage (event, scan, nvml, ioctl, classify, sweep); "
                                    "should stay 0"),
    "ghostgpu_agent_scan_duration_seconds": ("histogram", "Duration of full /proc scans"),
    "ghostgpu_agent_nvml_available": ("gauge", "1 when NVML answers (driver, GPU and library present), "
                                      "else 0"),
    "ghostgpu_agent_holders": ("gauge", "Processes holding GPU device files now"),
    "ghostgpu_agent_consumers": ("gauge", "Consumers (process x GPU) on this node by class"),
    "ghostgpu_agent_loop_last_step_timestamp_seconds": ("gauge", "Unix time the agent loop last "
                                                        "completed a step"),
    "ghostgpu_agent_stream_connected": ("gauge", "1 while the stream to the collector is open (only "
                                        "with --collector)"),
    "ghostgpu_agent_spool_events": ("gauge", "Events kept in the spool until the collector "
                                    "acknowledges them"),
    "ghostgpu_agent_spool_dropped_total": ("counter", "Events dropped from a full spool before the "
                                           "collector acknowledged them"),
    "ghostgpu_agent_events_sent_total": ("counter", "Events sent to the collector (resends included)"),
    "ghostgpu_build_info": ("gauge", "ghostgpu build: version, API version and Python version (always 1)"),
}


class AgentHealth:
    """Lifecycle and loop clock the agent reports into; the HTTP thread reads it (and the agent)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, live_window_s: float = LIVE_WINDOW_S,
                 start_deadline_s: float = START_DEADLINE_S) -> None:
        self._clock, self._wall_clock = clock, wall_clock
        self.live_window_s, self.start_deadline_s = live_window_s, start_deadline_s
        self.created_s = clock()
        self.tracer: Tracer | None = None  # set by the Tracer it is given to
        self.stream: Any = None  # the StreamSink (stats() -> dict) when the tracer streams
        # Written by the agent thread only.
        self.bpf_done = False
        self.bpf_programs = 0
        self.bpf_detail = ""
        self.first_scan_s: float | None = None
        self.ready = False
        self.last_step_s: float | None = None
        # (per-bucket counts, the last one +Inf; sum; count), replaced whole after each full scan.
        self._scans: tuple[tuple[int, ...], float, int] = ((0,) * (len(SCAN_BUCKETS_S) + 1), 0.0, 0)

    # --- the agent thread -----------------------------------------------------------------

    def bpf_started(self, programs: int, off_reason: str = "") -> None:
        self.bpf_programs = programs
        self.bpf_detail = off_reason
        self.bpf_done = True

    def scan_observed(self, duration_s: float) -> None:
        """A full /proc scan took duration_s (the first one is a readiness check)."""
        counts, total_s, n = self._scans
        slot = next((i for i, le in enumerate(SCAN_BUCKETS_S) if duration_s <= le), len(SCAN_BUCKETS_S))
        bumped = (*counts[:slot], counts[slot] + 1, *counts[slot + 1:])
        self._scans = (bumped, total_s + duration_s, n + 1)  # one store: a reader sees before or after
        if self.first_scan_s is None:
            self.first_scan_s = duration_s

    def started(self) -> None:
        self.last_step_s = self._clock()
        self.ready = True

    def stepped(self) -> None:
        self.last_step_s = self._clock()  # vDSO clock_gettime: no syscall, no lock

    # --- the HTTP thread ------------------------------------------------------------------

    def liveness(self) -> tuple[bool, str]:
        now = self._clock()
        last = self.last_step_s
        if last is None:
            so_far = now - self.created_s
            if so_far <= self.start_deadline_s:
                return True, f"ok: starting, {so_far:.1f} s so far (deadline {self.start_deadline_s:g} s)"
            return False, (f"start has not finished after {so_far:.1f} s (deadline "
                           f"{self.start_deadline_s:g} s): stuck loading BPF, reading NVML or in the "
                           "first /proc scan")
        ago = now - last
        if ago <= self.live_window_s:
            contained = self.tracer.errors if self.tracer is not None else None
            if contained is not None and contained.total:
                by_stage = ", ".join(f"{stage} {n}" for stage, n in contained.counts.items() if n)
                return True, (f"degraded: agent loop ran {ago:.1f} s ago; {contained.total} unexpected "
                              f"errors contained ({by_stage}); last: {contained.last}")
            return True, f"ok: agent loop ran {ago:.1f} s ago"
        return False, (f"agent loop last ran {ago:.1f} s ago (limit {self.live_window_s:g} s): wedged, "
                       "e.g. in a stuck NVML call or /proc read")

    def readiness(self) -> tuple[bool, list[str]]:
        so_far = self._clock() - self.created_s
        lines = []
        if not self.bpf_done:
            lines.append(f"bpf: waiting (compiling and attaching the programs, {so_far:.1f} s so far)")
        elif self.bpf_programs:
            lines.append(f"bpf: ok ({self.bpf_programs} tracepoint programs attached)")
        else:
            lines.append(f"bpf: ok (off: {self.bpf_detail or 'not attached'}; /proc scans only)")
        first = self.first_scan_s
        lines.append("proc scan: waiting (first /proc scan not done)" if first is None
                     else f"proc scan: ok (first scan took {first:.3f} s)")
        lines.append("start: ok" if self.ready else "start: waiting (NVML read and first classification)")
        return self.ready, lines

    def last_step_unix_s(self) -> float | None:
        last = self.last_step_s
        return None if last is None else self._wall_clock() - (self._clock() - last)

    def scans(self) -> tuple[tuple[int, ...], float, int]:
        return self._scans


class AgentCollector:
    """prometheus_client custom collector: reads the agent's numbers at scrape time."""

    def __init__(self, health: AgentHealth) -> None:
        self.health = health

    def describe(self) -> list[Metric]:
        return []  # nothing to check at register(); collect() reads live state

    def collect(self) -> Iterator[Metric]:
        h, tracer = self.health, self.health.tracer
        info = GaugeMetricFamily("ghostgpu_build_info", _help("ghostgpu_build_info"),
                                 labels=("version", "api_version", "python_version"))
        info.add_metric((__version__, str(protocol.API_VERSION), platform.python_version()), 1)
        yield info
        yield _gauge("ghostgpu_agent_ready", int(h.ready))
        yield _gauge("ghostgpu_agent_bpf_programs_attached", h.bpf_programs)
        stats = tracer.bpf_stats() if tracer is not None else {}
        yield _counter("ghostgpu_agent_ringbuf_drops_total", stats.get("ringbuf_drops", 0))
        errors = CounterMetricFamily("ghostgpu_agent_bpf_errors", _help("ghostgpu_agent_bpf_errors_total"),
                                     labels=("kind",))
        for kind in STAT_NAMES[1:]:
            if kind not in OUTCOME_STATS:  # refused or failed memory calls are the workload's, not ours
                errors.add_metric((kind,), stats.get(kind, 0))
        yield errors
        contained = CounterMetricFamily("ghostgpu_agent_errors", _help("ghostgpu_agent_errors_total"),
                                        labels=("stage",))
        for stage, n in (tracer.errors.counts if tracer is not None else dict.fromkeys(STAGES, 0)).items():
            contained.add_metric((stage,), n)
        yield contained
        counts, total_s, _n = h.scans()
        cumulative, buckets = 0, []
        for le, count in zip((*(f"{b:g}" for b in SCAN_BUCKETS_S), "+Inf"), counts, strict=True):
            cumulative += count
            buckets.append((le, cumulative))
        yield HistogramMetricFamily("ghostgpu_agent_scan_duration_seconds",
                                    _help("ghostgpu_agent_scan_duration_seconds"),
                                    buckets=buckets, sum_value=total_s)
        yield from self._agent_state(tracer)
        last_unix_s = h.last_step_unix_s()
        if last_unix_s is not None:
            yield _gauge("ghostgpu_agent_loop_last_step_timestamp_seconds", last_unix_s)
        if h.stream is not None:
            s = h.stream.stats()
            yield _gauge("ghostgpu_agent_stream_connected", int(bool(s.get("connected"))))
            yield _gauge("ghostgpu_agent_spool_events", s.get("spooled", 0))
            yield _counter("ghostgpu_agent_spool_dropped_total", s.get("dropped", 0))
            yield _counter("ghostgpu_agent_events_sent_total", s.get("events_sent", 0))

    def _agent_state(self, tracer: Tracer | None) -> Iterator[Metric]:
        nvml = tracer.nvml.available if tracer is not None else False
        yield _gauge("ghostgpu_agent_nvml_available", int(nvml))
        yield _gauge("ghostgpu_agent_holders", len(tracer.state.holders) if tracer is not None else 0)
        by_class = dict.fromkeys((str(c) for c in ConsumerClass), 0)
        # The agent replaces its consumers dict whole on every classification: list() of the
        # reference taken here is one C-level copy, never a dict that changes under iteration.
        for consumer in list(tracer.consumers.values()) if tracer is not None else ():
            by_class[str(consumer.cls)] = by_class.get(str(consumer.cls), 0) + 1
        consumers = GaugeMetricFamily("ghostgpu_agent_consumers", _help("ghostgpu_agent_consumers"),
                                      labels=("class",))
        for cls, n in by_class.items():
            consumers.add_metric((cls,), n)
        yield consumers


def _help(name: str) -> str:
    return TRACER_METRICS[name][1]


def _gauge(name: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, _help(name), value=value)


def _counter(name: str, value: float) -> CounterMetricFamily:
    # prometheus_client 0.26 takes the family name without _total and writes the sample with it.
    return CounterMetricFamily(name.removesuffix("_total"), _help(name), value=value)


def make_registry(health: AgentHealth) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(AgentCollector(health))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def health_routes(health: AgentHealth, registry: CollectorRegistry | None = None,
                  ) -> dict[str, Callable[[Request], Response]]:
    registry = registry or make_registry(health)

    def metrics(_req: Request) -> Response:
        # The 0.0.4 text format: what Prometheus 2.42 negotiates, and what generate_latest writes
        # for names that need no escaping (all of ours).
        return Response(200, generate_latest(registry), PROMETHEUS_TEXT)

    return {**probe_routes(health.liveness, health.readiness), "/metrics": metrics}


def start_health_server(listen: str, health: AgentHealth, flag: str = FLAG,
                        web_config: str | None = None, *, insecure: bool = False,
                        max_connections: int | None = None,
                        max_connections_per_source: int | None = None) -> HttpServer:
    """Bind and serve at once; HttpListenError (a ValueError, one line naming `flag`) when it cannot,
    or when it would serve plaintext on an address others can reach without `insecure` (--insecure);
    WebConfigError (one line naming the web config file) when that is wrong. With a web config, basic
    auth guards /metrics only: kubelet's probes cannot send credentials (docs/SECURITY.md). The probes
    are answered on the server's loop thread, outside the rate limit and never behind a slow scrape,
    and idle connections past the caps are closed for new ones (ghostgpu/common/web/httpserve.py)."""
    caps = given_caps(max_connections, max_connections_per_source)
    return HttpServer(listen, health_routes(health), flag=flag, name="health", web_config=web_config,
                      open_paths=PROBE_PATHS, insecure=insecure, **caps).start()
