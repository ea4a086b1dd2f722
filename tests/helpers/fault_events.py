"""GPU fault events (NodeEvent `fault`) as a tracer sends them, for collector tests fed by a SimTracer.

`fault_record()` builds the model's FaultRecord (ghostgpu/common/model/records.py) and `fault_event()`
turns it into the NodeEvent through the one converter the tracer uses (ghostgpu.common.wire.convert).
"""

from __future__ import annotations

import time
from typing import Any

from ghostgpu.common.model.records import FaultConsumer, FaultRecord, ProcessIdentity
from ghostgpu.common.wire.convert import record_to_event
from ghostgpu.v1 import stream_pb2

XID_LINE = ("NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python3, GPU has fallen off the bus.")


def hit(pid: int, container_id: str = "", comm: str = "python3", gpu: int | None = 1, named: bool = False,
        exited: bool = False) -> FaultConsumer:
    """A process the fault hit, in container `container_id` (none: a host process)."""
    cgroup = f"/kubepods.slice/cri-containerd-{container_id}.scope" if container_id else "/system.slice/x"
    who = ProcessIdentity(ns_pid=1 if container_id else pid, comm=comm, exe="/usr/bin/python3",
                          cmdline="python3 train.py", uid=1000, ppid=1, state="S", container_id=container_id,
                          runtime="containerd" if container_id else "", cgroup_path=cgroup)
    return FaultConsumer(pid=pid, named=named, exited=exited, gpu=gpu, process=who)


def fault_record(node: str = "gpu-node-1", xid: int | None = 79, gpu: int | None = 1,
                 affected: tuple[FaultConsumer, ...] = (), **fields: Any) -> FaultRecord:
    """An Xid the driver logged for GPU `gpu` (its UUID as the sim tracer's NodeInfo has it)."""
    base: dict[str, Any] = {
        "ts": time.time(), "node": node, "ts_ns": 12_345_678_000, "xid": xid, "gpu": gpu,
        "gpu_uuid": f"GPU-{gpu:08x}-0000-4000-8000-000000000000" if gpu is not None else "",
        "pci_bus_id": "0000:3b:00", "severity": "critical", "meaning": "GPU has fallen off the bus",
        "message": "pid=4242, name=python3, GPU has fallen off the bus.", "pid": 4242,
        "process_name": "python3", "affected": affected, "raw": XID_LINE, "kmsg_seq": 901}
    base.update(fields)
    return FaultRecord(**base)


def fault_event(seq: int, rec: FaultRecord, ts_unix_ns: int = 0) -> stream_pb2.NodeEvent:
    ev = record_to_event(rec, seq)
    assert ev is not None
    if ts_unix_ns:
        ev.ts_unix_ns = ts_unix_ns
    return ev
