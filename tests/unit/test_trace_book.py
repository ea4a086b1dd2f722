"""Trace sessions at the collector (collector/traces.py), over real loopback gRPC: scopes resolved
through each node's CRI relay, trace commands to simulated tracers and their answers, records
stored and watched live and after the end, node loss, namespace scopes growing, stop, deadlines."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import grpc
import pytest
from ghostgpu.collector.config import CollectorConfig
from ghostgpu.collector.trace_commands import node_error
from ghostgpu.collector.trace_scope import TraceError
from ghostgpu.collector.trace_watch import TraceWatcher, watch_messages
from ghostgpu.collector.traces import TraceBook

from ghostgpu.common.model.durations import format_ms, parse_duration_s
from ghostgpu.k8s import cri_runtime_v1_pb2 as cri
from ghostgpu.v1 import trace_pb2
from tests.helpers.polling import wait_until
from tests.helpers.sim_tracer import make_consumer, trace_record
from tests.helpers.trace_env import TraceCluster, trace_cluster

A, B, C, D = "a1" * 32, "b2" * 32, "c3" * 32, "d4" * 32
S = trace_pb2.TraceStatus
LIMIT = "limit: node n1 runs 4 trace sessions, the limit (--trace-max-sessions 4)"


def _audit(tc: TraceCluster, session: str = "") -> list[tuple[str, str, str]]:
    return [(e.action, e.who, e.detail) for e in tc.collector.trace_audit(session)]


@pytest.fixture
def tc(tmp_path: Path):  # type: ignore[no-untyped-def]
    with trace_cluster(tmp_path) as cluster:
        yield cluster


# ---- starting -------------------------------------------------------------------------------------


def test_pod_scope_starts_on_its_node_with_its_running_containers(tc: TraceCluster) -> None:
    tc.pod("n1", "ml", "trainer-0", {"train": A})
    tc.pod("n1", "ml", "trainer-0", {"old": B}, state=cri.CONTAINER_EXITED)
    tc.pod("n1", "ml", "other", {"train": C})
    t = tc.connect("n1")
    s = tc.client.start(namespace="ml", pod="trainer-0", duration_ms=30_000, gpu="0")
    assert (s.status, list(s.nodes), list(s.container_ids)) == (S.TRACE_STATUS_RUNNING, ["n1"], [A])
    assert s.requested_by == f"uid:{os.getuid()}" and s.id.startswith("t-")  # the loopback socket's owner
    assert s.deadline_unix_ns - s.started_unix_ns == 30_000 * 1_000_000 and s.max_records == 100_000
    start = t.wait_trace_command("trace_start").trace_start
    assert (start.session, list(start.container_ids), start.gpu, start.pid) == (s.id, [A], "0", 0)
    assert (start.deadline_unix_ns, start.max_records) == (s.deadline_unix_ns, 100_000)
    assert _audit(tc, s.id) == [("start", s.requested_by, "ml/trainer-0 gpu 0 for 30s on n1")]


def test_namespace_scope_starts_on_every_node_running_it(tc: TraceCluster) -> None:
    tc.pod("n1", "ml", "a", {"main": A})
    tc.pod("n2", "ml", "b", {"main": B})
    tc.pod("n3", "web", "c", {"main": C})
    t1, t2, t3 = tc.connect("n1"), tc.connect("n2"), tc.connect("n3")
    s = tc.client.start(namespace="ml", duration_ms=0)
    assert (list(s.nodes), list(s.container_ids)) == (["n1", "n2"], sorted([A, B]))
    assert list(t1.wait_trace_command("trace_start").trace_start.container_ids) == [A]
    assert list(t2.wait_trace_command("trace_start").trace_start.container_ids) == [B]
    assert t3.trace_commands == []
    assert s.deadline_unix_ns - s.started_unix_ns == 30_000_000_000  # the default duration


def test_container_by_id_prefix_by_name_and_pid_on_a_node(tc: TraceCluster) -> None:
    tc.pod("n1", "ml", "trainer-0", {"train": A, "sidecar": B})
    t = tc.connect("n1")
    s = tc.client.start(container=A[:12])
    assert list(t.wait_trace_command("trace_start", s.id).trace_start.container_ids) == [A]
    s = tc.client.start(namespace="ml", pod="trainer-0", container="sidecar")
    assert list(t.wait_trace_command("trace_start", s.id).trace_start.container_ids) == [B]
    s = tc.client.start(pid=4242, node="n1")
    start = t.wait_trace_command("trace_start", s.id).trace_start
    assert (start.pid, list(start.container_ids), list(s.nodes)) == (4242, [], ["n1"])


def test_unknown_things_are_not_found_naming_them(tc: TraceCluster) -> None:
    tc.pod("n1", "ml", "trainer-0", {"train": A, "sidecar": B})
    tc.connect("n1")
    q = tc.client
    assert q.start_error(namespace="nope") == (grpc.StatusCode.NOT_FOUND, "namespace nope not found (no "
                                               "container of it runs on a node with a connected tracer)")
    assert q.start_error(namespace="ml", pod="trainer-9") == (
        grpc.StatusCode.NOT_FOUND, "pod ml/trainer-9 not found (ghostgpu ps lists pods with GPU consumers)")
    assert q.start_error(namespace="ml", pod="trainer-0", container="eval") == (
        grpc.StatusCode.NOT_FOUND, "container eval not found in pod ml/trainer-0 (it has: sidecar, train)")
    code, line = q.start_error(container="ffff")
    assert code == grpc.StatusCode.NOT_FOUND and line.startswith("container ffff not found")
    for rpc in (lambda: q.stop("t-nope"), lambda: list(q.watch("t-nope"))):
        with pytest.raises(grpc.RpcError) as err:
            rpc()
        assert err.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
        assert err.value.details() == "trace session t-nope not found (ghostgpu trace list)"  # type: ignore
    assert [a for a, _, _ in _audit(tc)] == ["refused"] * 4


def test_bad_requests_are_invalid_naming_the_limit(tc: TraceCluster) -> None:
    tc.pod("n1", "ml", "trainer-0", {"train": A})
    tc.connect("n1")
    q, bad = tc.client, grpc.StatusCode.INVALID_ARGUMENT
    assert q.start_error(duration_ms=20 * 60_000, namespace="ml") == (
        bad, "duration 20m exceeds the maximum of 10m (--trace-max-duration)")
    assert q.start_error(pid=7) == (bad, "--pid needs --node: a PID names a process on one node")
    assert q.start_error()[0] == bad
    assert q.start_error(pod="trainer-0")[0] == bad
    assert q.start_error(max_records=100_001, namespace="ml") == (
        bad, "max records 100001 exceeds the maximum of 100000 (--trace-max-records)")
    assert len(_audit(tc)) == 5


def test_nodes_without_a_tracer_or_the_capability_fail_the_precondition(tc: TraceCluster) -> None:
    tc.pod("n2", "ml", "gone-0", {"train": C})
    t2 = tc.connect("n2")
    t2.send_snapshot([make_consumer("n2", 77, container_id=C)], seq=0)
    wait_until(lambda: any(r.k8s.pod == "gone-0" for r in tc.client.consumers()), "n2's pod names from CRI")
    t2.cancel()
    wait_until(lambda: not tc.client.node("n2").connected, "n2 to disconnect")
    tc.connect("n1")
    q, pre = tc.client, grpc.StatusCode.FAILED_PRECONDITION
    assert q.start_error(namespace="ml", pod="gone-0") == (
        pre, "node n2 has no connected tracer: pod ml/gone-0 cannot be traced there")
    assert q.start_error(pid=5, node="n2") == (pre, "node n2 has no connected tracer: pid 5 cannot be "
                                               "traced there")
    tc.pod("n3", "ml", "old-0", {"train": D})
    tc.connect("n3", capabilities=("cri-relay",))
    assert q.start_error(namespace="ml", pod="old-0") == (
        pre, "node n3's tracer cannot trace (version sim-0.1): upgrade it to one that offers \"trace\"")


def test_a_tracers_limit_is_resource_exhausted_and_the_session_failed(tc: TraceCluster) -> None:
    tc.pod("n1", "ml", "trainer-0", {"train": A})
    tc.connect("n1").trace_errors["trace_start"] = LIMIT
    assert tc.client.start_error(namespace="ml") == (grpc.StatusCode.RESOURCE_EXHAUSTED, LIMIT[7:])
    (s,) = tc.client.sessions()
    assert (s.status, s.ended_unix_ns > 0) == (S.TRACE_STATUS_FAILED, True)
    assert s.status_detail == LIMIT[7:]
    assert [a for a, _, _ in _audit(tc, s.id)] == ["refused"]


def test_one_node_refusing_leaves_the_session_on_the_others(tc: TraceCluster) -> None:
    tc.pod("n1", "ml", "a", {"main": A})
    tc.pod("n2", "ml", "b", {"main": B})
    tc.connect("n1").trace_errors["trace_start"] = LIMIT
    tc.connect("n2")
    s = tc.client.start(namespace="ml")
    assert (s.status, list(s.nodes)) == (S.TRACE_STATUS_RUNNING, ["n2"])
    assert s.status_detail == "node n1 runs 4 trace sessions, the limit (--trace-max-sessions 4)"


def test_a_silent_tracer_times_out_unavailable(tc: TraceCluster) -> None:
    tc.pod("n1", "ml", "a", {"main": A})
    tc.connect("n1").trace_silent = True
    assert tc.client.start_error(namespace="ml") == (
        grpc.StatusCode.UNAVAILABLE, "node n1's tracer did not answer trace_start within 1 s")


# ---- records, watching, ending --------------------------------------------------------------------


def test_watch_live_then_show_after_the_end(tc: TraceCluster) -> None:
    tc.pod("n1", "ml", "trainer-0", {"train": A})
    t = tc.connect("n1")
    s = tc.client.start(namespace="ml", pod="trainer-0")
    t.wait_trace_command("trace_start")
    t.send_trace(s.id, [trace_record(container_id=A) for _ in range(3)])
    wait_until(lambda: tc.client.session(s.id).records_total == 3, "3 records stored")
    got: list[trace_pb2.TraceWatchMessage] = []
    watching = threading.Thread(target=lambda: got.extend(tc.client.watch(s.id)))
    watching.start()
    wait_until(lambda: len(got) >= 1, "the stored records")
    t.send_trace(s.id, [trace_record(container_id=A, pid=9)], dropped_limit_total=4, dropped_ringbuf_total=2)
    wait_until(lambda: len(got) >= 2, "the live batch")
    t.end_trace(s.id)
    watching.join(10)
    assert not watching.is_alive(), "the watch ends after the session's end"
    assert [[r.seq for r in m.records] for m in got] == [[1, 2, 3], [4], []]
    assert [m.session.status for m in got] == [S.TRACE_STATUS_RUNNING] * 2 + [S.TRACE_STATUS_COMPLETED]
    r = got[0].records[0]
    assert (r.node, r.namespace, r.pod, r.container) == ("n1", "ml", "trainer-0", "train")
    records, final = tc.client.show(s.id)
    assert [x.seq for x in records] == [1, 2, 3, 4] and records[3].pid == 9
    assert (final.status, final.status_detail) == (S.TRACE_STATUS_COMPLETED, "deadline")
    assert final.records_total == 4
    assert (final.dropped_limit_total, final.dropped_ringbuf_total, final.dropped_store_total) == (4, 2, 0)
    assert [a for a, _, _ in _audit(tc, s.id)] == ["start", "expire"]


def test_counters_sum_over_nodes_and_a_watcher_leaving_changes_nothing(tc: TraceCluster) -> None:
    tc.pod("n1", "ml", "a", {"main": A})
    tc.pod("n2", "ml", "b", {"main": B})
    t1, t2 = tc.connect("n1"), tc.connect("n2")
    s = tc.client.start(namespace="ml")
    watch = tc.client.watch(s.id)
    next(watch)  # the session, nothing stored yet
    watch.cancel()
    live = tc.collector.traces._live[s.id]
    wait_until(lambda: not live.watchers, "the watcher to go with its client")
    t1.send_trace(s.id, [trace_record(container_id=A)], dropped_limit_total=1, dropped_transport_total=5)
    t2.send_trace(s.id, [trace_record(container_id=B)] * 2, dropped_limit_total=2, dropped_ringbuf_total=3)
    t1.send_trace(s.id, [], dropped_limit_total=10)  # running totals: the latest counts
    wait_until(lambda: tc.client.session(s.id).dropped_limit_total == 12, "the counters summed")
    got = tc.client.session(s.id)
    assert (got.records_total, got.dropped_ringbuf_total, got.dropped_transport_total) == (3, 3, 5)
    assert got.status == S.TRACE_STATUS_RUNNING
    t1.end_trace(s.id)
    assert tc.client.session(s.id).status == S.TRACE_STATUS_RUNNING  # n2 still runs it
    t2.end_trace(s.id, "error: ring buffer gone")
    wait_until(lambda: tc.client.session(s.id).status == S.TRACE_STATUS_COMPLETED, "the end")
    assert tc.client.session(s.id).status_detail == "deadline; node n2: error: ring buffer gone"


def test_node_lost_ends_the_session_and_keeps_its_records(tc: TraceCluster) -> None:
    tc.pod("n1", "ml", "a", {"main": A})
    tc.pod("n2", "ml", "b", {"main": B})
    t1, t2 = tc.connect("n1"), tc.connect("n2")
    s = tc.client.start(namespace="ml")
    t1.send_trace(s.id, [trace_record(container_id=A)] * 2)
    wait_until(lambda: tc.client.session(s.id).records_total == 2, "n1's records stored")
    t1.cancel()
    wait_until(lambda: tc.client.session(s.id).status == S.TRACE_STATUS_NODE_LOST, "node lost")
    got = tc.client.session(s.id)
    assert got.status_detail == "node n1's tracer disconnected mid-session; records so far are kept"
    assert t2.wait_trace_command("trace_stop", s.id).trace_stop.session == s.id
    records, _ = tc.client.show(s.id)
    assert [(r.node, r.seq, r.pod) for r in records] == [("n1", 1, "a"), ("n1", 2, "a")]
    assert ("node-lost", "node n1", got.status_detail) in _audit(tc, s.id)


def test_namespace_scope_takes_in_containers_started_mid_session(tc: TraceCluster) -> None:
    tc.pod("n1", "ml", "a", {"main": A})
    t1 = tc.connect("n1")
    tc.connect("n2")  # nothing of ml there yet
    s = tc.client.start(namespace="ml")
    t1.wait_trace_command("trace_start")
    tc.pod("n1", "ml", "a2", {"main": B})
    update = t1.wait_trace_command("trace_update", s.id).trace_update
    assert sorted(update.container_ids) == sorted([A, B])
    tc.pod("n2", "ml", "c", {"worker": C})
    start = tc.tracers["n2"].wait_trace_command("trace_start", s.id).trace_start
    assert (list(start.container_ids), start.deadline_unix_ns) == ([C], s.deadline_unix_ns)
    wait_until(lambda: list(tc.client.session(s.id).nodes) == ["n1", "n2"], "n2 in the session")
    assert sorted(tc.client.session(s.id).container_ids) == sorted([A, B, C])
    tc.tracers["n2"].send_trace(s.id, [trace_record(container_id=C)])
    wait_until(lambda: tc.client.session(s.id).records_total == 1, "n2's record")
    assert [(r.pod, r.container) for r in tc.client.show(s.id)[0]] == [("c", "worker")]


def test_a_namespace_with_nothing_running_yet_starts_and_waits(tc: TraceCluster) -> None:
    tc.pod("n1", "batch", "done", {"job": A}, state=cri.CONTAINER_EXITED)
    t = tc.connect("n1")
    s = tc.client.start(namespace="batch")
    assert (s.status, list(s.nodes)) == (S.TRACE_STATUS_RUNNING, [])
    tc.pod("n1", "batch", "next", {"job": B})
    assert list(t.wait_trace_command("trace_start", s.id).trace_start.container_ids) == [B]


def test_stop_tells_every_node_and_waits_for_their_last_batch(tc: TraceCluster) -> None:
    tc.pod("n1", "ml", "a", {"main": A})
    t = tc.connect("n1")
    s = tc.client.start(namespace="ml")
    t.send_trace(s.id, [trace_record(container_id=A)])
    stopped = tc.client.stop(s.id)
    assert t.wait_trace_command("trace_stop").trace_stop.session == s.id
    assert (stopped.status, stopped.records_total) == (S.TRACE_STATUS_STOPPED, 1)
    assert stopped.status_detail == f"stopped by {stopped.requested_by}"
    assert tc.client.stop(s.id) == stopped  # again: nothing changes
    assert [a for a, _, _ in _audit(tc, s.id)] == ["start", "stop"]


def test_the_collector_ends_a_session_its_tracers_never_end(tc: TraceCluster) -> None:
    tc.pod("n1", "ml", "a", {"main": A})
    tc.connect("n1")
    s = tc.client.start(namespace="ml", duration_ms=200)
    wait_until(lambda: tc.client.session(s.id).status == S.TRACE_STATUS_COMPLETED, "the deadline + grace")
    assert tc.client.session(s.id).status_detail == "deadline; no final batch from node n1"
    assert _audit(tc, s.id)[-1] == ("expire", "collector", "deadline; no final batch from node n1")


def test_a_pid_scope_names_records_from_what_cri_said_of_their_container(tc: TraceCluster) -> None:
    tc.pod("n1", "ml", "trainer-0", {"train": A})
    t = tc.connect("n1")
    t.send_snapshot([make_consumer("n1", 4242, container_id=A)], seq=0)
    wait_until(lambda: any(r.k8s.pod == "trainer-0" for r in tc.client.consumers()), "CRI's names cached")
    s = tc.client.start(pid=4242, node="n1")
    t.send_trace(s.id, [trace_record(container_id=A), trace_record()])
    wait_until(lambda: tc.client.session(s.id).records_total == 2, "the records")
    assert [(r.namespace, r.pod, r.container) for r in tc.client.show(s.id)[0]] == [
        ("ml", "trainer-0", "train"), ("", "", "")]


def test_store_bounds_count_what_they_let_go(tc: TraceCluster) -> None:
    tc.pod("n1", "ml", "a", {"main": A})
    t = tc.connect("n1")
    s = tc.client.start(namespace="ml", max_records=5)
    assert t.wait_trace_command("trace_start").trace_start.max_records == 5
    t.send_trace(s.id, [trace_record(container_id=A)] * 3)
    t.send_trace(s.id, [trace_record(container_id=A)] * 4)
    wait_until(lambda: tc.client.session(s.id).dropped_store_total == 2, "2 records over the bound")
    assert tc.client.session(s.id).records_total == 5
    assert [r.seq for r in tc.client.show(s.id)[0]] == [1, 2, 3, 4, 5]


# ---- pieces -------------------------------------------------------------------------------------


def test_error_prefixes_pick_the_code_and_the_node_is_named() -> None:
    e = node_error("n1", LIMIT)
    assert (e.code, e.line) == (grpc.StatusCode.RESOURCE_EXHAUSTED, LIMIT[len("limit: "):])
    for line, code in (("not found: no process 5", grpc.StatusCode.NOT_FOUND),
                       ("invalid: no GPU 9", grpc.StatusCode.INVALID_ARGUMENT),
                       ("BPF is off", grpc.StatusCode.FAILED_PRECONDITION)):
        e = node_error("gpu-3", line)
        assert e.code == code and e.line.startswith("node gpu-3: ")
    assert node_error("gpu-3", "tracer on gpu-3: boom").line == "tracer on gpu-3: boom"


def test_durations_parse_and_print_as_the_flags_take_them() -> None:
    assert [parse_duration_s(v, "--x") for v in ("30s", "10m", "1h", "500ms", "45", 600.0)] == [
        30, 600, 3600, 0.5, 45, 600]
    with pytest.raises(ValueError, match=r"^--x 'ten': use"):
        parse_duration_s("ten", "--x")
    assert [format_ms(v) for v in (1_200_000, 90_000, 3_600_000, 1500)] == ["20m", "90s", "1h", "1500ms"]


def test_a_watcher_that_falls_behind_is_dropped_not_the_session() -> None:
    async def run() -> tuple[int, list[int], str]:
        w = TraceWatcher(max_records=2)
        running = trace_pb2.TraceSession(id="t-1", status=S.TRACE_STATUS_RUNNING)
        w.push([trace_pb2.TraceRecord(node="n1", seq=1)], running)
        got = [m async for m in watch_messages([], None, lambda: running)]  # not following: the session
        w.push([trace_pb2.TraceRecord(node="n1", seq=s) for s in (2, 3)], running)
        with pytest.raises(TraceError) as err:
            async for _ in watch_messages([], w, lambda: running):
                pass
        return err.value.code.value[0], [len(m.records) for m in got], err.value.line

    code, sent, line = asyncio.run(run())
    assert (code, sent) == (grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], [0])
    assert line.startswith("this watch fell 2 records behind and was dropped; the session goes on")


def test_a_book_with_no_stream_answers_not_found_for_ids() -> None:
    class NoStore:
        def load(self) -> list[object]:
            return []

    book = TraceBook({}, NoStore(), CollectorConfig().trace_limits())  # type: ignore[arg-type]
    with pytest.raises(TraceError) as err:
        book.get("t-1")
    assert err.value.code == grpc.StatusCode.NOT_FOUND and book.list() == []
