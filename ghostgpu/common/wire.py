"""Tracer records (the JSON lines) <-> ghostgpu.v1.NodeEvent, both ways.

The tracer's dict records are the one event vocabulary: `ghostgpu tracer --jsonl` writes them, the
stream sends them as NodeEvents, and the collector hands them back to clients through
`event_to_record`, so a record that makes the trip comes back with the keys and values it left
with. JSON has null where proto3 scalars have none: -1 stands for an unknown GPU index, minor or
fd, 0 for an unknown namespace PID, parent, cgroup id or total memory (ghostgpu.common.convert keeps the
same rules for consumers).

`node` is not on the NodeEvent (the stream's Hello names the node once), so `event_to_record`
takes it from the caller.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from ghostgpu.common.convert import consumer_from_proto, consumer_to_proto
from ghostgpu.common.model import Consumer
from ghostgpu.v1 import node_pb2, stream_pb2

log = logging.getLogger("ghostgpu.common.wire")

HOLDER_KINDS = ("open", "close", "mmap", "unmap", "fork", "exec", "exit")
# Record kinds that travel on the stream; `ready` is a local start-up marker and does not.
STREAMED_KINDS = frozenset((*HOLDER_KINDS, "finding", "resolved", "notice", "info", "allocations"))

_KIND_TO_PB = {k: node_pb2.HolderEvent.Kind.Value(f"KIND_{k.upper()}") for k in HOLDER_KINDS}
_PB_TO_KIND = {v: k for k, v in _KIND_TO_PB.items()}
# The identity keys records.identity_fields() writes for a process /proc could be read for.
_IDENTITY_KEYS = ("ns_pid", "comm", "exe", "cmdline", "uid", "ppid", "state", "container_id", "pod_uid",
                  "runtime", "cgroup_path", "alive")


def ts_to_ns(ts: float | None) -> int:
    """A record's `ts` (unix seconds, rounded to µs) as unix nanoseconds."""
    return round(ts * 1e9) if ts else 0


def ns_to_ts(ns: int) -> float:
    # Rounding to µs gives back exactly the float the tracer wrote (records.wall_ts rounds the same).
    return round(ns / 1e9, 6)


def holder_kind(kind: int) -> str:
    """A HolderEvent.Kind as the record's `event` ("open", "exit", ...); "unknown" for one not known here."""
    return _PB_TO_KIND.get(kind, "unknown")


def _int_or(value: int | None, unset: int) -> int:
    return unset if value is None else int(value)


def _back(value: int, unset: int) -> int | None:
    return None if value == unset else value


# --- holder events ------------------------------------------------------------------------------

def holder_to_proto(rec: dict[str, Any]) -> node_pb2.HolderEvent:
    process = node_pb2.Process(
        pid=rec["pid"], ns_pid=_int_or(rec.get("ns_pid"), 0), comm=rec.get("comm") or "",
        exe=rec.get("exe") or "", cmdline=rec.get("cmdline") or "", uid=_int_or(rec.get("uid"), -1),
        ppid=_int_or(rec.get("ppid"), 0), state=rec.get("state") or "",
        container_id=rec.get("container_id") or "", pod_uid=rec.get("pod_uid") or "",
        runtime=rec.get("runtime") or "", cgroup_path=rec.get("cgroup_path") or "",
        # A record without identity keys is a process /proc could not be read for: not known alive.
        alive=bool(rec.get("alive", False)),
    )
    msg = node_pb2.HolderEvent(
        kind=_KIND_TO_PB[rec["event"]], source=rec.get("source") or "", ts_ns=rec.get("ts_ns") or 0,
        process=process, device=rec.get("device") or "", fd=_int_or(rec.get("fd"), -1),
        cgroup_id=rec.get("cgroup_id") or 0, child_pid=rec.get("child_pid") or 0,
        mapped=bool(rec.get("mapped")), tid=rec.get("tid") or 0, gpu=_int_or(rec.get("gpu"), -1),
        gpu_uuid=rec.get("gpu_uuid") or "", device_kind=rec.get("device_kind") or "",
        devices=rec.get("devices") or (),
    )
    if "ioctls" in rec:
        msg.ioctls_counted = True
        for entry in rec["ioctls"]:
            cmd = entry["cmd"]
            msg.ioctls.add(device=entry["device"], cmd=int(cmd, 16) if isinstance(cmd, str) else cmd,
                           name=entry.get("name") or "", count=entry["count"])
    if rec.get("held_s") is not None:
        msg.held_ns = round(rec["held_s"] * 1e9)
    return msg


def holder_from_proto(msg: node_pb2.HolderEvent) -> dict[str, Any]:
    p = msg.process
    rec: dict[str, Any] = {
        "event": holder_kind(msg.kind), "ts_ns": msg.ts_ns, "source": msg.source, "pid": p.pid,
        "tid": msg.tid, "gpu": _back(msg.gpu, -1), "gpu_uuid": msg.gpu_uuid, "device": msg.device or None,
        "device_kind": msg.device_kind or None, "fd": _back(msg.fd, -1), "devices": list(msg.devices),
        "class": None, "reason": "", "gpu_memory_bytes": None, "cgroup_id": msg.cgroup_id or None,
    }
    if msg.child_pid:
        rec["child_pid"] = msg.child_pid
    if msg.mapped:
        rec["mapped"] = True
    rec.update({
        "ns_pid": _back(p.ns_pid, 0), "comm": p.comm, "exe": p.exe, "cmdline": p.cmdline,
        "uid": _back(p.uid, -1), "ppid": _back(p.ppid, 0), "state": p.state, "container_id": p.container_id,
        "pod_uid": p.pod_uid, "runtime": p.runtime, "cgroup_path": p.cgroup_path, "alive": p.alive,
    })
    if msg.ioctls_counted:
        rec["ioctls"] = [{"device": i.device, "cmd": f"{i.cmd:#x}", "name": i.name, "count": i.count}
                         for i in msg.ioctls]
    if msg.HasField("held_ns"):
        rec["held_s"] = round(msg.held_ns / 1e9, 6)
    return rec


# --- node info and allocations ------------------------------------------------------------------

def info_to_proto(rec: dict[str, Any]) -> stream_pb2.NodeInfo:
    """NodeInfo from an `info` record (tracer/records.py:info_record)."""
    msg = stream_pb2.NodeInfo(bpf=bool(rec.get("bpf")), nvml=bool(rec.get("nvml")),
                              nvml_error=rec.get("nvml_error") or "",
                              driver_version=rec.get("driver_version") or "")
    for g in rec.get("gpus") or ():
        msg.gpus.add(index=g["index"], uuid=g.get("uuid") or "", name=g.get("name") or "",
                     minor=_int_or(g.get("minor"), -1), memory_total_bytes=g.get("memory_total_bytes") or 0)
    return msg


def info_from_proto(msg: stream_pb2.NodeInfo) -> dict[str, Any]:
    """The `info` record's body (no event, ts or node)."""
    return {
        "bpf": msg.bpf, "nvml": msg.nvml, "nvml_error": msg.nvml_error, "driver_version": msg.driver_version,
        "gpus": [{"index": g.index, "uuid": g.uuid, "name": g.name, "minor": _back(g.minor, -1),
                  "memory_total_bytes": g.memory_total_bytes or None} for g in msg.gpus],
    }


def allocations_to_proto(rec: dict[str, Any]) -> stream_pb2.Allocations:
    """Allocations from an `allocations` record (tracer/podresources.py); read time is the record's ts."""
    msg = stream_pb2.Allocations(available=bool(rec.get("available")), error=rec.get("error") or "",
                                 read_unix_ns=ts_to_ns(rec.get("ts")))
    for c in rec.get("containers") or ():
        msg.containers.add(namespace=c["namespace"], pod=c["pod"], container=c["container"],
                           resource_names=c.get("resource_names") or (), device_ids=c.get("device_ids") or ())
    return msg


def allocations_from_proto(msg: stream_pb2.Allocations) -> dict[str, Any]:
    """The `allocations` record's body (no event, ts or node)."""
    return {
        "available": msg.available, "error": msg.error,
        "containers": [{"namespace": c.namespace, "pod": c.pod, "container": c.container,
                        "resource_names": list(c.resource_names), "device_ids": list(c.device_ids)}
                       for c in msg.containers],
    }


# --- records <-> NodeEvent ----------------------------------------------------------------------

def record_to_event(rec: dict[str, Any], seq: int) -> stream_pb2.NodeEvent | None:
    """The NodeEvent for a record, None for a kind that is not streamed (`ready`).

    Raises ValueError (or KeyError/TypeError for a malformed record) naming what is wrong; the
    stream turns that into a notice so the sequence keeps no hole.
    """
    kind = rec.get("event")
    if kind not in STREAMED_KINDS:
        return None
    ev = stream_pb2.NodeEvent(seq=seq, ts_unix_ns=ts_to_ns(rec.get("ts")))
    if kind in _KIND_TO_PB:
        ev.holder.CopyFrom(holder_to_proto(rec))
    elif kind in ("finding", "resolved"):
        getattr(ev, kind).CopyFrom(consumer_to_proto(Consumer.from_json(rec)))
    elif kind == "notice":
        ev.notice.what = rec.get("what") or ""
        ev.notice.message = rec.get("message") or ""
    elif kind == "info":
        ev.info.CopyFrom(info_to_proto(rec))
    else:
        ev.allocations.CopyFrom(allocations_to_proto(rec))
    return ev


def event_to_record(ev: stream_pb2.NodeEvent, node: str = "") -> dict[str, Any]:
    """The tracer's record for a NodeEvent: the same keys `ghostgpu tracer --jsonl` writes."""
    body = ev.WhichOneof("body")
    ts = ns_to_ts(ev.ts_unix_ns)
    if body is None:
        raise ValueError(f"event seq {ev.seq} has no body")
    if body in ("finding", "resolved"):
        rec = consumer_from_proto(getattr(ev, body)).to_json()
        rec["event"], rec["ts"] = body, ts
        return rec
    if body == "holder":
        rec = holder_from_proto(ev.holder)
    elif body == "notice":
        rec = {"event": "notice", "what": ev.notice.what, "message": ev.notice.message}
    elif body == "info":
        rec = {"event": "info", **info_from_proto(ev.info)}
    else:
        rec = {"event": "allocations", **allocations_from_proto(ev.allocations)}
    rec["ts"] = ts
    rec["node"] = node
    return rec


def snapshot_from_records(seq: int, consumers: Iterable[dict[str, Any]], info: dict[str, Any] | None,
                          allocations: dict[str, Any] | None,
                          stats: stream_pb2.TracerStats | None = None) -> stream_pb2.Snapshot:
    """A Snapshot from the tracer's latest finding records, `info` and `allocations` (None: not known yet)."""
    snap = stream_pb2.Snapshot(seq=seq, ts_unix_ns=time.time_ns(), stats=stats)
    for rec in consumers:
        try:
            snap.consumers.append(consumer_to_proto(Consumer.from_json(rec)))
        except (KeyError, TypeError, ValueError) as exc:  # one bad record must not cost the whole snapshot
            log.warning("snapshot: skipping a malformed consumer record (%s)", exc)
    if info is not None:
        snap.info.CopyFrom(info_to_proto(info))
    if allocations is not None:
        snap.allocations.CopyFrom(allocations_to_proto(allocations))
    return snap
