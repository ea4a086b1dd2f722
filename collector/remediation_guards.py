"""Remediation's guards (docs/REMEDIATION.md, "Guards"), each a pure function of what the engine read:
no clock, no store, no I/O, so each is table-tested (tests/unit/test_remediation_guards.py) and the
engine (collector/remediation.py) and node isolation (collector/isolation.py) ask the same ones.

    eligible(candidate, policy, now_unix_ns, capabilities, node_labels)  # None, or why it is no candidate
    breaker(count_acts(acts, window_s, now_unix_ns), policy.breaker, node)  # Verdict: allowed, or why not
    min_healthy(gpu_nodes, isolated_nodes, policy.breaker.max_isolated_nodes_pct)  # one more isolation?
    effective_mode(config_mode, override, paused, pause_reason, cluster_breaker)  # the mode in force, why

Every "why not" is one line an operator can act on; it becomes an incident's `reason` and the audit
record's detail.

minHealthy rounds down and lets one node go: at most max(1, floor(gpu_nodes * pct / 100)) GPU nodes
are isolated by ghostgpu at once, so 10% of 25 nodes is 2, of 15 nodes 1, and of 5 nodes (fewer than
100/pct) still 1: a small cluster can isolate its one broken node, which serves no GPU pod anyway,
but never two. No GPU node known (the Kubernetes API not read yet): no isolation.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from ghostgpu.collector.remediation_policy import Breaker, RemediationPolicy

from ghostgpu.common.model.consumers import ConsumerClass
from ghostgpu.common.model.durations import format_s
from ghostgpu.common.model.remediation import (
    CAPABILITY,
    MODE_DRY_RUN,
    MODE_OFF,
    MODE_ON,
    MODES,
    OPT_OUT_LABEL,
)

OPT_IN_VALUE = "on"  # the one value of OPT_OUT_LABEL that leaves a node in; any other keeps hands off it
SCOPE_CLUSTER, SCOPE_NODE = "cluster", "node"


def _ago(seconds: float) -> str:
    """A short duration for a reason line: 5m, 1h, 42s, 1500ms."""
    return format_s(seconds) if seconds > 0 else "0s"


# ---- eligibility ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """What eligibility looks at in one finding (collector/cluster.py's FindingRec and its consumer)."""

    finding_id: int
    node: str
    cls: str  # its class (ghostgpu.common.model.consumers.ConsumerClass)
    opened_unix_ns: int
    resolved_unix_ns: int = 0  # 0: open
    namespace: str = ""  # "" when no pod is known: include ["*"] admits it
    exe: str = ""  # the executable's path, as the tracer read /proc/PID/exe
    comm: str = ""
    container_id: str = ""  # "": a host process (no container)
    pod_uid: str = ""  # "": no Kubernetes pod (a host process, or a container outside any pod)


def allowlisted(policy: RemediationPolicy, exe: str, comm: str) -> str | None:
    """The allowlist glob that matches the process (its exe path, the exe's name or its comm), or None."""
    names = [n for n in (exe, os.path.basename(exe), comm) if n]
    return next((g for g in policy.allowlist if any(fnmatchcase(n, g) for n in names)), None)


def node_opt_out(node: str, capabilities: Collection[str] | None,
                 node_labels: Mapping[str, str] | None) -> str | None:
    """Why `node` takes no part, or None: its tracer must offer CAPABILITY in its Hello (None: no tracer
    connected), and its Node must not carry OPT_OUT_LABEL with any value but "on" (None: its labels
    are not known, as without the Kubernetes API; the tracer's own switch still holds)."""
    if capabilities is None:
        return f"node {node} has no tracer connected to act through"
    if CAPABILITY not in capabilities:
        return (f"node {node} opted out: its tracer does not offer {CAPABILITY} (tracer --remediation off, "
                "or a tracer older than remediation)")
    if node_labels is not None and OPT_OUT_LABEL in node_labels:
        value = node_labels[OPT_OUT_LABEL]
        if value.strip().lower() != OPT_IN_VALUE:
            return f"node {node} opted out: label {OPT_OUT_LABEL}={value}"
    return None


def eligible(c: Candidate, policy: RemediationPolicy, now_unix_ns: int, capabilities: Collection[str] | None,
             node_labels: Mapping[str, str] | None = None) -> str | None:
    """None when the finding is a candidate for action 1 (kill the orphan); else why not, one line. The
    checks go from the finding to its node: the action on, the class orphaned, the finding open and
    in a Kubernetes pod (a container and a pod UID), at least min_age old, its namespace admitted,
    its process not allowlisted, its node taking part."""
    fid = f"finding {c.finding_id}"
    if not policy.kill_orphans:
        return "actions.kill_orphans is false"
    if c.cls != ConsumerClass.ORPHANED:
        return f"{fid} is {c.cls}, not {ConsumerClass.ORPHANED}: only orphaned holders are acted on"
    if c.resolved_unix_ns:
        return f"{fid} is resolved"
    if not c.container_id or not c.pod_uid:
        # The tracer re-checks the holder against CRI by its pod: without one there is nothing to
        # corroborate, and a host process or a container CRI does not run is never killed.
        missing = "container" if not c.container_id else "pod UID"
        return f"{fid} has no {missing}: no pod to corroborate: only a Kubernetes pod's orphan is killed"
    age_s = (now_unix_ns - c.opened_unix_ns) / 1e9
    if age_s < policy.min_age_s:
        shown = _ago(math.floor(age_s)) if age_s >= 1 else _ago(max(age_s, 0.0))  # 299s, not 299.6s
        return f"{fid} is {shown} old, under min_age {_ago(policy.min_age_s)}"
    ns = policy.namespaces
    if not ns.admits(c.namespace):
        shown = repr(c.namespace) if c.namespace else "'' (no pod known)"
        return (f"namespace {shown} is not admitted (namespaces include [{', '.join(ns.include)}], "
                f"exclude [{', '.join(ns.exclude)}])")
    glob = allowlisted(policy, c.exe, c.comm)
    if glob is not None:
        return f"{c.exe or c.comm} is allowlisted ({glob!r})"
    return node_opt_out(c.node, capabilities, node_labels)


# ---- the circuit breaker ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """A guard's answer: allowed, or not and why (one line); `scope` says whether a breaker holds the
    whole cluster (SCOPE_CLUSTER: everything becomes dry-run, the paused alert fires) or one node."""

    allowed: bool
    reason: str = ""
    scope: str = ""

    @classmethod
    def ok(cls) -> Verdict:
        return cls(True)


@dataclass(frozen=True)
class ActCounts:
    """Acts (not dry runs) within the breaker's window: in all, and per node."""

    total: int = 0
    by_node: Mapping[str, int] = field(default_factory=dict)


def count_acts(acts: Iterable[tuple[int, str]], window_s: float, now_unix_ns: int) -> ActCounts:
    """ActCounts of (acted_unix_ns, node) pairs: those later than now - window. One stamped after `now`
    (another replica's clock ahead of this one's) counts: the breaker errs on the side of acting less."""
    since_ns = now_unix_ns - int(window_s * 1e9)
    nodes = Counter(node for at_ns, node in acts if at_ns > since_ns)
    return ActCounts(sum(nodes.values()), dict(nodes))


def breaker(counts: ActCounts, b: Breaker, node: str | None = None) -> Verdict:
    """Whether one more act is allowed: fewer than max_actions in the window cluster-wide, and (for a
    `node`) fewer than max_per_node on it. The cluster's limit is said first: it holds every node."""
    window = _ago(b.window_s)
    if counts.total >= b.max_actions:
        return Verdict(False, f"{counts.total} acts in the last {window} (max_actions {b.max_actions})",
                       SCOPE_CLUSTER)
    if node is not None:
        on_node = counts.by_node.get(node, 0)
        if on_node >= b.max_per_node:
            return Verdict(False, f"{on_node} acts on node {node} in the last {window} (max_per_node "
                                  f"{b.max_per_node})", SCOPE_NODE)
    return Verdict.ok()


# ---- minHealthy -------------------------------------------------------------------------------------------


def isolation_cap(gpu_nodes: int, pct: float) -> int:
    """GPU nodes ghostgpu may hold isolated at once: pct of them rounded down, at least 1 (none with no
    GPU node). The 1e-9 keeps 10% of 30 at 3 where floating point makes it 2.9999999999999996."""
    if gpu_nodes <= 0:
        return 0
    return max(1, math.floor(gpu_nodes * pct / 100 + 1e-9))


def min_healthy(gpu_nodes: int, isolated: int, pct: float) -> Verdict:
    """Whether ghostgpu may isolate one more GPU node, `isolated` of `gpu_nodes` being isolated by it
    already (its taint or its cordon; nodes others cordoned do not count)."""
    if gpu_nodes <= 0:
        return Verdict(False, "no GPU node is known (the Kubernetes API has not listed them): no isolation")
    cap = isolation_cap(gpu_nodes, pct)
    if isolated >= cap:
        return Verdict(False, f"{isolated} of {gpu_nodes} GPU nodes are isolated by ghostgpu already; "
                              f"max_isolated_nodes_pct {pct:g} allows {cap}", SCOPE_CLUSTER)
    return Verdict.ok()


# ---- the mode in force ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EffectiveMode:
    """The mode remediation runs in now, and why: the one asked for (the override of `ghostgpu remediate
    mode`, else the config file's), held back to dry-run while paused or while the breaker is open."""

    mode: str  # off | dry-run | on
    why: str  # one line
    asked: str  # the mode asked for: the override's, else the config's
    source: str  # "config" or "override"
    paused: bool = False
    breaker_open: bool = False

    @property
    def held_back(self) -> bool:
        """Mode on was asked for and is not in force (paused, or the breaker open): the
        GhostGPURemediationPaused alert's condition."""
        return self.asked == MODE_ON and self.mode != MODE_ON


def effective_mode(config_mode: str, override: str | None = None, paused: bool = False,
                   pause_reason: str = "", cluster_breaker: Verdict | None = None) -> EffectiveMode:
    """The mode in force. `override`: what `ghostgpu remediate mode` set ("" or None: none, the config
    file's mode holds); one that is not a mode (a row a newer or broken writer left) is not trusted
    beyond dry-run. `cluster_breaker`: breaker(counts, b) without a node."""
    source, asked = ("override", override) if override else ("config", config_mode)
    note = ""
    if asked not in MODES:
        note = f"mode {asked!r} ({source}) is not a mode; "
        fallback = config_mode if config_mode in MODES else MODE_OFF
        asked = MODE_DRY_RUN if fallback == MODE_ON else fallback
    said = f"{note}mode {asked} ({'ghostgpu remediate mode' if source == 'override' else 'config file'})"
    tripped = cluster_breaker is not None and not cluster_breaker.allowed
    if asked != MODE_ON:
        return EffectiveMode(asked, said, asked, source, paused, tripped)
    if paused:
        why = f"paused ({pause_reason})" if pause_reason else "paused"
        return EffectiveMode(MODE_DRY_RUN, f"{said}, {why}; acts become dry runs until `ghostgpu remediate "
                                           "resume`", asked, source, True, tripped)
    if cluster_breaker is not None and tripped:
        why = f"breaker open: {cluster_breaker.reason}; acts become dry runs until the window moves past them"
        return EffectiveMode(MODE_DRY_RUN, f"{said}, {why}", asked, source, False, True)
    return EffectiveMode(MODE_ON, said, asked, source)
