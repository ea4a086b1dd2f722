"""Benchmark: what `kubectl ghostgpu ps` costs over `ghostgpu ps`, side by side in one run.

Run (no root, no BPF):  .venv/bin/python bench/bench_kubectl_plugin.py [--trials 30] [--holders 1000]

A real `ghostgpu collector` process holds `--holders` GPU holders of 10 nodes, sent by simulated
tracers over real gRPC (tests/helpers/sim_tracer.py). Three arms, rotating within each trial, each a
fresh process timed from spawn to exit with its output read:
- `kubectl ghostgpu ps --collector ADDR -o json`: the real kubectl finds the venv's `kubectl-ghostgpu`
  on PATH and runs it (the plugin's path, as a user runs it);
- `ghostgpu ps --collector ADDR -o json`: the venv's console script (the reference);
- `kubectl version --client -o json`: kubectl's own start-up, the floor the plugin mechanism adds.
Every `ps` answer must hold every holder. The port-forward is not measured: it needs an API server.

Nothing here is asserted; the JSON goes to bench/results/kubectl_plugin.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import interrupt_on_sigterm, machine, print_table, write_json
from ghostgpu.common.model.consumers import ConsumerClass
from tests.helpers.collector_proc import CollectorProcess
from tests.helpers.sim_tracer import SimTracer, make_consumer

VENV_BIN = Path(sys.executable).parent
NODES = 10


def env_for(home: Path) -> dict[str, str]:
    """The venv's bin first on PATH (kubectl finds the plugin there); no kubeconfig, no collector
    variable: the flag names the collector."""
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "GHOSTGPU_COLLECTOR")}
    env.update({"PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}", "HOME": str(home)})
    return env


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL,
                          timeout=120, check=False)
    took_s = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"bench_kubectl_plugin: {' '.join(argv)} exited {done.returncode}: "
                         f"{done.stderr.strip()}")
    return took_s, done.stdout


def summary_ms(values_s: list[float]) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values_s)
    return {"n": len(ms), "min_ms": round(ms[0], 1), "p50_ms": round(statistics.median(ms), 1),
            "max_ms": round(ms[-1], 1)}


def feed(collector: str, holders: int, stack: ExitStack) -> None:
    """`holders` consumers spread over NODES simulated tracers, each snapshot acknowledged."""
    per_node = holders // NODES
    for n in range(NODES):
        node = f"bench-node-{n:02d}"
        tracer = stack.enter_context(SimTracer(collector, node))
        welcome = tracer.connect()
        consumers = [make_consumer(node, 10_000 + i, gpu=i % 8, container_id=f"{n:02x}{i:06x}".ljust(64, "0"),
                                   cls=ConsumerClass.HIDDEN) for i in range(per_node)]
        tracer.send_snapshot(consumers, seq=welcome.acked_seq)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--holders", type=int, default=1000)
    args = ap.parse_args()
    interrupt_on_sigterm()
    kubectl = shutil.which("kubectl")
    if kubectl is None or not (VENV_BIN / "kubectl-ghostgpu").exists():
        print("bench_kubectl_plugin: needs kubectl on PATH and the venv's kubectl-ghostgpu "
              "(bash scripts/bootstrap.sh install)", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="ghostgpu-bench-kubectl-"))
    try:
        with ExitStack() as stack:
            collector = stack.enter_context(CollectorProcess(work / "collector", unix=False))
            feed(collector.address, args.holders, stack)
            env = env_for(work)
            ps = ["ps", "--collector", collector.address, "-o", "json"]
            arms = {
                "kubectl ghostgpu ps": [kubectl, "ghostgpu", *ps],
                "ghostgpu ps": [str(VENV_BIN / "ghostgpu"), *ps],
                "kubectl version --client": [kubectl, "version", "--client", "-o", "json"],
            }
            want = args.holders // NODES * NODES
            deadline = time.monotonic() + 30
            while len(json.loads(timed(arms["ghostgpu ps"], env)[1])) < want:  # every snapshot applied
                if time.monotonic() > deadline:
                    raise SystemExit(f"bench_kubectl_plugin: the collector never listed {want} holders")
            times: dict[str, list[float]] = {arm: [] for arm in arms}
            names = list(arms)
            for trial in range(args.trials):
                for arm in names[trial % 3:] + names[:trial % 3]:
                    took_s, out = timed(arms[arm], env)
                    if arm.endswith(" ps") and len(json.loads(out)) != want:
                        raise SystemExit(f"bench_kubectl_plugin: {arm} listed {len(json.loads(out))} "
                                         f"holders, not {want}")
                    times[arm].append(took_s)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result: dict[str, Any] = {arm: summary_ms(values) for arm, values in times.items()}
    plugin, bare = result["kubectl ghostgpu ps"], result["ghostgpu ps"]
    result["ratio_p50"] = round(plugin["p50_ms"] / bare["p50_ms"], 2)
    result["added_p50_ms"] = round(plugin["p50_ms"] - bare["p50_ms"], 1)
    result["holders"], result["nodes"], result["trials"] = want, NODES, args.trials
    result["machine"] = machine()
    print_table(["arm", "min ms", "p50 ms", "max ms"],
                [[arm, s["min_ms"], s["p50_ms"], s["max_ms"]] for arm, s in result.items()
                 if isinstance(s, dict) and "p50_ms" in s])
    print(f"kubectl ghostgpu ps / ghostgpu ps at p50: {result['ratio_p50']}x (+{result['added_p50_ms']} ms)")
    print(write_json("kubectl_plugin", result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
