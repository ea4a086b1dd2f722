"""The one mapping between the common model and the API (ghostgpu.v1): consumers both ways, the
tracer's typed records (ghostgpu.common.model.records) -> NodeEvent bodies and Snapshots directly,
and the query API's ClusterConsumer and a finding's Remediation both ways.

The collector reads what it needs straight out of a NodeEvent (consumers, allocations); it never
rebuilds the tracer's record, so that direction (event -> record, which the round-trip tests use to
show that a record survives the wire) lives with the tests, in tests/helpers/wire_decode.py.

Proto3 scalars have no "unset": -1 stands for an unknown GPU index, minor, fd or uid, 0 for an
unknown namespace PID, parent, start time, cgroup id or total memory, and `gpu_memory_bytes` and
`held_ns` are explicit `optional`s. opt_to_pb()/opt_from_pb() are the one place that applies it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from ghostgpu.common.model.consumers import (
    ClusterConsumer,
    Consumer,
    ConsumerClass,
    ConsumerKey,
    K8sInfo,
    consumer_key,
)
from ghostgpu.common.model.records import (
    HOLDER_KINDS,
    AllocationsRecord,
    ConsumerRecord,
    FaultConsumer,
    FaultRecord,
    GpuInfo,
    HolderRecord,
    InfoRecord,
    NoticeRecord,
    ProcessIdentity,
    Record,
)
from ghostgpu.common.model.remediation import RemediationState
from ghostgpu.v1 import node_pb2, query_pb2, stream_pb2

log = logging.getLogger("ghostgpu.common.wire.convert")

# The enums' constants by name (typed as their enum; EnumTypeWrapper.Value() is typed int).
_CLASS_TO_PB: dict[ConsumerClass, node_pb2.ConsumerClass] = {
    cls: getattr(node_pb2, f"CONSUMER_CLASS_{cls.name}") for cls in ConsumerClass}
_PB_TO_CLASS: dict[int, ConsumerClass] = {v: k for k, v in _CLASS_TO_PB.items()}
_KIND_TO_PB: dict[str, node_pb2.HolderEvent.Kind] = {
    k: getattr(node_pb2.HolderEvent, f"KIND_{k.upper()}") for k in HOLDER_KINDS}
_PB_TO_KIND: dict[int, str] = {v: k for k, v in _KIND_TO_PB.items()}


def opt_to_pb(value: int | None, unset: int) -> int:
    """An optional integer as its proto scalar: `unset` stands for None."""
    return unset if value is None else value


def opt_from_pb(value: int, unset: int) -> int | None:
    return None if value == unset else value


def ts_to_ns(ts: float | None) -> int:
    """A record's `ts` (unix seconds, rounded to µs) as unix nanoseconds."""
    return round(ts * 1e9) if ts else 0


def class_to_proto(cls: ConsumerClass) -> node_pb2.ConsumerClass:
    return _CLASS_TO_PB[cls]


def class_from_proto(value: int) -> ConsumerClass:
    """UNSPECIFIED, or a class from a newer peer, reads as unknown."""
    return _PB_TO_CLASS.get(value, ConsumerClass.UNKNOWN)


def holder_kind(kind: int) -> str:
    """A node_pb2.HolderEvent.Kind as the record's `event` ("open", "exit", ...); "unknown" for one not
    known here."""
    return _PB_TO_KIND.get(kind, "unknown")


# --- consumers ----------------------------------------------------------------------------------

def proto_consumer_key(c: node_pb2.Consumer) -> ConsumerKey:
    """Consumer.key of consumer_from_proto(c), without converting the whole message (the collector's
    per-event path)."""
    return consumer_key(c.process.pid, opt_from_pb(c.gpu_minor, -1), opt_from_pb(c.gpu, -1), c.gpu_uuid)


# The *_into functions write into a message in place (a NodeEvent's body, say): building a
# sub-message and handing it to its parent would copy it, which costs as much again.

def _process_into(p: node_pb2.Process, pid: int, who: Consumer | ProcessIdentity) -> None:
    """The identity fields a Consumer and a holder record's ProcessIdentity share, by the same names."""
    p.pid, p.ns_pid, p.comm, p.exe, p.cmdline = pid, opt_to_pb(who.ns_pid, 0), who.comm, who.exe, who.cmdline
    p.uid, p.ppid, p.state = opt_to_pb(who.uid, -1), opt_to_pb(who.ppid, 0), who.state
    p.container_id, p.pod_uid, p.runtime = who.container_id, who.pod_uid, who.runtime
    p.cgroup_path, p.alive = who.cgroup_path, who.alive


def consumer_into(msg: node_pb2.Consumer, c: Consumer) -> None:
    _process_into(msg.process, c.pid, c)
    msg.process.start_time_ns = opt_to_pb(c.start_time_ns, 0)
    msg.node, msg.gpu, msg.gpu_uuid = c.node, opt_to_pb(c.gpu, -1), c.gpu_uuid
    msg.gpu_minor, msg.reason = opt_to_pb(c.gpu_minor, -1), c.reason
    msg.first_seen_ns, msg.mapped = opt_to_pb(c.first_seen_ns, 0), c.mapped
    msg.devices.extend(c.devices)
    msg.fds.extend(c.fds)
    msg.allowlisted = c.allowlisted
    msg.system_places.extend(c.system_places)
    setattr(msg, "class", _CLASS_TO_PB[c.cls])  # `class` is a Python keyword
    if c.gpu_memory_bytes is not None:
        msg.gpu_memory_bytes = c.gpu_memory_bytes
    if c.allocated_bytes is not None:
        msg.allocated_bytes = c.allocated_bytes
    msg.allocated_reason = c.allocated_reason


def consumer_to_proto(c: Consumer) -> node_pb2.Consumer:
    msg = node_pb2.Consumer()
    consumer_into(msg, c)
    return msg


def consumer_from_proto(msg: node_pb2.Consumer) -> Consumer:
    p = msg.process
    return Consumer(
        node=msg.node, pid=p.pid, ns_pid=opt_from_pb(p.ns_pid, 0), comm=p.comm, gpu=opt_from_pb(msg.gpu, -1),
        gpu_uuid=msg.gpu_uuid, gpu_minor=opt_from_pb(msg.gpu_minor, -1), devices=list(msg.devices),
        container_id=p.container_id, pod_uid=p.pod_uid, runtime=p.runtime,
        cls=class_from_proto(getattr(msg, "class")), reason=msg.reason,
        gpu_memory_bytes=msg.gpu_memory_bytes if msg.HasField("gpu_memory_bytes") else None,
        allocated_bytes=msg.allocated_bytes if msg.HasField("allocated_bytes") else None,
        allocated_reason=msg.allocated_reason,
        exe=p.exe, cmdline=p.cmdline, uid=opt_from_pb(p.uid, -1), ppid=opt_from_pb(p.ppid, 0), state=p.state,
        start_time_ns=opt_from_pb(p.start_time_ns, 0), first_seen_ns=opt_from_pb(msg.first_seen_ns, 0),
        mapped=msg.mapped, fds=list(msg.fds), cgroup_path=p.cgroup_path, alive=p.alive,
        allowlisted=msg.allowlisted, system_places=list(msg.system_places),
    )


# --- holder events ------------------------------------------------------------------------------

_NO_IDENTITY = ProcessIdentity(alive=False)  # a process /proc could not be read for: not known alive


def holder_into(msg: node_pb2.HolderEvent, rec: HolderRecord) -> None:
    _process_into(msg.process, rec.pid, rec.process or _NO_IDENTITY)
    msg.kind, msg.source, msg.ts_ns, msg.tid = _KIND_TO_PB[rec.event], rec.source, rec.ts_ns, rec.tid
    msg.device, msg.device_kind, msg.fd = rec.device or "", rec.device_kind or "", opt_to_pb(rec.fd, -1)
    msg.cgroup_id, msg.child_pid, msg.mapped = rec.cgroup_id or 0, rec.child_pid, rec.mapped
    msg.gpu, msg.gpu_uuid = opt_to_pb(rec.gpu, -1), rec.gpu_uuid
    msg.devices.extend(rec.devices)
    if rec.ioctls is not None:
        msg.ioctls_counted = True  # counted, even when the list is empty
        for i in rec.ioctls:
            msg.ioctls.add(device=i.device, cmd=i.cmd, name=i.name, count=i.count)
    if rec.held_s is not None:
        msg.held_ns = round(rec.held_s * 1e9)


# --- node info and allocations ------------------------------------------------------------------

def gpu_to_proto(g: GpuInfo) -> stream_pb2.Gpu:
    msg = stream_pb2.Gpu(index=g.index, uuid=g.uuid, name=g.name, minor=opt_to_pb(g.minor, -1),
                         memory_total_bytes=g.memory_total_bytes or 0, pci_bus_id=g.pci_bus_id)
    for name in _GPU_MEMORY_FIELDS:
        value = getattr(g, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


def gpu_from_proto(m: stream_pb2.Gpu) -> GpuInfo:
    memory = {name: getattr(m, name) if m.HasField(name) else None for name in _GPU_MEMORY_FIELDS}
    return GpuInfo(index=m.index, uuid=m.uuid, name=m.name, minor=opt_from_pb(m.minor, -1),
                   memory_total_bytes=m.memory_total_bytes or None, pci_bus_id=m.pci_bus_id, **memory)


_GPU_MEMORY_FIELDS = (
    "memory_used_bytes", "memory_listed_bytes", "memory_unlisted_bytes", "unaccounted_bytes")


def info_to_proto(rec: InfoRecord) -> stream_pb2.NodeInfo:
    return stream_pb2.NodeInfo(bpf=rec.bpf, nvml=rec.nvml, nvml_error=rec.nvml_error,
                               driver_version=rec.driver_version, gpus=[gpu_to_proto(g) for g in rec.gpus])


# --- faults ----------------------------------------------------------------------------------------

def fault_to_proto(rec: FaultRecord) -> stream_pb2.Fault:
    msg = stream_pb2.Fault(
        ts_ns=rec.ts_ns, gpu=opt_to_pb(rec.gpu, -1), gpu_uuid=rec.gpu_uuid, pci_bus_id=rec.pci_bus_id,
        xid=opt_to_pb(rec.xid, -1), severity=rec.severity, meaning=rec.meaning, message=rec.message,
        pid=rec.pid or 0, process_name=rec.process_name, raw=rec.raw, kmsg_seq=rec.kmsg_seq,
        origin=rec.origin)
    for a in rec.affected:
        hit = msg.affected.add(named=a.named, exited=a.exited, gpu=opt_to_pb(a.gpu, -1))
        _process_into(hit.process, a.pid, a.process or _NO_IDENTITY)
    return msg


def fault_from_proto(m: stream_pb2.Fault, node: str, ts: float) -> FaultRecord:
    return FaultRecord(
        ts=ts, node=node, ts_ns=m.ts_ns, xid=opt_from_pb(m.xid, -1), gpu=opt_from_pb(m.gpu, -1),
        gpu_uuid=m.gpu_uuid, pci_bus_id=m.pci_bus_id, severity=m.severity, meaning=m.meaning,
        message=m.message, pid=m.pid or None, process_name=m.process_name, raw=m.raw, kmsg_seq=m.kmsg_seq,
        affected=tuple(_fault_consumer_from_proto(a) for a in m.affected), origin=m.origin or "kernel")


def _fault_consumer_from_proto(a: stream_pb2.FaultConsumer) -> FaultConsumer:
    return FaultConsumer(pid=a.process.pid, named=a.named, exited=a.exited, gpu=opt_from_pb(a.gpu, -1),
                         process=process_identity_from_proto(a.process))


def process_identity_from_proto(p: node_pb2.Process) -> ProcessIdentity:
    return ProcessIdentity(ns_pid=opt_from_pb(p.ns_pid, 0), comm=p.comm, exe=p.exe, cmdline=p.cmdline,
                           uid=opt_from_pb(p.uid, -1), ppid=opt_from_pb(p.ppid, 0), state=p.state,
                           container_id=p.container_id, pod_uid=p.pod_uid, runtime=p.runtime,
                           cgroup_path=p.cgroup_path, alive=p.alive)


def allocations_to_proto(rec: AllocationsRecord) -> stream_pb2.Allocations:
    """The read time is the record's ts."""
    return stream_pb2.Allocations(
        available=rec.available, error=rec.error, read_unix_ns=ts_to_ns(rec.ts),
        containers=[stream_pb2.ContainerAllocation(namespace=c.namespace, pod=c.pod, container=c.container,
                                                   resource_names=c.resource_names, device_ids=c.device_ids)
                    for c in rec.containers])


# --- records -> NodeEvent -----------------------------------------------------------------------

def _holder_body(ev: stream_pb2.NodeEvent, rec: HolderRecord) -> None:
    holder_into(ev.holder, rec)


def _consumer_body(ev: stream_pb2.NodeEvent, rec: ConsumerRecord) -> None:
    consumer_into(getattr(ev, rec.event), rec.consumer)  # finding | resolved


def _notice_body(ev: stream_pb2.NodeEvent, rec: NoticeRecord) -> None:
    ev.notice.what, ev.notice.message = rec.what, rec.message


def _info_body(ev: stream_pb2.NodeEvent, rec: InfoRecord) -> None:
    ev.info.CopyFrom(info_to_proto(rec))  # rare: once at start and when the GPUs change


def _allocations_body(ev: stream_pb2.NodeEvent, rec: AllocationsRecord) -> None:
    ev.allocations.CopyFrom(allocations_to_proto(rec))


def _fault_body(ev: stream_pb2.NodeEvent, rec: FaultRecord) -> None:
    ev.fault.CopyFrom(fault_to_proto(rec))


_BODY: dict[type, Callable[[stream_pb2.NodeEvent, Any], None]] = {
    HolderRecord: _holder_body, ConsumerRecord: _consumer_body, NoticeRecord: _notice_body,
    InfoRecord: _info_body, AllocationsRecord: _allocations_body, FaultRecord: _fault_body,
}


def record_to_event(rec: Record, seq: int) -> stream_pb2.NodeEvent | None:
    """The NodeEvent for a record, None for a kind that is not streamed (`ready`).

    Raises ValueError, TypeError or AttributeError for a value the proto cannot hold; the stream
    turns that into a notice, so the sequence keeps no hole.
    """
    body = _BODY.get(type(rec))
    if body is None:
        return None
    ev = stream_pb2.NodeEvent(seq=seq, ts_unix_ns=ts_to_ns(rec.ts))
    body(ev, rec)
    return ev


def snapshot_to_proto(seq: int, consumers: Iterable[Consumer], info: InfoRecord | None,
                      allocations: AllocationsRecord | None,
                      stats: stream_pb2.TracerStats | None = None) -> stream_pb2.Snapshot:
    """A Snapshot from the tracer's consumer table, latest `info` and `allocations` (None: not known yet)."""
    snap = stream_pb2.Snapshot(seq=seq, ts_unix_ns=time.time_ns(), stats=stats)
    for c in consumers:
        try:
            snap.consumers.append(consumer_to_proto(c))
        except (TypeError, ValueError) as exc:  # a value out of the proto's range must not cost the snapshot
            log.warning("snapshot: skipping consumer pid %s (%s)", c.pid, exc)
    if info is not None:
        snap.info.CopyFrom(info_to_proto(info))
    if allocations is not None:
        snap.allocations.CopyFrom(allocations_to_proto(allocations))
    return snap


# --- the query API's ClusterConsumer -------------------------------------------------------------

_ALLOCATED_TO_PB = {None: query_pb2.ALLOCATED_UNKNOWN, True: query_pb2.ALLOCATED_TRUE,
                    False: query_pb2.ALLOCATED_FALSE}
_PB_TO_ALLOCATED = {v: k for k, v in _ALLOCATED_TO_PB.items()}


def k8s_to_proto(k: K8sInfo) -> query_pb2.K8sIdentity:
    return query_pb2.K8sIdentity(
        namespace=k.namespace, pod=k.pod, pod_uid=k.pod_uid, container=k.container, image=k.image,
        container_state=k.container_state, sandbox_state=k.sandbox_state, resolution=k.resolution,
        error=k.error, runtime=k.runtime,
    )


def k8s_from_proto(m: query_pb2.K8sIdentity) -> K8sInfo:
    return K8sInfo(
        resolution=m.resolution or "none", namespace=m.namespace, pod=m.pod, pod_uid=m.pod_uid,
        container=m.container, image=m.image, container_state=m.container_state,
        sandbox_state=m.sandbox_state, error=m.error, runtime=m.runtime,
    )


def cluster_consumer_to_proto(c: ClusterConsumer) -> query_pb2.ClusterConsumer:
    return query_pb2.ClusterConsumer(
        consumer=consumer_to_proto(c.consumer), k8s=k8s_to_proto(c.k8s),
        allocated=_ALLOCATED_TO_PB[c.allocated], node_class=class_to_proto(c.node_class or c.consumer.cls),
        since_unix_ns=c.since_unix_ns, updated_unix_ns=c.updated_unix_ns,
    )


def cluster_consumer_from_proto(m: query_pb2.ClusterConsumer) -> ClusterConsumer:
    return ClusterConsumer(
        consumer=consumer_from_proto(m.consumer), k8s=k8s_from_proto(m.k8s),
        allocated=_PB_TO_ALLOCATED.get(m.allocated),
        node_class=class_from_proto(m.node_class) if m.node_class else None,
        since_unix_ns=m.since_unix_ns, updated_unix_ns=m.updated_unix_ns,
    )


def remediation_to_proto(r: RemediationState) -> query_pb2.Remediation:
    return query_pb2.Remediation(state=r.state, action=r.action, at_unix_ns=r.at_unix_ns, reason=r.reason,
                                 mode=r.mode, incident=r.incident, audit_seq=r.audit_seq)


def remediation_from_proto(m: query_pb2.Remediation) -> RemediationState | None:
    """None for an unset field: no remediation considered the finding."""
    if not m.state:
        return None
    return RemediationState(state=m.state, action=m.action, at_unix_ns=m.at_unix_ns, reason=m.reason,
                            mode=m.mode, incident=m.incident, audit_seq=m.audit_seq)
