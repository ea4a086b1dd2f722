"""`ghostgpu tracer` as a real process (BPF off, so no root): JSON lines alone, or streaming to a
collector with the CRI relay and the PodResources poller, stopped by SIGTERM; and the agent's
`info` record as NVML comes and its GPUs change."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.tracer.agent import Tracer
from ghostgpu.tracer.config import TracerConfig
from ghostgpu.tracer.events import NvmlGpu, NvmlProcess, NvmlView
from ghostgpu.tracer.sinks import CallbackSink

from ghostgpu.k8s import cri_runtime_v1_pb2 as cri
from ghostgpu.v1 import stream_pb2
from tests.helpers.fake_collector import FakeCollector
from tests.helpers.podresources_server import Container, Pod, PodResourcesServer
from tests.helpers.polling import wait_until
from tests.unit.test_cri_relay import RawRuntime

ROOT = Path(__file__).resolve().parents[2]
UUID0 = "GPU-6a1cd0c3-0000-4000-8000-000000000000"


def tracer(args: list[str], tmp_path: Path, stdout: int | None = subprocess.DEVNULL,
           ) -> subprocess.Popen[bytes]:
    # No NVML library here: LD_LIBRARY_PATH points at an empty directory so a host driver cannot answer.
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path), "GHOSTGPU_SCAN_INTERVAL_S": "60"}
    with open(tmp_path / "stderr", "w") as stderr:  # the child keeps its own copy of the descriptor
        cmd = [sys.executable, "-m", "ghostgpu.cli", "tracer", "--bpf", "off", "--node-name", "node-t", *args]
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=stdout, stderr=stderr)


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


@pytest.fixture
def collector() -> Iterator[FakeCollector]:
    with FakeCollector() as c:
        yield c


def test_jsonl_to_stdout_without_a_collector(tmp_path: Path) -> None:
    proc = tracer([], tmp_path, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        seen: list[dict[str, object]] = []
        deadline = time.monotonic() + 30
        while not any(r["event"] == "info" for r in seen) and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(json.loads(line))
        kinds = [r["event"] for r in seen]
        assert "ready" in kinds and kinds.index("info") == kinds.index("ready") + 1, kinds
        info = seen[kinds.index("info")]
        assert info["node"] == "node-t" and info["bpf"] is False
        assert info["nvml"] is False and info["gpus"] == []
        assert "allocations" not in kinds, "no PodResources poller without --collector or its endpoint"
    finally:
        assert stop(proc) == 0


def test_streaming_with_relay_and_podresources(collector: FakeCollector, tmp_path: Path) -> None:
    runtime = RawRuntime(str(tmp_path / "containerd.sock"))
    kubelet = PodResourcesServer(str(tmp_path / "kubelet.sock")).start()
    kubelet.pods = [Pod("ml", "train-0", [Container("main", {"nvidia.com/gpu": [f"{UUID0}::1"]})])]
    jsonl = tmp_path / "tracer.jsonl"
    proc = tracer(["--collector", collector.target, "--jsonl", str(jsonl), "--cri-endpoint",
                   f"unix://{runtime.path}", "--podresources-endpoint", f"unix://{kubelet.socket_path}"],
                  tmp_path)
    try:
        wait_until(lambda: any(ev.WhichOneof("body") == "allocations" for ev in collector.events()),
                   "the allocations event", timeout_s=30)
        hello = collector.messages("hello")[0].msg.hello
        assert hello.node == "node-t"
        assert list(hello.capabilities) == ["cri-relay", "podresources", "remediation"]  # --remediation on
        assert collector.messages("snapshot")[0].msg.snapshot.info.nvml is False
        alloc = next(ev.allocations for ev in collector.events() if ev.WhichOneof("body") == "allocations")
        assert alloc.available and alloc.containers[0].device_ids == [UUID0]
        assert collector.seqs() == list(range(1, len(collector.seqs()) + 1))
        collector.send_command(stream_pb2.Command(id=7, cri=stream_pb2.CriRequest(method="Version")))
        wait_until(lambda: collector.messages("result"), "the relayed Version")
        result = collector.messages("result")[0].msg.result
        assert result.id == 7 and result.cri.code == 0
        assert cri.VersionResponse.FromString(result.cri.response).runtime_name == "fakecri"
        assert stop(proc) == 0
        stderr = (tmp_path / "stderr").read_text()
        assert "not acknowledged" not in stderr, stderr
        lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
        streamed = [r for r in lines if r["event"] != "ready"]
        assert len(streamed) == len(collector.seqs()), "the JSON lines and the stream carry the same records"
    finally:
        if proc.poll() is None:
            proc.kill()
        runtime.stop()
        kubelet.stop()


def test_a_bad_collector_address_is_one_line(tmp_path: Path) -> None:
    proc = tracer(["--collector", "no-port-here"], tmp_path)
    assert proc.wait(30) == 2
    err = (tmp_path / "stderr").read_text()
    assert err.strip().count("\n") == 0 and "--collector 'no-port-here'" in err


@pytest.mark.parametrize("spool_events", ["0", "-1"])
def test_a_spool_of_no_events_is_refused(tmp_path: Path, spool_events: str) -> None:
    proc = tracer(["--collector", "127.0.0.1:1", "--spool-events", spool_events], tmp_path)
    assert proc.wait(30) == 2
    err = (tmp_path / "stderr").read_text()
    assert err.strip().count("\n") == 0 and "--spool-events" in err and f"got {spool_events}" in err


class ScriptedNvml:
    """Stands in for tracer.nvml.NvmlSource: each read() returns the view a test set last."""

    def __init__(self, view: NvmlView) -> None:
        self.view = view
        self.reads = 0

    def read(self) -> NvmlView:
        self.reads += 1
        return self.view

    def close(self) -> None:
        pass


def test_info_after_ready_and_when_nvml_or_its_gpus_change() -> None:
    out: list[dict[str, Any]] = []
    cfg = TracerConfig(node_name="node-i", bpf="off", nvml_interval_s=0.001)
    tracer = Tracer(cfg, CallbackSink(out.append))
    nvml = ScriptedNvml(NvmlView(available=False, error="NVML: driver not loaded"))
    tracer.nvml_source = nvml  # type: ignore[assignment]
    gpu0 = NvmlGpu(index=0, uuid="GPU-a", minor=0, name="H100", memory_total_bytes=80 << 30)

    def infos() -> list[dict[str, Any]]:
        return [r for r in out if r["event"] == "info"]

    def step_until(count: int, what: str) -> None:
        wait_until(lambda: tracer.step(timeout_ms=1) or len(infos()) == count, what)

    try:
        tracer.start()
        kinds = [r["event"] for r in out]
        assert kinds.index("info") == kinds.index("ready") + 1
        assert infos()[0]["nvml"] is False and infos()[0]["nvml_error"] == "NVML: driver not loaded"
        nvml.view = NvmlView(available=True, driver_version="550.54.15", gpus=(gpu0,))
        step_until(2, "info once NVML answers")
        assert infos()[1]["gpus"] == [{"index": 0, "uuid": "GPU-a", "name": "H100", "minor": 0,
                                       "memory_total_bytes": 80 << 30, "pci_bus_id": "",
                                       "memory_used_bytes": None, "memory_listed_bytes": 0,
                                       "memory_unlisted_bytes": 0, "unaccounted_bytes": None}]
        reads = nvml.reads
        wait_until(lambda: tracer.step(timeout_ms=1) or nvml.reads >= reads + 5, "five more NVML reads")
        assert len(infos()) == 2, "the same GPUs again are no news"
        nvml.view = NvmlView(available=True, driver_version="550.54.15",
                             gpus=(gpu0, replace(gpu0, index=1, uuid="GPU-b", minor=1)))
        step_until(3, "info for the second GPU")
        assert [g["uuid"] for g in infos()[2]["gpus"]] == ["GPU-a", "GPU-b"]
    finally:
        tracer.close()


def test_info_again_when_a_gpus_memory_split_moves_a_mib() -> None:
    """NVML's used memory split (listed + unlisted + unaccounted) is re-sent when a figure moves by
    1 MiB or more, at most once per NVML refresh; NVML's used memory drifting by less is no news."""
    out: list[dict[str, Any]] = []
    cfg = TracerConfig(node_name="node-i", bpf="off", nvml_interval_s=0.001)
    tracer = Tracer(cfg, CallbackSink(out.append))
    gib = 1 << 30
    listed = (NvmlProcess(pid=999_999, used_gpu_memory_bytes=4 * gib),)
    gpu0 = NvmlGpu(index=0, uuid="GPU-a", minor=0, memory_used_bytes=10 * gib, processes=listed)
    nvml = ScriptedNvml(NvmlView(available=True, driver_version="595.45.04", gpus=(gpu0,)))
    tracer.nvml_source = nvml  # type: ignore[assignment]

    def splits() -> list[tuple[Any, ...]]:
        return [tuple(r["gpus"][0][k] for k in ("memory_used_bytes", "memory_listed_bytes",
                                               "memory_unlisted_bytes", "unaccounted_bytes"))
                for r in out if r["event"] == "info"]

    try:
        tracer.start()
        assert splits() == [(10 * gib, 4 * gib, 0, 6 * gib)]
        nvml.view = replace(nvml.view, gpus=(replace(gpu0, memory_used_bytes=10 * gib + (1 << 19)),))
        reads = nvml.reads
        wait_until(lambda: tracer.step(timeout_ms=1) or nvml.reads >= reads + 5, "five more NVML reads")
        assert len(splits()) == 1, "half a MiB more is no news"
        nvml.view = replace(nvml.view, gpus=(replace(gpu0, memory_used_bytes=11 * gib),))
        wait_until(lambda: tracer.step(timeout_ms=1) or len(splits()) == 2, "info for a GiB more")
        assert splits()[1] == (11 * gib, 4 * gib, 0, 7 * gib)
    finally:
        tracer.close()
