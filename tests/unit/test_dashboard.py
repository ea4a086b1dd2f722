"""The Grafana dashboard: every expression parses in a real Prometheus 2.42 (its query API answers
400 bad_data on a parse error), reads only metrics ghostgpu exports, and the selectors and the four
kinds of panels docs/ALERTING.md describes are there."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.promql import metric_names, unknown_metrics
from tests.helpers.promstack import Prometheus, prometheus_module  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy/grafana/ghostgpu-dashboard.json"
UID = "ghostgpu-consumers"  # stable: links and provisioning refer to it
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# What Grafana puts in place of its variables. Multi-value variables with several values selected
# become a regex alternation (the case that breaks `node="$node"`), so that is what is tested.
SUBSTITUTIONS = {
    "node": "(gpu-node-1|gpu-node-2)", "gpu": "(0|1)", "datasource": "prometheus",
    "__rate_interval": "1m", "__interval": "15s", "__interval_ms": "15000", "__range": "6h",
    "__range_s": "21600", "__range_ms": "21600000",
}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
_LABEL_VALUES = re.compile(r"^label_values\((?:(?P<selector>.+),\s*)?(?P<label>\w+)\)$")


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, including those inside collapsed rows."""
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _targets() -> list[tuple[str, dict[str, Any]]]:
    return [(p["title"], t) for p in _panels(_dashboard()["panels"]) for t in p.get("targets", [])]


def _variables() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in _dashboard()["templating"]["list"]}


def _variable_selectors() -> list[tuple[str, str]]:
    """The metric/selector part of each label_values(...) variable query."""
    out = []
    for name, var in _variables().items():
        if var["type"] != "query":
            continue
        m = _LABEL_VALUES.match(var["query"]["query"])
        assert m and m.group("selector"), f"variable {name}: not label_values(selector, label)"
        assert var["definition"] == var["query"]["query"]
        out.append((f"variable {name}", m.group("selector")))
    return out


def substitute(expr: str) -> str:
    def value(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in SUBSTITUTIONS:
            raise AssertionError(f"unknown Grafana variable ${name} in {expr!r}")
        return SUBSTITUTIONS[name]

    return _VARIABLE.sub(value, expr)


def _all_expressions() -> list[tuple[str, str]]:
    return [(title, t["expr"]) for title, t in _targets()] + _variable_selectors()


@pytest.mark.prometheus
def test_every_expression_parses_in_prometheus(prometheus_module: Prometheus) -> None:  # noqa: F811
    exprs = _all_expressions()
    assert len(exprs) > 20
    bad = []
    for where, expr in exprs:
        status, body = prometheus_module.query_raw(substitute(expr))
        if status != 200 or body.get("status") != "success":
            bad.append(f"{where}: {expr}: {status} {body}")
    assert not bad, "\n".join(bad)


@pytest.mark.prometheus
def test_a_broken_expression_is_refused_by_the_query_api(prometheus_module: Prometheus) -> None:  # noqa: F811
    # The parse check above proves something only because this is how Prometheus answers a parse error.
    status, body = prometheus_module.query_raw('sum by (node) (ghostgpu_consumers{node=~"a"}')
    assert status == 400 and body["errorType"] == "bad_data", body
    status, body = prometheus_module.query_raw('ghostgpu_consumers{node=~"("}')  # a bad regex, too
    assert status == 400 and body["errorType"] == "bad_data", body


def test_expressions_read_only_metrics_ghostgpu_exports() -> None:
    from ghostgpu.collector.metrics import COLLECTOR_METRICS
    from ghostgpu.tracer.health import TRACER_METRICS

    families = {**COLLECTOR_METRICS, **TRACER_METRICS}
    unknown = {}
    for where, expr in _all_expressions():
        names = metric_names(substitute(expr))
        assert names, f"{where}: no metric in {expr!r}"
        if missing := unknown_metrics(names, families):
            unknown[where] = missing
    assert not unknown, f"metrics ghostgpu does not export: {unknown}"


def test_multi_value_variables_are_only_used_with_regex_matchers() -> None:
    for where, expr in _all_expressions():
        for m in re.finditer(r"(\w+)\s*(=~|!~|=|!=)\s*\"([^\"]*)\"", expr):
            if "$" in m.group(3):
                assert m.group(2) == "=~", f"{where}: {m.group(0)} breaks with several values selected"


def test_variables_node_and_gpu() -> None:
    dash = _dashboard()
    assert dash["uid"] == UID
    assert dash["schemaVersion"] >= 36  # Grafana 10 dashboards (datasource refs are objects)
    variables = _variables()
    ds = variables["datasource"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    for name in ("node", "gpu"):
        var = variables[name]
        assert var["type"] == "query" and var["datasource"] == DATASOURCE
        assert var["multi"] is True and var["includeAll"] is True and var["allValue"] == ".*"
        assert var["query"]["query"].endswith(f", {name})")
    assert '{node=~"$node"}' in variables["gpu"]["query"]["query"], "GPUs follow the selected nodes"


def test_every_panel_and_query_uses_the_datasource_variable() -> None:
    for panel in _panels(_dashboard()["panels"]):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], f"{panel['title']}: no query"
        for t in panel["targets"]:
            assert t["datasource"] == DATASOURCE, panel["title"]
    panels = list(_panels(_dashboard()["panels"]))
    for panel in panels:
        refs = [t["refId"] for t in panel.get("targets", [])]
        assert len(refs) == len(set(refs)), f"{panel['title']}: a refId repeats"
    for key in ("id", "title"):
        values = [p[key] for p in panels]
        assert len(values) == len(set(values)), f"panel {key}s repeat"


def _find(kind: str, *needles: str) -> dict[str, Any]:
    for panel in _panels(_dashboard()["panels"]):
        exprs = " ".join(t["expr"] for t in panel.get("targets", []))
        if panel["type"] == kind and all(n in exprs for n in needles):
            return panel
    raise AssertionError(f"no {kind} panel with {needles}")


def test_the_four_kinds_of_panels_are_there() -> None:
    by_class = _find("timeseries", "sum by (class) (ghostgpu_consumers{")
    assert 'node=~"$node", gpu=~"$gpu"' in by_class["targets"][0]["expr"]

    table = _find("table", "ghostgpu_nonvisible_consumer_info{", "ghostgpu_nonvisible_consumer_memory_bytes{")
    assert all(t.get("instant") and t.get("format") == "table" for t in table["targets"])
    organize = next(t["options"] for t in table["transformations"] if t["id"] == "organize")
    shown = set(organize["indexByName"]) - {k for k, v in organize["excludeByName"].items() if v}
    assert {"node", "gpu", "class", "namespace", "pod", "container", "pid", "comm"} <= shown
    assert organize["renameByName"]["Value #B"] == "GPU memory"

    memory = _find("timeseries", "ghostgpu_nonvisible_memory_bytes{")
    assert memory["fieldConfig"]["defaults"]["unit"] == "bytes"

    health = _find("table", "ghostgpu_tracer_connected", "ghostgpu_tracer_last_heartbeat_timestamp_seconds",
                   "ghostgpu_tracer_events_ingested_total", "ghostgpu_tracer_events_lost_total",
                   "ghostgpu_cri_resolution_failures_total", "ghostgpu_tracer_bpf_attached",
                   "ghostgpu_tracer_nvml_available")
    assert all("by (node)" in t["expr"] for t in health["targets"]), "tracer health is per node"


def test_consumer_panels_follow_the_node_and_gpu_selectors() -> None:
    gpu_families = ("ghostgpu_consumers", "ghostgpu_nonvisible_", "ghostgpu_gpu_")
    node_families = (*gpu_families, "ghostgpu_tracer_", "ghostgpu_findings_", "ghostgpu_cri_resolution_")
    for title, t in _targets():
        for m in re.finditer(r"(ghostgpu_\w+)(\{[^}]*\})?", t["expr"]):
            name, matchers = m.group(1), m.group(2) or ""
            if name.startswith(node_families):
                assert 'node=~"$node"' in matchers, f"{title}: {name} ignores the node selector"
            if name.startswith(gpu_families):
                assert 'gpu=~"$gpu"' in matchers, f"{title}: {name} ignores the GPU selector"


def test_substitution_leaves_no_variable_behind() -> None:
    for where, expr in _all_expressions():
        assert "$" not in substitute(expr), where
    with pytest.raises(AssertionError, match="unknown Grafana variable"):
        substitute("rate(x[$__unknown])")


def test_grid_positions_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in _panels(_dashboard()["panels"]):
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        for y in range(pos["y"], pos["y"] + pos["h"]):
            for x in range(pos["x"], pos["x"] + pos["w"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


_AGGREGATION = re.compile(r"(sum|max|min|avg|count|group)\s*(\((?!\s*\))|(by|without)\s*\()")


def test_merged_table_queries_carry_no_metric_name() -> None:
    # Grafana (10/11) turns every label of a table-format result into a column, __name__ included,
    # and its merge transformation joins rows only where all shared columns are equal: two queries
    # of different metrics never join, so each consumer would take two rows. An aggregation drops
    # __name__ (and keeps the labels it is told to).
    merged = [p for p in _panels(_dashboard()["panels"])
              if p["type"] == "table" and any(t["id"] == "merge" for t in p.get("transformations", []))]
    assert merged
    for panel in merged:
        for t in panel["targets"]:
            assert _AGGREGATION.match(t["expr"]), f"{panel['title']} {t['refId']}: {t['expr']} keeps __name__"


def test_a_panel_that_draws_below_zero_is_not_clipped_at_zero() -> None:
    for panel in _panels(_dashboard()["panels"]):
        if any(t["expr"].lstrip().startswith("-") for t in panel.get("targets", [])):
            defaults = panel["fieldConfig"]["defaults"]
            assert defaults.get("min") is None and defaults["custom"].get("axisSoftMin") is None, (
                f"{panel['title']}: negative series under a minimum of 0")


def test_heartbeat_age_is_the_one_the_silent_alert_uses() -> None:
    # time() - heartbeat also counts the time since the collector's last scrape (up to a whole
    # interval); GhostGPUTracerSilent takes the age at the scrape, and so must the panels that cite it.
    ages = [(title, t["expr"]) for title, t in _targets()
            if "ghostgpu_tracer_last_heartbeat_timestamp_seconds" in t["expr"]]
    assert ages
    for title, expr in ages:
        at_scrape = "timestamp(ghostgpu_tracer_last_heartbeat_timestamp_seconds" in expr
        assert at_scrape and "time()" not in expr, f"{title}: {expr}"
