"""The real tracer's health server (BPF, fake NVML, a fake container): /readyz turns 503 -> 200 while
BPF compiles, /metrics counts the attached programs and a planted hidden consumer, a wedged agent
loop (an NVML call that never returns) fails /healthz, and SIGTERM frees the port."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.tracer.health import LIVE_WINDOW_S, TRACER_METRICS
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.container import FakeContainer
from tests.helpers.fakenvml import FakeNvml
from tests.helpers.httpget import http_get
from tests.helpers.polling import wait_until
from tests.helpers.tracer_proc import TracerProcess
from tests.helpers.workload import allocates
from tests.unit.test_health import assert_port_released

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.usefixtures("root_bpf")]

# Port 0: the kernel picks a free one and the tracer prints it ("ghostgpu: health: serving on ...").
# One test sets it by flag, the other by environment (the config loader's GHOSTGPU_HEALTH_LISTEN).
HEALTH_FLAG = ["--health-listen", "127.0.0.1:0"]
HEALTH_ENV = {"GHOSTGPU_HEALTH_LISTEN": "127.0.0.1:0"}
FAST = ["--grace-s", "0.5"]
HEALTH_LINE = "ghostgpu: health: serving on "


def wait_http(predicate: Callable[[], bool], what: str, timeout_s: float) -> None:
    """wait_until with a gentler interval: each check is an HTTP round trip to the tracer, and the
    wedge test waits out the 30 s liveness window (the shared 5 ms would be ~6,000 requests)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)  # polling interval of a deadline loop, not a wait for a result


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(text: str, name: str, **labels: str) -> float:
    return samples(text)[(name, tuple(sorted(labels.items())))]


def health_url(tracer: TracerProcess) -> str:
    """The bound address from the tracer's stderr, waiting for the line with a deadline."""
    found: list[str] = []

    def line() -> bool:
        found[:] = [ln.removeprefix(HEALTH_LINE).split()[0] for ln in tracer.stderr().splitlines()
                    if ln.startswith(HEALTH_LINE)]
        assert tracer.proc.poll() is None, f"tracer exited: {tracer.stderr()}"
        return bool(found)

    wait_until(line, "the tracer's health line on stderr", timeout_s=15)
    return f"http://{found[0]}"


def open_findings(tracer: TracerProcess, cls: str) -> set[tuple[Any, ...]]:
    """Consumers of class `cls` open now by the tracer's own records (finding/resolved)."""
    now: dict[tuple[Any, ...], str] = {}
    for r in tracer.matching(lambda r: r.get("event") in ("finding", "resolved")):
        key = (r.get("pid"), r.get("gpu_uuid"), r.get("gpu"))
        if r["event"] == "finding":
            now[key] = r["class"]
        else:
            now.pop(key, None)
    return {key for key, c in now.items() if c == cls}


def test_ready_metrics_and_a_planted_consumer(tmp_path: Path, fake_nvml: FakeNvml) -> None:
    with TracerProcess(tmp_path, [*FAST, *HEALTH_FLAG], fake_nvml.env()) as tracer:
        url = health_url(tracer)
        # The server is up before the BPF compile (seconds): not ready, yet alive.
        status, body = http_get(f"{url}/readyz")
        assert status == 503 and "waiting" in body, body
        assert http_get(f"{url}/healthz")[0] == 200
        wait_http(lambda: http_get(f"{url}/readyz")[0] == 200, "/readyz 200", timeout_s=60)
        status, body = http_get(f"{url}/readyz")
        assert "tracepoint programs attached" in body.splitlines()[0], body
        tracer.wait_ready()  # the `ready` record follows start(), which /readyz reported
        text = http_get(f"{url}/metrics")[1]
        assert value(text, "ghostgpu_agent_ready") == 1
        assert value(text, "ghostgpu_agent_bpf_programs_attached") > 0
        assert value(text, "ghostgpu_agent_nvml_available") == 1
        assert value(text, "ghostgpu_agent_scan_duration_seconds_count") >= 1
        assert value(text, "ghostgpu_agent_ringbuf_drops_total") == 0
        names = {fam.name for fam in text_string_to_metric_families(text)}
        assert {n.removesuffix("_total") for n in TRACER_METRICS if "stream" not in n and "spool" not in n
                and "events_sent" not in n} <= names

        with FakeContainer() as c:
            # A GPU job (it allocates a compute class): one that only opened would be a `monitor`.
            p = c.run(["open", "/dev/nvidiactl", "open", "/dev/nvidia0", *allocates(), "ready", "wait"])
            p.wait_ready()
            tracer.wait_for(lambda r: r.get("event") == "finding" and r.get("pid") == p.host_pid
                            and r.get("class") == "hidden", what="hidden finding")

            def metrics_agree() -> bool:
                # Other tests on this machine may plant consumers too: the metric must equal what
                # the tracer itself reports open, and include ours.
                text = http_get(f"{url}/metrics")[1]
                hidden = open_findings(tracer, "hidden")
                return (any(key[0] == p.host_pid for key in hidden)
                        and value(text, "ghostgpu_agent_consumers", **{"class": "hidden"}) == len(hidden)
                        and value(text, "ghostgpu_agent_holders") >= 1)

            wait_http(metrics_agree, "hidden consumer in ghostgpu_agent_consumers", timeout_s=15)
            p.release()
            tracer.wait_for(lambda r: r.get("event") == "resolved" and r.get("pid") == p.host_pid,
                            what="resolved")

        def ours_gone() -> bool:
            text = http_get(f"{url}/metrics")[1]
            hidden = open_findings(tracer, "hidden")
            return (not any(key[0] == p.host_pid for key in hidden)
                    and value(text, "ghostgpu_agent_consumers", **{"class": "hidden"}) == len(hidden))

        wait_http(ours_gone, "the hidden consumer gone from the metrics", timeout_s=15)
        assert tracer.stop() == 0
        assert_port_released(url)


def test_a_wedged_agent_loop_fails_liveness(tmp_path: Path, fake_nvml: FakeNvml) -> None:
    with TracerProcess(tmp_path, FAST, {**fake_nvml.env(), **HEALTH_ENV}) as tracer:
        url = health_url(tracer)
        wait_http(lambda: http_get(f"{url}/readyz")[0] == 200, "/readyz 200", timeout_s=60)
        # The fake NVML reads its config on every call: a FIFO with no writer blocks that read in
        # open(2), as a hung driver call would, and the agent loop (1 s NVML interval) stops.
        config = fake_nvml.config_path
        fifo = config.with_name("wedge.fifo")
        os.mkfifo(fifo)
        os.link(fifo, config.with_name("wedge.link"))
        os.replace(config.with_name("wedge.link"), config)
        try:
            wait_http(lambda: http_get(f"{url}/healthz")[0] == 503, "/healthz 503 on a wedged loop",
                      timeout_s=LIVE_WINDOW_S + 30)
            status, body = http_get(f"{url}/healthz")
            assert status == 503 and "agent loop last ran" in body, body
            assert http_get(f"{url}/readyz")[0] == 200, "started stays started; liveness restarts the pod"
        finally:
            # Unwedge: the real config back under its name first, then a writer that closes at once
            # gives the blocked reader EOF, so no later call can open the FIFO again.
            fake_nvml.write()
            with contextlib.suppress(OSError):  # ENXIO: nobody is blocked reading it
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        wait_http(lambda: http_get(f"{url}/healthz")[0] == 200, "/healthz 200 once the loop runs again",
                  timeout_s=30)
        assert tracer.stop() == 0
        assert_port_released(url)

