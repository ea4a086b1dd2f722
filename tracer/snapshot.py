"""`ghostgpu snapshot`: the node's GPU consumers now, from /proc and NVML only (no BPF needed).

The consumers only: the command (ghostgpu/cli) renders them with the table `ps` uses.
"""

from __future__ import annotations

from dataclasses import replace

from ghostgpu.tracer.agent import Tracer
from ghostgpu.tracer.config import TracerConfig

from ghostgpu.common.model.consumers import Consumer
from ghostgpu.common.model.records import Record


class _Discard:
    """A snapshot reports what it finds, not how it got there: notices go to the log only."""

    def emit(self, record: Record) -> None:
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

