"""Client sockets in tests that flood or fill a server: whether the server closed its end."""

from __future__ import annotations

import socket


def peer_closed(s: socket.socket, timeout_s: float) -> bool:
    """Whether the server closed its end (EOF or reset), without waiting; `s` gets `timeout_s` back."""
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True
    finally:
        s.settimeout(timeout_s)
