"""The HTTP ports' accept loop (ghostgpu/common/web/httpserve.py) with a backlog: connections closed for
room before their task ever ran still have their sockets closed, and the survivors are the newest."""

from __future__ import annotations

import socket
import threading

from ghostgpu.common.web.httpserve import HttpServer
from tests.helpers.polling import wait_until
from tests.helpers.sockets import peer_closed

DEADLINE_S = 10.0


def test_a_backlog_past_the_per_source_cap_closes_every_evicted_socket(
        open_sockets: list[socket.socket]) -> None:
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
            open_sockets.append(socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE_S))
        go.set()
        wait_until(lambda: all(peer_closed(s, DEADLINE_S) for s in open_sockets[:-per_source]),
                   "every connection closed for room is closed", DEADLINE_S)
        assert not any(peer_closed(s, DEADLINE_S) for s in open_sockets[-per_source:])
        assert server.connections == per_source
        assert server.closed_for_room == len(open_sockets) - per_source
    finally:
        server.stop()
