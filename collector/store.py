"""The collector's SQLite store: stream positions, the event log, the findings history and trace sessions.

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

The `audit` table holds the security audit trail (collector/audit.py writes it through `op_audit`
beside its JSON lines file, and reads it): append-only, never pruned.
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

from ghostgpu.common.system.filemodes import FILE_MODE, private_file, tighten

log = logging.getLogger(__name__)

SCHEMA_VERSION = "1"
CODEC_RAW, CODEC_ZLIB = 0, 1
_PRUNE_INTERVAL_S = 600.0
_MAX_GROUP_JOBS = 4096
T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS positions (
  node TEXT NOT NULL, boot_id TEXT NOT NULL, instance_id TEXT NOT NULL,
  delivered_seq INTEGER NOT NULL, ingested_total INTEGER NOT NULL, duplicates_total INTEGER NOT NULL,
  gaps_total INTEGER NOT NULL, spool_dropped_total INTEGER NOT NULL, ringbuf_dropped_total INTEGER NOT NULL,
  updated_unix_ns INTEGER NOT NULL, PRIMARY KEY (node, boot_id, instance_id));
CREATE TABLE IF NOT EXISTS events (
  id INTEGER PRIMARY KEY, node TEXT NOT NULL, boot_id TEXT NOT NULL, instance_id TEXT NOT NULL,
  first_seq INTEGER NOT NULL, last_seq INTEGER NOT NULL, count INTEGER NOT NULL,
  stored_unix_ns INTEGER NOT NULL, codec INTEGER NOT NULL, blob BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS events_by_instance ON events (node, instance_id, last_seq);
CREATE TABLE IF NOT EXISTS findings (
  id INTEGER PRIMARY KEY, node TEXT NOT NULL, namespace TEXT NOT NULL, class TEXT NOT NULL,
  consumer_key TEXT NOT NULL, opened_unix_ns INTEGER NOT NULL, resolved_unix_ns INTEGER NOT NULL,
  consumer BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS findings_by_resolved ON findings (resolved_unix_ns);
CREATE TABLE IF NOT EXISTS trace_sessions (
  id TEXT PRIMARY KEY, started_unix_ns INTEGER NOT NULL, ended_unix_ns INTEGER NOT NULL,
  session BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS trace_records (
  id INTEGER PRIMARY KEY, session TEXT NOT NULL, node TEXT NOT NULL, first_seq INTEGER NOT NULL,
  last_seq INTEGER NOT NULL, count INTEGER NOT NULL, codec INTEGER NOT NULL, blob BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS trace_records_by_session ON trace_records (session, id);
CREATE TABLE IF NOT EXISTS trace_audit (
  id INTEGER PRIMARY KEY, ts_unix_ns INTEGER NOT NULL, session TEXT NOT NULL, action TEXT NOT NULL,
  who TEXT NOT NULL, detail TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS audit (
  seq INTEGER PRIMARY KEY, ts_unix_ns INTEGER NOT NULL, action TEXT NOT NULL, subject TEXT NOT NULL,
  result TEXT NOT NULL, detail TEXT NOT NULL, prev_sha256 TEXT NOT NULL, sha256 TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS audit_by_ts ON audit (ts_unix_ns);
CREATE TABLE IF NOT EXISTS faults (
  id INTEGER PRIMARY KEY, node TEXT NOT NULL, ts_unix_ns INTEGER NOT NULL, gpu TEXT NOT NULL,
  xid TEXT NOT NULL, namespaces TEXT NOT NULL, fault BLOB NOT NULL, boot_id TEXT NOT NULL,
  kmsg_seq INTEGER NOT NULL, log_ts_ns INTEGER NOT NULL, stored_unix_ns INTEGER NOT NULL,
  UNIQUE (node, boot_id, kmsg_seq, log_ts_ns));
CREATE INDEX IF NOT EXISTS faults_by_ts ON faults (ts_unix_ns);
CREATE INDEX IF NOT EXISTS faults_by_stored ON faults (stored_unix_ns);
CREATE TABLE IF NOT EXISTS fault_counts (
  node TEXT NOT NULL, gpu TEXT NOT NULL, xid TEXT NOT NULL, count INTEGER NOT NULL,
  PRIMARY KEY (node, gpu, xid));
"""


class StoreError(Exception):
    """The database cannot be opened or written: one line naming the path and what to do."""


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
CallOp = tuple[Literal["call"], Callable[[sqlite3.Connection], None]]
ReleaseOp = tuple[Literal["release"], int]  # bytes of blobs the group commits (back-pressure)
Op = EventsOp | PositionOp | FindingOp | AuditOp | CallOp | ReleaseOp


@dataclass
class _Job:
    ops: Sequence[Op] = ()
    done: Callable[[BaseException | None], None] | None = None
    read: Callable[[sqlite3.Connection], Any] | None = None
    future: Future[Any] | None = None


def _open(path: str) -> sqlite3.Connection:
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
        conn.executescript(_SCHEMA)
        conn.execute("BEGIN IMMEDIATE")  # proves the file is writable now, not at the first event
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
        if row is None:
            conn.execute("INSERT INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
        conn.execute("COMMIT")
    except (OSError, sqlite3.Error) as e:
        raise StoreError(f"{what}: cannot open or write it ({e}); pass a writable file with --db, "
                         "or --db :memory: to keep nothing") from None
    if row is not None and row[0] != SCHEMA_VERSION:
        raise StoreError(f"{what}: written by another ghostgpu (schema {row[0]}, this one {SCHEMA_VERSION}); "
                         "pass a new file with --db")
    return conn


class Store:
    """See the module docstring. Every public method is thread-safe."""

    def __init__(self, path: str, event_log_max: int, retention_days: float, compress: bool = True) -> None:
        self.path = path
        self.event_log_max = event_log_max
        self.retention_s = retention_days * 86400.0
        self.compress = compress
        self._conn = _open(path)
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._log_events: int = self._conn.execute("SELECT COALESCE(SUM(count), 0) FROM events").fetchone()[0]
        self._last_prune = 0.0
        self.failed: BaseException | None = None
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

    def load(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """At start, before any write is queued: fn(connection), as the loaders above read."""
        return fn(self._conn)

    def max_finding_id(self) -> int:
        max_id: int = self._conn.execute("SELECT COALESCE(MAX(id), 0) FROM findings").fetchone()[0]
        return max_id

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
    def op_call(fn: Callable[[sqlite3.Connection], None]) -> CallOp:
        """Run fn(connection) inside the group's transaction, after the group's other writes, in the
        order submitted; a sqlite3.Error rolls the group back and retries it as any write does."""
        return ("call", fn)

    def submit(self, ops: Sequence[Op],
               done: Callable[[BaseException | None], None] | None = None, size_bytes: int = 0) -> None:
        """Queue writes; `done(error)` runs on the writer thread once they are committed (or failed)."""
        if size_bytes:
            with self._lock:
                self._pending_bytes += size_bytes
            ops = [*ops, ("release", size_bytes)]
        self._queue.put(_Job(ops=ops, done=done))

    def encode_blob(self, blob: bytes) -> tuple[int, bytes]:
        return encode_blob(blob, self.compress)

    @property
    def pending_bytes(self) -> int:
        """Bytes of event blobs queued and not yet committed (for back-pressure on ingest)."""
        return self._pending_bytes

    def read(self, fn: Callable[[sqlite3.Connection], T]) -> Future[T]:
        """Run `fn(connection)` on the writer thread after every write queued before it is committed."""
        fut: Future[T] = Future()
        self._queue.put(_Job(read=fn, future=fut))
        return fut

    def barrier(self) -> Future[None]:
        return self.read(lambda conn: None)

    def close(self, timeout_s: float = 10.0) -> None:
        """Commit what is queued, stop the writer, close the database."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout_s)
        with contextlib.suppress(sqlite3.Error):
            self._conn.close()

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
            if time.monotonic() - self._last_prune > _PRUNE_INTERVAL_S:
                self._prune_retention()

    def _commit_group(self, jobs: list[_Job]) -> None:
        writes = [j for j in jobs if j.read is None]
        error: BaseException | None = self.failed
        released = sum(op[1] for j in writes for op in j.ops if op[0] == "release")
        if error is None and any(j.ops for j in writes):
            error = self._write_retrying(writes)
        if released:
            with self._lock:
                self._pending_bytes -= released
        for j in writes:
            if j.done is not None:
                try:
                    j.done(error)
                except Exception:
                    log.exception("store: commit callback failed")
        for j in jobs:
            if j.read is not None and j.future is not None and j.future.set_running_or_notify_cancel():
                try:
                    j.future.set_result(j.read(self._conn))
                except Exception as e:
                    j.future.set_exception(e)

    def _write_retrying(self, jobs: list[_Job]) -> StoreError | None:
        """Commit a group; a few tries (a busy lock, a moment of full disk), then fail for good.

        The failure is sticky: every later write fails too, so no later batch can commit past
        one that was lost, and the streams end with UNAVAILABLE while tracers keep their spools."""
        for attempt in range(3):
            try:
                self._write(jobs)
                return None
            except sqlite3.Error as e:
                with contextlib.suppress(sqlite3.Error):  # a closed or broken connection cannot roll back
                    if self._conn.in_transaction:
                        self._conn.execute("ROLLBACK")
                last = e
                time.sleep(0.2 * (attempt + 1))
        self.failed = StoreError(f"--db {self.path}: write failed ({last}); fix the disk or the file and "
                                 "restart the collector")
        log.error("%s", self.failed)
        return self.failed

    def _write(self, jobs: list[_Job]) -> None:
        positions: dict[tuple[str, str, str], PositionRow] = {}
        findings: dict[int, FindingRow] = {}
        events: list[tuple[str, str, str, int, int, int, int, int, bytes]] = []
        calls: list[Callable[[sqlite3.Connection], None]] = []
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
        conn = self._conn
        conn.execute("BEGIN")
        log_events = self._log_events
        if events:
            conn.executemany("INSERT INTO events (node, boot_id, instance_id, first_seq, last_seq, count, "
                             "stored_unix_ns, codec, blob) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", events)
            log_events = self._prune_events(log_events + sum(e[5] for e in events))
        if positions:
            conn.executemany("INSERT OR REPLACE INTO positions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                             list(positions.values()))
        if findings:
            conn.executemany("INSERT OR REPLACE INTO findings VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                             list(findings.values()))
        if audits:
            # OR IGNORE: a seq already stored (never, as collector/audit.py resumes after the newest)
            # must not fail the group, and with it every ack, for good.
            conn.executemany("INSERT OR IGNORE INTO audit VALUES (?, ?, ?, ?, ?, ?, ?, ?)", audits)
        for fn in calls:
            try:
                fn(conn)
            except sqlite3.Error:
                raise  # the group rolls back and is retried
            except Exception:  # a bug in one caller's rows must not stop the writer (and every ack)
                log.exception("store: a write function failed; its rows are skipped")
        conn.execute("COMMIT")
        self._log_events = log_events

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
        """Forget findings resolved, and stream positions not updated, more than retention_days ago."""
        self._last_prune = time.monotonic()
        cutoff_ns = time.time_ns() - int(self.retention_s * 1e9)
        try:
            with self._conn:
                self._conn.execute("DELETE FROM findings WHERE resolved_unix_ns > 0 AND resolved_unix_ns < ?",
                                   (cutoff_ns,))
                self._conn.execute("DELETE FROM positions WHERE updated_unix_ns < ?", (cutoff_ns,))
        except sqlite3.Error as e:
            log.error("--db %s: pruning old findings failed: %s", self.path, e)

    @property
    def event_log_count(self) -> int:
        return self._log_events


def encode_blob(blob: bytes, compress: bool = True) -> tuple[int, bytes]:
    """(codec, stored bytes): zlib level 1, run on the writer thread, off the event loop."""
    return (CODEC_ZLIB, zlib.compress(blob, 1)) if compress else (CODEC_RAW, blob)


def decode_blob(codec: int, blob: bytes) -> bytes:
    return zlib.decompress(blob) if codec == CODEC_ZLIB else blob

