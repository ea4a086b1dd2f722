#!/usr/bin/env python3
"""Benchmark: the collector's /metrics scrape with 1,000 nodes x 20 consumers (goal < 100 ms a scrape).

Run:  .venv/bin/python bench/bench_metrics_scrape.py [--nodes 1000] [--consumers 20] [--scrapes 20]
      .venv/bin/python bench/bench_metrics_scrape.py --no-heap-policy --out metrics_scrape_no_heap_policy

A real Collector (SQLite in a temp dir) with --metrics-listen on loopback. Its state is built the way
ingest builds it, on its event loop: per node a Hello/Position, a Snapshot of `consumers` consumers
(NodeView.apply_snapshot, then ClusterTable.update) with NodeInfo of 8 GPUs; containers resolve at
once to namespace/pod/container names. Per node: 4 hidden and 2 unattributed consumers (non-visible:
6,000 in all, so the default cap of 1,000 per-process series applies) and 14 visible ones.

Scrapes are real HTTP GETs over one keep-alive connection (as Prometheus scrapes), timed from request
to the last body byte, without and with `Accept-Encoding: gzip`:
- warm: nothing changed since the last scrape;
- cold: every node changed since the last scrape (one consumer's GPU memory per node, applied as a
  tracer's finding event is, plus a heartbeat), the collector's writes of those changes done;
- cold_unsettled: the same, scraped at once, while the collector still writes the 1,000 changed
  findings (the scrape shares the GIL with that burst);
- uncached: the renderer's cache emptied before each scrape (what the first scrape costs).
Also how long each scrape holds the collector's event loop (the one Collector.call per scrape).
Side by side in the same run: prometheus_client's generate_latest over a custom collector yielding the
same ghostgpu_* series (the naive way), and the same HttpServer serving a static body of the page's
size (the transport floor). Writes bench/results/metrics_scrape.json (`--out NAME`: NAME.json).

Each case lists the full (generation 2) garbage collections that landed in its scrapes and how long
each stopped the process: with collector/heap.py's policy (the default here, as `ghostgpu collector`
runs) and without it (`--no-heap-policy`) they are the figures behind that policy.
"""

from __future__ import annotations

import argparse
import gc
import http.client
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, machine, print_table, write_json

GOAL_MS = 100.0


class Names:
    """The benchmark's resolver: every container is a running pod of the `ml` namespace."""

    def __init__(self, transport_for: Any, on_change: Any) -> None:
        pass

    def get(self, node: str, container_id: str) -> Any:
        from ghostgpu.common.model.consumers import K8sInfo

        return K8sInfo("resolved", "ml", f"train-{container_id[:6]}-{container_id[6:10]}", "uid",
                       "trainer", "registry.local/ml/train:1.4", "CONTAINER_RUNNING", "SANDBOX_READY")


def consumers_of(node: int, count: int) -> list[Any]:
    from ghostgpu.common.model.consumers import ConsumerClass
    from tests.helpers.sim_tracer import make_consumer

    out = []
    for j in range(count):
        k = j % 10
        cls = (ConsumerClass.HIDDEN if k in (0, 5) else ConsumerClass.UNATTRIBUTED if k == 3
               else ConsumerClass.VISIBLE)
        cid = "" if cls == ConsumerClass.UNATTRIBUTED else f"{node:06d}{j:04d}".ljust(64, "0")
        out.append(make_consumer(f"gpu-node-{node:04d}", 1000 + j, gpu=j % 8, cls=cls, container_id=cid,
                                 gpu_memory_bytes=(j + 1) << 28))
    return out


def populate(collector: Any, nodes: int, consumers: int) -> None:
    from ghostgpu.collector.nodes import NodeView
    from ghostgpu.collector.store import Position

    from ghostgpu.common.wire.convert import consumer_to_proto
    from ghostgpu.v1 import stream_pb2

    info = stream_pb2.NodeInfo(bpf=True, nvml=True, driver_version="550.54.15", gpus=[
        stream_pb2.Gpu(index=i, uuid=f"GPU-{i:08x}-1c2d-4e5f-8a9b-{i:012x}", name="NVIDIA H100 80GB HBM3",
                       minor=i, memory_total_bytes=80 << 30) for i in range(8)])

    def one(i: int) -> None:
        name = f"gpu-node-{i:04d}"
        ns = collector.nodes.setdefault(name, NodeView(name))
        ns.begin(stream_pb2.Hello(api_version=1, node=name, boot_id="b", instance_id=f"i-{i}",
                                  tracer_version="0.4.0"), Position(name, "b", f"i-{i}"))
        pool = [consumer_to_proto(c) for c in consumers_of(i, consumers)]
        snap = stream_pb2.Snapshot(seq=0, consumers=pool, info=info)
        collector.cluster.update(ns, ns.apply_snapshot(snap))

    for start in range(0, nodes, 50):  # 50 nodes per loop turn: ingest of the real streams goes on meanwhile
        collector.call(lambda s=start: [one(i) for i in range(s, min(s + 50, nodes))], timeout_s=60)


def change_every_node(collector: Any, step: int, settle: bool = True) -> None:
    """One consumer's GPU memory per node, as the tracer's finding event carries it, and a heartbeat;
    with `settle`, then wait until the collector has written the changed findings to SQLite (what a
    second of the 1 s findings flush does), so the scrape is timed alone rather than against a
    1,000-node burst of ingest work that a real cluster spreads over the scrape interval."""
    from dataclasses import replace

    from ghostgpu.common.wire.convert import consumer_to_proto
    from ghostgpu.v1 import stream_pb2

    def run() -> None:
        for ns in collector.nodes.values():
            c = next(iter(ns.consumers.values()))  # never edited in place: the tables hold it
            c = replace(c, gpu_memory_bytes=(c.gpu_memory_bytes or 0) + (1 << 20))
            seq = ns.state_seq + 1
            ev = stream_pb2.NodeEvent(seq=seq, ts_unix_ns=time.time_ns(), finding=consumer_to_proto(c))
            collector.cluster.update(ns, ns.apply_events([ev], [seq], ["finding"], 0))
            ns.last_heartbeat_unix_ns = time.time_ns()

    collector.call(run, timeout_s=60)
    if settle:
        collector.call(collector.cluster.flush_changed, timeout_s=60)
        collector.store.barrier().result(60)


def get(conn: http.client.HTTPConnection, path: str, gzip_ok: bool) -> tuple[float, int]:
    """(seconds from request to the last body byte, body bytes on the wire)."""
    headers = {"Accept-Encoding": "gzip"} if gzip_ok else {}
    t0 = time.perf_counter()
    conn.request("GET", path, headers=headers)
    resp = conn.getresponse()
    body = resp.read()
    elapsed = time.perf_counter() - t0
    if resp.status != 200:
        raise RuntimeError(f"GET {path}: HTTP {resp.status}: {body[:200]!r}")
    return elapsed, len(body)


def stats_ms(values: list[float]) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return {"p50_ms": round(statistics.median(ms), 1), "p99_ms": round(p99, 1), "max_ms": round(ms[-1], 1),
            "n": len(ms)}


def series(runs: int, scrape: Callable[[], float],
           before: Callable[[int], None] | None = None) -> list[float]:
    out = []
    for i in range(runs):
        if before is not None:
            before(i)
        out.append(scrape())
    return out


def naive_registry(page: str) -> Any:
    """A prometheus_client registry whose custom collector yields the page's ghostgpu_* per-node series,
    building every family and sample at each collect, as a collector over the tables would."""
    from ghostgpu.collector.metrics import COLLECTOR_METRICS
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.parser import text_string_to_metric_families

    fams = [(f.name, f.type, [(list(s.labels), list(s.labels.values()), s.value) for s in f.samples])
            for f in text_string_to_metric_families(page) if f.name in COLLECTOR_METRICS
            or f.name + "_total" in COLLECTOR_METRICS]

    class Tables:
        def collect(self) -> Iterator[Any]:
            for name, kind, rows in fams:
                cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                fam = cls(name, "help", labels=rows[0][0] if rows else [])
                for _, values, value in rows:
                    fam.add_metric(values, value)
                yield fam

    registry = CollectorRegistry()
    registry.register(Tables())
    return registry


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--consumers", type=int, default=20)
    p.add_argument("--scrapes", type=int, default=20, help="scrapes per case (>= 20 for a p99)")
    p.add_argument("--max-process-series", type=int, default=1000)
    p.add_argument("--no-heap-policy", action="store_true",
                   help="leave gc alone (without collector/heap.py's freeze, as an embedded collector runs)")
    p.add_argument("--out", default="metrics_scrape", help="result name under bench/results/")
    args = p.parse_args()

    from ghostgpu.collector.config import CollectorConfig
    from ghostgpu.collector.main import Collector
    from prometheus_client import generate_latest

    from ghostgpu.common.web.httpserve import PROMETHEUS_TEXT, HttpServer, Response

    sys.setswitchinterval(0.0005)  # as `ghostgpu collector` runs (cli/main.py main)
    tmp = tempfile.mkdtemp(prefix="ghostgpu-bench-metrics-")
    config = CollectorConfig(listen=("127.0.0.1:0",), db_path=f"{tmp}/collector.db",
                             metrics_listen="127.0.0.1:0", metrics_max_process_series=args.max_process_series)
    collector = Collector(config, resolver_factory=Names)
    collector.start()
    results: dict[str, Any] = {}
    try:
        t0 = time.perf_counter()
        populate(collector, args.nodes, args.consumers)
        build_s = time.perf_counter() - t0
        if not args.no_heap_policy:
            # What `ghostgpu collector` does a minute after start (collector/heap.py), done at once here:
            # the populated heap goes to the permanent generation.
            collector.call(gc.freeze)
        metrics = collector.metrics
        loop_s: list[float] = []
        real_call = metrics.call

        def timed_call(fn: Callable[[], Any]) -> Any:
            def timed() -> Any:
                start = time.perf_counter()
                try:
                    return fn()
                finally:
                    loop_s.append(time.perf_counter() - start)
            return real_call(timed)

        metrics.call = timed_call
        # A full (generation 2) collection walks the collector's whole heap; one that lands in a
        # scrape is its p99 (Python 3.11), so each case lists the ones that did.
        gc_pauses: list[float] = []
        gc_started = [0.0]

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                gc_started[0] = time.perf_counter()
            elif info["generation"] == 2:
                gc_pauses.append(time.perf_counter() - gc_started[0])

        gc.callbacks.append(on_gc)
        host, port = collector.metrics_address.rsplit(":", 1)  # type: ignore[union-attr]
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        get(conn, "/metrics", False)  # first scrape fills the cache
        page = metrics.render_nodes()
        body = metrics.page()
        sample_lines = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))

        def uncache(_: int) -> None:
            metrics._consumers.clear()
            metrics._info.clear()

        cases = {"warm": None, "cold": lambda i: change_every_node(collector, i),
                 "cold_unsettled": lambda i: change_every_node(collector, i, settle=False),
                 "uncached": uncache}
        for name, before in cases.items():
            for gz in (False, True):
                loop_s.clear()
                wire: list[int] = []
                full_gc: list[float] = []

                def scrape(gz: bool = gz, wire: list[int] = wire, full_gc: list[float] = full_gc) -> float:
                    gc_pauses.clear()
                    elapsed, size = get(conn, "/metrics", gz)
                    wire.append(size)
                    full_gc.extend(gc_pauses)
                    return elapsed

                got = series(args.scrapes, scrape, before)
                key = f"{name}{'_gzip' if gz else ''}"
                results[key] = {**stats_ms(got), "wire_bytes": wire[-1], "loop_hold": stats_ms(loop_s),
                                "full_gc_during_scrapes_ms": [round(v * 1000, 1) for v in full_gc]}

        registry = naive_registry(page)
        naive = series(args.scrapes, lambda: _timed(lambda: generate_latest(registry)))
        results["naive_generate_latest"] = stats_ms(naive)

        static = HttpServer("127.0.0.1:0", {"/static": lambda req: Response(200, body, PROMETHEUS_TEXT)},
                            name="static").start()
        try:
            sconn = http.client.HTTPConnection("127.0.0.1", static.port, timeout=60)
            for gz in (False, True):
                got = series(args.scrapes, lambda gz=gz: get(sconn, "/static", gz)[0])
                results[f"static{'_gzip' if gz else ''}"] = stats_ms(got)
        finally:
            static.stop()
        conn.close()
    finally:
        collector.stop()

    rows = [[k, v["p50_ms"], v["p99_ms"], v["max_ms"], v.get("wire_bytes", "-"),
             v["loop_hold"]["p50_ms"] if "loop_hold" in v else "-",
             ", ".join(map(str, v.get("full_gc_during_scrapes_ms", []))) or "-"] for k, v in results.items()]
    print(f"{args.nodes} nodes x {args.consumers} consumers: {sample_lines} samples, page {len(body)} bytes, "
          f"state built in {build_s:.1f} s")
    print_table(["case", "p50 ms", "p99 ms", "max ms", "bytes on the wire", "loop held p50 ms",
                 "full GC in a scrape, ms"], rows)
    ratios = {
        "naive_over_cold_p50": round(results["naive_generate_latest"]["p50_ms"]
                                     / results["cold"]["p50_ms"], 1),
        "cold_over_static_p50": round(results["cold"]["p50_ms"] / results["static"]["p50_ms"], 1),
        "warm_over_static_p50": round(results["warm"]["p50_ms"] / results["static"]["p50_ms"], 1),
        "cold_gzip_over_static_gzip_p50": round(results["cold_gzip"]["p50_ms"]
                                                / results["static_gzip"]["p50_ms"], 1),
    }
    for k, v in ratios.items():
        print(f"{k}: {v}")
    goal_cases = ("warm", "cold", "warm_gzip", "cold_gzip")
    worst_p50 = max(results[k]["p50_ms"] for k in goal_cases)
    worst_p99 = max(results[k]["p99_ms"] for k in goal_cases)
    print(f"goal < {GOAL_MS:g} ms a scrape (warm and cold, plain and gzip): p50 "
          f"{'met' if worst_p50 < GOAL_MS else 'NOT met'} (worst {worst_p50} ms), p99 "
          f"{'met' if worst_p99 < GOAL_MS else 'NOT met'} (worst {worst_p99} ms)")
    data = {"nodes": args.nodes, "consumers_per_node": args.consumers, "scrapes_per_case": args.scrapes,
            "max_process_series": args.max_process_series, "samples": sample_lines, "page_bytes": len(body),
            "cases": results, "ratios": ratios, "goal_ms": GOAL_MS, "goal_met_p50": worst_p50 < GOAL_MS,
            "goal_met_p99": worst_p99 < GOAL_MS, "heap_policy": not args.no_heap_policy, "machine": machine()}
    path = write_json(args.out, data)
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
