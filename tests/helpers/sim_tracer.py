"""A simulated tracer: a real gRPC client speaking NodeStream.Connect directly.

It sends Hello, Snapshots, EventBatches and Heartbeats as a node tracer would, records the
Welcome and the Acks, and answers the collector's CRI relay Commands from a canned table or a
callable (refusing methods outside the read-only list, as the real tracer does). Messages go out
as bytes, so a test can also send malformed ones, and a benchmark can serialize its batches
beforehand (`synthetic_batches`) and push them with a window of unacknowledged batches.

Trace sessions (docs/TRACE.md): a sim tracer whose capabilities include "trace" answers
trace_start, trace_update and trace_stop Commands (every one is kept in `trace_commands`; the
answer's error line comes from `trace_errors[kind]`, "" by default; `trace_silent` answers none),
and on trace_stop sends the session's last batch (`ended`, "stopped") as the real tracer does.
`send_trace()` sends a TraceBatch of records (`trace_record()` builds one; seqs are numbered per
session), `end_trace()` a session's last batch, `wait_trace_command()` waits for a command.

Remediation: a sim tracer whose capabilities include "remediation" answers RemediateCommands with
`remediate_answer` (each one kept in `remediate_commands`).
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import grpc
from ghostgpu.tracer.cri_relay import ALLOWED_METHODS
from google.protobuf.message import Message

from ghostgpu.common.model.consumers import Consumer, ConsumerClass
from ghostgpu.common.transport.dial import open_channel
from ghostgpu.common.transport.tls import TlsFiles
from ghostgpu.common.wire.convert import consumer_to_proto
from ghostgpu.common.wire.protocol import API_VERSION, API_VERSION_METADATA, channel_options
from ghostgpu.v1 import node_pb2, stream_pb2, trace_pb2

METHOD = "/ghostgpu.v1.NodeStream/Connect"
CriAnswer = Callable[[str, bytes], tuple[int, str, bytes]]  # (method, request) -> (code, message, response)
CriTable = Mapping[str, "bytes | Message | tuple[int, str]"]
SIM_ENDPOINT = "unix:///run/sim/cri.sock"


class StreamEnded(AssertionError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"stream ended: {code.name}: {details}")
        self.code, self.details = code, details


def make_consumer(node: str, pid: int, gpu: int = 0, cls: ConsumerClass = ConsumerClass.HIDDEN,
                  container_id: str = "", **fields: Any) -> Consumer:
    """A plausible consumer of a container process on /dev/nvidia{gpu}."""
    cgroup = (f"/kubepods.slice/kubepods-pod{pid}.slice/cri-containerd-{container_id}.scope"
              if container_id else "/system.slice/train.service")
    base = Consumer(
        node=node, pid=pid, ns_pid=1 if container_id else pid, comm="python3", gpu=gpu,
        gpu_uuid=f"GPU-{gpu:08x}-0000-4000-8000-000000000000", gpu_minor=gpu,
        devices=[f"/dev/nvidia{gpu}", "/dev/nvidiactl", "/dev/nvidia-uvm"], container_id=container_id,
        pod_uid="", runtime="containerd" if container_id else "", cls=cls, reason=f"{cls} by the sim tracer",
        gpu_memory_bytes=None, exe="/usr/bin/python3.11", cmdline="python3 train.py --epochs 90", uid=1000,
        ppid=1, state="S", start_time_ns=pid * 1_000_000, first_seen_ns=pid * 2_000_000, fds=[5, 6, 7],
        cgroup_path=cgroup,
    )
    return replace(base, **fields)


def finding(seq: int, consumer: Consumer, ts_unix_ns: int = 0) -> stream_pb2.NodeEvent:
    return stream_pb2.NodeEvent(seq=seq, ts_unix_ns=ts_unix_ns or time.time_ns(),
                                finding=consumer_to_proto(consumer))


def resolved(seq: int, consumer: Consumer) -> stream_pb2.NodeEvent:
    return stream_pb2.NodeEvent(seq=seq, ts_unix_ns=time.time_ns(), resolved=consumer_to_proto(consumer))


def holder(seq: int, pid: int, container_id: str = "", kind: int = node_pb2.HolderEvent.KIND_OPEN,
           device: str = "/dev/nvidia0", ts_unix_ns: int = 0) -> stream_pb2.NodeEvent:
    cgroup = (f"/kubepods.slice/kubepods-podx.slice/cri-containerd-{container_id}.scope"
              if container_id else "")
    process = node_pb2.Process(pid=pid, ns_pid=1, comm="python3", container_id=container_id,
                               runtime="containerd" if container_id else "", cgroup_path=cgroup, alive=True)
    h = node_pb2.HolderEvent(kind=kind, source="bpf", ts_ns=seq * 1000, process=process, device=device, fd=5,
                             cgroup_id=4242)  # type: ignore[arg-type]
    return stream_pb2.NodeEvent(seq=seq, ts_unix_ns=ts_unix_ns or time.time_ns(), holder=h)


def allocations(rows: Sequence[tuple[str, str, str, Sequence[str]]], available: bool = True,
                error: str = "") -> stream_pb2.Allocations:
    return stream_pb2.Allocations(available=available, error=error, read_unix_ns=time.time_ns(), containers=[
        stream_pb2.ContainerAllocation(namespace=ns, pod=pod, container=c, resource_names=["nvidia.com/gpu"],
                                       device_ids=list(ids)) for ns, pod, c, ids in rows])


def trace_record(kind: str = "ioctl", container_id: str = "", pid: int = 4242, **fields: Any,
                 ) -> trace_pb2.TraceRecord:
    """A plausible traced call (RM_CONTROL on /dev/nvidia0); seq 0 lets send_trace() number it."""
    base: dict[str, Any] = {"ts_unix_ns": time.time_ns(), "kind": kind, "pid": pid, "tid": pid,
                            "container_id": container_id, "device": "/dev/nvidia0", "gpu": "0", "fd": 5,
                            "call": "RM_CONTROL" if kind == "ioctl" else kind, "comm": "python3"}
    if kind == "ioctl":
        base.update(request=0xC020462A, escape="NV_ESC_RM_CONTROL", cmd=0x20800110,
                    cmd_name="NV2080_CTRL_CMD_GPU_GET_INFO", nv_status=0, nv_status_name="NV_OK",
                    duration_ns=12_000)
    base.update(fields)
    return trace_pb2.TraceRecord(**base)


def _remediate_passes(cmd: stream_pb2.RemediateCommand) -> stream_pb2.RemediateResult:
    if cmd.dry_run:
        return stream_pb2.RemediateResult(incident=cmd.incident, outcome="proposed",
                                          reason="every check passed")
    return stream_pb2.RemediateResult(incident=cmd.incident, outcome="done", reason="ended after SIGTERM",
                                      signals=["SIGTERM"], released=True)


def message_bytes(**body: Any) -> bytes:
    """A serialized TracerMessage, e.g. message_bytes(events=stream_pb2.EventBatch(...))."""
    return stream_pb2.TracerMessage(**body).SerializeToString()


def batch_bytes(events: Sequence[stream_pb2.NodeEvent]) -> bytes:
    return message_bytes(events=stream_pb2.EventBatch(events=events))


def synthetic_batches(node: str, batches: int, batch_events: int, *, start_seq: int = 1, consumers: int = 20,
                      finding_every: int = 20) -> list[bytes]:
    """Serialized batches of holder events, one finding (a memory update of one of `consumers`
    hidden container consumers) every `finding_every` events, seqs from start_seq on."""
    pool = [make_consumer(node, 10_000 + i, gpu=i % 8, container_id=f"{i:02x}" * 32)
            for i in range(consumers)]
    out = []
    seq = start_seq
    for _ in range(batches):
        events = []
        for _ in range(batch_events):
            if finding_every and seq % finding_every == 0:
                c = pool[(seq // finding_every) % consumers]
                events.append(finding(seq, replace(c, gpu_memory_bytes=(seq % 97) << 20)))
            else:
                events.append(holder(seq, 10_000 + seq % consumers, pool[seq % consumers].container_id,
                                     device=f"/dev/nvidia{seq % 8}"))
            seq += 1
        out.append(batch_bytes(events))
    return out


class SimTracer:
    def __init__(self, target: str, node: str, *, boot_id: str = "sim-boot", instance_id: str | None = None,
                 api_version: int = API_VERSION, capabilities: Sequence[str] = ("cri-relay",),
                 cri: CriTable | CriAnswer | None = None, tracer_version: str = "sim-0.1",
                 max_send_bytes: int | None = None, tls: TlsFiles | None = None,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.target, self.node = target, node
        self.boot_id = boot_id
        self.instance_id = instance_id or uuid.uuid4().hex
        self.api_version = api_version
        self.capabilities = list(capabilities)
        self.cri = cri
        self.tracer_version = tracer_version
        self.welcome: stream_pb2.Welcome | None = None
        self.acked_seq = 0
        self.next_seq = 1
        self.status: tuple[grpc.StatusCode, str] | None = None  # set once the stream ended
        self.commands: list[tuple[str, bytes]] = []  # CRI calls the collector relayed through us
        self.trace_commands: list[stream_pb2.Command] = []  # trace_start/update/stop, in order
        self.trace_errors: dict[str, str] = {}  # command kind -> the error line to answer it with
        self.trace_silent = False  # answer no trace command (the collector's wait runs out)
        # Remediation (docs/REMEDIATION.md): with "remediation" in the capabilities, every RemediateCommand
        # is kept here and answered by `remediate_answer` (default: the re-check passes, the kill is done).
        self.remediate_commands: list[stream_pb2.RemediateCommand] = []
        self.remediate_answer: Callable[[stream_pb2.RemediateCommand], stream_pb2.RemediateResult] = \
            _remediate_passes
        self.trace_seq: dict[str, int] = {}  # session -> the last seq sent
        self._trace_totals: dict[str, dict[str, int]] = {}  # session -> its drop counters so far
        self._cond = threading.Condition()
        options = channel_options()
        if max_send_bytes is not None:  # to reach the collector's own limit, send past ours
            options = [o for o in options if o[0] != "grpc.max_send_message_length"]
            options.append(("grpc.max_send_message_length", max_send_bytes))
        # mTLS with `tls` (tests/helpers/certs.py); `credentials` skip our own checks of the files, to
        # show what the collector does with a certificate a real tracer would refuse to send.
        self._channel = (grpc.secure_channel(target, credentials, options) if credentials is not None
                         else open_channel(target, tls, options))
        self._out: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._call: Any = None
        self._reader: threading.Thread | None = None

    # ---- the stream -----------------------------------------------------------------------------

    def connect(self, timeout_s: float = 10.0, hello: bytes | None = None) -> stream_pb2.Welcome:
        """Open the stream and send Hello (or `hello` bytes); the Welcome, or StreamEnded."""
        self._out = queue.SimpleQueue()
        self.welcome, self.status = None, None
        stub = self._channel.stream_stream(METHOD, request_serializer=None,
                                           response_deserializer=stream_pb2.CollectorMessage.FromString)
        self._call = stub(self._requests(), metadata=[(API_VERSION_METADATA, str(self.api_version))])
        self._reader = threading.Thread(target=self._read, args=(self._call,), daemon=True,
                                        name=f"sim-{self.node}")
        self._reader.start()
        self.send(hello if hello is not None else message_bytes(hello=stream_pb2.Hello(
            api_version=self.api_version, node=self.node, boot_id=self.boot_id, instance_id=self.instance_id,
            tracer_version=self.tracer_version, capabilities=self.capabilities)))
        with self._cond:
            if not self._cond.wait_for(lambda: self.welcome is not None or self.status is not None,
                                       timeout_s):
                raise AssertionError(f"no Welcome from {self.target} within {timeout_s} s")
            if self.welcome is None:
                raise StreamEnded(*self.status)  # type: ignore[misc]
            self.acked_seq = self.welcome.acked_seq
            return self.welcome

    def _requests(self) -> Iterator[bytes]:
        out = self._out
        while (item := out.get()) is not None:
            yield item

    def _read(self, call: Any) -> None:
        try:
            for msg in call:
                kind = msg.WhichOneof("msg")
                with self._cond:
                    if kind == "welcome":
                        self.welcome = msg.welcome
                    elif kind == "ack":
                        self.acked_seq = max(self.acked_seq, msg.ack.seq)
                    self._cond.notify_all()
                if kind == "command":
                    self._answer(msg.command)
            status = (call.code(), call.details() or "")
        except grpc.RpcError as e:
            status = (e.code(), e.details() or "")  # type: ignore[attr-defined]
        with self._cond:
            self.status = status
            self._cond.notify_all()

    def _answer(self, command: stream_pb2.Command) -> None:
        body = command.WhichOneof("body") or ""
        if body.startswith("trace_") and "trace" in self.capabilities:
            self._answer_trace(command, body)
            return
        if body == "remediate" and "remediation" in self.capabilities:
            with self._cond:
                self.remediate_commands.append(command.remediate)
                self._cond.notify_all()
            result = self.remediate_answer(command.remediate)
            self.send(message_bytes(result=stream_pb2.CommandResult(id=command.id, remediate=result)))
            return
        if body != "cri":
            resp = stream_pb2.CriResponse(code=grpc.StatusCode.UNIMPLEMENTED.value[0],
                                          message="unknown command")
        else:
            req = command.cri
            self.commands.append((req.method, bytes(req.request)))
            code, message, response = self._cri_answer(req.method, bytes(req.request))
            resp = stream_pb2.CriResponse(code=code, message=message, response=response,
                                          endpoint=SIM_ENDPOINT)
        self.send(message_bytes(result=stream_pb2.CommandResult(id=command.id, cri=resp)))

    def _answer_trace(self, command: stream_pb2.Command, body: str) -> None:
        session = getattr(command, body).session
        with self._cond:
            self.trace_commands.append(command)
            self._cond.notify_all()
        if self.trace_silent:
            return
        error = self.trace_errors.get(body, "")
        result = trace_pb2.TraceCommandResult(session=session, error=error)
        self.send(message_bytes(result=stream_pb2.CommandResult(id=command.id, trace=result)))
        if body == "trace_stop" and not error:
            self.end_trace(session, "stopped")

    def _cri_answer(self, method: str, request: bytes) -> tuple[int, str, bytes]:
        if method not in ALLOWED_METHODS:  # the real tracer's list
            return grpc.StatusCode.PERMISSION_DENIED.value[0], f"CRI method {method} is not read-only", b""
        if self.cri is None:
            return (grpc.StatusCode.UNAVAILABLE.value[0],
                    f"no CRI socket on node {self.node} (looked at {SIM_ENDPOINT}); pass --cri-endpoint", b"")
        if callable(self.cri):
            return self.cri(method, request)
        answer = self.cri.get(method)
        if answer is None:
            return grpc.StatusCode.UNIMPLEMENTED.value[0], f"sim tracer has no canned {method}", b""
        if isinstance(answer, tuple):
            return answer[0], answer[1], b""
        return 0, "", answer if isinstance(answer, bytes) else answer.SerializeToString()

    # ---- sending --------------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        self._out.put(data)

    def send_snapshot(self, consumers: Sequence[Consumer] = (), seq: int | None = None,
                      allocations: stream_pb2.Allocations | None = None,
                      info: stream_pb2.NodeInfo | None = None,
                      stats: stream_pb2.TracerStats | None = None) -> None:
        snap = stream_pb2.Snapshot(seq=self.next_seq - 1 if seq is None else seq, ts_unix_ns=time.time_ns(),
                                   consumers=[consumer_to_proto(c) for c in consumers])
        for name, value in (("allocations", allocations), ("info", info), ("stats", stats)):
            if value is not None:
                getattr(snap, name).CopyFrom(value)
        self.send(message_bytes(snapshot=snap))

    def send_events(self, events: Sequence[stream_pb2.NodeEvent]) -> int:
        """Send one EventBatch; its last seq (next_seq moves past it)."""
        self.send(batch_bytes(events))
        last = events[-1].seq if events else 0
        self.next_seq = max(self.next_seq, last + 1)
        return last

    def heartbeat(self, stats: stream_pb2.TracerStats | None = None) -> None:
        hb = stream_pb2.Heartbeat(ts_unix_ns=time.time_ns(), last_seq=self.next_seq - 1)
        if stats is not None:
            hb.stats.CopyFrom(stats)
        self.send(message_bytes(heartbeat=hb))

    def push(self, batches: Sequence[bytes], last_seqs: Sequence[int], window: int = 8,
             timeout_s: float = 120.0) -> None:
        """Send pre-serialized batches keeping at most `window` unacknowledged; return once the
        last one is acknowledged."""
        deadline = time.monotonic() + timeout_s
        for i, data in enumerate(batches):
            if i >= window:
                self.wait_acked(last_seqs[i - window], max(0.0, deadline - time.monotonic()))
            self.send(data)
        if last_seqs:
            self.wait_acked(last_seqs[-1], max(0.0, deadline - time.monotonic()))
            self.next_seq = max(self.next_seq, last_seqs[-1] + 1)

    def send_trace(self, session: str, records: Sequence[trace_pb2.TraceRecord] = (), *, ended: bool = False,
                   end_reason: str = "", **totals: int) -> int:
        """Send one TraceBatch (records with seq 0 numbered on from the session's last); its last seq.
        `totals` (dropped_limit_total, dropped_ringbuf_total, dropped_transport_total) are running
        totals, as a tracer's: the session's last ones are sent again unless given."""
        kept = self._trace_totals.setdefault(session, {})
        kept.update(totals)
        batch = trace_pb2.TraceBatch(session=session, ended=ended, end_reason=end_reason, **kept)
        seq = self.trace_seq.get(session, 0)
        for r in records:
            m = batch.records.add()
            m.CopyFrom(r)
            if not m.seq:
                m.seq = seq + 1
            seq = m.seq
        self.trace_seq[session] = seq
        batch.records_total = seq
        self.send(message_bytes(trace=batch))
        return seq

    def end_trace(self, session: str, reason: str = "deadline") -> None:
        """The session's last batch on this node."""
        self.send_trace(session, ended=True, end_reason=reason)

    def wait_trace_command(self, kind: str, session: str | None = None, count: int = 1,
                           timeout_s: float = 10.0) -> stream_pb2.Command:
        """The count-th trace command of `kind` (trace_start, trace_update, trace_stop) received."""
        def found() -> list[stream_pb2.Command]:
            return [c for c in self.trace_commands if c.WhichOneof("body") == kind
                    and (session is None or getattr(c, kind).session == session)]

        with self._cond:
            if not self._cond.wait_for(lambda: len(found()) >= count, timeout_s):
                raise AssertionError(f"node {self.node}: no {kind} #{count} within {timeout_s} s "
                                     f"(got {[c.WhichOneof('body') for c in self.trace_commands]})")
            return found()[count - 1]

    # ---- waiting and closing --------------------------------------------------------------------

    def wait_acked(self, seq: int, timeout_s: float = 10.0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self.acked_seq >= seq or self.status is not None, timeout_s):
                raise AssertionError(f"node {self.node}: seq {seq} not acked within {timeout_s} s "
                                     f"(acked {self.acked_seq})")
            if self.acked_seq < seq:
                raise StreamEnded(*self.status)  # type: ignore[misc]

    def wait_ended(self, timeout_s: float = 10.0) -> tuple[grpc.StatusCode, str]:
        with self._cond:
            if not self._cond.wait_for(lambda: self.status is not None, timeout_s):
                raise AssertionError(f"node {self.node}: stream still open after {timeout_s} s")
            return self.status  # type: ignore[return-value]

    def close(self, timeout_s: float = 10.0) -> tuple[grpc.StatusCode, str]:
        """Half-close (the collector acks what it has and ends the stream); the final status."""
        self._out.put(None)
        return self.wait_ended(timeout_s)

    def cancel(self) -> None:
        """Drop the stream as a dying tracer does."""
        if self._call is not None:
            self._call.cancel()
        self._out.put(None)
        if self._reader is not None:
            self._reader.join(5.0)

    def stop(self) -> None:
        if self._call is not None and self.status is None:
            self.cancel()
        self._channel.close()

    def __enter__(self) -> SimTracer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
