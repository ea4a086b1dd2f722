"""The per-node part of the collector's /metrics page, written by hand in the text format 0.0.4.

prometheus_client's generate_latest over custom collectors builds a Metric and a Sample object per
series and formats each one: about 500 ms for 1,000 nodes x 20 consumers (prometheus-client 0.26,
bench/bench_metrics_scrape.py). Here each node's lines are f-strings, cached per node by
collector/metrics.py and rebuilt only for the nodes that changed, so a scrape mostly joins strings.

Format rules followed (text exposition 0.0.4, as Prometheus 2.42 parses it): label values escape
backslash, double quote and line feed and nothing else; HELP escapes backslash and line feed; HELP
and TYPE come before a family's first sample; a family's lines are one contiguous group; every line,
the last included, ends with a line feed; each (name, label set) appears once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final, Literal, NamedTuple

from ghostgpu.common.model.classes import FINDING_CLASSES
from ghostgpu.common.model.consumers import ClusterConsumer, ConsumerKey
from ghostgpu.v1 import stream_pb2

# name -> (type, help), every ghostgpu_* family the collector serves (docs/METRICS.md documents them).
COLLECTOR_METRICS: dict[str, tuple[str, str]] = {
    # Per node, rendered here.
    "ghostgpu_consumers": (
        "gauge", "GPU consumers (process x GPU) now, by node, GPU, final class and container"),
    "ghostgpu_nonvisible_consumer_info": (
        "gauge", "One series (=1) per non-visible consumer (an open finding), with its host pid and comm; "
        "capped by --metrics-max-process-series, oldest kept"),
    "ghostgpu_nonvisible_consumer_memory_bytes": (
        "gauge", "GPU memory NVML reports for a non-visible consumer (only where NVML says); same cap"),
    "ghostgpu_nonvisible_memory_bytes": (
        "gauge", "Summed GPU memory NVML reports for non-visible consumers (never capped)"),
    "ghostgpu_consumer_gpu_memory_allocated_bytes": (
        "gauge", "GPU memory a non-visible consumer holds by the driver calls it made (accepted allocations "
        "less frees; only where the tracer saw them all); same cap as the per-process series"),
    "ghostgpu_gpu_info": ("gauge", "GPUs the node's NVML reports (=1)"),
    "ghostgpu_gpu_memory_total_bytes": ("gauge", "Total memory of each GPU, as NVML reports it"),
    "ghostgpu_gpu_memory_unaccounted_bytes": (
        "gauge", "GPU memory NVML reports used that neither NVML's process list nor the driver calls of "
        "the consumers it does not list account for (absent when unknown)"),
    "ghostgpu_tracer_connected": ("gauge", "1 while the node's tracer stream is open"),
    "ghostgpu_tracer_last_heartbeat_timestamp_seconds": (
        "gauge", "When the collector last heard from the node's tracer (unix seconds)"),
    "ghostgpu_tracer_info": ("gauge", "The node's tracer version (=1)"),
    "ghostgpu_tracer_bpf_attached": ("gauge", "1 when the node's tracer has its BPF programs attached"),
    "ghostgpu_tracer_nvml_available": ("gauge", "1 when the node's tracer can read NVML"),
    "ghostgpu_tracer_events_ingested_total": ("counter", "Events stored from the node's tracers"),
    "ghostgpu_tracer_events_lost_total": (
        "counter", "Events the node's tracers lost: spool overflow (collector away too long) or BPF "
        "ring-buffer drops"),
    "ghostgpu_tracer_events_duplicate_total": ("counter", "Events received again (after a reconnect)"),
    # The tracer's own drop counters (TracerStats, proto/ghostgpu/v1/stream.proto), as its latest
    # heartbeat or snapshot said: one tracer process's counts, so they restart from 0 with the tracer
    # (Prometheus reads that as a counter reset). Absent until the node's tracer reported them.
    "ghostgpu_tracer_memory_objects_dropped_total": (
        "counter", "RM memory objects the node's tracer did not track because its object table was full "
        "(their holders' allocated_bytes become unknown), as the tracer last reported"),
    "ghostgpu_tracer_kmsg_unparsed_total": (
        "counter", "NVRM Xid kernel log lines the node's tracer could not parse (each kept raw as a fault "
        "with xid \"\"), as the tracer last reported"),
    "ghostgpu_tracer_faults_dropped_total": (
        "counter", "Xid lines the node's tracer lost because its queue to its loop was full, as the tracer "
        "last reported"),
    "ghostgpu_tracer_kmsg_records_lost_total": (
        "counter", "Kernel log records overwritten before the node's tracer read them (an Xid among them "
        "is lost), as the tracer last reported"),
    "ghostgpu_findings_opened_total": ("counter", "Findings opened since the collector started"),
    "ghostgpu_findings_resolved_total": ("counter", "Findings resolved since the collector started"),
    "ghostgpu_cri_resolution_failures_total": ("counter", "CRI calls for the node that did not answer"),
    "ghostgpu_xid_errors_total": (
        "counter", "GPU faults (Xid) the node's driver logged, by GPU (\"\": no GPU matched its PCI bus id) "
        "and Xid (\"\": a line that did not parse), as the collector stored them"),
    # Global, from the Collector's own prometheus_client registry (collector/metrics.py).
    "ghostgpu_build_info": ("gauge", "The collector's ghostgpu version, API version and Python (=1)"),
    "ghostgpu_tracers_connected": ("gauge", "Tracer streams open now"),
    "ghostgpu_audit_head_seq": (
        "gauge", "Seq of the newest record of the audit chain (it only grows, across restarts too; "
        "going back means records were cut)"),
    "ghostgpu_audit_records_total": (
        "counter", "Audit records this collector process appended, its collector.start record included"),
    "ghostgpu_cri_calls_total": ("counter", "CRI calls made to resolve containers"),
    "ghostgpu_cri_call_duration_seconds": ("histogram", "Latency of each CRI call"),
    "ghostgpu_cri_cache_entries": ("gauge", "Containers in the CRI answer cache"),
    "ghostgpu_cri_lookups_pending": ("gauge", "CRI lookups queued or running"),
    "ghostgpu_faults_dropped_total": (
        "counter", "GPU faults dropped from the collector's store to keep it within --faults-max, oldest "
        "first"),
    "ghostgpu_metrics_process_series_capped": (
        "gauge", "Non-visible consumers left out of the per-process families by "
        "--metrics-max-process-series"),
    "ghostgpu_store_info": (
        "gauge", "The store this collector writes: its engine (sqlite, postgresql) and this collector's "
        "replica id (always 1)"),
    "ghostgpu_store_up": (
        "gauge", "1 while the store's database takes writes; 0 while it is out of reach (PostgreSQL: "
        "retried, nothing acknowledged meanwhile) or after a write failed for good"),
    "ghostgpu_store_down_seconds": (
        "gauge", "How long the store's database has been out of reach (0 while it is reachable)"),
    "ghostgpu_store_errors_total": (
        "counter", "Failed tries of a group commit, transient ones (the database restarting) included"),
    "ghostgpu_store_pending_bytes": (
        "gauge", "Bytes of event batches queued for the store and not yet committed (ingest waits past "
        "its back-pressure limit)"),
    "ghostgpu_store_commit_seconds": ("histogram", "Duration of each group commit of the store"),
    "ghostgpu_collector_owned_nodes": (
        "gauge", "Nodes whose lease this collector replica holds: the nodes whose streams it applies and "
        "whose per-node series it writes"),
    "ghostgpu_collector_lease_takeovers_total": (
        "counter", "Node leases this replica took from another replica (a tracer moved here)"),
    "ghostgpu_collector_notifications_total": (
        "counter", "PostgreSQL notifications this replica's listener received, by channel (the replicas' "
        "own included)"),
    "ghostgpu_collector_notify_reconnects_total": (
        "counter", "Times this replica's listener connected again after losing its connection (what was "
        "notified meanwhile is read again)"),
    "ghostgpu_collector_notify_up": (
        "gauge", "1 while this replica's listener is connected and listening for the other replicas' "
        "changes"),
    "ghostgpu_collector_notify_down_seconds": (
        "gauge", "How long this replica's listener has been without its connection (0 while listening)"),
    "ghostgpu_collector_replica_commands_total": (
        "counter", "Commands between replicas (trace and CRI commands for a node another replica serves, "
        "trace parts' reports, stops for a session's home), by role (sent, run), kind and result"),
    "ghostgpu_remediation_incidents_total": (
        "counter", "Remediation incidents that reached a state (proposed, skipped, done, failed, unkillable) "
        "on this collector, by action, state and the mode they were decided in"),
    "ghostgpu_remediation_paused": (
        "gauge", "1 while remediation is paused (ghostgpu remediate pause): every act is a dry run"),
    "ghostgpu_remediation_breaker_open": (
        "gauge", "1 while the remediation breaker is open (too many acts in its window, cluster-wide or on "
        "a node): acts are dry runs"),
    "ghostgpu_remediation_mode": (
        "gauge", "The remediation mode in force: 1 for it, 0 for the others (off, dry-run, on)"),
    "ghostgpu_remediation_tickets_total": (
        "counter", "Remediation tickets by result: sent (the webhook took it), failed (refused, or out "
        "of attempts or time), dropped (the queue was full: the oldest is dropped)"),
    "ghostgpu_remediation_ticket_retries_total": (
        "counter", "Ticket POSTs sent again after no answer, a 5xx or a 429"),
    "ghostgpu_remediation_isolations_total": (
        "counter", "Node isolation incidents that reached a state (proposed, skipped, done, failed), by "
        "trigger (xid, unkillable, unaccounted-memory)"),
    "ghostgpu_alertmanager_posts_total": (
        "counter", "POSTs to Alertmanager, by result (only with --alertmanager)"),
    "ghostgpu_alertmanager_alerts_sent_total": ("counter", "Alerts Alertmanager accepted"),
    "ghostgpu_alertmanager_pending_alerts": ("gauge", "Alerts waiting to be delivered to Alertmanager"),
    "ghostgpu_alertmanager_last_success_timestamp_seconds": (
        "gauge", "When a POST to Alertmanager last succeeded (unix seconds)"),
}
ALERTMANAGER_METRICS = frozenset(n for n in COLLECTOR_METRICS if n.startswith("ghostgpu_alertmanager_"))
STORE_METRICS = frozenset(n for n in COLLECTOR_METRICS if n.startswith("ghostgpu_store_"))  # with a store
REPLICA_METRICS = frozenset(n for n in COLLECTOR_METRICS if n.startswith("ghostgpu_collector_"))  # replicas
# Of those, the ones only a replica on a shared PostgreSQL store has: its listener and replica commands.
SHARED_STORE_METRICS = frozenset(n for n in REPLICA_METRICS if n.startswith(("ghostgpu_collector_notif",
                                                                            "ghostgpu_collector_replica_")))

# Page order of the per-node families; a node's chunk holds one string per family, in this order.
CONSUMERS, INFO, MEMORY, AGGREGATE_MEMORY, ALLOCATED = range(5)
CONSUMER_FAMILIES = ("ghostgpu_consumers", "ghostgpu_nonvisible_consumer_info",
                     "ghostgpu_nonvisible_consumer_memory_bytes", "ghostgpu_nonvisible_memory_bytes",
                     "ghostgpu_consumer_gpu_memory_allocated_bytes")
PROCESS_FAMILIES = (INFO, MEMORY, ALLOCATED)  # the per-process families, under the cap
INFO_FAMILIES = ("ghostgpu_gpu_info", "ghostgpu_gpu_memory_total_bytes",
                 "ghostgpu_gpu_memory_unaccounted_bytes", "ghostgpu_tracer_info",
                 "ghostgpu_tracer_bpf_attached", "ghostgpu_tracer_nvml_available")
# TracerStats field -> its per-node family, in page order.
TRACER_STATS_FIELDS = (("memory_objects_dropped_total", "ghostgpu_tracer_memory_objects_dropped_total"),
                       ("kmsg_unparsed_total", "ghostgpu_tracer_kmsg_unparsed_total"),
                       ("faults_dropped_total", "ghostgpu_tracer_faults_dropped_total"),
                       ("kmsg_records_lost_total", "ghostgpu_tracer_kmsg_records_lost_total"))
TRACER_STATS_FAMILIES = tuple(name for _, name in TRACER_STATS_FIELDS)
STATUS_FAMILIES = ("ghostgpu_tracer_connected", "ghostgpu_tracer_last_heartbeat_timestamp_seconds",
                   "ghostgpu_tracer_events_ingested_total", "ghostgpu_tracer_events_lost_total",
                   "ghostgpu_tracer_events_duplicate_total", "ghostgpu_findings_opened_total",
                   "ghostgpu_findings_resolved_total", "ghostgpu_cri_resolution_failures_total",
                   *TRACER_STATS_FAMILIES)
NODE_FAMILIES = CONSUMER_FAMILIES + INFO_FAMILIES + STATUS_FAMILIES + ("ghostgpu_xid_errors_total",)
_FINDING_CLASSES = frozenset(FINDING_CLASSES)


def escape(value: str) -> str:
    """A label value as the text format writes it: only \\\\, \\" and \\n are escaped."""
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return value


def header(name: str) -> str:
    kind, text = COLLECTOR_METRICS[name]
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return f"# HELP {name} {text}\n# TYPE {name} {kind}\n"


def _b(text: str) -> bytes:
    # The page is built from bytes: joining per-node bytes makes the 8 MB body once, where a str page
    # was joined, encoded and concatenated with the registry's part: three 8 MB copies, ~10 ms.
    return text.encode("utf-8", "replace")  # "replace": a lone surrogate in a name never fails a scrape


_HEADERS = {name: _b(header(name)) for name in COLLECTOR_METRICS}


def node_label(node: str) -> str:
    return f'node="{escape(node)}"'


# One non-visible consumer's per-process lines, led by what the cap sorts by (oldest first):
# (since_unix_ns, node, pid, gpu, info line, memory line or "" where NVML does not say, allocated line
# or "" where the driver calls are unknown). A plain tuple sorts by itself and costs a third of a
# dataclass to build, 20,000 times in a cold scrape.
ProcessSeries = tuple[int, str, int, str, str, str, str]
INFO_LINE: Final = 4  # the items of a ProcessSeries that are its lines
MEMORY_LINE: Final = 5
ALLOCATED_LINE: Final = 6
_PROCESS_LINE: dict[int, Literal[4, 5, 6]] = {INFO: INFO_LINE, MEMORY: MEMORY_LINE, ALLOCATED: ALLOCATED_LINE}
# (the row, its labels, its process, its ghostgpu_consumers line and ghostgpu_nonvisible_memory_bytes line
# as the only member of its label set)
LabelEntry = tuple[ClusterConsumer, str, "ProcessSeries | None", str, str]


def _consumer_labels(node: str, nl: str, cc: ClusterConsumer) -> LabelEntry:
    # escape() is called afresh for every value: a memo of its answers kept one entry per pod name
    # ever seen (each short-lived job's pod is a new one) and was no faster than escape's three scans.
    c, k, esc = cc.consumer, cc.k8s, escape
    cls = c.cls.value
    gpu = "" if c.gpu is None else str(c.gpu)
    labels = (f'{nl},gpu="{gpu}",gpu_uuid="{esc(c.gpu_uuid)}",class="{cls}",'
              f'namespace="{esc(k.namespace)}",pod="{esc(k.pod)}",container="{esc(k.container)}"')
    line = f"ghostgpu_consumers{{{labels}}} 1\n"
    if cls not in _FINDING_CLASSES:
        return cc, labels, None, line, ""
    mem = c.gpu_memory_bytes
    plabels = f'{labels},pid="{c.pid}",comm="{esc(c.comm)}"'
    info = f"ghostgpu_nonvisible_consumer_info{{{plabels}}} 1\n"
    memory = f"ghostgpu_nonvisible_consumer_memory_bytes{{{plabels}}} {mem}\n" if mem is not None else ""
    held = c.allocated_bytes
    allocated = (f"ghostgpu_consumer_gpu_memory_allocated_bytes{{{plabels}}} {held}\n"
                 if held is not None else "")
    aggregate = f"ghostgpu_nonvisible_memory_bytes{{{labels}}} {mem or 0}\n"
    return cc, labels, (cc.since_unix_ns, node, c.pid, gpu, info, memory, allocated), line, aggregate


class NodeConsumers:
    """A node's consumer families, kept up to date by the rows ClusterTable reports changed.

    Each row's lines are written once, when the row first shows up or changes, and kept by its key:
    a node whose one consumer changed formats that one and joins the others' lines again (C-speed
    list work), rather than walking and formatting its twenty rows in Python."""

    def __init__(self, node: str) -> None:
        self.node, self.nl = node, node_label(node)
        self.entries: dict[ConsumerKey, LabelEntry] = {}
        self.text: tuple[bytes, ...] = (b"", b"", b"", b"", b"")  # CONSUMER_FAMILIES order
        self.processes: list[ProcessSeries] = []  # oldest first

    def apply(self, changed: Iterable[tuple[ConsumerKey, ClusterConsumer | None]]) -> NodeConsumers:
        """Take the rows of these keys as they are now (None: gone), then write the node's text."""
        entries, node, nl = self.entries, self.node, self.nl
        for key, cc in changed:
            if cc is None:
                entries.pop(key, None)
            else:
                old = entries.get(key)
                if old is None or old[0] is not cc:
                    entries[key] = _consumer_labels(node, nl, cc)
        values = list(entries.values())
        procs = [e[2] for e in values if e[2] is not None]
        procs.sort()
        self.processes = procs
        labels = [e[1] for e in values]
        if len(set(labels)) == len(labels):  # one consumer per label set: the lines are ready
            consumers = "".join([e[3] for e in values])
            aggregate = "".join([e[4] for e in values])
        else:
            consumers, aggregate = _grouped(values)
        self.text = (_b(consumers), _b("".join([p[INFO_LINE] for p in procs])),
                     _b("".join([p[MEMORY_LINE] for p in procs])), _b(aggregate),
                     _b("".join([p[ALLOCATED_LINE] for p in procs])))
        return self


def _grouped(values: list[LabelEntry]) -> tuple[str, str]:
    """ghostgpu_consumers and ghostgpu_nonvisible_memory_bytes where several consumers share a label set
    (processes of one container, or host processes, on one GPU): counted and summed."""
    counts: dict[str, int] = {}
    memory: dict[str, int] = {}
    for cc, labels, proc, _, _ in values:
        counts[labels] = counts.get(labels, 0) + 1
        if proc is not None:
            memory[labels] = memory.get(labels, 0) + (cc.consumer.gpu_memory_bytes or 0)
    return ("".join([f"ghostgpu_consumers{{{labels}}} {n}\n" for labels, n in counts.items()]),
            "".join([f"ghostgpu_nonvisible_memory_bytes{{{labels}}} {n}\n" for labels, n in memory.items()]))


def render_consumers(node: str, rows: Iterable[tuple[ConsumerKey, ClusterConsumer | None]]) -> NodeConsumers:
    """A node's consumer families from scratch, from its (key, row) pairs."""
    return NodeConsumers(node).apply(rows)


def render_info(node: str, version: str | None, info: stream_pb2.NodeInfo | None) -> tuple[bytes, ...]:
    """INFO_FAMILIES of a node from its Hello's tracer version and its NodeInfo (either may be None)."""
    nl = node_label(node)
    gpus = memory = unaccounted = bpf = nvml = ""
    if info is not None:
        driver = escape(info.driver_version)
        gpu_lines, mem_lines, unaccounted_lines = [], [], []
        for g in info.gpus:
            labels = f'{nl},gpu="{g.index}",gpu_uuid="{escape(g.uuid)}"'
            gpu_lines.append(
                f'ghostgpu_gpu_info{{{labels},name="{escape(g.name)}",driver_version="{driver}"}} 1\n')
            mem_lines.append(f"ghostgpu_gpu_memory_total_bytes{{{labels}}} {g.memory_total_bytes}\n")
            if g.HasField("unaccounted_bytes"):  # unset: not known (no NVML figure), never 0
                unaccounted_lines.append(
                    f"ghostgpu_gpu_memory_unaccounted_bytes{{{labels}}} {g.unaccounted_bytes}\n")
        gpus, memory, unaccounted = "".join(gpu_lines), "".join(mem_lines), "".join(unaccounted_lines)
        bpf = f"ghostgpu_tracer_bpf_attached{{{nl}}} {int(info.bpf)}\n"
        nvml = f"ghostgpu_tracer_nvml_available{{{nl}}} {int(info.nvml)}\n"
    tracer = f'ghostgpu_tracer_info{{{nl},version="{escape(version)}"}} 1\n' if version is not None else ""
    return (_b(gpus), _b(memory), _b(unaccounted), _b(tracer), _b(bpf), _b(nvml))


class NodeStatus(NamedTuple):
    """A node's counters, read on the collector's loop (they change with every batch). A NamedTuple:
    built for every node at every scrape, on the loop, at a quarter of a frozen dataclass's cost."""

    node: str
    connected: bool
    heartbeat_unix_ns: int
    ingested_total: int
    spool_lost_total: int
    ringbuf_lost_total: int
    duplicates_total: int
    opened: Sequence[tuple[str, int]]  # (class, findings opened), classes seen only
    resolved: Sequence[tuple[str, int]]
    # The TracerStats counts in TRACER_STATS_FIELDS order; None until the node's tracer reported them
    tracer_stats: tuple[int, ...] | None = None


def tracer_stats_values(stats: stream_pb2.TracerStats) -> tuple[int, ...]:
    """NodeStatus.tracer_stats from a TracerStats message."""
    return tuple(getattr(stats, f) for f, _ in TRACER_STATS_FIELDS)


def render_status(s: NodeStatus, cri_failures_total: int) -> tuple[str, ...]:
    """STATUS_FAMILIES of a node; rebuilt every scrape (a few lines a node), as str: assemble() encodes
    each family once, not 8,000 small strings."""
    nl = node_label(s.node)
    heartbeat = (f"ghostgpu_tracer_last_heartbeat_timestamp_seconds{{{nl}}} {s.heartbeat_unix_ns / 1e9!r}\n"
                 if s.heartbeat_unix_ns else "")
    lost = (f'ghostgpu_tracer_events_lost_total{{{nl},reason="spool_overflow"}} {s.spool_lost_total}\n'
            f'ghostgpu_tracer_events_lost_total{{{nl},reason="ringbuf"}} {s.ringbuf_lost_total}\n')
    opened = "".join([f'ghostgpu_findings_opened_total{{{nl},class="{escape(c)}"}} {n}\n'
                      for c, n in s.opened])
    resolved = "".join([f'ghostgpu_findings_resolved_total{{{nl},class="{escape(c)}"}} {n}\n'
                        for c, n in s.resolved])
    stats = s.tracer_stats
    tracer = (tuple(f"{name}{{{nl}}} {n}\n" for name, n in zip(TRACER_STATS_FAMILIES, stats, strict=True))
              if stats is not None else ("",) * len(TRACER_STATS_FAMILIES))
    return (f"ghostgpu_tracer_connected{{{nl}}} {int(s.connected)}\n", heartbeat,
            f"ghostgpu_tracer_events_ingested_total{{{nl}}} {s.ingested_total}\n", lost,
            f"ghostgpu_tracer_events_duplicate_total{{{nl}}} {s.duplicates_total}\n", opened, resolved,
            f"ghostgpu_cri_resolution_failures_total{{{nl}}} {cri_failures_total}\n", *tracer)


def render_xid_errors(counts: Iterable[tuple[tuple[str, str, str], int]]) -> bytes:
    """ghostgpu_xid_errors_total from ((node, gpu, xid), count) rows (few: one per kind of fault seen)."""
    lines = [f'ghostgpu_xid_errors_total{{{node_label(node)},gpu="{escape(gpu)}",xid="{escape(xid)}"}} {n}\n'
             for (node, gpu, xid), n in counts]
    return _HEADERS["ghostgpu_xid_errors_total"] + _b("".join(lines))


def assemble(chunks: Sequence[tuple[NodeConsumers, tuple[bytes, ...], tuple[str, ...]]],
             max_process_series: int) -> tuple[list[bytes], int]:
    """(the per-node families as parts of the page, to be joined; how many processes the cap left out).
    `chunks` is per node, in page order: (NodeConsumers, render_info(...), render_status(...))."""
    total = sum(len(c[0].processes) for c in chunks)
    capped = max(0, total - max_process_series)
    kept: list[ProcessSeries] = []
    if capped:  # one C sort of every process (6,000: ~1 ms) beats heapq.merge's Python loop
        kept = sorted([p for c in chunks for p in c[0].processes])[:max_process_series]
    out: list[bytes] = []
    for f, name in enumerate(CONSUMER_FAMILIES):
        out.append(_HEADERS[name])
        if capped and f in PROCESS_FAMILIES:
            line = _PROCESS_LINE[f]
            out.append(_b("".join([p[line] for p in kept])))
        else:
            out.extend([c[0].text[f] for c in chunks])
    for f, name in enumerate(INFO_FAMILIES):
        out.append(_HEADERS[name])
        out.extend([c[1][f] for c in chunks])
    for f, name in enumerate(STATUS_FAMILIES):
        out.append(_HEADERS[name])
        out.append(_b("".join([c[2][f] for c in chunks])))
    return out, capped
