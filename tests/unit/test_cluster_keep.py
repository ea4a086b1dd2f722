"""ClusterTable hands the resolver keep(node, container) when a container's first consumer comes, once
per container: the resolver then refreshes that answer every ttl by itself (collector/cri.py), and a
changed answer (the container stopped under a holder that outlived it) comes back through
on_cri_change, turning the holder orphaned though nothing on its node changed."""

from __future__ import annotations

from ghostgpu.collector.cluster import ClusterTable
from ghostgpu.collector.nodes import Changes, NodeView
from ghostgpu.collector.store import Position

from ghostgpu.common.model.consumers import ConsumerClass, K8sInfo
from ghostgpu.v1 import stream_pb2
from tests.helpers.sim_tracer import make_consumer

CID = "dd" * 32
RUNNING = K8sInfo("resolved", "ml", "train-0", container="main", container_state="CONTAINER_RUNNING",
                  sandbox_state="SANDBOX_READY")
EXITED = K8sInfo("resolved", "ml", "train-0", container="main", container_state="CONTAINER_EXITED",
                 sandbox_state="SANDBOX_READY")


def test_a_containers_first_consumer_keeps_its_answer_and_its_stop_turns_the_holder_orphaned() -> None:
    nodes: dict[str, NodeView] = {}
    answer = [RUNNING]
    kept: list[tuple[str, str]] = []
    table = ClusterTable(nodes, lambda node, cid: answer[0], None,
                         keep=lambda node, cid: kept.append((node, cid)))
    ns = nodes["n1"] = NodeView("n1")
    ns.begin(stream_pb2.Hello(node="n1", instance_id="i"), Position("n1", "boot", "i"))
    holders = [make_consumer("n1", pid, cls=ConsumerClass.HIDDEN, container_id=CID) for pid in (4242, 4243)]
    for h in holders:
        ns.consumers[h.key] = h
        table.update(ns, Changes(keys=[h.key]))
    assert kept == [("n1", CID)]  # once, for the first of its consumers
    assert sorted(r.cls for r in table.open["n1"].values()) == ["hidden", "hidden"]

    answer[0] = EXITED  # the resolver's own refresh found it stopped: it says so through on_cri_change
    table.on_cri_change("n1", CID)
    assert sorted(r.cls for r in table.open["n1"].values()) == ["orphaned", "orphaned"]
