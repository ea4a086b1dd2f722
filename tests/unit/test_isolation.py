"""Node isolation's pure parts (collector/isolation.py, collector/kube_api.py): which faults and memory
readings trigger it and when ("for N minutes", on an injected clock), what the Events say a human should
do, the exact PATCH and Event bodies (validated strictly against the Kubernetes schemas), and the RBAC
manifest's rules: exactly nodes get/patch and events create. minHealthy and the opt-out rules are
collector/remediation_guards.py's (tests/unit/test_remediation_guards.py); the Isolator applying them,
against the API server's test double, is tests/integration/test_isolation_kube.py."""

from __future__ import annotations

import sys

import pytest
from ghostgpu.collector.isolation import (
    UNACCOUNTED_MEMORY,
    XID,
    MemoryWatch,
    gpu_node_count,
    unkillable_trigger,
    xid_trigger,
)
from ghostgpu.collector.kube_api import (
    CLUSTER_ROLE,
    RBAC_MANIFEST,
    KubeApi,
    KubeError,
    NodeState,
    ObjectRef,
    Taint,
    cordon_patch,
    event_body,
    node_state,
    taint_patch,
)
from ghostgpu.collector.node_state import NodeStateRow
from ghostgpu.collector.nodes import NodeView

from ghostgpu.common.model.remediation import TAINT_KEY
from ghostgpu.v1 import query_pb2, stream_pb2
from tests.helpers.manifests import DEPLOY, Manifest

GIB = 1 << 30
K8S_VERSION = "1.32.0"


def fault(severity: str = "critical", xid: int = 79, gpu: int = 0, origin: str = "kernel",
          pods: tuple[tuple[str, str], ...] = (("ml", "train-0"),)) -> query_pb2.ClusterFault:
    cf = query_pb2.ClusterFault(id=12, node="gpu-1", fault=stream_pb2.Fault(
        gpu=gpu, xid=xid, severity=severity, meaning="GPU has fallen off the bus", origin=origin))
    for ns, pod in pods:
        cf.hits.add(k8s=query_pb2.K8sIdentity(namespace=ns, pod=pod))
    return cf


def view(node: str, *gpus: stream_pb2.Gpu) -> NodeView:
    v = NodeView(node)
    v.info = stream_pb2.NodeInfo(gpus=list(gpus))
    return v


def gpu(index: int, unaccounted_bytes: int | None) -> stream_pb2.Gpu:
    g = stream_pb2.Gpu(index=index, uuid=f"GPU-{index}")
    if unaccounted_bytes is not None:
        g.unaccounted_bytes = unaccounted_bytes
    return g


# ---- triggers and their messages -----------------------------------------------------------------

def test_a_critical_xid_from_the_driver_triggers_with_its_pods_and_the_next_steps() -> None:
    t = xid_trigger(fault())
    assert t is not None and t.kind == XID and t.node == "gpu-1"
    assert t.incident == "x12/isolate_node" and t.taint_value == "xid-79"
    assert t.pods == (("ml", "train-0"),)
    assert t.reason == "GPU 0 logged Xid 79 (GPU has fallen off the bus)"
    message = t.message()
    assert "did nothing else" in message and "drain the node" in message and "nvidia-smi -r -i 0" in message
    assert message.endswith(f"; then untaint it: kubectl taint nodes gpu-1 {TAINT_KEY}:NoSchedule-")
    assert t.message("cordon").endswith("; then uncordon it: kubectl uncordon gpu-1")


@pytest.mark.parametrize("severity,origin", [("warning", "kernel"), ("info", "kernel"), ("unknown", "kernel"),
                                             ("critical", "user")])
def test_no_other_fault_triggers_and_no_drill(severity: str, origin: str) -> None:
    assert xid_trigger(fault(severity=severity, origin=origin)) is None


def test_an_unkillable_holder_isolates_under_its_findings_own_incident() -> None:
    t = unkillable_trigger("gpu-2", "pid 4242 in D state, wchan nv_wait", "f77/kill_orphan")
    assert t.incident == "f77/isolate_node" and t.finding_id == 77 and t.taint_value == "unkillable"
    assert "pid 4242 in D state" in t.reason
    assert "drain the node, then reboot it" in t.message()


def test_memory_no_process_owns_triggers_only_after_n_minutes_without_a_break() -> None:
    watch = MemoryWatch()
    held = 3 * GIB + GIB // 5  # 3.2 GiB
    nodes = {"gpu-1": view("gpu-1", gpu(0, held), gpu(1, 0))}
    assert watch.observe(nodes, 2 * GIB, 600.0, now_unix_s=1000.0) == []
    assert watch.observe(nodes, 2 * GIB, 600.0, now_unix_s=1599.0) == []
    (t,) = watch.observe(nodes, 2 * GIB, 600.0, now_unix_s=1600.0)
    assert t.kind == UNACCOUNTED_MEMORY and t.node == "gpu-1"
    assert t.incident == "mgpu-1/gpu0/1000/isolate_node"
    assert t.reason == "GPU 0 holds 3.2 GiB no process owns, for 10 min"
    assert "reset needs no clients" in t.message() and "nvidia-smi -r -i 0" in t.message()
    assert "nvidia-smi -pm 0" in t.message()
    assert watch.observe(nodes, 2 * GIB, 600.0, now_unix_s=1700.0) == []  # once per episode


def test_memory_that_dips_below_the_threshold_starts_the_clock_over() -> None:
    watch = MemoryWatch()
    high = {"gpu-1": view("gpu-1", gpu(0, 3 * GIB))}
    assert watch.observe(high, 2 * GIB, 600.0, now_unix_s=0.0) == []
    assert watch.observe({"gpu-1": view("gpu-1", gpu(0, GIB))}, 2 * GIB, 600.0, now_unix_s=500.0) == []
    assert watch.observe(high, 2 * GIB, 600.0, now_unix_s=700.0) == []  # 200 s above, not 700
    assert watch.observe({"gpu-1": view("gpu-1", gpu(0, None))}, 2 * GIB, 600.0, now_unix_s=800.0) == []
    assert watch.observe(high, 2 * GIB, 600.0, now_unix_s=1300.0) == []
    assert len(watch.observe(high, 2 * GIB, 600.0, now_unix_s=1900.0)) == 1


def test_a_zero_threshold_turns_the_memory_trigger_off() -> None:
    watch = MemoryWatch()
    nodes = {"gpu-1": view("gpu-1", gpu(0, 50 * GIB))}
    assert watch.observe(nodes, 0, 0.0, now_unix_s=0.0) == []
    assert watch.observe(nodes, 0, 0.0, now_unix_s=10_000.0) == []


# ---- guards --------------------------------------------------------------------------------------

def test_gpu_nodes_are_the_nodes_whose_tracer_reports_a_gpu() -> None:
    nodes = {"a": view("a", gpu(0, 0)), "b": view("b"), "c": NodeView("c")}
    assert gpu_node_count(nodes) == 1


# ---- the bodies sent -----------------------------------------------------------------------------

def test_gpu_nodes_count_the_node_state_rows_of_every_replica_once() -> None:
    def row(node: str, *gpus: stream_pb2.Gpu, status: bytes | None = None) -> NodeStateRow:
        status_pb = query_pb2.TracerStatus(node=node, info=stream_pb2.NodeInfo(gpus=list(gpus)))
        blob = status_pb.SerializeToString()
        return NodeStateRow(node, "replica-b", 1, 1, b"", blob if status is None else status, 1, 0)

    mine = {"gpu-1": view("gpu-1", gpu(0, None))}
    stored = [row("gpu-1", gpu(0, None)), row("gpu-2", gpu(0, None)), row("cpu-1"),
              row("bad", status=b"\xff\xff")]
    assert gpu_node_count(mine, stored) == 2  # gpu-1 once; cpu-1 has no GPU; a bad blob is not counted


def _validate(obj: dict, kind: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    kubernetes_validate.validate({"apiVersion": "v1", "kind": kind, **obj}, K8S_VERSION, strict=True)


def test_the_taint_patch_replaces_the_whole_list_with_the_resource_version_as_precondition() -> None:
    other = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    old_ours = {"key": TAINT_KEY, "value": "xid-48", "effect": "NoSchedule",
                "timeAdded": "2026-01-01T00:00:00Z"}
    state = node_state({"metadata": {"name": "gpu-1", "resourceVersion": "41"},
                        "spec": {"taints": [other, old_ours]}})
    patch = taint_patch(state, Taint(TAINT_KEY, "xid-79", "NoSchedule"))
    assert patch == {"metadata": {"resourceVersion": "41"},
                     "spec": {"taints": [other, {"key": TAINT_KEY, "value": "xid-79",
                                                 "effect": "NoSchedule"}]}}
    _validate(patch, "Node")
    again = node_state({"metadata": {"name": "gpu-1", "resourceVersion": "42"}, "spec": patch["spec"]})
    assert taint_patch(again, Taint(TAINT_KEY, "xid-79", "NoSchedule")) is None  # there already: no PATCH


def test_the_cordon_patch_is_kubectls() -> None:
    assert cordon_patch() == {"spec": {"unschedulable": True}}
    _validate(cordon_patch(), "Node")


def test_the_events_are_core_v1_warnings_from_ghostgpu_on_the_node_and_the_pod() -> None:
    node = event_body(ObjectRef("Node", "gpu-1", "", "uid-1"), "GPUUnhealthy", "GPU 0 ...", 1_700_000_000.5,
                      "collector-0")
    assert node["metadata"]["namespace"] == "default"  # a Node's events go where kubelet puts them
    assert node["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": "gpu-1", "uid": "uid-1"}
    assert (node["type"], node["source"]["component"], node["count"]) == ("Warning", "ghostgpu", 1)
    assert node["firstTimestamp"] == node["lastTimestamp"] == "2023-11-14T22:13:20Z"
    pod = event_body(ObjectRef("Pod", "train-0", "ml"), "GPUUnhealthy", "x", 1_700_000_000.0)
    assert pod["metadata"]["namespace"] == "ml" and pod["involvedObject"]["namespace"] == "ml"
    for body in (node, pod):
        _validate(body, "Event")


def test_a_missing_kubeconfig_is_one_line_naming_it_and_the_rbac(tmp_path) -> None:
    pytest.importorskip("kubernetes", reason="pip install kubernetes (a runtime dependency)")
    with pytest.raises(KubeError) as e:
        KubeApi(kubeconfig=str(tmp_path / "nope"))
    line = str(e.value)
    assert "\n" not in line and str(tmp_path / "nope") in line and RBAC_MANIFEST in line


def test_a_missing_client_package_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # import kubernetes now raises ImportError
    with pytest.raises(KubeError) as e:
        KubeApi()
    assert "\n" not in str(e.value) and "pip install kubernetes" in str(e.value)


def test_no_node_state_is_lost_reading_a_node() -> None:
    s = node_state({"metadata": {"name": "n", "uid": "u", "resourceVersion": "3", "labels": {"a": "b"}},
                    "spec": {"unschedulable": True, "taints": [{"key": "k", "effect": "NoExecute"}]}})
    assert s == NodeState("n", "u", "3", {"a": "b"}, (Taint("k", "", "NoExecute"),), True,
                          ({"key": "k", "effect": "NoExecute"},))
    assert s.has_taint("k", "NoExecute") and not s.has_taint("k", "NoSchedule")


# ---- RBAC ----------------------------------------------------------------------------------------

def test_the_rbac_grants_exactly_nodes_get_patch_and_events_create_to_the_collector() -> None:
    m = Manifest(DEPLOY / "isolation-rbac.yaml")
    assert str(m.path).endswith(RBAC_MANIFEST)
    role = m.get("ClusterRole", CLUSTER_ROLE)
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    assert granted == {("", "nodes", "get"), ("", "nodes", "patch"), ("", "events", "create")}
    # no resourceNames, no nonResourceURLs: the three grants above and nothing else
    assert all(set(rule) == {"apiGroups", "resources", "verbs"} for rule in role["rules"])
    binding = m.get("ClusterRoleBinding", CLUSTER_ROLE)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": CLUSTER_ROLE}
    sa = m.get("ServiceAccount", "ghostgpu-collector")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "ghostgpu-collector",
                                    "namespace": sa["metadata"]["namespace"]}]
    assert set(m.by_kind("ClusterRole")) == {CLUSTER_ROLE} and len(m.documents) == 3
