"""Attacks on the HTTP ports (the tracer's health port, the collector's /metrics), run for real on
127.0.0.1 with bounded counts: slowloris, a stalled request head,
basic auth edge cases, junk requests against the rate limit, and plaintext off loopback."""

from __future__ import annotations

import base64
import http.client
import logging
import resource
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import bcrypt
import pytest
from ghostgpu.tracer.health import AgentHealth, start_health_server

from ghostgpu.common.web.httpserve import HEADER_TIMEOUT_S, WORKERS, HttpListenError, HttpServer
from ghostgpu.common.web.webconfig import WebConfigError
from tests.helpers.certs import Pki

REPO = Path(__file__).resolve().parents[2]
PASSWORD = "s3cret"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()
SLOWLORIS = 1000


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def healthy() -> AgentHealth:
    h = AgentHealth()
    h.bpf_started(3)
    h.scan_observed(0.01)
    h.started()
    return h


def get(server: HttpServer, path: str, auth: str | None = None, source: str = "127.0.0.1",
        timeout_s: float = 5.0) -> tuple[int, bytes, dict[str, str]]:
    host, port = server.address.rsplit(":", 1)
    kwargs: dict = {"timeout": timeout_s, "source_address": (source, 0)}
    if server.tls:
        kwargs["context"] = ssl._create_unverified_context()  # as kubelet's probes: no verification
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(host, int(port), **kwargs)
    else:
        conn = http.client.HTTPConnection(host, int(port), **kwargs)
    try:
        conn.request("GET", path, headers={"Authorization": auth} if auth else {})
        resp = conn.getresponse()
        return resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


@pytest.fixture
def web_config(tmp_path: Path) -> Path:
    pki = Pki(tmp_path / "pki")
    files = pki.write("web", pki.collector())
    config = tmp_path / "web.yml"
    config.write_text(f"tls_server_config:\n  cert_file: {files.cert}\n  key_file: {files.key}\n"
                      f"basic_auth_users:\n  prom: '{HASH}'\n"
                      "rate_limit: {interval: 1m, burst: 20}\n")
    return config


@pytest.fixture
def many_fds() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 3 * SLOWLORIS
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard) if hard != resource.RLIM_INFINITY
                                                    else need, hard))


def flood(server: HttpServer, socks: list[socket.socket], count: int, first: bytes = b"") -> None:
    host, port = server.address.rsplit(":", 1)
    for _ in range(count):
        s = socket.create_connection((host, int(port)), timeout=5.0)
        if first:
            s.sendall(first)
        socks.append(s)


# ---- slowloris, header deadline ----------------------------------------------------------


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_slowloris_adds_no_thread_and_the_probes_answer(tls: bool, web_config: Path, many_fds: None,
                                                        open_sockets: list[socket.socket]) -> None:
    server = start_health_server("127.0.0.1:0", healthy(), web_config=str(web_config) if tls else None)
    try:
        assert get(server, "/healthz")[0] == 200
        before = threading.active_count()
        # 1,000 connections: half send nothing (not even a TLS hello), half a request line and stop.
        flood(server, open_sockets, SLOWLORIS // 2)
        flood(server, open_sockets, SLOWLORIS // 2, b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        added = threading.active_count() - before
        assert added <= WORKERS, f"{added} threads added by {SLOWLORIS} idle connections"
        for probe in ("/healthz", "/readyz"):  # kubelet's probe, from the same address as the flood
            started = time.monotonic()
            status, body, _ = get(server, probe, timeout_s=3.0)
            assert status == 200, body
            assert time.monotonic() - started < 2.0
        assert server.connections <= server.max_connections
    finally:
        server.stop()


def test_a_request_head_must_arrive_within_the_header_deadline(open_sockets: list[socket.socket]) -> None:
    server = start_health_server("127.0.0.1:0", healthy())
    try:
        flood(server, open_sockets, 1, b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        s = open_sockets[0]
        s.settimeout(HEADER_TIMEOUT_S + 5.0)
        started = time.monotonic()
        assert s.recv(1024) == b""  # closed by the server
        assert time.monotonic() - started <= HEADER_TIMEOUT_S + 2.0
    finally:
        server.stop()


# ---- basic auth --------------------------------------------------------------------------


def test_a_password_over_72_bytes_is_a_401_without_a_traceback(
        web_config: Path, caplog: pytest.LogCaptureFixture) -> None:
    server = start_health_server("127.0.0.1:0", healthy(), web_config=str(web_config))
    caplog.set_level(logging.DEBUG)
    try:
        status, _, headers = get(server, "/metrics", basic("prom", "x" * 100))
        assert status == 401 and headers["www-authenticate"].startswith("Basic")
        assert get(server, "/metrics", basic("nobody", "y" * 73))[0] == 401
        assert get(server, "/metrics", basic("prom", PASSWORD))[0] == 200
        assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    finally:
        server.stop()


def malformed_hashes() -> list[str]:
    good = HASH
    return [good[:7] + "!" + good[8:],  # a character outside bcrypt's base64
            good[:28] + "z" + good[29:],  # the salt's last character carries bits bcrypt refuses
            good[:4] + "03" + good[6:]]  # a cost below 4


@pytest.mark.parametrize("bad", malformed_hashes(), ids=["char", "salt", "cost"])
def test_a_malformed_hash_of_the_right_length_is_refused_at_start_naming_the_user(
        tmp_path: Path, bad: str) -> None:
    assert len(bad) == 60
    config = tmp_path / "web.yml"
    config.write_text(f"basic_auth_users:\n  scraper: '{bad}'\n")
    with pytest.raises(WebConfigError, match=r"basic_auth_users\.scraper"):
        HttpServer("127.0.0.1:0", {}, web_config=str(config)).start()
    # the real command: exit 2, one line naming the user, nothing bound
    cmd = [sys.executable, "-m", "ghostgpu.cli", "collector", "--listen", "127.0.0.1:0", "--db", ":memory:",
           "--metrics-listen", "127.0.0.1:0", "--web-config-file", str(config)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO, check=False)
    assert out.returncode == 2, out.stderr
    assert "basic_auth_users.scraper" in out.stderr and out.stderr.count("\n") == 1


def test_wrong_pairs_do_not_evict_the_good_one(web_config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = start_health_server("127.0.0.1:0", healthy(), web_config=str(web_config))
    try:
        calls: list[bytes] = []
        real = bcrypt.checkpw
        monkeypatch.setattr(bcrypt, "checkpw", lambda pw, h: calls.append(pw) or real(pw, h))
        assert server.guard is not None
        server.guard.limiter.interval_s = 0  # this test is about the cache: no 429 from 100 tries
        assert get(server, "/metrics", basic("prom", PASSWORD))[0] == 200
        for i in range(101):
            assert get(server, "/metrics", basic(f"user{i}", f"pw{i}"))[0] == 401
        calls.clear()
        assert get(server, "/metrics", basic("prom", PASSWORD))[0] == 200
        assert calls == [], "the verified pair was evicted by wrong ones: bcrypt ran again"
    finally:
        server.stop()


def test_junk_from_one_address_neither_fails_the_probes_nor_limits_another(web_config: Path) -> None:
    server = start_health_server("127.0.0.1:0", healthy(), web_config=str(web_config))
    try:
        statuses = [get(server, "/metrics", basic("x", "y"), source="127.0.0.9")[0] for _ in range(25)]
        assert 429 in statuses  # burst 20: the junk address is limited
        assert get(server, "/healthz", source="127.0.0.9")[0] == 200  # probes are outside the limiter
        assert get(server, "/readyz")[0] == 200
        assert get(server, "/metrics", basic("prom", PASSWORD))[0] == 200  # another address is not limited
    finally:
        server.stop()


# ---- plaintext off loopback -------------------------------------------------------------


def test_plaintext_health_port_off_loopback_needs_insecure() -> None:
    with pytest.raises(HttpListenError, match=r"--health-listen 0\.0\.0\.0:0: plaintext HTTP .* --insecure"):
        start_health_server("0.0.0.0:0", healthy())
    server = start_health_server("0.0.0.0:0", healthy(), insecure=True)
    server.stop()


def test_plaintext_metrics_off_loopback_needs_insecure_like_grpc() -> None:
    cmd = [sys.executable, "-m", "ghostgpu.cli", "collector", "--listen", "127.0.0.1:0", "--db", ":memory:",
           "--metrics-listen", "0.0.0.0:0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO, check=False)
    assert out.returncode == 2, out.stderr
    assert "--metrics-listen 0.0.0.0:0: plaintext HTTP" in out.stderr and out.stderr.count("\n") == 1
