"""Three `ghostgpu collector` replicas on one PostgreSQL, end to end: every event stored exactly once.

Real parts: a PostgreSQL 15 cluster of the test's own (tests/helpers/postgres.py), three collector
processes started as a user would (`python -m ghostgpu.cli collector --store DSN --replica-id rN`,
tests/helpers/collector_proc.py), simulated tracers over real gRPC (tests/helpers/sim_tracer.py), and
in the last test the real tracer with BPF.

Each simulated node streams numbered events and, like the real tracer's spool, holds every event
until it is acknowledged: when its stream ends it reconnects (to a replica it is told, or through the
whole address list, as `--collector A,B,C` dials) and resends from the Welcome's acked_seq. Along the
way one replica is SIGKILLed mid-stream and started again under the same --replica-id, PostgreSQL is
stopped and started under the streams, and a lease is stolen from a live replica. At the end the
events table holds each node's seqs 1..N exactly once (rows read straight from PostgreSQL, each row's
first_seq..last_seq expanded and its blob decoded: no gap, no overlap), every Welcome's acked_seq
was at least what the node had seen acknowledged before (an Ack is never taken back), and `ghostgpu
ps` and NodeStatus on every replica show every node (collector/node_state.py).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest
from ghostgpu.collector.leases import Leases
from ghostgpu.collector.store import LeaseLost, Position, Store, decode_blob

from ghostgpu.v1 import stream_pb2
from tests.helpers.collector_env import QueryClient
from tests.helpers.collector_proc import CollectorProcess, ghostgpu_cli, ps_json
from tests.helpers.fakenvml import FakeGpu, FakeNvml
from tests.helpers.polling import wait_until
from tests.helpers.postgres import PostgresServer
from tests.helpers.sim_tracer import SimTracer, StreamEnded, holder, make_consumer
from tests.helpers.tracer_proc import TracerProcess
from tests.integration.conftest import GPU0_UUID

pytestmark = pytest.mark.postgres

BATCH = 25
NODES = 6
LEASE_TTL_S = "6"  # renewed every 2 s: the test's PostgreSQL restart fits well inside it
DEADLINE_S = 45.0  # a phase's wait, on a 2-core VM shared with other test runs
CONNECT_TIMEOUT_S = 10.0
BOOT = "sim-boot"


class SimNode:
    """One node's simulated tracer that survives its collector replica: it keeps every event sent
    until acknowledged, and after its stream ends connects again and resends what was not."""

    def __init__(self, name: str, pid: int) -> None:
        self.name = name
        self.instance_id = uuid.uuid4().hex
        self.consumer = make_consumer(name, pid)
        self.sim: SimTracer | None = None
        self.sent = 0  # the newest seq handed to a stream
        self.acked = 0  # the newest seq any replica acknowledged
        self.welcomes: list[tuple[str, int]] = []  # (target, acked_seq) of each stream opened
        self.refusals: list[str] = []  # Hellos refused (UNAVAILABLE while the database restarts)

    def _note_acks(self) -> None:
        if self.sim is not None:
            self.acked = max(self.acked, self.sim.acked_seq)

    def connect(self, target: str, deadline: float) -> None:
        """A stream to `target` (one replica, or a comma list of them); retried until the deadline."""
        self.close()
        while True:
            sim = SimTracer(target, self.name, boot_id=BOOT, instance_id=self.instance_id)
            try:
                welcome = sim.connect(timeout_s=CONNECT_TIMEOUT_S)
                break
            except AssertionError as e:  # StreamEnded (a refused Hello) or no Welcome in time
                sim.stop()
                self.refusals.append(str(e))
                if time.monotonic() > deadline:
                    raise AssertionError(f"node {self.name}: no stream to {target}; last: {e}") from None
        self.sim = sim
        self.welcomes.append((target, welcome.acked_seq))
        # Acks are durable: a replica taking the node over goes on from what was committed.
        assert self.acked <= welcome.acked_seq <= self.sent, (
            f"node {self.name}: Welcome from {target} acked {welcome.acked_seq}, but {self.acked} was "
            f"acknowledged before and {self.sent} sent")
        self.acked = welcome.acked_seq
        sim.send_snapshot([self.consumer], seq=welcome.acked_seq)
        for first in range(welcome.acked_seq + 1, self.sent + 1, BATCH):
            last = min(first + BATCH - 1, self.sent)
            sim.send_events([holder(s, self.consumer.pid) for s in range(first, last + 1)])

    def send(self, batches: int) -> None:
        """Numbered events, not waiting for their Acks; a stream that ended takes them at its resend."""
        assert self.sim is not None
        for _ in range(batches):
            first = self.sent + 1
            self.sent += BATCH
            if self.sim.status is None:
                self.sim.send_events([holder(s, self.consumer.pid) for s in range(first, self.sent + 1)])

    def settle(self, target: str, deadline: float) -> None:
        """Every event sent acknowledged, reconnecting to `target` whenever the stream ends."""
        while True:
            if self.sim is None or self.sim.status is not None:
                self.connect(target, deadline)
            assert self.sim is not None
            try:
                self.sim.wait_acked(self.sent, max(0.1, deadline - time.monotonic()))
                self._note_acks()
                return
            except StreamEnded:
                self._note_acks()

    def wait_ended(self, timeout_s: float) -> tuple[grpc.StatusCode, str]:
        assert self.sim is not None
        status = self.sim.wait_ended(timeout_s)
        self._note_acks()
        return status

    def close(self) -> None:
        if self.sim is not None:
            self._note_acks()
            self.sim.stop()
            self.sim = None


def replica(tmp_path: Path, dsn: str, name: str) -> CollectorProcess:
    return CollectorProcess(tmp_path / name, unix=False,
                            args=["--store", dsn, "--replica-id", name, "--lease-ttl", LEASE_TTL_S])


def lease_owners(dsn: str) -> dict[str, tuple[str, int]]:
    with psycopg.connect(dsn) as conn:
        return {n: (o, t) for n, o, t in conn.execute("SELECT node, owner, token FROM node_leases")}


def assert_stored_exactly_once(dsn: str, nodes: list[SimNode]) -> None:
    """Each node's seqs 1..sent in the events table once: the rows' ranges, and the events in their blobs."""
    with psycopg.connect(dsn) as conn:
        found = conn.execute("SELECT node, boot_id, instance_id, first_seq, last_seq, count, codec, blob "
                             "FROM events ORDER BY node, first_seq").fetchall()
        positions = {n: d for n, d in conn.execute("SELECT node, delivered_seq FROM positions")}
    by_node: dict[str, list[Any]] = {}
    for row in found:
        by_node.setdefault(row[0], []).append(row)
    for node in nodes:
        rows = by_node.pop(node.name, [])
        assert {(r[1], r[2]) for r in rows} == {(BOOT, node.instance_id)}, node.name
        ranged: list[int] = []
        decoded: list[int] = []
        for _, _, _, first, last, count, codec, blob in rows:
            assert count == last - first + 1
            ranged.extend(range(first, last + 1))
            batch = stream_pb2.TracerMessage.FromString(decode_blob(codec, bytes(blob))).events
            decoded.extend(e.seq for e in batch.events)
        want = list(range(1, node.sent + 1))
        assert ranged == want, f"node {node.name}: stored {[(r[3], r[4]) for r in rows]}, sent 1..{node.sent}"
        assert decoded == want, f"node {node.name}: the stored blobs hold other seqs than their rows say"
        assert positions[node.name] == node.sent
    assert by_node == {}, f"events of nodes nobody sent: {sorted(by_node)}"


@pytest.fixture
def cluster(tmp_path: Path, own_postgres: PostgresServer) -> Iterator[tuple[str, list[CollectorProcess]]]:
    dsn = own_postgres.create_database("ghostgpu")
    made: list[CollectorProcess] = []
    try:
        for i in range(3):
            made.append(replica(tmp_path, dsn, f"r{i}"))
        yield dsn, made
    finally:
        for r in made:
            r.stop()
            # pytest shows a test's captured output only when it fails: each replica's last words then
            print(f"---- {r.args[3]} ({r.address}) stderr:\n{r.stderr()}")


def test_every_event_stored_once_through_a_replica_crash_a_database_restart_and_a_lease_steal(
        cluster: tuple[str, list[CollectorProcess]], own_postgres: PostgresServer) -> None:
    dsn, replicas = cluster
    r0 = replicas[0]
    everyone = ",".join(r.address for r in replicas)
    nodes = [SimNode(f"gpu-node-{i}", 5000 + i) for i in range(NODES)]
    intruder: Store | None = None
    try:
        # Spread over the three replicas, two nodes each.
        for i, node in enumerate(nodes):
            node.connect(replicas[i % 3].address, time.monotonic() + DEADLINE_S)
            node.send(4)
        deadline = time.monotonic() + DEADLINE_S
        for node in nodes:
            node.settle(everyone, deadline)
        assert {n: o for n, (o, _) in lease_owners(dsn).items()} == {
            node.name: f"r{i % 3}" for i, node in enumerate(nodes)}

        # r0 dies mid-stream, batches in flight; it comes back under the same --replica-id (a container
        # restarted in its pod). Node 0 reconnects to it, node 3 dials the list of all three.
        for node in nodes:
            node.send(4)
        r0.kill()
        assert nodes[0].wait_ended(CONNECT_TIMEOUT_S)[0] == grpc.StatusCode.UNAVAILABLE
        r0.start()
        deadline = time.monotonic() + DEADLINE_S
        nodes[0].settle(r0.address, deadline)
        for node in nodes[1:]:
            node.settle(everyone, deadline)

        # PostgreSQL stops under the streams and starts again: batches sent meanwhile are held (no Ack)
        # and committed once it is back; a Hello meanwhile is refused and tried again.
        for node in nodes:
            node.send(2)
        own_postgres.stop("fast")
        for node in nodes:
            node.send(2)
        wait_until(lambda: any("database is out of reach" in r.stderr() for r in replicas),
                   "a replica holding a write while PostgreSQL is down", DEADLINE_S)
        own_postgres.start()
        deadline = time.monotonic() + DEADLINE_S
        for node in nodes:
            node.settle(everyone, deadline)

        # Another replica takes a node's lease from under its live stream (a replica the tracer just
        # reached): the owner's next write is refused, its stream ends, the tracer moves, and the
        # intruder's own write with its now stale token is refused too.
        victim = nodes[1]
        owner_before, token_before = lease_owners(dsn)[victim.name]
        # (its event log bound as the replicas': a replica with a smaller one prunes everyone's events)
        intruder = Store(dsn, 1_000_000, 7.0, replica_id="intruder")
        leases = Leases(intruder, "intruder", 60.0)
        taken = leases.take(victim.name).result(DEADLINE_S)
        leases.adopt(taken)
        assert (taken.previous_owner, taken.token) == (owner_before, token_before + 1)
        victim.send(1)
        code, details = victim.wait_ended(DEADLINE_S)
        assert code == grpc.StatusCode.ABORTED and "moved to another collector replica" in details, details
        victim.settle(everyone, time.monotonic() + DEADLINE_S)
        owner_after, token_after = lease_owners(dsn)[victim.name]
        assert owner_after in ("r0", "r1", "r2") and token_after == token_before + 2
        refused: Future[BaseException | None] = Future()
        rewind = Store.op_position(Position(victim.name, BOOT, victim.instance_id))  # delivered_seq 0
        intruder.submit([rewind], refused.set_result, fence=leases.fence(victim.name))
        lost = refused.result(DEADLINE_S)
        assert isinstance(lost, LeaseLost) and lost.current == token_after

        for node in nodes:
            node.send(2)
        deadline = time.monotonic() + DEADLINE_S
        for node in nodes:
            node.settle(everyone, deadline)
        assert_stored_exactly_once(dsn, nodes)

        # Any replica answers for every node: NodeStatus and `ghostgpu ps` (node_state rows).
        want = {node.name: node.sent for node in nodes}
        for r in replicas:
            with QueryClient(r.address) as q:
                def caught_up(q: QueryClient = q) -> bool:
                    status = {s.node: s for s in q.status()}
                    return all(n in status and status[n].connected and status[n].last_seq == seq
                               for n, seq in want.items())

                wait_until(caught_up, f"NodeStatus on {r.address} showing every node at its last seq",
                           DEADLINE_S)
                for s in q.status():
                    assert (s.events_lost_total, s.events_ingested_total) == (0, want[s.node]), s.node
            rows = ps_json(r.address)
            assert {(row["node"], row["pid"]) for row in rows} == {(n.name, n.consumer.pid) for n in nodes}
    finally:
        for node in nodes:
            node.close()
        if intruder is not None:
            intruder.close()


# ---- the real tracer ---------------------------------------------------------------------------------


BUS_ID = "00000000:3B:00.0"


def write_kmsg(line: str) -> None:
    """One record into the kernel log, as root may (priority 3, the level NVRM logs Xids at)."""
    fd = os.open("/dev/kmsg", os.O_WRONLY)
    try:
        os.write(fd, f"<3>{line}\n".encode())
    finally:
        os.close(fd)


def faults_of(collector: str, pid: int) -> list[dict[str, Any]]:
    out = ghostgpu_cli("faults", "--collector", collector, "-o", "json")
    assert out.returncode == 0, out.stderr
    return [row for row in json.loads(out.stdout) if row.get("pid") == pid]


@pytest.mark.root
@pytest.mark.bpf
@pytest.mark.usefixtures("root_bpf")
def test_the_real_tracer_moves_to_a_surviving_replica_and_nothing_is_stored_twice(
        tmp_path: Path, cluster: tuple[str, list[CollectorProcess]]) -> None:
    dsn, replicas = cluster
    node = "node-real-tracer"
    gpu = FakeGpu(index=0, uuid=GPU0_UUID, minor=0, pci_bus_id=BUS_ID)
    nvml = FakeNvml(tmp_path / "nvml.conf", gpus=[gpu])
    nvml.write()
    (tmp_path / "tracer").mkdir()
    marker = 40000 + os.getpid() % 20000  # the pid= of this test's Xid lines
    everyone = ",".join(r.address for r in replicas)
    with TracerProcess(tmp_path / "tracer", ["--grace-s", "0.5"], nvml.env(), node, everyone) as tracer:
        tracer.wait_ready(DEADLINE_S)
        wait_until(lambda: node in lease_owners(dsn), "the tracer's Hello taking its node's lease",
                   DEADLINE_S)
        by_name = {f"r{i}": r for i, r in enumerate(replicas)}
        first_owner = lease_owners(dsn)[node][0]
        owner = by_name[first_owner]
        with QueryClient(owner.address) as q:
            st = q.node(node)
            assert st.connected and "bpf" in st.capabilities
        write_kmsg(f"NVRM: Xid (PCI:0000:3b:00): 79, pid={marker}, name=gpuwork, GPU has fallen off the bus.")
        wait_until(lambda: faults_of(owner.address, marker), "the first Xid stored", DEADLINE_S)

        owner.kill()  # the tracer's replica dies: it reconnects through its address list
        wait_until(lambda: lease_owners(dsn)[node][0] != first_owner, "another replica taking the node",
                   DEADLINE_S)
        survivor = by_name[lease_owners(dsn)[node][0]]
        write_kmsg(f"NVRM: Xid (PCI:0000:3b:00): 13, pid={marker}, name=gpuwork, Graphics Exception.")
        wait_until(lambda: len(faults_of(survivor.address, marker)) == 2, "the second Xid stored", DEADLINE_S)
        with QueryClient(survivor.address) as q:
            st = q.node(node)
            assert st.connected and st.events_lost_total == 0
            instance = st.instance_id
    with psycopg.connect(dsn) as conn:
        ranges = conn.execute("SELECT instance_id, first_seq, last_seq FROM events WHERE node = %s "
                              "ORDER BY first_seq", (node,)).fetchall()
    assert ranges and {r[0] for r in ranges} == {instance}
    seqs = [s for _, first, last in ranges for s in range(first, last + 1)]
    assert seqs == list(range(1, seqs[-1] + 1)), f"stored ranges {[(r[1], r[2]) for r in ranges]}"
