"""One Alertmanager the collector pushes to: its URL, one POST of a batch, and its retry schedule.

`collector.alertpush.AlertPusher` runs one thread per Alertmanager, so an HA pair's members never
wait for each other: a member that hangs costs its own thread `timeout_s` per attempt, nothing more.
The HTTP/1.1 connection (`collector/httppost.py`) is kept between POSTs (Alertmanager's Go server
keeps it alive) and opened again after any error; one sent again after the peer closed an idle
connection is harmless, as Alertmanager merges alerts by label set.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from urllib.parse import unquote

from ghostgpu.collector.httppost import Connection, HttpUrl, jittered_backoff_s, one_line

API_PATH = "/api/v2/alerts"
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
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
        u = HttpUrl.split(url, "--alertmanager", URL_HELP)
        parts = u.parts
        if parts.query or parts.fragment:
            raise ValueError(f"--alertmanager {url!r}: a query or #fragment has no meaning here; {URL_HELP}")
        prefix = parts.path.rstrip("/").removesuffix(API_PATH).rstrip("/")
        auth = ""
        if parts.username is not None:
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            auth = "Basic " + base64.b64encode(pair.encode()).decode()
        return cls(u.scheme, u.host, u.port, prefix + API_PATH, auth,
                   f"{u.scheme}://{u.shown_host}:{u.port}{prefix}")


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
        self._http = Connection(endpoint.scheme, endpoint.host, endpoint.port, timeout_s, endpoint.display)
        self.failures = 0  # consecutive failed POSTs (no answer or 5xx)

    def post(self, alerts: list[dict[str, object]], timeout_s: float | None = None) -> PostResult:
        body = json.dumps(alerts, separators=(",", ":")).encode()
        headers = {"Content-Type": "application/json", "User-Agent": "ghostgpu-collector"}
        if self.endpoint.authorization:
            headers["Authorization"] = self.endpoint.authorization
        reply = self._http.post(self.endpoint.path, body, headers, timeout_s or self.timeout_s)
        if reply.status == 0:
            return PostResult(0, reply.error)
        if reply.status == 200:
            return PostResult(200, "")
        reason = _reason(reply.body) or reply.phrase
        if reply.status == 404:
            reason += f" (is {self.endpoint.display} an Alertmanager with API v2? check --alertmanager)"
        line = one_line(f"{self.endpoint.display} answered {reply.status}: {reason}")
        return PostResult(reply.status, line)

    def close(self) -> None:
        self._http.close()

    def backoff_s(self) -> float:
        """Delay before the next attempt after `failures` failed ones: 0.5 s doubling to 30 s, jittered."""
        return jittered_backoff_s(self.failures, BACKOFF_FIRST_S, BACKOFF_MAX_S)
