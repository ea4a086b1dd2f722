"""Mapping between the common model (ghostgpu.common.model) and the generated API (ghostgpu.v1).

The proto's scalars have no "unset": -1 stands for an unknown GPU index or minor, 0 for an unknown
namespace PID or start time, and `gpu_memory_bytes` is an explicit `optional`. These helpers are
the one place that knows it, so the collector and the tracer agree.
"""

from __future__ import annotations

from ghostgpu.common.model import Consumer, ConsumerClass
from ghostgpu.v1 import node_pb2

_CLASS_TO_PB = {cls: node_pb2.ConsumerClass.Value(f"CONSUMER_CLASS_{cls.name}") for cls in ConsumerClass}
_PB_TO_CLASS = {v: k for k, v in _CLASS_TO_PB.items()}


def class_to_proto(cls: ConsumerClass) -> int:
    return _CLASS_TO_PB[cls]


def class_from_proto(value: int) -> ConsumerClass:
    """UNSPECIFIED, or a class from a newer peer, reads as unknown."""
    return _PB_TO_CLASS.get(value, ConsumerClass.UNKNOWN)


def _opt(value: int | None, unset: int) -> int:
    return unset if value is None else value


def _back(value: int, unset: int) -> int | None:
    return None if value == unset else value


def consumer_to_proto(c: Consumer) -> node_pb2.Consumer:
    process = node_pb2.Process(
        pid=c.pid, ns_pid=_opt(c.ns_pid, 0), comm=c.comm, exe=c.exe, cmdline=c.cmdline,
        uid=_opt(c.uid, -1), ppid=_opt(c.ppid, 0), start_time_ns=_opt(c.start_time_ns, 0), state=c.state,
        container_id=c.container_id, pod_uid=c.pod_uid, runtime=c.runtime, cgroup_path=c.cgroup_path,
        alive=c.alive,
    )
    msg = node_pb2.Consumer(
        node=c.node, process=process, gpu=_opt(c.gpu, -1), gpu_uuid=c.gpu_uuid,
        gpu_minor=_opt(c.gpu_minor, -1), devices=c.devices, reason=c.reason,
        first_seen_ns=_opt(c.first_seen_ns, 0), mapped=c.mapped, fds=c.fds,
    )
    setattr(msg, "class", _CLASS_TO_PB[c.cls])  # `class` is a Python keyword
    if c.gpu_memory_bytes is not None:
        msg.gpu_memory_bytes = c.gpu_memory_bytes
    return msg


def consumer_from_proto(msg: node_pb2.Consumer) -> Consumer:
    p = msg.process
    cls = class_from_proto(getattr(msg, "class"))
    return Consumer(
        node=msg.node, pid=p.pid, ns_pid=_back(p.ns_pid, 0), comm=p.comm, gpu=_back(msg.gpu, -1),
        gpu_uuid=msg.gpu_uuid, gpu_minor=_back(msg.gpu_minor, -1), devices=list(msg.devices),
        container_id=p.container_id, pod_uid=p.pod_uid, runtime=p.runtime, cls=cls, reason=msg.reason,
        gpu_memory_bytes=msg.gpu_memory_bytes if msg.HasField("gpu_memory_bytes") else None,
        exe=p.exe, cmdline=p.cmdline, uid=_back(p.uid, -1), ppid=_back(p.ppid, 0), state=p.state,
        start_time_ns=_back(p.start_time_ns, 0), first_seen_ns=_back(msg.first_seen_ns, 0),
        mapped=msg.mapped, fds=list(msg.fds), cgroup_path=p.cgroup_path, alive=p.alive,
    )
