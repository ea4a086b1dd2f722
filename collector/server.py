"""The collector's gRPC server: grpc.aio on one event loop, TCP and unix listeners.

Why asyncio rather than the thread-pool server: a tracer's stream lives as long as the tracer,
so a thread-pool server parks a worker thread per node for ever, and its pool must be sized to
the cluster. Holding 1,000 tracer streams, a bare echo server took 1,008 threads and 84 KiB per
stream on the thread-pool server against 8 threads and 52 KiB on grpc.aio
(bench/bench_collector_memory.py); for throughput with 50 tracers the two echo servers were
within noise of each other (bench/bench_ingest.py), both limited by the simulated tracers. On
the aio server a stream is two coroutines on the one loop that owns the collector's state.

Message size limits come from ghostgpu.common.wire.protocol: a larger message is refused by gRPC itself with
RESOURCE_EXHAUSTED. The query service checks the client's `ghostgpu-api-version` metadata
(missing = v1) and refuses an unsupported one with FAILED_PRECONDITION naming both versions.
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
from ghostgpu.collector.aio_handlers import Context, Continuation, Req, Resp, behaviours, is_generator
from ghostgpu.collector.tcpgate import HANDSHAKE_TIMEOUT_S
from google.protobuf.message import DecodeError

from ghostgpu.common.transport.addresses import grpc_listen, is_unix, unix_path
from ghostgpu.common.wire.protocol import (
    API_VERSION,
    API_VERSION_METADATA,
    MAX_ANSWER_BYTES,
    channel_options,
    version_mismatch,
)
from ghostgpu.v1 import query_pb2_grpc, stream_pb2

QUERY_PREFIX = "/ghostgpu.v1.Query/"
# What the collector sends may be larger than what it accepts: ListConsumers of a 1,000-node
# cluster with 20 consumers each is ~11 MB (bench/bench_collector_memory.py), past the 8 MiB
# MAX_MESSAGE_BYTES that bounds what tracers and clients send; clients receive MAX_ANSWER_BYTES.
SERVER_OPTIONS = [
    *[o for o in channel_options() if o[0] != "grpc.max_send_message_length"],
    ("grpc.max_send_message_length", MAX_ANSWER_BYTES),
    # Two collectors on one port must not share it silently (gRPC sets SO_REUSEPORT by default).
    ("grpc.so_reuseport", 0),
    # Find tracers that vanished without a FIN (node power loss) within a minute.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # A connection whose TLS handshake and HTTP/2 settings are not done within 10 s is closed (gRPC's
    # default is 120 s): what collector/tcpgate.py counts as unauthenticated lives no longer than this.
    ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_TIMEOUT_S * 1000)),
]


class ListenError(ValueError):
    """A --listen address that is malformed or cannot be bound: one line naming it."""


def check_listen(addr: str) -> str:
    """HOST:PORT (port 0 picks a free one), [IPv6]:PORT, or unix:///absolute/path; else ListenError."""
    return grpc_listen(addr, ListenError)


def _clear_stale_socket(path: str) -> None:
    """Remove a unix socket left by a collector that died, never one that is still served."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return
    except FileNotFoundError:
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)
        except OSError:
            pass
        else:
            raise ListenError(f"--listen unix://{path}: another process serves this socket; stop it or "
                              "pass another path")


def client_version_problem(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """None when the client's API version is supported (missing metadata means v1)."""
    value = next((v for k, v in metadata or () if k == API_VERSION_METADATA), None)
    if value is None:
        return None
    text = value.decode() if isinstance(value, bytes) else str(value)
    try:
        version = int(text)
    except ValueError:
        return (f"client sent {API_VERSION_METADATA} {text!r}, not a number; this collector speaks "
                f"ghostgpu API v{API_VERSION}")
    return version_mismatch(version, "client")


def _checked(handler: grpc.RpcMethodHandler[Req, Resp], method: str,
             problem: str | None) -> grpc.RpcMethodHandler[Req, Resp]:
    """The query handler on raw bytes: a client of an unsupported version (`problem`) is refused with
    FAILED_PRECONDITION, and a malformed request is INVALID_ARGUMENT, where gRPC's own deserializer
    would answer UNKNOWN ("Unexpected DecodeError"; grpcio 1.85 aio)."""
    parse, name = handler.request_deserializer, method.rpartition("/")[2]
    assert parse is not None  # every Query method has its request's FromString
    behaviour = behaviours(handler)

    async def request(raw: bytes, context: Context) -> Req:
        if problem is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        try:
            return parse(raw)
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"malformed {name} request ({len(raw)} bytes): {e}")

    serialize = handler.response_serializer
    if behaviour.unary_stream is not None:
        stream = behaviour.unary_stream
        assert is_generator(stream)  # the Query service's response streams are async generators

        async def serve_stream(raw: bytes, context: Context) -> AsyncIterator[object]:
            async for item in stream(await request(raw, context), context):
                yield item

        return grpc.unary_stream_rpc_method_handler(serve_stream, None, serialize)
    unary = behaviour.unary_unary
    assert unary is not None  # a Query method is unary or answers with a stream

    async def serve(raw: bytes, context: Context) -> object:
        return await unary(await request(raw, context), context)

    return grpc.unary_unary_rpc_method_handler(serve, None, serialize)


class ApiVersionInterceptor(grpc.aio.ServerInterceptor):
    """Refuses query calls from clients of an unsupported API version (the stream checks Hello), and
    parses the requests of the others itself (see _checked)."""

    async def intercept_service(
        self, continuation: Continuation[Req, Resp], handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Req, Resp] | None:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(QUERY_PREFIX):
            return handler
        problem = client_version_problem(handler_call_details.invocation_metadata)
        return _checked(handler, handler_call_details.method, problem)


async def start_server(connect: Callable[..., Any], query: Any, listen: Sequence[str],
                       security: Any) -> tuple[grpc.aio.Server, list[str]]:
    """Build, bind and start the server (on the running loop); (server, the bound addresses).
    `security` (collector/security.py) binds each listener (mTLS, plaintext, a unix socket behind
    SO_PEERCRED) and puts the authorization check in front of every method."""
    # The authorizer first: a caller without the role is refused before its request is even parsed.
    try:
        options = [*SERVER_OPTIONS, *security.server_options(list(listen))]
    except ValueError as e:  # SecurityError: a cap flag out of range, its own line
        raise ListenError(str(e)) from None
    server = grpc.aio.server(options=options,
                             interceptors=[security.authorizer, ApiVersionInterceptor()],
                             maximum_concurrent_rpcs=None)
    # Connect takes raw bytes: ingest parses them itself (see collector/ingest.py).
    stream_handler: grpc.RpcMethodHandler[bytes, stream_pb2.CollectorMessage]
    stream_handler = grpc.stream_stream_rpc_method_handler(
        connect, request_deserializer=None,
        response_serializer=stream_pb2.CollectorMessage.SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("ghostgpu.v1.NodeStream", {"Connect": stream_handler}),))
    query_pb2_grpc.add_QueryServicer_to_server(query, server)
    bound = []
    for addr in listen:
        check_listen(addr)
        if is_unix(addr):
            _clear_stale_socket(unix_path(addr))
        try:
            bound.append(security.bind(server, addr))
        except (RuntimeError, OSError) as e:
            await server.stop(None)
            raise ListenError(f"--listen {addr}: cannot listen there ({e}); pick a free port or a "
                              "writable socket path") from None
        except ValueError as e:  # SecurityError, TlsError: their own line
            await server.stop(None)
            raise ListenError(str(e)) from None
    await server.start()
    return server, bound
