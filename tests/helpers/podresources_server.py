"""A kubelet PodResources v1 server on a real unix socket, for the tracer's poller tests.

It speaks the real kubelet messages (ghostgpu/k8s/podresources_v1.proto, the field numbers of
kubernetes/kubelet pkg/apis/podresources/v1) at the real method path `/v1.PodResourcesLister/List`.
A test sets what kubelet would answer (`pods`) or the gRPC status it fails with (`fail`), while the
server runs; `stop()` takes the socket away and `start()` brings it back on the same path, as a
kubelet restart does. Every call is counted.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from ghostgpu.k8s import podresources_v1_pb2 as pr
from ghostgpu.k8s import podresources_v1_pb2_grpc as pr_grpc


@dataclass
class Container:
    name: str
    devices: dict[str, list[str]] = field(default_factory=dict)  # resource name -> device ids
    cpu_ids: list[int] = field(default_factory=list)
    cdi_devices: list[str] = field(default_factory=list)  # DRA: CDI device names of one claim
    claim_driver: str = "gpu.nvidia.com"


@dataclass
class Pod:
    namespace: str
    name: str
    containers: list[Container]


def response_for(pods: list[Pod]) -> pr.ListPodResourcesResponse:
    out = pr.ListPodResourcesResponse()
    for pod in pods:
        pmsg = out.pod_resources.add(name=pod.name, namespace=pod.namespace)
        for c in pod.containers:
            cmsg = pmsg.containers.add(name=c.name, cpu_ids=c.cpu_ids)
            for resource, ids in c.devices.items():
                dev = cmsg.devices.add(resource_name=resource, device_ids=ids)
                dev.topology.nodes.add(ID=0)
            if c.cdi_devices:
                dyn = cmsg.dynamic_resources.add(claim_name=f"{c.name}-gpu", claim_namespace=pod.namespace)
                claim = dyn.claim_resources.add(driver_name=c.claim_driver, pool_name="node",
                                                device_name="gpu-0")
                for name in c.cdi_devices:
                    claim.cdi_devices.add(name=name)
    return out


class PodResourcesServer(pr_grpc.PodResourcesListerServicer):
    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.pods: list[Pod] = []
        self.fail: tuple[grpc.StatusCode, str] | None = None
        self.calls = 0
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None

    def List(self, request: pr.ListPodResourcesRequest, context: grpc.ServicerContext,
             ) -> pr.ListPodResourcesResponse:
        with self._lock:
            self.calls += 1
            fail, pods = self.fail, list(self.pods)
        if fail is not None:
            context.abort(*fail)
        return response_for(pods)

    def start(self) -> PodResourcesServer:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pr_grpc.add_PodResourcesListerServicer_to_server(self, server)
        if not server.add_insecure_port(f"unix://{self.socket_path}"):
            raise RuntimeError(f"cannot listen on {self.socket_path}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait(5)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)

    def __enter__(self) -> PodResourcesServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
