"""The tracer's side of remediation (docs/REMEDIATION.md): re-check one orphaned GPU holder at the
moment of acting, then signal it through a pidfd and confirm the device was released.

The collector decides; the node acts, because only the node can re-check what the decision rests on
in the instant before the signal: the process is the one decided on (its identity, below), it is in
the Kubernetes pod decided on and in a container of the runtime this node's CRI speaks for, CRI
still reports no running container for it, and it still holds a GPU device. Any re-check that
fails, or cannot be made, signals nothing ("skipped"): the tracer never acts without corroboration,
so a host process (no container) or a container CRI cannot vouch for (docker or podman run beside
the kubelet: CRI answers NOT_FOUND for it, which must not read as "gone") is never signalled.

The pidfd (pidfd_open, Linux 5.3; pidfd_send_signal, 5.1) is opened first: from then on it names the
one process that had the PID at that instant, and a signal through it can reach no other. The
re-checks follow (identity, CRI, the device hold), then the identity once more: a process reaped and
replaced at the PID meanwhile shows there, so the /proc reads in between were of the pinned process
and nothing sits between the last check and the signal but the pidfd. The identity is the PID, its
start time (clock ticks since boot, as every Process record carries it), its container and pod (the
cgroup an orphan stays in) and its exe. SIGTERM, then SIGKILL after the grace period; the pidfd turns
readable once the whole thread group has exited (a zombie leader whose threads still run stays
unreadable), which is the confirmation. A holder still alive after SIGKILL and a fixed wait is
`unkillable`: its state letter, wchan, kernel stack (where readable) and live threads go back to the
collector, which may escalate.

Pure parts (identity_problem, cri_problem, runtime_problem, unkillable_reason, live_tids_of) take
observations and return the decision; `ProcView` is the one reader of /proc here (a seam tests
replace), built on the tracer's own parsers (tracer/procfs.py, tracer/cgroup.py) and holder scanner,
so a hold is what the scanner calls one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import grpc
from ghostgpu.tracer.capabilities import has_effective
from ghostgpu.tracer.cgroup import parse_proc_cgroup
from ghostgpu.tracer.cri_relay import CriRelay
from ghostgpu.tracer.devices import DeviceCatalog
from ghostgpu.tracer.procfs import ProcScanner, parse_stat, read_bytes, ticks_to_boot_ns

from ghostgpu.common.model.remediation import (
    CRI_TIMEOUT_S,
    DONE,
    FAILED,
    KILL_WAIT_S,
    MAX_GRACE_S,
    PROPOSED,
    SKIPPED,
    UNKILLABLE,
)
from ghostgpu.k8s import cri_runtime_v1_pb2 as cri
from ghostgpu.v1 import stream_pb2

log = logging.getLogger("ghostgpu.remediate")

CRI_TIMEOUT_MS = int(CRI_TIMEOUT_S * 1000)
_DELETED = " (deleted)"
_GONE_STATES = ("Z", "X")  # a task in one of these runs nothing and holds nothing
STACK_MAX_BYTES = 4096  # the kernel stack goes back in the result: enough for any real one


def id12(container_id: str) -> str:
    return container_id[:12]


def _exe_path(exe: str) -> str:
    """The executable as a path: a binary replaced or removed since reads " (deleted)" in readlink."""
    return exe.removesuffix(_DELETED)


@dataclass(frozen=True)
class Seen:
    """One look at /proc/PID: its start time (ns since boot, as Process.start_time_ns) and exe
    ("" when unreadable: a kernel thread, or no ptrace access)."""

    start_time_ns: int
    exe: str
    # From /proc/PID/cgroup, as the tracer reads it (tracer/cgroup.py): "" on the host, outside a pod,
    # or where the cgroup does not say (a bare id under a cgroupfs pod: containerd and cri-dockerd alike).
    container_id: str = ""
    pod_uid: str = ""
    runtime: str = ""


@dataclass
class Stuck:
    """What /proc says about a process that outlived SIGKILL."""

    state: str = ""
    wchan: str = ""
    stack: str = ""
    tids: list[int] = field(default_factory=list)


class Problem(NamedTuple):
    """A re-check that failed: the outcome, its reason, and whether the process decided on is gone."""

    outcome: str
    reason: str
    exited: bool = False


def identity_problem(pid: int, want_start_ns: int, want_exe: str, seen: Seen | None,
                     want_container: str = "", want_pod: str = "") -> Problem | None:
    """Why /proc/PID is not the process decided on (`exited` when that process is gone: no PID, or
    the PID names another process), else None.

    The start time is in clock ticks (/proc/PID/stat field 22: 10 ms at USER_HZ 100), so a PID reused
    within the same tick keeps it; the container and pod (an orphan stays in its container's cgroup)
    and the exe are checked as well."""
    if seen is None:
        return Problem(SKIPPED, f"pid {pid} already exited", exited=True)
    if want_start_ns <= 0:
        return Problem(SKIPPED, f"pid {pid}: the decision carries no start time, so its identity cannot be "
                                f"re-checked")
    if seen.start_time_ns != want_start_ns:
        return Problem(SKIPPED, f"pid {pid} was reused: start time {seen.start_time_ns} ns, decided "
                                f"{want_start_ns} ns (since boot)", exited=True)
    if want_exe:
        if not seen.exe:
            return Problem(SKIPPED, f"pid {pid}: its exe cannot be read to compare with {want_exe!r}")
        if _exe_path(seen.exe) != _exe_path(want_exe):
            return Problem(SKIPPED, f"pid {pid} was reused: exe {seen.exe!r}, decided {want_exe!r}",
                           exited=True)
    if want_container and seen.container_id != want_container:
        now = id12(seen.container_id) if seen.container_id else "none"
        return Problem(SKIPPED, f"pid {pid} was reused: container {now}, decided {id12(want_container)}",
                       exited=True)
    if want_pod and not seen.pod_uid:
        # Same start time, exe and container: the very process, in a container no kubelet made.
        runtime = f"a {seen.runtime} container" if seen.runtime else "its cgroup"
        return Problem(SKIPPED, f"pid {pid} is in no Kubernetes pod ({runtime} names none; decided pod "
                                f"{want_pod}): nothing signalled outside a pod")
    if want_pod and seen.pod_uid != want_pod:
        return Problem(SKIPPED, f"pid {pid} was reused: pod {seen.pod_uid}, decided {want_pod}", exited=True)
    return None


# The runtime a cgroup names (tracer/cgroup.py) -> the runtime_name CRI's Version answers for it.
# cri-dockerd answers "docker"; podman speaks no CRI, so a podman container is never confirmed.
CRI_RUNTIME_NAMES: dict[str, str] = {
    "containerd": "containerd",
    "crio": "cri-o",
    "crio-conmon": "cri-o",
    "docker": "docker",
}


def runtime_problem(cgroup_runtime: str, cri_runtime: str) -> str | None:
    """Why CRI cannot vouch for a container of `cgroup_runtime` when its Version says `cri_runtime`
    (a skip reason), else None. An unnamed cgroup runtime ("": a bare id under a cgroupfs pod) passes:
    the pod UID in its cgroup stands for it."""
    if not cgroup_runtime or CRI_RUNTIME_NAMES.get(cgroup_runtime) == cri_runtime:
        return None
    return f"cannot confirm: {cgroup_runtime} container, CRI speaks for {cri_runtime or 'an unnamed runtime'}"


def cri_problem(container_id: str, code: int, message: str, state: int | None) -> str | None:
    """Why CRI's answer about `container_id` forbids acting (a skip reason), else None.
    `state` is ContainerStatus's state when `code` is OK (None when the answer would not parse)."""
    if code == grpc.StatusCode.NOT_FOUND.value[0]:
        return None  # unknown to the runtime: gone
    cannot = f"cannot confirm with CRI that container {id12(container_id)} is gone"
    if code != 0:
        return f"{cannot}: {message or f'code {code}'}"
    if state is None:
        return f"{cannot}: its answer did not parse"
    if state == cri.CONTAINER_RUNNING:
        return f"container {id12(container_id)} is running again (CRI)"
    if state == cri.CONTAINER_UNKNOWN:
        # containerd (1.7, 2.0) answers UNKNOWN while it cannot reach the container's shim: the
        # container may well run, so this is no word that it is gone.
        return f"{cannot}: CRI reports its state UNKNOWN (the runtime cannot reach it)"
    return None  # CREATED, EXITED: nothing of it runs


def live_tids_of(task_stats: dict[int, str]) -> list[int]:
    """The threads still running, from each /proc/PID/task/TID/stat text ("" once gone)."""
    live = []
    for tid, text in sorted(task_stats.items()):
        stat = parse_stat(text)
        if stat is not None and stat.state not in _GONE_STATES:
            live.append(tid)
    return live


def unkillable_reason(pid: int, stuck: Stuck) -> str:
    wchan = stuck.wchan or "unknown"
    where = " (stuck in the driver?)" if stuck.state == "D" else ""
    threads = f", {len(stuck.tids)} thread(s) alive" if stuck.tids else ""
    return f"pid {pid} did not exit after SIGKILL: state {stuck.state or '?'}, wchan {wchan}{threads}{where}"


class ProcView:
    """The /proc reads of one act; every read tolerates the process or its fds vanishing."""

    def __init__(self, proc_root: str, catalog: DeviceCatalog) -> None:
        self.proc_root, self.catalog = proc_root, catalog

    def _text(self, path: str) -> str:
        data = read_bytes(f"{self.proc_root}/{path}")
        return "" if data is None else data.decode("utf-8", "replace")

    def stat_text(self, pid: int) -> str:
        return self._text(f"{pid}/stat")

    def look(self, pid: int) -> Seen | None:
        """Start time and exe of pid, None once it is gone (reaped)."""
        stat = parse_stat(self.stat_text(pid))
        if stat is None:
            return None
        ident = parse_proc_cgroup(self._text(f"{pid}/cgroup"))
        return Seen(ticks_to_boot_ns(stat.start_ticks), self._exe(pid), ident.container_id, ident.pod_uid,
                    ident.runtime)

    def _exe(self, pid: int) -> str:
        # A zombie leader has dropped its mm, so its own exe link fails (ENOENT); a live thread
        # shares the group's mm and still answers.
        with contextlib.suppress(OSError):
            return os.readlink(f"{self.proc_root}/{pid}/exe")
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"{self.proc_root}/{pid}/task"):
                with contextlib.suppress(OSError):
                    return os.readlink(f"{self.proc_root}/{pid}/task/{tid}/exe")
        return ""

    def held(self, pid: int) -> set[str]:
        """The GPU device paths pid holds (fds, mappings, a zombie leader's threads' fds), as the
        tracer's scanner finds them. One scanner per call: it keeps per-process state while scanning,
        and a scanner's state is not shared with the node's own scans."""
        scanner = ProcScanner(self.catalog, self.proc_root, workers=1, stat_outside_dev_every=0)
        return {path for path, hold in scanner.scan_pid(pid).items() if hold.held}

    def stuck(self, pid: int) -> Stuck:
        stat = parse_stat(self.stat_text(pid))
        stack = self._text(f"{pid}/stack")  # EACCES without CAP_SYS_ADMIN, ENOENT without the config
        tasks: dict[int, str] = {}
        with contextlib.suppress(OSError):
            for name in os.listdir(f"{self.proc_root}/{pid}/task"):
                if name.isdigit():
                    tasks[int(name)] = self._text(f"{pid}/task/{name}/stat")
        wchan = self._text(f"{pid}/wchan").strip()
        return Stuck(state=stat.state if stat else "", wchan="" if wchan == "0" else wchan,
                     stack=stack[:STACK_MAX_BYTES], tids=live_tids_of(tasks))


def wait_exit(pidfd: int, timeout_s: float) -> bool:
    """Whether the thread group behind pidfd has exited within timeout_s (the pidfd is readable)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    deadline = time.monotonic() + timeout_s
    while True:
        left_ms = max(0, int((deadline - time.monotonic()) * 1000))
        try:
            if poller.poll(left_ms):
                return True
        except InterruptedError:  # PEP 475 retries, but keep the deadline ours
            pass
        if time.monotonic() >= deadline:
            return False


SignalSender = Callable[[int, int], None]  # (pidfd, signal number)


def _send(pidfd: int, signum: int) -> None:
    signal.pidfd_send_signal(pidfd, signum)


class Remediator:
    """Answers RemediateCommands (CommandRunner's body "remediate"): never raises, one result each.

    `enabled` False is `--remediation off`: every command is answered skipped. `proc` and `send` are
    the seams tests replace (the /proc view; the signal); `kill_wait_s` bounds the wait after SIGKILL.
    """

    def __init__(self, node: str, catalog: DeviceCatalog, relay: CriRelay | None, *, enabled: bool = True,
                 proc_root: str = "/proc", proc: ProcView | None = None, send: SignalSender = _send,
                 kill_wait_s: float = KILL_WAIT_S, max_grace_s: float = MAX_GRACE_S) -> None:
        self.node, self.relay, self.enabled = node, relay, enabled
        self.proc = proc or ProcView(proc_root, catalog)
        self.send, self.kill_wait_s, self.max_grace_s = send, kill_wait_s, max_grace_s

    def handle(self, command: stream_pb2.RemediateCommand) -> stream_pb2.RemediateResult:
        started_s = time.monotonic()
        try:
            result = self._act(command)
        except Exception as exc:  # one bad act must not kill the command worker, nor go unanswered
            log.exception("remediation %s of pid %d failed", command.incident, command.process.pid)
            reason = f"pid {command.process.pid}: unexpected {type(exc).__name__}: {exc}".replace("\n", " ")
            result = stream_pb2.RemediateResult(outcome=FAILED, reason=reason)
        result.incident = command.incident
        result.elapsed_ms = int((time.monotonic() - started_s) * 1000)
        log.warning("remediation %s: pid %d %s: %s", command.incident, command.process.pid, result.outcome,
                    result.reason)
        return result

    def _act(self, command: stream_pb2.RemediateCommand) -> stream_pb2.RemediateResult:
        pid = command.process.pid
        if not self.enabled:
            return _result(SKIPPED, f"node {self.node} opted out (tracer --remediation off)")
        if pid <= 1:
            return _result(SKIPPED, f"pid {pid} is never signalled")
        if not command.container_id:
            # A host program whose leader is a zombie reads orphaned, yet may be healthy: without a
            # container CRI can say is gone, nothing corroborates the decision.
            return _result(SKIPPED, f"pid {pid}: no container for CRI to corroborate; a host process is "
                                    f"never signalled")
        if not command.process.pod_uid:
            return _result(SKIPPED, f"pid {pid}: no pod to corroborate; only a container of a Kubernetes pod "
                                    f"is signalled")
        if self.relay is None:
            return _result(SKIPPED, f"cannot confirm with CRI that container {id12(command.container_id)} is "
                                    f"gone: the tracer on {self.node} runs no CRI relay")
        if where := self._namespace_problem():
            return _result(FAILED, where)
        # The pidfd first: it names the process that has the PID now, and no other, until it is closed.
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return _result(SKIPPED, f"pid {pid} already exited", exited=True)
        except OSError as exc:  # EINVAL: a thread id, not a process
            return _result(FAILED, f"pid {pid}: pidfd_open failed: {exc.strerror or exc}; nothing signalled")
        try:
            return self._recheck_and_signal(command, pidfd)
        finally:
            os.close(pidfd)

    def _recheck_and_signal(self, command: stream_pb2.RemediateCommand,
                            pidfd: int) -> stream_pb2.RemediateResult:
        pid = command.process.pid
        # a. identity: the pinned process is the one decided on, in the pod decided on
        seen = self.proc.look(pid)
        if problem := self._identity(command, seen):
            return _problem(problem)
        assert seen is not None  # identity_problem returns a Problem for None
        # b. liveness: CRI speaks for its runtime and corroborates that its container is gone
        if why := self._cri(command.container_id, seen.runtime):
            return _result(SKIPPED, why)
        # c. it still holds a GPU device
        if not self._holds(pid, command.devices):
            return _result(SKIPPED, f"pid {pid} no longer holds a GPU device")
        # d. identity once more: had the pinned process been reaped and the PID taken since (a), the
        # reads of b and c could be of the newcomer; the same identity now means they were not.
        if problem := self._identity(command, self.proc.look(pid)):
            return _problem(problem)
        grace_s = min(command.grace_ms / 1000, self.max_grace_s)
        if command.dry_run:
            return _result(PROPOSED, f"dry run: would send SIGTERM to pid {pid} ({self._describe(command)}), "
                                     f"SIGKILL after {grace_s:g} s")
        return self._signal(command, pidfd, grace_s)

    def _namespace_problem(self) -> str | None:
        """A pidfd names a PID of the tracer's own PID namespace, the checks read PIDs of proc_root's:
        they must be one (the DaemonSet's hostPID), or the checks would vouch for another process."""
        root = self.proc.proc_root
        try:
            own = int(os.readlink(f"{root}/self"))  # this process's PID in the namespace root shows
        except (OSError, ValueError):
            return f"cannot read {root}/self to check that {root} is this tracer's PID namespace"
        if own != os.getpid():
            return (f"{root} shows another PID namespace than the tracer's own (pid {own} there, "
                    f"{os.getpid()} here); run the tracer with hostPID: true to remediate on {self.node}")
        return None

    @staticmethod
    def _identity(command: stream_pb2.RemediateCommand, seen: Seen | None) -> Problem | None:
        p = command.process
        return identity_problem(p.pid, p.start_time_ns, p.exe, seen, command.container_id, p.pod_uid)

    def _cri(self, container_id: str, cgroup_runtime: str) -> str | None:
        """Why CRI does not corroborate that `container_id` is gone, else None. NOT_FOUND is CRI's word
        only for a container of the runtime it speaks for: first its Version says which that is."""
        assert self.relay is not None  # _act answers a tracer without a relay
        if cgroup_runtime:
            cannot = f"cannot confirm with CRI that container {id12(container_id)} is gone"
            answer = self.relay.call("Version", cri.VersionRequest().SerializeToString(), CRI_TIMEOUT_MS)
            if answer.code != 0:
                return (f"{cannot}: its Version (which runtime it speaks for) failed: "
                        f"{answer.message or f'code {answer.code}'}")
            try:
                runtime_name = cri.VersionResponse.FromString(answer.response).runtime_name
            except Exception:  # a malformed answer: no word on the runtime
                return f"{cannot}: its Version answer did not parse"
            if why := runtime_problem(cgroup_runtime, runtime_name):
                return why
        request = cri.ContainerStatusRequest(container_id=container_id).SerializeToString()
        answer = self.relay.call("ContainerStatus", request, CRI_TIMEOUT_MS)
        state: int | None = None
        if answer.code == 0:
            with contextlib.suppress(Exception):  # a malformed answer is "cannot confirm", below
                state = cri.ContainerStatusResponse.FromString(answer.response).status.state
        return cri_problem(container_id, answer.code, answer.message, state)

    def _holds(self, pid: int, devices: Iterable[str]) -> bool:
        held = self.proc.held(pid)
        wanted = set(devices)
        return bool(held & wanted) if wanted else bool(held)

    def _describe(self, command: stream_pb2.RemediateCommand) -> str:
        p = command.process
        return ", ".join(part for part in (p.comm, p.exe) if part) or "?"

    def _signal(self, command: stream_pb2.RemediateCommand, pidfd: int,
                grace_s: float) -> stream_pb2.RemediateResult:
        """e. SIGTERM, then SIGKILL, through the pidfd the re-checks ran under."""
        pid = command.process.pid
        signals: list[str] = []
        gone = False
        for signum, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, self.kill_wait_s)):
            try:
                self.send(pidfd, signum)
            except ProcessLookupError:  # ESRCH: it exited on its own, just now
                gone = True
                break
            except PermissionError:
                uid = _uid_of(self.proc, pid)
                return _result(FAILED, f"the tracer lacks CAP_KILL to signal pid {pid} (uid {uid})",
                               signals=signals)
            signals.append(signum.name)
            if wait_exit(pidfd, wait_s):
                gone = True
                break
        if not gone:
            stuck = self.proc.stuck(pid)
            return _result(UNKILLABLE, unkillable_reason(pid, stuck), signals=signals,
                           proc_state=stuck.state, wchan=stuck.wchan, stack=stuck.stack,
                           stuck_tids=stuck.tids)
        return self._confirm(command, signals)

    def _confirm(self, command: stream_pb2.RemediateCommand,
                 signals: list[str]) -> stream_pb2.RemediateResult:
        """f. It has exited: unless /proc still shows that very process holding a device, it is released."""
        pid = command.process.pid
        seen = self.proc.look(pid)
        same = seen is not None and seen.start_time_ns == command.process.start_time_ns
        if same and (held := self.proc.held(pid)):
            return _result(FAILED, f"pid {pid} exited but still holds {', '.join(sorted(held))}",
                           signals=signals)
        sent = " then ".join(signals) or "no signal (it exited first)"
        return _result(DONE, f"pid {pid} exited after {sent}; its GPU devices are released", signals=signals,
                       released=True, exited=True)


def _uid_of(proc: ProcView, pid: int) -> str:
    with contextlib.suppress(OSError):
        return str(os.stat(f"{proc.proc_root}/{pid}").st_uid)
    return "?"


def _result(outcome: str, reason: str, **fields: object) -> stream_pb2.RemediateResult:
    return stream_pb2.RemediateResult(outcome=outcome, reason=reason, **fields)  # type: ignore[arg-type]


def _problem(problem: Problem) -> stream_pb2.RemediateResult:
    return _result(problem.outcome, problem.reason, exited=problem.exited)


def cap_kill_note(status_path: str = "/proc/self/status") -> str | None:
    """One line for the tracer's start when remediation is on but CAP_KILL is not effective; else None."""
    if has_effective("CAP_KILL", status_path) is not False:
        return None
    return ("remediation is on but CAP_KILL is not effective: orphaned GPU holders of other uids can be "
            "reported here but not signalled; add KILL to the tracer container's "
            "securityContext.capabilities.add in the DaemonSet (or run with --remediation off)")
