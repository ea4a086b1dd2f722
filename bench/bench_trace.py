"""What a trace session (docs/TRACE.md) costs: per traced GPU ioctl, to processes outside every
session, to start, and at ~200k calls/s. Run as root: python bench/bench_trace.py [--quick | --full].

Parts 1-4: the kernel side is loaded in-process (`BpfSource.start()`), and `TraceSessions` is wired to it as
`tracer/node.py start_trace_sessions()` does, with an `emit` that counts records and returns True
(no stream: what is measured is the kernel side and the session thread). The workload is
tests/helpers/gpucalls.c (`--spin M`: M RM_CONTROL ioctls on /dev/nvidiactl, a `c 1 3` node in a
private /dev) and two small C programs compiled here: `loop` (non-GPU ioctl and openat+close) and
`pacer` (gpucalls' spin call, RM_CONTROL with the same NVOS54 block, paced to a rate). Modes take
turns within every round; figures are medians over rounds. The bench process is pinned to CPU 0
(the session thread, the poll loop), measured workloads to CPU 1 (strace with its tracee: the
cheapest placement for strace, ptrace stops switch on one CPU). Never asserts a speed.

1. ns per traced ioctl (gpucalls' own figure): no BPF | BPF, no session | a session on the
   workload's pid | `strace -f -qq -e trace=ioctl -o /dev/null` with BPF detached.
2. Processes outside every session: ioctl(FIONREAD) on a pipe, openat+close of /dev/null, per op in
   CPU time of the loop (wall time beside it): BPF, no session vs BPF with a session running on
   another, spinning, in-scope process (no BPF at all as the floor).
3. Session start on a warm tracer, the workload spinning: handle(trace_start) -> first record
   through emit, p50/p99.
4. Throughput: the pacer at --rate calls/s in scope for --duration-s: records delivered/s, drops
   (ring buffer, limit), CPU of the session thread and of the process; meanwhile fresh processes
   open /dev/nvidiactl and the main thread times open -> OPEN out of BpfSource.poll(), against the
   same openers with the pacer running outside any session.
5. The same workload through the real pipeline, with the in-process BPF of 1-4 unloaded:
   `ghostgpu collector` (SQLite file in a temp dir) and `ghostgpu tracer --bpf on` (fake NVML saying
   the pacer's driver release) as processes, and the pacer traced by the CLI as a user runs it,
   `ghostgpu trace --node bench --pid PID --for (duration + tail)s -o jsonl > file` (the three record
   limits raised to --max-records). Records delivered (lines the CLI wrote) and per second of the
   workload, the session's counters from `ghostgpu trace list -o json` (records stored; dropped:
   ring buffer, limit, transport, store), CPU (utime+stime of /proc/PID/stat, reaped children
   included) of the collector, the tracer and the CLI over the workload's window and up to the CLI's
   exit, and meanwhile fresh openers of /dev/nvidiactl: open (the record's ts_ns, CLOCK_BOOTTIME) ->
   its `open` line seen in the tracer's --jsonl file (read every --jsonl-poll-s on the bench's CPU).
   Reference: the same with the pacer outside any session (no CLI). The agents and the CLI are not
   pinned (every CPU, as on a node); the pacer and the openers run on CPU 1.

Writes bench/results/trace.json (--parts picks parts, for a smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ghostgpu.tracer.bpf_source import BpfSource  # noqa: E402
from ghostgpu.tracer.cgroup import CgroupIdResolver  # noqa: E402
from ghostgpu.tracer.config import TracerConfig  # noqa: E402
from ghostgpu.tracer.devices import classify_device_path  # noqa: E402
from ghostgpu.tracer.events import EventKind, boot_ns  # noqa: E402
from ghostgpu.tracer.trace_records import RecordMaker  # noqa: E402
from ghostgpu.tracer.trace_sessions import NodeTraceLimits, TraceSessions  # noqa: E402

from bench.bench_syscall_cost import Attachment, foreign_bpf_programs  # noqa: E402
from bench.common import (  # noqa: E402
    CLK_TCK,
    cpu_ticks,
    interrupt_on_sigterm,
    machine,
    preflight,
    print_table,
    write_json,
)
from ghostgpu.v1 import stream_pb2, trace_pb2  # noqa: E402
from tests.helpers.collector_proc import CollectorProcess, _clean_env  # noqa: E402
from tests.helpers.fakenvml import FakeGpu, FakeNvml  # noqa: E402
from tests.helpers.gpucalls import GpuCalls, GpuCallsOptions, build_gpucalls  # noqa: E402
from tests.helpers.tracer_proc import TracerProcess  # noqa: E402

DRIVER = "595.45.04"  # gpucalls' default layouts; the session decodes with the same release
PRIVATE_DEV = {"nvidiactl": (1, 3)}
WORK_CPU, BENCH_CPU = 1, 0
ALL_CPUS = os.sched_getaffinity(0)  # before main() pins the bench to BENCH_CPU
NODE = "bench"  # part 5's tracer --node-name
GPU0_UUID = "GPU-0a1b2c3d-0000-4000-8000-000000000000"
GOAL_ATTRIBUTION_P99_MS = 100.0  # no attribution event delayed past it while a session runs
# Part 2's goal is "unchanged": read as within 5% of the same loop with BPF and no session.
GOAL_OUTSIDE_RATIO_MAX = 1.05
DROP_KEYS = ("dropped_ringbuf_total", "dropped_limit_total", "dropped_transport_total", "dropped_store_total")

HELPERS_C = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

static double ns_of(clockid_t clk) {
    struct timespec ts;
    clock_gettime(clk, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

/* loop ioctl|open N: N ioctl(FIONREAD) on a pipe, or N openat+close of /dev/null. */
static int loop(int argc, char **argv) {
    if (argc != 4) return 2;
    int open_mode = strcmp(argv[2], "open") == 0;
    long n = atol(argv[3]);
    int p[2], avail = 0;
    if (pipe(p) < 0) return 3;
    double w0 = ns_of(CLOCK_MONOTONIC), c0 = ns_of(CLOCK_PROCESS_CPUTIME_ID);
    for (long i = 0; i < n; i++) {
        if (open_mode) {
            int f = open("/dev/null", O_RDONLY);
            close(f);
        } else {
            ioctl(p[0], FIONREAD, &avail);
        }
    }
    double c1 = ns_of(CLOCK_PROCESS_CPUTIME_ID), w1 = ns_of(CLOCK_MONOTONIC);
    printf("{\"wall_ns\": %.2f, \"cpu_ns\": %.2f}\n", (w1 - w0) / n, (c1 - c0) / n);
    return 0;
}

/* pacer RATE SECONDS: own mount namespace with /dev/nvidiactl as `c 1 3` on a tmpfs /dev, then
 * "ready PID", a line on stdin, and gpucalls' --spin call (RM_CONTROL, NVOS54 block: hClient@0
 * hObject@4 cmd@8 flags@12 params@16 paramsSize@24 status@28) at RATE calls/s, issued each
 * millisecond for the calls due by then. */
static int pacer(int argc, char **argv) {
    if (argc != 4) return 2;
    double rate = atof(argv[2]), secs = atof(argv[3]);
    if (unshare(CLONE_NEWNS) < 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) return 3;
    if (mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=64k") < 0) return 3;
    if (mknod("/dev/nvidiactl", S_IFCHR | 0666, makedev(1, 3)) < 0) return 3;
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof(line), stdin)) return 4;
    int fd = open("/dev/nvidiactl", O_RDWR | O_CLOEXEC);
    if (fd < 0) return 5;
    _Alignas(8) unsigned char blk[32] = {0}, params[64] = {0};
    uint32_t h_client = 0xc1d00001, h_subdev = 0xc1d00003, cmd = 0x20800403, psize = 8;
    uint64_t pp = (uint64_t)(uintptr_t)params;
    memcpy(blk, &h_client, 4), memcpy(blk + 4, &h_subdev, 4), memcpy(blk + 8, &cmd, 4);
    memcpy(blk + 16, &pp, 8), memcpy(blk + 24, &psize, 4);
    unsigned long request = (3ul << 30) | (32ul << 16) | (0x46ul << 8) | 42ul;
    long done = 0;
    double busy = 0, t0 = ns_of(CLOCK_MONOTONIC), el = 0;
    while ((el = (ns_of(CLOCK_MONOTONIC) - t0) / 1e9) < secs) {
        long due = (long)(rate * el) + 1;
        double b0 = ns_of(CLOCK_MONOTONIC);
        long burst = due - done;
        for (; done < due; done++) (void)ioctl(fd, request, blk);
        if (burst > 0) busy += ns_of(CLOCK_MONOTONIC) - b0;
        double next_ms = (double)((long)(el * 1000) + 1) / 1000;
        double target = t0 + next_ms * 1e9;
        struct timespec ts = {(time_t)(target / 1e9), (long)((long long)target % 1000000000LL)};
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL);
    }
    close(fd);
    printf("{\"calls\": %ld, \"seconds\": %.4f, \"busy_ns_per_call\": %.1f}\n", done, el,
           done ? busy / done : 0.0);
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "loop") == 0) return loop(argc, argv);
    if (argc > 1 && strcmp(argv[1], "pacer") == 0) return pacer(argc, argv);
    fprintf(stderr, "usage: helpers loop ioctl|open N | helpers pacer RATE SECONDS\n");
    return 2;
}
"""


# --- small helpers --------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); with 20 values p99 is the largest."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, int(-(-q * len(ordered) // 100)) - 1))]


def med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def rnd(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def build_helpers(workdir: Path) -> Path:
    src, exe = workdir / "helpers.c", workdir / "helpers"
    src.write_text(HELPERS_C)
    subprocess.run(["gcc", "-O2", "-Wall", "-o", str(exe), str(src)], check=True)
    return exe


def pinned(cpu: int) -> list[str]:
    return ["taskset", "-c", str(cpu)] if shutil.which("taskset") and (os.cpu_count() or 1) > 1 else []


class Counting:
    """The `emit` of the sessions: counts records per session, notes the first record's time, the
    running drop counters and the last batch. Runs on the session thread; returns True (sent)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sessions: dict[str, dict[str, Any]] = {}
        self.first = threading.Event()
        self.ended = threading.Event()

    def expect(self, session: str) -> None:
        with self.lock:
            self.sessions[session] = self._blank()
            self.first.clear()
            self.ended.clear()

    def __call__(self, msg: stream_pb2.TracerMessage) -> bool:
        now = time.monotonic()
        batch = msg.trace
        with self.lock:
            s = self.sessions.setdefault(batch.session, self._blank())
            s["batches"] += 1
            s["records"] += len(batch.records)
            s["ringbuf"], s["limit"] = batch.dropped_ringbuf_total, batch.dropped_limit_total
            if batch.records and s["first_s"] is None:
                s["first_s"], s["first_batch_records"] = now, len(batch.records)
                self.first.set()
            if batch.ended:
                s["ended"], s["ended_s"] = True, now
                self.ended.set()
        return True

    @staticmethod
    def _blank() -> dict[str, Any]:
        return {"records": 0, "first_s": None, "first_batch_records": 0, "ringbuf": 0, "limit": 0,
                "ended": False, "ended_s": None, "batches": 0}

    def get(self, session: str) -> dict[str, Any]:
        with self.lock:
            return dict(self.sessions.get(session, {}))


def start_openers(count: int, duration_s: float, binary: Path, stop: threading.Event, errors: list[str],
                  on_ready: Callable[[int, int], None]) -> threading.Thread:
    """`count` fresh processes that open the GPU device files (gpucalls, spin 0, on the work CPU),
    spread over the window; on_ready(pid, CLOCK_BOOTTIME ns before it started) for each. Parts 4
    and 5 time the attribution path with them."""
    def launch() -> None:
        gap = max(duration_s - 1.0, 0.5) / max(count, 1)
        time.sleep(0.5)
        for _ in range(count):
            if stop.is_set():
                return
            try:
                before = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
                opts = GpuCallsOptions(driver=DRIVER, spin=0, private_dev=PRIVATE_DEV)
                with GpuCalls(opts, prefix=pinned(WORK_CPU), binary=binary) as run:
                    ready = run.wait_ready(10.0)
                    on_ready(ready.pid, before)
                    run.release()
                    run.wait_done(10.0)
                    run.wait_exit(10.0)
            except Exception as exc:
                errors.append(str(exc).splitlines()[0])
            time.sleep(gap)

    launcher = threading.Thread(target=launch, name="bench-openers", daemon=True)
    launcher.start()
    return launcher


class Bench:
    def __init__(self, args: argparse.Namespace, helpers: Path) -> None:
        self.args, self.helpers = args, helpers
        self.gpucalls = build_gpucalls()
        self.source = BpfSource(("/dev/nvidia",), classify=classify_device_path)
        self.source.start()
        if self.source.trace is None:
            raise RuntimeError(self.source.trace_error or "trace sessions unavailable")
        kernel = self.source.trace
        self.attachment = Attachment(self.source._bpf)  # detaches every tracepoint: attach again
        self.attachment.attach()
        cgroups = CgroupIdResolver()
        maker = RecordMaker("bench", "/proc", cgroups, classify_device_path, kernel.dev_paths,
                            lambda minor: (str(minor), ""))
        # The tracer's defaults, but the records limit this run asks for.
        self.limits = replace(NodeTraceLimits.of(TracerConfig(node_name="bench")),
                              max_records=args.max_records)
        self.emit = Counting()
        self.sessions = TraceSessions(kernel, "bench", self.limits, maker, cgroups, self.emit,
                                      lambda: DRIVER)
        self._ids = 0

    def close(self) -> None:
        self.sessions.close()
        self.source.close()

    # --- sessions ----------------------------------------------------------------------------

    def start_session(self, pid: int, seconds: float = 120.0) -> str:
        self._ids += 1
        sid = f"b-{os.getpid()}-{self._ids}"
        self.emit.expect(sid)
        result = self.sessions.handle(stream_pb2.Command(trace_start=trace_pb2.TraceStart(
            session=sid, pid=pid, deadline_unix_ns=time.time_ns() + int(seconds * 1e9),
            max_records=self.args.max_records)))
        if result.error:
            raise RuntimeError(f"trace_start: {result.error}")
        return sid

    def stop_session(self, sid: str, timeout_s: float = 10.0) -> dict[str, Any]:
        self.sessions.handle(stream_pb2.Command(trace_stop=trace_pb2.TraceStop(session=sid)))
        deadline = time.monotonic() + timeout_s
        while not self.emit.get(sid).get("ended") and time.monotonic() < deadline:
            self.emit.ended.wait(0.05)
        return self.emit.get(sid)

    def lazy_hooks_attached(self) -> bool:
        return bool(self.source.trace.attached)

    def drain(self) -> None:
        """Take what the attribution ring buffer holds (nothing reads it between measurements)."""
        self.source.poll(0)

    # --- workloads -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def spinner(self, calls: int, prefix: list[str]) -> Iterator[GpuCalls]:
        opts = GpuCallsOptions(driver=DRIVER, spin=calls, private_dev=PRIVATE_DEV)
        with GpuCalls(opts, prefix=prefix, binary=self.gpucalls) as run:
            run.wait_ready(10.0)
            yield run

    def spin_once(self, calls: int, mode: str) -> dict[str, Any]:
        """One gpucalls --spin, released once its mode is set up; its ns/call (+ the session's counts)."""
        prefix = pinned(WORK_CPU)
        if mode == "strace":
            prefix += ["strace", "-f", "-qq", "-e", "trace=ioctl", "-o", "/dev/null", "--"]
        out: dict[str, Any] = {}
        with self.spinner(calls, prefix) as run:
            sid = self.start_session(run.workload_pid) if mode == "session" else None
            run.release()
            run.wait_done(120.0)
            spin = run.spin_result()
            run.wait_exit(10.0)
            if sid is not None:
                s = self.stop_session(sid)
                out.update(records=s["records"], dropped_ringbuf=s["ringbuf"], dropped_limit=s["limit"])
        if not spin:
            raise RuntimeError(f"gpucalls gave no spin result ({mode})")
        out["ns_per_call"] = float(spin["ns_per_call"])
        return out

    def loop_once(self, op: str, iterations: int) -> dict[str, float]:
        cmd = [*pinned(WORK_CPU), str(self.helpers), "loop", op, str(iterations)]
        return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)

    # --- 1. per traced ioctl ------------------------------------------------------------------

    def per_call(self) -> dict[str, Any]:
        a = self.args
        modes = ("none", "bpf", "session", "strace")
        rounds: list[dict[str, Any]] = []
        for _ in range(a.rounds):
            row: dict[str, Any] = {}
            for mode in modes:
                if mode in ("none", "strace"):
                    self.attachment.detach()
                try:
                    row[mode] = self.spin_once(a.strace_spin if mode == "strace" else a.spin, mode)
                finally:
                    if mode in ("none", "strace"):
                        self.attachment.attach()
                self.drain()
            row["foreign_bpf_programs"] = foreign_bpf_programs()
            rounds.append(row)
        ns = {m: med([r[m]["ns_per_call"] for r in rounds]) for m in modes}
        added = {m: ns[m] - ns["none"] for m in modes[1:]}
        paired = {m: med([r[m]["ns_per_call"] - r["none"]["ns_per_call"] for r in rounds]) for m in modes[1:]}
        ratio = med([(r["session"]["ns_per_call"] - r["none"]["ns_per_call"])
                     / max(r["strace"]["ns_per_call"] - r["none"]["ns_per_call"], 1e-9) for r in rounds])
        recs = [r["session"] for r in rounds]
        return {
            "spin_calls": a.spin, "strace_spin_calls": a.strace_spin,
            "ns_per_call_median": {m: rnd(v) for m, v in ns.items()},
            "added_ns_median": {m: rnd(v) for m, v in added.items()},
            "added_ns_median_of_rounds": {m: rnd(v) for m, v in paired.items()},
            "ratio_added_session_vs_strace": rnd(added["session"] / max(added["strace"], 1e-9), 4),
            "ratio_added_session_vs_strace_median_of_rounds": rnd(ratio, 4),
            "goal_ratio_max": 0.1,
            "session_records_delivered": [r["records"] for r in recs],
            "session_dropped_ringbuf": [r["dropped_ringbuf"] for r in recs],
            "session_dropped_limit": [r["dropped_limit"] for r in recs],
            "ns_per_call_min": {m: min(r[m]["ns_per_call"] for r in rounds) for m in modes},
            "rounds": [{**{m: r[m]["ns_per_call"] for m in modes},
                        "foreign_bpf_programs": r["foreign_bpf_programs"]} for r in rounds],
        }

    # --- 2. outside every session -----------------------------------------------------------

    def outside(self) -> dict[str, Any]:
        a = self.args
        iterations = {"ioctl": a.loop_iterations, "open": a.open_iterations}
        modes = ("none", "bpf", "session")
        rounds: list[dict[str, dict[str, dict[str, float]]]] = []
        hooks_during_session: list[bool] = []
        # The in-scope process spins on the bench's CPU (with the session thread) all along, in
        # every mode; only whether a session runs on it changes.
        with self.spinner(10**12, pinned(BENCH_CPU)) as spin:
            spin.release()
            time.sleep(0.2)
            for _ in range(a.rounds):
                row: dict[str, dict[str, dict[str, float]]] = {op: {} for op in iterations}
                for mode in modes:
                    sid = None
                    if mode == "none":
                        self.attachment.detach()
                    elif mode == "session":
                        sid = self.start_session(spin.workload_pid)
                        time.sleep(0.1)
                        hooks_during_session.append(self.lazy_hooks_attached())
                    try:
                        for op, n in iterations.items():
                            row[op][mode] = self.loop_once(op, n)
                    finally:
                        if mode == "none":
                            self.attachment.attach()
                        if sid is not None:
                            self.stop_session(sid)
                    self.drain()
                row["foreign_bpf_programs"] = foreign_bpf_programs()  # type: ignore[assignment]
                rounds.append(row)
        out: dict[str, Any] = {"iterations": iterations,
                               "lazy_hooks_attached_during_session": all(hooks_during_session),
                               "goal_ratio_session_vs_bpf_max": GOAL_OUTSIDE_RATIO_MAX}
        for clock in ("cpu_ns", "wall_ns"):
            per: dict[str, Any] = {}
            for op in iterations:
                ns = {m: med([r[op][m][clock] for r in rounds]) for m in modes}
                per[op] = {
                    "ns_per_op_median": {m: rnd(v, 2) for m, v in ns.items()},
                    "ns_per_op_min": {m: rnd(min(r[op][m][clock] for r in rounds), 2) for m in modes},
                    "ratio_session_vs_bpf": rnd(ns["session"] / ns["bpf"], 3),
                    "ratio_session_vs_bpf_median_of_rounds": rnd(
                        med([r[op]["session"][clock] / r[op]["bpf"][clock] for r in rounds]), 3),
                    "added_ns_session_vs_bpf": rnd(ns["session"] - ns["bpf"], 2),
                    "added_ns_bpf_vs_none": rnd(ns["bpf"] - ns["none"], 2),
                }
            out[clock] = per
        out["rounds"] = rounds
        return out

    # --- 3. session start ---------------------------------------------------------------------

    def start_latency(self) -> dict[str, Any]:
        a = self.args
        starts: list[float] = []
        handle: list[float] = []
        stops: list[float] = []
        first_batches: list[int] = []
        warmup: float | None = None
        with self.spinner(10**12, pinned(WORK_CPU)) as spin:
            spin.release()
            time.sleep(0.2)
            for k in range(a.starts + 1):
                t0 = time.monotonic()
                sid = self.start_session(spin.workload_pid)
                t1 = time.monotonic()
                self.emit.first.wait(10.0)
                got = self.emit.get(sid)
                first = got["first_s"]
                t2 = time.monotonic()
                self.stop_session(sid)
                t3 = time.monotonic()
                self.drain()
                if first is None:
                    raise RuntimeError("no record within 10 s of a session start")
                if k == 0:
                    warmup = first - t0
                    continue
                starts.append(first - t0)
                first_batches.append(got["first_batch_records"])
                handle.append(t1 - t0)
                stops.append(t3 - t2)
                time.sleep(0.05)
        return {
            "starts": len(starts),
            "first_record_s": {"p50": rnd(percentile(starts, 50), 4), "p99": rnd(percentile(starts, 99), 4),
                               "max": rnd(max(starts), 4)},
            "handle_s": {"p50": rnd(percentile(handle, 50), 4), "p99": rnd(percentile(handle, 99), 4)},
            "stop_to_last_batch_s": {"p50": rnd(percentile(stops, 50), 4),
                                     "p99": rnd(percentile(stops, 99), 4)},
            "first_start_s": rnd(warmup, 4),
            "goal_p50_s": 1.0,
            "values_s": [round(v, 4) for v in starts],
            "first_batch_records": first_batches,
        }

    # --- 4. throughput + attribution latency --------------------------------------------------

    def throughput(self, with_session: bool) -> dict[str, Any]:
        a = self.args
        cmd = [*pinned(WORK_CPU), str(self.helpers), "pacer", str(a.rate), str(a.duration_s)]
        pacer = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        openers: dict[int, float | None] = {}  # pid -> latency s, once its OPEN came out of poll()
        launcher_errors: list[str] = []
        stop = threading.Event()
        try:
            assert pacer.stdout is not None and pacer.stdin is not None
            line = pacer.stdout.readline().decode()
            if not line.startswith("ready "):
                raise RuntimeError(f"pacer: {line!r} {pacer.stderr.read().decode() if pacer.stderr else ''}")
            pid = int(line.split()[1])
            sid = self.start_session(pid, seconds=a.duration_s + 60) if with_session else None
            self.drain()
            thread = self.sessions._thread
            clock = time.pthread_getcpuclockid(thread.ident) if thread.ident else None
            cpu0 = os.times()
            thread0 = time.clock_gettime(clock) if clock is not None else 0.0
            wall0 = time.monotonic()
            pacer.stdin.write(b"\n")
            pacer.stdin.flush()

            launcher = start_openers(a.openers, a.duration_s, self.gpucalls, stop, launcher_errors,
                                     lambda pid, _before_ns: openers.__setitem__(pid, None))
            # The agent's loop, reduced to the part measured: poll the attribution ring buffer.
            while pacer.poll() is None or launcher.is_alive():
                for event in self.source.poll(50):
                    if event.kind == EventKind.OPEN and event.pid in openers and openers[event.pid] is None:
                        openers[event.pid] = (boot_ns() - event.ts_ns) / 1e9
            pacer_out = json.loads(pacer.stdout.read().decode().strip().splitlines()[-1])
            pacer_end = time.monotonic()
            session: dict[str, Any] = {}
            if sid is not None:
                session = self.stop_session(sid, timeout_s=60.0)
            wall = time.monotonic() - wall0
            cpu1 = os.times()
            thread_cpu = (time.clock_gettime(clock) - thread0) if clock is not None else None
        finally:
            stop.set()
            if pacer.poll() is None:
                pacer.kill()
            pacer.wait()
        process_cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
        latencies = [v for v in openers.values() if v is not None]
        out: dict[str, Any] = {
            "rate_target": a.rate,
            "rate_actual": rnd(pacer_out["calls"] / pacer_out["seconds"], 0),
            "calls": pacer_out["calls"],
            "pacer_busy_ns_per_call": pacer_out["busy_ns_per_call"],
            "wall_s": rnd(wall, 3),
            "session_thread_cpu_s": rnd(thread_cpu, 3),
            "process_cpu_s": rnd(process_cpu, 3),
            "process_cpu_pct_of_one_core": rnd(100 * process_cpu / wall, 1),
            "session_thread_cpu_pct_of_one_core": (rnd(100 * thread_cpu / wall, 1)
                                                   if thread_cpu is not None else None),
            "openers": len(openers),
            "openers_seen": len(latencies),
            "opener_errors": launcher_errors,
            "open_to_poll_ms": {"p50": rnd(1000 * percentile(latencies, 50), 2) if latencies else None,
                                "p99": rnd(1000 * percentile(latencies, 99), 2) if latencies else None,
                                "max": rnd(1000 * max(latencies), 2) if latencies else None},
            "open_to_poll_ms_values": [round(1000 * v, 2) for v in latencies],
        }
        if sid is not None:
            records = session.get("records", 0)
            out.update(
                records_delivered=records,
                records_per_s=rnd(records / pacer_out["seconds"], 0),
                dropped_ringbuf=session.get("ringbuf"),
                dropped_limit=session.get("limit"),
                last_batch_after_pacer_end_s=(rnd(session["ended_s"] - pacer_end, 3)
                                              if session.get("ended_s") else None),
                records_vs_calls=rnd(records / max(pacer_out["calls"], 1), 4),
            )
        return out


# --- 5. the real pipeline: collector + tracer + `ghostgpu trace` ----------------------------------


@contextlib.contextmanager
def on_cpus(cpus: set[int]) -> Iterator[None]:
    """Run the block on `cpus`: a process started from it inherits them (this thread's mask)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def proc_cpu_s(pid: int) -> float | None:
    """utime+stime (and its reaped children's) of a process, in seconds; None once it is gone."""
    own, children = cpu_ticks(pid), cpu_ticks(pid, children=True)
    return (own + (children or 0)) / CLK_TCK if own is not None else None


def exited_cpu_s(proc: subprocess.Popen[bytes], timeout_s: float) -> float | None:
    """Wait for `proc` to exit without reaping it, read its CPU (a zombie's /proc/PID/stat keeps the
    process's utime+stime), then reap it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is not None:
            cpu = proc_cpu_s(proc.pid)
            proc.wait()
            return cpu
        time.sleep(0.05)  # polling interval of a deadline loop
    raise RuntimeError(f"pid {proc.pid} did not exit in {timeout_s} s")


class JsonlWatch:
    """Polls the tracer's --jsonl file every `poll_s` on its own thread, as a reader of it would, and
    notes every `open` record: (pid, ts_ns of the open, CLOCK_BOOTTIME ns when the line was seen)."""

    def __init__(self, path: Path, poll_s: float) -> None:
        self.path, self.poll_s = path, poll_s
        self.offset = path.stat().st_size if path.exists() else 0
        self.opens: list[tuple[int, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-jsonl", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        buf = b""
        while not self._stop.is_set():
            try:
                with open(self.path, "rb") as f:
                    f.seek(self.offset)
                    chunk = f.read()
            except FileNotFoundError:
                chunk = b""
            if chunk:
                seen_ns = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
                self.offset += len(chunk)
                *lines, buf = (buf + chunk).split(b"\n")
                for line in lines:
                    if b'"open"' in line:
                        rec = json.loads(line)
                        if rec.get("event") == "open":
                            self.opens.append((int(rec["pid"]), int(rec["ts_ns"]), seen_ns))
            self._stop.wait(self.poll_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def latency_s(self, pid: int, after_boot_ns: int) -> float | None:
        """open -> line seen, for the first open of `pid` at or after `after_boot_ns` (PIDs are reused)."""
        for p, ts_ns, seen_ns in list(self.opens):
            if p == pid and ts_ns >= after_boot_ns:
                return (seen_ns - ts_ns) / 1e9
        return None


class ViaCollector:
    """`ghostgpu collector` and `ghostgpu tracer` (BPF on, fake NVML saying the pacer's driver
    release) as processes, the CLI as a user runs it; the in-process BPF of parts 1-4 is unloaded."""

    def __init__(self, args: argparse.Namespace, helpers: Path, workdir: Path, stack: contextlib.ExitStack,
                 ) -> None:
        self.args, self.helpers, self.workdir = args, helpers, workdir
        self.gpucalls = build_gpucalls()
        (workdir / "tracer").mkdir(parents=True, exist_ok=True)
        nvml = FakeNvml(workdir / "nvml.conf", gpus=[FakeGpu(index=0, uuid=GPU0_UUID, minor=0)],
                        driver_version=DRIVER)
        nvml.write()
        records = str(args.max_records)
        with on_cpus(ALL_CPUS):  # the agents float over every CPU, as on a node
            self.collector = stack.enter_context(CollectorProcess(workdir / "collector", unix=False, args=[
                "--trace-max-records", records, "--trace-store-max-records", str(2 * args.max_records)]))
            self.tracer = stack.enter_context(TracerProcess(
                workdir / "tracer", ["--bpf", "on", "--grace-s", "0.5", "--trace-max-records", records],
                nvml.env(), node_name=NODE, collector=self.collector.address))
        self.tracer.wait_ready(120.0)
        self._wait_connected(60.0)

    def _wait_connected(self, timeout_s: float) -> None:
        from ghostgpu.cli.client import Query

        query = Query(self.collector.address)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                nodes = query.nodes(NODE)
                if any(n.connected and "trace" in n.capabilities for n in nodes):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tracer {NODE} not connected with trace sessions in {timeout_s} s: "
                                       f"{self.tracer.stderr()}")
                time.sleep(0.1)  # polling interval of a deadline loop
        finally:
            query.close()

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ghostgpu.cli", *args], capture_output=True, text=True,
                              timeout=120, cwd=ROOT, env=_clean_env(), check=False)

    def agents_cpu(self) -> dict[str, float | None]:
        return {"collector": proc_cpu_s(self.collector.proc.pid),  # type: ignore[union-attr]
                "tracer": proc_cpu_s(self.tracer.proc.pid)}

    def run(self, with_session: bool) -> dict[str, Any]:
        a, tag = self.args, "session" if with_session else "reference"
        cmd = [*pinned(WORK_CPU), str(self.helpers), "pacer", str(a.rate), str(a.duration_s)]
        pacer = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        watch = JsonlWatch(self.tracer.path, a.jsonl_poll_s)
        trace: subprocess.Popen[bytes] | None = None
        openers: list[tuple[int, int]] = []  # (pid, CLOCK_BOOTTIME ns before it started)
        launcher_errors: list[str] = []
        stop = threading.Event()
        out_path, err_path = self.workdir / f"trace-{tag}.jsonl", self.workdir / f"trace-{tag}.stderr"
        try:
            assert pacer.stdout is not None and pacer.stdin is not None
            line = pacer.stdout.readline().decode()
            if not line.startswith("ready "):
                raise RuntimeError(f"pacer: {line!r} {pacer.stderr.read().decode() if pacer.stderr else ''}")
            pid = int(line.split()[1])
            if with_session:
                with open(out_path, "wb") as out, open(err_path, "wb") as err, on_cpus(ALL_CPUS):
                    trace = subprocess.Popen(
                        [sys.executable, "-m", "ghostgpu.cli", "trace", "--collector", self.collector.address,
                         "--node", NODE, "--pid", str(pid), "--for", f"{a.duration_s + a.session_tail_s:g}s",
                         "--max-records", str(a.max_records), "-o", "jsonl"],
                        stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=ROOT, env=_clean_env())
                deadline = time.monotonic() + 60.0
                while "running until" not in err_path.read_text(errors="replace"):
                    if trace.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"ghostgpu trace did not start: {err_path.read_text()[-2000:]}")
                    time.sleep(0.02)  # polling interval of a deadline loop
            pids = {**self.agents_cpu(), **({"cli": proc_cpu_s(trace.pid)} if trace else {})}
            wall0 = time.monotonic()
            pacer.stdin.write(b"\n")
            pacer.stdin.flush()

            launcher = start_openers(a.openers, a.duration_s, self.gpucalls, stop, launcher_errors,
                                     lambda pid, before_ns: openers.append((pid, before_ns)))
            out_pacer, _ = pacer.communicate(timeout=a.duration_s + 60)
            pacer_out = json.loads(out_pacer.decode().strip().splitlines()[-1])
            window = time.monotonic() - wall0
            cpu_window = {**self.agents_cpu(), **({"cli": proc_cpu_s(trace.pid)} if trace else {})}
            launcher.join(30.0)
            cli_cpu_end: float | None = None
            if trace is not None:
                cli_cpu_end = exited_cpu_s(trace, a.session_tail_s + 60.0)
            to_end = time.monotonic() - wall0
            cpu_end = {**self.agents_cpu(), **({"cli": cli_cpu_end} if trace else {})}
            time.sleep(max(0.0, 3 * a.jsonl_poll_s))  # the watch's last pass
        finally:
            stop.set()
            watch.close()
            for p in (pacer, trace):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait()

        def used(at: dict[str, float | None]) -> dict[str, float | None]:
            return {k: (None if at.get(k) is None or v is None else round(at[k] - v, 3))  # type: ignore[operator]
                    for k, v in pids.items()}

        cpu_w, cpu_e = used(cpu_window), used(cpu_end)
        lat = [v for v in (watch.latency_s(p, t) for p, t in openers) if v is not None]
        out: dict[str, Any] = {
            "rate_target": a.rate,
            "rate_actual": rnd(pacer_out["calls"] / pacer_out["seconds"], 0),
            "calls": pacer_out["calls"],
            "pacer_seconds": pacer_out["seconds"],
            "pacer_busy_ns_per_call": pacer_out["busy_ns_per_call"],
            "window_s": rnd(window, 3),
            "cpu_s_window": cpu_w,
            "cpu_pct_of_one_core_window": {k: (None if v is None else rnd(100 * v / window, 1))
                                           for k, v in cpu_w.items()},
            "to_end_s": rnd(to_end, 3),
            "cpu_s_to_end": cpu_e,
            "openers": len(openers),
            "openers_seen": len(lat),
            "opener_errors": launcher_errors,
            "jsonl_poll_s": a.jsonl_poll_s,
            "open_to_jsonl_ms": {"p50": rnd(1000 * percentile(lat, 50), 2) if lat else None,  # type: ignore[operator]
                                 "p99": rnd(1000 * percentile(lat, 99), 2) if lat else None,  # type: ignore[operator]
                                 "max": rnd(1000 * max(lat), 2) if lat else None},
            "open_to_jsonl_ms_values": [round(1000 * v, 2) for v in lat],
            "goal_p99_ms": GOAL_ATTRIBUTION_P99_MS,
        }
        if trace is not None:
            lines = out_path.read_bytes().splitlines()
            first = json.loads(lines[0]) if lines else {}
            session_id = first.get("session") or ""
            listed = json.loads(self.cli("trace", "list", "--collector", self.collector.address, "-o",
                                         "json").stdout or "[]")
            session = next((s for s in listed if s.get("id") == session_id), {})
            delivered = len(lines)
            err_tail = err_path.read_text(errors="replace").strip().splitlines()
            out.update(
                cli_rc=trace.returncode,
                cli_last_line=err_tail[-1] if err_tail else "",
                session=session_id,
                session_status=session.get("status"),
                records_delivered=delivered,
                records_per_s=rnd(delivered / pacer_out["seconds"], 0),
                records_vs_calls=rnd(delivered / max(pacer_out["calls"], 1), 4),
                records_total=session.get("records_total"),
                **{k: session.get(k) for k in DROP_KEYS},
                cpu_us_per_record_to_end={k: (None if v is None else rnd(1e6 * v / max(delivered, 1), 2))
                                          for k, v in cpu_e.items()},
            )
            out["dropped_total"] = sum(out[k] or 0 for k in DROP_KEYS)
        return out


def fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} ms"


def summary_rows(res: dict[str, Any]) -> list[list[Any]]:
    rows: list[list[Any]] = []
    if "per_call" in res:
        rows += per_call_rows(res)
    if "outside" in res:
        rows += outside_rows(res)
    if "start" in res:
        rows += start_rows(res)
    if "throughput" in res:
        rows += throughput_rows(res)
    if "via_collector" in res:
        rows += via_collector_rows(res)
    return rows


def per_call_rows(res: dict[str, Any]) -> list[list[Any]]:
    rows: list[list[Any]] = []
    p = res["per_call"]
    ns, add = p["ns_per_call_median"], p["added_ns_median"]
    rows.append(["1 traced ioctl: ns/call, no BPF (baseline)", f"{ns['none']:.1f}", "", ""])
    rows.append(["1 ... BPF loaded, no session", f"{ns['bpf']:.1f}", f"+{add['bpf']:.1f} ns", ""])
    dropped = sum(p["session_dropped_ringbuf"]) + sum(p["session_dropped_limit"])
    taken = sum(p["session_records_delivered"])
    rows.append(["1 ... a session on its pid", f"{ns['session']:.1f}", f"+{add['session']:.1f} ns",
                 f"{taken / max(taken + dropped, 1):.0%} of records taken, rest dropped (ringbuf)"])
    rows.append(["1 ... strace -f -e trace=ioctl, BPF detached", f"{ns['strace']:.1f}",
                 f"+{add['strace']:.1f} ns", ""])
    rows.append(["1 added(session) / added(strace)", f"{p['ratio_added_session_vs_strace']:.4f}",
                 f"rounds: {p['ratio_added_session_vs_strace_median_of_rounds']:.4f}", "goal <= 0.1"])
    return rows


def outside_rows(res: dict[str, Any]) -> list[list[Any]]:
    rows: list[list[Any]] = []
    o, goal = res["outside"]["cpu_ns"], res["outside"]["goal_ratio_session_vs_bpf_max"]
    for op, name in (("ioctl", "ioctl(FIONREAD) pipe"), ("open", "openat+close /dev/null")):
        n = o[op]["ns_per_op_median"]
        rows.append([f"2 outside: {name}, CPU ns/op none|bpf|session",
                     f"{n['none']:.1f} | {n['bpf']:.1f} | {n['session']:.1f}",
                     f"x{o[op]['ratio_session_vs_bpf']:.3f} "
                     f"(rounds x{o[op]['ratio_session_vs_bpf_median_of_rounds']:.3f})",
                     f"{o[op]['added_ns_session_vs_bpf']:+.1f} ns with a session; goal <= x{goal:g}"])
    return rows


def start_rows(res: dict[str, Any]) -> list[list[Any]]:
    s = res["start"]
    rows: list[list[Any]] = []
    rows.append(["3 session start -> first record (p50 | p99)",
                 f"{1000 * s['first_record_s']['p50']:.1f} | {1000 * s['first_record_s']['p99']:.1f} ms",
                 f"{s['starts']} starts, first ever {1000 * s['first_start_s']:.1f} ms", "goal p50 < 1 s"])
    return rows


def throughput_rows(res: dict[str, Any]) -> list[list[Any]]:
    rows: list[list[Any]] = []
    t, r = res["throughput"]["session"], res["throughput"]["reference_no_session"]
    rows.append(["4 paced workload in scope: actual calls/s", f"{t['rate_actual']:.0f}",
                 f"target {t['rate_target']}", f"busy ns/call {t['pacer_busy_ns_per_call']:.0f} "
                 f"(no session {r['pacer_busy_ns_per_call']:.0f})"])
    lag = t["last_batch_after_pacer_end_s"]
    rows.append(["4 records delivered/s", f"{t['records_per_s']:.0f}",
                 f"dropped ringbuf {t['dropped_ringbuf']}, limit {t['dropped_limit']}",
                 f"last batch {fmt_ms(None if lag is None else 1000 * lag)} after the workload"])
    rows.append(["4 CPU (% of one core): session thread | process",
                 f"{t['session_thread_cpu_pct_of_one_core']:.1f} | {t['process_cpu_pct_of_one_core']:.1f}",
                 f"no session: process {r['process_cpu_pct_of_one_core']:.1f}", ""])
    rows.append(["4 open -> OPEN out of poll() (p50 | p99), session",
                 f"{t['open_to_poll_ms']['p50']} | {t['open_to_poll_ms']['p99']} ms",
                 f"no session: {r['open_to_poll_ms']['p50']} | {r['open_to_poll_ms']['p99']} ms",
                 f"{t['openers_seen']}/{t['openers']} seen; goal p99 < 100 ms"])
    return rows


def via_collector_rows(res: dict[str, Any]) -> list[list[Any]]:
    rows: list[list[Any]] = []
    t, r = res["via_collector"]["session"], res["via_collector"]["reference_no_session"]
    rows.append(["5 real collector+tracer+CLI: paced calls/s in scope", f"{t['rate_actual']:.0f}",
                 f"target {t['rate_target']}", f"busy ns/call {t['pacer_busy_ns_per_call']:.0f} "
                 f"(no session {r['pacer_busy_ns_per_call']:.0f})"])
    rows.append(["5 records delivered to the CLI /s", f"{t['records_per_s']:.0f}",
                 f"{t['records_delivered']} records, {t['records_vs_calls']:.1%} of the calls",
                 f"stored {t['records_total']}; session {t['session_status']}"])
    rows.append(["5 dropped: ringbuf | limit | transport | store",
                 " | ".join(str(t[k]) for k in DROP_KEYS), f"total {t['dropped_total']}", ""])
    pct, ref = t["cpu_pct_of_one_core_window"], r["cpu_pct_of_one_core_window"]
    rows.append(["5 CPU (% of one core, workload window): collector | tracer | CLI",
                 f"{pct['collector']} | {pct['tracer']} | {pct['cli']}",
                 f"no session: {ref['collector']} | {ref['tracer']}", ""])
    per = t["cpu_us_per_record_to_end"]
    rows.append(["5 CPU us per record delivered (to the end): collector | tracer | CLI",
                 f"{per['collector']} | {per['tracer']} | {per['cli']}", "", ""])
    rows.append(["5 open -> `open` line in the tracer's --jsonl (p50 | p99), session",
                 f"{t['open_to_jsonl_ms']['p50']} | {t['open_to_jsonl_ms']['p99']} ms",
                 f"no session: {r['open_to_jsonl_ms']['p50']} | {r['open_to_jsonl_ms']['p99']} ms",
                 f"{t['openers_seen']}/{t['openers']} seen; goal p99 < {t['goal_p99_ms']:g} ms"])
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the default: about 2.5 minutes")
    size.add_argument("--full", action="store_true", help="more rounds, longer throughput windows")
    parser.add_argument("--rounds", type=int, help="alternating rounds of parts 1 and 2 (quick 7, full 9)")
    parser.add_argument("--spin", type=int, default=500_000,
                        help="gpucalls --spin M for modes none/bpf/session")
    parser.add_argument("--strace-spin", type=int, default=200_000, help="gpucalls --spin M under strace")
    parser.add_argument("--loop-iterations", type=int, default=1_000_000, help="part 2 ioctl loop length")
    parser.add_argument("--open-iterations", type=int, default=200_000,
                        help="part 2 openat+close loop length")
    parser.add_argument("--starts", type=int, help="part 3 session starts (quick 20, full 50)")
    parser.add_argument("--rate", type=int, default=200_000, help="parts 4 and 5 paced ioctls/s")
    parser.add_argument("--duration-s", type=float, help="parts 4 and 5 window (quick 6, full 20)")
    parser.add_argument("--openers", type=int,
                        help="parts 4 and 5 processes opening /dev/nvidiactl (quick 20, full 50)")
    parser.add_argument("--max-records", type=int, default=10_000_000,
                        help="the sessions' record limit (part 5: collector's, tracer's, CLI's)")
    parser.add_argument("--session-tail-s", type=float, default=3.0,
                        help="part 5: the session runs this long past the workload's window (--for)")
    parser.add_argument("--jsonl-poll-s", type=float, default=0.001,
                        help="part 5: how often the tracer's --jsonl file is read for open records")
    parser.add_argument("--parts", default="1,2,3,4,5", help="which parts to run (smoke runs)")
    parser.add_argument("--out", default="trace", help="results file name under bench/results/ (no .json)")
    args = parser.parse_args()
    parts = {int(x) for x in args.parts.split(",") if x.strip()}
    full = args.full
    args.rounds = args.rounds or (9 if full else 7)
    args.starts = args.starts or (50 if full else 20)
    args.duration_s = args.duration_s or (20.0 if full else 6.0)
    args.openers = args.openers or (50 if full else 20)
    if (why := preflight()) is not None:
        print(f"bench_trace: {why}", file=sys.stderr)
        return 2
    for tool in ("strace", "taskset"):
        if not shutil.which(tool):
            package = "strace" if tool == "strace" else "util-linux"
            print(f"bench_trace: {tool} is needed: apt-get install {package}", file=sys.stderr)
            return 2
    interrupt_on_sigterm()
    if (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {BENCH_CPU})  # this thread and the threads started from here
    t_start = time.monotonic()
    foreign_before = foreign_bpf_programs()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gg-bench-trace-") as tmp:
        helpers = build_helpers(Path(tmp))
        if parts & {1, 2, 3, 4}:
            bench = Bench(args, helpers)
            try:
                results["bpf_start_s"] = rnd(bench.source.start_s, 3)
                if 1 in parts:
                    print("1/5 per traced ioctl ...", file=sys.stderr, flush=True)
                    results["per_call"] = bench.per_call()
                if 2 in parts:
                    print("2/5 outside every session ...", file=sys.stderr, flush=True)
                    results["outside"] = bench.outside()
                if 3 in parts:
                    print("3/5 session start ...", file=sys.stderr, flush=True)
                    results["start"] = bench.start_latency()
                if 4 in parts:
                    print("4/5 throughput and attribution latency ...", file=sys.stderr, flush=True)
                    results["throughput"] = {"reference_no_session": bench.throughput(False),
                                             "session": bench.throughput(True)}
            finally:
                bench.close()
        if 5 in parts:
            print("5/5 the same through a real collector, tracer and `ghostgpu trace` ...", file=sys.stderr,
                  flush=True)
            with contextlib.ExitStack() as stack:
                via = ViaCollector(args, helpers, Path(tmp) / "via", stack)
                results["via_collector"] = {"reference_no_session": via.run(False), "session": via.run(True)}
    results["foreign_bpf_programs"] = {"before": foreign_before, "after": foreign_bpf_programs()}
    results["options"] = {k: v for k, v in vars(args).items() if k not in ("quick", "full", "out")}
    results["options"]["mode"] = "full" if full else "quick"
    results["bench_wall_s"] = rnd(time.monotonic() - t_start, 1)
    results["machine"] = machine()
    rows = summary_rows(results)
    print_table(["measure", "figure", "vs reference", "note"], rows)
    path = write_json(args.out, results)
    foreign = results["foreign_bpf_programs"]
    print(f"wrote {path.relative_to(ROOT)} in {results['bench_wall_s']} s; other processes' BPF programs: "
          f"{foreign['before']} before, {foreign['after']} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
