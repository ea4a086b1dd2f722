"""The stream's spool: bounded, oldest dropped first, exact acks and resends, batches by concatenation."""

from __future__ import annotations

import random

import pytest
from ghostgpu.tracer import records
from ghostgpu.tracer.spool import MAX_EVENT_BYTES, Spool, encode_event, encode_events_message, varint

from ghostgpu.common.model.records import HolderRecord
from ghostgpu.v1 import stream_pb2


def rec(i: int) -> dict[str, object]:
    return records.notice_record("n", "test", f"event {i}")


def fill(spool: Spool, first: int, last: int) -> int:
    return sum(spool.add(seq, rec(seq)) for seq in range(first, last + 1))


def encode_all(spool: Spool) -> None:
    taken = spool.take_pending(10**9)
    spool.put_encoded(len(taken), [(seq, encode_event(seq, r)) for seq, r in taken])


def seqs(stage) -> list[int]:  # type: ignore[no-untyped-def]
    return [seq for seq, _ in stage]


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="--spool-events"):
        Spool(0)


def test_overflow_drops_the_oldest_stage_first() -> None:
    spool = Spool(6)
    fill(spool, 1, 6)
    encode_all(spool)  # 1..6 unsent
    spool.take_unsent(2, 1 << 20)  # 1, 2 inflight
    assert fill(spool, 7, 9) == 3
    assert (seqs(spool.inflight), seqs(spool.unsent), seqs(spool.pending)) == ([], [4, 5, 6], [7, 8, 9])
    assert fill(spool, 10, 14) == 5
    assert (seqs(spool.unsent), seqs(spool.pending)) == ([], [9, 10, 11, 12, 13, 14])
    assert len(spool) == 6 and spool.dropped_total == 8


def test_overflow_while_records_are_out_for_encoding() -> None:
    spool = Spool(4)
    fill(spool, 1, 4)
    taken = spool.take_pending(3)  # 1, 2, 3 are being encoded outside the lock
    assert fill(spool, 5, 6) == 2  # drops 1 and 2, though they are not in the spool right now
    assert len(spool) == 4
    spool.put_encoded(len(taken), [(seq, encode_event(seq, r)) for seq, r in taken])
    encode_all(spool)
    assert seqs(spool.unsent) == [3, 4, 5, 6] and len(spool) == 4 and spool.dropped_total == 2


def test_an_unbounded_add_may_exceed_capacity_by_one() -> None:
    spool = Spool(2)
    fill(spool, 1, 2)
    assert spool.add(3, rec(3), bounded=False) == 0
    assert len(spool) == 3 and spool.dropped_total == 0


def test_ack_trims_every_stage_and_encodings_in_flight() -> None:
    spool = Spool(100)
    fill(spool, 1, 10)
    encode_all(spool)
    spool.take_unsent(4, 1 << 20)  # 1..4 inflight, 5..10 unsent
    fill(spool, 11, 14)
    taken = spool.take_pending(2)  # 11, 12 encoding
    assert spool.ack(3) == 3 and seqs(spool.inflight) == [4]
    assert spool.ack(2) == 0 and spool.acked == 3, "acks are cumulative and never go back"
    assert spool.ack(12) == 7  # inflight 4, unsent 5..10; 11 and 12 leave when their encoding returns
    spool.put_encoded(len(taken), [(seq, encode_event(seq, r)) for seq, r in taken])
    assert seqs(spool.unsent) == [] and seqs(spool.pending) == [13, 14] and len(spool) == 2


def test_requeue_resends_inflight_first() -> None:
    spool = Spool(100)
    fill(spool, 1, 8)
    encode_all(spool)
    spool.take_unsent(5, 1 << 20)
    spool.ack(2)
    spool.requeue()
    assert seqs(spool.inflight) == [] and seqs(spool.unsent) == [3, 4, 5, 6, 7, 8]


def test_take_unsent_respects_count_and_bytes_but_always_moves_one() -> None:
    spool = Spool(100)
    fill(spool, 1, 10)
    encode_all(spool)
    assert seqs(spool.take_unsent(3, 1 << 20)) == [1, 2, 3]
    size = len(spool.unsent[0][1]) + 8
    assert seqs(spool.take_unsent(100, 2 * size)) == [4, 5]
    assert seqs(spool.take_unsent(100, 1)) == [6]


def test_random_operations_keep_the_books() -> None:
    """Every event added is, at any time, exactly once in the spool, acknowledged, or counted dropped."""
    rng = random.Random(7)
    spool = Spool(20)
    seq = 0
    out: list[tuple[int, dict[str, object]]] = []
    for _ in range(5000):
        op = rng.random()
        if op < 0.5:
            seq += 1
            spool.add(seq, rec(seq))
        elif op < 0.6 and not out:
            out = spool.take_pending(rng.randint(1, 20))
        elif op < 0.7 and out:
            spool.put_encoded(len(out), [(s, b"x") for s, _ in out])
            out = []
        elif op < 0.8:
            spool.take_unsent(rng.randint(1, 10), 1 << 20)
        elif op < 0.83 and seq:
            spool.ack(rng.randint(spool.acked, seq))
        else:
            spool.requeue()
        held = seqs(spool.inflight) + seqs(spool.unsent) + [s for s, _ in out] + seqs(spool.pending)
        # Records out for encoding count until they come back, minus those overflow already dropped.
        assert len(spool) == len(held) - spool._drop_on_return
        assert len(spool) <= spool.capacity
        assert held == sorted(held) and len(held) == len(set(held))
    if out:
        spool.put_encoded(len(out), [(s, b"x") for s, _ in out])
    held = seqs(spool.inflight) + seqs(spool.unsent) + seqs(spool.pending)
    assert len(spool) == len(held) and all(s > spool.acked for s in held)
    lost = [s for s in range(spool.acked + 1, seq + 1) if s not in set(held)]
    assert spool.dropped_total >= len(lost), "the missing ones were all counted as dropped"
    assert spool.dropped_total > 0, "the run overflowed the spool at least once"


def test_batch_bytes_parse_as_the_events_they_hold() -> None:
    events = [encode_event(1, rec(1)), encode_event(2, records.notice_record("n", "big", "x" * 70_000)),
              encode_event(3, rec(3))]
    msg = stream_pb2.TracerMessage.FromString(encode_events_message(events))
    assert msg.WhichOneof("msg") == "events"
    assert [ev.seq for ev in msg.events.events] == [1, 2, 3]
    assert len(msg.events.events[1].notice.message) == 70_000


@pytest.mark.parametrize("n", [0, 1, 127, 128, 300, 16_383, 16_384, 1 << 21, (1 << 32) + 5])
def test_varint(n: int) -> None:
    # A uint64 field holding n encodes as tag 0x08 + varint(n): let protobuf check our bytes.
    assert stream_pb2.Ack.FromString(b"\x08" + varint(n)).seq == n


def test_a_record_that_cannot_be_encoded_becomes_a_notice_with_its_seq() -> None:
    # A pid is a uint32 on the wire: -1 cannot be encoded.
    bad_pid = HolderRecord(event="open", ts=1.0, ts_ns=1, source="bpf", node="n", pid=-1)
    ev = stream_pb2.NodeEvent.FromString(encode_event(12, bad_pid))
    assert ev.seq == 12 and ev.notice.what == "stream" and "'open' record seq 12" in ev.notice.message
    huge = records.notice_record("n", "big", "y" * (MAX_EVENT_BYTES + 1))
    ev = stream_pb2.NodeEvent.FromString(encode_event(13, huge))
    assert ev.seq == 13 and "byte limit" in ev.notice.message
