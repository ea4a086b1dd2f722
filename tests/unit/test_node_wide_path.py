"""A holder of node-wide devices only (nvidiactl, nvidia-uvm: no GPU) along the whole collector path:
its key, the cluster table's finding, the pushed alert's labels and texts, and `ps`/`findings`
showing `-` for its GPU."""

from __future__ import annotations

from dataclasses import replace

from ghostgpu.cli import view
from ghostgpu.collector.alertbook import alert_annotations, finding_labels
from ghostgpu.collector.cluster import ClusterTable
from ghostgpu.collector.nodes import Changes, NodeView
from ghostgpu.collector.store import Position

from ghostgpu.common.model.consumers import ClusterConsumer, ConsumerClass, K8sInfo
from ghostgpu.v1 import stream_pb2
from tests.helpers.sim_tracer import make_consumer

CID = "cc" * 32
NODE_WIDE = replace(make_consumer("n1", 4242, cls=ConsumerClass.HIDDEN, container_id=CID), gpu=None,
                    gpu_uuid="", gpu_minor=None, devices=["/dev/nvidia-uvm", "/dev/nvidiactl"],
                    reason="holds only node-wide devices /dev/nvidia-uvm (fd 4), /dev/nvidiactl (fd 3)")
K8S = K8sInfo("resolved", "team-b", "leftover-0", container="main")


def table_with(consumer: object) -> ClusterTable:
    nodes: dict[str, NodeView] = {}
    table = ClusterTable(nodes, lambda node, cid: K8S, None)
    ns = nodes["n1"] = NodeView("n1")
    ns.begin(stream_pb2.Hello(node="n1", instance_id="i"), Position("n1", "boot", "i"))
    ns.consumers[NODE_WIDE.key] = NODE_WIDE
    table.update(ns, Changes(keys=[NODE_WIDE.key]))
    return table


def test_a_finding_is_opened_under_the_key_with_no_gpu() -> None:
    table = table_with(NODE_WIDE)
    assert NODE_WIDE.key == (4242, None, "")
    [rec] = table.open["n1"].values()
    assert (rec.key, rec.cls) == (NODE_WIDE.key, "hidden")
    f = rec.to_proto()
    c = f.consumer.consumer
    assert (c.gpu, c.gpu_minor, c.gpu_uuid) == (-1, -1, "")


def test_the_alert_has_no_gpu_labels_and_says_what_an_empty_gpu_means() -> None:
    [rec] = table_with(NODE_WIDE).open["n1"].values()
    labels = finding_labels(rec.to_proto(), {})
    assert labels is not None
    assert "gpu" not in labels and "gpu_uuid" not in labels
    assert (labels["alertname"], labels["pid"], labels["pod"]) == (
        "GhostGPUHiddenConsumer", "4242", "leftover-0")
    description = alert_annotations(labels)["description"]
    assert "An empty GPU means it holds only node-wide NVIDIA devices" in description


def test_ps_and_findings_show_a_dash_for_the_gpu() -> None:
    [rec] = table_with(NODE_WIDE).open["n1"].values()
    cc = ClusterConsumer(NODE_WIDE, K8S, allocated=None)
    for text in (view.consumer_table([cc]), view.findings_table([rec.to_proto()])):
        header, row = text.splitlines()[:2]
        assert row[header.index(" GPU ") + 1:].split()[0] == "-", text
    assert view.consumers_json([cc])[0]["gpu"] is None
    assert view.finding_json(rec.to_proto())["gpu"] is None
