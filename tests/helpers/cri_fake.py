"""An in-process CRI runtime.v1 RuntimeService on a real unix socket, for resolver unit tests.

The table of sandboxes and containers is plain data a test edits while the server runs; every
call is counted per method. `gate` holds calls until a test opens it (to pile up lookups while
one is in flight), `stop()` and `start()` take the socket away and bring it back on the same
path (CRI unreachable, then back). Prefix IDs behave as in containerd 1.6: a unique prefix is
expanded to the full ID in the ListContainers filter and in ContainerStatus.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections import Counter
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from ghostgpu.k8s import cri_runtime_v1_pb2 as cri
from ghostgpu.k8s import cri_runtime_v1_pb2_grpc as cri_grpc

KUBELET_LABELS = ("io.kubernetes.pod.name", "io.kubernetes.pod.namespace", "io.kubernetes.pod.uid")


@dataclass
class FakeSandbox:
    id: str
    name: str
    namespace: str
    uid: str
    state: int = cri.SANDBOX_READY
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class FakeCriContainer:
    id: str
    sandbox_id: str
    name: str
    state: int = cri.CONTAINER_RUNNING
    image: str = "docker.io/library/cuda:12"
    labels: dict[str, str] = field(default_factory=dict)
    reason: str = ""
    exit_code: int = 0
    listed: bool = True  # False: ContainerStatus knows it, ListContainers does not (a runtime race)


class _Servicer(cri_grpc.RuntimeServiceServicer):
    def __init__(self, fake: FakeCri) -> None:
        self.fake = fake

    def _enter(self, method: str, context: grpc.ServicerContext) -> None:
        with self.fake.lock:
            self.fake.calls[method] += 1
        if not self.fake.gate.wait(10.0):
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "fake CRI gate stayed closed")
        code = self.fake.fail.get(method)
        if code is not None:
            context.abort(code, f"fake CRI: {method} fails on purpose")

    def Version(self, request: cri.VersionRequest, context: grpc.ServicerContext) -> cri.VersionResponse:
        self._enter("Version", context)
        return cri.VersionResponse(version="0.1.0", runtime_name=self.fake.runtime_name,
                                   runtime_version=self.fake.runtime_version, runtime_api_version="v1")

    def ListContainers(self, request: cri.ListContainersRequest,
                       context: grpc.ServicerContext) -> cri.ListContainersResponse:
        self._enter("ListContainers", context)
        with self.fake.lock:
            wanted = self.fake.expand(request.filter.id) if request.filter.id else ""
            out = [self.fake.to_container(c) for c in self.fake.containers.values()
                   if c.listed and (not wanted or c.id == wanted)]
        return cri.ListContainersResponse(containers=out)

    def ContainerStatus(self, request: cri.ContainerStatusRequest,
                        context: grpc.ServicerContext) -> cri.ContainerStatusResponse:
        self._enter("ContainerStatus", context)
        with self.fake.lock:
            c = self.fake.containers.get(self.fake.expand(request.container_id))
            if c is None:
                context.abort(grpc.StatusCode.NOT_FOUND,
                              f"an error occurred when try to find container {request.container_id!r}: "
                              "not found")
            status = cri.ContainerStatus(
                id=c.id, metadata=cri.ContainerMetadata(name=c.name), state=c.state,
                image=cri.ImageSpec(image=c.image), reason=c.reason, exit_code=c.exit_code,
                labels=c.labels)
        return cri.ContainerStatusResponse(status=status)

    def PodSandboxStatus(self, request: cri.PodSandboxStatusRequest,
                         context: grpc.ServicerContext) -> cri.PodSandboxStatusResponse:
        self._enter("PodSandboxStatus", context)
        with self.fake.lock:
            s = self.fake.sandboxes.get(request.pod_sandbox_id)
            if s is None:
                context.abort(grpc.StatusCode.NOT_FOUND,
                              f"an error occurred when try to find sandbox {request.pod_sandbox_id!r}: "
                              "not found")
            status = cri.PodSandboxStatus(
                id=s.id, metadata=cri.PodSandboxMetadata(name=s.name, uid=s.uid, namespace=s.namespace),
                state=s.state, labels=s.labels)
        return cri.PodSandboxStatusResponse(status=status)


class FakeCri:
    """The fake runtime: `add_sandbox`/`add_container` edit its table, `calls` counts requests."""

    def __init__(self, runtime_name: str = "fakecri", runtime_version: str = "1.0.0") -> None:
        # A short directory: a unix socket path must stay under 108 bytes (pytest's tmp_path may not).
        self.dir = tempfile.mkdtemp(prefix="gg-fcri-", dir="/tmp")
        self.socket = os.path.join(self.dir, "cri.sock")
        self.endpoint = "unix://" + self.socket
        self.runtime_name, self.runtime_version = runtime_name, runtime_version
        self.lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.fail: dict[str, grpc.StatusCode] = {}  # method -> code every call of it answers
        self.gate = threading.Event()
        self.gate.set()
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.containers: dict[str, FakeCriContainer] = {}
        self._server: grpc.Server | None = None

    def start(self) -> FakeCri:
        if self._server is None:
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
            cri_grpc.add_RuntimeServiceServicer_to_server(_Servicer(self), server)
            if server.add_insecure_port(self.endpoint) == 0:
                raise RuntimeError(f"fake CRI cannot bind {self.endpoint}")
            server.start()
            self._server = server
        return self

    def stop(self) -> None:
        """Close the socket (in-flight calls are cancelled): the runtime went away."""
        if self._server is not None:
            self._server.stop(grace=None).wait()
            self._server = None
        if os.path.exists(self.socket):
            os.unlink(self.socket)

    def close(self) -> None:
        self.gate.set()
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> FakeCri:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def total_calls(self) -> int:
        with self.lock:
            return sum(self.calls.values())

    def add_sandbox(self, sandbox_id: str, name: str, namespace: str, uid: str,
                    state: int = cri.SANDBOX_READY, labels: dict[str, str] | None = None) -> FakeSandbox:
        kubelet = dict(zip(KUBELET_LABELS, (name, namespace, uid), strict=True))
        s = FakeSandbox(sandbox_id, name, namespace, uid, state, kubelet if labels is None else labels)
        with self.lock:
            self.sandboxes[sandbox_id] = s
        return s

    def add_container(self, container_id: str, sandbox_id: str, name: str, *,
                      labels: dict[str, str] | None = None, **kw: object) -> FakeCriContainer:
        """A container of `sandbox_id`; without `labels`, kubelet's four labels from its sandbox."""
        if labels is None:
            s = self.sandboxes[sandbox_id]
            labels = {**dict(zip(KUBELET_LABELS, (s.name, s.namespace, s.uid), strict=True)),
                      "io.kubernetes.container.name": name}
        c = FakeCriContainer(container_id, sandbox_id, name, labels=labels, **kw)  # type: ignore[arg-type]
        with self.lock:
            self.containers[container_id] = c
        return c

    def expand(self, container_id: str) -> str:
        """Under the lock: containerd's truncindex: a unique prefix names the full ID."""
        if container_id in self.containers:
            return container_id
        matches = [i for i in self.containers if i.startswith(container_id)]
        return matches[0] if len(matches) == 1 else container_id

    def to_container(self, c: FakeCriContainer) -> cri.Container:
        return cri.Container(id=c.id, pod_sandbox_id=c.sandbox_id, state=c.state, labels=c.labels,
                             metadata=cri.ContainerMetadata(name=c.name), image=cri.ImageSpec(image=c.image))


def exited_runtime(method: str, request: bytes) -> tuple[int, str, bytes]:
    """A node's CRI as a tracer relays it (SimTracer's `cri=`): every container exited, its pod
    sandbox gone. What a churn of short-lived jobs leaves behind."""
    if method == "Version":
        version = cri.VersionResponse(runtime_name="containerd", runtime_version="1.7.2")
        return 0, "", version.SerializeToString()
    if method == "ListContainers":
        cid = cri.ListContainersRequest.FromString(request).filter.id
        c = cri.Container(id=cid, pod_sandbox_id="sb-" + cid[:12], state=cri.CONTAINER_EXITED,
                          metadata=cri.ContainerMetadata(name="step"), image=cri.ImageSpec(image="batch:1"),
                          labels={"io.kubernetes.pod.name": f"job-{cid[:10]}",
                                  "io.kubernetes.pod.namespace": "batch",
                                  "io.kubernetes.container.name": "step"})
        return 0, "", cri.ListContainersResponse(containers=[c]).SerializeToString()
    if method == "ContainerStatus":
        cid = cri.ContainerStatusRequest.FromString(request).container_id
        st = cri.ContainerStatus(id=cid, state=cri.CONTAINER_EXITED, exit_code=0, reason="Completed",
                                 finished_at=1)
        return 0, "", cri.ContainerStatusResponse(status=st).SerializeToString()
    if method == "PodSandboxStatus":
        return grpc.StatusCode.NOT_FOUND.value[0], "pod sandbox not found", b""
    return grpc.StatusCode.UNIMPLEMENTED.value[0], method, b""
