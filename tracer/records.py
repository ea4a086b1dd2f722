"""Build the typed records (ghostgpu.common.model.records) from the tracer's events, holders and consumers.

Each record is made once, here, and goes to the sinks as itself: the stream encodes it straight to
proto, the JSON-lines sink writes its to_json().
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from ghostgpu.tracer.classify import is_mps_server
from ghostgpu.tracer.events import NvmlGpu, NvmlView, ProcessInfo, SourceEvent
from ghostgpu.tracer.gpu_memory import memory_split
from ghostgpu.tracer.ioctl_decode import decode_ioctl

from ghostgpu.common.model.consumers import Consumer
from ghostgpu.common.model.records import (
    ConsumerRecord,
    GpuInfo,
    HolderRecord,
    InfoRecord,
    IoctlCount,
    NoticeRecord,
    ProcessIdentity,
    ReadyRecord,
)

SNAPSHOT_KEYS = (
    "node", "pid", "ns_pid", "comm", "gpu", "devices", "container_id", "pod_uid",
    "runtime", "class", "reason", "gpu_memory_bytes",
)  # fmt: skip


def wall_ts() -> float:
    return round(time.time(), 6)


def identity(info: ProcessInfo | None) -> ProcessIdentity | None:
    if info is None:
        return None
    return ProcessIdentity(
        ns_pid=info.ns_pid, comm=info.comm, exe=info.exe, cmdline=info.cmdline, uid=info.uid, ppid=info.ppid,
        state=info.state, container_id=info.container_id, pod_uid=info.pod_uid, runtime=info.runtime,
        cgroup_path=info.cgroup_path, alive=info.alive,
    )


def gpu_of(minor: int | None, nvml: NvmlView) -> tuple[int | None, str]:
    """(gpu, gpu_uuid) for a device minor: the NVML index when NVML maps it, else the minor."""
    if minor is None:
        return None, ""
    gpu = nvml.gpu_by_minor(minor) if nvml.available else None
    return (gpu.index, gpu.uuid) if gpu else (minor, "")


def ioctl_list(counts: Mapping[tuple[str, int], int], kinds: Mapping[str, str]) -> tuple[IoctlCount, ...]:
    """Decoded ioctl counts of one process, busiest first (ties by device, then the request in hex as
    the JSON writes it)."""
    out = [IoctlCount(path, cmd, decode_ioctl(cmd, kinds.get(path, "")).label, count)
           for (path, cmd), count in counts.items()]
    out.sort(key=lambda i: (-i.count, i.device, f"{i.cmd:#x}"))
    return tuple(out)


def event_record(
    node: str,
    ev: SourceEvent,
    info: ProcessInfo | None,
    devices: list[str],
    nvml: NvmlView,
    *,
    ioctls: tuple[IoctlCount, ...] | None = None,
    held_s: float | None = None,
) -> HolderRecord:
    dev = ev.device
    gpu, gpu_uuid = gpu_of(dev.gpu_minor if dev is not None and dev.is_gpu else None, nvml)
    return HolderRecord(
        event=str(ev.kind), ts=wall_ts(), ts_ns=ev.ts_ns, source=ev.source, node=node, pid=ev.pid, tid=ev.tid,
        gpu=gpu, gpu_uuid=gpu_uuid, device=dev.path if dev is not None else None,
        device_kind=str(dev.kind) if dev is not None else None, fd=ev.fd if ev.fd >= 0 else None,
        devices=tuple(devices), cgroup_id=ev.cgroup_id or None, child_pid=ev.child_pid, mapped=ev.mapped,
        process=identity(info), ioctls=ioctls, held_s=held_s,
    )


def consumer_record(event: str, consumer: Consumer) -> ConsumerRecord:
    return ConsumerRecord(event, wall_ts(), consumer)


def notice_record(node: str, what: str, message: str) -> NoticeRecord:
    return NoticeRecord(wall_ts(), node, what, message)


def info_record(node: str, bpf: bool, nvml: NvmlView, gpus: tuple[GpuInfo, ...] | None = None) -> InfoRecord:
    """What the node looks like: kernel tracing on or off, the GPUs NVML sees (or why it sees none),
    each with its memory split when `gpus` (gpu_infos()) is given."""
    return InfoRecord(wall_ts(), node, bpf, nvml.available, nvml.error, nvml.driver_version,
                      gpu_infos(nvml, ()) if gpus is None else gpus)


def _listed_bytes(gpu: NvmlGpu) -> int | None:
    """What NVML attributes to the processes it lists on a GPU (one entry per PID: tracer/nvml.py
    merges a PID's compute and graphics entries); None when it could not list them or gives no
    figure for one of them (no permission, MIG): a sum without it would read as a complete one."""
    if not gpu.processes_known:
        return None
    figures = [p.used_gpu_memory_bytes for p in gpu.processes]
    return None if any(f is None for f in figures) else sum(f for f in figures if f is not None)


def gpu_infos(nvml: NvmlView, consumers: Iterable[Consumer]) -> tuple[GpuInfo, ...]:
    """Each GPU NVML sees, with NVML's used memory split (tracer/gpu_memory.py memory_split): listed
    (NVML's per-process figures), unlisted (the allocated_bytes of the consumers on that GPU NVML does
    not list) and unaccounted (the rest). A consumer whose allocated_bytes is unknown adds nothing to
    unlisted: what it holds stays in unaccounted, the memory no figure names. The MPS server is left
    out of unlisted: it allocates for its clients, whose memory NVML lists under each client's PID
    (listed already)."""
    unlisted: dict[str, int] = {}
    listed_pids = {g.uuid: {p.pid for p in g.processes} for g in nvml.gpus}
    for c in consumers:
        if c.gpu_uuid in listed_pids and c.pid not in listed_pids[c.gpu_uuid] and c.allocated_bytes \
                and not is_mps_server(c.comm, c.exe):
            unlisted[c.gpu_uuid] = unlisted.get(c.gpu_uuid, 0) + c.allocated_bytes
    out: list[GpuInfo] = []
    for g in nvml.gpus:
        listed, unlisted_bytes, unaccounted = memory_split(g.memory_used_bytes, _listed_bytes(g),
                                                           unlisted.get(g.uuid, 0))
        out.append(GpuInfo(g.index, g.uuid, g.name, g.minor, g.memory_total_bytes,
                           pci_bus_id=g.pci_bus_id, memory_used_bytes=g.memory_used_bytes,
                           memory_listed_bytes=listed, memory_unlisted_bytes=unlisted_bytes,
                           unaccounted_bytes=unaccounted))
    return tuple(out)


SPLIT_STEP_BYTES = 1 << 20  # a GPU's memory split is re-sent when a figure moves by at least this much


def split_moved(old: tuple[GpuInfo, ...], new: tuple[GpuInfo, ...]) -> bool:
    """Whether the GPUs' memory figures moved enough to re-send them: one became known or unknown, or
    moved by SPLIT_STEP_BYTES or more (NVML's used memory drifts by less with every refresh)."""
    if [g.uuid for g in old] != [g.uuid for g in new]:
        return True
    fields = ("memory_used_bytes", "memory_listed_bytes", "memory_unlisted_bytes", "unaccounted_bytes")
    for a, b in zip(old, new, strict=True):
        for x, y in ((getattr(a, name), getattr(b, name)) for name in fields):
            if x is None or y is None:
                if (x is None) != (y is None):
                    return True
            elif abs(x - y) >= SPLIT_STEP_BYTES:
                return True
    return False


def ready_record(node: str, bpf: bool, nvml: bool, startup_s: float, holders: int) -> ReadyRecord:
    return ReadyRecord(wall_ts(), node, bpf, nvml, round(startup_s, 3), holders)


def info_signature(nvml: NvmlView) -> tuple[Any, ...]:
    """What an `info` record is re-emitted for at once: NVML coming or going, the GPU list changing
    (the memory split has its own step: split_moved)."""
    return (nvml.available, nvml.driver_version,
            tuple((g.index, g.uuid, g.name, g.minor, g.memory_total_bytes, g.pci_bus_id)
                  for g in nvml.gpus))
