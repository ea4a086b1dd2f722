"""deploy/kubernetes/ghostgpu.yaml agrees with the real CLI: every ghostgpu command line parses,
and the probes, ports and Prometheus monitors point where the flags say ghostgpu serves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml  # Debian's python3-yaml (scripts/bootstrap.sh installs it)
from ghostgpu.cli import main as cli

from ghostgpu.common.transport.addresses import parse_listen

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "ghostgpu.yaml"


def docs() -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(MANIFEST.read_text()) if d}


def container(kind: str, name: str) -> dict[str, Any]:
    (c,) = docs()[(kind, name)]["spec"]["template"]["spec"]["containers"]
    return c


def flag(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    return value


def port_named(c: dict[str, Any], name: str) -> int:
    (port,) = [p["containerPort"] for p in c["ports"] if p["name"] == name]
    return int(port)


@pytest.mark.parametrize(("kind", "name"), [("Deployment", "ghostgpu-collector"),
                                           ("DaemonSet", "ghostgpu-tracer")])
def test_command_lines_parse_with_the_real_cli(kind: str, name: str) -> None:
    args = container(kind, name)["args"]
    parsed = cli._build_parser().parse_args(args)  # SystemExit on any unknown or malformed flag
    assert parsed.command == args[0]


def test_collector_ports_service_and_service_monitor_agree() -> None:
    c = container("Deployment", "ghostgpu-collector")
    assert parse_listen(flag(c["args"], "--listen"), "--listen")[1] == port_named(c, "grpc")
    metrics = flag(c["args"], "--metrics-listen")
    assert parse_listen(metrics, "--metrics-listen")[1] == port_named(c, "metrics")
    service = docs()[("Service", "ghostgpu-collector")]
    targets = {p["name"]: p["targetPort"] for p in service["spec"]["ports"]}
    assert targets == {"grpc": "grpc", "metrics": "metrics"}
    monitor = docs()[("ServiceMonitor", "ghostgpu-collector")]["spec"]
    assert monitor["selector"]["matchLabels"] == service["spec"]["selector"]
    (endpoint,) = monitor["endpoints"]
    # Without honorLabels the target's namespace/pod/container replace the consumer's on every alert.
    assert endpoint["port"] == "metrics" and endpoint["honorLabels"] is True
    tracer_args = container("DaemonSet", "ghostgpu-tracer")["args"]
    host, port = flag(tracer_args, "--collector").rsplit(":", 1)
    assert host.split(".")[:2] == [service["metadata"]["name"], service["metadata"]["namespace"]]
    assert int(port) == port_named(c, "grpc")


def test_tracer_probes_hit_its_health_endpoints() -> None:
    c = container("DaemonSet", "ghostgpu-tracer")
    assert parse_listen(flag(c["args"], "--health-listen"), "--health-listen")[1] == port_named(c, "health")
    probes = {k: c[k]["httpGet"] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert {k: (p["path"], p["port"]) for k, p in probes.items()} == {
        "startupProbe": ("/readyz", "health"), "readinessProbe": ("/readyz", "health"),
        "livenessProbe": ("/healthz", "health")}
    spec = docs()[("DaemonSet", "ghostgpu-tracer")]["spec"]["template"]["spec"]
    assert spec["hostPID"] is True and c["securityContext"]["privileged"] is False  # test_deploy_security.py
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert flag(c["args"], "--cgroup-root") in mounts
    assert {"/sys/kernel/tracing", "/lib/modules", "/usr/src", "/var/lib/kubelet/pod-resources"} <= mounts
    monitor = docs()[("PodMonitor", "ghostgpu-tracer")]["spec"]
    (endpoint,) = monitor["podMetricsEndpoints"]
    assert endpoint["port"] == "health"
    node_label = {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"}
    assert node_label in endpoint["relabelings"]
