"""`ghostgpu up --metrics-listen --health-listen`: the embedded collector serves /metrics showing its
own node's tracer, and the tracer child serves /readyz and /metrics on the address up passed it.
Real processes, BPF and a fake NVML with one GPU (so the GPU families have a series)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from tests.helpers.fakenvml import FakeNvml
from tests.helpers.httpget import http_get
from tests.helpers.polling import wait_until
from tests.helpers.promstack import free_port
from tests.integration.test_up import REPO, _environment, _processes_with, _up
from tests.unit.test_metrics import samples


@pytest.mark.root
@pytest.mark.bpf
def test_up_serves_collector_metrics_and_passes_health_listen(tmp_path: Path, root_bpf: None,
                                                              fake_nvml: FakeNvml) -> None:
    metrics, health = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(_up(tmp_path, "--metrics-listen", metrics, "--health-listen", health),
                            env=_environment(fake_nvml.env()), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        def connected() -> bool:
            status, text = http_get(f"http://{metrics}/metrics")
            got = samples(text) if status == 200 else {}
            return got.get("ghostgpu_tracer_connected") == [({"node": "up-node"}, 1)] and bool(
                got.get("ghostgpu_gpu_info"))

        wait_until(lambda: proc.poll() is not None or connected(), "up-node connected on /metrics",
                   timeout_s=90)
        assert proc.poll() is None, proc.communicate()[1]
        got = samples(http_get(f"http://{metrics}/metrics")[1])
        assert got["ghostgpu_tracer_bpf_attached"] == [({"node": "up-node"}, 1)]
        assert got["ghostgpu_tracers_connected"] == [({}, 1)]
        wait_until(lambda: http_get(f"http://{health}/readyz")[0] == 200, "the tracer child's /readyz",
                   timeout_s=60)
        agent = samples(http_get(f"http://{health}/metrics")[1])
        assert agent["ghostgpu_agent_ready"] == [({}, 1)]
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert http_get(f"http://{metrics}/metrics")[0] == 0 and http_get(f"http://{health}/readyz")[0] == 0
    assert _processes_with(str(tmp_path)) == []


def test_up_bad_metrics_listen_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = subprocess.run(_up(tmp_path, "--metrics-listen", "9400"), capture_output=True, text=True,
                          timeout=60, cwd=REPO, env=_environment())
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "ghostgpu: --metrics-listen '9400': use HOST:PORT (e.g. 0.0.0.0:9400; port 0 picks a free one)"]
