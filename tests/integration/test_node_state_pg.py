"""Two collector replicas on one PostgreSQL (the real server, tests/helpers/postgres.py): a tracer
streams to replica A, and `ps` (ListConsumers) and NodeStatus on replica B show its consumers, named
through A's CRI answers, and its status; once its stream ends on A, B says not connected; once the
tracer moves to B, A shows what B writes; a replica that stops leaves its nodes not connected once
their leases run out (collector/node_state.py)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.collector.main import Collector

from ghostgpu.common.model.consumers import K8sInfo
from tests.helpers.collector_env import QueryClient
from tests.helpers.polling import wait_until
from tests.helpers.replicas import replica as shared_replica
from tests.helpers.sim_tracer import SimTracer, make_consumer

pytestmark = pytest.mark.postgres

CID = "ab" * 32
DEADLINE_S = 20.0  # a node's rows reach the store within a second; generous for a loaded 2-core VM


class NamesResolver:
    """CRI's answer for CID, known at once (the real resolver through a relay: test_collector_cri.py)."""

    def __init__(self, transport_for: Any, on_change: Any) -> None:
        pass

    def get(self, node: str, container_id: str) -> K8sInfo:
        if container_id == CID:
            return K8sInfo("resolved", "team-a", "train-0", "uid-a", "trainer", "img:1")
        return K8sInfo("unresolved", error="CRI lookup pending")


def replica(tmp_path: Path, dsn: str, name: str,
            **settings: Any) -> contextlib.AbstractContextManager[Collector]:
    return shared_replica(tmp_path, dsn, name, settings=settings, resolver_factory=NamesResolver)


def test_ps_and_node_status_on_any_replica_show_every_node(tmp_path: Path, postgres_dsn: str) -> None:
    with replica(tmp_path, postgres_dsn, "a") as a, replica(tmp_path, postgres_dsn, "b") as b, \
            QueryClient(a.address) as qa, QueryClient(b.address) as qb:
        with SimTracer(a.address, "gpu-7") as t:
            t.connect()
            t.send_snapshot([make_consumer("gpu-7", 41, container_id=CID), make_consumer("gpu-7", 42, gpu=1)],
                            seq=0)
            wait_until(lambda: [c.consumer.process.pid for c in qb.consumers()] == [41, 42],
                       "replica b's ps showing the consumers streamed to replica a", DEADLINE_S)
            (named,) = qb.consumers(namespace="team-a")
            assert (named.k8s.pod, named.consumer.node) == ("train-0", "gpu-7")
            assert qb.consumers() == qa.consumers()  # one answer, whichever replica serves it
            st = qb.node("gpu-7")
            assert st.connected and st.tracer_version == "sim-0.1" and st.consumers == 2
            t.close()
        wait_until(lambda: not qb.node("gpu-7").connected, "replica b's NodeStatus saying gpu-7 left",
                   DEADLINE_S)
        assert not qa.node("gpu-7").connected
        with SimTracer(b.address, "gpu-7") as t:  # the tracer comes back, to the other replica
            t.connect()
            t.send_snapshot([make_consumer("gpu-7", 43)], seq=0)
            wait_until(lambda: [c.consumer.process.pid for c in qa.consumers()] == [43],
                       "replica a's ps showing what replica b applies now", DEADLINE_S)
            wait_until(lambda: qa.node("gpu-7").connected, "replica a's NodeStatus: connected to b",
                       DEADLINE_S)


def test_a_replica_gone_leaves_its_nodes_not_connected_once_their_leases_run_out(
        tmp_path: Path, postgres_dsn: str) -> None:
    with replica(tmp_path, postgres_dsn, "b") as b, QueryClient(b.address) as qb:
        with replica(tmp_path, postgres_dsn, "a", lease_ttl_s=1.0) as a, SimTracer(a.address, "gpu-8") as t:
            t.connect()
            t.send_snapshot([make_consumer("gpu-8", 51)], seq=0)
            wait_until(lambda: [c.consumer.process.pid for c in qb.consumers()] == [51],
                       "replica b's ps showing gpu-8", DEADLINE_S)
            assert qb.node("gpu-8").connected
        # a stopped with its row saying connected: no replica renews gpu-8's lease now
        wait_until(lambda: not qb.node("gpu-8").connected, "gpu-8 not connected once its lease ran out",
                   DEADLINE_S)
        assert [c.consumer.process.pid for c in qb.consumers()] == [51]  # its last rows, as ps had them
