"""The tracer's own vocabulary: what its sources (the BPF ring buffer, /proc scans, NVML) report, and
the views the classifier reads. Internal to the tracer: what it emits is the typed records of
ghostgpu.common.model.records, built from these by tracer/records.py.

All timestamps are nanoseconds since boot (CLOCK_BOOTTIME): the clock of bpf_ktime_get_boot_ns()
and of /proc/PID/stat start times, so kernel events, scans and process ages compare directly.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from ghostgpu.common.model.consumers import DeviceRef


def boot_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME)


class EventKind(StrEnum):
    OPEN = "open"  # first fd of a process on a device
    CLOSE = "close"  # last fd of a process on a device closed (mapped=True: a mapping still holds it)
    MMAP = "mmap"  # first mapping of a device by a process
    UNMAP = "unmap"  # procfs: the mapping that held a closed device is gone
    FORK = "fork"  # a holder forked a new process (child_pid); the child inherits its fds
    EXEC = "exec"  # a holder exec'd: close-on-exec fds are gone, rescan it
    EXIT = "exit"  # the whole thread group of a holder is dead
    RENAME = "rename"  # a holder's leader changed its comm: re-read its identity (never a record)


# Kinds that only steer the holder table: the agent never turns them into a HolderRecord.
UNRECORDED_KINDS = frozenset({EventKind.RENAME})


@dataclass(frozen=True)
class SourceEvent:
    """A state change of one process's hold on one device, as a source saw it: the kernel (`bpf`) or a
    /proc scan (`procfs`). Not the wire's node_pb2.HolderEvent: the agent turns it, with the holder's
    identity and the node's GPUs, into a HolderRecord (ghostgpu.common.model.records)."""

    kind: EventKind
    source: str  # "bpf" | "procfs"
    ts_ns: int  # since boot
    pid: int  # host tgid
    tid: int = 0
    fd: int = -1
    device: DeviceRef | None = None
    cgroup_id: int = 0  # cgroup v2 id from bpf_get_current_cgroup_id(); 0 when unknown
    child_pid: int = 0  # FORK only
    mapped: bool = False  # CLOSE: a mapping still holds the device


@dataclass
class ProcessInfo:
    """Who a host PID is. Read from /proc once per process; start_ticks guards against PID reuse."""

    pid: int
    start_ticks: int | None = None  # /proc/PID/stat field 22, clock ticks since boot
    ns_pid: int | None = None  # last field of NSpid: in /proc/PID/status
    comm: str = ""
    exe: str = ""
    cmdline: str = ""
    uid: int | None = None
    ppid: int | None = None
    state: str = ""  # one letter of /proc/PID/stat: R S D Z T ...
    threads: int = 0  # live tasks under /proc/PID/task (a zombie leader keeps the group alive)
    cgroup_path: str = ""
    container_id: str = ""
    pod_uid: str = ""
    runtime: str = ""
    parent_comm: str = ""
    parent_container_id: str = ""
    alive: bool = True  # False when it was gone before /proc could be read (identity from cgroup id)

    @property
    def leader_zombie(self) -> bool:
        """The thread-group leader exited but other threads live on (and may hold the device)."""
        return self.state == "Z" and self.threads > 1


@dataclass
class DeviceHold:
    """How one process holds one device."""

    device: DeviceRef
    fds: set[int] = field(default_factory=set)
    mapped: bool = False
    first_seen_ns: int = 0
    source: str = ""  # who saw it first: "bpf" | "procfs"
    via_tasks: bool = False  # found under /proc/PID/task/*/fd because the leader is gone

    @property
    def held(self) -> bool:
        return bool(self.fds) or self.mapped


@dataclass
class Holder:
    process: ProcessInfo
    holds: dict[str, DeviceHold] = field(default_factory=dict)  # by device path
    ioctl_counts: dict[int, int] = field(default_factory=dict)  # ioctl request word -> count
    gpu_work: GpuWork | None = None  # what it asked the driver for; None: no call history at all
    memory: HeldMemory | None = None  # what the driver accepted from its memory calls; None: BPF off

    @property
    def pid(self) -> int:
        return self.process.pid


@dataclass(frozen=True)
class GpuWork:
    """What a holder asked the driver to do, from the kernel's always-on capture of the rare
    allocation calls (RM_ALLOC's hClass, ALLOC_MEMORY): what tells a GPU job from a monitoring client
    (nvidia-smi, dcgm-exporter), which only reads state. tracer/classify.py judges it."""

    allocated: bool  # it allocated memory, a channel or a compute/copy engine class
    what: str = ""  # the first such call, decoded, for the reason: "RM_ALLOC AMPERE_COMPUTE_A (0xc6c0)"
    # The kernel watched the process since its first open (BPF on, the open seen): a False
    # `allocated` is then evidence. A holder found by the /proc scan has no history (gpu_work None).
    complete: bool = True


@dataclass(frozen=True)
class HeldMemory:
    """The GPU memory a process holds by its own driver calls (tracer/gpu_memory.py), as the agent
    hands it to the classifier: bytes per RM device instance, None for memory under no device object
    the tracer saw. `incomplete` says why the figure cannot be exact ("" when it is)."""

    by_instance: Mapping[int | None, int] = field(default_factory=dict)
    incomplete: str = ""


@dataclass(frozen=True)
class NvmlProcess:
    pid: int
    used_gpu_memory_bytes: int | None  # None: NVML said "not available" (e.g. no permission, MIG)
    kind: str = "compute"  # "compute" | "graphics" | "compute+graphics" (one entry per PID)


@dataclass(frozen=True)
class NvmlGpu:
    index: int
    uuid: str
    minor: int | None
    name: str = ""
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    mig_mode: bool | None = None
    pci_bus_id: str = ""  # NVML's busId ("00000000:3B:00.0"); "" when NVML did not say
    processes: tuple[NvmlProcess, ...] = ()
    # False: NVML failed to list this GPU's processes (GPU lost, ...): absence is not evidence.
    processes_known: bool = True


@dataclass(frozen=True)
class NvmlView:
    """What the driver reports. available=False means no driver, GPU or library: see error."""

    available: bool
    ts_ns: int = 0
    driver_version: str = ""
    gpus: tuple[NvmlGpu, ...] = ()
    error: str = ""

    def gpu_by_minor(self, minor: int) -> NvmlGpu | None:
        for gpu in self.gpus:
            if gpu.minor == minor:
                return gpu
        return None


# What one /proc scan found: host PID -> device path -> how it is held (fds, mapping).
ProcView = dict[int, dict[str, DeviceHold]]
