"""The agent loop's self-reporting: contained errors, and the lifecycle it reports for health.

One bad event or scan must not take the node agent down.

A privileged DaemonSet that crash-loops detects nothing, so the agent loop runs each unit of work
(one ring-buffer event, one scan, one NVML read, one classification) through `Containment.run`.
An unexpected exception there is logged with its traceback once per place (stage, exception type
and the line that raised it), then only counted; the count per stage is exported as
`ghostgpu_agent_errors_total{stage}` and turns `/healthz` into "degraded" (still 200: restarting
the pod would lose the holder table and fix nothing). Tests assert the count stays 0, so no bug
hides behind the containment.

`HealthReport` is what the loop tells tracer/health.py (BPF attached, scans, steps): a protocol here
so that the agent never imports the health module, which reads the agent.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

log = logging.getLogger("ghostgpu.tracer")

# Every stage the agent loop contains, so the metric shows each at 0 before anything goes wrong.
STAGES = ("event", "scan", "nvml", "ioctl", "classify", "sweep", "fault", "memory", "info")

T = TypeVar("T")


def place_of(exc: BaseException) -> str:
    """Where an exception was raised: the innermost frame's file:line and function."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    last = frames[-1]
    return f"{last.filename.rsplit('/', 1)[-1]}:{last.lineno} in {last.name}"


class Containment:
    """Counts per stage, replaced whole on every error so the HTTP thread reads them without a lock."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(STAGES, 0)
        self.last: str = ""  # "stage: Type: message (file:line in func)" of the latest error
        self._logged: set[tuple[str, str, str]] = set()

    def run(self, stage: str, fn: Callable[..., T], *args: Any) -> T | None:
        """fn(*args); on an unexpected exception: log once per place, count, return None."""
        try:
            return fn(*args)
        except Exception as exc:  # the containment itself: everything else is a bug to count
            self.record(stage, exc)
            return None

    def record(self, stage: str, exc: Exception) -> None:
        where = place_of(exc)
        summary = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
        self.last = f"{stage}: {summary} ({where})"
        counts = dict(self.counts)
        counts[stage] = counts.get(stage, 0) + 1
        self.counts = counts
        key = (stage, type(exc).__name__, where)
        if key not in self._logged:
            self._logged.add(key)
            log.error("contained an unexpected error in stage %s; the agent goes on (logged once per "
                      "place, counted in ghostgpu_agent_errors_total)", stage,
                      exc_info=(type(exc), exc, exc.__traceback__))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class HealthReport(Protocol):
    """What the loop reports into: tracer/health.py's AgentHealth, with --health-listen."""

    tracer: Any

    def bpf_started(self, programs: int, off_reason: str = "") -> None: ...
    def scan_observed(self, duration_s: float) -> None: ...
    def started(self) -> None: ...
    def stepped(self) -> None: ...
