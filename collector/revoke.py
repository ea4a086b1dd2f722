"""Revocation: open streams re-checked when the policy changes, and ended when their certificate
expires (docs/SECURITY.md, "Revocation").

The policy is checked when a call opens (collector/authz.py), and a stream (Connect, WatchFindings,
WatchTrace, ...) can outlive both the policy that let it in and the certificate it came with. So
the authz wrapper registers every response-streaming call here for its lifetime: its principal, its
method, its task and, over mTLS, its certificate's notAfter. Nothing here runs per message:

- after a policy reload (`Security.tick`/`Security.reload`, on the collector's loop) `recheck`
  asks the new policy about each open stream; one whose principal lost the method's role is ended
  with PERMISSION_DENIED at once;
- one loop timer per distinct notAfter ends the streams of that certificate with UNAUTHENTICATED
  when it expires (a renewed certificate is a new connection, and a new check).

Ending a stream cancels its handler's task with a reason; the wrapper (`run`) turns that
cancellation into `context.abort(code, details)`, after the handler's own cleanup (its `finally`
blocks: a tracer's session closed and audited, a watcher removed) has run. Each pass is audited as
`stream.revoked`, one record per (subject, method) with the number of streams it ended, at most
AUDIT_GROUPS_MAX records per pass (then one record counting the rest).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol, cast

import grpc
from ghostgpu.collector.aio_handlers import Context
from ghostgpu.collector.audit import AuditFn

from ghostgpu.common.transport.principal import Principal
from ghostgpu.common.transport.tls import TlsError, first_auth_value, not_after, parse_certs

log = logging.getLogger(__name__)

AUDIT_GROUPS_MAX = 100  # stream.revoked records per pass; the rest are counted in one more


class PolicyLike(Protocol):
    def denial(self, principal: Principal, method: str) -> str | None: ...


@dataclass(eq=False)
class OpenStream:
    principal: Principal
    method: str
    task: asyncio.Task[Any] | None
    not_after_s: float | None  # the client certificate's notAfter (Unix seconds); None: no certificate
    ended: tuple[grpc.StatusCode, str] | None = field(default=None)  # set when revoked
    writing: bool = field(default=False)  # a message send is in flight
    cancel_due: bool = field(default=False)  # revoked during that send: the handler ends once it is done


# How long a revoked stream's message send in flight may take before its handler is cancelled anyway.
_WRITE_DRAIN_S = 5.0


class _TrackedWrites:
    """The handler's context, its context.write marked in flight, so that a revocation does not cancel
    the handler in the middle of one: gRPC core refuses a status while a message send is still in
    flight (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS, grpcio 1.85), and the stream would then stay open
    with no status at all. A revocation during a send lets it finish, and the handler ends after it
    (OpenStreams._end)."""

    def __init__(self, context: Context, stream: OpenStream) -> None:
        self._context = context
        self._stream = stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def write(self, message: object) -> None:
        stream = self._stream
        stream.writing = True
        try:
            await self._context.write(message)
        finally:
            stream.writing = False
        if stream.cancel_due:
            stream.cancel_due = False
            raise asyncio.CancelledError  # the revocation that came during the send


def _cancel_if_due(stream: OpenStream) -> None:
    """A send that did not finish within _WRITE_DRAIN_S (a client that stopped reading): cancel the
    handler anyway."""
    if stream.cancel_due and stream.task is not None and not stream.task.done():
        stream.task.cancel()


@lru_cache(maxsize=1024)  # one parse per certificate, not per stream
def _cert_not_after_s(pem: bytes) -> float | None:
    try:
        return not_after(parse_certs(pem, "client certificate", "")[0]).timestamp()
    except (TlsError, ValueError, IndexError):
        return None


def cert_not_after_s(context: Context) -> float | None:
    """The verified client certificate's notAfter, or None (plaintext, no certificate)."""
    auth = context.auth_context() or {}
    if auth.get("transport_security_type") != [b"ssl"]:
        return None
    pem = first_auth_value(auth, "x509_pem_cert")
    return _cert_not_after_s(pem) if pem is not None else None


class OpenStreams:
    """The open streams of one server, on its event loop. `recheck` may be called from any thread."""

    def __init__(self, audit: AuditFn | None = None) -> None:
        self.audit = audit
        self.revoked_total = 0
        self._open: set[OpenStream] = set()
        # client address -> its open streams: what the TCP gate asks (`holds`) before closing a
        # proven connection for room (collector/tcpgate.py)
        self._peers: dict[str, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # notAfter -> the streams of that certificate and the one timer that ends them
        self._expiry: dict[float, tuple[asyncio.TimerHandle, set[OpenStream]]] = {}

    def __len__(self) -> int:
        return len(self._open)

    def holds(self, peer: str) -> bool:
        """Whether the client at `peer` has a stream open. Any thread: one dict lookup."""
        return peer in self._peers

    # ---- the handler's side (collector/authz.py) -----------------------------------------------

    async def run(self, principal: Principal, method: str, context: Context,
                  serve: Callable[[Context], Awaitable[object]]) -> object:
        """`serve(context)` (the handler, given the context to write with), registered while it runs;
        a revocation ends it with its status."""
        stream = self._add(principal, method, cert_not_after_s(context) if principal.via == "mtls" else None)
        try:
            try:
                result = await serve(cast(Context, _TrackedWrites(context, stream)))
            except asyncio.CancelledError:
                if stream.ended is None:
                    raise  # the client went away, or the server is stopping
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
                result = None
        finally:
            self._remove(stream)
        if stream.ended is not None:
            code, details = stream.ended
            await context.abort(code, details)  # raises AbortError, which gRPC expects
        return result

    @staticmethod
    async def write_all(items: AsyncGenerator[object, None], context: Context) -> None:
        """An async generator handler's answers, written by this task (so a revocation that comes
        while one is being sent still ends the handler here), the generator closed whatever happens."""
        async with contextlib.aclosing(items) as gen:
            async for item in gen:
                await context.write(item)

    def _add(self, principal: Principal, method: str, not_after_s: float | None) -> OpenStream:
        loop = asyncio.get_running_loop()
        self._loop = loop
        stream = OpenStream(principal, method, asyncio.current_task(), not_after_s)
        self._open.add(stream)
        self._peers[principal.peer] = self._peers.get(principal.peer, 0) + 1
        if not_after_s is not None:
            entry = self._expiry.get(not_after_s)
            if entry is None:
                delay_s = max(0.0, not_after_s - time.time())
                handle = loop.call_at(loop.time() + delay_s, self._expire, not_after_s)
                entry = self._expiry[not_after_s] = (handle, set())
            entry[1].add(stream)
        return stream

    def _remove(self, stream: OpenStream) -> None:
        self._open.discard(stream)
        peer = stream.principal.peer
        left = self._peers.get(peer, 1) - 1
        if left > 0:
            self._peers[peer] = left
        else:
            self._peers.pop(peer, None)
        if stream.not_after_s is None:
            return
        entry = self._expiry.get(stream.not_after_s)
        if entry is not None:
            entry[1].discard(stream)
            if not entry[1]:
                entry[0].cancel()
                del self._expiry[stream.not_after_s]

    # ---- the policy's and the clock's side -----------------------------------------------------

    def recheck(self, policy: PolicyLike) -> None:
        """Ask `policy` about every open stream; end those it now denies (PERMISSION_DENIED)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # no stream was ever opened
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._recheck(policy)
        else:
            with contextlib.suppress(RuntimeError):  # the loop is shutting down
                loop.call_soon_threadsafe(self._recheck, policy)

    def _recheck(self, policy: PolicyLike) -> None:
        lost = []
        for stream in self._open:
            if stream.ended is None:
                line = policy.denial(stream.principal, stream.method)
                if line is not None:
                    lost.append((stream, f"permission denied: the policy was reloaded: {line}"))
        self._end(lost, grpc.StatusCode.PERMISSION_DENIED, "policy reload: role withdrawn")

    def _expire(self, not_after_s: float) -> None:
        entry = self._expiry.pop(not_after_s, None)
        if entry is None:
            return
        when = dt.datetime.fromtimestamp(not_after_s, dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")
        ended = []
        for stream in entry[1]:
            if stream.ended is None:
                ended.append((stream, f"the client certificate of {stream.principal.subject} expired at "
                                      f"{when} (notAfter) while this stream was open; renew it and "
                                      "connect again"))
        self._end(ended, grpc.StatusCode.UNAUTHENTICATED, "certificate expired")

    def _end(self, streams: list[tuple[OpenStream, str]], code: grpc.StatusCode, reason: str) -> None:
        if not streams:
            return
        groups: dict[tuple[str, str], list[OpenStream]] = {}
        for stream, details in streams:
            stream.ended = (code, details)
            if stream.task is not None and not stream.task.done():
                if stream.writing:  # cancelled once the send in flight is done (_TrackedWrites.write)
                    stream.cancel_due = True
                    asyncio.get_running_loop().call_later(_WRITE_DRAIN_S, _cancel_if_due, stream)
                else:
                    stream.task.cancel()
            groups.setdefault((stream.principal.subject, stream.method), []).append(stream)
        self.revoked_total += len(streams)
        log.warning("%s: ended %d open stream(s) with %s", reason, len(streams), code.name)
        if self.audit is None:
            return
        items = list(groups.items())
        for (subject, method), group in items[:AUDIT_GROUPS_MAX]:
            first = group[0].principal
            self._audit("stream.revoked", subject, "denied", method=method, reason=reason, status=code.name,
                        streams=len(group), peer=first.peer, via=first.via)
        rest = items[AUDIT_GROUPS_MAX:]
        if rest:
            self._audit("stream.revoked", "collector", "denied", reason=reason, status=code.name,
                        more_subjects=len(rest), streams=sum(len(g) for _, g in rest))

    def _audit(self, action: str, subject: str, result: str, **detail: Any) -> None:
        try:
            assert self.audit is not None
            self.audit(action, subject, result, **detail)
        except Exception:
            log.exception("revocation: auditing %s failed", action)
