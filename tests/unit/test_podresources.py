"""The PodResources poller against a kubelet-shaped gRPC server on a real unix socket."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
from ghostgpu.tracer.podresources import PodResourcesPoller, containers_of

from ghostgpu.common.model.records import AllocationsRecord
from tests.helpers.podresources_server import Container, Pod, PodResourcesServer, response_for
from tests.helpers.polling import wait_until

UUID0 = "GPU-6a1cd0c3-0000-4000-8000-000000000000"
UUID1 = "GPU-6a1cd0c3-0000-4000-8000-000000000001"
MIG = "MIG-1f0f7f4e-3c2d-5a43-9e2e-000000000000"


class Collect:
    """The emitted records, as the JSON they write."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def __call__(self, rec: AllocationsRecord) -> None:
        assert isinstance(rec, AllocationsRecord)  # typed: the stream maps it to proto directly
        with self._lock:
            self.records.append(rec.to_json())

    def __len__(self) -> int:
        with self._lock:
            return len(self.records)


@pytest.fixture
def kubelet(tmp_path: Path):
    with PodResourcesServer(str(tmp_path / "kubelet.sock")) as server:
        yield server


TRAIN = Pod("ml", "train-0", [Container("main", {"nvidia.com/gpu": [f"{UUID0}::0", f"{UUID0}::3", UUID1]},
                                        cpu_ids=[2, 3]),
                              Container("sidecar")])
INFER = Pod("serving", "infer-7",
            [Container("srv", {"nvidia.com/mig-1g.10gb": [MIG], "example.com/nic": ["eth1"]})])


def test_containers_keep_every_device_resource_and_lose_replicas() -> None:
    dra = Pod("dra", "claim-pod", [Container("c", cdi_devices=[f"k8s.gpu.nvidia.com/gpu={UUID1}"])])
    assert [c.to_json() for c in containers_of(response_for([TRAIN, INFER, dra]))] == [
        {"namespace": "dra", "pod": "claim-pod", "container": "c", "resource_names": ["gpu.nvidia.com"],
         "device_ids": [UUID1, f"k8s.gpu.nvidia.com/gpu={UUID1}"]},
        {"namespace": "ml", "pod": "train-0", "container": "main", "resource_names": ["nvidia.com/gpu"],
         "device_ids": [UUID0, UUID1]},
        {"namespace": "serving", "pod": "infer-7", "container": "srv",
         "resource_names": ["example.com/nic", "nvidia.com/mig-1g.10gb"], "device_ids": [MIG, "eth1"]},
    ]


def test_emits_on_start_and_on_change_only(kubelet: PodResourcesServer) -> None:
    kubelet.pods = [TRAIN]
    out = Collect()
    poller = PodResourcesPoller(f"unix://{kubelet.socket_path}", out, interval_s=0.02, node="n1")
    poller.start()
    try:
        wait_until(lambda: len(out) == 1, "the first allocations record")
        first = out.records[0]
        assert first["event"] == "allocations" and first["node"] == "n1" and first["available"] is True
        assert first["error"] == ""
        assert first["containers"] == [{"namespace": "ml", "pod": "train-0", "container": "main",
                                        "resource_names": ["nvidia.com/gpu"], "device_ids": [UUID0, UUID1]}]
        calls = kubelet.calls
        wait_until(lambda: kubelet.calls >= calls + 5, "five more polls")
        assert len(out) == 1, "the same answer was emitted again"
        # The same allocation in another order is the same answer.
        kubelet.pods = [Pod("ml", "train-0", [Container("sidecar"), Container(
            "main", {"nvidia.com/gpu": [UUID1, f"{UUID0}::7"]}, cpu_ids=[9])])]
        calls = kubelet.calls
        wait_until(lambda: kubelet.calls >= calls + 3, "three more polls")
        assert len(out) == 1
        kubelet.pods = [TRAIN, INFER]
        wait_until(lambda: len(out) == 2, "a record for the new pod")
        assert [c["pod"] for c in out.records[1]["containers"]] == ["train-0", "infer-7"]
    finally:
        poller.stop()


def test_unavailable_is_reported_once_per_transition(kubelet: PodResourcesServer,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    kubelet.pods = [INFER]
    out = Collect()
    poller = PodResourcesPoller(kubelet.socket_path, out, interval_s=0.02)
    poller.start()
    try:
        wait_until(lambda: len(out) == 1, "the first record")
        with caplog.at_level(logging.INFO, logger="ghostgpu.podresources"):
            kubelet.stop()  # kubelet goes away: its socket is gone
            wait_until(lambda: len(out) == 2, "the unavailable record")
            down = out.records[1]
            assert down["available"] is False and down["containers"] == []
            assert kubelet.socket_path in down["error"] and "--podresources-endpoint" in down["error"]
            kubelet.start()
            kubelet.fail = (grpc.StatusCode.UNAVAILABLE, "kubelet is restarting")
            wait_until(lambda: len(out) == 3, "the failing-kubelet record")
            failing = out.records[2]
            assert failing["available"] is False and "UNAVAILABLE" in failing["error"]
            calls = kubelet.calls
            wait_until(lambda: kubelet.calls >= calls + 5, "five more failing polls")
            assert len(out) == 3, "a failure was reported on every poll"
            lines = [r.getMessage() for r in caplog.records if r.name == "ghostgpu.podresources"]
            assert len(lines) == 2, lines
            kubelet.fail = None
            wait_until(lambda: len(out) == 4, "available again")
            assert out.records[3]["available"] is True and out.records[3]["containers"][0]["pod"] == "infer-7"
    finally:
        poller.stop()


def test_missing_socket_is_one_quiet_notice(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = Collect()
    poller = PodResourcesPoller(f"unix://{tmp_path}/nothing/kubelet.sock", out)
    with caplog.at_level(logging.DEBUG, logger="ghostgpu.podresources"):
        for _ in range(5):
            poller.poll_once()
    assert len(out) == 1
    assert out.records[0]["available"] is False
    assert f"{tmp_path}/nothing/kubelet.sock not found" in out.records[0]["error"]
    lines = [r for r in caplog.records if r.name == "ghostgpu.podresources"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO


def test_rate_limit_keeps_the_answer_and_backs_off(kubelet: PodResourcesServer) -> None:
    kubelet.pods = [TRAIN]
    out = Collect()
    poller = PodResourcesPoller(kubelet.socket_path, out, interval_s=1.0)
    try:
        assert poller.poll_once() is not None
        kubelet.fail = (grpc.StatusCode.RESOURCE_EXHAUSTED, "rejected by rate limit")
        intervals = []
        for _ in range(5):
            assert poller.poll_once() is None
            intervals.append(poller.current_interval_s)
        assert intervals == [2.0, 4.0, 8.0, 8.0, 8.0]
        assert len(out) == 1, "a rate limit is not an outage"
        kubelet.fail = None
        assert poller.poll_once() is None  # same answer as before the rate limit
        assert poller.current_interval_s == 1.0
    finally:
        poller.stop()


def test_bad_endpoint_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"--podresources-endpoint 'kubelet\.sock'"):
        PodResourcesPoller("kubelet.sock", print)
