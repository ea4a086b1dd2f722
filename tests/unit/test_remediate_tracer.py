"""The tracer's act of remediation (tracer/remediate.py): the pure decisions as tables, the order of
the re-checks with a scripted /proc view and CRI, and CommandRunner's one answer per command on the
remediation's own worker.

The signal path here runs against a real child process of the test (same uid: no root needed); the
fake containers, CRI and a real stream are in tests/integration/test_remediate_processes.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from ghostgpu.tracer.capabilities import has_effective
from ghostgpu.tracer.config import load_config
from ghostgpu.tracer.cri_relay import CommandRunner
from ghostgpu.tracer.devices import DeviceCatalog
from ghostgpu.tracer.remediate import (
    ProcView,
    Remediator,
    Seen,
    Stuck,
    cap_kill_note,
    cri_problem,
    identity_problem,
    live_tids_of,
    runtime_problem,
    unkillable_reason,
)

from ghostgpu.common.model.remediation import DONE, FAILED, PROPOSED, SKIPPED, UNKILLABLE
from ghostgpu.common.system.configfile import ConfigError
from ghostgpu.k8s import cri_runtime_v1_pb2 as cri
from ghostgpu.v1 import node_pb2, stream_pb2
from tests.helpers.polling import wait_until

NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
CID = "c0ffee" + "1" * 58
POD = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
START_NS = 5_000_000_000


# --- pure decisions ---------------------------------------------------------------------------

@pytest.mark.parametrize(("seen", "want_exe", "outcome", "words"), [
    (None, "/bin/x", SKIPPED, "pid 42 already exited"),
    (Seen(START_NS + 10_000_000, "/bin/x"), "/bin/x", SKIPPED, "pid 42 was reused: start time 5010000000"),
    (Seen(START_NS, "/bin/y"), "/bin/x", SKIPPED, "pid 42 was reused: exe '/bin/y'"),
    (Seen(START_NS, ""), "/bin/x", SKIPPED, "cannot be read"),
    (Seen(START_NS, "/bin/x"), "/bin/x", None, ""),
    (Seen(START_NS, "/bin/x (deleted)"), "/bin/x", None, ""),  # the same binary, replaced since
    (Seen(START_NS, ""), "", None, ""),  # no exe decided: the start time alone
])
def test_identity_problem(seen: Seen | None, want_exe: str, outcome: str | None, words: str) -> None:
    problem = identity_problem(42, START_NS, want_exe, seen)
    if outcome is None:
        assert problem is None
    else:
        assert problem is not None and problem.outcome == outcome and words in problem.reason
        # gone, or the PID names another process; an unreadable exe says neither
        assert problem.exited == ("already exited" in words or "reused" in words)


@pytest.mark.parametrize(("seen_pod", "runtime", "want_pod", "words", "exited"), [
    (POD, "containerd", POD, None, False),
    ("", "docker", POD, "pid 42 is in no Kubernetes pod (a docker container names none; decided pod", False),
    ("", "", POD, "pid 42 is in no Kubernetes pod (its cgroup names none", False),
    ("1" * 32, "containerd", POD, f"pid 42 was reused: pod {'1' * 32}, decided {POD}", True),
])
def test_identity_checks_the_pod(seen_pod: str, runtime: str, want_pod: str, words: str | None,
                                 exited: bool) -> None:
    seen = Seen(START_NS, "/bin/x", CID, seen_pod, runtime)
    problem = identity_problem(42, START_NS, "/bin/x", seen, CID, want_pod)
    if words is None:
        assert problem is None
    else:
        assert problem is not None and problem.outcome == SKIPPED and words in problem.reason
        assert problem.exited == exited


@pytest.mark.parametrize(("cgroup_runtime", "cri_runtime", "why"), [
    ("containerd", "containerd", None),
    ("crio", "cri-o", None),
    ("crio-conmon", "cri-o", None),
    ("docker", "docker", None),  # cri-dockerd
    ("", "containerd", None),  # a bare id under a cgroupfs pod: the pod UID stands for it
    ("docker", "containerd", "cannot confirm: docker container, CRI speaks for containerd"),
    ("podman", "containerd", "cannot confirm: podman container, CRI speaks for containerd"),
    ("podman", "cri-o", "cannot confirm: podman container, CRI speaks for cri-o"),
    ("containerd", "", "cannot confirm: containerd container, CRI speaks for an unnamed runtime"),
])
def test_runtime_problem(cgroup_runtime: str, cri_runtime: str, why: str | None) -> None:
    assert runtime_problem(cgroup_runtime, cri_runtime) == why


@pytest.mark.parametrize(("seen_container", "want", "ok"), [
    ("", "", True),  # a host process: no container decided
    (CID, CID, True),
    ("", CID, False),  # the PID now belongs to a host process
    ("beef" * 16, CID, False),
])
def test_identity_checks_the_container(seen_container: str, want: str, ok: bool) -> None:
    problem = identity_problem(42, START_NS, "/bin/x", Seen(START_NS, "/bin/x", seen_container), want)
    assert (problem is None) == ok
    if problem is not None:
        assert problem[1].startswith("pid 42 was reused: container ")


def test_identity_without_a_start_time_is_never_trusted() -> None:
    problem = identity_problem(42, 0, "/bin/x", Seen(START_NS, "/bin/x"))
    assert problem is not None and problem[0] == SKIPPED and "no start time" in problem[1]


@pytest.mark.parametrize(("code", "message", "state", "words"), [
    (NOT_FOUND, "not found", None, None),
    (0, "", cri.CONTAINER_EXITED, None),
    (0, "", cri.CONTAINER_CREATED, None),
    # containerd says UNKNOWN while its shim is unreachable: the container may run
    (0, "", cri.CONTAINER_UNKNOWN, "cannot confirm with CRI that container c0ffee111111 is gone: CRI reports "
                                   "its state UNKNOWN"),
    (0, "", cri.CONTAINER_RUNNING, "container c0ffee111111 is running again (CRI)"),
    (UNAVAILABLE, "no CRI socket", None,
     "cannot confirm with CRI that container c0ffee111111 is gone: no CRI"),
    (0, "", None, "did not parse"),
])
def test_cri_problem(code: int, message: str, state: int | None, words: str | None) -> None:
    why = cri_problem(CID, code, message, state)
    assert (why is None) if words is None else (why is not None and words in why)


def _stat(pid: int, state: str) -> str:
    fields = [state, "1", str(pid), "0", "0", "-1", "4194560"] + ["0"] * 10 + ["2", "0", "12345"] + ["0"] * 20
    return f"{pid} (a (b) c) " + " ".join(fields)


def test_live_tids_and_the_unkillable_reason() -> None:
    tids = live_tids_of({10: _stat(10, "Z"), 11: _stat(11, "D"), 12: "", 13: _stat(13, "R")})
    assert tids == [11, 13]
    reason = unkillable_reason(10, Stuck(state="D", wchan="nv_wait_for_event", tids=tids))
    assert reason == ("pid 10 did not exit after SIGKILL: state D, wchan nv_wait_for_event, 2 thread(s) "
                      "alive (stuck in the driver?)")
    assert "state S, wchan unknown" in unkillable_reason(10, Stuck(state="S"))


# --- the act, with a scripted /proc view ------------------------------------------------------

class ScriptedProc(ProcView):
    """A /proc view whose answers a test sets; the act around it is the real one. `log` is shared
    with FakeRelay and the signal seam: the order of everything the act looked at and did."""

    def __init__(self, seen: Seen | None, held: set[str], after: Seen | None = None) -> None:
        super().__init__("/proc", DeviceCatalog(("/dev/nvidia",), "/proc"))
        self.seen, self.held_paths, self.after = seen, held, after
        self.looks = self.holds = 0
        self.held_after: set[str] = set()  # what the confirm's look finds held (nothing: released)
        self.stuck_view = Stuck(state="D", wchan="uvm_wait", tids=[7, 8])
        self.log: list[str] = []

    def look(self, pid: int) -> Seen | None:
        self.looks += 1
        self.log.append("look")
        # the identity once more, after CRI and the hold, is the second look: a reuse shows there
        return self.after if self.looks >= 2 and self.after is not None else self.seen

    def held(self, pid: int) -> set[str]:
        self.holds += 1
        self.log.append("held")
        return set(self.held_paths if self.holds == 1 else self.held_after)

    def stuck(self, pid: int) -> Stuck:
        return self.stuck_view


class FakeRelay:
    """CRI as the act sees it: Version names `runtime_name`; ContainerStatus answers `code`/`state`."""

    def __init__(self, code: int = NOT_FOUND, state: int | None = None, runtime_name: str = "containerd",
                 version_code: int = 0) -> None:
        self.code, self.state, self.calls = code, state, 0
        self.runtime_name, self.version_code = runtime_name, version_code
        self.log: list[str] = []

    def call(self, method: str, request: bytes, timeout_ms: int = 0) -> stream_pb2.CriResponse:
        self.calls += 1
        self.log.append(method)
        if method == "Version":
            body = cri.VersionResponse(runtime_name=self.runtime_name).SerializeToString()
            return stream_pb2.CriResponse(code=self.version_code, message="fake version", response=body)
        assert method == "ContainerStatus"
        assert cri.ContainerStatusRequest.FromString(request).container_id == CID
        body = b""
        if self.state is not None:
            body = cri.ContainerStatusResponse(status=cri.ContainerStatus(id=CID, state=self.state)
                                               ).SerializeToString()
        return stream_pb2.CriResponse(code=self.code, message="fake", response=body)


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "600"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def command(pid: int, **kw: object) -> stream_pb2.RemediateCommand:
    fields: dict[str, object] = {"incident": "f7/kill_orphan", "container_id": CID,
                                 "devices": ["/dev/nvidia0"], "grace_ms": 2000}
    fields.update(kw)
    pod_uid = str(fields.pop("pod_uid", POD))
    return stream_pb2.RemediateCommand(
        process=node_pb2.Process(pid=pid, start_time_ns=START_NS, exe="/usr/bin/sleep", comm="sleep",
                                 pod_uid=pod_uid),
        **fields)  # type: ignore[arg-type]


def remediator(proc: ProcView, relay: FakeRelay | None = None, **kw: object) -> Remediator:
    return Remediator("node-a", proc.catalog, relay if relay is not None else FakeRelay(),  # type: ignore[arg-type]
                      proc=proc, **kw)  # type: ignore[arg-type]


SEEN = Seen(START_NS, "/usr/bin/sleep", CID, POD, "containerd")


@pytest.mark.parametrize(("proc", "relay", "cmd", "outcome", "words"), [
    (ScriptedProc(None, set()), FakeRelay(), {}, SKIPPED, "already exited"),
    (ScriptedProc(Seen(START_NS + 1, "/usr/bin/sleep", CID), {"/dev/nvidia0"}), FakeRelay(), {}, SKIPPED,
     "was reused: start time"),
    (ScriptedProc(Seen(START_NS, "/usr/bin/sleep", "beef" * 16, POD), {"/dev/nvidia0"}), FakeRelay(), {},
     SKIPPED, "was reused: container beefbeefbeef, decided c0ffee111111"),
    (ScriptedProc(SEEN, {"/dev/nvidia0"}), FakeRelay(0, cri.CONTAINER_RUNNING), {}, SKIPPED,
     "is running again (CRI)"),
    (ScriptedProc(SEEN, {"/dev/nvidia0"}), FakeRelay(UNAVAILABLE), {}, SKIPPED, "cannot confirm with CRI"),
    (ScriptedProc(SEEN, {"/dev/nvidia0"}), FakeRelay(0, cri.CONTAINER_UNKNOWN), {}, SKIPPED,
     "CRI reports its state UNKNOWN"),
    # a container no kubelet made: docker or podman beside it, whose ids CRI answers NOT_FOUND
    (ScriptedProc(Seen(START_NS, "/usr/bin/sleep", CID, "", "docker"), {"/dev/nvidia0"}), FakeRelay(), {},
     SKIPPED, "is in no Kubernetes pod (a docker container names none"),
    (ScriptedProc(Seen(START_NS, "/usr/bin/sleep", CID, POD, "docker"), {"/dev/nvidia0"}), FakeRelay(), {},
     SKIPPED, "cannot confirm: docker container, CRI speaks for containerd"),
    (ScriptedProc(Seen(START_NS, "/usr/bin/sleep", CID, POD, "podman"), {"/dev/nvidia0"}), FakeRelay(), {},
     SKIPPED, "cannot confirm: podman container, CRI speaks for containerd"),
    (ScriptedProc(SEEN, {"/dev/nvidia0"}), FakeRelay(version_code=UNAVAILABLE), {}, SKIPPED,
     "is gone: its Version (which runtime it speaks for) failed: fake version"),
    (ScriptedProc(Seen(START_NS, "/usr/bin/sleep", CID, "1" * 32, "containerd"), {"/dev/nvidia0"}),
     FakeRelay(), {}, SKIPPED, f"was reused: pod {'1' * 32}, decided {POD}"),
    (ScriptedProc(SEEN, {"/dev/nvidia0"}), FakeRelay(), {"container_id": ""}, SKIPPED,
     "no container for CRI to corroborate; a host process is never signalled"),
    (ScriptedProc(SEEN, {"/dev/nvidia0"}), FakeRelay(), {"pod_uid": ""}, SKIPPED, "no pod to corroborate"),
    (ScriptedProc(SEEN, {"/dev/nvidiactl"}), FakeRelay(), {}, SKIPPED, "no longer holds a GPU device"),
    (ScriptedProc(SEEN, set()), FakeRelay(), {"devices": []}, SKIPPED, "no longer holds a GPU device"),
    (ScriptedProc(SEEN, {"/dev/nvidiactl"}), FakeRelay(), {"devices": [], "dry_run": True}, PROPOSED,
     "dry run: would send SIGTERM to pid {pid} (sleep, /usr/bin/sleep), SIGKILL after 2 s"),
    (ScriptedProc(SEEN, {"/dev/nvidia0"}), FakeRelay(0, cri.CONTAINER_EXITED), {"dry_run": True}, PROPOSED,
     "dry run"),
    (ScriptedProc(SEEN, {"/dev/nvidia0"}), FakeRelay(), {"grace_ms": 3_600_000, "dry_run": True}, PROPOSED,
     "SIGKILL after 60 s"),  # the grace is capped
    # reaped and reused after the first look, before the signal: the last look catches it
    (ScriptedProc(SEEN, {"/dev/nvidia0"}, after=Seen(START_NS + 1, "/usr/bin/sleep", CID, POD, "containerd")),
     FakeRelay(), {}, SKIPPED, "was reused"),
    (ScriptedProc(SEEN, {"/dev/nvidia0"}, after=Seen(START_NS + 1, "/usr/bin/sleep", CID, POD, "containerd")),
     FakeRelay(), {"dry_run": True}, SKIPPED, "was reused"),
])
def test_rechecks_in_order_signal_nothing(child: subprocess.Popen[bytes], proc: ScriptedProc,
                                          relay: FakeRelay, cmd: dict[str, object], outcome: str,
                                          words: str) -> None:
    sent: list[int] = []
    result = remediator(proc, relay, send=lambda fd, sig: sent.append(sig)).handle(command(child.pid, **cmd))
    assert result.outcome == outcome, result.reason
    assert words.format(pid=child.pid) in result.reason
    assert result.incident == "f7/kill_orphan"
    assert sent == [] and not result.signals
    assert child.poll() is None


def test_no_container_id_is_never_signalled(child: subprocess.Popen[bytes]) -> None:
    """A host program with a zombie leader reads orphaned yet may be healthy: no container, no act,
    even when every other re-check would pass."""
    relay = FakeRelay()
    proc = ScriptedProc(Seen(START_NS, "/usr/bin/sleep"), {"/dev/nvidia0"})
    for dry_run in (True, False):
        result = remediator(proc, relay, send=lambda fd, sig: pytest.fail("signalled")).handle(
            command(child.pid, container_id="", pod_uid="", dry_run=dry_run))
        assert result.outcome == SKIPPED and "no container for CRI to corroborate" in result.reason
        assert not result.exited
    assert relay.calls == 0 and proc.looks == 0 and child.poll() is None


def test_a_bare_container_id_passes_on_its_pod(child: subprocess.Popen[bytes]) -> None:
    """A bare id under a cgroupfs pod names no runtime (containerd and cri-dockerd alike): the pod UID
    stands for it and Version is not asked."""
    relay = FakeRelay(runtime_name="something-else")
    proc = ScriptedProc(Seen(START_NS, "/usr/bin/sleep", CID, POD, ""), {"/dev/nvidia0"})
    result = remediator(proc, relay).handle(command(child.pid, dry_run=True))
    assert result.outcome == PROPOSED, result.reason
    assert relay.log == ["ContainerStatus"]


def _is_open_pidfd(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
    except OSError:
        return False


@pytest.mark.parametrize("dry_run", [False, True])
def test_the_pidfd_comes_first_and_identity_last(child: subprocess.Popen[bytes],
                                                  monkeypatch: pytest.MonkeyPatch, dry_run: bool) -> None:
    """The pidfd pins the process before any check; the identity is read again after CRI and the
    hold, right before the signal. A dry run goes the same way and closes its pidfd."""
    proc = ScriptedProc(SEEN, {"/dev/nvidia0"})
    relay = FakeRelay()
    relay.log = proc.log
    opened: list[int] = []
    real_open = os.pidfd_open

    def pidfd_open(pid: int, flags: int = 0) -> int:  # the real one, logged
        proc.log.append("pidfd_open")
        opened.append(real_open(pid, flags))
        return opened[-1]

    def send(fd: int, sig: int) -> None:
        proc.log.append(signal.Signals(sig).name)
        signal.pidfd_send_signal(fd, sig)

    monkeypatch.setattr(os, "pidfd_open", pidfd_open)
    result = remediator(proc, relay, send=send).handle(command(child.pid, dry_run=dry_run))
    signalled = [] if dry_run else ["SIGTERM", "look", "held"]  # then the confirm's look
    assert proc.log == ["pidfd_open", "look", "Version", "ContainerStatus", "held", "look", *signalled]
    assert result.outcome == (PROPOSED if dry_run else DONE), result.reason
    assert len(opened) == 1 and not _is_open_pidfd(opened[0])
    assert (child.poll() is None) == dry_run


def test_exited_says_whether_the_process_decided_on_is_gone(child: subprocess.Popen[bytes]) -> None:
    def act(proc: ScriptedProc, relay: FakeRelay | None = None, **kw: object) -> stream_pb2.RemediateResult:
        return remediator(proc, relay).handle(command(child.pid, **kw))

    assert act(ScriptedProc(None, set())).exited  # identity: already exited
    assert act(ScriptedProc(Seen(START_NS + 1, "/usr/bin/sleep", CID, POD), set())).exited  # reused
    assert not act(ScriptedProc(SEEN, {"/dev/nvidia0"}), dry_run=True).exited  # a dry run finding it alive
    assert not act(ScriptedProc(SEEN, {"/dev/nvidia0"}), FakeRelay(0, cri.CONTAINER_RUNNING)).exited
    assert not act(ScriptedProc(SEEN, set())).exited  # no longer holds: alive
    assert child.poll() is None
    done = act(ScriptedProc(SEEN, {"/dev/nvidia0"}))
    assert done.outcome == DONE and done.exited
    child.wait(5)


def test_a_pid_gone_before_pidfd_open_exited() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: pidfd_open answers ESRCH (unless the PID came round again in between)
    result = remediator(ScriptedProc(SEEN, {"/dev/nvidia0"})).handle(command(gone.pid))
    if result.reason == f"pid {gone.pid} already exited":
        assert result.outcome == SKIPPED and result.exited
    else:  # reused at once by another process: its identity is not the one decided on
        assert result.outcome == SKIPPED and "was reused" in result.reason and result.exited


def test_a_non_kubernetes_container_read_from_proc_is_never_signalled(child: subprocess.Popen[bytes],
                                                                       tmp_path: Path) -> None:
    """/proc/PID/cgroup as docker run shows it beside the kubelet (docker-<id>.scope, no pod), read
    by the real ProcView: CRI would answer NOT_FOUND, and that is no word that it is gone."""
    root = tmp_path
    os.symlink(str(os.getpid()), root / "self")
    pid_dir = root / str(child.pid)
    pid_dir.mkdir()
    (pid_dir / "stat").write_text(_stat(child.pid, "S").replace(" 12345 ", " 500 "))
    (pid_dir / "cgroup").write_text(f"0::/system.slice/docker-{CID}.scope\n")
    os.symlink("/usr/bin/sleep", pid_dir / "exe")

    class HeldView(ProcView):
        def held(self, pid: int) -> set[str]:
            return {"/dev/nvidia0"}

    view = HeldView(str(root), DeviceCatalog(("/dev/nvidia",), str(root)))
    seen = view.look(child.pid)
    assert seen is not None and (seen.container_id, seen.pod_uid, seen.runtime) == (CID, "", "docker")
    relay = FakeRelay()  # NOT_FOUND
    cmd = command(child.pid)
    cmd.process.start_time_ns = seen.start_time_ns
    result = remediator(view, relay, send=lambda fd, sig: pytest.fail("signalled")).handle(cmd)
    assert result.outcome == SKIPPED
    assert "is in no Kubernetes pod (a docker container names none" in result.reason
    assert relay.calls == 0 and child.poll() is None


def test_no_relay_never_acts(child: subprocess.Popen[bytes]) -> None:
    proc = ScriptedProc(SEEN, {"/dev/nvidia0"})
    result = Remediator("node-a", proc.catalog, None, proc=proc).handle(command(child.pid))
    assert result.outcome == SKIPPED and "runs no CRI relay" in result.reason
    assert child.poll() is None


def test_opted_out_node_skips(child: subprocess.Popen[bytes]) -> None:
    proc = ScriptedProc(SEEN, {"/dev/nvidia0"})
    result = remediator(proc, enabled=False).handle(command(child.pid))
    assert (result.outcome, result.reason) == (SKIPPED, "node node-a opted out (tracer --remediation off)")
    assert child.poll() is None


def test_sigterm_ends_it_through_the_pidfd(child: subprocess.Popen[bytes]) -> None:
    proc = ScriptedProc(SEEN, {"/dev/nvidia0"})
    result = remediator(proc).handle(command(child.pid))
    assert result.outcome == DONE, result.reason
    assert list(result.signals) == ["SIGTERM"] and result.released
    assert child.wait(5) == -signal.SIGTERM


def test_exited_yet_held_is_failed(child: subprocess.Popen[bytes]) -> None:
    proc = ScriptedProc(SEEN, {"/dev/nvidia0"})
    proc.held_after = {"/dev/nvidia0"}  # cannot happen with a real kernel: the seam shows the branch
    result = remediator(proc).handle(command(child.pid))
    assert result.outcome == FAILED and "exited but still holds /dev/nvidia0" in result.reason
    assert not result.released


def test_sigkill_after_the_grace(child: subprocess.Popen[bytes]) -> None:
    proc = ScriptedProc(SEEN, {"/dev/nvidia0"})
    sent: list[str] = []

    def send(fd: int, sig: int) -> None:  # SIGTERM is "ignored": only SIGKILL reaches the child
        sent.append(signal.Signals(sig).name)
        if sig == signal.SIGKILL:
            signal.pidfd_send_signal(fd, sig)

    result = remediator(proc, send=send).handle(command(child.pid, grace_ms=50))
    assert result.outcome == DONE, result.reason
    assert list(result.signals) == sent == ["SIGTERM", "SIGKILL"]
    assert child.wait(5) == -signal.SIGKILL


def test_alive_after_sigkill_is_unkillable(child: subprocess.Popen[bytes]) -> None:
    """A process stuck in the driver cannot be made here: the signal seam drops both signals."""
    proc = ScriptedProc(SEEN, {"/dev/nvidia0"})
    act = remediator(proc, send=lambda fd, sig: None, kill_wait_s=0.05)
    result = act.handle(command(child.pid, grace_ms=50))
    assert result.outcome == UNKILLABLE
    assert result.reason == (f"pid {child.pid} did not exit after SIGKILL: state D, wchan uvm_wait, "
                             "2 thread(s) alive (stuck in the driver?)")
    assert (result.proc_state, result.wchan, list(result.stuck_tids)) == ("D", "uvm_wait", [7, 8])
    assert list(result.signals) == ["SIGTERM", "SIGKILL"]


def test_eperm_is_failed_naming_cap_kill(child: subprocess.Popen[bytes]) -> None:
    def send(fd: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    result = remediator(ScriptedProc(SEEN, {"/dev/nvidia0"}), send=send).handle(command(child.pid))
    assert result.outcome == FAILED
    assert result.reason.startswith(f"the tracer lacks CAP_KILL to signal pid {child.pid} (uid ")


def test_esrch_is_an_exit_of_its_own(child: subprocess.Popen[bytes]) -> None:
    def send(fd: int, sig: int) -> None:
        raise ProcessLookupError(3, "No such process")

    result = remediator(ScriptedProc(SEEN, {"/dev/nvidia0"}), send=send).handle(command(child.pid))
    assert result.outcome == DONE and result.released and result.exited and not result.signals


def test_an_unexpected_error_is_one_failed_line(child: subprocess.Popen[bytes]) -> None:
    class Broken(ScriptedProc):
        def held(self, pid: int) -> set[str]:
            raise RuntimeError("boom\nsecond line")

    result = remediator(Broken(SEEN, set())).handle(command(child.pid))
    assert result.outcome == FAILED and "\n" not in result.reason and "RuntimeError: boom" in result.reason


# --- CommandRunner ------------------------------------------------------------------------------

def _run(runner: CommandRunner, cmd: stream_pb2.Command) -> list[stream_pb2.CommandResult]:
    results: list[stream_pb2.CommandResult] = []
    done = threading.Event()

    def reply(result: stream_pb2.CommandResult) -> None:
        results.append(result)
        done.set()

    runner.submit(cmd, reply)
    assert done.wait(10)
    runner.close()
    runner._pool.shutdown(wait=True)
    runner._remediation_pool.shutdown(wait=True)
    return results


def test_command_runner_answers_remediate_exactly_once() -> None:
    runner = CommandRunner(None, "n1", workers=1)
    seen: list[str] = []

    def act(c: stream_pb2.RemediateCommand) -> stream_pb2.RemediateResult:
        seen.append(c.incident)
        return stream_pb2.RemediateResult(incident=c.incident, outcome=PROPOSED, reason="dry run")

    runner.remediate_handler = act
    cmd = stream_pb2.Command(id=9, remediate=stream_pb2.RemediateCommand(incident="f1/kill_orphan"))
    results = _run(runner, cmd)
    assert seen == ["f1/kill_orphan"]
    assert len(results) == 1 and results[0].id == 9 and results[0].WhichOneof("body") == "remediate"
    assert results[0].remediate.outcome == PROPOSED


def test_command_runner_answers_a_raising_or_missing_act() -> None:
    runner = CommandRunner(None, "n1", workers=1)

    def act(c: stream_pb2.RemediateCommand) -> stream_pb2.RemediateResult:
        raise ValueError("bad")

    runner.remediate_handler = act
    results = _run(runner, stream_pb2.Command(id=3, remediate=stream_pb2.RemediateCommand(incident="f2/x")))
    assert [(r.id, r.remediate.outcome, r.remediate.incident) for r in results] == [(3, FAILED, "f2/x")]
    results = _run(CommandRunner(None, "n1", workers=1),
                   stream_pb2.Command(id=4, remediate=stream_pb2.RemediateCommand(incident="f3/x")))
    assert [(r.id, r.remediate.outcome) for r in results] == [(4, SKIPPED)]
    assert "runs no remediation" in results[0].remediate.reason


class Answers:
    """The CommandResults a CommandRunner hands its reply callback (from its worker threads), by id."""

    def __init__(self) -> None:
        self.results: dict[int, stream_pb2.CommandResult] = {}
        self._answered = threading.Condition()

    def reply(self, result: stream_pb2.CommandResult) -> None:
        with self._answered:
            self.results[result.id] = result
            self._answered.notify_all()

    def wait_for(self, ids: set[int]) -> None:
        with self._answered:
            assert self._answered.wait_for(lambda: ids <= self.results.keys(), timeout=10), \
                sorted(self.results)


def test_remediations_run_one_at_a_time_on_their_own_worker() -> None:
    """A kill waiting out its grace holds one worker: CRI calls still get answered on the pool, a
    second remediation waits its turn, and past the bound one is answered failed at once."""
    runner = CommandRunner(None, "n1", workers=1, max_remediations=2)
    release = threading.Event()
    running: list[str] = []
    most = [0]
    lock = threading.Lock()

    def act(c: stream_pb2.RemediateCommand) -> stream_pb2.RemediateResult:
        with lock:
            running.append(c.incident)
            most[0] = max(most[0], len(running))
        release.wait(10)
        with lock:
            running.remove(c.incident)
        return stream_pb2.RemediateResult(incident=c.incident, outcome=DONE, reason="gone")

    runner.remediate_handler = act
    answers = Answers()
    results, reply, wait_for = answers.results, answers.reply, answers.wait_for

    try:
        for i in (1, 2, 3):
            runner.submit(stream_pb2.Command(id=i, remediate=stream_pb2.RemediateCommand(incident=f"f{i}/x")),
                          reply)
        wait_for({3})  # past the bound: answered at once, in kind
        third = results[3].remediate
        assert (third.outcome, third.incident) == (SKIPPED, "f3/x")
        assert third.not_started and not third.exited
        assert third.reason == "2 remediations wait on the tracer on n1; nothing signalled; retry"
        runner.submit(stream_pb2.Command(id=4, cri=stream_pb2.CriRequest(method="Version")), reply)
        wait_for({4})  # the pool's one worker is free while the kill waits
        assert results[4].WhichOneof("body") == "cri" and 1 not in results and 2 not in results
        release.set()
        wait_for({1, 2})
        assert [results[i].remediate.outcome for i in (1, 2)] == [DONE, DONE]
        assert most[0] == 1 and runner.remediations == 0
    finally:
        release.set()
        runner.close()


def test_an_act_past_its_deadline_is_not_started_and_dry_runs_do_not_wait_behind_it() -> None:
    """A kill queued behind another's grace that the worker reaches after its deadline_ms is answered
    skipped, not_started, never handed to the act; a dry-run re-check sent meanwhile is answered on the
    pool at once."""
    runner = CommandRunner(None, "n1", workers=1)
    release = threading.Event()
    acted: list[str] = []

    def act(c: stream_pb2.RemediateCommand) -> stream_pb2.RemediateResult:
        acted.append(c.incident)
        if c.dry_run:
            return stream_pb2.RemediateResult(incident=c.incident, outcome=PROPOSED, reason="would")
        release.wait(10)
        return stream_pb2.RemediateResult(incident=c.incident, outcome=DONE, reason="gone", exited=True)

    runner.remediate_handler = act
    answers = Answers()
    results, reply, wait_for = answers.results, answers.reply, answers.wait_for

    try:
        runner.submit(stream_pb2.Command(id=1, remediate=stream_pb2.RemediateCommand(incident="f1/x")), reply)
        runner.submit(stream_pb2.Command(id=2, remediate=stream_pb2.RemediateCommand(
            incident="f2/x", deadline_ms=1)), reply)
        submitted_s = time.monotonic()
        runner.submit(stream_pb2.Command(id=3, remediate=stream_pb2.RemediateCommand(
            incident="f3/x", dry_run=True)), reply)
        wait_for({3})
        assert results[3].remediate.outcome == PROPOSED and 1 not in results
        # f2's 1 ms is past before the worker frees (a poll with a deadline, not a sleep)
        wait_until(lambda: time.monotonic() > submitted_s + 0.005, "f2's deadline to pass")
        release.set()
        wait_for({1, 2})
        late = results[2].remediate
        assert (late.outcome, late.not_started, late.exited) == (SKIPPED, True, False)
        assert "arrived after its deadline" in late.reason and "nothing signalled" in late.reason
        assert acted == ["f1/x", "f3/x"]
    finally:
        release.set()
        runner.close()


# --- the flag and the capability ------------------------------------------------------------------

def test_remediation_flag_from_env_and_its_check() -> None:
    assert load_config(env={}).remediation == "on"
    assert load_config(env={"GHOSTGPU_REMEDIATION": "off", "NODE_NAME": "n1"}).remediation == "off"
    with pytest.raises(ConfigError, match="remediation"):
        load_config(env={"GHOSTGPU_REMEDIATION": "maybe"})


def test_cap_kill_note(tmp_path: object) -> None:
    from pathlib import Path
    base = Path(str(tmp_path))
    with_kill, without = base / "with", base / "without"
    with_kill.write_text("Name:\tx\nCapEff:\t0000000000000020\n")
    without.write_text("Name:\tx\nCapEff:\t0000000000000000\n")
    assert has_effective("CAP_KILL", str(with_kill)) is True
    assert cap_kill_note(str(with_kill)) is None
    note = cap_kill_note(str(without))
    assert note is not None and "CAP_KILL" in note and "securityContext.capabilities.add" in note
    assert cap_kill_note(str(base / "missing")) is None


def test_the_node_builds_its_remediator_from_the_flag() -> None:
    from ghostgpu.tracer.node import build_remediator

    assert build_remediator(load_config(env={"NODE_NAME": "n1"}), None).enabled
    off = build_remediator(load_config(env={"NODE_NAME": "n1", "GHOSTGPU_REMEDIATION": "off"}), None)
    assert not off.enabled


def test_another_pid_namespace_never_acts(child: subprocess.Popen[bytes], tmp_path: object) -> None:
    """A /proc of another PID namespace (a pod without hostPID): its PIDs are not the pidfd's."""
    import os
    from pathlib import Path
    root = Path(str(tmp_path))
    os.symlink("999999", root / "self")
    proc = ScriptedProc(SEEN, {"/dev/nvidia0"})
    proc.proc_root = str(root)
    result = remediator(proc, send=lambda fd, sig: pytest.fail("signalled")).handle(command(child.pid))
    assert result.outcome == FAILED and "hostPID: true" in result.reason
    assert child.poll() is None
