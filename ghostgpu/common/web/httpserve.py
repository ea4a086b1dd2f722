"""A small HTTP server for Prometheus scrapes and kubelet probes (collector /metrics, tracer health).

    server = HttpServer("0.0.0.0:9400", {"/metrics": metrics_handler}, flag="--metrics-listen")
    server.start()            # binds at once; HttpListenError names the flag and the address
    server.address            # "127.0.0.1:9400" as a client dials it
    server.stop()

A handler takes the Request and returns a Response. A handler that raises answers 500 with one
line, logged once per distinct message; one that raises Unavailable (not ready yet, or shutting
down) answers 503 with its line and logs nothing. Bodies over 1 KiB are gzipped when the client
accepts it, as Prometheus does: a 1,000-node /metrics page shrinks about twentyfold.

Threads, and what an attacker can hold (docs/SECURITY.md, "Threats and what stops them"):
- One asyncio loop thread holds every connection: accepting, the TLS handshake, reading request
  heads, writing responses. An idle connection costs a socket, never a thread, so a slowloris with
  1,000 connections adds no thread.
- Handlers run on a pool of WORKERS threads (a scrape may wait on the collector's loop, bcrypt takes
  ~50 ms); each connection has at most one request in flight. `inline_paths` (the tracer's probes,
  which read a few attributes) are answered on the loop thread itself: they never queue behind a
  slow scrape or a password check.
- Deadlines: the request head (the TLS handshake included, on a new connection) must be complete
  within HEADER_TIMEOUT_S of the connection opening, or of its first byte on a kept-alive one; a
  kept-alive connection may wait IDLE_TIMEOUT_S for its next request; a response that the client
  does not read within WRITE_TIMEOUT_S closes the connection.
- Caps: at most `max_connections` connections on the listener and `max_connections_per_source`
  from one address. Over a cap the new connection is still taken, and the oldest *idle* one (no
  request in flight; one that never sent a complete request first) of that address, or of the
  listener, is closed; only when none is idle is the new one refused. So connections opened and left
  idle push out each other, never a client that is sending its request now: kubelet's probe, which
  connects and asks at once, is answered under a flood of idle connections, from the same address
  too.

With web_config (`--web-config-file`, the exporter-toolkit format: ghostgpu/common/web/webconfig.py) the
port speaks HTTPS and asks for basic auth as that file says, re-read when it or its certificate files
change (ghostgpu/common/web/webguard.py); `open_paths` (the probes) need no credentials and are outside
the rate limit. Plaintext on an address others can reach is refused at start (HttpListenError)
unless `insecure` (--insecure), as the collector's gRPC listener is.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gzip
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus
from typing import TypedDict
from urllib.parse import parse_qs, urlsplit

from ghostgpu.common.system.loopthread import serve_until_stopped
from ghostgpu.common.transport.addresses import dial_address, host_port, parse_listen
from ghostgpu.common.transport.tls import plaintext_allowed
from ghostgpu.common.web.webguard import WebGuard

log = logging.getLogger("ghostgpu.http")

TEXT = "text/plain; charset=utf-8"
# The text exposition format the collector writes by hand (see the Prometheus exposition docs).
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
GZIP_MIN_BYTES = 1024
HEADER_TIMEOUT_S = 10.0  # the TLS handshake and the request head, from the connection's start
IDLE_TIMEOUT_S = 60.0  # a kept-alive connection waits this long for its next request
WRITE_TIMEOUT_S = 30.0  # a client that stops reading mid-response is closed after this
SOCKET_TIMEOUT_S = WRITE_TIMEOUT_S  # the name this constant had with the thread-per-connection server
MAX_HEAD_BYTES = 64 * 1024  # request line and headers; past it 431 and close
MAX_BODY_BYTES = 64 * 1024  # a GET with a body: read and ignored up to this, else 413 and close
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_MAX_CONNECTIONS_PER_SOURCE = 32
WORKERS = 4
CAP_LOG_INTERVAL_S = 60.0  # the "connection cap reached" line, at most once per this
# Distinct handler failures logged with their trace, once each; past this many, a new one is answered
# (500) without a log line and not remembered: a failure whose text names a PID or a container would
# otherwise add one entry per process for as long as the server runs.
MAX_LOGGED_FAILURES = 100


class HttpListenError(ValueError):
    """The listen address is malformed or cannot be bound; one line naming the flag."""


class Unavailable(Exception):
    """Raised by a handler that cannot answer for now: 503 with this one line, no log (not a fault)."""


@dataclass(frozen=True)
class Request:
    path: str
    query: Mapping[str, list[str]]
    headers: Mapping[str, str]
    source: str = ""  # the client's address


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str = TEXT
    headers: Mapping[str, str] = field(default_factory=dict)


Handler = Callable[[Request], Response]


def probe_routes(liveness: Callable[[], tuple[bool, str]],
                 readiness: Callable[[], tuple[bool, list[str]]]) -> dict[str, Handler]:
    """/healthz and /readyz for Kubernetes' probes (the tracer's health port, the collector's metrics
    port): 200 or 503, the reason as plain text, one line each."""
    def healthz(_req: Request) -> Response:
        ok, line = liveness()
        return Response(200 if ok else 503, (line + "\n").encode())

    def readyz(_req: Request) -> Response:
        ok, lines = readiness()
        return Response(200 if ok else 503, "".join(f"{ln}\n" for ln in lines).encode())

    return {"/healthz": healthz, "/readyz": readyz}


class HttpCaps(TypedDict, total=False):
    """The connection caps a command passes on to HttpServer: those given (the rest keep its defaults)."""

    max_connections: int
    max_connections_per_source: int


def given_caps(max_connections: int | None, max_connections_per_source: int | None) -> HttpCaps:
    """The caps that are set (a flag not given is None)."""
    caps = HttpCaps()
    if max_connections is not None:
        caps["max_connections"] = max_connections
    if max_connections_per_source is not None:
        caps["max_connections_per_source"] = max_connections_per_source
    return caps


class _BadRequest(Exception):
    def __init__(self, status: int, line: str) -> None:
        super().__init__(line)
        self.status = status


class _Conn:
    """One accepted connection, as the caps see it (touched on the loop thread only)."""

    __slots__ = ("busy", "served", "sock", "source", "task")

    def __init__(self, source: str, task: asyncio.Task[None] | None) -> None:
        self.source, self.task = source, task
        self.sock: socket.socket | None = None  # until its task starts and owns it
        self.busy = False  # a request is being answered: never closed to make room
        self.served = 0


class HttpServer:
    def __init__(self, listen: str, routes: Mapping[str, Handler], flag: str = "--listen",
                 name: str = "http", web_config: str | None = None, open_paths: tuple[str, ...] = (), *,
                 insecure: bool = False, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 max_connections_per_source: int = DEFAULT_MAX_CONNECTIONS_PER_SOURCE,
                 header_timeout_s: float = HEADER_TIMEOUT_S, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 workers: int = WORKERS, inline_paths: tuple[str, ...] | None = None,
                 caps_flag: str = "--http-max-connections") -> None:
        self.host, self.port = parse_listen(listen, flag, HttpListenError)
        self.listen, self.flag, self.name = listen, flag, name
        self.routes = dict(routes)
        self.web_config, self.open_paths = web_config, open_paths
        self.inline_paths = frozenset(open_paths if inline_paths is None else inline_paths)
        self.insecure = insecure
        for value, what in ((max_connections, caps_flag),
                            (max_connections_per_source, f"{caps_flag}-per-source")):
            if value < 1:
                raise HttpListenError(f"{what} {value}: must be 1 or more")
        self.max_connections = max_connections
        self.max_per_source = min(max_connections_per_source, max_connections)
        self.header_timeout_s, self.idle_timeout_s = header_timeout_s, idle_timeout_s
        self.workers = workers
        self.guard: WebGuard | None = None
        self._logged: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._sock: socket.socket | None = None
        self._conns: dict[_Conn, None] = {}  # oldest first
        self._by_source: dict[str, dict[_Conn, None]] = {}
        self.closed_for_room = 0  # idle connections closed to make room (totals, for tests and logs)
        self.refused = 0  # new connections refused: every one over the cap busy
        self._cap_logged_s = -CAP_LOG_INTERVAL_S

    # ---- life cycle ------------------------------------------------------------------------------

    def start(self) -> HttpServer:
        """Bind and serve; HttpListenError naming the flag, or WebConfigError naming the web config."""
        if self.web_config:
            self.guard = WebGuard(self.web_config, self.open_paths)  # before binding: nothing half-up
        where = host_port(self.host, self.port)
        if not self.tls and not plaintext_allowed(where):
            if not self.insecure:
                raise HttpListenError(
                    f"{self.flag} {self.listen}: plaintext HTTP on an address others can reach; give "
                    "--web-config-file with a tls_server_config (and basic_auth_users: docs/SECURITY.md), "
                    "listen on 127.0.0.1, or pass --insecure to serve it unauthenticated anyway")
            log.warning("%s: INSECURE: %s serves plaintext HTTP to the network: anyone who can reach it "
                        "can read it (--insecure)", self.name, where)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            sock = socket.create_server((self.host, self.port), family=family, backlog=1024,
                                        dualstack_ipv6=self.host == "::" and socket.has_dualstack_ipv6())
        except OSError as e:
            raise HttpListenError(f"{self.flag} {self.listen}: cannot bind: {e.strerror or e}; "
                                  "pick a free port or another address") from None
        self.port = sock.getsockname()[1]
        sock.setblocking(False)
        self._sock = sock
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix=f"{self.name}-http")
        loop = self._loop = asyncio.new_event_loop()
        # A client that resets mid-handshake is no fault of ours: nothing for the log under a flood.
        loop.set_exception_handler(lambda _loop, ctx: log.debug("%s: %s", self.name, ctx.get("message")))
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-http", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        loop, listening = self._loop, self._sock
        assert loop is not None and listening is not None  # start() set both before the thread
        serve_until_stopped(loop, functools.partial(self._accept, listening), listening)

    async def _accept(self, listening: socket.socket) -> None:
        """Accept here, so that the caps see a connection before its TLS handshake."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, peer = await loop.sock_accept(listening)
            except OSError as e:  # EMFILE: out of descriptors; the caps are larger than the fd limit
                self._cap_line("", f"accept failed: {e.strerror or e}")
                await asyncio.sleep(0.1)
                continue
            source = str(peer[0]) if isinstance(peer, tuple) and peer else ""
            conn = _Conn(source, None)
            if not self._admit(conn):
                sock.close()
                continue
            conn.sock = sock
            conn.task = loop.create_task(self._client(conn, sock))
            # A ready socket's sock_accept returns without suspending: yield, or a backlog is drained
            # (and its connections closed for room by each other) before any of them is served.
            await asyncio.sleep(0)

    @property
    def address(self) -> str:
        """HOST:PORT as a client dials it: the wildcard addresses become loopback."""
        return dial_address(host_port(self.host, self.port))

    @property
    def tls(self) -> bool:
        return self.guard is not None and self.guard.tls

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.address}"

    @property
    def connections(self) -> int:
        return len(self._conns)

    def stop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return

        def shut() -> None:
            for conn in list(self._conns):
                _close(conn)
            loop.stop()

        with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
            loop.call_soon_threadsafe(shut)
        if self._thread is not None:
            self._thread.join(5.0)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- requests --------------------------------------------------------------------------------

    def handle(self, request: Request) -> Response:
        if self.guard is not None:
            refused = self.guard.refuse(request.path, request.headers.get("authorization"), request.source)
            if refused is not None:
                return Response(refused[0], refused[1], headers=refused[2])
        route = self.routes.get(request.path)
        if route is None:
            known = ", ".join(sorted(self.routes))
            return Response(404, f"no such path {request.path}; this server has {known}\n".encode())
        try:
            return route(request)
        except Unavailable as e:
            return Response(503, f"{self.name} {request.path}: {e}\n".encode())
        except Exception as e:
            line = f"{self.name} {request.path}: {type(e).__name__}: {e}"
            if line not in self._logged and len(self._logged) < MAX_LOGGED_FAILURES:
                self._logged.add(line)
                log.exception("%s", line)
            return Response(500, (line + "\n").encode())

    def _render(self, request: Request, head: bool, close: bool) -> bytes:
        """The whole answer to `request`, status line to body."""
        response = self.handle(request)
        body = response.body
        extra: list[tuple[str, str]] = []
        if len(body) >= GZIP_MIN_BYTES and "gzip" in request.headers.get("accept-encoding", ""):
            body = gzip.compress(body, compresslevel=1)
            extra.append(("Content-Encoding", "gzip"))
        extra.extend(response.headers.items())
        if self.guard is not None:
            extra.extend(self.guard.headers().items())
        return _message(response.status, response.content_type, body, extra, head, close)

    # ---- connections (the loop thread) -------------------------------------------------------

    async def _client(self, conn: _Conn, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.header_timeout_s  # handshake and first request head
        transport: asyncio.Transport | None = None
        conn.sock = None  # this task's now: its finally closes it
        try:
            context = self.guard.context() if self.guard is not None else None
            reader = asyncio.StreamReader(limit=MAX_HEAD_BYTES, loop=loop)
            protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
            if context is None:
                transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock)
            else:
                transport, _ = await loop.connect_accepted_socket(
                    lambda: protocol, sock, ssl=context, ssl_handshake_timeout=self.header_timeout_s)
            writer = asyncio.StreamWriter(transport, protocol, reader, loop)
            if self.guard is not None and context is not None:
                ssl_object = writer.get_extra_info("ssl_object")
                why = self.guard.peer_refused(ssl_object) if ssl_object is not None else None
                if why is not None:
                    log.debug("TLS client %s refused: %s", conn.source, why)
                    return
            await self._serve(conn, reader, writer, deadline)
        except (asyncio.CancelledError, TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError,
                ssl.SSLError, EOFError):
            pass  # closed to make room, a deadline, a client gone or speaking garbage: nothing to say
        finally:
            self._forget(conn)
            if transport is not None:
                transport.abort()
            sock.close()

    async def _serve(self, conn: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if conn.served:  # kept alive: the next request's first byte, then its head in time
                first = await asyncio.wait_for(reader.readexactly(1), self.idle_timeout_s)
                deadline = loop.time() + self.header_timeout_s
            else:
                first = b""
            try:
                rest = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), max(deadline - loop.time(), 0.0))
            except asyncio.LimitOverrunError:
                await self._send(writer, _error(431, "request head too large"))
                return
            conn.busy = True
            try:
                try:
                    method, request, close = _parse(first + rest, conn.source)
                    length = int(request.headers.get("content-length", "0") or 0)
                except ValueError:
                    raise _BadRequest(400, "malformed request") from None
                except _BadRequest:
                    raise
                if "transfer-encoding" in request.headers:
                    raise _BadRequest(411, "a GET has no body; chunked bodies are not read")
                if length < 0 or length > MAX_BODY_BYTES:
                    raise _BadRequest(413, "request body too large")
                if length:
                    await asyncio.wait_for(reader.readexactly(length), max(deadline - loop.time(), 0.0))
                if method not in ("GET", "HEAD"):
                    raise _BadRequest(501, f"unsupported method {method}")
            except _BadRequest as e:
                await self._send(writer, _error(e.status, str(e)))
                return
            head = method == "HEAD"
            if request.path in self.inline_paths:
                answer = self._render(request, head, close)
            else:
                assert self._pool is not None
                answer = await loop.run_in_executor(self._pool, self._render, request, head, close)
            await self._send(writer, answer)
            conn.busy = False
            conn.served += 1
            if close:
                return

    async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)

    def _admit(self, conn: _Conn) -> bool:
        """Room for `conn` under both caps, made by closing idle connections; False: refuse it."""
        same = self._by_source.get(conn.source, {})
        for pool in (same, self._conns):
            limit = self.max_per_source if pool is same else self.max_connections
            if len(pool) >= limit:
                victim = _oldest_idle(pool)
                if victim is None:
                    self.refused += 1
                    self._cap_line(conn.source, "refused a new connection")
                    return False
                self._forget(victim)
                _close(victim)
                self.closed_for_room += 1
                self._cap_line(conn.source, "closed an idle connection for a new one")
        self._conns[conn] = None
        self._by_source.setdefault(conn.source, {})[conn] = None
        return True

    def _forget(self, conn: _Conn) -> None:
        if self._conns.pop(conn, 0) is None:
            same = self._by_source.get(conn.source)
            if same is not None:
                same.pop(conn, None)
                if not same:
                    del self._by_source[conn.source]

    def _cap_line(self, source: str, what: str) -> None:
        now = time.monotonic()
        if now - self._cap_logged_s >= CAP_LOG_INTERVAL_S:
            self._cap_logged_s = now
            log.warning("%s %s: %s: %d connections open (at most %d), %d from %s (at most %d); %d idle ones "
                        "closed and %d refused so far: a flood of idle connections, or caps too small",
                        self.name, host_port(self.host, self.port), what, len(self._conns),
                        self.max_connections, len(self._by_source.get(source, ())), source or "?",
                        self.max_per_source, self.closed_for_room, self.refused)


def _close(conn: _Conn) -> None:
    """End a connection's task; close its socket if the task never started (a task cancelled before
    its first step never runs its `finally`)."""
    if conn.task is not None:
        conn.task.cancel()
    if conn.sock is not None:
        conn.sock.close()
        conn.sock = None


def _oldest_idle(conns: Mapping[_Conn, None]) -> _Conn | None:
    """The oldest connection with no request in flight, one that never completed a request first."""
    fallback = None
    for conn in conns:
        if conn.busy:
            continue
        if not conn.served:
            return conn
        if fallback is None:
            fallback = conn
    return fallback


def _parse(raw: bytes, source: str) -> tuple[str, Request, bool]:
    """(method, Request, close after answering) of a request head; ValueError when malformed."""
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise _BadRequest(400, "malformed request line")
    method, target, version = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise _BadRequest(400, "malformed header line")
        headers[name.lower()] = value.strip()
    connection = headers.get("connection", "").lower()
    close = "close" in connection or (version == "HTTP/1.0" and "keep-alive" not in connection)
    url = urlsplit(target)
    return method, Request(url.path, parse_qs(url.query), headers, source), close


def _message(status: int, content_type: str, body: bytes, extra: list[tuple[str, str]], head: bool,
             close: bool) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    lines = [f"HTTP/1.1 {status} {phrase}", "Server: ghostgpu", f"Date: {formatdate(usegmt=True)}",
             f"Content-Type: {content_type}", f"Content-Length: {len(body)}"]
    lines.extend(f"{k}: {v}" for k, v in extra)
    if close:
        lines.append("Connection: close")
    data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return data if head else data + body


def _error(status: int, line: str) -> bytes:
    return _message(status, TEXT, f"{line}\n".encode(), [], False, True)
