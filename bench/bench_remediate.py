"""Benchmark: what remediation costs (docs/REMEDIATION.md), side by side in one run.

Run as root (mknod, cgroups):  .venv/bin/python bench/bench_remediate.py [--kills 500] [--ticks 500]

1. The guarded kill: `Remediator.handle` (tracer/remediate.py, the function the tracer's command runner
   calls) on real holders, timed from the call to its result: the identity re-read from /proc, CRI asked
   through the tracer's own relay (tests/helpers/cri_fake.py on a real unix socket, answering NOT_FOUND),
   the device hold found by the tracer's scanner, SIGTERM through a pidfd and the wait for the exit.
   Each holder is `sleep` with a `c 1 3` node named nvidia0 in a temp dir open as its stdin (the
   catalog's prefix is that dir), moved into a FakeContainer's kubepods cgroup so that /proc says the
   container the command names. Also timed: the dry-run re-check alone (what the collector sends first:
   every check, no signal). References, in the same trials, each on its own node: `fuser -k -TERM NODE`
   (psmisc; it kills by device, so everything holding it) and a bare `os.kill(pid, SIGTERM)`; both
   timed to the holder's reap. Arms rotate within each trial.
2. The engine's tick on the collector's loop: a collector Remediator (collector/remediation.py) over a
   SQLite store, the cluster table holding 10,000 open findings (100 nodes x 100) of which 100 are
   orphaned, built as tests/unit/test_remediation_engine.py builds it, the commands answered at once by
   a fake sender. `tick()` timed in mode dry-run and mode off, alternating, on one event loop: wall time
   and the loop thread's own CPU (thread_time: what the loop is held for; the store's SQL runs on its
   writer thread). The first dry-run round (100 incidents decided, re-checked and proposed, every step
   audited) is timed from the tick to the last incident's end.

Nothing here is asserted; the JSON goes to bench/results/remediate.json.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ghostgpu.collector.audit import AuditLog
from ghostgpu.collector.cluster import ClusterTable, FindingRec
from ghostgpu.collector.remediation import Remediator as Engine
from ghostgpu.collector.remediation_commands import RemediateCalls
from ghostgpu.collector.remediation_policy import RemediationPolicy
from ghostgpu.collector.store import Store
from ghostgpu.tracer.cri_relay import CriRelay
from ghostgpu.tracer.devices import DeviceCatalog
from ghostgpu.tracer.remediate import ProcView, Remediator

from bench.common import interrupt_on_sigterm, machine, print_table, write_json
from ghostgpu.common.model.consumers import ClusterConsumer, Consumer, ConsumerClass, K8sInfo
from ghostgpu.common.model.remediation import CAPABILITY, DONE, MODE_DRY_RUN, MODE_OFF, PROPOSED
from ghostgpu.v1 import node_pb2, stream_pb2
from tests.helpers.container import FakeContainer
from tests.helpers.cri_fake import FakeCri

NODE = "bench-node"


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def summary_ms(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    return {"n": len(ms), "p50_ms": round(pct(ms, 50), 3), "p99_ms": round(pct(ms, 99), 3),
            "max_ms": round(max(ms), 3), "mean_ms": round(sum(ms) / len(ms), 3)}


# ---- 1. the guarded kill ---------------------------------------------------------------------------


class Holders:
    """`sleep` processes holding a node as stdin, each moved into the fake container's cgroups."""

    def __init__(self, container: FakeContainer) -> None:
        self.container = container
        self.live: dict[int, subprocess.Popen[bytes]] = {}

    def spawn(self, node: str) -> subprocess.Popen[bytes]:
        with open(node, "rb") as fh:
            p = subprocess.Popen(["sleep", "3600"], stdin=fh)  # returns once exec succeeded
        for directory in self.container.cgroup_paths.values():
            Path(directory, "cgroup.procs").write_text(str(p.pid))
        self.live[p.pid] = p
        return p

    def reap(self, p: subprocess.Popen[bytes]) -> None:
        p.wait()
        self.live.pop(p.pid, None)

    def close(self) -> None:
        for p in list(self.live.values()):
            p.kill()
            self.reap(p)


def fuser_pids(node: str) -> set[int]:
    out = subprocess.run(["fuser", node], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         check=False)
    return {int(tok) for tok in out.stdout.split() if tok.isdigit()}


def bench_kill(kills: int) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="ghostgpu-bench-rem-")
    try:
        nodes = {arm: f"{tmp}/nvidia{i}" for i, arm in enumerate(("act", "kill", "fuser"))}
        for node in nodes.values():
            os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        catalog = DeviceCatalog((f"{tmp}/nvidia",))
        # The act confirms CRI speaks for the cgroup's runtime (Version) before its NOT_FOUND counts.
        with FakeCri(runtime_name="containerd") as runtime, FakeContainer() as container:
            relay = CriRelay(runtime.endpoint, node=NODE)
            holders = Holders(container)
            try:
                return _kill_trials(kills, nodes, catalog, relay, container, holders, runtime)
            finally:
                holders.close()
                relay.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _kill_trials(kills: int, nodes: dict[str, str], catalog: DeviceCatalog, relay: CriRelay,
                 container: FakeContainer, holders: Holders, runtime: FakeCri) -> dict[str, Any]:
    # Each act logs one warning line (the tracer's record of it): kept, but not printed 3,000 times here.
    act_log = logging.getLogger("ghostgpu.remediate")
    act_log.addHandler(logging.NullHandler())
    act_log.propagate = False
    remediator = Remediator(NODE, catalog, relay)
    view = ProcView("/proc", catalog)

    # fuser -k kills whatever it matches: first make sure it matches our holder and nothing else.
    probe = holders.spawn(nodes["fuser"])
    matched = fuser_pids(nodes["fuser"])
    if matched != {probe.pid}:
        probe.kill()
        holders.reap(probe)
        raise SystemExit(f"bench_remediate: fuser {nodes['fuser']} matched {sorted(matched)}, not only our "
                         f"holder {probe.pid}; refusing to run fuser -k")
    probe.kill()
    holders.reap(probe)

    def command(pid: int, dry_run: bool) -> stream_pb2.RemediateCommand:
        seen = view.look(pid)
        assert seen is not None and seen.exe, f"holder {pid} is gone or its exe unreadable"
        return stream_pb2.RemediateCommand(
            incident=f"f{pid}/kill_orphan", container_id=container.container_id, devices=[nodes["act"]],
            grace_ms=5000, dry_run=dry_run,
            process=node_pb2.Process(pid=pid, start_time_ns=seen.start_time_ns, exe=seen.exe, comm="sleep",
                                     pod_uid=seen.pod_uid))

    times: dict[str, list[float]] = {"act": [], "recheck": [], "kill": [], "fuser": [], "look": [],
                                     "held": [], "cri": []}
    outcomes: dict[str, int] = {}

    def act() -> None:
        p = holders.spawn(nodes["act"])
        check_cmd, act_cmd = command(p.pid, True), command(p.pid, False)
        # The re-check's parts, each alone on the same holder: /proc identity, the scanner's hold, CRI.
        for part, fn in (("look", lambda: view.look(p.pid)), ("held", lambda: view.held(p.pid)),
                         ("cri", lambda: remediator._cri(container.container_id, ""))):
            t = time.perf_counter()
            fn()
            times[part].append(time.perf_counter() - t)
        t0 = time.perf_counter()
        check = remediator.handle(check_cmd)
        t1 = time.perf_counter()
        result = remediator.handle(act_cmd)
        t2 = time.perf_counter()
        holders.reap(p)
        if check.outcome != PROPOSED or result.outcome != DONE:
            raise SystemExit(f"bench_remediate: the act on pid {p.pid} answered {check.outcome} then "
                             f"{result.outcome}: {check.reason} / {result.reason}")
        outcomes[result.outcome] = outcomes.get(result.outcome, 0) + 1
        times["recheck"].append(t1 - t0)
        times["act"].append(t2 - t1)

    def kill() -> None:
        p = holders.spawn(nodes["kill"])
        t0 = time.perf_counter()
        os.kill(p.pid, 15)
        os.waitpid(p.pid, 0)
        times["kill"].append(time.perf_counter() - t0)
        p.returncode = -15
        holders.live.pop(p.pid, None)

    def fuser() -> None:
        p = holders.spawn(nodes["fuser"])
        t0 = time.perf_counter()
        # stderr: fuser says which /proc/PID/fd it could not stat (other users' in a container), per call
        subprocess.run(["fuser", "-s", "-k", "-TERM", nodes["fuser"]], stderr=subprocess.DEVNULL, check=False)
        os.waitpid(p.pid, 0)
        times["fuser"].append(time.perf_counter() - t0)
        p.returncode = -15
        holders.live.pop(p.pid, None)

    arms: list[Callable[[], None]] = [act, kill, fuser]
    for i in range(kills):
        for k in range(len(arms)):
            arms[(i + k) % len(arms)]()
    stats = {arm: summary_ms(v) for arm, v in times.items()}
    return {
        "kills": kills,
        # fuser reads every process's fds: its time grows with the host's process count
        "procs_on_host": sum(1 for name in os.listdir("/proc") if name.isdigit()),
        "arms": stats,
        "outcomes": outcomes,
        "cri_container_status_calls": runtime.calls["ContainerStatus"],
        "act_vs_kill_p50": round(stats["act"]["p50_ms"] / stats["kill"]["p50_ms"], 2),
        "act_vs_kill_p99": round(stats["act"]["p99_ms"] / stats["kill"]["p99_ms"], 2),
        "act_vs_fuser_p50": round(stats["act"]["p50_ms"] / stats["fuser"]["p50_ms"], 2),
        "act_vs_fuser_p99": round(stats["act"]["p99_ms"] / stats["fuser"]["p99_ms"], 2),
        "recheck_plus_act_p50_ms": round(
            pct([a + b for a, b in zip(times["recheck"], times["act"], strict=True)], 50) * 1000, 3),
    }


# ---- 2. the engine's tick ----------------------------------------------------------------------------


class InstantCalls(RemediateCalls):
    """A tracer whose re-checks pass at once (dry runs only: no act is ever asked in these modes)."""

    def __init__(self) -> None:
        super().__init__({})
        self.sent = 0

    async def call(self, node: str, command: stream_pb2.RemediateCommand,
                   timeout_s: float) -> stream_pb2.RemediateResult:
        self.sent += 1
        return stream_pb2.RemediateResult(incident=command.incident, outcome=PROPOSED,
                                          reason="every check passed")


class Stream:
    def __init__(self, node: str) -> None:
        self.node, self.active = node, True
        self.hello = stream_pb2.Hello(node=node, capabilities=["bpf", CAPABILITY])
        self.out: asyncio.Queue[Any] = asyncio.Queue()


def finding(fid: int, node: str, pid: int, cls: ConsumerClass) -> FindingRec:
    c = Consumer(node=node, pid=pid, ns_pid=None, comm="python", gpu=0, gpu_uuid="GPU-0", gpu_minor=0,
                 devices=["/dev/nvidia0"], container_id=f"{fid:064x}", pod_uid=f"pod-{fid}", runtime="",
                 cls=cls, reason="CRI does not know this container", gpu_memory_bytes=None,
                 exe="/usr/bin/python3", start_time_ns=777)
    cc = ClusterConsumer(c, K8sInfo(resolution="not_found", namespace="ml", pod=f"train-{fid}"))
    return FindingRec(fid, node, (pid, 0, "GPU-0"), str(cls), time.time_ns() - 600 * 10**9, cc)


def bench_tick(ticks: int, nodes: int, per_node: int, orphans_per_node: int) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="ghostgpu-bench-tick-")
    store = Store(f"{tmp}/c.db", event_log_max=1000, retention_days=7)
    try:
        return asyncio.run(_ticks(store, ticks, nodes, per_node, orphans_per_node))
    finally:
        store.close()
        shutil.rmtree(tmp, ignore_errors=True)


async def _ticks(store: Store, ticks: int, nodes: int, per_node: int,
                 orphans_per_node: int) -> dict[str, Any]:
    audit = AuditLog(None, store)
    cluster = ClusterTable({}, None, store)
    streams: dict[str, Any] = {}
    fid = 0
    for n in range(nodes):
        node = f"node-{n:03d}"
        streams[node] = Stream(node)
        for i in range(per_node):
            fid += 1
            cls = ConsumerClass.ORPHANED if i < orphans_per_node else ConsumerClass.HIDDEN
            rec = finding(fid, node, 1000 + i, cls)
            cluster.open.setdefault(node, {})[rec.key] = rec
    policies = {mode: RemediationPolicy(mode=mode) for mode in (MODE_OFF, MODE_DRY_RUN)}
    calls = {mode: InstantCalls() for mode in policies}
    engines = {mode: Engine(store, cluster, streams, policy=lambda p=p: p, audit=audit.append,  # type: ignore[misc]
                            calls=calls[mode]) for mode, p in policies.items()}

    async def timed(engine: Engine, then_idle: bool = False) -> tuple[float, float]:
        c0, t0 = time.thread_time(), time.perf_counter()
        await engine.tick()
        if then_idle:
            await engine.idle()
        return time.perf_counter() - t0, time.thread_time() - c0

    await timed(engines[MODE_OFF])  # warm: the store's first read
    first_wall_s, first_cpu_s = await timed(engines[MODE_DRY_RUN], then_idle=True)
    proposed = calls[MODE_DRY_RUN].sent
    if proposed != nodes * orphans_per_node:  # measuring a tick that decides nothing would mislead
        raise RuntimeError(f"the first dry-run round sent {proposed} re-checks, not "
                           f"{nodes * orphans_per_node}: the bench's findings are no longer candidates "
                           "(collector/remediation_guards.py eligible)")
    wall: dict[str, list[float]] = {m: [] for m in policies}
    cpu: dict[str, list[float]] = {m: [] for m in policies}
    for i in range(ticks):
        order = (MODE_OFF, MODE_DRY_RUN) if i % 2 == 0 else (MODE_DRY_RUN, MODE_OFF)
        for mode in order:
            w, c = await timed(engines[mode])
            wall[mode].append(w)
            cpu[mode].append(c)
    await engines[MODE_DRY_RUN].idle()
    out: dict[str, Any] = {
        "open_findings": sum(len(v) for v in cluster.open.values()),
        "orphaned": nodes * orphans_per_node, "nodes": nodes, "ticks": ticks,
        "tick_s": engines[MODE_OFF].timing.tick_s,
        "first_dry_run_round": {"incidents_proposed": proposed, "wall_ms": round(first_wall_s * 1000, 3),
                                "loop_cpu_ms": round(first_cpu_s * 1000, 3)},
        "sent_after_first_round": calls[MODE_DRY_RUN].sent - proposed,
    }
    for mode in policies:
        key = mode.replace("-", "_")
        out[key] = {"wall": summary_ms(wall[mode]), "loop_cpu": summary_ms(cpu[mode])}
    dry, off = out["dry_run"], out["off"]
    out["dry_run_vs_off_wall_p50"] = round(dry["wall"]["p50_ms"] / off["wall"]["p50_ms"], 2)
    out["dry_run_vs_off_loop_cpu_p50"] = round(dry["loop_cpu"]["p50_ms"] / off["loop_cpu"]["p50_ms"], 2)
    # p50 loop CPU of a tick as % of the 1 s between ticks: the share of the loop ingest loses to it
    out["dry_run_loop_cpu_pct_of_tick_s"] = round(dry["loop_cpu"]["p50_ms"] / 10 / out["tick_s"], 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=500, help="holders killed per arm")
    ap.add_argument("--ticks", type=int, default=500, help="ticks timed per mode")
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--findings-per-node", type=int, default=100)
    ap.add_argument("--orphans-per-node", type=int, default=1)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_remediate: needs root (mknod of the fake GPU nodes, cgroups): run it with sudo",
              file=sys.stderr)
        return 2
    if not shutil.which("fuser"):
        print("bench_remediate: fuser is missing (the reference): apt-get install psmisc", file=sys.stderr)
        return 2
    interrupt_on_sigterm()
    kill = bench_kill(args.kills)
    tick = bench_tick(args.ticks, args.nodes, args.findings_per_node, args.orphans_per_node)
    data = {"kill": kill, "tick": tick, "command": " ".join(["bench/bench_remediate.py", *sys.argv[1:]]),
            "machine": machine()}
    path = write_json("remediate", data)
    a = kill["arms"]
    print_table(["kill, ms", "p50", "p99", "max"],
                [[name, a[arm]["p50_ms"], a[arm]["p99_ms"], a[arm]["max_ms"]] for name, arm in (
                    ("guarded act (Remediator.handle)", "act"), ("dry-run re-check alone", "recheck"),
                    ("  /proc identity (ProcView.look)", "look"), ("  device hold (ProcView.held)", "held"),
                    ("  CRI ContainerStatus via the relay", "cri"),
                    ("os.kill + waitpid", "kill"), ("fuser -k -TERM + waitpid", "fuser"))])
    print(f"act / kill: p50 {kill['act_vs_kill_p50']}x, p99 {kill['act_vs_kill_p99']}x; "
          f"act / fuser: p50 {kill['act_vs_fuser_p50']}x, p99 {kill['act_vs_fuser_p99']}x")
    print_table(["tick, ms", "wall p50", "wall p99", "loop CPU p50", "loop CPU p99"],
                [[mode, tick[mode]["wall"]["p50_ms"], tick[mode]["wall"]["p99_ms"],
                  tick[mode]["loop_cpu"]["p50_ms"], tick[mode]["loop_cpu"]["p99_ms"]]
                 for mode in ("off", "dry_run")])
    r = tick["first_dry_run_round"]
    print(f"first dry-run round: {r['incidents_proposed']} incidents in {r['wall_ms']} ms "
          f"({r['loop_cpu_ms']} ms of loop CPU)")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
