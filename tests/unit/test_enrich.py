"""collector.enrich.enrich as a table: the node's class, CRI's verdict and PodResources' allocation in,
the final class and `allocated` out; plus K8sInfo.orphan_reason and Allocations on their own."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from ghostgpu.collector.enrich import NO_ALLOCATIONS, NO_CONTAINER, Allocations, allocations_from, enrich

from ghostgpu.common.model.consumers import Consumer, ConsumerClass, K8sInfo

C = ConsumerClass
CID = "4b825dc642cb6eb9a060e54bf8d69288fbee4904ec6e38d4fd0f1d4e4c1c8a10"
UUID0 = "GPU-0a1b2c3d-0000-4000-8000-000000000000"
UUID1 = "GPU-0a1b2c3d-0000-4000-8000-000000000001"
MIG0 = "MIG-6e1a8f1e-1b2c-5d3e-9f40-111111111111"
NODE_REASON = "the node's own reason"
DID_NOT = "PodResources did not allocate GPU 0"


def consumer(cls: ConsumerClass, gpu_uuid: str = UUID0, container_id: str = CID,
             gpu: int | None = 0) -> Consumer:
    return Consumer(
        node="n1", pid=4242, ns_pid=7, comm="python", gpu=gpu, gpu_uuid=gpu_uuid, gpu_minor=gpu,
        devices=["/dev/nvidia0", "/dev/nvidiactl"], container_id=container_id, pod_uid="uid-1",
        runtime="containerd", cls=cls, reason=NODE_REASON, gpu_memory_bytes=None)


def k8s(resolution: str = "resolved", state: str = "CONTAINER_RUNNING", sandbox: str = "SANDBOX_READY",
        **kw: object) -> K8sInfo:
    return K8sInfo(resolution=resolution, namespace="ml", pod="trainer-0", pod_uid="uid-1",  # type: ignore[arg-type]
                   container="cuda", container_state=state, sandbox_state=sandbox,
                   runtime="containerd 1.6.20", **kw)


RUNNING = k8s()
NOT_FOUND = K8sInfo(resolution="not_found", container_state="NOT_FOUND", runtime="containerd 1.6.20")
EXITED = k8s(state="CONTAINER_EXITED", container_reason="Completed", exit_code=0)
UNKNOWN_STATE = k8s(state="CONTAINER_UNKNOWN")
SANDBOX_GONE = k8s(sandbox="NOT_FOUND")
SANDBOX_STOPPED = k8s(sandbox="SANDBOX_NOTREADY")
UNRESOLVED = K8sInfo(resolution="unresolved", error="CRI unreachable")

MINE = allocations_from([("ml", "trainer-0", "cuda", [UUID0])])
OTHER_GPU = allocations_from([("ml", "trainer-0", "cuda", [UUID1])])
NOTHING_FOR_IT = allocations_from([("ml", "other-pod", "cuda", [UUID0])])
LISTED_EMPTY = allocations_from([("ml", "trainer-0", "cuda", [])])
REPLICA = allocations_from([("ml", "trainer-0", "cuda", [f"{UUID0}::3"])])
MIG_ONLY = allocations_from([("ml", "trainer-0", "cuda", [MIG0])])
MIG_AND_MINE = allocations_from([("ml", "trainer-0", "cuda", [MIG0, UUID0])])
UNAVAILABLE = Allocations(available=False, error="no kubelet socket")


@dataclass(frozen=True)
class Case:
    name: str
    node: ConsumerClass
    k8s: K8sInfo
    alloc: Allocations
    want: ConsumerClass
    allocated: bool | None
    reason: str | None = None  # a substring of the final reason; None: the node's reason is kept
    gpu_uuid: str = UUID0
    container_id: str = CID


CASES = [
    # Classes the node decided outrank anything CRI or PodResources adds; allocated is still reported.
    Case("system kept over a CRI orphan", C.SYSTEM, NOT_FOUND, NOTHING_FOR_IT, C.SYSTEM, None),
    Case("ghost kept over unallocated", C.GHOST, RUNNING, NOTHING_FOR_IT, C.GHOST, False),
    Case("node orphan kept with its reason", C.ORPHANED, RUNNING, MINE, C.ORPHANED, True),
    Case("node orphan kept over a CRI orphan", C.ORPHANED, EXITED, MINE, C.ORPHANED, True),
    # CRI's orphan verdicts beat unallocated.
    Case("not_found beats unallocated", C.VISIBLE, NOT_FOUND, NOTHING_FOR_IT, C.ORPHANED, None,
         "CRI (containerd 1.6.20) does not know this container: its record is gone, yet pid 4242 "
         "(pid 7 in its container) still holds /dev/nvidia0, /dev/nvidiactl"),
    Case("exited beats unallocated", C.HIDDEN, EXITED, NOTHING_FOR_IT, C.ORPHANED, False,
         "reports container cuda exited (reason Completed, exit code 0), yet pid 4242"),
    Case("unknown container state", C.VISIBLE, UNKNOWN_STATE, MINE, C.ORPHANED, True,
         "reports container cuda unknown, yet"),
    Case("sandbox gone", C.PENDING, SANDBOX_GONE, MINE, C.ORPHANED, True,
         "reports pod ml/trainer-0 sandbox gone"),
    Case("sandbox stopped", C.HIDDEN, SANDBOX_STOPPED, MINE, C.ORPHANED, True, "sandbox not ready (stopped)"),
    # Unallocated beats the node's visible, hidden, pending and unknown.
    Case("unallocated beats visible", C.VISIBLE, RUNNING, OTHER_GPU, C.UNALLOCATED, False,
         f"PodResources did not allocate GPU 0 ({UUID0}) to container cuda of pod ml/trainer-0, "
         "yet pid 4242 (pid 7 in its container) holds /dev/nvidia0, /dev/nvidiactl"),
    Case("unallocated beats hidden", C.HIDDEN, RUNNING, NOTHING_FOR_IT, C.UNALLOCATED, False, DID_NOT),
    Case("unallocated beats pending", C.PENDING, RUNNING, NOTHING_FOR_IT, C.UNALLOCATED, False, DID_NOT),
    Case("listed with no device", C.VISIBLE, RUNNING, LISTED_EMPTY, C.UNALLOCATED, False, DID_NOT),
    Case("no device at all, even without NVML", C.UNKNOWN, RUNNING, NOTHING_FOR_IT, C.UNALLOCATED, False,
         "did not allocate GPU 0 to container cuda", gpu_uuid=""),
    # Allocated, or allocation unknown: the node's class stays.
    Case("allocated keeps visible", C.VISIBLE, RUNNING, MINE, C.VISIBLE, True),
    Case("allocated keeps hidden", C.HIDDEN, RUNNING, MINE, C.HIDDEN, True),
    Case("replica suffix stripped", C.VISIBLE, RUNNING, REPLICA, C.VISIBLE, True),
    Case("MIG ids name no parent GPU", C.HIDDEN, RUNNING, MIG_ONLY, C.HIDDEN, None),
    Case("MIG ids plus the GPU itself", C.HIDDEN, RUNNING, MIG_AND_MINE, C.HIDDEN, True),
    Case("no NVML uuid, GPUs allocated", C.UNKNOWN, RUNNING, OTHER_GPU, C.UNKNOWN, None, gpu_uuid=""),
    Case("PodResources unavailable", C.HIDDEN, RUNNING, UNAVAILABLE, C.HIDDEN, None),
    Case("no PodResources report yet", C.VISIBLE, RUNNING, NO_ALLOCATIONS, C.VISIBLE, None),
    Case("CRI unreachable", C.HIDDEN, UNRESOLVED, NOTHING_FOR_IT, C.HIDDEN, None),
    Case("no container: untouched", C.UNATTRIBUTED, NO_CONTAINER, NOTHING_FOR_IT, C.UNATTRIBUTED, None,
         container_id=""),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_enrich(case: Case) -> None:
    node = consumer(case.node, gpu_uuid=case.gpu_uuid, container_id=case.container_id)
    out, allocated = enrich(node, case.k8s, case.alloc)
    assert (out.cls, allocated) == (case.want, case.allocated)
    if case.reason is None:
        assert out.reason == NODE_REASON
    else:
        assert case.reason in out.reason
    assert (out.pid, out.devices, out.container_id) == (node.pid, node.devices, node.container_id)
    assert node.cls == case.node  # the input consumer is not changed


def test_no_gpu_means_allocation_unknown() -> None:
    out, allocated = enrich(consumer(C.HIDDEN, gpu=None), RUNNING, NOTHING_FOR_IT)
    assert (out.cls, allocated) == (C.HIDDEN, None)


ORPHAN_REASONS = [
    (RUNNING, None),
    (UNRESOLVED, None),
    (NO_CONTAINER, None),
    (K8sInfo(resolution="not_found"), "CRI does not know this container: its record is gone"),
    (NOT_FOUND, "CRI (containerd 1.6.20) does not know this container: its record is gone"),
    (EXITED, "CRI (containerd 1.6.20) reports container cuda exited (reason Completed, exit code 0)"),
    (k8s(state="CONTAINER_EXITED", exit_code=137), "CRI (containerd 1.6.20) reports container cuda exited "
                                                    "(exit code 137)"),
    (UNKNOWN_STATE, "CRI (containerd 1.6.20) reports container cuda unknown"),
    (K8sInfo(resolution="resolved", container_state="CONTAINER_EXITED"), "CRI reports the container exited"),
    (SANDBOX_GONE, "CRI (containerd 1.6.20) reports pod ml/trainer-0 sandbox gone"),
    (SANDBOX_STOPPED, "CRI (containerd 1.6.20) reports pod ml/trainer-0 sandbox not ready (stopped)"),
    (K8sInfo(resolution="resolved", container_state="CONTAINER_RUNNING", sandbox_state="NOT_FOUND"),
     "CRI reports the pod sandbox gone"),
    (k8s(state="CONTAINER_CREATED"), None),
    (K8sInfo(resolution="unresolved", container_state="CONTAINER_EXITED", error="down"), None),
]


@pytest.mark.parametrize(("info", "want"), ORPHAN_REASONS)
def test_orphan_reason(info: K8sInfo, want: str | None) -> None:
    assert info.orphan_reason == want


def test_allocations_merge_rows_and_strip_replicas() -> None:
    a = allocations_from([("ml", "p", "c", [f"{UUID0}::1"]), ("ml", "p", "c", [UUID1, f"{UUID0}::2"])])
    assert a.by_container == {("ml", "p", "c"): frozenset({UUID0, UUID1})}
    assert a.available and a.error == ""
    who = K8sInfo(resolution="resolved", namespace="ml", pod="p", container="c")
    assert a.allocated(who, UUID1) is True
    assert a.allocated(who, "GPU-ffffffff-0000-4000-8000-000000000009") is False
    assert a.allocated(replace(who, resolution="unresolved"), UUID1) is None
    assert a.allocated(replace(who, pod=""), UUID1) is None  # resolved yet no pod: not a kubelet container
    assert NO_ALLOCATIONS.allocated(who, UUID1) is None


def daemon(places: list[str], allowlisted: str = "dcgm-exporter", cls: ConsumerClass = C.HIDDEN) -> Consumer:
    """What the node sends for an allowlisted name it found in a container: its real class, the entry,
    and the places its config admits such a daemon in."""
    return replace(consumer(cls), comm="dcgm-exporter", allowlisted=allowlisted, system_places=places)


# (id, consumer, CRI's answer, PodResources, final class, reason part; None: the node's reason)
PLACES = [
    ("namespace named", daemon(["ml"]), RUNNING, MINE, C.SYSTEM,
     "allowlisted node daemon dcgm-exporter (dcgm-exporter) in container cuda of pod ml/trainer-0, a place "
     "the tracer's config names (ml); pid 4242 (pid 7 in its container) holds /dev/nvidia0, /dev/nvidiactl"),
    ("namespace/container named", daemon(["kube-system", "ml/cuda"]), RUNNING, MINE, C.SYSTEM, "(ml/cuda)"),
    ("another container of the namespace", daemon(["ml/exporter"]), RUNNING, MINE, C.HIDDEN, None),
    ("another namespace", daemon(["gpu-operator"]), RUNNING, MINE, C.HIDDEN, None),
    ("a namespace is not a container name", daemon(["cuda"]), RUNNING, MINE, C.HIDDEN, None),
    ("no places: the host only", daemon([]), RUNNING, MINE, C.HIDDEN, None),
    ("not allowlisted", daemon(["ml"], allowlisted=""), RUNNING, MINE, C.HIDDEN, None),
    ("CRI unreachable: no names to trust", daemon(["ml"]), UNRESOLVED, MINE, C.HIDDEN, None),
    ("system beats a CRI orphan", daemon(["ml"]), EXITED, MINE, C.SYSTEM, "a place the tracer's config"),
    ("system beats unallocated", daemon(["ml"], cls=C.MONITOR), RUNNING, NOTHING_FOR_IT, C.SYSTEM, "(ml)"),
]


@pytest.mark.parametrize(("node", "info", "alloc", "want", "reason"), [p[1:] for p in PLACES],
                         ids=[p[0] for p in PLACES])
def test_allowlisted_daemon_in_a_named_place_is_system(node: Consumer, info: K8sInfo, alloc: Allocations,
                                                         want: ConsumerClass, reason: str | None) -> None:
    out, _ = enrich(node, info, alloc)
    assert out.cls is want
    assert out.reason == NODE_REASON if reason is None else reason in out.reason


def test_monitor_pod_without_a_gpu_request_is_unallocated() -> None:
    """A monitoring pod outside the configured places that holds a GPU it was never given: the
    collector's unallocated outranks the node's monitor (configure system_namespaces for such pods)."""
    out, allocated = enrich(consumer(C.MONITOR), RUNNING, NOTHING_FOR_IT)
    assert (out.cls, allocated) == (C.UNALLOCATED, False)


def test_node_wide_holder_is_never_unallocated() -> None:
    """PodResources allocates GPUs; a holder of nvidiactl and nvidia-uvm only names none."""
    node = replace(consumer(C.HIDDEN, gpu=None, gpu_uuid=""), devices=["/dev/nvidia-uvm", "/dev/nvidiactl"])
    for alloc in (NOTHING_FOR_IT, LISTED_EMPTY, MINE):
        out, allocated = enrich(node, RUNNING, alloc)
        assert (out.cls, allocated, out.reason) == (C.HIDDEN, None, NODE_REASON)
    out, _ = enrich(node, EXITED, MINE)
    assert out.cls is C.ORPHANED and "still holds /dev/nvidia-uvm, /dev/nvidiactl" in out.reason
