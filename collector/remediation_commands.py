"""RemediateCommands down a tracer's stream and the RemediateResults that answer them.

`RemediateCalls.call(node, command)` queues a Command.remediate on the node's current stream
(collector/ingest.py's IngestSession) and waits, bounded, for the CommandResult that carries the same
command id. What never comes back is a RemediateResult too, so the engine (collector/remediation.py)
treats every outcome alike: `outcome` "" and a reason saying why none came (no stream, the stream
ended, the tracer did not answer in time, the tracer answered with another body: it does not know
remediation). A command never queued on a stream (none connected, or its tracer does not offer
remediation) is answered with `not_started` set: nothing was sent, so nothing can have been done.
Ids count from REMEDIATE_ID_BASE, apart from the CRI relay's (from 1) and the trace
commands' (from 2**62); ingest hands every result to `answer` first, which claims the ids it is
waiting for whatever their body, and any body "remediate".

Runs on the collector's event loop.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping
from typing import Any, Protocol

from ghostgpu.common.model.remediation import CAPABILITY
from ghostgpu.v1 import stream_pb2

REMEDIATE_ID_BASE = 3 << 61  # above the trace commands' 2**62: they never count that far
NO_ANSWER = ""  # RemediateResult.outcome when the tracer's answer did not come


class CommandStream(Protocol):
    """What is needed of one tracer's stream (collector/ingest.py's IngestSession)."""

    node: str
    active: bool
    hello: stream_pb2.Hello
    out: asyncio.Queue[Any]


def offers_remediation(stream: CommandStream | None) -> bool:
    """The stream's tracer offered "remediation" in its Hello (it runs with --remediation on)."""
    return stream is not None and CAPABILITY in stream.hello.capabilities


def no_answer(incident: str, why: str, not_sent: bool = False) -> stream_pb2.RemediateResult:
    """not_sent: the command never left (RemediateResult.not_started); else it may have run."""
    return stream_pb2.RemediateResult(incident=incident, outcome=NO_ANSWER, reason=why, not_started=not_sent)


class RemediateCalls:
    """Remediate commands in flight per stream; `streams` is the live map of each node's stream."""

    def __init__(self, streams: Mapping[str, CommandStream]) -> None:
        self.streams = streams
        self._pending: dict[tuple[Any, int], asyncio.Future[stream_pb2.RemediateResult]] = {}
        self._ids = itertools.count(REMEDIATE_ID_BASE)

    async def call(self, node: str, command: stream_pb2.RemediateCommand,
                   timeout_s: float) -> stream_pb2.RemediateResult:
        stream = self.streams.get(node)
        if stream is None or not stream.active:
            return no_answer(command.incident, f"node {node}'s tracer is not connected", not_sent=True)
        if not offers_remediation(stream):
            return no_answer(command.incident, f"node {node}'s tracer does not offer remediation",
                             not_sent=True)
        cid = next(self._ids)
        fut: asyncio.Future[stream_pb2.RemediateResult] = asyncio.get_running_loop().create_future()
        self._pending[(stream, cid)] = fut
        message = stream_pb2.CollectorMessage(command=stream_pb2.Command(id=cid, remediate=command))
        stream.out.put_nowait(message)
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            return no_answer(command.incident, f"node {node}'s tracer did not answer within {timeout_s:g} s")
        finally:
            self._pending.pop((stream, cid), None)

    def answer(self, stream: CommandStream, result: stream_pb2.CommandResult) -> bool:
        """True when the result is a remediation's (ours, even if nobody waits for it now)."""
        body = result.WhichOneof("body")
        fut = self._pending.pop((stream, result.id), None)
        if fut is None:
            return body == "remediate"
        if not fut.done():
            if body == "remediate":
                fut.set_result(result.remediate)
            else:
                fut.set_result(no_answer("", f"node {stream.node}'s tracer does not know remediate commands "
                                         f"(it answered {body})"))
        return True

    def stream_ended(self, stream: CommandStream) -> None:
        for (s, _), fut in list(self._pending.items()):
            if s is stream and not fut.done():
                fut.set_result(no_answer("", f"node {stream.node}'s tracer disconnected before it answered"))
