"""The tracer's records as types: one frozen dataclass per kind the tracer emits.

A record is built once, from the tracer's own state (tracer/records.py), and travels as itself: the
stream encodes it straight to its NodeEvent body (ghostgpu.common.wire.convert), and the collector
reads the consumers and allocations out of that body. JSON is made only at the edges, by
`to_json()`: the JSON-lines sink (`ghostgpu tracer --jsonl`), the live view's callback, `-o json`.
The JSON keys (their order too) and values are what `ghostgpu tracer` has always written: a
contract, extended, never renamed. They are derived from the fields (ghostgpu.common.model.jsonform):
each field's metadata says where the contract departs from the plain rule. `record_from_json()` is
the inverse.

Every holder record carries the snapshot keys (node, pid, ns_pid, comm, gpu, devices, container_id,
pod_uid, runtime, class, reason, gpu_memory_bytes), so one reader handles events and findings alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ghostgpu.common.model.consumers import Consumer
from ghostgpu.common.model.jsonform import HEX, JsonForm, json_meta

HOLDER_KINDS = ("open", "close", "mmap", "unmap", "fork", "exec", "exit")
# Record kinds that travel on the stream; `ready` is a local start-up marker and does not.
STREAMED_KINDS = frozenset((*HOLDER_KINDS, "finding", "resolved", "notice", "info", "allocations", "fault"))

JsonRecord = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ProcessIdentity(JsonForm):
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


# A process /proc could not be read for gets these five keys only: its JSON has always said so.
_NO_IDENTITY_JSON: JsonRecord = {"ns_pid": None, "comm": "", "container_id": "", "pod_uid": "", "runtime": ""}
# A holder event has no class, reason or memory of its own; the keys are there for one reader of all.
_SNAPSHOT_KEYS_UNSET: JsonRecord = {"class": None, "reason": "", "gpu_memory_bytes": None}


@dataclass(frozen=True, slots=True)
class IoctlCount(JsonForm):
    device: str
    cmd: int = field(metadata=json_meta(codec=HEX))  # the request word; JSON writes it in hex ("0xc020462a")
    name: str
    count: int


@dataclass(frozen=True, slots=True)
class HolderRecord(JsonForm):
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
    # every device the process holds after the event
    devices: tuple[str, ...] = field(default=(), metadata=json_meta(then=_SNAPSHOT_KEYS_UNSET))
    cgroup_id: int | None = None
    child_pid: int = field(default=0, metadata=json_meta(omit_default=True))  # FORK only
    # CLOSE: a mapping still holds the device
    mapped: bool = field(default=False, metadata=json_meta(omit_default=True))
    # None: gone before /proc could be read. Its keys sit among the record's own.
    process: ProcessIdentity | None = field(default=None,
                                            metadata=json_meta(flatten=True, absent=_NO_IDENTITY_JSON))
    # None: the kernel's counters were not read
    ioctls: tuple[IoctlCount, ...] | None = field(default=None, metadata=json_meta(omit_default=True))
    # EXIT: how long it held its first device
    held_s: float | None = field(default=None, metadata=json_meta(omit_default=True))


@dataclass(frozen=True, slots=True)
class ConsumerRecord(JsonForm):
    """`finding` (a consumer appeared or changed) or `resolved` (it went; its last state).

    The Consumer is held, not copied: the tracer classifies into new Consumers every time and never
    changes one it has emitted. Its JSON is the consumer's keys, then `event` and `ts`."""

    event: str = field(metadata=json_meta(last=True))  # "finding" | "resolved"
    ts: float = field(metadata=json_meta(last=True))
    consumer: Consumer = field(metadata=json_meta(flatten=True))


@dataclass(frozen=True, slots=True)
class NoticeRecord(JsonForm):
    """A source is missing or lost data (NVML, BPF, the spool): `what` names it, `message` says it."""

    event: ClassVar[str] = "notice"
    ts: float
    node: str
    what: str
    message: str


@dataclass(frozen=True, slots=True)
class GpuInfo(JsonForm):
    index: int
    uuid: str
    name: str
    minor: int | None
    memory_total_bytes: int | None
    pci_bus_id: str = ""  # NVML's, "00000000:3B:00.0"
    # NVML's used memory, split (tracer/gpu_memory.py memory_split): what NVML attributes to the
    # processes it lists; what the consumers it does not list hold by their driver calls; the rest.
    memory_used_bytes: int | None = None
    memory_listed_bytes: int | None = None
    memory_unlisted_bytes: int | None = None
    unaccounted_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class InfoRecord(JsonForm):
    """What the node looks like: kernel tracing on or off, the GPUs NVML sees (or why it sees none)."""

    event: ClassVar[str] = "info"
    ts: float
    node: str
    bpf: bool
    nvml: bool
    nvml_error: str = ""
    driver_version: str = ""
    gpus: tuple[GpuInfo, ...] = ()


@dataclass(frozen=True, slots=True)
class FaultConsumer(JsonForm):
    """One process a GPU fault hit: it held the GPU when the driver logged the Xid."""

    pid: int  # host PID
    named: bool = False  # the driver's message named this process
    exited: bool = False  # it had already exited (within the look-back) when the Xid came
    gpu: int | None = None  # the GPU it held; None: node-wide devices only
    process: ProcessIdentity | None = field(default=None, metadata=json_meta(flatten=True,
                                                                            absent=_NO_IDENTITY_JSON))


@dataclass(frozen=True, slots=True)
class FaultRecord(JsonForm):
    """A GPU fault (Xid) from the kernel log, joined to the consumers that held that GPU then
    (tracer/faults.py). A line that did not parse is a fault too: `xid` None, `raw` keeps it."""

    event: ClassVar[str] = "fault"
    ts: float  # unix seconds, when the tracer read the line
    node: str
    ts_ns: int  # when the driver logged it, since boot (CLOCK_BOOTTIME, converted from the printk clock)
    xid: int | None
    gpu: int | None = None  # NVML index of the GPU with that PCI bus id; None: none matched
    gpu_uuid: str = ""
    pci_bus_id: str = ""  # as the driver wrote it
    severity: str = "unknown"  # critical | warning | info | unknown (tracer/xid_catalog.py)
    meaning: str = ""
    message: str = ""  # the driver's text after the Xid number
    pid: int | None = None  # the process the driver named
    process_name: str = ""
    affected: tuple[FaultConsumer, ...] = ()  # the named process first
    raw: str = ""
    kmsg_seq: int = 0
    origin: str = "kernel"  # kernel | user: a line user space wrote to /dev/kmsg (a drill, a test)


# The NVIDIA device plugin's time-slicing and MPS sharing advertise replica N of a device as `<ID>::N`.
_REPLICA_SUFFIX = re.compile(r"::\d+$")


def physical_device_id(device_id: str) -> str:
    """`GPU-...::3` -> `GPU-...`: a shared GPU's replica names the GPU itself. Only a numeric replica
    suffix goes; any other ID (a CDI name, an ID with `::` of another meaning) stays as it is."""
    return _REPLICA_SUFFIX.sub("", device_id)


@dataclass(frozen=True, slots=True)
class ContainerAllocation(JsonForm):
    namespace: str
    pod: str
    container: str
    resource_names: tuple[str, ...] = ()  # e.g. nvidia.com/gpu
    device_ids: tuple[str, ...] = ()  # physical IDs (physical_device_id): GPU/MIG UUIDs, CDI names


@dataclass(frozen=True, slots=True)
class AllocationsRecord(JsonForm):
    """What the kubelet's PodResources API allocated (tracer/podresources.py); `ts` is when it was read."""

    event: ClassVar[str] = "allocations"
    ts: float
    node: str
    available: bool
    error: str = ""
    containers: tuple[ContainerAllocation, ...] = ()


@dataclass(frozen=True, slots=True)
class ReadyRecord(JsonForm):
    """The tracer has attached, scanned and classified once: local only, never streamed."""

    event: ClassVar[str] = "ready"
    ts: float
    node: str
    bpf: bool
    nvml: bool
    startup_s: float
    holders: int


Record = (HolderRecord | ConsumerRecord | NoticeRecord | InfoRecord | AllocationsRecord | ReadyRecord
          | FaultRecord)

_RECORD_TYPES: dict[str, type[Record]] = {
    **dict.fromkeys(HOLDER_KINDS, HolderRecord), "finding": ConsumerRecord, "resolved": ConsumerRecord,
    "notice": NoticeRecord, "info": InfoRecord, "allocations": AllocationsRecord, "ready": ReadyRecord,
    "fault": FaultRecord,
}


def record_from_json(d: JsonRecord) -> Record:
    """The typed record for a JSON one (the inverse of to_json()). Raises ValueError naming what is
    missing or wrong."""
    kind = d.get("event")
    record_type = _RECORD_TYPES.get(kind) if isinstance(kind, str) else None
    if record_type is None:
        raise ValueError(f"unknown record kind {kind!r}")
    return record_type.from_json(d)

