"""Trace sessions on the real tracer (BPF on), driven through its stream by a scripted collector.

The workload is tests/helpers/gpucalls.c: the ioctl sequence of a CUDA start-up, from two
threads taking turns, on real character devices in a private /dev (every ioctl returns ENOTTY,
but the parameter blocks are real user memory the kernel side reads at entry and exit). It writes
what it issued; the decoded records must match it exactly, per thread and in order. Two driver
layouts that differ (RM_ALLOC's status offset, UVM_FREE) are checked through the fake NVML's
driver version.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ghostgpu.common.model.trace import TraceRecord
from ghostgpu.common.wire.convert_trace import record_from_proto
from ghostgpu.v1 import stream_pb2, trace_pb2
from tests.helpers.container import FakeContainer
from tests.helpers.fake_collector import FakeCollector
from tests.helpers.fakenvml import FakeNvml
from tests.helpers.gpucalls import NODES_MMAP, GpuCalls, GpuCallsOptions, expected_calls
from tests.helpers.polling import wait_until
from tests.helpers.tracer_proc import TracerProcess

pytestmark = pytest.mark.usefixtures("root_bpf")

FAST = ["--grace-s", "0.5"]
COMPARED = ("call", "escape", "h_class", "class_name", "cmd", "cmd_name", "nv_status", "nv_status_name",
            "ret")


class Traced:
    """A tracer streaming to a FakeCollector that starts and stops sessions by command."""

    def __init__(self, collector: FakeCollector, tracer: TracerProcess) -> None:
        self.fc, self.tracer = collector, tracer
        self._ids = 0

    def command(self, **body: Any) -> trace_pb2.TraceCommandResult:
        self._ids += 1
        cid = self._ids
        self.fc.send_command(stream_pb2.Command(id=cid, **body))
        wait_until(lambda: any(r.msg.result.id == cid for r in self.fc.messages("result")),
                   what=f"the answer to command {cid}", timeout_s=10)
        return next(r.msg.result.trace for r in self.fc.messages("result") if r.msg.result.id == cid)

    def start(self, session: str, seconds: float = 60, **scope: Any) -> None:
        answer = self.command(trace_start=trace_pb2.TraceStart(
            session=session, deadline_unix_ns=time.time_ns() + int(seconds * 1e9), **scope))
        assert answer.error == "", answer.error

    def batches(self, session: str) -> list[trace_pb2.TraceBatch]:
        return [r.msg.trace for r in self.fc.messages("trace") if r.msg.trace.session == session]

    def ended(self, session: str) -> trace_pb2.TraceBatch | None:
        return next((b for b in self.batches(session) if b.ended), None)

    def stop(self, session: str) -> trace_pb2.TraceBatch:
        self.command(trace_stop=trace_pb2.TraceStop(session=session))
        wait_until(lambda: self.ended(session) is not None, what=f"{session}'s last batch", timeout_s=10)
        return self.ended(session)  # type: ignore[return-value]

    def records(self, session: str) -> list[TraceRecord]:
        return [record_from_proto(r, session) for b in self.batches(session) for r in b.records]


@pytest.fixture
def traced(tmp_path: Path, fake_nvml: FakeNvml, request: pytest.FixtureRequest) -> Iterator[Traced]:
    driver = getattr(request, "param", "595.45.04")  # what NVML says: the layouts follow it
    fake_nvml.driver_version = driver
    fake_nvml.write()
    with FakeCollector() as fc, TracerProcess(tmp_path, FAST, fake_nvml.env(), collector=fc.target) as tracer:
        tracer.wait_ready()
        wait_until(lambda: any("trace" in r.msg.hello.capabilities for r in fc.messages("hello")),
                   what="a Hello offering trace sessions", timeout_s=15)
        yield Traced(fc, tracer)


def by_tid(records: list[TraceRecord], kinds: tuple[str, ...]) -> dict[int, list[TraceRecord]]:
    out: dict[int, list[TraceRecord]] = {}
    for r in sorted(records, key=lambda r: r.seq):
        if r.kind in kinds:
            out.setdefault(r.tid, []).append(r)
    return out


def assert_matches(expected: dict[int, list[dict]], got: dict[int, list[TraceRecord]]) -> None:
    """Every call the workload issued, decoded, per thread and in order."""
    assert sorted(got) == sorted(expected), "one record list per workload thread"
    for tid, calls in expected.items():
        want = [(c["kind"], c.get("device"), c.get("fd") if c["kind"] != "munmap" else None) for c in calls]
        have = [(r.kind, r.device, r.fd) for r in got[tid]]
        assert have == want, f"tid {tid}: kinds, devices and fds in order"
        for call, rec in zip(calls, got[tid], strict=True):
            if call["kind"] == "ioctl":
                want_fields = {k: call[k] for k in COMPARED}
                assert {k: getattr(rec, k) for k in COMPARED} == want_fields, (tid, call["i"])
                assert rec.request == call["request"] and rec.duration_ns > 0
                handles = {v for v in call["handles"].values()}
                assert handles <= set(rec.args.values()), (call["i"], call["handles"], rec.args)
            elif call["kind"] == "open":
                assert rec.ret == call["ret"] and rec.args["path"] == call["path"]
            elif call["kind"] == "mmap":
                assert rec.args["length"] == str(call["length"]) and rec.ret == call["ret"]


@pytest.mark.parametrize("traced", ["525.47.04", "595.45.04"], indirect=True)
def test_a_container_session_decodes_the_cuda_startup_exactly(traced: Traced, fake_nvml: FakeNvml) -> None:
    driver = fake_nvml.driver_version
    with FakeContainer() as c:
        procs = [os.path.join(d, "cgroup.procs") for d in c.cgroup_paths.values()]
        opts = GpuCallsOptions(driver=driver, private_dev=NODES_MMAP, cgroups=procs)
        with GpuCalls(opts) as run:
            run.wait_ready()
            traced.start("t-ctr", container_ids=[c.container_id])
            run.release()
            expected = expected_calls(run.finish())
        end = traced.stop("t-ctr")
    assert (end.end_reason, end.dropped_limit_total, end.dropped_ringbuf_total) == ("stopped", 0, 0)
    records = traced.records("t-ctr")
    assert all(r.container_id == c.container_id for r in records)
    kinds = ("ioctl", "open", "mmap", "munmap", "close")
    assert_matches({tid: [x for x in calls if x["kind"] in kinds] for tid, calls in expected.items()},
                   by_tid(records, kinds))
    assert [r.kind for r in records if r.kind == "exit"] == ["exit"]


def test_a_pid_session_follows_a_forked_child(traced: Traced) -> None:
    opts = GpuCallsOptions(driver="595.45.04", private_dev=NODES_MMAP, fork=True)
    with GpuCalls(opts) as run:
        pid = run.wait_ready().pid
        traced.start("t-pid", pid=pid)
        run.release()
        issued = run.finish()
    traced.stop("t-pid")
    records = traced.records("t-pid")
    [child] = [x["child_pid"] for x in issued if x["kind"] == "fork"]
    child_calls = [x for x in issued if x["pid"] == child and x["kind"] == "ioctl"]
    assert len(child_calls) == 3
    got = [r for r in records if r.pid == child and r.kind == "ioctl"]
    assert [(r.cmd_name, r.nv_status_name) for r in got] == [(x["cmd_name"], x["nv_status_name"])
                                                             for x in child_calls]
    assert any(r.kind == "fork" and r.child_pid == child for r in records)


def test_a_session_past_its_record_limit_counts_what_it_drops(traced: Traced) -> None:
    opts = GpuCallsOptions(driver="595.45.04", private_dev=NODES_MMAP, loop=20)
    with GpuCalls(opts) as run:
        pid = run.wait_ready().pid
        traced.command(trace_start=trace_pb2.TraceStart(
            session="t-lim", pid=pid, deadline_unix_ns=time.time_ns() + 60 * 10**9, max_records=50))
        run.release()
        issued = run.finish()
    end = traced.stop("t-lim")
    records = traced.records("t-lim")
    assert len(records) == end.records_total == 50
    # Every call past the limit is counted: plus the exit, minus the munmap (a mapping whose mmap
    # was not recorded is not known to be a GPU mapping).
    assert end.dropped_limit_total == len(issued) - 50 + 1 - 1


def test_attribution_goes_on_while_a_session_overflows(traced: Traced) -> None:
    """A session flooded past its record limit and its ring buffer (a spinning workload) never
    holds up attribution: a new consumer's open is reported meanwhile, and the drops are counted."""
    opts = GpuCallsOptions(driver="595.45.04", private_dev=NODES_MMAP, spin=3_000_000)
    with GpuCalls(opts) as run:
        pid = run.wait_ready().pid
        traced.command(trace_start=trace_pb2.TraceStart(
            session="t-flood", pid=pid, deadline_unix_ns=time.time_ns() + 60 * 10**9, max_records=1000))
        run.release()
        with FakeContainer() as c:
            p = c.run(["open", "/dev/nvidia0", "ready", "wait"])
            p.wait_ready()
            traced.tracer.wait_for(lambda r: r.get("event") == "open" and r.get("pid") == p.host_pid,
                                   what="the new consumer's open, during the flood", timeout_s=5)
            assert run.popen.poll() is None, "the flood was still running"
            p.release()
        run.finish(timeout_s=120)
    end = traced.stop("t-flood")
    assert end.records_total == 1000 and end.dropped_limit_total > 0


def test_the_tracer_ends_a_session_at_its_deadline(traced: Traced) -> None:
    traced.start("t-short", pid=os.getpid(), seconds=0.5)
    wait_until(lambda: traced.ended("t-short") is not None, what="the deadline's last batch", timeout_s=5)
    assert traced.ended("t-short").end_reason == "deadline"  # type: ignore[union-attr]
