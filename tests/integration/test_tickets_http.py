"""Remediation tickets against a real HTTP receiver: Python's http.server on a loopback port, on a
thread, answering each POST with the next status of its script. No root needed."""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from ghostgpu.collector.tickets import TicketSender

from tests.helpers.certs import Pki
from tests.helpers.polling import wait_until


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: dict[str, object]


@dataclass
class Receiver:
    """Answers POSTs with `script` in order (the last status repeats), keeping what it received."""

    script: list[int]
    retry_after: str = ""
    got: list[Received] = field(default_factory=list)
    url: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self) -> int:
        with self.lock:
            return self.script[min(len(self.got) - 1, len(self.script) - 1)]


def _handler(receiver: Receiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as a ticket system's server would

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            body = json.loads(self.rfile.read(length))
            headers = {k.lower(): v for k, v in self.headers.items()}
            with receiver.lock:
                receiver.got.append(Received(self.path, headers, body))
            status = receiver.answer()
            reply = json.dumps({"status": status}).encode()
            self.send_response(status)
            if status in (429, 503) and receiver.retry_after:
                self.send_header("Retry-After", receiver.retry_after)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


@contextlib.contextmanager
def serving(rec: Receiver, tls: ssl.SSLContext | None = None) -> Iterator[Receiver]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(rec))
    server.daemon_threads = True
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    scheme = "https" if tls is not None else "http"
    rec.url = f"{scheme}://127.0.0.1:{server.server_address[1]}/hooks/ghostgpu?queue=gpu"
    thread = threading.Thread(target=server.serve_forever, name="ticket-receiver", daemon=True)
    thread.start()
    try:
        yield rec
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def receiver(request: pytest.FixtureRequest) -> Iterator[Receiver]:
    script, retry_after = request.param if isinstance(request.param, tuple) else (request.param, "")
    with serving(Receiver(list(script), retry_after)) as rec:
        yield rec


def _sender(url: str, headers_file: str = "", **kw: float) -> TicketSender:
    options: dict[str, float] = {"backoff_first_s": 0.01, "backoff_max_s": 0.05, "timeout_s": 5.0}
    options.update(kw)
    sender = TicketSender(url, headers_file, max_attempts=int(options.pop("max_attempts", 6)), **options)
    sender.start()
    return sender


DOC = {"incident": "f42/kill_orphan", "audit_seq": 17, "mode": "on", "finding": {"id": 42}, "node": "n1",
       "pods": [], "evidence": {}, "actions": [], "sent_at": ""}


@pytest.mark.parametrize("receiver", [[503, 503, 201]], indirect=True)
def test_two_503s_then_201_is_one_ticket_in_three_attempts_with_the_files_headers(receiver: Receiver,
                                                                                 tmp_path: Path) -> None:
    headers = tmp_path / "headers"
    headers.write_text("# rotated by the secret manager\nAuthorization: Bearer t0ken\nX-Queue: gpu-ops\n")
    sender = _sender(receiver.url, str(headers))
    try:
        sender.submit(DOC)
        wait_until(lambda: sender.stats()["sent"] == 1, "the ticket to be taken")
        assert sender.stats() == {"sent": 1, "failed": 0, "dropped": 0, "retries": 2, "queued": 0}
        assert len(receiver.got) == 3
        for got in receiver.got:
            assert got.path == "/hooks/ghostgpu?queue=gpu"
            assert got.headers["content-type"] == "application/json"
            assert got.headers["authorization"] == "Bearer t0ken" and got.headers["x-queue"] == "gpu-ops"
            assert got.body["incident"] == "f42/kill_orphan" and got.body["audit_seq"] == 17
            assert str(got.body["sent_at"]).endswith("Z")  # stamped at each attempt
    finally:
        sender.stop()


@pytest.mark.parametrize("receiver", [[400]], indirect=True)
def test_a_400_fails_the_ticket_at_once(receiver: Receiver, caplog: pytest.LogCaptureFixture) -> None:
    sender = _sender(receiver.url)
    try:
        sender.submit(DOC)
        sender.submit({**DOC, "incident": "f43/kill_orphan"})
        wait_until(lambda: sender.stats()["failed"] == 2, "both tickets to fail")
        assert sender.stats() == {"sent": 0, "failed": 2, "dropped": 0, "retries": 0, "queued": 0}
        assert len(receiver.got) == 2  # one attempt each
        refusals = [r for r in caplog.records if "refused a ticket with 400" in r.getMessage()]
        assert len(refusals) == 1  # logged once per status
    finally:
        sender.stop()


@pytest.mark.parametrize("receiver", [([429, 201], "0")], indirect=True)
def test_a_429_is_retried_after_what_retry_after_says(receiver: Receiver) -> None:
    sender = _sender(receiver.url)
    try:
        sender.submit(DOC)
        wait_until(lambda: sender.stats()["sent"] == 1, "the ticket to be taken")
        assert sender.stats()["retries"] == 1 and len(receiver.got) == 2
    finally:
        sender.stop()


@pytest.mark.parametrize("receiver", [([503], "3600")], indirect=True)
def test_a_retry_after_past_the_bound_fails_the_ticket(receiver: Receiver) -> None:
    sender = _sender(receiver.url, max_total_s=30.0)
    try:
        sender.submit(DOC)
        wait_until(lambda: sender.stats()["failed"] == 1, "the ticket to fail")
        assert len(receiver.got) == 1 and sender.stats()["retries"] == 0
    finally:
        sender.stop()


def _dead_port() -> int:
    """A loopback port nothing listens on: bound, then closed (connections to it are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_dead_port_is_bounded_attempts_then_failed() -> None:
    sender = _sender(f"http://127.0.0.1:{_dead_port()}/", max_attempts=4)
    try:
        sender.submit(DOC)
        wait_until(lambda: sender.stats()["failed"] == 1, "the ticket to fail")
        assert sender.stats() == {"sent": 0, "failed": 1, "dropped": 0, "retries": 3, "queued": 0}
    finally:
        sender.stop()


@pytest.mark.parametrize("receiver", [[201]], indirect=True)
def test_a_bad_headers_line_fails_the_ticket_naming_the_file_and_line(
        receiver: Receiver, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    headers = tmp_path / "headers"
    headers.write_text("Authorization: Bearer ok\n")
    sender = _sender(receiver.url, str(headers))
    try:
        headers.write_text("Authorization: Bearer ok\nbroken line\n")  # rotated into a bad one after load
        sender.submit(DOC)
        wait_until(lambda: sender.stats()["failed"] == 1, "the ticket to fail")
        assert receiver.got == []
        assert any(f"{headers} line 2: not a \"Name: value\" header line" in r.getMessage()
                   for r in caplog.records)
        headers.write_text("Authorization: Bearer new\n")  # fixed: the next ticket reads it again
        sender.submit({**DOC, "incident": "f43/kill_orphan"})
        wait_until(lambda: sender.stats()["sent"] == 1, "the next ticket to be taken")
        assert receiver.got[0].headers["authorization"] == "Bearer new"
    finally:
        sender.stop()


def test_https_trusts_the_system_cas_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    """A receiver whose certificate no system CA signed is refused before any request is sent; the
    same receiver is reached once its CA is in the store OpenSSL reads (SSL_CERT_FILE names it)."""
    pki = Pki(tmp_path / "pki")
    files = pki.write("receiver", pki.collector())
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(str(files.cert), str(files.key))
    with serving(Receiver([201]), tls) as rec:
        untrusted = _sender(rec.url, max_attempts=2)
        try:
            untrusted.submit(DOC)
            wait_until(lambda: untrusted.stats()["failed"] == 1, "the ticket to the untrusted one to fail")
            assert rec.got == []
            assert any("CERTIFICATE_VERIFY_FAILED" in r.getMessage() for r in caplog.records)
        finally:
            untrusted.stop()
        monkeypatch.setenv("SSL_CERT_FILE", str(pki.ca_path))
        trusted = _sender(rec.url)
        try:
            trusted.submit(DOC)
            wait_until(lambda: trusted.stats()["sent"] == 1, "the ticket over https")
            assert [g.body["incident"] for g in rec.got] == ["f42/kill_orphan"]
        finally:
            trusted.stop()
