#!/usr/bin/env python3
"""Benchmark: the collector's event insert into PostgreSQL, per driver and method, beside PostgreSQL's
own ceiling, in one run on one server.

Run:  .venv/bin/python bench/bench_pg_driver.py [--rounds 7] [--batch-rows 2000,200]
                                                [--rows-per-measure 100000] [--dsn postgresql://...]

The workload is the store's: table events(node, boot_id, instance_id, seq, stored_unix_ns, body bytea
of 370 bytes, PRIMARY KEY (node, boot_id, instance_id, seq)), deduplicating inserts (`INSERT ... ON
CONFLICT DO NOTHING`), each batch one transaction, as the store's writer thread commits a group. A
batch holds runs of 50 consecutive events from one node (a tracer's batch), several nodes per batch
(a group commit gathers many streams), and starts with the last 10% of the batch before it again (a
tracer resending what it had not seen acknowledged), so every batch really conflicts.

Methods, each on its own connection made before timing:
- psycopg 3, sync: `executemany` (pipeline mode: psycopg 3.1+ sends all the rows before reading a
  result); one `INSERT ... SELECT * FROM unnest(%b::text[], ...)`, the columns as six binary arrays;
  binary `COPY` into a temp staging table (ON COMMIT DELETE ROWS) and `INSERT ... SELECT` from it;
- asyncpg on one asyncio loop: `executemany`; the same unnest; `copy_records_to_table` into staging
  and the same `INSERT ... SELECT`;
- server-side (the ceiling): the same keys expanded by PostgreSQL from one run descriptor per node
  run (`generate_series`) and one 370-byte body parameter: what the server does per batch with next
  to nothing to parse or transfer.

Before every measure: TRUNCATE, CHECKPOINT (so no measure pays another's checkpoint), one untimed
batch (warm statements; the first timed batch then has its 10% to conflict with). Rows/s counts
every row sent, duplicates included; after each measure the table must hold exactly the distinct
rows. Methods rotate within each round; the figure is the median over rounds. Client CPU (this
process) and the server backend's CPU (/proc, own server only) per 1,000 rows show where the time
goes: on 2 cores the client and the server share the machine. So does anything else running: with
its own server the bench waits before each measure (up to --quiet-wait-s) until other processes use
under 10% of the CPUs, and takes a measure again (3 tries at most) when they used 15% or more
during it; `others_cpu_share` in the JSON says how much they took.

Without --dsn the bench starts its own throwaway PostgreSQL (tests/helpers/postgres.py: Debian's
postgresql 15, default settings, fsync on). Writes bench/results/pg_driver.json.

bench/bench_replicas.py imports the bare-client reference from here: `BARE_CLIENT_METHOD`,
`bare_client_setup(conn, table)` and `bare_client_insert(conn, rows, table)`, with `EVENTS_DDL` and
`Workload` for the rows.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg

from bench.common import CLK_TCK, ROOT, cpu_ticks, machine, print_table, write_json

BODY_BYTES = 370  # a holder event's serialized NodeEvent, about
RUN_EVENTS = 50  # consecutive events of one node in a batch
NODES = 50
DUP_FRACTION = 0.10
QUIET_SHARE = 0.10  # of all CPUs, used by other processes: below it a measure may start
DISTURBED_SHARE = 0.15  # ... and at or above it during a measure, the measure is taken again
MEASURE_ATTEMPTS = 3
COLUMNS = ("node", "boot_id", "instance_id", "seq", "stored_unix_ns", "body")
PG_TYPES = ("text", "text", "text", "int8", "int8", "bytea")

Row = tuple[str, str, str, int, int, bytes]

EVENTS_DDL = """CREATE TABLE IF NOT EXISTS {table} (
    node text NOT NULL, boot_id text NOT NULL, instance_id text NOT NULL, seq bigint NOT NULL,
    stored_unix_ns bigint NOT NULL, body bytea NOT NULL,
    PRIMARY KEY (node, boot_id, instance_id, seq))"""
_COLS = ", ".join(COLUMNS)
_STAGE_DDL = "CREATE TEMP TABLE IF NOT EXISTS {table}_stage (LIKE {table}) ON COMMIT DELETE ROWS"
_FROM_STAGE = "INSERT INTO {table} SELECT * FROM {table}_stage ON CONFLICT DO NOTHING"


# ---- the rows ------------------------------------------------------------------------------------


@dataclass
class Workload:
    """Batches of `batch_rows` events: runs of RUN_EVENTS from one node, each batch starting with the
    last DUP_FRACTION of the one before. `batches[0]` is the untimed warm-up."""

    batch_rows: int
    timed_batches: int
    seed: int = 1
    batches: list[list[Row]] = field(init=False)
    distinct_rows: int = field(init=False)

    def __post_init__(self) -> None:
        rnd = random.Random(self.seed)
        nodes = [(f"gpu-node-{i:03d}", str(uuid.UUID(int=rnd.getrandbits(128))),
                  f"tracer-{rnd.getrandbits(32):08x}") for i in range(NODES)]
        next_seq = [1] * NODES
        body_pool = os.urandom(BODY_BYTES * 64)
        dup = round(self.batch_rows * DUP_FRACTION)
        node_at = 0
        self.batches = []
        made = 0
        for b in range(self.timed_batches + 1):
            rows: list[Row] = list(self.batches[-1][-dup:]) if b else []
            now_ns = time.time_ns()
            while len(rows) < self.batch_rows:
                node, boot, inst = nodes[node_at]
                take = min(RUN_EVENTS, self.batch_rows - len(rows))
                for s in range(next_seq[node_at], next_seq[node_at] + take):
                    start = (s * 37) % 63 * BODY_BYTES
                    rows.append((node, boot, inst, s, now_ns + made, body_pool[start:start + BODY_BYTES]))
                    made += 1
                next_seq[node_at] += take
                node_at = (node_at + 1) % NODES
            self.batches.append(rows)
        self.distinct_rows = made

    @property
    def timed(self) -> list[list[Row]]:
        return self.batches[1:]


def runs_of(rows: Sequence[Row]) -> list[tuple[str, str, str, int, int]]:
    """(node, boot_id, instance_id, first seq, count) per run of consecutive seqs of one node."""
    runs: list[list[Any]] = []
    for node, boot, inst, seq, _, _ in rows:
        last = runs[-1] if runs else None
        if last and last[:3] == [node, boot, inst] and last[3] + last[4] == seq:
            last[4] += 1
        else:
            runs.append([node, boot, inst, seq, 1])
    return [(r[0], r[1], r[2], r[3], r[4]) for r in runs]


def columns_of(rows: Sequence[Row]) -> list[list[Any]]:
    return [list(c) for c in zip(*rows, strict=True)]


# ---- psycopg 3 (sync) ----------------------------------------------------------------------------

PsycopgInsert = Callable[[psycopg.Connection[Any], Sequence[Row], str], None]


def _no_setup(conn: psycopg.Connection[Any], table: str) -> None:
    pass


def psycopg_executemany(conn: psycopg.Connection[Any], rows: Sequence[Row], table: str) -> None:
    # psycopg 3.1+ runs executemany in pipeline mode (libpq 14+): every row sent before any result read
    sql = f"INSERT INTO {table} ({_COLS}) VALUES (%b, %b, %b, %b, %b, %b) ON CONFLICT DO NOTHING"
    with conn.transaction(), conn.cursor() as cur:
        cur.executemany(sql, rows)


def psycopg_unnest(conn: psycopg.Connection[Any], rows: Sequence[Row], table: str) -> None:
    # %b: binary arrays; bytea in text format would go as hex, twice its size
    sql = (f"INSERT INTO {table} ({_COLS}) SELECT * FROM unnest(%b::text[], %b::text[], %b::text[], "
           "%b::int8[], %b::int8[], %b::bytea[]) ON CONFLICT DO NOTHING")
    with conn.transaction():
        conn.execute(sql, columns_of(rows))


def psycopg_copy_setup(conn: psycopg.Connection[Any], table: str) -> None:
    conn.execute(_STAGE_DDL.format(table=table))


def psycopg_copy(conn: psycopg.Connection[Any], rows: Sequence[Row], table: str) -> None:
    with conn.transaction(), conn.cursor() as cur:
        with cur.copy(f"COPY {table}_stage ({_COLS}) FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types(list(PG_TYPES))
            for row in rows:
                copy.write_row(row)
        cur.execute(_FROM_STAGE.format(table=table))


def server_side(conn: psycopg.Connection[Any], rows: Sequence[Row], table: str) -> None:
    """The ceiling: the same keys, expanded by the server from run descriptors; one body for all."""
    sql = (f"INSERT INTO {table} ({_COLS}) SELECT r.node, r.boot_id, r.instance_id, r.first_seq + g, %b, %b "
           "FROM unnest(%b::text[], %b::text[], %b::text[], %b::int8[], %b::int8[]) "
           "AS r(node, boot_id, instance_id, first_seq, n), generate_series(0, r.n - 1) AS g "
           "ON CONFLICT DO NOTHING")
    runs = runs_of(rows)
    with conn.transaction():
        conn.execute(sql, [rows[0][4], rows[0][5], *(list(c) for c in zip(*runs, strict=True))])


# ---- asyncpg -------------------------------------------------------------------------------------

AsyncpgInsert = Callable[[Any, Sequence[Row], str], Awaitable[None]]


async def _async_no_setup(conn: Any, table: str) -> None:
    pass


async def asyncpg_executemany(conn: Any, rows: Sequence[Row], table: str) -> None:
    sql = f"INSERT INTO {table} ({_COLS}) VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING"
    async with conn.transaction():
        await conn.executemany(sql, rows)


async def asyncpg_unnest(conn: Any, rows: Sequence[Row], table: str) -> None:
    sql = (f"INSERT INTO {table} ({_COLS}) SELECT * FROM unnest($1::text[], $2::text[], $3::text[], "
           "$4::int8[], $5::int8[], $6::bytea[]) ON CONFLICT DO NOTHING")
    async with conn.transaction():
        await conn.execute(sql, *columns_of(rows))


async def asyncpg_copy_setup(conn: Any, table: str) -> None:
    await conn.execute(_STAGE_DDL.format(table=table))


async def asyncpg_copy(conn: Any, rows: Sequence[Row], table: str) -> None:
    async with conn.transaction():
        await conn.copy_records_to_table(f"{table}_stage", records=rows, columns=list(COLUMNS))
        await conn.execute(_FROM_STAGE.format(table=table))


# ---- the methods ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    name: str
    driver: str  # "psycopg" | "asyncpg" | "server"
    insert: Callable[..., Any]
    setup: Callable[..., Any]


METHODS = [
    Method("psycopg executemany", "psycopg", psycopg_executemany, _no_setup),
    Method("psycopg unnest", "psycopg", psycopg_unnest, _no_setup),
    Method("psycopg copy+insert", "psycopg", psycopg_copy, psycopg_copy_setup),
    Method("asyncpg executemany", "asyncpg", asyncpg_executemany, _async_no_setup),
    Method("asyncpg unnest", "asyncpg", asyncpg_unnest, _async_no_setup),
    Method("asyncpg copy+insert", "asyncpg", asyncpg_copy, asyncpg_copy_setup),
    Method("server-side (ceiling)", "server", server_side, _no_setup),
]

# The store's method and the bare-client reference for bench/bench_replicas.py. In
# results/pg_driver.json it is psycopg's fastest at 200-row batches and 12% behind COPY at 2,000,
# with one statement and no per-connection temp table (bench/README.md says why it was chosen).
BARE_CLIENT_METHOD = "psycopg unnest"
_BARE = next(m for m in METHODS if m.name == BARE_CLIENT_METHOD)


def bare_client_setup(conn: psycopg.Connection[Any], table: str = "events") -> None:
    """Create `table` (EVENTS_DDL) and whatever the bare-client method needs on this connection."""
    conn.execute(EVENTS_DDL.format(table=table))
    _BARE.setup(conn, table)


def bare_client_insert(conn: psycopg.Connection[Any], rows: Sequence[Row], table: str = "events") -> None:
    """One batch, one transaction, duplicates dropped: the fastest way psycopg 3 stores events here.
    `conn` must be in autocommit mode (the transaction is the method's own)."""
    _BARE.insert(conn, rows, table)


# ---- measuring -----------------------------------------------------------------------------------


@dataclass
class Conns:
    admin: psycopg.Connection[Any]
    psycopg: dict[str, psycopg.Connection[Any]]
    asyncpg: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    postmaster_pid: int | None  # our own server's; None with --dsn


def _busy_ticks() -> int:
    """CPU ticks the whole machine spent busy (/proc/stat's first line, less idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    return sum(fields) - fields[3] - fields[4]


def _cluster_ticks(postmaster_pid: int) -> int:
    """CPU of the postmaster and every process it forked (backends, WAL writer, checkpointer...)."""
    from tests.helpers.postgres import child_pids

    return sum(cpu_ticks(p) or 0 for p in [postmaster_pid, *child_pids(postmaster_pid)])


def _others_share(postmaster_pid: int, window_s: float) -> float:
    """The share of the machine's CPUs that processes other than this bench and its server used
    over the next `window_s`."""
    me0, busy0, cl0 = cpu_ticks(os.getpid()) or 0, _busy_ticks(), _cluster_ticks(postmaster_pid)
    time.sleep(window_s)
    me1, busy1, cl1 = cpu_ticks(os.getpid()) or 0, _busy_ticks(), _cluster_ticks(postmaster_pid)
    return max(0, (busy1 - busy0) - (me1 - me0) - (cl1 - cl0)) / CLK_TCK / window_s / (os.cpu_count() or 1)


def wait_quiet(postmaster_pid: int | None, limit_s: float) -> float:
    """Wait (up to limit_s) until the rest of the machine uses under QUIET_SHARE of its CPUs for a
    second: other work on a 2-CPU VM (a test suite) halves a measure. Returns the seconds waited."""
    if postmaster_pid is None or limit_s <= 0:
        return 0.0
    t0 = time.monotonic()
    while _others_share(postmaster_pid, 1.0) >= QUIET_SHARE and time.monotonic() - t0 < limit_s:
        pass
    return round(time.monotonic() - t0, 1)


def measure(method: Method, workload: Workload, conns: Conns, table: str, quiet_limit_s: float = 0.0
            ) -> dict[str, Any]:
    conns.admin.execute(f"TRUNCATE {table}")
    conns.admin.execute("CHECKPOINT")
    waited_s = wait_quiet(conns.postmaster_pid, quiet_limit_s)
    if method.driver == "asyncpg":
        conn = conns.asyncpg[method.name]
        pid = conn.get_server_pid()

        def run(rows: Sequence[Row]) -> None:
            conns.loop.run_until_complete(method.insert(conn, rows, table))
    else:
        pconn = conns.psycopg[method.name]
        pid = pconn.info.backend_pid

        def run(rows: Sequence[Row]) -> None:
            method.insert(pconn, rows, table)

    run(workload.batches[0])
    local = conns.postmaster_pid is not None
    backend0 = cpu_ticks(pid) if local else None
    cluster0 = _cluster_ticks(conns.postmaster_pid) if conns.postmaster_pid else None
    me0, busy0 = cpu_ticks(os.getpid()) or 0, _busy_ticks()
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    for rows in workload.timed:
        run(rows)
    wall_s = time.perf_counter() - t0
    client_cpu_s = time.process_time() - cpu0
    me1, busy1 = cpu_ticks(os.getpid()) or 0, _busy_ticks()
    backend1 = cpu_ticks(pid) if local else None
    cluster1 = _cluster_ticks(conns.postmaster_pid) if conns.postmaster_pid else None
    stored = conns.admin.execute(f"SELECT count(*) FROM {table}").fetchone()
    if stored is None or stored[0] != workload.distinct_rows:
        raise SystemExit(f"{method.name}: the table holds {stored} rows, {workload.distinct_rows} expected")
    sent = sum(len(b) for b in workload.timed)
    per_k = 1000 / sent
    backend_cpu_s = (backend1 - backend0) / CLK_TCK if backend0 is not None and backend1 is not None else None
    # What the rest of the machine took meanwhile (other processes, not this bench nor its server):
    # a measure with much of it shared the 2 CPUs and should not be compared with one without.
    others_cpu_s = None
    if cluster0 is not None and cluster1 is not None:
        others_cpu_s = max(0, (busy1 - busy0) - (me1 - me0) - (cluster1 - cluster0)) / CLK_TCK
    return {"rows_per_s": round(sent / wall_s), "wall_s": round(wall_s, 3),
            "client_cpu_ms_per_1k_rows": round(client_cpu_s * 1000 * per_k, 3),
            "backend_cpu_ms_per_1k_rows": round(backend_cpu_s * 1000 * per_k, 3) if backend_cpu_s is not None
            else None,
            "others_cpu_share": round(others_cpu_s / wall_s / (os.cpu_count() or 1), 3)
            if others_cpu_s is not None else None, "waited_for_quiet_s": waited_s}


def _connect_all(dsn: str, table: str, postmaster_pid: int | None) -> Conns:
    import asyncpg

    admin = psycopg.connect(dsn, autocommit=True)
    admin.execute(EVENTS_DDL.format(table=table))
    loop = asyncio.new_event_loop()
    pconns: dict[str, psycopg.Connection[Any]] = {}
    aconns: dict[str, Any] = {}
    for m in METHODS:
        if m.driver == "asyncpg":
            aconns[m.name] = loop.run_until_complete(asyncpg.connect(dsn))
            loop.run_until_complete(m.setup(aconns[m.name], table))
        else:
            pconns[m.name] = psycopg.connect(dsn, autocommit=True)
            m.setup(pconns[m.name], table)
    return Conns(admin, pconns, aconns, loop, postmaster_pid)


def _close_all(conns: Conns) -> None:
    for a in conns.asyncpg.values():
        conns.loop.run_until_complete(a.close())
    conns.loop.close()
    for p in conns.psycopg.values():
        p.close()
    conns.admin.close()


def _server_facts(admin: psycopg.Connection[Any]) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    for name in ("server_version", "fsync", "synchronous_commit", "wal_level", "shared_buffers",
                 "max_wal_size", "full_page_writes", "wal_sync_method"):
        row = admin.execute(f"SHOW {name}").fetchone()
        facts[name] = row[0] if row else None
    return facts


def run_bench(dsn: str, postmaster_pid: int | None, args: argparse.Namespace) -> dict[str, Any]:
    import asyncpg

    table = "events"
    sizes = [int(x) for x in args.batch_rows.split(",")]
    workloads = {n: Workload(n, max(1, args.rows_per_measure // n)) for n in sizes}
    conns = _connect_all(dsn, table, postmaster_pid)
    raw: dict[tuple[str, int], list[dict[str, Any]]] = {(m.name, n): [] for m in METHODS for n in sizes}
    try:
        facts = _server_facts(conns.admin)
        # Untimed: a fresh cluster creates its WAL segments as it goes (zero-filled, fsynced); a
        # running one recycles them. Without this pass the first round measured that.
        for _ in range(args.warmup_rounds):
            for m in METHODS:
                measure(m, workloads[max(sizes)], conns, table)
        for rnd in range(args.rounds):
            for n in sizes:
                shift = rnd % len(METHODS)  # rotate who goes first, so no method always follows another
                for m in METHODS[shift:] + METHODS[:shift]:
                    for attempt in range(1, MEASURE_ATTEMPTS + 1):
                        r = measure(m, workloads[n], conns, table, args.quiet_wait_s)
                        r["attempt"] = attempt
                        if (r["others_cpu_share"] or 0) < DISTURBED_SHARE:
                            break
                    raw[(m.name, n)].append(r)
                    print(f"round {rnd + 1}/{args.rounds} batch {n:5d} {m.name:22s} "
                          f"{r['rows_per_s']:8d} rows/s (others {r['others_cpu_share']}, waited "
                          f"{r['waited_for_quiet_s']} s)", file=sys.stderr, flush=True)
        conns.admin.execute(f"TRUNCATE {table}")
    finally:
        _close_all(conns)
    results = []
    for n in sizes:
        for m in METHODS:
            rs = raw[(m.name, n)]

            def med(key: str, rs: list[dict[str, Any]] = rs) -> float | None:
                vals = [r[key] for r in rs if r[key] is not None]
                return round(statistics.median(vals), 3) if vals else None

            rates = [r["rows_per_s"] for r in rs]
            results.append({"method": m.name, "driver": m.driver, "batch_rows": n,
                            "rows_per_s_median": round(statistics.median(rates)), "rows_per_s_rounds": rates,
                            "client_cpu_ms_per_1k_rows_median": med("client_cpu_ms_per_1k_rows"),
                            "backend_cpu_ms_per_1k_rows_median": med("backend_cpu_ms_per_1k_rows"),
                            "others_cpu_share_rounds": [r["others_cpu_share"] for r in rs]})
    for r in results:
        ceiling = next(x for x in results if x["driver"] == "server" and x["batch_rows"] == r["batch_rows"])
        r["vs_ceiling"] = round(r["rows_per_s_median"] / ceiling["rows_per_s_median"], 3)
        # Each round against the ceiling of the same round: steadier than the medians' ratio when
        # the disk's fsync latency drifts from round to round (a shared VM's disk does).
        paired = [a / b for a, b in zip(r["rows_per_s_rounds"], ceiling["rows_per_s_rounds"], strict=True)]
        r["vs_ceiling_same_round_median"] = round(statistics.median(paired), 3)
    best = {}
    for n in sizes:
        for driver in ("psycopg", "asyncpg"):
            mine = [r for r in results if r["driver"] == driver and r["batch_rows"] == n]
            best[f"{driver}_{n}"] = max(mine, key=lambda r: r["rows_per_s_median"])["method"]
    rows_per_measure = {str(n): len(workloads[n].timed) * n for n in sizes}
    return {"workload": {"batch_rows": sizes, "rows_per_measure": rows_per_measure, "body_bytes": BODY_BYTES,
                         "run_events": RUN_EVENTS, "nodes": NODES, "dup_fraction": DUP_FRACTION,
                         "rounds": args.rounds, "warmup_rounds": args.warmup_rounds,
                         "quiet_share": QUIET_SHARE, "quiet_wait_s": args.quiet_wait_s},
            "server": facts, "drivers": {"psycopg": psycopg.__version__, "asyncpg": asyncpg.__version__,
                                         "libpq": psycopg.pq.version()},
            "results": results, "best": best, "bare_client_method": BARE_CLIENT_METHOD}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup-rounds", type=int, default=1, help="untimed passes of every method first")
    p.add_argument("--batch-rows", default="2000,200", help="comma-separated batch sizes")
    p.add_argument("--rows-per-measure", type=int, default=100_000,
                   help="timed rows per method, batch size and round")
    p.add_argument("--dsn", help="an existing PostgreSQL (a scratch database: the bench makes and truncates "
                                 "table events) instead of a throwaway one")
    p.add_argument("--quiet-wait-s", type=float, default=120.0,
                   help="before each measure, wait up to this long for other processes to go quiet")
    p.add_argument("--out", default="pg_driver", help="result name under bench/results/")
    args = p.parse_args()
    try:
        import asyncpg  # noqa: F401
    except ImportError:
        print("bench_pg_driver: asyncpg is missing: .venv/bin/pip install -e '.[dev]' "
              "(scripts/bootstrap.sh install)", file=sys.stderr)
        return 2
    if args.dsn:
        data = run_bench(args.dsn, None, args)
        data["server"]["own"] = False
    else:
        from tests.helpers.postgres import PostgresServer, PostgresUnavailable

        try:
            pg = PostgresServer()
        except PostgresUnavailable as e:
            print(f"bench_pg_driver: {e}", file=sys.stderr)
            return 2
        with pg:
            started_s = pg.start_s
            data = run_bench(pg.create_database("bench"), pg.pid, args)
        data["server"] |= {"own": True, "initdb_and_start_s": round(started_s or 0, 3)}
    data["machine"] = machine()
    print_table(["batch", "method", "rows/s (median)", "vs ceiling", "client CPU ms/1k", "backend CPU ms/1k"],
                [[r["batch_rows"], r["method"], r["rows_per_s_median"], r["vs_ceiling"],
                  r["client_cpu_ms_per_1k_rows_median"], r["backend_cpu_ms_per_1k_rows_median"]]
                 for r in data["results"]])
    for n in data["workload"]["batch_rows"]:
        print(f"fastest at {n}-row batches: psycopg {data['best'][f'psycopg_{n}']!r}, "
              f"asyncpg {data['best'][f'asyncpg_{n}']!r} (BARE_CLIENT_METHOD: {BARE_CLIENT_METHOD!r})")
    path = write_json(args.out, data)
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
