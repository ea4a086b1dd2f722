"""Trace scopes on real Kubernetes-style pods: a real containerd (CRI) runs them, the real tracer
(BPF, `--cri-endpoint` to that containerd) streams to a real `ghostgpu collector`, which resolves
the scope through the tracer's CRI relay only, and the real `ghostgpu trace` CLI prints the records.

Each workload container runs the static gpucalls (tests/helpers/gpucalls.c: the ioctl sequence
of a CUDA start-up) from an image that holds it at /bin/gpucalls, with the host's /dev/null as
its /dev/nvidiactl and /dev/nvidia-uvm and /dev/zero as its /dev/nvidia0 (mapped in through
CRI's devices, as the kubelet does for a device plugin). Its stdin is a FIFO in the container's
/tmp, which the test opens through /proc/PID/root once the session is known to run on the tracer:
the shell's redirection returns, it execs gpucalls (`--ready --hold`), which starts its calls on
the test's line and, after them, waits for the test to close the FIFO, which the test does once
the collector has every record (so the tracer read the process's identity while it lived).
gpucalls' JSON lines come back from the container's CRI log: the decoded records must be exactly
those calls, per thread and in order, carry the container's id and the names CRI gave it, and
nothing from any other pod.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.cli.client import Query

from ghostgpu.common.model.trace import TraceSession
from ghostgpu.k8s import cri_runtime_v1_pb2 as cri
from tests.helpers.collector_proc import REPO, CollectorProcess, _clean_env, ghostgpu_cli
from tests.helpers.containerd import Containerd, Pod
from tests.helpers.containerd_image import ImageVariant
from tests.helpers.fakenvml import FakeGpu, FakeNvml
from tests.helpers.gpucalls import build_gpucalls, expected_calls, parse_lines
from tests.helpers.polling import wait_until
from tests.helpers.tracer_proc import TracerProcess
from tests.integration.conftest import GPU0_UUID, require_bpf

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.containerd]

NODE = "node-trace"
DRIVER = "550.54.15"  # what the fake NVML says; gpucalls lays out its blocks for the same release
DEADLINE_S = 30.0  # generous: a 2-core VM shared with other test runs
GPUCALLS_TAG = "docker.io/local/gpucalls:test"
GATE = "/tmp/go"  # the FIFO that is the workload's stdin
DEVICES = [("/dev/null", "/dev/nvidiactl"), ("/dev/zero", "/dev/nvidia0"), ("/dev/null", "/dev/nvidia-uvm")]
GATED_GPUCALLS = ["/bin/sh", "-c", f"busybox mkfifo {GATE} && "
                  f"exec /bin/gpucalls --driver {DRIVER} --ready --hold < {GATE}"]
IDLE = ["/bin/sleep", "300"]
COMPARED = ("call", "cmd_name", "class_name", "nv_status_name")  # of an ioctl, beyond kind, device and fd
KINDS = ("open", "ioctl", "mmap", "munmap", "close")
RUNNING = re.compile(r"^trace (t-[0-9a-f]+) running until ", re.M)


@dataclass
class LiveTrace:
    """A `ghostgpu trace ...` process, its stdout and stderr in files."""

    proc: subprocess.Popen[bytes]
    out_path: Path
    err_path: Path
    session: str = ""

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait(self, timeout_s: float = DEADLINE_S) -> list[dict[str, Any]]:
        """Waits for a clean exit; the JSON lines it printed."""
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"ghostgpu trace still running after {timeout_s} s: "
                                 f"{self.stderr()}") from None
        assert rc == 0, f"ghostgpu trace exited {rc}: {self.stderr()}"
        return [json.loads(line) for line in self.out_path.read_text().splitlines()]


@dataclass
class TraceNode:
    """One node: containerd, the tracer relaying its CRI, the collector, a query channel."""

    containerd: Containerd
    collector: CollectorProcess
    tracer: TracerProcess
    query: Query
    workdir: Path
    pods: list[Pod] = field(default_factory=list)
    gates: dict[str, int] = field(default_factory=dict)  # container id -> our end of its stdin FIFO
    traces: list[LiveTrace] = field(default_factory=list)

    # ---- pods ---------------------------------------------------------------------------------

    def pod(self, name: str, namespace: str, command: list[str], gpucalls: bool = True) -> tuple[Pod, str]:
        """A pod with one container `cuda` (the gpucalls image and the device nodes when `gpucalls`)."""
        pod = self.containerd.run_pod(name, namespace)
        self.pods.append(pod)
        cid = self.containerd.create_container(pod, "cuda", command, devices=DEVICES if gpucalls else (),
                                               image=GPUCALLS_TAG)
        return pod, cid

    def gpucalls_pod(self, name: str, namespace: str) -> tuple[Pod, str]:
        return self.pod(name, namespace, GATED_GPUCALLS)

    def go(self, cid: str) -> None:
        """Lets the container's gpucalls start: opens its stdin FIFO (once the shell waits to read it),
        which execs gpucalls, and writes the line its --ready waits for."""
        gate = f"/proc/{self.containerd.container_host_pid(cid)}/root{GATE}"
        fd = -1

        def opened() -> bool:
            nonlocal fd
            try:  # ENOENT: no FIFO yet; ENXIO: nobody reading it yet
                fd = os.open(gate, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:
                if e.errno not in (errno.ENOENT, errno.ENXIO):
                    raise
                return False
            return True

        wait_until(opened, f"container {cid[:12]}'s shell opening {GATE}", DEADLINE_S)
        self.gates[cid] = fd
        os.write(fd, b"go\n")

    def done(self, cid: str) -> list[dict[str, Any]]:
        """What the container's gpucalls issued (its JSON lines), once it said `done` (it then holds)."""
        wait_until(lambda: "done" in self.containerd.log_lines(cid), f"gpucalls in {cid[:12]} done",
                   DEADLINE_S)
        return [r for r in parse_lines(self.containerd.log_lines(cid)) if "i" in r]

    def release(self, cid: str) -> None:
        """Closes the FIFO: gpucalls' --hold sees EOF, it exits 0."""
        os.close(self.gates.pop(cid))
        status = self.exited(cid)
        assert status.exit_code == 0, (f"gpucalls in {cid[:12]} exited {status.exit_code}: "
                                       f"{self.containerd.log_lines(cid, 'stderr')}")

    def exited(self, cid: str) -> cri.ContainerStatus:
        wait_until(lambda: self.containerd.container_status(cid).state == cri.CONTAINER_EXITED,
                   f"container {cid[:12]} to exit", DEADLINE_S)
        return self.containerd.container_status(cid)

    # ---- trace sessions ---------------------------------------------------------------------------

    def trace(self, *args: str) -> LiveTrace:
        """`ghostgpu trace ARGS -o jsonl`, returned once its session runs: the CLI prints its "running
        until" line after StartTrace returned, which the collector answers once every tracer in scope
        answered its trace_start, which a tracer does once its kernel maps are set."""
        n = len(self.traces) + 1
        out_path, err_path = (self.workdir / f"trace{n}.{x}" for x in ("out", "err"))
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "ghostgpu.cli", "trace", "--collector", self.collector.address, *args,
                 "-o", "jsonl"], stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=REPO, env=_clean_env())
        live = LiveTrace(proc, out_path, err_path)
        self.traces.append(live)
        found: list[str] = []

        def started() -> bool:
            found[:] = RUNNING.findall(live.stderr())
            assert proc.poll() is None or found, f"ghostgpu trace exited {proc.returncode}: {live.stderr()}"
            return bool(found)

        wait_until(started, "ghostgpu trace's session running", DEADLINE_S)
        live.session = found[0]
        return live

    def session(self, sid: str) -> TraceSession:
        return next(s for s in self.query.list_traces() if s.id == sid)

    def wait_records(self, sid: str, n: int) -> None:
        """Until the collector stored at least n records of the session."""
        wait_until(lambda: self.session(sid).records_total >= n, f"{n} records of {sid} stored", DEADLINE_S)


@pytest.fixture(scope="module")
def node(containerd_session: Containerd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TraceNode]:
    require_bpf()
    ctd = containerd_session.start()
    ctd.import_variant(ImageVariant(GPUCALLS_TAG, (("bin/gpucalls", str(build_gpucalls(static=True))),)))
    work = tmp_path_factory.mktemp("trace-ctd")
    nvml = FakeNvml(work / "nvml.conf", gpus=[FakeGpu(index=0, uuid=GPU0_UUID, minor=0)],
                    driver_version=DRIVER)
    nvml.write()
    (work / "tracer").mkdir()
    # No CRI socket for the collector: every CRI call (the scope, the names) goes through the relay.
    collector = CollectorProcess(work / "collector", unix=False)
    tracer = TracerProcess(work / "tracer", ["--grace-s", "0.5", "--cri-endpoint", ctd.endpoint], nvml.env(),
                           NODE, collector.address)
    query = Query(collector.address)
    tn = TraceNode(ctd, collector, tracer, query, work)
    try:
        tracer.wait_ready(DEADLINE_S)
        wait_until(lambda: any(n.node == NODE and n.connected and "trace" in n.capabilities
                               for n in query.nodes()), "the tracer connected, offering trace", DEADLINE_S)
        yield tn
    finally:
        query.close()
        tracer.stop()
        collector.stop()


@pytest.fixture
def trace_node(node: TraceNode, containerd: Containerd) -> Iterator[TraceNode]:
    """The node, its containerd running; what a test left (CLI processes, FIFO ends, pods) goes after it."""
    yield node
    for live in node.traces:
        if live.proc.poll() is None:
            live.proc.kill()
            live.proc.wait()
    node.traces.clear()
    for fd in node.gates.values():
        os.close(fd)
    node.gates.clear()
    pods, node.pods[:] = list(node.pods), []
    for pod in pods:
        node.containerd.remove_pod(pod.id)


def per_thread(rows: list[dict[str, Any]]) -> list[list[tuple[Any, ...]]]:
    """Each thread's device calls in order (kind, device, fd and, for an ioctl, its decoded names),
    the threads sorted: the workload's tids are those of its pod's PID namespace, the records' the
    host's."""
    threads: dict[int, list[tuple[Any, ...]]] = {}
    for r in rows:
        kind = r["kind"]
        if kind in KINDS:
            fd = None if kind == "munmap" else r["fd"]
            names = tuple(r[k] for k in COMPARED) if kind == "ioctl" else ()
            threads.setdefault(r["tid"], []).append((kind, r["device"], fd, *names))
    return sorted(threads.values())


def assert_decoded(records: list[dict[str, Any]], issued: list[dict[str, Any]]) -> None:
    """The session's records of the workload are its calls, decoded, per thread and in order."""
    want = per_thread([x for calls in expected_calls(issued).values() for x in calls])
    got = per_thread(sorted(records, key=lambda r: r["seq"]))
    assert got == want
    assert sum(kind == "ioctl" for thread in got for kind, *_ in thread) == 27  # the CUDA start-up, once
    # One process: its exec (the gate's shell became gpucalls) and exit, all of it the pid it printed.
    assert sorted(r["kind"] for r in records if r["kind"] not in KINDS) == ["exec", "exit"]
    assert {r["ns_pid"] for r in records} == {x["pid"] for x in issued}


def assert_named(records: list[dict[str, Any]], cid: str, namespace: str, pod: str) -> None:
    assert records
    for r in records:
        assert (r["node"], r["container_id"], r["namespace"], r["pod"], r["container"]) == (
            NODE, cid, namespace, pod, "cuda"), r


def test_a_pod_scope_catches_its_pods_calls_and_nothing_from_the_next_pod(trace_node: TraceNode) -> None:
    ns = "trace-pods"
    _, cid1 = trace_node.gpucalls_pod("trainer-a", ns)
    _, cid2 = trace_node.gpucalls_pod("trainer-b", ns)  # same namespace, same container name, same calls
    live = trace_node.trace("-n", ns, "--pod", "trainer-a", "--for", "8s")
    session = trace_node.session(live.session)
    assert (session.nodes, session.container_ids) == ((NODE,), (cid1,))
    trace_node.go(cid1)
    trace_node.go(cid2)
    issued1, issued2 = trace_node.done(cid1), trace_node.done(cid2)
    assert len(issued2) == len(issued1) > 27  # the other pod made the very same calls meanwhile
    trace_node.wait_records(live.session, len(issued1) + 1)  # its calls and its exec
    trace_node.release(cid1)
    trace_node.release(cid2)
    assert time.time_ns() < session.deadline_unix_ns, "the workloads took longer than the session"

    records = live.wait()  # the session ends at its deadline
    assert_named(records, cid1, ns, "trainer-a")
    assert_decoded(records, issued1)
    assert not [r for r in records if r["container_id"] == cid2 or r["pod"] == "trainer-b"]
    ended = trace_node.session(live.session)
    assert (str(ended.status), ended.records_total) == ("completed", len(records))
    assert f"trace {live.session} completed" in live.stderr()


@pytest.mark.parametrize("before", ["running", "exited"])
def test_a_namespace_scope_takes_in_a_container_started_mid_session(
        trace_node: TraceNode, before: str) -> None:
    """The namespace runs an idle pod (the new container comes by trace_update), or only an exited
    container (the session starts on no node; the new container's node gets trace_start)."""
    ns = f"trace-ns-{before}"
    _, first = trace_node.pod("idle-0", ns, IDLE if before == "running" else ["/bin/true"], gpucalls=False)
    if before == "exited":
        trace_node.exited(first)
    live = trace_node.trace("-n", ns, "--for", "60s")
    start = trace_node.session(live.session)
    assert start.container_ids == ((first,) if before == "running" else ())

    _, cid = trace_node.gpucalls_pod("late-0", ns)  # started mid-session
    # The collector resolves the namespace again every second; the new id is in the session once the
    # tracer answered the trace_update (or trace_start) that added it.
    wait_until(lambda: cid in trace_node.session(live.session).container_ids,
               "the session taking in the new container", DEADLINE_S)
    trace_node.go(cid)
    issued = trace_node.done(cid)
    trace_node.wait_records(live.session, len(issued) + 1)
    trace_node.release(cid)  # its exit is in the kernel's buffer before the stop: the tracer sends it
    stop = ghostgpu_cli("trace", "stop", live.session, "--collector", trace_node.collector.address)
    assert stop.returncode == 0 and f"trace {live.session} stopped" in stop.stdout, stop.stderr

    records = live.wait()
    assert_named(records, cid, ns, "late-0")  # the idle container made no GPU call
    assert_decoded(records, issued)
    ended = trace_node.session(live.session)
    assert str(ended.status) == "stopped" and ended.nodes == (NODE,)
    assert set(ended.container_ids) == {cid} | ({first} if before == "running" else set())


def test_an_unknown_pod_is_refused_by_name(trace_node: TraceNode) -> None:
    ns = "trace-refused"
    trace_node.pod("idle-0", ns, IDLE, gpucalls=False)  # the namespace exists, the pod does not
    out = ghostgpu_cli("trace", "--collector", trace_node.collector.address, "-n", ns, "--pod",
                       "does-not-exist", "--for", "5s")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == [
        f"ghostgpu: pod {ns}/does-not-exist not found (ghostgpu ps lists pods with GPU consumers)"]
    assert not [s for s in trace_node.query.list_traces() if s.scope.pod == "does-not-exist"]
