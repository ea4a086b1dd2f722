"""Remediation tickets without a network: the document's shape, the headers file, the URL, Retry-After,
and the queue's bound (the sender's thread is never started here). tests/integration/test_tickets_http.py
posts to a real receiver."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from ghostgpu.collector.tickets import (
    TicketDesk,
    TicketError,
    TicketFinding,
    TicketSender,
    TicketTarget,
    read_headers,
    retry_after_s,
    ticket_document,
)

from ghostgpu.common.model.remediation import DONE, KILL_ORPHAN, MODE_ON, PROPOSED, RemediationState
from ghostgpu.v1 import node_pb2, query_pb2

FINDING = TicketFinding(id=42, cls="orphaned", node="gpu-node-1", namespace="ml", pod="train-0",
                        container="worker", container_id="0123456789abcdef" * 4, pid=4242, comm="python3",
                        exe="/usr/bin/python3.11", gpu=0, opened_unix_ns=1_767_225_600_123_000_000)


def test_the_document_has_the_documented_shape() -> None:
    actions = [RemediationState(PROPOSED, KILL_ORPHAN, 1_767_225_900_000_000_000, "container exited 6m ago"),
               RemediationState(DONE, KILL_ORPHAN, 1_767_225_912_500_000_000, "SIGTERM; device released")]
    doc = ticket_document(incident="f42/kill_orphan", audit_seq=17, mode=MODE_ON, finding=FINDING,
                          pods=[{"namespace": "ml", "pod": "train-0", "uid": "u-1"}],
                          evidence={"container_state": "CONTAINER_EXITED", "fds": [3]}, actions=actions)
    assert list(doc) == ["incident", "audit_seq", "mode", "finding", "node", "pods", "evidence", "actions",
                         "sent_at"]
    assert doc["finding"] == {
        "id": 42, "class": "orphaned", "node": "gpu-node-1", "namespace": "ml", "pod": "train-0",
        "container": "worker", "container_id": "0123456789abcdef" * 4, "pid": 4242, "comm": "python3",
        "exe": "/usr/bin/python3.11", "gpu": 0, "opened_at": "2026-01-01T00:00:00.123Z"}
    assert doc["node"] == "gpu-node-1" and doc["audit_seq"] == 17 and doc["mode"] == "on"
    assert doc["actions"] == [
        {"action": "kill_orphan", "state": "proposed", "at": "2026-01-01T00:05:00.000Z",
         "reason": "container exited 6m ago"},
        {"action": "kill_orphan", "state": "done", "at": "2026-01-01T00:05:12.500Z",
         "reason": "SIGTERM; device released"}]
    assert doc["evidence"] == {"container_state": "CONTAINER_EXITED", "fds": [3]}
    assert doc["sent_at"] == ""
    json.dumps(doc)  # JSON as it stands


def test_the_document_copies_what_it_is_given() -> None:
    pods = [{"namespace": "ml", "pod": "train-0"}]
    evidence: dict[str, object] = {"k": "v"}
    doc = ticket_document(incident="f1/ticket", audit_seq=1, mode="dry-run", finding=FINDING, pods=pods,
                          evidence=evidence, actions=[])
    pods[0]["pod"] = "changed"
    evidence["k"] = "changed"
    assert doc["pods"] == [{"namespace": "ml", "pod": "train-0"}] and doc["evidence"] == {"k": "v"}


def test_evidence_that_is_not_json_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"^ticket f1/ticket: its evidence is not JSON") as e:
        ticket_document(incident="f1/ticket", audit_seq=1, mode="on", finding=FINDING, pods=[],
                        evidence={"x": object()}, actions=[])
    assert "\n" not in str(e.value)


def test_a_finding_from_the_query_api() -> None:
    finding = query_pb2.Finding(id=7, node="n1", opened_unix_ns=0)
    c = finding.consumer.consumer
    setattr(c, "class", node_pb2.ConsumerClass.Value("CONSUMER_CLASS_ORPHANED"))
    c.gpu = -1
    c.process.pid, c.process.comm, c.process.exe, c.process.container_id = 99, "holder", "/bin/holder", "abc"
    finding.consumer.k8s.namespace, finding.consumer.k8s.pod = "ns", "p"
    finding.consumer.k8s.container = "c"
    got = TicketFinding.from_proto(finding).to_json()
    assert got == {"id": 7, "class": "orphaned", "node": "n1", "namespace": "ns", "pod": "p",
                   "container": "c", "container_id": "abc", "pid": 99, "comm": "holder",
                   "exe": "/bin/holder", "gpu": None, "opened_at": ""}


def test_the_headers_file(tmp_path: Path) -> None:
    path = tmp_path / "headers"
    path.write_text("# the ticket system's token\n\nAuthorization: Bearer s3cr3t\n  X-Team:  gpu-ops  \n"
                    "X-Empty:\n")
    assert read_headers(str(path)) == {"Authorization": "Bearer s3cr3t", "X-Team": "gpu-ops", "X-Empty": ""}
    assert read_headers("") == {}


@pytest.mark.parametrize(("text", "fragment"), [
    ("Authorization Bearer x\n", "line 1: not a \"Name: value\" header line"),
    ("# ok\nBad Name: x\n", "line 2: not a \"Name: value\" header line"),
    (": value\n", "line 1: not a \"Name: value\""),
    ("X-A: a\x01b\n", "line 1: header X-A has a control character"),
    ("Content-Type: text/plain\n", "line 1: Content-Type is set by ghostgpu itself"),
    ("host: evil\n", "line 1: host is set by ghostgpu itself"),
])
def test_a_bad_headers_line_is_one_line_naming_the_file_and_line(tmp_path: Path, text: str,
                                                                 fragment: str) -> None:
    path = tmp_path / "headers"
    path.write_text(text)
    with pytest.raises(TicketError) as e:
        read_headers(str(path))
    assert str(e.value).startswith(f"remediation.actions.ticket.headers_file {path} ")
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_an_unreadable_or_huge_headers_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(TicketError, match=r"headers_file .*/nope: cannot read it \(No such file"):
        read_headers(str(tmp_path / "nope"))
    big = tmp_path / "big"
    big.write_text("X-A: " + "a" * 70_000 + "\n")
    with pytest.raises(TicketError, match=r"over 65536 bytes"):
        read_headers(str(big))
    binary = tmp_path / "bin"
    binary.write_bytes(b"X-A: \xff\n")
    with pytest.raises(TicketError, match=r"not UTF-8"):
        read_headers(str(binary))


def test_the_url() -> None:
    t = TicketTarget.parse("https://tickets.example.com/api/v1/ghostgpu?queue=gpu&token=t")
    assert (t.scheme, t.host, t.port, t.path) == ("https", "tickets.example.com", 443,
                                                   "/api/v1/ghostgpu?queue=gpu&token=t")
    assert t.display == "https://tickets.example.com:443/api/v1/ghostgpu"  # the query may hold a token
    t = TicketTarget.parse("http://[::1]:8080")
    assert (t.host, t.port, t.path, t.display) == ("::1", 8080, "/", "http://[::1]:8080")


@pytest.mark.parametrize(("url", "fragment"), [
    ("ftp://x/", "use http(s)://HOST"),
    ("tickets.example.com", "use http(s)://HOST"),
    ("http://host:99999/", "remediation.actions.ticket.url 'http://host:99999/': Port out of range"),
    ("https://user:pw@host/", "credentials in the URL would be logged"),
    ("http://host/#x", "a #fragment is never sent"),
])
def test_a_bad_url_is_one_line_naming_the_key(url: str, fragment: str) -> None:
    with pytest.raises(TicketError) as e:
        TicketTarget.parse(url)
    assert str(e.value).startswith("remediation.actions.ticket.url")
    assert fragment in str(e.value) and "\n" not in str(e.value)
    assert "pw" not in str(e.value)


def test_a_bad_headers_file_fails_at_load_too(tmp_path: Path) -> None:
    path = tmp_path / "headers"
    path.write_text("nonsense\n")
    with pytest.raises(TicketError, match="line 1"):
        TicketSender("http://127.0.0.1:9/", str(path))


def test_retry_after() -> None:
    assert retry_after_s("7", 0.0) == 7.0
    assert retry_after_s("Thu, 01 Jan 2026 00:00:30 GMT", 1_767_225_600.0) == 30.0
    assert retry_after_s("Thu, 01 Jan 2026 00:00:30 GMT", 1_767_225_700.0) == 0.0  # past: at once
    assert retry_after_s("soon", 0.0) is None


def test_the_queue_is_bounded_and_drops_the_oldest() -> None:
    sender = TicketSender("http://127.0.0.1:9/", max_queue=3)  # never started: nothing leaves the queue
    for i in range(5):
        sender.submit({"incident": f"f{i}/ticket"})
    assert sender.stats() == {"sent": 0, "failed": 0, "dropped": 2, "retries": 0, "queued": 3}
    assert [t.incident for t in sender._queue] == ["f2/ticket", "f3/ticket", "f4/ticket"]



@dataclass
class Setting:
    url: str
    headers_file: str = ""


def test_the_desk_builds_no_connection_on_the_loop_retries_a_refused_setting_and_hands_over_the_queue(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A sender is built without reading a file or making an SSL context (its thread does that); a
    setting whose sender could not be built is tried again at the next submit; a new url's sender takes
    the tickets the old one still had waiting."""
    monkeypatch.setattr(TicketSender, "start", lambda self: None)  # nothing leaves a queue here
    monkeypatch.setattr(TicketSender, "stop", lambda self, timeout_s=2.0: None)
    broken = tmp_path / "headers"
    broken.write_text("nonsense\n")  # read at each POST, not when the sender is built
    setting = Setting("https://user:pw@tickets.example.com/", str(broken))  # refused: credentials in the URL
    desk = TicketDesk(lambda: setting)
    desk.submit({"incident": "f1/kill_orphan"})
    assert desk.stats()["queued"] == 0
    setting.url = "https://tickets.example.com/a"
    desk.submit({"incident": "f2/kill_orphan"})
    desk.submit({"incident": "f3/kill_orphan"})
    first = desk._sender
    assert first is not None and first._http is None and desk.stats()["queued"] == 2
    setting.url = "https://tickets.example.com/b"
    desk.submit({"incident": "f4/kill_orphan"})
    second = desk._sender
    assert second is not None and second is not first
    assert [t.incident for t in second._queue] == ["f2/kill_orphan", "f3/kill_orphan", "f4/kill_orphan"]
    assert first.stats()["queued"] == 0
