"""WatchTrace answered from the store (collector/trace_follow.py), without PostgreSQL: the session's rows
sit in a SQLite store, written as the replicas would, and the test plays the listener."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from ghostgpu.collector.notices import TRACE_CHANNEL, encode_trace
from ghostgpu.collector.notify import Callback
from ghostgpu.collector.store import Store, encode_blob
from ghostgpu.collector.trace_follow import TraceFollow, select_after
from ghostgpu.collector.trace_scope import TraceError
from ghostgpu.collector.trace_store import TraceStore

from ghostgpu.common.model.trace import TraceScope, TraceSession, TraceStatus
from ghostgpu.v1 import trace_pb2

SID = "t-0000beef"
S = trace_pb2.TraceStatus


class FakeNotifier:
    def __init__(self) -> None:
        self.subs: list[Callback] = []

    def subscribe(self, channel: str, callback: Callback) -> Callable[[], None]:
        assert channel == TRACE_CHANNEL
        self.subs.append(callback)
        return lambda: self.subs.remove(callback)

    def tell(self, payload: str | None) -> None:
        for cb in list(self.subs):
            cb(payload)


@pytest.fixture
def store() -> Iterator[Store]:
    s = Store(":memory:", 1000, 7)
    try:
        yield s
    finally:
        s.close()


def session() -> TraceSession:
    now = time.time_ns()
    return TraceSession(id=SID, scope=TraceScope(namespace="ml"), requested_by="me", started_unix_ns=now,
                        deadline_unix_ns=now + 10**10, max_records=1000, nodes=("n1", "n2"), container_ids=())


def add_row(store: Store, node: str, seqs: range, row_id: int | None = None) -> None:
    """A batch as a replica stores it; row_id: an id given by hand, as a replica whose transaction
    took its id earlier but committed later leaves it."""
    tb = trace_pb2.TraceBatch(session=SID, records=[trace_pb2.TraceRecord(node=node, seq=q) for q in seqs])
    codec, blob = encode_blob(tb.SerializeToString())
    cols = "session, node, first_seq, last_seq, count, codec, blob"
    values = [SID, node, seqs[0], seqs[-1], len(seqs), codec, blob]
    if row_id is not None:
        cols, values = "id, " + cols, [row_id, *values]

    def run(conn: Any) -> None:
        conn.execute(f"INSERT INTO trace_records ({cols}) VALUES ({', '.join('?' * len(values))})", values)

    store.submit([Store.op_call(run)])
    store.barrier().result(5)


def test_a_node_s_rows_after_its_last_one_and_every_row_of_a_new_node(store: Store) -> None:
    TraceStore(store, 1000, 3600).save(session())
    add_row(store, "n1", range(1, 3), row_id=10)
    add_row(store, "n1", range(3, 5), row_id=11)
    blob, rows = store.read(select_after(SID, {}, 100)).result(5)
    assert blob is not None and [(r[0], r[1]) for r in rows] == [(10, "n1"), (11, "n1")]
    add_row(store, "n2", range(1, 2), row_id=5)  # an earlier id, committed later by another replica
    _, rows = store.read(select_after(SID, {"n1": 11}, 100)).result(5)
    assert [(r[0], r[1]) for r in rows] == [(5, "n2")]
    _, rows = store.read(select_after(SID, {"n1": 10, "n2": 5}, 100)).result(5)
    assert [(r[0], r[1]) for r in rows] == [(11, "n1")]
    assert store.read(select_after("t-none", {}, 100)).result(5) == (None, [])


def test_follow_sends_what_is_stored_then_each_notified_batch_and_ends_with_the_session(store: Store) -> None:
    ts = TraceStore(store, 1000, 3600)
    s = session()
    ts.save(s)
    add_row(store, "n1", range(1, 4), row_id=10)
    notifier = FakeNotifier()
    follow = TraceFollow(store, notifier)

    async def main() -> list[trace_pb2.TraceWatchMessage]:
        got: list[trace_pb2.TraceWatchMessage] = []
        watch = follow.watch(SID, True)
        got.append(await anext(watch))
        add_row(store, "n2", range(1, 3), row_id=1)  # an id below n1's: still sent
        notifier.tell(encode_trace("a", SID))
        got.append(await asyncio.wait_for(anext(watch), 5))
        ts.save(s.ended(TraceStatus.STOPPED, "stopped by me", time.time_ns()))
        store.barrier().result(5)
        notifier.tell(None)  # a resync wakes it as a notification does
        got.extend([m async for m in watch])
        return got

    got = asyncio.run(main())
    assert [[(r.node, r.seq) for r in m.records] for m in got] == [
        [("n1", 1), ("n1", 2), ("n1", 3)], [("n2", 1), ("n2", 2)], []]
    assert [m.session.status for m in got] == [S.TRACE_STATUS_RUNNING] * 2 + [S.TRACE_STATUS_STOPPED]
    assert notifier.subs and not follow._wakers  # the watch left


def test_without_follow_the_stored_records_or_the_session_alone(store: Store) -> None:
    TraceStore(store, 1000, 3600).save(session())
    follow = TraceFollow(store, FakeNotifier())

    async def main() -> list[trace_pb2.TraceWatchMessage]:
        return [m async for m in follow.watch(SID, False)]

    (only,) = asyncio.run(main())
    assert not only.records and only.session.id == SID and only.session.status == S.TRACE_STATUS_RUNNING


def test_an_unknown_session_is_not_found_and_a_stopping_collector_ends_followers(store: Store) -> None:
    TraceStore(store, 1000, 3600).save(session())
    follow = TraceFollow(store, FakeNotifier())

    async def main() -> tuple[TraceError, TraceError]:
        with pytest.raises(TraceError) as missing:
            await anext(follow.watch("t-nope", True))
        watch = follow.watch(SID, True)
        await anext(watch)
        follow.close()
        with pytest.raises(TraceError) as closing:
            await asyncio.wait_for(anext(watch), 5)
        return missing.value, closing.value

    missing, closing = asyncio.run(main())
    assert missing.code == grpc.StatusCode.NOT_FOUND and "t-nope" in missing.line
    assert closing.code == grpc.StatusCode.UNAVAILABLE
    assert asyncio.run(follow.session(SID)) is not None and asyncio.run(follow.session("t-nope")) is None
