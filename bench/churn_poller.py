#!/usr/bin/env python3
"""The reference for bench_churn.py: a poller that lists /proc/*/fd every second for /dev/nvidia*.

Run by the bench as its own process (`churn_poller.py OUT INTERVAL_S`), as a polling tool would run
beside the workload. Every sighting is kept with the boot-clock times of the scan that made it, so
that the bench can tell which of two processes that got the same PID it saw. Closing its stdin
tells it to write OUT (JSON) and exit; OUT also holds its own CPU seconds.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_shortlived import scan_proc_fds  # the same /proc/*/fd walk as the short-lived bench
from bench.common import stop_by_stdin

POLL_PREFIX = "/dev/nvidia"


def poller_main(out_path: str, interval_s: float) -> int:
    """Scan every interval_s (fixed rate) until stdin reaches EOF; then write the sightings."""
    sightings: list[tuple[int, int, int]] = []  # (pid, scan start boot ns, scan end boot ns)
    scans = 0
    next_tick = time.monotonic()
    try:
        while True:
            start_ns = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
            found = scan_proc_fds(POLL_PREFIX)
            end_ns = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
            sightings.extend((pid, start_ns, end_ns) for pid in found)
            scans += 1
            next_tick += interval_s
            if select.select([sys.stdin], [], [], max(0.0, next_tick - time.monotonic()))[0]:
                break  # stdin readable means EOF: the bench is done
    finally:
        cpu = os.times()
        Path(out_path).write_text(json.dumps({
            "sightings": sightings, "scans": scans, "cpu_s": round(cpu.user + cpu.system, 3),
        }))
    return 0


class Poller:
    """The poller process seen from the bench: start it, then finish() -> its result."""

    def __init__(self, workdir: Path, interval_s: float) -> None:
        self.out_path = workdir / "poller.json"
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(self.out_path),
                                      str(interval_s)], stdin=subprocess.PIPE)

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_by_stdin(self.proc, timeout_s)

    def finish(self) -> dict[str, Any]:
        self.stop()
        if not self.out_path.exists():
            raise RuntimeError(f"the poller wrote no result (rc={self.proc.returncode})")
        return json.loads(self.out_path.read_text())


if __name__ == "__main__":
    sys.exit(poller_main(sys.argv[1], float(sys.argv[2])))
