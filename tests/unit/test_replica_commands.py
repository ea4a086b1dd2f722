"""Commands across collector replicas (collector/replica_commands.py) on SQLite: the row's bytes, the
claim (once, fenced by the lease token), the answer and a sender giving up; two ReplicaCommands on
one store handing a command, a CRI call and a refusal to each other; and two trace books, one the
session's home, the other running its part on the node it serves (collector/trace_guests.py).
PostgreSQL's NOTIFY and two real collectors: tests/integration/test_replica_commands_pg.py."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from ghostgpu.collector.cri_fetch import CriCallError
from ghostgpu.collector.migrations import migrate
from ghostgpu.collector.replica_commands import (
    ClusterStreams,
    RemoteStream,
    ReplicaCommand,
    ReplicaCommandError,
    ReplicaCommands,
    ReplicaTiming,
    answer,
    claim,
    claim_open,
    decode_body,
    decode_result,
    encode_body,
    encode_result,
    give_up,
    insert_command,
    live_owners,
    read_answer,
)
from ghostgpu.collector.store import Store
from ghostgpu.collector.trace_commands import TraceLimits, TraceTiming
from ghostgpu.collector.trace_scope import TraceError
from ghostgpu.collector.trace_store import TraceStore, decode_records
from ghostgpu.collector.traces import TraceBook

from ghostgpu.common.model.trace import TraceScope, TraceStatus
from ghostgpu.v1 import stream_pb2, trace_pb2
from tests.helpers.sim_tracer import trace_record

NOW = 1_700_000_000 * 10**9
FAR = NOW + 3600 * 10**9
FAST = ReplicaTiming(sweep_s=0.05, sweep_unlistened_s=0.01, first_poll_s=0.01, max_poll_s=0.05, hop_s=1.0)
TRACE_FAST = TraceTiming(tick_s=0.01, end_grace_s=2.0, reresolve_s=60.0, command_timeout_s=2.0)


# ---- the row's bytes --------------------------------------------------------------------------------


def test_body_carries_deadline_metadata_and_payload() -> None:
    body = encode_body(NOW, {"names": {"ab": ["ml", "p", "c"]}}, b"\x00payload")
    assert decode_body(body) == (NOW, {"names": {"ab": ["ml", "p", "c"]}}, b"\x00payload")
    assert decode_body(encode_body(NOW, {}, b"")) == (NOW, {}, b"")


@pytest.mark.parametrize("body", [b"", b"\x00" * 11, encode_body(NOW, {"a": 1}, b"")[:-1],
                                  encode_body(NOW, {}, b"")[:8] + b"\x00\x00\x00\x02[]"])
def test_a_body_that_is_none_says_so(body: bytes) -> None:
    with pytest.raises(ValueError, match="replica command body"):
        decode_body(body)


def test_result_is_a_payload_or_an_error_line() -> None:
    assert decode_result(encode_result(b"answer")) == b"answer"
    assert decode_result(encode_result()) == b""
    with pytest.raises(ReplicaCommandError) as e:
        decode_result(encode_result(error="timeout: replica b did not finish cri"))
    assert e.value.timeout and e.value.line == "timeout: replica b did not finish cri"
    with pytest.raises(ReplicaCommandError) as e:
        decode_result(b"collector-b")  # a claimed row's result: no answer
    assert not e.value.timeout and e.value.line.startswith("gone: ")


# ---- the SQL ------------------------------------------------------------------------------------------


@pytest.fixture
def conn() -> Iterator[sqlite3.Connection]:
    c = sqlite3.connect(":memory:", isolation_level=None)
    migrate(c, "sqlite", "--db :memory:")
    yield c
    c.close()


def _lease(conn: sqlite3.Connection, node: str, owner: str, token: int, expires: int = FAR) -> None:
    conn.execute("INSERT INTO node_leases VALUES (?, ?, ?, ?, ?) ON CONFLICT (node) DO UPDATE SET "
                 "owner = excluded.owner, token = excluded.token, expires_unix_ns = excluded.expires_unix_ns",
                 (node, owner, token, expires, NOW))


def _row(conn: sqlite3.Connection, cid: int) -> tuple[int, bytes]:
    answered, result = conn.execute("SELECT answered_unix_ns, result FROM replica_commands WHERE id = ?",
                                    (cid,)).fetchone()
    return answered, bytes(result)


def test_a_row_is_claimed_once_and_answered(conn: sqlite3.Connection) -> None:
    body = encode_body(FAR, {"k": 1}, b"req")
    cid = insert_command(conn, "gpu-1", "cri", body, "a", NOW)
    assert read_answer(conn, cid) is None
    got = claim(conn, cid, "gpu-1", "b", None, NOW + 1)
    assert got == ReplicaCommand(cid, "gpu-1", "cri", "a", NOW, FAR, {"k": 1}, b"req")
    assert _row(conn, cid) == (-(NOW + 1), b"b")  # claimed: minus the time, the claiming replica
    assert claim(conn, cid, "gpu-1", "c", None, NOW + 2) is None
    assert read_answer(conn, cid) is None
    assert answer(conn, cid, "a", encode_result(b"resp"), NOW + 3)
    assert read_answer(conn, cid) == encode_result(b"resp")
    assert not answer(conn, cid, "a", encode_result(b"again"), NOW + 4)  # answered once
    assert claim(conn, cid, "gpu-1", "b", None, NOW + 5) is None


def test_a_claim_with_a_token_needs_the_lease_held_with_it(conn: sqlite3.Connection) -> None:
    cid = insert_command(conn, "gpu-1", "cri", encode_body(FAR, {}, b""), "a", NOW)
    assert claim(conn, cid, "gpu-1", "b", 3, NOW) is None  # no lease row at all
    _lease(conn, "gpu-1", "b", 4)
    assert claim(conn, cid, "gpu-1", "b", 3, NOW) is None  # the token moved on: another stream took it
    _lease(conn, "gpu-1", "c", 3)
    assert claim(conn, cid, "gpu-1", "b", 3, NOW) is None  # another replica's
    _lease(conn, "gpu-1", "b", 3)
    assert claim(conn, cid, "gpu-1", "b", 3, NOW) is not None
    assert claim(conn, cid, "gpu-2", "b", None, NOW) is None  # the row's node, not another


def test_claim_open_takes_the_open_rows_of_the_targets_oldest_first(conn: sqlite3.Connection) -> None:
    body = encode_body(FAR, {}, b"")
    old = insert_command(conn, "gpu-1", "cri", body, "a", NOW - 3600 * 10**9)  # past the window
    first = insert_command(conn, "gpu-1", "trace_start", body, "a", NOW)
    other = insert_command(conn, "gpu-2", "cri", body, "a", NOW)
    mine = insert_command(conn, "@b", "trace_part", body, "c", NOW)
    taken = insert_command(conn, "gpu-1", "cri", body, "a", NOW)
    claim(conn, taken, "gpu-1", "z", None, NOW)
    fenced = insert_command(conn, "gpu-3", "cri", body, "a", NOW)
    _lease(conn, "gpu-3", "b", 9)
    rows = claim_open(conn, {"gpu-1": None, "@b": None, "gpu-3": 8}, "b", NOW + 1)
    assert [r.id for r in rows] == [first, mine]
    assert [r.id for r in claim_open(conn, {"gpu-1": None, "@b": None, "gpu-3": 9}, "b", NOW + 2)] == [fenced]
    assert claim_open(conn, {"gpu-1": None}, "b", NOW + 3) == []
    assert claim_open(conn, {}, "b", NOW) == []
    assert _row(conn, old)[0] == 0 and _row(conn, other)[0] == 0


def test_a_row_whose_body_is_no_body_is_answered_never_run(conn: sqlite3.Connection) -> None:
    cid = insert_command(conn, "gpu-1", "cri", b"junk", "a", NOW)
    assert claim(conn, cid, "gpu-1", "b", None, NOW) is None
    with pytest.raises(ReplicaCommandError, match="shorter than its header"):
        decode_result(read_answer(conn, cid) or b"")


def test_a_sender_giving_up(conn: sqlite3.Connection) -> None:
    body = encode_body(FAR, {}, b"")
    unclaimed = insert_command(conn, "gpu-1", "cri", body, "a", NOW)
    assert give_up(conn, unclaimed, "timeout: nobody", NOW) is None
    assert claim(conn, unclaimed, "gpu-1", "b", None, NOW) is None  # never runs late
    assert read_answer(conn, unclaimed) == encode_result(error="timeout: nobody")
    running = insert_command(conn, "gpu-1", "cri", body, "a", NOW)
    claim(conn, running, "gpu-1", "b", None, NOW)
    assert give_up(conn, running, "timeout: nobody", NOW) is None
    assert answer(conn, running, "a", encode_result(b"late"), NOW)  # nobody reads it; no harm
    done = insert_command(conn, "gpu-1", "cri", body, "a", NOW)
    answer(conn, done, "a", encode_result(b"just in time"), NOW)
    assert give_up(conn, done, "timeout: nobody", NOW) == encode_result(b"just in time")


def test_owners_are_the_live_leases(conn: sqlite3.Connection) -> None:
    _lease(conn, "gpu-1", "a", 1)
    _lease(conn, "gpu-2", "b", 1)
    _lease(conn, "gpu-3", "c", 1, expires=NOW - 1)
    assert live_owners(conn, NOW) == {"gpu-1": "a", "gpu-2": "b"}


# ---- two replicas on one store ----------------------------------------------------------------------


class FakeStream:
    """What ReplicaCommands and the trace book need of an IngestSession."""

    def __init__(self, node: str, capabilities: tuple[str, ...] = ("cri-relay", "trace")) -> None:
        self.node = node
        self.active = True
        self.cri_relay = True
        self.hello = stream_pb2.Hello(node=node, tracer_version="fake-1", capabilities=capabilities)
        self.out: asyncio.Queue[Any] = asyncio.Queue()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(str(tmp_path / "c.db"), event_log_max=1000, retention_days=7)
    yield s
    s.close()


def _take(store: Store, node: str, owner: str, token: int = 1) -> None:
    def run(c: Any) -> None:
        _lease(c, node, owner, token, time.time_ns() + 3600 * 10**9)

    store.read_write(run).result(5)


async def until(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.005)


def _run(coro: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro(), 60.0))


def test_a_command_for_a_node_another_replica_serves_runs_there(store: Store) -> None:
    async def main() -> None:
        b_streams = {"gpu-1": FakeStream("gpu-1")}
        a = ReplicaCommands(store, None, "a", {}, timing=FAST)
        b = ReplicaCommands(store, None, "b", b_streams, fence=lambda n: (n, 1) if n in b_streams else None,
                            timing=FAST)
        seen: list[ReplicaCommand] = []

        async def echo(cmd: ReplicaCommand) -> bytes:
            seen.append(cmd)
            return cmd.payload[::-1]

        async def refuse(cmd: ReplicaCommand) -> bytes:
            raise ReplicaCommandError("gone: no such thing")

        b.handle("echo", echo)
        b.handle("refuse", refuse)
        _take(store, "gpu-1", "b")
        a.start()
        b.start()
        try:
            assert await a.send("gpu-1", "echo", b"abc", 5.0, {"x": 1}) == b"cba"
            assert (seen[0].node, seen[0].from_replica, seen[0].meta) == ("gpu-1", "a", {"x": 1})
            with pytest.raises(ReplicaCommandError, match=r"^gone: no such thing$"):
                await a.send("gpu-1", "refuse", b"", 5.0)
            with pytest.raises(ReplicaCommandError, match="replica b runs no nothing commands"):
                await a.send("gpu-1", "nothing", b"", 5.0)
            # a node nobody serves: nobody claims it, the sender gives up at its deadline
            with pytest.raises(ReplicaCommandError) as e:
                await a.send("gpu-9", "echo", b"", 0.2)
            assert e.value.timeout and e.value.line.startswith("timeout: replica serving it did not answer")
            # who serves what, as the trace book sees it
            await a.refresh()
            assert a.owners == {"gpu-1": "b"} and b.owners == {}
            streams = ClusterStreams({}, a)
            remote = streams["gpu-1"]
            assert isinstance(remote, RemoteStream) and remote.active and remote is streams["gpu-1"]
            assert list(streams) == ["gpu-1"] and len(streams) == 1 and "gpu-9" not in streams
            assert a.transport("gpu-9") is None and b.transport("gpu-1") is None
        finally:
            a.close()
            b.close()

    _run(main)


def test_a_row_nobody_claims_within_claim_s_is_given_up_and_every_command_is_counted(store: Store) -> None:
    async def main() -> None:
        a = ReplicaCommands(store, None, "a", {}, timing=FAST)
        b = ReplicaCommands(store, None, "b", {}, timing=FAST)
        release = asyncio.Event()

        async def slow(cmd: ReplicaCommand) -> bytes:
            await release.wait()
            return b"late but sure"

        b.handle("slow", slow)
        a.start()
        b.start()
        try:
            # nobody is replica "gone": the row is given up once claim_s passed, not at the deadline
            with pytest.raises(ReplicaCommandError) as e:
                await a.send("@gone", "slow", b"", 600.0, claim_s=0.1)
            assert (e.value.timeout, e.value.answered) == (True, None)
            assert e.value.line == "timeout: replica gone did not take slow within 0.1 s (is it running?)"
            # b takes its row at once and runs it past claim_s: claimed, so its answer is waited for
            started = time.monotonic()
            sent = asyncio.ensure_future(a.send("@b", "slow", b"", 600.0, claim_s=0.1))
            await until(lambda: bool(b._running) and time.monotonic() > started + 0.3,
                        "b running the row, and claim_s past")
            release.set()
            assert await sent == b"late but sure"
            with pytest.raises(ReplicaCommandError, match="replica b runs no nothing commands"):
                await a.send("@b", "nothing", b"", 5.0)
            a.post("@b", "slow")
            await until(lambda: b.stats.total("run") == 3, "b running the message posted")
        finally:
            a.close()
            b.close()
        assert a.stats.counts == {("sent", "slow", "timeout"): 1, ("sent", "slow", "ok"): 1,
                                  ("sent", "nothing", "error"): 1, ("sent", "slow", "posted"): 1}
        assert b.stats.counts == {("run", "slow", "ok"): 2, ("run", "other", "error"): 1}
        assert (a.stats.sent_total, a.stats.timeouts_total, b.stats.run_total) == (4, 1, 3)

    _run(main)


def test_a_cri_call_through_the_replica_serving_the_node(store: Store) -> None:
    calls: list[tuple[str, str, bytes, float]] = []

    def transport_for(node: str) -> Any:
        if node != "gpu-1":
            return None

        def call(method: str, request: bytes, timeout_s: float) -> bytes:
            calls.append((node, method, request, timeout_s))
            if method == "ContainerStatus":
                raise CriCallError(grpc.StatusCode.NOT_FOUND,
                                   "no such container (via the tracer on node gpu-1)")
            return b"containers:" + request

        return call

    async def main() -> None:
        a = ReplicaCommands(store, None, "a", {}, timing=FAST)
        b = ReplicaCommands(store, None, "b", {"gpu-1": FakeStream("gpu-1")}, timing=FAST)
        b.serve_cri(transport_for)
        _take(store, "gpu-1", "b")
        a.start()
        b.start()
        try:
            await a.refresh()
            transport = a.transport("gpu-1")
            assert transport is not None
            assert await asyncio.to_thread(transport, "ListContainers", b"req", 2.0) == b"containers:req"
            assert calls[0][:3] == ("gpu-1", "ListContainers", b"req") and 1.0 < calls[0][3] <= 2.0
            with pytest.raises(CriCallError) as e:
                await asyncio.to_thread(transport, "ContainerStatus", b"", 2.0)
            assert (e.value.code, e.value.message) == (grpc.StatusCode.NOT_FOUND,
                                                        "no such container (via the tracer on node gpu-1)")
            # the node's stream left b (its lease still live): UNAVAILABLE, not a wait
            b.local = {}
            with pytest.raises(CriCallError) as e:
                await asyncio.to_thread(transport, "ListContainers", b"", 2.0)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE and "at replica b" in e.value.message
        finally:
            a.close()
            b.close()

    _run(main)


# ---- a trace session across two replicas ----------------------------------------------------------------


class FakeTracer:
    """Answers the trace commands queued on a FakeStream through the book that owns the stream."""

    def __init__(self, book: TraceBook, stream: FakeStream) -> None:
        self.book, self.stream = book, stream
        self.commands: list[stream_pb2.Command] = []
        self.task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            msg = await self.stream.out.get()
            command = msg.command
            kind = command.WhichOneof("body")
            self.commands.append(command)
            session = getattr(command, kind).session
            result = trace_pb2.TraceCommandResult(session=session)
            self.book.answer(self.stream, stream_pb2.CommandResult(id=command.id, trace=result))  # type: ignore[arg-type]
            if kind == "trace_stop":
                self.book.batch(self.stream, trace_pb2.TraceBatch(  # type: ignore[arg-type]
                    session=session, ended=True, end_reason="stopped"))

    def kinds(self) -> list[str]:
        return [c.WhichOneof("body") or "" for c in self.commands]


def _book(store: Store, streams: dict[str, Any], replica: ReplicaCommands) -> TraceBook:
    limits = TraceLimits(max_duration_s=600.0, default_duration_s=60.0, max_records=1000, timing=TRACE_FAST)
    return TraceBook(streams, TraceStore(store, 100_000, 3600.0), limits, replica=replica)


def test_a_trace_started_on_one_replica_runs_on_the_replica_serving_its_node(store: Store) -> None:
    async def main() -> None:
        stream = FakeStream("gpu-1")
        a_streams: dict[str, Any] = {}
        b_streams: dict[str, Any] = {"gpu-1": stream}
        ra = ReplicaCommands(store, None, "a", a_streams, timing=FAST)
        rb = ReplicaCommands(store, None, "b", b_streams, timing=FAST)
        home, host = _book(store, a_streams, ra), _book(store, b_streams, rb)
        _take(store, "gpu-1", "b")
        for r in (ra, rb):
            r.start()
        for book in (home, host):
            book.start_ticking()
        tracer = FakeTracer(host, stream)
        try:
            s = await home.start(TraceScope(node="gpu-1", pid=4242), 60_000, 0, "user:alice")
            assert (s.status, s.nodes) == (TraceStatus.RUNNING, ("gpu-1",))
            assert tracer.kinds() == ["trace_start"]
            start = tracer.commands[0].trace_start
            assert (start.session, start.pid, start.deadline_unix_ns) == (s.id, 4242, s.deadline_unix_ns)
            assert s.id not in host.sessions and s.id in host.guests.guests  # type: ignore[union-attr]
            records = [trace_record(seq=i + 1) for i in range(3)]
            host.batch(stream, trace_pb2.TraceBatch(session=s.id, records=records,  # type: ignore[arg-type]
                                                    dropped_ringbuf_total=2))
            await until(lambda: home.get(s.id).records_total == 3, "the home counting the guest's records")
            assert home.get(s.id).dropped_ringbuf_total == 2
            stopped = await home.stop(s.id, "user:alice")
            assert tracer.kinds() == ["trace_start", "trace_stop"]
            assert (stopped.status, stopped.status_detail, stopped.records_total) == (
                TraceStatus.STOPPED, "stopped by user:alice", 3)
            assert not host.guests.guests  # type: ignore[union-attr]
            rows = await asyncio.wrap_future(home.store.records(s.id))
            assert [(r.node, r.seq) for r in decode_records(rows)] == [("gpu-1", n) for n in (1, 2, 3)]
            actions = [e.action for e in await asyncio.wrap_future(home.audit(s.id))]
            assert actions == ["start", "stop"]  # the home's audit; the replica running it adds none
        finally:
            tracer.task.cancel()
            for r in (ra, rb):
                r.close()
            home.shutdown()
            host.shutdown()

    _run(main)


def test_the_node_lost_on_the_serving_replica_ends_the_session_at_its_home(store: Store) -> None:
    async def main() -> None:
        stream = FakeStream("gpu-1")
        b_streams: dict[str, Any] = {"gpu-1": stream}
        ra = ReplicaCommands(store, None, "a", {}, timing=FAST)
        rb = ReplicaCommands(store, None, "b", b_streams, timing=FAST)
        home, host = _book(store, {}, ra), _book(store, b_streams, rb)
        _take(store, "gpu-1", "b")
        for r in (ra, rb):
            r.start()
        for book in (home, host):
            book.start_ticking()
        tracer = FakeTracer(host, stream)
        try:
            s = await home.start(TraceScope(node="gpu-1", pid=4242), 60_000, 0, "user:alice")
            stream.active = False
            del b_streams["gpu-1"]
            host.stream_ended(stream)  # type: ignore[arg-type]
            await until(lambda: home.get(s.id).status == TraceStatus.NODE_LOST,
                        "the home ending it as node lost")
            assert "node gpu-1's tracer disconnected" in home.get(s.id).status_detail
            # a trace_start that reaches b after the node left: the tracer is not there
            _take(store, "gpu-1", "b", token=2)
            with pytest.raises(TraceError) as e:
                await home.start(TraceScope(node="gpu-1", pid=4242), 60_000, 0, "user:alice")
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
            assert "no longer connected to replica b" in e.value.line
        finally:
            tracer.task.cancel()
            for r in (ra, rb):
                r.close()
            home.shutdown()
            host.shutdown()

    _run(main)
