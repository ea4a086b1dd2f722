"""Findings other replicas announce, delivered to this replica's watchers (collector/findings_remote.py),
without PostgreSQL: the rows sit in a SQLite store and the test plays the listener, calling the
subscriber with payloads (and None, a resync) as collector/notify.py would."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
from ghostgpu.collector.cluster import ClusterTable, FindingRec, Watcher
from ghostgpu.collector.findings_remote import RemoteFindings
from ghostgpu.collector.notices import CHANGED, FINDINGS_CHANNEL, OPENED, RESOLVED, encode_findings
from ghostgpu.collector.notify import Callback, NullNotifier
from ghostgpu.collector.store import Store

from ghostgpu.common.model.consumers import ClusterConsumer, K8sInfo
from ghostgpu.v1 import query_pb2
from tests.helpers.sim_tracer import make_consumer

K = query_pb2.FindingEvent


class FakeNotifier(NullNotifier):
    """The test plays the listener: `tell` hands subscribers a payload as a NOTIFY would."""

    def __init__(self) -> None:
        self.subs: dict[str, list[Callback]] = {}

    def subscribe(self, channel: str, callback: Callback) -> Callable[[], None]:
        self.subs.setdefault(channel, []).append(callback)
        return lambda: self.subs[channel].remove(callback)

    def tell(self, payload: str | None) -> None:
        for cb in list(self.subs.get(FINDINGS_CHANNEL, [])):
            cb(payload)


def rec(fid: int, pid: int, namespace: str = "team-a", memory: int = 0, resolved_ns: int = 0) -> FindingRec:
    c = make_consumer("n1", pid, container_id="ab" * 32, gpu_memory_bytes=memory or None)
    cc = ClusterConsumer(c, K8sInfo("resolved", namespace, "p", "u", "main", "img"), None, node_class=c.cls)
    return FindingRec(fid, "n1", c.key, str(c.cls), 1_000, cc, resolved_ns)


class Env:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.cluster = ClusterTable({}, None, None)
        self.notifier = FakeNotifier()
        self.remote = RemoteFindings(self.cluster, store, self.notifier)
        self.remote.replica_id = "b"
        self.watcher = Watcher("", "", ())
        self.cluster.watch(self.watcher, include_open=False)

    def write(self, *recs: FindingRec) -> None:
        self.store.submit([Store.op_finding(r.row()) for r in recs])
        self.store.barrier().result(5)

    def events(self, w: Watcher | None = None) -> list[tuple[int, int, int]]:
        """(kind, id, resolved?) taken from the watcher's queue."""
        w = w or self.watcher
        out = [(e.kind, e.finding.id, int(e.finding.resolved_unix_ns > 0)) for e in w.items]
        w.items.clear()
        return out

    async def settle(self) -> None:
        """Until the reader task delivered every notice told so far."""
        await asyncio.wait_for(self.remote.drained(), 10)


@pytest.fixture
def env() -> Iterator[Env]:
    store = Store(":memory:", 1000, 7)
    try:
        yield Env(store)
    finally:
        store.close()


def run(env: Env, steps: Callable[[Env], Any]) -> None:
    async def main() -> None:
        env.remote.start()
        try:
            await steps(env)
        finally:
            env.remote.close()

    asyncio.run(main())


def test_changes_reach_the_watchers_with_the_writers_kinds_in_order(env: Env) -> None:
    async def steps(e: Env) -> None:
        e.write(rec(1, 1), rec(2, 2))
        e.notifier.tell(encode_findings("a", [(1, OPENED), (2, OPENED)])[0])
        await e.settle()
        assert e.events() == [(K.KIND_OPENED, 1, 0), (K.KIND_OPENED, 2, 0)]
        e.write(rec(2, 2, memory=5 << 20), rec(1, 1, resolved_ns=2_000))
        e.notifier.tell(encode_findings("a", [(2, CHANGED)])[0])
        e.notifier.tell(encode_findings("a", [(1, RESOLVED)])[0])
        await e.settle()
        assert e.events() == [(K.KIND_CHANGED, 2, 0), (K.KIND_RESOLVED, 1, 1)]
        assert sorted(e.remote.open) == [2]
        assert e.remote.open[2].consumer.consumer.gpu_memory_bytes == 5 << 20

    run(env, steps)


def test_opened_then_resolved_before_the_read_goes_out_as_both(env: Env) -> None:
    async def steps(e: Env) -> None:
        e.write(rec(7, 7, resolved_ns=3_000))
        e.notifier.tell(encode_findings("a", [(7, OPENED), (7, RESOLVED)])[0])
        await e.settle()
        assert e.events() == [(K.KIND_OPENED, 7, 0), (K.KIND_RESOLVED, 7, 1)]  # open as it was, then closed
        assert e.remote.open == {}

    run(env, steps)


def test_own_notices_deliver_nothing_and_forget_what_was_held(env: Env) -> None:
    async def steps(e: Env) -> None:
        e.write(rec(1, 1))
        e.notifier.tell(encode_findings("a", [(1, OPENED)])[0])
        await e.settle()
        e.events()
        e.notifier.tell(encode_findings("b", [(1, CHANGED)])[0])  # b: this replica applies the node now
        await e.settle()
        assert e.events() == [] and e.remote.open == {}

    run(env, steps)


def test_a_resync_tells_what_changed_unheard_and_a_late_notice_is_not_told_twice(env: Env) -> None:
    async def steps(e: Env) -> None:
        e.write(rec(1, 1), rec(2, 2))
        e.notifier.tell(encode_findings("a", [(1, OPENED), (2, OPENED)])[0])
        await e.settle()
        e.events()
        # unheard: 1 resolved, 2 changed, 3 opened, 4 opened and resolved (gone from the open set)
        e.write(rec(1, 1, resolved_ns=5_000), rec(2, 2, memory=9 << 20), rec(3, 3),
                rec(4, 4, resolved_ns=6_000))
        e.notifier.tell(None)
        await e.settle()
        assert sorted(e.events()) == sorted([(K.KIND_RESOLVED, 1, 1), (K.KIND_CHANGED, 2, 0),
                                             (K.KIND_OPENED, 3, 0)])
        # the notices of those same commits, heard after the resync: nothing twice
        for payload in encode_findings("a", [(3, OPENED), (1, RESOLVED), (1, CHANGED)]):
            e.notifier.tell(payload)
        await e.settle()
        assert e.events() == []
        assert sorted(e.remote.open) == [2, 3]

    run(env, steps)


def test_filters_local_only_and_include_open(env: Env) -> None:
    async def steps(e: Env) -> None:
        team_b = Watcher("", "team-b", ())
        other_node = Watcher("n2", "", ())
        pusher = Watcher("", "", ())
        pusher.local_only = True
        for w in (team_b, other_node, pusher):
            e.cluster.watch(w, include_open=False)
        e.write(rec(1, 1), rec(2, 2, namespace="team-b"))
        e.notifier.tell(encode_findings("a", [(1, OPENED), (2, OPENED)])[0])
        await e.settle()
        assert e.events(team_b) == [(K.KIND_OPENED, 2, 0)]
        assert e.events(other_node) == [] and e.events(pusher) == []
        late = Watcher("", "", ())
        e.cluster.watch(late, include_open=True)
        assert e.events(late) == [(K.KIND_OPENED, 1, 0), (K.KIND_OPENED, 2, 0)]
        # a finding this replica holds itself is replayed once, from its own table
        local = replace(rec(1, 1))
        e.cluster.open["n1"] = {local.key: local}
        again = Watcher("", "", ())
        e.cluster.watch(again, include_open=True)
        assert e.events(again) == [(K.KIND_OPENED, 1, 0), (K.KIND_OPENED, 2, 0)]
        pusher_late = Watcher("", "", ())
        pusher_late.local_only = True
        e.cluster.watch(pusher_late, include_open=True)
        assert e.events(pusher_late) == [(K.KIND_OPENED, 1, 0)]  # its own only

    run(env, steps)


@pytest.mark.parametrize("payload", ["junk", '{"v":9,"src":"a","o":[1]}', '{"v":1,"src":"a","o":"1"}'])
def test_a_notice_it_cannot_read_is_skipped(env: Env, payload: str) -> None:
    async def steps(e: Env) -> None:
        e.write(rec(1, 1))
        e.notifier.tell(payload)
        e.notifier.tell(encode_findings("a", [(1, OPENED)])[0])
        await e.settle()
        assert e.events() == [(K.KIND_OPENED, 1, 0)]

    run(env, steps)


def test_a_pruned_row_is_skipped(env: Env) -> None:
    async def steps(e: Env) -> None:
        e.notifier.tell(encode_findings("a", [(99, RESOLVED)])[0])  # gone from the table already
        await e.settle()
        assert e.events() == []

    run(env, steps)
