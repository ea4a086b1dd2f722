"""Attacks on the audit chain's order (ghostgpu/common/audit/chain.py `verify`): records removed,
reordered or replayed, and a chain that does not start at the genesis hash. Each is run on the
records in memory, on the JSON lines file through `ghostgpu audit --file --verify`, and (genesis) on
the store's rows, and each verdict names the record by its seq and says which check broke, so a
check that stops working fails here whichever other check would still notice something.

tests/unit/test_audit.py holds the byte-level edits and the resume after a restart; cutting the
tail and deleting the head records are caught by checking the file and the store against each other
(tests/unit/test_audit_witness.py), not by a check of one chain.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from ghostgpu.cli.main import main
from ghostgpu.collector.audit import AuditLog, record_from_row, row_from_record

from ghostgpu.common.audit.chain import GENESIS_SHA256, AuditRecord, Verdict, verify

N = 6
FORGED_START = "ab" * 32


def chain(n: int = N) -> list[AuditRecord]:
    log = AuditLog(None, None)
    return [log.append("trace.start", f"user:u{i}", "ok", session=f"t-{i}", nodes=("n1",))
            for i in range(1, n + 1)]


def rechained(records: Sequence[AuditRecord], start: str, first_seq: int = 1) -> list[AuditRecord]:
    """The same contents renumbered from `first_seq` and hashed into a new chain starting at `start`:
    what someone who rewrites the records themselves (not just moves lines) produces."""
    out: list[AuditRecord] = []
    for seq, r in enumerate(records, first_seq):
        out.append(AuditRecord.make(seq, r.ts_unix_ns, r.action, r.subject, r.result, r.detail,
                                    out[-1].sha256 if out else start))
    return out


def missing(seq: int, last: int | None = None) -> Verdict:
    last = seq if last is None else last
    return Verdict(False, seq, f"record {seq}: records {seq}..{last} are missing (after record {seq - 1})")


def out_of_order(at: int, seq: int) -> Verdict:
    return Verdict(False, at, f"record {at}: seq {seq} comes again or out of order (after record {at - 1})")


def broken_link(seq: int) -> Verdict:
    return Verdict(False, seq, f"record {seq}: prev_sha256 is not record {seq - 1}'s sha256 (a record was "
                   "edited, removed or put in its place)")


GENESIS = Verdict(False, 1, "record 1: prev_sha256 is not the chain's start (64 zeros)")


def write_file(path: Path, records: Sequence[AuditRecord]) -> Path:
    path.write_text("".join(r.line() + "\n" for r in records))
    return path


def cli_verify(capsys: pytest.CaptureFixture[str], path: Path) -> tuple[int, str]:
    code = main(["audit", "--file", str(path), "--verify"])
    return code, capsys.readouterr().out


def cli_line(verdict: Verdict) -> str:
    return f"audit chain broken at record {verdict.first_bad_seq}: {verdict.why}\n"


def test_the_untouched_chain_is_intact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = chain()
    assert verify(r) == (True, None, f"audit chain intact: {N} records")
    intact = f"audit chain intact: {N} records\n"
    assert cli_verify(capsys, write_file(tmp_path / "a.jsonl", r)) == (0, intact)


# --- removal ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("seq", range(2, N))
def test_removing_one_record_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str], seq: int) -> None:
    r = chain()
    kept = [x for x in r if x.seq != seq]
    assert verify(kept) == missing(seq)
    assert cli_verify(capsys, write_file(tmp_path / "a.jsonl", kept)) == (1, cli_line(missing(seq)))


def test_removing_a_run_of_records_names_the_run() -> None:
    r = chain()
    assert verify(r[:2] + r[4:]) == missing(3, 4)
    assert verify(r[:1] + r[5:]) == missing(2, 5)


def test_removing_a_record_and_renumbering_the_rest_breaks_the_next_link() -> None:
    """Seqs closed up over the gap (and each moved record rehashed): the link to the record before
    the gap is what breaks."""
    r = chain()
    renumbered = [*r[:2], *(AuditRecord.make(x.seq - 1, x.ts_unix_ns, x.action, x.subject, x.result,
                                             x.detail, x.prev_sha256) for x in r[3:])]
    assert verify(renumbered) == broken_link(3)


@pytest.mark.parametrize("seq", range(2, N + 1))
def test_a_record_from_another_chain_in_its_place_breaks_its_link(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str],
                                                                   seq: int) -> None:
    """Record `seq` replaced by the same-numbered record of another log (intact, right seq): only the
    link to the record before it can tell."""
    r, other = chain(), chain()
    assert other[seq - 1].seq == seq and other[seq - 1].sha256 != r[seq - 1].sha256
    mixed = [*r[:seq - 1], other[seq - 1], *r[seq:]]
    assert verify(mixed) == broken_link(seq)
    assert cli_verify(capsys, write_file(tmp_path / "a.jsonl", mixed)) == (1, cli_line(broken_link(seq)))


# --- reorder and replay ----------------------------------------------------------------------------

@pytest.mark.parametrize("seq", range(2, N))
def test_swapping_two_neighbours_names_the_first(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 seq: int) -> None:
    r = chain()
    i = seq - 1
    swapped = [*r[:i], r[i + 1], r[i], *r[i + 2:]]
    assert verify(swapped) == missing(seq)  # record seq+1 stands where seq should
    assert cli_verify(capsys, write_file(tmp_path / "a.jsonl", swapped)) == (1, cli_line(missing(seq)))


def test_swapping_the_first_two_records_of_the_file(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Record 2 first reads as a window starting mid-chain; record 1 after it comes out of order. (The
    command also holds a whole file to starting at record 1, so it may name the head instead.)"""
    r = chain()
    swapped = [r[1], r[0], *r[2:]]
    assert verify(swapped) == out_of_order(3, 1)
    code, out = cli_verify(capsys, write_file(tmp_path / "a.jsonl", swapped))
    assert code == 1 and out.startswith("audit chain broken at record "), out


@pytest.mark.parametrize("seq", range(1, N + 1))
def test_replaying_a_record_at_the_end_names_the_place(seq: int) -> None:
    r = chain()
    assert verify([*r, r[seq - 1]]) == out_of_order(N + 1, seq)


def test_moving_a_record_later_is_out_of_order() -> None:
    r = chain()
    assert verify([r[1], r[2], r[0]]) == out_of_order(4, 1)
    assert verify([*r[:2], *r[3:], r[2]]) == missing(3)


def test_swapping_two_records_with_their_seqs_rewritten_breaks_the_link() -> None:
    """The contents of records 3 and 4 exchanged, each renumbered to its new place and rehashed: the
    seqs read 1..N, but the new record 3 still carries old record 4's prev_sha256 (old record 3's
    hash), not record 2's."""
    r = chain()
    a, b = r[2], r[3]
    moved = [AuditRecord.make(3, b.ts_unix_ns, b.action, b.subject, b.result, b.detail, b.prev_sha256),
             AuditRecord.make(4, a.ts_unix_ns, a.action, a.subject, a.result, a.detail, a.prev_sha256)]
    assert [x.seq for x in [*r[:2], *moved, *r[4:]]] == list(range(1, N + 1))
    assert verify([*r[:2], *moved, *r[4:]]) == broken_link(3)


# --- genesis ---------------------------------------------------------------------------------------

def test_a_first_record_not_chained_to_genesis_is_named(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Record 1 rewritten to link to something before it (its hash recomputed, so it is intact)."""
    r = chain()
    first = AuditRecord.make(1, r[0].ts_unix_ns, r[0].action, r[0].subject, r[0].result, r[0].detail,
                             FORGED_START)
    assert first.intact
    assert verify([first, *r[1:]]) == GENESIS
    assert cli_verify(capsys, write_file(tmp_path / "a.jsonl", [first, *r[1:]])) == (1, cli_line(GENESIS))


@pytest.mark.parametrize("start", [FORGED_START, "0" * 63 + "1", "", "0" * 65])
def test_a_whole_chain_rebuilt_on_another_start_fails_only_at_genesis(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], start: str) -> None:
    """Every link and hash consistent: the genesis check is the only one that can see it."""
    forged = rechained(chain(), start)
    assert all(x.intact for x in forged) and verify(forged[1:]).ok
    assert verify(forged) == GENESIS
    assert cli_verify(capsys, write_file(tmp_path / "a.jsonl", forged)) == (1, cli_line(GENESIS))


def test_the_genesis_check_holds_for_the_store_rows() -> None:
    forged = rechained(chain(), FORGED_START)
    from_store = [record_from_row(row_from_record(x)) for x in forged]
    assert verify(from_store) == GENESIS
    honest = rechained(chain(), GENESIS_SHA256)
    assert verify([record_from_row(row_from_record(x)) for x in honest]).ok


def test_a_window_starting_mid_chain_is_not_held_to_genesis() -> None:
    """--since reads from a later record on: its prev_sha256 is the record before, not zeros."""
    r = chain()
    assert verify(r[3:]) == (True, None, f"audit chain intact: {N - 3} records")
    assert verify(rechained(r[3:], r[2].sha256, first_seq=4)).ok
