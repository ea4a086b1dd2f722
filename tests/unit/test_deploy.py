"""deploy/kubernetes/ghostgpu.yaml and replicated/ghostgpu.yaml agree with the real CLI: every ghostgpu
command line parses, and the probes, ports and Prometheus monitors point where the flags say ghostgpu
serves."""

from __future__ import annotations

from pathlib import Path

import pytest
from ghostgpu.cli import main as cli

from ghostgpu.common.transport.addresses import parse_listen
from tests.helpers.manifests import MANIFESTS, Manifest, flag, selects


@pytest.fixture(params=MANIFESTS, ids=lambda p: str(p.relative_to(p.parents[1])))
def m(request: pytest.FixtureRequest) -> Manifest:
    path: Path = request.param
    return Manifest(path)


@pytest.mark.parametrize(("kind", "name"), [("Deployment", "ghostgpu-collector"),
                                           ("DaemonSet", "ghostgpu-tracer")])
def test_command_lines_parse_with_the_real_cli(m: Manifest, kind: str, name: str) -> None:
    args = m.container(kind, name)["args"]
    parsed = cli._build_parser().parse_args(args)  # SystemExit on any unknown or malformed flag
    assert parsed.command == args[0]


def test_collector_ports_service_and_service_monitor_agree(m: Manifest) -> None:
    c = m.container("Deployment", "ghostgpu-collector")
    grpc_port = m.port_named("Deployment", "ghostgpu-collector", "grpc")
    assert parse_listen(flag(c["args"], "--listen"), "--listen")[1] == grpc_port
    metrics = flag(c["args"], "--metrics-listen")
    assert parse_listen(metrics, "--metrics-listen")[1] == m.port_named("Deployment", "ghostgpu-collector",
                                                                        "metrics")
    service = m.get("Service", "ghostgpu-collector")
    targets = {p["name"]: p["targetPort"] for p in service["spec"]["ports"]}
    assert targets == {"grpc": "grpc", "metrics": "metrics"}
    monitor = m.get("ServiceMonitor", "ghostgpu-collector")["spec"]
    assert monitor["selector"]["matchLabels"] == service["spec"]["selector"]
    (endpoint,) = monitor["endpoints"]
    # Without honorLabels the target's namespace/pod/container replace the consumer's on every alert.
    assert endpoint["port"] == "metrics" and endpoint["honorLabels"] is True
    # The tracers dial a Service of this file (NAME.NAMESPACE.svc:PORT) that selects the collector's
    # pods and forwards that port to their gRPC port.
    tracer_args = m.container("DaemonSet", "ghostgpu-tracer")["args"]
    host, port = flag(tracer_args, "--collector").rsplit(":", 1)
    name, namespace = host.split(".")[:2]
    dialed = m.get("Service", name)
    assert dialed["metadata"]["namespace"] == namespace
    pod_labels = m.get("Deployment", "ghostgpu-collector")["spec"]["template"]["metadata"]["labels"]
    assert selects(dialed["spec"]["selector"], pod_labels)
    (forward,) = [p for p in dialed["spec"]["ports"] if p["port"] == int(port)]
    assert forward["targetPort"] == "grpc"


def test_tracer_probes_hit_its_health_endpoints(m: Manifest) -> None:
    c = m.container("DaemonSet", "ghostgpu-tracer")
    health_port = m.port_named("DaemonSet", "ghostgpu-tracer", "health")
    assert parse_listen(flag(c["args"], "--health-listen"), "--health-listen")[1] == health_port
    probes = {k: c[k]["httpGet"] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert {k: (p["path"], p["port"]) for k, p in probes.items()} == {
        "startupProbe": ("/readyz", "health"), "readinessProbe": ("/readyz", "health"),
        "livenessProbe": ("/healthz", "health")}
    spec = m.pod("DaemonSet", "ghostgpu-tracer")
    assert spec["hostPID"] is True and c["securityContext"]["privileged"] is False  # test_deploy_security.py
    mounts = {mount["mountPath"] for mount in c["volumeMounts"]}
    assert flag(c["args"], "--cgroup-root") in mounts
    assert {"/sys/kernel/tracing", "/lib/modules", "/usr/src", "/var/lib/kubelet/pod-resources"} <= mounts
    monitor = m.get("PodMonitor", "ghostgpu-tracer")["spec"]
    (endpoint,) = monitor["podMetricsEndpoints"]
    assert endpoint["port"] == "health"
    node_label = {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"}
    assert node_label in endpoint["relabelings"]
