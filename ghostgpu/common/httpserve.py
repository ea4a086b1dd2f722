"""A small HTTP server for Prometheus scrapes and kubelet probes (collector /metrics, tracer health).

    server = HttpServer("0.0.0.0:9400", {"/metrics": metrics_handler}, flag="--metrics-listen")
    server.start()            # binds at once; HttpListenError names the flag and the address
    server.address            # "127.0.0.1:9400" as a client dials it
    server.stop()

A handler takes the Request and returns a Response. It runs on the server's own thread (one per
connection, so a slow scraper never holds up a probe); a handler that raises answers 500 with
one line, logged once per distinct message; one that raises Unavailable (not ready yet, or
shutting down) answers 503 with its line and logs nothing. Bodies over 1 KiB are gzipped when the client
accepts it, as Prometheus does: a 1,000-node /metrics page shrinks about twentyfold.

With web_config (`--web-config-file`, the exporter-toolkit format: ghostgpu/common/webconfig.py) the
port speaks HTTPS and asks for basic auth as that file says, re-read when it or its certificate files
change (ghostgpu/common/webguard.py). The TLS handshake runs on the connection's own thread, so a
client that stalls mid-handshake holds up nobody; `open_paths` (the probes) need no credentials.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from ghostgpu.common.addresses import dial_address, host_port, parse_listen
from ghostgpu.common.webguard import WebGuard

log = logging.getLogger("ghostgpu.http")

TEXT = "text/plain; charset=utf-8"
# The text exposition format the collector writes by hand (see the Prometheus exposition docs).
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
GZIP_MIN_BYTES = 1024
SOCKET_TIMEOUT_S = 30.0  # a client that stops reading mid-response frees its thread after this
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


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str = TEXT
    headers: Mapping[str, str] = field(default_factory=dict)


Handler = Callable[[Request], Response]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    guard: WebGuard | None = None

    def get_request(self) -> tuple[socket.socket, object]:
        sock, addr = self.socket.accept()
        context = self.guard.context() if self.guard is not None else None
        if context is not None:  # the handshake runs on the connection's thread (finish_request)
            sock = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def finish_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        if isinstance(request, ssl.SSLSocket):
            request.settimeout(SOCKET_TIMEOUT_S)
            try:
                request.do_handshake()
            except (ssl.SSLError, OSError) as e:  # a plain-HTTP client, an untrusted certificate: its problem
                log.debug("TLS handshake with %s failed: %s", client_address, e)
                return
            why = self.guard.peer_refused(request) if self.guard is not None else None
            if why is not None:
                log.debug("TLS client %s refused: %s", client_address, why)
                return
        super().finish_request(request, client_address)


class HttpServer:
    def __init__(self, listen: str, routes: Mapping[str, Handler], flag: str = "--listen",
                 name: str = "http", web_config: str | None = None, open_paths: tuple[str, ...] = ()) -> None:
        self.host, self.port = parse_listen(listen, flag, HttpListenError)
        self.listen, self.flag, self.name = listen, flag, name
        self.routes = dict(routes)
        self.web_config, self.open_paths = web_config, open_paths
        self.guard: WebGuard | None = None
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._logged: set[str] = set()

    def start(self) -> HttpServer:
        """Bind and serve; HttpListenError naming the flag, or WebConfigError naming the web config."""
        if self.web_config:
            self.guard = WebGuard(self.web_config, self.open_paths)  # before binding: nothing half-up
        handler = _make_handler(self)
        try:
            if ":" in self.host:
                server_cls = type("_Server6", (_Server,), {"address_family": socket.AF_INET6})
                self._server = server_cls((self.host, self.port), handler)
            else:
                self._server = _Server((self.host, self.port), handler)
        except OSError as e:
            raise HttpListenError(f"{self.flag} {self.listen}: cannot bind: {e.strerror or e}; "
                                  "pick a free port or another address") from None
        self.port = self._server.server_address[1]
        self._server.guard = self.guard
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"{self.name}-http", daemon=True)
        self._thread.start()
        return self

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

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(5.0)

    def handle(self, request: Request) -> Response:
        if self.guard is not None:
            refused = self.guard.refuse(request.path, request.headers.get("authorization"))
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


def _make_handler(server: HttpServer) -> type[BaseHTTPRequestHandler]:
    class _Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: Prometheus reuses its connection every scrape
        timeout = SOCKET_TIMEOUT_S
        # Headers and body go out as two writes; with Nagle on, a body smaller than a segment (a gzipped
        # page, a probe's "ok") waits for the ACK of the headers, which the client delays ~40 ms
        # (Linux delayed ACK): 48 ms -> 4 ms per gzipped scrape (bench/bench_metrics_scrape.py).
        disable_nagle_algorithm = True

        def do_GET(self) -> None:
            self._answer(head=False)

        def do_HEAD(self) -> None:
            self._answer(head=True)

        def _answer(self, head: bool) -> None:
            parts = urlsplit(self.path)
            headers = {k.lower(): v for k, v in self.headers.items()}
            request = Request(parts.path, parse_qs(parts.query), headers)
            response = server.handle(request)
            body = response.body
            encoding = ""
            if len(body) >= GZIP_MIN_BYTES and "gzip" in request.headers.get("accept-encoding", ""):
                body, encoding = gzip.compress(body, compresslevel=1), "gzip"
            self.send_response(response.status)
            self.send_header("Content-Type", response.content_type)
            self.send_header("Content-Length", str(len(body)))
            if encoding:
                self.send_header("Content-Encoding", encoding)
            for k, v in response.headers.items():
                self.send_header(k, v)
            if server.guard is not None:
                for k, v in server.guard.headers().items():
                    self.send_header(k, v)
            self.end_headers()
            if not head:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # one line per scrape every second would drown the logs

    return _Handler
