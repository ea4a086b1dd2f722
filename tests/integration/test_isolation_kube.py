"""Node isolation end to end against the Kubernetes API server's TEST DOUBLE (tests/helpers/kube_double.py:
no API server can run on these machines): the real official client (`kubernetes`) inside the Isolator,
every body it sends validated strictly against the Kubernetes schemas by the double; the real SQLite
store and audit chain. Then the real kubectl, once, against the same double: `kubectl taint` and
`kubectl cordon` pass the same validation, and it parses the RBAC manifest."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.collector.audit import AuditLog
from ghostgpu.collector.isolation import (
    CLAIM_GRACE_S,
    SETTLE_AFTER_S,
    Isolator,
    Outcome,
    unkillable_trigger,
    xid_trigger,
)
from ghostgpu.collector.kube_api import CLUSTER_ROLE, KubeApi, KubeError, NodeLabels
from ghostgpu.collector.nodes import NodeView
from ghostgpu.collector.remediation_policy import IsolationSettings, RemediationPolicy
from ghostgpu.collector.remediation_store import (
    PAUSED,
    IncidentRow,
    IsolatedNode,
    claim_isolated,
    insert_incident,
    select_tally,
    set_control,
)
from ghostgpu.collector.store import Store

from ghostgpu.common.model.remediation import (
    DONE,
    FAILED,
    ISOLATE_NODE,
    OPT_OUT_LABEL,
    PROPOSED,
    SKIPPED,
    TAINT_KEY,
)
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

    def audit_records(self) -> list[dict[str, Any]]:
        self.store.barrier().result(10)
        return [json.loads(line) for line in Path(self.audit.path or "").read_text().splitlines()]

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


# ---- acting safely: the re-read before the PATCH, minHealthy's slot, clearing, settling -------------

def test_a_change_to_dry_run_between_the_get_and_the_patch_leaves_it_proposed(tmp_path, store) -> None:
    with KubeDouble(nodes=[node_object("gpu-1")]) as api:
        run = Run(tmp_path, store, api)
        calls = []

        async def refresh() -> None:  # the engine's fresh_view: the second read is the one before the PATCH
            calls.append(1)
            if len(calls) == 2:
                run.policy = replace(run.policy, mode="dry-run")

        run.isolator.refresh = refresh
        out = run.isolate(xid_trigger(critical_xid()))
        assert (out.state, out.reason) == (PROPOSED, "not acted on: mode dry-run before the act")
        assert api.patches() == [] and api.events == [] and len(calls) == 2
    assert run.rows("SELECT state, acted_unix_ns FROM remediation_incidents") == [(PROPOSED, 0)]
    assert run.rows("SELECT node FROM isolated_nodes") == []


def test_a_pause_stored_while_the_recheck_runs_holds_the_patch_back(tmp_path, store) -> None:
    with KubeDouble(nodes=[node_object("gpu-1")]) as api:
        run = Run(tmp_path, store, api)
        store.read_write(set_control(PAUSED, "maintenance", "alice", 1)).result(10)
        out = run.isolate(xid_trigger(critical_xid()))
        assert out.state == PROPOSED and "paused by alice (maintenance) at the moment of acting" in out.reason
        assert api.patches() == [] and api.events == []
    assert run.rows("SELECT node FROM isolated_nodes") == []  # the claimed slot was given back


def test_two_isolators_racing_for_the_last_min_healthy_slot_isolate_one_node(tmp_path, store) -> None:
    with KubeDouble(nodes=[node_object("gpu-1"), node_object("gpu-2")]) as api:
        run = Run(tmp_path, store, api, gpu_nodes=5)  # cap: 1
        other = Isolator(store, lambda: run.policy, audit=run.audit.append, gpu_nodes=lambda: 5)

        async def both() -> list[Outcome]:
            try:
                return list(await asyncio.gather(run.isolator.isolate(xid_trigger(critical_xid("gpu-1", 1))),
                                                 other.isolate(xid_trigger(critical_xid("gpu-2", 2)))))
            finally:
                run.isolator.close()
                other.close()

        outs = asyncio.run(both())  # type: ignore[arg-type]
        assert sorted(o.state for o in outs) == [DONE, SKIPPED]
        (skipped,) = [o for o in outs if o.state == SKIPPED]
        assert skipped.reason.startswith("minHealthy: 1 of 5 GPU nodes are isolated by ghostgpu already")
        assert len([p for p in api.patches() if p.status == 200]) == 1
    assert len(run.rows("SELECT node FROM isolated_nodes")) == 1


def test_min_healthy_counts_the_gpu_nodes_other_replicas_stored(tmp_path, store) -> None:
    status = query_pb2.TracerStatus(node="gpu-9", info=stream_pb2.NodeInfo(gpus=[stream_pb2.Gpu(index=0)]))
    store.read_write(lambda conn: conn.execute(
        "INSERT INTO node_state (node, owner, token, updated_unix_ns, consumers, status) VALUES "
        "(?, ?, ?, ?, ?, ?)", ("gpu-9", "replica-b", 1, 1, b"", status.SerializeToString()))).result(10)
    with KubeDouble(nodes=[node_object("gpu-1")]) as api:
        run = Run(tmp_path, store, api)
        run.isolator = Isolator(store, lambda: run.policy, audit=run.audit.append)  # the default count
        run.isolator.nodes = {"gpu-1": gpu_view("gpu-1")}
        assert asyncio.run(_gpu_nodes(run.isolator)) == 2  # its own node and the one replica-b stored


async def _gpu_nodes(isolator: Isolator) -> int:
    return await isolator._gpu_nodes()


def gpu_view(node: str) -> NodeView:
    v = NodeView(node)
    v.info = stream_pb2.NodeInfo(gpus=[stream_pb2.Gpu(index=0)])
    return v


def test_a_node_a_human_untainted_loses_its_row_audited(tmp_path, store) -> None:
    long_ago_ns = time.time_ns() - int((CLAIM_GRACE_S + 60) * 1e9)
    store.read_write(claim_isolated(IsolatedNode("gpu-2", "taint", "xid", "Xid 79", long_ago_ns,
                                                 "x1/isolate_node"), 10)).result(10)
    with KubeDouble(nodes=[node_object("gpu-1"), node_object("gpu-2")]) as api:  # gpu-2: untainted
        run = Run(tmp_path, store, api, gpu_nodes=5)  # cap 1: the stale row would refuse gpu-1
        out = run.isolate(xid_trigger(critical_xid("gpu-1", 2)))
        assert out.state == DONE, out.reason
    assert run.rows("SELECT node FROM isolated_nodes") == [("gpu-1",)]
    cleared = [r for r in run.audit_records() if r["detail"].get("incident") == "x1/isolate_node"]
    assert [(r["action"], r["result"]) for r in cleared] == [("remediation.outcome", DONE)]
    assert cleared[0]["detail"]["reason"].startswith("cleared by a human: node gpu-2 untainted")


def test_an_isolation_whose_replica_died_after_the_act_is_settled_from_the_node(tmp_path, store) -> None:
    acted_ns = time.time_ns() - int((SETTLE_AFTER_S + 60) * 1e9)
    for node in ("gpu-1", "gpu-2"):
        incident = f"x-{node}/isolate_node"
        store.read_write(insert_incident(IncidentRow(
            incident, 0, node, "", ISOLATE_NODE, PROPOSED, "on", "Xid 79", acted_ns, acted_ns, acted_ns,
            "replica-dead", 0, json.dumps({"trigger": "xid", "how": "taint"})))).result(10)
        store.read_write(claim_isolated(IsolatedNode(node, "taint", "xid", "Xid 79", acted_ns, incident),
                                        10)).result(10)
    taint = {"key": TAINT_KEY, "value": "xid-79", "effect": "NoSchedule"}
    with KubeDouble(nodes=[node_object("gpu-1", taints=[taint]), node_object("gpu-2")]) as api:
        run = Run(tmp_path, store, api)
        tickets: list[dict[str, Any]] = []
        run.isolator.ticket = tickets.append

        async def settle() -> int:
            try:
                return await run.isolator.settle()
            finally:
                run.isolator.close()

        assert asyncio.run(settle()) == 2  # type: ignore[arg-type]
        assert api.patches() == []
    assert sorted(run.rows("SELECT node, state FROM remediation_incidents")) == [("gpu-1", DONE),
                                                                                ("gpu-2", FAILED)]
    assert run.rows("SELECT node FROM isolated_nodes") == [("gpu-1",)]  # the failed one's slot given back
    assert sorted(t["incident"] for t in tickets) == ["x-gpu-1/isolate_node", "x-gpu-2/isolate_node"]


def test_the_kill_engines_unsettled_query_leaves_isolations_alone(tmp_path, store) -> None:
    acted_ns = time.time_ns()
    store.read_write(insert_incident(IncidentRow(
        "x1/isolate_node", 0, "gpu-1", "", ISOLATE_NODE, PROPOSED, "on", "Xid", acted_ns, acted_ns, acted_ns,
        "r", 0, "{}"))).result(10)
    assert store.read(select_tally(0, [])).result(10).unsettled == []


def test_each_isolation_acted_on_files_a_ticket_with_its_steps(tmp_path, store) -> None:
    with KubeDouble(nodes=[node_object("gpu-1")]) as api:
        run = Run(tmp_path, store, api)
        tickets: list[dict[str, Any]] = []
        run.isolator.ticket = tickets.append
        assert run.isolate(xid_trigger(critical_xid())).state == DONE  # type: ignore[arg-type]
    (doc,) = tickets
    assert doc["incident"] == "x5/isolate_node" and doc["node"] == "gpu-1" and doc["mode"] == "on"
    assert doc["pods"] == [{"namespace": "ml", "pod": "train-0"}]
    assert [(a["action"], a["state"], a["reason"].split(":")[0]) for a in doc["actions"]] == [
        (ISOLATE_NODE, PROPOSED, "decided"), (ISOLATE_NODE, PROPOSED, "re-checked"),
        (ISOLATE_NODE, PROPOSED, "acted"), (ISOLATE_NODE, DONE, "outcome")]
    assert doc["evidence"]["trigger"] == "xid" and doc["evidence"]["outcome"] == DONE
    assert doc["audit_seq"] == max(r["seq"] for r in run.audit_records())


def test_any_error_after_the_act_ends_the_incident_failed(tmp_path, store, monkeypatch) -> None:
    def broken(*args: Any) -> bool:
        raise RuntimeError("the client broke")

    monkeypatch.setattr(KubeApi, "taint", broken)
    with KubeDouble(nodes=[node_object("gpu-1")]) as api:
        run = Run(tmp_path, store, api)
        out = run.isolate(xid_trigger(critical_xid()))
        assert (out.state, out.reason) == (FAILED, "RuntimeError: the client broke")
    assert run.audit_steps()[-2:] == [("remediation.acted", PROPOSED), ("remediation.outcome", FAILED)]
    assert run.rows("SELECT state FROM remediation_incidents") == [(FAILED,)]
    assert run.rows("SELECT node FROM isolated_nodes") == []


def test_a_spawned_task_that_raises_is_logged(tmp_path, store, caplog) -> None:
    isolator = Isolator(store, RemediationPolicy)

    async def boom() -> None:
        raise RuntimeError("lost no more")

    async def go() -> None:
        isolator._spawn(boom())
        await isolator.idle()
        isolator.close()

    with caplog.at_level(logging.ERROR, logger="ghostgpu.collector.isolation"):
        asyncio.run(go())
    assert any("lost no more" in r.getMessage() for r in caplog.records)


class HeldWrites:
    """The store, with every submit() held back until the next read, read_write or barrier: writes queued
    on the store's writer thread commit whenever it gets to them, so a test that needs one committed
    before the next step sees it only if the code waited for it."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._held: list[tuple[Any, Any, Any]] = []

    def submit(self, ops: Any, *args: Any, **kwargs: Any) -> None:
        self._held.append((ops, args, kwargs))

    def _flush(self) -> None:
        held, self._held = self._held, []
        for ops, args, kwargs in held:
            self._store.submit(ops, *args, **kwargs)

    def read(self, fn: Any) -> Any:
        self._flush()
        return self._store.read(fn)

    def read_write(self, fn: Any) -> Any:
        self._flush()
        return self._store.read_write(fn)

    def barrier(self) -> Any:
        self._flush()
        return self._store.barrier()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_the_acted_record_is_committed_before_the_patch_goes_out(tmp_path, store, monkeypatch) -> None:
    seen_at_patch: list[list[tuple[str, str]]] = []
    taint = KubeApi.taint

    def taint_after_looking(api: KubeApi, *args: Any) -> bool:
        # committed rows only: a connection of its own to the database file
        with contextlib.closing(sqlite3.connect(str(tmp_path / "collector.db"))) as conn:
            seen_at_patch.append(conn.execute("SELECT step, state FROM remediation_steps ORDER BY id")
                                 .fetchall())
        return taint(api, *args)

    monkeypatch.setattr(KubeApi, "taint", taint_after_looking)
    with KubeDouble(nodes=[node_object("gpu-1")]) as api:
        run = Run(tmp_path, store, api)
        run.isolator.store = HeldWrites(store)  # type: ignore[assignment]
        assert run.isolate(xid_trigger(critical_xid())).state == DONE  # type: ignore[arg-type]
    (steps,) = seen_at_patch
    assert steps[-1] == ("acted", PROPOSED), steps


def test_node_labels_unreadable_or_opted_out_right_before_the_patch_hold_it_back(tmp_path, store) -> None:
    with KubeDouble(nodes=[node_object("gpu-1")]) as api:
        kubeconfig = str(api.write_kubeconfig(tmp_path))
        run = Run(tmp_path, store, api)
        calls: list[int] = []

        async def refresh() -> None:  # the second read is the one before the PATCH: label the node then
            calls.append(1)
            if len(calls) == 2:
                api.nodes["gpu-1"]["metadata"].setdefault("labels", {})[OPT_OUT_LABEL] = "off"

        run.isolator.refresh = refresh
        run.isolator.labels = NodeLabels(lambda: KubeApi(kubeconfig))
        try:
            out = run.isolate(xid_trigger(critical_xid()))
        finally:
            run.isolator.labels.close()
        assert (out.state, out.reason) == (
            PROPOSED, f"not acted on: node gpu-1 opted out: label {OPT_OUT_LABEL}=off")
        assert api.patches() == [] and api.events == []

    def unreachable() -> KubeApi:
        raise KubeError("kubernetes https://10.0.0.1: get node gpu-2: no answer (timeout)")

    second = tmp_path / "second"
    second.mkdir()
    with KubeDouble(nodes=[node_object("gpu-2")]) as api:
        run = Run(second, store, api)
        run.isolator.labels = NodeLabels(unreachable)
        try:
            out = run.isolate(xid_trigger(critical_xid("gpu-2", 6)))
        finally:
            run.isolator.labels.close()
        assert (out.state, out.reason) == (PROPOSED, "not acted on: node labels could not be read: "
                                           "kubernetes https://10.0.0.1: get node gpu-2: no answer (timeout)")
        assert api.patches() == [] and api.events == []
    assert run.rows("SELECT node FROM isolated_nodes") == []


def test_two_replicas_settling_one_isolation_record_one_outcome_and_one_ticket(tmp_path, store) -> None:
    acted_ns = time.time_ns() - int((SETTLE_AFTER_S + 60) * 1e9)
    incident = "x-gpu-1/isolate_node"
    store.read_write(insert_incident(IncidentRow(
        incident, 0, "gpu-1", "", ISOLATE_NODE, PROPOSED, "on", "Xid 79", acted_ns, acted_ns, acted_ns,
        "replica-dead", 0, json.dumps({"trigger": "xid", "how": "taint"})))).result(10)
    taint = {"key": TAINT_KEY, "value": "xid-79", "effect": "NoSchedule"}
    with KubeDouble(nodes=[node_object("gpu-1", taints=[taint])]) as api:
        run = Run(tmp_path, store, api)
        other = Isolator(store, lambda: run.policy, audit=run.audit.append, gpu_nodes=lambda: 10)
        tickets: list[dict[str, Any]] = []
        run.isolator.ticket = other.ticket = tickets.append

        async def both() -> list[int]:
            try:
                return list(await asyncio.gather(run.isolator.settle(), other.settle()))
            finally:
                run.isolator.close()
                other.close()

        assert sorted(asyncio.run(both())) == [0, 1]  # type: ignore[arg-type]
    assert [t["incident"] for t in tickets] == [incident]
    assert run.audit_steps() == [("remediation.outcome", DONE)]
    assert run.rows("SELECT state FROM remediation_incidents") == [(DONE,)]


def test_a_failure_to_record_the_act_gives_the_min_healthy_slot_back(tmp_path, store, monkeypatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr("ghostgpu.collector.isolation.mark_acted", broken)
    with KubeDouble(nodes=[node_object("gpu-1")]) as api:
        run = Run(tmp_path, store, api)
        out = run.isolate(xid_trigger(critical_xid()))
        assert out.state == PROPOSED and "the act could not be recorded" in out.reason, out.reason
        assert api.patches() == [] and api.events == []
    assert run.rows("SELECT node FROM isolated_nodes") == []
    assert run.rows("SELECT state, acted_unix_ns FROM remediation_incidents") == [(PROPOSED, 0)]


# ---- the node-label source both engines read ------------------------------------------------------

def test_node_labels_are_read_once_per_ttl_and_refreshed_after(tmp_path) -> None:
    now = [0.0]
    with KubeDouble(nodes=[node_object("gpu-1", labels={OPT_OUT_LABEL: "off"})]) as api:
        kubeconfig = str(api.write_kubeconfig(tmp_path))
        labels = NodeLabels(lambda: KubeApi(kubeconfig), ttl_s=30, clock=lambda: now[0])

        async def read() -> Any:
            return await labels.labels("gpu-1")

        try:
            assert asyncio.run(read())[OPT_OUT_LABEL] == "off"
            assert asyncio.run(read())[OPT_OUT_LABEL] == "off"
            assert len([r for r in api.requests if r.path.startswith("/api/v1/nodes")]) == 1  # cached
            api.nodes["gpu-1"]["metadata"]["labels"].pop(OPT_OUT_LABEL)
            now[0] = 31.0
            assert OPT_OUT_LABEL not in asyncio.run(read())
        finally:
            labels.close()


def test_node_labels_are_none_unconfigured_or_unreachable_and_logged_once(tmp_path, caplog) -> None:
    def unconfigured() -> KubeApi:
        raise KubeError("kubernetes: cannot load the in-cluster service account")

    with KubeDouble() as api:
        kubeconfig = str(api.write_kubeconfig(tmp_path))
    # the double is gone: nothing answers at its address
    now = [0.0]
    def unreachable() -> KubeApi:
        return KubeApi(kubeconfig, timeout_s=2)

    for factory, kind in ((unconfigured, "in-cluster"), (unreachable, "no answer")):
        labels = NodeLabels(factory, ttl_s=30, clock=lambda: now[0])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ghostgpu.collector.kube_api"):
            try:
                for i in range(3):
                    now[0] = i * 31.0  # past the TTL each time: read again, logged once
                    assert asyncio.run(labels.labels("gpu-1")) is None  # type: ignore[arg-type]
            finally:
                labels.close()
        assert len([r for r in caplog.records if kind in r.getMessage()]) == 1, kind


def test_node_labels_now_reads_afresh_and_says_why_it_could_not(tmp_path, monkeypatch) -> None:
    with KubeDouble(nodes=[node_object("gpu-1")]) as api:
        kubeconfig = str(api.write_kubeconfig(tmp_path))
        labels = NodeLabels(lambda: KubeApi(kubeconfig), ttl_s=30, clock=lambda: 0.0)

        async def read() -> tuple[Any, Any, Any]:
            cached = await labels.labels("gpu-1")
            api.nodes["gpu-1"]["metadata"].setdefault("labels", {})[OPT_OUT_LABEL] = "off"
            return cached, await labels.labels_now("gpu-1"), await labels.labels("gpu-1")

        try:
            cached, now, after = asyncio.run(read())
        finally:
            labels.close()
        assert OPT_OUT_LABEL not in cached  # read before the label went on
        assert now == ({**cached, OPT_OUT_LABEL: "off"}, "")  # within the TTL, read again all the same
        assert after[OPT_OUT_LABEL] == "off"  # and the cache took it
    # the double is gone: a configured API that does not answer says why
    unreachable = NodeLabels(lambda: KubeApi(kubeconfig, timeout_s=2))
    # outside a cluster with no kubeconfig: no API configured, nothing to say
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    unconfigured = NodeLabels(lambda: KubeApi(""))
    try:
        got, why = asyncio.run(unreachable.labels_now("gpu-1"))  # type: ignore[arg-type]
        assert got is None and why.startswith(f"kubernetes {api.url}: get node gpu-1: no answer"), why
        assert asyncio.run(unconfigured.labels_now("gpu-1")) == (None, "")  # type: ignore[arg-type]
    finally:
        unreachable.close()
        unconfigured.close()


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
