"""grpc.aio's method handlers typed as grpc.aio calls them, for the collector's interceptors.

typeshed types `grpc.RpcMethodHandler` for sync grpc: a behaviour takes a `grpc.ServicerContext` and
returns the answer (or an iterator of answers). Under grpc.aio each behaviour is a coroutine function,
or an async generator function for a response stream, and takes a `grpc.aio.ServicerContext`. The
interceptors (collector/authz.py, collector/server.py) wrap the handlers of every method, so the
messages are `object` here: they pass through without being looked at.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias, TypeVar, cast

import grpc

if TYPE_CHECKING:
    from typing_extensions import TypeIs

Req = TypeVar("Req")
Resp = TypeVar("Resp")

# Quoted: grpc's classes take no type arguments at run time (typeshed's stubs add them).
# What an interceptor's intercept_service is handed: the next interceptor, or the handler lookup.
Handler: TypeAlias = "grpc.RpcMethodHandler[Req, Resp]"
Continuation: TypeAlias = "Callable[[grpc.HandlerCallDetails], Awaitable[Handler[Req, Resp] | None]]"
# A servicer context, whatever the method's messages.
Context: TypeAlias = "grpc.aio.ServicerContext[object, object]"
# unary_unary and stream_unary (whose first argument is the requests' async iterator): the answer.
Unary: TypeAlias = "Callable[[object, Context], Awaitable[object]]"
# unary_stream and stream_stream: an async generator function (yields the answers), or a coroutine
# function that writes them with context.write (collector/ingest.py's Connect).
Generator: TypeAlias = "Callable[[object, Context], AsyncGenerator[object, None]]"
Streaming: TypeAlias = "Generator | Unary"


@dataclass(frozen=True)
class Behaviours:
    """A handler's behaviours (the one that is not None serves the method)."""

    unary_unary: Unary | None
    unary_stream: Streaming | None
    stream_unary: Unary | None
    stream_stream: Streaming | None


def behaviours(handler: grpc.RpcMethodHandler[Req, Resp]) -> Behaviours:
    """The handler's behaviours as grpc.aio calls them (the one place the sync typing is set aside)."""
    return Behaviours(unary_unary=cast("Unary | None", handler.unary_unary),
                      unary_stream=cast("Streaming | None", handler.unary_stream),
                      stream_unary=cast("Unary | None", handler.stream_unary),
                      stream_stream=cast("Streaming | None", handler.stream_stream))


def is_generator(behaviour: Streaming) -> TypeIs[Generator]:
    """An async generator function (yields the answers), not a coroutine function that writes them."""
    return inspect.isasyncgenfunction(behaviour)
