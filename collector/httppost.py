"""One kept-alive HTTP/1.1 connection the collector POSTs JSON on, and the retry schedule around it.

Shared by the two outbound HTTP clients of the collector, each on threads of its own: the
Alertmanager push (`collector/alertsend.py`) and the remediation tickets (`collector/tickets.py`).
A `Connection` belongs to one thread, so it needs no lock. It keeps the connection between POSTs
and opens it again after any error; https verifies the peer against the system's CAs
(`ssl.create_default_context()`), hostname included.
"""

from __future__ import annotations

import http.client
import random
import socket
import ssl
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

REASON_MAX_CHARS = 300  # a peer's error text, cut to one readable log line
# What a POST on a kept-alive connection the other side closed while idle raises: the request never
# reached the peer's handler, so it is sent once more on a fresh connection.
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


@dataclass(frozen=True)
class HttpUrl:
    """An http(s) URL split and checked once: what both peers the collector POSTs to start from."""

    scheme: str
    host: str
    port: int  # the URL's, else the scheme's default
    parts: SplitResult  # the rest (path, query, fragment, credentials) for the caller's own rules

    @property
    def shown_host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host

    @classmethod
    def split(cls, url: str, what: str, help_text: str) -> HttpUrl:
        """ValueError "WHAT 'URL': why; HELP" for anything but http(s)://HOST[:PORT]..."""
        try:
            parts = urlsplit(url.strip())
            port = parts.port
        except ValueError as e:  # urlsplit refuses a bad port or a bracket mismatch
            raise ValueError(f"{what} {url!r}: {e}; {help_text}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{what} {url!r}: {help_text}")
        return cls(parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80), parts)


def one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= REASON_MAX_CHARS else line[:REASON_MAX_CHARS - 3] + "..."


def jittered_backoff_s(failures: int, first_s: float, max_s: float) -> float:
    """Delay before the next attempt after `failures` failed ones: `first_s` doubling up to `max_s`,
    each drawn from [half, full] so the collectors of a fleet do not retry in step."""
    full = min(max_s, first_s * 2 ** max(0, failures - 1))
    return random.uniform(full / 2, full)


@dataclass(frozen=True)
class Reply:
    """What one POST got back. status 0: no answer (refused, reset, timed out); `error` says which."""

    status: int
    body: bytes = b""
    phrase: str = ""  # the status line's reason phrase ("Service Unavailable")
    retry_after: str = ""  # the Retry-After header as sent, "" when absent
    error: str = ""  # one line, only when status is 0


class Connection:
    """POSTs to one scheme://host:port; owned by one thread."""

    def __init__(self, scheme: str, host: str, port: int, timeout_s: float, display: str = "") -> None:
        self.scheme, self.host, self.port = scheme, host, port
        self.timeout_s = timeout_s
        shown_host = f"[{host}]" if ":" in host else host
        self.display = display or f"{scheme}://{shown_host}:{port}"  # the peer in log lines, no secrets
        self._conn: http.client.HTTPConnection | None = None
        self._tls: ssl.SSLContext | None = ssl.create_default_context() if scheme == "https" else None

    def post(self, path: str, body: bytes, headers: dict[str, str], timeout_s: float | None = None) -> Reply:
        for attempt in (1, 2):
            reused = self._conn is not None and self._conn.sock is not None
            conn = self._connection(timeout_s or self.timeout_s)
            try:
                conn.request("POST", path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                break
            except (OSError, http.client.HTTPException) as e:
                self.close()
                if reused and attempt == 1 and isinstance(e, _STALE):
                    continue  # the peer (or a proxy) closed the idle kept-alive connection: a fresh one
                timed_out = isinstance(e, socket.timeout | TimeoutError)
                what = "timed out" if timed_out else f"{type(e).__name__}: {e}"
                return Reply(0, error=one_line(f"no answer from {self.display}: {what}"))
        if resp.will_close:
            self.close()
        return Reply(resp.status, data, resp.reason or "", resp.getheader("Retry-After", "") or "")

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        if self._conn is None:
            if self._tls is not None:
                self._conn = http.client.HTTPSConnection(self.host, self.port, timeout=timeout_s,
                                                         context=self._tls)
            else:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
        else:
            self._conn.timeout = timeout_s
            if self._conn.sock is not None:
                self._conn.sock.settimeout(timeout_s)
        return self._conn

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
