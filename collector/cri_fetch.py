"""One CRI lookup: container ID -> K8sInfo, through any transport that moves runtime.v1 bytes.

The transport is a plain function (method, serialized request, timeout) -> serialized response,
so the same procedure runs through a tracer's relay (the bytes travel in a stream Command) or a
local unix socket (`direct_transport`). Only the read-only RuntimeService methods are ever called.

Procedure (the calls and the runtimes' behaviour: docs/reference/cri-and-podresources.md, section 1):
ListContainers(filter.id); nothing listed -> ContainerStatus to confirm (NOT_FOUND -> "not_found");
else PodSandboxStatus for the pod, and ContainerStatus for the reason and exit code of an exited or
unknown container.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from ghostgpu.common.model.consumers import K8sInfo
from ghostgpu.common.transport.addresses import socket_target
from ghostgpu.k8s import cri_runtime_v1_pb2 as cri

CriTransport = Callable[[str, bytes, float], bytes]  # (method, request bytes, timeout_s) -> response bytes

SERVICE_PATH = "/runtime.v1.RuntimeService/"
READ_ONLY_METHODS = frozenset({"Version", "ListContainers", "ContainerStatus", "ListPodSandbox",
                               "PodSandboxStatus"})
# Kubelet's labels (kubernetes/kubelet pkg/types/labels.go): the fallback when the sandbox is gone.
LABEL_POD_NAME = "io.kubernetes.pod.name"
LABEL_POD_NAMESPACE = "io.kubernetes.pod.namespace"
LABEL_POD_UID = "io.kubernetes.pod.uid"
LABEL_CONTAINER_NAME = "io.kubernetes.container.name"
# containerd and CRI-O ignore VersionRequest.version (docs/reference/cri-and-podresources.md §1.4)
_CRI_VERSION = "v1"

# A runtime restart makes a new socket; gRPC's default reconnect backoff (1 s growing to 120 s)
# would leave resolution failing long after the runtime is back, so keep it short.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 16 << 20),
]

M = TypeVar("M", bound=Message)


class CriCallError(Exception):
    """A CRI call that did not answer OK: the gRPC status code and CRI's (or the relay's) message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class DirectTransport:
    """A transport over a local CRI socket: one channel, reused for every call and every runtime
    restart (gRPC reconnects by itself); only the read-only methods are let through. A CriTransport:
    call it with (method, request bytes, timeout_s); `channel` is there for whoever closes it."""

    def __init__(self, endpoint: str) -> None:
        self.target = socket_target(endpoint)
        self.channel = grpc.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
        self._calls: dict[str, grpc.UnaryUnaryMultiCallable[bytes, bytes]] = {}
        self._lock = threading.Lock()

    def __call__(self, method: str, request: bytes, timeout_s: float) -> bytes:
        if method not in READ_ONLY_METHODS:
            raise CriCallError(grpc.StatusCode.PERMISSION_DENIED,
                               f"CRI method {method!r} is not one of the read-only methods ghostgpu calls")
        with self._lock:
            stub = self._calls.get(method)
            if stub is None:
                # No serializers: the request and response stay raw bytes, as on the relay.
                stub = self._calls[method] = self.channel.unary_unary(SERVICE_PATH + method)
        try:
            return stub(request, timeout=timeout_s)
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else grpc.StatusCode.UNKNOWN
            details = (e.details() if isinstance(e, grpc.Call) else "") or str(e)
            raise CriCallError(code, f"{details} (CRI endpoint {self.target})") from None


def direct_transport(endpoint: str) -> DirectTransport:
    """The transport over the local CRI socket at `endpoint` (see DirectTransport)."""
    return DirectTransport(endpoint)


class CriClient:
    """Typed read-only calls over a transport, counting calls, failures and the last latency."""

    def __init__(self, transport: CriTransport, timeout_s: float,
                 on_call: Callable[[str, float, bool], None] | None = None) -> None:
        self.transport = transport
        self.timeout_s = timeout_s
        self.on_call = on_call

    def _call(self, method: str, request: Message, response_type: type[M]) -> M:
        start = time.monotonic()
        ok = False
        try:
            raw = self.transport(method, request.SerializeToString(), self.timeout_s)
            try:
                out = response_type.FromString(raw)
            except DecodeError as e:
                raise CriCallError(grpc.StatusCode.INTERNAL,
                                   f"CRI {method} answered bytes that are not a runtime.v1 "
                                   f"{response_type.__name__}: {e}") from None
            ok = True
            return out
        except CriCallError as e:
            if e.code == grpc.StatusCode.NOT_FOUND:
                ok = True  # an answer, not a failure: CRI says the object does not exist
            raise
        finally:
            if self.on_call is not None:
                self.on_call(method, time.monotonic() - start, ok)

    def version(self) -> str:
        v = self._call("Version", cri.VersionRequest(version=_CRI_VERSION), cri.VersionResponse)
        return " ".join(x for x in (v.runtime_name, v.runtime_version) if x)

    def list_containers(self, container_id: str) -> list[cri.Container]:
        req = cri.ListContainersRequest(filter=cri.ContainerFilter(id=container_id))
        return list(self._call("ListContainers", req, cri.ListContainersResponse).containers)

    def container_status(self, container_id: str) -> cri.ContainerStatus:
        req = cri.ContainerStatusRequest(container_id=container_id)
        return self._call("ContainerStatus", req, cri.ContainerStatusResponse).status

    def sandbox_status(self, sandbox_id: str) -> cri.PodSandboxStatus | None:
        """The sandbox's status, None when CRI says NOT_FOUND (the pod is gone)."""
        try:
            req = cri.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id)
            return self._call("PodSandboxStatus", req, cri.PodSandboxStatusResponse).status
        except CriCallError as e:
            if e.code == grpc.StatusCode.NOT_FOUND:
                return None
            raise


def normalize_container_id(container_id: str) -> str:
    """kubelet writes `containerd://<id>` in pod status; CRI wants the bare (lower-case) ID."""
    _, sep, rest = container_id.strip().partition("://")
    return (rest if sep else container_id.strip()).lower()


def _pick(containers: list[cri.Container], container_id: str) -> cri.Container | None:
    """The listed container the ID (or ID prefix) names. containerd expands a unique prefix in the
    filter itself (its truncindex); a runtime that does not may list more, so check here."""
    exact = [c for c in containers if c.id == container_id]
    if exact:
        return exact[0]
    matches = [c for c in containers if c.id.startswith(container_id)]
    if len(matches) > 1:
        raise CriCallError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"container ID prefix {container_id} is ambiguous: {len(matches)} containers")
    return matches[0] if matches else None


def _first(*values: str) -> str:
    return next((v for v in values if v), "")


def _names(labels: Mapping[str, str], sandbox: cri.PodSandboxStatus | None,
           metadata_name: str) -> tuple[str, str, str, str]:
    """(namespace, pod, pod_uid, container): sandbox metadata, else kubelet labels, else metadata."""
    meta = sandbox.metadata if sandbox is not None else cri.PodSandboxMetadata()
    return (_first(meta.namespace, labels.get(LABEL_POD_NAMESPACE, "")),
            _first(meta.name, labels.get(LABEL_POD_NAME, "")),
            _first(meta.uid, labels.get(LABEL_POD_UID, "")),
            _first(labels.get(LABEL_CONTAINER_NAME, ""), metadata_name))


def fetch_k8s_info(client: CriClient, container_id: str, runtime: str,
                   early: Callable[[K8sInfo], None] | None = None) -> K8sInfo:
    """What CRI says about one container; raises CriCallError when CRI does not answer.

    `early`, when given, hears the names as soon as ListContainers has answered for a running
    container that carries the kubelet's pod labels: through a tracer's relay every call is a
    round trip to the node, and the sandbox check that follows only ever adds an orphan verdict.
    """
    listed = _pick(client.list_containers(container_id), container_id)
    if early is not None and listed is not None and listed.state == cri.CONTAINER_RUNNING:
        labels = dict(listed.labels)
        if labels.get(LABEL_POD_NAME) and labels.get(LABEL_POD_NAMESPACE):
            namespace, pod, pod_uid, container = _names(labels, None, listed.metadata.name)
            early(K8sInfo(
                resolution="resolved", namespace=namespace, pod=pod, pod_uid=pod_uid, container=container,
                image=_first(listed.image.image, listed.image_ref),
                container_state=cri.ContainerState.Name(listed.state), runtime=runtime))
    status: cri.ContainerStatus | None = None
    if listed is None:
        # Not listed: confirm with ContainerStatus, which also sees a container created just now.
        try:
            status = client.container_status(container_id)
        except CriCallError as e:
            if e.code == grpc.StatusCode.NOT_FOUND:
                return K8sInfo(resolution="not_found", container_state="NOT_FOUND", runtime=runtime)
            raise
        listed = _pick(client.list_containers(status.id), status.id) if status.id else None
    if listed is not None:
        cid, sandbox_id, state = listed.id, listed.pod_sandbox_id, listed.state
        name, labels = listed.metadata.name, dict(listed.labels)
        image = _first(listed.image.image, listed.image_ref)
    else:  # CRI knows it but will not list it: take what ContainerStatus says, pod from labels
        assert status is not None
        cid, sandbox_id, state = status.id, "", status.state
        name, labels = status.metadata.name, dict(status.labels)
        image = _first(status.image.image, status.image_ref)
    exited = state in (cri.CONTAINER_EXITED, cri.CONTAINER_UNKNOWN)
    if exited and status is None:
        status = client.container_status(cid)
    sandbox = client.sandbox_status(sandbox_id) if sandbox_id else None
    if sandbox is not None:
        sandbox_state = cri.PodSandboxState.Name(sandbox.state)
    else:
        sandbox_state = "NOT_FOUND" if sandbox_id else ""
    namespace, pod, pod_uid, container = _names(labels, sandbox, name)
    return K8sInfo(
        resolution="resolved", namespace=namespace, pod=pod, pod_uid=pod_uid, container=container,
        image=image, container_state=cri.ContainerState.Name(state), sandbox_state=sandbox_state,
        runtime=runtime, container_reason=status.reason if exited and status is not None else "",
        # An UNKNOWN container that never finished has no exit code, only CRI's default 0.
        exit_code=status.exit_code if status is not None and (
            state == cri.CONTAINER_EXITED or (exited and status.finished_at)) else None,
    )
