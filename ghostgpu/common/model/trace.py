"""Trace sessions in the common model: what a session covers, its state, and one traced call.

A TraceRecord is made once on the node (kernel record -> decoded call -> this), travels as
ghostgpu.v1.TraceRecord (ghostgpu.common.wire.convert) and becomes JSON only at the edges (to_json,
the keys `ghostgpu trace -o jsonl` prints). Numbers the decoding tables do not know stay numbers;
their names are then "".
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any

TRACE_KINDS = ("ioctl", "open", "close", "mmap", "munmap", "fork", "exec", "exit")
INSTANT_KINDS = frozenset(TRACE_KINDS) - {"ioctl"}  # shown as instants, not slices
# A session's default limits, the same on both sides: the longest one a tracer runs (tracer/config.py)
# and a collector lets a client start, and the records kept per session (collector/config.py).
TRACE_MAX_DURATION_S = 600.0
TRACE_MAX_RECORDS = 100_000

# Two kinds of decoder note (tracer/call_decode.py writes them; tests/unit/test_trace_view.py holds
# these to the decoder's own output) that the views say once rather than on every call.
STATUS_NOT_WRITTEN = "status not written by the driver"  # "... (ret -25)": nv_status is the block's own
DRIVER_LAYOUT_NOTE = " decoded with the "  # "driver 999.1 not covered: decoded with the 595.45.04 layout"


def is_driver_note(note: str) -> bool:
    """A note about the node's driver rather than one call: its version is not in the layout tables
    (on every call), or a block changed between the releases around it (on every call of that block)."""
    return DRIVER_LAYOUT_NOTE in note and note.endswith(" layout")


class TraceStatus(enum.StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"  # reached its deadline
    STOPPED = "stopped"  # a user stopped it
    NODE_LOST = "node lost"  # a node's tracer went away mid-session; its records so far are kept
    FAILED = "failed"  # no tracer could run it

    @property
    def ended(self) -> bool:
        return self is not TraceStatus.RUNNING


@dataclass(frozen=True)
class TraceScope:
    namespace: str = ""
    pod: str = ""
    container: str = ""  # a container name in the pod, or a container id (prefix)
    node: str = ""
    pid: int = 0  # host PID on `node`, and every process it forks from then on
    gpu: str = ""  # GPU index or UUID

    def describe(self) -> str:
        """One line for tables and messages: ns/pod/container, or node pid N."""
        parts = []
        if self.namespace or self.pod or self.container:
            parts.append("/".join(p for p in (self.namespace, self.pod, self.container) if p))
        if self.pid:
            parts.append(f"pid {self.pid}")
        if self.node:
            parts.append(f"on {self.node}")
        if self.gpu:
            parts.append(f"gpu {self.gpu}")
        return " ".join(parts) or "(everything)"

    def to_json(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "pod": self.pod, "container": self.container, "node": self.node,
                "pid": self.pid, "gpu": self.gpu}


@dataclass(frozen=True)
class TraceSession:
    id: str
    scope: TraceScope
    requested_by: str
    started_unix_ns: int
    deadline_unix_ns: int
    status: TraceStatus = TraceStatus.RUNNING
    status_detail: str = ""
    ended_unix_ns: int = 0
    nodes: tuple[str, ...] = ()
    container_ids: tuple[str, ...] = ()
    records_total: int = 0
    dropped_limit_total: int = 0
    dropped_ringbuf_total: int = 0
    dropped_store_total: int = 0
    max_records: int = 0
    dropped_transport_total: int = 0

    def ended(self, status: TraceStatus, detail: str, at_unix_ns: int) -> TraceSession:
        return replace(self, status=status, status_detail=detail, ended_unix_ns=at_unix_ns)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "scope": self.scope.to_json(), "requested_by": self.requested_by,
            "started_unix_ns": self.started_unix_ns, "deadline_unix_ns": self.deadline_unix_ns,
            "ended_unix_ns": self.ended_unix_ns or None, "status": str(self.status),
            "status_detail": self.status_detail, "nodes": list(self.nodes),
            "container_ids": list(self.container_ids), "records_total": self.records_total,
            "dropped_limit_total": self.dropped_limit_total,
            "dropped_ringbuf_total": self.dropped_ringbuf_total,
            "dropped_store_total": self.dropped_store_total, "max_records": self.max_records,
            "dropped_transport_total": self.dropped_transport_total,
        }


@dataclass(frozen=True)
class TraceRecord:
    """One traced call (kind "ioctl": a slice with a duration) or process event (an instant)."""

    session: str
    node: str
    seq: int
    ts_ns: int  # unix ns at syscall entry
    kind: str
    pid: int
    tid: int
    ns_pid: int | None = None
    container_id: str = ""
    namespace: str = ""
    pod: str = ""
    container: str = ""
    comm: str = ""
    gpu: str = ""
    device: str = ""
    fd: int | None = None
    call: str = ""
    request: int | None = None
    escape: str = ""
    cmd: int | None = None
    cmd_name: str = ""
    h_class: int | None = None
    class_name: str = ""
    nv_status: int | None = None
    nv_status_name: str = ""
    ret: int = 0
    duration_ns: int = 0
    child_pid: int | None = None
    args: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def errno(self) -> int | None:
        return -self.ret if self.ret < 0 else None

    @property
    def status_unwritten(self) -> bool:
        """The call failed before the driver wrote its status: nv_status is then what the block held
        (its initial zero reads as NV_OK), not an answer. The record keeps the number and the note."""
        return self.nv_status is not None and any(n.startswith(STATUS_NOT_WRITTEN) for n in self.notes)

    @property
    def summary_key(self) -> str:
        """What `--summary` groups by: the call plus its command or class name (or number)."""
        if self.cmd is not None:
            return f"{self.call} {self.cmd_name or hex(self.cmd)}"
        if self.h_class is not None:
            return f"{self.call} {self.class_name or hex(self.h_class)}"
        return self.call or self.kind

    def to_json(self) -> dict[str, Any]:
        """The JSON-lines keys of `ghostgpu trace -o jsonl`: the contract's (never renamed), then extras."""
        return {
            "session": self.session, "node": self.node, "ts_ns": self.ts_ns, "pid": self.pid, "tid": self.tid,
            "ns_pid": self.ns_pid, "container_id": self.container_id, "namespace": self.namespace,
            "pod": self.pod, "container": self.container, "gpu": self.gpu, "device": self.device,
            "call": self.call, "request": self.request, "escape": self.escape, "cmd": self.cmd,
            "cmd_name": self.cmd_name, "h_class": self.h_class, "class_name": self.class_name,
            "nv_status": self.nv_status, "nv_status_name": self.nv_status_name, "ret": self.ret,
            "duration_ns": self.duration_ns,
            # extras
            "seq": self.seq, "kind": self.kind, "comm": self.comm, "fd": self.fd, "errno": self.errno,
            "child_pid": self.child_pid, "args": dict(self.args), "notes": list(self.notes),
        }
