#!/usr/bin/env python3
"""Benchmark: does the tracer catch short-lived GPU consumers that a 1 s /proc poller misses?

Run as root:  .venv/bin/python bench/bench_shortlived.py [--containers 50] [--per-container 20]

Starts the real tracer (`ghostgpu tracer`, BPF + /proc + fake NVML), then runs containers x
per-container consumers in fake containers (tests/helpers/container.py), each `open /dev/nvidia0`,
`sleep 10..50 ms`, `exit 0`, a few in flight at once so the 2-core VM is not swamped. Side by side
runs a reference poller: a separate process that every 1 s walks /proc/*/fd for links to
/dev/nvidia* and records (pid, container id), the way a polling tool finds consumers.

A consumer counts as caught when the tracer wrote an `open` (resp. `exit`) record with its host
PID and its container's id; the same for the poller's sightings. Goal: the tracer catches 100%.
Prints a table and writes bench/results/shortlived.json. Every container, the poller and the
tracer are stopped and removed on the way out, also on error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ghostgpu.tracer.cgroup import parse_proc_cgroup

from bench.common import interrupt_on_sigterm, machine, preflight, print_table, stop_by_stdin, write_json
from tests.helpers.container import FakeContainer
from tests.helpers.fakenvml import FakeGpu, FakeNvml
from tests.helpers.tracer_proc import TracerProcess
from tests.helpers.workload import build_gpuwork

GOAL_CATCH_RATE = 1.0
GPU0_UUID = "GPU-0a1b2c3d-0000-4000-8000-000000000000"
DEVICE = "/dev/nvidia0"
POLL_PREFIX = "/dev/nvidia"


@dataclass
class ConsumerRun:
    container_id: str
    host_pid: int
    sleep_ms: int
    rc: int | None
    step_errors: list[str]


# --- the reference poller (runs as its own process: `--poller OUT`) ----------------------------


def scan_proc_fds(prefix: str, proc_root: str = "/proc") -> dict[int, str]:
    """One polling pass: host PID -> container id of every process with an fd linking to prefix*.

    Processes exit mid-scan all the time here: every read that fails just skips that process.
    """
    found: dict[int, str] = {}
    try:
        names = os.listdir(proc_root)
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        fd_dir = f"{proc_root}/{name}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"{fd_dir}/{fd}")
            except OSError:
                continue
            if target.startswith(prefix):
                try:
                    with open(f"{proc_root}/{name}/cgroup") as f:
                        found[int(name)] = parse_proc_cgroup(f.read()).container_id
                except OSError:
                    found[int(name)] = ""
                break
    return found


def poller_main(out_path: str, interval_s: float) -> int:
    """Scan every interval_s (fixed rate) until stdin closes; then write what was seen as JSON."""
    seen: dict[int, str] = {}
    scan_s: list[float] = []
    next_tick = time.monotonic()
    try:
        while True:
            t0 = time.monotonic()
            for pid, cid in scan_proc_fds(POLL_PREFIX).items():
                seen.setdefault(pid, cid)
            scan_s.append(time.monotonic() - t0)
            next_tick += interval_s
            # stdin readable means EOF: the bench is done. Otherwise this is the poller's tick.
            if select.select([sys.stdin], [], [], max(0.0, next_tick - time.monotonic()))[0]:
                break
    finally:
        Path(out_path).write_text(json.dumps({
            "seen": {str(pid): cid for pid, cid in seen.items()},
            "scans": len(scan_s),
            "scan_s_max": max(scan_s, default=0.0),
            "scan_s_mean": sum(scan_s) / len(scan_s) if scan_s else 0.0,
        }))
    return 0


class Poller:
    """The poller process seen from the bench: start(), then finish() -> its result."""

    def __init__(self, workdir: Path, interval_s: float) -> None:
        self.out_path = workdir / "poller.json"
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--poller", str(self.out_path),
             "--poll-interval-s", str(interval_s)],
            stdin=subprocess.PIPE,
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_by_stdin(self.proc, timeout_s)

    def finish(self, timeout_s: float = 10.0) -> dict[str, Any]:
        self.stop(timeout_s)
        if not self.out_path.exists():
            raise RuntimeError(f"the poller wrote no result (rc={self.proc.returncode})")
        return json.loads(self.out_path.read_text())


# --- consumers ---------------------------------------------------------------------------------


def run_consumer(container: FakeContainer, sleep_ms: int) -> ConsumerRun:
    """One short-lived consumer in `container`, run to its end; its pipes are closed after."""
    p = container.run(["open", DEVICE, "sleep", str(sleep_ms), "exit", "0"])
    try:
        host_pid = p.init_pid
        rc = p.popen.wait(timeout=30)
        while p.read_line(0.0) is not None:  # step-error lines, if the open failed
            pass
        return ConsumerRun(container.container_id, host_pid, sleep_ms, rc, p.step_errors())
    finally:
        for pipe in (p.popen.stdin, p.popen.stdout, p.popen.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


def run_container(container: FakeContainer, sleeps_ms: list[int], stop: threading.Event) -> list[ConsumerRun]:
    """The container's consumers one after the other; stops early once `stop` is set (Ctrl-C)."""
    runs = []
    for ms in sleeps_ms:
        if stop.is_set():
            break
        runs.append(run_consumer(container, ms))
    return runs


# --- evaluation --------------------------------------------------------------------------------


def caught(runs: list[ConsumerRun], records: list[dict[str, Any]], event: str) -> set[int]:
    """Host PIDs of runs with a record of `event` naming that PID and the right container id."""
    want = {(r.host_pid, r.container_id) for r in runs}
    return {rec["pid"] for rec in records
            if rec.get("event") == event and (rec.get("pid"), rec.get("container_id")) in want}


def wait_for_records(tracer: TracerProcess, runs: list[ConsumerRun], deadline_s: float) -> float:
    """Poll the tracer's JSON lines until every run has its open and exit record, or the deadline."""
    t0 = time.monotonic()
    while True:
        records = tracer.matching(lambda r: r.get("event") in ("open", "exit"))
        if all(len(caught(runs, records, kind)) == len(runs) for kind in ("open", "exit")):
            break
        if time.monotonic() - t0 > deadline_s or tracer.proc.poll() is not None:
            break
        time.sleep(0.1)  # polling interval of a deadline loop
    return time.monotonic() - t0


def rate(n: int, total: int) -> float:
    return round(n / total, 4) if total else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--containers", type=int, default=50)
    ap.add_argument("--per-container", type=int, default=20)
    ap.add_argument("--in-flight", type=int, default=4, help="containers running a consumer at once")
    ap.add_argument("--sleep-ms", type=int, nargs=2, default=(10, 50), metavar=("MIN", "MAX"))
    ap.add_argument("--poll-interval-s", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=20240601)
    ap.add_argument("--drain-deadline-s", type=float, default=30.0)
    ap.add_argument("--out", default="shortlived", help="result name under bench/results/")
    ap.add_argument("--poller", help=argparse.SUPPRESS)  # internal: run as the reference poller
    args = ap.parse_args()
    if args.poller:
        return poller_main(args.poller, args.poll_interval_s)
    interrupt_on_sigterm()
    problem = preflight()
    if problem:
        print(f"bench_shortlived: {problem}", file=sys.stderr)
        return 2
    build_gpuwork()  # before the clock starts
    rng = random.Random(args.seed)
    plan = [[rng.randint(*args.sleep_ms) for _ in range(args.per_container)] for _ in range(args.containers)]
    total = args.containers * args.per_container
    load_1m_at_start = round(os.getloadavg()[0], 2)  # others sharing the machine skew timings

    with contextlib.ExitStack() as stack:
        workdir = Path(tempfile.mkdtemp(prefix="ghostgpu-bench-shortlived-"))
        stack.callback(shutil.rmtree, workdir, True)
        nvml = FakeNvml(workdir / "nvml.conf", gpus=[FakeGpu(index=0, uuid=GPU0_UUID, minor=0)])
        nvml.write()
        tracer = stack.enter_context(TracerProcess(workdir, ["--grace-s", "0.5"], nvml.env(), "bench-node"))
        tracer.wait_ready(60.0)
        containers = [stack.enter_context(FakeContainer()) for _ in range(args.containers)]
        poller = Poller(workdir, args.poll_interval_s)
        stack.callback(poller.stop)

        t0 = time.monotonic()
        stop = threading.Event()
        with ThreadPoolExecutor(max_workers=args.in_flight) as pool:
            try:
                futures = [pool.submit(run_container, c, sleeps, stop)
                           for c, sleeps in zip(containers, plan, strict=True)]
                runs = [run for f in futures for run in f.result()]
            except BaseException:
                stop.set()  # the pool's exit waits for the workers: let them end at once
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        consumers_s = time.monotonic() - t0
        poll_result = poller.finish()
        drain_s = wait_for_records(tracer, runs, args.drain_deadline_s)
        records = tracer.matching(lambda r: r.get("event") in ("open", "exit", "notice"))
        run_s = time.monotonic() - t0

    opened = caught(runs, records, "open")
    exited = caught(runs, records, "exit")
    pids = {r.host_pid for r in runs}
    open_pids = {rec.get("pid") for rec in records if rec.get("event") == "open"}
    wrong_cid = sorted((pids - opened) & open_pids)
    poll_seen = {int(pid): cid for pid, cid in poll_result["seen"].items()}
    poll_caught = {r.host_pid for r in runs if poll_seen.get(r.host_pid) == r.container_id}
    open_sources: dict[str, int] = {}
    for rec in records:
        if rec.get("event") == "open" and rec.get("pid") in opened:
            open_sources[rec.get("source", "?")] = open_sources.get(rec.get("source", "?"), 0) + 1
    failed = [r for r in runs if r.rc != 0 or r.step_errors]

    result: dict[str, Any] = {
        "bench": "shortlived",
        "consumers": total,
        "containers": args.containers,
        "per_container": args.per_container,
        "in_flight": args.in_flight,
        "sleep_ms": list(args.sleep_ms),
        "seed": args.seed,
        "consumers_failed": len(failed),
        "distinct_host_pids": len(pids),
        "tracer": {
            "open_caught": len(opened), "open_rate": rate(len(opened), total),
            "exit_caught": len(exited), "exit_rate": rate(len(exited), total),
            "open_with_wrong_container_id": len(wrong_cid),
            "open_sources": open_sources,
            "alive_false_opens": sum(1 for r in records if r.get("event") == "open"
                                     and r.get("pid") in opened and r.get("alive") is False),
            "notices": [r.get("what") + ": " + r.get("message", "") for r in records
                        if r.get("event") == "notice"],
            "drain_s": round(drain_s, 3),
        },
        "poller_1s": {
            "caught": len(poll_caught), "rate": rate(len(poll_caught), total),
            "scans": poll_result["scans"],
            "scan_s_mean": round(poll_result["scan_s_mean"], 4),
            "scan_s_max": round(poll_result["scan_s_max"], 4),
        },
        "ratio_tracer_open_vs_poller": round(len(opened) / len(poll_caught), 1) if poll_caught else None,
        "consumers_run_s": round(consumers_s, 2),
        "run_s": round(run_s, 2),
        "goal_catch_rate": GOAL_CATCH_RATE,
        "goal_met": len(opened) == total and len(exited) == total,
        "missed_examples": [asdict(r) for r in runs if r.host_pid not in opened][:5],
        "failed_examples": [asdict(r) for r in failed][:5],
        "machine": {**machine(), "loadavg_1m_at_start": load_1m_at_start},
    }
    print_table(
        ["who", "caught", "of", "rate", "goal"],
        [
            ["tracer: open record, right container", len(opened), total, f"{rate(len(opened), total):.1%}",
             "100%"],
            ["tracer: exit record, right container", len(exited), total, f"{rate(len(exited), total):.1%}",
             "100%"],
            [f"poller every {args.poll_interval_s:g} s (/proc/*/fd)", len(poll_caught), total,
             f"{rate(len(poll_caught), total):.1%}", "reference"],
        ],
    )
    print(f"{total} consumers in {args.containers} containers ran in {consumers_s:.1f} s "
          f"({args.in_flight} in flight); whole run {run_s:.1f} s; failed consumers: {len(failed)}")
    print(f"wrote {write_json(args.out, result)}")
    return 0 if result["goal_met"] else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as exc:
        print(f"bench_shortlived: interrupted ({exc}); containers, consumers and the tracer were cleaned up",
              file=sys.stderr)
        sys.exit(130)
