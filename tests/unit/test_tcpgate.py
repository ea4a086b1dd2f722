"""The collector's TCP gate (collector/tcpgate.py) against a stand-in for gRPC: a listener in this
process whose accepted sockets the test holds, as gRPC holds its own. The gate finds them among this
process's descriptors, and shuts down what is past its caps: the clients read EOF."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator

import pytest
from ghostgpu.collector.revoke import OpenStreams
from ghostgpu.collector.tcpgate import (
    UNPROVEN_S,
    TcpGate,
    connection_quota,
    default_max_connections,
    peer_address,
)

from ghostgpu.common.transport.principal import Principal
from tests.helpers.polling import wait_until
from tests.helpers.sockets import peer_closed

DEADLINE_S = 10.0


class _Server:
    """gRPC's side: a listener whose accepted sockets stay open until the test ends."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []

    def connect(self, clients: list[socket.socket], source: str = "127.0.0.1") -> socket.socket:
        client = socket.socket()
        client.bind((source, 0))
        client.settimeout(DEADLINE_S)
        client.connect(("127.0.0.1", self.port))
        clients.append(client)
        self.held.append(self.sock.accept()[0])
        return client

    def close(self) -> None:
        for s in [*self.held, self.sock]:
            s.close()


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server()
    try:
        yield srv
    finally:
        srv.close()


def _peer(client: socket.socket) -> str:
    host, port = client.getsockname()[:2]
    return f"ipv4:{host}:{port}"


def test_unproven_connections_past_the_per_source_cap_close_oldest_first(
        server: _Server, open_sockets: list[socket.socket]) -> None:
    gate = TcpGate(server.port, max_connections=1000, max_connections_per_source=3)
    try:
        for _ in range(10):  # one source: each newcomer pushes out that source's oldest unproven one
            server.connect(open_sockets)
            gate.check()
        other = server.connect(open_sockets, source="127.0.1.7")  # another address has its own three
        gate.check()
        assert [peer_closed(s, DEADLINE_S) for s in open_sockets[:10]] == [True] * 7 + [False] * 3
        assert not peer_closed(other, DEADLINE_S)
        assert gate.closed_for_room == 7 and gate.connections == 4
    finally:
        gate.stop()


def test_proven_connections_are_closed_for_room_unless_they_hold_an_open_stream(
        server: _Server, open_sockets: list[socket.socket]) -> None:
    streaming: set[str] = set()
    gate = TcpGate(server.port, max_connections=3, max_connections_per_source=3,
                   holds_stream=streaming.__contains__)
    try:
        tracer, viewer, denied = (server.connect(open_sockets) for _ in range(3))
        for client in (tracer, viewer, denied):  # an RPC over each: all proven
            gate.prove(_peer(client))
        gate.check()
        streaming.add(_peer(tracer))  # only the tracer's RPC is a stream the policy let in
        newcomer = server.connect(open_sockets)
        gate.check()
        # Full: the oldest proven connection that holds no stream goes, the viewer's, not the tracer's.
        wait_until(lambda: peer_closed(viewer, DEADLINE_S), "the viewer's connection closed", DEADLINE_S)
        assert not any(peer_closed(s, DEADLINE_S) for s in (tracer, denied, newcomer))
        assert gate.refused == 0

        for client in (denied, newcomer):
            gate.prove(_peer(client))
            streaming.add(_peer(client))
        gate.check()
        late = server.connect(open_sockets)
        gate.check()
        wait_until(lambda: peer_closed(late, DEADLINE_S), "refused: every one holds a stream", DEADLINE_S)
        assert gate.refused == 1
        assert not any(peer_closed(s, DEADLINE_S) for s in (tracer, denied, newcomer))
    finally:
        gate.stop()


def test_a_connection_past_the_handshake_deadline_counts_as_proven(
        server: _Server, open_sockets: list[socket.socket]) -> None:
    """One that got through gRPC's handshake deadline without an RPC is not unproven any more: the
    per-source cap leaves it, and the listener's cap takes it only as one without a stream."""
    gate = TcpGate(server.port, max_connections=1000, max_connections_per_source=1)
    try:
        old = server.connect(open_sockets)
        gate.check(now_s=0.0)
        young = server.connect(open_sockets)
        gate.check(now_s=UNPROVEN_S + 1.0)
        assert not peer_closed(old, DEADLINE_S) and not peer_closed(young, DEADLINE_S)
        assert gate.closed_for_room == 0
    finally:
        gate.stop()


def test_a_proof_does_not_outlive_its_connection(server: _Server, open_sockets: list[socket.socket]) -> None:
    gate = TcpGate(server.port, max_connections=1000, max_connections_per_source=1)
    try:
        first = server.connect(open_sockets)
        gate.prove(_peer(first))
        gate.check()
        server.held.pop().close()  # gRPC closed it
        gate.check(now_s=10_000.0)
        assert gate.connections == 0 and not gate._proven
    finally:
        gate.stop()


def test_a_descriptor_that_holds_another_socket_now_is_never_touched(
        server: _Server, open_sockets: list[socket.socket]) -> None:
    gate = TcpGate(server.port, max_connections=1000, max_connections_per_source=32)
    try:
        server.connect(open_sockets)
        fd = server.held[0].fileno()
        wrong_inode = os.fstat(fd).st_ino + 1
        assert gate._connection_of(fd, wrong_inode) == ("", 0)
        assert gate._connection_of(fd, os.fstat(fd).st_ino) == ("127.0.0.1", open_sockets[0].getsockname()[1])
        assert gate._connection_of(server.sock.fileno(), os.fstat(server.sock.fileno()).st_ino) is None
    finally:
        gate.stop()


@pytest.mark.parametrize("peer, address", [
    ("ipv4:10.0.0.5:41234", ("10.0.0.5", 41234)),
    ("ipv6:%5B::1%5D:41234", ("::1", 41234)),
    ("ipv6:[fe80::1]:7", ("fe80::1", 7)),
    ("ipv6:%5B::ffff:10.0.0.5%5D:41234", ("10.0.0.5", 41234)),
    ("unix:/run/ghostgpu/collector.sock", None),
    ("unix:", None),
    ("ipv4:10.0.0.5:port", None),
    ("", None),
])
def test_peer_address(peer: str, address: tuple[str, int] | None) -> None:
    assert peer_address(peer) == address


@pytest.mark.parametrize("fd_limit, cap, quota_one", [
    (1024, 720, 768),  # 768 descriptors past the reserve: 48 of slack above the cap
    (1 << 20, 10_000, 10_000 + (1 << 20) // 16 - 16),
    (300, 28, 44),  # a small limit: 44 past the reserve, 16 of them slack
])
def test_the_caps_fit_in_the_fd_limit(fd_limit: int, cap: int, quota_one: int) -> None:
    assert default_max_connections(fd_limit) == cap
    assert connection_quota(cap, fd_limit) == quota_one
    assert connection_quota(cap, fd_limit) <= max(32, fd_limit - 256)


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
