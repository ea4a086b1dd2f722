"""Trace sessions have a home replica (collector/trace_store.py): a replica starting up on a shared
PostgreSQL store ends the sessions it ran itself (nobody received their end), never another replica's
running one."""

from __future__ import annotations

import time

import pytest
from ghostgpu.collector.store import Store
from ghostgpu.collector.trace_store import RESTARTED, TraceStore

from ghostgpu.common.model.trace import TraceScope, TraceSession, TraceStatus

pytestmark = pytest.mark.postgres


def _running(sid: str) -> TraceSession:
    now = time.time_ns()
    return TraceSession(id=sid, scope=TraceScope(namespace="ml"), requested_by="user:alice",
                        started_unix_ns=now, deadline_unix_ns=now + 3600 * 10**9,
                        status=TraceStatus.RUNNING, max_records=100)


def test_a_starting_replica_ends_its_own_running_sessions_and_leaves_the_others(postgres_dsn: str) -> None:
    a = Store(postgres_dsn, 1000, 7, replica_id="replica-a")
    b = Store(postgres_dsn, 1000, 7, replica_id="replica-b")
    try:
        TraceStore(a, 1000, 3600).save(_running("t-a"))
        TraceStore(b, 1000, 3600).save(_running("t-b"))
        a.barrier().result(10)
        b.barrier().result(10)

        # replica-b starts again: its own session ended as node lost, replica-a's left running
        loaded = {s.id: s for s in TraceStore(b, 1000, 3600).load()}
        assert set(loaded) == {"t-b"}
        assert loaded["t-b"].status == TraceStatus.NODE_LOST and loaded["t-b"].status_detail == RESTARTED
        b.barrier().result(10)  # its end row committed

        # replica-a starts again: now t-a ends too, and t-b is an ended session both see
        loaded = {s.id: s for s in TraceStore(a, 1000, 3600).load()}
        assert loaded["t-a"].status == TraceStatus.NODE_LOST
        assert loaded["t-b"].status == TraceStatus.NODE_LOST
    finally:
        a.close()
        b.close()
