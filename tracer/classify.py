"""Classification: one pure function from holders + the NVML view to consumers (process x GPU).

Every node-side rule lives here: each gathers the evidence for its class alone (the allowlist and
where the daemon runs, NVML's listing, the process tree, the grace period, the calls the holder made,
the container), and ghostgpu.common.model.classes decides which of the classes that hold wins, with the
same table the collector's enrich() uses. The grace period holds for host and container processes
alike, and for every class below it (unknown too): NVML lists a new CUDA context only once it exists,
a moment after the device file is opened.

A process holding only node-wide devices (nvidiactl, nvidia-uvm, nvidia-modeset, nvidia-caps/*) is
one consumer with no GPU: it keeps the driver's modules busy (a left-over one blocks a driver reload),
so it goes through the same rules, and NVML, which lists processes per GPU, never lists it.

Reasons are one human line naming the evidence; numbers that move between refreshes (ages, MiB,
fds) appear only in the text, and diff_consumers() (tracer/consumer_diff.py) compares the reason
with its numbers masked, so an age ticking up is not a change.

Memory: `gpu_memory_bytes` is NVML's figure; `allocated_bytes` what the driver accepted from the
process's own memory calls, less what it freed (tracer/gpu_memory.py, fed by the kernel side), or
None with `allocated_reason` saying why it is unknown (unknown is never 0). Both are set, and the
reason names the memory a consumer holds, in one place: _with_memory().
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ghostgpu.tracer.config import TracerConfig
from ghostgpu.tracer.consumer_diff import diff_consumers as diff_consumers  # where the agent imports it
from ghostgpu.tracer.events import DeviceHold, Holder, NvmlGpu, NvmlProcess, NvmlView, ProcessInfo
from ghostgpu.tracer.gpu_memory import BEFORE_START as BEFORE_START  # where the agent's tests import it

from ghostgpu.common.model import classes
from ghostgpu.common.model.consumers import Consumer, ConsumerClass, DeviceKind, consumer_order
from ghostgpu.common.model.display import mib_phrase, short_id, size_phrase

COMM_LEN = 15  # TASK_COMM_LEN - 1: the kernel truncates comm to 15 bytes
# The MPS server holds the GPU for its clients; NVML lists the clients' PIDs (CUDA 11+, Volta+).
MPS_SERVER = "nvidia-cuda-mps-server"
Holds = Sequence[tuple[str, DeviceHold]]

# Why a consumer's allocated_bytes is unknown (its allocated_reason). BEFORE_START is the
# accountant's own (a client it first saw in use), in the same words.
NO_KERNEL_SIDE = "BPF is off, so no driver call is seen"
NO_HOLDER = "no process the tracer saw holds this GPU's device file, so none of its driver calls"


def _ticks_to_ns(ticks: int) -> int:
    return ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ClassifyConfig:
    """What classify() is told: a slice of TracerConfig (its settings have no defaults here), and what
    the agent knows at the moment of one classification."""

    grace_ns: int
    # Entries with a "/" match the executable path exactly; others the comm or the exe's file name.
    system_allowlist: tuple[str, ...]
    # Where, besides the host, an allowlisted daemon counts as system: Kubernetes namespaces and
    # NAMESPACE/CONTAINER pairs (tracer config system_namespaces, system_containers). Only CRI names
    # them, so they travel on the consumer for the collector's enrich() to check.
    system_places: tuple[str, ...]
    reaper_comms: tuple[str, ...]
    own_pids: frozenset[int] = frozenset()
    # (gpu uuid, pid) -> boot ns when the tracer first saw NVML list that pid on that GPU
    nvml_first_listed: Mapping[tuple[str, int], int] = field(default_factory=dict)
    boot_ns_of_ticks: Callable[[int], int] = _ticks_to_ns
    # Every process that held a GPU device file at this boot time is among the holders: None when the
    # kernel reports every open (BPF), else when the last full /proc scan began. A PID NVML listed
    # before it and that holds no GPU device file was reused; one listed later may be a holder not
    # scanned yet.
    holders_complete_ns: int | None = None

    @classmethod
    def of(cls, cfg: TracerConfig) -> ClassifyConfig:
        """The settings from `cfg`; the agent replaces the rest with what it knows now."""
        return cls(grace_ns=int(cfg.grace_s * 1e9), system_allowlist=tuple(cfg.system_allowlist),
                   system_places=(*cfg.system_namespaces, *cfg.system_containers),
                   reaper_comms=tuple(cfg.reaper_comms))


def _s(ns: int) -> str:
    return f"{max(ns, 0) / 1e9:.1f} s"


def _gpu_text(gpu: int | None, uuid: str, minor: int | None) -> str:
    return f"GPU {gpu} ({uuid})" if uuid else f"GPU minor {minor}"


def _holds_text(holds: Holds) -> str:
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


# ---- the evidence, one function per rule -------------------------------------------------------

def _named(info: ProcessInfo, name: str) -> bool:
    """Whether a process is called `name`: its comm (cut to 15 bytes) or its executable's file name."""
    exe = os.path.basename(info.exe.removesuffix(" (deleted)"))
    return bool((info.comm and info.comm == name[:COMM_LEN]) or (exe and exe == name))


def _allowlisted(info: ProcessInfo, allowlist: Sequence[str]) -> str:
    """The allowlist entry the process matches ("" none): a path its executable, a name its name."""
    exe = info.exe.removesuffix(" (deleted)")  # a daemon whose binary an upgrade replaced
    for entry in allowlist:
        if (exe == entry) if "/" in entry else _named(info, entry):
            return entry
    return ""


def _away_from_host(info: ProcessInfo) -> str:
    """Where a process runs if not on the host itself ("" on the host): in a container, or in a PID
    namespace of its own (NSpid shows a second number)."""
    if info.container_id:
        return f"runs in container {short_id(info.container_id)}"
    if info.ns_pid is not None and info.ns_pid != info.pid:
        return f"runs in a PID namespace of its own (PID {info.ns_pid} there)"
    return ""


def _system_reason(info: ProcessInfo, entry: str, cfg: ClassifyConfig) -> str | None:
    if info.pid in cfg.own_pids:
        return "the tracer itself"
    if entry and not _away_from_host(info):
        return f"allowlisted node daemon {entry} ({info.comm or info.exe}) on the host"
    return None


def _impersonation(info: ProcessInfo, entry: str, cfg: ClassifyConfig) -> str:
    """What the reason says of a process named like an allowlisted daemon away from the host."""
    away = _away_from_host(info)
    if not entry or not away:
        return ""
    if cfg.system_places and info.container_id:
        return (f"it is named like allowlisted node daemon {entry} but {away}: such a daemon is system on "
                f"the host, or where CRI places it in {', '.join(cfg.system_places)} (collector), and "
                f"elsewhere it impersonates {entry}")
    return (f"it impersonates allowlisted node daemon {entry}: it {away}, and such daemons are system "
            "only on the host")


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


def _unknown_reason(nvml: NvmlView, nv_gpu: NvmlGpu | None, minor: int | None, gpu_text: str) -> str | None:
    """Why NVML cannot say whether it lists a holder of this GPU (minor None: of no GPU), or None."""
    if not nvml.available:
        why = nvml.error or "no reason given"
        return f"NVML is unavailable ({why}), so whether it lists the PID is unknown"
    if minor is None:
        return None  # NVML answers: it lists processes per GPU, and this holder holds none
    if nv_gpu is None:
        return f"NVML reports no GPU with device minor {minor}, so visibility is unknown"
    if not getattr(nv_gpu, "processes_known", True):
        return f"NVML could not list the processes of {gpu_text}, so visibility is unknown"
    return None


def _work(holder: Holder) -> tuple[bool, str]:
    """(monitor, why): whether the holder's call history shows it only reads the GPU's state, and the
    evidence either way. A monitoring client (nvidia-smi, nvitop, gpustat, dcgm-exporter) issues
    control calls only; a GPU job allocates memory, a channel or a compute class, or maps device memory.
    Without a whole history (opened before the tracer started, or BPF off) nothing proves a monitor."""
    work = holder.gpu_work
    if work is not None and work.allocated:
        return False, f"it allocated GPU resources ({work.what or 'an RM_ALLOC or ALLOC_MEMORY call'})"
    if any(h.held and h.mapped and h.device.kind in (DeviceKind.GPU, DeviceKind.MIG)
           for h in holder.holds.values()):
        return False, "it maps GPU device memory"
    if work is None or not work.complete:
        return False, ("whether it allocated GPU resources is unknown: the evidence is incomplete (it opened "
                       "the device before the tracer watched it, or BPF is off)")
    return True, ("since its first open it allocated no memory, channel or compute class and mapped no "
                  "device memory: it only reads the GPU's state")


def is_mps_server(comm: str, exe: str) -> bool:
    """Whether a process (by its comm and executable) is the MPS server (MPS_SERVER)."""
    return _named(ProcessInfo(0, comm=comm, exe=exe), MPS_SERVER)


def _mps_servers(holders: Sequence[Holder]) -> dict[int, ProcessInfo]:
    """GPU minor -> an MPS server holding that GPU's device file."""
    out: dict[int, ProcessInfo] = {}
    for holder in holders:
        if _named(holder.process, MPS_SERVER):
            for hold in holder.holds.values():
                if hold.held and hold.device.is_gpu and hold.device.gpu_minor is not None:
                    out.setdefault(hold.device.gpu_minor, holder.process)
    return out


def _holds_gpu(holder: Holder | None) -> bool:
    return holder is not None and any(h.held and h.device.is_gpu for h in holder.holds.values())


# ---- consumers ------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Scope:
    """One consumer's GPU (minor None: node-wide devices only) and what NVML says of it."""

    minor: int | None
    gpu: int | None
    uuid: str
    nv_gpu: NvmlGpu | None
    text: str
    unlisted: str  # what NVML's silence means for it


@dataclass(frozen=True)
class _Ctx:
    """What every consumer of one classification is judged against."""

    nvml: NvmlView
    now_ns: int
    cfg: ClassifyConfig
    node: str
    pid_exists: Callable[[int], int | None]
    listed_by_uuid: Mapping[str, Mapping[int, NvmlProcess]]
    mps: Mapping[int, ProcessInfo]  # GPU minor -> an MPS server holding it


def _scope(minor: int | None, nvml: NvmlView) -> _Scope:
    if minor is None:
        return _Scope(None, None, "", None, "no GPU (node-wide devices only)",
                      "no GPU device file, so NVML lists it nowhere; it keeps the driver in use")
    nv_gpu = nvml.gpu_by_minor(minor) if nvml.available else None
    gpu, uuid = (nv_gpu.index, nv_gpu.uuid) if nv_gpu is not None else (minor, "")
    text = _gpu_text(gpu, uuid, minor)
    return _Scope(minor, gpu, uuid, nv_gpu, text, f"NVML lists no such process on {text}")


def _holder_consumer(holder: Holder, holds: Holds, control: Sequence[str], scope: _Scope, ctx: _Ctx,
                     ) -> Consumer:
    info, cfg = holder.process, ctx.cfg
    entry = _allowlisted(info, cfg.system_allowlist)
    where = f"in container {short_id(info.container_id)}" if info.container_id else \
        "on the host, outside any container"
    first_ns = min(hold.first_seen_ns for _, hold in holds)
    age_ns = ctx.now_ns - first_ns
    only = "only node-wide devices " if scope.minor is None else ""
    what = f"holds {only}{_holds_text(holds)} for {_s(age_ns)}"
    listed = ctx.listed_by_uuid.get(scope.uuid, {}).get(info.pid) if scope.nv_gpu is not None else None
    ghost = _ghost_reason(info.pid, scope.uuid, scope.text, listed, cfg, ctx.pid_exists) if listed else None
    memory = listed.used_gpu_memory_bytes if listed is not None else None
    monitor, work = _work(holder)
    # Every class whose rule holds, with its reason; the shared precedence picks one.
    found: dict[ConsumerClass, str] = {}
    if system := _system_reason(info, entry, cfg):
        found[ConsumerClass.SYSTEM] = f"{system} {what}"
    if ghost:
        found[ConsumerClass.GHOST] = f"{ghost}; the PID {what}"
    if orphan := _orphan_reason(info, cfg):
        found[ConsumerClass.ORPHANED] = f"{orphan} and still {what}"
    if (unknown := _unknown_reason(ctx.nvml, scope.nv_gpu, scope.minor, scope.text)) is not None:
        found[ConsumerClass.UNKNOWN] = f"{what}; {unknown}"
    if listed is not None:
        found[ConsumerClass.VISIBLE] = (f"NVML lists PID {info.pid} on {scope.text} using "
                                        f"{mib_phrase(memory)}; {what}")
    if age_ns < cfg.grace_ns:
        found[ConsumerClass.PENDING] = f"{what} {where}, within the {_s(cfg.grace_ns)} grace period" + (
            f"; NVML does not list it on {scope.text} yet" if scope.minor is not None else "")
    if monitor:
        found[ConsumerClass.MONITOR] = f"{what} {where}; {work}"
    unlisted = ConsumerClass.HIDDEN if info.container_id else ConsumerClass.UNATTRIBUTED
    found[unlisted] = f"{what} {where}; {scope.unlisted}; {work}"
    cls = classes.highest(found)
    reason = found[cls]
    if cls is not ConsumerClass.SYSTEM and (note := _impersonation(info, entry, cfg)):
        reason = f"{reason}; {note}"
    candidate = entry and info.container_id and cls is not ConsumerClass.SYSTEM
    return Consumer(
        node=ctx.node, pid=info.pid, ns_pid=info.ns_pid, comm=info.comm, gpu=scope.gpu, gpu_uuid=scope.uuid,
        gpu_minor=scope.minor, devices=sorted([path for path, _ in holds] + list(control)),
        container_id=info.container_id, pod_uid=info.pod_uid, runtime=info.runtime, cls=cls,
        reason=reason, gpu_memory_bytes=memory, exe=info.exe, cmdline=info.cmdline, uid=info.uid,
        ppid=info.ppid, state=info.state,
        start_time_ns=cfg.boot_ns_of_ticks(info.start_ticks) if info.start_ticks is not None else None,
        first_seen_ns=first_ns, mapped=any(hold.mapped for _, hold in holds),
        fds=sorted({fd for _, hold in holds for fd in hold.fds}), cgroup_path=info.cgroup_path,
        alive=info.alive, allowlisted=entry, system_places=list(cfg.system_places) if candidate else [],
    )


def _listed_consumer(gpu: NvmlGpu, listed: NvmlProcess, holder: Holder | None, ctx: _Ctx,
                     ) -> tuple[Consumer, Holder | None]:
    """A (GPU, pid) NVML lists but no holder of that GPU covers: a ghost (the PID is gone, or reused:
    it holds no GPU device file, and a CUDA process keeps its own open for life), an MPS client, or
    a holder of another GPU."""
    gpu_text = _gpu_text(gpu.index, gpu.uuid, gpu.minor)
    lists = f"NVML lists PID {listed.pid} on {gpu_text} using {mib_phrase(listed.used_gpu_memory_bytes)}"
    cfg = ctx.cfg
    ghost = _ghost_reason(listed.pid, gpu.uuid, gpu_text, listed, cfg, ctx.pid_exists)
    found = {ConsumerClass.VISIBLE: f"{lists}; no fd of it on the GPU's device file was seen"}
    listed_ns = cfg.nvml_first_listed.get((gpu.uuid, listed.pid))
    if ghost is None and not _holds_gpu(holder):
        server = ctx.mps.get(gpu.minor) if gpu.minor is not None else None
        complete_ns = cfg.holders_complete_ns
        judged = complete_ns is None or (ctx.now_ns if listed_ns is None else listed_ns) <= complete_ns
        if server is not None:
            found[ConsumerClass.VISIBLE] = (f"{lists} through MPS: the MPS server {server.comm} (PID "
                                            f"{server.pid}) holds the GPU's device file for its clients")
        elif judged:
            ghost = (f"{lists}, but PID {listed.pid} holds no GPU device file: a CUDA process keeps its "
                     "device files open for life, so the PID was reused by another process and the "
                     "memory is held by the dead")
        else:
            found[ConsumerClass.VISIBLE] += " yet (a /proc scan has not looked since NVML listed it)"
    if listed.pid in cfg.own_pids:
        found[ConsumerClass.SYSTEM] = f"the tracer itself is listed by NVML on {gpu_text}"
    if ghost:
        found[ConsumerClass.GHOST] = f"{ghost}; no process holds the GPU's device file"
    cls = classes.highest(found)
    # A holder under this PID is who NVML means (another GPU's, or an MPS client's), unless the PID was
    # reused; then the control devices it holds are reported here, not as a node-wide consumer.
    known = holder if holder is not None and ghost is None else None
    info = known.process if known is not None else ProcessInfo(listed.pid, alive=ghost is None)
    control = [] if known is None or _holds_gpu(known) else \
        sorted(path for path, hold in known.holds.items() if hold.held)
    start_ticks = info.start_ticks if known is not None else None
    return Consumer(
        node=ctx.node, pid=listed.pid, ns_pid=info.ns_pid, comm=info.comm, gpu=gpu.index, gpu_uuid=gpu.uuid,
        gpu_minor=gpu.minor, devices=control, container_id=info.container_id, pod_uid=info.pod_uid,
        runtime=info.runtime, cls=cls, reason=found[cls], gpu_memory_bytes=listed.used_gpu_memory_bytes,
        exe=info.exe, cmdline=info.cmdline, uid=info.uid, ppid=info.ppid, state=info.state,
        start_time_ns=cfg.boot_ns_of_ticks(start_ticks) if start_ticks is not None else None,
        first_seen_ns=listed_ns, cgroup_path=info.cgroup_path, alive=info.alive and ghost is None,
    ), known


def classify(holders: Sequence[Holder], nvml: NvmlView, now_ns: int, cfg: ClassifyConfig, node: str,
             pid_exists: Callable[[int], int | None]) -> list[Consumer]:
    """One consumer per (process x GPU) held or NVML-listed, and one per process that holds only
    node-wide devices, sorted by (gpu, pid) with node-wide ones first.

    pid_exists(pid) is the PID's start_ticks when it exists on the host, else None.
    """
    listed_by_uuid = {gpu.uuid: _merge_listed(gpu) for gpu in nvml.gpus} if nvml.available else {}
    ctx = _Ctx(nvml, now_ns, cfg, node, pid_exists, listed_by_uuid, _mps_servers(holders))
    out: list[tuple[Consumer, Holder | None]] = []  # each consumer and the holder it is of (None: none)
    node_wide: list[tuple[Holder, list[tuple[str, DeviceHold]]]] = []
    for holder in sorted(holders, key=lambda h: h.pid):
        held = sorted((path, hold) for path, hold in holder.holds.items() if hold.held)
        per_gpu: dict[int, list[tuple[str, DeviceHold]]] = {}
        for path, hold in held:
            if hold.device.is_gpu and hold.device.gpu_minor is not None:
                per_gpu.setdefault(hold.device.gpu_minor, []).append((path, hold))
        control = [(path, hold) for path, hold in held if not hold.device.is_gpu]
        if not per_gpu and control:
            node_wide.append((holder, control))
        for minor, holds in sorted(per_gpu.items()):
            out.append((_holder_consumer(holder, holds, [p for p, _ in control], _scope(minor, nvml), ctx),
                        holder))
    if nvml.available:
        covered = {(c.gpu_uuid, c.pid) for c, _ in out if c.gpu_uuid}
        by_pid = {h.pid: h for h in holders}
        for gpu in nvml.gpus:
            for pid, listed in sorted(listed_by_uuid[gpu.uuid].items()):
                if (gpu.uuid, pid) not in covered:
                    out.append(_listed_consumer(gpu, listed, by_pid.get(pid), ctx))
    # A holder NVML lists (an MPS client) is reported on that GPU, with its control devices.
    reported = {c.pid for c, _ in out if c.cls is not ConsumerClass.GHOST and c.devices}
    for holder, control in node_wide:
        if holder.pid not in reported:
            out.append((_holder_consumer(holder, control, [], _scope(None, nvml), ctx), holder))
    consumers = _with_memory(out)
    consumers.sort(key=consumer_order)
    return consumers


# ---- memory ---------------------------------------------------------------------------------

def _held_memory(holder: Holder | None) -> tuple[Mapping[int | None, int] | None, str]:
    """(bytes per RM device instance, "") of what a holder's driver calls hold, or (None, why that is
    unknown). Only a holder whose every hold the kernel saw opened (source "bpf", as gpu_work.judge
    asks for a whole call history) has a figure: one found by a /proc scan opened its device before
    the tracer watched, and whatever it allocated then is not in the accountant."""
    if holder is None:
        return None, NO_HOLDER
    if holder.memory is None:
        return None, NO_KERNEL_SIDE
    if any(hold.source != "bpf" for hold in holder.holds.values()):
        return None, BEFORE_START
    if holder.memory.incomplete:
        return None, holder.memory.incomplete
    return holder.memory.by_instance, ""


def _spread(minors: Sequence[int | None], by_instance: Mapping[int | None, int]) -> list[int]:
    """A process's bytes over its consumers (their GPUs' device minors; None: node-wide).

    RM device instance N is taken to be the GPU of /dev/nvidiaN (device minor N): the driver numbers
    both in its probe order (docs/reference/nvidia-ioctl-abi.md §10 names the identity chain), an
    assumption bench/gpu_real_check.sh checks on a real driver. What no consumer of the process is
    on (memory under no device object the tracer saw, or on a GPU whose device file it does not
    hold) goes to its first consumer, so that the process's total is never shown low."""
    out = [by_instance.get(minor, 0) if minor is not None else 0 for minor in minors]
    stray = sum(n for instance, n in by_instance.items() if instance is None or instance not in minors)
    if out:
        out[0] += stray
    return out


def _memory_note(c: Consumer) -> str:
    """What the reason says of the memory a consumer holds ("" for none): NVML's figure where NVML
    gives one, else the driver calls'. A visible or ghost reason is NVML's listing, which names it."""
    on = f"on GPU {c.gpu}" if c.gpu is not None else "of GPU memory"
    if c.gpu_memory_bytes is not None:
        if not c.gpu_memory_bytes or c.cls in (ConsumerClass.VISIBLE, ConsumerClass.GHOST):
            return ""
        return f"it holds {size_phrase(c.gpu_memory_bytes)} {on} (NVML's figure)"
    if c.allocated_bytes:
        return f"it holds {size_phrase(c.allocated_bytes)} {on} (from the driver calls ghostgpu saw)"
    return ""


def _with_memory(pairs: Sequence[tuple[Consumer, Holder | None]]) -> list[Consumer]:
    """Each consumer with its allocated_bytes (or why unknown) and the memory its reason names."""
    of_holder: dict[int, list[int]] = {}  # holder pid -> its consumers' positions, in GPU order
    for i, (_, holder) in sorted(enumerate(pairs), key=lambda p: consumer_order(p[1][0])):
        if holder is not None:
            of_holder.setdefault(holder.pid, []).append(i)
    allocated: dict[int, tuple[int | None, str]] = {}
    for positions in of_holder.values():
        by_instance, why = _held_memory(pairs[positions[0]][1])
        if by_instance is None:
            allocated.update(dict.fromkeys(positions, (None, why)))
            continue
        shares = _spread([pairs[i][0].gpu_minor for i in positions], by_instance)
        allocated.update((i, (n, "")) for i, n in zip(positions, shares, strict=True))
    out: list[Consumer] = []
    for i, (consumer, _) in enumerate(pairs):
        n, why = allocated.get(i, (None, NO_HOLDER))
        c = replace(consumer, allocated_bytes=n, allocated_reason=why)
        if note := _memory_note(c):
            c.reason = f"{c.reason}; {note}"
        out.append(c)
    return out
