#!/usr/bin/env python3
"""Benchmark: how long after its commit on replica A a finding change reaches a WatchFindings client on
replica B (PostgreSQL LISTEN/NOTIFY, collector/notify.py and collector/findings_remote.py).

Run:  .venv/bin/python bench/bench_watch_latency.py [--findings 70] [--interval-ms 20] [--load 0,4000,20000]
                                                    [--dsn postgresql://...]

Two Collectors in this process share one PostgreSQL database. A simulated tracer streams to A, one
batch per change: each finding opens, changes (its GPU memory) and resolves, `--interval-ms` apart,
so 3 x --findings notifications, each measured alone (this is latency, not throughput). The commit
time is taken on A's writer thread, in the `done` callback of the job that wrote the finding row
(the store calls it right after COMMIT, in the same process as B, so one monotonic clock); the
arrival time is when B's gRPC WatchFindings client (a thread here) reads the event. So a figure is
commit -> NOTIFY delivery -> B's listener thread -> B's loop -> the row read back through B's store
-> the watcher's queue -> gRPC -> the client. Also given: the tracer's send -> A's commit (ingest and
the group commit; a change is written at once with PostgreSQL, not at the next 1 s flush) and the
send -> B's client.

`--load`: each figure again while a second simulated tracer streams holder events to B at that many
events/s (batches of 200), so that B's writer thread, through which the rows are read back, is busy
with group commits of its own. Its tracer runs in this process too: under load the figures include
the GIL's share, as on a replica whose loop is busy.

The budget is 100 ms at p99 from commit to watcher. Without --dsn the bench starts its own throwaway
PostgreSQL (tests/helpers/postgres.py: Debian's postgresql 15, default settings, fsync on). Everything
(server, both collectors, tracer, client) shares this machine's cores. Writes
bench/results/watch_latency.json.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ghostgpu.collector.config import CollectorConfig
from ghostgpu.collector.main import Collector

from bench.common import machine, print_table, write_json
from ghostgpu.common.model.consumers import K8sInfo
from ghostgpu.v1 import query_pb2
from tests.helpers.collector_env import QueryClient
from tests.helpers.sim_tracer import SimTracer, finding, make_consumer, resolved, synthetic_batches

CID = "c0" * 32
BUDGET_P99_MS = 100.0
K = query_pb2.FindingEvent
STATE = {K.KIND_OPENED: "opened", K.KIND_CHANGED: "changed", K.KIND_RESOLVED: "resolved"}


class Names:
    """CRI's answer for CID at once (the resolver is not what is measured)."""

    def __init__(self, transport_for: Any, on_change: Any) -> None:
        pass

    def get(self, node: str, container_id: str) -> K8sInfo:
        return K8sInfo("resolved", "bench", "pod-0", "uid-0", "main", "img:1")


def percentiles(values_ms: list[float]) -> dict[str, float]:
    ordered = sorted(values_ms)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)

    return {"n": len(ordered), "p50": at(0.50), "p90": at(0.90), "p99": at(0.99),
            "max": round(ordered[-1], 2), "mean": round(statistics.fmean(ordered), 2)}


class Commits:
    """Wraps replica A's Store.submit: the commit time of every finding row written, by (id, state)."""

    def __init__(self, collector: Collector) -> None:
        self.at: dict[tuple[int, str], list[float]] = defaultdict(list)
        self.opened: set[int] = set()
        store = collector.store
        submit = store.submit

        def wrapped(ops: Any, done: Any = None, size_bytes: int = 0, fence: Any = None) -> None:
            keys = []
            for op in ops:
                if op[0] == "finding":
                    row = op[1]
                    if row.resolved_unix_ns:
                        keys.append((row.id, "resolved"))
                    elif row.id in self.opened:
                        keys.append((row.id, "changed"))
                    else:
                        self.opened.add(row.id)
                        keys.append((row.id, "opened"))
            if keys:
                inner = done

                def done_at(error: BaseException | None) -> None:
                    now = time.perf_counter()
                    if error is None:
                        for key in keys:
                            self.at[key].append(now)
                    if inner is not None:
                        inner(error)

                done = done_at
            submit(ops, done, size_bytes, fence)

        store.submit = wrapped  # type: ignore[method-assign]


class Load:
    """A tracer streaming holder events to a replica at a paced rate, on its own thread."""

    BATCH_EVENTS = 200

    def __init__(self, address: str, events_per_s: float) -> None:
        self.tracer = SimTracer(address, "load-node")
        self.events_per_s = events_per_s
        self.sent_events = 0
        self.elapsed_s = 0.0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Load:
        self.tracer.connect()
        self.thread.start()
        return self

    def _run(self) -> None:
        started = time.perf_counter()
        seq = 1
        period_s = self.BATCH_EVENTS / self.events_per_s
        while not self._stop.is_set():
            (batch,) = synthetic_batches("load-node", 1, self.BATCH_EVENTS, start_seq=seq, finding_every=0)
            self.tracer.push([batch], [seq + self.BATCH_EVENTS - 1], window=1, timeout_s=60)
            seq += self.BATCH_EVENTS
            self.sent_events += self.BATCH_EVENTS
            ahead_s = started + self.sent_events / self.events_per_s - time.perf_counter()
            if ahead_s > 0:
                self._stop.wait(min(ahead_s, period_s))
        self.elapsed_s = time.perf_counter() - started

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self.thread.join(60)
        self.tracer.stop()
        return {"events_per_s_asked": self.events_per_s,
                "events_per_s_sent": round(self.sent_events / max(self.elapsed_s, 1e-9))}


def run(dsn: str, findings: int, interval_s: float, load_events_per_s: float) -> dict[str, Any]:
    def replica(name: str) -> Collector:
        config = CollectorConfig(listen=("127.0.0.1:0",), db_path=":memory:", store_url=dsn, replica_id=name)
        return Collector(config, resolver_factory=Names).start()

    a, b = replica("bench-a"), replica("bench-b")
    load = Load(b.address, load_events_per_s).start() if load_events_per_s else None
    try:
        if not (a.notifier.wait_listening(30) and b.notifier.wait_listening(30)):
            raise RuntimeError("a replica's listener did not connect within 30 s")
        commits = Commits(a)
        arrived: dict[tuple[int, str], list[float]] = defaultdict(list)
        sent: dict[tuple[int, str], float] = {}
        expected = 3 * findings
        with QueryClient(b.address) as qb, SimTracer(a.address, "bench-node") as t:
            call = qb.watch()
            count = [0]

            def read() -> None:
                for ev in call:
                    arrived[ev.finding.id, STATE[ev.kind]].append(time.perf_counter())
                    count[0] += 1
                    if count[0] >= expected:
                        return

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            deadline = time.monotonic() + 30
            while b.call(lambda: len(b.cluster.watchers)) < 1:
                if time.monotonic() > deadline:
                    raise RuntimeError("B's watcher did not register within 30 s")
                time.sleep(0.01)
            t.connect()
            seq = 0
            for i in range(findings):
                pid = 1000 + i
                base = make_consumer("bench-node", pid, container_id=CID)
                steps = [("opened", finding, base),
                         ("changed", finding, make_consumer("bench-node", pid, container_id=CID,
                                                             gpu_memory_bytes=(i + 1) << 20)),
                         ("resolved", resolved, base)]
                for state, make, consumer in steps:
                    seq += 1
                    t.send_events([make(seq, consumer)])
                    sent[pid, state] = time.perf_counter()  # by pid: the id is A's to give
                    time.sleep(interval_s)
            reader.join(60)
            call.cancel()
            t.wait_acked(seq, timeout_s=30)
        if count[0] < expected:
            raise RuntimeError(f"B's watcher got {count[0]} of {expected} events within 60 s")
        # A hands out ids in increasing order, and the findings opened one after another
        opened_ids = sorted(fid for fid, state in commits.at if state == "opened")
        ids_by_pid = {1000 + n: fid for n, fid in enumerate(opened_ids)}
        lat: dict[str, list[float]] = defaultdict(list)
        for key, commit_times in commits.at.items():
            got = arrived.get(key, [])
            for c_t, a_t in zip(commit_times, got, strict=False):
                lat["commit_to_watcher"].append((a_t - c_t) * 1e3)
                lat[f"commit_to_watcher_{key[1]}"].append((a_t - c_t) * 1e3)
        for pid, fid in ids_by_pid.items():
            for state in ("opened", "changed", "resolved"):
                s_t = sent.get((pid, state))
                if s_t is None or not commits.at.get((fid, state)) or not arrived.get((fid, state)):
                    continue
                lat["send_to_commit"].append((commits.at[fid, state][0] - s_t) * 1e3)
                lat["send_to_watcher"].append((arrived[fid, state][0] - s_t) * 1e3)
        stats = {name: percentiles(values) for name, values in sorted(lat.items())}
        return {"notifications": expected, "load_on_b": load.stop() if load is not None else None,
                "stats_ms": stats,
                "listener": {"a_reconnects": a.notifier.reconnects_total,  # type: ignore[attr-defined]
                             "b_notifications": b.notifier.notifications_total}}  # type: ignore[attr-defined]
    finally:
        if load is not None and load.thread.is_alive():
            load.stop()
        b.stop(grace_s=0.5)
        a.stop(grace_s=0.5)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--findings", type=int, default=70, help="findings opened, changed and resolved (3 "
                                                              "notifications each)")
    p.add_argument("--interval-ms", type=float, default=20.0, help="between two batches of the tracer")
    p.add_argument("--dsn", help="an existing PostgreSQL database (scratch: the collectors migrate it) "
                                 "instead of a throwaway server")
    p.add_argument("--load", default="0,4000,20000",
                   help="comma-separated holder events/s another tracer streams to B meanwhile, one run each")
    p.add_argument("--out", default="watch_latency", help="result name under bench/results/")
    args = p.parse_args()
    loads = [float(x) for x in args.load.split(",")]
    server: dict[str, Any] = {"own": not args.dsn}
    runs = []
    with contextlib.ExitStack() as stack:
        if args.dsn:
            dsns = [args.dsn] * len(loads)
        else:
            from tests.helpers.postgres import PostgresServer, PostgresUnavailable

            try:
                pg = stack.enter_context(PostgresServer())
            except PostgresUnavailable as e:
                print(f"bench_watch_latency: {e}", file=sys.stderr)
                return 2
            server["version"] = pg.psql("SHOW server_version")
            dsns = [pg.create_database(f"bench{n}") for n in range(len(loads))]
        for dsn, load in zip(dsns, loads, strict=True):
            runs.append(run(dsn, args.findings, args.interval_ms / 1e3, load))
    for r in runs:
        r["met"] = r["stats_ms"]["commit_to_watcher"]["p99"] < BUDGET_P99_MS
    data = {"workload": {"findings": args.findings, "interval_ms": args.interval_ms,
                         "notifications": 3 * args.findings, "load_events_per_s": loads},
            "budget_commit_to_watcher_p99_ms": BUDGET_P99_MS, "met": all(r["met"] for r in runs),
            "runs": runs, "server": server, "machine": machine()}
    rows = []
    for r in runs:
        load = (r["load_on_b"] or {}).get("events_per_s_sent", 0)
        rows += [[load, name, s["n"], s["p50"], s["p90"], s["p99"], s["max"]]
                 for name, s in r["stats_ms"].items()]
    print_table(["B ingests ev/s", "measure", "n", "p50 ms", "p90 ms", "p99 ms", "max ms"], rows)
    path = write_json(args.out, data)
    worst = max(r["stats_ms"]["commit_to_watcher"]["p99"] for r in runs)
    print(f"commit -> B's watcher p99 at most {worst} ms (budget {BUDGET_P99_MS:g} ms): "
          f"{'met' if data['met'] else 'MISSED'}; {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
