"""A one-method gRPC server (`/t.T/Who`, bytes in and out) on its own thread and event loop, for tests
that look at who the server sees calling: the handler gets the real ServicerContext."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc

WHO = "/t.T/Who"
Handler = Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]


@contextlib.contextmanager
def who_server(address: str, who: Handler, start_timeout_s: float = 10.0) -> Iterator[None]:
    """Serve `who` as WHO, plaintext, on `address` (e.g. a UnixGate's internal address) until exit."""
    started = threading.Event()
    held: dict[str, Any] = {}

    async def serve() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "t.T", {"Who": grpc.unary_unary_rpc_method_handler(who)}),))
        server.add_insecure_port(address)
        await server.start()
        done = asyncio.Event()
        held.update(done=done, loop=asyncio.get_running_loop())
        started.set()
        await done.wait()
        await server.stop(None)

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert started.wait(start_timeout_s), f"the Who server on {address} did not start"
    try:
        yield
    finally:
        held["loop"].call_soon_threadsafe(held["done"].set)
        thread.join(start_timeout_s)
