"""ghostgpu/common/transport/tls.py and tls_explain.py without a handshake: the tables behind the contract.

Where plaintext is allowed, who a verified certificate names, the one-line errors for each bad
file, and the line a client gets for each way a TLS connection fails (the details strings are the
ones grpcio 1.85 gives; tests/unit/test_tls_grpc.py gets them from real handshakes).
"""

from __future__ import annotations

import builtins
import logging
import re
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ghostgpu.common.transport import tls
from ghostgpu.common.transport.principal import Principal
from ghostgpu.common.transport.tls import (
    TlsError,
    TlsFiles,
    check_client,
    check_server,
    principal_from_auth_context,
)
from ghostgpu.common.transport.tls_explain import explain_connect_failure, probe_tls
from tests.helpers.certs import EXPIRED, NOT_YET_VALID, Pki, write_file


@pytest.mark.parametrize(("listen", "allowed"), [
    ("unix:///run/ghostgpu/collector.sock", True),
    ("127.0.0.1:7450", True),
    ("127.1.2.3:7450", True),
    ("localhost:7450", True),
    ("LOCALHOST:0", True),
    ("[::1]:7450", True),
    ("[::ffff:127.0.0.1]:7450", True),
    ("0.0.0.0:7450", False),
    ("[::]:7450", False),
    (":7450", False),
    ("10.0.0.5:7450", False),
    ("collector.example:7450", False),
    ("localhost.example.com:7450", False),
])
def test_plaintext_allowed(listen: str, allowed: bool) -> None:
    assert tls.plaintext_allowed(listen) is allowed


def test_resolve_fills_from_env_and_names_the_variable(tmp_path: Path) -> None:
    env = {"GHOSTGPU_TLS_CERT": "/e/c.crt", "GHOSTGPU_TLS_KEY": "/e/c.key", "GHOSTGPU_TLS_CA": "/e/ca.crt",
           "GHOSTGPU_TLS_TRUST_DOMAIN": "prod.example"}
    files = TlsFiles.resolve(cert="/f/c.crt", env=env)
    assert (files.cert, files.key, files.ca, files.trust_domain) == ("/f/c.crt", "/e/c.key", "/e/ca.crt",
                                                                    "prod.example")
    assert files.enabled and files.label("cert") == "--tls-cert" and files.label("key") == "GHOSTGPU_TLS_KEY"
    assert not TlsFiles.resolve(env={}).enabled and TlsFiles.resolve(env={}).trust_domain == "ghostgpu"
    with pytest.raises(TlsError, match=r"^GHOSTGPU_TLS_TRUST_DOMAIN 'Prod!': a trust domain is lowercase"):
        TlsFiles.resolve(env={"GHOSTGPU_TLS_TRUST_DOMAIN": "Prod!"})
    # A missing CA names the flag, even if the user set the variable for another file.
    with pytest.raises(TlsError, match=r"^GHOSTGPU_TLS_CERT /e/c.crt: no such file"):
        check_client(TlsFiles.resolve(ca=str(Pki(tmp_path).ca_path), env=env))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


def _auth(pem: bytes | None, security: bytes = b"ssl") -> dict[str, list[bytes]]:
    auth = {"transport_security_type": [security]}
    if pem is not None:
        auth["x509_pem_cert"] = [pem]
    return auth


def test_principal_from_auth_context(pki: Pki, caplog: pytest.LogCaptureFixture) -> None:
    peer = "ipv4:10.0.0.9:5555"
    foreign = Pki(pki.dir / "foreign", trust_domain="other")
    cases = [
        (pki.node("n1").cert_pem, Principal("node", "n1", (), "mtls", peer), None),
        (pki.user("alice", ["ops", "ml"]).cert_pem, Principal("user", "alice", ("ops", "ml"), "mtls", peer),
         None),
        (pki.leaf(common_name="bob", orgs=["dev"]).cert_pem, Principal("user", "bob", ("dev",), "mtls", peer),
         None),
        (foreign.node("n1").cert_pem, None, "of trust domain 'other', not 'ghostgpu'"),
        (pki.collector().cert_pem, None, "neither spiffe://ghostgpu/node/NAME nor"),
        (pki.leaf(common_name="x", uris=["spiffe://ghostgpu/node/a", "spiffe://ghostgpu/node/b"]).cert_pem,
         None, "has 2 SPIFFE IDs"),
        (pki.leaf(common_name="x", uris=["spiffe://ghostgpu/node/a/b"]).cert_pem, None, "neither"),
        (pki.leaf(common_name="not a name").cert_pem, None, "no SPIFFE ID and no usable CN"),
    ]
    for pem, want, logged in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ghostgpu.common.transport.tls"):
            got = principal_from_auth_context(_auth(pem), "ghostgpu", peer)
        assert got == want, pem
        if logged:
            assert logged in caplog.text
    # No verified certificate: plaintext, or TLS without a client certificate.
    assert principal_from_auth_context({}, "ghostgpu", peer) is None
    assert principal_from_auth_context(_auth(None), "ghostgpu", peer) is None
    assert principal_from_auth_context(_auth(pki.node("n1").cert_pem, b"insecure"), "ghostgpu", peer) is None
    assert principal_from_auth_context(_auth(foreign.node("n1").cert_pem), "other", peer) == Principal(
        "node", "n1", (), "mtls", peer)


def _good(pki: Pki, stem: str = "srv") -> TlsFiles:
    return pki.write(stem, pki.collector())


def _case_files(pki: Pki, case: str) -> TlsFiles:
    """The files of each bad case in test_tls_error_lines, made under pki.dir/case."""
    d = pki.dir / case
    d.mkdir(exist_ok=True)
    good = _good(pki)
    if case == "missing":
        return TlsFiles(str(d / "nope.crt"), good.key, good.ca)
    if case == "directory":
        return TlsFiles(good.cert, good.key, str(d))
    if case == "not-pem":
        return TlsFiles(str(write_file(d / "c.crt", b"\x30\x82 DER bytes")), good.key, good.ca)
    if case == "key-as-cert":
        return TlsFiles(good.key, good.key, good.ca)
    if case == "half-written":
        pem = pki.collector().cert_pem
        return TlsFiles(str(write_file(d / "c.crt", pem[: len(pem) // 2] + b"-----END CERTIFICATE-----\n")),
                        good.key, good.ca)
    if case == "bad-key":
        return TlsFiles(good.cert, str(write_file(d / "k.key", b"-----BEGIN PRIVATE KEY-----\nAAAA\n"
                                                 b"-----END PRIVATE KEY-----\n")), good.ca)
    if case == "key-mismatch":
        return TlsFiles(good.cert, pki.write(f"{case}-other", pki.collector()).key, good.ca)
    if case == "expired":
        return pki.write(case, pki.collector(**EXPIRED))
    if case == "not-yet-valid":
        return pki.write(case, pki.collector(**NOT_YET_VALID))
    if case == "other-ca":
        return Pki(d).write("srv", Pki(d / "x").collector(), ca_path=pki.ca_path)
    if case == "cert-without-key":
        return TlsFiles(good.cert, None, good.ca)
    if case == "key-without-cert":
        return TlsFiles(None, good.key, good.ca)
    if case == "server-without-ca":
        return TlsFiles(good.cert, good.key, None)
    if case == "server-without-cert":
        return TlsFiles(None, None, good.ca)
    raise AssertionError(case)


@pytest.mark.parametrize(("case", "line"), [
    ("missing", r"^--tls-cert \S+/nope.crt: no such file; pass the path of a PEM file"),
    ("directory", r"^--tls-ca \S+/directory: is a directory; pass the PEM file inside it$"),
    ("not-pem", r"^--tls-cert \S+/c.crt: not a PEM certificate \(no '-----BEGIN CERTIFICATE-----'\)"),
    ("key-as-cert", r"^--tls-cert \S+/srv.key: not a PEM certificate"),
    ("half-written", r"^--tls-cert \S+/c.crt: a certificate in it does not parse \(.*\); the file may be "
                     r"half-written or damaged$"),
    ("bad-key", r"^--tls-key \S+/k.key: the private key does not parse"),
    ("key-mismatch", r"^--tls-key \S+/key-mismatch-other.key: this key does not match the certificate "
                     r"\S+/srv.crt; pass the key issued with it$"),
    ("expired", r"^--tls-cert \S+/expired.crt: certificate expired \d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ "
                r"\(1d ago\); replace it"),
    ("not-yet-valid", r"^--tls-cert \S+/not-yet-valid.crt: certificate not valid until \S+ \S+Z "
                      r"\(in 2[34]h\); check this host's clock$"),
    ("other-ca", r"^--tls-cert \S+/other-ca/srv.crt: not signed by the CA in \S+/ca.crt \(issuer "
                 r"O=ghostgpu ghostgpu,CN=ghostgpu CA\); pass the CA that issued it"),
    ("cert-without-key", r"^--tls-cert given without --tls-key: pass both the certificate and its key$"),
    ("key-without-cert", r"^--tls-key given without --tls-cert: pass both"),
    ("server-without-ca", r"^--tls-ca missing: pass the CA certificate that signed the peers' certificates"),
    ("server-without-cert", r"^--tls-cert and --tls-key missing: this side must show a certificate"),
])
def test_tls_error_lines(pki: Pki, case: str, line: str) -> None:
    files = _case_files(pki, case)
    with pytest.raises(TlsError, match=line) as err:
        check_server(files)
    assert "\n" not in str(err.value)


def test_unreadable_file_is_one_line(pki: Pki, monkeypatch: pytest.MonkeyPatch) -> None:
    # Root reads any file whatever its mode, so the refusal comes from open() itself here.
    files = _good(pki)
    real_open = builtins.open

    def refuse(path: object, *args: object, **kwargs: object) -> object:
        if str(path) == files.key:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(builtins, "open", refuse)
    with pytest.raises(TlsError, match=r"^--tls-key \S+: cannot read it \(Permission denied\); make it "
                       r"readable by this user$"):
        check_server(files)


def test_clients_need_what_they_show(pki: Pki) -> None:
    good = _good(pki)
    assert check_client(pki.client()).cert_pem is None  # a user without a certificate: CA only
    with pytest.raises(TlsError, match=r"^--tls-cert and --tls-key missing"):
        check_client(pki.client(), require_cert=True)  # the tracer must show its node certificate
    with pytest.raises(TlsError, match=r"^--tls-ca missing"):
        check_client(TlsFiles(good.cert, good.key, None))
    loaded = check_client(pki.write("n1", pki.node("n1")), require_cert=True)
    assert loaded.describe().startswith("serial 0x") and "CN=n1" in loaded.describe()
    assert check_server(good).leaf.serial_number > 0


CLOSED = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:7450: Socket closed"
VERIFY = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:7450: Tls handshake "
          "failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:"
          "CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate: OK")
PLAIN = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:7450: Tls handshake failed "
         "(TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:100000f7:SSL routines:OPENSSL_internal:"
         "WRONG_VERSION_NUMBER: Invalid certificate verification context: OK")
HOSTNAME = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:7450: Custom "
            "verification check failed with error: UNAUTHENTICATED: Hostname Verification Check failed.")
REFUSED = ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:7450: Connection "
           "refused")
WITH_CERT = TlsFiles("/p/user.crt", "/p/user.key", "/p/ca.crt")
CA_ONLY = TlsFiles(None, None, "/p/ca.crt")


@pytest.mark.parametrize(("files", "details", "line"), [
    (WITH_CERT, PLAIN, r"^collector 127.0.0.1:7450 speaks plaintext and this client TLS: drop --tls-ca"),
    (WITH_CERT, VERIFY, r"^collector 127.0.0.1:7450: its certificate is not trusted \(unable to get local "
                        r"issuer certificate\); pass as --tls-ca the CA that signed the collector's "
                        r"certificate \(now /p/ca.crt\)$"),
    (WITH_CERT, HOSTNAME, r"^collector 127.0.0.1:7450: its certificate does not name '127.0.0.1'; "
                          r"dial a name"),
    (CA_ONLY, CLOSED, r"^collector 127.0.0.1:7450 closed the TLS handshake: it requires a client "
                      r"certificate; pass --tls-cert and --tls-key"),
    (WITH_CERT, CLOSED, r"^collector 127.0.0.1:7450 closed the TLS handshake: it refused the client "
                        r"certificate /p/user.crt"),
    (WITH_CERT, REFUSED, None),
    (CA_ONLY, "Deadline Exceeded", None),
])
def test_explain_tls_client_failures(files: TlsFiles, details: str, line: str | None) -> None:
    got = explain_connect_failure("127.0.0.1:7450", files, details)
    if line is None:
        assert got is None
    else:
        assert got is not None and "\n" not in got
        assert re.match(line, got), got


@pytest.fixture
def tls_port(pki: Pki) -> Iterator[int]:
    """A bare TLS server (Python's ssl) on loopback that completes handshakes and hangs up."""
    files = _good(pki, "probe")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(files.cert or "", files.key)
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                try:
                    with context.wrap_socket(conn, server_side=True):
                        pass
                except (OSError, ssl.SSLError):
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    listener.close()
    thread.join(timeout=5)


def test_plaintext_client_against_tls_port(tls_port: int) -> None:
    address = f"127.0.0.1:{tls_port}"
    assert probe_tls("127.0.0.1", tls_port)
    line = explain_connect_failure(address, TlsFiles(), CLOSED.replace("7450", str(tls_port)))
    assert line is not None
    assert line.startswith(f"collector {address} speaks TLS and this client is plaintext: pass --tls-ca")


def test_plaintext_client_against_plain_or_closed_port() -> None:
    with socket.create_server(("127.0.0.1", 0)) as plain:  # accepts (backlog), never speaks TLS
        port = plain.getsockname()[1]
        assert not probe_tls("127.0.0.1", port, timeout_s=0.3)
    assert not probe_tls("127.0.0.1", port, timeout_s=0.3)  # closed now: connection refused
    assert explain_connect_failure(f"127.0.0.1:{port}", TlsFiles(), CLOSED) is None
    assert explain_connect_failure("unix:///run/x.sock", TlsFiles(), CLOSED) is None
