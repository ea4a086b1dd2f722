"""The collector's TCP gate (collector/tcpgate.py) against a stand-in for gRPC's unix socket: its tables
after links are closed for room before or while they connect, the sockets of those links, and
proven links closed for room unless they hold an open stream."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from ghostgpu.collector.revoke import OpenStreams
from ghostgpu.collector.tcpgate import TcpGate

from ghostgpu.common.principal import Principal

T = TypeVar("T")
DEADLINE_S = 10.0


class _Backend:
    """gRPC's side of the relay: accepts on the gate's internal socket and holds what it accepts."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(1024)
        self.held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(5.0)
        for s in self.held:
            s.close()


@pytest.fixture
def clients() -> Iterator[list[socket.socket]]:
    socks: list[socket.socket] = []
    try:
        yield socks
    finally:
        for s in socks:
            s.close()


def _gate(**kwargs: Any) -> tuple[TcpGate, _Backend]:
    gate = TcpGate("127.0.0.1", 0, **kwargs)
    backend = _Backend(gate.internal_path)
    gate.start()
    return gate, backend


def _on_loop(gate: TcpGate, fn: Callable[[], T]) -> T:
    """`fn()` on the gate's loop thread: its tables are that thread's."""
    assert gate._loop is not None

    async def call() -> T:
        return fn()

    return asyncio.run_coroutine_threadsafe(call(), gate._loop).result(DEADLINE_S)


def _tables(gate: TcpGate) -> dict[str, int]:
    def read() -> dict[str, int]:
        return {"links": len(gate._links), "unproven": len(gate._unproven),
                "by_source": sum(len(v) for v in gate._unproven_by_source.values()),
                "by_name": len(gate._by_name),
                "named_live": sum(1 for lk in gate._by_name.values() if lk in gate._links)}
    return _on_loop(gate, read)


def _poll(what: str, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {DEADLINE_S} s: {what}")
        time.sleep(0.01)


def _connect(gate: TcpGate, clients: list[socket.socket]) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", gate.port), timeout=DEADLINE_S)
    clients.append(s)
    return s


def _closed(s: socket.socket) -> bool:
    """Whether the gate closed its end (EOF or reset), without waiting."""
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True
    finally:
        s.settimeout(DEADLINE_S)


def _peer(s: socket.socket) -> str:
    return f"ipv4:127.0.0.1:{s.getsockname()[1]}"


def _blocked(gate: TcpGate) -> threading.Event:
    """The gate's loop held until the event is set: connections pile up in the listen backlog."""
    assert gate._loop is not None
    go, holding = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        go.wait(DEADLINE_S)

    gate._loop.call_soon_threadsafe(hold)
    assert holding.wait(DEADLINE_S)
    return go


def test_links_closed_for_room_before_or_while_connecting_leave_no_entry_and_no_socket(
        clients: list[socket.socket]) -> None:
    per_source = 3
    gate, backend = _gate(max_connections=1000, max_connections_per_source=per_source)
    try:
        go = _blocked(gate)
        for _ in range(60):  # one source, a backlog of 20 times its cap
            _connect(gate, clients)
        go.set()
        _poll("the per-source cap's survivors relayed", lambda: _tables(gate) == {
            "links": per_source, "unproven": per_source, "by_source": per_source,
            "by_name": per_source, "named_live": per_source})
        # and once more without a backlog: each new one closes the oldest while it may be connecting
        for _ in range(60):
            _connect(gate, clients)
        _poll("the tables back to the live count", lambda: _tables(gate) == {
            "links": per_source, "unproven": per_source, "by_source": per_source,
            "by_name": per_source, "named_live": per_source})
        _poll("every link closed for room closed its client's socket",
              lambda: all(_closed(s) for s in clients[:-per_source]))
        assert not any(_closed(s) for s in clients[-per_source:])
        assert gate.closed_for_room == len(clients) - per_source
        assert gate.connections == per_source
    finally:
        gate.stop()
        backend.close()


def test_proven_links_are_closed_for_room_unless_they_hold_an_open_stream(
        clients: list[socket.socket]) -> None:
    streaming: set[str] = set()
    gate, backend = _gate(max_connections=3, max_connections_per_source=3,
                          holds_stream=streaming.__contains__)
    try:
        tracer, viewer, denied = (_connect(gate, clients) for _ in range(3))
        _poll("three links relayed", lambda: _tables(gate)["by_name"] == 3)
        names = _on_loop(gate, lambda: list(gate._by_name))
        assert sorted(gate.peer(f"unix:{n}") or "" for n in names) == sorted(
            _peer(s) for s in (tracer, viewer, denied))  # an RPC over each: all proven
        streaming.add(_peer(tracer))  # only the tracer's RPC is a stream the policy let in
        newcomer = _connect(gate, clients)
        # The full gate closed the oldest proven link that holds no stream, the viewer's, not the tracer's.
        _poll("the viewer's link closed", lambda: _closed(viewer))
        assert not _closed(tracer) and not _closed(denied) and not _closed(newcomer)
        assert gate.refused == 0

        for s in (denied, newcomer):
            streaming.add(_peer(s))
        _on_loop(gate, lambda: [setattr(lk, "proven", True) for lk in gate._links])
        late = _connect(gate, clients)
        _poll("refused: every link holds a stream", lambda: _closed(late))
        assert gate.refused == 1
        assert not any(_closed(s) for s in (tracer, denied, newcomer))
    finally:
        gate.stop()
        backend.close()


def test_open_streams_tell_the_gate_which_client_addresses_hold_one() -> None:
    async def run() -> None:
        streams = OpenStreams()
        peer = "ipv4:10.0.0.5:41234"
        who = Principal("node", "a", via="mtls", peer=peer)
        first, second = streams._add(who, "/m", None), streams._add(who, "/m", None)
        assert streams.holds(peer) and not streams.holds("ipv4:10.0.0.5:41235")
        streams._remove(first)
        assert streams.holds(peer)
        streams._remove(second)
        assert not streams.holds(peer)

    asyncio.run(run())
