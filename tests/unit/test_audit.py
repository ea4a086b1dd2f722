"""The audit trail (collector/audit.py, ghostgpu/common/audit/chain.py): the hash chain, verify naming
the first edited record after ONE byte of an old record changes in the file (every byte of it), a
removed or reordered record, resuming the chain after a restart (from the file or the store), a broken
file tail, concurrent appends from many threads, and the store table matching the file."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from ghostgpu.cli.main import main
from ghostgpu.collector.audit import AuditError, AuditLog, record_from_row, select_audit
from ghostgpu.collector.store import Store

from ghostgpu.common.audit.chain import (
    GENESIS_SHA256,
    AuditRecord,
    BadLine,
    check,
    parse_lines,
    record_sha256,
    verify,
)
from ghostgpu.common.wire.convert_audit import audit_record_from_proto, audit_record_to_proto


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(str(tmp_path / "c.db"), event_log_max=1000, retention_days=7)
    yield s
    s.close()


def file_items(path: Path) -> list[AuditRecord | BadLine]:
    return parse_lines(path.read_text().splitlines())


def stored(store: Store) -> list[AuditRecord | BadLine]:
    return [record_from_row(r) for r in store.read(select_audit()).result(10)]


def fill(log: AuditLog, n: int, start: int = 1) -> list[AuditRecord]:
    return [log.append("trace.start", f"user:u{i}", "ok", session=f"t-{i}", scope={"namespace": "ml"},
                       nodes=("n1", "n2"), duration_s=30.5)
            for i in range(start, start + n)]


def test_records_chain_and_hash_their_canonical_json(tmp_path: Path) -> None:
    log = AuditLog(str(tmp_path / "audit.jsonl"), None)
    a, b = fill(log, 2)
    assert (a.seq, b.seq) == (1, 2)
    assert a.prev_sha256 == GENESIS_SHA256 and b.prev_sha256 == a.sha256
    assert a.detail == {"session": "t-1", "scope": {"namespace": "ml"}, "nodes": ["n1", "n2"],
                        "duration_s": 30.5}  # as JSON reads it back: a tuple is a list
    body = {k: v for k, v in json.loads(a.line()).items() if k != "sha256"}
    assert a.sha256 == record_sha256(body) == __import__("hashlib").sha256(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    lines = (tmp_path / "audit.jsonl").read_text().splitlines()
    assert lines == [a.line(), b.line()]
    assert verify(file_items(tmp_path / "audit.jsonl")) == (True, None, "audit chain intact: 2 records")
    log.close()
    assert (tmp_path / "audit.jsonl").stat().st_mode & 0o777 == 0o600


def _flip(data: bytes, offset: int) -> bytes:
    old = data[offset:offset + 1]
    new = b"0" if old not in b"0123456789" else b"7" if old != b"7" else b"8"
    return data[:offset] + new + data[offset + 1:]


def test_one_byte_edited_anywhere_in_an_old_record_names_that_record(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path), None)
    fill(log, 6)
    log.close()
    data = path.read_bytes()
    lines = data.split(b"\n")
    start = sum(len(line) + 1 for line in lines[:2])  # record 3's first byte
    end = start + len(lines[2]) + 1  # and its newline
    for offset in range(start, end):
        path.write_bytes(_flip(data, offset))
        ok, bad_seq, why = verify(file_items(path))
        assert not ok and bad_seq == 3, (offset, data[offset:offset + 1], why)
        assert why.startswith("record 3: ")
    path.write_bytes(data)
    assert verify(file_items(path)).ok


def test_an_edited_detail_value_says_edited(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path), None)
    fill(log, 4)
    path.write_text(path.read_text().replace('"user:u2"', '"user:ux"'))
    assert verify(file_items(path)) == (False, 2, "record 2: its content does not match its sha256 (edited)")


def test_removed_reordered_and_forged_records(tmp_path: Path) -> None:
    log = AuditLog(None, None)
    r = fill(log, 5)
    assert verify([r[0], r[1], r[3], r[4]]) == (False, 3,
                                                "record 3: records 3..3 are missing (after record 2)")
    assert verify([r[0], r[2], r[1]]).first_bad_seq == 2
    assert verify(r[2:]).ok  # a window starting mid-chain (--since) checks from its first record on
    assert verify([]).ok
    # A record rebuilt with a fresh hash over edited content still breaks the link to its successor.
    forged = AuditRecord.make(3, r[2].ts_unix_ns, "trace.start", "user:mallory", "ok", {}, r[1].sha256)
    assert verify([r[0], r[1], forged, r[3]]) == (
        False, 4, "record 4: prev_sha256 is not record 3's sha256 (a record was edited, removed or put in "
        "its place)")
    first = AuditRecord.make(1, 1, "denied", "anonymous", "denied", {}, "ab" * 32)
    assert verify([first]) == (False, 1, "record 1: prev_sha256 is not the chain's start (64 zeros)")


def test_the_chain_resumes_after_a_restart(tmp_path: Path, store: Store) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path), store)
    fill(log, 3)
    log.close()
    log = AuditLog(str(path), store)
    assert log.seq == 3 and log.tail_problem == ""
    fill(log, 2, start=4)
    log.close()
    store.barrier().result(10)
    for items in (file_items(path), stored(store)):
        assert [r.seq for r in items] == [1, 2, 3, 4, 5]  # type: ignore[union-attr]
        assert verify(items) == (True, None, "audit chain intact: 5 records")
    assert stored(store) == file_items(path)  # the same records, both ways


def runs(actions: str, resumed: dict[int, int | None] | None = None) -> list[AuditRecord]:
    """Records 1..N, one per letter: S collector.start, P collector.stop, d denied. A start takes the
    chain up from the record before it, or from `resumed[seq]` (None: a start that names no head)."""
    names = {"S": "collector.start", "P": "collector.stop", "d": "denied"}
    out: list[AuditRecord] = []
    for seq, letter in enumerate(actions, 1):
        detail: dict[str, object] = {}
        at = (resumed or {}).get(seq, seq - 1)
        if letter == "S" and at is not None:
            detail = {"resumed_seq": at, "resumed_sha256": out[at - 1].sha256 if at else GENESIS_SHA256}
        out.append(AuditRecord.make(seq, seq, names[letter], "", "ok", detail,
                                    out[-1].sha256 if out else GENESIS_SHA256))
    return out


UNCLEAN = ("record {seq}: unclean stop: the collector started again after record {prev}, which is no "
           "collector.stop: it crashed, was killed or ran out of memory, or the records after {prev} were "
           "cut while it was stopped; compare the head Prometheus saw last (ghostgpu_audit_head_seq) "
           "before trusting the trail")


@pytest.mark.parametrize(("actions", "resumed", "verdict", "warned"), [
    ("SdPSdP", None, (True, None, "audit chain intact: 6 records"), []),  # clean restarts
    ("SdSdP", None, (True, None, "audit chain intact: 5 records"), [(3, 2)]),  # killed after record 2
    ("SSSP", None, (True, None, "audit chain intact: 4 records"), [(2, 1), (3, 2)]),  # crashing at start
    ("dSdP", None, (True, None, "audit chain intact: 4 records"), []),  # the first run's start not seen
    ("SddS", {4: 2}, (False, 4, "record 4: the collector says it took the chain up after record 2, but "
                      "record 3 comes before it (records were removed and the chain forged)"), []),
    ("SdPS", {4: 1}, (False, 4, "record 4: the collector says it took the chain up after record 1, but "
                      "record 3 comes before it (records were removed and the chain forged)"), []),
    ("SdSdSd", {5: 3}, (False, 5, "record 5: the collector says it took the chain up after record 3, but "
                        "record 4 comes before it (records were removed and the chain forged)"), [(3, 2)]),
    ("SdS", {3: None}, (False, 3, "record 3: the collector started again after record 2, which is no "
                        "collector.stop, and does not say which head it took the chain up from"), []),
])
def test_a_start_without_a_stop_before_it_is_an_unclean_stop_when_it_took_up_that_head(
        actions: str, resumed: dict[int, int | None] | None, verdict: tuple[bool, int | None, str],
        warned: list[tuple[int, int]]) -> None:
    records = runs(actions, resumed)
    assert check(records, from_start=True) == (verdict, [UNCLEAN.format(seq=s, prev=p) for s, p in warned])
    assert verify(records, from_start=True) == verdict


@pytest.mark.parametrize(("actions", "resumed", "code", "first_line", "warnings"), [
    ("SdSdP", None, 0, "audit chain intact: 5 records", 1),
    ("SddS", {4: 2}, 1, "audit chain broken at record 4: record 4: the collector says it took the chain up "
                        "after record 2, but record 3 comes before it (records were removed and the chain "
                        "forged)", 0),
])
def test_verify_exits_0_on_an_unclean_stop_and_1_on_a_head_that_does_not_fit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], actions: str,
        resumed: dict[int, int | None] | None, code: int, first_line: str, warnings: int) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_text("".join(r.line() + "\n" for r in runs(actions, resumed)))
    assert main(["audit", "--file", str(path), "--verify"]) == code
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == first_line
    assert len(lines) == 1 + warnings and all(line.startswith("warning: record ") for line in lines[1:])


def test_the_store_carries_the_chain_when_the_file_is_gone(tmp_path: Path, store: Store) -> None:
    log = AuditLog(str(tmp_path / "a.jsonl"), store)
    fill(log, 3)
    log.close()
    (tmp_path / "a.jsonl").unlink()
    log = AuditLog(str(tmp_path / "a.jsonl"), store)
    assert log.seq == 3
    fill(log, 1, start=4)
    store.barrier().result(10)
    assert verify(stored(store)) == (True, None, "audit chain intact: 4 records")


def test_a_cut_short_tail_is_said_once_and_shows_in_verify(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                           ) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path), None)
    fill(log, 3)
    log.close()
    data = path.read_bytes()
    path.write_bytes(data[:-40])  # record 3 half written (a crash mid-write)
    log = AuditLog(str(path), None)
    assert log.tail_problem == (f"audit file {path}: its last line is cut short (the collector stopped "
                                "mid-write?); the chain goes on after record 2 and `ghostgpu audit --verify` "
                                "will show the break")
    assert caplog.text.count("cut short") == 1
    new = log.append("tracer.connect", "node:n1", "ok")
    assert (new.seq, new.prev_sha256) == (3, json.loads(data.splitlines()[1])["sha256"])
    items = file_items(path)
    assert isinstance(items[2], BadLine) and items[3] == new  # the new record is on a line of its own
    ok, bad_seq, why = verify(items)
    assert (ok, bad_seq) == (False, 3) and why.startswith("record 3: line 3 is not an audit record")


def test_concurrent_appends_keep_one_chain(tmp_path: Path, store: Store) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(str(path), store)
    threads = [threading.Thread(target=fill, args=(log, 200, t * 1000)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.barrier().result(10)
    for items in (file_items(path), stored(store)):
        assert verify(items) == (True, None, "audit chain intact: 1600 records")
        assert [r.seq for r in items] == list(range(1, 1601))  # type: ignore[union-attr]


def test_an_unwritable_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    with pytest.raises(AuditError, match=r"^audit file .*/dir: cannot open it for appending \(Is a dir"):
        AuditLog(str(tmp_path / "dir"), None)


def test_an_edited_store_row_is_named(store: Store) -> None:
    log = AuditLog(None, store)
    fill(log, 4)
    store.barrier().result(10)

    def edit(conn: object) -> None:
        conn.execute("UPDATE audit SET detail = '{\"session\":\"t-9\"' WHERE seq = 2")  # type: ignore[attr-defined]

    store.submit([Store.op_call(edit)])
    assert verify(stored(store)) == (False, 2, "record 2: row seq 2: detail is not a JSON object")


def test_proto_round_trip_keeps_the_hash() -> None:
    log = AuditLog(None, None)
    records = fill(log, 3)
    back = [audit_record_from_proto(audit_record_to_proto(r)) for r in records]
    assert back == records
    assert verify(back).ok


# ---- a chain collector replicas share (PostgreSQL: tests/integration/test_audit_replicas.py) ---------

def _shared_chain(steps: list[tuple[str, str]]) -> list[AuditRecord]:
    """Records as replicas sharing one chain write them: (action, replica) per step; a start names the
    head before it, as collector/audit.py's append_on_head does in the write transaction."""
    out: list[AuditRecord] = []
    for action, replica in steps:
        prev_seq, prev_sha = (out[-1].seq, out[-1].sha256) if out else (0, GENESIS_SHA256)
        key = "replica" if action.startswith("collector.") else "by"
        detail: dict[str, object] = {key: replica}
        if action == "collector.start":
            detail |= {"resumed_seq": prev_seq, "resumed_sha256": prev_sha}
        out.append(AuditRecord.make(prev_seq + 1, prev_seq + 1, action, "collector", "ok", detail, prev_sha))
    return out


def test_replicas_runs_are_checked_apart() -> None:
    records = _shared_chain([("collector.start", "a"), ("denied", "a"), ("collector.start", "b"),
                             ("denied", "b"), ("tracer.connect", "a"), ("collector.stop", "b"),
                             ("collector.start", "b"), ("denied", "a")])
    assert check(records, from_start=True) == ((True, None, "audit chain intact: 8 records"), [])
    crashed = _shared_chain([("collector.start", "a"), ("collector.start", "b"), ("denied", "b"),
                             ("collector.start", "a")])  # a again, its first run never stopped
    verdict, warnings = check(crashed, from_start=True)
    assert verdict.ok and len(warnings) == 1
    assert warnings[0].startswith("record 4: unclean stop: replica a started again, and its run from "
                                  "record 1 has no collector.stop")
    # A start that names another head than the record before it: records removed, the chain forged.
    forged = records[:3]
    body = {**forged[2].detail, "resumed_seq": 1}
    forged[2] = AuditRecord.make(3, 3, "collector.start", "collector", "ok", body, forged[1].sha256)
    verdict = check(forged, from_start=True)[0]
    assert (verdict.ok, verdict.first_bad_seq) == (False, 3)
    assert "replica b says it took the chain up after record 1, but record 2 comes before it" in verdict.why


def test_a_replica_witness_file_is_held_against_the_shared_chain() -> None:
    from ghostgpu.common.audit.chain import compare_witness

    chain = _shared_chain([("collector.start", "a"), ("denied", "b"), ("denied", "a"), ("denied", "b"),
                           ("denied", "a")])
    mine: list[AuditRecord | BadLine] = [chain[0], chain[2], chain[4]]
    assert compare_witness(list(chain), mine, "a.jsonl") == (
        True, None, "the 3 records of a.jsonl are in the store as written")
    rewritten = chain[:2]  # from record 3 on, rebuilt with new hashes: a consistent chain of its own
    for r in chain[2:]:
        rewritten.append(AuditRecord.make(r.seq, r.ts_unix_ns, r.action, "user:nobody", r.result, r.detail,
                                          rewritten[-1].sha256))
    assert verify(list(rewritten), from_start=True).ok
    assert compare_witness(list(rewritten), mine, "a.jsonl")[:2] == (False, 3)
    assert compare_witness(list(chain[:4]), mine, "a.jsonl") == (
        False, 5, "record 5 (denied) is in a.jsonl but not in the store (cut from the store)")
    assert compare_witness(list(chain), [chain[2], chain[0]], "a.jsonl")[:2] == (False, 1)
