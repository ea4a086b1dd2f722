#!/usr/bin/env python3
"""Benchmark: a full ProcScanner.scan() against `fuser -v` and `lsof` on the same processes.

Run as root (mknod):  .venv/bin/python bench/bench_scan.py [--procs 1000] [--fds 100]

It forks N children that each hold F fds: one on a fake GPU node (mknod c 1 3 under a temp dir
whose prefix is configured), the rest a mix like a real worker (regular files, some shared by all
children and some private, pipes, sockets, eventfds, /dev/null), then times (best of R runs, same
set, round robin so load bursts on a shared host hit every contender) the tracer's default scan,
variants of it (one worker; files outside /dev stat'ed every scan; never), `fuser -v NODE` and
`lsof NODE`, prints a table and writes bench/results/scan.json. Every child dies with the parent
(PR_SET_PDEATHSIG) and is killed and reaped on exit, even on error or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import resource
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ghostgpu.tracer.devices import DeviceCatalog
from ghostgpu.tracer.procfs import ProcScanner

GOAL_VS_FUSER = 0.5
GOAL_VS_LSOF = 0.1
PR_SET_PDEATHSIG = 1
READY_DEADLINE_S = 300.0


def fd_plan(total_fds: int, regular_share: float) -> dict[str, int]:
    """How many fds of each kind a child opens besides stdio, the release pipe and the GPU node."""
    rest = max(total_fds - 7, 0)  # stdio, ready and release pipes, the node, /dev/null
    regular = round(rest * regular_share)
    pipes = (rest - regular) // 3 // 2 * 2
    sockets = (rest - regular) // 3 // 2 * 2
    eventfds = rest - regular - pipes - sockets
    return {"regular_shared": regular // 3, "regular_private": regular - regular // 3,
            "pipe": pipes, "socket": sockets, "eventfd": eventfds}


def _open_fds() -> list[int]:
    """Our open fds (listdir opens and closes its own, so check each one is still there)."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            os.fstat(int(name))
            out.append(int(name))
    return sorted(out)


def child_main(node: str, shared: list[str], private_dir: str, plan: dict[str, int], total_fds: int,
               holes: int, ready_w: int, release_r: int) -> None:
    """Open the planned fds, say ready, block until the parent lets go (or dies). Never returns."""
    code = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        for fd in _open_fds():  # whatever the parent inherited from its own caller
            if fd > 2 and fd not in (ready_w, release_r):
                os.close(fd)
        keep = [os.open(node, os.O_RDONLY)]
        keep += [os.open(p, os.O_RDONLY) for p in shared[: plan["regular_shared"]]]
        for i in range(plan["regular_private"]):
            keep.append(os.open(f"{private_dir}/f{os.getpid()}-{i}", os.O_RDWR | os.O_CREAT, 0o600))
        for _ in range(plan["pipe"] // 2):
            keep += os.pipe()
        for _ in range(plan["socket"] // 2):
            keep += [s.detach() for s in socket.socketpair()]
        keep += [os.eventfd(0) for _ in range(plan["eventfd"])]
        devnull = os.open("/dev/null", os.O_RDONLY)
        while len(_open_fds()) < total_fds + holes:
            os.dup(devnull)
        for fd in _open_fds()[total_fds // 2 :][:holes]:  # a sparse table, like a long-lived process
            os.close(fd)
        os.write(ready_w, b"r")
        os.dup2(devnull, ready_w)  # closes the pipe end without leaving a hole
        os.read(release_r, 1)  # EOF when the parent closes its end or dies
        code = 0
    finally:
        os._exit(code)


class Children:
    """N forked holders; always reaped by kill(pid) + waitpid(pid) on close."""

    def __init__(self) -> None:
        self.pids: list[int] = []
        self.release_w = -1

    def spawn(self, count: int, node: str, shared: list[str], private_dir: str, total_fds: int,
              regular_share: float, holes: int = 0) -> None:
        plan = fd_plan(total_fds, regular_share)
        ready_r, ready_w = os.pipe()
        release_r, self.release_w = os.pipe()
        devnull = os.open("/dev/null", os.O_RDWR)
        for _ in range(count):
            pid = os.fork()
            if pid == 0:
                os.close(ready_r)
                os.close(self.release_w)
                for fd in (0, 1, 2):
                    os.dup2(devnull, fd)
                os.close(devnull)
                child_main(node, shared, private_dir, plan, total_fds, holes, ready_w, release_r)
            self.pids.append(pid)
        os.close(ready_w)
        os.close(release_r)
        os.close(devnull)
        got, deadline = 0, time.monotonic() + READY_DEADLINE_S
        while got < count:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([ready_r], [], [], left)[0]:
                raise RuntimeError(f"only {got}/{count} children ready after {READY_DEADLINE_S:.0f} s")
            data = os.read(ready_r, 4096)
            if not data:
                raise RuntimeError(f"children died: only {got}/{count} ready")
            got += len(data)
        os.close(ready_r)

    def close(self) -> None:
        if self.release_w >= 0:
            os.close(self.release_w)
            self.release_w = -1
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in self.pids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self.pids.clear()


def interleaved_best(runs: int, fns: dict[str, Callable[[], object]]) -> dict[str, list[float]]:
    """Each timed `runs` times, round robin, so a burst of load on the host hits all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for run in range(runs):
        for name in names[run % len(names) :] + names[: run % len(names)]:  # rotate: no fixed neighbour
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
        last = ", ".join(f"{name} {ts[-1]:.3f} s" for name, ts in times.items())
        print(f"bench_scan: run {run + 1}/{runs}: {last}", file=sys.stderr, flush=True)
    return times


def run_tool(argv: list[str]) -> subprocess.CompletedProcess[bytes]:
    # fuser/lsof exit 1 when nothing matched: not an error here, the hit count is checked instead
    return subprocess.run(argv, capture_output=True, check=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=1000)
    ap.add_argument("--fds", type=int, default=100)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--regular-share", type=float, default=0.4,
                    help="share of each child's fds on regular files (the rest: pipes, sockets, eventfds)")
    ap.add_argument("--holes", type=int, default=0, help="fds closed mid-table in each child (sparse tables)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "scan.json"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_scan: needs root (mknod of the fake GPU node); run it with sudo", file=sys.stderr)
        return 2
    for tool in ("fuser", "lsof"):
        if shutil.which(tool) is None:
            print(f"bench_scan: {tool} not found; install psmisc and lsof", file=sys.stderr)
            return 2
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < args.fds + 16:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, args.fds + 64), hard))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tmp = tempfile.mkdtemp(prefix="ghostgpu-bench-")
    children = Children()
    try:
        node = f"{tmp}/nvidia0"
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        shared = []
        for i in range(args.fds):
            Path(f"{tmp}/shared{i}").write_bytes(b"x")
            shared.append(f"{tmp}/shared{i}")
        os.mkdir(f"{tmp}/private")
        load_before = os.getloadavg()  # before our own burst of forks: what else the host is doing
        t0 = time.perf_counter()
        children.spawn(args.procs, node, shared, f"{tmp}/private", args.fds, args.regular_share, args.holes)
        spawn_s = time.perf_counter() - t0
        print(f"bench_scan: {args.procs} children ready in {spawn_s:.1f} s", file=sys.stderr, flush=True)
        catalog = DeviceCatalog((f"{tmp}/nvidia",))
        scanners = {  # the default first: that is the scanner the tracer runs
            "ours": ProcScanner(catalog),
            "ours_1_worker": ProcScanner(catalog, workers=1),
            "ours_stat_outside_dev_always": ProcScanner(catalog, stat_outside_dev_every=1),
            "ours_stat_outside_dev_never": ProcScanner(catalog, stat_outside_dev_every=0),
        }
        wanted = {str(p).encode() for p in children.pids}
        views = {name: sc.scan() for name, sc in scanners.items()}
        hits = {name: sum(1 for pid in children.pids if node in view.get(pid, {}))
                for name, view in views.items()}
        fuser, lsof = run_tool(["fuser", "-v", node]), run_tool(["lsof", node])
        hits["fuser"] = len(set(fuser.stdout.split()) & wanted)
        lsof_rows = [line.split() for line in lsof.stdout.splitlines()[1:]]  # COMMAND PID USER FD ...
        hits["lsof"] = len({row[1] for row in lsof_rows if len(row) > 1} & wanted)
        fns: dict[str, Callable[[], object]] = {name: sc.scan for name, sc in scanners.items()}
        fns["fuser"] = lambda: run_tool(["fuser", "-v", node])
        fns["lsof"] = lambda: run_tool(["lsof", node])
        times = interleaved_best(args.runs, fns)
        counters = {name: {"fds_seen": sc.fds_seen, "stats_done": sc.stats_done}
                    for name, sc in scanners.items()}
    finally:
        children.close()
        shutil.rmtree(tmp, ignore_errors=True)
    best = {name: min(ts) for name, ts in times.items()}
    result = {
        "procs": args.procs, "fds_per_proc": args.fds, "holes_per_proc": args.holes, "runs": args.runs,
        "fd_mix": fd_plan(args.fds, args.regular_share), "spawn_s": round(spawn_s, 3),
        "best_s": best, "hits": hits, "all_runs_s": times, "counters": counters,
        "ours_vs_fuser": best["ours"] / best["fuser"], "ours_vs_lsof": best["ours"] / best["lsof"],
        "goal_vs_fuser": GOAL_VS_FUSER, "goal_vs_lsof": GOAL_VS_LSOF,
        "fuser_rc": fuser.returncode, "lsof_rc": lsof.returncode, "loadavg_before": load_before,
        "host": {"kernel": platform.release(), "cpus": os.cpu_count(), "python": platform.python_version()},
    }
    print(f"{args.procs} processes x {args.fds} fds ({args.holes} holes), best of {args.runs}, "
          f"spawned in {spawn_s:.1f} s, load average {load_before[0]:.1f}")
    print(f"{'':<30}{'seconds':>9}{'hits':>6}{'/fuser':>8}{'/lsof':>8}")
    for name, secs in best.items():
        print(f"{name:<30}{secs:>9.4f}{hits[name]:>6}{secs / best['fuser']:>8.3f}{secs / best['lsof']:>8.3f}")
    for tool, goal in (("fuser", GOAL_VS_FUSER), ("lsof", GOAL_VS_LSOF)):
        ratio = best["ours"] / best[tool]
        print(f"goal ours/{tool} <= {goal}: {ratio:.3f} {'ok' if ratio <= goal else 'MISSED'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0 if all(count == args.procs for count in hits.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
