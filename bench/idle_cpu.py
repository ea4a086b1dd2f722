"""What bench_agent.py's idle windows read: processes on the node, memory and CPU of a process, and
the CPU of one full /proc reconcile as the tracer runs it, which bench_agent spreads over
full_scan_interval_s (its idle window holds only incremental rescans)."""

from __future__ import annotations

import os
import resource

from ghostgpu.tracer.config import TracerConfig
from ghostgpu.tracer.devices import DeviceCatalog
from ghostgpu.tracer.procfs import ProcScanner
from ghostgpu.tracer.rescan import read_marks

from bench.common import cpu_ticks, status_kib


def count_pids() -> int:
    try:
        return sum(1 for name in os.listdir("/proc") if name.isdigit())
    except OSError:
        return 0


def memory_of(pid: int) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
        kib = status_kib(pid, key)
        out[key] = round(kib / 1024, 1) if kib is not None else None
    return out


def cpu_total_ticks(pid: int) -> int:
    own, children = cpu_ticks(pid), cpu_ticks(pid, children=True)
    if own is None or children is None:
        raise RuntimeError(f"process {pid} is gone: its CPU time cannot be read")
    return own + children


def own_cpu_s() -> float:
    """CPU seconds of this process and its reaped children (the forked scan workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def full_reconcile_cpu_s(prefix: str, runs: int = 3) -> float:
    """CPU of one full reconcile's /proc work with the tracer's settings: the marks, then the scan
    (best of `runs`; the first also warms the dentry cache, as the tracer's start scan did)."""
    cfg = TracerConfig(node_name="bench", device_prefixes=[prefix] if prefix else [])
    scanner = ProcScanner(DeviceCatalog(cfg.prefixes, cfg.proc_root), cfg.proc_root)
    best = float("inf")
    for _ in range(runs):
        t0 = own_cpu_s()
        read_marks(cfg.proc_root)
        scanner.scan()
        best = min(best, own_cpu_s() - t0)
    return best
