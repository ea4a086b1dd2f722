"""Alerting end to end, real parts only: a GPU pod's hidden consumer pages through Alertmanager.

A real containerd (CRI) runs the pod; the real tracer (BPF, a fake NVML that lists no process)
streams over mTLS (its node certificate; the collector's from the same test CA, tests/helpers/certs.py)
to a real `ghostgpu collector` process, which names the pod through the tracer's CRI relay, serves
/metrics and pushes findings to Alertmanager. Debian's Prometheus 2.42 scrapes the
collector every second and evaluates the shipped rules file (deploy/prometheus/ghostgpu-rules.yaml;
the findings alerts' `for:` shortened to 0 s, their only change), sending to Debian's Alertmanager
0.25. Both paths are read back where a user would see them, Alertmanager's /api/v2/alerts:

- scrape path: GhostGPUHiddenConsumer from Prometheus, with the metric's labels (node, GPU, pod, PID);
- push path: the same alert name from the collector itself (label source="ghostgpu-collector").

Removing the pod resolves both. Nothing sleeps: every wait polls with a deadline.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.audit_log import audit_records
from tests.helpers.certs import Pki
from tests.helpers.collector_proc import CollectorProcess, tls_flags
from tests.helpers.containerd import Containerd, Pod
from tests.helpers.fakenvml import FakeGpu, FakeNvml
from tests.helpers.polling import poll
from tests.helpers.promstack import (
    ALERTMANAGER_BIN,
    PROMETHEUS_BIN,
    Alertmanager,
    Prometheus,
    findings_rules_firing_at_once,
    free_port,
    require_binary,
)
from tests.helpers.tracer_proc import TracerProcess
from tests.helpers.workload import gpuwork_image, job_command
from tests.integration.conftest import GPU0_UUID, require_bpf
from tests.unit.test_dashboard import _VARIABLE as VARIABLE
from tests.unit.test_dashboard import _targets as all_dashboard_targets

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.containerd,
              pytest.mark.prometheus]

NODE = "node-alerts"
NS = "ghost-alerts"
ALERT = "GhostGPUHiddenConsumer"
PUSHED = "ghostgpu-collector"  # the `source` label of alerts the collector posts itself
DEADLINE_S = 45.0  # scrape (1 s) + evaluation (1 s) + CRI names, on a 2-core VM shared with other tests


@dataclass
class Stack:
    containerd: Containerd
    alertmanager: Alertmanager
    prometheus: Prometheus
    collector: CollectorProcess
    tracer: TracerProcess
    metrics_address: str
    pods: list[Pod]
    audit_log: Path  # the collector's, beside its database

    def audit(self, action: str) -> list[dict[str, Any]]:
        return audit_records(self.audit_log, action)

    def gpu_pod(self, name: str) -> tuple[Pod, str, int]:
        """A pod with container `cuda` holding host /dev/null as its /dev/nvidia0, a GPU job (gpuwork
        allocates on it; one that only opened it would be a `monitor`, which pages no one);
        (pod, id, init PID)."""
        pod = self.containerd.run_pod(name, NS)
        self.pods.append(pod)
        cid = self.containerd.create_container(pod, "cuda", job_command(),
                                               devices=[("/dev/null", "/dev/nvidia0")],
                                               image=self.containerd.import_variant(gpuwork_image()))
        return pod, cid, self.containerd.container_host_pid(cid)


@pytest.fixture(scope="module")
def stack(containerd_session: Containerd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    require_bpf()
    require_binary(PROMETHEUS_BIN)
    require_binary(ALERTMANAGER_BIN)
    ctd = containerd_session.start()
    work = tmp_path_factory.mktemp("alerting")
    nvml = FakeNvml(work / "nvml.conf", gpus=[FakeGpu(index=0, uuid=GPU0_UUID, minor=0)])
    nvml.write()
    (work / "tracer").mkdir()
    pki = Pki(work / "pki")
    server_tls = tls_flags(pki.write("collector", pki.collector()))
    node_tls = tls_flags(pki.write(f"node-{NODE}", pki.node(NODE)))
    pods: list[Pod] = []
    with Alertmanager(work / "am") as am:
        metrics = f"127.0.0.1:{free_port()}"
        # No --policy: the built-in one lets a node certificate stream for its own node.
        collector = CollectorProcess(work / "collector", args=[
            "--metrics-listen", metrics, "--alertmanager", am.url, "--alertmanager-resend-s", "5",
            *server_tls])
        tracer = None
        try:
            rules = findings_rules_firing_at_once(work / "rules.yaml")
            with Prometheus(work / "prom", scrape_targets={"ghostgpu-collector": metrics}, rule_files=[rules],
                            alertmanagers=[am.address], interval_s=1) as prom:
                tracer = TracerProcess(work / "tracer", ["--grace-s", "0.5", "--cri-endpoint", ctd.endpoint,
                                                         *node_tls], nvml.env(), NODE, collector.address)
                tracer.wait_ready(DEADLINE_S)
                prom.wait_target_up("ghostgpu-collector", DEADLINE_S)
                yield Stack(ctd, am, prom, collector, tracer, metrics, pods,
                            collector.db_path.with_suffix(".audit.jsonl"))
        finally:
            if tracer is not None:
                tracer.stop()
            collector.stop()
            ctd.start()
            for pod in pods:
                ctd.remove_pod(pod.id)


def test_the_tracer_streams_over_mtls_as_its_node(stack: Stack) -> None:
    """The stack below runs with TLS on: the collector saw the tracer's node certificate."""
    if not poll(lambda: stack.audit("tracer.connect"), DEADLINE_S):
        raise AssertionError(f"no tracer.connect in {stack.audit_log}: {stack.collector.stderr()}")
    connect = stack.audit("tracer.connect")[0]
    assert (connect["subject"], connect["result"], connect["detail"]["node"], connect["detail"]["via"]) == (
        f"node:{NODE}", "ok", NODE, "mtls")
    assert stack.audit("tracer.refused") == []


def hidden_alerts(am: Alertmanager, pushed: bool, **labels: str) -> list[dict[str, Any]]:
    """Active GhostGPUHiddenConsumer alerts with `labels`, from the push path or the scrape path."""
    return [a for a in am.alerts(alertname=ALERT, **labels)
            if (a["labels"].get("source") == PUSHED) == pushed]


def wait_alert(am: Alertmanager, pushed: bool, what: str, **labels: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = []

    def present() -> bool:
        nonlocal found
        found = hidden_alerts(am, pushed, **labels)
        return bool(found)

    if not poll(present, DEADLINE_S):
        have = [a["labels"] for a in am.alerts()]
        raise AssertionError(f"timed out after {DEADLINE_S} s waiting for {what} {labels}; "
                             f"Alertmanager has: {have}")
    return found[0]


def expected_labels(pod: str, pid: int) -> dict[str, str]:
    # comm is waited for with the other labels: the container's command is gpuwork itself.
    return {"node": NODE, "namespace": NS, "pod": pod, "container": "cuda", "pid": str(pid), "gpu": "0",
            "gpu_uuid": GPU0_UUID, "class": "hidden", "severity": "critical", "comm": "gpuwork"}


def check_annotations(alert: dict[str, Any], pod: str, pid: int) -> None:
    summary = alert["annotations"].get("summary", "")
    for part in (NODE, GPU0_UUID, f"{NS}/{pod}", str(pid)):
        assert part in summary, f"summary {summary!r} does not name {part}"
    assert alert["annotations"].get("description"), "an alert must say what to do"


def test_hidden_consumer_pages_through_prometheus_rules(stack: Stack) -> None:
    am = stack.alertmanager
    pod, _cid, pid = stack.gpu_pod("scraped-0")
    labels = expected_labels("scraped-0", pid)
    alert = wait_alert(am, False, "the scrape path's alert", **labels)
    # Prometheus adds the scrape target's labels; everything else came from the metric and the rule.
    assert alert["labels"]["job"] == "ghostgpu-collector"
    assert alert["labels"]["instance"] == stack.metrics_address
    assert alert["status"]["state"] == "active"
    check_annotations(alert, "scraped-0", pid)
    assert "/graph?g0.expr=" in alert["generatorURL"], alert  # Prometheus's link to the rule's expression

    stack.containerd.remove_pod(pod.id)
    stack.pods.remove(pod)
    if not poll(lambda: not hidden_alerts(am, False, pod="scraped-0"), DEADLINE_S):
        raise AssertionError(f"the scrape path's alert for pod scraped-0 did not resolve in {DEADLINE_S} s: "
                             f"{[a['labels'] for a in hidden_alerts(am, False, pod='scraped-0')]}")


def test_hidden_consumer_pages_through_the_direct_push(stack: Stack) -> None:
    am = stack.alertmanager
    pod, _cid, pid = stack.gpu_pod("pushed-0")
    labels = expected_labels("pushed-0", pid)
    alert = wait_alert(am, True, "the collector's pushed alert", **labels)
    assert "job" not in alert["labels"]  # not Prometheus: the collector posted it
    assert alert["status"]["state"] == "active"
    check_annotations(alert, "pushed-0", pid)

    stack.containerd.remove_pod(pod.id)
    stack.pods.remove(pod)
    # The collector posts the same labels with endsAt: Alertmanager 0.25 leaves it out of the active list.
    # A firing alert goes out without endsAt, so only Alertmanager's resolve_timeout could end it
    # otherwise: gone well before that means the collector sent the resolution.
    assert am.resolve_timeout_s > DEADLINE_S
    if not poll(lambda: not hidden_alerts(am, True, pod="pushed-0"), DEADLINE_S):
        raise AssertionError(f"the pushed alert for pod pushed-0 did not resolve in {DEADLINE_S} s")


def dashboard_targets(title: str) -> list[dict[str, Any]]:
    return [t for panel_title, t in all_dashboard_targets() if panel_title == title]


# What Grafana puts in the dashboard's variables with this test's node and every GPU selected.
GRAFANA_VALUES = {"node": NODE, "gpu": ".*", "__rate_interval": "1m", "__interval": "15s", "__range": "1h"}


def as_grafana_sends(expr: str) -> str:
    return VARIABLE.sub(lambda m: GRAFANA_VALUES[m.group(1) or m.group(2)], expr)


def dashboard_query(title: str, expr_part: str) -> str:
    (expr,) = [t["expr"] for t in dashboard_targets(title) if expr_part in t["expr"]]
    return as_grafana_sends(expr)


def test_the_dashboard_shows_the_planted_consumer(stack: Stack) -> None:
    """The dashboard's own queries, run against the Prometheus that scrapes the real collector, show the
    hidden consumer's row (pod and PID) in the non-visible table, the class over time and the node's
    tracer connected; every panel's query answers without error."""
    prom = stack.prometheus
    pod, _cid, pid = stack.gpu_pod("dashboard-0")
    table = dashboard_query("Non-visible consumers", "ghostgpu_nonvisible_consumer_info")
    rows: list[dict[str, Any]] = []

    def shown() -> bool:
        nonlocal rows
        rows = [r["metric"] for r in prom.query(table)]
        return any(r.get("pod") == "dashboard-0" and r.get("pid") == str(pid) for r in rows)

    if not poll(shown, DEADLINE_S):
        raise AssertionError(f"the non-visible table never showed pod dashboard-0 PID {pid}: {rows}")
    row = next(r for r in rows if r.get("pid") == str(pid))
    assert (row["namespace"], row["container"], row["class"], row["gpu_uuid"]) == (
        NS, "cuda", "hidden", GPU0_UUID)
    assert "__name__" not in row  # Grafana merges the info and memory rows only without it
    by_class = prom.query(dashboard_query("Consumers by class", "sum by (class)"))
    assert any(r["metric"]["class"] == "hidden" and float(r["value"][1]) >= 1 for r in by_class)
    connected = prom.query(dashboard_query("Tracer health by node", "ghostgpu_tracer_connected"))
    assert [(r["metric"]["node"], r["value"][1]) for r in connected] == [(NODE, "1")]
    for _title, target in all_dashboard_targets():
        prom.query(as_grafana_sends(target["expr"]))  # fails naming the expression on any error
    stack.containerd.remove_pod(pod.id)
    stack.pods.remove(pod)
