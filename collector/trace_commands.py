"""Trace commands down the tracers' streams, their answers, and what the collector's limits are.

`TraceCommands.call` sends a Command (trace_start, trace_update or trace_stop) on a tracer's
stream (collector/ingest.py's IngestSession: its `out` queue) and waits, bounded, for the
CommandResult.trace that answers it: its error line, "" when done. An answer that does not come
in time, or a stream that ends first, is an error line too ("timeout: ...", "gone: ..."), so the
caller treats every outcome alike. Command ids count from 2**62, apart from the CRI relay's
(collector/relay.py, from 1): a result is routed by its id as well as by its body, and an old
tracer that answers a trace command with a CRI "unknown command" is still heard. A node another
collector replica serves gets its commands through that replica (collector/replica_commands.py
RemoteStream); its answer, or why none came, is an error line all the same.

The error-line convention with the tracer (its prefix picks the gRPC code the client gets):
"limit: ..." RESOURCE_EXHAUSTED (its per-node session limit), "not found: ..." NOT_FOUND (no such
process or session), "invalid: ..." INVALID_ARGUMENT (an unknown GPU), "denied: ..."
PERMISSION_DENIED (the pid is not in a container of the caller's namespaces,
TraceStart.pid_containers), anything else
FAILED_PRECONDITION (it cannot trace now). The line names the node, or the collector adds it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from ghostgpu.collector.trace_scope import TraceError

from ghostgpu.common.model.durations import format_ms
from ghostgpu.common.model.trace import TraceScope
from ghostgpu.v1 import stream_pb2

if TYPE_CHECKING:
    from ghostgpu.collector.ingest import IngestSession

_CODES = {"limit:": grpc.StatusCode.RESOURCE_EXHAUSTED, "not found:": grpc.StatusCode.NOT_FOUND,
          "invalid:": grpc.StatusCode.INVALID_ARGUMENT, "timeout:": grpc.StatusCode.UNAVAILABLE,
          "gone:": grpc.StatusCode.UNAVAILABLE, "denied:": grpc.StatusCode.PERMISSION_DENIED}
COMMAND_ID_BASE = 1 << 62


@dataclass(frozen=True)
class TraceTiming:
    """The trace book's waits and ticks: not settings (tests shorten them)."""

    end_grace_s: float = 5.0  # past the deadline (or a stop) the collector ends what tracers did not
    command_timeout_s: float = 5.0  # for each trace_start/update/stop answer
    reresolve_s: float = 1.0  # a namespace scope takes in containers started since
    tick_s: float = 0.25
    # With replicas: how often a replica looks for sessions whose home replica is gone
    # (collector/trace_homes.py); a store read of the running sessions, so not every tick.
    home_gone_check_s: float = 10.0


@dataclass(frozen=True)
class TraceLimits:
    """The trace slice of CollectorConfig (collector/config.py: the defaults and their checks), with
    the book's timing."""

    max_duration_s: float  # --trace-max-duration
    default_duration_s: float  # --trace-default-duration
    max_records: int  # --trace-max-records: per session, default and maximum
    timing: TraceTiming = field(default_factory=TraceTiming)

    def duration_ms(self, requested_ms: int) -> int:
        """A session's length: what the client asked for, else --trace-default-duration."""
        return requested_ms or int(self.default_duration_s * 1000)


def validate(scope: TraceScope, duration_ms: int, max_records: int, limits: TraceLimits) -> tuple[int, int]:
    """(duration_ms, max_records) with the defaults filled in; INVALID_ARGUMENT naming what is wrong."""
    bad = grpc.StatusCode.INVALID_ARGUMENT
    if not (scope.namespace or scope.pod or scope.container or scope.pid):
        raise TraceError(bad, "a trace needs a scope: --namespace, --pod, --container, or --pid with --node")
    if scope.pid and not scope.node:
        raise TraceError(bad, "--pid needs --node: a PID names a process on one node")
    if scope.pod and not scope.namespace:
        raise TraceError(bad, f"--pod {scope.pod} needs --namespace: pod names are per namespace")
    max_ms = int(limits.max_duration_s * 1000)
    duration_ms = limits.duration_ms(duration_ms)
    if duration_ms > max_ms:
        raise TraceError(bad, f"duration {format_ms(duration_ms)} exceeds the maximum of {format_ms(max_ms)} "
                         "(--trace-max-duration)")
    if max_records > limits.max_records:
        raise TraceError(bad, f"max records {max_records} exceeds the maximum of {limits.max_records} "
                         "(--trace-max-records)")
    return duration_ms, max_records or limits.max_records


def line_error(error: str) -> TraceError:
    """An error line as the client gets it: the gRPC code by its prefix, the prefix dropped."""
    line = error.strip()
    for prefix, code in _CODES.items():
        if line.startswith(prefix):
            return TraceError(code, line[len(prefix):].strip())
    return TraceError(grpc.StatusCode.FAILED_PRECONDITION, line)


def node_error(node: str, error: str) -> TraceError:
    """A tracer's (or the command's) error line as the client gets it: code by prefix, node named."""
    e = line_error(error)
    named = f"node {node}" in e.line or f"on {node}" in e.line  # "tracer on gpu-3: ..." names it too
    return e if named else TraceError(e.code, f"node {node}: {e.line}")


class TraceCommands:
    """Commands in flight per stream; every method runs on the event loop."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._pending: dict[tuple[IngestSession, int], asyncio.Future[str]] = {}
        self._ids = itertools.count(COMMAND_ID_BASE)

    def send(self, stream: IngestSession, **body: Any) -> int:
        """Queue a Command on the stream, answered or not; its id (0 for a node another replica
        serves: collector/replica_commands.py's RemoteStream hands it over)."""
        if (remote := getattr(stream, "send_remote", None)) is not None:
            remote(**body)
            return 0
        cid = next(self._ids)
        stream.out.put_nowait(stream_pb2.CollectorMessage(command=stream_pb2.Command(id=cid, **body)))
        return cid

    async def call(self, stream: IngestSession | None, meta: Mapping[str, Any] | None = None,
                   **body: Any) -> str:
        """Send one command and wait for its answer: the error line, "" when done. A node another
        replica serves gets it through that replica, with `meta` (collector/replica_commands.py)."""
        if stream is None or not stream.active:
            return "gone: its tracer is not connected"
        if (remote := getattr(stream, "call_remote", None)) is not None:
            answer: str = await remote(self.timeout_s, meta, **body)
            return answer
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        cid = self.send(stream, **body)
        self._pending[(stream, cid)] = fut
        try:
            return await asyncio.wait_for(fut, self.timeout_s)
        except TimeoutError:
            what = next(iter(body))
            return f"timeout: node {stream.node}'s tracer did not answer {what} within {self.timeout_s:g} s"
        finally:
            self._pending.pop((stream, cid), None)

    def answer(self, stream: IngestSession, result: stream_pb2.CommandResult) -> bool:
        """A CommandResult: True when it answers a trace command (ours, even if nobody waits now)."""
        body = result.WhichOneof("body")
        fut = self._pending.pop((stream, result.id), None)
        if fut is None:
            return body == "trace" or result.id >= COMMAND_ID_BASE
        if not fut.done():
            fut.set_result(result.trace.error if body == "trace" else
                           f"node {stream.node}'s tracer does not know trace commands (it answered {body})")
        return True

    def stream_ended(self, stream: IngestSession) -> None:
        for (s, _), fut in list(self._pending.items()):
            if s is stream and not fut.done():
                fut.set_result(f"gone: node {stream.node}'s tracer disconnected before it answered")
