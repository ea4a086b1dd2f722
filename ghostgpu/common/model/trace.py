"""Trace sessions in the common model: what a session covers, its state, and one traced call.

A TraceRecord is made once on the node (kernel record -> decoded call -> this), travels as
ghostgpu.v1.TraceRecord (ghostgpu.common.wire.convert) and becomes JSON only at the edges (to_json,
the keys `ghostgpu trace -o jsonl` prints). Numbers the decoding tables do not know stay numbers;
their names are then "".
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from operator import attrgetter

from ghostgpu.common.model.jsonform import JsonForm, json_meta

TRACE_KINDS = ("ioctl", "open", "close", "mmap", "munmap", "fork", "exec", "exit")
INSTANT_KINDS = frozenset(TRACE_KINDS) - {"ioctl"}  # shown as instants, not slices

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
class TraceScope(JsonForm):
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



@dataclass(frozen=True)
class TraceSession(JsonForm):
    id: str
    scope: TraceScope
    requested_by: str
    started_unix_ns: int
    deadline_unix_ns: int
    ended_unix_ns: int = field(default=0, metadata=json_meta(null=0))  # 0: still running (JSON null)
    status: TraceStatus = TraceStatus.RUNNING
    status_detail: str = ""
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


@dataclass(frozen=True, kw_only=True)
class TraceRecord(JsonForm):
    """One traced call (kind "ioctl": a slice with a duration) or process event (an instant).

    The fields are in the order `ghostgpu trace -o jsonl` writes them: the contract's keys (never
    renamed) up to duration_ns, then the extras."""

    session: str
    node: str
    ts_ns: int  # unix ns at syscall entry
    pid: int
    tid: int
    ns_pid: int | None = None
    container_id: str = ""
    namespace: str = ""
    pod: str = ""
    container: str = ""
    gpu: str = ""
    device: str = ""
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
    # extras
    seq: int
    kind: str
    comm: str = ""
    fd: int | None = field(default=None, metadata=json_meta(then={"errno": attrgetter("errno")}))
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
