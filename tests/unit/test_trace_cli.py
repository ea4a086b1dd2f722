"""`ghostgpu trace` and `trace list|show|stop`: flags, outputs and errors, against a stand-in Query
service on loopback (real gRPC, the real CLI), so nothing here needs the collector's trace code.

Ctrl-C is a real SIGINT to a real `ghostgpu trace` process: stdin a pipe (the session is stopped),
a terminal (a pty: the question is asked and "n" leaves it running) and --detach (never asked).
"""

from __future__ import annotations

import json
import os
import pty
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from ghostgpu.cli import trace_view
from ghostgpu.cli.main import _build_parser, main
from ghostgpu.cli.trace import confirm_stop, parse_duration

from ghostgpu.common.model.trace import TraceRecord, TraceStatus
from ghostgpu.common.wire.convert_trace import session_to_proto
from ghostgpu.v1 import query_pb2_grpc, trace_pb2
from tests.helpers.polling import wait_until
from tests.helpers.wire_decode import record_to_proto
from tests.unit.test_chrome_trace import SESSION, T0, sample_records

REPO = Path(__file__).resolve().parents[2]
JSONL_KEYS = ["session", "node", "ts_ns", "pid", "tid", "ns_pid", "container_id", "namespace", "pod",
              "container", "gpu", "device", "call", "request", "escape", "cmd", "cmd_name", "h_class",
              "class_name", "nv_status", "nv_status_name", "ret", "duration_ns"]
NOT_FOUND_LINE = "trace session t-404 not found (ghostgpu trace list)"


class FakeTraceQuery(query_pb2_grpc.QueryServicer):
    """Sessions and records the test gives; WatchTrace sends the records, then (unless `hold`) the
    ended session; with `hold` it waits for StopTrace, like a session that runs for a long time."""

    def __init__(self) -> None:
        self.session = replace(SESSION, deadline_unix_ns=time.time_ns() + 3600 * 10**9)
        self.records = sample_records()
        self.hold = False
        self.close_early = False  # end the stream while the session still runs (a collector going away)
        self.refuse: tuple[grpc.StatusCode, str] | None = None
        self.requests: list[tuple[str, Any]] = []
        self.live: queue.Queue[trace_pb2.TraceWatchMessage] = queue.Queue()

    def _enter(self, name: str, request: Any, context: grpc.ServicerContext) -> None:
        self.requests.append((name, request))
        if self.refuse:
            context.abort(*self.refuse)

    def names(self) -> list[str]:
        return [n for n, _ in self.requests]

    def StartTrace(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._enter("StartTrace", request, context)
        return trace_pb2.StartTraceResponse(session=session_to_proto(self.session))

    def StopTrace(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._enter("StopTrace", request, context)
        self.session = self.session.ended(TraceStatus.STOPPED, "stopped by uid 0", T0 + 10**9)
        self.live.put(trace_pb2.TraceWatchMessage(session=session_to_proto(self.session)))
        return trace_pb2.StopTraceResponse(session=session_to_proto(self.session))

    def ListTraces(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._enter("ListTraces", request, context)
        other = replace(SESSION, id="t-7", started_unix_ns=T0 - 10**10, status=TraceStatus.COMPLETED,
                        ended_unix_ns=T0 - 5 * 10**9, records_total=3, dropped_ringbuf_total=2)
        return trace_pb2.ListTracesResponse(sessions=[session_to_proto(s) for s in (self.session, other)])

    def WatchTrace(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        self._enter("WatchTrace", request, context)
        if request.id != self.session.id:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"trace session {request.id} not found (ghostgpu trace list)")
        recs = [record_to_proto(r) for r in self.records]
        yield trace_pb2.TraceWatchMessage(records=recs[:3], session=session_to_proto(self.session))
        yield trace_pb2.TraceWatchMessage(records=recs[3:], session=session_to_proto(self.session))
        if self.close_early:
            return
        if self.session.status.ended or not (self.hold and request.follow):
            ended = self.session if self.session.status.ended else \
                self.session.ended(TraceStatus.COMPLETED, "deadline", T0 + 30 * 10**9)
            yield trace_pb2.TraceWatchMessage(session=session_to_proto(ended))
            return
        while context.is_active():
            try:
                m = self.live.get(timeout=0.05)
            except queue.Empty:
                continue
            yield m
            if m.session.status != trace_pb2.TRACE_STATUS_RUNNING:
                return


@pytest.fixture
def fake() -> Iterator[tuple[FakeTraceQuery, str]]:
    servicer = FakeTraceQuery()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    query_pb2_grpc.add_QueryServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(grace=None).wait()


# --for
@pytest.mark.parametrize(("text", "seconds"), [("30s", 30), ("2m", 120), ("1h30m", 5400), ("500ms", 0.5),
                                               ("90", 90), ("2.5", 2.5), ("1m30s", 90), ("1.5h", 5400)])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "abc", "30x", "-5s", "0", "0s", "1h 30m", "s", "m30"])
def test_bad_duration_is_one_line_and_exit_2(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "--pod", "p", f"--for={text}", "--collector", "127.0.0.1:1"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert captured.out == "" and len(err) == 1 and err[0].startswith("ghostgpu: --for "), captured


# argv: `trace FLAGS` starts a session, `trace list|show|stop` are verbs
def test_argv_dispatch() -> None:
    parse = _build_parser().parse_args
    live = parse(["trace", "-n", "ml", "--pod", "p", "--for", "30s", "--gpu", "GPU-1", "-o", "jsonl"])
    assert (live.trace_command, live.namespace, live.pod, live.duration, live.gpu, live.output) == \
        (None, "ml", "p", "30s", "GPU-1", "jsonl")
    assert parse(["trace", "list"]).trace_command == "list"
    before = parse(["trace", "--collector", "X", "-o", "json", "list"])  # flags before the verb hold
    assert (before.collector, before.output) == ("X", "json")
    show = parse(["trace", "show", "t-1", "--summary", "--chrome-trace", "f.json", "--collector", "Y"])
    assert (show.trace_command, show.id, show.summary, show.summary_with_calls, show.chrome_trace,
            show.collector) == ("show", "t-1", True, False, "f.json", "Y")
    both = parse(["trace", "--summary-with-calls", "show", "t-1"])  # before the verb: it holds
    assert (both.summary, both.summary_with_calls) == (False, True)
    stop = parse(["trace", "stop", "t-2"])
    assert (stop.trace_command, stop.id) == ("stop", "t-2")


@pytest.mark.parametrize(("argv", "words"), [
    (["trace", "--pod", "p", "list"], "--pod apply to"),
    (["trace", "-o", "jsonl", "list"], "trace list -o jsonl"),
    (["trace", "--summary", "stop", "t-1"], "--summary"),
    (["trace", "--summary-with-calls", "list"], "--summary-with-calls"),
])
def test_misplaced_flags_are_one_line(argv: list[str], words: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--collector", "127.0.0.1:1"] if argv[-1] != "t-1" else argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


# views
def test_live_rows() -> None:
    recs = {r.seq if r.node == "gpu-1" else 100: r for r in sample_records()}
    row = trace_view.live_row(recs[3])
    assert row[1:] == ("gpu-1", "ml/trainer-0/main", "4242/4243", "RM_CONTROL", "NV_OK", "12.2",
                       "NV2080_CTRL_CMD_GPU_GET_INFO")
    assert len(row[0]) == 15 and row[0][2] == row[0][5] == ":" and row[0][8] == "."
    assert row[0].endswith(".123506")  # T0 + 50 µs: microseconds of the entry time
    assert trace_view.live_row(recs[4])[5] == "NV_ERR_INVALID_ARGUMENT"
    assert trace_view.live_row(recs[5])[4:7] == ("UNKNOWN_ESCAPE", "ENOTTY", "0.8")
    assert trace_view.live_row(recs[2])[7] == "NV01_ROOT hObjectNew=0xc1d00001"
    open_row = trace_view.live_row(recs[1])
    assert open_row[4:] == ("open", "-", "-", "fd=5 path=/dev/nvidiactl flags=O_RDWR")
    assert trace_view.live_row(recs[7])[7] == "child_pid=4300"
    assert trace_view.live_row(recs[100])[2] == "host"
    unknown = replace(recs[4], nv_status=0x56, nv_status_name="", ret=-1)
    assert trace_view.status(unknown) == "0x56 EPERM"


def test_live_table_aligns_and_prints_the_header_once() -> None:
    table = trace_view.LiveTable()
    recs = sample_records()
    first, second = table.lines(recs[:2]), table.lines(recs[2:])
    assert first[0].split() == list(trace_view.LIVE_HEADER) and len(first) == 3 and len(second) == 6
    assert not any(line.startswith("TIME") for line in second)
    assert table.lines([]) == []
    assert first[1].index("ml/trainer-0") == first[0].index("NAMESPACE/POD/CONTAINER")


def _rec(key_cmd: int | None, dur_us: int, seq: int, **kw: Any) -> TraceRecord:
    return TraceRecord(session="t", node="n", seq=seq, ts_ns=T0 + seq, kind="ioctl", pid=1, tid=1,
                       call="RM_CONTROL" if key_cmd is not None else "RM_FREE", cmd=key_cmd,
                       cmd_name="CMD_A" if key_cmd == 1 else "", duration_ns=dur_us * 1000, **kw)


def test_summary_math() -> None:
    # CMD_A: 100 calls of 1..100 µs (p99 99 µs by nearest rank), 2 errors; 0x2: one call of 10000 µs
    recs = [_rec(1, d, d, nv_status=0x1F if d in (5, 6) else 0) for d in range(1, 101)]
    recs += [_rec(2, 10_000, 200, ret=-22), _rec(None, 50, 201, nv_status=0)]
    rows, total = trace_view.summarize(recs)
    assert [r.call for r in rows] == ["RM_CONTROL 0x2", "RM_CONTROL CMD_A", "RM_FREE"]
    grand = 10_000_000 + 5_050_000 + 50_000
    a = rows[1]
    assert (a.calls, a.errors, a.total_ns, a.avg_ns, a.p99_ns) == (100, 2, 5_050_000, 50_500, 99_000)
    assert a.pct_time == pytest.approx(100 * 5_050_000 / grand)
    assert (rows[0].errors, rows[0].p99_ns, rows[2].errors) == (1, 10_000_000, 0)
    assert (total.call, total.calls, total.errors, total.total_ns) == ("total", 102, 3, grand)
    assert sum(r.pct_time for r in rows) == pytest.approx(100) and total.pct_time == 100
    assert trace_view.p99([]) == 0 and trace_view.p99([7]) == 7 and trace_view.p99(list(range(1, 201))) == 198
    lines = trace_view.summary_table(recs).splitlines()
    assert lines[0].split() == ["%", "TIME", "TOTAL(µs)", "AVG(µs)", "P99(µs)", "CALLS", "ERRORS", "CALL"]
    assert lines[1].split() == ["66.23", "10000.0", "10000.0", "10000.0", "1", "1", "RM_CONTROL", "0x2"]
    assert lines[2].split() == ["33.44", "5050.0", "50.5", "99.0", "100", "2", "RM_CONTROL", "CMD_A"]
    assert set(lines[-2]) <= {"-", " "} and lines[-1].split() == ["100.00", "15100.0", "148.0", "100.0",
                                                                  "102", "3", "total"]
    assert trace_view.summary_table([]) == "(no calls traced)"


def test_jsonl_keys_are_the_contract_then_extras() -> None:
    for r in sample_records():
        obj = json.loads(trace_view.jsonl_line(r))
        assert list(obj)[: len(JSONL_KEYS)] == JSONL_KEYS
        extras = {"seq", "kind", "comm", "fd", "errno", "child_pid", "args", "notes"}
        assert set(obj) - set(JSONL_KEYS) == extras


def test_confirm_stop() -> None:
    class Tty:
        def __init__(self, answer: str) -> None:
            self.answer = answer

        def isatty(self) -> bool:
            return True

        def readline(self) -> str:
            return self.answer

    err = Tty("")
    err.write = lambda s: None  # type: ignore[attr-defined]
    err.flush = lambda: None  # type: ignore[attr-defined]
    assert confirm_stop("t-1", Tty("\n"), err) and confirm_stop("t-1", Tty("y\n"), err)  # type: ignore[arg-type]
    assert confirm_stop("t-1", Tty(""), err)  # EOF  # type: ignore[arg-type]
    assert not confirm_stop("t-1", Tty("n\n"), err) and not confirm_stop("t-1", Tty("No\n"), err)  # type: ignore[arg-type]
    with open(os.devnull) as devnull:
        assert confirm_stop("t-1", devnull, err)  # type: ignore[arg-type]  # not a terminal: stop


# the commands against the stand-in collector
def _data_rows(out: str) -> list[str]:
    return [line for line in out.splitlines() if line[:2].isdigit() and line[2] == ":"]


def test_live_trace_table_and_summary(fake: tuple[FakeTraceQuery, str],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    servicer, address = fake
    assert main(["trace", "-n", "ml", "--pod", "trainer-0", "--container", "main", "--gpu", "0",
                 "--for", "1m30s", "--summary-with-calls", "--collector", address]) == 0
    (name, start), (watch_name, watch) = servicer.requests
    assert (name, watch_name, watch.id, watch.follow) == ("StartTrace", "WatchTrace", "t-42", True)
    scope = start.scope
    assert (scope.namespace, scope.pod, scope.container, scope.gpu, start.duration_ms) == \
        ("ml", "trainer-0", "main", "0", 90_000)
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0].split() == list(trace_view.LIVE_HEADER)
    assert len(_data_rows(captured.out)) == 8
    assert "RM_CONTROL NV2080_CTRL_CMD_GPU_GET_INFO" in captured.out and "% TIME" in captured.out
    assert captured.out.rstrip().splitlines()[-1].split()[-1] == "total"
    err = captured.err.splitlines()
    assert err[0].startswith("trace t-42 running until ") and "Ctrl-C" in err[1]
    assert err[-1].startswith("trace t-42 completed at ") and "(deadline)" in err[-1]


# --summary is strace -c (the summary only), --summary-with-calls strace -C (the calls, then it)
SUMMARY_LINES = trace_view.summary_table(sample_records()).splitlines()


@pytest.mark.parametrize("flags", [["--summary"], ["--summary", "--summary-with-calls"]])
@pytest.mark.parametrize("verb", [[], ["show", "t-42"]])
def test_summary_alone_prints_only_the_summary(flags: list[str], verb: list[str],
                                               fake: tuple[FakeTraceQuery, str],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    _, address = fake
    assert main(["trace", *verb, *flags, "--collector", address] + ([] if verb else ["-n", "ml"])) == 0
    captured = capsys.readouterr()
    if "--summary-with-calls" in flags:  # given both, the calls are printed too
        assert len(_data_rows(captured.out)) == 8
        assert captured.out.splitlines()[-len(SUMMARY_LINES):] == SUMMARY_LINES
    else:
        assert captured.out.splitlines() == SUMMARY_LINES
    assert captured.err.splitlines()[-1].startswith("trace t-42 completed at ")


@pytest.mark.parametrize(("flag", "keys"), [(None, {"session", "records"}),
                                            ("--summary", {"session", "summary"}),
                                            ("--summary-with-calls", {"session", "records", "summary"})])
def test_json_document_keys(flag: str | None, keys: set[str], fake: tuple[FakeTraceQuery, str],
                            capsys: pytest.CaptureFixture[str]) -> None:
    _, address = fake
    assert main(["trace", "-n", "ml", "-o", "json", *([flag] if flag else []), "--collector", address]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == keys and doc["session"]["id"] == "t-42"
    assert len(doc.get("records", [])) == (8 if "records" in keys else 0)
    assert doc.get("summary") == (trace_view.summary_json(sample_records()) if "summary" in keys else None)


def test_jsonl_summary_alone_is_its_rows(fake: tuple[FakeTraceQuery, str],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    _, address = fake
    assert main(["trace", "-n", "ml", "-o", "jsonl", "--summary", "--collector", address]) == 0
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines()]
    assert rows == trace_view.summary_json(sample_records())
    assert [r["call"] for r in rows][-1] == "total" and rows[-1]["calls"] == 8
    assert "% TIME" not in captured.err


def test_pod_without_namespace_is_in_default(fake: tuple[FakeTraceQuery, str]) -> None:
    servicer, address = fake
    assert main(["trace", "--pod", "trainer-0", "--collector", address, "-o", "json"]) == 0
    start = servicer.requests[0][1]
    assert (start.scope.namespace, start.scope.pod, start.duration_ms) == ("default", "trainer-0", 0)


def test_jsonl_prints_records_only(fake: tuple[FakeTraceQuery, str],
                                   capsys: pytest.CaptureFixture[str]) -> None:
    _, address = fake
    assert main(["trace", "-n", "ml", "-o", "jsonl", "--summary-with-calls", "--collector", address]) == 0
    captured = capsys.readouterr()
    objs = [json.loads(line) for line in captured.out.splitlines()]
    assert len(objs) == 8 and all(list(o)[:23] == JSONL_KEYS and o["session"] == "t-42" for o in objs)
    assert "% TIME" in captured.err  # the summary, where it cannot break a JSON-lines reader


def test_json_document_and_chrome_trace(fake: tuple[FakeTraceQuery, str], tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    _, address = fake
    path = tmp_path / "t.json"
    assert main(["trace", "-n", "ml", "-o", "json", "--summary-with-calls", "--chrome-trace", str(path),
                 "--collector", address]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"session", "records", "summary"}
    assert doc["session"]["status"] == "completed" and len(doc["records"]) == 8
    assert doc["summary"][-1]["call"] == "total" and doc["summary"][-1]["calls"] == 8
    chrome = json.loads(path.read_text())
    assert sum(e["ph"] == "X" for e in chrome["traceEvents"]) == 4


def test_show_prints_what_live_printed(fake: tuple[FakeTraceQuery, str],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    servicer, address = fake
    assert main(["trace", "-n", "ml", "--collector", address]) == 0
    live = capsys.readouterr().out
    servicer.requests.clear()
    assert main(["trace", "show", "t-42", "--collector", address]) == 0
    assert capsys.readouterr().out == live
    assert servicer.names() == ["WatchTrace"] and servicer.requests[0][1].follow is False


def test_unknown_session_is_its_line_and_exit_2(fake: tuple[FakeTraceQuery, str],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    _, address = fake
    for argv in (["trace", "show", "t-404"], ["trace", "show", "t-404", "-o", "json"]):
        assert main([*argv, "--collector", address]) == 2
        assert capsys.readouterr() == ("", f"ghostgpu: {NOT_FOUND_LINE}\n")


@pytest.mark.parametrize(("code", "line"), [
    (grpc.StatusCode.NOT_FOUND,
     "pod default/trainer-0 not found (ghostgpu ps lists pods with GPU consumers)"),
    (grpc.StatusCode.FAILED_PRECONDITION,
     "node gpu-3 has no connected tracer: pod default/x cannot be traced there"),
    (grpc.StatusCode.INVALID_ARGUMENT,
     "duration 20m exceeds the maximum of 10m (--trace-max-duration)"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED,
     "node gpu-3 runs 4 trace sessions, the limit (--trace-max-sessions)"),
])
def test_refusals_are_one_line_and_exit_2(code: grpc.StatusCode, line: str, fake: tuple[FakeTraceQuery, str],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    servicer, address = fake
    servicer.refuse = (code, line)
    for argv in (["trace", "--pod", "trainer-0"], ["trace", "list"], ["trace", "stop", "t-42"]):
        assert main([*argv, "--collector", address]) == 2
        assert capsys.readouterr() == ("", f"ghostgpu: {line}\n")


def test_unreachable_collector_is_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["trace", "--pod", "p"], ["trace", "list"], ["trace", "show", "t-1"]):
        assert main([*argv, "--collector", f"unix://{tmp_path}/none.sock"]) == 1
        captured = capsys.readouterr()
        assert captured.out == "" and len(captured.err.splitlines()) == 1
        assert captured.err.startswith(f"ghostgpu: cannot reach the collector at unix://{tmp_path}/none.sock")


def test_list_and_stop(fake: tuple[FakeTraceQuery, str], capsys: pytest.CaptureFixture[str]) -> None:
    _, address = fake
    assert main(["trace", "list", "--collector", address]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "STATUS", "SCOPE", "NODES", "RECORDS", "DROPPED", "STARTED",
                                "ENDS/ENDED", "BY"]
    assert [line.split()[:2] for line in lines[1:]] == [["t-7", "completed"], ["t-42", "running"]]
    assert lines[1].split()[2:6] == ["ml/trainer-0", "gpu-1,gpu-2", "3", "2"]
    assert main(["trace", "list", "-o", "json", "--collector", address]) == 0
    sessions = json.loads(capsys.readouterr().out)
    assert [s["id"] for s in sessions] == ["t-7", "t-42"] and sessions[1]["ended_unix_ns"] is None
    assert main(["trace", "stop", "t-42", "--collector", address]) == 0
    out = capsys.readouterr().out
    assert out.startswith("trace t-42 stopped at ") and "(stopped by uid 0)" in out


def test_a_collector_that_never_ends_the_session_is_given_up(fake: tuple[FakeTraceQuery, str],
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from ghostgpu.cli import trace

    servicer, address = fake
    servicer.hold = True
    monkeypatch.setattr(trace, "END_GRACE_S", 0.2)
    servicer.session = replace(SESSION, deadline_unix_ns=time.time_ns())  # the watchdog fires in 0.2 s
    assert main(["trace", "-n", "ml", "--collector", address]) == 0
    captured = capsys.readouterr()
    assert len(_data_rows(captured.out)) == 8 and "did not end trace t-42 in time" in captured.err


def test_a_stream_closed_early_and_a_failed_session_are_said(fake: tuple[FakeTraceQuery, str],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    servicer, address = fake
    servicer.close_early = True
    assert main(["trace", "-n", "ml", "--collector", address]) == 0
    captured = capsys.readouterr()
    assert len(_data_rows(captured.out)) == 8
    assert "closed the stream before trace t-42 ended" in captured.err
    servicer.close_early = False
    servicer.session = servicer.session.ended(TraceStatus.FAILED, "no tracer could run it", T0)
    assert main(["trace", "-n", "ml", "--collector", address]) == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("trace t-42 failed at ") and "(no tracer could run it): ml/trainer-0" in last


# Ctrl-C, for real
class TraceProcess:
    """`ghostgpu trace -n ml` as a user runs it; its output read as it comes (a question ends
    without a newline, so in chunks, not lines)."""

    def __init__(self, address: str, *flags: str, stdin: Any = subprocess.DEVNULL) -> None:
        argv = [sys.executable, "-m", "ghostgpu.cli", "trace", "-n", "ml", "--collector", address, *flags]
        self.proc = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.chunks: dict[str, list[bytes]] = {"out": [], "err": []}
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.readers = [threading.Thread(target=self._read, args=(stream.fileno(), self.chunks[name]),
                                         daemon=True)
                        for name, stream in (("out", self.proc.stdout), ("err", self.proc.stderr))]
        for t in self.readers:
            t.start()

    @staticmethod
    def _read(fd: int, sink: list[bytes]) -> None:
        while chunk := os.read(fd, 65536):
            sink.append(chunk)

    def text(self, name: str) -> str:
        return b"".join(self.chunks[name]).decode(errors="replace")

    def interrupt_when_streaming(self) -> None:
        def printed() -> int:
            text = self.text("out")
            return len(_data_rows(text)) + sum(line.startswith("{") for line in text.splitlines())

        wait_until(lambda: printed() == 8, "the records on stdout", timeout_s=20)
        self.proc.send_signal(signal.SIGINT)

    def wait(self) -> tuple[int, str, str]:
        rc = self.proc.wait(timeout=20)
        for t in self.readers:  # both pipes at EOF: everything printed is read
            t.join(timeout=5)
        return rc, self.text("out"), self.text("err")


@pytest.fixture
def holding(fake: tuple[FakeTraceQuery, str]) -> tuple[FakeTraceQuery, str]:
    fake[0].hold = True
    return fake


def test_ctrl_c_without_a_terminal_stops_the_session(holding: tuple[FakeTraceQuery, str]) -> None:
    servicer, address = holding
    p = TraceProcess(address, "--summary-with-calls")
    p.interrupt_when_streaming()
    rc, out, err = p.wait()
    assert rc == 0, err
    assert servicer.names().count("StopTrace") == 1 and "? [Y/n]" not in err
    assert servicer.names()[-1] == "WatchTrace"  # the records sent before the stop, up to the end
    assert err.splitlines()[-1].startswith("trace t-42 stopped at ") and "% TIME" in out


def test_ctrl_c_on_a_terminal_asks_and_no_leaves_it_running(holding: tuple[FakeTraceQuery, str]) -> None:
    servicer, address = holding
    master, slave = pty.openpty()
    try:
        p = TraceProcess(address, stdin=slave)
        p.interrupt_when_streaming()
        wait_until(lambda: "stop session t-42 ? [Y/n]" in p.text("err"), "the question", timeout_s=10)
        os.write(master, b"n\n")
        rc, _, err = p.wait()
    finally:
        os.close(master)
        os.close(slave)
    assert rc == 0, err
    assert "StopTrace" not in servicer.names() and "trace t-42 left running" in err


def test_ctrl_c_with_detach_never_asks(holding: tuple[FakeTraceQuery, str]) -> None:
    servicer, address = holding
    p = TraceProcess(address, "--detach", "-o", "jsonl")
    p.interrupt_when_streaming()
    rc, out, err = p.wait()
    assert rc == 0, err
    assert any(line.startswith("t-42: detached") for line in err.splitlines()), err
    assert "ghostgpu trace show t-42" in err
    assert "StopTrace" not in servicer.names() and "? [Y/n]" not in err and "left running" in err
    assert all(json.loads(line)["session"] == "t-42" for line in out.splitlines())
