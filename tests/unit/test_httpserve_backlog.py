"""The HTTP ports' accept loop (ghostgpu/common/httpserve.py) with a backlog: connections closed for
room before their task ever ran still have their sockets closed, and the survivors are the newest."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from ghostgpu.common.httpserve import HttpServer

DEADLINE_S = 10.0


@pytest.fixture
def clients() -> Iterator[list[socket.socket]]:
    socks: list[socket.socket] = []
    try:
        yield socks
    finally:
        for s in socks:
            s.close()


def _poll(what: str, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {DEADLINE_S} s: {what}")
        time.sleep(0.01)


def _closed(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True
    finally:
        s.settimeout(DEADLINE_S)


def test_a_backlog_past_the_per_source_cap_closes_every_evicted_socket(clients: list[socket.socket]) -> None:
    per_source = 3
    server = HttpServer("127.0.0.1:0", {}, max_connections_per_source=per_source).start()
    try:
        loop = server._loop
        assert loop is not None
        go, holding = threading.Event(), threading.Event()

        def hold() -> None:  # the loop held: the connections pile up in the listen backlog
            holding.set()
            go.wait(DEADLINE_S)

        loop.call_soon_threadsafe(hold)
        assert holding.wait(DEADLINE_S)
        for _ in range(40):
            clients.append(socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE_S))
        go.set()
        _poll("every connection closed for room is closed",
              lambda: all(_closed(s) for s in clients[:-per_source]))
        assert not any(_closed(s) for s in clients[-per_source:])
        assert server.connections == per_source
        assert server.closed_for_room == len(clients) - per_source
    finally:
        server.stop()
