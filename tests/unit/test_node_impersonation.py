"""A node certificate speaking for another node, against a real collector over real mTLS (no root).

tests/unit/test_security_e2e.py has the plain case (n1's certificate, Hello for n2, nothing else
connected). Here: the victim node already streaming, names that share a prefix or a suffix with the
certificate's, the attempt leaving no trace in the victim's state, and the certificate still
working for its own node afterwards. Each is refused at the Hello with PERMISSION_DENIED, so
dropping or loosening the node binding (collector/ingest.py) fails every one of them.
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

from ghostgpu.common.model.consumers import ConsumerClass
from ghostgpu.common.transport.tls import TlsFiles
from tests.helpers.audit_log import audit_records, secure_options
from tests.helpers.certs import Pki
from tests.helpers.collector_env import QueryClient
from tests.helpers.polling import wait_until
from tests.helpers.sim_tracer import SimTracer, StreamEnded, finding, make_consumer

POLICY = """
rules:
  - role: tracer
    subjects: ["node:*"]
  - role: viewer
    subjects: ["user:alice"]
"""


@dataclass
class Env:
    collector: Collector
    pki: Pki
    audit: Path

    def node_tls(self, name: str) -> TlsFiles:
        return self.pki.write(f"node-{name}", self.pki.node(name))

    def viewer(self) -> QueryClient:
        return QueryClient(self.collector.address, tls=self.pki.write("user-alice", self.pki.user("alice")))

    def records(self, action: str) -> list[dict[str, Any]]:
        return audit_records(self.audit, action)


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    pki, opts, audit = secure_options(tmp_path, POLICY)
    config = CollectorConfig(listen=("127.0.0.1:0",), db_path=str(tmp_path / "c.db"))
    c = Collector(config, security=opts).start()
    try:
        yield Env(c, pki, audit)
    finally:
        c.stop(grace_s=0.5)


def refused(t: SimTracer) -> str:
    """The details of a Hello the collector must refuse for the node binding."""
    with pytest.raises(StreamEnded) as e:
        t.connect()
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED, e.value.details
    return e.value.details


def test_a_node_certificate_cannot_take_over_a_connected_node(env: Env) -> None:
    victim = SimTracer(env.collector.address, "n2", tls=env.node_tls("n2"))
    victim.connect()
    victim.send_events([finding(1, make_consumer("n2", 42))])
    victim.wait_acked(1)

    attacker = SimTracer(env.collector.address, "n2", tls=env.node_tls("n1"), boot_id="attacker-boot")
    assert "the certificate of node n1 cannot speak for node n2" in refused(attacker)

    # The victim's stream is untouched: still connected, still acknowledged.
    victim.send_events([finding(2, make_consumer("n2", 43, cls=ConsumerClass.GHOST))])
    victim.wait_acked(2)
    assert victim.status is None
    with env.viewer() as alice:
        assert [(n.node, n.connected) for n in alice.status()] == [("n2", True)]
        assert sorted(c.consumer.process.pid for c in alice.consumers()) == [42, 43]
    victim.stop()
    wait_until(lambda: env.records("tracer.disconnect"), "the victim's disconnect audited")
    assert [(r["subject"], r["detail"]["node"]) for r in env.records("tracer.connect")] == [("node:n2", "n2")]
    assert [(r["subject"], r["result"], r["detail"]["node"]) for r in env.records("tracer.refused")] == [
        ("node:n1", "denied", "n2")]


@pytest.mark.parametrize("claimed", ["n10", "n1.evil", "evil.n1", "n", "node-n1", "n2"])
def test_a_node_certificate_speaks_for_exactly_its_name(env: Env, claimed: str) -> None:
    """No prefix, suffix or domain match: n1's certificate is n1 alone."""
    details = refused(SimTracer(env.collector.address, claimed, tls=env.node_tls("n1")))
    assert f"the certificate of node n1 cannot speak for node {claimed}" in details
    refusal = env.records("tracer.refused")[0]
    assert (refusal["subject"], refusal["detail"]["node"]) == ("node:n1", claimed)
    assert env.records("tracer.connect") == []
    with env.viewer() as alice:
        assert alice.status() == [] and alice.consumers() == []


def test_a_refused_certificate_still_streams_as_its_own_node(env: Env) -> None:
    tls = env.node_tls("n1")
    refused(SimTracer(env.collector.address, "n2", tls=tls))
    own = SimTracer(env.collector.address, "n1", tls=tls)
    own.connect()
    own.send_events([finding(1, make_consumer("n1", 7))])
    own.wait_acked(1)
    with env.viewer() as alice:
        assert [c.consumer.node for c in alice.consumers()] == ["n1"]
        assert [n.node for n in alice.status()] == ["n1"]
    own.stop()
