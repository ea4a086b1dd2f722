"""Node isolation end to end against the Kubernetes API server's TEST DOUBLE (tests/helpers/kube_double.py:
no API server can run on these machines): the real official client (`kubernetes`) inside the Isolator,
every body it sends validated strictly against the Kubernetes schemas by the double; the real SQLite
store and audit chain. Then the real kubectl, once, against the same double: `kubectl taint` and
`kubectl cordon` pass the same validation, and it parses the RBAC manifest."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.collector.audit import AuditLog
from ghostgpu.collector.isolation import Isolator, Outcome, unkillable_trigger, xid_trigger
from ghostgpu.collector.kube_api import CLUSTER_ROLE
from ghostgpu.collector.nodes import NodeView
from ghostgpu.collector.remediation_policy import IsolationSettings, RemediationPolicy
from ghostgpu.collector.store import Store

from ghostgpu.common.model.remediation import DONE, FAILED, OPT_OUT_LABEL, PROPOSED, SKIPPED, TAINT_KEY
from ghostgpu.v1 import query_pb2, stream_pb2
from tests.helpers.kube_double import KubeDouble, node_object
from tests.helpers.manifests import DEPLOY

pytest.importorskip("kubernetes", reason="pip install kubernetes (the collector's runtime dependency)")
pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (the dev extra)")

RBAC = DEPLOY / "isolation-rbac.yaml"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(str(tmp_path / "collector.db"), event_log_max=100, retention_days=1)
    yield s
    s.close()


def critical_xid(node: str = "gpu-1", fault_id: int = 5) -> query_pb2.ClusterFault:
    cf = query_pb2.ClusterFault(id=fault_id, node=node, fault=stream_pb2.Fault(
        gpu=0, xid=79, severity="critical", meaning="GPU has fallen off the bus", origin="kernel"))
    cf.hits.add(k8s=query_pb2.K8sIdentity(namespace="ml", pod="train-0"))
    return cf


def json_documents(text: str) -> list[dict[str, Any]]:
    decoder, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        doc, i = decoder.raw_decode(text, i)
        out.extend(doc["items"] if doc.get("kind") == "List" else [doc])
    return out


class Run:
    """An Isolator on a double, a store and an audit file, with the policy as a test sets it."""

    def __init__(self, tmp_path: Path, store: Store, api: KubeDouble, gpu_nodes: int = 10, **policy: Any):
        iso = IsolationSettings(kubeconfig=str(api.write_kubeconfig(tmp_path)),
                                how=policy.pop("how", "taint"))
        self.policy = RemediationPolicy(mode=policy.pop("mode", "on"), isolate_node=True, isolation=iso,
                                        **policy)
        self.audit = AuditLog(str(tmp_path / "audit.jsonl"), store)
        self.store, self.api = store, api
        self.isolator = Isolator(store, lambda: self.policy, audit=self.audit.append,
                                 gpu_nodes=lambda: gpu_nodes)

    def isolate(self, trigger: Any) -> Outcome:
        async def go() -> Outcome:
            try:
                return await self.isolator.isolate(trigger)
            finally:
                self.isolator.close()
        return asyncio.run(go())

    def audit_steps(self) -> list[tuple[str, str]]:
        self.store.barrier().result(10)
        lines = [json.loads(line) for line in Path(self.audit.path or "").read_text().splitlines()]
        return [(r["action"], r["result"]) for r in lines if r["action"].startswith("remediation.")]

    def rows(self, sql: str) -> list[tuple[Any, ...]]:
        return list(self.store.read(lambda conn: conn.execute(sql).fetchall()).result(10))


def test_a_critical_xid_taints_the_node_and_posts_events_on_the_node_and_the_pod(tmp_path, store) -> None:
    with KubeDouble(nodes=[node_object("gpu-1")]) as api:
        run = Run(tmp_path, store, api)
        trigger = xid_trigger(critical_xid())
        assert trigger is not None
        out = run.isolate(trigger)
        assert out.state == DONE, out.reason
        taint = {"key": TAINT_KEY, "value": "xid-79", "effect": "NoSchedule"}
        assert api.node("gpu-1")["spec"]["taints"] == [taint]
        (patch,) = api.patches()
        assert patch.content_type.startswith("application/merge-patch+json")
        assert patch.body["metadata"]["resourceVersion"] == "1"  # the precondition
        node_event, pod_event = api.events
        assert node_event["involvedObject"]["kind"] == "Node"
        assert node_event["metadata"]["namespace"] == "default"
        assert pod_event["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "name": "train-0",
                                               "namespace": "ml"}
        assert "nvidia-smi -r -i 0" in node_event["message"] and node_event["type"] == "Warning"
        assert not api.errors
    assert run.audit_steps() == [("remediation.decided", PROPOSED), ("remediation.re-checked", PROPOSED),
                                 ("remediation.acted", PROPOSED), ("remediation.outcome", DONE)]
    assert run.rows("SELECT node, how, trigger_kind, incident FROM isolated_nodes") == [
        ("gpu-1", "taint", "xid", "x5/isolate_node")]
    assert run.rows("SELECT state, mode FROM remediation_incidents") == [(DONE, "on")]
    assert [r[0] for r in run.rows("SELECT step FROM remediation_steps ORDER BY id")] == [
        "decided", "re-checked", "acted", "outcome"]


def test_cordon_instead_of_a_taint(tmp_path, store) -> None:
    with KubeDouble(nodes=[node_object("gpu-1")]) as api:
        run = Run(tmp_path, store, api, how="cordon")
        out = run.isolate(unkillable_trigger("gpu-1", "pid 7 in D state", "f3/kill_orphan"))
        assert out.state == DONE, out.reason
        node = api.node("gpu-1")
        assert node["spec"] == {"unschedulable": True}
        (patch,) = api.patches()
        assert patch.body == {"spec": {"unschedulable": True}}
        assert patch.content_type.startswith("application/strategic-merge-patch+json")
        assert [e["involvedObject"]["kind"] for e in api.events] == ["Node"]
        assert api.events[0]["message"].endswith("then uncordon it: kubectl uncordon gpu-1")
        assert not api.errors


def test_the_opt_out_label_is_respected(tmp_path, store) -> None:
    with KubeDouble(nodes=[node_object("gpu-1", labels={OPT_OUT_LABEL: "off"})]) as api:
        run = Run(tmp_path, store, api)
        out = run.isolate(xid_trigger(critical_xid()))
        assert (out.state, out.reason) == (SKIPPED, f"node gpu-1 opted out: label {OPT_OUT_LABEL}=off")
        assert api.patches() == [] and api.events == [] and not api.errors
    assert run.audit_steps()[-1] == ("remediation.outcome", SKIPPED)


def test_a_tracer_started_with_remediation_off_opts_its_node_out(tmp_path, store) -> None:
    with KubeDouble(nodes=[node_object("gpu-1")]) as api:
        run = Run(tmp_path, store, api)
        view = NodeView("gpu-1")
        view.hello = stream_pb2.Hello(node="gpu-1", capabilities=["bpf"])  # no "remediation" offered
        run.isolator.nodes = {"gpu-1": view}
        out = run.isolate(xid_trigger(critical_xid()))
        assert out.state == SKIPPED and "--remediation off" in out.reason
        assert api.patches() == [] and api.events == [] and not api.errors


def test_min_healthy_refuses_once_too_many_gpu_nodes_are_isolated(tmp_path, store) -> None:
    with KubeDouble(nodes=[node_object("gpu-1"), node_object("gpu-2")]) as api:
        run = Run(tmp_path, store, api, gpu_nodes=5)  # 10% of 5, rounded down, but at least one
        assert run.isolate(xid_trigger(critical_xid("gpu-1", 1))).state == DONE  # type: ignore[arg-type]
        run.isolator = Isolator(store, lambda: run.policy, audit=run.audit.append, gpu_nodes=lambda: 5)
        out = run.isolate(xid_trigger(critical_xid("gpu-2", 2)))
        assert out.state == SKIPPED
        assert out.reason == ("minHealthy: 1 of 5 GPU nodes are isolated by ghostgpu already; "
                              "max_isolated_nodes_pct 10 allows 1")
        assert len(api.patches()) == 1 and "taints" not in api.node("gpu-2")["spec"]
        assert not api.errors


def test_dry_run_patches_nothing_and_posts_nothing(tmp_path, store) -> None:
    with KubeDouble(nodes=[node_object("gpu-1")]) as api:
        run = Run(tmp_path, store, api, mode="dry-run")
        out = run.isolate(xid_trigger(critical_xid()))
        assert out.state == PROPOSED and out.reason.startswith("dry run (mode dry-run): would taint")
        assert api.patches() == [] and api.events == [] and not api.errors
        assert [r.method for r in api.requests if r.path.startswith("/api/v1/nodes")] == ["GET"]
    assert run.rows("SELECT node FROM isolated_nodes") == []
    assert run.audit_steps()[-1] == ("remediation.outcome", PROPOSED)


def test_the_same_incident_never_isolates_twice(tmp_path, store) -> None:
    with KubeDouble(nodes=[node_object("gpu-1")]) as api:
        run = Run(tmp_path, store, api)
        assert run.isolate(xid_trigger(critical_xid())).state == DONE  # type: ignore[arg-type]
        # a second replica (or this one after a restart) hears the same fault
        run.isolator = Isolator(store, lambda: run.policy, audit=run.audit.append, gpu_nodes=lambda: 10)
        out = run.isolate(xid_trigger(critical_xid()))
        assert out.state == SKIPPED and "recorded already" in out.reason
        assert len(api.patches()) == 1 and not api.errors


def test_a_concurrent_writer_409_is_retried_on_a_fresh_read(tmp_path, store) -> None:
    with KubeDouble(nodes=[node_object("gpu-1")], conflicts=2) as api:
        run = Run(tmp_path, store, api)
        assert run.isolate(xid_trigger(critical_xid())).state == DONE  # type: ignore[arg-type]
        assert [r.status for r in api.patches()] == [409, 409, 200] and not api.errors


def test_rbac_forbidden_fails_with_one_line_naming_the_cluster_role(tmp_path, store) -> None:
    with KubeDouble(nodes=[node_object("gpu-1")], forbid={("patch", "nodes")}) as api:
        run = Run(tmp_path, store, api)
        out = run.isolate(xid_trigger(critical_xid()))
        assert out.state == FAILED and "403 Forbidden" in out.reason and CLUSTER_ROLE in out.reason
        assert "kubectl apply -f deploy/kubernetes/isolation-rbac.yaml" in out.reason
        assert "\n" not in out.reason
    assert run.rows("SELECT node FROM isolated_nodes") == []


def test_mode_off_or_the_action_off_does_nothing_at_all(tmp_path, store) -> None:
    with KubeDouble(nodes=[node_object("gpu-1")]) as api:
        run = Run(tmp_path, store, api, mode="off")
        assert run.isolate(xid_trigger(critical_xid())).state == SKIPPED  # type: ignore[arg-type]
        run.policy = replace(run.policy, mode="on", isolate_node=False)
        assert run.isolate(xid_trigger(critical_xid())).state == SKIPPED  # type: ignore[arg-type]
        assert api.requests == []
    assert run.audit_steps() == []


# ---- the real kubectl, once ----------------------------------------------------------------------

def test_kubectl_taints_cordons_and_parses_the_rbac_through_the_same_validation(tmp_path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (scripts/bootstrap.sh installs Debian's kubernetes-client)")
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    with KubeDouble(nodes=[node_object("gpu-1")]) as api:
        env = {**os.environ, "KUBECONFIG": str(api.write_kubeconfig(tmp_path)), "HOME": str(tmp_path)}

        def kubectl_run(*args: str) -> subprocess.CompletedProcess[str]:
            p = subprocess.run([kubectl, *args], env=env, capture_output=True, text=True, timeout=120)
            assert p.returncode == 0, f"kubectl {' '.join(args)}: {p.stderr.strip()}"
            return p

        kubectl_run("taint", "nodes", "gpu-1", f"{TAINT_KEY}=xid-79:NoSchedule")
        kubectl_run("cordon", "gpu-1")
        node = api.node("gpu-1")
        assert node["spec"]["taints"] == [{"key": TAINT_KEY, "value": "xid-79", "effect": "NoSchedule"}]
        assert node["spec"]["unschedulable"] is True
        assert len(api.patches()) == 2 and not api.errors
        # --validate=false: client-side validation wants the server's OpenAPI documents, which the double
        # does not serve; kubectl still maps every kind through the double's discovery, and what it
        # prints is validated strictly below.
        p = kubectl_run("create", "--dry-run=client", "--validate=false", "-f", str(RBAC), "-o", "json")
    items = json_documents(p.stdout)  # kubectl prints one JSON object per document, one after another
    assert sorted(i["kind"] for i in items) == ["ClusterRole", "ClusterRoleBinding", "ServiceAccount"]
    for item in items:
        kubernetes_validate.validate(item, "1.32.0", strict=True)
    (role,) = [i for i in items if i["kind"] == "ClusterRole"]
    assert sorted((r, v) for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]) == [
        ("events", "create"), ("nodes", "get"), ("nodes", "patch")]
