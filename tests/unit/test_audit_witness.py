"""Cutting the audit trail, against the real collector (collector/main.py) and the
real `ghostgpu audit --db PATH --verify`: a tail cut from the audit file, tails cut from both the file
and the store, head records deleted. The chain records each run's start and stop with the head it
took up, the store and the file are checked against each other, and /metrics exports the head for
Prometheus to witness (deploy/prometheus/tests/audit-test.yaml runs the alert on it).
"""

from __future__ import annotations

import json
import sqlite3
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.cli.main import main
from ghostgpu.collector.config import CollectorConfig
from ghostgpu.collector.main import Collector

from ghostgpu.common.audit.chain import GENESIS_SHA256


class Trail:
    """A real collector's store and audit file in tmp_path; `run()` starts and stops the collector
    once (one run: its collector.start, a few records, its collector.stop)."""

    def __init__(self, tmp_path: Path) -> None:
        self.db = tmp_path / "collector.db"
        self.file = tmp_path / "collector.audit.jsonl"
        # ghostgpu_audit_head_seq as Prometheus would scrape it: right after each start, before each stop
        self.heads: list[float] = []

    def run(self, records: int = 3) -> None:
        c = Collector(CollectorConfig(listen=("127.0.0.1:0",), db_path=str(self.db),
                                      metrics_listen="127.0.0.1:0")).start()
        try:
            self.heads.append(scrape(c.metrics_address).get("ghostgpu_audit_head_seq", -1.0))
            for i in range(records):
                c.security.audit("denied", f"uid:{1000 + i}", "denied", method="/ghostgpu.v1.Query/ListAudit")
            self.heads.append(scrape(c.metrics_address).get("ghostgpu_audit_head_seq", -1.0))
        finally:
            c.stop()

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.file.read_text().splitlines() if line.strip()]

    def cut_file(self, keep: int) -> None:
        self.file.write_text("".join(line + "\n" for line in self.file.read_text().splitlines()[:keep]))

    def cut_store(self, where: str) -> None:
        with sqlite3.connect(self.db) as conn:
            conn.execute(f"DELETE FROM audit WHERE {where}")


def scrape(address: str | None) -> dict[str, float]:
    assert address is not None
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith("ghostgpu_audit_")}


@pytest.fixture
def trail(tmp_path: Path) -> Iterator[Trail]:
    yield Trail(tmp_path)


def verify(capsys: pytest.CaptureFixture[str], t: Trail) -> tuple[int, str]:
    code = main(["audit", "--db", str(t.db), "--verify"])
    out, err = capsys.readouterr()
    return code, out.strip() + err.strip()


def test_each_run_is_in_the_chain_and_the_head_is_exported(trail: Trail,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    trail.run()
    trail.run()
    lines = trail.lines()
    assert [r["action"] for r in lines] == ["collector.start", *["denied"] * 3, "collector.stop"] * 2
    first, second = lines[0], lines[5]
    assert (first["detail"]["resumed_seq"], first["detail"]["resumed_sha256"]) == (0, GENESIS_SHA256)
    assert (second["detail"]["resumed_seq"], second["detail"]["resumed_sha256"]) == (5, lines[4]["sha256"])
    assert (lines[4]["detail"]["started_seq"], lines[4]["detail"]["records"]) == (1, 5)
    assert trail.heads == [1, 4, 6, 9]  # it only grows, across restarts too
    assert verify(capsys, trail) == (
        0, f"audit chain intact: 10 records; audit file {trail.file} agrees")


def test_a_tail_cut_from_the_audit_file_is_named(trail: Trail, capsys: pytest.CaptureFixture[str]) -> None:
    trail.run()
    trail.cut_file(keep=3)  # records 4 and 5 (denied, collector.stop) gone from the file only
    code, out = verify(capsys, trail)
    assert code == 1, out
    assert out == (f"audit chain broken at record 4: record 4 (denied) is in the store but not in "
                   f"{trail.file} (cut from the file, or the file is another collector's)")


def test_a_tail_cut_from_the_store_is_named(trail: Trail, capsys: pytest.CaptureFixture[str]) -> None:
    trail.run()
    trail.cut_store("seq > 2")
    code, out = verify(capsys, trail)
    assert code == 1 and out.startswith("audit chain broken at record 3: record 3 (denied) is in "), out
    assert "but not in the store" in out


def test_tails_cut_from_both_show_at_the_next_start_and_in_the_exported_head(
        trail: Trail, capsys: pytest.CaptureFixture[str]) -> None:
    trail.run()  # records 1..5; the last scrape saw 4
    trail.cut_file(keep=2)
    trail.cut_store("seq > 2")
    trail.run()  # takes the chain up at 2
    code, out = verify(capsys, trail)
    # The chain cannot tell this from a crash after record 2 (test_a_crash_...): a warning, and the
    # witness outside the node tells the two apart.
    assert code == 0, out
    assert out.splitlines() == [
        f"audit chain intact: 7 records; audit file {trail.file} agrees",
        "warning: record 3: unclean stop: the collector started again after record 2, which is no "
        "collector.stop: it crashed, was killed or ran out of memory, or the records after 2 were cut "
        "while it was stopped; compare the head Prometheus saw last (ghostgpu_audit_head_seq) before "
        "trusting the trail"]
    assert trail.heads == [1, 4, 3, 6]  # the witness: Prometheus saw the head go from 4 back to 3...
    starts = [r for r in trail.lines() if r["action"] == "collector.start"]
    assert starts[1]["seq"] == 3 and starts[1]["detail"]["resumed_seq"] == 2  # ...the run says where from


def test_a_crash_is_an_unclean_stop_not_a_broken_chain(trail: Trail,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    trail.run()
    # A SIGKILL or an OOM kill before the stop record: the run's records, and no collector.stop.
    trail.cut_file(keep=4)
    trail.cut_store("seq > 4")
    trail.run()
    trail.run()
    code, out = verify(capsys, trail)
    assert code == 0, out
    assert out.splitlines()[0] == f"audit chain intact: 14 records; audit file {trail.file} agrees"
    assert [line.split(": unclean stop:")[0] for line in out.splitlines()[1:]] == ["warning: record 5"]
    code = main(["audit", "--file", str(trail.file), "--verify", "-o", "json"])
    verdict = json.loads(capsys.readouterr().out)
    assert code == 0 and verdict["ok"] and len(verdict["warnings"]) == 1, verdict
    assert verdict["warnings"][0].startswith("record 5: unclean stop: the collector started again after "
                                             "record 4")


def test_head_records_deleted_from_both_are_named(trail: Trail, capsys: pytest.CaptureFixture[str]) -> None:
    trail.run()
    trail.cut_store("seq <= 2")
    trail.file.write_text("".join(line + "\n" for line in trail.file.read_text().splitlines()[2:]))
    code, out = verify(capsys, trail)
    assert (code, out) == (1, "audit chain broken at record 1: in the store: records 1..2 are missing: the "
                              "trail begins at record 3 (its first records were deleted)")


def test_a_deleted_audit_file_is_no_intact_chain(trail: Trail, capsys: pytest.CaptureFixture[str]) -> None:
    trail.run()
    trail.file.unlink()
    code, out = verify(capsys, trail)
    assert code == 1, out
    assert out.startswith(f"audit chain not verified: audit file {trail.file}: cannot read it"), out


def test_an_audit_file_moved_away_while_stopped_still_verifies(trail: Trail,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    trail.run()
    trail.file.rename(trail.file.with_suffix(".old"))  # rotation, as docs/SECURITY.md says to do it
    trail.run()  # the new file begins at this run's collector.start
    assert trail.lines()[0]["action"] == "collector.start" and trail.lines()[0]["seq"] == 6
    assert verify(capsys, trail) == (
        0, f"audit chain intact: 10 records; audit file {trail.file} agrees")
