"""The collector's TCP gate (collector/tcpgate.py) against a stand-in for gRPC's unix socket: its tables
after links are closed for room before or while they connect, the sockets of those links, and
proven links closed for room unless they hold an open stream."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ghostgpu.collector.revoke import OpenStreams
from ghostgpu.collector.tcpgate import TcpGate

from ghostgpu.common.transport.principal import Principal
from tests.helpers.polling import wait_until
from tests.helpers.sockets import peer_closed

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


def _connect(gate: TcpGate, open_sockets: list[socket.socket]) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", gate.port), timeout=DEADLINE_S)
    open_sockets.append(s)
    return s


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
        open_sockets: list[socket.socket]) -> None:
    per_source = 3
    gate, backend = _gate(max_connections=1000, max_connections_per_source=per_source)
    try:
        go = _blocked(gate)
        for _ in range(60):  # one source, a backlog of 20 times its cap
            _connect(gate, open_sockets)
        go.set()
        live = {"links": per_source, "unproven": per_source, "by_source": per_source,
                "by_name": per_source, "named_live": per_source}
        wait_until(lambda: _tables(gate) == live, "the per-source cap's survivors relayed", DEADLINE_S)
        # and once more without a backlog: each new one closes the oldest while it may be connecting
        for _ in range(60):
            _connect(gate, open_sockets)
        wait_until(lambda: _tables(gate) == live, "the tables back to the live count", DEADLINE_S)
        wait_until(lambda: all(peer_closed(s, DEADLINE_S) for s in open_sockets[:-per_source]),
                   "every link closed for room closed its client's socket", DEADLINE_S)
        assert not any(peer_closed(s, DEADLINE_S) for s in open_sockets[-per_source:])
        assert gate.closed_for_room == len(open_sockets) - per_source
        assert gate.connections == per_source
    finally:
        gate.stop()
        backend.close()


def test_proven_links_are_closed_for_room_unless_they_hold_an_open_stream(
        open_sockets: list[socket.socket]) -> None:
    streaming: set[str] = set()
    gate, backend = _gate(max_connections=3, max_connections_per_source=3,
                          holds_stream=streaming.__contains__)
    try:
        tracer, viewer, denied = (_connect(gate, open_sockets) for _ in range(3))
        wait_until(lambda: _tables(gate)["by_name"] == 3, "three links relayed", DEADLINE_S)
        names = _on_loop(gate, lambda: list(gate._by_name))
        assert sorted(gate.peer(f"unix:{n}") or "" for n in names) == sorted(
            _peer(s) for s in (tracer, viewer, denied))  # an RPC over each: all proven
        streaming.add(_peer(tracer))  # only the tracer's RPC is a stream the policy let in
        newcomer = _connect(gate, open_sockets)
        # The full gate closed the oldest proven link that holds no stream, the viewer's, not the tracer's.
        wait_until(lambda: peer_closed(viewer, DEADLINE_S), "the viewer's link closed", DEADLINE_S)
        assert not any(peer_closed(s, DEADLINE_S) for s in (tracer, denied, newcomer))
        assert gate.refused == 0

        for s in (denied, newcomer):
            streaming.add(_peer(s))
        _on_loop(gate, lambda: [setattr(lk, "proven", True) for lk in gate._links])
        late = _connect(gate, open_sockets)
        wait_until(lambda: peer_closed(late, DEADLINE_S), "refused: every link holds a stream", DEADLINE_S)
        assert gate.refused == 1
        assert not any(peer_closed(s, DEADLINE_S) for s in (tracer, denied, newcomer))
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
