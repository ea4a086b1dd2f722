"""The churn test's record matching (tests/helpers/churn_match.py): PIDs reused within a run are told
apart by time, a late /proc exit by its `held_s`, another process's record by its identity."""

from __future__ import annotations

from tests.helpers.churn import Lifetime
from tests.helpers.churn_match import Matcher, exit_lag_ms, percentile

CID = "c" * 64
MS = 1_000_000


def lives() -> list[Lifetime]:
    # PID 100 twice (host, then in a container), PID 200 once.
    return [Lifetime(100, 1_000 * MS, 1_012 * MS, 0, ""), Lifetime(100, 9_000 * MS, 9_011 * MS, 0, CID),
            Lifetime(200, 1_001 * MS, 1_013 * MS, 0, "")]


def rec(event: str, pid: int, ts_ms: int, **extra: object) -> dict[str, object]:
    kind = "gpu" if event == "open" else None
    return {"event": event, "pid": pid, "ts_ns": ts_ms * MS, "device_kind": kind, "comm": "churn", **extra}


def test_a_reused_pid_is_two_lifetimes() -> None:
    match = Matcher(lives(), offset_ns=0).add_all([
        rec("open", 100, 1_001), rec("exit", 100, 1_011),
        rec("open", 100, 9_001, container_id=CID), rec("exit", 100, 9_010, container_id=CID),
        rec("open", 200, 1_002),
    ])
    assert [s.life.pid for s in match.missing("exit")] == [200]
    assert match.missing("open") == []
    first, second = (match.seen[life.key] for life in lives()[:2])
    assert len(first.opens) == len(second.opens) == 1 and first.opens[0]["ts_ns"] == 1_001 * MS


def test_a_late_scan_exit_goes_to_the_lifetime_it_held_in() -> None:
    # Found by a /proc scan after PID 100 was reused: held_s points back into the first lifetime.
    life = Matcher(lives(), offset_ns=0).add(rec("exit", 100, 20_000, source="procfs", held_s=18.999))
    assert life is not None and life.key == lives()[0].key


def test_records_of_other_processes_are_not_ours() -> None:
    m = Matcher(lives(), offset_ns=0)
    assert m.add(rec("open", 100, 1_001, container_id=CID)) is None  # the host lifetime has no container
    assert m.add(rec("open", 100, 1_001, comm="python3")) is None
    assert m.add(rec("open", 100, 500)) is None  # before our first fork of that PID
    assert m.add(rec("open", 300, 1_001)) is None
    assert m.foreign == 2


def test_only_non_visible_findings_count_and_by_first_seen() -> None:
    m = Matcher(lives(), offset_ns=0)
    pending = {"event": "finding", "pid": 200, "class": "pending", "first_seen_ns": 1_002 * MS}
    hidden = {"event": "finding", "pid": 100, "class": "hidden", "first_seen_ns": 9_001 * MS,
              "container_id": CID, "ts": 99_999.0}
    m.add_all([pending, hidden])
    assert [s.life.key for s in m.with_findings()] == [lives()[1].key]


def test_exit_lag_prefers_the_arrival_stamp() -> None:
    m = Matcher(lives(), offset_ns=0)
    m.add(rec("exit", 200, 1_012, _arrival_ns=1_020 * MS, ts=1.0))
    assert exit_lag_ms(m.seen[lives()[2].key], offset_ns=0) == 7.0
    m.add(rec("exit", 100, 1_011, ts=1.015))  # no stamp: the tracer's wall clock, through the offset
    assert round(exit_lag_ms(m.seen[lives()[0].key], offset_ns=0) or 0, 3) == 3.0


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 99), percentile([], 50)) == (50.0, 99.0, None)
