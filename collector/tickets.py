"""Remediation tickets (action 3, docs/REMEDIATION.md "Tickets"): one JSON document per incident,
POSTed to a generic webhook (`remediation.actions.ticket.url`, headers from
`remediation.actions.ticket.headers_file`).

    sender = TicketSender(policy.ticket.url, policy.ticket.headers_file)
    sender.start()
    sender.submit(ticket_document(incident=..., audit_seq=..., mode=..., finding=..., pods=...,
                                  evidence=..., actions=...))   # on the event loop: O(1), never blocks
    sender.stats()   # {"sent", "failed", "dropped", "retries", "queued"} for /metrics (TicketDesk's)
    sender.stop()

`ticket_document()` is pure: the engine builds the document, the sender only stamps `sent_at` on
each attempt. `submit()` files it in a bounded queue (past the bound the oldest ticket is dropped
and counted) and wakes the sender's own thread, which delivers one ticket at a time: a POST with
Content-Type application/json and the headers file read again for each attempt (a rotated token is
picked up without a reload), retried with jittered exponential backoff on no answer, 5xx and 429
(a Retry-After within the ticket's time bound is waited for), up to `max_attempts` and
`max_total_s` in all; any other status fails the ticket at once, logged once per status. A
receiver may see a ticket twice (an answer lost after it was stored): the `incident` key is
the same in both, and it is what to deduplicate on.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Protocol

from ghostgpu.collector.httppost import Connection, HttpUrl, Reply, jittered_backoff_s, one_line

from ghostgpu.common.model.remediation import RemediationState
from ghostgpu.common.wire.convert import class_from_proto
from ghostgpu.v1 import query_pb2

__all__ = ["TicketDesk", "TicketError", "TicketFinding", "TicketSender", "TicketTarget",
           "read_headers", "ticket_document"]

log = logging.getLogger("ghostgpu.tickets")

URL_KEY = "remediation.actions.ticket.url"
HEADERS_KEY = "remediation.actions.ticket.headers_file"
URL_HELP = "use http(s)://HOST[:PORT][/path] (e.g. https://tickets.example.com/api/ghostgpu)"
HEADERS_FILE_MAX_BYTES = 64 * 1024
MAX_LOGGED = 100  # distinct statuses or header-file errors logged once each; past this, counted only
# Header names are RFC 9110 tokens; these the sender sets itself (or http.client does), so a file
# naming one is a mistake, not an override.
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_RESERVED = frozenset({"content-type", "content-length", "host", "transfer-encoding", "connection"})

class TicketError(Exception):
    """A ticket setting or headers file is unusable: one line naming it and what to do."""


@dataclass(frozen=True)
class TicketTarget:
    """Where tickets go: parsed once, so a bad URL fails at load, not at the first incident."""

    scheme: str
    host: str
    port: int
    path: str  # path and query, as sent in the request line
    display: str  # scheme://host:port/path, for log lines (the query may carry a token: left out)

    @classmethod
    def parse(cls, url: str) -> TicketTarget:
        try:
            u = HttpUrl.split(url, URL_KEY, URL_HELP)
        except ValueError as e:
            raise TicketError(str(e)) from None
        parts = u.parts
        if parts.username is not None:
            raise TicketError(f"{URL_KEY}: credentials in the URL would be logged; put an Authorization "
                              f"line in {HEADERS_KEY} instead")
        if parts.fragment:
            raise TicketError(f"{URL_KEY} {url!r}: a #fragment is never sent; {URL_HELP}")
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return cls(u.scheme, u.host, u.port, path, f"{u.scheme}://{u.shown_host}:{u.port}{parts.path}")


def read_headers(path: str) -> dict[str, str]:
    """The headers file: "Name: value" lines; blank lines and lines starting with # are skipped.
    TicketError (one line naming the file and line) on anything else. "" reads as no headers."""
    if not path:
        return {}
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADERS_FILE_MAX_BYTES + 1)
    except OSError as e:
        raise TicketError(f"{HEADERS_KEY} {path}: cannot read it ({e.strerror or e}); fix the path or "
                          "its permissions") from None
    if len(raw) > HEADERS_FILE_MAX_BYTES:
        raise TicketError(f"{HEADERS_KEY} {path}: over {HEADERS_FILE_MAX_BYTES} bytes; it holds only "
                          "\"Name: value\" lines")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TicketError(f"{HEADERS_KEY} {path}: not UTF-8 text; write \"Name: value\" lines") from None
    headers: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        name, sep, value = stripped.partition(":")
        name, value = name.strip(), value.strip()
        where = f"{HEADERS_KEY} {path} line {number}"
        if not sep or not _TOKEN.match(name):
            raise TicketError(f"{where}: not a \"Name: value\" header line "
                              "(e.g. Authorization: Bearer TOKEN)")
        if any((ord(c) < 32 and c != "\t") or ord(c) == 127 for c in value):
            raise TicketError(f"{where}: header {name} has a control character in its value")
        if name.lower() in _RESERVED:
            raise TicketError(f"{where}: {name} is set by ghostgpu itself; remove the line")
        headers[name] = value
    return headers


def rfc3339_ns(unix_ns: int) -> str:
    """A unix-ns instant as RFC 3339 UTC with milliseconds; "" for 0 (unknown)."""
    if unix_ns <= 0:
        return ""
    when = datetime.fromtimestamp(unix_ns / 1e9, UTC)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class TicketFinding:
    """The finding as a ticket shows it (its `finding` object)."""

    id: int
    cls: str  # the class keyword ("orphaned"); `class` in the document
    node: str
    namespace: str
    pod: str
    container: str
    container_id: str
    pid: int
    comm: str
    exe: str
    gpu: int | None  # NVML index; None for a holder of node-wide devices only
    opened_unix_ns: int

    @classmethod
    def from_proto(cls, finding: query_pb2.Finding) -> TicketFinding:
        c, k8s = finding.consumer.consumer, finding.consumer.k8s
        return cls(id=finding.id, cls=class_from_proto(getattr(c, "class")).value,
                   node=finding.node or c.node, namespace=k8s.namespace, pod=k8s.pod,
                   container=k8s.container, container_id=c.process.container_id, pid=c.process.pid,
                   comm=c.process.comm, exe=c.process.exe, gpu=c.gpu if c.gpu >= 0 else None,
                   opened_unix_ns=finding.opened_unix_ns)

    def to_json(self) -> dict[str, object]:
        return {"id": self.id, "class": self.cls, "node": self.node, "namespace": self.namespace,
                "pod": self.pod, "container": self.container, "container_id": self.container_id,
                "pid": self.pid, "comm": self.comm, "exe": self.exe, "gpu": self.gpu,
                "opened_at": rfc3339_ns(self.opened_unix_ns)}


def ticket_document(*, incident: str, audit_seq: int, mode: str, finding: TicketFinding,
                    pods: Sequence[Mapping[str, str]], evidence: Mapping[str, object],
                    actions: Sequence[RemediationState]) -> dict[str, object]:
    """The ticket for one incident (docs/REMEDIATION.md "Tickets" has the shape); `sent_at` is "" until
    the sender stamps it. ValueError (one line) if the evidence is not JSON."""
    doc: dict[str, object] = {
        "incident": incident,
        "audit_seq": audit_seq,
        "mode": mode,
        "finding": finding.to_json(),
        "node": finding.node,
        "pods": [dict(p) for p in pods],
        "evidence": dict(evidence),
        "actions": [{"action": a.action, "state": a.state, "at": rfc3339_ns(a.at_unix_ns), "reason": a.reason}
                    for a in actions],
        "sent_at": "",
    }
    try:
        json.dumps(doc)
    except (TypeError, ValueError) as e:
        raise ValueError(f"ticket {incident}: its evidence is not JSON ({e})") from None
    return doc


def retry_after_s(value: str, now_unix_s: float) -> float | None:
    """Retry-After as seconds from now: delay-seconds or an HTTP-date (RFC 9110 10.2.3); None if neither."""
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP-date is always GMT
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - now_unix_s)


@dataclass
class _Ticket:
    document: dict[str, object]
    incident: str


class TicketSender:
    """Delivers tickets to one webhook on a thread of its own; `submit()` and `stats()` are safe from
    any thread."""

    def __init__(self, url: str, headers_file: str = "", *, max_queue: int = 1000, max_attempts: int = 6,
                 max_total_s: float = 300.0, timeout_s: float = 10.0, backoff_first_s: float = 1.0,
                 backoff_max_s: float = 60.0, check_headers: bool = True) -> None:
        """check_headers: read the headers file now, a bad one a TicketError (False: only at each POST,
        on the sender's thread, as TicketDesk builds it on the collector's loop, where no file is read)."""
        if max_queue < 1 or max_attempts < 1 or not max_total_s > 0 or not timeout_s > 0:
            raise TicketError(f"TicketSender: max_queue {max_queue} and max_attempts {max_attempts} must be "
                              f">= 1, max_total_s {max_total_s} and timeout_s {timeout_s} > 0")
        self.target = TicketTarget.parse(url)
        self.headers_file = headers_file
        if check_headers:
            read_headers(headers_file)  # a bad file fails at load too (each ticket still reads it again)
        self.max_queue, self.max_attempts = max_queue, max_attempts
        self.max_total_s, self.timeout_s = max_total_s, timeout_s
        self.backoff_first_s, self.backoff_max_s = backoff_first_s, backoff_max_s
        self._http: Connection | None = None  # made on the sender's thread (https: an SSL context to load)
        self._queue: deque[_Ticket] = deque()
        self._cond = threading.Condition()  # the queue, the counters and _stopping
        self._stop_event = threading.Event()  # wakes a backoff wait at stop
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._sent = self._failed = self._dropped = self._retries = 0
        self._logged: set[str] = set()
        self._failing = False  # the last ticket failed: the next failures log at debug

    # ---- any thread --------------------------------------------------------------------------------

    def submit(self, document: Mapping[str, object]) -> None:
        """Queue one ticket: O(1), never blocks on the network, never raises (the engine calls it on the
        collector's loop). Past `max_queue` the oldest waiting ticket is dropped and counted."""
        try:
            ticket = _Ticket(dict(document), str(document.get("incident", "")))
            with self._cond:
                dropped = None
                if len(self._queue) >= self.max_queue:
                    dropped = self._queue.popleft()
                    self._dropped += 1
                self._queue.append(ticket)
                self._cond.notify()
            if dropped is not None:
                self._log_once("dropped", logging.WARNING, "tickets: %d wait for %s; the oldest (%s) and any "
                               "more past the bound are dropped and counted", self.max_queue,
                               self.target.display, dropped.incident)
        except Exception:  # the engine must not fail on a ticket; its incident is audited anyway
            log.exception("tickets: could not queue a ticket")

    def take_queued(self) -> list[dict[str, object]]:
        """The tickets still waiting, taken out of this sender's queue (a new URL's sender sends them)."""
        with self._cond:
            out = [t.document for t in self._queue]
            self._queue.clear()
            return out

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {"sent": self._sent, "failed": self._failed, "dropped": self._dropped,
                    "retries": self._retries, "queued": len(self._queue)}

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tickets", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Ends the thread: the ticket in flight gets no further attempt; those still queued are left
        (logged with their count), as the incidents are in the audit chain."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("tickets: still posting to %s at stop", self.target.display)
        left = self.stats()["queued"]
        if left:
            log.warning("tickets: %d not sent at stop (their incidents are in the audit chain)", left)

    # ---- the sender thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._http = Connection(self.target.scheme, self.target.host, self.target.port, self.timeout_s,
                                    self.target.display)
            while True:
                with self._cond:
                    while not self._queue and not self._stopping:
                        self._cond.wait()
                    if self._stopping:
                        return
                    ticket = self._queue.popleft()
                sent, why = self._deliver(ticket)
                with self._cond:
                    if sent:
                        self._sent += 1
                    else:
                        self._failed += 1
                if sent and self._failing:
                    log.info("tickets: %s takes tickets again", self.target.display)
                elif not sent and why:
                    log.log(logging.DEBUG if self._failing else logging.WARNING,
                            "tickets: ticket %s not delivered: %s", ticket.incident, why)
                self._failing = not sent
        except Exception:  # a bug here must not take the collector down; it is logged with its trace
            log.exception("tickets: the sender for %s stopped", self.target.display)
        finally:
            if self._http is not None:
                self._http.close()

    def _deliver(self, ticket: _Ticket) -> tuple[bool, str]:
        """(sent, why not); why is "" when the reason was already logged once (a 4xx, a bad file)."""
        deadline = time.monotonic() + self.max_total_s
        why = ""
        for attempt in range(1, self.max_attempts + 1):
            if attempt > 1:
                with self._cond:
                    self._retries += 1
            try:
                headers = read_headers(self.headers_file)
            except TicketError as e:
                self._log_once(str(e), logging.ERROR, "tickets: %s", str(e))
                return False, ""
            headers.update({"Content-Type": "application/json", "User-Agent": "ghostgpu-collector"})
            ticket.document["sent_at"] = rfc3339_ns(time.time_ns())
            body = json.dumps(ticket.document, separators=(",", ":")).encode()
            left_s = deadline - time.monotonic()
            assert self._http is not None  # made by _run before the first delivery
            reply = self._http.post(self.target.path, body, headers, max(0.001, min(self.timeout_s, left_s)))
            if 200 <= reply.status < 300:
                return True, ""
            if not _retryable(reply.status):
                self._log_once(f"status {reply.status}", logging.WARNING,
                               "tickets: %s refused a ticket with %s (not retried; later refusals with "
                               "this status are counted, not logged): %s", self.target.display,
                               reply.status, _answer(reply))
                return False, ""
            why = reply.error or f"{self.target.display} answered {reply.status}: {_answer(reply)}"
            if attempt == self.max_attempts:
                return False, f"{why} ({attempt} attempts)"
            delay_s = jittered_backoff_s(attempt, self.backoff_first_s, self.backoff_max_s)
            asked = retry_after_s(reply.retry_after, time.time()) if reply.retry_after else None
            if asked is not None:
                delay_s = asked
            if time.monotonic() + delay_s >= deadline:
                return False, (f"{why}; the next attempt in {delay_s:.1f} s would pass the "
                               f"{self.max_total_s:g} s bound ({attempt} attempts)")
            if self._stop_event.wait(delay_s):
                return False, f"{why}; stopped before attempt {attempt + 1}"
        return False, why

    def _log_once(self, key: str, level: int, msg: str, *args: object) -> None:
        if key in self._logged or len(self._logged) >= MAX_LOGGED:
            return
        self._logged.add(key)
        log.log(level, msg, *args)


def _retryable(status: int) -> bool:
    """No answer, 5xx and 429 may pass; any other refusal would only be refused again."""
    return status == 0 or status == 429 or status >= 500


def _answer(reply: Reply) -> str:
    return one_line(reply.body.decode("utf-8", errors="replace")) or reply.phrase


class TicketSetting(Protocol):
    """remediation.actions.ticket as the policy has it (collector/remediation_policy.py's TicketAction,
    which reads its url with TicketTarget: this module may not import it back)."""

    @property
    def url(self) -> str: ...

    @property
    def headers_file(self) -> str: ...


class TicketDesk:
    """The engine's ticket seam: `submit()` hands the document to a TicketSender for the ticket url in
    force (the remediation section is reloaded at any time: a changed url or headers file gets a new
    sender; the old one finishes its ticket in flight on a thread of its own). No url: no ticket.
    `stats()` adds up every sender this desk ran, so the counters only grow."""

    def __init__(self, action: Callable[[], TicketSetting]) -> None:
        self.action = action
        self._sender: TicketSender | None = None
        self._key: tuple[str, str] = ("", "")  # the (url, headers_file) self._sender posts with
        self._senders: list[TicketSender] = []  # every one started, for stats(): a handful per run
        self._refused: tuple[str, str] | None = None  # the setting whose sender could not be built, logged

    def submit(self, document: Mapping[str, object]) -> None:
        sender = self._current()
        if sender is not None:
            sender.submit(document)

    def _current(self) -> TicketSender | None:
        want = self.action()
        key = (want.url, want.headers_file)
        if key == self._key:
            return self._sender
        sender = None
        if want.url:
            try:
                # No file read and no SSL context here, on the loop: the sender makes its connection on
                # its own thread and reads the headers file at each POST, so a file fixed in place
                # brings tickets back with the next one.
                sender = TicketSender(want.url, want.headers_file, check_headers=False)
            except TicketError as e:  # checked at load; the key is not taken: the next submit tries again
                if self._refused != key:
                    self._refused = key
                    log.error("tickets: %s; no ticket is sent until it is fixed", e)
                return None
        old, self._sender, self._key = self._sender, sender, key
        if sender is not None:
            if old is not None:  # the tickets still waiting go to the new url
                for document in old.take_queued():
                    sender.submit(document)
            sender.start()
            self._senders.append(sender)
        if old is not None:
            threading.Thread(target=old.stop, name="tickets-retire", daemon=True).start()
        return sender

    def stats(self) -> dict[str, int]:
        out = {"sent": 0, "failed": 0, "dropped": 0, "retries": 0, "queued": 0}
        for sender in self._senders:
            for k, v in sender.stats().items():
                out[k] = out.get(k, 0) + v
        return out

    def close(self) -> None:
        if self._sender is not None:
            self._sender.stop()
