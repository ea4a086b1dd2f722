"""Real Prometheus and Alertmanager for tests: Debian's `prometheus` 2.42 and `prometheus-alertmanager` 0.25.

Each daemon runs on a free loopback port with its config and storage in a test's tmp directory, is
ready once `/-/ready` answers 200 (polled with a deadline), fails with one line naming the binary
plus its last stderr lines if it does not come up, and is always killed at teardown (SIGTERM, then
SIGKILL; the kernel kills it too if the test runner dies, through PR_SET_PDEATHSIG).

    with Alertmanager(tmp_path / "am") as am, Prometheus(
            tmp_path / "prom", scrape_targets={"ghostgpu": "127.0.0.1:9400"},
            rule_files=[RULES], alertmanagers=[am.address], interval_s=1) as prom:
        prom.wait_target_up("ghostgpu")
        am.wait_alert("GhostGPUHiddenConsumer", pod="x")

Fixtures (import them into a test module or conftest): `alertmanager`, `prometheus` (empty config,
function scope) and `prometheus_module` (one per module, for parse checks). Tests that use them are
marked `prometheus`: without the binaries they skip, or fail under GHOSTGPU_REQUIRE_INTEGRATION=1
(tests/conftest.py turns every skip into a failure then).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.polling import poll

PROMETHEUS_BIN = os.environ.get("GHOSTGPU_PROMETHEUS", "/usr/bin/prometheus")
PROMTOOL_BIN = os.environ.get("GHOSTGPU_PROMTOOL", "/usr/bin/promtool")
ALERTMANAGER_BIN = os.environ.get("GHOSTGPU_ALERTMANAGER", "/usr/bin/prometheus-alertmanager")
START_TIMEOUT_S = 30.0  # TSDB open + rule load on a loaded 2-core VM take a few seconds at most
STOP_TIMEOUT_S = 10.0
HTTP_TIMEOUT_S = 5.0
STDERR_TAIL_LINES = 15
_BIND_ATTEMPTS = 3  # a free port can be taken between our probe and the daemon's bind


def require_binary(path: str) -> None:
    """Skip without `path` (a failure under GHOSTGPU_REQUIRE_INTEGRATION=1: see tests/conftest.py)."""
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.skip(f"{path} is missing: apt-get install prometheus prometheus-alertmanager "
                    "(scripts/bootstrap.sh install)")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent(argv: list[str]) -> list[str]:
    """argv run under util-linux `setpriv --pdeathsig KILL`: a killed pytest must not leave daemons
    holding ports. Not Popen(preexec_fn=...): Python code between fork and exec in a test process
    that has gRPC loaded can abort the child (grpcio's fork handlers: epoll_wait "Bad file
    descriptor", SIGABRT), which made Alertmanager exit -6 at start now and then."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *argv] if setpriv else argv


def http_json(method: str, url: str, body: Any = None, timeout_s: float = HTTP_TIMEOUT_S) -> tuple[int, Any]:
    """(HTTP status, decoded JSON body or None); an HTTP error status is returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data is not None else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw) if raw.strip() else None
    except ValueError:
        return status, raw.decode(errors="replace")


def _stderr_tail(text: str) -> list[str]:
    """The error lines of a go-kit log (shutdown chatter follows the cause), else the last lines."""
    lines = text.strip().splitlines()
    errors = [line for line in lines if "level=error" in line]
    return (errors or lines)[-STDERR_TAIL_LINES:]


class _Daemon:
    """One daemon process on 127.0.0.1:<free port>; subclasses write the config and name the flags."""

    binary = ""
    name = ""

    def __init__(self, workdir: Path) -> None:
        require_binary(self.binary)
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._stderr_path = workdir / f"{self.name}.stderr"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def _args(self) -> list[str]:
        raise NotImplementedError

    def start(self, timeout_s: float = START_TIMEOUT_S) -> _Daemon:
        for attempt in range(_BIND_ATTEMPTS):
            self.port = free_port()
            offset = self._stderr_path.stat().st_size if self._stderr_path.exists() else 0
            with open(self._stderr_path, "ab") as err:
                argv = _die_with_parent([self.binary, *self._args()])
                self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                             cwd=self.workdir)
            if poll(self._ready_or_exited, timeout_s) and self.proc.poll() is None:
                return self
            exit_code = self.proc.poll()
            self.kill()
            text = self._stderr_path.read_bytes()[offset:].decode(errors="replace")
            if "address already in use" in text and attempt + 1 < _BIND_ATTEMPTS:
                continue
            how = (f"exited with {exit_code}" if exit_code is not None else
                   f"was not ready on {self.url}/-/ready within {timeout_s} s")
            tail = "\n".join(_stderr_tail(text))
            raise AssertionError(f"{self.binary} {how} (config and log in {self.workdir}); "
                                 f"last stderr:\n{tail}")
        raise AssertionError("unreachable")

    def _ready_or_exited(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            return True
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1.0) as resp:
                return bool(resp.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM and wait; SIGKILL past the deadline."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stderr(self) -> str:
        try:
            return self._stderr_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def __enter__(self) -> _Daemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Alertmanager(_Daemon):
    """Alertmanager 0.25 with one route to a receiver that notifies nobody; alerts are read back
    through GET /api/v2/alerts. Clustering (gossip on :9094) is off so parallel tests never meet."""

    binary = ALERTMANAGER_BIN
    name = "alertmanager"

    def __init__(self, workdir: Path, *, resolve_timeout_s: float = 300.0) -> None:
        super().__init__(workdir)
        self.resolve_timeout_s = resolve_timeout_s  # ends an alert posted without endsAt
        config = {
            "global": {"resolve_timeout": f"{resolve_timeout_s:g}s"},
            "route": {"receiver": "null", "group_by": ["alertname"], "group_wait": "0s",
                      "group_interval": "1s", "repeat_interval": "1h"},
            "receivers": [{"name": "null"}],
        }
        self.config_path = workdir / "alertmanager.yml"
        self.config_path.write_text(json.dumps(config, indent=1))  # JSON is YAML; no PyYAML needed
        self.start()

    def _args(self) -> list[str]:
        return [f"--config.file={self.config_path}", f"--storage.path={self.workdir / 'data'}",
                f"--web.listen-address={self.address}", "--cluster.listen-address=", "--log.level=info"]

    def alerts(self, active: bool = True, **labels: str) -> list[dict[str, Any]]:
        """GET /api/v2/alerts with label equality filters. Alertmanager 0.25 leaves resolved alerts
        (endsAt in the past) out of this list, so an alert that resolved disappears from it."""
        query = [("active", str(active).lower()), ("silenced", "false"), ("inhibited", "false")]
        query += [("filter", f'{k}="{v}"') for k, v in labels.items()]
        status, body = http_json("GET", f"{self.url}/api/v2/alerts?{urllib.parse.urlencode(query)}")
        if status != 200 or not isinstance(body, list):
            raise AssertionError(f"Alertmanager GET /api/v2/alerts answered {status}: {body!r}")
        return body

    def post_alerts(self, alerts: Sequence[Mapping[str, Any]]) -> tuple[int, Any]:
        return http_json("POST", f"{self.url}/api/v2/alerts", list(alerts))

    def wait_alert(self, alertname: str, timeout_s: float = 30.0, **labels: str) -> dict[str, Any]:
        """The first active alert named `alertname` with these labels; fails listing what it has."""
        found: list[dict[str, Any]] = []

        def present() -> bool:
            nonlocal found
            found = self.alerts(alertname=alertname, **labels)
            return bool(found)

        if not poll(present, timeout_s):
            have = [a.get("labels") for a in self.alerts()]
            raise AssertionError(f"Alertmanager has no {alertname} {labels} after {timeout_s} s; "
                                 f"it has: {have}")
        return found[0]

    def wait_gone(self, alertname: str, timeout_s: float = 30.0, **labels: str) -> None:
        if not poll(lambda: not self.alerts(alertname=alertname, **labels), timeout_s):
            raise AssertionError(f"Alertmanager still has {alertname} {labels} after {timeout_s} s")


class Prometheus(_Daemon):
    """Prometheus 2.42 scraping `scrape_targets` ({job: "HOST:PORT"}), evaluating `rule_files` and
    sending alerts to `alertmanagers` ("HOST:PORT"), every `interval_s`. Lifecycle API on (reload)."""

    binary = PROMETHEUS_BIN
    name = "prometheus"

    def __init__(self, workdir: Path, *, scrape_targets: Mapping[str, str] | None = None,
                 rule_files: Sequence[Path] = (), alertmanagers: Sequence[str] = (),
                 interval_s: float = 15.0, extra_args: Sequence[str] = ()) -> None:
        super().__init__(workdir)
        every = f"{int(interval_s * 1000)}ms"
        config: dict[str, Any] = {
            "global": {"scrape_interval": every, "evaluation_interval": every, "scrape_timeout": every},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [target]}]}
                               for job, target in (scrape_targets or {}).items()],
        }
        if alertmanagers:
            config["alerting"] = {"alertmanagers": [{"api_version": "v2",
                                                     "static_configs": [{"targets": list(alertmanagers)}]}]}
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(json.dumps(config, indent=1))
        self.extra_args = list(extra_args)
        self.start()

    def _args(self) -> list[str]:
        return [f"--config.file={self.config_path}", f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address={self.address}", "--web.enable-lifecycle", "--log.level=info",
                *self.extra_args]

    def query_raw(self, expr: str, at_unix_s: float | None = None) -> tuple[int, Any]:
        """GET /api/v1/query: (HTTP status, body). A parse error is 400 with errorType bad_data."""
        params = {"query": expr} | ({} if at_unix_s is None else {"time": f"{at_unix_s:.3f}"})
        return http_json("GET", f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}")

    def query(self, expr: str, at_unix_s: float | None = None) -> list[dict[str, Any]]:
        """The result vector of an instant query; fails naming the expression on any error."""
        status, body = self.query_raw(expr, at_unix_s)
        if status != 200 or not isinstance(body, dict) or body.get("status") != "success":
            raise AssertionError(f"Prometheus query {expr!r} answered {status}: {body!r}")
        data = body["data"]
        # A scalar or string result is one [time, value] pair, not a list of series.
        if data["resultType"] in ("vector", "matrix"):
            return list(data["result"])
        return [{"value": data["result"]}]

    def _get(self, path: str) -> Any:
        status, body = http_json("GET", f"{self.url}{path}")
        if status != 200 or not isinstance(body, dict):
            raise AssertionError(f"Prometheus GET {path} answered {status}: {body!r}")
        return body["data"]

    def alerts(self) -> list[dict[str, Any]]:
        """Pending and firing alerts (/api/v1/alerts)."""
        return list(self._get("/api/v1/alerts")["alerts"])

    def rule_groups(self) -> list[dict[str, Any]]:
        return list(self._get("/api/v1/rules")["groups"])

    def targets(self) -> list[dict[str, Any]]:
        return list(self._get("/api/v1/targets")["activeTargets"])

    def wait_target_up(self, job: str, timeout_s: float = 30.0) -> None:
        def up() -> bool:
            return any(t["labels"].get("job") == job and t["health"] == "up" for t in self.targets())

        if not poll(up, timeout_s):
            have = [(t["labels"].get("job"), t["health"], t.get("lastError")) for t in self.targets()]
            raise AssertionError(f"Prometheus target {job} is not up after {timeout_s} s: {have}")

    def reload(self) -> None:
        status, body = http_json("POST", f"{self.url}/-/reload")
        if status != 200:
            raise AssertionError(f"Prometheus /-/reload answered {status}: {body!r}")


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[Alertmanager]:
    am = Alertmanager(tmp_path / "alertmanager")
    try:
        yield am
    finally:
        am.stop()


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Prometheus]:
    prom = Prometheus(tmp_path / "prometheus")
    try:
        yield prom
    finally:
        prom.stop()


@pytest.fixture(scope="module")
def prometheus_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """One Prometheus with no targets for a module's parse checks (queries need no data)."""
    prom = Prometheus(tmp_path_factory.mktemp("prometheus"))
    try:
        yield prom
    finally:
        prom.stop()


def promtool(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run `promtool ARGS...` to completion (skips, or fails under CI, without the binary)."""
    require_binary(PROMTOOL_BIN)
    return subprocess.run([PROMTOOL_BIN, *args], capture_output=True, text=True, timeout=timeout_s,
                          check=False, env={**os.environ, "NO_COLOR": "1"})



SHIPPED_RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "ghostgpu-rules.yaml"
FINDINGS_GROUP = "ghostgpu-findings"


def findings_rules_firing_at_once(dest: Path, source: Path = SHIPPED_RULES) -> Path:
    """The shipped rules with every findings alert's `for:` set to 0 s (their only change), written
    to `dest`: what fires in a test or a benchmark is what fires in production, only without the wait."""
    import yaml  # Debian's python3-yaml; only the tests and benchmarks that run Prometheus need it

    doc = yaml.safe_load(source.read_text())
    changed = 0
    for group in doc["groups"]:
        if group["name"] == FINDINGS_GROUP:
            for rule in group["rules"]:
                if "alert" in rule:
                    rule["for"] = "0s"
                    changed += 1
    if not changed:
        raise AssertionError(f"{source}: no alert in group {FINDINGS_GROUP}")
    dest.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dest
