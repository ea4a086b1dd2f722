"""Records <-> NodeEvent: every record kind the tracer emits survives the trip over the wire unchanged.

The records are built by the tracer's own record functions (tracer/records.py) from real events,
process identities and NVML views, so the table follows the agent's keys, not a copy of them; the
PodResources poller's records are read from their JSON (record_from_json).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from ghostgpu.tracer import records
from ghostgpu.tracer.events import UNRECORDED_KINDS, EventKind, NvmlGpu, NvmlView, ProcessInfo, SourceEvent

from ghostgpu.common.model.consumers import Consumer, ConsumerClass, DeviceKind, DeviceRef
from ghostgpu.common.model.records import HOLDER_KINDS, STREAMED_KINDS, HolderRecord, Record, record_from_json
from ghostgpu.common.wire.convert import record_to_event
from ghostgpu.v1 import stream_pb2
from tests.helpers.wire_decode import event_to_record

NODE = "gpu-node-7"
NV0 = DeviceRef("/dev/nvidia0", DeviceKind.GPU, 0, 195, 0)
CTL = DeviceRef("/dev/nvidiactl", DeviceKind.CONTROL, None, 195, 255)
UUID0 = "GPU-0a1b2c3d-0000-4000-8000-000000000000"
NVML = NvmlView(available=True, ts_ns=5, driver_version="550.54.15", gpus=(
    NvmlGpu(index=0, uuid=UUID0, minor=0, name="NVIDIA H100 80GB HBM3", memory_total_bytes=85_899_345_920),
    NvmlGpu(index=1, uuid="GPU-1", minor=None, name="", memory_total_bytes=None),
))
NO_NVML = NvmlView(available=False, error="NVML: libnvidia-ml.so.1 not found; install the NVIDIA driver")
INFO = ProcessInfo(pid=4242, start_ticks=100, ns_pid=7, comm="python3", exe="/usr/bin/python3.11",
                   cmdline="python3 train.py --epochs 3", uid=1000, ppid=4200, state="S",
                   cgroup_path="/kubepods.slice/kubepods-pod1.slice/cri-containerd-" + "a" * 64 + ".scope",
                   container_id="a" * 64, pod_uid="1441bc39-919a-4962-bb72-ea854cbd68ff",
                   runtime="containerd")
GONE = ProcessInfo(pid=4243, alive=False, container_id="b" * 64, runtime="crio", cgroup_path="/x")
CONSUMER = Consumer(
    node=NODE, pid=4242, ns_pid=7, comm="python3", gpu=0, gpu_uuid=UUID0, gpu_minor=0,
    devices=["/dev/nvidia0", "/dev/nvidiactl"], container_id="a" * 64, pod_uid="pod-uid",
    runtime="containerd",
    cls=ConsumerClass.HIDDEN, reason="holds /dev/nvidia0; NVML does not list it", gpu_memory_bytes=0,
    exe="/usr/bin/python3", cmdline="python3 x.py", uid=0, ppid=1, state="S", start_time_ns=12_345,
    first_seen_ns=67_890, mapped=True, fds=[3, 9], cgroup_path="/kubepods/x", alive=True,
)


def holder(kind: EventKind, info: ProcessInfo | None = INFO, dev: DeviceRef | None = NV0, fd: int = 5,
           nvml: NvmlView = NVML, **extra: Any) -> HolderRecord:
    fields = {k: extra.pop(k) for k in ("child_pid", "mapped", "cgroup_id") if k in extra}
    ev = SourceEvent(kind, extra.pop("source", "bpf"), 987_654_321, 4242, tid=4250, fd=fd, device=dev,
                     **fields)
    devices = ["/dev/nvidia0", "/dev/nvidiactl"] if dev is not None else []
    return records.event_record(NODE, ev, info, devices, nvml, **extra)


IOCTLS = records.ioctl_list({("/dev/nvidiactl", 0xC020462A): 12, ("/dev/nvidia0", 0xC0104629): 3},
                            {"/dev/nvidiactl": "control", "/dev/nvidia0": "gpu"})

# Every record kind the agent, the PodResources poller and the stream sink emit.
RECORDS = [
    ("open", holder(EventKind.OPEN, cgroup_id=81234)),
    ("open-procfs-no-nvml", holder(EventKind.OPEN, nvml=NO_NVML, source="procfs")),
    ("open-control-device", holder(EventKind.OPEN, dev=CTL)),
    ("close-mapped-with-ioctls", holder(EventKind.CLOSE, mapped=True, ioctls=IOCTLS)),
    ("close-counted-no-ioctls", holder(EventKind.CLOSE, ioctls=[])),
    ("close-not-counted", holder(EventKind.CLOSE)),
    ("mmap", holder(EventKind.MMAP, fd=-1)),
    ("unmap", holder(EventKind.UNMAP, fd=-1, source="procfs")),
    ("fork", holder(EventKind.FORK, dev=None, fd=-1, child_pid=4300)),
    ("exec", holder(EventKind.EXEC, dev=None, fd=-1)),
    ("exit-held", holder(EventKind.EXIT, dev=None, fd=-1, ioctls=IOCTLS, held_s=12.345678)),
    ("exit-gone-before-proc", holder(EventKind.EXIT, info=GONE, dev=None, fd=-1, held_s=0.0)),
    ("finding", records.consumer_record("finding", CONSUMER)),
    ("finding-unknowns", records.consumer_record("finding", replace(
        CONSUMER, ns_pid=None, gpu=None, gpu_minor=None, gpu_memory_bytes=None, uid=None, ppid=None,
        start_time_ns=None, first_seen_ns=None, cls=ConsumerClass.UNKNOWN, devices=[], fds=[], alive=False))),
    ("resolved", records.consumer_record("resolved", replace(CONSUMER, cls=ConsumerClass.VISIBLE,
                                                             gpu_memory_bytes=1 << 30))),
    ("notice", records.notice_record(NODE, "bpf.ringbuf_drops", "3 new (3 in all): the kernel lost state")),
    ("info", records.info_record(NODE, True, NVML)),
    ("info-no-nvml", records.info_record(NODE, False, NO_NVML)),
    ("allocations", record_from_json({
        "event": "allocations", "ts": 1_767_000_000.123456, "node": NODE, "available": True,
        "error": "", "containers": [
            {"namespace": "ml", "pod": "train-0", "container": "main",
             "resource_names": ["nvidia.com/gpu"], "device_ids": [UUID0, "GPU-1"]},
            {"namespace": "ml", "pod": "infer", "container": "srv",
             "resource_names": ["nvidia.com/mig-1g.10gb"], "device_ids": ["MIG-5c"]}]})),
    ("allocations-unavailable", record_from_json({
        "event": "allocations", "ts": 1_767_000_001.5, "node": NODE, "available": False,
        "error": "PodResources socket /x not found", "containers": []})),
]


def trip(rec: Record, seq: int = 41) -> Record:
    ev = record_to_event(rec, seq)
    assert ev is not None
    wire = stream_pb2.NodeEvent.FromString(ev.SerializeToString())
    assert wire.seq == seq
    assert wire.ts_unix_ns == round(rec.ts * 1e9)
    return event_to_record(wire, node=NODE)


def canonical(rec: Record) -> str:
    """JSON as a reader sees it: 1 and 1.0, or a list and a tuple, would differ here."""
    return json.dumps(rec.to_json(), sort_keys=True)


@pytest.mark.parametrize("rec", [r for _, r in RECORDS], ids=[name for name, _ in RECORDS])
def test_round_trip(rec: Record) -> None:
    assert canonical(trip(rec)) == canonical(rec)


def test_body_matches_the_kind() -> None:
    bodies = {name: record_to_event(rec, 1).WhichOneof("body") for name, rec in RECORDS}
    assert bodies["open"] == bodies["exit-held"] == "holder"
    assert (bodies["finding"], bodies["resolved"], bodies["notice"]) == ("finding", "resolved", "notice")
    assert (bodies["info"], bodies["allocations"]) == ("info", "allocations")


def test_holder_event_fields_on_the_wire() -> None:
    ev = record_to_event(dict(RECORDS)["close-mapped-with-ioctls"], 3)
    h = ev.holder
    assert h.kind == h.KIND_CLOSE and h.source == "bpf" and h.ts_ns == 987_654_321 and h.tid == 4250
    assert h.process.pid == 4242 and h.process.ns_pid == 7 and h.process.container_id == "a" * 64
    assert (h.gpu, h.gpu_uuid, h.device, h.fd, h.mapped) == (0, UUID0, "/dev/nvidia0", 5, True)
    assert [(i.cmd, i.count) for i in h.ioctls] == [(0xC020462A, 12), (0xC0104629, 3)]
    control = record_to_event(dict(RECORDS)["open-control-device"], 4).holder
    assert control.gpu == -1 and control.device_kind == "control"


def test_a_process_proc_never_showed_reads_back_as_not_alive() -> None:
    """identity_fields(None) writes only five keys; the trip adds the rest with their unknown values."""
    typed = holder(EventKind.EXIT, info=None, dev=None, fd=-1)
    rec, back = typed.to_json(), trip(typed).to_json()
    assert {k: back[k] for k in rec} == rec
    assert back["alive"] is False and back["uid"] is None and back["exe"] == ""


def test_ready_is_not_streamed() -> None:
    ready = records.ready_record(NODE, True, False, 1.0, 0)
    assert record_to_event(ready, 1) is None
    assert "ready" not in STREAMED_KINDS


def test_every_holder_kind_has_a_wire_kind() -> None:
    assert set(HOLDER_KINDS) == {str(k) for k in EventKind if k not in UNRECORDED_KINDS}
    for kind in HOLDER_KINDS:
        assert trip(holder(EventKind(kind))).to_json()["event"] == kind


def test_an_event_without_a_body_is_refused() -> None:
    with pytest.raises(ValueError, match="no body"):
        event_to_record(stream_pb2.NodeEvent(seq=9))


def test_consumer_from_json_ignores_record_keys_and_names_what_is_missing() -> None:
    rec = records.consumer_record("finding", CONSUMER).to_json()
    assert Consumer.from_json({**rec, "namespace": "ml", "allocated": "unknown"}) == CONSUMER
    partial = {k: v for k, v in rec.items() if k not in ("exe", "fds", "alive")}
    assert Consumer.from_json(partial) == replace(CONSUMER, exe="", fds=[], alive=True)
    with pytest.raises(ValueError, match="'comm'"):
        Consumer.from_json({k: v for k, v in rec.items() if k != "comm"})
    with pytest.raises(ValueError, match="unknown class 'haunted'"):
        Consumer.from_json({**rec, "class": "haunted"})


def test_a_malformed_record_raises_naming_the_problem() -> None:
    with pytest.raises((KeyError, ValueError)):
        record_to_event(record_from_json({"event": "open", "ts": 1.0}), 1)  # no pid
