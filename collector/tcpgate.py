"""The collector's mTLS TCP port, with connection caps in front of gRPC (issue 17, item 8).

grpcio's server has `maximum_concurrent_rpcs` but no cap on connections, and it accepts until the
process runs out of file descriptors: with RLIMIT_NOFILE 1024, about 1,050 idle connections that
never finished a TLS handshake locked admins and tracers out. So the collector accepts on the
public port itself (`TcpGate`), as it does for its unix socket (collector/peers.py `UnixGate`), and
relays each connection it admits, bytes unchanged (TLS is still between the client and gRPC), to
the gRPC server's private unix socket in a 0700 directory only the collector can enter.

- **Before authentication**, a connection is *unproven*: it is younger than the gRPC handshake
  deadline (HANDSHAKE_TIMEOUT_S; gRPC closes a connection whose TLS handshake and HTTP/2 settings do
  not complete by then, `grpc.server_handshake_timeout_ms` in collector/server.py) and no RPC has
  come over it yet (`peer()`, which the authorizer asks, proves it). At most
  `max_connections_per_source` unproven connections per source address: past it the oldest
  unproven one of that address is closed for the new one.
- **Per listener**: at most `max_connections` connections. Past it, the oldest unproven connection
  (of any address) is closed for the new one; when every connection is proven, the oldest one that
  holds no open response stream (`holds_stream`, asked of collector/revoke.py `OpenStreams`) is:
  any certificate of the CA proves a connection, even one the policy then denies every call, so
  proven alone must not keep a slot for good. Only when every connection holds a stream (tracers,
  watchers the policy let in) is the new one refused.

So idle unauthenticated connections push out each other, never a tracer's or an admin's: a client
that connects and completes its handshake (milliseconds) is in before a flood can close it. Each
relayed connection costs three descriptors (the client's socket, the relay's and gRPC's end of
it); the commands raise their soft fd limit to the hard one at start (ghostgpu/common/system/fdlimit.py),
and the default cap fits in what that leaves.

gRPC names the relay's own socket (`unix:DIR/tcp-N`, bound in the private directory, unlinked once
connected, N never repeated) as the peer; `peer()` maps it back to the client's address
(`ipv4:10.0.0.5:41234`), which the audit log records.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable

from ghostgpu.common.system.loopthread import serve_until_stopped

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0  # gRPC's deadline for TLS and HTTP/2 settings (grpc.server_handshake_timeout_ms)
UNPROVEN_S = HANDSHAKE_TIMEOUT_S + 1.0  # past this a live connection has been through the handshake
DEFAULT_MAX_CONNECTIONS = 10_000
DEFAULT_MAX_CONNECTIONS_PER_SOURCE = 32
FDS_PER_CONNECTION = 3
FDS_RESERVED = 256  # the store, the audit log, the CRI sockets, the metrics port, gRPC's own
TCP_NAME = "tcp-"
CAP_LOG_INTERVAL_S = 60.0


def default_max_connections(fd_limit: int | None = None) -> int:
    """DEFAULT_MAX_CONNECTIONS, or fewer where the fd limit would not hold that many relays."""
    if fd_limit is None:
        import resource

        fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    fits = max(16, (fd_limit - FDS_RESERVED) // FDS_PER_CONNECTION)
    return min(DEFAULT_MAX_CONNECTIONS, fits)


class _Link:
    """One relayed connection (loop thread only)."""

    __slots__ = ("inner", "name", "outer", "peer", "proven", "sock", "source", "started")

    def __init__(self, source: str, peer: str, started: float, sock: socket.socket) -> None:
        self.source, self.peer, self.started = source, peer, started
        self.sock: socket.socket | None = sock  # the accepted socket until its transport owns it
        self.proven = False
        self.name = ""
        self.outer: asyncio.Transport | None = None
        self.inner: asyncio.Transport | None = None

    def close(self) -> None:
        for t in (self.outer, self.inner):
            if t is not None:
                t.abort()
        if self.outer is None and self.sock is not None:
            self.sock.close()  # closed before its relay ran (or while it connected): nothing else would


class _Half(asyncio.Protocol):
    """One direction's end: what it receives goes out the other side, with its back-pressure."""

    def __init__(self, gate: TcpGate, link: _Link) -> None:
        self.gate, self.link = gate, link
        self.transport: asyncio.Transport | None = None
        self.other: _Half | None = None
        self.out: asyncio.Transport | None = None  # the other side's transport, once both are up
        self._early: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        out = self.out  # the hot path: one attribute, no lookups through the other half
        if out is None:
            self._early.append(data)
            return
        out.write(data)

    def flush_early(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.out = self.other.transport
            if self._early:
                self.out.write(b"".join(self._early))
        self._early.clear()

    def eof_received(self) -> bool:
        other = self.other
        if other is not None and other.transport is not None and other.transport.can_write_eof():
            other.transport.write_eof()
            return True  # half-closed: the other direction may still carry the last bytes
        return False

    def pause_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.close()
        self.gate._forget(self.link)


class TcpGate:
    """The public TCP port of one mTLS listener; gRPC serves `internal_address` behind it."""

    def __init__(self, host: str, port: int, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 max_connections_per_source: int = DEFAULT_MAX_CONNECTIONS_PER_SOURCE,
                 unproven_s: float = UNPROVEN_S, holds_stream: Callable[[str], bool] | None = None) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # Bound now: a taken port is the caller's one-line error before anything starts.
        self._sock = socket.create_server((host, port), family=family, backlog=4096,
                                          dualstack_ipv6=host == "::" and socket.has_dualstack_ipv6())
        self._sock.setblocking(False)
        self.host, self.port = host, self._sock.getsockname()[1]
        self.max_connections = max_connections
        self.max_per_source = min(max_connections_per_source, max_connections)
        self.unproven_s = unproven_s
        # Whether a client address (`ipv4:HOST:PORT`) has a response stream open; asked from this
        # loop's thread, so it must be a lock-free read (OpenStreams.holds). None: none ever does.
        self.holds_stream = holds_stream or (lambda _peer: False)
        self._dir = tempfile.mkdtemp(prefix="ghostgpu-grpc-tls-")
        os.chmod(self._dir, 0o700)
        self.internal_path = f"{self._dir}/grpc.sock"
        self.internal_address = f"unix://{self.internal_path}"
        self._next = 0
        self._links: dict[_Link, None] = {}  # oldest first
        self._unproven: dict[_Link, None] = {}  # oldest first; pruned as they age
        self._unproven_by_source: dict[str, dict[_Link, None]] = {}
        self._by_name: dict[str, _Link] = {}
        self._names_lock = threading.Lock()  # peer() is asked from gRPC's loop
        self.closed_for_room = 0
        self.refused = 0
        self._cap_logged_s = -CAP_LOG_INTERVAL_S
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- what the authorizer asks --------------------------------------------------------------

    def peer(self, grpc_peer: str) -> str | None:
        """The client's address (`ipv4:HOST:PORT`) of a connection relayed here, from gRPC's
        `unix:DIR/tcp-N`; None for any other peer. Marks it proven: an RPC came over it, so its TLS
        handshake with a certificate of the CA is done."""
        _, _, name = grpc_peer.partition(":")
        with self._names_lock:
            link = self._by_name.get(name)
        if link is None:
            return None
        if not link.proven:
            link.proven = True  # a plain store; the loop reads it when it prunes
        return link.peer

    @property
    def connections(self) -> int:
        return len(self._links)

    # ---- life cycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Serve in its own thread: relaying must not wait behind the collector's busy loop."""
        loop = self._loop = asyncio.new_event_loop()
        loop.set_exception_handler(lambda _l, ctx: log.debug("tcp gate: %s", ctx.get("message")))

        def abort_links() -> None:
            for link in list(self._links):
                link.close()

        def run() -> None:
            serve_until_stopped(loop, self._accept, self._sock, before_cancel=abort_links)

        self._thread = threading.Thread(target=run, name="ghostgpu-tcp-gate", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        else:
            self._sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- the loop thread ------------------------------------------------------------------------

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(self._sock)
            except OSError as e:  # EMFILE: the caps are above what the fd limit holds
                self._cap_line("", f"accept failed: {e.strerror or e}")
                await asyncio.sleep(0.05)
                continue
            host, port = str(addr[0]), int(addr[1])
            kind = "ipv6" if sock.family == socket.AF_INET6 else "ipv4"
            peer = f"ipv6:[{host}]:{port}" if kind == "ipv6" else f"ipv4:{host}:{port}"
            link = _Link(host, peer, loop.time(), sock)
            if not self._admit(link, loop.time()):
                sock.close()
                continue
            task = loop.create_task(self._relay(link, sock))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            # A ready socket's sock_accept returns without suspending: yield, or a backlog is drained
            # (and its links evicted by each other) before any relay runs.
            await asyncio.sleep(0)

    async def _relay(self, link: _Link, sock: socket.socket) -> None:
        if link not in self._links:  # closed for room before it started: never bind or connect
            sock.close()
            return
        loop = asyncio.get_running_loop()
        self._next += 1
        name = f"{self._dir}/{TCP_NAME}{self._next}"
        inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            inner.bind(name)
            inner.setblocking(False)
            await loop.sock_connect(inner, self.internal_path)
        except (OSError, asyncio.CancelledError) as e:
            if not isinstance(e, asyncio.CancelledError):
                log.warning("tcp gate %s:%d: cannot reach the gRPC server (%s); dropped a connection",
                            self.host, self.port, e)
            inner.close()
            sock.close()
            self._forget(link)
            return
        finally:
            with contextlib.suppress(OSError):
                os.unlink(name)  # the connected socket keeps its name; nobody can bind it again
        if link not in self._links:  # closed for room while it connected
            inner.close()
            sock.close()
            return
        link.name = name
        with self._names_lock:
            self._by_name[name] = link
        up, down = _Half(self, link), _Half(self, link)
        up.other, down.other = down, up
        try:
            link.inner, _ = await loop.create_unix_connection(lambda: down, sock=inner)  # type: ignore[assignment]
            link.outer, _ = await loop.connect_accepted_socket(lambda: up, sock)  # type: ignore[assignment]
        except (OSError, asyncio.CancelledError):
            link.close()
            inner.close()
            sock.close()
            self._forget(link)
            return
        if link not in self._links:
            link.close()
            return
        up.flush_early()
        down.flush_early()

    def _admit(self, link: _Link, now: float) -> bool:
        self._prune(now)
        same = self._unproven_by_source.get(link.source, {})
        if len(same) >= self.max_per_source:
            self._close_for_room(next(iter(same)), link.source)
        if len(self._links) >= self.max_connections:
            victim = next(iter(self._unproven), None)
            if victim is None:
                victim = next((lk for lk in self._links if not self.holds_stream(lk.peer)), None)
            if victim is None:
                self.refused += 1
                self._cap_line(link.source, "refused a new connection: every one holds an open stream")
                return False
            self._close_for_room(victim, link.source)
        self._links[link] = None
        self._unproven[link] = None
        self._unproven_by_source.setdefault(link.source, {})[link] = None
        return True

    def _close_for_room(self, victim: _Link, source: str) -> None:
        self._forget(victim)
        victim.close()
        self.closed_for_room += 1
        self._cap_line(source, "closed an idle connection for a new one")

    def _prune(self, now: float) -> None:
        """Drop from the unproven tables what is proven or has aged past the handshake deadline."""
        for link in list(self._unproven):
            if link.proven or now - link.started >= self.unproven_s:
                self._unprove(link)
            else:
                break  # oldest first: the rest are younger
        # Proven ones in the middle (an RPC came early) leave too; a few per admission is enough.
        for link in [lk for lk in itertools.islice(self._unproven, 64) if lk.proven]:
            self._unprove(link)

    def _unprove(self, link: _Link) -> None:
        self._unproven.pop(link, None)
        same = self._unproven_by_source.get(link.source)
        if same is not None:
            same.pop(link, None)
            if not same:
                del self._unproven_by_source[link.source]

    def _forget(self, link: _Link) -> None:
        if self._links.pop(link, 0) is None:
            self._unprove(link)
        if link.name:  # whether or not it was still listed: a relay may name it after it was closed
            with self._names_lock:
                self._by_name.pop(link.name, None)

    def _cap_line(self, source: str, what: str) -> None:
        now = time.monotonic()
        if now - self._cap_logged_s >= CAP_LOG_INTERVAL_S:
            self._cap_logged_s = now
            log.warning("collector %s:%d: %s: %d connections open (--max-connections %d), %d "
                        "unauthenticated from %s (--max-connections-per-source %d); %d closed for room and "
                        "%d refused so far", self.host, self.port, what, len(self._links),
                        self.max_connections, len(self._unproven_by_source.get(source, ())), source or "?",
                        self.max_per_source,
                        self.closed_for_room, self.refused)
