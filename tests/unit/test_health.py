"""Tracer health (tracer/health.py): the liveness/readiness state machine on an injected clock, the
/metrics exposition (prometheus_client's parser and `promtool check metrics`), the agent's own
reporting, bad or busy listen addresses, and a real `ghostgpu tracer` (BPF off, no root) serving it."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from ghostgpu.tracer.agent import Tracer
from ghostgpu.tracer.config import ConfigError, TracerConfig, load_config
from ghostgpu.tracer.containment import STAGES, Containment
from ghostgpu.tracer.events import NvmlView
from ghostgpu.tracer.health import (
    SCAN_BUCKETS_S,
    TRACER_METRICS,
    AgentHealth,
    health_routes,
    start_health_server,
)
from ghostgpu.tracer.sinks import CallbackSink
from prometheus_client.parser import text_string_to_metric_families

from ghostgpu.common.model.consumers import ConsumerClass
from ghostgpu.common.web.httpserve import HttpListenError, HttpServer
from tests.helpers.fake_collector import FakeCollector
from tests.helpers.httpget import http_get
from tests.helpers.polling import wait_until
from tests.unit.test_tracer_node import ScriptedNvml, stop, tracer

PROMTOOL = "/usr/bin/promtool"


class Clock:
    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(text: str, name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise AssertionError(f"no sample {name}{labels} in:\n{text}")


# --- the state machine ----------------------------------------------------------------------

def test_not_ready_until_start_finished_then_ready() -> None:
    clock = Clock()
    h = AgentHealth(clock=clock)
    ready, lines = h.readiness()
    assert not ready
    assert [ln.split(":")[0] for ln in lines] == ["bpf", "proc scan", "start"]
    assert all("waiting" in ln for ln in lines), lines
    h.bpf_started(14)
    clock.now_s += 4.0
    h.scan_observed(0.02)
    ready, lines = h.readiness()
    assert not ready and lines[0] == "bpf: ok (14 tracepoint programs attached)"
    assert lines[1] == "proc scan: ok (first scan took 0.020 s)" and "waiting" in lines[2]
    h.started()
    assert h.readiness() == (True, [lines[0], lines[1], "start: ok"])


def test_bpf_knowingly_off_is_ready() -> None:
    h = AgentHealth(clock=Clock())
    h.bpf_started(0, "--bpf off")
    h.scan_observed(0.5)
    h.started()
    ready, lines = h.readiness()
    assert ready and lines[0] == "bpf: ok (off: --bpf off; /proc scans only)"


def test_live_while_starting_until_the_start_deadline() -> None:
    clock = Clock()
    h = AgentHealth(clock=clock, start_deadline_s=120.0)
    clock.now_s += 119.0
    ok, line = h.liveness()
    assert ok and "starting" in line
    clock.now_s += 2.0
    ok, line = h.liveness()
    assert not ok and "start has not finished after 121.0 s" in line


def test_live_then_stale_when_the_loop_stops_stepping() -> None:
    clock = Clock()
    h = AgentHealth(clock=clock, live_window_s=30.0)
    h.started()
    clock.now_s += 29.5
    assert h.liveness()[0]
    h.stepped()
    clock.now_s += 31.0
    ok, line = h.liveness()
    assert not ok and "last ran 31.0 s ago" in line and "limit 30 s" in line
    h.stepped()  # a loop that comes back is live again
    assert h.liveness() == (True, "ok: agent loop ran 0.0 s ago")


def test_last_step_timestamp_is_wall_time_of_the_step() -> None:
    clock, wall = Clock(50.0), Clock(1_700_000_000.0)
    h = AgentHealth(clock=clock, wall_clock=wall)
    assert h.last_step_unix_s() is None
    h.started()
    clock.now_s += 7.0
    wall.now_s += 7.0
    assert h.last_step_unix_s() == pytest.approx(1_700_000_000.0)


def test_scan_histogram_buckets() -> None:
    h = AgentHealth(clock=Clock())
    for d in (0.003, 0.2, 0.2, 30.0):
        h.scan_observed(d)
    counts, total_s, n = h.scans()
    assert n == 4 and total_s == pytest.approx(30.403)
    assert counts[0] == 1 and counts[SCAN_BUCKETS_S.index(0.25)] == 2 and counts[-1] == 1
    assert h.first_scan_s == 0.003


# --- /metrics, /healthz, /readyz over HTTP ----------------------------------------------------

class FakeStream:
    def stats(self) -> dict[str, Any]:
        return {"connected": True, "spooled": 3, "dropped": 2, "events_sent": 41}


def fake_tracer() -> SimpleNamespace:
    consumers = {i: SimpleNamespace(cls=cls) for i, cls in enumerate(
        (ConsumerClass.HIDDEN, ConsumerClass.HIDDEN, ConsumerClass.VISIBLE))}
    return SimpleNamespace(
        bpf_stats=lambda: {"ringbuf_drops": 5, "fds_full": 2, "holds_full": 0},
        nvml=NvmlView(available=True), state=SimpleNamespace(holders={10: None, 11: None}),
        consumers=consumers, errors=Containment())


@pytest.fixture
def served() -> Any:
    clock = Clock()
    h = AgentHealth(clock=clock)
    server = HttpServer("127.0.0.1:0", health_routes(h), flag="--health-listen", name="health").start()
    try:
        yield h, clock, server
    finally:
        server.stop()


def test_probes_over_http(served: Any) -> None:
    h, clock, server = served
    status, body = http_get(f"{server.url}/readyz")
    assert status == 503 and body.count("\n") == 3 and "bpf: waiting" in body
    assert http_get(f"{server.url}/healthz")[0] == 200
    h.bpf_started(14)
    h.scan_observed(0.01)
    h.started()
    assert http_get(f"{server.url}/readyz") == (200, "bpf: ok (14 tracepoint programs attached)\n"
                                                 "proc scan: ok (first scan took 0.010 s)\nstart: ok\n")
    clock.now_s += 45.0
    status, body = http_get(f"{server.url}/healthz")
    assert status == 503 and "last ran 45.0 s ago" in body


def test_metrics_carry_the_agent_numbers_and_every_family(served: Any) -> None:
    h, _clock, server = served
    h.tracer, h.stream = fake_tracer(), FakeStream()
    h.bpf_started(14)
    h.scan_observed(0.04)
    h.started()
    status, text = http_get(f"{server.url}/metrics")
    assert status == 200
    fams = families(text)
    ours = {name for name in fams if name.startswith("ghostgpu_")}
    # The parser names counters without _total.
    assert ours == {name.removesuffix("_total") for name in TRACER_METRICS}
    for name, (kind, help_text) in TRACER_METRICS.items():
        fam = fams[name.removesuffix("_total")]
        assert (fam.type, fam.documentation) == (kind, help_text), name
    assert sample(text, "ghostgpu_agent_ready") == 1
    assert sample(text, "ghostgpu_agent_bpf_programs_attached") == 14
    assert sample(text, "ghostgpu_agent_ringbuf_drops_total") == 5
    assert sample(text, "ghostgpu_agent_bpf_errors_total", kind="fds_full") == 2
    assert sample(text, "ghostgpu_agent_bpf_errors_total", kind="procs_full") == 0
    assert sample(text, "ghostgpu_agent_scan_duration_seconds_count") == 1
    assert sample(text, "ghostgpu_agent_scan_duration_seconds_bucket", le="0.05") == 1
    assert sample(text, "ghostgpu_agent_scan_duration_seconds_bucket", le="0.025") == 0
    assert sample(text, "ghostgpu_agent_nvml_available") == 1
    assert sample(text, "ghostgpu_agent_holders") == 2
    assert sample(text, "ghostgpu_agent_consumers", **{"class": "hidden"}) == 2
    assert sample(text, "ghostgpu_agent_consumers", **{"class": "visible"}) == 1
    assert sample(text, "ghostgpu_agent_consumers", **{"class": "ghost"}) == 0
    assert sample(text, "ghostgpu_agent_stream_connected") == 1
    assert sample(text, "ghostgpu_agent_spool_events") == 3
    assert sample(text, "ghostgpu_agent_spool_dropped_total") == 2
    assert sample(text, "ghostgpu_agent_events_sent_total") == 41
    assert sample(text, "ghostgpu_build_info", api_version="1") == 1
    assert "process_resident_memory_bytes" in fams and "python_info" in fams


def test_contained_errors_are_counted_and_make_healthz_degraded(served: Any) -> None:
    h, _clock, server = served
    h.tracer = fake_tracer()
    h.started()
    assert http_get(f"{server.url}/healthz") == (200, "ok: agent loop ran 0.0 s ago\n")
    text = http_get(f"{server.url}/metrics")[1]
    assert [sample(text, "ghostgpu_agent_errors_total", stage=s) for s in STAGES] == [0] * len(STAGES)

    def bad_event() -> None:
        raise KeyError(42)

    assert h.tracer.errors.run("event", bad_event) is None  # contained: no exception escapes
    h.tracer.errors.run("event", bad_event)
    status, body = http_get(f"{server.url}/healthz")
    assert status == 200 and body.startswith("degraded: agent loop ran 0.0 s ago; 2 unexpected errors "
                                             "contained (event 2); last: event: KeyError: 42 (")
    text = http_get(f"{server.url}/metrics")[1]
    assert sample(text, "ghostgpu_agent_errors_total", stage="event") == 2
    assert sample(text, "ghostgpu_agent_errors_total", stage="scan") == 0


def test_stream_families_only_when_streaming(served: Any) -> None:
    _h, _clock, server = served
    text = http_get(f"{server.url}/metrics")[1]
    fams = families(text)
    assert "ghostgpu_agent_stream_connected" not in fams and "ghostgpu_agent_spool_events" not in fams
    assert "ghostgpu_agent_loop_last_step_timestamp_seconds" not in fams, "no step yet: no timestamp"
    assert sample(text, "ghostgpu_agent_ready") == 0


def test_promtool_check_metrics_is_silent(served: Any) -> None:
    if not os.access(PROMTOOL, os.X_OK):
        pytest.skip(f"{PROMTOOL} missing: apt-get install prometheus (scripts/bootstrap.sh install)")
    h, _clock, server = served
    h.tracer, h.stream = fake_tracer(), FakeStream()
    h.scan_observed(0.2)
    h.started()
    text = http_get(f"{server.url}/metrics")[1]
    res = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True,
                         timeout=30)
    assert (res.returncode, res.stdout, res.stderr) == (0, "", "")


# --- the agent reports into it ----------------------------------------------------------------

def test_the_agent_reports_start_steps_and_scans() -> None:
    clock = Clock()
    h = AgentHealth(clock=clock)
    t = Tracer(TracerConfig(node_name="node-h", bpf="off"), CallbackSink(lambda _r: None), health=h)
    t.nvml_source = ScriptedNvml(NvmlView(available=False, error="NVML: no library"))  # type: ignore[assignment]
    try:
        assert h.tracer is t and not h.readiness()[0]
        t.start()
        ready, lines = h.readiness()
        assert ready and lines[0] == "bpf: ok (off: --bpf off; /proc scans only)", lines
        assert h.scans()[2] == 1 and h.last_step_s == clock.now_s
        clock.now_s += 60.0
        assert not h.liveness()[0]
        t.step(timeout_ms=1)
        assert h.liveness()[0] and h.last_step_s == clock.now_s
    finally:
        t.close()


# --- bad addresses --------------------------------------------------------------------------

@pytest.mark.parametrize("addr", ["nope", "127.0.0.1", "127.0.0.1:http", "127.0.0.1:70000", ":"])
def test_a_bad_listen_value_is_one_config_line(addr: str) -> None:
    with pytest.raises(ConfigError) as err:
        TracerConfig(node_name="n", health_listen=addr)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("health_listen (--health-listen") and repr(addr) in msg


def test_the_env_and_the_toml_key_reach_the_config(tmp_path: Path) -> None:
    assert load_config(env={"GHOSTGPU_HEALTH_LISTEN": "0.0.0.0:9401"}).health_listen == "0.0.0.0:9401"
    toml = tmp_path / "t.toml"
    toml.write_text('[tracer]\nhealth_listen = "127.0.0.1:0"\n')
    assert load_config(toml, env={}).health_listen == "127.0.0.1:0"
    assert load_config(env={}).health_listen == ""
    with pytest.raises(ConfigError, match="GHOSTGPU_HEALTH_LISTEN"):
        load_config(env={"GHOSTGPU_HEALTH_LISTEN": "9401"})


def test_a_busy_port_names_the_flag() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        addr = f"127.0.0.1:{busy.getsockname()[1]}"
        with pytest.raises(HttpListenError) as err:
            start_health_server(addr, AgentHealth())
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"--health-listen {addr}: cannot bind")


# --- a real `ghostgpu tracer` process (BPF off) -------------------------------------------------

def health_address(tmp_path: Path) -> str | None:
    for line in (tmp_path / "stderr").read_text().splitlines():
        if line.startswith("ghostgpu: health: serving on "):
            return line.split()[4]
    return None


def test_a_busy_health_port_exits_2_before_bpf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        monkeypatch.setenv("GHOSTGPU_HEALTH_LISTEN", f"127.0.0.1:{busy.getsockname()[1]}")
        # --bpf off is in the helper's command; `--bpf on` after it wins: a bind after the BPF
        # load would print the load's outcome (or a `ready` record), never this line.
        proc = tracer(["--bpf", "on"], tmp_path, stdout=subprocess.PIPE)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and out == b""
    err = (tmp_path / "stderr").read_text()
    assert err.strip().count("\n") == 0 and "--health-listen" in err and "cannot bind" in err, err


def test_a_bad_health_listen_env_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GHOSTGPU_HEALTH_LISTEN", "no-port")
    proc = tracer([], tmp_path)
    assert proc.wait(60) == 2
    err = (tmp_path / "stderr").read_text()
    assert err.strip().count("\n") == 0 and "GHOSTGPU_HEALTH_LISTEN" in err and "'no-port'" in err, err


def test_a_bad_health_listen_flag_exits_2(tmp_path: Path) -> None:
    proc = tracer(["--health-listen", "9401"], tmp_path)
    assert proc.wait(60) == 2
    err = (tmp_path / "stderr").read_text()
    assert err.strip().count("\n") == 0 and "--health-listen" in err and "'9401'" in err, err


def test_a_streaming_tracer_serves_its_health(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GHOSTGPU_HEALTH_LISTEN", "127.0.0.1:0")
    with FakeCollector() as collector:
        proc = tracer(["--collector", collector.target], tmp_path)
        try:
            wait_until(lambda: health_address(tmp_path) is not None, "the health line on stderr", 30)
            url = f"http://{health_address(tmp_path)}"
            wait_until(lambda: http_get(f"{url}/readyz")[0] == 200, "/readyz 200", 30)
            assert http_get(f"{url}/healthz")[0] == 200
            wait_until(lambda: collector.seqs() != [], "events at the collector", 30)

            def streamed() -> bool:
                text = http_get(f"{url}/metrics")[1]
                return (sample(text, "ghostgpu_agent_stream_connected") == 1
                        and sample(text, "ghostgpu_agent_events_sent_total") >= 1)

            wait_until(streamed, "stream_connected 1 and events sent", 30)
            text = http_get(f"{url}/metrics")[1]
            assert sample(text, "ghostgpu_agent_ready") == 1
            assert sample(text, "ghostgpu_agent_bpf_programs_attached") == 0
            assert sample(text, "ghostgpu_agent_nvml_available") == 0
            assert sample(text, "ghostgpu_agent_scan_duration_seconds_count") >= 1
        finally:
            assert stop(proc) == 0
    assert_port_released(url)


def assert_port_released(url: str) -> None:
    """Nothing listens there any more: a connect is refused, and a restarted tracer (which binds with
    SO_REUSEADDR, as http.server does, past our probes' TIME_WAIT) can bind it again."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=5).close()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, int(port)))
        s.listen()

