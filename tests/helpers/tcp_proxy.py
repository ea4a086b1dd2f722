"""A TCP relay a test can cut without closing it: a network partition, as a replica sees one.

    with TcpRelay(("127.0.0.1", pg.port)) as relay:      # relay.port: connect here instead
        ...
        relay.partition()    # bytes stop flowing both ways; every socket stays open (no RST, no FIN)
        relay.heal()         # bytes flow again on the same connections, and new ones are served

A partition is not a refused connection: the peer's writes are accepted by the kernel and never
answered, so only timeouts (TCP keepalive, the application's own) notice it. While partitioned, new
connections are accepted and held silent too, as a black-holing network would leave a SYN unanswered
only at the IP level; a held connection is what libpq's connect_timeout meets.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading


class TcpRelay:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._flowing = threading.Event()
        self._flowing.set()
        self._stop = threading.Event()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._accept, daemon=True, name="tcp-relay-accept")]
        for t in self._threads:
            t.start()

    def partition(self) -> None:
        self._flowing.clear()

    def heal(self) -> None:
        self._flowing.set()

    def _accept(self) -> None:
        self._listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, server))
            t = threading.Thread(target=self._pump, args=(client, server), daemon=True, name="tcp-relay-pump")
            t.start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        sel.register(a, selectors.EVENT_READ, b)
        sel.register(b, selectors.EVENT_READ, a)
        try:
            while not self._stop.is_set():
                if not self._flowing.wait(0.2):
                    continue  # partitioned: read nothing, so nothing is forwarded either way
                for key, _ in sel.select(0.2):
                    src: socket.socket = key.fileobj  # type: ignore[assignment]
                    dst: socket.socket = key.data
                    if not self._flowing.is_set():
                        break
                    data = src.recv(65536)
                    if not data:
                        return
                    dst.sendall(data)
        except OSError:
            return
        finally:
            sel.close()
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.close()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for a, b in self._pairs:
                for s in (a, b):
                    with contextlib.suppress(OSError):
                        s.close()

    def __enter__(self) -> TcpRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
