"""Remediation's guards (collector/remediation_guards.py), table-tested: who is a candidate, the
circuit breaker tripping at K (cluster-wide and per node), minHealthy's rounding, and the mode in
force under an override, a pause and an open breaker."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import replace

import pytest
from ghostgpu.collector.remediation_guards import (
    SCOPE_CLUSTER,
    SCOPE_NODE,
    ActCounts,
    Candidate,
    Verdict,
    breaker,
    count_acts,
    effective_mode,
    eligible,
    isolation_cap,
    min_healthy,
)
from ghostgpu.collector.remediation_policy import Breaker, NamespaceFilter, RemediationPolicy

from ghostgpu.common.model.remediation import CAPABILITY, MODE_DRY_RUN, MODE_OFF, MODE_ON, OPT_OUT_LABEL

S = 1_000_000_000  # ns in a second
NOW = 1_800_000_000 * S
POLICY = RemediationPolicy(mode=MODE_ON, min_age_s=300.0, allowlist=("nv-hostengine", "/usr/bin/dcgm*"))
ORPHAN = Candidate(finding_id=7, node="n1", cls="orphaned", opened_unix_ns=NOW - 600 * S, namespace="ml",
                   exe="/usr/bin/python3.11", comm="python3", container_id="c0ffee" * 4,
                   pod_uid="6d1f2a3b-0000-4000-8000-000000000001")
OFFERS = frozenset({CAPABILITY})


# ---- eligibility ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("candidate", "policy", "caps", "labels", "why"), [
    (ORPHAN, POLICY, OFFERS, None, None),  # labels unknown (no Kubernetes API): the tracer's switch holds
    (ORPHAN, POLICY, OFFERS, {OPT_OUT_LABEL: "on", "zone": "a"}, None),
    (replace(ORPHAN, opened_unix_ns=NOW - 300 * S), POLICY, OFFERS, {}, None),  # exactly min_age
    (replace(ORPHAN, namespace=""), POLICY, OFFERS, {}, None),  # no pod known: include ["*"] admits ""
    (ORPHAN, replace(POLICY, kill_orphans=False), OFFERS, {}, "actions.kill_orphans is false"),
    (replace(ORPHAN, cls="hidden"), POLICY, OFFERS, {},
     "finding 7 is hidden, not orphaned: only orphaned holders are acted on"),
    (replace(ORPHAN, resolved_unix_ns=NOW - S), POLICY, OFFERS, {}, "finding 7 is resolved"),
    # A host process, and a container outside any Kubernetes pod: nothing to corroborate with CRI.
    (replace(ORPHAN, container_id="", pod_uid=""), POLICY, OFFERS, {},
     "finding 7 has no container: no pod to corroborate: only a Kubernetes pod's orphan is killed"),
    (replace(ORPHAN, pod_uid=""), POLICY, OFFERS, {},
     "finding 7 has no pod UID: no pod to corroborate: only a Kubernetes pod's orphan is killed"),
    (replace(ORPHAN, opened_unix_ns=NOW - 299 * S), POLICY, OFFERS, {},
     "finding 7 is 299s old, under min_age 5m"),
    (replace(ORPHAN, opened_unix_ns=NOW - 299 * S - S // 2), POLICY, OFFERS, {},
     "finding 7 is 299s old, under min_age 5m"),
    (replace(ORPHAN, opened_unix_ns=NOW + 5 * S), POLICY, OFFERS, {},  # another replica's clock ahead
     "finding 7 is 0s old, under min_age 5m"),
    (replace(ORPHAN, namespace="kube-system"), POLICY, OFFERS, {},
     "namespace 'kube-system' is not admitted (namespaces include [*], exclude [kube-system])"),
    (ORPHAN, replace(POLICY, namespaces=NamespaceFilter(("research",), ())), OFFERS, {},
     "namespace 'ml' is not admitted (namespaces include [research], exclude [])"),
    (replace(ORPHAN, namespace=""), replace(POLICY, namespaces=NamespaceFilter(("ml-*",), ())), OFFERS, {},
     "namespace '' (no pod known) is not admitted (namespaces include [ml-*], exclude [])"),
    (replace(ORPHAN, exe="/usr/bin/nv-hostengine", comm="nv-hostengine"), POLICY, OFFERS, {},
     "/usr/bin/nv-hostengine is allowlisted ('nv-hostengine')"),  # by the exe's name
    (replace(ORPHAN, exe="/usr/bin/dcgm-exporter", comm="dcgm-exporter"), POLICY, OFFERS, {},
     "/usr/bin/dcgm-exporter is allowlisted ('/usr/bin/dcgm*')"),  # by the exe's path
    (replace(ORPHAN, exe="", comm="nv-hostengine"), POLICY, OFFERS, {},
     "nv-hostengine is allowlisted ('nv-hostengine')"),  # by comm where the exe is unknown
    (ORPHAN, POLICY, None, {}, "node n1 has no tracer connected to act through"),
    (ORPHAN, POLICY, frozenset(), {}, "node n1 opted out: its tracer does not offer remediation (tracer "
     "--remediation off, or a tracer older than remediation)"),
    (ORPHAN, POLICY, OFFERS, {OPT_OUT_LABEL: "off"}, f"node n1 opted out: label {OPT_OUT_LABEL}=off"),
    # Any value but "on" keeps hands off: a typo errs on the side of doing nothing.
    (ORPHAN, POLICY, OFFERS, {OPT_OUT_LABEL: "disabled"},
     f"node n1 opted out: label {OPT_OUT_LABEL}=disabled"),
    (ORPHAN, POLICY, OFFERS, {OPT_OUT_LABEL: ""}, f"node n1 opted out: label {OPT_OUT_LABEL}="),
])
def test_eligible_says_why_a_finding_is_no_candidate(
        candidate: Candidate, policy: RemediationPolicy, caps: Collection[str] | None,
        labels: Mapping[str, str] | None, why: str | None) -> None:
    assert eligible(candidate, policy, NOW, caps, labels) == why


def test_eligible_checks_the_finding_before_its_node() -> None:
    """A hidden finding on a node that opted out is refused for its class: the first reason is the one
    an operator can act on for that finding."""
    why = eligible(replace(ORPHAN, cls="ghost"), POLICY, NOW, frozenset(), {OPT_OUT_LABEL: "off"})
    assert why is not None and why.startswith("finding 7 is ghost, not orphaned")


# ---- the circuit breaker ----------------------------------------------------------------------------------

B = Breaker(max_actions=10, window_s=3600.0, max_per_node=3)


def acts(n: int, node: str = "n1", age_s: float = 60.0) -> list[tuple[int, str]]:
    return [(NOW - int(age_s * S), node)] * n


def test_count_acts_counts_the_window_only() -> None:
    rows = acts(2, "n1", 10) + acts(1, "n2", 3599) + acts(4, "n1", 3600) + acts(1, "n3", -30)
    counts = count_acts(rows, 3600.0, NOW)
    # An act exactly one window ago is out; one stamped ahead of `now` (a replica's clock) is in.
    assert counts == ActCounts(4, {"n1": 2, "n2": 1, "n3": 1})
    assert count_acts([], 3600.0, NOW) == ActCounts(0, {})


@pytest.mark.parametrize(("rows", "node", "verdict"), [
    ([], None, Verdict(True)),
    (acts(2, "n1") + acts(7, "n2"), "n1", Verdict(True)),  # 9 < 10, 2 < 3 on n1
    (acts(3, "n1") + acts(6, "n2"), "n3", Verdict(True)),  # n1 at its limit holds n1 only
    (acts(3, "n1") + acts(6, "n2"), "n1",
     Verdict(False, "3 acts on node n1 in the last 1h (max_per_node 3)", SCOPE_NODE)),
    (acts(3, "n1") + acts(6, "n2"), None, Verdict(True)),  # the cluster's verdict: no node asked
    # The breaker trips at K: the 10th act is allowed, the 11th is not, on every node.
    (acts(2, "n1") + acts(7, "n2") + acts(1, "n3"), "n4",
     Verdict(False, "10 acts in the last 1h (max_actions 10)", SCOPE_CLUSTER)),
    (acts(3, "n1") + acts(7, "n2"), "n1",  # both limits: the cluster's is said
     Verdict(False, "10 acts in the last 1h (max_actions 10)", SCOPE_CLUSTER)),
    (acts(10, "n2", age_s=3600), "n1", Verdict(True)),  # the window moved past them
])
def test_the_breaker_trips_at_k_cluster_wide_and_per_node(rows: list[tuple[int, str]], node: str | None,
                                                          verdict: Verdict) -> None:
    assert breaker(count_acts(rows, B.window_s, NOW), B, node) == verdict


def test_the_breaker_trips_at_exactly_k_acts() -> None:
    b = Breaker(max_actions=4, window_s=600.0, max_per_node=99)
    allowed = []
    rows: list[tuple[int, str]] = []
    for i in range(6):
        verdict = breaker(count_acts(rows, b.window_s, NOW), b, f"n{i}")
        allowed.append(verdict.allowed)
        if verdict.allowed:
            rows += acts(1, f"n{i}")
    assert allowed == [True, True, True, True, False, False] and len(rows) == 4
    assert breaker(count_acts(rows, b.window_s, NOW), b).reason == "4 acts in the last 10m (max_actions 4)"


# ---- minHealthy -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("nodes", "pct", "cap"), [
    (0, 10, 0), (1, 10, 1), (5, 10, 1), (9, 10, 1), (10, 10, 1), (19, 10, 1), (20, 10, 2), (25, 10, 2),
    (30, 10, 3), (100, 10, 10), (3, 33.3, 1), (3, 100, 3), (7, 50, 3), (1000, 0.1, 1), (1000, 12.5, 125),
])
def test_the_isolation_cap_rounds_down_and_lets_one_node_go(nodes: int, pct: float, cap: int) -> None:
    assert isolation_cap(nodes, pct) == cap


@pytest.mark.parametrize(("nodes", "isolated", "pct", "verdict"), [
    (20, 0, 10, Verdict(True)),
    (20, 1, 10, Verdict(True)),
    (20, 2, 10, Verdict(False, "2 of 20 GPU nodes are isolated by ghostgpu already; "
                               "max_isolated_nodes_pct 10 allows 2", SCOPE_CLUSTER)),
    (5, 0, 10, Verdict(True)),  # fewer nodes than 100/pct: one may go ...
    (5, 1, 10, Verdict(False, "1 of 5 GPU nodes are isolated by ghostgpu already; max_isolated_nodes_pct 10 "
                              "allows 1", SCOPE_CLUSTER)),  # ... never two
    (1, 0, 10, Verdict(True)),
    (0, 0, 10, Verdict(False, "no GPU node is known (the Kubernetes API has not listed them): no isolation")),
    (4, 9, 50, Verdict(False, "9 of 4 GPU nodes are isolated by ghostgpu already; max_isolated_nodes_pct 50 "
                              "allows 2", SCOPE_CLUSTER)),  # a stale count errs on the side of no isolation
])
def test_min_healthy_allows_one_more_isolation_only_under_the_cap(nodes: int, isolated: int, pct: float,
                                                                  verdict: Verdict) -> None:
    assert min_healthy(nodes, isolated, pct) == verdict


# ---- the mode in force ------------------------------------------------------------------------------------

OPEN = Verdict(False, "10 acts in the last 1h (max_actions 10)", SCOPE_CLUSTER)


@pytest.mark.parametrize(("config", "override", "paused", "tripped", "mode", "why"), [
    (MODE_OFF, None, False, None, MODE_OFF, "mode off (config file)"),
    (MODE_DRY_RUN, "", False, None, MODE_DRY_RUN, "mode dry-run (config file)"),
    (MODE_ON, None, False, Verdict(True), MODE_ON, "mode on (config file)"),
    (MODE_OFF, MODE_ON, False, None, MODE_ON, "mode on (ghostgpu remediate mode)"),
    (MODE_ON, MODE_OFF, False, None, MODE_OFF, "mode off (ghostgpu remediate mode)"),
    (MODE_ON, MODE_DRY_RUN, True, OPEN, MODE_DRY_RUN, "mode dry-run (ghostgpu remediate mode)"),
    (MODE_ON, None, True, None, MODE_DRY_RUN, "mode on (config file), paused (by user:alice: upgrade); acts "
     "become dry runs until `ghostgpu remediate resume`"),
    (MODE_ON, None, False, OPEN, MODE_DRY_RUN, "mode on (config file), breaker open: 10 acts in the last 1h "
     "(max_actions 10); acts become dry runs until the window moves past them"),
    (MODE_ON, None, True, OPEN, MODE_DRY_RUN, "mode on (config file), paused (by user:alice: upgrade); acts "
     "become dry runs until `ghostgpu remediate resume`"),
    (MODE_OFF, None, True, None, MODE_OFF, "mode off (config file)"),  # paused and off: still off
    (MODE_ON, "full-throttle", False, None, MODE_DRY_RUN,
     "mode 'full-throttle' (override) is not a mode; mode dry-run (ghostgpu remediate mode)"),
    (MODE_OFF, "full-throttle", False, None, MODE_OFF,
     "mode 'full-throttle' (override) is not a mode; mode off (ghostgpu remediate mode)"),
])
def test_the_mode_in_force(config: str, override: str | None, paused: bool, tripped: Verdict | None,
                           mode: str, why: str) -> None:
    eff = effective_mode(config, override, paused, "by user:alice: upgrade" if paused else "", tripped)
    assert (eff.mode, eff.why) == (mode, why)
    assert eff.held_back == (eff.asked == MODE_ON and mode != MODE_ON)
    assert eff.breaker_open == (tripped is not None and not tripped.allowed)


def test_held_back_is_the_paused_alerts_condition() -> None:
    assert effective_mode(MODE_ON, cluster_breaker=OPEN).held_back
    assert effective_mode(MODE_ON, paused=True).held_back
    assert not effective_mode(MODE_ON).held_back
    assert not effective_mode(MODE_DRY_RUN, paused=True).held_back  # nothing was to act
    assert effective_mode(MODE_OFF, MODE_ON, paused=True).source == "override"
