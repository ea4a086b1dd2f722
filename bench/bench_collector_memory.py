#!/usr/bin/env python3
"""Benchmark: collector memory with 1,000 simulated nodes of 20 consumers each.

Run:  .venv/bin/python bench/bench_collector_memory.py [--nodes 1000] [--consumers 20] [--settle-s 5]

The real `ghostgpu collector` runs as its own process (SQLite in a temp dir). One driver process
opens one connection and one stream per simulated node (as a real tracer does), sends Hello, a
Snapshot of `consumers` consumers (half hidden container processes, which are open findings, a
quarter visible, a quarter outside any container, 10 containers per node), NodeInfo with 8 GPUs,
PodResources allocations, and a batch of 100 events, waits for its Ack, and keeps every stream
open. The tracers offer no CRI relay, so every container is cached as unresolved (a CRI entry per
container, as in a cluster whose runtime is away). VmRSS of the collector is read before any node
connects and `settle-s` after the last Ack, once NodeStatus and ListConsumers show every node and
consumer. Reference, same run: the bare grpc.aio echo server of bench_ingest.py holding the same
1,000 connections and streams (what gRPC itself costs), and the same echo on the thread-pool
`grpc.server` (a worker thread per open stream: why the collector uses grpc.aio).
Writes bench/results/collector_memory.json.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_ingest import _spawn_server
from bench.common import ROOT, machine, print_table, status_kib, write_json

METHOD = "/ghostgpu.v1.NodeStream/Connect"
MB = 1024


def node_messages(node: str, consumers: int) -> list[bytes]:
    from ghostgpu.common.model.consumers import ConsumerClass
    from ghostgpu.common.wire.convert import consumer_to_proto
    from ghostgpu.v1 import stream_pb2
    from tests.helpers.sim_tracer import (
        allocations,
        batch_bytes,
        finding,
        holder,
        make_consumer,
        message_bytes,
    )

    classes = [ConsumerClass.HIDDEN, ConsumerClass.HIDDEN, ConsumerClass.VISIBLE, ConsumerClass.UNATTRIBUTED]
    pool = []
    for j in range(consumers):
        cls = classes[j % 4]
        cid = f"{node[-4:]}{j % 10:02d}".ljust(64, "0") if cls != ConsumerClass.UNATTRIBUTED else ""
        pool.append(make_consumer(node, 1000 + j, gpu=j % 8, cls=cls, container_id=cid,
                                  gpu_memory_bytes=j << 28))
    info = stream_pb2.NodeInfo(bpf=True, nvml=True, driver_version="550.54.15", gpus=[
        stream_pb2.Gpu(index=i, uuid=f"GPU-{i:08x}-0000-4000-8000-000000000000", name="NVIDIA H100 80GB HBM3",
                       minor=i, memory_total_bytes=80 << 30) for i in range(8)])
    alloc = allocations([("ml", f"train-{k}", "trainer", [f"GPU-{k:08x}-0000-4000-8000-000000000000"])
                         for k in range(8)])
    hello = message_bytes(hello=stream_pb2.Hello(api_version=1, node=node, boot_id="boot-" + node,
                                                 instance_id="inst-" + node, tracer_version="sim",
                                                 capabilities=["bpf", "nvml"]))
    snap = message_bytes(snapshot=stream_pb2.Snapshot(
        seq=0, consumers=[consumer_to_proto(c) for c in pool], info=info, allocations=alloc,
        ts_unix_ns=time.time_ns()))
    events = [finding(s, pool[s % consumers]) if s % 10 == 0 else holder(s, 1000 + s % consumers,
                                                                          pool[s % consumers].container_id)
              for s in range(1, 101)]
    return [hello, snap, batch_bytes(events)]


async def drive(target: str, nodes: int, consumers: int,
                hold: asyncio.Event) -> tuple[float, list[asyncio.Task[None]]]:
    """Open every node's stream, feed it, wait for its Ack; return once all are acked, the streams
    staying open until `hold` is set."""
    import grpc

    from ghostgpu.common.wire.protocol import channel_options
    from ghostgpu.v1 import stream_pb2

    acked = 0
    done = asyncio.Event()

    async def one(i: int) -> None:
        nonlocal acked
        msgs = node_messages(f"mem-node-{i:04d}", consumers)
        async with grpc.aio.insecure_channel(target, options=channel_options()) as ch:
            call = ch.stream_stream(METHOD, response_deserializer=stream_pb2.CollectorMessage.FromString)()
            for m in msgs:
                await call.write(m)
            async for reply in call:
                if reply.WhichOneof("msg") == "ack" and reply.ack.seq >= 100:
                    break
            acked += 1
            if acked == nodes:
                done.set()
            await hold.wait()
            call.cancel()

    start = time.monotonic()
    tasks = [asyncio.create_task(one(i)) for i in range(nodes)]
    await asyncio.wait_for(done.wait(), 600)
    return time.monotonic() - start, tasks


def _counts(addr: str) -> tuple[int, int]:
    import grpc

    from ghostgpu.v1 import query_pb2, query_pb2_grpc

    with grpc.insecure_channel(addr, options=[("grpc.max_receive_message_length", 256 << 20)]) as ch:
        stub = query_pb2_grpc.QueryStub(ch)
        nodes = stub.NodeStatus(query_pb2.NodeStatusRequest(), timeout=60).nodes
        rows = stub.ListConsumers(query_pb2.ListConsumersRequest(), timeout=60).consumers
    return sum(1 for n in nodes if n.connected), len(rows)


def measure(target: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ghostgpu-bench-mem-") as tmp:
        server, addr = _spawn_server(target, tmp)
        try:
            time.sleep(1.0)  # imports and start-up settle
            idle_kib = status_kib(server.pid, "VmRSS") or 0

            async def run() -> dict[str, Any]:
                hold = asyncio.Event()
                elapsed, tasks = await drive(addr, args.nodes, args.consumers, hold)
                await asyncio.sleep(args.settle_s)
                out: dict[str, Any] = {"connect_and_ack_s": round(elapsed, 2)}
                if target == "collector":
                    out["connected_nodes"], out["consumers"] = await asyncio.to_thread(_counts, addr)
                out["rss_kib"] = status_kib(server.pid, "VmRSS")
                out["hwm_kib"] = status_kib(server.pid, "VmHWM")
                out["threads"] = status_kib(server.pid, "Threads")  # a count, not kB: same "Key: N" line
                hold.set()
                await asyncio.gather(*tasks, return_exceptions=True)
                return out

            result = asyncio.run(run())
        finally:
            server.terminate()
            server.wait(30)
    rss = result["rss_kib"] or 0
    result.update({"target": target, "idle_rss_mb": round(idle_kib / MB, 1), "rss_mb": round(rss / MB, 1),
                   "peak_rss_mb": round((result.pop("hwm_kib") or 0) / MB, 1),
                   "per_node_kib": round((rss - idle_kib) / args.nodes, 1)})
    result.pop("rss_kib")
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--consumers", type=int, default=20)
    p.add_argument("--settle-s", type=float, default=5.0)
    args = p.parse_args()
    runs = [measure(t, args) for t in ("collector", "echo-aio", "echo-sync")]
    col, ref, ref_sync = runs
    rows = [[r["target"], r["idle_rss_mb"], r["rss_mb"], r["peak_rss_mb"], r["per_node_kib"], r["threads"],
             r.get("consumers", "-")] for r in runs]
    print_table(["target", "idle RSS MB", f"RSS MB, {args.nodes} nodes", "peak MB", "KiB per node", "threads",
                 "consumers"], rows)
    complete = (col.get("connected_nodes") == args.nodes
                and col.get("consumers") == args.nodes * args.consumers)
    data = {"nodes": args.nodes, "consumers_per_node": args.consumers, "settle_s": args.settle_s,
            "collector": col, "reference_echo_aio": ref, "reference_echo_sync": ref_sync,
            "collector_over_echo_rss": round(col["rss_mb"] / ref["rss_mb"], 2) if ref["rss_mb"] else None,
            "complete": complete, "machine": machine()}
    path = write_json("collector_memory", data)
    print(f"wrote {path.relative_to(ROOT)}")
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
