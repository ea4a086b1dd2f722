"""`ghostgpu trace --chrome-trace FILE`: trace records as Chrome Trace Event JSON.

A pure function of the records (and the session), in the format's object form
{"traceEvents": [...], "displayTimeUnit": "ns", "otherData": {...}} that Perfetto
(ui.perfetto.dev), chrome://tracing and speedscope open:

- one process per traced process: pid is the host pid, named by a "process_name" metadata event
  ("namespace/pod/container (pid N)", or "node/comm (pid N)" outside a container);
- one thread per tid, named "tid N" by a "thread_name" metadata event;
- one complete event (ph "X") per ioctl: name is the call plus its command or class
  (TraceRecord.summary_key), cat "ioctl", args the decoded fields;
- one thread-scoped instant (ph "i", s "t") per open, close, mmap, munmap, fork, exec and exit.

Times are microseconds (floats, so nanoseconds survive) since `ts_base_unix_ns` in otherData, the
session's start (or the first record's time, when earlier): absolute unix microseconds would not
keep nanoseconds in a double. Two nodes can have processes with the same host pid; the second
node's then get pid + k * 2^22 (above Linux's largest pid), their names still say the real pid.
Events are sorted by ts (metadata first, at ts 0).
"""

from __future__ import annotations

import errno
from collections.abc import Iterable
from typing import Any

from ghostgpu import __version__
from ghostgpu.common.model.display import short_id
from ghostgpu.common.model.trace import INSTANT_KINDS, TraceRecord, TraceSession

PID_SPACE = 1 << 22  # PID_MAX_LIMIT on 64-bit Linux: host pids are below it


def process_name(r: TraceRecord) -> str:
    """ "namespace/pod/container (pid N)"; outside a named pod "node/comm (pid N)" (with the
    container's short id when the collector could not name it)."""
    if r.pod:
        who = "/".join(p for p in (r.namespace, r.pod, r.container) if p)
    else:
        parts = [r.node or "?", short_id(r.container_id) if r.container_id else "", r.comm or "?"]
        who = "/".join(p for p in parts if p)
    return f"{who} (pid {r.pid})"


def event_name(r: TraceRecord) -> str:
    """The call plus its command or class name (or number): RM_CONTROL NV2080_CTRL_CMD_GPU_GET_INFO."""
    return r.summary_key


def errno_name(ret: int) -> str:
    """ENOTTY for -25; "" for a return that is no error."""
    return errno.errorcode.get(-ret, f"errno {-ret}") if ret < 0 else ""


def event_args(r: TraceRecord) -> dict[str, Any]:
    """The decoded fields a viewer shows for one event."""
    out: dict[str, Any] = {}
    if r.kind == "ioctl":
        out["request"] = hex(r.request or 0)
        if r.escape:
            out["escape"] = r.escape
        if r.cmd is not None:
            out["cmd"] = hex(r.cmd)
        if r.h_class is not None:
            out["h_class"] = hex(r.h_class)
        if r.nv_status is not None:
            out["nv_status"] = hex(r.nv_status)
            out["nv_status_name"] = r.nv_status_name or hex(r.nv_status)
    out["ret"] = r.ret
    if r.ret < 0:
        out["errno"] = errno_name(r.ret)
    for key, value in (("device", r.device), ("gpu", r.gpu), ("fd", r.fd), ("child_pid", r.child_pid)):
        if value not in (None, ""):
            out[key] = value
    out.update(r.args)
    if r.notes:
        out["notes"] = "; ".join(r.notes)
    return out


class _Ids:
    """(node, host pid) -> the trace's pid: the host pid, moved up by PID_SPACE on a collision."""

    def __init__(self) -> None:
        self.pids: dict[tuple[str, int], int] = {}

    def offset(self, node: str, pid: int) -> int:
        key = (node, pid)
        if key not in self.pids:
            taken = set(self.pids.values())
            k = 0
            while pid + k * PID_SPACE in taken:
                k += 1
            self.pids[key] = pid + k * PID_SPACE
        return self.pids[key] - pid


def chrome_trace(records: Iterable[TraceRecord], session: TraceSession | None = None) -> dict[str, Any]:
    """The whole Chrome Trace Event document for these records (any order)."""
    recs = sorted(records, key=lambda r: (r.ts_ns, r.node, r.seq))
    starts = [r.ts_ns for r in recs[:1]] + ([session.started_unix_ns] if session else [])
    base_ns = min(starts) if starts else 0
    ids = _Ids()
    names: dict[int, str] = {}  # trace pid -> process name
    named: set[int] = set()  # pids named by a record the collector gave pod names (they win)
    threads: dict[tuple[int, int], str] = {}
    events: list[dict[str, Any]] = []
    for r in recs:
        off = ids.offset(r.node, r.pid)
        pid, tid = r.pid + off, r.tid + off
        if pid not in named and (r.pod or pid not in names):
            names[pid] = process_name(r)
            if r.pod:
                named.add(pid)
        threads.setdefault((pid, tid), f"tid {r.tid}")
        ts_us = (r.ts_ns - base_ns) / 1e3
        ev: dict[str, Any] = {"name": event_name(r), "cat": r.kind, "ts": ts_us, "pid": pid, "tid": tid,
                              "args": event_args(r)}
        if r.kind in INSTANT_KINDS:
            ev.update(ph="i", s="t")
        else:
            ev.update(ph="X", dur=r.duration_ns / 1e3)
        events.append(ev)
    meta: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "ts": 0.0, "pid": pid, "tid": 0, "args": {"name": name}}
        for pid, name in sorted(names.items())]
    meta += [{"name": "thread_name", "ph": "M", "ts": 0.0, "pid": pid, "tid": tid, "args": {"name": name}}
             for (pid, tid), name in sorted(threads.items())]
    other: dict[str, str] = {"generator": f"ghostgpu {__version__}", "ts_base_unix_ns": str(base_ns)}
    if session is not None:
        other.update(session=session.id, scope=session.scope.describe(), status=str(session.status),
                     requested_by=session.requested_by, nodes=",".join(session.nodes))
    return {"traceEvents": meta + events, "displayTimeUnit": "ns", "otherData": other}
