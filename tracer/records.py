"""Turn events, holders and consumers into the JSON records the sinks write.

Every record carries the snapshot keys (node, pid, ns_pid, comm, gpu, devices, container_id,
pod_uid, runtime, class, reason, gpu_memory_bytes) so that one reader handles events and
findings alike; events add `event`, `ts` and what the event is about.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from ghostgpu.tracer.events import HolderEvent, NvmlView, ProcessInfo
from ghostgpu.tracer.ioctl_decode import decode_ioctl

from ghostgpu.common.model import Consumer

SNAPSHOT_KEYS = (
    "node", "pid", "ns_pid", "comm", "gpu", "devices", "container_id", "pod_uid",
    "runtime", "class", "reason", "gpu_memory_bytes",
)  # fmt: skip


def wall_ts() -> float:
    return round(time.time(), 6)


def identity_fields(info: ProcessInfo | None) -> dict[str, Any]:
    if info is None:
        return {"ns_pid": None, "comm": "", "container_id": "", "pod_uid": "", "runtime": ""}
    return {
        "ns_pid": info.ns_pid,
        "comm": info.comm,
        "exe": info.exe,
        "cmdline": info.cmdline,
        "uid": info.uid,
        "ppid": info.ppid,
        "state": info.state,
        "container_id": info.container_id,
        "pod_uid": info.pod_uid,
        "runtime": info.runtime,
        "cgroup_path": info.cgroup_path,
        "alive": info.alive,
    }


def gpu_of(minor: int | None, nvml: NvmlView) -> tuple[int | None, str]:
    """(gpu, gpu_uuid) for a device minor: the NVML index when NVML maps it, else the minor."""
    if minor is None:
        return None, ""
    gpu = nvml.gpu_by_minor(minor) if nvml.available else None
    return (gpu.index, gpu.uuid) if gpu else (minor, "")


def ioctl_list(counts: Mapping[tuple[str, int], int], kinds: Mapping[str, str]) -> list[dict[str, Any]]:
    """Decoded ioctl counts of one process: [{device, cmd, name, count}], busiest first."""
    out = []
    for (path, cmd), count in counts.items():
        name = decode_ioctl(cmd, kinds.get(path, "")).label
        out.append({"device": path, "cmd": f"{cmd:#x}", "name": name, "count": count})
    out.sort(key=lambda r: (-r["count"], r["device"], r["cmd"]))
    return out


def event_record(
    node: str,
    ev: HolderEvent,
    info: ProcessInfo | None,
    devices: list[str],
    nvml: NvmlView,
) -> dict[str, Any]:
    dev = ev.device
    gpu, gpu_uuid = gpu_of(dev.gpu_minor if dev is not None and dev.is_gpu else None, nvml)
    rec: dict[str, Any] = {
        "event": str(ev.kind),
        "ts": wall_ts(),
        "ts_ns": ev.ts_ns,
        "source": ev.source,
        "node": node,
        "pid": ev.pid,
        "tid": ev.tid,
        "gpu": gpu,
        "gpu_uuid": gpu_uuid,
        "device": dev.path if dev is not None else None,
        "device_kind": str(dev.kind) if dev is not None else None,
        "fd": ev.fd if ev.fd >= 0 else None,
        "devices": devices,
        "class": None,
        "reason": "",
        "gpu_memory_bytes": None,
        "cgroup_id": ev.cgroup_id or None,
    }
    if ev.child_pid:
        rec["child_pid"] = ev.child_pid
    if ev.mapped:
        rec["mapped"] = True
    rec.update(identity_fields(info))
    return rec


def consumer_record(event: str, consumer: Consumer) -> dict[str, Any]:
    rec = consumer.to_json()
    rec["event"] = event
    rec["ts"] = wall_ts()
    return rec


def notice_record(node: str, what: str, message: str) -> dict[str, Any]:
    return {"event": "notice", "ts": wall_ts(), "node": node, "what": what, "message": message}


def info_record(node: str, bpf: bool, nvml: NvmlView) -> dict[str, Any]:
    """What the node looks like: kernel tracing on or off, the GPUs NVML sees (or why it sees none)."""
    return {
        "event": "info", "ts": wall_ts(), "node": node, "bpf": bpf, "nvml": nvml.available,
        "nvml_error": nvml.error, "driver_version": nvml.driver_version,
        "gpus": [{"index": g.index, "uuid": g.uuid, "name": g.name, "minor": g.minor,
                  "memory_total_bytes": g.memory_total_bytes} for g in nvml.gpus],
    }


def info_signature(nvml: NvmlView) -> tuple[Any, ...]:
    """What an `info` record is re-emitted for: NVML coming or going, the GPU list changing."""
    return (nvml.available, nvml.driver_version,
            tuple((g.index, g.uuid, g.name, g.minor, g.memory_total_bytes) for g in nvml.gpus))
