"""Who is on the other end of a plaintext connection (collector/peers.py): /proc/net/tcp rows parsed,
gRPC peer strings, the loopback lookup against a planted table and against this process's own real
socket, and the unix gate's SO_PEERCRED mapping over a real socket."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from ghostgpu.collector.peers import UnixGate, is_loopback, loopback_uid, parse_peer

from ghostgpu.common.transport.sockdiag import parse_proc_net_tcp
from tests.helpers.who_server import WHO, who_server

HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
# 127.0.0.1:41234 -> 127.0.0.1:7450 established, uid 1000; the listener 127.0.0.1:7450, uid 0.
TCP = HEADER + (
    "   0: 0100007F:1D1A 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0\n"
    "   1: 0100007F:A0F2 0100007F:1D1A 01 00000000:00000000 00:00000000 00000000  1000        0 2 1 0\n"
    "   2: 0100007F:A0F3 0100007F:1D1A 06 00000000:00000000 00:00000000 00000000  1001        0 3 1 0\n"
    "   3: garbage\n"
)
# [::1]:41235 -> [::1]:7450 uid 33, and a v4-mapped ::ffff:127.0.0.1:41236 uid 44.
TCP6 = HEADER + (
    "   0: 00000000000000000000000001000000:A0F4 00000000000000000000000001000000:1D1A 01 "
    "00000000:00000000 00:00000000 00000000    33        0 4 1 0\n"
    "   1: 0000000000000000FFFF00000100007F:A0F5 0000000000000000FFFF00000100007F:1D1A 01 "
    "00000000:00000000 00:00000000 00000000    44        0 5 1 0\n"
)


def test_parse_proc_net_tcp_rows() -> None:
    rows = parse_proc_net_tcp(TCP)
    assert rows == [("127.0.0.1", 7450, "0.0.0.0", 0, 0x0A, 0),
                    ("127.0.0.1", 41202, "127.0.0.1", 7450, 1, 1000),
                    ("127.0.0.1", 41203, "127.0.0.1", 7450, 6, 1001)]
    assert parse_proc_net_tcp(TCP6) == [("::1", 41204, "::1", 7450, 1, 33),
                                        ("127.0.0.1", 41205, "127.0.0.1", 7450, 1, 44)]


@pytest.mark.parametrize(("peer", "expected"), [
    ("ipv4:127.0.0.1:5432", ("127.0.0.1", 5432)),
    ("ipv6:[::1]:5432", ("::1", 5432)),
    ("unix:", None), ("unix-abstract:ghostgpu-peer-x-1", None), ("ipv4:127.0.0.1:x", None), ("", None),
])
def test_parse_peer(peer: str, expected: tuple[str, int] | None) -> None:
    assert parse_peer(peer) == expected


@pytest.mark.parametrize(("host", "loop"), [("127.0.0.1", True), ("127.3.4.5", True), ("::1", True),
                                            ("10.0.0.1", False), ("::", False)])
def test_is_loopback(host: str, loop: bool) -> None:
    assert is_loopback(host) is loop


@pytest.mark.parametrize(("peer", "ports", "uid"), [
    ("ipv4:127.0.0.1:41202", {7450}, 1000),
    ("ipv4:127.0.0.1:41203", {7450}, None),  # TIME_WAIT: not a live peer
    ("ipv4:127.0.0.1:41202", {9999}, None),  # connected to someone else
    ("ipv6:[::1]:41204", {7450}, 33),
    ("ipv4:127.0.0.1:41205", {7450}, 44),  # an IPv4 client of a dual-stack listener
    ("ipv4:10.0.0.5:41202", {7450}, None),  # not loopback: never looked up
    ("ipv4:127.0.0.1:1", {7450}, None),
])
def test_loopback_uid_from_a_planted_table(tmp_path: Path, peer: str, ports: set[int],
                                           uid: int | None) -> None:
    (tmp_path / "tcp").write_text(TCP)
    (tmp_path / "tcp6").write_text(TCP6)
    assert loopback_uid(peer, ports, proc_net=str(tmp_path)) == uid


@contextlib.contextmanager
def _connected() -> Iterator[tuple[str, int, int]]:
    """A real loopback TCP connection: (client host, client port, server port)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            conn, _ = server.accept()
            with conn:
                host, cport = client.getsockname()
                yield host, cport, port


def test_loopback_uid_of_a_real_connection_is_our_uid() -> None:
    with _connected() as (host, cport, port):
        assert loopback_uid(f"ipv4:{host}:{cport}", {port}) == os.getuid()


def test_the_unix_gate_names_each_connection_by_its_uid(tmp_path: Path) -> None:
    """A real gRPC server behind the gate; the handler asks the gate who its peer is."""
    seen: list[str] = []
    gate = UnixGate(str(tmp_path / "public.sock"))

    async def who(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        peer = context.peer()
        principal = gate.principal(peer)
        seen.append(peer)
        return (principal.subject if principal else "nobody").encode()

    with who_server(gate.internal_address, who):
        gate.start()
        try:
            assert oct(os.stat(tmp_path / "public.sock").st_mode & 0o777) == oct(0o666)
            with grpc.insecure_channel(f"unix://{tmp_path}/public.sock") as ch:
                assert ch.unary_unary(WHO)(b"", timeout=10) == f"uid:{os.getuid()}".encode()
            # The relay's own socket is a path in the gate's 0700 directory, never an abstract name
            # (which anyone could bind first).
            assert seen[0].startswith(f"unix:{os.path.dirname(gate.internal_address[len('unix://'):])}/peer-")
            assert os.stat(os.path.dirname(seen[0][len("unix:"):])).st_mode & 0o777 == 0o700
            assert not os.path.exists(seen[0][len("unix:"):])  # unlinked once connected
            # A peer name the gate never made is nobody.
            assert gate.principal(seen[0] + "0") is None
            assert gate.principal("unix-abstract:ghostgpu-peer-x-1") is None
        finally:
            gate.stop()
    assert not (tmp_path / "public.sock").exists()


def test_sock_diag_asks_for_the_exact_socket_and_reads_its_uid() -> None:
    import struct

    from ghostgpu.common.transport.sockdiag import DiagUnavailable, build_request, parse_reply

    req = build_request("127.0.0.1", 41202, "127.0.0.1", 7450, seq=7)
    assert len(req) == 16 + 56 and struct.unpack_from("=IHHII", req) == (72, 20, 1, 7, 0)
    assert req[16:24] == bytes([socket.AF_INET, socket.IPPROTO_TCP, 0, 0]) + struct.pack("=I", 2)
    assert req[24:28] == struct.pack(">HH", 41202, 7450) and req[28:32] == bytes([127, 0, 0, 1])
    assert build_request("::1", 1, "::1", 2)[16] == socket.AF_INET6
    answer = struct.pack("=IHHII", 16 + 72, 20, 0, 7, 0) + bytes(64) + struct.pack("=II", 1000, 99)
    assert parse_reply(answer) == 1000
    enoent = struct.pack("=IHHII", 36, 2, 0, 7, 0) + struct.pack("=i", -2) + bytes(16)
    assert parse_reply(enoent) is None
    with pytest.raises(DiagUnavailable):
        parse_reply(struct.pack("=IHHII", 36, 2, 0, 7, 0) + struct.pack("=i", -1) + bytes(16))


def test_sock_diag_names_the_owner_of_a_real_socket() -> None:
    from ghostgpu.common.transport.sockdiag import socket_uid

    with _connected() as (host, cport, port):
        assert socket_uid(host, cport, "127.0.0.1", port) == os.getuid()
        assert socket_uid(host, cport, "127.0.0.1", port + 1 if port < 65535 else 1) is None
