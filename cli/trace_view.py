"""What `ghostgpu trace` prints: the live table, the summary table, JSON lines, the session list.

Pure functions of TraceRecord and TraceSession (ghostgpu.common.model.trace), so every output is tested
without a collector. The live table is strace in spirit, one line per call as it arrives:

    # gpu-1: driver 999.99.99-fake not covered: decoded with the 595.45.04 layout
    TIME             NODE   NAMESPACE/POD/CONTAINER  PID/TID    CALL        STATUS    DUR(µs)  ARGS
    14:03:07.123456  gpu-1  ml/trainer-0/main        4242/4243  RM_CONTROL  NV_OK     12.5     NV2080_...
    # STATUS -: ...
    14:03:07.123460  gpu-1  ml/trainer-0/main        4242/4243  RM_FREE     - ENOTTY  0.8      ...

ARGS is last so that a long one never pushes the columns after it. A fact of the session rather
than of one call (a node's driver the layout tables do not cover, what "-" in STATUS means) is a
`# ` line, printed once, above the first rows it applies to; the rows do not repeat it. Each
record's `notes` stay whole in the JSON outputs. The summary is `strace -c`: per
TraceRecord.summary_key the calls, errors (ret < 0, or an NV_STATUS other than NV_OK), total,
average and p99 time and the share of all time, sorted by total time, then a total line.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ghostgpu.cli import view
from ghostgpu.cli.chrome_trace import errno_name

from ghostgpu.common.model.display import LISTING_ID_LEN, short_id
from ghostgpu.common.model.trace import STATUS_NOT_WRITTEN, TraceRecord, TraceSession, is_driver_note

NV_OK = 0
LIVE_HEADER = ("TIME", "NODE", "NAMESPACE/POD/CONTAINER", "PID/TID", "CALL", "STATUS", "DUR(µs)", "ARGS")
# Starting widths, so that the columns of the first records rarely move when longer ones come.
LIVE_MIN_WIDTHS = (15, 8, 24, 11, 16, 8, 8, 0)


def clock(ts_ns: int) -> str:
    """HH:MM:SS.ffffff, local time, like `strace -tt`."""
    return time.strftime("%H:%M:%S", time.localtime(ts_ns // 1_000_000_000)) + f".{ts_ns % 10**9 // 1000:06d}"


def who(r: TraceRecord) -> str:
    """namespace/pod/container as the collector named it, else the container id's prefix, else "host"."""
    if r.pod:
        return "/".join(p for p in (r.namespace, r.pod, r.container) if p)
    return short_id(r.container_id, LISTING_ID_LEN) if r.container_id else "host"


def is_error(r: TraceRecord) -> bool:
    return r.ret < 0 or (r.nv_status is not None and r.nv_status != NV_OK)


UNWRITTEN_FACT = f"STATUS -: {STATUS_NOT_WRITTEN} (the call failed before it; the errno follows)"


def status(r: TraceRecord) -> str:
    """The NV_STATUS name (or its number in hex; "-" for one the driver did not write) and, for a
    failed syscall, the errno name."""
    parts = []
    if r.status_unwritten:
        parts.append("-")
    elif r.nv_status is not None:
        parts.append(r.nv_status_name or hex(r.nv_status))
    if r.ret < 0:
        parts.append(errno_name(r.ret))
    return " ".join(parts) or "-"


def driver_facts(r: TraceRecord) -> list[str]:
    """Its node's driver notes (the layout tables do not cover the driver, a block changed around
    it), named by the node: facts of the session, not of this call."""
    return [f"{r.node}: {n}" if r.node else n for n in r.notes if is_driver_note(n)]


def facts(r: TraceRecord) -> list[str]:
    """What a record says about its session rather than itself: its driver facts and, for a status
    the driver did not write, what the STATUS column's "-" means."""
    return driver_facts(r) + ([UNWRITTEN_FACT] if r.status_unwritten else [])


def row_notes(r: TraceRecord) -> list[str]:
    """The notes about this call alone: those `facts` does not say once for the session."""
    return [n for n in r.notes
            if not is_driver_note(n) and not (r.status_unwritten and n.startswith(STATUS_NOT_WRITTEN))]


def micros(ns: float) -> str:
    return f"{ns / 1e3:.1f}"


def args_text(r: TraceRecord) -> str:
    """The decoded arguments: command or class name first, then the decoder's fields in its order."""
    parts: list[str] = []
    if r.cmd is not None:
        parts.append(r.cmd_name or hex(r.cmd))
    elif r.h_class is not None:
        parts.append(r.class_name or hex(r.h_class))
    if r.kind != "ioctl" and r.device and "path" not in r.args:
        parts.append(r.device)
    if r.fd is not None and r.kind in ("open", "close") and "fd" not in r.args:
        parts.append(f"fd={r.fd}")
    if r.child_pid is not None and "child_pid" not in r.args:
        parts.append(f"child_pid={r.child_pid}")
    parts += [f"{k}={v}" for k, v in r.args.items()]
    parts += [f"({note})" for note in row_notes(r)]
    return " ".join(parts) or "-"


def live_row(r: TraceRecord) -> tuple[str, ...]:
    dur = micros(r.duration_ns) if r.kind == "ioctl" else "-"
    return (clock(r.ts_ns), r.node or "-", who(r), f"{r.pid}/{r.tid}", r.call or r.kind, status(r), dur,
            args_text(r))


class LiveTable:
    """Lines for records as they arrive: widths grow with each batch (never shrink); no truncation.
    A session fact is a `# ` line the first time a record carries it, above the rows of that batch
    (the first batch's: above the header)."""

    def __init__(self) -> None:
        self.widths = [max(len(h), w) for h, w in zip(LIVE_HEADER, LIVE_MIN_WIDTHS, strict=True)]
        self.started = False
        self.said: set[str] = set()

    def lines(self, records: Sequence[TraceRecord]) -> list[str]:
        rows = [live_row(r) for r in records]
        for row in rows:
            self.widths = [max(w, len(cell)) for w, cell in zip(self.widths, row, strict=True)]
        new = [f for f in dict.fromkeys(f for r in records for f in facts(r)) if f not in self.said]
        self.said.update(new)
        out = [f"# {f}" for f in new]
        if rows and not self.started:
            self.started = True
            out.append(self._line(LIVE_HEADER))
        return out + [self._line(row) for row in rows]

    def _line(self, cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, self.widths, strict=True)).rstrip()


def jsonl_line(r: TraceRecord) -> str:
    return json.dumps(r.to_json(), separators=(",", ":"))


@dataclass(frozen=True)
class SummaryRow:
    call: str  # TraceRecord.summary_key, or "total"
    calls: int
    errors: int
    total_ns: int
    avg_ns: float
    p99_ns: int
    pct_time: float

    def to_json(self) -> dict[str, Any]:
        return {"call": self.call, "calls": self.calls, "errors": self.errors, "total_ns": self.total_ns,
                "avg_ns": self.avg_ns, "p99_ns": self.p99_ns, "pct_time": self.pct_time}


def p99(durations: Sequence[int]) -> int:
    """Nearest rank: the smallest duration at least 99% of the calls took no longer than (0 if none)."""
    if not durations:
        return 0
    ordered = sorted(durations)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def _row(call: str, recs: Sequence[TraceRecord], grand_ns: int) -> SummaryRow:
    durations = [r.duration_ns for r in recs]
    total = sum(durations)
    return SummaryRow(call=call, calls=len(recs), errors=sum(is_error(r) for r in recs), total_ns=total,
                      avg_ns=total / len(recs) if recs else 0.0, p99_ns=p99(durations),
                      pct_time=100.0 * total / grand_ns if grand_ns else 0.0)


def summarize(records: Iterable[TraceRecord]) -> tuple[list[SummaryRow], SummaryRow]:
    """Per call, sorted by total time (then calls, then name); and the total line."""
    recs = list(records)
    grand_ns = sum(r.duration_ns for r in recs)
    groups: dict[str, list[TraceRecord]] = {}
    for r in recs:
        groups.setdefault(r.summary_key, []).append(r)
    rows = [_row(call, group, grand_ns) for call, group in groups.items()]
    rows.sort(key=lambda s: (-s.total_ns, -s.calls, s.call))
    total = _row("total", recs, grand_ns)
    return rows, total


def summary_json(records: Iterable[TraceRecord]) -> list[dict[str, Any]]:
    """The summary rows, then the total, as `-o json` keeps them."""
    rows, total = summarize(records)
    return [s.to_json() for s in [*rows, total]]


def summary_jsonl(records: Iterable[TraceRecord]) -> str:
    """`-o jsonl --summary`: the summary rows, then the total, one JSON object a line."""
    return "\n".join(json.dumps(row, separators=(",", ":")) for row in summary_json(records))


SUMMARY_HEADER = ("% TIME", "TOTAL(µs)", "AVG(µs)", "P99(µs)", "CALLS", "ERRORS", "CALL")


def _summary_cells(s: SummaryRow) -> list[str]:
    return [f"{s.pct_time:.2f}", micros(s.total_ns), micros(s.avg_ns), micros(s.p99_ns), str(s.calls),
            str(s.errors) if s.errors else "", s.call]


def summary_table(records: Iterable[TraceRecord]) -> str:
    """`strace -c` for GPU calls: laid out by view.grid, a dashed line before the total."""
    rows, total = summarize(records)
    if not rows:
        return "(no calls traced)"
    body = [_summary_cells(s) for s in rows]
    widths = [max(len(h), *(len(r[i]) for r in [*body, _summary_cells(total)]))
              for i, h in enumerate(SUMMARY_HEADER)]
    dashes = ["-" * w for w in widths]
    return view.grid(SUMMARY_HEADER, [*body, dashes, _summary_cells(total)])


def summary_only(records: Iterable[TraceRecord]) -> str:
    """`--summary` without the calls: the nodes' driver facts the names were decoded under, once
    each, then the summary table."""
    recs = list(records)
    said = dict.fromkeys(f for r in recs for f in driver_facts(r))
    return "\n".join([*(f"# {f}" for f in said), summary_table(recs)])


# `ghostgpu trace list`
def _when(unix_ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_ns / 1e9)) if unix_ns else "-"


def dropped(s: TraceSession) -> int:
    return s.dropped_limit_total + s.dropped_ringbuf_total + s.dropped_store_total + s.dropped_transport_total


SESSION_COLUMNS: tuple[view.Column[TraceSession], ...] = (
    ("ID", lambda s: s.id),
    ("STATUS", lambda s: str(s.status)),
    ("SCOPE", lambda s: s.scope.describe()),
    ("NODES", lambda s: ",".join(s.nodes) or "-"),
    ("RECORDS", lambda s: str(s.records_total)),
    ("DROPPED", lambda s: str(dropped(s))),
    ("STARTED", lambda s: _when(s.started_unix_ns)),
    ("ENDS/ENDED", lambda s: _when(s.ended_unix_ns if s.status.ended and s.ended_unix_ns
                                   else s.deadline_unix_ns)),
    ("BY", lambda s: s.requested_by or "-"),
)


def session_table(sessions: Sequence[TraceSession]) -> str:
    return view.table(SESSION_COLUMNS, sorted(sessions, key=lambda s: (s.started_unix_ns, s.id)),
                      "(no trace sessions)")


def session_line(s: TraceSession) -> str:
    """One line for a session's state: what `trace stop` prints and `trace` ends with."""
    counts = f"{s.records_total} records"
    if d := dropped(s):
        counts += (f", {d} dropped (record limit {s.dropped_limit_total}, ring buffer "
                   f"{s.dropped_ringbuf_total}, collector store {s.dropped_store_total}, transport "
                   f"{s.dropped_transport_total})")
    if s.status.ended:
        state = f"{s.status} at {_when(s.ended_unix_ns)}" if s.ended_unix_ns else str(s.status)
    else:
        state = f"running until {_when(s.deadline_unix_ns)}"
    detail = f" ({s.status_detail})" if s.status_detail else ""
    nodes = f" on {','.join(s.nodes)}" if s.nodes and not s.scope.node else ""  # a node scope says it
    return f"trace {s.id} {state}{detail}: {s.scope.describe()}{nodes}, {counts}"
