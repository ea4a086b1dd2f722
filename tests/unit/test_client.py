"""`ghostgpu ps` / `ghostgpu findings` against a query server on loopback (real gRPC, real CLI).

The server here is a stand-in for the collector's Query service: it returns the rows a test
gives it and records what the client sent, so these tests pin the client's side of the contract
(flags -> requests, answers -> tables and JSON, errors -> one line) without a collector.
"""

from __future__ import annotations

import itertools
import os
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
from ghostgpu.cli import view
from ghostgpu.cli.client import parse_classes
from ghostgpu.cli.main import main

from ghostgpu.common.model.consumers import ClusterConsumer, Consumer, ConsumerClass, K8sInfo
from ghostgpu.common.model.durations import LOOK_BACK, parse_duration_s
from ghostgpu.common.wire.convert import cluster_consumer_to_proto
from ghostgpu.v1 import query_pb2, query_pb2_grpc, stream_pb2
from tests.helpers.polling import wait_until

REPO = Path(__file__).resolve().parents[2]
NOW_S = time.time()
BASE = Consumer(
    node="gpu-node-1", pid=4242, ns_pid=7, comm="python3", gpu=0, gpu_uuid="GPU-aaaa", gpu_minor=0,
    devices=["/dev/nvidia0", "/dev/nvidiactl"], container_id="c0ffee" * 10 + "abcd", pod_uid="",
    runtime="containerd", cls=ConsumerClass.HIDDEN, reason="holds /dev/nvidia0; NVML lists no such process",
    gpu_memory_bytes=None,
)
RESOLVED = ClusterConsumer(
    consumer=replace(BASE, allocated_bytes=3 << 30),  # NVML does not list it: its driver calls' figure
    k8s=K8sInfo(resolution="resolved", namespace="ml", pod="trainer-0", pod_uid="u-1", container="main",
                image="registry/ml:1", container_state="CONTAINER_RUNNING", sandbox_state="SANDBOX_READY"),
    allocated=False, node_class=ConsumerClass.HIDDEN, since_unix_ns=int((NOW_S - 125) * 1e9),
)
UNRESOLVED = ClusterConsumer(
    consumer=replace(BASE, pid=5000, ns_pid=1, gpu=1, gpu_uuid="GPU-bbbb", gpu_minor=1,
                     container_id="deadbeef" * 8, cls=ConsumerClass.ORPHANED,
                     reason="reparented to host PID 1", gpu_memory_bytes=3 << 20),
    k8s=K8sInfo(resolution="unresolved", error="CRI unreachable"), since_unix_ns=int((NOW_S - 7300) * 1e9),
)
HOST = ClusterConsumer(
    consumer=replace(BASE, node="gpu-node-2", pid=99, ns_pid=None, container_id="", comm="nv-hostengine",
                     cls=ConsumerClass.VISIBLE, reason="NVML lists it", gpu_memory_bytes=512 << 20),
    allocated=True, since_unix_ns=int((NOW_S - 5) * 1e9),
)


def _finding(fid: int, c: ClusterConsumer, opened_s: float, resolved_s: float = 0) -> query_pb2.Finding:
    return query_pb2.Finding(id=fid, node=c.consumer.node, consumer=cluster_consumer_to_proto(c),
                             opened_unix_ns=int(opened_s * 1e9), resolved_unix_ns=int(resolved_s * 1e9))


class FakeQuery(query_pb2_grpc.QueryServicer):
    """Answers with what the test put in; records each request and its metadata."""

    def __init__(self) -> None:
        self.consumers: list[ClusterConsumer] = []
        self.nodes: list[query_pb2.TracerStatus] = []
        self.findings: list[query_pb2.Finding] = []
        self.watch_events: queue.Queue[query_pb2.FindingEvent] = queue.Queue()
        self.refuse = ""  # a FAILED_PRECONDITION message for every call
        self.requests: list[tuple[str, Any, dict[str, str]]] = []

    def _enter(self, name: str, request: Any, context: grpc.ServicerContext) -> None:
        self.requests.append((name, request, dict(context.invocation_metadata())))
        if self.refuse:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.refuse)

    def ListConsumers(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._enter("ListConsumers", request, context)
        rows = [cluster_consumer_to_proto(c) for c in self.consumers]
        return query_pb2.ListConsumersResponse(consumers=rows)

    def NodeStatus(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._enter("NodeStatus", request, context)
        return query_pb2.NodeStatusResponse(nodes=self.nodes, collector_version="test")

    def ListFindings(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._enter("ListFindings", request, context)
        return query_pb2.ListFindingsResponse(findings=self.findings)

    def WatchFindings(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        self._enter("WatchFindings", request, context)
        while context.is_active():
            try:
                yield self.watch_events.get(timeout=0.05)
            except queue.Empty:
                continue


class Server:
    def __init__(self, fake: FakeQuery, port: int = 0) -> None:
        self.fake = fake
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        query_pb2_grpc.add_QueryServicer_to_server(fake, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()
        self.address = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(grace=None).wait()


@pytest.fixture
def server() -> Iterator[Server]:
    fake = FakeQuery()
    # Ages as of this test, not of the module's import (a full run reaches this file minutes later).
    shift_ns = time.time_ns() - int(NOW_S * 1e9)
    fake.consumers = [replace(c, since_unix_ns=c.since_unix_ns + shift_ns)
                      for c in (UNRESOLVED, RESOLVED, HOST)]
    gpu0 = stream_pb2.Gpu(index=0, uuid="GPU-aaaa", name="NVIDIA H100", pci_bus_id="00000000:3B:00.0",
                          memory_used_bytes=10 << 30, memory_listed_bytes=4 << 30,
                          memory_unlisted_bytes=3 << 30, unaccounted_bytes=3 << 30)
    info = stream_pb2.NodeInfo(bpf=True, nvml=True, driver_version="550.54.15", gpus=[gpu0])
    fake.nodes = [query_pb2.TracerStatus(node="gpu-node-1", connected=True, info=info,
                                         last_heartbeat_unix_ns=time.time_ns()),
                  query_pb2.TracerStatus(node="gpu-node-2", connected=False)]
    s = Server(fake)
    yield s
    s.stop()


def _rows(text: str) -> list[list[str]]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("NODE "))
    return [line.split() for line in lines[start:] if line.strip()]


def test_ps_table(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ps", "--collector", server.address]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rows[0] == ["NODE", "GPU", "PID", "CPID", "NAMESPACE/POD/CONTAINER", "CLASS", "GPU-MEM", "SINCE"]
    assert [r[:-1] for r in rows[1:4]] == [
        # NVML gives no figure for 4242: the driver calls' one, marked, with the footnote below
        ["gpu-node-1", "0", "4242", "7", "ml/trainer-0/main", "hidden", "3072MiB*"],
        ["gpu-node-1", "1", "5000", "1", "deadbeefdeadb", "orphaned", "3MiB"],
        ["gpu-node-2", "0", "99", "-", "host", "visible", "512MiB"],
    ]
    assert out.splitlines()[-1] == "* from the driver calls ghostgpu saw"
    # SINCE ages as the fixture set them; seconds tick on while a loaded machine runs the test.
    assert [r[-1] for r in rows[1:3]] == ["2m", "2h"]
    assert rows[3][-1].endswith("s") and 5 <= int(rows[3][-1][:-1]) < 60
    lines = out.splitlines()
    assert lines[0].startswith("node gpu-node-1 | tracer connected")
    assert "BPF tracepoints attached" in lines[0]
    assert "NVML driver 550.54.15: 0:NVIDIA H100" in lines[0]
    # Under its node, each GPU's used memory: used = listed + unlisted + unaccounted.
    assert lines[1] == ("  GPU 0 (00000000:3B:00.0): 10240MiB used = 4096MiB by processes NVML lists + "
                        "3072MiB by holders it does not list + 3072MiB unaccounted")
    assert lines[2].startswith("node gpu-node-2 | tracer DISCONNECTED")


def test_ps_wide(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ps", "--collector", server.address, "-o", "wide"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(line for line in lines if line.startswith("NODE "))
    assert head.split()[8:] == ["COMM", "IMAGE", "ALLOCATED", "DEVICES", "REASON"]
    row = next(line for line in lines if " 4242 " in line)
    assert row.split()[8:12] == ["python3", "registry/ml:1", "false", "nvidia0,nvidiactl"]
    assert row.endswith("  holds /dev/nvidia0; NVML lists no such process")
    assert "unknown" in next(line for line in lines if " 5000 " in line)


def test_ps_json_is_cluster_consumer_rows(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert main(["ps", "--collector", server.address, "-o", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    unresolved, resolved, host = server.fake.consumers
    # Each row is the consumer's, plus its GPU as its node's last snapshot told it (null: not known).
    gpu0 = {"index": 0, "uuid": "GPU-aaaa", "name": "NVIDIA H100", "minor": 0, "memory_total_bytes": None,
            "pci_bus_id": "00000000:3B:00.0", "memory_used_bytes": 10 << 30, "memory_listed_bytes": 4 << 30,
            "memory_unlisted_bytes": 3 << 30, "unaccounted_bytes": 3 << 30}
    assert rows == [{**resolved.to_json(), "gpu_info": gpu0}, {**unresolved.to_json(), "gpu_info": None},
                    {**host.to_json(), "gpu_info": None}]
    assert (rows[0]["allocated_bytes"], rows[1]["allocated_bytes"]) == (3 << 30, None)
    for key in ("node", "pid", "ns_pid", "comm", "gpu", "devices", "container_id", "class", "reason",
                "gpu_memory_bytes", "namespace", "pod", "container", "image", "allocated"):
        assert key in rows[0]
    assert (rows[0]["allocated"], rows[1]["allocated"], rows[2]["allocated"]) == (False, "unknown", True)


def test_ps_sends_filters_and_api_version(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["ps", "--collector", server.address, "-n", "ml", "--class", "hidden", "--class", "Orphaned",
            "--node", "gpu-node-1"]
    assert main(args) == 0
    _, req, metadata = next(r for r in server.fake.requests if r[0] == "ListConsumers")
    assert (req.node, req.namespace) == ("gpu-node-1", "ml")
    assert list(req.classes) == [2, 4]  # CONSUMER_CLASS_HIDDEN, CONSUMER_CLASS_ORPHANED
    assert metadata["ghostgpu-api-version"] == "1"


def test_bad_class_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ps", "--collector", "127.0.0.1:1", "--class", "sneaky"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--class 'sneaky'" in err[0] and "hidden" in err[0]
    assert parse_classes(["hidden,ghost"]) == [ConsumerClass.HIDDEN, ConsumerClass.GHOST]


@pytest.mark.parametrize(("text", "seconds"), [("30s", 30), ("15m", 900), ("1h", 3600), ("7d", 604800),
                                               ("1.5h", 5400), (" 2m ", 120)])
def test_parse_since(text: str, seconds: float) -> None:
    assert parse_duration_s(text, "--since", LOOK_BACK) == seconds


@pytest.mark.parametrize("text", ["", "1", "h", "1w", "-1h", "1h30m", "abc"])
def test_bad_since_is_one_line(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["findings", "--collector", "127.0.0.1:1", f"--since={text}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--since" in err[0] and "30s, 15m, 1h, 7d" in err[0]


def _dead_address() -> str:
    s = Server(FakeQuery())  # bind a port, then free it: nothing listens there now
    s.stop()
    return s.address


@pytest.mark.parametrize("command", [["ps"], ["findings"], ["ps", "-o", "json"]])
def test_unreachable_collector(command: list[str], tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    for address in (_dead_address(), f"unix://{tmp_path}/nothing.sock"):
        assert main([*command, "--collector", address]) == 1
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert captured.out == "" and len(err) == 1, captured
        assert err[0].startswith(f"ghostgpu: cannot reach the collector at {address} (")
        assert err[0].endswith("start one with `ghostgpu collector` or `ghostgpu up`, or pass --collector")


@pytest.mark.parametrize("command", [["ps"], ["findings"]])
def test_failed_precondition_message_passes_through(command: list[str], server: Server,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    server.fake.refuse = "client speaks ghostgpu API v1, this collector (ghostgpu 9.0) speaks v2; upgrade"
    assert main([*command, "--collector", server.address]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"ghostgpu: {server.fake.refuse}\n"


def test_findings_table_and_json(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    opened = time.mktime((2025, 3, 4, 10, 11, 12, 0, 0, -1))
    server.fake.findings = [_finding(2, UNRESOLVED, opened + 60), _finding(1, RESOLVED, opened, opened + 30)]
    before_ns = time.time_ns()
    assert main(["findings", "--collector", server.address, "--since", "2h", "--limit", "5", "-n", "ml"]) == 0
    _, req, _ = next(r for r in server.fake.requests if r[0] == "ListFindings")
    assert abs(before_ns - 7200 * 10**9 - req.since_unix_ns) < 5 * 10**9
    assert (req.limit, req.namespace) == (5, "ml")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["OPENED", "RESOLVED", "NODE", "CLASS", "NAMESPACE/POD", "PID", "GPU",
                                "REASON"]
    assert lines[1].startswith("2025-03-04 10:11:12  2025-03-04 10:11:42  gpu-node-1  hidden    ml/trainer")
    assert lines[2].startswith("2025-03-04 10:12:12  open                 gpu-node-1  orphaned  deadbeefdea")
    assert main(["findings", "--collector", server.address, "-o", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0] == {**RESOLVED.to_json(), "id": 1, "opened": opened, "resolved": opened + 30,
                       "remediation": None}
    assert rows[1] == {**UNRESOLVED.to_json(), "id": 2, "opened": opened + 60, "resolved": None,
                       "remediation": None}


def test_ages() -> None:
    assert [view.age(s) for s in (0, 59.9, 60, 3599, 3600, 86399, 86400 * 3, -4)] == \
        ["0s", "59s", "1m", "59m", "1h", "23h", "3d", "0s"]


def test_no_gpu_header_says_so_plainly() -> None:
    info = stream_pb2.NodeInfo(bpf=False, nvml=False,
                               nvml_error="NVML: libnvidia-ml.so.1 not found; install the NVIDIA driver")
    line = view.node_header(query_pb2.TracerStatus(node="n", connected=True, info=info))
    assert "BPF off: /proc scans only" in line
    assert "no NVIDIA GPU visible here (NVML: libnvidia-ml.so.1 not found; install the NVIDIA driver); " \
        "still watching device files" in line


class WatchProcess:
    """`ghostgpu ps --watch` piped, as a user would run it into `tee`."""

    def __init__(self, address: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "ghostgpu.cli", "ps", "--watch", "--collector",
                                      address], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.out: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.out.append(line.rstrip("\n"))

    def tables(self) -> list[list[str]]:
        """Printed screens, split at the blank line that ends each."""
        screens, current = [], []
        for line in list(self.out):
            if line == "" and current and any(x.startswith("NODE ") for x in current):
                screens.append(current)
                current = []
            elif line or current:
                current.append(line)
        return screens

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=10)
        return err


def test_watch_redraws_on_findings_and_survives_a_collector_restart(server: Server) -> None:
    watch = WatchProcess(server.address)
    try:
        wait_until(lambda: len(watch.tables()) == 1, "the first table", timeout_s=15)
        assert any(" 4242 " in line for line in watch.tables()[0])
        wait_until(lambda: any(r[0] == "WatchFindings" for r in server.fake.requests), "the watch stream")
        added = replace(HOST, consumer=replace(HOST.consumer, pid=777))
        server.fake.consumers = [*server.fake.consumers, added]
        server.fake.watch_events.put(query_pb2.FindingEvent(kind=query_pb2.FindingEvent.KIND_OPENED))
        wait_until(lambda: len(watch.tables()) >= 2 and any(" 777 " in x for x in watch.tables()[-1]),
                   "a redraw with the new consumer")
        # The collector restarts on the same port with other rows: the watch follows it.
        port = server.port
        server.stop()
        fake = FakeQuery()
        fake.consumers = [replace(HOST, consumer=replace(HOST.consumer, pid=31337))]
        restarted = Server(fake, port=port)
        try:
            wait_until(lambda: any(" 31337 " in x for x in watch.tables()[-1]),
                       "the restarted collector's rows", timeout_s=15)
            wait_until(lambda: any(r[0] == "WatchFindings" for r in fake.requests), "the watch re-subscribed",
                       timeout_s=10)
        finally:
            restarted.stop()
    finally:
        err = watch.stop()
    assert watch.proc.returncode == 0, err
    # Piped, a table prints once per change, not on every 2 s redraw.
    printed = [tuple(t) for t in watch.tables()]
    assert all(a != b for a, b in itertools.pairwise(printed))


def test_event_lines_under_the_live_view() -> None:
    from ghostgpu.v1 import node_pb2

    proc = node_pb2.Process(pid=321, ns_pid=1, comm="demo-batch", container_id="ab" * 32)
    opened = stream_pb2.NodeEvent(seq=1, ts_unix_ns=time.time_ns(), holder=node_pb2.HolderEvent(
        kind=node_pb2.HolderEvent.KIND_OPEN, process=proc, device="/dev/nvidia0", device_kind="gpu"))
    control = stream_pb2.NodeEvent(seq=2, holder=node_pb2.HolderEvent(
        kind=node_pb2.HolderEvent.KIND_OPEN, process=proc, device="/dev/nvidiactl", device_kind="control"))
    exited = stream_pb2.NodeEvent(seq=3, holder=node_pb2.HolderEvent(
        kind=node_pb2.HolderEvent.KIND_EXIT, process=proc, held_ns=52_000_000))
    line = view.event_line(opened)
    assert line is not None
    assert line.endswith(" open     pid 321 (demo-batch, pid 1 inside) in container abababababab"
                         "a /dev/nvidia0")
    assert view.event_line(control) is None  # control devices alone make no consumer
    assert (view.event_line(exited) or "").endswith("in container abababababab"
                                                    "a (held a GPU for 52 ms)")
    notice = stream_pb2.NodeEvent(seq=4, notice=stream_pb2.Notice(what="nvml", message="no driver"))
    assert (view.event_line(notice) or "").endswith("notice   nvml: no driver")
