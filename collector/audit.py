"""The collector's security audit trail: one append-only, hash-chained record per privileged or
security-relevant action (docs/SECURITY.md, "Audit"; the record and its chain are
ghostgpu/common/audit/chain.py).

    audit = AuditLog("/var/lib/ghostgpu/audit.jsonl", store)
    audit.append("trace.start", "user:alice", "ok", session="t-1", scope="ns/pod", duration_s=30)

Each record goes two ways, written under one lock so the seqs and the chain stay in order whatever
the thread (the event loop, gRPC's TLS certificate fetcher, a SIGHUP):
- the JSON lines file, opened O_APPEND and written with one os.write per record: a crash of the
  collector loses nothing already appended (a power loss may lose the tail: the next start says so);
- the store's `audit` table, through its writer thread (Store.op_audit), so ListAudit and
  `ghostgpu audit --db` read it; the write commits with the next group, never on the caller's thread.

At start the chain goes on after the newest record the file or the store holds. A file whose last
line is cut short or is no valid record is reported in one line and left as it is: the chain goes on
from the last good record, and `ghostgpu audit --verify` shows the break, as it should.

With a PostgreSQL store (replicas sharing one database, docs/REPLICAS.md) there is one chain for all
of them, and no replica can know its head in memory: each append is a function run in the store's
write transaction (Store.op_call) that takes the chain's lock (a transaction-scoped advisory lock,
AUDIT_LOCK, held to the commit), reads the head, builds the record on it with the same hashing code
and inserts it. So the appends of every replica are serialized in the database, and a record's seq,
prev_sha256 and sha256 are known only once its group commits (`append` returns None there). The file
is then off unless --audit-log names one; when it does, it holds this replica's records as they were
committed (written from the commit callback, in commit order): not a chain by itself (the records
between them are other replicas'), but a witness `ghostgpu audit --store URL --verify --file FILE`
holds against the shared chain (docs/SECURITY.md, "Audit").

The audit table (schema in collector/store.py) is read here too: `select_audit` for ListAudit (on
the store's thread, after every write queued before), `read_audit_file` for `ghostgpu audit --db`
(a read-only connection of its own, no collector needed).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from ghostgpu.collector.db import Conn, serialize_writers
from ghostgpu.collector.store import Store, StoreError

from ghostgpu.common.audit.chain import (
    GENESIS_SHA256,
    AuditRecord,
    BadLine,
    canonical_json,
    normalize_detail,
    parse_line,
)

log = logging.getLogger(__name__)

AUDIT_LOCK = 0x67686F7374617564  # "ghostaud": the shared chain's head, one append at a time
SHARED_START_TIMEOUT_S = 30.0  # how long the start waits for its collector.start record to commit
_TAIL_BLOCK_BYTES = 64 * 1024
# A record's detail is at most this much canonical JSON, whatever a caller sent (a 1 MiB node name
# in a Hello, a policy file's text in an error): one record must not cost what the attacker chose.
DETAIL_MAX_BYTES = 4096
_VALUE_KEPT = 256  # characters kept of a long value when the detail is over
_HEAD_KEPT = 1500  # characters of the detail's JSON kept when cutting values is not enough


class AuditFn(Protocol):
    """What the servicers and checks call to audit: AuditLog.append (one record; details as keywords)."""

    def __call__(self, action: str, subject: str, result: str, **detail: Any) -> object: ...


def bound_detail(detail: dict[str, Any], max_bytes: int = DETAIL_MAX_BYTES) -> dict[str, Any]:
    """`detail` as it will be stored (normalize_detail) when its canonical JSON fits in `max_bytes`.
    Else each value longer than 256 characters (as text, or as JSON for a list or mapping) is cut
    to them with its full length said, and `detail_bytes` says the size it had; if that is still
    over, the detail is `detail_bytes` and the head of its JSON (`detail_head`)."""
    norm = normalize_detail(detail)
    text = canonical_json(norm)
    if len(text) <= max_bytes:
        return norm
    cut: dict[str, Any] = {}
    for key, value in norm.items():
        shown = value if isinstance(value, str) else canonical_json(value)
        if len(shown) > _VALUE_KEPT:
            value = f"{shown[:_VALUE_KEPT]}... ({len(shown)} characters)"
        cut[key] = value
    cut["detail_bytes"] = len(text)
    if len(canonical_json(cut)) <= max_bytes:
        return cut
    return {"detail_bytes": len(text), "detail_head": text[:min(_HEAD_KEPT, max_bytes // 3)]}


class AuditRow(NamedTuple):
    """One row of the audit table: a ghostgpu.common.audit.chain.AuditRecord, detail as its JSON text."""

    seq: int
    ts_unix_ns: int
    action: str
    subject: str
    result: str
    detail: str
    prev_sha256: str
    sha256: str


def select_audit(since_unix_ns: int = 0, after_seq: int = 0,
                 limit: int = 0) -> Callable[[Conn], list[AuditRow]]:
    """A read for Store.read(): audit rows written at or after `since` with seq above `after_seq`,
    oldest first, at most `limit` (0: all)."""

    def run(conn: Conn) -> list[AuditRow]:
        # No LIMIT for "all": SQLite reads LIMIT -1 as none, PostgreSQL (15) refuses a negative one.
        sql = "SELECT * FROM audit WHERE ts_unix_ns >= ? AND seq > ? ORDER BY seq"
        params: tuple[int, ...] = (since_unix_ns, after_seq)
        if limit:
            sql, params = sql + " LIMIT ?", (*params, limit)
        return [AuditRow(*r) for r in conn.execute(sql, params).fetchall()]

    return run


def select_audit_head(conn: Conn) -> AuditRow | None:
    """A read for Store.read(): the newest audit row (where the chain goes on), or None."""
    row = conn.execute("SELECT * FROM audit ORDER BY seq DESC LIMIT 1").fetchone()
    return AuditRow(*row) if row else None


def read_audit_file(path: str, since_unix_ns: int = 0) -> list[AuditRow]:
    """The audit rows of a store file, opened read-only (a collector may be writing it: WAL lets it);
    StoreError with one line naming --db when it is not there, not a store, or has no audit table."""
    what = f"--db {path}"
    if not os.path.isfile(path):
        raise StoreError(f"{what}: no such file; pass the collector's database (its --db)")
    uri = Path(path).absolute().as_uri()
    conn = None
    try:
        try:
            conn = sqlite3.connect(f"{uri}?mode=ro", uri=True)
            conn.execute("SELECT 1 FROM meta LIMIT 1").fetchall()
        except sqlite3.OperationalError as e:
            if "no such table" in str(e):
                raise
            # WAL needs a writable -shm file: a copy or a read-only directory has none. immutable=1
            # reads the main file as it stands (committed WAL frames a checkpoint has not moved are missed).
            if conn is not None:
                conn.close()
            conn = sqlite3.connect(f"{uri}?mode=ro&immutable=1", uri=True)
        has = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'audit'").fetchone()
        if has is None:
            raise StoreError(f"{what}: has no audit table (written by a ghostgpu from before the audit "
                             "trail); nothing to read")
        return select_audit(since_unix_ns)(conn)
    except sqlite3.Error as e:
        raise StoreError(f"{what}: cannot read it as a ghostgpu store ({e}); pass the collector's "
                         "database (its --db)") from None
    finally:
        if conn is not None:
            conn.close()


def read_audit_store(url: str, password_file: str | None = None, since_unix_ns: int = 0) -> list[AuditRow]:
    """The audit rows of a --store URL, read-only (`ghostgpu audit --store`): a PostgreSQL database the
    replicas share (a session whose transactions are READ ONLY: nothing this reads with can write), or
    sqlite:///PATH as --db reads it. StoreError with one line naming --store when it cannot be read."""
    from ghostgpu.collector.db import StoreUrlError, connect_postgresql, db_errors, parse_store_url

    try:
        parsed = parse_store_url(url)
        if parsed.engine == "sqlite":
            return read_audit_file(parsed.target, since_unix_ns)
        conn = connect_postgresql(parsed, password_file, application_name="ghostgpu audit")
    except StoreUrlError as e:
        raise StoreError(str(e)) from None
    except db_errors() as e:
        raise StoreError(f"{parsed.flag}: cannot connect ({_first_line(e)}); check the host, the database, "
                         "the user and its password (--store-password-file)") from None
    try:
        conn.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
        return select_audit(since_unix_ns)(conn)
    except db_errors() as e:
        raise StoreError(f"{parsed.flag}: cannot read its audit table ({_first_line(e)}); pass the "
                         "database the collector replicas share (their --store)") from None
    finally:
        conn.close()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def row_from_record(r: AuditRecord) -> AuditRow:
    return AuditRow(r.seq, r.ts_unix_ns, r.action, r.subject, r.result, canonical_json(r.detail),
                    r.prev_sha256, r.sha256)


def record_from_row(row: AuditRow) -> AuditRecord | BadLine:
    """The record of a row; a row whose detail is no JSON object (edited in the table) is a BadLine,
    which verification reports at its place in the chain."""
    try:
        detail = json.loads(row.detail)
    except ValueError:
        detail = None
    if not isinstance(detail, dict):
        return BadLine(row.seq, f"row seq {row.seq}: detail is not a JSON object")
    return AuditRecord(row.seq, row.ts_unix_ns, row.action, row.subject, row.result, detail,
                       row.prev_sha256, row.sha256)


class AuditError(Exception):
    """The audit file cannot be opened or written: one line naming it and what to do."""


def _last_line(fd: int, size: int) -> tuple[bytes, bool]:
    """(the file's last non-empty line, whether it ends with a newline); reads backwards in blocks."""
    buf, pos = b"", size
    while pos > 0:
        step = min(_TAIL_BLOCK_BYTES, pos)
        pos -= step
        buf = os.pread(fd, step, pos) + buf
        body = buf.rstrip(b"\n")
        if b"\n" in body or pos == 0:
            break
    complete = buf.endswith(b"\n")
    body = buf.rstrip(b"\n")
    return body.rpartition(b"\n")[2], complete


def _last_good(path: str) -> AuditRecord | None:
    """The last intact record of the file, read whole (only after its tail turned out broken)."""
    last: AuditRecord | None = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, text in enumerate(f, 1):
            item = parse_line(text, n) if text.strip() else None
            if isinstance(item, AuditRecord) and item.intact:
                last = item
    return last


class AuditLog:
    """See the module docstring. path None: the store only; store None: the file only; both None:
    the chain in memory (tests, `--db :memory:` without an audit file). A PostgreSQL store makes the
    chain shared (`shared`): built in the database, one for every replica."""

    def __init__(self, path: str | None, store: Store | None) -> None:
        self.path = path
        self.store = store
        self.shared = store is not None and store.engine == "postgresql"
        self._lock = threading.Lock()
        self._fd: int | None = None
        self.tail_problem = ""  # the one line said at start about a broken file tail, "" if none
        self.appended_total = 0  # records this process appended (committed ones, with a shared chain)
        head = self._open_file() if path else None
        if self.shared:
            head = None  # the file holds only this replica's records: the chain goes on from the database's
        if store is not None:
            row = store.read(select_audit_head).result(30.0)
            stored = record_from_row(row) if row is not None else None
            if isinstance(stored, AuditRecord) and (head is None or stored.seq > head.seq):
                if head is not None or (path and not self.shared):
                    log.warning("audit file %s ends at record %s, the store at %s: going on from the store's",
                                path, head.seq if head else 0, stored.seq)
                head = stored
        # With a shared chain: the newest record this replica has seen (at start, or committed since).
        self.seq = head.seq if head else 0
        self.last_sha256 = head.sha256 if head else GENESIS_SHA256

    def _open_file(self) -> AuditRecord | None:
        """Open (or create, 0600) the file for appending; the record the chain goes on from."""
        path = self.path
        assert path is not None
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            size = os.fstat(self._fd).st_size
            if size == 0:
                return None
            with open(path, "rb") as f:
                text, complete = _last_line(f.fileno(), size)
        except OSError as e:
            raise AuditError(f"audit file {path}: cannot open it for appending ({e.strerror}); pass a "
                             "writable path or fix its permissions") from None
        item = parse_line(text.decode("utf-8", errors="replace"), 0)
        if complete and isinstance(item, AuditRecord) and item.intact:
            return item
        why = ("its last line is cut short (the collector stopped mid-write?)" if not complete
               else "its last line is no intact audit record")
        good = _last_good(path)
        self.tail_problem = (f"audit file {path}: {why}; the chain goes on after record "
                             f"{good.seq if good else 0} and `ghostgpu audit --verify` will show the break")
        log.error("%s", self.tail_problem)
        if not complete:
            os.write(self._fd, b"\n")  # the next record starts on a line of its own
        return good

    def append(self, action: str, subject: str, result: str, **detail: Any) -> AuditRecord | None:
        """Write one record (thread-safe); returns it, or None with a shared chain (its seq is the
        database's to give, at the commit). A file that cannot be written is logged, never raised: an
        audit failure must not turn a refused call into a crash of the collector."""
        if self.shared:
            self._append_shared(action, subject, result, bound_detail(detail))
            return None
        return self._append_local(action, subject, result, bound_detail(detail), resume=False)

    def start(self, **detail: Any) -> AuditRecord:
        """The run's first record, collector.start, with `resumed_seq` and `resumed_sha256`: the head it
        took the chain up from (ghostgpu/common/audit/chain.py checks they are the record before it).
        With a shared chain the head is read in the write transaction and this waits for the commit
        (AuditError, one line, when it does not come within SHARED_START_TIMEOUT_S)."""
        action, subject, result = "collector.start", "collector", "ok"
        if not self.shared:
            return self._append_local(action, subject, result, bound_detail(detail), resume=True)
        fut = self._append_shared(action, subject, result, bound_detail(detail), resume=True)
        assert self.store is not None  # shared: a PostgreSQL store
        try:
            return fut.result(SHARED_START_TIMEOUT_S)
        except TimeoutError:
            raise AuditError(f"audit: the collector.start record did not commit within "
                             f"{SHARED_START_TIMEOUT_S:g} s ({self.store.url.flag}); check that the "
                             "database is up and writable") from None
        except StoreError as e:
            raise AuditError(f"audit: the collector.start record was not written ({e})") from None

    def _append_local(self, action: str, subject: str, result: str, detail: dict[str, Any],
                      resume: bool) -> AuditRecord:
        with self._lock:
            if resume:
                detail = {**detail, "resumed_seq": self.seq, "resumed_sha256": self.last_sha256}
            record = AuditRecord.make(self.seq + 1, time.time_ns(), action, subject, result, detail,
                                      self.last_sha256)
            self.seq, self.last_sha256 = record.seq, record.sha256
            self.appended_total += 1
            self._write_line(record)
            if self.store is not None:
                self.store.submit([Store.op_audit(row_from_record(record))])
        return record

    def _write_line(self, record: AuditRecord) -> None:
        if self._fd is not None:
            try:
                os.write(self._fd, (record.line() + "\n").encode())
            except OSError as e:
                where = "the shared chain only" if self.shared else "the store only"
                log.error("audit file %s: cannot append record %d (%s); it is in %s",
                          self.path, record.seq, e.strerror, where)

    def _append_shared(self, action: str, subject: str, result: str, detail: dict[str, Any],
                       resume: bool = False) -> Future[AuditRecord]:
        """Queue the record's write on the store: seq, prev_sha256 and sha256 come from the head read
        under AUDIT_LOCK in the write transaction. The future gets the record as committed."""
        store = self.store
        assert store is not None
        ts_unix_ns = time.time_ns()  # when it was asked for, whatever the commit waits on
        built: list[AuditRecord] = []  # the try that committed built the last one (a retry builds anew)
        fut: Future[AuditRecord] = Future()

        def write(conn: Conn) -> None:
            built.clear()  # set again only once the row is in (a failed try leaves nothing to report)
            built.append(append_on_head(conn, ts_unix_ns, action, subject, result, detail, resume))

        def done(error: BaseException | None) -> None:  # on the store's writer thread, in commit order
            if error is None and built:
                record = built[0]
                with self._lock:
                    if record.seq > self.seq:
                        self.seq, self.last_sha256 = record.seq, record.sha256
                    self.appended_total += 1
                    self._write_line(record)
                fut.set_result(record)
            else:
                # The store failed for good (it says so in its own line): the record is lost with the writes.
                fut.set_exception(error or StoreError(f"audit: {action} was not written"))

        store.submit([Store.op_call(write)], done)
        return fut

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def append_on_head(conn: Conn, ts_unix_ns: int, action: str, subject: str, result: str,
                   detail: Mapping[str, Any], resume: bool = False) -> AuditRecord:
    """In a write transaction: lock the chain's head (AUDIT_LOCK, to the commit: the next append of any
    replica waits here), read it, insert the record that follows it and return that record. `resume`:
    a collector.start, whose detail names the head it follows (resumed_seq, resumed_sha256).

    Several of these may run in one transaction (a group commit): each reads the one inserted before.
    Another function of the group may hold a lock of its own taken in the other order by another
    replica (the fault ids' FAULT_ID_LOCK): PostgreSQL's deadlock check (deadlock_timeout, 1 s by
    default) then aborts one transaction with SQLSTATE 40P01, which the store retries."""
    serialize_writers(conn, AUDIT_LOCK)
    head = conn.execute("SELECT seq, sha256 FROM audit ORDER BY seq DESC LIMIT 1").fetchone()
    seq, prev = (int(head[0]), str(head[1])) if head is not None else (0, GENESIS_SHA256)
    if resume:
        detail = {**detail, "resumed_seq": seq, "resumed_sha256": prev}
    record = AuditRecord.make(seq + 1, ts_unix_ns, action, subject, result, detail, prev)
    # DO NOTHING, then a plain error: a seq taken under the lock can only be there already if a writer
    # skipped the lock; that must cost this one record (logged by the store), not every later commit.
    if conn.execute("INSERT INTO audit VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (seq) DO NOTHING",
                    row_from_record(record)).rowcount != 1:
        raise AuditError(f"audit: record {record.seq} is in the table already (a writer that does not "
                         f"take the chain's lock?); {action} not written")
    return record
