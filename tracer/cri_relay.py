"""The CRI relay: the collector's CRI calls, forwarded to this node's runtime socket as raw bytes.

The collector sends a CriRequest down the stream; the tracer forwards the serialized runtime.v1
request to `/runtime.v1.RuntimeService/<Method>` on the node's socket and returns the serialized
answer with its gRPC status. The tracer never parses CRI, so a runtime newer than our copy of the
API passes through unchanged, and no CRI socket is ever reachable from beyond its node.

Only the five read-only methods pass (Version, ListContainers, ContainerStatus, ListPodSandbox,
PodSandboxStatus); anything else is refused with PERMISSION_DENIED before the socket is touched,
so a compromised collector cannot stop, create or exec into containers through a tracer.

`CommandRunner` answers every command of the stream on its pool: CRI calls, trace sessions
(tracer/trace_sessions.py) and remediation (tracer/remediate.py, which reads one field of a
ContainerStatus answer itself: whether the container runs, and Version's runtime name). Real acts
have a worker of its own: an act may wait out a 60 s grace, and must not hold up the CRI calls, trace
setups and dry-run re-checks behind it (those run on the pool). An act that would start later than its
deadline_ms after it arrived is answered skipped, not_started, nothing signalled: the collector's
guards were checked for a kill sent then, not whenever the worker frees.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from ghostgpu.common.model.remediation import FAILED, SKIPPED
from ghostgpu.common.transport.addresses import socket_path
from ghostgpu.common.wire import protocol
from ghostgpu.v1 import stream_pb2, trace_pb2

log = logging.getLogger("ghostgpu.cri_relay")

ALLOWED_METHODS = frozenset({"Version", "ListContainers", "ContainerStatus", "ListPodSandbox",
                             "PodSandboxStatus"})
# Probe order (docs/reference/cri-and-podresources.md §1.5): containerd, CRI-O (both spellings: /var/run is
# /run on systemd hosts, not always in a pod's mounts), k3s/RKE2's containerd, cri-dockerd.
DEFAULT_SOCKETS = (
    "/run/containerd/containerd.sock",
    "/run/crio/crio.sock",
    "/var/run/crio/crio.sock",
    "/run/k3s/containerd/containerd.sock",
    "/var/run/cri-dockerd.sock",
)
DEFAULT_TIMEOUT_S = 5.0
MAX_TIMEOUT_S = 30.0
REDETECT_INTERVAL_S = 1.0  # with no socket found, look again at most this often (a runtime starting late)
# The answer travels back inside a CommandResult on the stream, whose messages are capped at
# ghostgpu.common.wire.protocol.MAX_MESSAGE_BYTES: keep room for the envelope.
MAX_RESPONSE_BYTES = protocol.MAX_MESSAGE_BYTES - (64 << 10)


def rpc_status(exc: grpc.RpcError) -> tuple[grpc.StatusCode, str | None]:
    """(code, details) of a failed call; an RpcError that is not a call's outcome reads as UNKNOWN."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return code, details


def is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def detect_socket(candidates: tuple[str, ...] = DEFAULT_SOCKETS) -> str | None:
    """The first of `candidates` that is a unix socket (the node's runtime, in probe order), else None."""
    return next((path for path in candidates if is_socket(path)), None)


class CriRelay:
    """Forwards allowlisted runtime.v1 calls to one socket: `endpoint`, or the first default found."""

    def __init__(self, endpoint: str | None = None, node: str = "",
                 candidates: tuple[str, ...] = DEFAULT_SOCKETS) -> None:
        self.node = node
        self._explicit = socket_path(endpoint) if endpoint else None
        self._candidates = candidates
        self._lock = threading.Lock()
        self._path: str | None = self._explicit
        self._channel: grpc.Channel | None = None
        self._next_detect_s = 0.0
        if self._path is None:
            self._detect()

    @property
    def endpoint(self) -> str | None:
        """The socket in use (None while none was found)."""
        return self._path

    def _detect(self) -> None:
        self._next_detect_s = time.monotonic() + REDETECT_INTERVAL_S
        self._path = detect_socket(self._candidates)
        if self._path is not None:
            log.info("CRI relay: using %s", self._path)

    def _channel_for_call(self) -> tuple[grpc.Channel | None, str]:
        """(channel, "") or (None, why not); looks for a socket again when none was found yet."""
        with self._lock:
            if self._path is None and time.monotonic() >= self._next_detect_s:
                self._detect()
            if self._path is None:
                looked = ", ".join(self._candidates)
                return None, (f"no CRI socket on node {self.node or '(this node)'} (looked at {looked}); "
                              f"pass --cri-endpoint unix:///path/to/runtime.sock")
            if self._explicit is not None and not os.path.exists(self._path):
                return None, (f"CRI socket {self._path} (from --cri-endpoint) does not exist on node "
                              f"{self.node or '(this node)'}; is the runtime running?")
            if self._channel is None:
                # gRPC re-dials the path after a runtime restart (new socket inode), so one channel lasts.
                self._channel = grpc.insecure_channel(
                    f"unix://{self._path}", options=[("grpc.max_receive_message_length", MAX_RESPONSE_BYTES)])
            return self._channel, ""

    def call(self, method: str, request: bytes, timeout_ms: int = 0) -> stream_pb2.CriResponse:
        """Forward one call; never raises: every outcome is a CriResponse with a gRPC status code."""
        if method not in ALLOWED_METHODS:
            return stream_pb2.CriResponse(
                code=grpc.StatusCode.PERMISSION_DENIED.value[0], endpoint=self._path or "",
                message=(f"CRI method {method!r} is not relayed: only the read-only methods "
                         f"{', '.join(sorted(ALLOWED_METHODS))} pass"))
        channel, why = self._channel_for_call()
        if channel is None:
            return stream_pb2.CriResponse(code=grpc.StatusCode.UNAVAILABLE.value[0], message=why,
                                          endpoint=self._path or "")
        timeout_s = min(timeout_ms / 1000, MAX_TIMEOUT_S) if timeout_ms > 0 else DEFAULT_TIMEOUT_S
        # No serializers: the request and answer stay the bytes the collector and the runtime wrote.
        stub: grpc.UnaryUnaryMultiCallable[bytes, bytes]
        stub = channel.unary_unary(f"/runtime.v1.RuntimeService/{method}")
        try:
            response = stub(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            code, details = rpc_status(exc)
            return stream_pb2.CriResponse(code=code.value[0], endpoint=self._path or "",
                                          message=f"CRI {method} on {self._path}: {details}")
        except Exception as exc:  # a grpc surprise must not kill the stream's command worker
            message = f"CRI {method} on {self._path}: {type(exc).__name__}: {exc}"
            return stream_pb2.CriResponse(code=grpc.StatusCode.INTERNAL.value[0], endpoint=self._path or "",
                                          message=message)
        return stream_pb2.CriResponse(code=0, response=response, endpoint=self._path or "")

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = None


TRACE_SETUP_WAIT_S = 10.0
MAX_REMEDIATIONS = 16  # queued or running on one node; each may take its grace, a kill wait and CRI calls
RemediateHandler = Callable[[stream_pb2.RemediateCommand], stream_pb2.RemediateResult]


class CommandRunner:
    """Runs the collector's commands off the stream's receiver thread, a few at a time.

    A slow runtime must not hold up Acks, and a flood of commands must not grow threads or queues
    without end: beyond `max_queued` waiting or running, a command is answered RESOURCE_EXHAUSTED
    at once. Every command gets exactly one CommandResult, an unknown one UNIMPLEMENTED.
    Real acts run one at a time on their own worker (dry runs on the pool); beyond `max_remediations`
    waiting or running, one is answered `skipped` with not_started at once, nothing signalled, as is
    one whose deadline_ms passed before the worker reached it.
    """

    def __init__(self, relay: CriRelay | None, node: str, workers: int = 4, max_queued: int = 64,
                 max_remediations: int = MAX_REMEDIATIONS) -> None:
        self._relay = relay
        self._node = node
        self._max_queued = max_queued
        self._max_remediations = max_remediations
        self._lock = threading.Lock()
        self.running = 0  # queued or running on the pool
        self.remediations = 0  # queued or running on the remediation worker
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="ghostgpu-command")
        # One act at a time per node, in the order sent: two kills never overlap on one node, and
        # one that waits out its grace holds only this worker.
        self._remediation_pool = ThreadPoolExecutor(1, thread_name_prefix="ghostgpu-remediate")
        # Trace sessions (tracer/trace_sessions.py), set once the kernel side runs.
        self.trace_handler: Callable[[stream_pb2.Command], trace_pb2.TraceCommandResult] | None = None
        self.trace_unavailable = "the tracer is starting"
        self.trace_ready = threading.Event()  # set once trace_handler (or why there is none) is known
        # Remediation (tracer/remediate.py Remediator.handle): blocks up to its grace period plus a
        # fixed kill wait, on the remediation worker; None: this tracer runs none.
        self.remediate_handler: RemediateHandler | None = None

    def submit(self, command: stream_pb2.Command, reply: Callable[[stream_pb2.CommandResult], Any]) -> None:
        if command.WhichOneof("body") == "remediate" and not command.remediate.dry_run:
            self._submit_remediation(command, reply)
            return
        with self._lock:
            busy = self.running >= self._max_queued
            if not busy:
                self.running += 1
        if busy:
            why = f"tracer on {self._node} has {self._max_queued} commands waiting; retry"
            reply(self._result(command.id, grpc.StatusCode.RESOURCE_EXHAUSTED, why))
            return
        try:
            self._pool.submit(self._run, command, reply)
        except RuntimeError:  # the pool is shut down: the tracer is stopping
            with self._lock:
                self.running -= 1

    def _submit_remediation(self, command: stream_pb2.Command,
                            reply: Callable[[stream_pb2.CommandResult], Any]) -> None:
        with self._lock:
            waiting = self.remediations
            busy = waiting >= self._max_remediations
            if not busy:
                self.remediations += 1
        if busy:  # answered in kind: the collector reads an outcome, and takes its claim back
            why = f"{waiting} remediations wait on the tracer on {self._node}; nothing signalled; retry"
            reply(stream_pb2.CommandResult(id=command.id, remediate=_not_started(command.remediate, why)))
            return
        try:
            self._remediation_pool.submit(self._run_remediation, command, reply, time.monotonic())
        except RuntimeError:  # the pool is shut down: the tracer is stopping
            with self._lock:
                self.remediations -= 1

    def _run_remediation(self, command: stream_pb2.Command,
                         reply: Callable[[stream_pb2.CommandResult], Any], received_s: float) -> None:
        try:
            deadline_ms = command.remediate.deadline_ms
            if deadline_ms and time.monotonic() > received_s + deadline_ms / 1000:
                why = (f"arrived after its deadline ({deadline_ms} ms after the tracer on {self._node} "
                       "received it); nothing signalled")
                result = _not_started(command.remediate, why)
            else:
                result = self._remediate(command.remediate)
            reply(stream_pb2.CommandResult(id=command.id, remediate=result))
        except Exception:
            log.exception("command %d failed", command.id)
        finally:
            with self._lock:
                self.remediations -= 1

    def _run(self, command: stream_pb2.Command, reply: Callable[[stream_pb2.CommandResult], Any]) -> None:
        try:
            body = command.WhichOneof("body")
            if body == "cri" and self._relay is not None:
                req = command.cri
                response = self._relay.call(req.method, req.request, req.timeout_ms)
                result = stream_pb2.CommandResult(id=command.id, cri=response)
            elif body == "cri":
                result = self._result(command.id, grpc.StatusCode.UNIMPLEMENTED,
                                      f"tracer on {self._node} runs no CRI relay")
            elif body == "remediate":  # a dry run: re-checks only, never behind an act's grace
                result = stream_pb2.CommandResult(id=command.id, remediate=self._remediate(command.remediate))
            elif body in ("trace_start", "trace_update", "trace_stop"):
                # Hello offers "trace" once BPF runs, a moment before the sessions are set up.
                self.trace_ready.wait(TRACE_SETUP_WAIT_S)
                handler = self.trace_handler
                if handler is None:
                    answer = trace_pb2.TraceCommandResult(
                        error=f"tracer on {self._node} cannot trace: {self.trace_unavailable}")
                else:
                    answer = handler(command)
                result = stream_pb2.CommandResult(id=command.id, trace=answer)
            else:
                # No body is a command from a newer collector: answer, never leave it hanging.
                result = self._result(command.id, grpc.StatusCode.UNIMPLEMENTED,
                                      f"tracer on {self._node} does not know this command; upgrade it")
            reply(result)
        except Exception:
            log.exception("command %d failed", command.id)
        finally:
            with self._lock:
                self.running -= 1

    def _remediate(self, command: stream_pb2.RemediateCommand) -> stream_pb2.RemediateResult:
        """The act's result; never raises, so the collector always hears how the incident ended."""
        handler = self.remediate_handler
        if handler is None:
            return stream_pb2.RemediateResult(incident=command.incident, outcome=SKIPPED,
                                              reason=f"tracer on {self._node} runs no remediation")
        try:
            return handler(command)
        except Exception as exc:  # the handler answers its own errors; this is the last net
            log.exception("remediation %s failed", command.incident)
            reason = f"tracer on {self._node}: {type(exc).__name__}: {exc}".replace("\n", " ")
            return stream_pb2.RemediateResult(incident=command.incident, outcome=FAILED, reason=reason)

    @staticmethod
    def _result(command_id: int, code: grpc.StatusCode, message: str) -> stream_pb2.CommandResult:
        return stream_pb2.CommandResult(id=command_id, cri=stream_pb2.CriResponse(code=code.value[0],
                                                                                   message=message))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._remediation_pool.shutdown(wait=False, cancel_futures=True)


def _not_started(command: stream_pb2.RemediateCommand, why: str) -> stream_pb2.RemediateResult:
    """The answer to an act never started: skipped, exited false, not_started (the claim goes back)."""
    return stream_pb2.RemediateResult(incident=command.incident, outcome=SKIPPED, reason=why, exited=False,
                                      not_started=True)
