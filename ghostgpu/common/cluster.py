"""The cluster side of the common model: a node's consumer as the collector shows it.

A ClusterConsumer is a node's Consumer (with its final class) plus what CRI said about its
container and whether PodResources allocated it that GPU. `ghostgpu ps -o json` writes
`to_json()`: the node snapshot's keys plus namespace, pod, container, image and allocated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ghostgpu.common.convert import class_from_proto, class_to_proto, consumer_from_proto, consumer_to_proto
from ghostgpu.common.model import Consumer, ConsumerClass
from ghostgpu.v1 import query_pb2


@dataclass(frozen=True)
class K8sInfo:
    """What CRI said about one container (see collector/cri.py), or why it could not say."""

    resolution: str  # "resolved" | "not_found" | "unresolved" (CRI unreachable, retried) | "none"
    namespace: str = ""
    pod: str = ""
    pod_uid: str = ""
    container: str = ""
    image: str = ""
    container_state: str = ""  # CONTAINER_RUNNING, _EXITED, _UNKNOWN, _CREATED, or NOT_FOUND
    sandbox_state: str = ""  # SANDBOX_READY, SANDBOX_NOTREADY, NOT_FOUND
    error: str = ""  # why unresolved
    runtime: str = ""  # e.g. "containerd 1.6.20"
    container_reason: str = ""  # CRI's reason for an exited container (e.g. "Completed", "Error")
    exit_code: int | None = None

    @property
    def orphan_reason(self) -> str | None:
        """CRI's verdict that the container is gone, as one line; None while it runs (or CRI is silent)."""
        who = f"CRI ({self.runtime})" if self.runtime else "CRI"
        if self.resolution == "not_found":
            return f"{who} does not know this container: its record is gone"
        if self.resolution != "resolved":
            return None
        if self.container_state in ("CONTAINER_EXITED", "CONTAINER_UNKNOWN"):
            detail = ", ".join(x for x in (
                f"reason {self.container_reason}" if self.container_reason else "",
                f"exit code {self.exit_code}" if self.exit_code is not None else "") if x)
            state = self.container_state.removeprefix("CONTAINER_").lower()
            name = f"container {self.container}" if self.container else "the container"
            return f"{who} reports {name} {state}" + (f" ({detail})" if detail else "")
        pod = f"pod {self.namespace}/{self.pod}" if self.pod else "the pod"
        if self.sandbox_state == "NOT_FOUND":
            return f"{who} reports {pod} sandbox gone"
        if self.sandbox_state == "SANDBOX_NOTREADY":
            return f"{who} reports {pod} sandbox not ready (stopped)"
        return None


@dataclass
class ClusterConsumer:
    consumer: Consumer  # class and reason are final
    k8s: K8sInfo = field(default_factory=lambda: K8sInfo(resolution="none"))
    allocated: bool | None = None  # None: unknown
    node_class: ConsumerClass | None = None  # what the node tracer said, before CRI and PodResources
    since_unix_ns: int = 0
    updated_unix_ns: int = 0

    def to_json(self) -> dict[str, Any]:
        d = self.consumer.to_json()
        d.update({
            "namespace": self.k8s.namespace,
            "pod": self.k8s.pod,
            "container": self.k8s.container,
            "image": self.k8s.image,
            "allocated": "unknown" if self.allocated is None else self.allocated,
            "node_class": str(self.node_class) if self.node_class is not None else str(self.consumer.cls),
            "since": self.since_unix_ns / 1e9 if self.since_unix_ns else None,
            "resolution": self.k8s.resolution,
            "container_state": self.k8s.container_state,
            "sandbox_state": self.k8s.sandbox_state,
            "cri_runtime": self.k8s.runtime,
            "cri_error": self.k8s.error,
        })
        if not d["pod_uid"] and self.k8s.pod_uid:
            d["pod_uid"] = self.k8s.pod_uid
        return d


_ALLOCATED_TO_PB = {None: query_pb2.ALLOCATED_UNKNOWN, True: query_pb2.ALLOCATED_TRUE,
                    False: query_pb2.ALLOCATED_FALSE}
_PB_TO_ALLOCATED = {v: k for k, v in _ALLOCATED_TO_PB.items()}


def k8s_to_proto(k: K8sInfo) -> query_pb2.K8sIdentity:
    return query_pb2.K8sIdentity(
        namespace=k.namespace, pod=k.pod, pod_uid=k.pod_uid, container=k.container, image=k.image,
        container_state=k.container_state, sandbox_state=k.sandbox_state, resolution=k.resolution,
        error=k.error, runtime=k.runtime,
    )


def k8s_from_proto(m: query_pb2.K8sIdentity) -> K8sInfo:
    return K8sInfo(
        resolution=m.resolution or "none", namespace=m.namespace, pod=m.pod, pod_uid=m.pod_uid,
        container=m.container, image=m.image, container_state=m.container_state,
        sandbox_state=m.sandbox_state, error=m.error, runtime=m.runtime,
    )


def cluster_consumer_to_proto(c: ClusterConsumer) -> query_pb2.ClusterConsumer:
    return query_pb2.ClusterConsumer(
        consumer=consumer_to_proto(c.consumer), k8s=k8s_to_proto(c.k8s),
        allocated=_ALLOCATED_TO_PB[c.allocated], node_class=class_to_proto(c.node_class or c.consumer.cls),
        since_unix_ns=c.since_unix_ns, updated_unix_ns=c.updated_unix_ns,
    )


def cluster_consumer_from_proto(m: query_pb2.ClusterConsumer) -> ClusterConsumer:
    return ClusterConsumer(
        consumer=consumer_from_proto(m.consumer), k8s=k8s_from_proto(m.k8s),
        allocated=_PB_TO_ALLOCATED.get(m.allocated),
        node_class=class_from_proto(m.node_class) if m.node_class else None,
        since_unix_ns=m.since_unix_ns, updated_unix_ns=m.updated_unix_ns,
    )
