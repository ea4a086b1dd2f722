"""The JSON form derived from the model's dataclasses: every record type, populated, reads back equal.

Each JsonForm class of the model room has a populated instance here (a test fails when a new one
has none): its to_json() is plain JSON and from_json() gives the instance back. The exact bytes the
tracer's records write are held to the legacy builders in test_records.py; the trace classes' key
order and their two departures (ended_unix_ns 0 as null, the derived errno) are held here. Then the
rules themselves on small classes: key, last, omit_default, flatten, null, codec, then.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import ClassVar

import pytest

from ghostgpu.common.model import consumers, records, trace
from ghostgpu.common.model.consumers import Consumer, ConsumerClass
from ghostgpu.common.model.jsonform import HEX, JsonForm, json_meta
from ghostgpu.common.model.records import (
    AllocationsRecord,
    ConsumerRecord,
    ContainerAllocation,
    FaultConsumer,
    FaultRecord,
    GpuInfo,
    HolderRecord,
    InfoRecord,
    IoctlCount,
    NoticeRecord,
    ProcessIdentity,
    ReadyRecord,
)
from ghostgpu.common.model.trace import TraceRecord, TraceScope, TraceSession, TraceStatus

CONSUMER = Consumer(
    node="n", pid=42, ns_pid=7, comm="python3", gpu=0, gpu_uuid="GPU-0", gpu_minor=0,
    devices=["/dev/nvidia0", "/dev/nvidiactl"], container_id="c" * 64, pod_uid="p", runtime="containerd",
    cls=ConsumerClass.HIDDEN, reason="holds /dev/nvidia0", gpu_memory_bytes=1 << 20, exe="/usr/bin/python3",
    cmdline="python3 x.py", uid=1000, ppid=1, state="S", start_time_ns=5, first_seen_ns=6, mapped=True,
    fds=[3, 9], cgroup_path="/kubepods/x", alive=False, allowlisted="dcgm", system_places=["kube-system"],
    allocated_bytes=3 << 30, allocated_reason="")
IDENTITY = ProcessIdentity(ns_pid=7, comm="python3", exe="/usr/bin/python3", cmdline="python3 x.py", uid=0,
                           ppid=1, state="S", container_id="c" * 64, pod_uid="p", runtime="containerd",
                           cgroup_path="/kubepods/x", alive=False)
IOCTLS = (IoctlCount("/dev/nvidiactl", 0xC020462A, "RM_ALLOC", 12), IoctlCount("/dev/nvidia0", 0x2A, "", 1))
GPUS = (GpuInfo(0, "GPU-0", "H100", 0, 80 << 30, "00000000:3B:00.0", 9 << 30, 4 << 30, 3 << 30, 2 << 30),
        GpuInfo(1, "GPU-1", "", None, None))
FAULT_HIT = FaultConsumer(pid=42, named=True, exited=False, gpu=0, process=IDENTITY)
FAULT = FaultRecord(ts=3.5, node="n", ts_ns=11, xid=79, gpu=0, gpu_uuid="GPU-0", pci_bus_id="0000:3b:00",
                    severity="critical", meaning="GPU has fallen off the bus",
                    message="GPU has fallen off the bus.",
                    pid=42, process_name="python3", affected=(FAULT_HIT, FaultConsumer(pid=43, exited=True)),
                    raw="NVRM: Xid (PCI:0000:3b:00): 79, pid=42, name=python3, GPU has fallen off the bus.",
                    kmsg_seq=900)
ALLOCATED = ContainerAllocation("ml", "train-0", "main", ("nvidia.com/gpu",), ("GPU-0", "GPU-1"))
SCOPE = TraceScope(namespace="ml", pod="train-0", container="main", node="n", pid=42, gpu="0")
SESSION = TraceSession(id="t-1", scope=SCOPE, requested_by="uid 0", started_unix_ns=1, deadline_unix_ns=2,
                       ended_unix_ns=3, status=TraceStatus.STOPPED, status_detail="stopped by uid 0",
                       nodes=("n", "m"), container_ids=("c" * 64,), records_total=4,
                       dropped_limit_total=5, dropped_ringbuf_total=6, dropped_store_total=7, max_records=8,
                       dropped_transport_total=9)
CALL = TraceRecord(session="t-1", node="n", ts_ns=1, pid=42, tid=43, ns_pid=7, container_id="c" * 64,
                   namespace="ml", pod="train-0", container="main", gpu="0", device="/dev/nvidiactl",
                   call="RM_ALLOC", request=0xC020462B, escape="NV_ESC_RM_ALLOC", cmd=None, cmd_name="",
                   h_class=0, class_name="NV01_ROOT", nv_status=0, nv_status_name="NV_OK", ret=-25,
                   duration_ns=900, seq=3, kind="ioctl", comm="python3", fd=5, child_pid=None,
                   args={"hClient": "0xc1d00001"}, notes=("a note",))

RUNNING = TraceSession(id="t-2", scope=TraceScope(), requested_by="", started_unix_ns=1, deadline_unix_ns=2)
HOLDER = HolderRecord(
    event="close", ts=1.5, ts_ns=9, source="bpf", node="n", pid=42, tid=43, gpu=0, gpu_uuid="GPU-0",
    device="/dev/nvidia0", device_kind="gpu", fd=3, devices=("/dev/nvidia0", "/dev/nvidiactl"), cgroup_id=77,
    child_pid=50, mapped=True, process=IDENTITY, ioctls=IOCTLS, held_s=1.234567)
GONE = HolderRecord(event="exit", ts=1.5, ts_ns=9, source="procfs", node="n", pid=42)  # gone before /proc

# One populated instance of every JsonForm class of the model room (several where a field may be unset).
POPULATED: list[JsonForm] = [
    CONSUMER, IDENTITY, *IOCTLS, *GPUS, ALLOCATED, SCOPE, SESSION, RUNNING, CALL, HOLDER, GONE,
    HolderRecord(event="close", ts=1.5, ts_ns=9, source="bpf", node="n", pid=42, process=ProcessIdentity(),
                 ioctls=(), held_s=0.0),  # counted, none; held for no time
    ConsumerRecord("finding", 2.5, CONSUMER),
    ConsumerRecord("resolved", 2.5, Consumer(
        node="n", pid=42, ns_pid=None, comm="", gpu=None, gpu_uuid="", gpu_minor=None, devices=[],
        container_id="", pod_uid="", runtime="", cls=ConsumerClass.UNKNOWN, reason="",
        gpu_memory_bytes=None)),
    NoticeRecord(1.0, "n", "nvml", "no driver"),
    InfoRecord(1.0, "n", True, True, "", "550.54.15", GPUS),
    InfoRecord(1.0, "n", True, False, "NVML: not found"),
    AllocationsRecord(1.0, "n", True, "", (ALLOCATED, ContainerAllocation("ml", "p", "c"))),
    AllocationsRecord(1.0, "n", False, "socket not found"),
    ReadyRecord(1.0, "n", True, False, 0.123, 2),
    FAULT, FAULT_HIT,
    FaultRecord(ts=3.5, node="n", ts_ns=12, xid=None, raw="NVRM: Xid (PCI:garbled", kmsg_seq=901),  # kept raw
    Consumer(node="n", pid=9, ns_pid=None, comm="", gpu=0, gpu_uuid="", gpu_minor=0, devices=[],
             container_id="", pod_uid="", runtime="", cls=ConsumerClass.HIDDEN, reason="",
             gpu_memory_bytes=None,
             allocated_bytes=None, allocated_reason="allocated before the tracer started"),
    TraceRecord(session="t-1", node="n", ts_ns=1, pid=42, tid=42, seq=1, kind="exit"),
]


def json_form_classes() -> set[type]:
    out: set[type] = set()
    for module in (consumers, records, trace):
        out |= {v for v in vars(module).values()
                if isinstance(v, type) and issubclass(v, JsonForm) and v.__module__ == module.__name__}
    return out


def test_every_json_form_class_has_a_populated_instance() -> None:
    assert json_form_classes() - {type(x) for x in POPULATED} == set()


@pytest.mark.parametrize("value", POPULATED, ids=lambda v: type(v).__name__)
def test_json_reads_back_equal(value: JsonForm) -> None:
    text = json.dumps(value.to_json())  # plain JSON: no default= needed
    assert type(value).from_json(json.loads(text)) == value
    assert json.dumps(value.to_json()) == text  # a second call (the generated to_json) writes the same


def test_record_from_json_picks_the_type_by_event() -> None:
    for value in POPULATED:
        if isinstance(value, records.Record):
            assert records.record_from_json(json.loads(json.dumps(value.to_json()))) == value


def test_trace_session_json() -> None:
    assert list(SESSION.to_json()) == [
        "id", "scope", "requested_by", "started_unix_ns", "deadline_unix_ns", "ended_unix_ns", "status",
        "status_detail", "nodes", "container_ids", "records_total", "dropped_limit_total",
        "dropped_ringbuf_total", "dropped_store_total", "max_records", "dropped_transport_total"]
    d = RUNNING.to_json()
    assert d["ended_unix_ns"] is None and d["status"] == "running" and d["scope"]["pid"] == 0


def test_trace_record_json() -> None:
    d = CALL.to_json()
    assert list(d) == [
        "session", "node", "ts_ns", "pid", "tid", "ns_pid", "container_id", "namespace", "pod", "container",
        "gpu", "device", "call", "request", "escape", "cmd", "cmd_name", "h_class", "class_name", "nv_status",
        "nv_status_name", "ret", "duration_ns", "seq", "kind", "comm", "fd", "errno", "child_pid", "args",
        "notes"]
    assert (d["errno"], d["args"], d["notes"]) == (25, {"hClient": "0xc1d00001"}, ["a note"])
    assert d["args"] is not CALL.args


def test_holder_record_json() -> None:
    d = GONE.to_json()
    assert list(d)[-5:] == ["ns_pid", "comm", "container_id", "pod_uid", "runtime"]
    assert "alive" not in d and "ioctls" not in d and "child_pid" not in d and "mapped" not in d
    full = HOLDER.to_json()
    assert full["ioctls"][0] == {"device": "/dev/nvidiactl", "cmd": "0xc020462a", "name": "RM_ALLOC",
                                 "count": 12}
    assert (full["class"], full["reason"], full["gpu_memory_bytes"]) == (None, "", None)


# --- the rules, on small classes -------------------------------------------------------------------

class Colour(enum.StrEnum):
    RED = "red"


@dataclass(frozen=True)
class Inner(JsonForm):
    a: int = 0
    b: str = ""


THEN = {"k": "v", "twice": lambda o: 2 * o.word}  # a constant, and a value derived from the object


@dataclass(frozen=True)
class Outer(JsonForm):
    kind: ClassVar[str] = "outer"
    colour: Colour = field(metadata=json_meta(key="color", last=True))
    count: int = field(default=0, metadata=json_meta(omit_default=True))
    inner: Inner | None = field(default=None, metadata=json_meta(flatten=True, absent={"a": None}))
    ended: int = field(default=0, metadata=json_meta(null=0))
    word: int = field(default=0, metadata=json_meta(codec=HEX, then=THEN))
    items: tuple[Inner, ...] = ()


def test_the_rules() -> None:
    plain = Outer(Colour.RED)
    assert plain.to_json() == {"kind": "outer", "a": None, "ended": None, "word": "0x0", "k": "v", "twice": 0,
                               "items": [], "color": "red"}
    assert list(plain.to_json())[-1] == "color"
    full = Outer(Colour.RED, 3, Inner(1, "x"), 9, 255, (Inner(2),))
    d = full.to_json()
    assert d == {"kind": "outer", "count": 3, "a": 1, "b": "x", "ended": 9, "word": "0xff", "k": "v",
                 "twice": 510, "items": [{"a": 2, "b": ""}], "color": "red"}
    assert Outer.from_json(d) == full and Outer.from_json(plain.to_json()) == plain
    assert Outer.from_json({"color": "red", "word": 16}) == Outer(Colour.RED, word=16)  # a plain int reads


def test_reading_names_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="Outer JSON has no 'color' key"):
        Outer.from_json({})
    with pytest.raises(ValueError, match="Outer JSON: unknown color 'blue'"):
        Outer.from_json({"color": "blue"})
    with pytest.raises(ValueError, match="unknown class 'haunted'"):
        Consumer.from_json({**CONSUMER.to_json(), "class": "haunted"})


def test_a_subclass_writes_its_own_fields() -> None:
    @dataclass(frozen=True)
    class More(Inner):
        c: bool = True

    assert Inner(1).to_json() == {"a": 1, "b": ""}  # the parent's generated first
    assert More(1).to_json() == {"a": 1, "b": "", "c": True}


def test_what_cannot_be_written_is_refused() -> None:
    @dataclass(frozen=True)
    class Bad(JsonForm):
        x: int = field(default=0, metadata=json_meta(flatten=True))

    with pytest.raises(TypeError, match="only a JsonForm field can be flattened"):
        Bad().to_json()

