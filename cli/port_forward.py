"""A `kubectl port-forward` to the collector's Service, as a child process: `kubectl ghostgpu`'s way to a
collector inside a cluster when no --collector is given (cli/kubectl_plugin.py).

The pieces are apart so each can be tested without an API server:
- `port_forward_command` builds the command line (pure);
- `parse_forwarding` reads kubectl's ready line, "Forwarding from 127.0.0.1:PORT -> 7450" (pure);
- `PortForward` runs the child, waits for the ready line with a deadline, and stops the child on exit.
  The local port is kubectl's choice (`:REMOTE`, kubectl 1.32's "listen on a random port locally"), read
  from its ready line: kubectl binds port 0 itself and keeps it, so no other process can take the port
  between its choice and the listen, as it could if this process picked one and closed it first.

The child runs in its own process group, so that a Ctrl-C in the terminal reaches this process only,
which stops the group itself (SIGTERM, SIGKILL after STOP_TIMEOUT_S): kubectl's credential helpers
(an exec plugin such as gke-gcloud-auth-plugin) go with it. On Linux the child also gets SIGTERM from
the kernel when this process dies without cleaning up (SIGKILL): PR_SET_PDEATHSIG.

kubectl's stdin is /dev/null: without a kubeconfig kubectl 1.32 asks for a user name on it. Its stdout
is read to the end by a thread (after the ready line it writes "Handling connection for PORT" per
connection, which must not fill the pipe); its stderr goes to a temporary file, whose last line is the
error a failed start shows.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import IO

READY_TIMEOUT_S = 30.0  # kubectl asks the API server for the Service and a pod, maybe through an auth plugin
STOP_TIMEOUT_S = 5.0  # SIGTERM, then SIGKILL
LISTEN_HOST = "127.0.0.1"
_FORWARDING = re.compile(r"^Forwarding from (127\.0\.0\.1|\[::1\]):(\d{1,5}) -> (\d{1,5})\s*$")
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class PortForwardError(Exception):
    """The port-forward did not start: one line, kubectl's own reason in it."""


@dataclass(frozen=True)
class ForwardTarget:
    """What to forward to: the chart's collector Service, and the kubeconfig to reach it with."""

    namespace: str = "ghostgpu"
    service: str = "ghostgpu-collector"
    remote_port: int = 7450
    context: str | None = None
    kubeconfig: str | None = None

    @property
    def server_name(self) -> str:
        """The name the chart's collector certificate carries: SERVICE.NAMESPACE.svc."""
        return f"{self.service}.{self.namespace}.svc"

    def describe(self) -> str:
        return f"service/{self.service} in namespace {self.namespace}"


def port_forward_command(kubectl: str, target: ForwardTarget, local_port: int | None = None) -> list[str]:
    """kubectl port-forward on 127.0.0.1:LOCAL_PORT to the Service's port (kubectl picks one of its pods);
    without local_port, kubectl picks a free local port and says which on its ready line."""
    cmd = [kubectl, "port-forward"]
    if target.kubeconfig:
        cmd += ["--kubeconfig", target.kubeconfig]
    if target.context:
        cmd += ["--context", target.context]
    return [*cmd, "--namespace", target.namespace, "--address", LISTEN_HOST,
            f"service/{target.service}", f"{local_port or ''}:{target.remote_port}"]


def parse_forwarding(line: str) -> tuple[str, int, int] | None:
    """(host, local port, remote port) of kubectl's "Forwarding from HOST:PORT -> PORT", else None."""
    m = _FORWARDING.match(line.strip("\r\n"))
    if m is None:
        return None
    local, remote = int(m.group(2)), int(m.group(3))
    if not (0 < local < 65536 and 0 < remote < 65536):
        return None
    return m.group(1).strip("[]"), local, remote


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the parent dies, even by SIGKILL."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


class PortForward:
    """`with PortForward(kubectl, target) as pf:` dial pf.address; the child is stopped on leaving."""

    def __init__(self, kubectl: str, target: ForwardTarget, *, ready_timeout_s: float = READY_TIMEOUT_S,
                 stop_timeout_s: float = STOP_TIMEOUT_S, local_port: int | None = None) -> None:
        self.kubectl, self.target = kubectl, target
        self.ready_timeout_s, self.stop_timeout_s = ready_timeout_s, stop_timeout_s
        self.local_port = local_port  # None: kubectl's choice, known from the ready line
        self.command = port_forward_command(kubectl, target, self.local_port)
        self.proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None
        self._ready = threading.Event()  # set on the ready line, or when stdout ends (the child exited)
        self._forwarded: tuple[str, int, int] | None = None
        self._reader: threading.Thread | None = None

    @property
    def address(self) -> str:
        """HOST:PORT to dial, once started."""
        if self._forwarded is None:
            raise RuntimeError("the port-forward has not started")
        return f"{self._forwarded[0]}:{self._forwarded[1]}"

    def start(self) -> PortForward:
        """Start kubectl and wait for its ready line; PortForwardError (the child stopped) when it exits
        first or says nothing within ready_timeout_s."""
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (kept open for the child's life; close())
        try:
            self.proc = subprocess.Popen(
                self.command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._stderr,
                start_new_session=True, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        except OSError as exc:
            self._close_stderr()
            raise PortForwardError(f"cannot run {self.kubectl} ({exc.strerror or exc}): install kubectl, or "
                                   "pass --collector") from None
        try:
            self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True,
                                            name="kubectl-port-forward")
            self._reader.start()
            self._ready.wait(self.ready_timeout_s)
        except BaseException:  # Ctrl-C or SIGTERM while waiting: no `with` block is there to stop it yet
            self.close()
            raise
        if self._forwarded is not None:
            return self
        exited = self.proc.poll() is not None or self._wait_exit(self.stop_timeout_s)
        status = self.proc.returncode
        self.stop()
        why = _last_line(self._stderr_text())
        self._close_stderr()
        if exited:
            raise PortForwardError(f"kubectl port-forward to {self.target.describe()} exited with status "
                                   f"{status} before forwarding: {why or 'no message'}; check --context, "
                                   "--ghostgpu-namespace and --collector-service, or pass --collector")
        raise PortForwardError(f"kubectl port-forward to {self.target.describe()} did not say 'Forwarding "
                               f"from' within {self.ready_timeout_s:g} s{': ' + why if why else ''}; "
                               "pass --collector, or port-forward yourself")

    def _wait_exit(self, timeout_s: float) -> bool:
        assert self.proc is not None
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def _read(self, stdout: IO[bytes] | None) -> None:
        if stdout is None:
            self._ready.set()
            return
        with stdout:
            for raw in stdout:  # to the end: the child's later lines must not fill the pipe
                if self._forwarded is None:
                    found = parse_forwarding(raw.decode(errors="replace"))
                    if found is not None and self.local_port in (None, found[1]):
                        self._forwarded = found
                        self.local_port = found[1]
                        self._ready.set()
        self._ready.set()

    def _stderr_text(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def _close_stderr(self) -> None:
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def stop(self) -> int | None:
        """SIGTERM to the child's process group, SIGKILL after stop_timeout_s; its exit status."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            self._signal_group(proc, signal.SIGTERM)
            if not self._wait_exit(self.stop_timeout_s):
                self._signal_group(proc, signal.SIGKILL)
                proc.wait()
        if self._reader is not None:
            self._reader.join(self.stop_timeout_s)
        return proc.returncode

    @staticmethod
    def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
        try:
            os.killpg(proc.pid, sig)  # start_new_session: its pid is its group's id
        except ProcessLookupError:
            pass
        except PermissionError:
            proc.send_signal(sig)

    def close(self) -> None:
        self.stop()
        self._close_stderr()

    def __enter__(self) -> PortForward:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def exit_on_sigterm() -> None:
    """SIGTERM as SystemExit(143), so `with` blocks and finally clauses run and the child is stopped.
    (Python's default for SIGTERM ends the process at once, past every finally; a KeyboardInterrupt
    would have `ghostgpu trace` ask on the terminal whether to stop its session.)"""
    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def kubeconfig_present(kubeconfig: str | None, env: Mapping[str, str] | None = None,
                       home: str | None = None) -> bool:
    """Whether kubectl would find a kubeconfig: --kubeconfig, a file of $KUBECONFIG (a path list), or
    ~/.kube/config."""
    env = os.environ if env is None else env
    if kubeconfig:
        return True
    listed: Sequence[str] = [p for p in env.get("KUBECONFIG", "").split(os.pathsep) if p]
    if listed:
        return any(os.path.isfile(p) for p in listed)
    home = home if home is not None else os.path.expanduser("~")
    return os.path.isfile(os.path.join(home, ".kube", "config"))
