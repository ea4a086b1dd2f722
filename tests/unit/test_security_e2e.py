"""The collector's security end to end, no root needed: a real Collector serving mTLS on loopback, tracers
(tests/helpers/sim_tracer.py) and clients with certificates from a real CA (tests/helpers/certs.py),
the policy from a file, and the audit log read back from disk. No mock of the TLS layer anywhere."""

from __future__ import annotations

import json
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from ghostgpu.cli import main as cli
from ghostgpu.collector.config import CollectorConfig
from ghostgpu.collector.main import Collector

from ghostgpu.common.model.consumers import ConsumerClass
from ghostgpu.common.transport.tls import TlsFiles
from tests.helpers.audit_log import audit_records, secure_options
from tests.helpers.certs import EXPIRED, Pki, serial_of, write_file
from tests.helpers.cri_fake import FakeCri
from tests.helpers.polling import wait_until
from tests.helpers.sim_tracer import SimTracer, StreamEnded, finding, make_consumer
from tests.helpers.trace_env import FAST, TraceClient, cri_via

A = "a1" * 32
POLICY = """
rules:
  - role: trace-operator
    subjects: ["user:alice"]
    namespaces: ["ml-*"]
    max_duration: 5m
  - role: viewer
    subjects: ["user:alice", "group:ops"]
  - role: tracer
    subjects: ["node:*"]
"""


@dataclass
class Secure:
    collector: Collector
    pki: Pki
    server: TlsFiles
    policy: Path
    audit: Path
    cri: FakeCri

    def tracer(self, node: str, tls: TlsFiles) -> SimTracer:
        return SimTracer(self.collector.address, node, tls=tls, cri=cri_via(self.cri),
                         capabilities=("cri-relay", "trace"))

    def client(self, tls: TlsFiles) -> TraceClient:
        return TraceClient(self.collector.address, tls=tls)

    def audit_records(self, action: str | None = None) -> list[dict[str, Any]]:
        return audit_records(self.audit, action)


@pytest.fixture
def secure(tmp_path: Path) -> Iterator[Secure]:
    pki, opts, audit = secure_options(tmp_path, POLICY)
    policy = Path(opts.policy_path or "")
    fake = FakeCri().start()
    fake.add_sandbox("sb-ml", "trainer-0", "ml-train", "uid-trainer-0")
    fake.add_container(A, "sb-ml", "main")
    fake.add_sandbox("sb-prod", "api-0", "prod", "uid-api-0")
    fake.add_container("b2" * 32, "sb-prod", "main")
    c = Collector(CollectorConfig(listen=("127.0.0.1:0",), db_path=str(tmp_path / "c.db")), trace_timing=FAST,
                  security=opts).start()
    try:
        yield Secure(c, pki, opts.tls, policy, audit, fake)
    finally:
        c.stop(grace_s=0.5)
        fake.close()


def test_a_tracer_with_its_node_certificate_streams_and_is_audited(secure: Secure) -> None:
    t = secure.tracer("n1", secure.pki.write("node-n1", secure.pki.node("n1")))
    t.connect()
    t.send_events([finding(1, make_consumer("n1", 42))])
    t.wait_acked(1)
    t.stop()
    wait_until(lambda: secure.audit_records("tracer.disconnect"), "the disconnect audited")
    connect = secure.audit_records("tracer.connect")[0]
    assert (connect["subject"], connect["result"], connect["detail"]["node"]) == ("node:n1", "ok", "n1")
    assert connect["detail"]["via"] == "mtls"


def test_a_node_certificate_cannot_speak_for_another_node(secure: Secure) -> None:
    t = secure.tracer("n2", secure.pki.write("node-n1", secure.pki.node("n1")))
    with pytest.raises(StreamEnded) as e:
        t.connect()
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "the certificate of node n1 cannot speak for node n2" in e.value.details
    refused = secure.audit_records("tracer.refused")
    assert [(r["subject"], r["result"], r["detail"]["node"]) for r in refused] == [
        ("node:n1", "denied", "n2")]


@pytest.mark.parametrize("how", ["another CA", "expired", "no certificate"])
def test_a_tracer_is_refused_at_the_handshake(secure: Secure, tmp_path: Path, how: str) -> None:
    if how == "another CA":
        other = Pki(tmp_path / "other")
        tls = other.write("node-n1", other.node("n1"), ca_path=secure.pki.ca_path)
    elif how == "expired":
        # The tracer itself refuses to start with it (tracer/node.py tracer_tls); send it anyway.
        old = secure.pki.node("n1", **EXPIRED)
        creds = grpc.ssl_channel_credentials(Path(secure.pki.ca_path).read_bytes(), old.key_pem, old.cert_pem)
        t = SimTracer(secure.collector.address, "n1", credentials=creds)
    else:
        tls = secure.pki.client()
    if how != "expired":
        t = secure.tracer("n1", tls)
    with pytest.raises(StreamEnded) as e:
        t.connect(timeout_s=5.0)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert secure.audit_records("tracer.connect") == []


def test_a_user_traces_only_within_the_policy(secure: Secure) -> None:
    t = secure.tracer("n1", secure.pki.write("node-n1", secure.pki.node("n1")))
    t.connect()
    with secure.client(secure.pki.write("user-alice", secure.pki.user("alice"))) as alice:
        s = alice.start(namespace="ml-train", duration_ms=60_000)
        assert s.requested_by == "user:alice"
        code, details = alice.start_error(namespace="prod", duration_ms=60_000)
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert "user:alice" in details and "prod" in details and "ml-*" in details
        code, details = alice.start_error(namespace="ml-train", duration_ms=600_000)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "5m" in details
        alice.stop(s.id)
    with secure.client(secure.pki.write("user-bob", secure.pki.user("bob", groups=["ops"]))) as bob:
        assert bob.consumers() == []  # viewer through group:ops
        code, details = bob.start_error(namespace="ml-train")
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert "StartTrace" in details and "user:bob" in details and "trace-operator" in details
    denied = secure.audit_records("denied")
    assert [r["subject"] for r in denied] == ["user:alice", "user:alice", "user:bob"]
    assert {r["action"] for r in secure.audit_records()} >= {"trace.start", "trace.stop", "denied"}


def test_a_user_without_a_certificate_is_refused(secure: Secure) -> None:
    with secure.client(secure.pki.client()) as nobody, pytest.raises(grpc.RpcError) as e:
        nobody.consumers()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_plaintext_client_against_the_tls_port_gets_one_clear_line(
        secure: Secure, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["ps", "--collector", secure.collector.address]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "TLS" in err and "--tls-ca" in err and secure.collector.address in err


def test_the_cli_with_a_user_certificate_works(secure: Secure, capsys: pytest.CaptureFixture[str]) -> None:
    alice = secure.pki.write("user-alice", secure.pki.user("alice"))
    assert cli.main(["ps", "--collector", secure.collector.address, "--tls-cert", str(alice.cert),
                     "--tls-key", str(alice.key), "--tls-ca", str(alice.ca), "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def _server_serial(address: str, tls: TlsFiles) -> int:
    """The serial of the certificate the collector presents to a new handshake."""
    host, _, port = address.rpartition(":")
    ctx = ssl.create_default_context(cafile=tls.ca)
    ctx.load_cert_chain(tls.cert, tls.key)
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname=host) as s:
        der = s.getpeercert(binary_form=True)
    return serial_of(ssl.DER_cert_to_PEM_cert(der).encode())


def test_rotated_certificates_keep_open_streams_and_serve_new_handshakes(secure: Secure) -> None:
    alice = secure.pki.write("user-alice", secure.pki.user("alice"))
    before = _server_serial(secure.collector.address, alice)
    t = secure.tracer("n1", secure.pki.write("node-n1", secure.pki.node("n1")))
    t.connect()
    t.send_events([finding(1, make_consumer("n1", 42))])
    t.wait_acked(1)
    fresh = secure.pki.collector()
    write_file(Path(secure.server.cert), fresh.cert_pem)  # cert-manager rewrites the Secret
    write_file(Path(secure.server.key), fresh.key_pem, 0o600)
    wait_until(lambda: _server_serial(secure.collector.address, alice) == serial_of(fresh.cert_pem),
               "a new handshake presents the new certificate")
    assert before != serial_of(fresh.cert_pem)
    # The stream opened before the rotation is still the same stream, and still acknowledged.
    t.send_events([finding(2, make_consumer("n1", 43, cls=ConsumerClass.GHOST))])
    t.wait_acked(2)
    assert t.status is None
    assert [r["result"] for r in secure.audit_records("tls.reload")] == ["ok"]


def test_a_bad_policy_reload_keeps_the_old_policy(secure: Secure) -> None:
    secure.policy.write_text(POLICY.replace("role: viewer", "role: boss"))
    wait_until(lambda: secure.audit_records("policy.reload_error"), "the bad policy refused")
    line = secure.audit_records("policy.reload_error")[0]["detail"]["detail"]
    assert "rules[1].role" in line and "boss" in line
    with secure.client(secure.pki.write("user-bob", secure.pki.user("bob", groups=["ops"]))) as bob:
        assert bob.consumers() == []  # the old policy: bob is still a viewer
    secure.policy.write_text(POLICY.replace('"group:ops"', '"group:nobody"'))
    wait_until(lambda: secure.audit_records("policy.reload"), "the good policy loaded")
    with secure.client(secure.pki.write("user-bob", secure.pki.user("bob", groups=["ops"]))) as bob, \
            pytest.raises(grpc.RpcError) as e:
        bob.consumers()
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_the_audit_chain_verifies(secure: Secure, capsys: pytest.CaptureFixture[str]) -> None:
    t = secure.tracer("n1", secure.pki.write("node-n1", secure.pki.node("n1")))
    t.connect()
    t.stop()
    wait_until(lambda: secure.audit_records("tracer.disconnect"), "the disconnect audited")
    assert cli.main(["audit", "--db", str(Path(secure.audit).with_name("c.db")), "--file", str(secure.audit),
                     "--verify"]) == 0
    assert "intact" in capsys.readouterr().out


def test_repeated_denials_fold_into_one_audit_record(secure: Secure) -> None:
    with secure.client(secure.pki.write("user-eve", secure.pki.user("eve"))) as eve:
        for _ in range(20):
            with pytest.raises(grpc.RpcError) as e:
                eve.consumers()
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    denied = secure.audit_records("denied")
    assert [(r["subject"], r["detail"]["method"]) for r in denied] == [
        ("user:eve", "/ghostgpu.v1.Query/ListConsumers")]
    assert secure.collector.security.authorizer.denied_total == 20
