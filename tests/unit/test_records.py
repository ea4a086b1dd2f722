"""The typed records write, byte for byte, the JSON the tracer's dict records always wrote.

`ghostgpu tracer --jsonl` output is a contract (keys, their order, values). The dict builders the
tracer had before its records were typed are kept here, as they were, as the reference: every
record kind's to_json() must serialize to the same bytes. Also: record_from_json() inverts
to_json(), and the one consumer key agrees with itself from a Consumer and from its proto.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from typing import Any

import pytest
from ghostgpu.collector.enrich import allocations_from
from ghostgpu.tracer import records
from ghostgpu.tracer.events import EventKind, NvmlGpu, NvmlView, ProcessInfo, SourceEvent
from ghostgpu.tracer.ioctl_decode import decode_ioctl
from ghostgpu.tracer.sinks import dumps

from ghostgpu.common.model.consumers import Consumer, ConsumerClass, DeviceKind, DeviceRef, consumer_key
from ghostgpu.common.model.records import Record, physical_device_id, record_from_json
from ghostgpu.common.wire.convert import consumer_to_proto, proto_consumer_key

NODE = "node-r"
NV0 = DeviceRef("/dev/nvidia0", DeviceKind.GPU, 0, 195, 0)
CTL = DeviceRef("/dev/nvidiactl", DeviceKind.CONTROL, None, 195, 255)
NVML = NvmlView(available=True, driver_version="550.54.15", gpus=(
    NvmlGpu(index=3, uuid="GPU-3", minor=0, name="H100", memory_total_bytes=80 << 30),
    NvmlGpu(index=1, uuid="GPU-1", minor=None)))
INFO = ProcessInfo(pid=4242, ns_pid=7, comm="python3", exe="/usr/bin/python3", cmdline="python3 x.py", uid=0,
                   ppid=1, state="S", cgroup_path="/kubepods/x", container_id="c" * 64, pod_uid="p",
                   runtime="containerd")
CONSUMER = Consumer(node=NODE, pid=4242, ns_pid=None, comm="python3", gpu=3, gpu_uuid="GPU-3", gpu_minor=0,
                    devices=["/dev/nvidia0"], container_id="c" * 64, pod_uid="p", runtime="containerd",
                    cls=ConsumerClass.HIDDEN, reason="holds /dev/nvidia0", gpu_memory_bytes=None, fds=[3])


# --- the dict builders as they were (tracer/records.py and Consumer.to_json before typed records) ---

def legacy_identity(info: ProcessInfo | None) -> dict[str, Any]:
    if info is None:
        return {"ns_pid": None, "comm": "", "container_id": "", "pod_uid": "", "runtime": ""}
    return {"ns_pid": info.ns_pid, "comm": info.comm, "exe": info.exe, "cmdline": info.cmdline,
            "uid": info.uid, "ppid": info.ppid, "state": info.state, "container_id": info.container_id,
            "pod_uid": info.pod_uid, "runtime": info.runtime, "cgroup_path": info.cgroup_path,
            "alive": info.alive}


def legacy_event(rec_ts: float, ev: SourceEvent, info: ProcessInfo | None, devices: list[str],
                 nvml: NvmlView) -> dict[str, Any]:
    dev = ev.device
    gpu, gpu_uuid = records.gpu_of(dev.gpu_minor if dev is not None and dev.is_gpu else None, nvml)
    rec: dict[str, Any] = {
        "event": str(ev.kind), "ts": rec_ts, "ts_ns": ev.ts_ns, "source": ev.source, "node": NODE,
        "pid": ev.pid, "tid": ev.tid, "gpu": gpu, "gpu_uuid": gpu_uuid,
        "device": dev.path if dev is not None else None,
        "device_kind": str(dev.kind) if dev is not None else None,
        "fd": ev.fd if ev.fd >= 0 else None, "devices": devices, "class": None, "reason": "",
        "gpu_memory_bytes": None, "cgroup_id": ev.cgroup_id or None,
    }
    if ev.child_pid:
        rec["child_pid"] = ev.child_pid
    if ev.mapped:
        rec["mapped"] = True
    rec.update(legacy_identity(info))
    return rec


def legacy_consumer(c: Consumer) -> dict[str, Any]:
    d = asdict(c)
    d["class"] = str(d.pop("cls"))
    if not d["allocated_reason"]:  # written only when it says why allocated_bytes is unknown
        del d["allocated_reason"]
    return d


COUNTS = {("/dev/nvidiactl", 0xC020462A): 12, ("/dev/nvidia0", 0xC0104629): 12, ("/dev/nvidia0", 0x2A): 1}
KINDS = {"/dev/nvidiactl": "control", "/dev/nvidia0": "gpu"}


def legacy_ioctls(counts: dict[tuple[str, int], int], kinds: dict[str, str]) -> list[dict[str, Any]]:
    out = []
    for (path, cmd), count in counts.items():
        name = decode_ioctl(cmd, kinds.get(path, "")).label
        out.append({"device": path, "cmd": f"{cmd:#x}", "name": name, "count": count})
    out.sort(key=lambda r: (-r["count"], r["device"], r["cmd"]))
    return out


HOLDERS = [  # (name, event, identity, extra fields of the record)
    ("open", SourceEvent(EventKind.OPEN, "bpf", 5, 4242, tid=4243, fd=3, device=NV0, cgroup_id=9), INFO, {}),
    ("open-unknown-process", SourceEvent(EventKind.OPEN, "procfs", 5, 4242, fd=3, device=CTL), None, {}),
    ("close-mapped-counted", SourceEvent(EventKind.CLOSE, "bpf", 6, 4242, fd=3, device=NV0, mapped=True),
     INFO, {"ioctls": True}),
    ("fork", SourceEvent(EventKind.FORK, "bpf", 7, 4242, child_pid=4300), INFO, {}),
    ("exit", SourceEvent(EventKind.EXIT, "procfs", 8, 4242), replace(INFO, alive=False),
     {"ioctls": True, "held_s": 1.234567}),
]


@pytest.mark.parametrize(("ev", "info", "extra"), [h[1:] for h in HOLDERS], ids=[h[0] for h in HOLDERS])
def test_holder_records_write_the_same_bytes(ev: SourceEvent, info: ProcessInfo | None,
                                             extra: dict[str, Any]) -> None:
    devices = ["/dev/nvidia0", "/dev/nvidiactl"]
    typed = records.event_record(NODE, ev, info, devices, NVML,
                                 ioctls=records.ioctl_list(COUNTS, KINDS) if extra.get("ioctls") else None,
                                 held_s=extra.get("held_s"))
    legacy = legacy_event(typed.ts, ev, info, devices, NVML)
    if extra.get("ioctls"):
        legacy["ioctls"] = legacy_ioctls(COUNTS, KINDS)
    if "held_s" in extra:
        legacy["held_s"] = extra["held_s"]
    assert dumps(typed.to_json()) == dumps(legacy)


@pytest.mark.parametrize("consumer", [CONSUMER, replace(CONSUMER, gpu_memory_bytes=0, uid=3, alive=False)])
def test_consumer_records_write_the_same_bytes(consumer: Consumer) -> None:
    assert json.dumps(consumer.to_json()) == json.dumps(legacy_consumer(consumer))
    typed = records.consumer_record("resolved", consumer)
    legacy = {**legacy_consumer(consumer), "event": "resolved", "ts": typed.ts}
    assert dumps(typed.to_json()) == dumps(legacy)


def test_node_records_write_the_same_bytes() -> None:
    notice = records.notice_record(NODE, "nvml", "no driver")
    assert dumps(notice.to_json()) == dumps(
        {"event": "notice", "ts": notice.ts, "node": NODE, "what": "nvml", "message": "no driver"})
    info = records.info_record(NODE, True, NVML)
    assert dumps(info.to_json()) == dumps({
        "event": "info", "ts": info.ts, "node": NODE, "bpf": True, "nvml": True, "nvml_error": "",
        "driver_version": "550.54.15",
        "gpus": [{"index": g.index, "uuid": g.uuid, "name": g.name, "minor": g.minor,
                  "memory_total_bytes": g.memory_total_bytes,
                  # extended, after the keys it always had: the PCI bus id and the memory split
                  "pci_bus_id": "", "memory_used_bytes": None, "memory_listed_bytes": 0,
                  "memory_unlisted_bytes": 0, "unaccounted_bytes": None} for g in NVML.gpus]})
    ready = records.ready_record(NODE, False, True, 0.12345, 2)
    assert dumps(ready.to_json()) == dumps({"event": "ready", "ts": ready.ts, "node": NODE, "bpf": False,
                                            "nvml": True, "startup_s": 0.123, "holders": 2})
    # What the PodResources poller wrote as a dict before its record was typed: the same bytes.
    allocations = {"event": "allocations", "ts": 1.5, "node": NODE, "available": True, "error": "",
                   "containers": [{"namespace": "ml", "pod": "a", "container": "m",
                                   "resource_names": ["nvidia.com/gpu"], "device_ids": ["GPU-3"]}]}
    assert dumps(record_from_json(allocations).to_json()) == dumps(allocations)


def every_record() -> list[Record]:
    holders = [records.event_record(NODE, ev, info, ["/dev/nvidia0"], NVML,
                                    ioctls=records.ioctl_list(COUNTS, KINDS) if extra.get("ioctls") else None,
                                    held_s=extra.get("held_s")) for _, ev, info, extra in HOLDERS]
    return [*holders, records.consumer_record("finding", CONSUMER), records.notice_record(NODE, "x", "y"),
            records.info_record(NODE, False, NVML), records.ready_record(NODE, True, False, 1.0, 0)]


@pytest.mark.parametrize("rec", every_record(), ids=lambda r: r.event)
def test_record_from_json_inverts_to_json(rec: Record) -> None:
    assert record_from_json(rec.to_json()) == rec


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown record kind 'haunt'"):
        record_from_json({"event": "haunt"})


@pytest.mark.parametrize("consumer", [CONSUMER, replace(CONSUMER, gpu_minor=None),
                                      replace(CONSUMER, gpu_minor=None, gpu=None, gpu_uuid="")])
def test_one_consumer_key_from_the_model_and_from_the_proto(consumer: Consumer) -> None:
    assert consumer.key == consumer_key(consumer.pid, consumer.gpu_minor, consumer.gpu, consumer.gpu_uuid)
    assert proto_consumer_key(consumer_to_proto(consumer)) == consumer.key


UUID = "GPU-6a1cd0c3-0000-4000-8000-000000000000"
MIG = "MIG-1f0f7f4e-3c2d-5a43-9e2e-000000000000"


@pytest.mark.parametrize(("raw", "physical"), [
    # a shared GPU's replica (the NVIDIA device plugin's time-slicing and MPS: `<ID>::N`) is its GPU
    (f"{UUID}::0", UUID), (f"{UUID}::3", UUID), (f"{UUID}::12", UUID), (f"{MIG}::1", MIG),
    # anything else stays: a plain ID, a device name, a CDI name
    (UUID, UUID), (MIG, MIG), ("nvidia0", "nvidia0"), ("eth1", "eth1"),
    (f"k8s.gpu.nvidia.com/gpu={UUID}", f"k8s.gpu.nvidia.com/gpu={UUID}"),
    # `::` that is not a replica number: kept (the collector's old rule cut at the first `::`)
    ("a::b", "a::b"), (f"{UUID}::", f"{UUID}::"), (f"{UUID}::1::2", f"{UUID}::1"),
])
def test_a_replica_names_its_physical_device(raw: str, physical: str) -> None:
    """One rule for the tracer (PodResources device IDs) and the collector (its allocations table)."""
    assert physical_device_id(raw) == physical
    assert allocations_from([("ml", "p", "c", [raw])]).by_container[("ml", "p", "c")] == {physical}
