"""A trace-operator's `--pid` scope confined to its namespaces, against the real
`ghostgpu collector` serving mTLS, the real `ghostgpu tracer` (BPF, its node certificate, its CRI
relay to an in-process runtime, tests/helpers/cri_fake.py, that names the fake containers' pods),
and fake containers (tests/helpers/container.py): the tracer confirms from the process's cgroup that
it is in a container of the caller's namespaces, and the kernel keeps a pid scope to its container
(bpf/trace.bpf.c trace_pincg). Clients are in-process gRPC with user certificates; every wait polls.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.helpers.audit_log import audit_records
from tests.helpers.certs import Pki
from tests.helpers.collector_proc import CollectorProcess, tls_flags
from tests.helpers.container import FakeContainer
from tests.helpers.cri_fake import FakeCri
from tests.helpers.fakenvml import FakeNvml
from tests.helpers.polling import wait_until
from tests.helpers.trace_env import TraceClient
from tests.helpers.tracer_proc import TracerProcess

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.usefixtures("root_bpf")]

NODE = "node-scope"
RM_CONTROL = "0xc020462a"
DEADLINE_S = 30.0
POLICY = """
rules:
  - role: trace-operator
    subjects: ["user:alice"]
    namespaces: ["ml-*"]
  - role: trace-operator
    subjects: ["user:carol"]
    namespaces: ["*"]
  - role: tracer
    subjects: ["node:*"]
"""


@dataclass
class Node:
    collector: CollectorProcess
    pki: Pki
    cri: FakeCri
    ml: FakeContainer  # ml-train/trainer-0/main
    other: FakeContainer  # kube-system/dns-0/main

    def user(self, name: str) -> TraceClient:
        return TraceClient(self.collector.address, tls=self.pki.write(f"user-{name}", self.pki.user(name)))

    def audit(self, action: str) -> list[dict[str, Any]]:
        return audit_records(self.collector.db_path.with_suffix(".audit.jsonl"), action)


@pytest.fixture
def node(tmp_path: Path, fake_nvml: FakeNvml) -> Iterator[Node]:
    pki = Pki(tmp_path / "pki")
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    fake = FakeCri().start()
    ml, other = FakeContainer(), FakeContainer()
    fake.add_sandbox("sb-ml", "trainer-0", "ml-train", ml.pod_uid)
    fake.add_container(ml.container_id, "sb-ml", "main")
    fake.add_sandbox("sb-sys", "dns-0", "kube-system", other.pod_uid)
    fake.add_container(other.container_id, "sb-sys", "main")
    (tmp_path / "tracer").mkdir()
    node_tls = tls_flags(pki.write(f"node-{NODE}", pki.node(NODE)))
    tracer_args = ["--grace-s", "0.5", "--cri-endpoint", fake.endpoint, *node_tls]
    try:
        with ml, other, CollectorProcess(tmp_path / "collector", unix=False, args=[
                *tls_flags(pki.write("collector", pki.collector())), "--policy", str(policy)]) as col, \
                TracerProcess(tmp_path / "tracer", tracer_args, fake_nvml.env(), NODE, col.address):
            n = Node(col, pki, fake, ml, other)
            wait_until(lambda: n.audit("tracer.connect"), "the tracer connected", timeout_s=DEADLINE_S)
            yield n
    finally:
        fake.close()


def _refused(client: TraceClient, **scope: Any) -> tuple[grpc.StatusCode, str]:
    return client.start_error(duration_ms=10_000, node=NODE, **scope)


def test_an_operator_cannot_trace_a_host_pid(node: Node) -> None:
    """`ghostgpu trace -n ml-train --pid 1 --node N` by an operator limited to ml-*: PID 1 is no
    process of ml-train (on 43a3763 it was traced). The tracer says so from its cgroup."""
    job = node.ml.run(["open", "/dev/nvidia0", "ready", "wait"])
    job.wait_ready()
    with node.user("alice") as alice, node.user("carol") as carol:
        code, details = _refused(alice, namespace="ml-train", pid=1)
        assert code == grpc.StatusCode.PERMISSION_DENIED, details
        assert f"pid 1 on node {NODE} is not in a container of the caller's namespaces" in details
        code, details = _refused(alice, namespace="ml-zzz", pid=1)  # a namespace with nothing in it
        assert code == grpc.StatusCode.PERMISSION_DENIED, details
        code, details = _refused(carol, pid=1)  # namespaces ["*"]: every container, still no host pid
        assert code == grpc.StatusCode.PERMISSION_DENIED, details
        other = node.other.run(["open", "/dev/nvidia0", "ready", "wait"])
        other.wait_ready()
        code, details = _refused(alice, namespace="ml-train", pid=other.host_pid)  # kube-system's process
        assert code == grpc.StatusCode.PERMISSION_DENIED, details
        s = alice.start(namespace="ml-train", pid=job.host_pid, node=NODE, duration_ms=10_000)  # hers
        alice.stop(s.id)
    denied = {(r["subject"], r["detail"]["method"].rsplit("/", 1)[1]) for r in node.audit("denied")}
    assert denied == {("user:alice", "StartTrace"), ("user:carol", "StartTrace")}


def test_a_descendant_that_joins_another_container_leaves_the_pid_scope(node: Node) -> None:
    """The traced process forks; its child is moved into another container's cgroup (as `runc exec`
    joins one), calls there, and execs: none of its calls in the other container is traced (on
    43a3763 the two before its exec were), while the parent's are."""
    steps = ["open", "/dev/nvidia0", "ready", "wait", "ioctl", "0", RM_CONTROL, "3", "fork", "ready", "wait",
             "ioctl", "0", RM_CONTROL, "2", "exec", "open", "/dev/nvidia0", "ioctl", "0", RM_CONTROL, "4",
             "ready", "wait"]
    job = node.ml.run(steps)
    job.wait_ready()
    parent = job.host_pid
    with node.user("alice") as alice:
        s = alice.start(namespace="ml-train", pid=parent, node=NODE, duration_ms=60_000)
        job.release()
        job.wait_ready()  # the child, still in ml-train's container
        child = job.host_pid
        assert child != parent
        node.other.create()  # idempotent: the other container's cgroups (no process of its own)
        for directory in node.other.cgroup_paths.values():
            Path(directory, "cgroup.procs").write_text(str(child))
        assert node.other.pids() == [child]
        job.release()
        job.wait_ready()  # after its calls and its exec in the other container
        calls = _ioctls_by_pid(alice, s.id, parent, want=3)
        alice.stop(s.id)
        records, _ = alice.show(s.id)
    by_pid: dict[int, int] = {}
    for r in records:
        if r.kind == "ioctl":
            by_pid[r.pid] = by_pid.get(r.pid, 0) + 1
    assert calls == 3 and by_pid == {parent: 3}, by_pid


def _ioctls_by_pid(client: TraceClient, sid: str, pid: int, want: int) -> int:
    """Wait until the collector holds `want` ioctl records of `pid` in session `sid`."""
    got = 0

    def enough() -> bool:
        nonlocal got
        records, _ = client.show(sid)
        got = sum(1 for r in records if r.kind == "ioctl" and r.pid == pid)
        return got >= want

    wait_until(enough, f"{want} ioctl records of pid {pid}", timeout_s=DEADLINE_S)
    return got
