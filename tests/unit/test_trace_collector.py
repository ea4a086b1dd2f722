"""Trace sessions wired into the real collector: the --trace-* flags, who started a session on the
unix socket and over TCP, sessions and records across a collector restart, the store's total bound
making room from old sessions, and the audit trail the CLI can read (Collector.trace_audit)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import grpc
import pytest
from ghostgpu.cli import main as cli
from ghostgpu.collector.config import CollectorConfig
from ghostgpu.collector.run import run_collector
from ghostgpu.collector.trace_commands import TraceLimits
from ghostgpu.collector.trace_store import RESTARTED
from ghostgpu.collector.traces import STOPPED

from ghostgpu.common.system.settings import flag_values
from ghostgpu.v1 import trace_pb2
from tests.helpers.polling import wait_until
from tests.helpers.sim_tracer import trace_record
from tests.helpers.trace_env import FAST, TraceClient, trace_cluster

A, B = "a1" * 32, "b2" * 32
S = trace_pb2.TraceStatus


def parse(*argv: str) -> argparse.Namespace:
    return cli._build_parser().parse_args(list(argv))


@pytest.mark.parametrize("command", ["collector", "up"])
def test_trace_flags_reach_the_collector(command: str) -> None:
    args = parse(command, "--trace-max-duration", "20m", "--trace-default-duration", "45s",
                 "--trace-max-records", "500", "--trace-store-max-records", "9000",
                 "--trace-retention-h", "2")
    cfg = CollectorConfig(**flag_values(CollectorConfig, args))
    assert cfg.trace_limits() == TraceLimits(max_duration_s=1200, default_duration_s=45, max_records=500)
    assert (cfg.trace_store_max_records, cfg.trace_retention_h) == (9000, 2.0)
    cfg = CollectorConfig(**flag_values(CollectorConfig, parse(command)))
    assert cfg.trace_limits() == TraceLimits(max_duration_s=600, default_duration_s=30, max_records=100_000)
    assert (cfg.trace_store_max_records, cfg.trace_retention_h) == (1_000_000, 24.0)


@pytest.mark.parametrize(("argv", "line"), [
    (["--trace-max-duration", "ten"], "--trace-max-duration 'ten': use a duration like 30s, 2m"),
    (["--trace-default-duration", "20m"], "--trace-default-duration 1200s is more than --trace-max-duration"),
    (["--trace-retention-h", "0"], "--trace-retention-h 0.0: must be more than 0"),
])
def test_a_bad_trace_flag_is_one_line_and_exit_2(argv: list[str], line: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("collector", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "c.db"), *argv)
    assert run_collector(args, lambda stop: None) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ghostgpu: collector: {line}") and err.count("\n") == 1


def test_requested_by_is_the_callers_uid_from_the_kernel(tmp_path: Path) -> None:
    # No claim travels: on the unix socket SO_PEERCRED names the uid, on loopback TCP /proc/net/tcp
    # does (collector/peers.py). Both are this test's own uid, which the default policy makes admin.
    me = f"uid:{os.getuid()}"
    with trace_cluster(tmp_path, unix=True) as tc:
        tc.pod("n1", "ml", "a", {"main": A})
        tc.connect("n1")
        with TraceClient(f"unix://{tmp_path}/collector.sock") as q:
            s = q.start(namespace="ml")
            assert s.requested_by == me
            assert q.stop(s.id).status_detail == f"stopped by {me}"
        audit = [(e.action, e.who) for e in tc.collector.trace_audit(s.id)]
        assert audit == [("start", me), ("stop", me)]


def test_sessions_and_records_survive_a_restart(tmp_path: Path) -> None:
    with trace_cluster(tmp_path) as tc:
        tc.pod("n1", "ml", "a", {"main": A})
        t = tc.connect("n1")
        s = tc.client.start(namespace="ml")
        t.send_trace(s.id, [trace_record(container_id=A)] * 3)
        wait_until(lambda: tc.client.session(s.id).records_total == 3, "3 records stored")
        tc.collector.stop()  # with its tracer still connected
        assert t.wait_trace_command("trace_stop", s.id).trace_stop.session == s.id
    with trace_cluster(tmp_path) as tc:
        got = tc.client.session(s.id)
        # the collector stopped under it: ended, records kept
        assert (got.status, got.status_detail, got.records_total) == (S.TRACE_STATUS_NODE_LOST, STOPPED, 3)
        records, _ = tc.client.show(s.id)
        assert [(r.seq, r.pod) for r in records] == [(1, "a"), (2, "a"), (3, "a")]
        assert [e.action for e in tc.collector.trace_audit(s.id)] == ["start", "node-lost"]
    assert RESTARTED.startswith("collector restarted")  # a crash instead: tests/unit/test_trace_store.py


def test_the_total_bound_makes_room_from_ended_sessions(tmp_path: Path) -> None:
    with trace_cluster(tmp_path, trace_store_max_records=5) as tc:
        tc.pod("n1", "ml", "a", {"main": A})
        t = tc.connect("n1")
        old = tc.client.start(namespace="ml")
        t.send_trace(old.id, [trace_record(container_id=A)] * 4)
        t.end_trace(old.id)
        wait_until(lambda: tc.client.session(old.id).status == S.TRACE_STATUS_COMPLETED, "the first to end")
        new = tc.client.start(namespace="ml")
        t.send_trace(new.id, [trace_record(container_id=A)] * 3)
        wait_until(lambda: [s.id for s in tc.client.sessions()] == [new.id], "the old session to go")
        t.send_trace(new.id, [trace_record(container_id=A)] * 4)  # nothing ended is left to make room
        wait_until(lambda: tc.client.session(new.id).dropped_store_total == 2, "records past the total")
        assert tc.client.session(new.id).records_total == 5


def test_list_is_newest_first_and_an_unknown_rpc_state_is_clean(tmp_path: Path) -> None:
    with trace_cluster(tmp_path, limits=FAST) as tc:
        tc.pod("n1", "ml", "a", {"main": A})
        tc.pod("n1", "ml", "b", {"main": B})
        tc.connect("n1")
        first = tc.client.start(namespace="ml", pod="a")
        second = tc.client.start(namespace="ml", pod="b")
        assert [s.id for s in tc.client.sessions()] == [second.id, first.id]
        with pytest.raises(grpc.RpcError) as err:
            tc.client.stop("")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
