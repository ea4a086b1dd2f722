"""The alert rules: promtool checks them and runs their unit tests, the PrometheusRule says the same,
the direct Alertmanager push says the same, and they read only metrics the collector exports."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers.promql import metric_names, unknown_metrics
from tests.helpers.promstack import promtool

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy/prometheus/ghostgpu-rules.yaml"
PROMETHEUS_RULE = REPO / "deploy/prometheus/ghostgpu-prometheusrule.yaml"
RULE_TESTS = sorted((REPO / "deploy/prometheus/tests").glob("*.yaml"))

# Every alert's severity, as docs/ALERTING.md's table gives it.
SEVERITIES = {
    "GhostGPUHiddenConsumer": "critical", "GhostGPUOrphanedConsumer": "critical",
    "GhostGPUGhostMemory": "warning", "GhostGPUUnallocatedAccess": "warning",
    "GhostGPUUnattributedConsumer": "warning", "GhostGPUTracerDown": "critical",
    "GhostGPUTracerSilent": "warning", "GhostGPUEventsLost": "warning",
    "GhostGPUCriResolutionFailing": "warning", "GhostGPUMetricsCapped": "warning",
    "GhostGPUAuditRewound": "critical", "GhostGPUXidCritical": "critical",
    "GhostGPUUnaccountedMemory": "warning", "GhostGPURemediationPaused": "warning",
}
FINDING_CLASS = {"GhostGPUHiddenConsumer": "hidden", "GhostGPUOrphanedConsumer": "orphaned",
                 "GhostGPUGhostMemory": "ghost", "GhostGPUUnallocatedAccess": "unallocated",
                 "GhostGPUUnattributedConsumer": "unattributed"}
_TEMPLATE = re.compile(r"\{\{ \$labels\.(\w+) \}\}")


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _rules() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in _load(RULES)["groups"] for r in g["rules"]}


def test_groups_and_alerts_are_the_spec_s() -> None:
    groups = {g["name"]: [r["alert"] for r in g["rules"]] for g in _load(RULES)["groups"]}
    assert set(groups) == {"ghostgpu-findings", "ghostgpu-health", "ghostgpu-gpu"}
    assert set(groups["ghostgpu-findings"]) == set(FINDING_CLASS)
    assert set(groups["ghostgpu-gpu"]) == {"GhostGPUXidCritical", "GhostGPUUnaccountedMemory"}
    assert {a for alerts in groups.values() for a in alerts} == set(SEVERITIES)


@pytest.mark.parametrize("alert", sorted(SEVERITIES))
def test_each_alert_has_severity_for_and_texts(alert: str) -> None:
    rule = _rules()[alert]
    assert rule["labels"] == {"severity": SEVERITIES[alert]}
    assert re.fullmatch(r"\d+[smh]", str(rule["for"])), f"{alert}: for: {rule.get('for')!r}"
    assert set(rule["annotations"]) == {"summary", "description"}
    named = set(_TEMPLATE.findall(rule["annotations"]["summary"]))
    if alert in FINDING_CLASS:
        # The summary names where (node, GPU), who (pod) and which process (PID).
        assert {"node", "gpu", "pod", "pid"} <= named, f"{alert} summary names only {named}"
        assert f'class="{FINDING_CLASS[alert]}"' in rule["expr"]
        assert "ghostgpu_nonvisible_consumer_" in rule["expr"], "findings alerts read the per-process series"
    elif alert == "GhostGPUMetricsCapped":  # a collector-wide gauge: the collector is the place
        assert "instance" in named
    elif alert == "GhostGPUAuditRewound":  # one series per collector across restarts (pods change)
        assert {"job", "namespace"} <= named
    elif alert == "GhostGPURemediationPaused":  # one per deployment and cause: replicas share the switch
        assert {"cause", "job", "namespace"} <= named
    else:
        assert "node" in named


def test_prometheusrule_groups_equal_the_rules_file() -> None:
    doc = _load(PROMETHEUS_RULE)
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    assert doc["kind"] == "PrometheusRule"
    assert doc["metadata"]["name"] == "ghostgpu"
    assert doc["metadata"]["labels"]["release"] == "prometheus"  # kube-prometheus-stack's ruleSelector
    assert doc["spec"]["groups"] == _load(RULES)["groups"]


@pytest.mark.prometheus
def test_promtool_check_rules_passes_on_both_files(tmp_path: Path) -> None:
    spec_rules = tmp_path / "prometheusrule-spec.yaml"
    spec_rules.write_text(yaml.safe_dump(_load(PROMETHEUS_RULE)["spec"], sort_keys=False))
    for path in (RULES, spec_rules):
        out = promtool("check", "rules", str(path))
        assert out.returncode == 0, f"promtool check rules {path}:\n{out.stdout}{out.stderr}"
        assert f"SUCCESS: {len(SEVERITIES)} rules found" in out.stdout


@pytest.mark.prometheus
def test_promtool_check_rules_refuses_a_broken_expression(tmp_path: Path) -> None:
    # The check above means something only if promtool does fail on a bad rule.
    doc = _load(RULES)
    doc["groups"][0]["rules"][0]["expr"] = "ghostgpu_nonvisible_consumer_info{class=\"hidden\""
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc, sort_keys=False))
    out = promtool("check", "rules", str(bad))
    assert out.returncode != 0 and "GhostGPUHiddenConsumer" in out.stdout + out.stderr


@pytest.mark.prometheus
def test_promtool_unit_tests_pass() -> None:
    assert RULE_TESTS, "no promtool tests in deploy/prometheus/tests"
    out = promtool("test", "rules", *map(str, RULE_TESTS), timeout_s=120.0)
    assert out.returncode == 0, f"promtool test rules:\n{out.stdout}{out.stderr}"
    assert out.stdout.count("SUCCESS") == len(RULE_TESTS)


def test_promtool_unit_tests_cover_every_alert_firing_and_not() -> None:
    fired: dict[str, int] = {}
    silent: dict[str, int] = {}
    for path in RULE_TESTS:
        doc = _load(path)
        assert doc["rule_files"] == ["../ghostgpu-rules.yaml"], f"{path.name} tests another rules file"
        for test in doc["tests"]:
            for case in test["alert_rule_test"]:
                name = case["alertname"]
                if not case["exp_alerts"]:
                    silent[name] = silent.get(name, 0) + 1
                    continue
                fired[name] = fired.get(name, 0) + 1
                for exp in case["exp_alerts"]:
                    labels, annotations = exp["exp_labels"], exp["exp_annotations"]
                    assert labels["severity"] == SEVERITIES[name]
                    assert set(annotations) == {"summary", "description"}, f"{path.name}: {name}"
                    if name in FINDING_CLASS:  # a holder of node-wide devices only has no GPU labels
                        gpu = set() if "node-wide" in test["name"] else {"gpu", "gpu_uuid"}
                        assert {"node", "pid", "class", *gpu} <= set(labels)
    assert set(fired) == set(SEVERITIES), f"never tested firing: {set(SEVERITIES) - set(fired)}"
    assert set(silent) == set(SEVERITIES), f"never tested not firing: {set(SEVERITIES) - set(silent)}"


def test_rules_read_only_metrics_the_collector_exports() -> None:
    from ghostgpu.collector.metrics import COLLECTOR_METRICS

    used = {name for rule in _rules().values() for name in metric_names(rule["expr"])}
    assert used, "no metric names found in the rules"
    assert unknown_metrics(used, COLLECTOR_METRICS) == set()


def test_finding_alerts_and_texts_match_the_direct_push() -> None:
    from ghostgpu.collector.alertpush import ALERT_ANNOTATIONS, FINDING_ALERTS

    rules = _rules()
    assert {name for name, _ in FINDING_ALERTS.values()} == set(FINDING_CLASS)
    for cls, (alertname, severity) in FINDING_ALERTS.items():
        rule = rules[alertname]
        assert FINDING_CLASS[alertname] == cls
        assert rule["labels"]["severity"] == severity, alertname
        for key, pushed in ALERT_ANNOTATIONS[alertname].items():
            # {x} in the push is {{ $labels.x }} in the rule, and nothing else may differ.
            assert _TEMPLATE.sub(r"{\1}", rule["annotations"][key]) == pushed, f"{alertname} {key}"
            assert "{{" not in _TEMPLATE.sub("", rule["annotations"][key]), "only $labels templates"
        assert set(ALERT_ANNOTATIONS[alertname]) == set(rule["annotations"])


def test_the_critical_xid_rule_names_the_catalogue_s_critical_xids() -> None:
    from ghostgpu.tracer.xid_catalog import CRITICAL_XIDS

    expr = _rules()["GhostGPUXidCritical"]["expr"]
    lists = set(re.findall(r'xid=~"([0-9|]+)"', expr))
    assert len(lists) == 1, f"every arm reads the same Xids: {lists}"
    # 154 is critical or not by its message (the recovery action it states): left to the direct push.
    assert {int(x) for x in lists.pop().split("|")} == CRITICAL_XIDS - {154}
    assert {48, 63, 64, 74, 79, 92, 93, 94, 95, 119} <= CRITICAL_XIDS


def test_metric_name_lexer_finds_names_only() -> None:
    # The metric checks here and in test_dashboard rest on this lexer.
    expr = ('sum by (node) (rate(ghostgpu_a_total{class=~"hidden|x", pod!="y"}[5m])) > 0 and on (node) '
            'ghostgpu_b offset 5m or histogram_quantile(0.9, sum without (le) (rate(c_bucket[1h:5m]))) '
            '* 1e3 unless label_replace(d:e, "dst", "$1", "src", "(.*)") @ end()')
    assert metric_names(expr) == {"ghostgpu_a_total", "ghostgpu_b", "c_bucket", "d:e"}
    families = {"ghostgpu_a_total": ("counter", ""), "c": ("histogram", ""), "ghostgpu_b": ("gauge", "")}
    assert unknown_metrics(metric_names(expr), families) == {"d:e"}
    assert unknown_metrics({"ghostgpu_b_bucket"}, families) == {"ghostgpu_b_bucket"}  # not a histogram
