"""The sender thread of a StreamSink (tracer/stream.py): connections, reconnects and flow control.

The split follows the threads. stream.py is what the tracer's loop calls (emit, close, stats);
`StreamSender` is everything the one sender thread does, as stream.proto says:

    connect -> Hello -> Welcome (drop spool <= acked_seq) -> Snapshot(seq = last assigned)
    -> the spool's unacknowledged events -> live EventBatches: at once on an idle link, else at
    max_batch_events or FLUSH_S after their first event, at most WINDOW_BATCHES unacknowledged
    -> Heartbeat after heartbeat_s of silence

reading Acks (trim the spool) and Commands (CRI relay, answered on the same stream) through the
StreamSession's receiver thread. A lost stream is retried with jittered exponential backoff.
What the two sides share is one `Outbox`: the spool, the seq counter and the counters, under its lock.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from ghostgpu.tracer.config import TracerConfig
from ghostgpu.tracer.cri_relay import CommandRunner
from ghostgpu.tracer.records import notice_record
from ghostgpu.tracer.spool import Spool, encode_event, encode_events_message
from ghostgpu.tracer.stream_session import StreamSession

from ghostgpu import __version__
from ghostgpu.common.model.consumers import Consumer, ConsumerKey
from ghostgpu.common.model.records import AllocationsRecord, InfoRecord, Record
from ghostgpu.common.system.settings import default_of
from ghostgpu.common.transport.dial import CollectorRefused, CollectorUnresolved
from ghostgpu.common.transport.tls import TlsFiles
from ghostgpu.common.transport.tls_explain import explain_connect_failure
from ghostgpu.common.wire import protocol
from ghostgpu.v1 import stream_pb2

log = logging.getLogger("ghostgpu.stream")

FLUSH_S = 0.010  # a batch leaves at most this long after its first event (while the window is open)
WINDOW_BATCHES = 4  # unacknowledged at once: a collector behind gets fewer, larger, cheaper batches
MAX_BATCH_BYTES = protocol.MAX_MESSAGE_BYTES // 2  # a batch of long command lines still fits a message
COMMAND_REPLY_S = 5.0  # a command's answer that cannot be queued this soon is dropped (the collector retries)


def _spool_events() -> int:
    return int(default_of(TracerConfig, "spool_events"))


@dataclass(frozen=True)
class StreamOptions:
    """The stream's settings, a slice of TracerConfig (spool_events, tls, collector_uid: tracer/node.py
    passes them), and its protocol timings, which are no setting (tests shorten them)."""

    spool_events: int = field(default_factory=_spool_events)  # --spool-events: TracerConfig's default
    heartbeat_s: float = 5.0  # a Heartbeat after this much silence
    backoff_min_s: float = 0.1  # reconnect delay, doubling (with jitter) up to backoff_max_s
    backoff_max_s: float = 5.0
    welcome_timeout_s: float = 10.0
    ack_timeout_s: float = 30.0  # a batch unacknowledged this long means a dead connection: reconnect
    info_wait_s: float = 30.0  # wait this long for the agent's first `info` (its bpf/nvml go into Hello)
    close_deadline_s: float = 2.0  # close() flushes for at most this long
    tls: TlsFiles | None = None  # mTLS to the collector (docs/SECURITY.md); None: plaintext
    collector_uid: int | None = None  # who besides root may serve a plaintext collector (dial.py)


class Outbox:
    """What a StreamSink's callers (emit, emit_trace, stats, the snapshot) and its sender thread
    share, every field guarded by `lock`: the seq counter, the spool, the trace batches waiting
    behind the events, the state a Snapshot is made of, and the counters stats() reports."""

    __slots__ = ("allocations", "batches_sent", "closed", "connect_failures", "connected", "consumers",
                 "dropped_unreported", "events_sent", "first_pending_s", "info", "lock", "max_batch",
                 "overflowing", "seq", "spool", "trace_out", "welcomes")

    def __init__(self, spool_events: int) -> None:
        self.lock = threading.Lock()
        self.seq = 0  # the last seq assigned
        self.spool = Spool(spool_events)
        self.first_pending_s = 0.0  # monotonic time of the oldest record not yet encoded
        self.max_batch = protocol.MAX_BATCH_EVENTS  # until a Welcome says otherwise
        self.dropped_unreported = 0  # spool drops not yet reported in a notice
        self.overflowing = self.closed = self.connected = False
        self.welcomes = self.connect_failures = self.events_sent = self.batches_sent = 0
        self.trace_out: deque[bytes] = deque()  # TraceBatch messages, sent after the events before them
        # The Snapshot's table, kept as records are emitted (so it matches seq); `info` also fills Hello.
        self.consumers: dict[ConsumerKey, Consumer] = {}
        self.info: InfoRecord | None = None
        self.allocations: AllocationsRecord | None = None


class StreamSender:
    """The sender thread (`run`) and the receiver callbacks of one StreamSink, sharing its Outbox.
    What the sink alone knows comes in as calls: the Snapshot (built under the lock that assigns
    seqs), the TracerStats, and `report`, which emits a record past the spool's bound."""

    def __init__(self, target: str, node: str, options: StreamOptions, out: Outbox, *, wake: threading.Event,
                 commands: CommandRunner, instance_id: str, boot_id: str, capabilities: list[str],
                 snapshot: Callable[[], stream_pb2.Snapshot],
                 tracer_stats: Callable[[], stream_pb2.TracerStats],
                 report: Callable[[Record], None]) -> None:
        self.target = target
        self.node = node
        self.options = options
        self._out = out
        self._wake = wake  # set by emit (a batch's first event, a full batch), acks and close()
        self._commands = commands
        self._instance_id = instance_id
        self._boot_id = boot_id
        self._capabilities = capabilities
        self._snapshot = snapshot
        self._tracer_stats = tracer_stats
        self._report = report
        self._backoff_s = options.backoff_min_s
        self.stopping = threading.Event()
        self._deadline_s = float("inf")
        self._down_logged = False
        self._refusal_logged = ""
        self.on_reconnect: Callable[[], None] | None = None

    def stop(self, deadline_s: float) -> None:
        """Flush until `deadline_s` (monotonic), then end the thread."""
        self._deadline_s = deadline_s
        self.stopping.set()
        self._wake.set()

    def run(self) -> None:
        try:
            self._idle_until(time.monotonic() + self.options.info_wait_s, lambda: self._out.info is not None)
            outcome = ""
            while not self.stopping.is_set():
                outcome = self._attempt()
                if outcome != "stopped" and not self.stopping.is_set():
                    self._backoff()
            # One last try to hand over what is spooled, unless the collector refused this tracer
            # (a version it does not speak, a certificate or policy that keeps it out): the answer
            # would be the same, and the collector would audit one more refusal.
            if (outcome != "stopped" and len(self._out.spool) and time.monotonic() < self._deadline_s
                    and not self._refusal_logged):
                self._attempt()
        except Exception:
            log.exception("stream to the collector at %s stopped unexpectedly", self.target)

    def _idle_until(self, until_s: float, done: Callable[[], bool] = lambda: False) -> None:
        """Wait (encoding what arrives, so the spool stays compact) until a time, `done`, or close()."""
        out = self._out
        while not self.stopping.is_set() and not done():
            self._wake.clear()
            now = time.monotonic()
            if now >= until_s:
                return
            timeout = until_s - now
            with out.lock:
                if out.spool.pending:
                    full = len(out.spool.pending) >= out.max_batch
                    timeout = 0 if full else min(timeout, max(out.first_pending_s + FLUSH_S - now, 0))
            if timeout <= 0:
                self._encode_pending()
                continue
            self._wake.wait(timeout)

    def _backoff(self) -> None:
        delay = self._backoff_s * random.uniform(0.5, 1.0)  # jitter: tracers of one cluster spread out
        self._backoff_s = min(self._backoff_s * 2, self.options.backoff_max_s)
        self._idle_until(time.monotonic() + delay)

    def _encode_pending(self) -> None:
        """Records -> NodeEvent bytes, a batch at a time, outside the lock so emit() never waits long."""
        out = self._out
        while True:
            with out.lock:
                taken = out.spool.take_pending(out.max_batch)
                if out.spool.pending:
                    out.first_pending_s = time.monotonic()
            if not taken:
                return
            encoded = [(seq, encode_event(seq, rec)) for seq, rec in taken]
            with out.lock:
                out.spool.put_encoded(len(taken), encoded)

    def _hello(self) -> bytes:
        caps = list(self._capabilities)
        info = self._out.info
        if info is not None:
            # "trace": sessions run wherever the kernel side does (refused with a reason otherwise);
            # "trace-confine": it checks TraceStart.pid_containers (a caller who is not admin)
            caps[:0] = [name for name, on in (("bpf", info.bpf), ("nvml", info.nvml), ("trace", info.bpf),
                                              ("trace-confine", info.bpf)) if on]
        hello = stream_pb2.Hello(api_version=protocol.API_VERSION, node=self.node, boot_id=self._boot_id,
                                 instance_id=self._instance_id, tracer_version=__version__, capabilities=caps)
        return stream_pb2.TracerMessage(hello=hello).SerializeToString()

    def _attempt(self) -> str:
        """One connection, from Hello to its end: "failed", "lost" or "stopped" (flushed on close)."""
        out = self._out
        session = StreamSession(self.target, self._on_ack, self._on_command, self._wake, self.options.tls,
                                collector_uid=self.options.collector_uid)
        try:
            try:
                session.open(self._hello())
            except CollectorRefused as exc:  # a collector another local user serves: nothing sent
                with out.lock:
                    out.connect_failures += 1
                if str(exc) != self._refusal_logged:
                    log.error("%s; retrying", exc)
                    self._refusal_logged = str(exc)
                self._backoff_s = self.options.backoff_max_s
                return "failed"
            except CollectorUnresolved as exc:  # no name of a --collector list resolves now: said once
                with out.lock:
                    out.connect_failures += 1
                if not self._down_logged:
                    log.warning("%s; spooling events and retrying", exc)
                    self._down_logged = True
                return "failed"
            except Exception as exc:  # e.g. a target gRPC cannot parse: say so, retry like any failure
                log.warning("cannot open a stream to the collector at %s: %s", self.target, exc)
                return "failed"
            timeout_s = self.options.welcome_timeout_s
            if self.stopping.is_set():
                timeout_s = max(0.0, self._deadline_s - time.monotonic())
            welcome = session.wait_welcome(
                timeout_s, lambda: self.stopping.is_set() and time.monotonic() >= self._deadline_s)
            if welcome is None:
                self._connect_failed(session)
                return "failed"
            if not self._on_welcome(welcome):  # a Welcome in an API version we do not speak (logged)
                with out.lock:
                    out.connect_failures += 1
                return "failed"
            snap = self._snapshot()
            session.put(stream_pb2.TracerMessage(snapshot=snap).SerializeToString(), self._put_deadline())
            return self._pump(session)
        finally:
            session.close(graceful=self.stopping.is_set())
            with out.lock:
                out.connected = False
                out.spool.requeue()

    def _connect_failed(self, session: StreamSession) -> None:
        with self._out.lock:
            self._out.connect_failures += 1
        code, details = session.error_code(), session.error_details()
        if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED):
            # Version skew, or a certificate or policy that does not let this node in: nothing
            # changes until someone acts, so say it once and come back rarely; never crash over it.
            line = (f"collector at {self.target} refused this tracer (ghostgpu {__version__}, API "
                    f"v{protocol.API_VERSION}): {details}")
            if line != self._refusal_logged:
                log.error("%s", line)
                self._refusal_logged = line
            self._backoff_s = self.options.backoff_max_s
        elif not self._down_logged:
            what = code.name if code is not None else "no Welcome"
            tls = self.options.tls or TlsFiles(None, None, None)
            # A TLS mismatch (plaintext against TLS, an untrusted or refused certificate) reads as
            # UNAVAILABLE "Socket closed": name the cause and the flag instead.
            why = explain_connect_failure(self.target, tls, details or "") if code is not None else None
            log.warning("collector at %s not reachable (%s: %s); spooling events and retrying", self.target,
                        what, why or details or f"no answer within {self.options.welcome_timeout_s:g} s")
            self._down_logged = True

    def _on_welcome(self, welcome: stream_pb2.Welcome) -> bool:
        out = self._out
        if welcome.api_version not in protocol.SUPPORTED_API_VERSIONS:
            log.error("collector at %s speaks ghostgpu API v%d, this tracer (ghostgpu %s) speaks v%d; run "
                      "matching versions of ghostgpu", self.target, welcome.api_version, __version__,
                      protocol.API_VERSION)
            self._backoff_s = self.options.backoff_max_s
            return False
        with out.lock:
            out.max_batch = welcome.max_batch_events or protocol.MAX_BATCH_EVENTS
            out.spool.ack(min(welcome.acked_seq, out.seq))
            out.connected = True
            out.welcomes += 1
        self._backoff_s = self.options.backoff_min_s
        self._down_logged = False
        self._refusal_logged = ""
        if out.welcomes > 1 and self.on_reconnect is not None:
            # The collector ended what ran over the lost stream (trace sessions: "node lost").
            try:
                self.on_reconnect()
            except Exception:
                log.exception("reconnect hook failed")
        log.info("streaming to the collector at %s (acked seq %d)", self.target, welcome.acked_seq)
        self._report_overflow()
        return True

    def _report_overflow(self) -> None:
        """Events the spool dropped, said once the collector is back (as a notice it stores, too)."""
        out = self._out
        with out.lock:
            lost, out.dropped_unreported = out.dropped_unreported, 0
            out.overflowing = False
        if lost:
            events = "event" if lost == 1 else "events"
            message = f"spool overflow: {lost} {events} lost while the collector at {self.target} was away"
            log.warning("%s", message)
            self._report(notice_record(self.node, "stream.spool_overflow", message))

    def _put_deadline(self) -> float:
        return self._deadline_s if self.stopping.is_set() else float("inf")

    def _pump(self, session: StreamSession) -> str:
        """Live batches, resends, heartbeats and the ack watchdog until the stream ends or close()."""
        out = self._out
        while True:
            if session.ended.is_set():
                self._lost(session)
                return "lost"
            self._wake.clear()
            now = time.monotonic()
            stopping = self.stopping.is_set()
            with out.lock:
                n_pending, first = len(out.spool.pending), out.first_pending_s
                n_unsent, n_inflight = len(out.spool.unsent), len(out.spool.inflight)
                overflowed = out.dropped_unreported and len(out.spool) < out.spool.capacity
            if stopping and (now >= self._deadline_s or not (n_pending or n_unsent or n_inflight
                                                             or out.trace_out)):
                return "stopped"
            if overflowed:  # the collector fell behind while connected and has caught up again
                self._report_overflow()
                continue
            # An idle link (nothing in flight) sends a lone finding at once, for detection latency;
            # while batches await their acks, new events gather for up to FLUSH_S, and for as long
            # as the window is full (an ack wakes us).
            window = session.inflight_batches() < WINDOW_BATCHES
            due = window and (n_pending >= out.max_batch or now - first >= FLUSH_S)
            if n_unsent or (n_pending and (stopping or n_inflight == 0 or due)):
                self._encode_pending()
                self._send_unsent(session)
                continue
            if self._send_trace(session):  # only now: every event emitted before it is on the stream
                continue
            oldest = session.oldest_unacked_s()
            if oldest is not None and now - oldest > self.options.ack_timeout_s:
                log.warning("collector at %s acknowledged nothing for %g s; reconnecting", self.target,
                            self.options.ack_timeout_s)
                return "lost"
            if now - session.last_send_s >= self.options.heartbeat_s:
                hb = stream_pb2.Heartbeat(ts_unix_ns=time.time_ns(), last_seq=out.seq,
                                          stats=self._tracer_stats())
                session.put(stream_pb2.TracerMessage(heartbeat=hb).SerializeToString(), self._put_deadline())
                continue
            timeouts = [session.last_send_s + self.options.heartbeat_s - now]
            if n_pending and window:
                timeouts.append(first + FLUSH_S - now)
            if oldest is not None:
                timeouts.append(oldest + self.options.ack_timeout_s - now)
            if stopping:
                timeouts.append(self._deadline_s - now)
            self._wake.wait(max(0.0, min(timeouts)))

    def _send_unsent(self, session: StreamSession) -> None:
        out = self._out
        while not session.ended.is_set():
            with out.lock:
                batch = out.spool.take_unsent(out.max_batch, MAX_BATCH_BYTES)
            if not batch:
                return
            session.sent(batch[-1][0])
            if not session.put(encode_events_message([data for _, data in batch]), self._put_deadline()):
                return  # the stream ended (or close() ran out of time): requeued on teardown
            with out.lock:
                out.events_sent += len(batch)
                out.batches_sent += 1

    def _send_trace(self, session: StreamSession) -> bool:
        """Hand one queued TraceBatch to the stream if no event is waiting ahead of it."""
        out = self._out
        with out.lock:
            if not out.trace_out or out.spool.pending or out.spool.unsent:
                return False
            data = out.trace_out.popleft()
        if not session.put(data, self._put_deadline()):
            with out.lock:
                out.trace_out.appendleft(data)  # the stream ended: the next connection sends it
            return False
        return True

    def _lost(self, session: StreamSession) -> None:
        code, details = session.error_code(), session.error_details()
        log.warning("lost the collector at %s (%s: %s); spooling events and reconnecting", self.target,
                    code.name if code is not None else "stream ended", details)
        self._down_logged = True

    # --- the receiver thread (StreamSession) ------------------------------------------------

    def _on_ack(self, session: StreamSession, seq: int) -> None:
        out = self._out
        with out.lock:
            out.spool.ack(min(seq, out.seq))
            waiting = bool(out.spool.pending)  # events held back while the window was full
        session.acked(seq)
        if waiting or self.stopping.is_set():
            self._wake.set()  # close() waits for the last acks

    def _on_command(self, session: StreamSession, command: stream_pb2.Command) -> None:
        self._commands.submit(command, lambda result: session.put(
            stream_pb2.TracerMessage(result=result).SerializeToString(), time.monotonic() + COMMAND_REPLY_S))
