"""Every RPC is checked before it runs: who is calling (collector/peers.py, the TLS certificate),
and whether the policy (collector/policy.py) gives them the method's role.

A server interceptor (grpc.aio) sees only the method name and the metadata; the peer and the TLS
auth context live on the servicer context. So the interceptor wraps each handler: the wrapper
identifies the caller from its context, refuses with PERMISSION_DENIED (naming the method, the
subject and the missing role, and auditing it) or runs the handler with the caller in
`current_principal()`, a context variable the handlers read (ingest's Hello check, the trace
start's namespace and duration limits, `requested_by`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Protocol

import grpc
from ghostgpu.collector.aio_handlers import (
    Context,
    Continuation,
    Req,
    Resp,
    Streaming,
    behaviours,
    is_generator,
)
from ghostgpu.collector.audit import AuditFn
from ghostgpu.collector.peers import UnixGate, loopback_uid
from ghostgpu.collector.revoke import OpenStreams

from ghostgpu.common.transport.principal import ANONYMOUS, Principal
from ghostgpu.common.transport.tls import principal_from_auth_context

DENIED_WINDOW_S = 10.0  # one `denied` audit record per (subject, method, transport) per window
DENIED_KEYS_MAX = 10_000
_CURRENT: ContextVar[Principal] = ContextVar("ghostgpu_principal", default=ANONYMOUS)


class PolicyLike(Protocol):
    def check(self, principal: Principal, method: str) -> str | None: ...

    def denial(self, principal: Principal, method: str) -> str | None: ...


def current_principal() -> Principal:
    """The caller of the RPC being served (anonymous outside one)."""
    return _CURRENT.get()


class DenialFold:
    """A refusal repeated must not grow the audit log without bound: one record per key (who, and
    what was refused) per DENIED_WINDOW_S, the next one saying how many were folded into it. Used
    for denied RPCs here and for refused Hellos (collector/ingest.py)."""

    def __init__(self, window_s: float = DENIED_WINDOW_S, keys_max: int = DENIED_KEYS_MAX,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s, self.keys_max, self.clock = window_s, keys_max, clock
        self._seen: dict[tuple[str, ...], tuple[float, int]] = {}

    def __call__(self, key: tuple[str, ...]) -> int | None:
        """None when this refusal is folded into the window's record; else how many were folded
        since the last record of `key` (write a record saying so)."""
        now_s = self.clock()
        last_s, folded = self._seen.get(key, (-self.window_s, 0))
        if now_s - last_s < self.window_s:
            self._seen[key] = (last_s, folded + 1)
            return None
        if key not in self._seen and len(self._seen) >= self.keys_max:  # many subjects: forget old windows
            # The table is in the order the windows began (a new window is re-inserted): the ones
            # that ended are at its front, so forgetting them never walks the open ones.
            while self._seen and now_s - next(iter(self._seen.values()))[0] >= self.window_s:
                del self._seen[next(iter(self._seen))]
            # Every window still open (more keys per window than keys_max): the table must not grow
            # past its bound anyway, so the oldest window goes; its key's next refusal is recorded
            # again, without the count folded into the forgotten window.
            while len(self._seen) >= self.keys_max:
                del self._seen[next(iter(self._seen))]
        self._seen.pop(key, None)  # re-inserted: the table stays in the order the windows began
        self._seen[key] = (now_s, 0)
        return folded


class Identify:
    """A servicer context -> the Principal behind it (see ghostgpu/common/transport/principal.py)."""

    def __init__(self, trust_domain: str, gates: list[UnixGate] | None = None,
                 server_ports: set[int] | None = None) -> None:
        self.trust_domain = trust_domain
        # The unix listeners and the TCP ports, as the server binds them (shared, not copied).
        self.gates = gates if gates is not None else []
        self.server_ports = server_ports if server_ports is not None else set()

    def __call__(self, context: Context) -> Principal:
        peer = context.peer() or ""
        auth = context.auth_context() or {}
        if auth.get("transport_security_type") == [b"ssl"]:
            # The handshake verified the chain; a certificate without a ghostgpu identity (another
            # trust domain) is anonymous: the policy gives it nothing unless it names `anonymous`.
            found = principal_from_auth_context(auth, self.trust_domain, peer)
            return found or Principal("anonymous", via="mtls", peer=peer)
        if peer.startswith("unix:/"):  # a relayed connection: its own path in its gate's private directory
            found = next((p for gate in self.gates if (p := gate.principal(peer)) is not None), None)
            if found is not None:
                return found
        uid = loopback_uid(peer, self.server_ports)
        if uid is not None:
            return Principal("uid", str(uid), via="loopback", peer=peer)
        return Principal("anonymous", via="plaintext", peer=peer)


class Authorizer(grpc.aio.ServerInterceptor):
    def __init__(self, identify: Callable[[Context], Principal],
                 policy: Callable[[], PolicyLike], audit: AuditFn | None = None) -> None:
        self.identify = identify
        self.policy = policy  # the current policy: a reload swaps what this returns
        self.audit = audit
        self.denied_total = 0
        # A client retrying a refused call must not grow the audit log without bound: one record per
        # (subject, method, transport) per window, the next one saying how many were folded into it.
        self._denied = DenialFold()
        # Open streams, re-checked after a policy reload and ended at their certificate's notAfter
        # (collector/revoke.py); Security calls streams.recheck.
        self.streams = OpenStreams(audit)

    async def intercept_service(
        self, continuation: Continuation[Req, Resp], handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Req, Resp] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        return _wrap(handler, handler_call_details.method, self.admit, self.streams)

    async def admit(self, method: str, context: Context) -> Principal:
        principal = self.identify(context)
        policy = self.policy()
        line = policy.denial(principal, method)
        if line is None:
            return principal
        self.denied_total += 1
        repeats = self._fold(principal.subject, method, principal.via)
        if self.audit is not None and repeats is not None:
            self.audit("denied", principal.subject, "denied", method=method,
                       missing=policy.check(principal, method), peer=principal.peer, via=principal.via,
                       repeats_folded=repeats)
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"permission denied: {line}")
        raise AssertionError("unreachable: abort raises")  # pragma: no cover


    def _fold(self, subject: str, method: str, via: str) -> int | None:
        """None when this denial is folded into the window's record; else how many were folded
        since the last record of (subject, method, transport)."""
        return self._denied((subject, method, via))


Admit = Callable[[str, Context], Awaitable[Principal]]


def _wrap(handler: grpc.RpcMethodHandler[Req, Resp], method: str, admit: Admit,
          streams: OpenStreams) -> grpc.RpcMethodHandler[Req, Resp]:
    """The same handler, behind `admit` and with the caller set for its whole run."""
    parse, serialize = handler.request_deserializer, handler.response_serializer
    behaviour = behaviours(handler)
    if behaviour.unary_unary is not None:
        inner_uu = behaviour.unary_unary

        async def unary_unary(request: object, context: Context) -> object:
            _CURRENT.set(await admit(method, context))
            return await inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, parse, serialize)
    if behaviour.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            _streaming(behaviour.unary_stream, method, admit, streams), parse, serialize)
    if behaviour.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(
            _streaming(behaviour.stream_stream, method, admit, streams), parse, serialize)
    inner_su = behaviour.stream_unary
    assert inner_su is not None  # a handler has one behaviour

    async def stream_unary(requests: object, context: Context) -> object:
        _CURRENT.set(await admit(method, context))
        return await inner_su(requests, context)

    return grpc.stream_unary_rpc_method_handler(stream_unary, parse, serialize)


def _streaming(inner: Streaming, method: str, admit: Admit,
               streams: OpenStreams) -> Callable[[object, Context], Awaitable[object]]:
    """A response-streaming behavior: an async generator (yields answers) or a coroutine that writes
    with context.write (collector/ingest.py's Connect). Either runs as a coroutine registered in
    `streams` (a generator's answers written by it), so a revocation can end it at any await."""
    if is_generator(inner):
        async def generator(request: object, context: Context) -> None:
            who = await admit(method, context)
            _CURRENT.set(who)
            await streams.run(who, method, context, lambda ctx: streams.write_all(inner(request, ctx), ctx))

        return generator

    async def coroutine(request: object, context: Context) -> object:
        who = await admit(method, context)
        _CURRENT.set(who)
        return await streams.run(who, method, context, lambda ctx: inner(request, ctx))

    return coroutine
