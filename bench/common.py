"""Small helpers shared by bench_shortlived.py and bench_agent.py: preflight checks, /proc readers,
a plain-text table and the JSON writer for bench/results/."""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def preflight() -> str | None:
    """One line naming what is missing to run a whole-tracer bench, or None when all is there."""
    if os.geteuid() != 0:
        return "needs root (BPF, mknod, namespaces): run as root, e.g. sudo .venv/bin/python bench/..."
    try:
        import bcc  # noqa: F401
    except ImportError:
        return "bcc is not installed: apt-get install python3-bpfcc (scripts/bootstrap.sh install)"
    if not os.path.isdir("/sys/kernel/tracing/events/syscalls"):
        return "tracefs is not mounted: mount -t tracefs tracefs /sys/kernel/tracing"
    if not (shutil.which("gcc") or shutil.which("cc")):
        return "gcc is needed to build gpuwork and the fake NVML: apt-get install gcc"
    return None


def interrupt_on_sigterm() -> None:
    """Turn SIGTERM (and SIGINT, which a non-interactive shell's background job inherits as
    ignored) into KeyboardInterrupt, so the ExitStack cleanup removes containers and the tracer."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def machine() -> dict[str, Any]:
    """What the figures were measured on; load averages show whether something else was busy."""
    load_1m, load_5m, _ = os.getloadavg()
    return {
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg_1m_at_end": round(load_1m, 2),
        "loadavg_5m_at_end": round(load_5m, 2),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def status_kib(pid: int, key: str) -> int | None:
    """A `kB` line of /proc/PID/status (VmRSS, VmHWM, RssAnon, ...), None when the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_ticks(pid: int, children: bool = False) -> int | None:
    """utime + stime of a process in clock ticks (fields 14 and 15 of /proc/PID/stat); with
    children=True, cutime + cstime instead (16, 17: its reaped children, e.g. forked scan workers)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: count fields after its last ')'.
    rest = text[text.rfind(")") + 2 :].split()
    first = 13 if children else 11
    try:
        return int(rest[first]) + int(rest[first + 1])
    except (IndexError, ValueError):
        return None


def best_median(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"best": None, "median": None}
    return {"best": round(min(values), 3), "median": round(statistics.median(values), 3)}


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], out: Any = None) -> None:
    """A left-aligned plain-text table (markdown pipes, so it pastes into bench/README.md)."""
    out = out or sys.stdout
    cells = [[str(h) for h in headers]] + [[fmt(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |", file=out)
        if n == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|", file=out)


def write_json(name: str, data: dict[str, Any]) -> Path:
    """Write bench/results/NAME.json (atomically, so a reader never sees half a file)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path


def stop_by_stdin(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """Close a reference poller's stdin (its signal to write its results and exit); kill it past
    the deadline. Idempotent."""
    if proc.stdin is not None and not proc.stdin.closed:
        proc.stdin.close()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
