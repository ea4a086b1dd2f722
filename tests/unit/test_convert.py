"""Consumer <-> ghostgpu.v1.Consumer: every field survives the trip, unknowns included."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ghostgpu.common.model.consumers import Consumer, ConsumerClass
from ghostgpu.common.wire.convert import consumer_from_proto, consumer_to_proto
from ghostgpu.v1 import node_pb2

FULL = Consumer(
    node="gpu-node-1", pid=4242, ns_pid=1, comm="python3", gpu=3, gpu_uuid="GPU-abc", gpu_minor=5,
    devices=["/dev/nvidia5", "/dev/nvidiactl"], container_id="a" * 64,
    pod_uid="1441bc39-919a-4962-bb72-ea854cbd68ff",
    runtime="containerd", cls=ConsumerClass.HIDDEN, reason="holds /dev/nvidia5", gpu_memory_bytes=0,
    exe="/usr/bin/python3", cmdline="python3 train.py", uid=1000, ppid=4200, state="S",
    start_time_ns=123_000_000, first_seen_ns=456_000_000, mapped=True, fds=[4, 7],
    cgroup_path="/kubepods.slice/x", alive=True,
)
UNKNOWNS = replace(FULL, ns_pid=None, gpu=None, gpu_minor=None, gpu_memory_bytes=None, uid=None, ppid=None,
                   start_time_ns=None, first_seen_ns=None, alive=False, gpu_uuid="", devices=[], fds=[])


# A holder of node-wide devices only: no GPU at all. An allowlisted name in a container with its places.
NODE_WIDE = replace(FULL, gpu=None, gpu_minor=None, gpu_uuid="",
                    devices=["/dev/nvidia-uvm", "/dev/nvidiactl"], cls=ConsumerClass.MONITOR)
PLACED = replace(FULL, allowlisted="dcgm-exporter", system_places=["gpu-operator", "kube-system/dcgm"])


@pytest.mark.parametrize("consumer", [FULL, UNKNOWNS, NODE_WIDE, PLACED,
                                      *(replace(FULL, cls=c) for c in ConsumerClass)])
def test_round_trip(consumer: Consumer) -> None:
    msg = consumer_to_proto(consumer)
    wire = node_pb2.Consumer.FromString(msg.SerializeToString())
    assert consumer_from_proto(wire) == consumer


def test_zero_memory_is_not_unknown() -> None:
    assert consumer_to_proto(FULL).HasField("gpu_memory_bytes")
    assert not consumer_to_proto(UNKNOWNS).HasField("gpu_memory_bytes")


def test_class_from_a_newer_peer_reads_as_unknown() -> None:
    msg = consumer_to_proto(FULL)
    setattr(msg, "class", 99)
    assert consumer_from_proto(msg).cls is ConsumerClass.UNKNOWN


def test_every_class_has_a_wire_value() -> None:
    values = {node_pb2.ConsumerClass.Name(consumer_to_proto(replace(FULL, cls=c)).__getattribute__("class"))
              for c in ConsumerClass}
    assert len(values) == len(ConsumerClass)


def test_node_wide_holder_has_no_gpu_on_the_wire() -> None:
    msg = consumer_to_proto(NODE_WIDE)
    assert (msg.gpu, msg.gpu_minor, msg.gpu_uuid) == (-1, -1, "")
    assert node_pb2.ConsumerClass.Name(getattr(msg, "class")) == "CONSUMER_CLASS_MONITOR"
    assert consumer_from_proto(msg).key == (4242, None, "")
    assert NODE_WIDE.to_json()["gpu"] is None and Consumer.from_json(NODE_WIDE.to_json()) == NODE_WIDE


def test_json_keys_are_extended_not_renamed() -> None:
    keys = list(PLACED.to_json())
    assert keys[-3:] == ["allowlisted", "system_places", "class"]
    assert Consumer.from_json({k: v for k, v in FULL.to_json().items()
                               if k not in ("allowlisted", "system_places")}) == FULL  # an older record
