"""The tracer's act of remediation (tracer/remediate.py): the pure decisions as tables, the order of
the re-checks with a scripted /proc view and CRI, and CommandRunner's one answer per command.

The signal path here runs against a real child process of the test (same uid: no root needed); the
fake containers, CRI and a real stream are in tests/integration/test_remediate_processes.py.
"""

from __future__ import annotations

import signal
import subprocess
import threading
from collections.abc import Iterator

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
    unkillable_reason,
)

from ghostgpu.common.model.remediation import DONE, FAILED, PROPOSED, SKIPPED, UNKILLABLE
from ghostgpu.common.system.configfile import ConfigError
from ghostgpu.k8s import cri_runtime_v1_pb2 as cri
from ghostgpu.v1 import node_pb2, stream_pb2

NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
CID = "c0ffee" + "1" * 58
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
        assert problem is not None and problem[0] == outcome and words in problem[1]


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
    (0, "", cri.CONTAINER_UNKNOWN, None),
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
    """A /proc view whose answers a test sets; the act around it is the real one."""

    def __init__(self, seen: Seen | None, held: set[str], after: Seen | None = None) -> None:
        super().__init__("/proc", DeviceCatalog(("/dev/nvidia",), "/proc"))
        self.seen, self.held_paths, self.after = seen, held, after
        self.looks = self.holds = 0
        self.held_after: set[str] = set()  # what the confirm's look finds held (nothing: released)
        self.stuck_view = Stuck(state="D", wchan="uvm_wait", tids=[7, 8])

    def look(self, pid: int) -> Seen | None:
        self.looks += 1
        # the look after pidfd_open is the second one: a reuse in between shows there
        return self.after if self.looks >= 2 and self.after is not None else self.seen

    def held(self, pid: int) -> set[str]:
        self.holds += 1
        return set(self.held_paths if self.holds == 1 else self.held_after)

    def stuck(self, pid: int) -> Stuck:
        return self.stuck_view


class FakeRelay:
    def __init__(self, code: int = NOT_FOUND, state: int | None = None) -> None:
        self.code, self.state, self.calls = code, state, 0

    def call(self, method: str, request: bytes, timeout_ms: int = 0) -> stream_pb2.CriResponse:
        self.calls += 1
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
    return stream_pb2.RemediateCommand(
        process=node_pb2.Process(pid=pid, start_time_ns=START_NS, exe="/usr/bin/sleep", comm="sleep"),
        **fields)  # type: ignore[arg-type]


def remediator(proc: ProcView, relay: FakeRelay | None = None, **kw: object) -> Remediator:
    return Remediator("node-a", proc.catalog, relay if relay is not None else FakeRelay(),  # type: ignore[arg-type]
                      proc=proc, **kw)  # type: ignore[arg-type]


SEEN = Seen(START_NS, "/usr/bin/sleep", CID)


@pytest.mark.parametrize(("proc", "relay", "cmd", "outcome", "words"), [
    (ScriptedProc(None, set()), FakeRelay(), {}, SKIPPED, "already exited"),
    (ScriptedProc(Seen(START_NS + 1, "/usr/bin/sleep", CID), {"/dev/nvidia0"}), FakeRelay(), {}, SKIPPED,
     "was reused: start time"),
    (ScriptedProc(Seen(START_NS, "/usr/bin/sleep", "beef" * 16), {"/dev/nvidia0"}), FakeRelay(), {}, SKIPPED,
     "was reused: container beefbeefbeef, decided c0ffee111111"),
    (ScriptedProc(SEEN, {"/dev/nvidia0"}), FakeRelay(0, cri.CONTAINER_RUNNING), {}, SKIPPED,
     "is running again (CRI)"),
    (ScriptedProc(SEEN, {"/dev/nvidia0"}), FakeRelay(UNAVAILABLE), {}, SKIPPED, "cannot confirm with CRI"),
    (ScriptedProc(SEEN, {"/dev/nvidiactl"}), FakeRelay(), {}, SKIPPED, "no longer holds a GPU device"),
    (ScriptedProc(SEEN, set()), FakeRelay(), {"devices": []}, SKIPPED, "no longer holds a GPU device"),
    (ScriptedProc(SEEN, {"/dev/nvidiactl"}), FakeRelay(), {"devices": [], "dry_run": True}, PROPOSED,
     "dry run: would send SIGTERM to pid {pid} (sleep, /usr/bin/sleep), SIGKILL after 2 s"),
    (ScriptedProc(SEEN, {"/dev/nvidia0"}), FakeRelay(0, cri.CONTAINER_EXITED), {"dry_run": True}, PROPOSED,
     "dry run"),
    (ScriptedProc(SEEN, {"/dev/nvidia0"}), FakeRelay(), {"grace_ms": 3_600_000, "dry_run": True}, PROPOSED,
     "SIGKILL after 60 s"),  # the grace is capped
    (ScriptedProc(SEEN, {"/dev/nvidia0"}, after=Seen(START_NS + 1, "/usr/bin/sleep", CID)), FakeRelay(), {},
     SKIPPED, "was reused"),  # reused between the checks and pidfd_open: nothing is signalled
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


def test_no_container_id_needs_no_cri(child: subprocess.Popen[bytes]) -> None:
    relay = FakeRelay(UNAVAILABLE)
    proc = ScriptedProc(SEEN, {"/dev/nvidia0"})
    result = remediator(proc, relay).handle(command(child.pid, container_id="", dry_run=True))
    assert result.outcome == PROPOSED and relay.calls == 0


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
    assert result.outcome == DONE and result.released and not result.signals


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


def test_a_busy_runner_answers_remediate_in_kind() -> None:
    runner = CommandRunner(None, "n1", workers=1, max_queued=0)
    results = _run(runner, stream_pb2.Command(id=5, remediate=stream_pb2.RemediateCommand(incident="f4/x")))
    assert results[0].remediate.outcome == FAILED and "nothing signalled" in results[0].remediate.reason


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
