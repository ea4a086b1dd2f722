"""The CRI relay: raw runtime.v1 bytes to a real unix socket, only for the read-only methods."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from ghostgpu.tracer.cri_relay import ALLOWED_METHODS, CommandRunner, CriRelay

from ghostgpu.k8s import cri_runtime_v1_pb2 as cri
from ghostgpu.v1 import stream_pb2

WRITE_METHODS = ("RunPodSandbox", "StopPodSandbox", "RemovePodSandbox", "CreateContainer", "StartContainer",
                 "StopContainer", "RemoveContainer", "ExecSync", "Exec", "UpdateContainerResources", "")
CID = "3f4a" + "0" * 60


class RawRuntime:
    """A runtime.v1 server that sees requests as bytes, the way the relay must deliver them."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.calls: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()
        handlers = {name: grpc.unary_unary_rpc_method_handler(self._handler(name)) for name in (
            "Version", "ListContainers", "ContainerStatus", "ListPodSandbox", "PodSandboxStatus")}
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("runtime.v1.RuntimeService",
                                                                                   handlers),))
        assert self.server.add_insecure_port(f"unix://{path}")
        self.server.start()

    def _handler(self, name: str):  # type: ignore[no-untyped-def]
        def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
            with self._lock:
                self.calls.append((name, request))
            if name == "Version":
                return cri.VersionResponse(version="0.1.0", runtime_name="fakecri", runtime_version="1.7.0",
                                           runtime_api_version="v1").SerializeToString()
            if name == "ContainerStatus":
                cid = cri.ContainerStatusRequest.FromString(request).container_id
                context.abort(grpc.StatusCode.NOT_FOUND,
                              f"an error occurred when try to find container {cid!r}")
            if name == "ListContainers":
                wanted = cri.ListContainersRequest.FromString(request).filter.id
                resp = cri.ListContainersResponse()
                resp.containers.add(id=wanted, pod_sandbox_id="sb1", state=cri.CONTAINER_RUNNING)
                return resp.SerializeToString()
            return b""

        return handle

    def stop(self) -> None:
        self.server.stop(grace=None).wait(5)


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[RawRuntime]:
    server = RawRuntime(str(tmp_path / "containerd.sock"))
    yield server
    server.stop()


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[socket.socket]:
    """A bare unix socket that counts nothing but accept(): any touch of the socket shows up."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(tmp_path / "crio.sock"))
    sock.listen(16)
    sock.setblocking(False)
    yield sock
    sock.close()


def accepted(sock: socket.socket) -> int:
    n = 0
    while True:
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            return n
        conn.close()
        n += 1


@pytest.mark.parametrize("method", WRITE_METHODS)
def test_write_methods_are_refused_without_touching_the_socket(listener: socket.socket, method: str) -> None:
    relay = CriRelay(f"unix://{listener.getsockname()}", node="n1")
    try:
        resp = relay.call(method, cri.RunPodSandboxRequest().SerializeToString(), 1000)
        assert resp.code == grpc.StatusCode.PERMISSION_DENIED.value[0] == 7
        assert f"{method!r} is not relayed" in resp.message and "Version" in resp.message
        assert resp.response == b""
        assert accepted(listener) == 0
        # The same relay does reach the socket for an allowed method (the listener is a real socket).
        relay.call("Version", b"", 200)
        assert accepted(listener) >= 1
    finally:
        relay.close()


def test_allowed_methods_are_exactly_the_read_only_five() -> None:
    assert {"Version", "ListContainers", "ContainerStatus", "ListPodSandbox",
                               "PodSandboxStatus"} == ALLOWED_METHODS


def test_forwarding_returns_the_runtime_bytes(runtime: RawRuntime) -> None:
    relay = CriRelay(f"unix://{runtime.path}", node="n1")
    try:
        version = relay.call("Version", cri.VersionRequest(version="v1").SerializeToString(), 2000)
        assert version.code == 0 and version.endpoint == runtime.path
        assert cri.VersionResponse.FromString(version.response).runtime_version == "1.7.0"
        request = cri.ListContainersRequest(filter=cri.ContainerFilter(id=CID)).SerializeToString()
        listed = relay.call("ListContainers", request, 0)
        assert listed.code == 0
        assert cri.ListContainersResponse.FromString(listed.response).containers[0].id == CID
        assert runtime.calls[-1] == ("ListContainers", request), "the request bytes arrived unchanged"
        status = cri.ContainerStatusRequest(container_id=CID).SerializeToString()
        missing = relay.call("ContainerStatus", status)
        assert missing.code == grpc.StatusCode.NOT_FOUND.value[0]
        assert CID in missing.message and missing.response == b""
    finally:
        relay.close()


def test_no_socket_is_unavailable_naming_where_it_looked(tmp_path: Path) -> None:
    candidates = (str(tmp_path / "run/containerd/containerd.sock"), str(tmp_path / "run/crio/crio.sock"))
    relay = CriRelay(None, node="gpu-node-3", candidates=candidates)
    resp = relay.call("Version", b"")
    assert resp.code == grpc.StatusCode.UNAVAILABLE.value[0] == 14
    assert "no CRI socket on node gpu-node-3" in resp.message
    assert all(c in resp.message for c in candidates) and "--cri-endpoint" in resp.message
    assert relay.endpoint is None


def test_detection_order_and_a_runtime_that_starts_late(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import ghostgpu.tracer.cri_relay as mod

    monkeypatch.setattr(mod, "REDETECT_INTERVAL_S", 0.0)
    first, second = tmp_path / "a.sock", tmp_path / "b.sock"
    relay = CriRelay(None, node="n", candidates=(str(first), str(second)))
    assert relay.endpoint is None
    late = RawRuntime(str(second))
    try:
        assert relay.call("Version", b"").code == 0
        assert relay.endpoint == str(second)
        with contextlib.closing(CriRelay(None, candidates=(str(first), str(second)))) as again:
            assert again.endpoint == str(second)
        regular = tmp_path / "c.sock"
        regular.write_text("not a socket")
        with contextlib.closing(CriRelay(None, candidates=(str(regular), str(second)))) as skip:
            assert skip.endpoint == str(second), "a regular file is not a runtime socket"
    finally:
        late.stop()
        relay.close()


def test_explicit_endpoint_that_vanished(tmp_path: Path) -> None:
    relay = CriRelay(f"unix://{tmp_path}/gone.sock", node="n")
    resp = relay.call("ListPodSandbox", b"")
    assert resp.code == 14 and "--cri-endpoint" in resp.message and "does not exist" in resp.message
    assert not os.path.exists(tmp_path / "gone.sock")


def test_endpoint_must_be_a_unix_path() -> None:
    with pytest.raises(ValueError, match="--cri-endpoint 'localhost:1234'"):
        CriRelay("localhost:1234")


def test_command_runner_answers_every_command(runtime: RawRuntime) -> None:
    relay = CriRelay(runtime.path, node="n1")
    runner = CommandRunner(relay, "n1", workers=2)
    results: dict[int, stream_pb2.CommandResult] = {}
    done = threading.Event()

    def reply(result: stream_pb2.CommandResult) -> None:
        results[result.id] = result
        if len(results) == 3:
            done.set()

    try:
        runner.submit(stream_pb2.Command(id=1, cri=stream_pb2.CriRequest(method="Version")), reply)
        runner.submit(stream_pb2.Command(id=2, cri=stream_pb2.CriRequest(method="StopContainer")), reply)
        runner.submit(stream_pb2.Command(id=3), reply)
        assert done.wait(10)
        assert results[1].cri.code == 0
        assert cri.VersionResponse.FromString(results[1].cri.response).runtime_name == "fakecri"
        assert results[2].cri.code == 7
        assert results[3].cri.code == 12 and "does not know this command" in results[3].cri.message
    finally:
        runner.close()
        relay.close()
