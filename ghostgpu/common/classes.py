"""Every consumer class in one place: what it means, which one wins, who decides it, which are findings.

A consumer (one process x one GPU) has exactly one class. Evidence is gathered in two places, and
both settle it with `highest()` over the one table below, so a class outranks another only by its
place in RULES:

- on the node, tracer/classify.py `classify()`: the allowlist, NVML's process lists, the process
  tree (a zombie leader, a container process reparented out of its container), the grace period,
  and whether the holder is in a container;
- at the collector, collector/enrich.py `enrich()`: two facts a node cannot judge alone, CRI's (the
  container exited or is unknown, or its pod sandbox is gone: orphaned) and PodResources' (the
  container was never given this GPU: unallocated), weighed against the class the node sent.

A rule is the evidence for its class alone ("holds the GPU for less than the grace period"), never
"... and no rule above holds": precedence does that, once, here. Two rules that cannot hold at once
(hidden needs a container, unattributed its absence) still get an order; no consumer reaches it.

The class names are ConsumerClass (ghostgpu.common.model), the wire's CONSUMER_CLASS_* values and
the `class` label of the metrics and alerts: a contract, extended, never renamed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from ghostgpu.common.model import ConsumerClass


class Decider(StrEnum):
    """Where a class's evidence is gathered."""

    NODE = "node"  # tracer/classify.py classify(): /proc, BPF, the cgroup and NVML on the node itself
    COLLECTOR = "collector"  # collector/enrich.py enrich(): CRI and PodResources, asked through the collector


@dataclass(frozen=True)
class ClassRule:
    cls: ConsumerClass
    meaning: str  # what the class says about the consumer, as README's "Classes" table tells users
    decided_by: tuple[Decider, ...]
    # A finding is a class a GPU team must look at: it opens a finding (history, `ghostgpu findings`),
    # a pushed alert, and per-process series on /metrics ("non-visible" there).
    finding: bool


_NODE, _COLLECTOR = (Decider.NODE,), (Decider.COLLECTOR,)

# Highest precedence first.
RULES: tuple[ClassRule, ...] = (
    ClassRule(ConsumerClass.SYSTEM,
              "an allowlisted node daemon (or the tracer itself) that holds GPU devices by design",
              _NODE, finding=False),
    ClassRule(ConsumerClass.GHOST,
              "NVML lists a PID that does not exist on the host, or whose start time shows it was "
              "reused: GPU memory held by the dead",
              _NODE, finding=True),
    ClassRule(ConsumerClass.ORPHANED,
              "a holder whose owner is gone: a zombie thread-group leader whose threads still hold the "
              "GPU, or a container process reparented outside its container (node); a container CRI "
              "reports exited or unknown, or whose pod sandbox is gone (collector)",
              (Decider.NODE, Decider.COLLECTOR), finding=True),
    ClassRule(ConsumerClass.UNALLOCATED,
              "a container holding a GPU that PodResources never allocated to it",
              _COLLECTOR, finding=True),
    ClassRule(ConsumerClass.UNKNOWN,
              "NVML cannot say whether it lists the process (no driver or library, no GPU with that "
              "device minor, or its process list failed): never a false alarm",
              _NODE, finding=False),
    ClassRule(ConsumerClass.VISIBLE,
              "NVML lists it on that GPU",
              _NODE, finding=False),
    ClassRule(ConsumerClass.PENDING,
              "holding for less than the grace period: NVML lists a new CUDA context only a moment "
              "after the device file is opened",
              _NODE, finding=False),
    ClassRule(ConsumerClass.UNATTRIBUTED,
              "a holder outside any container that NVML does not list",
              _NODE, finding=True),
    ClassRule(ConsumerClass.HIDDEN,
              "a container process holding the GPU that NVML does not list",
              _NODE, finding=True),
)

PRECEDENCE: tuple[ConsumerClass, ...] = tuple(rule.cls for rule in RULES)
# cls -> its place in PRECEDENCE, 0 the highest. highest() reads it at each call, so a test that
# reorders it sees both deciders follow.
RANK: Mapping[ConsumerClass, int] = {cls: i for i, cls in enumerate(PRECEDENCE)}
# Findings in precedence order. Members are StrEnum, so a plain class string ("hidden") tests as in.
FINDING_CLASSES: tuple[ConsumerClass, ...] = tuple(rule.cls for rule in RULES if rule.finding)
NODE_CLASSES = frozenset(rule.cls for rule in RULES if Decider.NODE in rule.decided_by)
COLLECTOR_CLASSES = frozenset(rule.cls for rule in RULES if Decider.COLLECTOR in rule.decided_by)


def highest(applicable: Iterable[ConsumerClass]) -> ConsumerClass:
    """The class that wins among those whose rules hold; ValueError when none does."""
    return min(applicable, key=RANK.__getitem__)


def outranks(a: ConsumerClass, b: ConsumerClass) -> bool:
    """Whether `a` wins over `b` when both rules hold."""
    return RANK[a] < RANK[b]


def _check() -> None:
    # Every class has exactly one rule: a class added to ConsumerClass without its place here fails
    # at import, not in a consumer's first classification.
    missing = set(ConsumerClass) - set(PRECEDENCE)
    if missing or len(PRECEDENCE) != len(set(PRECEDENCE)):
        raise AssertionError(f"classes.RULES must name every ConsumerClass once; missing {sorted(missing)}")


_check()
