"""The tracer's act of remediation (tracer/remediate.py) against real processes in fake containers.

Each holder is gpuwork in a FakeContainer (own PID and mount namespaces, a private /dev with
nvidia0 as a real character node, a kubepods cgroup), and the CRI the tracer's own relay reaches is
a FakeCri on a real unix socket that names itself containerd (Version), as the node's runtime would.
The identity decided on (pid, start time, exe, container, pod) is what the tracer's /proc code reads,
as the collector would send it back. Signals go through real pidfds; nothing here is mocked but the one
case no kernel can be made to show on demand (a holder that outlives SIGKILL, see its test).

A container init (PID 1 of its namespace) has no SIGTERM handler, and the kernel drops a signal with
no handler sent to a namespace's init from an ancestor namespace (pid_namespaces(7)): it "ignores"
SIGTERM as many real container entrypoints do, and only SIGKILL ends it. A holder forked inside the
container (PID 2) dies of SIGTERM.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest
from ghostgpu.tracer.cri_relay import CriRelay
from ghostgpu.tracer.devices import DeviceCatalog
from ghostgpu.tracer.events import boot_ns
from ghostgpu.tracer.remediate import ProcView, Remediator
from ghostgpu.tracer.stream import StreamSink

from ghostgpu.common.model.records import InfoRecord
from ghostgpu.common.model.remediation import CAPABILITY, DONE, PROPOSED, SKIPPED, UNKILLABLE
from ghostgpu.k8s import cri_runtime_v1_pb2 as cri
from ghostgpu.v1 import node_pb2, stream_pb2
from tests.conftest import require_root
from tests.helpers.container import ContainerProcess, FakeContainer
from tests.helpers.cri_fake import FakeCri
from tests.helpers.fake_collector import FakeCollector
from tests.helpers.polling import poll, wait_until
from tests.helpers.workload import build_gpuwork

pytestmark = [pytest.mark.root, pytest.mark.netns]

NODE = "node-a"
HOLD = ["open", "/dev/nvidiactl", "open", "/dev/nvidia0"]


@pytest.fixture(autouse=True)
def _root() -> None:
    require_root()
    if not shutil.which("gcc"):
        pytest.skip("gcc is needed to build the test workload (gpuwork)")


@pytest.fixture
def fake_cri() -> Iterator[FakeCri]:
    with FakeCri(runtime_name="containerd") as runtime:
        runtime.add_sandbox("sb1", "job-0", "team-a", "uid-1")
        yield runtime


@pytest.fixture
def relay(fake_cri: FakeCri) -> Iterator[CriRelay]:
    r = CriRelay(fake_cri.endpoint, node=NODE)
    yield r
    r.close()


@pytest.fixture
def container() -> Iterator[FakeContainer]:
    with FakeContainer() as c:
        yield c


def catalog() -> DeviceCatalog:
    return DeviceCatalog(("/dev/nvidia",), "/proc")


def remediator(relay: CriRelay | None, **kw: object) -> Remediator:
    return Remediator(NODE, catalog(), relay, **kw)  # type: ignore[arg-type]


def decided(pid: int, container_id: str, **kw: object) -> stream_pb2.RemediateCommand:
    """The identity the tracer's own /proc reader gives pid now: what the collector decides on."""
    seen = ProcView("/proc", catalog()).look(pid)
    assert seen is not None and seen.exe, f"pid {pid} is gone or its exe unreadable"
    fields: dict[str, object] = {"incident": f"f{pid}/kill_orphan", "container_id": container_id,
                                 "devices": ["/dev/nvidia0"], "grace_ms": 5000}
    fields.update(kw)
    pod_uid = str(fields.pop("pod_uid", seen.pod_uid))
    return stream_pb2.RemediateCommand(
        process=node_pb2.Process(pid=pid, start_time_ns=seen.start_time_ns, exe=seen.exe, comm="gpuwork",
                                 pod_uid=pod_uid),
        **fields)  # type: ignore[arg-type]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def forked_holder(c: FakeContainer) -> tuple[ContainerProcess, int]:
    """A holder at PID 2 of its container (it dies of SIGTERM), and its host PID."""
    p = c.run([*HOLD, "fork", "ready", "wait"])
    p.wait_ready()
    assert p.ns_pid == 2
    return p, p.host_pid


def test_unknown_to_cri_sigterm_ends_it(container: FakeContainer, relay: CriRelay) -> None:
    """(1) Its container is unknown to CRI: re-checked, SIGTERM through the pidfd, gone, released."""
    _, pid = forked_holder(container)
    result = remediator(relay).handle(decided(pid, container.container_id))
    assert result.outcome == DONE, result.reason
    assert list(result.signals) == ["SIGTERM"] and result.released and result.exited
    wait_until(lambda: not alive(pid), f"pid {pid} gone")


def test_a_holder_ignoring_sigterm_gets_sigkill(container: FakeContainer, relay: CriRelay,
                                                 fake_cri: FakeCri) -> None:
    """(2) The container init ignores SIGTERM (see the module doc): SIGKILL after the grace."""
    fake_cri.add_container(container.container_id, "sb1", "job", state=cri.CONTAINER_EXITED)
    p = container.run([*HOLD, "ready", "wait"])
    p.wait_ready()
    pid = p.host_pid
    result = remediator(relay).handle(decided(pid, container.container_id, grace_ms=300))
    assert result.outcome == DONE, result.reason
    assert list(result.signals) == ["SIGTERM", "SIGKILL"] and result.released
    assert fake_cri.calls["ContainerStatus"] == 1


def test_a_running_container_is_never_touched(container: FakeContainer, relay: CriRelay,
                                              fake_cri: FakeCri) -> None:
    """(3) CRI says the container runs (it came back between the decision and the act): nothing sent."""
    fake_cri.add_container(container.container_id, "sb1", "job", state=cri.CONTAINER_RUNNING)
    _, pid = forked_holder(container)
    result = remediator(relay).handle(decided(pid, container.container_id))
    assert result.outcome == SKIPPED
    assert result.reason == f"container {container.container_id[:12]} is running again (CRI)"
    assert not result.signals and not result.exited and alive(pid)


def test_an_unknown_container_state_is_no_corroboration(container: FakeContainer, relay: CriRelay,
                                                        fake_cri: FakeCri) -> None:
    """containerd answers UNKNOWN while it cannot reach the container's shim: it may still run."""
    fake_cri.add_container(container.container_id, "sb1", "job", state=cri.CONTAINER_UNKNOWN)
    _, pid = forked_holder(container)
    result = remediator(relay).handle(decided(pid, container.container_id))
    assert result.outcome == SKIPPED and "CRI reports its state UNKNOWN" in result.reason
    assert not result.signals and alive(pid)


def test_a_container_of_another_runtime_is_never_touched(fake_cri: FakeCri, relay: CriRelay) -> None:
    """A docker container in a pod's cgroup on a node whose CRI is containerd: NOT_FOUND from
    containerd says nothing about it."""
    with FakeContainer(runtime="docker") as other:
        _, pid = forked_holder(other)
        result = remediator(relay).handle(decided(pid, other.container_id))
        assert result.outcome == SKIPPED
        assert result.reason == "cannot confirm: docker container, CRI speaks for containerd"
        assert fake_cri.calls["ContainerStatus"] == 0
        assert not result.signals and alive(pid)


def test_a_container_outside_kubernetes_is_never_touched(relay: CriRelay) -> None:
    """`docker run` beside the kubelet: docker-<id>.scope with no pod above it. CRI answers NOT_FOUND
    for its id; with no pod in its cgroup nothing is signalled, whatever the decision said."""
    standalone = FakeContainer(runtime="docker")
    standalone.cgroup_path = f"/ghostgpu-test-docker.slice/docker-{standalone.container_id}.scope"
    standalone.cgroup_paths = {m.mountpoint: m.mountpoint + standalone.cgroup_path for m in standalone.mounts}
    with standalone:
        _, pid = forked_holder(standalone)
        seen = ProcView("/proc", catalog()).look(pid)
        assert seen is not None and (seen.container_id, seen.pod_uid) == (standalone.container_id, "")
        result = remediator(relay).handle(decided(pid, standalone.container_id))  # as decided: no pod
        assert (result.outcome, result.reason) == (SKIPPED, f"pid {pid}: no pod to corroborate; only a "
                                                            "container of a Kubernetes pod is signalled")
        stale = decided(pid, standalone.container_id, pod_uid="0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0")
        result = remediator(relay).handle(stale)
        assert result.outcome == SKIPPED
        assert result.reason.startswith(f"pid {pid} is in no Kubernetes pod (a docker container names none")
        assert not result.signals and alive(pid)


def test_a_host_process_is_never_touched(relay: CriRelay) -> None:
    """A host program holding the device whose leader turned zombie reads orphaned, yet may be
    healthy: with no container for CRI to corroborate, nothing is signalled."""
    host = subprocess.Popen(["sleep", "600"])
    try:
        command = decided(host.pid, "", pod_uid="")
        result = remediator(relay).handle(command)
        assert result.outcome == SKIPPED and "no container for CRI to corroborate" in result.reason
        assert not result.signals and host.poll() is None
    finally:
        host.kill()
        host.wait()


def test_unreachable_cri_is_no_corroboration(container: FakeContainer, relay: CriRelay,
                                             fake_cri: FakeCri) -> None:
    _, pid = forked_holder(container)
    fake_cri.stop()
    result = remediator(relay).handle(decided(pid, container.container_id))
    assert result.outcome == SKIPPED and "cannot confirm with CRI" in result.reason
    assert alive(pid)


def test_dry_run_proposes_and_leaves_it_alive(container: FakeContainer, relay: CriRelay) -> None:
    """(5)"""
    _, pid = forked_holder(container)
    result = remediator(relay).handle(decided(pid, container.container_id, dry_run=True))
    assert result.outcome == PROPOSED
    assert result.reason.startswith(f"dry run: would send SIGTERM to pid {pid} (gpuwork, ")
    assert result.reason.endswith("SIGKILL after 5 s")
    assert not result.signals and not result.exited and alive(pid)


def test_a_released_device_is_skipped(container: FakeContainer, relay: CriRelay) -> None:
    p = container.run(["open", "/dev/nvidia0", "fork", "ready", "close", "0", "ready", "wait"])
    p.wait_ready()
    pid = p.host_pid
    command = decided(pid, container.container_id)
    p.wait_ready()  # it closed its fd
    result = remediator(relay).handle(command)
    assert (result.outcome, result.reason) == (SKIPPED, f"pid {pid} no longer holds a GPU device")
    assert alive(pid)


def test_a_zombie_leader_whose_thread_holds_is_killed(container: FakeContainer, relay: CriRelay) -> None:
    """(6) The leader left with SYS_exit (pthread_exit); a thread keeps the device open."""
    p = container.run([*HOLD, "fork", "ready", "thread-hold"])
    p.wait_ready()
    pid = p.host_pid
    wait_until(lambda: not alive(pid), "the leader to turn zombie")  # a zombie leader reads Z
    assert os.listdir(f"/proc/{pid}/task") != [str(pid)]  # its thread lives on
    result = remediator(relay).handle(decided(pid, container.container_id))
    assert result.outcome == DONE, result.reason
    assert list(result.signals) == ["SIGTERM"] and result.released
    wait_until(lambda: not os.path.exists(f"/proc/{pid}/task") or os.listdir(f"/proc/{pid}/task") == [],
               "every thread gone")


def _reuse_pid(pid: int, deadline_attempts: int = 2000) -> subprocess.Popen[bytes]:
    """A new process at `pid`, holding a GPU device too, with the same exe: only the start time tells
    it apart. ns_last_pid (kernel/pid.c) is where the next PID search starts; another process may
    take the number first, so retry."""
    gpuwork = str(build_gpuwork())
    script = (f"mount -t tmpfs none /dev && mknod /dev/nvidia0 c 1 3 && "
              f"exec {gpuwork} open /dev/nvidia0 ready wait")
    for _ in range(deadline_attempts):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        # unshare (util-linux) makes the new mount namespace's propagation private by default, and
        # each exec keeps the PID: unshare -> sh -> gpuwork
        proc = subprocess.Popen(["unshare", "-m", "sh", "-c", script], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    pytest.fail(f"could not get a new process at pid {pid} in {deadline_attempts} tries")


def test_a_pid_in_another_container_is_not_the_one_decided(container: FakeContainer,
                                                           relay: CriRelay) -> None:
    """A PID reused within one clock tick (10 ms: the start time's unit) keeps the start time, and an
    image's exe is common: the cgroup tells them apart. Here the holder's start time and exe are those
    decided on, but the decision was for another container."""
    _, pid = forked_holder(container)
    elsewhere = "0ddba11" + "0" * 57
    result = remediator(relay).handle(decided(pid, elsewhere))
    assert result.outcome == SKIPPED
    assert result.reason == (f"pid {pid} was reused: container {container.container_id[:12]}, "
                             "decided 0ddba1100000")
    assert not result.signals and alive(pid)


def test_forced_pid_reuse_is_caught(container: FakeContainer, relay: CriRelay) -> None:
    """(4) Decide on a holder, kill it, put a new process (same exe, holding the device) at its PID,
    then send the old identity: nothing is signalled, the new process lives on."""
    p, pid = forked_holder(container)
    command = decided(pid, container.container_id)
    p.kill()  # the init dies, and its namespace with it
    wait_until(lambda: not os.path.exists(f"/proc/{pid}"), f"pid {pid} reaped")
    # A start time is in clock ticks: the newcomer must start in a later tick for it to differ (a PID
    # cannot come round again within one tick but for ns_last_pid; the container check covers that).
    tick_ns = 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    wait_until(lambda: boot_ns() >= command.process.start_time_ns + tick_ns, "the next clock tick")
    newcomer = _reuse_pid(pid)
    try:
        assert newcomer.stdout is not None
        assert newcomer.stdout.readline().startswith(b"ready")
        assert ProcView("/proc", catalog()).held(pid) == {"/dev/nvidia0"}
        result = remediator(relay).handle(command)
        assert result.outcome == SKIPPED
        assert result.reason.startswith(f"pid {pid} was reused: start time "), result.reason
        assert not result.signals and result.exited
        assert newcomer.poll() is None and alive(pid)
    finally:
        newcomer.kill()
        newcomer.wait()


class StuckProc(ProcView):
    """/proc as it reads for a holder stuck in the driver (state D): the one thing no test here can
    make a real process do. Everything else (the re-checks, pidfd, the waits, wchan, threads) is real."""

    def stat_text(self, pid: int) -> str:
        text = super().stat_text(pid)
        head, _, rest = text.rpartition(")")
        return f"{head}) D{rest[2:]}" if rest else text


def test_unkillable_is_reported_with_wchan_and_threads(container: FakeContainer, relay: CriRelay) -> None:
    """(7) A seam drops the signals (as a process in D state does not act on SIGKILL) and /proc reads
    state D; the process, its pidfd, the waits and the other /proc reads are real."""
    _, pid = forked_holder(container)
    sent: list[int] = []
    act = remediator(relay, proc=StuckProc("/proc", catalog()), send=lambda fd, sig: sent.append(sig),
                     kill_wait_s=0.2)
    result = act.handle(decided(pid, container.container_id, grace_ms=100))
    assert result.outcome == UNKILLABLE
    assert result.reason.startswith(f"pid {pid} did not exit after SIGKILL: state D, wchan ")
    assert result.reason.endswith("(stuck in the driver?)")
    assert result.proc_state == "D" and list(result.stuck_tids) == [pid]
    assert list(result.signals) == ["SIGTERM", "SIGKILL"] and len(sent) == 2
    assert alive(pid)


def test_end_to_end_over_the_stream(container: FakeContainer, fake_cri: FakeCri) -> None:
    """The wire path: the Hello offers "remediation", a Command goes down a real stream, the
    CommandRunner acts, and one CommandResult comes back."""
    _, pid = forked_holder(container)
    relay = CriRelay(fake_cri.endpoint, node=NODE)
    act = Remediator(NODE, catalog(), relay)
    with FakeCollector() as collector:
        sink = StreamSink(collector.target, NODE, relay=relay, capabilities=[CAPABILITY],
                          remediate=act.handle)
        try:
            info = {"event": "info", "ts": 1.0, "node": NODE, "bpf": False, "nvml": False, "nvml_error": "",
                    "driver_version": "", "gpus": []}
            sink.emit(InfoRecord.from_json(info))
            wait_until(lambda: collector.messages("hello"), "Hello")
            assert CAPABILITY in collector.messages("hello")[0].msg.hello.capabilities
            collector.send_command(stream_pb2.Command(id=77, remediate=decided(pid, container.container_id)))
            wait_until(lambda: collector.messages("result"), "the CommandResult", timeout_s=15)
            results = [r.msg.result for r in collector.messages("result")]
            assert [r.id for r in results] == [77]
            answer = results[0].remediate
            assert answer.outcome == DONE and answer.incident == f"f{pid}/kill_orphan", answer.reason
            assert list(answer.signals) == ["SIGTERM"] and answer.released
            assert poll(lambda: not alive(pid))
        finally:
            sink.close()
            relay.close()
