"""ghostgpu/common/transport/dial.py: which plaintext targets reach this host, so that the uid serving them is
checked (a port squatted by another local user is never trusted): loopback in every spelling, the
wildcards, v4-mapped loopback and this host's own interface addresses; another host is not asked."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

import pytest

from ghostgpu.common.transport.dial import loopback_of, serving_uid


@pytest.mark.parametrize(("ip", "expected"), [
    ("127.0.0.1", "127.0.0.1"),
    ("127.3.2.1", "127.3.2.1"),
    ("::1", "::1"),
    ("0:0:0:0:0:0:0:1", "::1"),
    ("0.0.0.0", "127.0.0.1"),  # a connect() to the wildcard reaches this host
    ("::", "::1"),
    ("::ffff:127.0.0.1", "127.0.0.1"),
    ("::ffff:0.0.0.0", "127.0.0.1"),
    ("::ffff:10.0.0.1", None),
    ("10.0.0.1", None),
    ("192.0.2.7", None),
    ("2001:db8::1", None),
    ("collector.example", None),
])
def test_loopback_in_every_spelling(ip: str, expected: str | None) -> None:
    assert loopback_of(ip) == expected


@pytest.fixture
def wildcard_listener() -> Iterator[int]:
    with socket.create_server(("0.0.0.0", 0)) as s:
        yield s.getsockname()[1]


def own_interface_address() -> str | None:
    """A non-loopback address of this host (the source of a route out), None without one."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent, a route is only looked up
        except OSError:
            return None
        ip = str(s.getsockname()[0])
    return None if loopback_of(ip) is not None else ip


@pytest.mark.parametrize("host", ["0.0.0.0", "127.0.0.1", "[::ffff:127.0.0.1]", "localhost"])
def test_a_listener_on_the_wildcard_is_asked_about_for_every_spelling(wildcard_listener: int,
                                                                      host: str) -> None:
    assert serving_uid(f"{host}:{wildcard_listener}") == os.geteuid()


def test_this_hosts_own_address_is_asked_another_hosts_is_not(wildcard_listener: int) -> None:
    own = own_interface_address()
    if own is not None:  # a host with an interface besides loopback
        assert serving_uid(f"{own}:{wildcard_listener}") == os.geteuid()
    # Another host's address on the same port: the local wildcard listener is not what it reaches.
    assert serving_uid(f"198.51.100.7:{wildcard_listener}") is None


def test_nobody_listening_is_left_to_grpc() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    assert serving_uid(f"0.0.0.0:{port}") is None
