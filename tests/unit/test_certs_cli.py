"""`ghostgpu certs init|issue` through the real CLI: the files, their modes, what is inside them
(the identity format of docs/SECURITY.md), the refusals, and a real TLS handshake with the result."""

from __future__ import annotations

import datetime as dt
import os
import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from ghostgpu.cli.main import main

from ghostgpu.common.transport.tls import (
    TlsFiles,
    check_client,
    check_server,
    not_after,
    not_before,
    principal_from_auth_context,
)


def certs(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["certs", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def uris(cert: x509.Certificate) -> list[str]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return list(san.get_values_for_type(x509.UniformResourceIdentifier))


@pytest.fixture
def ca_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    d = tmp_path / "pki"
    assert certs(capsys, "init", "--dir", str(d))[0] == 0
    return d


def test_init_writes_a_private_ca_and_refuses_to_overwrite(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "pki"
    code, out, _ = certs(capsys, "init", "--dir", str(d), "--days", "30")
    assert code == 0 and f"wrote {d}/ca.crt and {d}/ca.key (trust domain ghostgpu)" in out
    assert stat.S_IMODE(os.stat(d / "ca.key").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(d / "ca.crt").st_mode) == 0o644
    ca = load(d / "ca.crt")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert uris(ca) == ["spiffe://ghostgpu"]
    assert abs((not_after(ca) - dt.datetime.now(dt.UTC)) - dt.timedelta(days=30)) < dt.timedelta(minutes=1)
    first = (d / "ca.crt").read_bytes()

    code, _, err = certs(capsys, "init", "--dir", str(d))
    assert code == 2
    assert err == (f"ghostgpu: {d}/ca.crt: exists; pass --force to replace it (clients holding the old one "
                   "keep working until it expires)\n")
    assert (d / "ca.crt").read_bytes() == first
    assert certs(capsys, "init", "--dir", str(d), "--force")[0] == 0
    assert (d / "ca.crt").read_bytes() != first


def test_issue_node_user_and_collector(ca_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = certs(capsys, "issue", "--dir", str(ca_dir), "--node", "gpu-node-1.example")
    assert code == 0 and f"--tls-cert {ca_dir}/node-gpu-node-1.example.crt" in out
    assert certs(capsys, "issue", "--dir", str(ca_dir), "--user", "alice", "--group", "ops", "--group",
                 "ml-team")[0] == 0
    assert certs(capsys, "issue", "--dir", str(ca_dir), "--collector", "collector.ghostgpu.svc,10.0.0.5",
                 "--collector", "127.0.0.1", "--days", "7")[0] == 0

    node = load(ca_dir / "node-gpu-node-1.example.crt")
    assert uris(node) == ["spiffe://ghostgpu/node/gpu-node-1.example"]
    assert node.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "gpu-node-1.example"
    user = load(ca_dir / "user-alice.crt")
    assert uris(user) == ["spiffe://ghostgpu/user/alice"]
    orgs = user.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    assert [a.value for a in orgs] == ["ops", "ml-team"]
    coll = load(ca_dir / "collector.crt")
    san = coll.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["collector.ghostgpu.svc"]
    assert [str(i) for i in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.5", "127.0.0.1"]
    assert uris(coll) == ["spiffe://ghostgpu/collector"]
    assert coll.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "collector.ghostgpu.svc"
    def usages(cert: x509.Certificate) -> list[x509.ObjectIdentifier]:
        return list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)

    assert usages(coll) == [ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH]
    assert usages(node) == usages(user) == [ExtendedKeyUsageOID.CLIENT_AUTH]

    now = dt.datetime.now(dt.UTC)
    for cert in (node, user, coll):
        assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
        assert cert.public_key().curve.name == "secp256r1"
        assert isinstance(cert.signature_hash_algorithm, hashes.SHA256)
        assert dt.timedelta(minutes=4) < now - not_before(cert) < dt.timedelta(minutes=6)
    assert abs((not_after(coll) - now) - dt.timedelta(days=7)) < dt.timedelta(minutes=1)
    assert stat.S_IMODE(os.stat(ca_dir / "user-alice.key").st_mode) == 0o600
    assert len({c.serial_number for c in (node, user, coll)}) == 3

    # The files pass the checks the commands run at start, and name who they say.
    ca = str(ca_dir / "ca.crt")
    check_server(TlsFiles(str(ca_dir / "collector.crt"), str(ca_dir / "collector.key"), ca))
    stem = ca_dir / "node-gpu-node-1.example"
    check_client(TlsFiles(f"{stem}.crt", f"{stem}.key", ca), require_cert=True)
    auth = {"transport_security_type": [b"ssl"], "x509_pem_cert": [(ca_dir / "user-alice.crt").read_bytes()]}
    principal = principal_from_auth_context(auth, "ghostgpu", "peer")
    assert principal is not None and principal.subjects() == ("user:alice", "group:ops", "group:ml-team")


def test_trust_domain_comes_from_the_ca(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "pki"
    monkeypatch.setenv("GHOSTGPU_TLS_TRUST_DOMAIN", "from-env")
    assert certs(capsys, "init", "--dir", str(d), "--trust-domain", "prod.example")[0] == 0
    assert certs(capsys, "issue", "--dir", str(d), "--node", "n1")[0] == 0
    assert uris(load(d / "node-n1.crt")) == ["spiffe://prod.example/node/n1"]
    assert certs(capsys, "issue", "--dir", str(d), "--node", "n1", "--trust-domain", "other",
                 "--force")[0] == 0
    assert uris(load(d / "node-n1.crt")) == ["spiffe://other/node/n1"]


@pytest.mark.parametrize(("argv", "line"), [
    (["issue", "--node", "bad_name!"], "--node 'bad_name!': a node name is letters, digits, '.' and '-', "
     "starting and ending with a letter or digit, at most 253 characters"),
    (["issue", "--user=-alice"], "--user '-alice': a user name is letters"),
    (["issue", "--user", "alice", "--group", "a b"], "--group 'a b': a group name is letters"),
    (["issue", "--node", "n1", "--group", "ops"], "--group: only a --user certificate carries groups"),
    (["issue", "--collector", "bad host"], "--collector 'bad host': not a DNS name or IP address; give the "
     "names clients dial"),
    (["issue", "--collector", ","], "--collector: give at least one host name or IP address clients dial"),
    (["issue", "--node", "n1", "--trust-domain", "UPPER"], "--trust-domain 'UPPER': a trust domain is "
     "lowercase letters"),
    (["init", "--trust-domain", "a/b", "--force"], "--trust-domain 'a/b': a trust domain is lowercase"),
])
def test_bad_input_is_one_line(ca_dir: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                               line: str) -> None:
    code, _, err = certs(capsys, argv[0], "--dir", str(ca_dir), *argv[1:])
    assert code == 2 and err.startswith(f"ghostgpu: {line}") and err.count("\n") == 1, err


def test_issue_needs_init(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "empty"
    code, _, err = certs(capsys, "issue", "--dir", str(d), "--node", "n1")
    assert code == 2 and err == f"ghostgpu: --dir {d}: no ca.crt; run `ghostgpu certs init --dir {d}` first\n"
    with pytest.raises(SystemExit) as exit_:
        main(["certs", "init", "--dir", str(d), "--days", "0"])
    assert exit_.value.code == 2 and "'0': give a number of days above 0" in capsys.readouterr().err


def test_issued_files_complete_a_verified_handshake(ca_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """OpenSSL (Python's ssl) on both ends: the server verifies the node's certificate against
    ca.crt, the client verifies the collector's, including its name."""
    certs(capsys, "issue", "--dir", str(ca_dir), "--collector", "localhost,127.0.0.1")
    certs(capsys, "issue", "--dir", str(ca_dir), "--node", "n1")
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(ca_dir / "collector.crt", ca_dir / "collector.key")
    server_ctx.load_verify_locations(ca_dir / "ca.crt")
    server_ctx.verify_mode = ssl.CERT_REQUIRED
    client_ctx = ssl.create_default_context(cafile=str(ca_dir / "ca.crt"))
    client_ctx.load_cert_chain(ca_dir / "node-n1.crt", ca_dir / "node-n1.key")
    seen: dict[str, object] = {}
    a, b = socket.socketpair()

    def serve() -> None:
        with server_ctx.wrap_socket(a, server_side=True) as tls:
            seen["client"] = tls.getpeercert()
            tls.sendall(b"ok")

    thread = threading.Thread(target=serve)
    thread.start()
    with client_ctx.wrap_socket(b, server_hostname="localhost") as tls:
        assert tls.recv(2) == b"ok"
    thread.join(timeout=10)
    client = seen["client"]
    assert isinstance(client, dict)
    assert ("URI", "spiffe://ghostgpu/node/n1") in client["subjectAltName"]
