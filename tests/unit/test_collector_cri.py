"""CRI through a tracer's relay: the collector's real CriResolver sends runtime.v1 requests down the
stream, the simulated tracer answers from an in-test runtime, the names reach the cluster table."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
from ghostgpu.collector.cri import CriCallError

from ghostgpu.k8s import cri_runtime_v1_pb2 as cri
from ghostgpu.v1 import node_pb2
from tests.helpers.collector_env import QueryClient, running_collector
from tests.helpers.polling import wait_until
from tests.helpers.sim_tracer import SimTracer, holder, make_consumer

RUNNING_ID, EXITED_ID, UNKNOWN_ID = "1a" * 32, "2b" * 32, "3c" * 32
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


class FakeRuntime:
    """What a node's containerd would answer, as raw runtime.v1 bytes; `down` makes it unreachable."""

    def __init__(self) -> None:
        self.down = False
        self.calls: list[str] = []
        self.containers = {
            RUNNING_ID: cri.Container(id=RUNNING_ID, pod_sandbox_id="sb-1", state=cri.CONTAINER_RUNNING,
                                      metadata=cri.ContainerMetadata(name="trainer"),
                                      image=cri.ImageSpec(image="registry.local/train:3")),
            EXITED_ID: cri.Container(id=EXITED_ID, pod_sandbox_id="sb-1", state=cri.CONTAINER_EXITED,
                                     metadata=cri.ContainerMetadata(name="sidecar")),
        }
        self.sandboxes = {"sb-1": cri.PodSandboxStatus(
            id="sb-1", state=cri.SANDBOX_READY,
            metadata=cri.PodSandboxMetadata(name="train-7", namespace="ml", uid="pod-uid-7"))}

    def __call__(self, method: str, request: bytes) -> tuple[int, str, bytes]:
        self.calls.append(method)
        if self.down:
            return UNAVAILABLE, "connection refused: /run/containerd/containerd.sock", b""
        if method == "Version":
            version = cri.VersionResponse(runtime_name="containerd", runtime_version="1.6.20")
            return 0, "", version.SerializeToString()
        if method == "ListContainers":
            cid = cri.ListContainersRequest.FromString(request).filter.id
            found = [c for c in self.containers.values() if c.id.startswith(cid)]
            return 0, "", cri.ListContainersResponse(containers=found).SerializeToString()
        if method == "ContainerStatus":
            cid = cri.ContainerStatusRequest.FromString(request).container_id
            c = self.containers.get(cid)
            if c is None:
                return NOT_FOUND, f"container {cid} not found", b""
            st = cri.ContainerStatus(id=c.id, metadata=c.metadata, state=c.state, exit_code=137,
                                     reason="OOMKilled", finished_at=1)
            return 0, "", cri.ContainerStatusResponse(status=st).SerializeToString()
        if method == "PodSandboxStatus":
            sid = cri.PodSandboxStatusRequest.FromString(request).pod_sandbox_id
            return 0, "", cri.PodSandboxStatusResponse(status=self.sandboxes[sid]).SerializeToString()
        return grpc.StatusCode.UNIMPLEMENTED.value[0], method, b""


def _by_pid(q: QueryClient) -> dict[int, Any]:
    return {r.consumer.process.pid: r for r in q.consumers()}


def _connected(c: Any, runtime: FakeRuntime, node: str = "n1", **kw: Any) -> SimTracer:
    t = SimTracer(c.address, node, cri=runtime, **kw)
    t.connect()
    consumers = [make_consumer(node, pid, container_id=cid)
                 for pid, cid in ((1, RUNNING_ID), (2, EXITED_ID), (3, UNKNOWN_ID))]
    t.send_snapshot(consumers, seq=0)
    t.send_events([holder(1, 1)])
    t.wait_acked(1)
    return t


def test_names_and_orphans_come_from_cri_through_the_tracer_relay(tmp_path: Path) -> None:
    runtime = FakeRuntime()
    with running_collector(tmp_path) as c, QueryClient(c.address) as q, _connected(c, runtime):
        wait_until(lambda: all(r.k8s.resolution in ("resolved", "not_found") for r in q.consumers()),
                   "all three containers resolved through the relay")
        rows = _by_pid(q)
        k = rows[1].k8s
        assert (k.namespace, k.pod, k.pod_uid, k.container) == ("ml", "train-7", "pod-uid-7", "trainer")
        assert k.image == "registry.local/train:3"
        assert (k.container_state, k.sandbox_state, k.runtime) == ("CONTAINER_RUNNING", "SANDBOX_READY",
                                                                   "containerd 1.6.20")
        assert getattr(rows[1].consumer, "class") == node_pb2.CONSUMER_CLASS_HIDDEN
        assert getattr(rows[2].consumer, "class") == node_pb2.CONSUMER_CLASS_ORPHANED
        assert "container sidecar exited (reason OOMKilled, exit code 137)" in rows[2].consumer.reason
        assert rows[3].k8s.resolution == "not_found"
        assert getattr(rows[3].consumer, "class") == node_pb2.CONSUMER_CLASS_ORPHANED
        assert "does not know this container" in rows[3].consumer.reason
        assert {"Version", "ListContainers", "ContainerStatus", "PodSandboxStatus"} <= set(runtime.calls)
        assert [r.k8s.pod for r in q.consumers(namespace="ml", pod="train-7")] == ["train-7", "train-7"]


def test_events_flow_unresolved_while_cri_is_down_and_resolve_when_it_returns(tmp_path: Path) -> None:
    runtime = FakeRuntime()
    runtime.down = True
    with running_collector(tmp_path) as c, QueryClient(c.address) as q, _connected(c, runtime) as t:
        wait_until(lambda: "connection refused" in _by_pid(q)[1].k8s.error, "the CRI error to show")
        assert _by_pid(q)[1].k8s.resolution == "unresolved"
        t.send_events([holder(2, 1), holder(3, 1)])
        t.wait_acked(3)  # ingest does not wait for CRI
        assert q.node("n1").cri_failures_total > 0
        runtime.down = False
        wait_until(lambda: _by_pid(q)[1].k8s.pod == "train-7", "the retry to resolve pid 1", timeout_s=15)


def test_relay_returns_the_tracers_status_codes(tmp_path: Path) -> None:
    runtime = FakeRuntime()
    with running_collector(tmp_path) as c, _connected(c, runtime):
        raw = c.relay.call("n1", "Version", cri.VersionRequest().SerializeToString(), 2.0)
        assert cri.VersionResponse.FromString(raw).runtime_version == "1.6.20"
        with pytest.raises(CriCallError) as err:
            c.relay.call("n1", "RemoveContainer", b"", 2.0)
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "via the tracer on node n1" in err.value.message
        with pytest.raises(CriCallError) as err:
            c.relay.call("elsewhere", "Version", b"", 2.0)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE and "node elsewhere" in err.value.message


def test_no_relay_without_the_capability_and_no_socket_on_the_node(tmp_path: Path) -> None:
    with running_collector(tmp_path) as c:
        with SimTracer(c.address, "quiet", capabilities=()) as t:
            t.connect()
            assert c.transport_for("quiet") is None
            with pytest.raises(CriCallError) as err:
                c.relay.call("quiet", "Version", b"", 1.0)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
        with SimTracer(c.address, "nosock", cri=None) as t:  # offers the relay, has no CRI socket
            t.connect()
            with pytest.raises(CriCallError) as err:
                c.transport_for("nosock")("Version", b"", 1.0)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            assert "pass --cri-endpoint" in err.value.message


def test_a_relay_call_ends_at_its_deadline_or_when_the_stream_goes(tmp_path: Path) -> None:
    release = threading.Event()

    def stuck(method: str, request: bytes) -> tuple[int, str, bytes]:
        release.wait(30)
        return 0, "", b""

    with running_collector(tmp_path) as c:
        t = SimTracer(c.address, "slow", cri=stuck)
        t.connect()
        with pytest.raises(CriCallError) as err:
            c.relay.call("slow", "Version", b"", 0.2)
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and "within 0.2 s" in err.value.message
        outcome: list[BaseException] = []

        def call() -> None:
            try:
                c.relay.call("slow", "Version", b"", 20.0)
            except CriCallError as e:
                outcome.append(e)

        caller = threading.Thread(target=call)
        caller.start()
        wait_until(lambda: c.call(lambda: c.relay.in_flight("slow")) == 1,
                   "the call to be in flight")
        t._call.cancel()  # the tracer vanishes; its reader thread is still stuck in the CRI call
        caller.join(10)
        assert outcome and outcome[0].code == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        release.set()
        t.stop()
