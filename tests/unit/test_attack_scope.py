"""Trace scopes, session reads and node binding, run as the attacker would: a real Collector serving
mTLS on loopback with a policy file, certificates from a real CA (tests/helpers/certs.py), tracers
speaking the stream proto (tests/helpers/sim_tracer.py) whose CRI relay answers from an in-process runtime
(tests/helpers/cri_fake.py), and the audit log read back from disk (docs/SECURITY.md, "Threats and
what stops them"). The real tracer's side of the first (scopes inside the caller's namespaces) is
tests/integration/test_attack_scope_tracer.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from ghostgpu.collector.config import CollectorConfig
from ghostgpu.collector.main import Collector

from ghostgpu.common.transport.tls import TlsFiles
from ghostgpu.v1 import trace_pb2
from tests.helpers.audit_log import audit_records, secure_options
from tests.helpers.certs import Pki
from tests.helpers.collector_env import running_collector
from tests.helpers.cri_fake import FakeCri
from tests.helpers.polling import wait_until
from tests.helpers.sim_tracer import SimTracer, StreamEnded
from tests.helpers.trace_env import FAST, TraceClient, cri_via

ML = "a1" * 32  # ml-train/trainer-0/main
SYS = "c3" * 32  # kube-system/dns-0/main
CONFINING = ("cri-relay", "trace", "trace-confine")
POLICY = """
rules:
  - role: trace-operator
    subjects: ["user:alice", "user:bob"]
    namespaces: ["ml-*"]
  - role: viewer
    subjects: ["user:alice", "user:bob", "group:ops"]
  - role: trace-operator
    subjects: ["user:carol"]
    namespaces: ["*"]
  - role: tracer
    subjects: ["node:*", "group:tracers"]
  - role: admin
    subjects: ["user:root-ops"]
"""


@dataclass
class Attack:
    collector: Collector
    pki: Pki
    audit: Path
    cri: FakeCri

    def tracer(self, node: str, tls: TlsFiles, capabilities: tuple[str, ...] = CONFINING) -> SimTracer:
        return SimTracer(self.collector.address, node, tls=tls, cri=cri_via(self.cri),
                         capabilities=capabilities)

    def node(self, node: str = "n1", capabilities: tuple[str, ...] = CONFINING) -> SimTracer:
        t = self.tracer(node, self.pki.write(f"node-{node}", self.pki.node(node)), capabilities)
        t.connect()
        return t

    def user(self, name: str, groups: tuple[str, ...] = ()) -> TraceClient:
        return TraceClient(self.collector.address,
                           tls=self.pki.write(f"user-{name}", self.pki.user(name, groups=list(groups))))

    def records(self, action: str) -> list[dict[str, Any]]:
        return audit_records(self.audit, action)


@pytest.fixture
def attack(tmp_path: Path) -> Iterator[Attack]:
    pki, opts, audit = secure_options(tmp_path, POLICY)
    fake = FakeCri().start()
    fake.add_sandbox("sb-ml", "trainer-0", "ml-train", "uid-trainer-0")
    fake.add_container(ML, "sb-ml", "main")
    fake.add_sandbox("sb-sys", "dns-0", "kube-system", "uid-dns-0")
    fake.add_container(SYS, "sb-sys", "main")
    c = Collector(CollectorConfig(listen=("127.0.0.1:0",), db_path=str(tmp_path / "c.db")), trace_timing=FAST,
                  security=opts).start()
    try:
        yield Attack(c, pki, audit, fake)
    finally:
        c.stop(grace_s=0.5)
        fake.close()


def _code(call: Any) -> tuple[grpc.StatusCode, str]:
    try:
        got = call()
    except grpc.RpcError as e:
        return e.code(), e.details()  # type: ignore[attr-defined]
    raise AssertionError(f"the call succeeded: {got}")


def _denied(attack: Attack, method: str) -> list[dict[str, Any]]:
    return [r for r in attack.records("denied") if r["detail"]["method"] == f"/ghostgpu.v1.Query/{method}"]


# ---- a trace-operator traces only inside its namespaces ----------------------------------------


def test_an_operator_cannot_trace_a_host_pid_through_an_empty_namespace(attack: Attack) -> None:
    """`ghostgpu trace -n ml-zzz --pid 1 --node n1` by an operator limited to ml-*: the namespace
    matches nothing, so on 43a3763 PID 1 alone was traced."""
    t = attack.node()
    with attack.user("alice") as alice:
        code, details = alice.start_error(namespace="ml-zzz", pid=1, node="n1")
    assert code == grpc.StatusCode.PERMISSION_DENIED, details
    assert "pid 1 on node n1" in details and "ml-zzz" in details
    assert [c for c in t.trace_commands if c.WhichOneof("body") == "trace_start"] == []
    assert [r["subject"] for r in _denied(attack, "StartTrace")] == ["user:alice"]


def test_a_pid_is_sent_with_the_containers_it_must_be_in(attack: Attack) -> None:
    """A pid scope of an operator goes to the node with its namespace's containers (from CRI): the
    tracer starts it only for a process in one of them; a tracer refusal is the client's denial."""
    t = attack.node()
    with attack.user("alice") as alice, attack.user("carol") as carol, attack.user("root-ops") as admin:
        alice.start(namespace="ml-train", pid=4242, node="n1", duration_ms=5_000)
        start = t.wait_trace_command("trace_start").trace_start
        assert (start.pid, list(start.pid_containers)) == (4242, [ML])
        carol.start(pid=4243, node="n1", duration_ms=5_000)  # namespaces ["*"]: any container, no host pid
        starts = [c.trace_start for c in t.trace_commands if c.WhichOneof("body") == "trace_start"]
        assert sorted(starts[-1].pid_containers) == sorted([ML, SYS])
        admin.start(pid=1, node="n1", duration_ms=5_000)  # an admin traces host processes
        starts = [c.trace_start for c in t.trace_commands if c.WhichOneof("body") == "trace_start"]
        assert (starts[-1].pid, list(starts[-1].pid_containers)) == (1, [])
        t.trace_errors["trace_start"] = "denied: pid 1 on node n1 is not in a container of carol's namespaces"
        code, details = carol.start_error(pid=1, node="n1")
        assert code == grpc.StatusCode.PERMISSION_DENIED and "pid 1 on node n1" in details
    assert [r["subject"] for r in _denied(attack, "StartTrace")] == ["user:carol"]


def test_a_bare_container_id_outside_the_namespaces_is_refused(attack: Attack) -> None:
    """A container id names no namespace: CRI's labels say whose it is."""
    attack.node()
    attack.cri.add_sandbox("sb-bare", "bare-0", "", "uid-bare-0")  # a container no pod namespace owns
    attack.cri.add_container("d4" * 32, "sb-bare", "main")
    with attack.user("carol") as carol:
        code, details = carol.start_error(container="d4" * 6)
        assert code == grpc.StatusCode.PERMISSION_DENIED, details
        assert "d4d4d4d4d4d4" in details and "outside user:carol's trace namespaces" in details
        carol.start(container=SYS[:12], duration_ms=5_000)  # in a namespace: ["*"] covers it


@pytest.mark.parametrize("failure", ["no trace-confine", "runtime down", "node gone"])
def test_a_pid_that_cannot_be_confirmed_is_refused(attack: Attack, failure: str) -> None:
    """Fail closed: whatever keeps the node from confirming the pid's container refuses the start."""
    caps = ("cri-relay", "trace") if failure == "no trace-confine" else CONFINING
    t = attack.node(capabilities=caps)
    if failure == "runtime down":
        attack.cri.close()
    elif failure == "node gone":
        t.stop()
        wait_until(lambda: attack.records("tracer.disconnect"), "the tracer gone")
    with attack.user("alice") as alice:
        code, details = alice.start_error(namespace="ml-train", pid=4242, node="n1")
    want = grpc.StatusCode.UNAVAILABLE if failure == "runtime down" else grpc.StatusCode.FAILED_PRECONDITION
    assert code == want, details
    assert [c for c in t.trace_commands if c.WhichOneof("body") == "trace_start"] == []


# ---- reading and stopping other people's sessions ------------------------------------------------


def test_an_operator_reads_and_stops_only_what_its_namespaces_and_ownership_allow(attack: Attack) -> None:
    """An operator limited to ml-* read the records of an admin's kube-system session on 43a3763."""
    t = attack.node()
    with attack.user("root-ops") as admin, attack.user("alice") as alice, attack.user("bob") as bob:
        sys_session = admin.start(namespace="kube-system", duration_ms=60_000)
        t.wait_trace_command("trace_start")
        t.send_trace(sys_session.id, [trace_pb2.TraceRecord(kind="ioctl", container_id=SYS, pid=7)])
        ml_session = alice.start(namespace="ml-train", duration_ms=60_000)

        assert {s.id for s in alice.sessions()} == {ml_session.id}
        assert {s.id for s in bob.sessions()} == {ml_session.id}  # inside bob's ml-* too
        assert {s.id for s in admin.sessions()} == {sys_session.id, ml_session.id}

        code, details = _code(lambda: alice.show(sys_session.id))  # `trace show`
        assert code == grpc.StatusCode.PERMISSION_DENIED, details
        assert sys_session.id in details and "kube-system" in details
        code, details = _code(lambda: list(alice.watch(sys_session.id, follow=True, timeout_s=5)))
        assert code == grpc.StatusCode.PERMISSION_DENIED, details
        code, details = _code(lambda: alice.stop(sys_session.id))
        assert code == grpc.StatusCode.PERMISSION_DENIED, details

        records, _ = bob.show(ml_session.id)  # bob reads alice's ml-train session
        assert records == []
        code, details = _code(lambda: bob.stop(ml_session.id))  # but stops only his own
        assert code == grpc.StatusCode.PERMISSION_DENIED and "user:alice" in details, details
        assert admin.stop(ml_session.id).status == trace_pb2.TRACE_STATUS_STOPPED  # admins stop any
        assert admin.stop(sys_session.id).status == trace_pb2.TRACE_STATUS_STOPPED
    denied = {(r["subject"], r["detail"]["method"].rsplit("/", 1)[1]) for r in attack.records("denied")}
    assert denied == {("user:alice", "WatchTrace"), ("user:alice", "StopTrace"), ("user:bob", "StopTrace")}
    assert {r["detail"].get("session") for r in _denied(attack, "WatchTrace")} == {sys_session.id}


def test_a_viewer_alone_reads_no_trace_session(attack: Attack) -> None:
    attack.node()
    with attack.user("root-ops") as admin, attack.user("dave", groups=("ops",)) as dave:
        s = admin.start(namespace="ml-train", duration_ms=60_000)
        assert dave.consumers() == []  # a viewer
        assert dave.sessions() == []
        code, _ = _code(lambda: dave.show(s.id))
        assert code == grpc.StatusCode.PERMISSION_DENIED


# ---- only a node certificate naming the node streams as it ------------------------------------


@pytest.mark.parametrize("who", ["tracer by a group rule", "admin"])
def test_a_user_certificate_cannot_stream_as_a_node(attack: Attack, who: str) -> None:
    """A user certificate that a group rule made a tracer streamed as any node on 43a3763."""
    name, groups = ("mallory", ["tracers"]) if who != "admin" else ("root-ops", [])
    t = attack.tracer("n1", attack.pki.write(f"user-{name}", attack.pki.user(name, groups=groups)))
    with pytest.raises(StreamEnded) as e:
        t.connect()
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert f"user:{name} cannot speak for node n1" in e.value.details
    assert "node certificate" in e.value.details
    refused = attack.records("tracer.refused")
    assert [(r["subject"], r["result"], r["detail"]["node"]) for r in refused] == [
        (f"user:{name}", "denied", "n1")]
    assert attack.records("tracer.connect") == []


def test_a_local_uid_speaks_only_for_the_collectors_node(tmp_path: Path) -> None:
    """Without certificates the kernel names a local tracer by uid: with the collector's node known
    (`ghostgpu up`), root or the collector's uid streams as that node only."""
    with running_collector(tmp_path, node_name="n-local") as c:
        other = SimTracer(c.address, "n-other")
        with pytest.raises(StreamEnded) as e:
            other.connect()
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "cannot speak for node n-other" in e.value.details and "n-local" in e.value.details
        local = SimTracer(c.address, "n-local")
        local.connect()
        local.stop()
