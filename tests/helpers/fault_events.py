"""GPU fault events (NodeEvent `fault`) as a tracer sends them, for collector tests fed by a SimTracer.

`fault_record()` builds the model's FaultRecord (ghostgpu/common/model/records.py) and `fault_event()`
turns it into the NodeEvent through the one converter the tracer uses (ghostgpu.common.wire.convert).
`Names` is a collector resolver_factory whose CRI answers a test decides: TRAIN is ml/train-7, GONE a
container CRI no longer knows, any other pending until `answer()`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

from ghostgpu.common.model.consumers import K8sInfo
from ghostgpu.common.model.records import FaultConsumer, FaultRecord, ProcessIdentity
from ghostgpu.common.wire.convert import record_to_event
from ghostgpu.v1 import stream_pb2

TRAIN, EVAL, GONE = "1a" * 32, "2b" * 32, "3c" * 32
PENDING = K8sInfo("unresolved", error="CRI lookup pending")
XID_LINE = ("NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python3, GPU has fallen off the bus.")
# Each record its own /dev/kmsg sequence number, as the kernel numbers them: the collector stores a
# fault once per record (collector/faults.py), so two faults of a test are two records unless it says.
_KMSG_SEQ = itertools.count(901)


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
    """An Xid the driver logged for GPU `gpu` (its UUID as the sim tracer's NodeInfo has it), a kernel
    log record of its own (kmsg_seq) unless `fields` says which."""
    base: dict[str, Any] = {
        "ts": time.time(), "node": node, "ts_ns": 12_345_678_000, "xid": xid, "gpu": gpu,
        "gpu_uuid": f"GPU-{gpu:08x}-0000-4000-8000-000000000000" if gpu is not None else "",
        "pci_bus_id": "0000:3b:00", "severity": "critical", "meaning": "GPU has fallen off the bus",
        # As tracer/xid.py hands it on: the driver's pid= and name= fields read apart from the message.
        "message": "GPU has fallen off the bus.", "pid": 4242,
        "process_name": "python3", "affected": affected, "raw": XID_LINE, "kmsg_seq": next(_KMSG_SEQ)}
    base.update(fields)
    return FaultRecord(**base)


def fault_event(seq: int, rec: FaultRecord, ts_unix_ns: int = 0) -> stream_pb2.NodeEvent:
    ev = record_to_event(rec, seq)
    assert ev is not None
    if ts_unix_ns:
        ev.ts_unix_ns = ts_unix_ns
    return ev


def k8s(namespace: str, pod: str, container: str, state: str = "CONTAINER_RUNNING") -> K8sInfo:
    return K8sInfo("resolved", namespace, pod, f"uid-{pod}", container, "img:1", state, "SANDBOX_READY",
                   runtime="containerd 1.6.20")


class Names:
    """The collector's resolver_factory: CRI answers by container ID, pending until `answer()`."""

    made: list[Names] = []

    def __init__(self, transport_for: Any, on_change: Callable[[str, str], None]) -> None:
        self.on_change = on_change
        self.names: dict[str, K8sInfo] = {TRAIN: k8s("ml", "train-7", "trainer"),
                                          GONE: K8sInfo("not_found", container_state="NOT_FOUND")}
        Names.made.append(self)

    def get(self, node: str, container_id: str) -> K8sInfo:
        return self.names.get(container_id, PENDING)

    def answer(self, node: str, container_id: str, info: K8sInfo) -> None:
        """CRI answered (call it on the collector's loop, as the real resolver's callback lands there)."""
        self.names[container_id] = info
        self.on_change(node, container_id)
