"""The one mapping between trace sessions in the common model (ghostgpu.common.model.trace) and the API
(ghostgpu.v1 trace.proto), both ways. The rest of the model maps in ghostgpu.common.wire.convert.

Proto3 scalars have no "unset": ns_pid 0, fd -1 and child_pid 0 stand for None; cmd, h_class
and nv_status are explicit `optional`s (0 is a real class, NV01_ROOT, and a real status, NV_OK).
"""

from __future__ import annotations

from ghostgpu.common.model.trace import TraceRecord, TraceScope, TraceSession, TraceStatus
from ghostgpu.common.wire.convert import opt_from_pb, opt_to_pb
from ghostgpu.v1 import trace_pb2

# The enum's constants by name (typed as the enum; EnumTypeWrapper.Value() is typed int).
_STATUS_TO_PB: dict[TraceStatus, trace_pb2.TraceStatus] = {
    s: getattr(trace_pb2, f"TRACE_STATUS_{s.name}") for s in TraceStatus}
_PB_TO_STATUS: dict[int, TraceStatus] = {v: k for k, v in _STATUS_TO_PB.items()}


def scope_to_proto(s: TraceScope) -> trace_pb2.TraceScope:
    return trace_pb2.TraceScope(namespace=s.namespace, pod=s.pod, container=s.container, node=s.node,
                                pid=s.pid, gpu=s.gpu)


def scope_from_proto(m: trace_pb2.TraceScope) -> TraceScope:
    return TraceScope(namespace=m.namespace, pod=m.pod, container=m.container, node=m.node, pid=m.pid,
                      gpu=m.gpu)


def status_to_proto(s: TraceStatus) -> trace_pb2.TraceStatus:
    return _STATUS_TO_PB[s]


def status_from_proto(value: int) -> TraceStatus:
    return _PB_TO_STATUS.get(value, TraceStatus.FAILED)


def session_to_proto(s: TraceSession) -> trace_pb2.TraceSession:
    return trace_pb2.TraceSession(
        id=s.id, scope=scope_to_proto(s.scope), requested_by=s.requested_by,
        started_unix_ns=s.started_unix_ns, deadline_unix_ns=s.deadline_unix_ns, ended_unix_ns=s.ended_unix_ns,
        status=status_to_proto(s.status), status_detail=s.status_detail, nodes=list(s.nodes),
        container_ids=list(s.container_ids), records_total=s.records_total,
        dropped_limit_total=s.dropped_limit_total, dropped_ringbuf_total=s.dropped_ringbuf_total,
        dropped_store_total=s.dropped_store_total, max_records=s.max_records,
        dropped_transport_total=s.dropped_transport_total,
    )


def session_from_proto(m: trace_pb2.TraceSession) -> TraceSession:
    return TraceSession(
        id=m.id, scope=scope_from_proto(m.scope), requested_by=m.requested_by,
        started_unix_ns=m.started_unix_ns, deadline_unix_ns=m.deadline_unix_ns,
        status=status_from_proto(m.status), status_detail=m.status_detail, ended_unix_ns=m.ended_unix_ns,
        nodes=tuple(m.nodes), container_ids=tuple(m.container_ids), records_total=m.records_total,
        dropped_limit_total=m.dropped_limit_total, dropped_ringbuf_total=m.dropped_ringbuf_total,
        dropped_store_total=m.dropped_store_total, max_records=m.max_records,
        dropped_transport_total=m.dropped_transport_total,
    )


def record_into(m: trace_pb2.TraceRecord, r: TraceRecord) -> None:
    """Fill `m` (a fresh message, or one inside a batch) from r; the session id travels on the batch."""
    m.seq, m.node, m.ts_unix_ns, m.kind = r.seq, r.node, r.ts_ns, r.kind
    m.pid, m.tid, m.ns_pid = r.pid, r.tid, opt_to_pb(r.ns_pid, 0)
    m.container_id, m.namespace, m.pod = r.container_id, r.namespace, r.pod
    m.container, m.comm = r.container, r.comm
    m.gpu, m.device, m.fd, m.call = r.gpu, r.device, opt_to_pb(r.fd, -1), r.call
    m.request, m.escape, m.cmd_name, m.class_name = r.request or 0, r.escape, r.cmd_name, r.class_name
    if r.cmd is not None:
        m.cmd = r.cmd
    if r.h_class is not None:
        m.h_class = r.h_class
    if r.nv_status is not None:
        m.nv_status = r.nv_status
    m.nv_status_name, m.ret, m.duration_ns = r.nv_status_name, r.ret, r.duration_ns
    m.child_pid = opt_to_pb(r.child_pid, 0)
    m.args.update(r.args)
    m.notes.extend(r.notes)


def record_from_proto(m: trace_pb2.TraceRecord, session: str) -> TraceRecord:
    return TraceRecord(
        session=session, node=m.node, seq=m.seq, ts_ns=m.ts_unix_ns, kind=m.kind, pid=m.pid, tid=m.tid,
        ns_pid=opt_from_pb(m.ns_pid, 0), container_id=m.container_id, namespace=m.namespace, pod=m.pod,
        container=m.container, comm=m.comm, gpu=m.gpu, device=m.device, fd=opt_from_pb(m.fd, -1),
        call=m.call, request=m.request if m.kind == "ioctl" else None, escape=m.escape,
        cmd=m.cmd if m.HasField("cmd") else None, cmd_name=m.cmd_name,
        h_class=m.h_class if m.HasField("h_class") else None, class_name=m.class_name,
        nv_status=m.nv_status if m.HasField("nv_status") else None, nv_status_name=m.nv_status_name,
        ret=m.ret, duration_ns=m.duration_ns, child_pid=opt_from_pb(m.child_pid, 0), args=dict(m.args),
        notes=tuple(m.notes),
    )
