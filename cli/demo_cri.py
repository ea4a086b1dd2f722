"""The container runtime of `ghostgpu up --demo`: a CRI runtime.v1 endpoint that knows the demo pods.

The demo's containers are made by hand (cli/demo.py), so no real runtime knows them; a real
containerd on the node would truthfully answer "no such container", and the collector would call
every demo consumer orphaned. This endpoint, on a unix socket in the demo's temporary directory,
answers the read-only RuntimeService calls the way containerd would for real pods, so the demo
also shows CRI resolution: namespace, pod, container and image names, and an exited container
behind the orphan. Both the tracer (relay) and the embedded collector (direct) are pointed at it.

Every other container is not the demo's business: a call about one goes on to the node's real
runtime socket when there is one, else is answered UNAVAILABLE (the collector then leaves the
container unresolved). Never NOT_FOUND: that would make the node's real pods look orphaned.
"""

from __future__ import annotations

import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc

from ghostgpu.k8s import cri_runtime_v1_pb2 as cri
from ghostgpu.k8s import cri_runtime_v1_pb2_grpc as cri_grpc

DEMO_NAMESPACE = "ghostgpu-demo"
RUNTIME_NAME = "ghostgpu-demo-runtime"


@dataclass(frozen=True)
class DemoPod:
    """One demo pod with one container, as CRI describes it."""

    container_id: str
    sandbox_id: str
    pod: str
    pod_uid: str
    container: str
    image: str
    exited: bool = False  # the orphan: its shim died, so the runtime reports the container exited

    def pod_labels(self) -> dict[str, str]:
        """The labels kubelet puts on a pod sandbox."""
        return {"io.kubernetes.pod.name": self.pod, "io.kubernetes.pod.namespace": DEMO_NAMESPACE,
                "io.kubernetes.pod.uid": self.pod_uid}

    def labels(self) -> dict[str, str]:
        """The labels kubelet puts on a container: its pod's, plus the container's name."""
        return {**self.pod_labels(), "io.kubernetes.container.name": self.container}

    def container_msg(self, created_ns: int) -> cri.Container:
        return cri.Container(
            id=self.container_id, pod_sandbox_id=self.sandbox_id, image=cri.ImageSpec(image=self.image),
            metadata=cri.ContainerMetadata(name=self.container), image_ref=self.image,
            state=cri.CONTAINER_EXITED if self.exited else cri.CONTAINER_RUNNING, created_at=created_ns,
            labels=self.labels(),
        )


class DemoRuntime(cri_grpc.RuntimeServiceServicer):
    """Read-only answers about the demo pods; other containers go to `real_endpoint` (if any)."""

    def __init__(self, pods: list[DemoPod], real_endpoint: str | None = None) -> None:
        self.pods = {p.container_id: p for p in pods}
        self.sandboxes = {p.sandbox_id: p for p in pods}
        self.created_ns = time.time_ns()
        self.real_endpoint = real_endpoint
        self._real = None
        if real_endpoint:
            self._real = cri_grpc.RuntimeServiceStub(grpc.insecure_channel(real_endpoint))

    def _elsewhere(self, method: str, request: Any, context: grpc.ServicerContext) -> Any:
        """Not a demo container: the node's real runtime answers, or nobody does."""
        if self._real is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the ghostgpu demo runtime knows only the demo pods "
                          "and this node has no other CRI socket")
        try:
            return getattr(self._real, method)(request, timeout=5.0)
        except grpc.RpcError as e:
            context.abort(e.code(), f"{self.real_endpoint}: {e.details()}")

    def Version(self, request: Any, context: grpc.ServicerContext) -> Any:
        return cri.VersionResponse(version="0.1.0", runtime_name=RUNTIME_NAME, runtime_version="demo",
                                   runtime_api_version="v1")

    def ListContainers(self, request: Any, context: grpc.ServicerContext) -> Any:
        wanted = request.filter.id if request.HasField("filter") else ""
        pods = [p for cid, p in self.pods.items() if not wanted or cid.startswith(wanted)]
        if wanted and not pods:
            return self._elsewhere("ListContainers", request, context)
        return cri.ListContainersResponse(containers=[p.container_msg(self.created_ns) for p in pods])

    def ContainerStatus(self, request: Any, context: grpc.ServicerContext) -> Any:
        pod = self.pods.get(request.container_id)
        if pod is None:
            return self._elsewhere("ContainerStatus", request, context)
        c = pod.container_msg(self.created_ns)
        status = cri.ContainerStatus(
            id=c.id, metadata=c.metadata, state=c.state, created_at=c.created_at, started_at=c.created_at,
            image=c.image, image_ref=c.image_ref, labels=c.labels,
        )
        if pod.exited:
            status.finished_at = time.time_ns()
            status.exit_code = 137
            status.reason = "Error"
            status.message = "containerd-shim exited: the container's process was left running"
        return cri.ContainerStatusResponse(status=status)

    def _sandbox(self, pod: DemoPod) -> cri.PodSandbox:
        return cri.PodSandbox(
            id=pod.sandbox_id, state=cri.SANDBOX_READY, created_at=self.created_ns,
            metadata=cri.PodSandboxMetadata(name=pod.pod, uid=pod.pod_uid, namespace=DEMO_NAMESPACE),
            labels=pod.pod_labels(),
        )

    def ListPodSandbox(self, request: Any, context: grpc.ServicerContext) -> Any:
        wanted = request.filter.id if request.HasField("filter") else ""
        items = [self._sandbox(p) for sid, p in self.sandboxes.items() if not wanted or sid == wanted]
        if wanted and not items:
            return self._elsewhere("ListPodSandbox", request, context)
        return cri.ListPodSandboxResponse(items=items)

    def PodSandboxStatus(self, request: Any, context: grpc.ServicerContext) -> Any:
        pod = self.sandboxes.get(request.pod_sandbox_id)
        if pod is None:
            return self._elsewhere("PodSandboxStatus", request, context)
        s = self._sandbox(pod)
        return cri.PodSandboxStatusResponse(status=cri.PodSandboxStatus(
            id=s.id, metadata=s.metadata, state=s.state, created_at=s.created_at, labels=s.labels))


def serve(pods: list[DemoPod], socket_path: str, real_endpoint: str | None = None) -> grpc.Server:
    """Start the demo runtime on a unix socket; the caller stops it."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="ghostgpu-demo-cri"))
    cri_grpc.add_RuntimeServiceServicer_to_server(DemoRuntime(pods, real_endpoint), server)
    server.add_insecure_port(f"unix://{socket_path}")
    server.start()
    return server
