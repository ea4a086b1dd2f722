"""A replica cut off from PostgreSQL: its leases lapse, it ends its streams, another replica takes the
node, and the cut-off replica's late writes are refused by the fencing token (collector/leases.py).

Real PostgreSQL (tests/helpers/postgres.py); replica A reaches it through a TCP relay the test cuts
(tests/helpers/tcp_proxy.py): a partition, with every socket left open, not a refused connection.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import grpc
import psycopg
import pytest
from ghostgpu.collector.config import CollectorConfig
from ghostgpu.collector.leases import Leases
from ghostgpu.collector.main import Collector
from ghostgpu.collector.store import Store

from ghostgpu.v1 import stream_pb2
from tests.helpers.polling import wait_until
from tests.helpers.sim_tracer import SimTracer, StreamEnded, synthetic_batches
from tests.helpers.tcp_proxy import TcpRelay

pytestmark = pytest.mark.postgres

LEASE_TTL_S = 2.0
refusals: list[str] = []
BATCH = 50


@pytest.fixture
def relayed_dsn(postgres_dsn: str) -> Iterator[tuple[str, TcpRelay]]:
    parts = urlsplit(postgres_dsn)
    assert parts.hostname is not None and parts.port is not None
    with TcpRelay((parts.hostname, parts.port)) as relay:
        netloc = parts.netloc.replace(f":{parts.port}", f":{relay.port}")
        yield parts._replace(netloc=netloc).geturl(), relay


def _replica(dsn: str, name: str) -> Collector:
    return Collector(CollectorConfig(listen=("127.0.0.1:0",), store_url=dsn, replica_id=name,
                                     lease_ttl_s=LEASE_TTL_S)).start()


def _connect_retrying(t: SimTracer, timeout_s: float = 30.0) -> stream_pb2.Welcome:
    """Connect as the tracer does: an UNAVAILABLE Hello (the lease not takeable yet) is tried again."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return t.connect(timeout_s=timeout_s)
        except StreamEnded as e:
            if e.code != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            refusals.append(e.details)


def _stored_ranges(dsn: str, node: str) -> list[tuple[int, int]]:
    with psycopg.connect(dsn) as conn:
        return [(a, b) for a, b in conn.execute(
            "SELECT first_seq, last_seq FROM events WHERE node = %s ORDER BY first_seq", (node,))]


def test_a_partitioned_replica_hands_its_node_over_and_its_late_writes_are_refused(
        postgres_dsn: str, relayed_dsn: tuple[str, TcpRelay]) -> None:
    a_dsn, relay = relayed_dsn
    a = _replica(a_dsn, "replica-a")
    b = _replica(postgres_dsn, "replica-b")
    batches = synthetic_batches("n1", 4, BATCH)
    try:
        with SimTracer(a.address, "n1", instance_id="i1") as t:
            t.connect()
            t.push(batches[:1], [BATCH])
            relay.partition()
            t.send(batches[1])  # accepted by A, which can no longer commit it (nor ack it)
            code, details = t.wait_ended(timeout_s=LEASE_TTL_S * 6)
        assert code == grpc.StatusCode.UNAVAILABLE and "lost its database" in details
        assert a.leases.held == {}

        # The tracer moves to B, which takes the lease (a newer token) and goes on from seq 50:
        # batch 2 is sent again and stored by B.
        with SimTracer(b.address, "n1", instance_id="i1") as t:
            welcome = _connect_retrying(t)
            assert welcome.acked_seq == BATCH
            t.push(batches[1:], [2 * BATCH, 3 * BATCH, 4 * BATCH])
            relay.heal()
            # A's writer gets its connection back (or a new one) and retries the group it held: the
            # lease row carries B's token now, so the group is refused, not stored a second time.
            wait_until(lambda: a.store.fenced_out_total > 0, "replica A's held batch refused", timeout_s=30)
            assert _stored_ranges(postgres_dsn, "n1") == [(1, 50), (51, 100), (101, 150), (151, 200)]
            with psycopg.connect(postgres_dsn) as conn:
                lease = conn.execute("SELECT owner, token FROM node_leases WHERE node = 'n1'").fetchone()
                position = conn.execute("SELECT delivered_seq FROM positions WHERE node = 'n1'").fetchone()
            assert lease is not None and position is not None
            (owner, token), delivered = lease, position[0]
            assert owner == "replica-b" and delivered == 4 * BATCH
            assert token == b.leases.held["n1"]
    finally:
        relay.heal()
        a.stop()
        b.stop()


def test_a_session_stalled_mid_pipeline_on_a_lease_row_is_ended_by_the_next_lease_take(
        postgres_dsn: str) -> None:
    """A replica cut off between two messages of one pipelined exchange (no Sync yet) is not idle in
    its transaction as PostgreSQL 15 counts it, so idle_in_transaction_session_timeout never ends it.
    Here the relay's kernel would still answer the server's keepalives too: the lock wait of the
    replica taking the node ends it (collector/db.py's end_stalled_sessions)."""
    a = Store(postgres_dsn, 1_000_000, 7.0, replica_id="replica-a")
    b = Store(postgres_dsn, 1_000_000, 7.0, replica_id="replica-b")
    stuck = psycopg.connect(postgres_dsn, autocommit=True, application_name="ghostgpu-collector replica-a")
    try:
        Leases(a, "replica-a", LEASE_TTL_S).take("n1").result(10)
        # replica A's write, cut off after the fence's share lock was flushed and before its Sync
        pg = stuck.pgconn
        pg.enter_pipeline_mode()
        pg.send_query_params(b"BEGIN", None)
        pg.send_query_params(b"SELECT token FROM node_leases WHERE node = 'n1' FOR SHARE", None)
        pg.send_flush_request()
        pg.flush()
        with psycopg.connect(postgres_dsn, autocommit=True) as watcher:
            def holding() -> bool:
                row = watcher.execute("SELECT state, wait_event FROM pg_stat_activity WHERE pid = %s",
                                      (pg.backend_pid,)).fetchone()
                return row == ("active", "ClientRead")
            wait_until(holding, "replica A's session holding the lease row mid-pipeline", 10)

            taker = Leases(b, "replica-b", LEASE_TTL_S)
            refused = 0
            while True:  # as the tracer does: a Hello refused for a lock wait is sent again
                try:
                    taken = taker.take("n1").result(30)
                    break
                except psycopg.errors.LockNotAvailable:
                    refused += 1
                    assert refused < 3, "the lease take kept waiting on the stalled session"
            assert (taken.previous_owner, refused) == ("replica-a", 1)
            assert b.stalled_ended_total == 1
            gone = watcher.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                                   (pg.backend_pid,)).fetchone()
            assert gone == (0,)
    finally:
        stuck.close()
        a.close()
        b.close()
