"""The real Prometheus (2.42, tests/helpers/promstack.py) scrapes the collector's /metrics and a
tracer's health port over TLS with basic auth, as `--web-config-file` sets them up; a wrong password
is 401, for Prometheus as for any client; kubelet-style probes reach /healthz and /readyz without
credentials."""

from __future__ import annotations

import base64
import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bcrypt
import pytest
from ghostgpu.tracer.health import AgentHealth, start_health_server

from ghostgpu.common.web.httpserve import HttpServer
from tests.helpers.certs import Pki
from tests.helpers.collector_env import running_collector
from tests.helpers.polling import wait_until
from tests.helpers.promstack import Prometheus

pytestmark = pytest.mark.prometheus

PASSWORD = "scrape-pw"


@pytest.fixture
def web_config(tmp_path: Path) -> tuple[Path, Pki]:
    pki = Pki(tmp_path / "pki")
    pki.write("metrics", pki.collector())  # SANs 127.0.0.1, ::1, localhost: Prometheus verifies the IP
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()
    config = tmp_path / "pki" / "web.yml"
    config.write_text("tls_server_config:\n  cert_file: metrics.crt\n  key_file: metrics.key\n"
                      f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    return config, pki


@pytest.fixture
def tracer_health(web_config: tuple[Path, Pki]) -> Iterator[HttpServer]:
    health = AgentHealth()
    health.bpf_started(3)
    health.scan_observed(0.01)
    health.started()
    server = start_health_server("127.0.0.1:0", health, web_config=str(web_config[0]))
    try:
        yield server
    finally:
        server.stop()


def job(name: str, target: str, ca: Path, password: str) -> dict[str, Any]:
    return {"job_name": name, "scheme": "https", "honor_labels": True,
            "tls_config": {"ca_file": str(ca)},
            "basic_auth": {"username": "prometheus", "password": password},
            "static_configs": [{"targets": [target]}]}


def get(url: str, ca: Path, password: str | None = None) -> int:
    ctx = ssl.create_default_context(cafile=str(ca))
    headers = {}
    if password is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(f"prometheus:{password}".encode()).decode()
    try:
        request = urllib.request.Request(url, headers=headers)
        with urllib.request.urlopen(request, context=ctx, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code


def test_prometheus_scrapes_over_tls_with_basic_auth(tmp_path: Path, web_config: tuple[Path, Pki],
                                                     tracer_health: HttpServer) -> None:
    config, pki = web_config
    with running_collector(tmp_path, metrics_listen="127.0.0.1:0", web_config_file=str(config)) as collector:
        assert collector.metrics_url is not None and collector.metrics_url.startswith("https://")
        metrics = collector.metrics_address
        assert metrics is not None
        with Prometheus(tmp_path / "prometheus", interval_s=0.5) as prom:
            # The helper writes plain static targets; this scrape needs scheme, tls_config and basic_auth.
            prom.config_path.write_text(json.dumps({
                "global": {"scrape_interval": "500ms", "scrape_timeout": "500ms"},
                "scrape_configs": [job("collector", metrics, pki.ca_path, PASSWORD),
                                   job("tracer", tracer_health.address, pki.ca_path, PASSWORD),
                                   job("wrong-password", metrics, pki.ca_path, "guess")],
            }))
            prom.reload()
            prom.wait_target_up("collector")
            prom.wait_target_up("tracer")
            assert prom.query('up{job="collector"}')[0]["value"][1] == "1"
            assert prom.query('count({job="collector", __name__=~"ghostgpu_.+"}) > 0')
            assert prom.query('count({job="tracer", __name__=~"ghostgpu_agent_.+"}) > 0')

            def refused() -> bool:
                targets = [t for t in prom.targets() if t["labels"].get("job") == "wrong-password"]
                return bool(targets) and targets[0]["health"] == "down" and "401" in targets[0]["lastError"]

            wait_until(refused, "the wrong password's target to be down with 401", timeout_s=30.0)
        url = f"https://{metrics}/metrics"
        assert get(url, pki.ca_path, "guess") == 401
        assert get(url, pki.ca_path) == 401
        assert get(url, pki.ca_path, PASSWORD) == 200


def test_probes_need_no_credentials_and_skip_verification(web_config: tuple[Path, Pki],
                                                          tracer_health: HttpServer) -> None:
    """kubelet's httpGet with scheme HTTPS does not verify the certificate and sends no credentials."""
    insecure = ssl.create_default_context()
    insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE
    for path in ("/healthz", "/readyz"):
        with urllib.request.urlopen(f"{tracer_health.url}{path}", context=insecure, timeout=10) as r:
            assert r.status == 200
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{tracer_health.url}/metrics", context=insecure, timeout=10)
    assert e.value.code == 401
