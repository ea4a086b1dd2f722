"""Rendering shared by `ghostgpu ps`, `findings`, `up` and `snapshot`: tables, JSON rows, lines.

Everything here is a pure function of query-service answers (ClusterConsumer, ghostgpu.v1
messages), of a node's own consumers (`snapshot`) and `now`, so the views are tested without a
collector, `up` shows exactly what `ps` shows, and every table is laid out by the one `table()`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from ghostgpu.common.model.consumers import ClusterConsumer, Consumer, consumer_order
from ghostgpu.common.model.display import (
    DRIVER_CALLS_FOOTNOTE,
    DRIVER_CALLS_MARK,
    LISTING_ID_LEN,
    memory_cell,
    mib,
    short_id,
)
from ghostgpu.common.wire.convert import (
    class_from_proto,
    cluster_consumer_from_proto,
    gpu_from_proto,
    holder_kind,
    remediation_from_proto,
)
from ghostgpu.v1 import node_pb2, query_pb2, stream_pb2

Row = TypeVar("Row")
Column = tuple[str, Callable[[Row], str]]  # header, cell of one row
MEMORY_HEADER = "GPU-MEM"  # NVML's figure, else the driver calls' (marked: the table adds the footnote)


def age(seconds: float) -> str:
    """5s, 3m, 2h, 4d: the largest whole unit, like kubectl's AGE."""
    s = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


def who(c: ClusterConsumer) -> str:
    """namespace/pod/container when CRI named it, else the container ID's prefix, else "host"."""
    if c.k8s.pod:
        return "/".join(x for x in (c.k8s.namespace, c.k8s.pod, c.k8s.container) if x)
    if c.consumer.container_id:
        return short_id(c.consumer.container_id, LISTING_ID_LEN)
    return "host"


def _gpu(c: ClusterConsumer) -> str:
    return "-" if c.consumer.gpu is None else str(c.consumer.gpu)


def _devices(c: ClusterConsumer) -> str:
    return ",".join(d.removeprefix("/dev/") for d in c.consumer.devices) or "-"


def _allocated(c: ClusterConsumer) -> str:
    return "unknown" if c.allocated is None else str(c.allocated).lower()


def _columns(now_s: float, wide: bool) -> list[Column[ClusterConsumer]]:
    cols: list[Column[ClusterConsumer]] = [
        ("NODE", lambda c: c.consumer.node or "-"),
        ("GPU", _gpu),
        ("PID", lambda c: str(c.consumer.pid)),
        ("CPID", lambda c: "-" if c.consumer.ns_pid is None else str(c.consumer.ns_pid)),
        ("NAMESPACE/POD/CONTAINER", who),
        ("CLASS", lambda c: str(c.consumer.cls)),
        (MEMORY_HEADER, lambda c: memory_cell(c.consumer.gpu_memory_bytes, c.consumer.allocated_bytes)),
        ("SINCE", lambda c: age(now_s - c.since_unix_ns / 1e9) if c.since_unix_ns else "-"),
    ]
    if wide:
        cols += [
            ("COMM", lambda c: c.consumer.comm or "?"),
            ("IMAGE", lambda c: c.k8s.image or "-"),
            ("ALLOCATED", _allocated),
            ("DEVICES", _devices),
            ("REASON", lambda c: c.consumer.reason),
        ]
    return cols


def grid(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns two spaces apart, no trailing blanks."""
    table = [list(header), *(list(r) for r in rows)]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r)).rstrip() for r in table)


def table(columns: Sequence[Column[Row]], items: Iterable[Row], empty: str) -> str:
    """A header and one line per item, laid out by grid(); `empty` on a line of its own when no item.
    A memory cell from the driver calls (DRIVER_CALLS_MARK) gets the footnote that says so."""
    rows = [[cell(item) for _, cell in columns] for item in items]
    text = grid([name for name, _ in columns], rows)
    if any(name == MEMORY_HEADER and row[i].endswith(DRIVER_CALLS_MARK)
           for i, (name, _) in enumerate(columns) for row in rows):
        text += "\n" + DRIVER_CALLS_FOOTNOTE
    return text + "\n" + empty if not rows else text


def consumer_table(consumers: Sequence[ClusterConsumer], wide: bool = False, now_s: float | None = None,
                   empty: str = "(no GPU consumers)") -> str:
    now = time.time() if now_s is None else now_s
    return table(_columns(now, wide), sorted(consumers, key=lambda c: consumer_order(c.consumer)), empty)


# `ghostgpu snapshot`: one node's consumers as classify() gave them (already sorted), no collector,
# so no Kubernetes names: the pod UID from the cgroup instead.
SNAPSHOT_COLUMNS: tuple[Column[Consumer], ...] = (
    ("GPU", lambda c: "-" if c.gpu is None else str(c.gpu)),
    ("PID", lambda c: str(c.pid)),
    ("CPID", lambda c: "-" if c.ns_pid is None else str(c.ns_pid)),
    ("COMM", lambda c: c.comm or "?"),
    ("CLASS", lambda c: str(c.cls)),
    (MEMORY_HEADER, lambda c: memory_cell(c.gpu_memory_bytes, c.allocated_bytes)),
    ("CONTAINER", lambda c: short_id(c.container_id, LISTING_ID_LEN) or "-"),
    ("POD-UID", lambda c: c.pod_uid or "-"),
    ("DEVICES", lambda c: ",".join(d.removeprefix("/dev/") for d in c.devices)),
)
SNAPSHOT_WIDE_COLUMNS = (*SNAPSHOT_COLUMNS, ("REASON", lambda c: c.reason))


def snapshot_table(consumers: Sequence[Consumer], wide: bool = True) -> str:
    return table(SNAPSHOT_WIDE_COLUMNS if wide else SNAPSHOT_COLUMNS, consumers,
                 "(no process holds a GPU device file)")


def consumers_json(consumers: Sequence[ClusterConsumer],
                   nodes: Sequence[query_pb2.TracerStatus] = ()) -> list[dict[str, Any]]:
    """`ps -o json`: one object per consumer (a list, as it has always been), each with `gpu_info`:
    its GPU as its node's last snapshot told it (the `gpus` entry of the node's info: PCI bus id and
    NVML's used memory split into listed, unlisted and unaccounted), null when not known."""
    gpus: dict[tuple[str, str], dict[str, Any]] = {}
    for status in nodes:
        for g in status.info.gpus:
            gpus[(status.node, g.uuid)] = gpu_from_proto(g).to_json()
    rows = []
    for c in sorted(consumers, key=lambda c: consumer_order(c.consumer)):
        row = c.to_json()
        row["gpu_info"] = gpus.get((c.consumer.node, c.consumer.gpu_uuid)) if c.consumer.gpu_uuid else None
        rows.append(row)
    return rows


def nvml_text(info: stream_pb2.NodeInfo, demo_gpu: bool = False) -> str:
    if not info.nvml:
        why = info.nvml_error.removeprefix("NVML: ") or "no reason given"
        return f"no NVIDIA GPU visible here (NVML: {why}); still watching device files"
    gpus = ", ".join(f"{g.index}:{g.name or g.uuid}" for g in info.gpus) or "no GPUs"
    label = "DEMO GPU (fake NVML planted by --demo, no real device)" if demo_gpu else "NVML"
    return f"{label} driver {info.driver_version or '?'}: {gpus}"


def gpu_memory_line(g: stream_pb2.Gpu) -> str:
    """One GPU's used memory as the node's last snapshot split it: used = listed + unlisted + unaccounted
    (tracer/gpu_memory.py memory_split; `-` for a figure not known)."""
    info = gpu_from_proto(g)
    name = f"GPU {info.index}" + (f" ({info.pci_bus_id})" if info.pci_bus_id else "")
    if info.memory_used_bytes is None:
        return f"  {name}: used memory unknown (NVML did not say)"
    return (f"  {name}: {mib(info.memory_used_bytes)} used = {mib(info.memory_listed_bytes)} by processes "
            f"NVML lists + {mib(info.memory_unlisted_bytes)} by holders it does not list + "
            f"{mib(info.unaccounted_bytes)} unaccounted")


def node_lines(status: query_pb2.TracerStatus, now_s: float | None = None, demo_gpu: bool = False,
               ) -> list[str]:
    """The node's header line (node_header) and, under it, one line per GPU with its memory split."""
    return [node_header(status, now_s, demo_gpu), *(gpu_memory_line(g) for g in status.info.gpus)]


def node_header(status: query_pb2.TracerStatus, now_s: float | None = None, demo_gpu: bool = False) -> str:
    """One line per node: tracer link, BPF, GPUs and driver as the node's last snapshot told them."""
    now = time.time() if now_s is None else now_s
    if status.connected:
        link = "tracer connected"
        if status.last_heartbeat_unix_ns:
            link += f" (heard {age(now - status.last_heartbeat_unix_ns / 1e9)} ago)"
    else:
        seen = f", last heard {age(now - status.last_heartbeat_unix_ns / 1e9)} ago" \
            if status.last_heartbeat_unix_ns else ""
        link = f"tracer DISCONNECTED{seen}"
    parts = [f"node {status.node}", link]
    if status.HasField("info"):
        parts.append("BPF tracepoints attached" if status.info.bpf else "BPF off: /proc scans only")
        parts.append(nvml_text(status.info, demo_gpu))
    lost = status.events_lost_total + status.stats.spool_dropped_total
    if lost:
        parts.append(f"{lost} events LOST (spool overflow or ring-buffer drops)")
    return " | ".join(parts)


def _stamp(unix_ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_ns / 1e9))


def remediation_json(f: query_pb2.Finding) -> dict[str, Any] | None:
    """A finding's `remediation` (docs/REMEDIATION.md): state, action, at (unix seconds, as the other
    times), reason, mode, incident, audit_seq; None when no remediation considered it."""
    r = remediation_from_proto(f.remediation) if f.HasField("remediation") else None
    if r is None:
        return None
    return {"state": r.state, "action": r.action, "at": r.at_unix_ns / 1e9 if r.at_unix_ns else None,
            "reason": r.reason, "mode": r.mode, "incident": r.incident, "audit_seq": r.audit_seq}


def finding_json(f: query_pb2.Finding) -> dict[str, Any]:
    """`ClusterConsumer.to_json()` plus the finding's id and times (unix seconds; resolved: None if open)
    and its remediation (None: none)."""
    d = cluster_consumer_from_proto(f.consumer).to_json()
    d.update({"id": f.id, "opened": f.opened_unix_ns / 1e9,
              "resolved": f.resolved_unix_ns / 1e9 if f.resolved_unix_ns else None,
              "remediation": remediation_json(f)})
    if not d.get("node"):
        d["node"] = f.node
    return d


FindingRow = tuple[query_pb2.Finding, ClusterConsumer]  # the finding and its consumer, decoded once


def _finding_columns(wide: bool) -> list[Column[FindingRow]]:
    cols: list[Column[FindingRow]] = [
        ("OPENED", lambda r: _stamp(r[0].opened_unix_ns)),
        ("RESOLVED", lambda r: _stamp(r[0].resolved_unix_ns) if r[0].resolved_unix_ns else "open"),
        ("NODE", lambda r: r[0].node or r[1].consumer.node),
        ("CLASS", lambda r: str(r[1].consumer.cls)),
        ("NAMESPACE/POD", lambda r: f"{r[1].k8s.namespace}/{r[1].k8s.pod}" if r[1].k8s.pod else who(r[1])),
        ("PID", lambda r: str(r[1].consumer.pid)),
        ("GPU", lambda r: _gpu(r[1])),
    ]
    if wide:
        cols += [
            ("COMM", lambda r: r[1].consumer.comm or "?"),
            ("CONTAINER", lambda r: r[1].k8s.container
             or short_id(r[1].consumer.container_id, LISTING_ID_LEN) or "-"),
            ("DEVICES", lambda r: _devices(r[1])),
            ("REMEDIATION", lambda r: r[0].remediation.state or "-"),
        ]
    return [*cols, ("REASON", lambda r: r[1].consumer.reason)]


def findings_table(findings: Sequence[query_pb2.Finding], wide: bool = False) -> str:
    rows = [(f, cluster_consumer_from_proto(f.consumer))
            for f in sorted(findings, key=lambda f: (f.opened_unix_ns, f.id))]
    return table(_finding_columns(wide), rows, "(no findings in this window)")


def _clock(unix_ns: int) -> str:
    return time.strftime("%H:%M:%S", time.localtime((unix_ns or time.time_ns()) / 1e9))


def _process_text(p: node_pb2.Process) -> str:
    where = f"container {short_id(p.container_id, LISTING_ID_LEN)}" if p.container_id else "the host"
    inside = f", pid {p.ns_pid} inside" if p.ns_pid and p.container_id else ""
    return f"pid {p.pid} ({p.comm or '?'}{inside}) in {where}"


def finding_event_line(ev: query_pb2.FindingEvent) -> str:
    kind = {query_pb2.FindingEvent.KIND_OPENED: "opened", query_pb2.FindingEvent.KIND_CHANGED: "changed",
            query_pb2.FindingEvent.KIND_RESOLVED: "resolved"}.get(ev.kind, "finding")
    f = ev.finding
    c = cluster_consumer_from_proto(f.consumer)
    when = f.resolved_unix_ns if ev.kind == query_pb2.FindingEvent.KIND_RESOLVED else \
        (c.updated_unix_ns or f.opened_unix_ns)
    return (f"{_clock(when)} finding {kind:8} {c.consumer.cls}: pid {c.consumer.pid} "
            f"({c.consumer.comm or '?'}) {who(c)} on {f.node or c.consumer.node}: {c.consumer.reason}")


def event_line(ev: stream_pb2.NodeEvent) -> str | None:
    """One line for a node event worth showing under a live view; None for the rest."""
    body = ev.WhichOneof("body")
    when = _clock(ev.ts_unix_ns)
    if body == "holder":
        h = ev.holder
        kind = holder_kind(h.kind)
        if kind not in ("open", "close", "exit", "mmap") or h.device_kind in ("control", "uvm"):
            return None  # control devices alone make no consumer: their opens are noise here
        extra = []
        if h.HasField("held_ns"):
            extra.append(f"held a GPU for {h.held_ns / 1e6:.0f} ms")
        if ioctls := sum(i.count for i in h.ioctls):
            extra.append(f"{ioctls} ioctls")
        tail = f" ({', '.join(extra)})" if extra else ""
        device = f" {h.device}" if h.device else ""
        return f"{when} {kind:8} {_process_text(h.process)}{device}{tail}"
    if body in ("finding", "resolved"):
        c = getattr(ev, body)
        cls = class_from_proto(getattr(c, "class"))
        return f"{when} {'gone' if body == 'resolved' else cls:8} {_process_text(c.process)}: {c.reason}"
    if body == "notice":
        return f"{when} notice   {ev.notice.what}: {ev.notice.message}"
    return None
