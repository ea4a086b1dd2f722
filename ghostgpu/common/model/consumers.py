"""The small common model shared by the tracer, the collector and the commands.

Only plain data lives here: a node's Consumer (what the tracer classified), and the cluster's view
of it (ClusterConsumer: the Consumer plus what CRI said, K8sInfo, and whether PodResources
allocated the GPU). The tracer and the collector never import each other; both speak in these
types, mapped to the generated API by ghostgpu.common.wire.convert.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ghostgpu.common.model.jsonform import JsonForm, json_meta


class ConsumerClass(StrEnum):
    """One class per consumer (process x GPU); ghostgpu.common.model.classes says what each means, which wins
    and who decides it."""

    SYSTEM = "system"  # an allowlisted node daemon that holds devices by design
    GHOST = "ghost"  # NVML lists a PID that does not exist (or was reused): memory held by the dead
    ORPHANED = "orphaned"  # a holder whose owner is gone (zombie leader, reparented container process)
    UNALLOCATED = "unallocated"  # a container using a GPU never allocated to it (collector, PodResources)
    VISIBLE = "visible"  # NVML lists it on that GPU
    UNATTRIBUTED = "unattributed"  # a holder outside any container that NVML does not list
    HIDDEN = "hidden"  # a container process holding the GPU that NVML does not list, past the grace period
    PENDING = "pending"  # holding for less than the grace period: NVML may not list it yet
    UNKNOWN = "unknown"  # the rule needs NVML and NVML is not available
    MONITOR = "monitor"  # opened the GPU only to read its state (nvidia-smi, dcgm-exporter): never allocated


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


ConsumerKey = tuple[int, int | None, str]


def consumer_key(pid: int, gpu_minor: int | None, gpu: int | None, gpu_uuid: str) -> ConsumerKey:
    """Identity of a consumer across refreshes: host PID x GPU (its device minor, else its index) x UUID.

    The one definition: Consumer.key, the stream's snapshot table and the collector's table (read
    straight from the proto, ghostgpu.common.wire.convert.proto_consumer_key) all key consumers by it.
    """
    return (pid, gpu_minor if gpu_minor is not None else gpu, gpu_uuid)


@dataclass
class Consumer(JsonForm):
    """One process x one GPU, classified. The JSON keys are a contract: extend, never rename.

    A process that holds only node-wide devices (nvidiactl, nvidia-uvm, nvidia-modeset, nvidia-caps/*)
    is one consumer with no GPU: `gpu`, `gpu_minor` None and `gpu_uuid` "" (shown `-`)."""

    node: str
    pid: int  # host PID
    ns_pid: int | None  # PID inside the process's own PID namespace
    comm: str
    gpu: int | None  # NVML index when NVML maps the device minor, else the device minor; None: node-wide
    gpu_uuid: str
    gpu_minor: int | None
    devices: list[str]  # device paths held for this GPU (and the control devices the process holds)
    container_id: str
    pod_uid: str
    runtime: str
    cls: ConsumerClass = field(metadata=json_meta(key="class", last=True))  # JSON: `class`, the last key
    reason: str
    gpu_memory_bytes: int | None  # what NVML says this PID uses on this GPU; None when NVML does not say
    # What the driver accepted from this process's own allocation calls on this GPU, less what it
    # freed (tracer/gpu_memory.py); None: unknown, and allocated_reason says why. Never 0 for unknown.
    allocated_bytes: int | None = None
    allocated_reason: str = field(default="", metadata=json_meta(omit_default=True))
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
    # The system_allowlist entry its name or executable matches ("" none). Outside the host, the
    # places the node's config admits such a daemon in (Kubernetes namespaces, NAMESPACE/CONTAINER):
    # only the collector's CRI names can place it there (collector/enrich.py).
    allowlisted: str = ""
    system_places: list[str] = field(default_factory=list)

    @property
    def key(self) -> ConsumerKey:
        return consumer_key(self.pid, self.gpu_minor, self.gpu, self.gpu_uuid)


def consumer_order(c: Consumer) -> tuple[str, int, int, str]:
    """The one order consumers are listed and reported in: by node, then GPU (node-wide holders, with
    no GPU, first), then PID, then the GPU's UUID."""
    return (c.node, c.gpu if c.gpu is not None else -1, c.pid, c.gpu_uuid)


# --- the cluster's view of a consumer: the node's Consumer plus what CRI and PodResources said ---

@dataclass(frozen=True)
class K8sInfo:
    """What CRI said about one container (see collector/cri.py), or why it could not say."""

    resolution: str  # "resolved" | "not_found" | "unresolved" (CRI unreachable, retried) | "none"
    namespace: str = ""
    pod: str = ""
    pod_uid: str = ""
    container: str = ""
    image: str = ""
    container_state: str = ""  # CONTAINER_RUNNING, _EXITED, _UNKNOWN, _CREATED, or NOT_FOUND
    sandbox_state: str = ""  # SANDBOX_READY, SANDBOX_NOTREADY, NOT_FOUND
    error: str = ""  # why unresolved
    runtime: str = ""  # e.g. "containerd 1.6.20"
    container_reason: str = ""  # CRI's reason for an exited container (e.g. "Completed", "Error")
    exit_code: int | None = None

    @property
    def orphan_reason(self) -> str | None:
        """CRI's verdict that the container is gone, as one line; None while it runs (or CRI is silent)."""
        who = f"CRI ({self.runtime})" if self.runtime else "CRI"
        if self.resolution == "not_found":
            return f"{who} does not know this container: its record is gone"
        if self.resolution != "resolved":
            return None
        if self.container_state in ("CONTAINER_EXITED", "CONTAINER_UNKNOWN"):
            detail = ", ".join(x for x in (
                f"reason {self.container_reason}" if self.container_reason else "",
                f"exit code {self.exit_code}" if self.exit_code is not None else "") if x)
            state = self.container_state.removeprefix("CONTAINER_").lower()
            name = f"container {self.container}" if self.container else "the container"
            return f"{who} reports {name} {state}" + (f" ({detail})" if detail else "")
        pod = f"pod {self.namespace}/{self.pod}" if self.pod else "the pod"
        if self.sandbox_state == "NOT_FOUND":
            return f"{who} reports {pod} sandbox gone"
        if self.sandbox_state == "SANDBOX_NOTREADY":
            return f"{who} reports {pod} sandbox not ready (stopped)"
        return None


@dataclass
class ClusterConsumer:
    consumer: Consumer  # class and reason are final
    k8s: K8sInfo = field(default_factory=lambda: K8sInfo(resolution="none"))
    allocated: bool | None = None  # None: unknown
    node_class: ConsumerClass | None = None  # what the node tracer said, before CRI and PodResources
    since_unix_ns: int = 0
    updated_unix_ns: int = 0

    def to_json(self) -> dict[str, Any]:
        d = self.consumer.to_json()
        d.update({
            "namespace": self.k8s.namespace,
            "pod": self.k8s.pod,
            "container": self.k8s.container,
            "image": self.k8s.image,
            "allocated": "unknown" if self.allocated is None else self.allocated,
            "node_class": str(self.node_class) if self.node_class is not None else str(self.consumer.cls),
            "since": self.since_unix_ns / 1e9 if self.since_unix_ns else None,
            "resolution": self.k8s.resolution,
            "container_state": self.k8s.container_state,
            "sandbox_state": self.k8s.sandbox_state,
            "cri_runtime": self.k8s.runtime,
            "cri_error": self.k8s.error,
        })
        if not d["pod_uid"] and self.k8s.pod_uid:
            d["pod_uid"] = self.k8s.pod_uid
        return d
