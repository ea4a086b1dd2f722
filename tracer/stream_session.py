"""One NodeStream.Connect call: the gRPC plumbing under StreamSink, from Hello to the stream's end.

gRPC's synchronous bidirectional stream takes an iterator of requests, which a gRPC thread drains
into the connection one message at a time, and gives an iterator of answers. A StreamSession feeds the
first from a bounded queue (so a collector that stops reading pushes back instead of growing a
queue without end) and drains the second on its own receiver thread: Welcome, Acks and Commands,
handed to StreamSink's callbacks. Messages are passed as already serialized bytes (no request
serializer), which lets StreamSink build event batches from the spool's bytes without re-parsing.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from ghostgpu.common.transport.dial import open_channel
from ghostgpu.common.transport.tls import TlsFiles
from ghostgpu.common.wire import protocol
from ghostgpu.v1 import stream_pb2

log = logging.getLogger("ghostgpu.stream")

CONNECT_METHOD = "/ghostgpu.v1.NodeStream/Connect"
OUTQ_MAX = 16  # messages handed to gRPC and not yet written: at most 16 batches ahead of the socket
STALL_S = 30.0  # a collector that takes no message for this long is treated as gone
GRACEFUL_END_S = 0.5  # on close: how long the collector gets to end the stream after our half-close

AckFn = Callable[["StreamSession", int], None]
CommandFn = Callable[["StreamSession", stream_pb2.Command], None]


def read_boot_id(proc_root: str = "/proc") -> str:
    """Hello's boot_id: with the instance id, it tells the collector a reboot from a restart."""
    try:
        with open(f"{proc_root}/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class StreamSession:
    def __init__(self, target: str, on_ack: AckFn, on_command: CommandFn, wake: threading.Event,
                 tls: TlsFiles | None = None, collector_uid: int | None = None) -> None:
        self.tls = tls
        self.collector_uid = collector_uid
        self.target = target
        self._on_ack = on_ack
        self._on_command = on_command
        self._wake = wake
        self.outq: queue.Queue[bytes | None] = queue.Queue(maxsize=OUTQ_MAX)
        self.ended = threading.Event()  # the stream is over (error, server end, stall): tear down
        self._welcomed = threading.Event()
        self.welcome: stream_pb2.Welcome | None = None
        self.error: grpc.RpcError | None = None
        self.stalled = False
        self.last_send_s = time.monotonic()
        self._unacked: deque[tuple[int, float]] = deque()  # (last seq of a batch, when it was queued)
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._call: Any = None
        self._rx: threading.Thread | None = None

    def open(self, hello: bytes) -> None:
        # A fresh channel per attempt: a reused one keeps gRPC's own reconnect backoff (up to 120 s),
        # which would override ours after a collector restart. It also re-reads the TLS files, so a
        # rotated node certificate is used from the next connection on.
        # Plaintext: CollectorRefused (before anything is sent) when another local uid serves it.
        self._channel = open_channel(self.target, self.tls, protocol.channel_options(),
                                     collector_uid=self.collector_uid)
        connect: grpc.StreamStreamMultiCallable[bytes, stream_pb2.CollectorMessage]
        connect = self._channel.stream_stream(CONNECT_METHOD, request_serializer=None,
                                              response_deserializer=stream_pb2.CollectorMessage.FromString)
        self.outq.put(hello)
        self._call = connect(self._requests(),
                             metadata=((protocol.API_VERSION_METADATA, str(protocol.API_VERSION)),))
        self._rx = threading.Thread(target=self._receive, name="ghostgpu-stream-rx", daemon=True)
        self._rx.start()

    def _requests(self) -> Iterator[bytes]:
        while True:
            item = self.outq.get()
            if item is None:  # half-close (or the session is being torn down)
                return
            yield item

    def _receive(self) -> None:
        try:
            for msg in self._call:
                which = msg.WhichOneof("msg")
                if which == "welcome":
                    if self.welcome is None:
                        self.welcome = msg.welcome
                        self._welcomed.set()
                elif self.welcome is None:
                    continue  # nothing before Welcome counts: the collector has not placed us yet
                elif which == "ack":
                    self._on_ack(self, msg.ack.seq)
                elif which == "command":
                    self._on_command(self, msg.command)
        except grpc.RpcError as exc:
            self.error = exc
        except Exception:  # a callback bug must end this session, not hang the sender
            log.exception("stream receiver failed")
        finally:
            self.ended.set()
            self._welcomed.set()
            self._wake.set()

    def wait_welcome(self, timeout_s: float, give_up: Callable[[], bool]) -> stream_pb2.Welcome | None:
        deadline = time.monotonic() + timeout_s
        while not self._welcomed.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or give_up():
                return None
            self._welcomed.wait(min(left, 0.1))  # 0.1 s: how fast close() is noticed while connecting
        return self.welcome

    def put(self, data: bytes, deadline_s: float = float("inf")) -> bool:
        """Queue one message for the socket; False when the stream ended or the deadline passed.

        Blocks while the queue is full (the collector reads slower than we write). Nothing taken for
        STALL_S means the collector or the path to it is gone: the session ends and is retried.
        """
        stall_s = time.monotonic() + STALL_S
        while not self.ended.is_set():
            now = time.monotonic()
            if now >= deadline_s:
                return False
            if now >= stall_s:
                self.stalled = True
                self.ended.set()
                return False
            try:
                self.outq.put(data, timeout=min(0.1, deadline_s - now, stall_s - now))
            except queue.Full:
                continue
            self.last_send_s = time.monotonic()
            return True
        return False

    def sent(self, last_seq: int) -> None:
        with self._lock:
            self._unacked.append((last_seq, time.monotonic()))

    def acked(self, seq: int) -> None:
        with self._lock:
            while self._unacked and self._unacked[0][0] <= seq:
                self._unacked.popleft()

    def inflight_batches(self) -> int:
        with self._lock:
            return len(self._unacked)

    def oldest_unacked_s(self) -> float | None:
        with self._lock:
            return self._unacked[0][1] if self._unacked else None

    def error_code(self) -> grpc.StatusCode | None:
        if self.error is not None and hasattr(self.error, "code"):
            return self.error.code()
        return None

    def error_details(self) -> str:
        if self.stalled:
            return f"the collector took no message for {STALL_S:g} s"
        if self.error is not None and hasattr(self.error, "details"):
            return self.error.details() or ""
        return ""

    def close(self, graceful: bool) -> None:
        if self._call is not None:
            if graceful and not self.ended.is_set():
                try:
                    self.outq.put_nowait(None)  # half-close: the collector ends the stream in turn
                    self.ended.wait(GRACEFUL_END_S)
                except queue.Full:
                    pass
            self._call.cancel()
            # Unblock gRPC's request thread if it waits on an empty queue; a full queue means it is
            # not waiting there and stops on its own now that the call is cancelled.
            with contextlib.suppress(queue.Full):
                self.outq.put_nowait(None)
            if self._rx is not None:
                self._rx.join(5.0)
        if self._channel is not None:
            self._channel.close()
