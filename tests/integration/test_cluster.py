"""ghostgpu across a cluster, end to end with real parts only.

Real tracer processes (BPF, /proc, a fake NVML library) stream over real gRPC (loopback TCP and a
unix socket) into a real `ghostgpu collector` process; a real containerd (CRI) runs the pods,
reached only through the tracer's CRI relay (the collector is given no CRI socket of its own);
a PodResources server speaking the kubelet's messages says which GPU each container was given;
what a user sees is read with the real `ghostgpu ps -o json` and `ghostgpu findings -o json`.

Every tracer here runs on this one host, so each one sees every holder on it, other tests' too:
assertions pick rows by node and PID or container ID, never "all rows".
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from ghostgpu.k8s import cri_runtime_v1_pb2 as cri
from ghostgpu.v1 import query_pb2
from tests.helpers.collector_env import QueryClient
from tests.helpers.collector_proc import CollectorProcess, cluster_rows, ghostgpu_cli, ps_json, wait_rows
from tests.helpers.container import FakeContainer
from tests.helpers.containerd import Containerd, Pod
from tests.helpers.fakenvml import FakeGpu, FakeNvml, FakeProc
from tests.helpers.podresources_server import Container as PrContainer
from tests.helpers.podresources_server import Pod as PrPod
from tests.helpers.podresources_server import PodResourcesServer
from tests.helpers.polling import poll, wait_until
from tests.helpers.tracer_proc import Record, TracerProcess
from tests.helpers.workload import GPUWORK_IMAGE, allocates, gpuwork_image, job_command
from tests.integration.conftest import GPU0_UUID, GPU1_UUID, require_bpf

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns]

FAST = ["--grace-s", "0.5"]
DEADLINE_S = 30.0  # generous: a 2-core VM shared with other test runs
NS = "ghost-e2e"
CRI_NODE = "node-cri"
# What `ps -o json` adds to the node snapshot's keys (the README's JSON contract).
CLUSTER_KEYS = {"namespace", "pod", "container", "image", "allocated"}




def gpu_allocation(pod: str, gpu_uuid: str) -> PrPod:
    return PrPod(NS, pod, [PrContainer("cuda", {"nvidia.com/gpu": [gpu_uuid]})])


# What the node's kubelet allocated: trainer-0 the GPU it opens (GPU 0), leaky-0 another (GPU 1).
ALLOCATIONS = [gpu_allocation("trainer-0", GPU0_UUID), gpu_allocation("leaky-0", GPU1_UUID)]


def last_finding(tracer: TracerProcess, pid: int) -> Record:
    recs = tracer.matching(lambda r: r.get("event") == "finding" and r.get("pid") == pid)
    assert recs, f"tracer {tracer.node_name} wrote no finding for pid {pid}"
    return recs[-1]


def by_node_pid(rows: list[dict[str, Any]], pids: set[int]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["node"], r["pid"]): r for r in rows if r["pid"] in pids and r["gpu"] == 0}


# ---- several tracers, fake containers ---------------------------------------------------------

def test_several_tracers_into_one_collector_show_each_nodes_consumers(tmp_path: Path, root_bpf: None) -> None:
    """node-a streams over TCP, node-b over a unix socket. Both see the same two holders; node-b's
    NVML lists the second one, so the collector must keep each node's view apart."""
    gpus = [FakeGpu(index=0, uuid=GPU0_UUID, minor=0)]
    nvml_a = FakeNvml(tmp_path / "nvml-a.conf", gpus=list(gpus))
    nvml_b = FakeNvml(tmp_path / "nvml-b.conf", gpus=list(gpus))
    # A CRI socket that does not exist: names stay unresolved and the classes are the nodes' own.
    no_cri = ["--cri-endpoint", f"unix://{tmp_path}/no-runtime.sock"]
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    with CollectorProcess(tmp_path / "collector") as col, FakeContainer() as c1, FakeContainer() as c2:
        # GPU jobs, though the tracers start after them: found by the scan with no call history,
        # they are `hidden` with the evidence incomplete.
        p1 = c1.run(["open", "/dev/nvidia0", *allocates(), "ready", "wait"])
        p2 = c2.run(["open", "/dev/nvidia0", *allocates(), "ready", "wait"])
        p1.wait_ready()
        p2.wait_ready()
        nvml_a.write()
        nvml_b.update(procs=[FakeProc(gpu=0, pid=p2.host_pid, used_bytes=1 << 30)])
        pids = {p1.host_pid, p2.host_pid}
        expected = {("node-a", p1.host_pid): "hidden", ("node-a", p2.host_pid): "hidden",
                    ("node-b", p1.host_pid): "hidden", ("node-b", p2.host_pid): "visible"}
        args = [*FAST, *no_cri]
        with TracerProcess(tmp_path / "a", args, nvml_a.env(), "node-a", col.address) as ta, \
                TracerProcess(tmp_path / "b", args, nvml_b.env(), "node-b", col.unix_address) as tb, \
                QueryClient(col.address) as q:
            tracers = {"node-a": ta, "node-b": tb}

            def settled() -> bool:
                # Every row is exactly the node tracer's latest finding for that holder, with its class.
                rows = by_node_pid(cluster_rows(q), pids)
                if {k: r["class"] for k, r in rows.items()} != expected:
                    return False
                for (node, pid), row in rows.items():
                    rec = tracers[node].matching(lambda r, pid=pid: r.get("event") == "finding"
                                                 and r.get("pid") == pid)
                    if not rec or any(row[k] != v for k, v in rec[-1].items() if k not in ("event", "ts")):
                        return False
                return True

            wait_until(settled, "both nodes' rows to match their tracers' latest findings", DEADLINE_S)

            rows = by_node_pid(ps_json(col.address), pids)
            assert {k: r["class"] for k, r in rows.items()} == expected
            for (node, pid), row in rows.items():
                rec = last_finding(tracers[node], pid)
                node_keys = set(rec) - {"event", "ts"}
                assert set(row) >= node_keys | CLUSTER_KEYS
                c = c1 if pid == p1.host_pid else c2
                assert (row["node"], row["ns_pid"], row["comm"], row["runtime"]) == (
                    node, 1, "gpuwork", "containerd")
                assert (row["container_id"], row["pod_uid"]) == (c.container_id, c.pod_uid)
                assert (row["gpu"], row["gpu_uuid"], row["devices"]) == (0, GPU0_UUID, ["/dev/nvidia0"])
                # No CRI: no names, allocation unknown, and the class is the node's own.
                assert (row["namespace"], row["pod"], row["container"], row["image"]) == ("", "", "", "")
                assert row["allocated"] == "unknown" and row["resolution"] == "unresolved"
                assert row["node_class"] == row["class"]
            assert rows[("node-b", p2.host_pid)]["gpu_memory_bytes"] == 1 << 30

            hidden = ps_json(col.address, "--class", "hidden")
            assert {r["class"] for r in hidden} == {"hidden"}
            assert set(by_node_pid(hidden, pids)) == {k for k, v in expected.items() if v == "hidden"}
            only_b = ps_json(col.address, "--node", "node-b", "--class", "visible")
            assert {(r["node"], r["class"]) for r in only_b} == {("node-b", "visible")}
            assert set(by_node_pid(only_b, pids)) == {("node-b", p2.host_pid)}
            assert ps_json(col.address, "-n", "no-such-namespace") == []

            status = {s.node: s for s in q.status()}
            a, b = status["node-a"], status["node-b"]
            assert a.connected and b.connected and a.instance_id != b.instance_id
            for s in (a, b):
                assert {"bpf", "nvml", "cri-relay", "podresources"} <= set(s.capabilities)
                assert [g.uuid for g in s.info.gpus] == [GPU0_UUID]
                assert s.events_ingested_total >= 2 and s.events_lost_total == 0
            table = ghostgpu_cli("ps", "--collector", col.unix_address)
            assert table.returncode == 0, table.stderr
            for node in ("node-a", "node-b"):
                assert f"node {node} | tracer connected" in table.stdout


# ---- one node with a real containerd and a kubelet PodResources server --------------------------

@dataclass
class CriNode:
    containerd: Containerd
    collector: CollectorProcess
    tracer: TracerProcess
    kubelet: PodResourcesServer
    pods: list[Pod] = field(default_factory=list)

    def run_gpu_pod(self, name: str, command: list[str] | None = None) -> tuple[Pod, str]:
        """A pod with one container `cuda` holding host /dev/null as its /dev/nvidia0: by default a
        GPU job (gpuwork allocates on it), which NVML does not list."""
        pod = self.containerd.run_pod(name, NS)
        self.pods.append(pod)
        image = self.containerd.import_variant(gpuwork_image())
        cid = self.containerd.create_container(pod, "cuda", command or job_command(),
                                               devices=[("/dev/null", "/dev/nvidia0")], image=image)
        return pod, cid


@pytest.fixture(scope="module")
def cri_node(containerd_session: Containerd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CriNode]:
    require_bpf()
    ctd = containerd_session.start()
    work = tmp_path_factory.mktemp("cri-node")
    nvml = FakeNvml(work / "nvml.conf", gpus=[FakeGpu(index=0, uuid=GPU0_UUID, minor=0),
                                             FakeGpu(index=1, uuid=GPU1_UUID, minor=1)])
    nvml.write()
    kubelet = PodResourcesServer(str(work / "kubelet.sock"))
    kubelet.pods = list(ALLOCATIONS)
    kubelet.start()
    (work / "tracer").mkdir()
    # No --collector-cri-endpoint: every CRI call goes through the tracer's relay.
    collector = CollectorProcess(work / "collector")
    tracer = TracerProcess(work / "tracer", [*FAST, "--cri-endpoint", ctd.endpoint,
                                             "--podresources-endpoint", f"unix://{kubelet.socket_path}"],
                           nvml.env(), CRI_NODE, collector.address)
    node = CriNode(ctd, collector, tracer, kubelet)
    try:
        tracer.wait_ready(DEADLINE_S)
        with QueryClient(collector.address) as q:
            wait_until(lambda: any(s.node == CRI_NODE and s.connected and s.allocations.available
                                   for s in q.status()), "node-cri connected with PodResources", DEADLINE_S)
        yield node
    finally:
        tracer.stop()
        collector.stop()
        kubelet.stop()
        ctd.start()
        for pod in node.pods:
            ctd.remove_pod(pod.id)


@pytest.fixture(scope="module")
def trainer(cri_node: CriNode) -> tuple[Pod, str]:
    """ghost-e2e/trainer-0, container cuda, holding /dev/nvidia0 (GPU 0, which it was allocated)."""
    return cri_node.run_gpu_pod("trainer-0")


@pytest.fixture
def q(cri_node: CriNode, containerd: Containerd) -> Iterator[QueryClient]:
    with QueryClient(cri_node.collector.address) as client:
        yield client


def container_rows(node: CriNode, q: QueryClient, cid: str, what: str, **match: Any) -> list[dict[str, Any]]:
    """Poll until the container's holders are listed (its init among them) and every one has `match`."""
    init_pid = node.containerd.container_host_pid(cid)
    found: list[dict[str, Any]] = []

    def settled() -> bool:
        nonlocal found
        found = [r for r in cluster_rows(q, node=CRI_NODE) if r["container_id"] == cid and r["gpu"] == 0]
        return init_pid in {r["pid"] for r in found} and all(
            r.get(k) == v for r in found for k, v in match.items())

    if not poll(settled, DEADLINE_S):
        brief = [{k: r[k] for k in ("pid", "class", "resolution", "allocated", "cri_error")} for r in found]
        raise AssertionError(f"timed out after {DEADLINE_S} s waiting for {what}: {brief}")
    return found


def test_containerd_container_is_named_through_the_tracers_cri_relay(
        cri_node: CriNode, trainer: tuple[Pod, str], q: QueryClient) -> None:
    pod, cid = trainer
    ctd = cri_node.containerd
    container_rows(cri_node, q, cid, "the trainer's holders hidden and resolved through the relay",
                   resolution="resolved", **{"class": "hidden"})
    status = ctd.runtime.ContainerStatus(cri.ContainerStatusRequest(container_id=cid), timeout=10).status
    sandbox_req = cri.PodSandboxStatusRequest(pod_sandbox_id=pod.id)
    sandbox = ctd.runtime.PodSandboxStatus(sandbox_req, timeout=10).status
    init_pid = ctd.container_host_pid(cid)

    rows = [r for r in ps_json(cri_node.collector.address, "--node", CRI_NODE) if r["container_id"] == cid]
    assert init_pid in {r["pid"] for r in rows}
    for row in rows:
        assert (row["namespace"], row["pod"], row["pod_uid"]) == (
            sandbox.metadata.namespace, sandbox.metadata.name, sandbox.metadata.uid)
        assert (row["namespace"], row["pod"], row["pod_uid"]) == (NS, "trainer-0", pod.uid)
        assert row["container"] == status.metadata.name == "cuda"
        assert row["image"] == GPUWORK_IMAGE
        assert (row["resolution"], row["container_state"], row["sandbox_state"], row["cri_error"]) == (
            "resolved", "CONTAINER_RUNNING", "SANDBOX_READY", "")
        assert row["cri_runtime"].startswith("containerd ")
        assert (row["class"], row["node_class"], row["allocated"]) == ("hidden", "hidden", True)
        # containerd's cgroupfs path (pod<uid>/<id>) reads the same as cri-dockerd's: the node leaves the
        # runtime open (docs/reference/cgroup-paths.md, vector T03) and CRI names it.
        assert (row["gpu"], row["gpu_uuid"], row["runtime"]) == (0, GPU0_UUID, "")
        assert "/dev/nvidia0" in row["devices"]
    nspid = Path(f"/proc/{init_pid}/status").read_text().split("NSpid:")[1].split("\n")[0].split()
    assert next(r for r in rows if r["pid"] == init_pid)["ns_pid"] == int(nspid[-1])

    in_ns = ps_json(cri_node.collector.address, "-n", NS, "--class", "hidden")
    assert {r["namespace"] for r in in_ns} == {NS} and cid in {r["container_id"] for r in in_ns}
    assert all(r["container_id"] != cid for r in ps_json(cri_node.collector.address, "-n", "kube-system"))
    assert {"cri-relay", "podresources"} <= set(q.node(CRI_NODE).capabilities)


def test_orphan_that_cri_does_not_know_next_to_one_that_runs(
        cri_node: CriNode, trainer: tuple[Pod, str], q: QueryClient) -> None:
    _, running_cid = trainer
    with FakeContainer() as fake:
        p = fake.run(["open", "/dev/nvidia0", *allocates(), "ready", "wait"])
        p.wait_ready()
        with pytest.raises(grpc.RpcError) as err:  # what CRI itself says about the fake's ID
            cri_node.containerd.runtime.ContainerStatus(
                cri.ContainerStatusRequest(container_id=fake.container_id), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        # CRI's verdict outranks the node's own class (pending within the grace period, then hidden).
        wait_rows(q, lambda r: r["pid"] == p.host_pid and (r["class"], r["node_class"]) == (
            "orphaned", "hidden"), "the fake holder orphaned", DEADLINE_S, node=CRI_NODE)
        container_rows(cri_node, q, running_cid, "the trainer resolved", resolution="resolved")

        rows = ps_json(cri_node.collector.address, "--node", CRI_NODE)
        orphan = next(r for r in rows if r["pid"] == p.host_pid and r["gpu"] == 0)
        assert orphan["container_id"] == fake.container_id
        assert (orphan["class"], orphan["node_class"]) == ("orphaned", "hidden")
        assert (orphan["resolution"], orphan["container_state"]) == ("not_found", "NOT_FOUND")
        assert orphan["cri_runtime"].startswith("containerd ")
        assert orphan["reason"].startswith(
            f"CRI ({orphan['cri_runtime']}) does not know this container: its record is gone")
        assert f"pid {p.host_pid} (pid 1 in its container) still holds /dev/nvidia0" in orphan["reason"]
        running = [r for r in rows if r["container_id"] == running_cid]
        assert running
        for r in running:
            assert (r["class"], r["resolution"], r["container_state"]) == (
                "hidden", "resolved", "CONTAINER_RUNNING")
            assert "NVML lists no such process" in r["reason"]

        out = ghostgpu_cli("findings", "--collector", cri_node.collector.address, "-o", "json",
                           "--node", CRI_NODE, "--class", "orphaned")
        assert out.returncode == 0, out.stderr
        found = [f for f in json.loads(out.stdout) if f["pid"] == p.host_pid]
        assert [(f["class"], f["container_id"], f["resolved"]) for f in found] == [
            ("orphaned", fake.container_id, None)]


def test_unallocated_until_podresources_gives_the_container_its_gpu(
        cri_node: CriNode, trainer: tuple[Pod, str], q: QueryClient) -> None:
    _, right_cid = trainer
    _, leaky_cid = cri_node.run_gpu_pod("leaky-0")  # opens GPU 0; the kubelet gave it GPU 1
    container_rows(cri_node, q, leaky_cid, "leaky-0 unallocated", node_class="hidden",
                   **{"class": "unallocated"})
    container_rows(cri_node, q, right_cid, "trainer-0 allocated", allocated=True)
    rows = ps_json(cri_node.collector.address, "--node", CRI_NODE)
    leaky = [r for r in rows if r["container_id"] == leaky_cid]
    right = [r for r in rows if r["container_id"] == right_cid]
    assert leaky and right
    for r in leaky:
        assert (r["class"], r["node_class"], r["allocated"], r["pod"]) == (
            "unallocated", "hidden", False, "leaky-0")
        assert (f"PodResources did not allocate GPU 0 ({GPU0_UUID}) to container cuda of pod {NS}/leaky-0"
                in r["reason"])
    assert {(r["class"], r["allocated"]) for r in right} == {("hidden", True)}

    # The kubelet now reports GPU 0 for leaky-0 (the poller reads it within its 10 s interval).
    cri_node.kubelet.pods = [gpu_allocation("trainer-0", GPU0_UUID), gpu_allocation("leaky-0", GPU0_UUID)]
    container_rows(cri_node, q, leaky_cid, "leaky-0 allocated", allocated=True, **{"class": "hidden"})
    assert not [r for r in ps_json(cri_node.collector.address, "--class", "unallocated")
                if r["container_id"] == leaky_cid]
    history = [f for f in q.findings(node=CRI_NODE) if f.consumer.consumer.process.container_id == leaky_cid]
    unallocated = [f for f in history if f.consumer.consumer.reason.startswith("PodResources did not")]
    assert unallocated and all(f.resolved_unix_ns and f.consumer.allocated == query_pb2.ALLOCATED_FALSE
                               for f in unallocated)
    still_open = [f for f in history if not f.resolved_unix_ns]
    assert still_open and {f.consumer.allocated for f in still_open} == {query_pb2.ALLOCATED_TRUE}
