"""`ghostgpu snapshot`: the node's GPU consumers now, from /proc and NVML only (no BPF needed)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ghostgpu.tracer.agent import Tracer
from ghostgpu.tracer.config import TracerConfig

from ghostgpu.common.model import Consumer


class _Discard:
    """A snapshot reports what it finds, not how it got there: notices go to the log only."""

    def emit(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def take_snapshot(cfg: TracerConfig) -> list[Consumer]:
    """One scan and one NVML read, classified."""
    tracer = Tracer(replace(cfg, bpf="off"), _Discard())
    try:
        tracer.start()
        return tracer.current_consumers()
    finally:
        tracer.close()


COLUMNS = (
    ("GPU", lambda c: "-" if c.gpu is None else str(c.gpu)),
    ("PID", lambda c: str(c.pid)),
    ("CPID", lambda c: "-" if c.ns_pid is None else str(c.ns_pid)),
    ("COMM", lambda c: c.comm or "?"),
    ("CLASS", lambda c: str(c.cls)),
    ("GPU-MEM", lambda c: _mib(c.gpu_memory_bytes)),
    ("CONTAINER", lambda c: c.container_id[:13] or "-"),
    ("POD-UID", lambda c: c.pod_uid or "-"),
    ("DEVICES", lambda c: ",".join(d.removeprefix("/dev/") for d in c.devices)),
)
WIDE_COLUMNS = (*COLUMNS, ("REASON", lambda c: c.reason))


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):.0f}MiB"


def render_table(consumers: list[Consumer], wide: bool = True) -> str:
    cols = WIDE_COLUMNS if wide else COLUMNS
    rows = [[name for name, _ in cols]] + [[fn(c) for _, fn in cols] for c in consumers]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows]
    if not consumers:
        lines.append("(no process holds a GPU device file)")
    return "\n".join(lines)
