"""Classification: one pure function from holders + the NVML view to consumers (process x GPU).

Every node-side rule lives here: each gathers the evidence for its class alone (the allowlist,
NVML's listing, the process tree, the grace period, the container), and ghostgpu.common.classes
decides which of the classes that hold wins, with the same table the collector's enrich() uses.
The grace period holds for host and container processes alike: NVML lists a new CUDA context only
once it exists, a moment after the device file is opened.

Reasons are one human line naming the evidence; numbers that move between refreshes (ages, MiB,
fds) appear only in the text, and diff_consumers() compares the reason with its numbers masked,
so an age ticking up is not a change.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ghostgpu.tracer.config import DEFAULT_SYSTEM_ALLOWLIST
from ghostgpu.tracer.events import DeviceHold, Holder, NvmlGpu, NvmlProcess, NvmlView, ProcessInfo

from ghostgpu.common import classes
from ghostgpu.common.display import mib_phrase, short_id
from ghostgpu.common.model import Consumer, ConsumerClass

ConsumerKey = tuple[int, int | None, str]
COMM_LEN = 15  # TASK_COMM_LEN - 1: the kernel truncates comm to 15 bytes


def _ticks_to_ns(ticks: int) -> int:
    return ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ClassifyConfig:
    grace_ns: int = 2_000_000_000
    system_allowlist: tuple[str, ...] = DEFAULT_SYSTEM_ALLOWLIST
    reaper_comms: tuple[str, ...] = ("systemd", "init")
    own_pids: frozenset[int] = frozenset()
    # (gpu uuid, pid) -> boot ns when the tracer first saw NVML list that pid on that GPU
    nvml_first_listed: Mapping[tuple[str, int], int] = field(default_factory=dict)
    boot_ns_of_ticks: Callable[[int], int] = _ticks_to_ns


def _s(ns: int) -> str:
    return f"{max(ns, 0) / 1e9:.1f} s"


def _gpu_text(gpu: int | None, uuid: str, minor: int | None) -> str:
    return f"GPU {gpu} ({uuid})" if uuid else f"GPU minor {minor}"


def _holds_text(holds: Sequence[tuple[str, DeviceHold]]) -> str:
    parts: list[str] = []
    for path, hold in holds:
        fds = sorted(hold.fds)
        how = [f"fd {','.join(map(str, fds))}"] if fds else []
        if hold.mapped:
            how.append("mapped" if fds else "mapped, fd closed")
        parts.append(f"{path} ({'; '.join(how)})")
    return ", ".join(parts)


def _merge_listed(gpu: NvmlGpu) -> dict[int, NvmlProcess]:
    """NVML may list one PID twice (a compute and a graphics context): add their memory."""
    out: dict[int, NvmlProcess] = {}
    for proc in gpu.processes:
        seen = out.get(proc.pid)
        if seen is None:
            out[proc.pid] = proc
            continue
        mem = [m for m in (seen.used_gpu_memory_bytes, proc.used_gpu_memory_bytes) if m is not None]
        out[proc.pid] = NvmlProcess(proc.pid, sum(mem) if mem else None, seen.kind)
    return out


def _system_name(info: ProcessInfo, cfg: ClassifyConfig) -> str | None:
    if info.pid in cfg.own_pids:
        return "the tracer itself"
    exe = os.path.basename(info.exe.removesuffix(" (deleted)"))
    for name in cfg.system_allowlist:
        if (info.comm and info.comm == name[:COMM_LEN]) or (exe and exe == name):
            return f"allowlisted node daemon {name}"
    return None


def _ghost_reason(pid: int, uuid: str, gpu_text: str, listed: NvmlProcess, cfg: ClassifyConfig,
                  pid_exists: Callable[[int], int | None]) -> str | None:
    """Why NVML's listing of pid on this GPU belongs to a dead process, or None if it does not."""
    where = f"NVML lists PID {pid} on {gpu_text} using {mib_phrase(listed.used_gpu_memory_bytes)}"
    start_ticks = pid_exists(pid)
    if start_ticks is None:
        return f"{where}, but no such process exists on the host"
    first_ns = cfg.nvml_first_listed.get((uuid, pid))
    if first_ns is not None:
        started_ns = cfg.boot_ns_of_ticks(start_ticks)
        if started_ns > first_ns:
            return (f"{where} since {_s(first_ns)} after boot, but PID {pid} was reused by a process "
                    f"started at {_s(started_ns)}")
    return None


def _orphan_reason(info: ProcessInfo, cfg: ClassifyConfig) -> str | None:
    if info.leader_zombie:
        return f"its thread-group leader is a zombie while {info.threads - 1} thread(s) live on"
    if info.state == "Z":
        return "it is a zombie (state Z)"
    if not info.container_id or info.parent_container_id == info.container_id:
        return None
    short = short_id(info.container_id)
    if info.ppid == 1:
        return f"container {short}'s process was reparented to host PID 1 outside its container"
    if info.parent_comm and info.parent_comm in cfg.reaper_comms:
        return (f"container {short}'s process was reparented to subreaper {info.parent_comm} "
                f"(PID {info.ppid}) outside its container")
    return None


def _unknown_reason(nvml: NvmlView, nv_gpu: NvmlGpu | None, minor: int, gpu_text: str) -> str | None:
    """Why NVML cannot say whether it lists a holder of this GPU, or None when it can."""
    if not nvml.available:
        why = nvml.error or "no reason given"
        return f"NVML is unavailable ({why}), so whether it lists the PID is unknown"
    if nv_gpu is None:
        return f"NVML reports no GPU with device minor {minor}, so visibility is unknown"
    if not getattr(nv_gpu, "processes_known", True):
        return f"NVML could not list the processes of {gpu_text}, so visibility is unknown"
    return None


def _holder_consumers(holder: Holder, nvml: NvmlView, now_ns: int, cfg: ClassifyConfig, node: str,
                      pid_exists: Callable[[int], int | None],
                      listed_by_uuid: Mapping[str, Mapping[int, NvmlProcess]]) -> list[Consumer]:
    info = holder.process
    held = sorted((path, hold) for path, hold in holder.holds.items() if hold.held)
    per_gpu: dict[int, list[tuple[str, DeviceHold]]] = {}
    for path, hold in held:
        if hold.device.is_gpu and hold.device.gpu_minor is not None:
            per_gpu.setdefault(hold.device.gpu_minor, []).append((path, hold))
    control = [path for path, hold in held if not hold.device.is_gpu]
    system = _system_name(info, cfg)
    orphan = _orphan_reason(info, cfg)
    cid = info.container_id
    where = f"in container {short_id(cid)}" if cid else "on the host, outside any container"
    out: list[Consumer] = []
    for minor, holds in sorted(per_gpu.items()):
        nv_gpu = nvml.gpu_by_minor(minor) if nvml.available else None
        gpu, uuid = (nv_gpu.index, nv_gpu.uuid) if nv_gpu is not None else (minor, "")
        gpu_text = _gpu_text(gpu, uuid, minor)
        first_ns = min(hold.first_seen_ns for _, hold in holds)
        age_ns = now_ns - first_ns
        what = f"holds {_holds_text(holds)} for {_s(age_ns)}"
        listed = listed_by_uuid.get(uuid, {}).get(info.pid) if nv_gpu is not None else None
        ghost = _ghost_reason(info.pid, uuid, gpu_text, listed, cfg, pid_exists) if listed else None
        memory = listed.used_gpu_memory_bytes if listed is not None else None
        # Every class whose rule holds, with its reason; the shared precedence picks one.
        found: dict[ConsumerClass, str] = {}
        if system:
            found[ConsumerClass.SYSTEM] = f"{system} ({info.comm or info.exe}) {what}"
        if ghost:
            found[ConsumerClass.GHOST] = f"{ghost}; the PID {what}"
        if orphan:
            found[ConsumerClass.ORPHANED] = f"{orphan} and still {what}"
        if (unknown := _unknown_reason(nvml, nv_gpu, minor, gpu_text)) is not None:
            found[ConsumerClass.UNKNOWN] = f"{what}; {unknown}"
        if listed is not None:
            found[ConsumerClass.VISIBLE] = (f"NVML lists PID {info.pid} on {gpu_text} using "
                                            f"{mib_phrase(memory)}; {what}")
        if age_ns < cfg.grace_ns:
            found[ConsumerClass.PENDING] = (f"{what} {where}, within the {_s(cfg.grace_ns)} grace period; "
                                            f"NVML does not list it on {gpu_text} yet")
        unlisted = f"{what} {where}; NVML lists no such process on {gpu_text}"
        if info.container_id:
            found[ConsumerClass.HIDDEN] = unlisted
        else:
            found[ConsumerClass.UNATTRIBUTED] = unlisted
        cls = classes.highest(found)
        reason = found[cls]
        out.append(Consumer(
            node=node, pid=info.pid, ns_pid=info.ns_pid, comm=info.comm, gpu=gpu, gpu_uuid=uuid,
            gpu_minor=minor, devices=sorted([path for path, _ in holds] + control),
            container_id=info.container_id, pod_uid=info.pod_uid, runtime=info.runtime, cls=cls,
            reason=reason, gpu_memory_bytes=memory, exe=info.exe, cmdline=info.cmdline, uid=info.uid,
            ppid=info.ppid, state=info.state,
            start_time_ns=cfg.boot_ns_of_ticks(info.start_ticks) if info.start_ticks is not None else None,
            first_seen_ns=first_ns, mapped=any(hold.mapped for _, hold in holds),
            fds=sorted({fd for _, hold in holds for fd in hold.fds}), cgroup_path=info.cgroup_path,
            alive=info.alive,
        ))
    return out


def _listed_consumer(gpu: NvmlGpu, listed: NvmlProcess, holder: Holder | None, cfg: ClassifyConfig,
                     node: str, pid_exists: Callable[[int], int | None]) -> Consumer:
    """A (GPU, pid) NVML lists but no holder covers: a ghost, or a process whose fds we cannot see."""
    gpu_text = _gpu_text(gpu.index, gpu.uuid, gpu.minor)
    ghost = _ghost_reason(listed.pid, gpu.uuid, gpu_text, listed, cfg, pid_exists)
    # A holder of another GPU under this PID is who NVML means, unless the PID was reused.
    known = holder is not None and ghost is None
    info = holder.process if holder is not None and known else ProcessInfo(listed.pid, alive=ghost is None)
    found = {ConsumerClass.VISIBLE: (f"NVML lists PID {listed.pid} on {gpu_text} using "
                                     f"{mib_phrase(listed.used_gpu_memory_bytes)}; "
                                     f"no fd of it on the GPU's device file was seen")}
    if listed.pid in cfg.own_pids:
        found[ConsumerClass.SYSTEM] = f"the tracer itself is listed by NVML on {gpu_text}"
    if ghost:
        found[ConsumerClass.GHOST] = f"{ghost}; no process holds the GPU's device file"
    cls = classes.highest(found)
    reason = found[cls]
    start_ticks = info.start_ticks if known else None
    return Consumer(
        node=node, pid=listed.pid, ns_pid=info.ns_pid, comm=info.comm, gpu=gpu.index, gpu_uuid=gpu.uuid,
        gpu_minor=gpu.minor, devices=[], container_id=info.container_id, pod_uid=info.pod_uid,
        runtime=info.runtime, cls=cls, reason=reason, gpu_memory_bytes=listed.used_gpu_memory_bytes,
        exe=info.exe, cmdline=info.cmdline, uid=info.uid, ppid=info.ppid, state=info.state,
        start_time_ns=cfg.boot_ns_of_ticks(start_ticks) if start_ticks is not None else None,
        first_seen_ns=cfg.nvml_first_listed.get((gpu.uuid, listed.pid)), cgroup_path=info.cgroup_path,
        alive=info.alive and ghost is None,
    )


def classify(holders: Sequence[Holder], nvml: NvmlView, now_ns: int, cfg: ClassifyConfig, node: str,
             pid_exists: Callable[[int], int | None]) -> list[Consumer]:
    """One consumer per (process x GPU) held or NVML-listed, sorted by (gpu, pid).

    pid_exists(pid) is the PID's start_ticks when it exists on the host, else None.
    """
    listed_by_uuid = {gpu.uuid: _merge_listed(gpu) for gpu in nvml.gpus} if nvml.available else {}
    out: list[Consumer] = []
    for holder in sorted(holders, key=lambda h: h.pid):
        out += _holder_consumers(holder, nvml, now_ns, cfg, node, pid_exists, listed_by_uuid)
    if nvml.available:
        covered = {(c.gpu_uuid, c.pid) for c in out if c.gpu_uuid}
        by_pid = {h.pid: h for h in holders}
        for gpu in nvml.gpus:
            for pid, listed in sorted(listed_by_uuid[gpu.uuid].items()):
                if (gpu.uuid, pid) not in covered:
                    out.append(_listed_consumer(gpu, listed, by_pid.get(pid), cfg, node, pid_exists))
    out.sort(key=lambda c: (c.gpu if c.gpu is not None else -1, c.pid, c.gpu_uuid))
    return out


_NUMBERS = re.compile(r"\d+(?:[.,]\d+)*")  # "12.3", "5,6,7" (an fd list) each mask to one "#"


def _signature(c: Consumer) -> tuple[object, ...]:
    # The reason with its numbers masked: "pending for 0.4 s" and "for 1.2 s" are the same finding,
    # "zombie" and "reparented" are not. Numbers that matter are compared as fields. The comm is
    # one: a holder that renames itself (busybox applets, worker pools) is shown, and alerted on,
    # by its current name.
    reason_shape = _NUMBERS.sub("#", c.reason)
    return (c.cls, reason_shape, tuple(c.devices), c.gpu_memory_bytes, c.container_id, c.mapped, c.alive,
            c.comm)


def diff_consumers(old: Mapping[ConsumerKey, Consumer], new: list[Consumer],
                   ) -> tuple[list[Consumer], list[Consumer]]:
    """(opened or changed, resolved) between the last consumers by key and a new classification."""
    new_keys = {c.key for c in new}
    changed = [c for c in new if c.key not in old or _signature(old[c.key]) != _signature(c)]
    resolved = [c for key, c in old.items() if key not in new_keys]
    resolved.sort(key=lambda c: (c.gpu if c.gpu is not None else -1, c.pid, c.gpu_uuid))
    return changed, resolved
