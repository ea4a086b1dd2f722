"""--web-config-file: the exporter-toolkit format read strictly, and served for real: HTTPS over
loopback with Python's ssl on both sides (no mock of the TLS layer), bcrypt basic auth, the probes'
open paths, reload of rotated certificates, client certificates, rate limit and headers."""

from __future__ import annotations

import base64
import http.client
import logging
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bcrypt
import pytest
from cryptography import x509
from ghostgpu.tracer.health import PROBE_PATHS

from ghostgpu.common.web import webguard
from ghostgpu.common.web.httpserve import TEXT, HttpServer, Response
from ghostgpu.common.web.webconfig import WebConfigError, load_web_config, parse_web_config
from ghostgpu.common.web.webguard import BasicAuth, RateLimiter, WebGuard
from tests.helpers.certs import Pki, serial_of, write_file
from tests.helpers.polling import wait_until

HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()  # cost 4: fast tests, same code path


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


# ---- the file ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "needle"), [
    ("tls_server_config: {cert_file: a, key_file: b}\nbasic_auth_user: {}\n",
     "basic_auth_user: unknown key; known keys: tls_server_config"),
    ("tls_server_config: {cert_file: a, key_file: b, clinet_auth_type: x}\n",
     "tls_server_config.clinet_auth_type: unknown key"),
    ("tls_server_config: {cert_file: a}\n", "tls_server_config.key_file: missing"),
    ("tls_server_config: {key_file: a}\n", "tls_server_config.cert_file: missing"),
    ("tls_server_config: {cert_file: a, key_file: b, client_auth_type: Sometimes}\n",
     "client_auth_type: 'Sometimes' is not one of NoClientCert"),
    ("tls_server_config: {cert_file: a, key_file: b, client_auth_type: RequireAnyClientCert}\n",
     "RequireAnyClientCert (a certificate asked for but not verified) is not supported"),
    ("tls_server_config: {cert_file: a, key_file: b, client_ca_file: ca}\n",
     "client_ca_file: set without a client_auth_type"),
    ("tls_server_config: {cert_file: a, key_file: b, client_auth_type: RequireAndVerifyClientCert}\n",
     "client_ca_file: RequireAndVerifyClientCert needs the CA"),
    ("tls_server_config: {cert_file: a, key_file: b, min_version: TLS14}\n",
     "min_version: 'TLS14' is not one of"),
    ("tls_server_config: {cert_file: a, key_file: b, min_version: TLS13, max_version: TLS12}\n",
     "min_version: above max_version"),
    ("tls_server_config: {cert_file: a, key_file: b, cipher_suites: [TLS_RSA_WITH_RC4_128_SHA]}\n",
     "cipher_suites: unknown name 'TLS_RSA_WITH_RC4_128_SHA'"),
    ("tls_server_config: {cert_file: a, key_file: b, client_allowed_sans: [x]}\n",
     "client_allowed_sans: needs client_auth_type RequireAndVerifyClientCert"),
    ("basic_auth_users: {alice: hunter2}\n", "basic_auth_users.alice: not a bcrypt hash"),
    ("http_server_config: {headers: {X-Frame-Options: allow}}\n", "X-Frame-Options: 'allow' is not one of"),
    ("http_server_config: {headers: {X-Powered-By: me}}\n", "headers.X-Powered-By: unknown key"),
    ("http_server_config: {http2: maybe}\n", "http2: 'maybe' is not true or false"),
    ("rate_limit: {interval: soon, burst: 1}\n", "rate_limit.interval 'soon'"),
    ("rate_limit: {interval: 1s}\n", "rate_limit.burst: 0 would refuse every request"),
    ("tls_server_config: [a]\n", "tls_server_config: expected a mapping"),
    ("tls_server_config: {cert_file: a\n", "not valid YAML at line"),
])
def test_bad_config_is_one_line_naming_the_key(text: str, needle: str) -> None:
    with pytest.raises(WebConfigError) as e:
        parse_web_config(text, "/etc/ghostgpu/web.yml")
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("web config /etc/ghostgpu/web.yml: ")


def test_relative_paths_resolve_against_the_file_and_defaults_match_exporter_toolkit(tmp_path: Path) -> None:
    path = tmp_path / "web.yml"
    path.write_text(f"tls_server_config: {{cert_file: tls/a.crt, key_file: /abs/a.key}}\n"
                    f"basic_auth_users: {{prom: '{HASH}'}}\n")
    config = load_web_config(str(path))
    assert config.tls is not None
    assert config.tls.cert_file == str(tmp_path / "tls" / "a.crt") and config.tls.key_file == "/abs/a.key"
    assert (config.tls.min_version, config.tls.max_version, config.tls.client_auth_type) == \
        ("TLS12", "TLS13", "NoClientCert")
    assert config.users == {"prom": HASH.encode()} and config.http2 is True
    assert config.files == (str(path), str(tmp_path / "tls" / "a.crt"), "/abs/a.key")


def test_an_empty_file_or_only_users_means_plain_http(tmp_path: Path) -> None:
    assert parse_web_config("", "x").tls is None
    assert parse_web_config("tls_server_config: {}\n", "x").tls is None  # as exporter-toolkit: no TLS key set
    with pytest.raises(WebConfigError, match="cannot read: No such file"):
        load_web_config(str(tmp_path / "missing.yml"))


def test_basic_auth_caches_verified_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bytes] = []
    real = bcrypt.checkpw
    monkeypatch.setattr(bcrypt, "checkpw", lambda pw, h: calls.append(pw) or real(pw, h))
    auth = BasicAuth({"prom": HASH.encode()})
    assert auth.check(basic("prom", "s3cret")) and auth.check(basic("prom", "s3cret"))
    assert not auth.check(basic("prom", "wrong")) and not auth.check(basic("prom", "wrong"))
    # bcrypt once for the verified pair; a failure is never cached, so it cannot evict the good one
    assert calls == [b"s3cret", b"wrong", b"wrong"]
    # An unknown user costs a bcrypt too (no timing oracle for user names) and never passes.
    assert not auth.check(basic("mallory", "s3cret"))
    assert calls[-1] == b"s3cret" and len(calls) == 4
    for bad in (None, "", "Bearer x", "Basic !!!", "Basic " + base64.b64encode(b"no-colon").decode()):
        assert not auth.check(bad)


def test_rate_limiter_is_a_token_bucket() -> None:
    now = [0.0]
    limiter = RateLimiter(1.0, 2, clock=lambda: now[0])
    assert [limiter.allow() for _ in range(3)] == [True, True, False]
    now[0] += 1.0
    assert limiter.allow() and not limiter.allow()


# ---- served for real ---------------------------------------------------------------------------------

@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "pki")


def serve(config: Path, open_paths: tuple[str, ...] = ()) -> HttpServer:
    paths = ("/metrics", *PROBE_PATHS)
    routes = {p: (lambda _r, p=p: Response(200, f"{p} ok\n".encode(), TEXT)) for p in paths}
    return HttpServer("127.0.0.1:0", routes, flag="--metrics-listen", name="metrics", web_config=str(config),
                      open_paths=open_paths).start()


@pytest.fixture
def tls_server(tmp_path: Path, pki: Pki) -> Iterator[tuple[HttpServer, Path, Pki]]:
    files = pki.write("web", pki.collector())
    config = tmp_path / "web.yml"
    config.write_text(f"tls_server_config:\n  cert_file: pki/web.crt\n  key_file: {files.key}\n"
                      f"basic_auth_users:\n  prom: '{HASH}'\n"
                      "http_server_config:\n  headers: {X-Content-Type-Options: nosniff}\n")
    server = serve(config, PROBE_PATHS)
    try:
        yield server, config, pki
    finally:
        server.stop()


def get(server: HttpServer, path: str, ca: Path | None, auth: str | None = None,
        cert: tuple[str, str] | None = None) -> tuple[int, dict[str, str], int]:
    """(status, headers, the server certificate's serial) of one GET on a new TLS connection."""
    ctx = ssl.create_default_context(cafile=str(ca)) if ca else ssl.create_default_context()
    if cert:
        ctx.load_cert_chain(*cert)
    host, port = server.address.rsplit(":", 1)
    conn = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=10)
    try:
        conn.request("GET", path, headers={"Authorization": auth} if auth else {})
        resp = conn.getresponse()
        resp.read()
        der = conn.sock.getpeercert(binary_form=True)
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, x509.load_der_x509_certificate(
            der).serial_number
    finally:
        conn.close()


def test_https_with_basic_auth_and_open_probes(tls_server: Any) -> None:
    server, _config, pki = tls_server
    assert server.url.startswith("https://127.0.0.1:")
    status, headers, _ = get(server, "/metrics", pki.ca_path)
    assert status == 401 and headers["www-authenticate"].startswith("Basic")
    assert get(server, "/metrics", pki.ca_path, basic("prom", "nope"))[0] == 401
    assert get(server, "/nowhere", pki.ca_path)[0] == 401  # no route list for strangers
    status, headers, _ = get(server, "/metrics", pki.ca_path, basic("prom", "s3cret"))
    assert status == 200 and headers["x-content-type-options"] == "nosniff"
    for probe in PROBE_PATHS:  # kubelet cannot send credentials; it skips verification (scheme: HTTPS)
        assert get(server, probe, pki.ca_path)[0] == 200
    with pytest.raises(ssl.SSLCertVerificationError):  # a client that does not trust our CA
        get(server, "/healthz", Pki(pki.dir.parent / "other").ca_path)
    host, port = server.address.rsplit(":", 1)
    plain = http.client.HTTPConnection(host, int(port), timeout=5)  # plain HTTP against the TLS port
    with pytest.raises((http.client.RemoteDisconnected, ConnectionResetError)):
        plain.request("GET", "/healthz")
        plain.getresponse()
    plain.close()


def test_rotated_certificate_serves_new_connections_and_a_bad_one_keeps_the_old(
        tls_server: Any, caplog: pytest.LogCaptureFixture) -> None:
    server, _config, pki = tls_server
    first = get(server, "/healthz", pki.ca_path)[2]
    assert first == serial_of((pki.dir / "web.crt").read_bytes())
    rotated = pki.collector()
    write_file(pki.dir / "web.key", rotated.key_pem, 0o600)
    write_file(pki.dir / "web.crt", rotated.cert_pem)
    # Seen within a second, reloaded off the loop thread: a later connection gets it.
    wait_until(lambda: get(server, "/healthz", pki.ca_path)[2] == serial_of(rotated.cert_pem),
               "the rotated certificate to be served")
    # cert-manager half-way: a new certificate whose key has not been written yet.
    caplog.set_level(logging.WARNING, "ghostgpu.http")
    write_file(pki.dir / "web.crt", pki.collector().cert_pem)
    assert server.guard is not None
    guard = server.guard
    # Each connection serves the rotated certificate, before and after the bad one was seen.
    wait_until(lambda: get(server, "/healthz", pki.ca_path)[2] == serial_of(rotated.cert_pem)
               and guard.reload_errors == 1, "the bad certificate to be refused")
    assert get(server, "/healthz", pki.ca_path)[2] == serial_of(rotated.cert_pem)
    assert get(server, "/healthz", pki.ca_path)[2] == serial_of(rotated.cert_pem)
    lines = [r.getMessage() for r in caplog.records if "keeping the previous web config" in r.getMessage()]
    assert len(lines) == 1 and "key matches the certificate" in lines[0]  # once per change, not per request
    assert server.guard is not None and server.guard.reload_errors == 1


def test_users_reload_with_the_file(tls_server: Any) -> None:
    server, config, pki = tls_server
    new_hash = bcrypt.hashpw(b"rotated", bcrypt.gensalt(4)).decode()
    write_file(config, config.read_text().replace(HASH, new_hash).encode())
    wait_until(lambda: get(server, "/metrics", pki.ca_path, basic("prom", "rotated"))[0] == 200,
               "the new password to be accepted")
    assert get(server, "/metrics", pki.ca_path, basic("prom", "s3cret"))[0] == 401


def test_client_certificates_and_allowed_sans(tmp_path: Path, pki: Pki) -> None:
    files = pki.write("web", pki.collector())
    alice = pki.write("alice", pki.user("alice"))
    bob = pki.write("bob", pki.user("bob"))
    config = tmp_path / "web.yml"
    config.write_text(f"tls_server_config:\n  cert_file: {files.cert}\n  key_file: {files.key}\n"
                      f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {files.ca}\n"
                      "  client_allowed_sans: ['spiffe://ghostgpu/user/alice']\n")
    server = serve(config)
    try:
        assert get(server, "/metrics", pki.ca_path, cert=(alice.cert, alice.key))[0] == 200
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
            get(server, "/metrics", pki.ca_path)  # no client certificate
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
            get(server, "/metrics", pki.ca_path, cert=(bob.cert, bob.key))  # a SAN not in the list
    finally:
        server.stop()


def test_rate_limit_answers_429(tmp_path: Path) -> None:
    config = tmp_path / "web.yml"
    config.write_text("rate_limit: {interval: 1h, burst: 2}\n")
    server = serve(config)
    try:
        assert server.url.startswith("http://")
        host, port = server.address.rsplit(":", 1)
        statuses = []
        for _ in range(3):
            conn = http.client.HTTPConnection(host, int(port), timeout=5)
            conn.request("GET", "/metrics")
            statuses.append(conn.getresponse().status)
            conn.close()
        assert statuses == [200, 200, 429]
    finally:
        server.stop()


def test_a_bad_file_fails_start_before_binding(tmp_path: Path) -> None:
    config = tmp_path / "web.yml"
    config.write_text("tls_server_config: {cert_file: nope.crt, key_file: nope.key}\n")
    with pytest.raises(WebConfigError, match=r"tls_server_config\.cert_file: /.*/nope\.crt: no such file"):
        serve(config)


def test_a_reload_runs_off_the_callers_thread_and_the_files_are_looked_at_once_a_second(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """context() and refuse() run on the HTTP loop thread, which serves every connection and the
    probes: they get the current set at once while a reload (YAML, bcrypt, an SSLContext) runs."""
    config = tmp_path / "web.yml"
    write_file(config, b"http_server_config: {headers: {X-Frame-Options: deny}}\n")
    now = [0.0]
    guard = WebGuard(str(config), clock=lambda: now[0])
    release, entered, loaded = threading.Event(), threading.Event(), load_web_config

    calls: list[str] = []

    def slow_load(path: str) -> Any:
        calls.append(path)
        entered.set()
        assert threading.current_thread() is not threading.main_thread()
        release.wait(10.0)
        return loaded(path)

    monkeypatch.setattr(webguard, "load_web_config", slow_load)
    write_file(config, b"http_server_config: {headers: {X-Frame-Options: sameorigin}}\n")
    assert guard.context() is None and not entered.is_set()  # not a second since the last look
    now[0] += webguard.RELOAD_CHECK_INTERVAL_S
    assert guard.context() is None and guard.refuse("/metrics", None) is None  # at once: the old set
    assert entered.wait(10.0) and guard.headers() == {"X-Frame-Options": "deny"}
    now[0] += webguard.RELOAD_CHECK_INTERVAL_S
    guard.context()  # a reload is running: no second one
    release.set()
    wait_until(lambda: guard.reloads == 1, "the reload to finish")
    assert guard.headers() == {"X-Frame-Options": "sameorigin"} and len(calls) == 1
    write_file(config, b"http_server_config: {headers: {X-Frame-Options: [no]}}\n")
    now[0] += webguard.RELOAD_CHECK_INTERVAL_S
    guard.context()
    wait_until(lambda: guard.reload_errors == 1, "the bad file to be refused")
    assert guard.headers() == {"X-Frame-Options": "sameorigin"} and guard.reloads == 1  # the old set kept
