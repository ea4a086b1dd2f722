#!/usr/bin/env python3
"""Benchmark: collector memory under process churn (goal: flat within 5 MB from 2,000 to 20,000).

Run:  .venv/bin/python bench/bench_collector_churn.py [--consumers 20000] [--checkpoint 2000] [--per-batch 20]

The real `ghostgpu collector` runs as its own process (SQLite in a temp dir, /metrics on, the heap
policy the command ships with). One simulated tracer (tests/helpers/sim_tracer.py) feeds it
`consumers` short-lived consumers, each a process of its own (a new PID) in a container of its own
(a new container ID), as a node running short jobs does: one batch opens `per-batch` of them (a
holder `open` and a `hidden` finding each), the next ends them (a holder `exit` and a `resolved`
each), every batch acknowledged before the next. The tracer answers the collector's CRI calls
through its relay as a runtime whose containers have exited and whose pod sandboxes are gone
(NOT_FOUND), so every container is looked up and every finding turns `orphaned` (the driver waits
for that, by the WatchFindings events, before it ends them) and then resolves.
/metrics is scraped every 20 rounds and a WatchFindings client follows every finding event,
as Prometheus and `ghostgpu up`'s view do. VmRSS of the collector is read once the first
`checkpoint` consumers have come and gone and again at the end, each time after CRI lookups are
done (ghostgpu_cri_lookups_pending 0) and a short settle.

Reference, same run: the same collector fed the same number of events in the same batches by the
same driver, for `per-batch` long-lived consumers (the same PIDs and containers every round: finding
updates and holder events, nothing ends): what the event log, SQLite and ingest cost without churn.
Writes bench/results/collector_churn.json.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, machine, print_table, status_kib, write_json
from tests.helpers.cri_fake import exited_runtime

PY = sys.executable
MB = 1024  # KiB per MiB (VmRSS is in kB)
GOAL_MB = 5.0
SETTLE_S = 2.0
SCRAPE_EVERY_ROUNDS = 20


def spawn_collector(tmp: str) -> tuple[subprocess.Popen[str], str, str]:
    """`ghostgpu collector` on free loopback ports; (process, gRPC address, /metrics URL)."""
    cmd = [PY, "-m", "ghostgpu.cli", "collector", "--listen", "127.0.0.1:0", "--db", f"{tmp}/collector.db",
           "--metrics-listen", "127.0.0.1:0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if "listening on" in line:
            addr = line.split("listening on", 1)[1].split(";")[0].split(",")[0].strip()
            metrics = line.split("metrics ", 1)[1].split(";")[0].strip()
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # drain
            return proc, addr, metrics
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise SystemExit(f"bench: the collector did not start: {proc.stderr.read()}")


def rounds(mode: str, consumers: int, per_batch: int) -> Any:
    """Per round, (the batch that opens or updates per_batch consumers, the batch that ends or
    updates them again): NodeEvent lists, seqs running on."""
    from dataclasses import replace

    from ghostgpu.common.model.consumers import ConsumerClass
    from ghostgpu.v1 import node_pb2
    from tests.helpers.sim_tracer import finding, holder, make_consumer, resolved

    seq = 0
    for r in range(consumers // per_batch):
        batch = range(r * per_batch, (r + 1) * per_batch) if mode == "churn" else range(per_batch)
        pool = [make_consumer("churn-node", 100_000 + i, gpu=i % 8, cls=ConsumerClass.HIDDEN,
                              container_id=f"{i:064x}") for i in batch]
        opens, ends = [], []
        for c in pool:
            opens += [holder(0, c.pid, c.container_id), finding(0, c)]
            if mode == "churn":
                ends += [holder(0, c.pid, c.container_id, kind=node_pb2.HolderEvent.KIND_EXIT),
                         resolved(0, c)]
            else:
                ends += [holder(0, c.pid, c.container_id, kind=node_pb2.HolderEvent.KIND_CLOSE),
                         finding(0, replace(c, gpu_memory_bytes=(r % 97) << 20))]
        for event in (*opens, *ends):  # in sending order: a seq at or below one sent is a duplicate
            seq += 1
            event.seq = seq
        yield opens, ends


def scrape(url: str) -> dict[str, float]:
    """The collector's own ghostgpu_* samples, summed per family name."""
    from tests.helpers.httpget import http_get

    status, text = http_get(url, timeout_s=30)
    if status != 200:
        raise SystemExit(f"bench: {url} answered {status}")
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("ghostgpu_") and " " in line:
            name = line.split("{", 1)[0].split(" ", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def orphaned_opened(event: Any) -> bool:
    from ghostgpu.v1 import node_pb2, query_pb2

    return (event.kind == query_pb2.FindingEvent.KIND_OPENED
            and getattr(event.finding.consumer.consumer, "class") == node_pb2.CONSUMER_CLASS_ORPHANED)


def follow(stream: Any, into: list[bool]) -> None:
    """Append orphaned_opened() of every finding event until the stream is cancelled."""
    import grpc

    with contextlib.suppress(grpc.RpcError):
        into.extend(map(orphaned_opened, stream))


def wait_for(predicate: Any, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench: no {what} within {timeout_s:g} s")
        time.sleep(0.0005)  # polling interval: a relayed CRI lookup takes a few ms


def settled_kib(pid: int, url: str) -> tuple[int, dict[str, float]]:
    deadline = time.monotonic() + 120
    while (families := scrape(url)).get("ghostgpu_cri_lookups_pending", 0) and time.monotonic() < deadline:
        time.sleep(0.2)  # polling interval while CRI lookups drain
    time.sleep(SETTLE_S)
    return status_kib(pid, "VmRSS") or 0, families


def measure(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    from tests.helpers.collector_env import QueryClient
    from tests.helpers.sim_tracer import SimTracer, batch_bytes

    with tempfile.TemporaryDirectory(prefix="ghostgpu-bench-churn-") as tmp:
        proc, addr, url = spawn_collector(tmp)
        try:
            time.sleep(1.0)  # imports and start-up settle
            idle_kib = status_kib(proc.pid, "VmRSS") or 0
            watched: list[bool] = []
            with QueryClient(addr) as q, SimTracer(addr, "churn-node", cri=exited_runtime) as t:
                stream = q.watch(include_open=True)
                threading.Thread(target=follow, args=(stream, watched), daemon=True).start()
                t.connect()
                t.send_snapshot([], seq=0)
                start = time.monotonic()
                at_checkpoint_kib, n = 0, 0
                for r, (opens, ends) in enumerate(rounds(mode, args.consumers, args.per_batch)):
                    t.send(batch_bytes(opens))
                    t.wait_acked(opens[-1].seq, 60)
                    n += args.per_batch
                    if mode == "churn":  # CRI's answer first: each finding turns orphaned before it ends
                        wait_for(lambda: sum(watched) >= n, "orphaned findings")  # noqa: B023
                    t.send(batch_bytes(ends))
                    t.wait_acked(ends[-1].seq, 60)
                    if r % SCRAPE_EVERY_ROUNDS == 0:
                        scrape(url)
                    if n == args.checkpoint:
                        at_checkpoint_kib, _ = settled_kib(proc.pid, url)
                elapsed_s = time.monotonic() - start
                end_kib, families = settled_kib(proc.pid, url)
                rows = len(q.consumers())
                stream.cancel()
        finally:
            proc.terminate()
            proc.wait(30)
    growth_mb = (end_kib - at_checkpoint_kib) / MB
    per_1000_kib = (end_kib - at_checkpoint_kib) / max(1, n - args.checkpoint) * 1000
    return {"mode": mode, "consumers": n, "elapsed_s": round(elapsed_s, 1),
            "idle_rss_mb": round(idle_kib / MB, 1), "rss_at_checkpoint_mb": round(at_checkpoint_kib / MB, 1),
            "rss_at_end_mb": round(end_kib / MB, 1), "growth_after_checkpoint_mb": round(growth_mb, 2),
            "kib_per_1000_consumers": round(per_1000_kib, 1),
            "findings_opened": int(families.get("ghostgpu_findings_opened_total", 0)),
            "findings_resolved": int(families.get("ghostgpu_findings_resolved_total", 0)),
            "cri_cache_entries": int(families.get("ghostgpu_cri_cache_entries", 0)),
            "cri_calls": int(families.get("ghostgpu_cri_calls_total", 0)),
            "finding_events_watched": len(watched), "consumer_rows_at_end": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--consumers", type=int, default=20_000)
    p.add_argument("--checkpoint", type=int, default=2_000)
    p.add_argument("--per-batch", type=int, default=20)
    args = p.parse_args()
    if not 0 < args.checkpoint < args.consumers or args.checkpoint % args.per_batch:
        raise SystemExit("bench: --checkpoint must be a multiple of --per-batch below --consumers")
    churn, ref = (measure(mode, args) for mode in ("churn", "reference"))
    print_table(["run", "idle RSS MB", f"RSS MB at {args.checkpoint}", f"RSS MB at {args.consumers}",
                 "growth MB", "KiB per 1,000", "findings opened", "CRI cache", "s"],
                [[r["mode"], r["idle_rss_mb"], r["rss_at_checkpoint_mb"], r["rss_at_end_mb"],
                  r["growth_after_checkpoint_mb"], r["kib_per_1000_consumers"], r["findings_opened"],
                  r["cri_cache_entries"], r["elapsed_s"]] for r in (churn, ref)])
    complete = churn["consumers"] == args.consumers and churn["consumer_rows_at_end"] == 0
    goal_met = churn["growth_after_checkpoint_mb"] <= GOAL_MB
    ratio = round(churn["rss_at_end_mb"] / ref["rss_at_end_mb"], 2) if ref["rss_at_end_mb"] else None
    print(f"churn RSS at the end / reference: {ratio}; growth after {args.checkpoint}: "
          f"{churn['growth_after_checkpoint_mb']} MB (goal <= {GOAL_MB:g} MB: "
          f"{'met' if goal_met else 'NOT met'})")
    data = {"consumers": args.consumers, "checkpoint": args.checkpoint, "per_batch": args.per_batch,
            "goal_growth_mb": GOAL_MB, "churn": churn, "reference_long_lived": ref,
            "churn_over_reference_rss": ratio, "goal_met": goal_met, "complete": complete,
            "machine": machine()}
    path = write_json("collector_churn", data)
    print(f"wrote {path.relative_to(ROOT)}")
    return 0 if complete and goal_met else 1


if __name__ == "__main__":
    sys.exit(main())
