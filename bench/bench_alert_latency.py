#!/usr/bin/env python3
"""Benchmark: from a planted hidden GPU consumer to its alert in Alertmanager, by both paths.

Run as root:  .venv/bin/python bench/bench_alert_latency.py [--trials 10] [--slow-trials 3]

Everything is real but the GPU: a fake container (its own PID namespace and kubepods cgroups)
starts gpuwork, which opens /dev/nvidia0 (a character device node) and allocates a compute class on
it (a GPU job: one that only opened it would be a `monitor`, which pages no one); the real tracer (BPF, a fake
NVML that lists no process, --grace-s 0 so the consumer is hidden at once) streams to a real
`ghostgpu collector` process serving /metrics and posting findings to Alertmanager. Debian's
Prometheus 2.42 scrapes the collector and evaluates the shipped rules (findings alerts' `for:` at
0 s, see tests/helpers/promstack.py) and sends to Debian's Alertmanager 0.25.

The clock starts just before the container process is started and stops when Alertmanager's
GET /api/v2/alerts (polled every --poll-ms) first lists GhostGPUHiddenConsumer for that PID:
- push: posted by the collector (label source="ghostgpu-collector"); goal < 1 s;
- scrape: from Prometheus's rule evaluation, scraping and evaluating every 1 s, and in a second
  phase every --slow-interval-s (15 s, a common production interval and dcgm-exporter's).
Then the process is killed and the time until each alert leaves the active list is recorded too.
With the shipped `for:` (30 s for hidden) the scrape path pages that much later, on purpose.
Prints a table, writes bench/results/alert_latency.json.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import interrupt_on_sigterm, machine, preflight, print_table, write_json
from tests.helpers.collector_proc import CollectorProcess
from tests.helpers.container import FakeContainer
from tests.helpers.fakenvml import FakeGpu, FakeNvml
from tests.helpers.promstack import (
    ALERTMANAGER_BIN,
    PROMETHEUS_BIN,
    Alertmanager,
    Prometheus,
    findings_rules_firing_at_once,
    free_port,
)
from tests.helpers.tracer_proc import TracerProcess
from tests.helpers.workload import allocates

GOAL_PUSH_S = 1.0
ALERT = "GhostGPUHiddenConsumer"
NODE = "bench-alerts"
GPU0_UUID = "GPU-0a1b2c3d-0000-4000-8000-0000000000a1"
TRIAL_TIMEOUT_S = 120.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def summary(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50_s": round(statistics.median(values), 3),
            "p99_s": round(percentile(values, 99), 3), "min_s": round(min(values), 3),
            "max_s": round(max(values), 3)}


def wait_times(check: Callable[[], set[str]], wanted: set[str], start: float, poll_s: float,
               what: str) -> dict[str, float]:
    """Poll `check()` (which paths hold now) until every path in `wanted` was seen; seconds since start."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + TRIAL_TIMEOUT_S
    while len(seen) < len(wanted):
        now_paths = check()
        now = time.perf_counter()
        for path in wanted & now_paths:
            seen.setdefault(path, now - start)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: only {sorted(seen)} of {sorted(wanted)} after {TRIAL_TIMEOUT_S} s")
        time.sleep(poll_s)  # the polling interval of a deadline loop
    return seen


def firing_paths(am: Alertmanager, pid: int) -> set[str]:
    paths = set()
    for a in am.alerts(alertname=ALERT, pid=str(pid)):
        paths.add("push" if a["labels"].get("source") == "ghostgpu-collector" else "scrape")
    return paths


def run_phase(am: Alertmanager, prom_dir: Path, metrics: str, rules: Path, interval_s: float,
              trials: int, poll_s: float) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"push": [], "scrape": [], "push_resolve": [], "scrape_resolve": []}
    with Prometheus(prom_dir, scrape_targets={"ghostgpu-collector": metrics}, rule_files=[rules],
                    alertmanagers=[am.address], interval_s=interval_s) as prom:
        prom.wait_target_up("ghostgpu-collector", 60.0)
        for i in range(trials):
            # Each trial would otherwise start just after the evaluation that resolved the last one,
            # always at the same point of Prometheus's cycle: start at a random point of it instead.
            time.sleep(random.uniform(0.0, interval_s))
            with FakeContainer() as box:
                start = time.perf_counter()
                proc = box.run(["open", "/dev/nvidia0", *allocates(), "ready", "wait"])
                proc.wait_ready()
                pid = proc.host_pid
                fired = wait_times(lambda pid=pid: firing_paths(am, pid), {"push", "scrape"}, start, poll_s,
                                   f"trial {i} alerts")
                time.sleep(random.uniform(0.0, interval_s))  # the same for the resolution: a random phase
                proc.kill()
                gone_at = time.perf_counter()
                resolved = wait_times(lambda pid=pid: {"push", "scrape"} - firing_paths(am, pid),
                                      {"push", "scrape"}, gone_at, poll_s, f"trial {i} resolution")
            for path in ("push", "scrape"):
                out[path].append(fired[path])
                out[f"{path}_resolve"].append(resolved[path])
            print(f"  interval {interval_s:g} s, trial {i + 1}/{trials}: push {fired['push'] * 1000:.0f} ms, "
                  f"scrape {fired['scrape']:.2f} s; resolved push {resolved['push'] * 1000:.0f} ms, "
                  f"scrape {resolved['scrape']:.2f} s", file=sys.stderr)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--trials", type=int, default=10, help="trials with a 1 s scrape/evaluation interval")
    parser.add_argument("--slow-trials", type=int, default=3, help="trials at --slow-interval-s (0 skips)")
    parser.add_argument("--slow-interval-s", type=float, default=15.0)
    parser.add_argument("--poll-ms", type=float, default=10.0, help="how often Alertmanager is read")
    args = parser.parse_args()
    problem = preflight()
    for binary in (PROMETHEUS_BIN, ALERTMANAGER_BIN):
        if problem is None and not Path(binary).exists():
            problem = f"{binary} is missing: apt-get install prometheus prometheus-alertmanager"
    if problem:
        print(f"bench_alert_latency: {problem}", file=sys.stderr)
        return 2
    interrupt_on_sigterm()
    poll_s = args.poll_ms / 1000
    phases: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="ghostgpu-bench-alerts-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        nvml = FakeNvml(work / "nvml.conf", gpus=[FakeGpu(index=0, uuid=GPU0_UUID, minor=0)])
        nvml.write()
        am = stack.enter_context(Alertmanager(work / "am"))
        metrics = f"127.0.0.1:{free_port()}"
        collector = stack.enter_context(CollectorProcess(work / "collector", unix=False, args=[
            "--db", ":memory:", "--metrics-listen", metrics, "--alertmanager", am.url]))
        (work / "tracer").mkdir()
        tracer = stack.enter_context(TracerProcess(work / "tracer", ["--grace-s", "0"], nvml.env(), NODE,
                                                   collector.address))
        tracer.wait_ready(60.0)
        rules = findings_rules_firing_at_once(work / "rules.yaml")
        phases["1s"] = run_phase(am, work / "prom-1s", metrics, rules, 1.0, args.trials, poll_s)
        if args.slow_trials > 0:
            phases[f"{args.slow_interval_s:g}s"] = run_phase(am, work / "prom-slow", metrics, rules,
                                                             args.slow_interval_s, args.slow_trials, poll_s)
    rows = []
    result: dict[str, Any] = {"goal_push_p50_s": GOAL_PUSH_S, "poll_ms": args.poll_ms, "phases": {}}
    for name, data in phases.items():
        result["phases"][name] = {k: summary(v) for k, v in data.items()}
        for path in ("push", "scrape"):
            fired, resolved = summary(data[path]), summary(data[f"{path}_resolve"])
            rows.append([f"{path} (Prometheus every {name})" if path == "scrape" else f"push (phase {name})",
                         fired["n"], fired["p50_s"], fired["p99_s"], fired["max_s"], resolved["p50_s"]])
    push_all = [v for d in phases.values() for v in d["push"]]
    scrape_1s = phases["1s"]["scrape"]
    result["push_p50_s"] = summary(push_all).get("p50_s")
    result["scrape_1s_over_push_p50"] = round(statistics.median(scrape_1s) / statistics.median(push_all), 1)
    result["reference_scrape_interval_s"] = args.slow_interval_s
    result["push_p50_vs_15s_interval"] = round(statistics.median(push_all) / 15.0, 4)
    result["machine"] = machine()
    print_table(["path", "trials", "alert p50 s", "p99 s", "max s", "resolved p50 s"], rows)
    print(f"push p50 {result['push_p50_s']} s (goal < {GOAL_PUSH_S} s); the 1 s scrape path is "
          f"{result['scrape_1s_over_push_p50']}x the push p50; a {args.slow_interval_s:g} s scrape interval "
          f"alone is {args.slow_interval_s / statistics.median(push_all):.0f}x it")
    path = write_json("alert_latency", result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
