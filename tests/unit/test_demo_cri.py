"""The demo's CRI runtime (cli/demo_cri.py) over real unix sockets: it names the demo pods and
never passes judgement on anyone else's container (forwarded to the node's runtime, or UNAVAILABLE)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from ghostgpu.cli.demo_cri import DEMO_NAMESPACE, DemoPod, serve

from ghostgpu.k8s import cri_runtime_v1_pb2 as cri
from ghostgpu.k8s import cri_runtime_v1_pb2_grpc as cri_grpc

DEMO = DemoPod("d" * 64, "e" * 64, "hidden-trainer", "uid-1", "trainer", "ghostgpu/demo-trainer:1")
ORPHAN = DemoPod("0" * 64, "1" * 64, "orphaned-worker", "uid-2", "worker", "ghostgpu/demo-worker:1",
                 exited=True)
REAL = DemoPod("a" * 64, "b" * 64, "real-pod", "uid-3", "app", "registry/app:2")


@pytest.fixture
def sockets(tmp_path: Path) -> Iterator[Any]:
    servers: list[grpc.Server] = []

    def start(name: str, pods: list[DemoPod], real: str | None = None) -> cri_grpc.RuntimeServiceStub:
        servers.append(serve(pods, str(tmp_path / name), real))
        return cri_grpc.RuntimeServiceStub(grpc.insecure_channel(f"unix://{tmp_path / name}"))

    yield start, tmp_path
    for s in servers:
        s.stop(None)


def _by_id(cid: str) -> cri.ListContainersRequest:
    return cri.ListContainersRequest(filter=cri.ContainerFilter(id=cid))


def test_demo_pods_read_like_kubelet_made_them(sockets: Any) -> None:
    start, _ = sockets
    stub = start("demo.sock", [DEMO, ORPHAN])
    (c,) = stub.ListContainers(_by_id(DEMO.container_id)).containers
    assert (c.metadata.name, c.image.image) == ("trainer", "ghostgpu/demo-trainer:1")
    assert c.state == cri.CONTAINER_RUNNING
    assert c.labels["io.kubernetes.pod.namespace"] == DEMO_NAMESPACE
    sandbox = stub.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=c.pod_sandbox_id)).status
    assert (sandbox.metadata.namespace, sandbox.metadata.name, sandbox.state) == \
        (DEMO_NAMESPACE, "hidden-trainer", cri.SANDBOX_READY)
    status = stub.ContainerStatus(cri.ContainerStatusRequest(container_id=ORPHAN.container_id)).status
    assert (status.state, status.exit_code, status.reason) == (cri.CONTAINER_EXITED, 137, "Error")


def test_other_containers_go_to_the_real_runtime(sockets: Any) -> None:
    start, tmp_path = sockets
    start("real.sock", [REAL])
    stub = start("demo.sock", [DEMO], f"unix://{tmp_path / 'real.sock'}")
    (c,) = stub.ListContainers(_by_id(REAL.container_id)).containers
    assert c.labels["io.kubernetes.pod.name"] == "real-pod"
    status = stub.ContainerStatus(cri.ContainerStatusRequest(container_id=REAL.container_id)).status
    assert status.metadata.name == "app"


def test_without_a_real_runtime_others_are_unavailable_never_not_found(sockets: Any) -> None:
    start, _ = sockets
    stub = start("demo.sock", [DEMO])
    for call in (lambda: stub.ListContainers(_by_id("f" * 64)),
                 lambda: stub.ContainerStatus(cri.ContainerStatusRequest(container_id="f" * 64)),
                 lambda: stub.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id="f" * 64))):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "knows only the demo pods" in (err.value.details() or "")
