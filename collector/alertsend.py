"""One Alertmanager the collector pushes to: its URL, one POST of a batch, and its retry schedule.

`collector.alertpush.AlertPusher` runs one thread per Alertmanager, so an HA pair's members never
wait for each other: a member that hangs costs its own thread `timeout_s` per attempt, nothing more.
The HTTP/1.1 connection is kept between POSTs (Alertmanager's Go server keeps it alive) and opened
again after any error.
"""

from __future__ import annotations

import base64
import http.client
import json
import random
import socket
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

API_PATH = "/api/v2/alerts"
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
REASON_MAX_CHARS = 300  # an Alertmanager's error text, cut to one readable log line
# What a POST on a kept-alive connection the other side closed while idle raises (posting alerts
# again is harmless: Alertmanager merges them by label set).
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError, ConnectionAbortedError)
URL_HELP = ("use http://HOST:PORT or https://HOST:PORT (e.g. http://127.0.0.1:9093; a path prefix such as "
            "http://HOST:PORT/alertmanager is kept)")


@dataclass(frozen=True)
class Endpoint:
    """Where to POST: parsed once, so a bad --alertmanager fails at start, not at the first finding."""

    scheme: str
    host: str
    port: int
    path: str  # the full request path, prefix + /api/v2/alerts
    authorization: str  # "Basic ..." from user:password@ in the URL, else ""
    display: str  # the URL without its password, for logs and errors

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        text = url.strip()
        try:
            parts = urlsplit(text)
            port = parts.port
        except ValueError as e:  # urlsplit refuses a bad port or a bracket mismatch
            raise ValueError(f"--alertmanager {url!r}: {e}; {URL_HELP}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--alertmanager {url!r}: {URL_HELP}")
        if parts.query or parts.fragment:
            raise ValueError(f"--alertmanager {url!r}: a query or #fragment has no meaning here; {URL_HELP}")
        prefix = parts.path.rstrip("/").removesuffix(API_PATH).rstrip("/")
        auth = ""
        if parts.username is not None:
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            auth = "Basic " + base64.b64encode(pair.encode()).decode()
        host = parts.hostname
        port = port or (443 if parts.scheme == "https" else 80)
        shown_host = f"[{host}]" if ":" in host else host
        return cls(parts.scheme, host, port, prefix + API_PATH, auth,
                   f"{parts.scheme}://{shown_host}:{port}{prefix}")


@dataclass(frozen=True)
class PostResult:
    status: int  # HTTP status; 0 when no answer came (refused, timeout, reset)
    reason: str  # one line: the Alertmanager's error text or the socket error; "" on 200

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def rejected(self) -> bool:
        """400: Alertmanager stored the batch's valid alerts and refused the rest; retrying cannot help."""
        return self.status == 400


def one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= REASON_MAX_CHARS else line[:REASON_MAX_CHARS - 3] + "..."


def _reason(body: bytes) -> str:
    """Alertmanager answers a 400 with a JSON string (0.25) or an object with `message`; else raw text."""
    text = body.decode("utf-8", errors="replace")
    try:
        value = json.loads(text)
    except ValueError:
        return one_line(text)
    if isinstance(value, dict):
        value = value.get("message", value)
    return one_line(str(value))


class Sender:
    """POSTs JSON batches to one Alertmanager; owned by one thread, so it needs no lock."""

    def __init__(self, endpoint: Endpoint, timeout_s: float) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._conn: http.client.HTTPConnection | None = None
        self.failures = 0  # consecutive failed POSTs (no answer or 5xx)

    def post(self, alerts: list[dict[str, object]], timeout_s: float | None = None) -> PostResult:
        body = json.dumps(alerts, separators=(",", ":")).encode()
        headers = {"Content-Type": "application/json", "User-Agent": "ghostgpu-collector"}
        if self.endpoint.authorization:
            headers["Authorization"] = self.endpoint.authorization
        for attempt in (1, 2):
            reused = self._conn is not None and self._conn.sock is not None
            conn = self._connection(timeout_s or self.timeout_s)
            try:
                conn.request("POST", self.endpoint.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                break
            except (OSError, http.client.HTTPException) as e:
                self.close()
                if reused and attempt == 1 and isinstance(e, _STALE):
                    continue  # the peer (or a proxy) closed the idle kept-alive connection: a fresh one
                timed_out = isinstance(e, socket.timeout | TimeoutError)
                what = "timed out" if timed_out else f"{type(e).__name__}: {e}"
                return PostResult(0, one_line(f"no answer from {self.endpoint.display}: {what}"))
        if resp.will_close:
            self.close()
        if resp.status == 200:
            return PostResult(200, "")
        reason = _reason(data) or resp.reason
        if resp.status == 404:
            reason += f" (is {self.endpoint.display} an Alertmanager with API v2? check --alertmanager)"
        return PostResult(resp.status, one_line(f"{self.endpoint.display} answered {resp.status}: {reason}"))

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        if self._conn is None:
            https = self.endpoint.scheme == "https"
            cls = http.client.HTTPSConnection if https else http.client.HTTPConnection
            self._conn = cls(self.endpoint.host, self.endpoint.port, timeout=timeout_s)
        else:
            self._conn.timeout = timeout_s
            if self._conn.sock is not None:
                self._conn.sock.settimeout(timeout_s)
        return self._conn

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def backoff_s(self) -> float:
        """Delay before the next attempt after `failures` failed ones: 0.5 s doubling to 30 s, each
        drawn from [half, full] so the collectors of a fleet do not retry in step."""
        full = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** max(0, self.failures - 1))
        return random.uniform(full / 2, full)
