"""A scripted NodeStream collector on a real socket (loopback TCP or unix), for the tracer's stream tests.

It follows the collector's side of the protocol as far as a tracer can tell (Welcome with
acked_seq and max_batch_events, cumulative Acks after each batch, Commands) and records every
message it receives with the connection it came on. A test scripts it while it runs: hold the
Welcome (`gate`), answer a chosen acked_seq, stop acknowledging past a seq (`ack_limit`), refuse
with FAILED_PRECONDITION (`refuse`), send commands; `stop()`/`start()` on the same port is a
collector restart.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from ghostgpu.v1 import stream_pb2, stream_pb2_grpc


@dataclass
class Received:
    conn: int  # 1 for the first stream, 2 for the next, ...
    at_s: float  # time.monotonic() when it arrived
    msg: stream_pb2.TracerMessage


@dataclass
class Connection:
    number: int
    metadata: dict[str, str]
    out: queue.Queue[stream_pb2.CollectorMessage | None] = field(default_factory=queue.Queue)


class FakeCollector(stream_pb2_grpc.NodeStreamServicer):
    def __init__(self, address: str = "127.0.0.1:0") -> None:
        self.address = address  # HOST:0 until start() picks the port
        self.gate = threading.Event()
        self.gate.set()
        self.welcome_acked_seq = 0
        self.max_batch_events = 2000
        self.ack_limit: int | None = None  # acknowledge at most up to this seq
        self.refuse: str | None = None  # FAILED_PRECONDITION with this message
        self.received: list[Received] = []
        self.connections: list[Connection] = []
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None

    @property
    def target(self) -> str:
        return self.address

    def start(self) -> FakeCollector:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        stream_pb2_grpc.add_NodeStreamServicer_to_server(self, server)
        port = server.add_insecure_port(self.address)
        if not port:
            raise RuntimeError(f"cannot listen on {self.address}")
        if not self.address.startswith("unix:"):
            self.address = f"{self.address.rpartition(':')[0]}:{port}"
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait(5)
            self._server = None

    def Connect(self, request_iterator: Iterator[stream_pb2.TracerMessage],
                context: grpc.ServicerContext) -> Iterator[stream_pb2.CollectorMessage]:
        with self._lock:
            conn = Connection(len(self.connections) + 1, dict(context.invocation_metadata()))
            self.connections.append(conn)
        context.add_callback(lambda: conn.out.put(None))  # unblock the writer when the RPC ends
        first = next(request_iterator)
        self._record(conn, first)
        if self.refuse is not None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.refuse)
        if not self.gate.wait(30):
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "test gate never opened")
        yield stream_pb2.CollectorMessage(welcome=stream_pb2.Welcome(
            api_version=1, collector_version="fake", acked_seq=self.welcome_acked_seq,
            max_batch_events=self.max_batch_events))
        threading.Thread(target=self._read, args=(conn, request_iterator), daemon=True).start()
        while True:
            item = conn.out.get()
            if item is None:
                return
            yield item

    def _read(self, conn: Connection, requests: Iterator[stream_pb2.TracerMessage]) -> None:
        try:
            for msg in requests:
                self._record(conn, msg)
                if msg.WhichOneof("msg") == "events" and msg.events.events:
                    last = msg.events.events[-1].seq
                    if self.ack_limit is not None:
                        last = min(last, self.ack_limit)
                    conn.out.put(stream_pb2.CollectorMessage(ack=stream_pb2.Ack(seq=last)))
        except grpc.RpcError:
            pass
        finally:
            conn.out.put(None)

    def _record(self, conn: Connection, msg: stream_pb2.TracerMessage) -> None:
        with self._lock:
            self.received.append(Received(conn.number, time.monotonic(), msg))

    def ack(self, seq: int) -> None:
        """Acknowledge up to seq on the newest connection (with ack_limit holding acks back)."""
        with self._lock:
            conn = self.connections[-1]
        conn.out.put(stream_pb2.CollectorMessage(ack=stream_pb2.Ack(seq=seq)))

    def send_command(self, command: stream_pb2.Command) -> None:
        """To the newest connection."""
        with self._lock:
            conn = self.connections[-1]
        conn.out.put(stream_pb2.CollectorMessage(command=command))

    # --- what arrived ------------------------------------------------------------------------

    def messages(self, kind: str, conn: int | None = None) -> list[Received]:
        with self._lock:
            return [r for r in self.received
                    if r.msg.WhichOneof("msg") == kind and (conn is None or r.conn == conn)]

    def events(self, conn: int | None = None) -> list[stream_pb2.NodeEvent]:
        return [ev for r in self.messages("events", conn) for ev in r.msg.events.events]

    def seqs(self, conn: int | None = None) -> list[int]:
        return [ev.seq for ev in self.events(conn)]

    def __enter__(self) -> FakeCollector:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
