"""The collector's store: stream positions, the event log, the findings history and trace sessions.

    store = Store("sqlite:///var/lib/ghostgpu/collector.db", event_log_max, retention_days)
    store = Store("postgresql://ghostgpu@db/ghostgpu", ..., password_file=..., replica_id="collector-0")

Two engines, one contract (collector/db.py; tests/integration/test_store_contract.py runs the same tests
on both): SQLite, the embedded default of one collector, and PostgreSQL, which several replicas share
(docs/REPLICAS.md). The schema is collector/migrations.py's, applied at start.

One writer thread owns the connection. Callers queue write operations with `submit()`; the writer
takes everything queued, runs it in one transaction (group commit) and only then calls each job's
`done` callback, so an Ack never covers an event that is not on disk. Reads run on the same
thread after the commit of the group they were queued with, so a read sees every write queued
before it, and `:memory:` (one private database per connection) works too.

Events are stored per batch, not per event: one row holds a slice of one EventBatch as a
serialized TracerMessage (zlib-compressed: tracer events repeat their container IDs and cgroup
paths, so they shrink about 20x), and the log is bounded by a total event count, oldest rows first.

The trace tables (trace_sessions, trace_records, trace_audit) are written by collector/trace_store.py
through `op_call`: a function run on the writer thread inside the group's transaction, so its rows
commit (or roll back) with everything else of the group, and compression stays off the event loop.

The `faults` table holds the GPU faults (Xid) the tracers sent, each with the pods it hit, the newest
`--faults-max` of them (collector/faults.py writes it through `op_call`, in the transaction of the
batch that carried the fault; one row per kernel log record: node, boot, kmsg_seq and the record's
time are unique); `fault_counts` how many were ever stored per node, GPU and Xid.

With PostgreSQL a write that fails because the server restarts or cannot be reached is retried until
it commits (the replica stops acknowledging meanwhile, so the tracers spool, as when the collector is
down; `db_down_since` says since when, for /readyz and /metrics); with SQLite, and for any other error,
a few tries and the store fails for good. A job submitted with a `fence` (node, token) commits only
while that token still holds the node's lease (collector/leases.py): checked in the group's
transaction, under a share lock on the lease row, so a replica that lost a node can never write it.

The `audit` table holds the security audit trail (collector/audit.py writes it through `op_audit`
beside its JSON lines file, and reads it; with PostgreSQL through `op_call`, each record built on the
chain's head inside the write transaction, so replicas append to one chain): append-only, never pruned.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import sqlite3
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypeVar

from ghostgpu.collector.db import (
    StoreUrl,
    StoreUrlError,
    connect_postgresql,
    connection_lost,
    db_errors,
    end_stalled_sessions,
    is_transient,
    lock_wait_ran_out,
    parse_store_url,
    upsert_sql,
)
from ghostgpu.collector.migrations import FINDING_ID_BLOCK, SchemaError, migrate

from ghostgpu.common.system.filemodes import FILE_MODE, private_file, tighten

log = logging.getLogger(__name__)

CODEC_RAW, CODEC_ZLIB = 0, 1
_PRUNE_INTERVAL_S = 600.0
_PG_PRUNE_INTERVAL_S = 60.0  # PostgreSQL bounds the event log here, not per group (several writers)
_MAX_GROUP_JOBS = 4096
_RETENTION_LOCK = 0x67686F7374726574  # "ghostret": one replica prunes at a time
_RECONNECT_MAX_S = 2.0
T = TypeVar("T")

_POSITION_COLUMNS = ("node", "boot_id", "instance_id", "delivered_seq", "ingested_total", "duplicates_total",
                     "gaps_total", "spool_dropped_total", "ringbuf_dropped_total", "updated_unix_ns")
_FINDING_COLUMNS = ("id", "node", "namespace", "class", "consumer_key", "opened_unix_ns", "resolved_unix_ns",
                    "consumer")
_UPSERT_POSITION = upsert_sql("positions", _POSITION_COLUMNS, _POSITION_COLUMNS[:3])
_UPSERT_FINDING = upsert_sql("findings", _FINDING_COLUMNS, ("id",))
# DO NOTHING: the event log holds each (node, boot, instance, seq) once (PostgreSQL's events_seq_once
# constraint); a slice a fenced-out replica could still send is dropped, never stored twice.
_INSERT_EVENTS = ("INSERT INTO events (node, boot_id, instance_id, first_seq, last_seq, count, "
                  "stored_unix_ns, codec, blob) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING")


class StoreError(Exception):
    """The database cannot be opened or written: one line naming the path and what to do."""


class LeaseLost(Exception):
    """A fenced write refused: another replica holds the node's lease now (a newer token)."""

    def __init__(self, node: str, token: int, current: int | None) -> None:
        super().__init__(f"node {node}: its stream moved to another collector replica (lease token "
                         f"{current if current is not None else 'gone'}, this replica held {token})")
        self.node, self.token, self.current = node, token, current


@dataclass
class Position:
    """Where one tracer instance's stream stands, and its counters (one row per instance)."""

    node: str
    boot_id: str
    instance_id: str
    delivered_seq: int = 0  # highest seq stored (accepted; durable once its job committed)
    ingested_total: int = 0
    duplicates_total: int = 0
    gaps_total: int = 0  # seqs never received (the tracer's spool overflowed while we were away)
    spool_dropped_total: int = 0  # as the tracer last reported
    ringbuf_dropped_total: int = 0
    updated_unix_ns: int = 0

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.node, self.boot_id, self.instance_id)

    @property
    def lost_total(self) -> int:
        # A spool overflow shows twice: as the tracer's count and as a gap in the seqs; count it once.
        return max(self.gaps_total, self.spool_dropped_total) + self.ringbuf_dropped_total


class FindingRow(NamedTuple):
    id: int
    node: str
    namespace: str
    cls: str
    consumer_key: str
    opened_unix_ns: int
    resolved_unix_ns: int
    consumer: bytes  # a serialized ghostgpu.v1.ClusterConsumer


# The rows of one positions insert: Position's fields in table order.
PositionRow = tuple[str, str, str, int, int, int, int, int, int, int]
# What submit() takes, tagged by its first item: the writer groups each kind into one statement.
# events: node, boot_id, instance_id, first_seq, last_seq, count, blob
EventsOp = tuple[Literal["events"], str, str, str, int, int, int, bytes]
PositionOp = tuple[Literal["position"], PositionRow]
FindingOp = tuple[Literal["finding"], FindingRow]
AuditOp = tuple[Literal["audit"], tuple[int | str, ...]]  # collector/audit.py's AuditRow
CallOp = tuple[Literal["call"], Callable[[Any], None]]  # fn(a collector/db.py Conn)
ReleaseOp = tuple[Literal["release"], int]  # bytes of blobs the group commits (back-pressure)
Op = EventsOp | PositionOp | FindingOp | AuditOp | CallOp | ReleaseOp


@dataclass
class _Job:
    ops: Sequence[Op] = ()
    done: Callable[[BaseException | None], None] | None = None
    read: Callable[[Any], Any] | None = None
    future: Future[Any] | None = None
    fence: tuple[str, int] | None = None  # (node, lease token) the job's writes need (collector/leases.py)
    write: bool = False  # a read that writes: run in its own transaction (read_write)


def _open_sqlite(path: str) -> sqlite3.Connection:
    what = f"--db {path}"
    try:
        if path != ":memory:":
            # 0600 in a directory made 0700, whatever the umask: the findings and the admin-only audit
            # trail are no other local user's to read. SQLite gives -wal and -shm the file's mode;
            # ones an older ghostgpu left looser are tightened here, with one line.
            private_file(path)
            for suffix in ("-wal", "-shm", "-journal"):
                tighten(path + suffix, FILE_MODE)
        conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a commit survives a crash of this process
        migrate(conn, "sqlite", what)  # BEGIN IMMEDIATE: the file is writable now, not at the first event
    except SchemaError as e:
        raise StoreError(str(e)) from None
    except (OSError, sqlite3.Error, ValueError) as e:
        raise StoreError(f"{what}: cannot open or write it ({e}); pass a writable file with --db, "
                         "or --db :memory: to keep nothing") from None
    return conn


def _open_postgresql(url: StoreUrl, password_file: str | None, application_name: str) -> Any:
    try:
        conn = connect_postgresql(url, password_file, application_name=application_name)
        migrate(conn, "postgresql", url.flag)
    except StoreUrlError as e:
        raise StoreError(str(e)) from None
    except SchemaError as e:
        raise StoreError(str(e)) from None
    except db_errors() as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StoreError(f"{url.flag}: cannot open the database ({first}); check the host, the database, "
                         "the user and its password (--store-password-file), and that PostgreSQL 15+ runs "
                         "there") from None
    return conn


class Store:
    """See the module docstring. Every public method is thread-safe."""

    def __init__(self, path: str, event_log_max: int, retention_days: float, compress: bool = True, *,
                 password_file: str | None = None, replica_id: str = "collector") -> None:
        """path: a --db path or a --store URL (collector/db.py); password_file: PostgreSQL's password;
        replica_id: this collector among the replicas (its lease owner name and application_name)."""
        try:
            self.url = parse_store_url(path)
        except StoreUrlError as e:
            raise StoreError(str(e)) from None
        self.path = self.url.shown()
        self.engine = self.url.engine
        self.replica_id = replica_id
        self.event_log_max = event_log_max
        self.retention_s = retention_days * 86400.0
        self.compress = compress
        self._password_file = password_file
        self._conn: Any = self._connect()
        self._in_tx = False
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._log_events: int = 0 if self.engine == "postgresql" else self._conn.execute(
            "SELECT COALESCE(SUM(count), 0) FROM events").fetchone()[0]
        self._last_prune = 0.0
        self.failed: BaseException | None = None
        self.db_down_since: float | None = None  # monotonic time the database went out of reach, or None
        self.errors_total = 0  # failed tries of a group commit (transient ones included)
        self.fenced_out_total = 0  # jobs refused because their node's lease moved (LeaseLost)
        self.stalled_ended_total = 0  # other collectors' sessions ended for holding locks mid-transaction
        self.commit_seconds: list[float] = []  # group commit times since stats() last took them
        self._id_next, self._id_end = 0, 0  # the finding id block in hand (next_finding_id)
        self._id_spare: Future[tuple[int, int]] | None = None
        # Read now, before the writer thread owns the connection (a SQLite connection is one thread's).
        self._sqlite_first_id = self.max_finding_id() + 1 if self.engine == "sqlite" else 0
        self._prune_retention()
        self._thread = threading.Thread(target=self._run, name="collector-store", daemon=True)
        self._thread.start()

    # ---- loading at start ------------------------------------------------------------------

    def load_positions(self) -> list[Position]:
        rows = self._conn.execute("SELECT * FROM positions").fetchall()
        return [Position(*r) for r in rows]

    def load_open_findings(self) -> list[FindingRow]:
        rows = self._conn.execute("SELECT * FROM findings WHERE resolved_unix_ns = 0 ORDER BY id").fetchall()
        return [FindingRow(*r) for r in rows]

    def load(self, fn: Callable[[Any], T]) -> T:
        """At start, before any write is queued: fn(connection), as the loaders above read."""
        return fn(self._conn)

    def max_finding_id(self) -> int:
        max_id: int = self._conn.execute("SELECT COALESCE(MAX(id), 0) FROM findings").fetchone()[0]
        return max_id

    def next_finding_id(self) -> int:
        """A finding id no other replica hands out. SQLite: the next after the highest stored. PostgreSQL:
        from a block of FINDING_ID_BLOCK ids taken from the finding_ids sequence, the next block fetched
        on the writer thread once this one is three quarters used (the event loop waits only when a
        replica opens findings faster than one block per round trip)."""
        if self._id_next >= self._id_end:
            if self._id_spare is None:
                self._id_spare = self._take_id_block()
            try:
                self._id_next, self._id_end = self._id_spare.result(30.0)
            finally:
                self._id_spare = None
        elif self._id_spare is None and self._id_end - self._id_next < FINDING_ID_BLOCK // 4:
            self._id_spare = self._take_id_block()
        fid = self._id_next
        self._id_next += 1
        return fid

    def _take_id_block(self) -> Future[tuple[int, int]]:
        if self.engine == "sqlite":  # one writer: the ids after the highest stored are this collector's
            fut: Future[tuple[int, int]] = Future()
            fut.set_result((self._sqlite_first_id, 1 << 62))
            return fut

        def take(conn: Any) -> tuple[int, int]:
            block = conn.execute("SELECT nextval('finding_ids')").fetchone()[0]
            return block * FINDING_ID_BLOCK, (block + 1) * FINDING_ID_BLOCK

        return self.read(take)

    # ---- writes ----------------------------------------------------------------------------

    @staticmethod
    def op_events(pos: Position, first_seq: int, last_seq: int, count: int, blob: bytes) -> EventsOp:
        return ("events", pos.node, pos.boot_id, pos.instance_id, first_seq, last_seq, count, blob)

    @staticmethod
    def op_position(pos: Position) -> PositionOp:
        # A copy (the caller goes on counting), built by hand: dataclasses.astuple is 10x slower.
        return ("position", (pos.node, pos.boot_id, pos.instance_id, pos.delivered_seq, pos.ingested_total,
                             pos.duplicates_total, pos.gaps_total, pos.spool_dropped_total,
                             pos.ringbuf_dropped_total, pos.updated_unix_ns))

    @staticmethod
    def op_finding(row: FindingRow) -> FindingOp:
        return ("finding", row)

    @staticmethod
    def op_audit(row: Sequence[int | str]) -> AuditOp:
        """One audit row (collector/audit.py's AuditRow), inserted with the group."""
        return ("audit", tuple(row))

    @staticmethod
    def op_call(fn: Callable[[Any], None]) -> CallOp:
        """Run fn(connection) inside the group's transaction, after the group's other writes, in the
        order submitted; a sqlite3.Error rolls the group back and retries it as any write does."""
        return ("call", fn)

    def submit(self, ops: Sequence[Op],
               done: Callable[[BaseException | None], None] | None = None, size_bytes: int = 0,
               fence: tuple[str, int] | None = None) -> None:
        """Queue writes; `done(error)` runs on the writer thread once they are committed (or failed).
        fence (node, token): commit only while that token holds the node's lease, else done(LeaseLost)."""
        if size_bytes:
            with self._lock:
                self._pending_bytes += size_bytes
            ops = [*ops, ("release", size_bytes)]
        self._queue.put(_Job(ops=ops, done=done, fence=fence))

    def encode_blob(self, blob: bytes) -> tuple[int, bytes]:
        return encode_blob(blob, self.compress)

    @property
    def pending_bytes(self) -> int:
        """Bytes of event blobs queued and not yet committed (for back-pressure on ingest)."""
        return self._pending_bytes

    def read(self, fn: Callable[[Any], T]) -> Future[T]:
        """Run `fn(connection)` on the writer thread after every write queued before it is committed."""
        fut: Future[T] = Future()
        self._queue.put(_Job(read=fn, future=fut))
        return fut

    def read_write(self, fn: Callable[[Any], T]) -> Future[T]:
        """Run `fn(connection)` in a transaction of its own on the writer thread (after every write
        queued before it): a read that writes, such as taking a node's lease (collector/leases.py).
        A transient PostgreSQL error fails the future (the caller decides whether to try again)."""
        fut: Future[T] = Future()
        self._queue.put(_Job(read=fn, future=fut, write=True))
        return fut

    def barrier(self) -> Future[None]:
        return self.read(lambda conn: None)

    def close(self, timeout_s: float = 10.0) -> None:
        """Commit what is queued, stop the writer, close the database."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout_s)
        with contextlib.suppress(*db_errors()):
            self._conn.close()

    # ---- the connection ------------------------------------------------------------------------

    def _connect(self) -> Any:
        if self.engine == "sqlite":
            return _open_sqlite(self.url.target)
        return _open_postgresql(self.url, self._password_file, f"ghostgpu-collector {self.replica_id}")

    def _begin(self) -> None:
        self._conn.execute("BEGIN")
        self._in_tx = True

    def _commit(self) -> None:
        self._conn.execute("COMMIT")
        self._in_tx = False

    def _rollback(self) -> None:
        self._in_tx = False
        with contextlib.suppress(*db_errors()):  # a closed or broken connection cannot roll back
            if self.engine == "postgresql" or self._conn.in_transaction:
                self._conn.execute("ROLLBACK")  # PostgreSQL: outside a transaction, only a warning

    def _reconnect(self) -> None:
        """PostgreSQL: a fresh connection after the old one broke; raises while the server is out of reach."""
        with contextlib.suppress(*db_errors()):
            self._conn.close()
        self._conn = _open_postgresql(self.url, self._password_file, f"ghostgpu-collector {self.replica_id}")

    def _wait_for_database(self, attempt: int, error: BaseException) -> None:
        """Back off, then try again (PostgreSQL). A connection that broke is opened again, and the time
        the database is out of reach is what /readyz reports; a deadlock or a lock wait cut short
        (connection_lost says no) is only tried again on the same connection."""
        if not connection_lost(error) and not self._conn.closed:
            time.sleep(min(_RECONNECT_MAX_S, 0.02 * (2 ** min(attempt, 6))))
            return
        if self.db_down_since is None:
            self.db_down_since = time.monotonic()
            log.error("%s: the database is out of reach; not acknowledging events until it is back "
                      "(the tracers spool meanwhile)", self.url.flag)
        time.sleep(min(_RECONNECT_MAX_S, 0.1 * (2 ** min(attempt, 5))))
        try:
            self._reconnect()
        except StoreError as e:
            log.debug("%s", e)

    def _after_lock_wait(self, error: BaseException) -> None:
        """After a lock wait ran out (PostgreSQL, rolled back): end the collector sessions stalled on
        their client while they hold locks (collector/db.py's end_stalled_sessions), so the next try
        does not wait on a replica cut off mid-transaction."""
        if self.engine != "postgresql" or not lock_wait_ran_out(error):
            return
        try:
            ended = end_stalled_sessions(self._conn)
        except db_errors() as e:
            log.warning("%s: cannot end the collector sessions stalled mid-transaction (%s); grant this "
                        "role pg_signal_backend, or wait for the server's keepalive to end them",
                        self.url.flag, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
            return
        if ended:
            self.stalled_ended_total += len(ended)
            log.warning("%s: ended %d collector session(s) stalled mid-transaction on their client, holding "
                        "locks: %s", self.url.flag, len(ended), ", ".join(ended))

    def _database_back(self) -> None:
        if self.db_down_since is not None:
            log.warning("%s: the database is back after %.1f s", self.url.flag,
                        time.monotonic() - self.db_down_since)
            self.db_down_since = None

    # ---- the writer thread -------------------------------------------------------------------

    def _run(self) -> None:
        stop = False
        while not stop:
            jobs: list[_Job] = []
            first = self._queue.get()
            if first is None:
                break
            jobs.append(first)
            while len(jobs) < _MAX_GROUP_JOBS:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    stop = True
                    break
                jobs.append(job)
            self._commit_group(jobs)
            interval_s = _PG_PRUNE_INTERVAL_S if self.engine == "postgresql" else _PRUNE_INTERVAL_S
            if time.monotonic() - self._last_prune > interval_s and self.db_down_since is None:
                self._prune_retention()

    def _commit_group(self, jobs: list[_Job]) -> None:
        writes = [j for j in jobs if j.read is None]
        error: BaseException | None = self.failed
        refused: dict[int, LeaseLost] = {}
        released = sum(op[1] for j in writes for op in j.ops if op[0] == "release")
        if error is None and any(j.ops for j in writes):
            error, refused = self._write_retrying(writes)
        if released:
            with self._lock:
                self._pending_bytes -= released
        for j in writes:
            if j.done is not None:
                try:
                    j.done(refused.get(id(j), error))
                except Exception:
                    log.exception("store: commit callback failed")
        for j in jobs:
            if j.read is not None and j.future is not None and j.future.set_running_or_notify_cancel():
                try:
                    j.future.set_result(self._run_read(j))
                except Exception as e:
                    j.future.set_exception(e)

    def _run_read(self, job: _Job) -> Any:
        assert job.read is not None
        if not job.write:
            try:
                return job.read(self._conn)
            except db_errors() as e:
                if self.engine == "postgresql" and connection_lost(e):
                    with contextlib.suppress(StoreError):
                        self._reconnect()
                raise
        if self.failed is not None:
            raise self.failed
        try:
            self._begin()
            out = job.read(self._conn)
            self._commit()
            return out
        except BaseException as e:
            self._rollback()
            self._after_lock_wait(e)
            if self.engine == "postgresql" and isinstance(e, db_errors()) and connection_lost(e):
                with contextlib.suppress(StoreError):
                    self._reconnect()
            raise

    def _write_retrying(self, jobs: list[_Job]) -> tuple[StoreError | None, dict[int, LeaseLost]]:
        """Commit a group: (error, the jobs refused by their fence, by id). PostgreSQL out of reach or
        restarting: retried until it is back, acking nothing meanwhile. Any other error: a few tries
        (a busy lock, a moment of full disk), then fail for good.

        The failure is sticky: every later write fails too, so no later batch can commit past
        one that was lost, and the streams end with UNAVAILABLE while tracers keep their spools."""
        attempt, hard_tries = 0, 0
        while True:
            started = time.perf_counter()
            try:
                refused = self._write(jobs)
                self.fenced_out_total += len(refused)
                self._database_back()
                self.commit_seconds.append(time.perf_counter() - started)
                if len(self.commit_seconds) > 65536:  # nobody scrapes: keep the newest
                    del self.commit_seconds[:32768]
                return None, refused
            except db_errors() as e:
                self._rollback()
                self._after_lock_wait(e)
                self.errors_total += 1
                last = e
                if self.engine == "postgresql" and is_transient(e) and self.failed is None:
                    attempt += 1
                    self._wait_for_database(attempt, e)
                    continue
                hard_tries += 1
                if hard_tries >= 3:
                    break
                time.sleep(0.2 * hard_tries)
        first = str(last).strip().splitlines()[0] if str(last).strip() else type(last).__name__
        self.failed = StoreError(f"{self.url.flag}: write failed ({first}); fix the disk or the database and "
                                 "restart the collector")
        log.error("%s", self.failed)
        return self.failed, {}

    def _fenced_out(self, jobs: list[_Job]) -> dict[int, LeaseLost]:
        """In the group's transaction: the jobs whose lease token no longer holds their node. The
        lease rows stay share-locked to the commit (PostgreSQL), so no lease moves under the group."""
        held: dict[str, set[int]] = {}
        for j in jobs:
            if j.fence is not None:
                held.setdefault(j.fence[0], set()).add(j.fence[1])
        if not held:
            return {}
        nodes = sorted(held)
        marks = ", ".join("?" * len(nodes))
        lock = " ORDER BY node FOR SHARE" if self.engine == "postgresql" else ""
        sql = f"SELECT node, token FROM node_leases WHERE node IN ({marks}){lock}"
        current = dict(self._conn.execute(sql, nodes).fetchall())
        refused: dict[int, LeaseLost] = {}
        for j in jobs:
            if j.fence is not None and current.get(j.fence[0]) != j.fence[1]:
                refused[id(j)] = LeaseLost(j.fence[0], j.fence[1], current.get(j.fence[0]))
        return refused

    def _write(self, jobs: list[_Job]) -> dict[int, LeaseLost]:
        conn = self._conn
        self._begin()
        refused = self._fenced_out(jobs)
        if refused:
            jobs = [j for j in jobs if id(j) not in refused]
        positions: dict[tuple[str, str, str], PositionRow] = {}
        findings: dict[int, FindingRow] = {}
        events: list[tuple[str, str, str, int, int, int, int, int, bytes]] = []
        calls: list[Callable[[Any], None]] = []
        audits: list[tuple[int | str, ...]] = []
        now_ns = time.time_ns()
        for job in jobs:
            for op in job.ops:
                # op[0] each time, not a local: mypy narrows the tagged tuple by its own item only
                if op[0] == "events":
                    codec, blob = self.encode_blob(op[7])
                    events.append((*op[1:7], now_ns, codec, blob))
                elif op[0] == "position":
                    positions[op[1][:3]] = op[1]  # the latest counters of each instance win
                elif op[0] == "finding":
                    findings[op[1][0]] = op[1]
                elif op[0] == "call":
                    calls.append(op[1])
                elif op[0] == "audit":
                    audits.append(op[1])
        log_events = self._log_events
        if events:
            conn.executemany(_INSERT_EVENTS, events)
            if self.engine == "sqlite":  # PostgreSQL: bounded in _prune_retention (several writers)
                log_events = self._prune_events(log_events + sum(e[5] for e in events))
        if positions:
            conn.executemany(_UPSERT_POSITION, list(positions.values()))
        if findings:
            conn.executemany(_UPSERT_FINDING, list(findings.values()))
        if audits:
            # DO NOTHING: a seq already stored (never, as collector/audit.py resumes after the newest)
            # must not fail the group, and with it every ack, for good.
            conn.executemany("INSERT INTO audit VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (seq) DO NOTHING",
                             audits)
        errors = db_errors()
        for fn in calls:
            try:
                fn(conn)
            except errors:
                raise  # the group rolls back and is retried
            except Exception:  # a bug in one caller's rows must not stop the writer (and every ack)
                log.exception("store: a write function failed; its rows are skipped")
        self._commit()
        self._log_events = log_events
        return refused

    def _prune_events(self, log_events: int) -> int:
        """Delete the oldest rows until the log holds at most event_log_max events; the new count."""
        excess = log_events - self.event_log_max
        if excess <= 0:
            return log_events
        freed, last_id = 0, None
        for row_id, count in self._conn.execute("SELECT id, count FROM events ORDER BY id"):
            freed += count
            last_id = row_id
            if freed >= excess:
                break
        if last_id is not None:
            self._conn.execute("DELETE FROM events WHERE id <= ?", (last_id,))
        return log_events - freed

    def _prune_retention(self) -> None:
        """Forget findings resolved, and stream positions not updated, more than retention_days ago;
        with PostgreSQL also bound the event log and drop answered replica commands, on one replica at
        a time (a transaction-scoped advisory lock: the others skip this round)."""
        self._last_prune = time.monotonic()
        cutoff_ns = time.time_ns() - int(self.retention_s * 1e9)
        conn = self._conn
        try:
            self._begin()
            if self.engine == "postgresql" and not conn.execute(
                    "SELECT pg_try_advisory_xact_lock(?)", (_RETENTION_LOCK,)).fetchone()[0]:
                self._rollback()
                return
            conn.execute("DELETE FROM findings WHERE resolved_unix_ns > 0 AND resolved_unix_ns < ?",
                         (cutoff_ns,))
            conn.execute("DELETE FROM positions WHERE updated_unix_ns < ?", (cutoff_ns,))
            conn.execute("DELETE FROM replica_commands WHERE created_unix_ns < ?",
                         (time.time_ns() - 3_600_000_000_000,))
            if self.engine == "postgresql":
                self._prune_events_shared()
            self._commit()
        except db_errors() as e:
            self._rollback()
            log.error("%s: pruning old findings failed: %s", self.url.flag, e)

    def _prune_events_shared(self) -> None:
        """PostgreSQL: the oldest event rows past event_log_max events, whoever wrote them."""
        row = self._conn.execute(
            "SELECT id FROM (SELECT id, SUM(count) OVER (ORDER BY id DESC) AS newer FROM events) t "
            "WHERE newer > ? ORDER BY id DESC LIMIT 1", (self.event_log_max,)).fetchone()
        if row is not None:
            self._conn.execute("DELETE FROM events WHERE id <= ?", (row[0],))

    @property
    def event_log_count(self) -> int:
        return self._log_events


def encode_blob(blob: bytes, compress: bool = True) -> tuple[int, bytes]:
    """(codec, stored bytes): zlib level 1, run on the writer thread, off the event loop."""
    return (CODEC_ZLIB, zlib.compress(blob, 1)) if compress else (CODEC_RAW, blob)


def decode_blob(codec: int, blob: bytes) -> bytes:
    return zlib.decompress(blob) if codec == CODEC_ZLIB else blob

