#!/usr/bin/env python3
"""Benchmark: does the tracer survive process churn? 20,000 exec'ing short-lived GPU consumers.

Run as root:  .venv/bin/python bench/bench_churn.py [--count 20000] [--concurrency 16] [--hogs]
              .venv/bin/python bench/bench_churn.py --soak-min 30   (see bench/churn_soak.py)

Starts a real `ghostgpu collector` and a real `ghostgpu tracer --collector ADDR --jsonl - --bpf on`
(fake NVML: one GPU that lists no process), then runs the churn of tests/helpers/churn.py as fast
as the machine forks: half the consumers on the host, half in fake containers, each opening
/dev/nvidia0 as fd 3, exec'ing (the fd survives), holding it ~10 ms and exiting. The tracer's
JSON lines come through a pipe that a reader thread stamps with CLOCK_BOOTTIME as each line
arrives: that stamp minus the launcher's reap time (the same clock) is the exit-record lag.

Reported: the tracer alive at the end; every consumer's open and exit record (matched by PID and
time, PIDs are reused); exit lag p50/p99; false findings (a non-visible class for a 10 ms
consumer) in the tracer's records and in the collector's findings; tracer CPU seconds per
consumer (utime+stime, forked scan workers included); tracer and collector RSS after the first
2,000 consumers and at the end; and, side by side, how many consumers a 1 s /proc poller saw
(bench/churn_poller.py) and its CPU. Writes bench/results/churn.json; exits 1 when a goal is missed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.churn_poller import Poller
from bench.common import (
    CLK_TCK,
    cpu_ticks,
    interrupt_on_sigterm,
    machine,
    preflight,
    print_table,
    status_kib,
    write_json,
)
from tests.helpers.churn import ChurnRun, CpuHogs, Lifetime, build_churn
from tests.helpers.churn_match import (
    ERRORS_METRIC,
    Matcher,
    describe,
    exit_lag_ms,
    health_address,
    metric_sum,
    percentile,
)
from tests.helpers.collector_proc import CollectorProcess
from tests.helpers.fakenvml import FakeGpu, FakeNvml
from tests.helpers.httpget import http_get

GPU0_UUID = "GPU-0a1b2c3d-0000-4000-8000-000000000000"
NODE = "bench-churn"
DROPS_METRIC = "ghostgpu_agent_ringbuf_drops_total"
GOAL_EXIT_LAG_P99_MS = 100.0
GOAL_RSS_GROWTH_BYTES = 5_000_000
FIRST_BATCH = 2_000  # RSS is taken after this many consumers (warm) and at the end: it must stay flat
REPO = Path(__file__).resolve().parent.parent
POLL_S = 0.1  # the bench's own loop: cheap reads of the launchers' files, no parsing mid-run


class PipedTracer:
    """`ghostgpu tracer --jsonl -`: stdout read by a thread that stamps each line on arrival."""

    def __init__(self, workdir: Path, collector: str, env: dict[str, str], args: list[str]) -> None:
        self.stderr_path = workdir / "tracer.stderr"
        cmd = [sys.executable, "-m", "ghostgpu.cli", "tracer", "--jsonl", "-", "--collector", collector,
               "--node-name", NODE, "--bpf", "on", "--health-listen", "127.0.0.1:0", *args]
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                         env={**os.environ, **env}, cwd=REPO)
        self.lines: list[tuple[int, bytes]] = []  # (CLOCK_BOOTTIME ns at arrival, the line)
        self._reader = threading.Thread(target=self._read, name="tracer-stdout", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        clock, append = time.clock_gettime_ns, self.lines.append
        for line in self.proc.stdout:  # list.append is atomic: the main thread reads lines[n:] safely
            append((clock(time.CLOCK_BOOTTIME), line))

    def records(self, start: int) -> list[dict[str, Any]]:
        """Parsed lines from index `start` on, each with `_arrival_ns`."""
        out = []
        for arrival_ns, line in self.lines[start:]:
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                rec["_arrival_ns"] = arrival_ns
                out.append(rec)
        return out

    def wait_ready(self, timeout_s: float) -> None:
        deadline, seen = time.monotonic() + timeout_s, 0
        while True:
            fresh = self.lines[seen:]
            seen += len(fresh)
            if any(b'"event":"ready"' in line for _, line in fresh):
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the tracer did not get ready in {timeout_s} s (rc={self.proc.poll()}): "
                                   f"{self.stderr()}")
            time.sleep(POLL_S)  # polling interval of a deadline loop

    def health_url(self) -> str | None:
        address = health_address(self.stderr())
        return f"http://{address}" if address else None

    def stderr(self, whole: bool = False) -> str:
        text = self.stderr_path.read_text(errors="replace")
        return text if whole else text[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)


def rss_bytes(pid: int) -> int | None:
    kib = status_kib(pid, "VmRSS")
    return kib * 1024 if kib is not None else None


def cpu_s(pid: int) -> float | None:
    own, children = cpu_ticks(pid), cpu_ticks(pid, children=True)
    return (own + (children or 0)) / CLK_TCK if own is not None else None


def poller_caught(lifetimes: list[Lifetime], sightings: list[list[int]]) -> int:
    """Lifetimes alive during a scan that saw their PID: the poller's catch count."""
    by_pid: dict[int, list[Lifetime]] = {}
    for life in lifetimes:
        by_pid.setdefault(life.pid, []).append(life)
    caught: set[tuple[int, int]] = set()
    for pid, start_ns, end_ns in sightings:
        for life in by_pid.get(pid, ()):
            if life.fork_ns <= end_ns and life.reap_ns >= start_ns:
                caught.add(life.key)
    return len(caught)


def collector_false_findings(address: str, lifetimes: list[Lifetime], since_unix_ns: int) -> int:
    """Consumers of ours with a non-visible finding in the collector's history."""
    from ghostgpu.cli.client import Query
    from ghostgpu.cli.view import finding_json

    query = Query(address)
    try:
        found = [{**finding_json(f), "event": "finding"} for f in query.findings(since_unix_ns, node=NODE)]
    finally:
        query.close()
    return len(Matcher(lifetimes).add_all(found).with_findings())


def churn(args: argparse.Namespace, workdir: Path, collector: CollectorProcess, tracer: PipedTracer,
          ) -> dict[str, Any]:
    """Run the consumers; RSS samples along the way. Returns lifetimes and what was sampled."""
    pids = {"tracer": tracer.proc.pid, "collector": collector.proc.pid}  # type: ignore[union-attr]
    samples: list[dict[str, Any]] = []
    rss_first: dict[str, int | None] | None = None
    reaped, next_sample = 0, 0.0
    with contextlib.ExitStack() as stack:
        if args.hogs:
            stack.enter_context(CpuHogs(args.hog_limit_s))
        run = stack.enter_context(ChurnRun(workdir, args.count, args.concurrency, args.containers,
                                           args.hold_ms, args.rate_per_s))
        t0 = time.monotonic()
        while not run.finished:
            reaped += len(run.read())
            now = time.monotonic() - t0
            if rss_first is None and reaped >= min(FIRST_BATCH, args.count):
                rss_first = {name: rss_bytes(pid) for name, pid in pids.items()}
            if now >= next_sample:
                samples.append({"t_s": round(now, 2), "reaped": reaped,
                                **{f"{n}_rss_bytes": rss_bytes(p) for n, p in pids.items()}})
                next_sample = now + 1.0
            if tracer.proc.poll() is not None and not args.keep_going:
                break  # the tracer died: the rest of the churn measures nothing
            time.sleep(POLL_S)
        churn_s = time.monotonic() - t0
        lifetimes = run.lifetimes()
        if rss_first is None:  # the run ended between two passes of the loop
            rss_first = {name: rss_bytes(pid) for name, pid in pids.items()}
        failures = run.failures()
    return {"lifetimes": lifetimes, "churn_s": churn_s, "samples": samples, "rss_first": rss_first or {},
            "launcher_failures": failures}


def drain(tracer: PipedTracer, lifetimes: list[Lifetime], deadline_s: float) -> tuple[Matcher, float]:
    """Feed the tracer's records to a Matcher until every consumer has its open and exit, or the deadline."""
    match, fed, t0 = Matcher(lifetimes), 0, time.monotonic()
    while True:
        fresh = tracer.records(fed)
        fed += len(fresh)
        match.add_all(fresh)
        done = not (match.missing("open") or match.missing("exit"))
        if done or tracer.proc.poll() is not None or time.monotonic() - t0 > deadline_s:
            return match, time.monotonic() - t0
        time.sleep(0.25)  # polling interval of the deadline loop


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    nvml = FakeNvml(workdir / "nvml.conf", gpus=[FakeGpu(index=0, uuid=GPU0_UUID, minor=0)])
    nvml.write()
    with contextlib.ExitStack() as stack:
        collector = stack.enter_context(CollectorProcess(workdir / "collector", unix=False))
        tracer = PipedTracer(workdir, collector.address, nvml.env(), args.tracer_arg or [])
        stack.callback(tracer.stop)
        tracer.wait_ready(120.0)
        url = tracer.health_url()
        poller = Poller(workdir, args.poll_interval_s)
        stack.callback(poller.stop)
        since_unix_ns = time.time_ns()
        cpu0 = cpu_s(tracer.proc.pid)
        ran = churn(args, workdir, collector, tracer)
        lifetimes: list[Lifetime] = ran["lifetimes"]
        match, drain_s = drain(tracer, lifetimes, args.drain_deadline_s)
        cpu1 = cpu_s(tracer.proc.pid)
        alive = tracer.proc.poll() is None
        rss_end = {"tracer": rss_bytes(tracer.proc.pid), "collector": rss_bytes(collector.proc.pid)}  # type: ignore[union-attr]
        status, text = http_get(f"{url}/metrics") if alive and url else (0, "")
        polled = poller.finish()
        collector_findings = collector_false_findings(collector.address, lifetimes, since_unix_ns) \
            if collector.running else None
        stderr_tail = tracer.stderr(whole=True)
    n = len(lifetimes)
    lags_ms = [lag for s in match.seen.values() if (lag := exit_lag_ms(s, match.offset_ns)) is not None]
    growth = {k: (rss_end[k] - v) if rss_end.get(k) is not None and v is not None else None
              for k, v in ran["rss_first"].items()}
    tracer_cpu = round(cpu1 - cpu0, 2) if cpu0 is not None and cpu1 is not None else None
    caught = n - len(match.missing("exit"))
    by_poller = poller_caught(lifetimes, polled["sightings"])
    return {
        "bench": "churn",
        "consumers": n,
        "consumers_failed": sum(1 for life in lifetimes if life.status != 0),
        "concurrency": args.concurrency, "containers": args.containers, "hold_ms": args.hold_ms,
        "rate_per_s_asked": args.rate_per_s or None,
        "cpu_hogs": args.hogs,
        "churn_s": round(ran["churn_s"], 2),
        "consumers_per_s": round(n / ran["churn_s"], 1) if ran["churn_s"] else None,
        "launcher_failures": ran["launcher_failures"],
        "tracer": {
            "alive_at_end": alive,
            "open_records": n - len(match.missing("open")),
            "exit_records": caught,
            "exit_lag_ms": {"p50": _r(percentile(lags_ms, 50)), "p99": _r(percentile(lags_ms, 99)),
                            "max": _r(max(lags_ms, default=None))},
            "false_findings": len(match.with_findings()),
            "wrong_container_id": len(match.wrong_identity()),
            "foreign_records_skipped": match.foreign,
            "cpu_s": tracer_cpu,
            "cpu_ms_per_consumer": round(tracer_cpu * 1000 / n, 3) if tracer_cpu is not None and n else None,
            "agent_errors_total": metric_sum(text, ERRORS_METRIC) if status == 200 else None,
            "ringbuf_drops_total": metric_sum(text, DROPS_METRIC) if status == 200 else None,
            "rss_bytes_after_first": ran["rss_first"].get("tracer"), "rss_bytes_end": rss_end["tracer"],
            "rss_growth_bytes": growth.get("tracer"),
            "drain_s": round(drain_s, 2),
            "tracebacks": stderr_tail.count("Traceback"),
            "stderr_tail": stderr_tail[-1500:],
        },
        "collector": {
            "false_findings": collector_findings,
            "rss_bytes_after_first": ran["rss_first"].get("collector"), "rss_bytes_end": rss_end["collector"],
            "rss_growth_bytes": growth.get("collector"),
        },
        "poller_1s": {"caught": by_poller, "scans": polled["scans"], "cpu_s": polled["cpu_s"],
                      "cpu_ms_per_consumer": round(polled["cpu_s"] * 1000 / n, 3) if n else None},
        "ratio_tracer_exits_vs_poller": round(caught / by_poller, 1) if by_poller else None,
        "rss_after_first_consumers": min(FIRST_BATCH, n),
        "examples": {"missing_open": describe(match.missing("open")),
                     "missing_exit": describe(match.missing("exit")),
                     "false_findings": describe(match.with_findings())},
        "rss_samples": ran["samples"],
    }


def _r(value: float | None) -> float | None:
    return round(value, 1) if value is not None else None


def goals(result: dict[str, Any]) -> dict[str, bool]:
    t, c, n = result["tracer"], result["collector"], result["consumers"]
    p99 = t["exit_lag_ms"]["p99"]
    return {
        "tracer_alive": bool(t["alive_at_end"]),
        "every_open_and_exit": t["open_records"] == n and t["exit_records"] == n,
        "exit_lag_p99_under_100_ms": p99 is not None and p99 < GOAL_EXIT_LAG_P99_MS,
        "no_false_findings": t["false_findings"] == 0 and c["false_findings"] in (0, None),
        "no_agent_errors": t["agent_errors_total"] == 0 and not t["tracebacks"],  # None (absent) fails
        "rss_flat_within_5_mb": all(g is not None and g <= GOAL_RSS_GROWTH_BYTES
                                    for g in (t["rss_growth_bytes"], c["rss_growth_bytes"])),
    }


def report(result: dict[str, Any]) -> None:
    t, c, p, n = result["tracer"], result["collector"], result["poller_1s"], result["consumers"]
    mb = 1e6

    def rss(side: dict[str, Any]) -> str:
        first, end = side["rss_bytes_after_first"], side["rss_bytes_end"]
        return "-" if first is None or end is None else f"{first / mb:.1f} -> {end / mb:.1f} MB"

    lag = t["exit_lag_ms"]
    print_table(["measure", "tracer", "reference: 1 s /proc poller", "ratio", "goal"], [
        ["consumers seen (exit record / sighting)", f"{t['exit_records']} of {n}", f"{p['caught']} of {n}",
         f"{result['ratio_tracer_exits_vs_poller']}x" if result["ratio_tracer_exits_vs_poller"] else "-",
         "all"],
        ["open records", f"{t['open_records']} of {n}", "-", "-", "all"],
        [f"exit lag p50 / p99 / max (ms), of {t['exit_records']} reported",
         f"{lag['p50']} / {lag['p99']} / {lag['max']}", "-", "-", f"p99 < {GOAL_EXIT_LAG_P99_MS:g}"],
        ["false findings (tracer / collector)", f"{t['false_findings']} / {c['false_findings']}", "-", "-",
         "0"],
        ["CPU ms per consumer", t["cpu_ms_per_consumer"], p["cpu_ms_per_consumer"],
         f"{t['cpu_ms_per_consumer'] / p['cpu_ms_per_consumer']:.1f}x"
         if t["cpu_ms_per_consumer"] is not None and p["cpu_ms_per_consumer"] else "-", "-"],
        [f"tracer RSS after {result['rss_after_first_consumers']} -> end", rss(t), "-", "-",
         "flat within 5 MB"],
        [f"collector RSS after {result['rss_after_first_consumers']} -> end", rss(c), "-", "-",
         "flat within 5 MB"],
        ["tracer alive at end / agent errors", f"{t['alive_at_end']} / {t['agent_errors_total']}", "-", "-",
         "True / 0"],
    ])
    print(f"{n} consumers ({result['consumers_failed']} failed) in {result['churn_s']} s = "
          f"{result['consumers_per_s']}/s at concurrency {result['concurrency']}"
          f"{' with CPU hogs' if result['cpu_hogs'] else ''}; drain {t['drain_s']} s; "
          f"ring-buffer drops {t['ringbuf_drops_total']}")
    missed = [name for name, ok in result["goals"].items() if not ok]
    print("goals met" if not missed else f"goals missed: {', '.join(missed)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--count", type=int, default=20_000, help="consumers (half host, half containers)")
    ap.add_argument("--concurrency", type=int, default=16, help="consumers alive at once, all launchers")
    ap.add_argument("--containers", type=int, default=4)
    ap.add_argument("--hold-ms", type=int, default=10)
    ap.add_argument("--rate-per-s", type=float, default=0.0, help="pace consumers (0: as fast as forks go)")
    ap.add_argument("--hogs", action="store_true", help="also a busy loop per core during the churn")
    ap.add_argument("--hog-limit-s", type=float, default=600.0)
    ap.add_argument("--poll-interval-s", type=float, default=1.0)
    ap.add_argument("--drain-deadline-s", type=float, default=60.0)
    ap.add_argument("--keep-going", action="store_true", help="finish the churn even if the tracer died")
    ap.add_argument("--tracer-arg", action="append", help="extra tracer flag (repeat), e.g. --tracer-arg=-v")
    ap.add_argument("--out", default="churn", help="result name under bench/results/")
    ap.add_argument("--soak-min", type=float, help="soak instead: `ghostgpu up --demo` for N minutes")
    ap.add_argument("--soak-churn-per-s", type=float, default=20.0,
                    help="soak: churn consumers per second beside the demo (0: the demo alone)")
    ap.add_argument("--soak-warmup-s", type=float, help="soak: samples before this are not fitted")
    args = ap.parse_args()
    interrupt_on_sigterm()
    problem = preflight()
    if problem:
        print(f"bench_churn: {problem}", file=sys.stderr)
        return 2
    build_churn()  # before any clock starts
    if args.soak_min is not None:
        from bench.churn_soak import soak_main

        return soak_main(args)
    load_1m_at_start = round(os.getloadavg()[0], 2)
    workdir = Path(tempfile.mkdtemp(prefix="ghostgpu-bench-churn-"))
    try:
        result = measure(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["goals"] = goals(result)
    result["machine"] = {**machine(), "loadavg_1m_at_start": load_1m_at_start}
    report(result)
    print(f"wrote {write_json(args.out, result)}")
    return 0 if all(result["goals"].values()) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as exc:
        print(f"bench_churn: interrupted ({exc}); consumers, containers, tracer and collector were stopped",
              file=sys.stderr)
        sys.exit(130)
