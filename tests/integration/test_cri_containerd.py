"""CRI resolution against a real containerd (Debian's 1.6, CRI plugin) started by the tests.

A pod sandbox and a busybox container are created through CRI; the container's /dev/nvidia0 is
the host's /dev/null (a real device node, no GPU) and the container holds it open on fd 3. The
resolver, through the same direct unix-socket transport the collector uses, must name that
container exactly as CRI reports it, call an unknown ID not_found, and ride out a containerd
restart: unresolved with the error while it is down, resolved again (on_change) once it is back.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from ghostgpu.collector.cri import CriResolver, direct_transport
from ghostgpu.tracer.cgroup import parse_proc_cgroup

from ghostgpu.common.model.consumers import K8sInfo
from ghostgpu.k8s import cri_runtime_v1_pb2 as cri
from tests.helpers.containerd import Containerd, Pod
from tests.helpers.containerd_image import BUSYBOX_IMAGE
from tests.helpers.polling import wait_until

pytestmark = [pytest.mark.root, pytest.mark.containerd]

HOLD_NVIDIA0 = ["/bin/sh", "-c", "exec 3</dev/nvidia0; sleep 300"]
NODE = "node-1"


@dataclass(frozen=True)
class GpuPod:
    pod: Pod
    container_id: str


@pytest.fixture(scope="module")
def gpu_pod(containerd_session: Containerd) -> Iterator[GpuPod]:
    c = containerd_session.start()
    pod = c.run_pod("trainer-0", "ml")
    try:
        cid = c.create_container(pod, "cuda", HOLD_NVIDIA0, devices=[("/dev/null", "/dev/nvidia0")])
        yield GpuPod(pod, cid)
    finally:
        c.start()
        c.remove_pod(pod.id)


class Changes:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ids: list[str] = []

    def __call__(self, node: str, cid: str) -> None:
        with self.lock:
            self.ids.append(cid)

    def count(self, cid: str) -> int:
        with self.lock:
            return self.ids.count(cid)


@pytest.fixture
def changes() -> Changes:
    return Changes()


@pytest.fixture
def resolver(containerd: Containerd, changes: Changes) -> Iterator[CriResolver]:
    transport = direct_transport(containerd.endpoint)
    with CriResolver(lambda node: transport if node == NODE else None, changes, ttl_s=0.3,
                     retry_initial_s=0.05, retry_max_s=0.5, call_timeout_s=2.0) as r:
        yield r
    transport.channel.close()  # type: ignore[attr-defined]


def settled(r: CriResolver, cid: str, what: str = "resolved", timeout_s: float = 10.0) -> K8sInfo:
    # Complete lookups only: the names may be published before the sandbox check.
    def done() -> bool:
        return r.get(NODE, cid).resolution == what and (what != "resolved" or r.stats().pending == 0)

    wait_until(done, f"container {cid[:12]} {what}", timeout_s)
    return r.get(NODE, cid)


def test_container_holds_nvidia0_in_its_kubepods_cgroup(containerd: Containerd, gpu_pod: GpuPod) -> None:
    pid = containerd.container_host_pid(gpu_pod.container_id)
    fd3 = f"/proc/{pid}/fd/3"
    wait_until(lambda: os.path.exists(fd3) and os.readlink(fd3) == "/dev/nvidia0", "fd 3 -> /dev/nvidia0")
    with open(f"/proc/{pid}/cgroup") as f:
        text = f.read()
    assert f"/kubepods/besteffort/pod{gpu_pod.pod.uid}/{gpu_pod.container_id}" in text
    ident = parse_proc_cgroup(text)  # what the tracer attributes this holder to
    assert (ident.container_id, ident.pod_uid) == (gpu_pod.container_id, gpu_pod.pod.uid)


def test_resolver_names_the_container_as_cri_reports_it(
        containerd: Containerd, gpu_pod: GpuPod, resolver: CriResolver, changes: Changes) -> None:
    cid = gpu_pod.container_id
    info = settled(resolver, cid)
    status = containerd.runtime.ContainerStatus(
        cri.ContainerStatusRequest(container_id=cid), timeout=10).status
    sandbox = containerd.runtime.PodSandboxStatus(
        cri.PodSandboxStatusRequest(pod_sandbox_id=gpu_pod.pod.id), timeout=10).status
    assert (info.namespace, info.pod, info.pod_uid) == (
        sandbox.metadata.namespace, sandbox.metadata.name, sandbox.metadata.uid)
    assert (info.namespace, info.pod, info.pod_uid) == ("ml", "trainer-0", gpu_pod.pod.uid)
    assert info.container == status.metadata.name == "cuda"
    assert info.image == BUSYBOX_IMAGE
    assert (info.container_state, info.sandbox_state) == ("CONTAINER_RUNNING", "SANDBOX_READY")
    assert info.runtime.startswith("containerd ") and info.error == ""
    assert info.orphan_reason is None
    assert changes.count(cid) == 2  # the names from ListContainers, then the sandbox's state
    assert settled(resolver, cid[:12]).container == "cuda"  # a short prefix resolves, as in CRI


def test_unknown_container_id_is_not_found(resolver: CriResolver) -> None:
    info = settled(resolver, secrets.token_hex(32), "not_found")
    assert info.container_state == "NOT_FOUND"
    assert info.orphan_reason is not None
    assert info.orphan_reason.startswith("CRI (containerd ")
    assert "does not know this container" in info.orphan_reason


def test_exited_container_reports_its_exit(
        containerd: Containerd, gpu_pod: GpuPod, resolver: CriResolver) -> None:
    cid = containerd.create_container(gpu_pod.pod, "setup", ["/bin/sh", "-c", "exit 3"])

    def exited() -> bool:
        req = cri.ContainerStatusRequest(container_id=cid)
        return containerd.runtime.ContainerStatus(req, timeout=10).status.state == cri.CONTAINER_EXITED

    wait_until(exited, "the setup container to exit")
    info = settled(resolver, cid)
    assert (info.container, info.container_state, info.exit_code) == ("setup", "CONTAINER_EXITED", 3)
    assert info.container_reason == "Error"
    assert info.orphan_reason is not None and "reports container setup exited" in info.orphan_reason


def test_containerd_down_is_unresolved_then_resolved_when_it_returns(
        containerd: Containerd, gpu_pod: GpuPod, resolver: CriResolver, changes: Changes) -> None:
    cid = gpu_pod.container_id
    settled(resolver, cid)
    pid = containerd.container_host_pid(cid)
    containerd.stop()
    try:
        down = settled(resolver, cid, "unresolved")
        assert "CRI unreachable for node node-1: UNAVAILABLE" in down.error
        assert down.pod == "trainer-0"  # the names last seen are kept while CRI is away
        assert os.readlink(f"/proc/{pid}/fd/3") == "/dev/nvidia0"  # the container lives on
        wait_until(lambda: resolver.node_failures(NODE) >= 2, "retries while containerd is down")
        before = changes.count(cid)
    finally:
        containerd.start()
    back = settled(resolver, cid)
    assert (back.pod, back.container, back.container_state, back.error) == (
        "trainer-0", "cuda", "CONTAINER_RUNNING", "")
    assert changes.count(cid) > before
    assert containerd.container_host_pid(cid) == pid  # containerd recovered the running container
