"""The proto -> model direction that only the tests need: a NodeEvent read back into the tracer's record.

The collector never rebuilds a tracer's record (it reads consumers and allocations straight out of
the event, ghostgpu.common.wire.convert), so these inverses of convert.record_to_event live here,
where the round-trip tests (every record survives the wire) and the fault tests use them. Also
record_to_proto, a trace record in a fresh message, for the tests' fake collectors.
"""

from __future__ import annotations

from ghostgpu.common.model.records import (
    AllocationsRecord,
    ConsumerRecord,
    ContainerAllocation,
    HolderRecord,
    InfoRecord,
    IoctlCount,
    NoticeRecord,
    ProcessIdentity,
    Record,
)
from ghostgpu.common.model.trace import TraceRecord
from ghostgpu.common.wire.convert import (
    consumer_from_proto,
    fault_from_proto,
    gpu_from_proto,
    holder_kind,
    opt_from_pb,
)
from ghostgpu.common.wire.convert_trace import record_into
from ghostgpu.v1 import node_pb2, stream_pb2, trace_pb2


def ns_to_ts(ns: int) -> float:
    # Rounding to µs gives back exactly the float the tracer wrote (tracer/records.wall_ts rounds the same).
    return round(ns / 1e9, 6)


def holder_from_proto(msg: node_pb2.HolderEvent, ts: float, node: str) -> HolderRecord:
    p = msg.process
    who = ProcessIdentity(
        ns_pid=opt_from_pb(p.ns_pid, 0), comm=p.comm, exe=p.exe, cmdline=p.cmdline,
        uid=opt_from_pb(p.uid, -1), ppid=opt_from_pb(p.ppid, 0), state=p.state,
        container_id=p.container_id, pod_uid=p.pod_uid, runtime=p.runtime, cgroup_path=p.cgroup_path,
        alive=p.alive,
    )
    return HolderRecord(
        event=holder_kind(msg.kind), ts=ts, ts_ns=msg.ts_ns, source=msg.source, node=node, pid=p.pid,
        tid=msg.tid, gpu=opt_from_pb(msg.gpu, -1), gpu_uuid=msg.gpu_uuid, device=msg.device or None,
        device_kind=msg.device_kind or None, fd=opt_from_pb(msg.fd, -1), devices=tuple(msg.devices),
        cgroup_id=msg.cgroup_id or None, child_pid=msg.child_pid, mapped=msg.mapped, process=who,
        ioctls=tuple(IoctlCount(i.device, i.cmd, i.name, i.count) for i in msg.ioctls)
        if msg.ioctls_counted else None,
        held_s=round(msg.held_ns / 1e9, 6) if msg.HasField("held_ns") else None,
    )


def info_from_proto(msg: stream_pb2.NodeInfo, ts: float, node: str) -> InfoRecord:
    gpus = tuple(gpu_from_proto(g) for g in msg.gpus)
    return InfoRecord(ts, node, msg.bpf, msg.nvml, msg.nvml_error, msg.driver_version, gpus)


def allocations_from_proto(msg: stream_pb2.Allocations, ts: float, node: str) -> AllocationsRecord:
    return AllocationsRecord(ts, node, msg.available, msg.error, tuple(
        ContainerAllocation(c.namespace, c.pod, c.container, tuple(c.resource_names), tuple(c.device_ids))
        for c in msg.containers))


def event_to_record(ev: stream_pb2.NodeEvent, node: str = "") -> Record:
    """The tracer's record for a NodeEvent (its to_json(): the keys `ghostgpu tracer --jsonl` writes).
    `node` is not on a NodeEvent (the stream's Hello names the node once), so the caller passes it."""
    body = ev.WhichOneof("body")
    if body is None:
        raise ValueError(f"event seq {ev.seq} has no body")
    ts = ns_to_ts(ev.ts_unix_ns)
    if body in ("finding", "resolved"):
        return ConsumerRecord(body, ts, consumer_from_proto(getattr(ev, body)))
    if body == "holder":
        return holder_from_proto(ev.holder, ts, node)
    if body == "notice":
        return NoticeRecord(ts, node, ev.notice.what, ev.notice.message)
    if body == "info":
        return info_from_proto(ev.info, ts, node)
    if body == "fault":
        return fault_from_proto(ev.fault, node, ts)
    return allocations_from_proto(ev.allocations, ts, node)


def record_to_proto(r: TraceRecord) -> trace_pb2.TraceRecord:
    m = trace_pb2.TraceRecord()
    record_into(m, r)
    return m
