"""What the collector adds to a node's consumer: names from CRI, allocation from PodResources.

`enrich()` is the collector's part of classification, a pure function. The node tracer already
decided system, ghost, orphaned (zombie, reparented), visible, monitor, hidden, pending, ...; the
collector knows facts a node cannot judge alone:

- CRI says the holder's container exited, is unknown, or its pod sandbox is gone: `orphaned`.
- CRI places an allowlisted daemon the node found in a container (the consumer's `allowlisted`) in a
  namespace or NAMESPACE/CONTAINER its `system_places` (the tracer's config) name: `system`. A pod
  picks its own process and container names, never its namespace, so only CRI's names count.
- PodResources says the container was never given this GPU: `unallocated`. A consumer with no GPU
  (node-wide devices only) cannot be judged so: allocations name GPUs.

Which of these and the node's class wins is ghostgpu.common.model.classes' precedence, the one classify()
applies on the node: the node's system and ghost (and its own orphaned verdict) stand, CRI's and
PodResources' verdicts replace anything below them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from ghostgpu.common.model import classes
from ghostgpu.common.model.consumers import Consumer, ConsumerClass, K8sInfo
from ghostgpu.common.model.records import physical_device_id

NO_CONTAINER = K8sInfo(resolution="none")


@dataclass(frozen=True)
class Allocations:
    """PodResources for one node: (namespace, pod, container) -> physical device IDs (GPU/MIG UUIDs)."""

    available: bool
    error: str = ""
    by_container: Mapping[tuple[str, str, str], frozenset[str]] = field(default_factory=dict)

    def allocated(self, k8s: K8sInfo, gpu_uuid: str) -> bool | None:
        """True/False when PodResources can say; None (unknown) when it, CRI or NVML cannot."""
        if not self.available or k8s.resolution != "resolved" or not k8s.pod:
            return None
        ids = self.by_container.get((k8s.namespace, k8s.pod, k8s.container))
        if not ids:
            return False  # the container asked for no device at all (absent or listed empty), yet holds a GPU
        if not gpu_uuid:
            return None  # no NVML: which GPU this is cannot be named by UUID
        if gpu_uuid in ids:
            return True
        if any(i.startswith("MIG-") for i in ids):
            return None  # a MIG UUID names no parent GPU without NVML's help: do not guess
        return False


NO_ALLOCATIONS = Allocations(available=False, error="no PodResources report from this node")


def allocations_from(entries: Sequence[tuple[str, str, str, Sequence[str]]], available: bool = True,
                     error: str = "") -> Allocations:
    """Build from (namespace, pod, container, device_ids) rows; one container may appear more than once.
    A replica's ID (`<UUID>::N`, a shared GPU) counts as its GPU's, as the tracer already writes it."""
    merged: dict[tuple[str, str, str], set[str]] = {}
    for namespace, pod, container, ids in entries:
        merged.setdefault((namespace, pod, container), set()).update(physical_device_id(i) for i in ids)
    return Allocations(available, error, {k: frozenset(v) for k, v in merged.items()})


def system_place(consumer: Consumer, k8s: K8sInfo) -> str | None:
    """The place (of the consumer's system_places) CRI puts its container in, or None."""
    if not consumer.allowlisted or not consumer.system_places or k8s.resolution != "resolved":
        return None
    for place in consumer.system_places:
        if place in (k8s.namespace, f"{k8s.namespace}/{k8s.container}"):
            return place
    return None


def enrich(consumer: Consumer, k8s: K8sInfo, allocations: Allocations) -> tuple[Consumer, bool | None]:
    """(consumer with its final class and reason, allocated): the node's view plus CRI and PodResources."""
    if not consumer.container_id:
        return consumer, None
    allocated = allocations.allocated(k8s, consumer.gpu_uuid) if consumer.gpu is not None else None
    orphan = k8s.orphan_reason
    place = system_place(consumer, k8s)
    applicable = [consumer.cls]  # the node's class stands unless a rule that outranks it holds
    if place is not None:
        applicable.append(ConsumerClass.SYSTEM)
    if orphan is not None:
        applicable.append(ConsumerClass.ORPHANED)
    if allocated is False:
        applicable.append(ConsumerClass.UNALLOCATED)
    cls = classes.highest(applicable)
    if cls == consumer.cls:
        return consumer, allocated  # the node's reason too: an orphan it saw keeps its own evidence
    in_container = f" (pid {consumer.ns_pid} in its container)" if consumer.ns_pid else ""
    pid_text = f"pid {consumer.pid}{in_container}"
    devices = ", ".join(consumer.devices) or "a GPU device"
    if cls is ConsumerClass.SYSTEM:
        reason = (f"allowlisted node daemon {consumer.allowlisted} ({consumer.comm}) in container "
                  f"{k8s.container} of pod {k8s.namespace}/{k8s.pod}, a place the tracer's config names "
                  f"({place}); {pid_text} holds {devices}")
    elif cls is ConsumerClass.ORPHANED:
        reason = f"{orphan}, yet {pid_text} still holds {devices}"
    else:
        gpu = f"GPU {consumer.gpu} ({consumer.gpu_uuid})" if consumer.gpu_uuid else f"GPU {consumer.gpu}"
        reason = (f"PodResources did not allocate {gpu} to container {k8s.container} of pod "
                  f"{k8s.namespace}/{k8s.pod}, yet {pid_text} holds {devices}")
    return replace(consumer, cls=cls, reason=reason), allocated
