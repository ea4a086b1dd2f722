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
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from ghostgpu.collector.db import Conn
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
        rows = conn.execute("SELECT * FROM audit WHERE ts_unix_ns >= ? AND seq > ? ORDER BY seq LIMIT ?",
                            (since_unix_ns, after_seq, limit or -1)).fetchall()
        return [AuditRow(*r) for r in rows]

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
    the chain in memory (tests, `--db :memory:` without an audit file)."""

    def __init__(self, path: str | None, store: Store | None) -> None:
        self.path = path
        self.store = store
        self._lock = threading.Lock()
        self._fd: int | None = None
        self.tail_problem = ""  # the one line said at start about a broken file tail, "" if none
        head = self._open_file() if path else None
        if store is not None:
            row = store.read(select_audit_head).result(30.0)
            stored = record_from_row(row) if row is not None else None
            if isinstance(stored, AuditRecord) and (head is None or stored.seq > head.seq):
                if head is not None or path:
                    log.warning("audit file %s ends at record %s, the store at %s: going on from the store's",
                                path, head.seq if head else 0, stored.seq)
                head = stored
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

    def append(self, action: str, subject: str, result: str, **detail: Any) -> AuditRecord:
        """Write one record (thread-safe); returns it. A file that cannot be written is logged, never
        raised: an audit failure must not turn a refused call into a crash of the collector."""
        with self._lock:
            record = AuditRecord.make(self.seq + 1, time.time_ns(), action, subject, result,
                                      bound_detail(detail), self.last_sha256)
            self.seq, self.last_sha256 = record.seq, record.sha256
            if self._fd is not None:
                try:
                    os.write(self._fd, (record.line() + "\n").encode())
                except OSError as e:
                    log.error("audit file %s: cannot append record %d (%s); it is in the store only",
                              self.path, record.seq, e.strerror)
            if self.store is not None:
                self.store.submit([Store.op_audit(row_from_record(record))])
        return record

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
