"""Soak mode of bench_churn.py (`--soak-min N`): does a long `ghostgpu up --demo` leak memory?

Runs `ghostgpu up --demo` (the collector in the `up` process, the tracer as its child; stdout is a
file, so `up` prints a screen only when something changed) for N minutes with its own unix socket
and database, plus a paced churn of exec'ing short-lived consumers beside it (`--soak-churn-per-s`,
tests/helpers/churn.py): the demo's own short-lived job comes every 3 s only, far too rarely to
show a per-process leak in minutes. Every SAMPLE_S the RSS of each ghostgpu process (`up` and its
tracer, found by parent PID and command line) is read; after the warm-up a least-squares line
through each series gives its slope in MB per hour. Goal: under 1 MB/h for each process and for
their sum, with one tracer PID throughout (a restarted tracer is a crash). The fit's standard
error is printed beside each slope: RSS moves by ~1 MB between samples, so a 2-minute soak only
shows that the harness works (errors of tens of MB/h); telling 1 MB/h apart takes an hour or more.
Writes bench/results/soak.json (`--out` names it soak-<out>); exits 1 over the goal.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import machine, print_table, status_kib, write_json
from tests.helpers.churn import ChurnRun

REPO = Path(__file__).resolve().parent.parent
NODE = "soak-node"
SAMPLE_S = 5.0
START_DEADLINE_S = 180.0  # BPF compile, the demo's plants and the first view on a loaded 2-core VM
GOAL_SLOPE_MB_PER_H = 1.0
STOP_DEADLINE_S = 30.0


def children(pid: int) -> list[int]:
    """Direct children of pid (all threads' children files)."""
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    return out


def ghostgpu_processes(up_pid: int) -> dict[str, list[int]]:
    """role -> PIDs: `up` itself, and the `ghostgpu ... tracer` processes below it. A tracer's own
    children are not walked: its forked /proc scan workers carry its command line for a moment."""
    roles: dict[str, list[int]] = {"up": [up_pid], "tracer": []}
    todo = children(up_pid)
    while todo:
        pid = todo.pop()
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"ghostgpu.cli" in argv and b"tracer" in argv:
                roles["tracer"].append(pid)
                continue
        todo += children(pid)
    return roles


def slope_mb_per_h(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares slope of (t_s, rss_bytes) in MB per hour and its standard error (from the
    residuals: a short soak cannot tell 1 MB/h from RSS noise, and the error says so); None for
    fewer than 3 points."""
    if len(points) < 3:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var_t = sum((t - mean_t) ** 2 for t, _ in points)
    if var_t == 0:
        return None
    slope = sum((t - mean_t) * (y - mean_y) for t, y in points) / var_t
    residual = sum((y - mean_y - slope * (t - mean_t)) ** 2 for t, y in points)
    stderr = (residual / (n - 2) / var_t) ** 0.5
    per_h = 3600 / 1e6
    return round(slope * per_h, 3), round(stderr * per_h, 3)


def start_up(workdir: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "FAKE_NVML_CONFIG")}
    cmd = [sys.executable, "-m", "ghostgpu.cli", "up", "--demo", "--listen", f"unix://{workdir}/up.sock",
           "--db", str(workdir / "up.db"), "--node-name", NODE]
    with open(workdir / "up.stdout", "wb") as out, open(workdir / "up.stderr", "wb") as err:
        # A session of its own: the teardown can signal `up`, its tracer and the demo's plants at once.
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=REPO, env=env,
                                start_new_session=True)


def wait_attached(up: subprocess.Popen[bytes], workdir: Path) -> float:
    """Seconds until `up`'s view says BPF is attached; raises with its stderr past the deadline."""
    t0 = time.monotonic()
    while b"BPF tracepoints attached" not in (workdir / "up.stdout").read_bytes():
        if up.poll() is not None or time.monotonic() - t0 > START_DEADLINE_S:
            err = (workdir / "up.stderr").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"ghostgpu up --demo did not attach in {START_DEADLINE_S} s "
                               f"(rc={up.poll()}): {err}")
        time.sleep(0.2)  # polling interval of a deadline loop
    return time.monotonic() - t0


def stop_up(up: subprocess.Popen[bytes]) -> int | None:
    """SIGTERM `up` (it stops its tracer and removes the demo), SIGKILL its session past the deadline."""
    if up.poll() is None:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(STOP_DEADLINE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(up.pid, signal.SIGKILL)
            up.wait()
    return up.returncode


def tracer_lines(view_path: Path, limit: int = 20) -> list[str]:
    """What `up`'s view said about its tracer exiting or restarting (the supervisor writes it there)."""
    seen: dict[str, None] = {}
    for line in view_path.read_text(errors="replace").splitlines():
        if "tracer" in line and any(word in line for word in ("exited", "restart", "died")):
            seen.setdefault(line.strip(), None)
    return list(seen)[-limit:]


def sample(up_pid: int, t_s: float) -> dict[str, Any]:
    roles = ghostgpu_processes(up_pid)
    row: dict[str, Any] = {"t_s": round(t_s, 1), "pids": roles}
    for role, pids in roles.items():
        kib = [status_kib(pid, "VmRSS") for pid in pids]
        row[f"{role}_rss_bytes"] = sum(k for k in kib if k is not None) * 1024 if pids else None
    return row


def soak(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    duration_s = args.soak_min * 60
    warmup_s = args.soak_warmup_s if args.soak_warmup_s is not None else min(600.0, max(30.0, duration_s / 5))
    samples: list[dict[str, Any]] = []
    up = start_up(workdir)
    try:
        attach_s = wait_attached(up, workdir)
        with contextlib.ExitStack() as stack:
            if args.soak_churn_per_s > 0:
                count = max(2, int(args.soak_churn_per_s * duration_s))
                stack.enter_context(ChurnRun(workdir, count, concurrency=4, containers=2, hold_ms=10,
                                             rate_per_s=args.soak_churn_per_s))
            t0 = time.monotonic()
            while (now := time.monotonic() - t0) < duration_s and up.poll() is None:
                samples.append(sample(up.pid, now))
                time.sleep(max(0.0, SAMPLE_S - (time.monotonic() - t0 - now)))  # the sampling period
            ran_s = time.monotonic() - t0
        alive = up.poll() is None
    finally:
        rc = stop_up(up)
    fitted = [s for s in samples if s["t_s"] >= warmup_s]
    fits: dict[str, tuple[float, float] | None] = {}
    for role in ("up", "tracer"):
        fits[role] = slope_mb_per_h([(s["t_s"], s[f"{role}_rss_bytes"]) for s in fitted
                                     if s[f"{role}_rss_bytes"] is not None])
    fits["total"] = slope_mb_per_h([(s["t_s"], s["up_rss_bytes"] + s["tracer_rss_bytes"]) for s in fitted
                                    if s["up_rss_bytes"] is not None and s["tracer_rss_bytes"] is not None])
    tracer_pids = {pid for s in samples for pid in s["pids"]["tracer"]}
    return {
        "bench": "soak", "minutes": args.soak_min, "warmup_s": warmup_s, "sample_s": SAMPLE_S,
        "churn_per_s": args.soak_churn_per_s, "attach_s": round(attach_s, 1), "ran_s": round(ran_s, 1),
        "up_alive_at_end": alive, "up_exit_status": rc, "tracer_pids_seen": sorted(tracer_pids),
        "samples_fitted": len(fitted),
        "rss_slope_mb_per_h": {role: fit[0] if fit else None for role, fit in fits.items()},
        "rss_slope_stderr_mb_per_h": {role: fit[1] if fit else None for role, fit in fits.items()},
        "rss_bytes_first_fitted": _rss_of(fitted[0]) if fitted else None,
        "rss_bytes_last": _rss_of(samples[-1]) if samples else None,
        "up_stderr_tail": (workdir / "up.stderr").read_text(errors="replace")[-1500:],
        "up_view_tracer_lines": tracer_lines(workdir / "up.stdout"),
        "samples": [{k: v for k, v in s.items() if k != "pids"} for s in samples],
    }


def soak_main(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="ghostgpu-bench-soak-"))
    try:
        result = soak(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    slopes, errors = result["rss_slope_mb_per_h"], result["rss_slope_stderr_mb_per_h"]
    result["goal_met"] = (result["up_alive_at_end"] and len(result["tracer_pids_seen"]) == 1
                          and all(v is not None and v < GOAL_SLOPE_MB_PER_H for v in slopes.values()))
    result["machine"] = machine()
    first, last = result["rss_bytes_first_fitted"] or {}, result["rss_bytes_last"] or {}
    print_table(["process", "RSS after warm-up (MB)", "RSS at end (MB)", "slope ± stderr (MB/h)", "goal"], [
        [role, _mb(first.get(role)), _mb(last.get(role)), f"{slopes[role]} ± {errors[role]}",
         f"< {GOAL_SLOPE_MB_PER_H:g}"] for role in ("up", "tracer")]
        + [["both", "-", "-", f"{slopes['total']} ± {errors['total']}", f"< {GOAL_SLOPE_MB_PER_H:g}"]])
    print(f"ghostgpu up --demo for {args.soak_min:g} min with {args.soak_churn_per_s:g} churn consumers/s; "
          f"{result['samples_fitted']} samples after a {result['warmup_s']:g} s warm-up; up alive at end: "
          f"{result['up_alive_at_end']}; tracer PIDs seen: {result['tracer_pids_seen']}")
    if not result["up_alive_at_end"]:
        print(f"ghostgpu up exited with status {result['up_exit_status']} after {result['ran_s']:g} s; "
              f"its stderr ends:\n{result['up_stderr_tail'][-600:]}")
    name = "soak" if args.out == "churn" else f"soak-{args.out}"
    print(f"wrote {write_json(name, result)}")
    return 0 if result["goal_met"] else 1


def _rss_of(row: dict[str, Any]) -> dict[str, int | None]:
    return {role: row[f"{role}_rss_bytes"] for role in ("up", "tracer")}


def _mb(value: int | None) -> str:
    return f"{value / 1e6:.1f}" if value is not None else "-"
