"""ClusterTable.revalidate: every container that has a consumer is asked of the resolver again each
second, so a container that stops under a holder that outlived it turns the holder orphaned though
nothing on its node changed (the resolver's refresh comes back through on_cri_change)."""

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


class Resolver:
    """A CRI cache as the table sees it: what it answers now, and every container it was asked for."""

    def __init__(self) -> None:
        self.answer = RUNNING
        self.asked: list[tuple[str, str]] = []

    def get(self, node: str, cid: str) -> K8sInfo:
        self.asked.append((node, cid))
        return self.answer


def test_a_stopped_container_is_asked_again_and_its_holder_turns_orphaned() -> None:
    nodes: dict[str, NodeView] = {}
    cri = Resolver()
    table = ClusterTable(nodes, cri.get, None)
    assert table.revalidate() == 0  # nothing held: nothing asked
    ns = nodes["n1"] = NodeView("n1")
    ns.begin(stream_pb2.Hello(node="n1", instance_id="i"), Position("n1", "boot", "i"))
    holder = make_consumer("n1", 4242, cls=ConsumerClass.HIDDEN, container_id=CID)
    ns.consumers[holder.key] = holder
    table.update(ns, Changes(keys=[holder.key]))
    assert [r.cls for r in table.open["n1"].values()] == ["hidden"]

    cri.asked.clear()
    assert table.revalidate() == 1 and cri.asked == [("n1", CID)]
    cri.answer = EXITED  # the refresh came back changed: the resolver says so through on_cri_change
    table.on_cri_change("n1", CID)
    assert [r.cls for r in table.open["n1"].values()] == ["orphaned"]
