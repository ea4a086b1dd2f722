"""ghostgpu.common.model.classes is the one precedence both classifiers apply: for every set of rules that
hold at once, the node's classify() and the collector's enrich() pick the class the table ranks
highest, and reordering the table reorders both."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import pytest
from ghostgpu.collector.alertbook import FINDING_ALERTS
from ghostgpu.collector.enrich import allocations_from, enrich
from ghostgpu.tracer.classify import ClassifyConfig, classify
from ghostgpu.tracer.config import TracerConfig
from ghostgpu.tracer.events import DeviceHold, GpuWork, Holder, NvmlGpu, NvmlProcess, NvmlView, ProcessInfo

from ghostgpu.common.model import classes
from ghostgpu.common.model.consumers import Consumer, ConsumerClass, DeviceKind, DeviceRef, K8sInfo

C = ConsumerClass
S = 1_000_000_000
NOW = 100 * S
PID = 100
UUID0 = "GPU-00000000-aaaa"
CID = "c" * 64
NV0 = DeviceRef("/dev/nvidia0", DeviceKind.GPU, 0, 195, 0)
CFG = replace(ClassifyConfig.of(TracerConfig(node_name="node-a", grace_s=2.0)),
              boot_ns_of_ticks=lambda ticks: ticks * 10_000_000)
# The node's evidence, one switch per rule; a scenario turns on any subset of them.
NODE_SWITCHES = ("system", "ghost", "orphaned", "unknown", "listed", "pending", "monitor", "container")


def test_the_table_names_every_class_once_in_its_order() -> None:
    # unknown waits out the grace period (pending first); monitor replaces hidden/unattributed but not
    # a listing (visible), nor anything a team must look at above it.
    assert classes.PRECEDENCE == (C.SYSTEM, C.GHOST, C.ORPHANED, C.UNALLOCATED, C.VISIBLE, C.PENDING,
                                  C.MONITOR, C.UNKNOWN, C.UNATTRIBUTED, C.HIDDEN)
    assert set(classes.PRECEDENCE) == set(ConsumerClass)
    assert all(rule.meaning and rule.decided_by for rule in classes.RULES)
    assert {C.SYSTEM, C.ORPHANED, C.UNALLOCATED} == classes.COLLECTOR_CLASSES
    assert set(ConsumerClass) - {C.UNALLOCATED} == classes.NODE_CLASSES


def test_findings_are_the_classes_a_team_must_look_at() -> None:
    assert set(classes.FINDING_CLASSES) == {"hidden", "ghost", "orphaned", "unallocated", "unattributed"}
    assert set(FINDING_ALERTS) == set(classes.FINDING_CLASSES)  # every finding class has its alert
    # Plain strings (a store row's class, a metrics label) test as members too.
    assert "hidden" in classes.FINDING_CLASSES and "visible" not in classes.FINDING_CLASSES
    assert "hidden" in frozenset(classes.FINDING_CLASSES)


def test_highest() -> None:
    assert classes.highest([C.HIDDEN, C.PENDING, C.ORPHANED]) is C.ORPHANED
    assert classes.highest({C.VISIBLE: "reason"}) is C.VISIBLE
    assert classes.outranks(C.UNALLOCATED, C.UNKNOWN) and not classes.outranks(C.HIDDEN, C.PENDING)
    with pytest.raises(ValueError):
        classes.highest([])


# ---- the node: classify() ----------------------------------------------------------------------

def node_scenario(on: frozenset[str]) -> tuple[list[Holder], NvmlView, dict[int, int], set[ConsumerClass]]:
    """(holders, NVML view, the PIDs that exist, the classes whose rules hold) for the switches `on`."""
    info = ProcessInfo(pid=PID, comm="nv-hostengine" if "system" in on else "python3", start_ticks=1000,
                       ppid=50, parent_comm="containerd-shim", state="Z" if "orphaned" in on else "S",
                       threads=1, container_id=CID if "container" in on else "", parent_container_id="")
    seen_ns = NOW - (S // 2 if "pending" in on else 10 * S)
    holder = Holder(info, {NV0.path: DeviceHold(NV0, {5}, False, seen_ns, "bpf")},
                    gpu_work=GpuWork(False) if "monitor" in on else None)
    listed = "listed" in on or "ghost" in on  # a ghost is a listing whose PID is gone
    gpu = NvmlGpu(0, UUID0, 0, processes=(NvmlProcess(PID, 1 << 30, "compute"),) if listed else (),
                  processes_known="unknown" not in on)
    exists = {} if "ghost" in on else {PID: 1000}
    holding = {C.SYSTEM: "system" in on, C.GHOST: "ghost" in on, C.ORPHANED: "orphaned" in on,
               C.UNKNOWN: "unknown" in on, C.VISIBLE: listed, C.PENDING: "pending" in on,
               C.MONITOR: "monitor" in on,
               C.HIDDEN: "container" in on, C.UNATTRIBUTED: "container" not in on}
    view = NvmlView(True, NOW, "595.45.04", (gpu,))
    return [holder], view, exists, {c for c, held in holding.items() if held}


def node_scenarios() -> Iterator[tuple[frozenset[str], set[ConsumerClass]]]:
    for n in range(len(NODE_SWITCHES) + 1):
        for on in itertools.combinations(NODE_SWITCHES, n):
            yield frozenset(on), node_scenario(frozenset(on))[3]


def classify_one(on: frozenset[str]) -> Consumer:
    holders, view, exists, _ = node_scenario(on)
    # An allowlisted name is system on the host only; the tracer itself is system wherever it runs.
    cfg = replace(CFG, own_pids=frozenset({PID})) if "system" in on else CFG
    [consumer] = classify(holders, view, NOW, cfg, "n1", exists.get)
    return consumer


def winner(applicable: set[ConsumerClass], rank: Mapping[ConsumerClass, int]) -> ConsumerClass:
    return min(applicable, key=rank.__getitem__)


def test_classify_picks_the_highest_rule_that_holds() -> None:
    for on, applicable in node_scenarios():
        got = classify_one(on).cls
        assert got == winner(applicable, classes.RANK), (sorted(on), applicable)
        # Said pairwise: whenever two rules hold, the higher one wins.
        for a, b in itertools.permutations(applicable, 2):
            if classes.outranks(a, b):
                assert got != b, (sorted(on), a, b)


# ---- the collector: enrich() -------------------------------------------------------------------

RUNNING = K8sInfo(resolution="resolved", namespace="ml", pod="p-0", container="cuda",
                  container_state="CONTAINER_RUNNING", sandbox_state="SANDBOX_READY", runtime="containerd")
EXITED = K8sInfo(resolution="resolved", namespace="ml", pod="p-0", container="cuda",
                 container_state="CONTAINER_EXITED", sandbox_state="SANDBOX_READY", runtime="containerd")
MINE = allocations_from([("ml", "p-0", "cuda", [UUID0])])
OTHER = allocations_from([("ml", "p-0", "cuda", ["GPU-ffffffff-0000"])])


CollectorScenario = tuple[ConsumerClass, bool, bool, bool, set[ConsumerClass]]


def collector_scenarios() -> Iterator[CollectorScenario]:
    """(the node's class, CRI says orphaned, PodResources says unallocated, CRI places an allowlisted
    daemon where the node's config admits it, the classes that hold)."""
    for node_cls, orphan, unallocated, placed in itertools.product(ConsumerClass, *[(False, True)] * 3):
        applicable = {node_cls, *([C.ORPHANED] if orphan else []), *([C.UNALLOCATED] if unallocated else []),
                      *([C.SYSTEM] if placed else [])}
        yield node_cls, orphan, unallocated, placed, applicable


def enrich_one(node_cls: ConsumerClass, orphan: bool, unallocated: bool, placed: bool) -> Consumer:
    node = Consumer(node="n1", pid=PID, ns_pid=7, comm="python3", gpu=0, gpu_uuid=UUID0, gpu_minor=0,
                    devices=["/dev/nvidia0"], container_id=CID, pod_uid="", runtime="containerd",
                    cls=node_cls, reason="the node's reason", gpu_memory_bytes=None,
                    allowlisted="dcgm-exporter", system_places=["ml/cuda" if placed else "gpu-operator"])
    out, _ = enrich(node, EXITED if orphan else RUNNING, OTHER if unallocated else MINE)
    return out


ENRICH_REASONS = {C.ORPHANED: "CRI (containerd) reports container cuda exited",
                  C.UNALLOCATED: "PodResources did not allocate GPU 0",
                  C.SYSTEM: "allowlisted node daemon dcgm-exporter (python3) in container cuda of pod ml/p-0"}


def test_enrich_picks_the_highest_rule_that_holds() -> None:
    for node_cls, orphan, unallocated, placed, applicable in collector_scenarios():
        out = enrich_one(node_cls, orphan, unallocated, placed)
        want = winner(applicable, classes.RANK)
        assert out.cls == want, (node_cls, orphan, unallocated, placed)
        if want == node_cls:
            assert out.reason == "the node's reason"  # the node's verdict stands with its evidence
        else:
            assert out.reason.startswith(ENRICH_REASONS[want]), out.reason


def test_every_pair_of_rules_that_can_hold_at_once_is_exercised() -> None:
    pairs = {frozenset(p) for _, applicable in node_scenarios()
             for p in itertools.combinations(applicable, 2)}
    pairs |= {frozenset(p) for *_, applicable in collector_scenarios()
              for p in itertools.combinations(applicable, 2)}
    every = {frozenset(p) for p in itertools.combinations(ConsumerClass, 2)}
    assert every - pairs == {frozenset({C.HIDDEN, C.UNATTRIBUTED})}  # in a container, or not


def test_both_follow_the_table_when_it_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """No second copy of the order hides in either classifier: reversed, both follow it."""
    reversed_rank = {cls: -rank for cls, rank in classes.RANK.items()}
    monkeypatch.setattr(classes, "RANK", reversed_rank)
    for on, applicable in node_scenarios():
        assert classify_one(on).cls == winner(applicable, reversed_rank), sorted(on)
    for node_cls, orphan, unallocated, placed, applicable in collector_scenarios():
        assert enrich_one(node_cls, orphan, unallocated, placed).cls == winner(applicable, reversed_rank)


def test_the_documented_class_table_is_the_table_here() -> None:
    """docs/CLASSES.md's table names every class once, in precedence order, findings marked."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "CLASSES.md").read_text()
    rows = [line.split("|")[1:-1] for line in doc.splitlines() if line.startswith("| `")]
    assert [cells[0].strip().strip("`") for cells in rows] == [str(c) for c in classes.PRECEDENCE]
    for cells in rows:
        cls = ConsumerClass(cells[0].strip().strip("`"))
        assert (cells[1].strip() == "yes") is (cls in classes.FINDING_CLASSES), f"{cls}: finding column"


def test_the_readme_names_every_class_and_links_the_table() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("### Classes", 1)[1].split("\n### ", 1)[0]
    assert "(docs/CLASSES.md)" in section
    assert [c for c in classes.PRECEDENCE if f"`{c}`" not in section] == []
