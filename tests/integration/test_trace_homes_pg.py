"""Trace sessions and their home replica on one PostgreSQL (the real server, tests/helpers/postgres.py;
collector/trace_homes.py): a session started on replica A is listed, shown and stopped through
replica B (B audits the stop, A ends the session, B's tracer is told); a stop for a home that is gone
fails at once naming it; a gone home's running session is ended past its deadline by exactly one of
the replicas left, and a follower waiting on it ends; /metrics counts the listener's notifications
and the replica commands."""

from __future__ import annotations

import contextlib
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from ghostgpu.collector.main import Collector
from ghostgpu.collector.store import Store
from ghostgpu.collector.trace_homes import HOME_GONE_GRACE_S, HOME_STOP
from ghostgpu.collector.trace_store import TraceStore
from prometheus_client.parser import text_string_to_metric_families

from ghostgpu.common.model.trace import TraceScope, TraceSession, TraceStatus
from ghostgpu.v1 import trace_pb2
from tests.helpers.cri_fake import FakeCri
from tests.helpers.polling import wait_until
from tests.helpers.replicas import TRAINER_CID
from tests.helpers.replicas import replica as shared_replica
from tests.helpers.sim_tracer import SimTracer, trace_record
from tests.helpers.trace_env import FAST, TRACE_CAPS, TraceClient, cri_via

pytestmark = pytest.mark.postgres

CID = TRAINER_CID
DEADLINE_S = 20.0  # a hand-over takes a notice or a sweep (1 s); generous for a loaded 2-core VM
S = trace_pb2.TraceStatus
GONE = "replica-gone"
CHECK_OFTEN = replace(FAST, home_gone_check_s=0.05)


def replica(tmp_path: Path, dsn: str, name: str,
            **settings: Any) -> contextlib.AbstractContextManager[Collector]:
    timing = settings.pop("trace_timing", FAST)
    return shared_replica(tmp_path, dsn, name, settings=settings, trace_timing=timing)


def plant_running_session(dsn: str, sid: str, deadline_unix_ns: int) -> None:
    """A running session whose home, GONE, never ends it: its row as GONE wrote it, then nothing."""
    store = Store(dsn, 1000, 7, replica_id=GONE)
    try:
        TraceStore(store, 1000, 3600).save(TraceSession(
            id=sid, scope=TraceScope(namespace="ml"), requested_by="user:alice",
            started_unix_ns=deadline_unix_ns - 60 * 10**9, deadline_unix_ns=deadline_unix_ns,
            status=TraceStatus.RUNNING, max_records=100, nodes=("gpu-7",)))
        store.barrier().result(10)
    finally:
        store.close()


def metrics(c: Collector) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(f"http://{c.metrics_address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def commands(c: Collector) -> dict[tuple[str, str, str], float]:
    return {(s["role"], s["kind"], s["result"]): v
            for s, v in metrics(c).get("ghostgpu_collector_replica_commands_total", [])}


def test_a_session_is_listed_shown_and_stopped_through_a_replica_that_is_not_its_home(
        tmp_path: Path, postgres_dsn: str, trainer_runtime: FakeCri) -> None:
    with replica(tmp_path, postgres_dsn, "a", metrics_listen="127.0.0.1:0") as a, \
            replica(tmp_path, postgres_dsn, "b", metrics_listen="127.0.0.1:0") as b, \
            TraceClient(a.address) as qa, TraceClient(b.address) as qb, \
            SimTracer(b.address, "gpu-7", cri=cri_via(trainer_runtime), capabilities=TRACE_CAPS) as t:
        t.connect()
        wait_until(lambda: "gpu-7" in b.leases.held, "replica b holding gpu-7's lease", DEADLINE_S)
        s = qa.start(namespace="ml", pod="trainer-0", duration_ms=60_000)  # a is its home
        t.wait_trace_command("trace_start", s.id)
        t.send_trace(s.id, [trace_record(container_id=CID) for _ in range(2)])
        wait_until(lambda: qa.session(s.id).records_total == 2, "replica a counting what b stored",
                   DEADLINE_S)

        # b lists a's session (as a last wrote its row) and shows it
        wait_until(lambda: qb.session(s.id).records_total == 2, "replica b listing a's session", DEADLINE_S)
        records, shown = qb.show(s.id)
        assert [r.seq for r in records] == [1, 2] and shown.status == S.TRACE_STATUS_RUNNING

        # the stop through b: b audits it, a ends the session, the tracer is told
        stopped = qb.stop(s.id)
        assert t.wait_trace_command("trace_stop", s.id).trace_stop.session == s.id
        assert (stopped.status, stopped.records_total) == (S.TRACE_STATUS_STOPPED, 2)
        assert stopped.status_detail == f"stopped by {s.requested_by}"
        assert qa.session(s.id).status == S.TRACE_STATUS_STOPPED  # ended at its home
        audit = a.trace_audit(s.id)
        assert [e.action for e in audit] == ["start", "stop"]
        assert "at replica b, ended by its home a" in audit[1].detail
        assert qb.stop(s.id).status == S.TRACE_STATUS_STOPPED  # again: ended, nothing handed over

        code, details = stop_error(qb, "t-00000000")
        assert code == grpc.StatusCode.NOT_FOUND and "t-00000000 not found" in details

        # /metrics: the hand-over, both sides, and the listeners' notifications
        assert commands(b)[("sent", HOME_STOP, "ok")] == 1
        assert commands(a)[("run", HOME_STOP, "ok")] == 1
        assert commands(a)[("sent", "trace_start", "ok")] >= 1  # a's start, run by b for gpu-7
        got = metrics(b)
        heard = {s["channel"]: v for s, v in got["ghostgpu_collector_notifications_total"]}
        assert heard["ghostgpu_commands"] > 0 and heard["ghostgpu_trace"] > 0
        assert got["ghostgpu_collector_notify_up"] == [({}, 1.0)]


def stop_error(client: TraceClient, sid: str) -> tuple[Any, str]:
    try:
        s = client.stop(sid)
    except grpc.RpcError as e:
        return e.code(), e.details()  # type: ignore[attr-defined]
    raise AssertionError(f"StopTrace {sid} succeeded: {s}")


def test_a_stop_for_a_home_that_is_gone_fails_at_once_naming_it(tmp_path: Path, postgres_dsn: str) -> None:
    plant_running_session(postgres_dsn, "t-0000dead", time.time_ns() + 3600 * 10**9)
    with replica(tmp_path, postgres_dsn, "b") as b, TraceClient(b.address) as qb:
        code, details = stop_error(qb, "t-0000dead")
        assert code == grpc.StatusCode.UNAVAILABLE
        assert details == (f"trace session t-0000dead: replica {GONE} did not take {HOME_STOP} within 2 s "
                           "(is it running?); it is the session's home: the session ends at its deadline, "
                           f"or {HOME_GONE_GRACE_S:g} s after it by any replica")
        assert [e.action for e in b.trace_audit("t-0000dead")] == ["error"]
        assert qb.session("t-0000dead").status == S.TRACE_STATUS_RUNNING  # until its deadline


def test_a_gone_homes_session_is_ended_past_its_deadline_by_one_replica_and_its_follower_ends(
        tmp_path: Path, postgres_dsn: str) -> None:
    # past its deadline by all but a second of what the replicas wait for a home to end it
    after_s = FAST.end_grace_s + HOME_GONE_GRACE_S
    plant_running_session(postgres_dsn, "t-00000001", time.time_ns() - int((after_s - 1.0) * 1e9))
    with replica(tmp_path, postgres_dsn, "b", trace_timing=CHECK_OFTEN) as b, \
            replica(tmp_path, postgres_dsn, "c", trace_timing=CHECK_OFTEN) as c, \
            TraceClient(b.address) as qb, TraceClient(c.address) as qc:
        # a follower on b: waits for the end, which no home will write
        last = None
        for msg in qb.watch("t-00000001", follow=True, timeout_s=DEADLINE_S):
            last = msg.session
        assert last is not None and last.status == S.TRACE_STATUS_NODE_LOST
        assert f"home replica {GONE} gone" in last.status_detail
        ended_mono = time.monotonic()

        # every replica looked again since: still one end, one audit row
        for r in (b, c):
            wait_until(lambda r=r: r.call(lambda: not r.traces._checking_homes
                                          and r.traces._next_home_check > ended_mono + 0.05),
                       f"replica {r.config.replica_id} checking again", DEADLINE_S)
        rows = [e for r in (b, c) for e in r.trace_audit("t-00000001")]
        assert [e.action for e in rows] == ["node-lost"] * 2  # one row, read through both replicas
        assert rows[0].detail == last.status_detail
        by = [name for name in ("b", "c") if f"ended by replica {name};" in last.status_detail]
        assert len(by) == 1
        assert qc.session("t-00000001").status == S.TRACE_STATUS_NODE_LOST
