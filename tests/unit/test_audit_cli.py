"""`ghostgpu audit` (cli/audit.py): the three sources (a store file read-only, the JSON lines
file, the collector's ListAudit over real gRPC, paged), --since, table and json, and --verify's exit
codes and lines, on an intact trail and after an edit."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from ghostgpu.cli import audit as audit_cli
from ghostgpu.cli.main import main
from ghostgpu.collector.audit import AuditLog, row_from_record
from ghostgpu.collector.query import QueryService
from ghostgpu.collector.store import Store

from ghostgpu.common.audit.chain import GENESIS_SHA256, AuditRecord
from ghostgpu.v1 import query_pb2_grpc

DAY_NS = 86400 * 10**9
KEYS = ["seq", "ts_unix_ns", "action", "subject", "result", "detail", "prev_sha256", "sha256"]


def trail(now_ns: int) -> list[AuditRecord]:
    """Five chained records: two from two days ago, three from now."""
    spec = [(now_ns - 2 * DAY_NS, "tracer.connect", "node:n1", "ok", {"peer": "ipv4:10.0.0.5:4000"}),
            (now_ns - 2 * DAY_NS, "policy.reload", "collector", "ok", {"line": "3 rules"}),
            (now_ns, "trace.start", "user:alice", "ok", {"session": "t-1", "duration_s": 30}),
            (now_ns, "denied", "user:bob", "denied", {"method": "/ghostgpu.v1.Query/StartTrace"}),
            (now_ns, "trace.stop", "user:alice", "ok", {"session": "t-1"})]
    out: list[AuditRecord] = []
    for seq, (ts, action, subject, result, detail) in enumerate(spec, 1):
        out.append(AuditRecord.make(seq, ts, action, subject, result, detail,
                                    out[-1].sha256 if out else GENESIS_SHA256))
    return out


@pytest.fixture
def db(tmp_path: Path) -> Iterator[tuple[str, Store]]:
    """A collector's store file holding the trail, still open (WAL) as a running collector keeps it,
    and the audit file beside it holding the same records."""
    path = str(tmp_path / "collector.db")
    store = Store(path, event_log_max=1000, retention_days=7)
    records = trail(time.time_ns())
    store.submit([Store.op_audit(row_from_record(r)) for r in records])
    (tmp_path / "collector.audit.jsonl").write_text("".join(r.line() + "\n" for r in records))
    store.barrier().result(10)
    yield path, store
    store.close()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["audit", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_db_verify_intact(db: tuple[str, Store], capsys: pytest.CaptureFixture[str]) -> None:
    beside = db[0].replace(".db", ".audit.jsonl")
    assert run(capsys, "--db", db[0], "--verify") == (
        0, f"audit chain intact: 5 records; audit file {beside} agrees\n", "")


def test_db_verify_names_the_edited_record(db: tuple[str, Store], capsys: pytest.CaptureFixture[str]) -> None:
    path, store = db
    store.close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE audit SET subject = 'user:carol' WHERE seq = 3")
    code, out, _ = run(capsys, "--db", path, "--verify")
    assert (code, out) == (1, "audit chain broken at record 3: in the store: record 3: its content does not "
                              "match its sha256 (edited)\n")
    code, out, _ = run(capsys, "--db", path, "--verify", "-o", "json")
    assert code == 1 and json.loads(out) == {"ok": False, "first_bad_seq": 3, "records": 5, "first_seq": 1,
                                             "warnings": [],
                                             "last_seq": 5, "why": "in the store: record 3: its content "
                                             "does not match its sha256 (edited)"}
    with sqlite3.connect(path) as conn:
        conn.execute("DELETE FROM audit WHERE seq = 3")
    code, out, _ = run(capsys, "--db", path, "--verify")
    assert (code, out) == (1, "audit chain broken at record 3: in the store: record 3: records 3..3 are "
                              "missing (after record 2)\n")


def test_db_table_json_and_since(db: tuple[str, Store], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--db", db[0])  # default --since 1h: the three recent ones
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["SEQ", "TIME", "ACTION", "SUBJECT", "RESULT", "DETAIL"]
    assert [line.split()[0] for line in lines[1:]] == ["3", "4", "5"]
    assert lines[2].split()[3:] == ["denied", "user:bob", "denied", "method=/ghostgpu.v1.Query/StartTrace"]
    assert lines[1].endswith("duration_s=30 session=t-1")

    code, out, _ = run(capsys, "--db", db[0], "--since", "7d", "-o", "json")
    records = json.loads(out)
    assert code == 0 and [r["seq"] for r in records] == [1, 2, 3, 4, 5]
    assert list(records[0]) == KEYS and records[0]["detail"] == {"peer": "ipv4:10.0.0.5:4000"}

    beside = db[0].replace(".db", ".audit.jsonl")
    assert run(capsys, "--db", db[0], "--verify", "--since", "1h") == (
        0, f"audit chain intact: 3 records; audit file {beside} agrees (seq 3..5; earlier records not "
           "read)\n", "")


def test_an_empty_trail(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    Store(str(tmp_path / "empty.db"), event_log_max=10, retention_days=1).close()
    code, out, _ = run(capsys, "--db", str(tmp_path / "empty.db"))
    assert code == 0 and out.splitlines()[-1] == "(no audit records in this window)"
    empty = str(tmp_path / "empty.db")
    assert run(capsys, "--db", empty, "--verify") == (0, "audit chain intact: 0 records\n", "")


def test_file_verify_after_one_byte_changes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path), None)
    for i in range(6):
        log.append("tracer.connect", f"node:n{i}", "ok", peer=f"ipv4:10.0.0.{i}:4000")
    log.close()
    assert run(capsys, "--file", str(path), "--verify") == (0, "audit chain intact: 6 records\n", "")
    data = path.read_bytes()
    at = data.index(b"node:n2")
    path.write_bytes(data[:at + 6] + b"X" + data[at + 7:])  # n2 -> nX in record 3
    code, out, _ = run(capsys, "--file", str(path), "--verify")
    assert (code, out) == (1, "audit chain broken at record 3: record 3: its content does not match its "
                              "sha256 (edited)\n")
    path.write_bytes(data[:at] + b"\x00" + data[at + 1:])  # a byte that breaks the JSON
    code, out, err = run(capsys, "--file", str(path), "--verify")
    assert code == 1 and out.startswith("audit chain broken at record 3: record 3: line 3 is not an audit")
    code, out, err = run(capsys, "--file", str(path), "-o", "json")  # listing still shows the rest
    assert code == 0 and [r["seq"] for r in json.loads(out)] == [1, 2, 4, 5, 6]
    assert err.startswith("ghostgpu: audit: line 3 is not an audit record")


@pytest.mark.parametrize(("argv", "code", "err"), [
    (["--db", "{tmp}/none.db"], 1, "ghostgpu: --db {tmp}/none.db: no such file; pass the collector's "
     "database (its --db)\n"),
    (["--db", "{tmp}/junk.db"], 1, "ghostgpu: --db {tmp}/junk.db: cannot read it as a ghostgpu store"),
    (["--file", "{tmp}/none.jsonl"], 1, "ghostgpu: --file {tmp}/none.jsonl: cannot read it (No such file"),
    (["--db", "{tmp}/junk.db", "--since", "yesterday"], 2, "ghostgpu: --since 'yesterday': use a number"),
])
def test_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], code: int,
                             err: str) -> None:
    (tmp_path / "junk.db").write_bytes(b"not a database at all" * 100)
    got_code, out, got_err = run(capsys, *(a.format(tmp=tmp_path) for a in argv))
    assert (got_code, out) == (code, "")
    assert got_err.startswith(err.format(tmp=tmp_path)) and got_err.count("\n") == 1, got_err


def test_an_old_store_without_the_audit_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    code, _, err = run(capsys, "--db", str(path))
    assert code == 1 and "has no audit table (written by a ghostgpu from before the audit trail)" in err


def test_one_source_at_most(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["audit", "--db", "a.db", "--collector", "127.0.0.1:1"])
    assert exit_.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
    # --file goes with --db only to be checked against it (--verify)
    for argv in (["--db", "a.db", "--file", "a.jsonl"], ["--collector", "127.0.0.1:1", "--file", "a.jsonl"]):
        assert main(["audit", *argv]) == 2
        assert "--file: give it alone, or with --db or --store and --verify" in capsys.readouterr().err


@contextlib.contextmanager
def query_server(store: Store) -> Iterator[str]:
    """The real QueryService (its ListAudit) on a grpc.aio server on loopback, its loop in a thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-query-loop", daemon=True)
    thread.start()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        query_pb2_grpc.add_QueryServicer_to_server(QueryService({}, None, store), server)  # type: ignore[arg-type]
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_collector_list_audit_pages(db: tuple[str, Store], capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(audit_cli, "PAGE_RECORDS", 2)  # five records: three pages
    with query_server(db[1]) as address:
        assert run(capsys, "--collector", address, "--verify") == (0, "audit chain intact: 5 records\n", "")
        code, out, _ = run(capsys, "--collector", address, "--since", "1h", "-o", "json")
        assert code == 0 and [r["seq"] for r in json.loads(out)] == [3, 4, 5]
        assert json.loads(out)[0]["detail"] == {"duration_s": 30, "session": "t-1"}


def test_collector_unreachable_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--collector", "unix:///nonexistent/ghostgpu.sock")
    assert (code, out) == (1, "")
    assert err.startswith("ghostgpu: cannot reach the collector at unix:///nonexistent/ghostgpu.sock")
