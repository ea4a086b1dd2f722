"""The replicas' NOTIFY payloads (collector/notices.py): encoded, decoded, split under PostgreSQL's limit."""

from __future__ import annotations

import json

import pytest
from ghostgpu.collector.notices import (
    CHANGED,
    OPENED,
    PAYLOAD_MAX_BYTES,
    RESOLVED,
    FindingsNotice,
    NoticeError,
    TraceNotice,
    decode_findings,
    decode_trace,
    encode_findings,
    encode_trace,
)

ROUND_TRIPS = [
    # (changes given, changes decoded): opened, then changed, then resolved; each (id, kind) once
    ([(7, OPENED)], [(7, OPENED)]),
    ([(9, RESOLVED), (7, OPENED)], [(7, OPENED), (9, RESOLVED)]),
    ([(5, RESOLVED), (5, OPENED), (5, CHANGED)], [(5, OPENED), (5, CHANGED), (5, RESOLVED)]),
    ([(3, CHANGED), (3, CHANGED), (4, CHANGED)], [(3, CHANGED), (4, CHANGED)]),
    ([(1 << 62, OPENED)], [(1 << 62, OPENED)]),  # PostgreSQL's block ids are large
]


@pytest.mark.parametrize(("given", "decoded"), ROUND_TRIPS)
def test_findings_round_trip(given: list[tuple[int, int]], decoded: list[tuple[int, int]]) -> None:
    payloads = encode_findings("collector-0", given)
    assert len(payloads) == 1
    assert decode_findings(payloads[0]) == FindingsNotice("collector-0", decoded)


def test_no_change_is_no_payload() -> None:
    assert encode_findings("collector-0", []) == []


@pytest.mark.parametrize("count", [1, 500, 2000, 20_000])
def test_many_ids_split_within_the_limit_and_lose_none(count: int) -> None:
    changes = [(10**12 + i, OPENED if i % 3 else RESOLVED) for i in range(count)]
    payloads = encode_findings("r" * 255, changes)
    assert all(len(p.encode()) <= PAYLOAD_MAX_BYTES for p in payloads)
    got = [c for p in payloads for c in decode_findings(p).changes]
    assert sorted(got) == sorted(changes)
    if count >= 2000:
        assert len(payloads) > 1


def test_a_non_ascii_source_stays_within_bytes() -> None:
    payloads = encode_findings("réplica-ü" * 20, [(i, OPENED) for i in range(3000)])
    assert all(len(p.encode()) <= PAYLOAD_MAX_BYTES for p in payloads)
    assert decode_findings(payloads[-1]).source == "réplica-ü" * 20


@pytest.mark.parametrize(("source", "why"), [("", "1 to 255"), ("x" * 256, "256 characters")])
def test_a_bad_replica_id_is_one_line_naming_the_flag(source: str, why: str) -> None:
    with pytest.raises(ValueError, match="--replica-id") as e:
        encode_findings(source, [(1, OPENED)])
    assert why in str(e.value) and "\n" not in str(e.value)


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="kind 0"):
        encode_findings("c", [(1, 0)])


BAD_FINDINGS = [
    "",
    "not json",
    "[1, 2]",
    json.dumps({"v": 2, "src": "a", "o": [1]}),  # a newer collector's
    json.dumps({"v": 1, "o": [1]}),  # no source
    json.dumps({"v": 1, "src": "a", "o": "1,2"}),
    json.dumps({"v": 1, "src": "a", "r": [1.5]}),
    json.dumps({"v": 1, "src": "a", "c": [True]}),
]


@pytest.mark.parametrize("payload", BAD_FINDINGS)
def test_a_payload_that_is_not_a_findings_notice_is_refused(payload: str) -> None:
    with pytest.raises(NoticeError):
        decode_findings(payload)


@pytest.mark.parametrize(("source", "session"), [("collector-0", "t-1a2b3c4d"), ("pod-x", "t-00000000")])
def test_trace_round_trip(source: str, session: str) -> None:
    payload = encode_trace(source, session)
    assert decode_trace(payload) == TraceNotice(source, session)
    assert encode_trace(source, session) == payload  # identical: PostgreSQL folds them per transaction


BAD_TRACE = ["{}", json.dumps({"v": 1, "src": "a"}), json.dumps({"v": 1, "src": "a", "s": ""}),
             json.dumps({"v": 1, "src": "a", "s": 5})]


@pytest.mark.parametrize("payload", BAD_TRACE)
def test_a_payload_that_is_not_a_trace_notice_is_refused(payload: str) -> None:
    with pytest.raises(NoticeError):
        decode_trace(payload)
