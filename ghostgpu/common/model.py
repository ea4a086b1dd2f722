"""The small common model shared by the tracer and the collector.

Only plain data lives here: the collector never imports tracer internals, and both speak in
these types and the generated gRPC API.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any


class ConsumerClass(StrEnum):
    """One class per consumer (process x GPU); see classify() for the rules and their order."""

    SYSTEM = "system"  # an allowlisted node daemon that holds devices by design
    GHOST = "ghost"  # NVML lists a PID that does not exist (or was reused): memory held by the dead
    ORPHANED = "orphaned"  # a holder whose owner is gone (zombie leader, reparented container process)
    UNALLOCATED = "unallocated"  # a container using a GPU never allocated to it (collector, PodResources)
    VISIBLE = "visible"  # NVML lists it on that GPU
    UNATTRIBUTED = "unattributed"  # a holder outside any container that NVML does not list
    HIDDEN = "hidden"  # a container process holding the GPU that NVML does not list, past the grace period
    PENDING = "pending"  # holding for less than the grace period: NVML may not list it yet
    UNKNOWN = "unknown"  # the rule needs NVML and NVML is not available



class DeviceKind(StrEnum):
    GPU = "gpu"  # one GPU: /dev/nvidiaN, /dev/dri/renderD*, /dev/davinciN
    MIG = "mig"  # a MIG capability (/dev/nvidia-caps/nvidia-capM) that gates one GPU's instance
    CONTROL = "control"  # node-wide control: nvidiactl, nvidia-modeset, nvidia-caps (config/monitor), kfd
    UVM = "uvm"  # unified memory: nvidia-uvm, nvidia-uvm-tools
    OTHER = "other"  # matched a prefix but no known role (nvlink, nvswitch, imex channels, ...)



@dataclass(frozen=True, order=True)
class DeviceRef:
    """A GPU device file as a process sees it.

    `path` is the path inside the holder's mount namespace (what it opened, or what
    /proc/PID/fd links to). `gpu_minor` is the per-GPU minor the file stands for (the N of
    /dev/nvidiaN, the GPU of a MIG capability), None for node-wide control devices.
    """

    path: str
    kind: DeviceKind = DeviceKind.OTHER
    gpu_minor: int | None = None
    major: int | None = None
    minor: int | None = None

    @property
    def is_gpu(self) -> bool:
        """Only a per-GPU device (or a MIG capability) makes a GPU consumer; control devices do not."""
        return self.gpu_minor is not None and self.kind in (DeviceKind.GPU, DeviceKind.MIG)


@dataclass
class Consumer:
    """One process x one GPU, classified. The JSON keys are a contract: extend, never rename."""

    node: str
    pid: int  # host PID
    ns_pid: int | None  # PID inside the process's own PID namespace
    comm: str
    gpu: int | None  # NVML index when NVML maps the device minor, else the device minor
    gpu_uuid: str
    gpu_minor: int | None
    devices: list[str]  # device paths held for this GPU (and the control devices the process holds)
    container_id: str
    pod_uid: str
    runtime: str
    cls: ConsumerClass
    reason: str
    gpu_memory_bytes: int | None  # what NVML says this PID uses on this GPU; None when NVML does not say
    exe: str = ""
    cmdline: str = ""
    uid: int | None = None
    ppid: int | None = None
    state: str = ""
    start_time_ns: int | None = None  # since boot (CLOCK_BOOTTIME), from /proc/PID/stat field 22
    first_seen_ns: int | None = None  # since boot, when the tracer first saw this consumer
    mapped: bool = False
    fds: list[int] = field(default_factory=list)
    cgroup_path: str = ""
    alive: bool = True

    @property
    def key(self) -> tuple[int, int | None, str]:
        """Identity of a consumer across refreshes: PID (with its start time) x GPU."""
        return (self.pid, self.gpu_minor if self.gpu_minor is not None else self.gpu, self.gpu_uuid)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["class"] = str(d.pop("cls"))
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Consumer:
        """The inverse of to_json(). Extra keys (a record's `event`, `ts`) are ignored, so a finding
        record reads back as its consumer; a missing required key raises ValueError naming it."""
        values: dict[str, Any] = {}
        for f in _CONSUMER_FIELDS:
            key = "class" if f.name == "cls" else f.name
            if key in d:
                values[f.name] = d[key]
            elif f.default is MISSING and f.default_factory is MISSING:
                raise ValueError(f"consumer record has no {key!r} key")
        try:
            values["cls"] = ConsumerClass(values["cls"])
        except ValueError:
            raise ValueError(f"consumer record: unknown class {values['cls']!r}") from None
        for name in ("devices", "fds"):
            if name in values:
                values[name] = list(values[name])
        return cls(**values)


_CONSUMER_FIELDS = fields(Consumer)
