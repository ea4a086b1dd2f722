#!/usr/bin/env python3
"""Benchmark: collector replicas over PostgreSQL, side by side in one run.

Run:  .venv/bin/python bench/bench_replicas.py [--tracers 30] [--events-per-tracer 20000]
                                               [--batch-events 2000,200] [--kills 20] [--nodes 1000]

Everything runs here, against a throwaway PostgreSQL 15 (tests/helpers/postgres.py, fsync on):
- ingest: events/s from `--tracers` simulated tracers (bench/bench_ingest.py's client processes, the
  same pre-serialized batches) at each batch size, for 1 `ghostgpu collector` on SQLite, 1 on
  PostgreSQL, and 3 replicas on PostgreSQL with the tracers spread over them; NodeStatus (or the
  events table) must then hold every event once. The reference is PostgreSQL's own ceiling: a bare
  psycopg client doing the same deduplicating inserts at the same batch sizes, one transaction per
  batch (bench/bench_pg_driver.py's fastest method, per-event rows with the event key unique), and
  the same bare client writing the store's own row shape (one row per batch, its bytes compressed as
  the store does, the store's schema and exclusion constraint).
- failover: 3 replicas, 6 tracers spread over them; SIGKILL the replica a tracer streams to, the
  tracer reconnects to the next address at once (what gRPC's pick_first does with a dead address) and
  sends on; the time from the SIGKILL to the first acknowledged batch of each moved node, over `--kills`
  kills (the killed replica restarts between kills). Goal: p99 <= 3 s.
- memory: `--nodes` sim tracers (a 20-consumer snapshot each, every consumer a hidden one: an open
  finding) spread over 3 replicas; each replica's RSS over its idle RSS, per node it owns. Each
  replica also holds the other replicas' open findings (collector/findings_remote.py, for its
  include_open watchers), so this is more per node than one collector holding them all.
Writes bench/results/replicas.json. Watch latency across replicas: bench/bench_watch_latency.py.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, machine, print_table, status_kib, write_json

PY = sys.executable
GOAL_RATIO = 0.8
GOAL_FAILOVER_P99_S = 3.0
INGEST = str(ROOT / "bench" / "bench_ingest.py")


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))], 3)


# ---- collector processes -------------------------------------------------------------------------


class Replica:
    def __init__(self, store: str, name: str, port: int = 0) -> None:
        self.store, self.name, self.port = store, name, port
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""
        self.start()

    def start(self) -> None:
        cmd = [PY, "-m", "ghostgpu.cli", "collector", "--listen", f"127.0.0.1:{self.port}",
               "--replica-id", self.name, "--lease-ttl", "5"]
        cmd += ["--store", self.store] if "://" in self.store else ["--db", self.store]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        assert self.proc.stderr is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if "listening on" in line:
                self.address = line.split("listening on", 1)[1].split(";")[0].split(",")[0].strip()
                self.port = int(self.address.rsplit(":", 1)[1])
                threading.Thread(target=self.proc.stderr.read, daemon=True).start()
                return
            if not line and self.proc.poll() is not None:
                break
        raise SystemExit(f"bench: replica {self.name} did not start: {self.proc.stderr.read()}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


# ---- ingest --------------------------------------------------------------------------------------


def _clients(targets: list[str], tracers: int, batch_events: int, per_tracer: int) -> list[dict[str, Any]]:
    """bench_ingest.py's client processes, one per target, the tracers split over them."""
    procs = []
    first = 0
    for i, addr in enumerate(targets):
        count = tracers // len(targets) + (i < tracers % len(targets))
        cmd = [PY, INGEST, "--client", addr, str(first), str(count), str(batch_events), str(per_tracer), "8"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True))
        first += count
    for p in procs:
        assert p.stdout is not None
        if p.stdout.readline().strip() != "ready":
            raise SystemExit("bench: a client process failed to connect")
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    out = [json.loads(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
    for p in procs:
        p.kill()
    return out


def _stored_once(dsn: str) -> dict[str, Any]:
    """Every (node, instance) seq range in the events table: contiguous from 1, no overlap."""
    import psycopg

    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT node, instance_id, first_seq, last_seq FROM events "
                            "ORDER BY node, instance_id, first_seq").fetchall()
    gaps = overlaps = events = 0
    last: dict[tuple[str, str], int] = {}
    for node, inst, first, end in rows:
        prev = last.get((node, inst), 0)
        if first <= prev:
            overlaps += 1
        elif first > prev + 1:
            gaps += 1
        last[node, inst] = end
        events += end - first + 1
    return {"events": events, "gaps": gaps, "overlaps": overlaps}


def ingest_run(kind: str, pg: Any, tmp: str, args: argparse.Namespace, batch: int) -> dict[str, Any]:
    if kind == "sqlite-1":
        replicas = [Replica(f"{tmp}/ingest-{batch}.db", "s1")]
        dsn = None
    else:
        dsn = pg.create_database(f"ingest_{kind.replace('-', '_')}_{batch}")
        replicas = [Replica(dsn, f"r{i}") for i in range(int(kind.split("-")[1]))]
    try:
        results = _clients([r.address for r in replicas], args.tracers, batch, args.events_per_tracer)
        rss_mb = [round((status_kib(r.proc.pid, "VmHWM") or 0) / 1024, 1) for r in replicas if r.proc]
    finally:
        for r in replicas:
            r.stop()
    events = sum(r["events"] for r in results)
    errors = [e for r in results for e in r["errors"]]
    wall_s = max(r["end"] for r in results) - min(r["start"] for r in results)
    out: dict[str, Any] = {"target": kind, "batch_events": batch, "events": events,
                           "wall_s": round(wall_s, 3),
                           "events_per_s": round(events / wall_s) if wall_s > 0 and not errors else None,
                           "peak_rss_mb": rss_mb, "errors": errors[:3]}
    if dsn is not None:
        stored = _stored_once(dsn)
        out["stored"] = stored
        out["exactly_once"] = stored["events"] == events and not stored["gaps"] and not stored["overlaps"]
    return out


def bare_client(pg: Any, batch: int, events: int) -> dict[str, Any]:
    """PostgreSQL's own ceiling: bench_pg_driver's fastest psycopg method, same batch sizes."""
    import psycopg

    from bench.bench_pg_driver import Workload, bare_client_insert, bare_client_setup

    dsn = pg.create_database(f"bare_{batch}")
    work = Workload(batch_rows=batch, timed_batches=max(1, events // batch))
    with psycopg.connect(dsn, autocommit=True) as conn:
        bare_client_setup(conn)
        bare_client_insert(conn, work.batches[0])
        start = time.perf_counter()
        for rows in work.timed:
            bare_client_insert(conn, rows)
        wall_s = time.perf_counter() - start
    rows_n = sum(len(b) for b in work.timed)
    return {"target": "bare-client", "batch_events": batch, "events": rows_n, "wall_s": round(wall_s, 3),
            "events_per_s": round(rows_n / wall_s)}


def bare_store_shape(pg: Any, batch: int, events: int) -> dict[str, Any]:
    """The same bare client writing the store's own row shape: one events row per batch (the batch's
    bytes, zlib level 1 as the store stores them), the store's schema and its exclusion constraint,
    INSERT ... ON CONFLICT DO NOTHING, one transaction per batch."""
    import zlib

    import psycopg
    from ghostgpu.collector.db import PgConn
    from ghostgpu.collector.migrations import migrate

    from tests.helpers.sim_tracer import synthetic_batches

    dsn = pg.create_database(f"bare_shape_{batch}")
    nbatches = max(1, events // batch)
    blobs = [zlib.compress(b, 1) for b in synthetic_batches("bare-node", min(nbatches, 50), batch)]
    sql = ("INSERT INTO events (node, boot_id, instance_id, first_seq, last_seq, count, stored_unix_ns, "
           "codec, blob) VALUES (%s, %s, %s, %s, %s, %s, %s, 1, %s) ON CONFLICT DO NOTHING")
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(PgConn(conn), "postgresql", "bench")
        start = time.perf_counter()
        for k in range(nbatches):
            with conn.transaction():
                conn.execute(sql, (f"bare-node-{k % 30}", "boot", "inst", k * batch + 1, (k + 1) * batch,
                                   batch, time.time_ns(), blobs[k % len(blobs)]))
        wall_s = time.perf_counter() - start
    return {"target": "bare-client-store-shape", "batch_events": batch, "events": nbatches * batch,
            "wall_s": round(wall_s, 3), "events_per_s": round(nbatches * batch / wall_s)}


# ---- failover ------------------------------------------------------------------------------------


def failover(pg: Any, kills: int) -> dict[str, Any]:
    from tests.helpers.sim_tracer import SimTracer, synthetic_batches

    dsn = pg.create_database("failover")
    replicas = [Replica(dsn, f"r{i}") for i in range(3)]
    tracers: dict[str, tuple[SimTracer, int]] = {}
    seqs: dict[str, int] = {}

    def connect(node: str, at: int) -> SimTracer:
        for k in range(len(replicas)):
            r = replicas[(at + k) % len(replicas)]
            if r.proc is None or r.proc.poll() is not None:
                continue
            t = SimTracer(r.address, node, instance_id=f"{node}-i", capabilities=())
            try:
                t.connect(timeout_s=10)
            except AssertionError:
                t.stop()
                continue
            tracers[node] = (t, (at + k) % len(replicas))
            return t
        raise SystemExit(f"bench: node {node} found no replica")

    def send_one(node: str) -> None:
        t, _ = tracers[node]
        seq = seqs.get(node, 0)
        batch = synthetic_batches(node, 1, 50, start_seq=seq + 1)
        t.push(batch, [seq + 50], window=1, timeout_s=30)
        seqs[node] = seq + 50

    nodes = [f"fo-node-{i}" for i in range(6)]
    for i, node in enumerate(nodes):
        connect(node, i % 3)
        send_one(node)
    times_s: list[float] = []
    try:
        for k in range(kills):
            victim = k % 3
            moved = [n for n, (_, at) in tracers.items() if at == victim]
            t0 = time.monotonic()
            replicas[victim].kill()
            for node in moved:
                old, _ = tracers[node]
                old.stop()
                connect(node, victim + 1)
                send_one(node)
                times_s.append(time.monotonic() - t0)
            replicas[victim].start()  # back for the next round, on the same port
    finally:
        for t, _ in tracers.values():
            t.stop()
        for r in replicas:
            r.stop()
    stored = _stored_once(dsn)
    return {"kills": kills, "moved_nodes": len(times_s), "p50_s": _pct(times_s, 0.5),
            "p99_s": _pct(times_s, 0.99), "max_s": round(max(times_s), 3) if times_s else None,
            "stored": stored, "exactly_once": stored["events"] == sum(seqs.values()) and not stored["gaps"]
            and not stored["overlaps"], "goal_p99_s": GOAL_FAILOVER_P99_S}


# ---- memory --------------------------------------------------------------------------------------


def memory(pg: Any, nodes: int) -> dict[str, Any]:
    dsn = pg.create_database("memory")
    replicas = [Replica(dsn, f"r{i}") for i in range(3)]
    try:
        idle_kib = [status_kib(r.proc.pid, "VmRSS") or 0 for r in replicas if r.proc]
        procs = []
        for i, r in enumerate(replicas):
            count = nodes // 3 + (i < nodes % 3)
            cmd = [PY, INGEST, "--client", r.address, str(i * 10_000), str(count), "50", "50", "1"]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          text=True))
        for p in procs:
            assert p.stdout is not None
            p.stdout.readline()  # ready: every tracer connected and sent its snapshot
        time.sleep(3)  # bench only (no test): let each replica apply the snapshots it was sent
        rss_kib = [status_kib(r.proc.pid, "VmRSS") or 0 for r in replicas if r.proc]
        for p in procs:
            p.kill()
    finally:
        for r in replicas:
            r.stop()
    per = [round((rss - idle) / max(1, nodes // 3)) for rss, idle in zip(rss_kib, idle_kib, strict=True)]
    return {"nodes": nodes, "replicas": 3, "idle_rss_kib": idle_kib, "rss_kib": rss_kib,
            "kib_per_node_per_replica": per}


# ---- main ----------------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tracers", type=int, default=30)
    p.add_argument("--events-per-tracer", type=int, default=20_000)
    p.add_argument("--batch-events", default="2000,200")
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--skip", default="", help="comma list of parts to leave out: ingest,failover,memory")
    args = p.parse_args()
    import tempfile

    from tests.helpers.postgres import PostgresServer

    skip = set(filter(None, args.skip.split(",")))
    data: dict[str, Any] = {"machine": machine(), "tracers": args.tracers,
                            "events_per_tracer": args.events_per_tracer, "goal_ratio_vs_bare": GOAL_RATIO}
    with tempfile.TemporaryDirectory(prefix="ghostgpu-bench-replicas-") as tmp, PostgresServer() as pg:
        pg.psql("ALTER SYSTEM SET max_connections = 200")
        pg.restart()
        if "ingest" not in skip:
            runs = []
            for batch in (int(x) for x in args.batch_events.split(",")):
                total = args.tracers * args.events_per_tracer
                runs.append(bare_client(pg, batch, total))
                runs.append(bare_store_shape(pg, batch, total))
                for kind in ("sqlite-1", "pg-1", "pg-3"):
                    r = ingest_run(kind, pg, tmp, args, batch)
                    runs.append(r)
                    print(f"{kind:8s} batch {batch:5d}: {r['events_per_s']} events/s", file=sys.stderr,
                          flush=True)
            for r in runs:
                for ref_name, key in (("bare-client", "ratio_vs_bare_client"),
                                      ("bare-client-store-shape", "ratio_vs_bare_store_shape")):
                    ref = next(x for x in runs
                               if x["target"] == ref_name and x["batch_events"] == r["batch_events"])
                    r[key] = round(r["events_per_s"] / ref["events_per_s"], 3) if r["events_per_s"] else None
            print_table(["target", "batch", "events/s", "vs bare client", "vs its row shape", "exactly once"],
                        [[r["target"], r["batch_events"], r["events_per_s"], r["ratio_vs_bare_client"],
                          r["ratio_vs_bare_store_shape"], r.get("exactly_once", "-")] for r in runs])
            data["ingest"] = runs
        if "failover" not in skip:
            data["failover"] = failover(pg, args.kills)
            print(f"failover: {data['failover']}", file=sys.stderr)
        if "memory" not in skip:
            data["memory"] = memory(pg, args.nodes)
            print(f"memory: {data['memory']}", file=sys.stderr)
    path = write_json("replicas", data)
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
