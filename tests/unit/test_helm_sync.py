"""The chart is the one source of the plain manifests: scripts/render_manifests.py --check finds
deploy/kubernetes/ghostgpu.yaml, replicated/ghostgpu.yaml and isolation-rbac.yaml exactly as the chart
renders them, and the chart's files/ copies of the alerting rules and the dashboard equal the originals.
Also what only the chart renders and no generated file shows: remediation's config file, loaded by the
collector's own parser, with the tracer's CAP_KILL and the collector's ServiceAccount beside it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ghostgpu.cli import main as cli
from ghostgpu.collector.remediation_config import load_remediation

from tests.helpers.helm import CI, REPO, helm, render
from tests.helpers.manifests import flag

SCRIPT = REPO / "scripts" / "render_manifests.py"
COPIES = {
    REPO / "deploy" / "prometheus" / "ghostgpu-rules.yaml": "ghostgpu-rules.yaml",
    REPO / "deploy" / "grafana" / "ghostgpu-dashboard.json": "ghostgpu-dashboard.json",
}
RENDER_TIMEOUT_S = 300


def test_the_generated_manifests_are_what_the_chart_renders() -> None:
    # The pinned helm, or a skip naming how to get it (a failure under GHOSTGPU_REQUIRE_INTEGRATION=1).
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True,
                          timeout=RENDER_TIMEOUT_S, cwd=REPO, env={**os.environ, "HELM": helm()})
    assert done.returncode == 0, done.stderr  # each stale file, named, with the command to run


def test_the_charts_copies_of_the_rules_and_dashboard_are_the_originals() -> None:
    files = REPO / "deploy" / "helm" / "ghostgpu" / "files"
    assert {p.name for p in files.iterdir()} == set(COPIES.values())
    for original, name in COPIES.items():
        assert (files / name).read_bytes() == original.read_bytes(), (
            f"deploy/helm/ghostgpu/files/{name} differs from {original.relative_to(REPO)}: "
            "run .venv/bin/python scripts/render_manifests.py")


def test_every_generated_file_says_so_and_how() -> None:
    for path in (REPO / "deploy" / "kubernetes").rglob("*.yaml"):
        text = path.read_text()
        generated = "GENERATED from deploy/helm/ghostgpu by scripts/render_manifests.py" in text
        # The CloudNativePG Cluster and the example Secrets are the user's, not the chart's.
        assert generated == (path.parent.name == "kubernetes" or path.name == "ghostgpu.yaml"), path


def test_remediation_renders_a_config_the_collector_loads(tmp_path: Path) -> None:
    docs = render([CI / "remediation-values.yaml"])
    collector = docs.by_kind("Deployment")["ghostgpu-collector"]["spec"]["template"]["spec"]
    (container,) = collector["containers"]
    args = container["args"]
    parsed = cli._build_parser().parse_args(args)  # SystemExit on an unknown flag
    assert parsed.alertmanager == ["http://alertmanager-operated.monitoring.svc:9093"]
    config_path = flag(args, "--config")
    (mount,) = [m for m in container["volumeMounts"] if config_path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in collector["volumes"] if v["name"] == mount["name"]]
    config_map = docs.by_kind("ConfigMap")[volume["configMap"]["name"]]
    written = tmp_path / os.path.basename(config_path)
    written.write_text(config_map["data"][written.name])
    policy = load_remediation(str(written))  # ConfigError (one line) on any key the collector refuses
    assert policy.mode == "dry-run" and policy.isolate_node and policy.kill_orphans
    # Remediation signals orphans: the tracer gets CAP_KILL on top of the measured five.
    (tracer,) = docs.by_kind("DaemonSet")["ghostgpu-tracer"]["spec"]["template"]["spec"]["containers"]
    assert "KILL" in tracer["securityContext"]["capabilities"]["add"]
    # isolate_node: the collector runs as the ServiceAccount the ClusterRoleBinding names, token mounted.
    binding = docs.by_kind("ClusterRoleBinding")["ghostgpu-node-isolation"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": collector["serviceAccountName"],
                                    "namespace": "ghostgpu"}]
    assert collector["automountServiceAccountToken"] is True


def test_remediation_without_isolation_still_reads_the_opt_out_label() -> None:
    # The kill engine reads each node's ghostgpu.io/remediation label before an act and holds every act
    # back while it cannot (collector/kube_api.py NodeLabels.labels_now): in a pod without a token that
    # is every act. So: the token, and nodes get, nothing more.
    docs = render(set_values={"remediation.enabled": "true", "remediation.config.mode": "on"})
    collector = docs.by_kind("Deployment")["ghostgpu-collector"]["spec"]["template"]["spec"]
    assert collector["automountServiceAccountToken"] is True
    (role,) = docs.by_kind("ClusterRole").values()
    rules = [(r["apiGroups"], r["resources"], r["verbs"]) for r in role["rules"]]
    assert rules == [([""], ["nodes"], ["get"])]
    (binding,) = docs.by_kind("ClusterRoleBinding").values()
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": collector["serviceAccountName"],
                                    "namespace": "ghostgpu"}]


def test_without_remediation_no_kill_no_token_no_rbac() -> None:
    docs = render([CI / "default-values.yaml"])
    (tracer,) = docs.by_kind("DaemonSet")["ghostgpu-tracer"]["spec"]["template"]["spec"]["containers"]
    assert "KILL" not in tracer["securityContext"]["capabilities"]["add"]
    assert not docs.by_kind("ClusterRole") and not docs.by_kind("ServiceAccount")
    collector = docs.by_kind("Deployment")["ghostgpu-collector"]["spec"]["template"]["spec"]
    assert collector["automountServiceAccountToken"] is False and "serviceAccountName" not in collector
