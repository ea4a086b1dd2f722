"""The collector's picture of the cluster: snapshots, events applied once, the final class from CRI
and PodResources, the findings lifecycle, watches, filters, node status and the event log.

CRI answers come from a small in-test resolver (a dict), so names are known at once; the real
resolver through a tracer's relay is in test_collector_cri.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from ghostgpu.collector import cluster as cluster_module
from ghostgpu.collector.main import Collector

from ghostgpu.common.model.consumers import ConsumerClass, K8sInfo
from ghostgpu.v1 import node_pb2, query_pb2, stream_pb2
from tests.helpers.collector_env import QueryClient, running_collector
from tests.helpers.polling import wait_until
from tests.helpers.sim_tracer import SimTracer, allocations, finding, holder, make_consumer, resolved

HIDDEN, VISIBLE = node_pb2.CONSUMER_CLASS_HIDDEN, node_pb2.CONSUMER_CLASS_VISIBLE
CID_A, CID_B, CID_C = "aa" * 32, "bb" * 32, "cc" * 32


class DictResolver:
    """K8sInfo by container ID; `set()` changes an answer and tells the collector, as CRI would."""

    def __init__(self, transport_for: Any, on_change: Any) -> None:
        self.on_change = on_change
        self.answers: dict[str, K8sInfo] = {
            CID_A: K8sInfo("resolved", "team-a", "train-0", "uid-a", "trainer", "img:1", "CONTAINER_RUNNING",
                           "SANDBOX_READY", runtime="containerd 1.6.20"),
            CID_B: K8sInfo("resolved", "team-b", "infer-0", "uid-b", "server", "img:2", "CONTAINER_RUNNING",
                           "SANDBOX_READY", runtime="containerd 1.6.20"),
        }

    def get(self, node: str, container_id: str) -> K8sInfo:
        return self.answers.get(container_id, K8sInfo("unresolved", error="CRI lookup pending"))

    def set(self, node: str, container_id: str, info: K8sInfo) -> None:
        self.answers[container_id] = info
        self.on_change(node, container_id)


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[Collector]:
    with running_collector(tmp_path, resolver_factory=DictResolver) as c:
        yield c


@pytest.fixture
def q(collector: Collector) -> Iterator[QueryClient]:
    with QueryClient(collector.address) as client:
        yield client


def _pids(rows: list[query_pb2.ClusterConsumer]) -> list[int]:
    return [r.consumer.process.pid for r in rows]


def test_snapshot_replaces_the_nodes_consumers(collector: Collector, q: QueryClient) -> None:
    a, b, c = (make_consumer("n1", pid, container_id=cid)
               for pid, cid in ((1, CID_A), (2, CID_B), (3, CID_C)))
    with SimTracer(collector.address, "n1") as t:
        t.connect()
        t.send_snapshot([a, b], seq=0)
        t.send_events([holder(1, 1)])
        t.wait_acked(1)
        assert _pids(q.consumers()) == [1, 2]
        t.send_snapshot([b, c], seq=1)
        t.send_events([holder(2, 1)])
        t.wait_acked(2)
        assert _pids(q.consumers()) == [2, 3]
        assert q.node("n1").consumers == 2


def test_events_the_snapshot_already_holds_are_stored_not_applied(collector: Collector,
                                                                   q: QueryClient) -> None:
    a, x = make_consumer("n1", 1, container_id=CID_A), make_consumer("n1", 9, container_id=CID_B)
    with SimTracer(collector.address, "n1") as t:
        t.connect()
        t.send_snapshot([a], seq=10)  # reflects seqs 1..10
        t.send_events([finding(9, x), resolved(10, a), finding(11, replace(a, comm="after"))])
        t.wait_acked(11)
        rows = q.consumers()
        assert _pids(rows) == [1] and rows[0].consumer.process.comm == "after"
        assert [e.event.seq for e in q.events(node="n1", instance_id=t.instance_id)] == [9, 10, 11]


def test_final_class_and_names_from_cri_and_podresources(collector: Collector, q: QueryClient) -> None:
    gpu0 = make_consumer("n1", 1, gpu=0, cls=ConsumerClass.VISIBLE, container_id=CID_A)
    gpu1 = make_consumer("n1", 2, gpu=1, cls=ConsumerClass.VISIBLE, container_id=CID_B)
    with SimTracer(collector.address, "n1") as t:
        t.connect()
        alloc = allocations([("team-a", "train-0", "trainer", [gpu0.gpu_uuid]),
                             ("team-b", "infer-0", "server", ["GPU-somebody-else"])])
        t.send_snapshot([gpu0, gpu1], seq=0, allocations=alloc)
        t.send_events([holder(1, 1)])
        t.wait_acked(1)
        by_pid = {r.consumer.process.pid: r for r in q.consumers()}
        k8s = by_pid[1].k8s
        assert (k8s.namespace, k8s.pod, k8s.container) == ("team-a", "train-0", "trainer")
        assert by_pid[1].allocated == query_pb2.ALLOCATED_TRUE
        assert getattr(by_pid[1].consumer, "class") == VISIBLE
        assert by_pid[2].allocated == query_pb2.ALLOCATED_FALSE
        assert getattr(by_pid[2].consumer, "class") == node_pb2.CONSUMER_CLASS_UNALLOCATED
        assert by_pid[2].node_class == VISIBLE
        assert "PodResources did not allocate GPU 1" in by_pid[2].consumer.reason
        # CRI now says pod infer-0's container exited: orphaned outranks unallocated.
        gone = K8sInfo("resolved", "team-b", "infer-0", "uid-b", "server", "img:2", "CONTAINER_EXITED",
                       "SANDBOX_READY", runtime="containerd 1.6.20", container_reason="Error", exit_code=137)
        collector.resolver.set("n1", CID_B, gone)
        orphaned = node_pb2.CONSUMER_CLASS_ORPHANED
        wait_until(lambda: getattr(q.consumers(pod="infer-0")[0].consumer, "class") == orphaned,
                   "pid 2 to turn orphaned")
        assert "exited (reason Error, exit code 137)" in q.consumers(pod="infer-0")[0].consumer.reason


def test_filters_by_node_namespace_pod_and_class(collector: Collector, q: QueryClient) -> None:
    for node, pid in (("n1", 1), ("n2", 2)):
        with SimTracer(collector.address, node) as t:
            t.connect()
            t.send_snapshot([make_consumer(node, pid, container_id=CID_A),
                             make_consumer(node, pid + 10, container_id=CID_B, cls=ConsumerClass.VISIBLE),
                             make_consumer(node, pid + 20, cls=ConsumerClass.UNATTRIBUTED)], seq=0)
            t.send_events([holder(1, 1)])
            t.wait_acked(1)
    assert _pids(q.consumers()) == [1, 11, 21, 2, 12, 22]
    assert _pids(q.consumers(node="n2")) == [2, 12, 22]
    assert _pids(q.consumers(namespace="team-a")) == [1, 2]
    assert _pids(q.consumers(node="n1", pod="infer-0")) == [11]
    assert _pids(q.consumers(classes=[HIDDEN, node_pb2.CONSUMER_CLASS_UNATTRIBUTED])) == [1, 21, 2, 22]
    assert q.consumers(namespace="nobody") == []


def test_findings_open_change_resolve_and_stay_in_history(collector: Collector, q: QueryClient) -> None:
    a = make_consumer("n1", 1, container_id=CID_A)
    b = make_consumer("n1", 2, container_id=CID_B)
    with SimTracer(collector.address, "n1") as t:
        t.connect()
        t.send_events([finding(1, a), finding(2, b)])
        t.send_events([finding(3, replace(a, gpu_memory_bytes=1 << 30))])  # changed, still hidden
        t.send_events([finding(4, replace(b, cls=ConsumerClass.VISIBLE))])  # no longer a finding
        t.send_events([resolved(5, a)])
        t.wait_acked(5)
    history = q.findings()
    assert [(f.id, f.consumer.consumer.process.pid) for f in history] == [(1, 1), (2, 2)]
    assert all(f.resolved_unix_ns >= f.opened_unix_ns > 0 for f in history)
    assert history[0].consumer.consumer.gpu_memory_bytes == 1 << 30  # its latest state
    assert history[0].consumer.k8s.namespace == "team-a"
    assert [f.id for f in q.findings(namespace="team-b")] == [2]
    assert q.findings(node="n2") == [] and q.findings(classes=[VISIBLE]) == []
    assert [f.id for f in q.findings(limit=1)] == [2]  # the newest
    assert q.findings(since_unix_ns=max(f.resolved_unix_ns for f in history) + 1) == []
    assert [f.id for f in q.findings(since_unix_ns=history[0].resolved_unix_ns)] == [1]


def test_watch_findings_replays_open_ones_then_streams_changes(collector: Collector, q: QueryClient) -> None:
    a, b = make_consumer("n1", 1, container_id=CID_A), make_consumer("n1", 2, container_id=CID_B)
    with SimTracer(collector.address, "n1") as t:
        t.connect()
        t.send_events([finding(1, a)])
        t.wait_acked(1)
        everything, team_b = q.watch(include_open=True), q.watch(namespace="team-b")
        got: list[tuple[int, int, int]] = []
        got_b: list[tuple[int, int, int]] = []

        def read(call: Any, out: list[tuple[int, int, int]], n: int) -> None:
            for ev in call:
                out.append((ev.kind, ev.finding.id, ev.finding.consumer.consumer.process.pid))
                if len(out) == n:
                    return

        readers = [threading.Thread(target=read, args=(everything, got, 4)),
                   threading.Thread(target=read, args=(team_b, got_b, 2))]
        for r in readers:
            r.start()
        wait_until(lambda: len(got) == 1, "the open finding replayed")
        # One batch per change: within a batch only each consumer's last state counts.
        t.send_events([finding(2, b)])
        t.send_events([finding(3, replace(b, gpu_memory_bytes=5))])
        t.send_events([resolved(4, a)])
        for r in readers:
            r.join(10)
        everything.cancel()
        team_b.cancel()
    kinds = query_pb2.FindingEvent
    assert got == [(kinds.KIND_OPENED, 1, 1), (kinds.KIND_OPENED, 2, 2), (kinds.KIND_CHANGED, 2, 2),
                   (kinds.KIND_RESOLVED, 1, 1)]
    assert got_b == [(kinds.KIND_OPENED, 2, 2), (kinds.KIND_CHANGED, 2, 2)]


def test_a_watcher_that_falls_behind_is_dropped_not_waited_for(collector: Collector, q: QueryClient,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_module, "WATCH_QUEUE_MAX", 5)
    call = q.watch()
    it = iter(call)
    with SimTracer(collector.address, "n1") as t:
        t.connect()
        wait_until(lambda: collector.call(lambda: len(collector.cluster.watchers)) == 1,
                   "the watcher to register")
        # 3,000 findings of ~1 KB: far more than gRPC buffers for a watcher that does not read.
        t.send_snapshot([make_consumer("n1", pid, container_id=CID_C) for pid in range(1, 3001)], seq=0)
        t.send_events([holder(1, 1)])
        t.wait_acked(1, timeout_s=30)  # ingest went on
    with pytest.raises(grpc.RpcError) as err:
        for _ in it:
            pass
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "dropped" in err.value.details()
    assert len(q.consumers()) == 3000


def test_node_status_counts_and_reports(collector: Collector, q: QueryClient) -> None:
    info = stream_pb2.NodeInfo(bpf=True, nvml=True, driver_version="550.54", gpus=[
        stream_pb2.Gpu(index=0, uuid="GPU-0", name="H100", minor=0, memory_total_bytes=80 << 30)])
    with SimTracer(collector.address, "n1", capabilities=("bpf", "nvml", "cri-relay")) as t:
        t.connect()
        t.send_snapshot([make_consumer("n1", 1, container_id=CID_A)], seq=0, info=info,
                        allocations=allocations([], available=False, error="no kubelet socket"))
        t.send_events([holder(s, 1) for s in range(1, 6)])
        t.send_events([holder(s, 1) for s in range(10, 12)])  # 6..9 lost in the tracer's spool
        t.heartbeat(stream_pb2.TracerStats(spool_dropped_total=4, ringbuf_dropped_total=3, spool_events=0))
        t.wait_acked(11)
        wait_until(lambda: q.node("n1").stats.ringbuf_dropped_total == 3, "the heartbeat's stats")
        st = q.node("n1")
    assert (st.events_ingested_total, st.duplicates_total, st.last_seq, st.consumers) == (7, 0, 11, 1)
    assert st.events_lost_total == 4 + 3  # the spool overflow is one loss, seen as a gap and as reported
    assert st.info.driver_version == "550.54" and st.info.gpus[0].name == "H100"
    assert not st.allocations.available and st.allocations.error == "no kubelet socket"
    assert st.last_heartbeat_unix_ns >= st.connected_unix_ns > 0 and st.tracer_version == "sim-0.1"


def test_a_tracer_instance_silent_past_the_retention_is_forgotten(collector: Collector,
                                                                  q: QueryClient) -> None:
    tracers = [SimTracer(collector.address, "n1") for _ in range(3)]
    keys = [("n1", t.boot_id, t.instance_id) for t in tracers]

    def age_the_first() -> None:  # as if the first instance last spoke 8 days ago; the retention is 7
        collector.nodes["n1"].positions[keys[0]].updated_unix_ns -= 8 * 86400 * 10**9

    for i, t in enumerate(tracers):
        if i == 2:
            collector.call(age_the_first)
        with t:
            t.connect()
            t.send_events([holder(s, 1) for s in range(1, 4 - i)])
            t.wait_acked(3 - i)
            t.close()
    assert q.node("n1").events_ingested_total == 2 + 1  # the second and third instances'
    kept = collector.call(lambda: [(k in collector.nodes["n1"].positions, k in collector.ingest.durable)
                                   for k in keys])
    assert kept == [(False, False), (True, True), (True, True)]


def test_list_events_pages_by_instance_and_seq(collector: Collector, q: QueryClient) -> None:
    with SimTracer(collector.address, "n1") as t, SimTracer(collector.address, "n2") as t2:
        t.connect()
        t2.connect()
        for start in (1, 4, 7):
            t.send_events([holder(s, s) for s in range(start, start + 3)])
        t2.send_events([holder(1, 77)])
        t.wait_acked(9)
        t2.wait_acked(1)
    page = q.events(instance_id=t.instance_id, after_seq=2, limit=4)
    assert [e.event.seq for e in page] == [3, 4, 5, 6]
    assert {(e.node, e.boot_id, e.instance_id) for e in page} == {("n1", "sim-boot", t.instance_id)}
    assert page[0].event.holder.process.pid == 3
    assert [e.event.seq for e in q.events(node="n1", limit=2)] == [8, 9]  # no instance: the newest
    assert [(e.node, e.event.seq) for e in q.events(node="n2")] == [("n2", 1)]
    assert len(q.events()) == 10
