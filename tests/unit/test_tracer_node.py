"""`ghostgpu tracer` as a real process (BPF off, so no root): JSON lines alone, or streaming to a
collector with the CRI relay and the PodResources poller, stopped by SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

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
        assert hello.node == "node-t" and list(hello.capabilities) == ["cri-relay", "podresources"]
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
    assert err.strip().count("\n") == 0 and "collector address 'no-port-here'" in err
