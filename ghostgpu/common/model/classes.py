"""Every consumer class in one place: what it means, which one wins, who decides it, which are findings.

A consumer (one process x one GPU) has exactly one class. Evidence is gathered in two places, and
both settle it with `highest()` over the one table below, so a class outranks another only by its
place in RULES:

- on the node, tracer/classify.py `classify()`: the allowlist and where the daemon runs, NVML's
  process lists, the process tree (a zombie leader, a container process reparented out of its
  container), the grace period, the calls the holder made (monitor), and whether it is in a container;
- at the collector, collector/enrich.py `enrich()`: facts a node cannot judge alone, CRI's (the
  container exited or is unknown, or its pod sandbox is gone: orphaned; an allowlisted daemon runs in a
  namespace or container the node's config names: system) and PodResources' (the container was never
  given this GPU: unallocated), weighed against the class the node sent.

A consumer with no GPU (a process holding only node-wide devices: nvidiactl, nvidia-uvm,
nvidia-modeset, nvidia-caps/*) goes through the same rules; NVML lists processes per GPU and so never
lists it, and PodResources cannot say it was allocated.

A rule is the evidence for its class alone ("holds the GPU for less than the grace period"), never
"... and no rule above holds": precedence does that, once, here. Two rules that cannot hold at once
(hidden needs a container, unattributed its absence) still get an order; no consumer reaches it.

The class names are ConsumerClass (ghostgpu.common.model.consumers), the wire's CONSUMER_CLASS_* values and
the `class` label of the metrics and alerts: a contract, extended, never renamed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from ghostgpu.common.model.consumers import ConsumerClass


class Decider(StrEnum):
    """Where a class's evidence is gathered."""

    NODE = "node"  # tracer/classify.py classify(): /proc, BPF, the cgroup and NVML on the node itself
    COLLECTOR = "collector"  # collector/enrich.py enrich(): CRI and PodResources, asked through the collector


@dataclass(frozen=True)
class ClassRule:
    cls: ConsumerClass
    meaning: str  # what the class says about the consumer, as docs/CLASSES.md's table tells users
    decided_by: tuple[Decider, ...]
    # A finding is a class a GPU team must look at: it opens a finding (history, `ghostgpu findings`),
    # a pushed alert, and per-process series on /metrics ("non-visible" there).
    finding: bool


_NODE, _COLLECTOR = (Decider.NODE,), (Decider.COLLECTOR,)

# Highest precedence first.
RULES: tuple[ClassRule, ...] = (
    ClassRule(ConsumerClass.SYSTEM,
              "an allowlisted node daemon (matched by executable path or name) that holds GPU devices by "
              "design, running on the host itself (node) or in a Kubernetes namespace or container the "
              "tracer's system_namespaces or system_containers name (collector, by CRI's names); or the "
              "tracer itself. A same-named process elsewhere keeps its real class, its reason noting the "
              "name it impersonates",
              (Decider.NODE, Decider.COLLECTOR), finding=False),
    ClassRule(ConsumerClass.GHOST,
              "NVML lists a PID that does not exist on the host, whose start time shows it was reused, or "
              "that holds no GPU device file (a CUDA process keeps its own open for life, so the PID now "
              "belongs to another process), and no MPS server holds that GPU: GPU memory held by the dead",
              _NODE, finding=True),
    ClassRule(ConsumerClass.ORPHANED,
              "a holder whose owner is gone: a zombie thread-group leader whose threads still hold the "
              "GPU, or a container process reparented outside its container (node); a container CRI "
              "reports exited or unknown, or whose pod sandbox is gone (collector)",
              (Decider.NODE, Decider.COLLECTOR), finding=True),
    ClassRule(ConsumerClass.UNALLOCATED,
              "a container holding a GPU that PodResources never allocated to it",
              _COLLECTOR, finding=True),
    ClassRule(ConsumerClass.VISIBLE,
              "NVML lists it on that GPU (an MPS client: while an MPS server holds that GPU)",
              _NODE, finding=False),
    ClassRule(ConsumerClass.PENDING,
              "holding for less than the grace period, which every class below waits out: NVML lists a "
              "new CUDA context only a moment after the device file is opened",
              _NODE, finding=False),
    ClassRule(ConsumerClass.MONITOR,
              "a holder that, watched since its first open, allocated no memory, channel or compute class "
              "and mapped no device memory: it only reads the GPU's state (nvidia-smi, nvitop, gpustat, "
              "dcgm-exporter); counted and shown, no alert by default",
              _NODE, finding=False),
    ClassRule(ConsumerClass.UNKNOWN,
              "NVML cannot say whether it lists the process (no driver or library, no GPU with that "
              "device minor, or its process list failed): never a false alarm",
              _NODE, finding=False),
    ClassRule(ConsumerClass.UNATTRIBUTED,
              "a holder of a GPU, or of node-wide devices only, outside any container that NVML does not "
              "list (and that allocated, mapped device memory, or was not watched since its first open)",
              _NODE, finding=True),
    ClassRule(ConsumerClass.HIDDEN,
              "a container process holding a GPU, or node-wide devices only, that NVML does not list (and "
              "that allocated, mapped device memory, or was not watched since its first open)",
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
