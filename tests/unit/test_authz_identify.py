"""collector/authz.py `Identify`: every branch of who a caller is, one row each, with real certificates
from the test PKI (tests/helpers/certs.py) and, where the branch needs one, a real loopback socket.

The rule that matters most: a certificate the CA signed but that names no ghostgpu identity (no
SPIFFE ID and no usable CN, a foreign trust domain, two IDs, an unknown path) is `anonymous`, over
mTLS, and never falls through to the transport's uid: on a loopback connection from root that would
be `uid:0`, which the built-in policy makes admin. The last test runs that attack against a real
collector over real TLS.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from ghostgpu.cli.certs import Pair
from ghostgpu.collector.authz import Identify
from ghostgpu.collector.config import CollectorConfig
from ghostgpu.collector.main import Collector
from ghostgpu.collector.peers import UnixGate

from ghostgpu.common.transport.principal import Principal
from ghostgpu.v1 import query_pb2
from tests.helpers.certs import Pki
from tests.helpers.collector_env import QueryClient
from tests.helpers.who_server import WHO, who_server

TD = "ghostgpu"
REMOTE = "ipv4:10.0.0.9:5555"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


def bare_leaf(pki: Pki, *, cn: str | None = None, orgs: Sequence[str] = (), uris: Sequence[str] = (),
              dns: Sequence[str] = ()) -> Pair:
    """A client certificate signed by the test CA with exactly these subject fields and SANs (none at
    all by default: an empty subject, no SAN), which `ghostgpu certs` would never issue."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert = x509.load_pem_x509_certificate(pki.ca.cert_pem)
    ca_key = serialization.load_pem_private_key(pki.ca.key_pem, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    attrs += [x509.NameAttribute(NameOID.COMMON_NAME, cn)] if cn is not None else []
    now = dt.datetime.now(dt.UTC)
    builder = (x509.CertificateBuilder().subject_name(x509.Name(attrs)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),
                              critical=False))
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
    sans += [x509.DNSName(d) for d in dns]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return Pair(cert.public_bytes(serialization.Encoding.PEM), key_pem)


@dataclass
class Context:
    """The two things Identify reads of a grpc.aio.ServicerContext."""

    peer_: str
    auth: dict[str, list[bytes]]

    def peer(self) -> str:
        return self.peer_

    def auth_context(self) -> dict[str, list[bytes]]:
        return self.auth


def mtls(pem: bytes | None) -> dict[str, list[bytes]]:
    """What grpc's auth context holds after a verified handshake (x509_pem_cert: the client's)."""
    auth = {"transport_security_type": [b"ssl"]}
    if pem is not None:
        auth["x509_pem_cert"] = [pem]
    return auth


@contextlib.contextmanager
def loopback_connection() -> Iterator[tuple[str, int]]:
    """A real established loopback TCP connection: (gRPC's peer string for the client end, server port)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            conn, _ = server.accept()
            with conn:
                host, cport = client.getsockname()
                yield f"ipv4:{host}:{cport}", port


def anonymous(via: str, peer: str) -> Principal:
    return Principal("anonymous", via=via, peer=peer)


def cert_rows(pki: Pki) -> list[tuple[str, bytes | None, Principal]]:
    """(branch, client certificate, who Identify must say) for every certificate case."""
    foreign = Pki(pki.dir / "foreign", trust_domain="other")
    return [
        ("spiffe-node", pki.node("n1").cert_pem, Principal("node", "n1", (), "mtls", REMOTE)),
        ("spiffe-user-with-groups", pki.user("alice", ["ops", "ml"]).cert_pem,
         Principal("user", "alice", ("ops", "ml"), "mtls", REMOTE)),
        ("cn-and-o-without-spiffe", bare_leaf(pki, cn="bob", orgs=["dev", "ops"]).cert_pem,
         Principal("user", "bob", ("dev", "ops"), "mtls", REMOTE)),
        ("cn-without-o", bare_leaf(pki, cn="carol").cert_pem, Principal("user", "carol", (), "mtls", REMOTE)),
        ("foreign-trust-domain", foreign.node("n1").cert_pem, anonymous("mtls", REMOTE)),
        ("foreign-trust-domain-signed-by-our-ca",
         bare_leaf(pki, cn="n1", uris=["spiffe://other/node/n1"]).cert_pem, anonymous("mtls", REMOTE)),
        ("two-spiffe-ids", bare_leaf(pki, cn="x", uris=["spiffe://ghostgpu/node/a",
                                                        "spiffe://ghostgpu/user/b"]).cert_pem,
         anonymous("mtls", REMOTE)),
        ("unknown-spiffe-path", bare_leaf(pki, cn="x", uris=["spiffe://ghostgpu/admin/root"]).cert_pem,
         anonymous("mtls", REMOTE)),
        ("spiffe-path-too-deep", bare_leaf(pki, cn="x", uris=["spiffe://ghostgpu/node/a/b"]).cert_pem,
         anonymous("mtls", REMOTE)),
        ("the-collector-certificate", pki.collector().cert_pem, anonymous("mtls", REMOTE)),
        ("no-cn-no-san", bare_leaf(pki).cert_pem, anonymous("mtls", REMOTE)),
        ("only-o-no-cn", bare_leaf(pki, orgs=["system:masters"]).cert_pem, anonymous("mtls", REMOTE)),
        ("dns-san-only", bare_leaf(pki, dns=["root.example"]).cert_pem, anonymous("mtls", REMOTE)),
        ("cn-that-is-no-name", bare_leaf(pki, cn="0 root").cert_pem, anonymous("mtls", REMOTE)),
        ("tls-without-a-client-certificate", None, anonymous("mtls", REMOTE)),
    ]


CERT_CASES = ["spiffe-node", "spiffe-user-with-groups", "cn-and-o-without-spiffe", "cn-without-o",
              "foreign-trust-domain", "foreign-trust-domain-signed-by-our-ca", "two-spiffe-ids",
              "unknown-spiffe-path", "spiffe-path-too-deep", "the-collector-certificate", "no-cn-no-san",
              "only-o-no-cn", "dns-san-only", "cn-that-is-no-name", "tls-without-a-client-certificate"]


@pytest.fixture(scope="module")
def rows(pki: Pki) -> dict[str, tuple[bytes | None, Principal]]:
    built = {name: (pem, want) for name, pem, want in cert_rows(pki)}
    assert list(built) == CERT_CASES
    return built


@pytest.mark.parametrize("case", CERT_CASES)
def test_a_verified_certificate_names_its_identity_or_nobody(rows: dict[str, tuple[bytes | None, Principal]],
                                                             case: str) -> None:
    pem, want = rows[case]
    got = Identify(TD)(Context(REMOTE, mtls(pem)))  # type: ignore[arg-type]
    assert got == want
    assert got.subject != "uid:0" and got.kind != "uid"


@pytest.mark.parametrize("case", [c for c in CERT_CASES if c not in (
    "spiffe-node", "spiffe-user-with-groups", "cn-and-o-without-spiffe", "cn-without-o")])
def test_an_identity_less_certificate_over_loopback_from_root_is_not_the_socket_owner(
        rows: dict[str, tuple[bytes | None, Principal]], case: str) -> None:
    """TLS on a loopback connection whose socket this process (root, in CI) owns: the certificate, not the
    socket's uid, says who calls. Falling back to the uid would make the certificate admin."""
    pem, _ = rows[case]
    with loopback_connection() as (peer, port):
        identify = Identify(TD, server_ports={port})
        assert identify(Context(peer, {})) == Principal("uid", str(os.getuid()), via="loopback", peer=peer)
        assert identify(Context(peer, mtls(pem))) == anonymous("mtls", peer)  # type: ignore[arg-type]


def test_the_unix_socket_peer_is_the_uid_its_gate_saw(tmp_path: Path) -> None:
    """A real gRPC server behind a real UnixGate, Identify in the handler: through the public socket the
    caller is the uid SO_PEERCRED gave the gate; straight to the server's own socket it is nobody."""
    gate = UnixGate(str(tmp_path / "public.sock"))
    identify = Identify(TD, gates=[gate])
    seen: list[Principal] = []

    async def who(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        seen.append(identify(context))
        return b""

    with who_server(gate.internal_address, who):
        gate.start()
        try:
            with grpc.insecure_channel(f"unix://{tmp_path}/public.sock") as ch:
                ch.unary_unary(WHO)(b"", timeout=10)
            with grpc.insecure_channel(gate.internal_address) as ch:
                ch.unary_unary(WHO)(b"", timeout=10)
        finally:
            gate.stop()
    relayed, direct = seen
    assert (relayed.kind, relayed.name, relayed.via) == ("uid", str(os.getuid()), "unix")
    assert (direct.kind, direct.via) == ("anonymous", "plaintext")


def test_a_loopback_peer_is_the_uid_owning_its_socket() -> None:
    with loopback_connection() as (peer, port):
        assert Identify(TD, server_ports={port})(Context(peer, {})) == Principal(  # type: ignore[arg-type]
            "uid", str(os.getuid()), via="loopback", peer=peer)
        # Not one of the server's ports: the socket is someone else's connection, so nobody.
        assert Identify(TD, server_ports={port + 1 if port < 65535 else 1})(
            Context(peer, {})) == anonymous("plaintext", peer)  # type: ignore[arg-type]


@pytest.mark.parametrize("peer", [REMOTE, "ipv6:[2001:db8::5]:4000", "ipv4:10.0.0.1:1", "", "unknown"])
def test_a_plaintext_peer_elsewhere_is_anonymous(peer: str) -> None:
    """--insecure on a non-loopback address: no certificate, no kernel word on the uid."""
    assert Identify(TD, server_ports={7450})(Context(peer, {})) == anonymous("plaintext", peer)  # type: ignore[arg-type]
    insecure = {"transport_security_type": [b"insecure"], "x509_pem_cert": [b"-----BEGIN CERTIFICATE-----"]}
    assert Identify(TD, server_ports={7450})(Context(peer, insecure)).kind == "anonymous"  # type: ignore[arg-type]


# --- the attack, against the real collector over real TLS ---------------------------------------

@pytest.fixture
def collector(tmp_path: Path, pki: Pki) -> Iterator[tuple[Collector, Path]]:
    """A collector serving mTLS on loopback with the built-in policy (uid 0 and its own uid are admin)."""
    audit = tmp_path / "audit.jsonl"
    tls = pki.write("collector", pki.collector())
    config = CollectorConfig(listen=("127.0.0.1:0",), db_path=str(tmp_path / "c.db"), tls_cert=tls.cert,
                             tls_key=tls.key, tls_ca=tls.ca, audit_log=str(audit))
    c = Collector(config).start()
    try:
        yield c, audit
    finally:
        c.stop(grace_s=0.5)


@pytest.mark.parametrize(("case", "fields"), [
    ("no-cn-no-san", {}),
    ("only-o-no-cn", {"orgs": ["admins"]}),
    ("unknown-spiffe-path", {"cn": "x", "uris": ["spiffe://ghostgpu/admin/root"]}),
    ("cn-that-is-no-name", {"cn": "0 root"}),
])
def test_an_identity_less_certificate_gets_nothing_from_a_real_collector(
        collector: tuple[Collector, Path], pki: Pki, case: str, fields: dict[str, Any]) -> None:
    """The built-in policy makes uid 0 admin: a certificate taken for `uid:0` would be admin, whoever
    runs this."""
    c, audit = collector
    files = pki.write(f"client-{case}", bare_leaf(pki, **fields))
    with QueryClient(c.address, tls=files) as client:
        for call in (client.consumers, lambda: client.stub.ListAudit(query_pb2.ListAuditRequest(),
                                                                      metadata=client.metadata, timeout=10)):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
            assert "anonymous" in e.value.details()  # type: ignore[attr-defined]
    denied = [json.loads(line) for line in audit.read_text().splitlines() if '"denied"' in line]
    assert {(r["subject"], r["detail"]["via"]) for r in denied} == {("anonymous", "mtls")}

