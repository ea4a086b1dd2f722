"""The tracer's side of remediation (docs/REMEDIATION.md): re-check one orphaned GPU holder at the
moment of acting, then signal it through a pidfd and confirm the device was released.

The collector decides; the node acts, because only the node can re-check what the decision rests on
in the instant before the signal: the process is the one decided on (its identity, below), CRI still
reports no running container for it, and it still holds a GPU device. Any re-check that fails, or
cannot be made, signals nothing ("skipped"): the tracer never acts without corroboration.

The signal goes through a pidfd (pidfd_open, Linux 5.3; pidfd_send_signal, 5.1), opened after the
re-checks and followed by one more identity check: from then on the fd pins that very process, so a
PID the kernel hands to a new process between the check and the signal can never be hit. The
identity is the PID, its start time (clock ticks since boot, as every Process record carries it), its
container (the cgroup an orphan stays in) and its exe. SIGTERM, then SIGKILL after the grace period;
the pidfd turns readable once the whole thread group has exited (a zombie leader whose threads still
run stays unreadable), which is the confirmation. A holder still alive after SIGKILL and a fixed wait
is `unkillable`: its state letter, wchan, kernel stack (where readable) and live threads go back to
the collector, which may escalate.

Pure parts (identity_problem, cri_problem, unkillable_reason, live_tids_of) take observations and
return the decision; `ProcView` is the one reader of /proc here (a seam tests replace), built on the
tracer's own parsers (tracer/procfs.py) and holder scanner, so a hold is what the scanner calls one.
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

import grpc
from ghostgpu.tracer.capabilities import has_effective
from ghostgpu.tracer.cgroup import parse_proc_cgroup
from ghostgpu.tracer.cri_relay import CriRelay
from ghostgpu.tracer.devices import DeviceCatalog
from ghostgpu.tracer.procfs import ProcScanner, parse_stat, read_bytes, ticks_to_boot_ns

from ghostgpu.common.model.remediation import DONE, FAILED, PROPOSED, SKIPPED, UNKILLABLE
from ghostgpu.k8s import cri_runtime_v1_pb2 as cri
from ghostgpu.v1 import stream_pb2

log = logging.getLogger("ghostgpu.remediate")

MAX_GRACE_S = 60.0  # a longer grace_ms is cut to this: the command's worker must come back
KILL_WAIT_S = 5.0  # after SIGKILL, how long exit may take before the holder counts as unkillable
CRI_TIMEOUT_MS = 5000
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
    container_id: str = ""  # from /proc/PID/cgroup, as the tracer reads it ("" on the host)


@dataclass
class Stuck:
    """What /proc says about a process that outlived SIGKILL."""

    state: str = ""
    wchan: str = ""
    stack: str = ""
    tids: list[int] = field(default_factory=list)


def identity_problem(pid: int, want_start_ns: int, want_exe: str, seen: Seen | None,
                     want_container: str = "") -> tuple[str, str] | None:
    """(outcome, reason) when /proc/PID is not the process decided on, else None.

    The start time is in clock ticks (/proc/PID/stat field 22: 10 ms at USER_HZ 100), so a PID reused
    within the same tick keeps it; the container (an orphan stays in its container's cgroup) and the
    exe are checked as well."""
    if seen is None:
        return SKIPPED, f"pid {pid} already exited"
    if want_start_ns <= 0:
        return SKIPPED, f"pid {pid}: the decision carries no start time, so its identity cannot be re-checked"
    if seen.start_time_ns != want_start_ns:
        return SKIPPED, (f"pid {pid} was reused: start time {seen.start_time_ns} ns, decided "
                         f"{want_start_ns} ns (since boot)")
    if want_exe:
        if not seen.exe:
            return SKIPPED, f"pid {pid}: its exe cannot be read to compare with {want_exe!r}"
        if _exe_path(seen.exe) != _exe_path(want_exe):
            return SKIPPED, f"pid {pid} was reused: exe {seen.exe!r}, decided {want_exe!r}"
    if want_container and seen.container_id != want_container:
        now = id12(seen.container_id) if seen.container_id else "none"
        return SKIPPED, f"pid {pid} was reused: container {now}, decided {id12(want_container)}"
    return None


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
    return None  # CREATED, EXITED, UNKNOWN: nothing of it runs


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
        container_id = parse_proc_cgroup(self._text(f"{pid}/cgroup")).container_id
        return Seen(ticks_to_boot_ns(stat.start_ticks), self._exe(pid), container_id)

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
        and the command pool runs acts in parallel."""
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
        if where := self._namespace_problem():
            return _result(FAILED, where)
        # a. identity
        if problem := self._identity(command):
            return _result(*problem)
        # b. liveness: CRI must corroborate that the container is gone
        if command.container_id and (why := self._cri(command.container_id)):
            return _result(SKIPPED, why)
        # c. it still holds a GPU device
        if not self._holds(pid, command.devices):
            return _result(SKIPPED, f"pid {pid} no longer holds a GPU device")
        grace_s = min(command.grace_ms / 1000, self.max_grace_s)
        what = self._describe(command)
        if command.dry_run:
            return _result(PROPOSED, f"dry run: would send SIGTERM to pid {pid} ({what}), SIGKILL after "
                                     f"{grace_s:g} s")
        return self._signal(command, grace_s)

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

    def _identity(self, command: stream_pb2.RemediateCommand) -> tuple[str, str] | None:
        p = command.process
        return identity_problem(p.pid, p.start_time_ns, p.exe, self.proc.look(p.pid), command.container_id)

    def _cri(self, container_id: str) -> str | None:
        if self.relay is None:
            return (f"cannot confirm with CRI that container {id12(container_id)} is gone: the tracer "
                    f"on {self.node} runs no CRI relay")
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

    def _signal(self, command: stream_pb2.RemediateCommand, grace_s: float) -> stream_pb2.RemediateResult:
        pid = command.process.pid
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return _result(SKIPPED, f"pid {pid} already exited")
        try:
            # e. The pidfd pins whatever process had this PID when it was opened: if that is not the
            # one decided on (reused since the checks above), nothing is signalled.
            if problem := self._identity(command):
                return _result(*problem)
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
        finally:
            os.close(pidfd)

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
                       released=True)


def _uid_of(proc: ProcView, pid: int) -> str:
    with contextlib.suppress(OSError):
        return str(os.stat(f"{proc.proc_root}/{pid}").st_uid)
    return "?"


def _result(outcome: str, reason: str, **fields: object) -> stream_pb2.RemediateResult:
    return stream_pb2.RemediateResult(outcome=outcome, reason=reason, **fields)  # type: ignore[arg-type]


def cap_kill_note(status_path: str = "/proc/self/status") -> str | None:
    """One line for the tracer's start when remediation is on but CAP_KILL is not effective; else None."""
    if has_effective("CAP_KILL", status_path) is not False:
        return None
    return ("remediation is on but CAP_KILL is not effective: orphaned GPU holders of other uids can be "
            "reported here but not signalled; add KILL to the tracer container's "
            "securityContext.capabilities.add in the DaemonSet (or run with --remediation off)")
