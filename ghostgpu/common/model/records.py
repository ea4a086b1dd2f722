"""The tracer's records as types: one frozen dataclass per kind the tracer emits.

A record is built once, from the tracer's own state (tracer/records.py), and travels as itself: the
stream encodes it straight to its NodeEvent body and the collector decodes that body straight back
(ghostgpu.common.wire.convert). JSON is made only at the edges, by `to_json()`: the JSON-lines sink
(`ghostgpu tracer --jsonl`), the live view's callback, `-o json`. Each `to_json()` writes the keys
(their order too) and values `ghostgpu tracer` has always written: they are a contract, extended,
never renamed. `record_from_json()` is its inverse, for a source that still hands the sinks JSON.

Every holder record carries the snapshot keys (node, pid, ns_pid, comm, gpu, devices, container_id,
pod_uid, runtime, class, reason, gpu_memory_bytes), so one reader handles events and findings alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ghostgpu.common.model.consumers import Consumer

HOLDER_KINDS = ("open", "close", "mmap", "unmap", "fork", "exec", "exit")
# Record kinds that travel on the stream; `ready` is a local start-up marker and does not.
STREAMED_KINDS = frozenset((*HOLDER_KINDS, "finding", "resolved", "notice", "info", "allocations"))

JsonRecord = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ProcessIdentity:
    """Who a holder is, as /proc said when its event was handled (the tracer's ProcessInfo, less what
    only the tracer needs)."""

    ns_pid: int | None = None
    comm: str = ""
    exe: str = ""
    cmdline: str = ""
    uid: int | None = None
    ppid: int | None = None
    state: str = ""
    container_id: str = ""
    pod_uid: str = ""
    runtime: str = ""
    cgroup_path: str = ""
    alive: bool = True

    def to_json(self) -> JsonRecord:
        return {"ns_pid": self.ns_pid, "comm": self.comm, "exe": self.exe, "cmdline": self.cmdline,
                "uid": self.uid, "ppid": self.ppid, "state": self.state, "container_id": self.container_id,
                "pod_uid": self.pod_uid, "runtime": self.runtime, "cgroup_path": self.cgroup_path,
                "alive": self.alive}

    @classmethod
    def from_json(cls, d: JsonRecord) -> ProcessIdentity:
        return cls(ns_pid=d.get("ns_pid"), comm=d.get("comm") or "", exe=d.get("exe") or "",
                   cmdline=d.get("cmdline") or "", uid=d.get("uid"), ppid=d.get("ppid"),
                   state=d.get("state") or "", container_id=d.get("container_id") or "",
                   pod_uid=d.get("pod_uid") or "", runtime=d.get("runtime") or "",
                   cgroup_path=d.get("cgroup_path") or "", alive=bool(d.get("alive", False)))


# A process /proc could not be read for gets these five keys only: its JSON has always said so.
_NO_IDENTITY_JSON: JsonRecord = {"ns_pid": None, "comm": "", "container_id": "", "pod_uid": "", "runtime": ""}


@dataclass(frozen=True, slots=True)
class IoctlCount:
    device: str
    cmd: int  # the request word; JSON writes it in hex ("0xc020462a")
    name: str
    count: int

    def to_json(self) -> JsonRecord:
        return {"device": self.device, "cmd": f"{self.cmd:#x}", "name": self.name, "count": self.count}


def _cmd(cmd: str | int) -> int:
    return int(cmd, 16) if isinstance(cmd, str) else cmd


@dataclass(frozen=True, slots=True)
class HolderRecord:
    """open, close, mmap, unmap, fork, exec or exit: a state change of one process's hold on a device."""

    event: str  # one of HOLDER_KINDS ("unknown" for a kind from a newer peer)
    ts: float  # unix seconds, rounded to µs
    ts_ns: int  # since boot (CLOCK_BOOTTIME)
    source: str  # "bpf" | "procfs"
    node: str
    pid: int  # host tgid
    tid: int = 0
    gpu: int | None = None  # NVML index, else the device minor; None: not a per-GPU device
    gpu_uuid: str = ""
    device: str | None = None
    device_kind: str | None = None
    fd: int | None = None
    devices: tuple[str, ...] = ()  # every device the process holds after the event
    cgroup_id: int | None = None
    child_pid: int = 0  # FORK only; written only when set
    mapped: bool = False  # CLOSE: a mapping still holds the device; written only when true
    process: ProcessIdentity | None = None  # None: gone before /proc could be read
    ioctls: tuple[IoctlCount, ...] | None = None  # None: the kernel's counters were not read
    held_s: float | None = None  # EXIT: how long it held its first device

    def to_json(self) -> JsonRecord:
        d: JsonRecord = {
            "event": self.event, "ts": self.ts, "ts_ns": self.ts_ns, "source": self.source,
            "node": self.node, "pid": self.pid, "tid": self.tid, "gpu": self.gpu, "gpu_uuid": self.gpu_uuid,
            "device": self.device, "device_kind": self.device_kind, "fd": self.fd,
            "devices": list(self.devices), "class": None, "reason": "", "gpu_memory_bytes": None,
            "cgroup_id": self.cgroup_id,
        }
        if self.child_pid:
            d["child_pid"] = self.child_pid
        if self.mapped:
            d["mapped"] = True
        d.update(_NO_IDENTITY_JSON if self.process is None else self.process.to_json())
        if self.ioctls is not None:
            d["ioctls"] = [i.to_json() for i in self.ioctls]
        if self.held_s is not None:
            d["held_s"] = self.held_s
        return d

    @classmethod
    def from_json(cls, d: JsonRecord) -> HolderRecord:
        ioctls = None
        if "ioctls" in d:
            ioctls = tuple(IoctlCount(i["device"], _cmd(i["cmd"]), i.get("name") or "", i["count"])
                           for i in d["ioctls"])
        return cls(
            event=d["event"], ts=d.get("ts") or 0.0, ts_ns=d.get("ts_ns") or 0, source=d.get("source") or "",
            node=d.get("node") or "", pid=d["pid"], tid=d.get("tid") or 0, gpu=d.get("gpu"),
            gpu_uuid=d.get("gpu_uuid") or "", device=d.get("device"), device_kind=d.get("device_kind"),
            fd=d.get("fd"), devices=tuple(d.get("devices") or ()), cgroup_id=d.get("cgroup_id"),
            child_pid=d.get("child_pid") or 0, mapped=bool(d.get("mapped")),
            # identity_fields(None) never wrote `alive`: its presence says /proc was read.
            process=ProcessIdentity.from_json(d) if "alive" in d else None, ioctls=ioctls,
            held_s=d.get("held_s"),
        )


@dataclass(frozen=True, slots=True)
class ConsumerRecord:
    """`finding` (a consumer appeared or changed) or `resolved` (it went; its last state).

    The Consumer is held, not copied: the tracer classifies into new Consumers every time and never
    changes one it has emitted."""

    event: str  # "finding" | "resolved"
    ts: float
    consumer: Consumer

    def to_json(self) -> JsonRecord:
        d = self.consumer.to_json()
        d["event"] = self.event
        d["ts"] = self.ts
        return d

    @classmethod
    def from_json(cls, d: JsonRecord) -> ConsumerRecord:
        return cls(d["event"], d.get("ts") or 0.0, Consumer.from_json(d))


@dataclass(frozen=True, slots=True)
class NoticeRecord:
    """A source is missing or lost data (NVML, BPF, the spool): `what` names it, `message` says it."""

    event: ClassVar[str] = "notice"
    ts: float
    node: str
    what: str
    message: str

    def to_json(self) -> JsonRecord:
        return {"event": "notice", "ts": self.ts, "node": self.node, "what": self.what,
                "message": self.message}

    @classmethod
    def from_json(cls, d: JsonRecord) -> NoticeRecord:
        return cls(d.get("ts") or 0.0, d.get("node") or "", d.get("what") or "", d.get("message") or "")


@dataclass(frozen=True, slots=True)
class GpuInfo:
    index: int
    uuid: str
    name: str
    minor: int | None
    memory_total_bytes: int | None

    def to_json(self) -> JsonRecord:
        return {"index": self.index, "uuid": self.uuid, "name": self.name, "minor": self.minor,
                "memory_total_bytes": self.memory_total_bytes}


@dataclass(frozen=True, slots=True)
class InfoRecord:
    """What the node looks like: kernel tracing on or off, the GPUs NVML sees (or why it sees none)."""

    event: ClassVar[str] = "info"
    ts: float
    node: str
    bpf: bool
    nvml: bool
    nvml_error: str = ""
    driver_version: str = ""
    gpus: tuple[GpuInfo, ...] = ()

    def to_json(self) -> JsonRecord:
        return {"event": "info", "ts": self.ts, "node": self.node, "bpf": self.bpf, "nvml": self.nvml,
                "nvml_error": self.nvml_error, "driver_version": self.driver_version,
                "gpus": [g.to_json() for g in self.gpus]}

    @classmethod
    def from_json(cls, d: JsonRecord) -> InfoRecord:
        gpus = tuple(GpuInfo(g["index"], g.get("uuid") or "", g.get("name") or "", g.get("minor"),
                             g.get("memory_total_bytes")) for g in d.get("gpus") or ())
        return cls(d.get("ts") or 0.0, d.get("node") or "", bool(d.get("bpf")), bool(d.get("nvml")),
                   d.get("nvml_error") or "", d.get("driver_version") or "", gpus)


@dataclass(frozen=True, slots=True)
class ContainerAllocation:
    namespace: str
    pod: str
    container: str
    resource_names: tuple[str, ...] = ()  # e.g. nvidia.com/gpu
    device_ids: tuple[str, ...] = ()  # physical IDs: GPU/MIG UUIDs, "::replica" suffixes removed

    def to_json(self) -> JsonRecord:
        return {"namespace": self.namespace, "pod": self.pod, "container": self.container,
                "resource_names": list(self.resource_names), "device_ids": list(self.device_ids)}


@dataclass(frozen=True, slots=True)
class AllocationsRecord:
    """What the kubelet's PodResources API allocated (tracer/podresources.py); `ts` is when it was read."""

    event: ClassVar[str] = "allocations"
    ts: float
    node: str
    available: bool
    error: str = ""
    containers: tuple[ContainerAllocation, ...] = ()

    def to_json(self) -> JsonRecord:
        return {"event": "allocations", "ts": self.ts, "node": self.node, "available": self.available,
                "error": self.error, "containers": [c.to_json() for c in self.containers]}

    @classmethod
    def from_json(cls, d: JsonRecord) -> AllocationsRecord:
        containers = tuple(ContainerAllocation(c["namespace"], c["pod"], c["container"],
                                               tuple(c.get("resource_names") or ()),
                                               tuple(c.get("device_ids") or ()))
                           for c in d.get("containers") or ())
        return cls(d.get("ts") or 0.0, d.get("node") or "", bool(d.get("available")), d.get("error") or "",
                   containers)


@dataclass(frozen=True, slots=True)
class ReadyRecord:
    """The tracer has attached, scanned and classified once: local only, never streamed."""

    event: ClassVar[str] = "ready"
    ts: float
    node: str
    bpf: bool
    nvml: bool
    startup_s: float
    holders: int

    def to_json(self) -> JsonRecord:
        return {"event": "ready", "ts": self.ts, "node": self.node, "bpf": self.bpf, "nvml": self.nvml,
                "startup_s": self.startup_s, "holders": self.holders}

    @classmethod
    def from_json(cls, d: JsonRecord) -> ReadyRecord:
        return cls(d.get("ts") or 0.0, d.get("node") or "", bool(d.get("bpf")), bool(d.get("nvml")),
                   d.get("startup_s") or 0.0, d.get("holders") or 0)


Record = HolderRecord | ConsumerRecord | NoticeRecord | InfoRecord | AllocationsRecord | ReadyRecord
# What a sink accepts: a typed record, or a JSON one from a source that still writes JSON (the
# PodResources poller's `allocations`), read once where it enters.
AnyRecord = Record | JsonRecord

_FROM_JSON: dict[str, Callable[[JsonRecord], Record]] = {
    **dict.fromkeys(HOLDER_KINDS, HolderRecord.from_json),
    "finding": ConsumerRecord.from_json, "resolved": ConsumerRecord.from_json,
    "notice": NoticeRecord.from_json, "info": InfoRecord.from_json,
    "allocations": AllocationsRecord.from_json, "ready": ReadyRecord.from_json,
}


def record_from_json(d: JsonRecord) -> Record:
    """The typed record for a JSON one (the inverse of to_json()). Raises KeyError, TypeError or
    ValueError naming what is missing or wrong."""
    kind = d.get("event")
    read = _FROM_JSON.get(kind) if kind is not None else None
    if read is None:
        raise ValueError(f"unknown record kind {kind!r}")
    return read(d)


def as_json(record: AnyRecord) -> JsonRecord:
    """The JSON edge: a record's JSON object (a JSON record is already one)."""
    return record if isinstance(record, dict) else record.to_json()
