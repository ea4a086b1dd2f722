"""The kubelet PodResources poller: which devices each container on this node was allocated.

A thread calls `/v1.PodResourcesLister/List` on the kubelet's socket every `interval_s` and emits
an `allocations` record on start and whenever the answer changes (never the same answer twice),
so the collector can tell a container using a GPU it was never given (`unallocated`, the
`NVIDIA_VISIBLE_DEVICES=all` leak). Every device resource is kept with its name; the collector
decides which are GPUs. Device IDs lose any `::N` suffix (physical_device_id): the NVIDIA device
plugin's time-slicing and MPS sharing advertise replica N of a GPU as `<UUID>::N`, and it is the
physical GPU that counts. The record is the typed AllocationsRecord, mapped to proto once
(ghostgpu.common.wire.convert) like every other record.

Failures are one record and one log line per transition (available -> not, or a different kind
of failure), not one per poll; a missing socket is how a machine without kubelet looks and is
said once, quietly. RESOURCE_EXHAUSTED (kubelet rate-limits this endpoint) keeps the last answer
and doubles the poll interval until a call succeeds.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from ghostgpu.tracer.cri_relay import rpc_status

from ghostgpu.common.model.records import AllocationsRecord, ContainerAllocation, physical_device_id
from ghostgpu.common.transport.addresses import socket_path
from ghostgpu.k8s import podresources_v1_pb2

log = logging.getLogger("ghostgpu.podresources")

DEFAULT_ENDPOINT = "unix:///var/lib/kubelet/pod-resources/kubelet.sock"
LIST_METHOD = "/v1.PodResourcesLister/List"
CALL_TIMEOUT_S = 5.0
MAX_BACKOFF_FACTOR = 8  # RESOURCE_EXHAUSTED backs off to at most 8x the interval
MAX_RECEIVE_BYTES = 16 << 20  # kubelet's own server limit for this API
_GPU_UUID = re.compile(r"\b(?:GPU|MIG)-[0-9A-Za-z-]+")


def endpoint_path(endpoint: str) -> str:
    return socket_path(endpoint, "--podresources-endpoint", "kubelet.sock")


def containers_of(response: podresources_v1_pb2.ListPodResourcesResponse) -> tuple[ContainerAllocation, ...]:
    """The `containers` of an allocations record: every container holding at least one device.

    A container with no device is left out (the collector reads "not listed" as "allocated nothing").
    Dynamic resources (DRA claims) count too: their CDI device names are kept, plus any GPU/MIG UUID
    they spell, so a claimed GPU is not mistaken for an unallocated one.
    """
    out: list[ContainerAllocation] = []
    for pod in response.pod_resources:
        for c in pod.containers:
            names: list[str] = []
            ids: list[str] = []
            for dev in c.devices:
                names.append(dev.resource_name)
                ids.extend(physical_device_id(i) for i in dev.device_ids)
            for dyn in c.dynamic_resources:
                for claim in dyn.claim_resources:
                    names.append(claim.driver_name or f"claim:{dyn.claim_namespace}/{dyn.claim_name}")
                    for cdi in claim.cdi_devices:
                        ids.append(cdi.name)
                        ids.extend(_GPU_UUID.findall(cdi.name))
            if ids:
                out.append(ContainerAllocation(pod.namespace, pod.name, c.name, tuple(sorted(set(names))),
                                               tuple(sorted(set(ids)))))
    out.sort(key=lambda r: (r.namespace, r.pod, r.container))
    return tuple(out)


class PodResourcesPoller:
    def __init__(self, endpoint: str | None, emit: Callable[[AllocationsRecord], None],
                 interval_s: float = 10.0, node: str = "", clock: Callable[[], float] = time.time) -> None:
        self.path = endpoint_path(endpoint or DEFAULT_ENDPOINT)
        self.interval_s = interval_s
        self.current_interval_s = interval_s
        self._emit = emit
        self._node = node
        self._wall = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._channel: grpc.Channel | None = None
        self._last: tuple[Any, ...] | None = None  # what the last emitted record said
        self._exhausted_logged = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ghostgpu-podresources", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:  # never let one odd answer end the poller; say it and keep polling
                log.exception("PodResources poll failed unexpectedly")
            self._stop.wait(self.current_interval_s)

    def poll_once(self) -> AllocationsRecord | None:
        """One List call; returns the record it emitted, None when nothing changed."""
        if not os.path.exists(self.path):
            return self._unavailable("missing", (
                f"PodResources socket {self.path} not found: not a Kubernetes node, or mount the host's "
                f"/var/lib/kubelet/pod-resources into the tracer (--podresources-endpoint overrides)"))
        if self._channel is None:
            # One channel: gRPC re-dials the path when kubelet restarts and re-creates its socket.
            self._channel = grpc.insecure_channel(
                f"unix://{self.path}", options=[("grpc.max_receive_message_length", MAX_RECEIVE_BYTES)])
        call = self._channel.unary_unary(
            LIST_METHOD, request_serializer=podresources_v1_pb2.ListPodResourcesRequest.SerializeToString,
            response_deserializer=podresources_v1_pb2.ListPodResourcesResponse.FromString)
        try:
            response = call(podresources_v1_pb2.ListPodResourcesRequest(), timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as exc:
            code, details = rpc_status(exc)
            if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.current_interval_s = min(self.current_interval_s * 2,
                                              self.interval_s * MAX_BACKOFF_FACTOR)
                if not self._exhausted_logged:
                    log.warning("PodResources List on %s: kubelet rate limit (%s); polling every %g s until "
                                "it answers", self.path, details, self.current_interval_s)
                    self._exhausted_logged = True
                return None
            return self._unavailable(code.name, (
                f"PodResources List on {self.path} failed: {code.name}: {details}; check that kubelet runs "
                f"and the tracer may read its pod-resources socket (root)"))
        self.current_interval_s = self.interval_s
        self._exhausted_logged = False
        containers = containers_of(response)
        return self._report(("ok", containers), available=True, error="", containers=containers)

    def _unavailable(self, kind: str, error: str) -> AllocationsRecord | None:
        if self._last is not None and self._last[0] == kind:
            return None
        if kind == "missing":
            log.info("%s", error)  # normal off Kubernetes: one quiet line
        else:
            log.warning("%s", error)
        return self._report((kind,), available=False, error=error, containers=())

    def _report(self, signature: tuple[Any, ...], available: bool, error: str,
                containers: tuple[ContainerAllocation, ...]) -> AllocationsRecord | None:
        if signature == self._last:
            return None
        self._last = signature
        rec = AllocationsRecord(round(self._wall(), 6), self._node, available, error, containers)
        self._emit(rec)
        return rec
