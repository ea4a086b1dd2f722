"""Remediation's actions 2 and 3 through the whole collector: a real Collector (its YAML config's
`remediation:` section: mode on, isolate_node on, a ticket URL with a headers file), sim tracers that
offer "remediation" and answer its RemediateCommands, the Kubernetes API server's TEST DOUBLE
(tests/helpers/kube_double.py, every body validated against the Kubernetes schemas) reached by the
official client through the config's kubeconfig, and a real HTTP receiver for the tickets
(tests/integration/test_tickets_http.py's, on a thread). No root needed.

- An orphan whose kill ends `unkillable` (state D, wchan, stack): its node is tainted, a Warning Event
  saying what a human should do next lands on the Node and on the Pod, and the webhook gets the
  incident's ticket with the headers from the file.
- A critical Xid taints its node; a warning or info one does not.
- minHealthy: once ghostgpu holds as many GPU nodes isolated as max_isolated_nodes_pct allows, the next
  trigger is skipped with that reason, and the double sees no PATCH for its node.
- Every step is in the audit chain, and `ghostgpu audit --verify` passes.

Every wait polls with a deadline.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.collector.main import Collector

from ghostgpu.common.model.consumers import ConsumerClass
from ghostgpu.common.model.remediation import TAINT_KEY
from ghostgpu.v1 import stream_pb2
from tests.helpers.collector_env import running_collector
from tests.helpers.collector_proc import ghostgpu_cli
from tests.helpers.fault_events import TRAIN, Names, fault_event, fault_record, hit
from tests.helpers.polling import wait_until
from tests.helpers.sim_tracer import SimTracer, make_consumer
from tests.integration.test_tickets_http import Receiver, serving

pytest.importorskip("kubernetes", reason="pip install kubernetes (the collector's runtime dependency)")
pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (the dev extra)")

from tests.helpers.kube_double import KubeDouble, node_object  # needs kubernetes_validate

DEADLINE_S = 30.0  # the first isolation imports the kubernetes client; a shared 2-core VM
CAPABILITIES = ("cri-relay", "remediation")
STACK = "[<0>] nv_wait_for_channel+0x5c/0x120 [nvidia]\n[<0>] nvidia_ioctl+0x2f1/0x8a0 [nvidia]"


def config_yaml(api: KubeDouble, tmp_path: Path, ticket_url: str = "", headers_file: str = "",
                max_isolated_nodes_pct: int = 100) -> Path:
    path = tmp_path / "collector.yaml"
    path.write_text(f"""\
remediation:
  mode: "on"
  min_age: 0s
  grace: 1s
  namespaces: {{include: ["*"], exclude: ["kube-system"]}}
  actions:
    kill_orphans: true
    isolate_node: true
    ticket: {{url: "{ticket_url}", headers_file: "{headers_file}"}}
  breaker: {{max_actions: 10, window: 1h, max_per_node: 3, max_isolated_nodes_pct: {max_isolated_nodes_pct}}}
  isolation: {{how: taint, kubeconfig: "{api.write_kubeconfig(tmp_path)}"}}
""")
    return path


def node_info() -> stream_pb2.NodeInfo:
    """One GPU: the node counts as a GPU node for minHealthy."""
    return stream_pb2.NodeInfo(bpf=True, nvml=True, gpus=[
        stream_pb2.Gpu(index=0, uuid="GPU-00000000-0000-4000-8000-000000000000", minor=0),
        stream_pb2.Gpu(index=1, uuid="GPU-00000001-0000-4000-8000-000000000000", minor=1)])


def unkillable(cmd: stream_pb2.RemediateCommand) -> stream_pb2.RemediateResult:
    """The tracer's answers for a holder stuck in the driver: the re-check passes, no signal ends it."""
    if cmd.dry_run:
        return stream_pb2.RemediateResult(incident=cmd.incident, outcome="proposed",
                                          reason="every check passed")
    return stream_pb2.RemediateResult(
        incident=cmd.incident, outcome="unkillable",
        reason="alive 1 s after SIGKILL, in state D (in the driver)",
        signals=["SIGTERM", "SIGKILL"], released=False, proc_state="D", wchan="nv_wait_for_channel",
        stack=STACK, elapsed_ms=1200)


def audit_records(collector: str) -> list[dict[str, Any]]:
    out = ghostgpu_cli("audit", "--collector", collector, "-o", "json", "--since", "1h")
    assert out.returncode == 0, out.stderr
    rows: list[dict[str, Any]] = json.loads(out.stdout)
    return rows


def remediation_steps(collector: str) -> list[tuple[str, str, dict[str, Any]]]:
    return [(r["action"], r["result"], r.get("detail", {})) for r in audit_records(collector)
            if r["action"].startswith("remediation.")]


def assert_the_chain_verifies(collector: str) -> None:
    verify = ghostgpu_cli("audit", "--collector", collector, "--verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr


def taints(api: KubeDouble, node: str) -> list[dict[str, str]]:
    found: list[dict[str, str]] = api.node(node)["spec"].get("taints", [])
    return found


def patched_nodes(api: KubeDouble) -> list[str]:
    return [r.path.rsplit("/", 1)[-1] for r in api.patches()]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with serving(Receiver([201])) as rec:
        yield rec


def sim_tracers(stack: ExitStack, address: str, *nodes: str) -> list[SimTracer]:
    out = []
    for node in nodes:
        t = stack.enter_context(SimTracer(address, node, capabilities=CAPABILITIES))
        t.connect()
        t.send_snapshot([], info=node_info())
        out.append(t)
    return out


def gpu_nodes_known(c: Collector, count: int) -> bool:
    return sum(1 for v in c.nodes.values() if v.info is not None and len(v.info.gpus) > 0) >= count


def test_an_unkillable_orphan_taints_its_node_posts_events_and_files_a_ticket(
        tmp_path: Path, receiver: Receiver) -> None:
    node = "gpu-node-stuck"
    headers = tmp_path / "ticket-headers"
    headers.write_text("# the ticket system's token\nAuthorization: Bearer t0ken\nX-Queue: gpu-ops\n")
    with KubeDouble(nodes=[node_object(node)]) as api:
        config = config_yaml(api, tmp_path, receiver.url, str(headers))
        with running_collector(tmp_path, config_path=str(config), resolver_factory=Names) as c, \
                SimTracer(c.address, node, capabilities=CAPABILITIES) as t:
            t.remediate_answer = unkillable
            t.connect()
            # A holder in the pod ml/train-7 whose container is gone: orphaned, its pod known.
            t.send_snapshot([make_consumer(node, 4242, cls=ConsumerClass.ORPHANED, container_id=TRAIN)],
                            info=node_info())

            wait_until(lambda: len(api.events) >= 2, "the isolation's Events on the Node and the Pod",
                       DEADLINE_S)
            # two incidents, two tickets: the kill's and the isolation's
            wait_until(lambda: len(receiver.got) >= 2, "the kill's and the isolation's tickets", DEADLINE_S)

            # the kill: a dry-run re-check, then the act, both for pid 4242
            assert [(cmd.dry_run, cmd.process.pid) for cmd in t.remediate_commands] == [
                (True, 4242), (False, 4242)]
            rows = json.loads(ghostgpu_cli("findings", "--collector", c.address, "-o", "json",
                                           "--node", node).stdout)
            (row,) = [r for r in rows if r["pid"] == 4242]
            # The finding shows its kill's end, unkillable, and names the isolation that followed it
            # (collector/remediation_store.py select_states); both are in the chain below.
            shown = row["remediation"]
            assert (shown["action"], shown["state"]) == ("kill_orphan", "unkillable"), shown
            assert "then node isolation: done" in shown["reason"], shown

            # the taint, its PATCH validated by the double
            assert taints(api, node) == [{"key": TAINT_KEY, "value": "unkillable", "effect": "NoSchedule"}]
            assert patched_nodes(api) == [node]
            node_event, pod_event = api.events
            assert node_event["type"] == pod_event["type"] == "Warning"
            assert node_event["involvedObject"]["kind"] == "Node"
            assert node_event["involvedObject"]["name"] == node
            assert pod_event["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "name": "train-7",
                                                   "namespace": "ml"}
            message = node_event["message"]
            assert "stuck in the driver" in message
            assert "drain the node, then reboot it" in message  # what a human does next
            assert f"kubectl taint nodes {node} {TAINT_KEY}:NoSchedule-" in message  # and how to undo it
            assert not api.errors

            # the ticket: the finding, the node, the pod, the tracer's report, what was done, the audit seq
            by_incident = {str(g.body["incident"]): g for g in receiver.got}
            assert sorted(by_incident) == [f"f{row['id']}/isolate_node", f"f{row['id']}/kill_orphan"], (
                sorted(by_incident))
            got = by_incident[f"f{row['id']}/kill_orphan"]
            assert got.headers["authorization"] == "Bearer t0ken"
            assert got.headers["x-queue"] == "gpu-ops"
            assert got.headers["content-type"] == "application/json"
            doc = got.body
            assert doc["incident"] == f"f{row['id']}/kill_orphan"
            assert doc["node"] == node and doc["mode"] == "on"
            finding = doc["finding"]
            assert isinstance(finding, dict)
            assert (finding["id"], finding["class"], finding["pid"]) == (row["id"], "orphaned", 4242)
            assert doc["pods"] == [{"namespace": "ml", "pod": "train-7", "container": "trainer"}]
            evidence = doc["evidence"]
            assert isinstance(evidence, dict)
            assert (evidence["outcome"], evidence["proc_state"], evidence["wchan"], evidence["stack"]) == (
                "unkillable", "D", "nv_wait_for_channel", STACK)
            assert evidence["signals"] == ["SIGTERM", "SIGKILL"] and evidence["released"] is False
            actions = doc["actions"]  # what was done: the kill's steps, the last its end
            assert isinstance(actions, list) and actions, doc
            kills = [a for a in actions if a["action"] == "kill_orphan"]
            assert (kills[-1]["state"], kills[-1]["reason"]) == (
                "unkillable", "alive 1 s after SIGKILL, in state D (in the driver)"), actions
            assert isinstance(doc["audit_seq"], int) and doc["audit_seq"] > 0
            # the isolation's ticket: its trigger, the taint done, its own steps
            iso_doc = by_incident[f"f{row['id']}/isolate_node"].body
            assert iso_doc["node"] == node and iso_doc["mode"] == "on"
            assert iso_doc["pods"] == [{"namespace": "ml", "pod": "train-7"}], iso_doc["pods"]
            iso_evidence = iso_doc["evidence"]
            assert isinstance(iso_evidence, dict)
            assert (iso_evidence["trigger"], iso_evidence["outcome"]) == ("unkillable", "done"), iso_evidence
            iso_actions = iso_doc["actions"]
            assert isinstance(iso_actions, list)
            iso_states = [a["state"] for a in iso_actions if a["action"] == "isolate_node"]
            assert iso_states[-1] == "done", iso_actions

            # every step in the chain: the kill's and the isolation's
            steps = remediation_steps(c.address)
            kill = [(a, res) for a, res, d in steps if d.get("incident") == doc["incident"]]
            assert kill == [("remediation.decided", "proposed"), ("remediation.re-checked", "proposed"),
                            ("remediation.acted", "proposed"), ("remediation.outcome", "unkillable")], kill
            (ended,) = [d for _, res, d in steps
                        if d.get("incident") == doc["incident"] and res == "unkillable"]
            assert "state D" in ended["reason"], ended
            iso = [(a, res) for a, res, d in steps if d.get("remediation") == "isolate_node"]
            assert iso == [("remediation.decided", "proposed"), ("remediation.re-checked", "proposed"),
                           ("remediation.acted", "proposed"), ("remediation.outcome", "done")], iso
            seqs = {r["seq"]: r for r in audit_records(c.address)}
            assert seqs[doc["audit_seq"]]["action"].startswith("remediation.")
            assert_the_chain_verifies(c.address)


def test_a_critical_xid_taints_its_node_and_a_warning_or_info_one_does_not(tmp_path: Path) -> None:
    with KubeDouble(nodes=[node_object("gpu-node-x"), node_object("gpu-node-w")]) as api:
        config = config_yaml(api, tmp_path)
        with running_collector(tmp_path, config_path=str(config), resolver_factory=Names) as c, \
                ExitStack() as stack:
            xid_node, warn_node = sim_tracers(stack, c.address, "gpu-node-x", "gpu-node-w")
            wait_until(lambda: gpu_nodes_known(c, 2), "both GPU nodes known", DEADLINE_S)
            # Warning and info faults first, on both nodes, each a kernel log record of its own.
            quiet = [fault_record(node=n, xid=xid, gpu=0, severity=sev, meaning=meaning,
                                  affected=(hit(4242),))
                     for n in ("gpu-node-x", "gpu-node-w")
                     for xid, sev, meaning in ((13, "warning", "Graphics engine exception"),
                                               (63, "info", "ECC page retirement"))]
            for t in (xid_node, warn_node):
                mine = [r for r in quiet if r.node == t.node]
                t.wait_acked(t.send_events([fault_event(t.next_seq + i, r) for i, r in enumerate(mine)]))
            # Then a critical one on gpu-node-x only; the stream is in order, so the quiet ones were seen.
            critical = fault_record(node="gpu-node-x", xid=79, gpu=0, affected=(hit(4242, TRAIN),))
            xid_node.wait_acked(xid_node.send_events([fault_event(xid_node.next_seq, critical)]))
            wait_until(lambda: bool(taints(api, "gpu-node-x")), "the critical Xid's taint", DEADLINE_S)
            wait_until(lambda: len(api.events) >= 2, "the Events on the Node and the Pod", DEADLINE_S)

            assert taints(api, "gpu-node-x") == [
                {"key": TAINT_KEY, "value": "xid-79", "effect": "NoSchedule"}]
            assert patched_nodes(api) == ["gpu-node-x"]  # the warning and info faults isolated nothing
            assert "taints" not in api.node("gpu-node-w")["spec"]
            node_event, pod_event = api.events
            assert node_event["involvedObject"]["name"] == "gpu-node-x"
            assert pod_event["involvedObject"]["name"] == "train-7"
            assert "Xid 79" in node_event["message"] and "nvidia-smi -r -i 0" in node_event["message"]
            assert not api.errors
            iso = [(a, res, d["trigger"]) for a, res, d in remediation_steps(c.address)
                   if d.get("remediation") == "isolate_node"]
            assert iso == [("remediation.decided", "proposed", "xid"),
                           ("remediation.re-checked", "proposed", "xid"),
                           ("remediation.acted", "proposed", "xid"), ("remediation.outcome", "done", "xid")]
            assert_the_chain_verifies(c.address)


def test_min_healthy_refuses_a_second_isolation_and_patches_nothing_for_it(tmp_path: Path) -> None:
    nodes = ("gpu-node-a", "gpu-node-b", "gpu-node-c")
    with KubeDouble(nodes=[node_object(n) for n in nodes]) as api:
        # 10% of 3 GPU nodes rounds down to 0, and at least one may be isolated: one, never two.
        config = config_yaml(api, tmp_path, max_isolated_nodes_pct=10)
        with running_collector(tmp_path, config_path=str(config), resolver_factory=Names) as c, \
                ExitStack() as stack:
            a, b, _ = sim_tracers(stack, c.address, *nodes)
            wait_until(lambda: gpu_nodes_known(c, 3), "three GPU nodes known", DEADLINE_S)
            a.wait_acked(a.send_events([fault_event(a.next_seq, fault_record(node="gpu-node-a", gpu=0))]))
            wait_until(lambda: bool(taints(api, "gpu-node-a")), "the first node tainted", DEADLINE_S)
            b.wait_acked(b.send_events([fault_event(b.next_seq, fault_record(node="gpu-node-b", gpu=0))]))

            def refused() -> list[dict[str, Any]]:
                return [d for act, res, d in remediation_steps(c.address)
                        if act == "remediation.outcome" and res == "skipped"
                        and d.get("node") == "gpu-node-b"]

            wait_until(lambda: bool(refused()), "the second isolation skipped", DEADLINE_S)
            (detail,) = refused()
            assert detail["reason"] == ("minHealthy: 1 of 3 GPU nodes are isolated by ghostgpu already; "
                                        "max_isolated_nodes_pct 10 allows 1")
            assert patched_nodes(api) == ["gpu-node-a"]  # no PATCH for gpu-node-b
            assert "taints" not in api.node("gpu-node-b")["spec"]
            on_nodes = [e["involvedObject"]["name"] for e in api.events
                        if e["involvedObject"]["kind"] == "Node"]
            assert on_nodes == ["gpu-node-a"]
            assert not api.errors
            assert_the_chain_verifies(c.address)


def test_min_healthy_holds_for_two_critical_xids_on_two_nodes_at_once(tmp_path: Path) -> None:
    """Both triggers in flight together (a driver fault across the fleet): one node is isolated, the
    other refused, though neither isolation had committed when the other was checked."""
    nodes = ("gpu-node-a", "gpu-node-b", "gpu-node-c")
    with KubeDouble(nodes=[node_object(n) for n in nodes]) as api:
        config = config_yaml(api, tmp_path, max_isolated_nodes_pct=10)
        with running_collector(tmp_path, config_path=str(config), resolver_factory=Names) as c, \
                ExitStack() as stack:
            a, b, _ = sim_tracers(stack, c.address, *nodes)
            wait_until(lambda: gpu_nodes_known(c, 3), "three GPU nodes known", DEADLINE_S)
            sent = [(t, t.send_events([fault_event(t.next_seq, fault_record(node=t.node, gpu=0))]))
                    for t in (a, b)]
            for t, seq in sent:
                t.wait_acked(seq)

            def outcomes() -> dict[str, tuple[str, str]]:
                return {d["node"]: (res, d["reason"]) for act, res, d in remediation_steps(c.address)
                        if act == "remediation.outcome" and d.get("remediation") == "isolate_node"}

            wait_until(lambda: len(outcomes()) == 2, "both isolations ended", DEADLINE_S)
            ended = outcomes()
            assert sorted(res for res, _ in ended.values()) == ["done", "skipped"], ended
            (refused,) = [n for n, (res, _) in ended.items() if res == "skipped"]
            assert ended[refused][1].startswith("minHealthy: 1 of 3 GPU nodes are isolated"), ended
            assert patched_nodes(api) == [n for n in ("gpu-node-a", "gpu-node-b") if n != refused]
            assert "taints" not in api.node(refused)["spec"]
            assert not api.errors
