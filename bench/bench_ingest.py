#!/usr/bin/env python3
"""Benchmark: collector ingest, events/s from 50 concurrent simulated tracers over loopback TCP.

Run:  .venv/bin/python bench/bench_ingest.py [--tracers 50] [--batch-events 2000,200,50]
                                              [--events-per-tracer 20000] [--window 8] [--client-procs 2]

Each target runs as its own process: the real `ghostgpu collector` (SQLite in a temp dir, default
event log), and the references, measured in the same run on the same machine: a bare gRPC echo
server on grpc.aio that parses each TracerMessage and acks its last seq, storing nothing (the
ceiling of Python gRPC here), and the same echo on the thread-pool `grpc.server` (why the
collector is built on grpc.aio). Simulated tracers (tests/helpers/sim_tracer.py) run in
`client-procs` processes; each connects, sends a 20-consumer snapshot, then, all together, pushes
its pre-serialized batches (holder events, one finding every 20 events) keeping `window` batches
unacknowledged. The rate is every tracer's last event acknowledged: events / (last ack - first
send). For the collector, NodeStatus must then count every event ingested once, none lost or
duplicated. Goal: >= 100,000 events/s. Writes bench/results/ingest.json.

--paced EVENTS_PER_S [--duration-s 10] instead offers a steady total rate from the tracers for a
fixed time, batched by the real tracer's policy (bench/ingest_paced.py), against the collector and
echo-aio: offered vs acknowledged events/s, batch sizes, ack latency from event creation. Writes
bench/results/ingest_paced.json (`--out NAME`: bench/results/NAME.json). `--paced-window N` sets the
unacknowledged batches per tracer (default: the tracer's WINDOW_BATCHES; 0: no window, every due
batch leaves, as the tracer did before it had one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import CLK_TCK, ROOT, cpu_ticks, machine, print_table, status_kib, write_json

GOAL_EVENTS_PER_S = 100_000
PY = sys.executable
METHOD_SERVICE = "ghostgpu.v1.NodeStream"


# ---- reference servers ---------------------------------------------------------------------------


def _echo_reply(raw: bytes) -> bytes | None:
    from ghostgpu.common.wire.protocol import API_VERSION, MAX_BATCH_EVENTS
    from ghostgpu.v1 import stream_pb2

    msg = stream_pb2.TracerMessage.FromString(raw)
    kind = msg.WhichOneof("msg")
    if kind == "hello":
        reply = stream_pb2.CollectorMessage(welcome=stream_pb2.Welcome(api_version=API_VERSION,
                                                                       max_batch_events=MAX_BATCH_EVENTS))
    elif kind == "events":
        events = msg.events.events
        reply = stream_pb2.CollectorMessage(ack=stream_pb2.Ack(seq=events[len(events) - 1].seq))
    else:
        return None
    return reply.SerializeToString()


def serve_echo(kind: str, listen: str) -> None:
    import grpc

    from ghostgpu.common.wire.protocol import channel_options

    if kind == "echo-aio":
        async def connect_aio(requests: Any, context: Any) -> None:
            async for raw in requests:
                if (reply := _echo_reply(raw)) is not None:
                    await context.write(reply)

        async def main() -> None:
            server = grpc.aio.server(options=channel_options())
            handler = grpc.stream_stream_rpc_method_handler(connect_aio)
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(METHOD_SERVICE,
                                                                                  {"Connect": handler}),))
            port = server.add_insecure_port(listen)
            await server.start()
            print(f"listening on 127.0.0.1:{port}", file=sys.stderr, flush=True)
            await server.wait_for_termination()

        asyncio.run(main())
        return

    def connect_sync(requests: Any, context: Any) -> Any:
        for raw in requests:
            if (reply := _echo_reply(raw)) is not None:
                yield reply

    # A thread-pool server parks one worker per open stream: size the pool for a thousand nodes
    # (workers start lazily, so 50 streams make ~50 threads).
    server = grpc.server(ThreadPoolExecutor(max_workers=4096), options=channel_options())
    handler = grpc.stream_stream_rpc_method_handler(connect_sync)
    generic = grpc.method_handlers_generic_handler(METHOD_SERVICE, {"Connect": handler})
    server.add_generic_rpc_handlers((generic,))
    port = server.add_insecure_port(listen)
    server.start()
    print(f"listening on 127.0.0.1:{port}", file=sys.stderr, flush=True)
    server.wait_for_termination()


# ---- client processes ----------------------------------------------------------------------------


def run_clients(target: str, first: int, count: int, batch_events: int, events_per_tracer: int,
                window: int) -> None:
    """One client process: `count` sim tracers; 'ready' on stdout, waits for a line on stdin, pushes,
    prints one JSON line of timings."""
    from tests.helpers.sim_tracer import SimTracer, make_consumer, synthetic_batches

    nbatches = max(1, events_per_tracer // batch_events)
    tracers, plans = [], []
    for i in range(first, first + count):
        node = f"bench-node-{i:03d}"
        t = SimTracer(target, node, capabilities=())
        t.connect(timeout_s=60)
        t.send_snapshot([make_consumer(node, 10_000 + j, gpu=j % 8, container_id=f"{j:02x}" * 32)
                         for j in range(20)], seq=0)
        batches = synthetic_batches(node, nbatches, batch_events)
        plans.append((batches, [batch_events * (k + 1) for k in range(nbatches)]))
        tracers.append(t)
    print("ready", flush=True)
    sys.stdin.readline()
    start = time.time()
    ends: list[float] = [0.0] * len(tracers)
    errors: list[str] = []

    def push(k: int) -> None:
        try:
            tracers[k].push(*plans[k], window=window, timeout_s=600)
            ends[k] = time.time()
        except AssertionError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=push, args=(k,)) for k in range(len(tracers))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    events = sum(len(p[0]) * batch_events for p in plans)
    print(json.dumps({"start": start, "end": max(ends), "events": events, "errors": errors}), flush=True)
    for t in tracers:
        t.stop()


# ---- orchestration -------------------------------------------------------------------------------


def _spawn_server(target: str, tmp: str) -> tuple[subprocess.Popen[str], str]:
    if target == "collector":
        cmd = [PY, "-m", "ghostgpu.cli", "collector", "--listen", "127.0.0.1:0",
               "--db", f"{tmp}/collector.db"]
    else:
        cmd = [PY, str(Path(__file__).resolve()), "--serve", target]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if "listening on" in line:
            addr = line.split("listening on", 1)[1].split(";")[0].split(",")[0].strip()
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # drain
            return proc, addr
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise SystemExit(f"bench: {target} did not start: {proc.stderr.read()}")


def _node_totals(addr: str) -> dict[str, int]:
    import grpc

    from ghostgpu.v1 import query_pb2, query_pb2_grpc

    with grpc.insecure_channel(addr) as ch:
        resp = query_pb2_grpc.QueryStub(ch).NodeStatus(query_pb2.NodeStatusRequest(), timeout=30)
    return {"nodes": len(resp.nodes), "ingested": sum(n.events_ingested_total for n in resp.nodes),
            "lost": sum(n.events_lost_total for n in resp.nodes),
            "duplicates": sum(n.duplicates_total for n in resp.nodes)}


def measure(target: str, args: argparse.Namespace, batch_events: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ghostgpu-bench-ingest-") as tmp:
        server, addr = _spawn_server(target, tmp)
        clients = []
        try:
            per = [args.tracers // args.client_procs + (i < args.tracers % args.client_procs)
                   for i in range(args.client_procs)]
            first = 0
            for count in per:
                cmd = [PY, str(Path(__file__).resolve()), "--client", addr, str(first), str(count),
                       str(batch_events), str(args.events_per_tracer), str(args.window)]
                clients.append(subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                text=True))
                first += count
            for c in clients:
                assert c.stdout is not None
                if c.stdout.readline().strip() != "ready":
                    raise SystemExit(f"bench: a client process failed to connect to {target}")
            cpu0 = cpu_ticks(server.pid) or 0
            for c in clients:
                assert c.stdin is not None
                c.stdin.write("go\n")
                c.stdin.flush()
            results = [json.loads(c.stdout.readline()) for c in clients]  # type: ignore[union-attr]
            cpu1 = cpu_ticks(server.pid) or 0
            rss_kib = status_kib(server.pid, "VmHWM")
            totals = _node_totals(addr) if target == "collector" else None
        finally:
            for c in clients:
                c.kill()
            server.terminate()
            server.wait(30)
    errors = [e for r in results for e in r["errors"]]
    events = sum(r["events"] for r in results)
    wall_s = max(r["end"] for r in results) - min(r["start"] for r in results)
    out = {"target": target, "batch_events": batch_events, "events": events, "wall_s": round(wall_s, 3),
           "events_per_s": round(events / wall_s) if wall_s > 0 and not errors else None,
           "server_cpu_s": round((cpu1 - cpu0) / CLK_TCK, 2),
           "server_peak_rss_mb": round((rss_kib or 0) / 1024, 1),
           "errors": errors[:5]}
    if totals is not None:
        out["node_status"] = totals
        out["exactly_once"] = (totals["ingested"] == events and totals["lost"] == 0
                               and totals["duplicates"] == 0)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tracers", type=int, default=50)
    p.add_argument("--batch-events", default="2000,200,50", help="comma-separated batch sizes to measure")
    p.add_argument("--events-per-tracer", type=int, default=20_000)
    p.add_argument("--window", type=int, default=8, help="unacknowledged batches per tracer")
    p.add_argument("--client-procs", type=int, default=2)
    p.add_argument("--targets", help="default collector,echo-aio,echo-sync (--paced: collector,echo-aio)")
    p.add_argument("--paced", type=float, metavar="EVENTS_PER_S",
                   help="offer this many events/s in all, batched by the tracer's policy")
    p.add_argument("--duration-s", type=float, default=10.0, help="--paced: how long to offer")
    p.add_argument("--paced-window", type=int, metavar="BATCHES",
                   help="--paced: unacknowledged batches per tracer (default: tracer/stream.py's "
                        "WINDOW_BATCHES; 0: no window)")
    p.add_argument("--out", help="result name under bench/results/ (default: ingest, --paced: ingest_paced)")
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--client", nargs=6, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve_echo(args.serve, "127.0.0.1:0")
        return 0
    if args.client:
        addr, first, count, batch, per, window = args.client
        run_clients(addr, int(first), int(count), int(batch), int(per), int(window))
        return 0
    if args.paced:
        return main_paced(args)
    args.targets = args.targets or "collector,echo-aio,echo-sync"
    runs = []
    for batch_events in (int(x) for x in args.batch_events.split(",")):
        for target in args.targets.split(","):
            r = measure(target, args, batch_events)
            runs.append(r)
            print(f"{target:10s} batch {batch_events:5d}: {r['events_per_s']} events/s "
                  f"(server CPU {r['server_cpu_s']} s over {r['wall_s']} s)", file=sys.stderr, flush=True)
    rows = []
    for r in runs:
        ref = next((x for x in runs if x["target"] == "echo-aio" and x["batch_events"] == r["batch_events"]),
                   None)
        ok = ref is not None and ref["events_per_s"] and r["events_per_s"]
        ratio = r["events_per_s"] / ref["events_per_s"] if ok and ref else None
        r["ratio_vs_echo_aio"] = round(ratio, 3) if ratio else None
        rows.append([r["target"], r["batch_events"], r["events_per_s"], r["ratio_vs_echo_aio"],
                     r["server_cpu_s"], r["server_peak_rss_mb"], r.get("exactly_once", "-")])
    print_table(["target", "batch", "events/s", "vs echo-aio", "server CPU s", "peak RSS MB", "exactly once"],
                rows)
    collector = [r for r in runs if r["target"] == "collector" and r["events_per_s"]]
    best = max((r["events_per_s"] for r in collector), default=None)
    data = {"goal_events_per_s": GOAL_EVENTS_PER_S, "tracers": args.tracers, "window": args.window,
            "events_per_tracer": args.events_per_tracer, "client_procs": args.client_procs,
            "best_collector_events_per_s": best, "runs": runs, "machine": machine()}
    path = write_json(args.out or "ingest", data)
    print(f"wrote {path.relative_to(ROOT)}")
    ok = all(r.get("exactly_once", True) for r in runs) and best is not None and best >= GOAL_EVENTS_PER_S
    return 0 if ok else 1


def main_paced(args: argparse.Namespace) -> int:
    from bench.ingest_paced import measure_paced

    runs = []
    for target in (args.targets or "collector,echo-aio").split(","):
        with tempfile.TemporaryDirectory(prefix="ghostgpu-bench-ingest-") as tmp:
            r = measure_paced(target, args.tracers, args.client_procs, args.paced, args.duration_s,
                              _spawn_server, _node_totals, tmp, args.paced_window)
        runs.append(r)
        note = f" ({r['note']})" if r.get("note") else ""
        print(f"{target:10s} paced: offered {r['offered_events_per_s']}, acked {r['acked_events_per_s']} "
              f"events/s{note}", file=sys.stderr, flush=True)
    rows = [[r["target"], r["offered_events_per_s"], r["acked_events_per_s"], r["batch_events"]["mean"],
             r["batch_events"]["p50"], r["batch_events"]["p99"], r["ack_latency_ms"]["p50"],
             r["ack_latency_ms"]["p99"], r["client_wake_late_ms"]["p99"], r["server_cpu_s"],
             r["clients_cpu_s"], r.get("exactly_once", "-")] for r in runs]
    print_table(["target", "offered/s", "acked/s", "batch mean", "p50", "p99", "ack ms p50", "p99",
                 "client late ms p99", "server CPU s", "clients CPU s", "exactly once"], rows)
    data = {"offered_events_per_s": args.paced, "duration_s": args.duration_s, "tracers": args.tracers,
            "client_procs": args.client_procs, "window_batches": runs[0]["window_batches"] if runs else None,
            "runs": runs, "machine": machine()}
    path = write_json(args.out or "ingest_paced", data)
    print(f"wrote {path.relative_to(ROOT)}")
    ok = all(r["clients_kept_up"] and r["acked_events_per_s"] and r.get("exactly_once", True) for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    sys.exit(main())
