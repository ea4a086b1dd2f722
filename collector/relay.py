"""The collector's side of the CRI relay: runtime.v1 calls sent down a tracer's stream as Commands.

A tracer that offers the "cri-relay" capability in its Hello answers a Command carrying a CriRequest
(method, raw request bytes, timeout) with a CommandResult carrying a CriResult (gRPC status code,
message, raw response bytes, the endpoint it reached) on the same stream (proto/ghostgpu/v1/
stream.proto; the tracer's side is tracer/cri_relay.py). `CriRelayClient.call` is such a call as a
blocking CRI transport (collector/cri_fetch.py's CriTransport), for the CRI resolver's workers.

Threads: `call` runs on a worker thread and waits on a concurrent future; everything else runs on
the collector's event loop, as the streams do (collector/ingest.py). A call hands the loop a
Command to queue on the node's current stream, under an id unique in this collector, and the
future that waits for its answer. The future ends exactly once:

- the tracer answers: the response bytes, or CriCallError with the runtime's status code and message;
- the stream ends first (tracer gone, replaced by a newer stream, collector stopping): UNAVAILABLE;
- no connected tracer offers the relay for the node: UNAVAILABLE at once;
- no answer within the call's timeout plus a second for the round trip: DEADLINE_EXCEEDED, and the
  command is forgotten, so a late answer is dropped (logged at debug).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import weakref
from collections.abc import Mapping
from functools import partial
from typing import Any, Protocol

import grpc
from ghostgpu.collector.cri_fetch import CriCallError, CriTransport

from ghostgpu.v1 import stream_pb2

log = logging.getLogger(__name__)

_CODES = {c.value[0]: c for c in grpc.StatusCode}
ROUND_TRIP_S = 1.0  # waited for past the tracer's own CRI timeout
Calls = dict[int, concurrent.futures.Future[bytes]]  # command id -> the call waiting for its answer


class RelayStream(Protocol):
    """What the relay needs of one tracer's stream (collector/ingest.py's IngestSession)."""

    node: str
    active: bool  # False once the stream is ending: nothing more is sent on it
    cri_relay: bool  # the tracer's Hello offered "cri-relay"
    out: asyncio.Queue[Any]  # what the stream's writer sends, in order


def answer_of(fut: concurrent.futures.Future[bytes], timeout_s: float) -> bytes:
    """fut.result(timeout_s) for a relayed call (concurrent.futures.TimeoutError past it), raising a new
    CriCallError for a failed one: re-raising the future's own would tie it, its traceback, the waiting
    frames and the future into a reference cycle per failed call (NOT_FOUND for a gone container or
    sandbox is one), which only the cyclic GC frees, and which the commands' gc policy
    (collector/heap.py) may freeze with the long-lived heap for up to an hour."""
    error = fut.exception(timeout_s)
    if error is None:
        return fut.result()
    if not isinstance(error, CriCallError):
        raise error  # not one the relay sets: as it is
    raise CriCallError(error.code, error.message)


class CriRelayClient:
    """CRI calls through the tracers' streams. `streams` is the live map of each node's current stream
    (Ingest.sessions); every method but `call` runs on the event loop."""

    def __init__(self, streams: Mapping[str, RelayStream]) -> None:
        self.streams = streams
        self.loop: asyncio.AbstractEventLoop | None = None  # the serving loop, once it runs (Ingest.serve_on)
        # The calls sent on each stream and not answered yet; an entry goes with its stream.
        self.pending: weakref.WeakKeyDictionary[RelayStream, Calls] = weakref.WeakKeyDictionary()
        self._command_ids = itertools.count(1)

    def transport(self, node: str) -> CriTransport | None:
        """The relay transport for a node whose tracer is connected with cri-relay, else None."""
        stream = self.streams.get(node)
        if stream is None or not stream.cri_relay:
            return None
        return partial(self.call, node)

    def call(self, node: str, method: str, request: bytes, timeout_s: float) -> bytes:
        """One CRI call through the node's tracer (blocking; call it off the event loop)."""
        loop = self.loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None  # a worker thread, as it should be
        if running is not None and running is loop:
            raise RuntimeError("CriRelayClient.call blocks: call it from a worker thread, not the event loop")
        fut: concurrent.futures.Future[bytes] = concurrent.futures.Future()
        command_id = next(self._command_ids)

        def send() -> None:
            stream = self.streams.get(node)
            if stream is None or not stream.active or not stream.cri_relay:
                fut.set_exception(CriCallError(grpc.StatusCode.UNAVAILABLE,
                                               f"node {node} has no connected tracer offering cri-relay"))
                return
            self.pending.setdefault(stream, {})[command_id] = fut
            req = stream_pb2.CriRequest(method=method, request=request,
                                        timeout_ms=max(1, int(timeout_s * 1000)))
            command = stream_pb2.Command(id=command_id, cri=req)
            stream.out.put_nowait(stream_pb2.CollectorMessage(command=command))

        if loop is None or loop.is_closed():
            raise CriCallError(grpc.StatusCode.UNAVAILABLE, f"node {node} has no connected tracer")
        loop.call_soon_threadsafe(send)
        try:
            return answer_of(fut, timeout_s + ROUND_TRIP_S)
        except concurrent.futures.TimeoutError:
            loop.call_soon_threadsafe(self._forget, node, command_id)
            raise CriCallError(grpc.StatusCode.DEADLINE_EXCEEDED, f"the tracer on node {node} did not answer "
                               f"CRI {method} within {timeout_s:g} s") from None

    def _forget(self, node: str, command_id: int) -> None:
        stream = self.streams.get(node)
        if stream is not None:
            self.pending.get(stream, {}).pop(command_id, None)

    def in_flight(self, node: str) -> int:
        """How many commands the node's current stream was sent and has not answered."""
        stream = self.streams.get(node)
        return len(self.pending.get(stream, {})) if stream is not None else 0

    def answer(self, stream: RelayStream, result: stream_pb2.CommandResult) -> None:
        """A CommandResult the tracer sent on `stream`: ends the call waiting for it, if any."""
        fut = self.pending.get(stream, {}).pop(result.id, None)
        if fut is None or fut.done():
            log.debug("node %s answered command %d, which nobody waits for", stream.node, result.id)
            return
        if result.WhichOneof("body") != "cri":
            fut.set_exception(CriCallError(grpc.StatusCode.INTERNAL, f"tracer on node {stream.node} "
                                           "answered a CRI command without a CRI result"))
            return
        r = result.cri
        if r.code == 0:
            fut.set_result(bytes(r.response))
        else:
            where = f"via the tracer on node {stream.node}" + (f", {r.endpoint}" if r.endpoint else "")
            code = _CODES.get(r.code, grpc.StatusCode.UNKNOWN)
            fut.set_exception(CriCallError(code, f"{r.message} ({where})"))

    def stream_ended(self, stream: RelayStream) -> None:
        """The stream is gone: every call still waiting on it fails UNAVAILABLE."""
        for fut in self.pending.pop(stream, {}).values():
            if not fut.done():
                fut.set_exception(CriCallError(grpc.StatusCode.UNAVAILABLE,
                                               f"the stream of node {stream.node} ended before it answered"))
