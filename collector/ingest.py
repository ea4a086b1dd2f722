"""The NodeStream.Connect servicer: one bidirectional stream per tracer (proto/ghostgpu/v1/stream.proto).

Per stream, two coroutines on the collector's event loop: a reader that parses, validates and
applies what the tracer sends, and a writer that sends what the collector owes it (the Welcome,
Acks once the batch is committed, CRI relay Commands). Requests arrive as raw bytes: the servicer
parses them itself, so a malformed message is INVALID_ARGUMENT (gRPC's own deserializer would say
INTERNAL), and a batch whose events are all new is stored as the very bytes that came in.

The stream's rules: the first message must be a Hello of a supported API version naming a node;
a new Hello for a node replaces (aborts) its older stream, on this replica or, through the node's lease
(collector/leases.py), on another replica sharing the store: the Hello takes the lease (a new fencing
token) and reads the node's committed positions in that transaction, every write of the node carries
the token, and a write refused for a moved token ends the old stream (ABORTED, naming the move); a
batch is validated whole before anything changes; events at or below the stored seq are duplicates
(counted, not stored again); an Ack covers only committed events.

Trace sessions (docs/TRACE.md): TraceBatches and the answers to trace commands go to `traces`
(collector/traces.py's TraceBook, which reads the same `sessions`), which also hears every stream's
end, as a session running on a tracer whose stream ended has lost that node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from functools import partial
from typing import Any, Protocol

import grpc
from ghostgpu.collector.audit import AuditFn
from ghostgpu.collector.authz import DenialFold, current_principal
from ghostgpu.collector.cluster import ClusterTable
from ghostgpu.collector.db import db_errors
from ghostgpu.collector.faults import FaultBook, Taken
from ghostgpu.collector.leases import Leases, TakenLease
from ghostgpu.collector.nodes import BatchError, NodeView, validate_batch
from ghostgpu.collector.relay import CriRelayClient
from ghostgpu.collector.store import LeaseLost, Op, Position, Store, StoreError
from google.protobuf.message import DecodeError

from ghostgpu import __version__
from ghostgpu.common.model.names import node_name_problem, shown
from ghostgpu.common.transport.principal import Principal
from ghostgpu.common.wire.protocol import API_VERSION, MAX_BATCH_EVENTS, version_mismatch
from ghostgpu.v1 import stream_pb2, trace_pb2

log = logging.getLogger(__name__)

_ACK = object()
MAX_INFLIGHT_BATCHES = 32  # per stream, uncommitted: past it the reader waits (back-pressure on the tracer)
PENDING_BYTES_MAX = 64 << 20  # all streams: event bytes queued for the writer
_STORE_ERRORS: tuple[type[BaseException], ...] = (*db_errors(), StoreError)


class TraceSink(Protocol):
    """What ingest hands the trace session book (collector/traces.py)."""

    def batch(self, stream: IngestSession, tb: trace_pb2.TraceBatch) -> None: ...

    def answer(self, stream: IngestSession, result: stream_pb2.CommandResult) -> bool: ...

    def stream_ended(self, stream: IngestSession) -> None: ...


class CommandSink(Protocol):
    """What ingest hands the remediation commands' waiters (collector/remediation_commands.py)."""

    def answer(self, stream: IngestSession, result: stream_pb2.CommandResult) -> bool: ...

    def stream_ended(self, stream: IngestSession) -> None: ...


def node_binding_refusal(node: str, who: Principal, local_node: str | None,
                         local_uids: frozenset[int]) -> str | None:
    """None when `who` may send a Hello for `node`; else why not (one clause)."""
    if who.kind == "node":
        if who.name == node:
            return None
        return (f"the certificate of node {who.name} cannot speak for node {node}: give this tracer node "
                f"{node}'s certificate (ghostgpu certs issue --node {node})")
    if who.kind == "uid" and who.via in ("unix", "loopback"):
        if not who.name.isdigit() or int(who.name) not in local_uids:
            return (f"{who.subject} cannot speak for node {node}: only root or the collector's uid "
                    f"({', '.join(map(str, sorted(local_uids)))}) is this host's tracer; run the tracer as "
                    "root, or give it a node certificate")
        if local_node and node != local_node:
            return (f"{who.subject} cannot speak for node {node}: this host's tracer speaks for node "
                    f"{local_node} (the collector's node) only")
        return None
    return (f"{who.subject} cannot speak for node {node}: only a node certificate naming that node "
            f"streams as it (ghostgpu certs issue --node {node}), whatever the policy's roles")


class StreamAbort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class IngestSession:
    """One connected stream of one tracer, as the collector serves it."""

    def __init__(self, hello: stream_pb2.Hello, state: NodeView) -> None:
        self.hello = hello
        self.node = hello.node
        self.state = state
        self.out: asyncio.Queue[Any] = asyncio.Queue()
        self.active = True
        self.cri_relay = "cri-relay" in hello.capabilities
        self.committed_seq = 0
        self.acked_seq = 0
        self.ack_queued = False
        self.inflight = 0
        self.drained = asyncio.Event()
        self.drained.set()
        self.who: Principal | None = None  # who opened it (collector/authz.py), until it is audited closed

    def end(self, code: grpc.StatusCode | None, details: str = "") -> None:
        """Finish the stream: OK when code is None, else abort with the code."""
        self.active = False
        self.out.put_nowait(StreamAbort(code, details) if code is not None else None)

    def queue_ack(self) -> None:
        if not self.ack_queued:
            self.ack_queued = True
            self.out.put_nowait(_ACK)


class Ingest:
    """The stream servicer; every method runs on the event loop. CRI calls to the tracers go through
    `relay` (collector/relay.py), which this servicer hands the tracers' answers and ended streams."""

    def __init__(self, nodes: dict[str, NodeView], cluster: ClusterTable, store: Store, event_log_max: int, *,
                 sessions: dict[str, IngestSession], traces: TraceSink | None = None,
                 audit: AuditFn | None = None, local_node: str | None = None,
                 faults: FaultBook | None = None, leases: Leases | None = None) -> None:
        """sessions: the connected streams by node, filled here (the trace book reads the same dict);
        traces: the trace session book; audit: AuditLog.append (collector/audit.py); local_node: the
        collector's own node (`ghostgpu up`), whose tracer may speak as a local uid; faults: the GPU
        faults' book (collector/faults.py), whose rows commit with the batch that carried them; leases:
        the node leases this replica takes at each Hello and fences its writes with (collector/leases.py;
        None: unfenced, a lone collector in tests)."""
        self.nodes = nodes
        self.cluster = cluster
        self.store = store
        self.event_log_max = event_log_max
        self.sessions = sessions
        self.relay = CriRelayClient(self.sessions)
        self.traces = traces
        # Remediate commands' answers (collector/remediation_commands.py RemediateCalls); the Collector
        # sets it. Asked first: it claims the ids it waits for, whatever the body.
        self.remediation: CommandSink | None = None
        self.audit = audit
        self.faults = faults
        self.leases = leases
        self.durable: dict[tuple[str, str, str], int] = {}  # committed seq per tracer instance
        self.loop: asyncio.AbstractEventLoop | None = None  # the serving loop, once it runs (serve_on)
        self.local_node = local_node
        self.local_uids = frozenset({0, os.getuid()})  # the uids that are this host's tracer (_speaks_for)
        self._done: list[tuple[IngestSession, tuple[str, str, str], int, list[Taken],
                               BaseException | None]] = []
        self._refused = DenialFold()  # one tracer.refused record per (subject, reason) per 10 s
        self._done_lock = threading.Lock()
        self._drain_scheduled = False
        # A shared store holds every replica's nodes: a replica reads a node's positions when it takes
        # the node's lease, not at start (its /metrics and NodeStatus hold only the nodes it applies).
        for pos in store.load_positions() if store.engine == "sqlite" else ():
            self.durable[pos.key] = pos.delivered_seq
            self.nodes.setdefault(pos.node, NodeView(pos.node)).positions[pos.key] = pos

    def serve_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop the streams (and the CRI calls through them) run on, known once it runs."""
        self.loop = self.relay.loop = loop

    # ---- the handler ----------------------------------------------------------------------------

    async def connect(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        it = requests.__aiter__()
        try:
            raw = await it.__anext__()
        except StopAsyncIteration:
            return
        who = current_principal()
        try:
            hello = self._hello(raw, who)
            self._speaks_for(hello.node, who)
            session = await self._open(hello)
        except StreamAbort as e:
            await context.abort(e.code, e.details)
        session.who = who
        self._audit("tracer.connect", who.subject, "ok", node=session.node, peer=who.peer, via=who.via,
                    tracer_version=hello.tracer_version, instance_id=hello.instance_id)
        reader: asyncio.Task[None] | None = None
        try:  # from here on the session is registered: whatever happens, it is closed
            pos = session.state.position
            assert pos is not None
            # A tracer gone before its Welcome makes this write fail; the session must not stay in
            # self.sessions (and its node read as connected) until that node's next Hello.
            await context.write(stream_pb2.CollectorMessage(welcome=stream_pb2.Welcome(
                api_version=API_VERSION, collector_version=__version__, acked_seq=pos.delivered_seq,
                max_batch_events=MAX_BATCH_EVENTS)))
            reader = asyncio.create_task(self._read(session, it))
            await self._write(session, context)
        finally:
            if reader is not None:
                reader.cancel()
            self._close(session)

    def _hello(self, raw: bytes, who: Principal) -> stream_pb2.Hello:
        msg = self._parse(raw)
        if msg.WhichOneof("msg") != "hello":
            raise StreamAbort(grpc.StatusCode.FAILED_PRECONDITION, "stream must start with Hello")
        hello = msg.hello  # its message holds only this Hello: nothing to detach (unlike nodes._copy)
        # The node name is checked before anything stores, logs or audits it (a 1 MiB name must
        # cost nothing): a DNS-1123 subdomain of at most 253 characters, as Kubernetes names nodes.
        bad_name = node_name_problem(hello.node) if hello.node else None
        if bad_name:
            self._audit_refused(who, "node name", node=shown(hello.node), peer=who.peer, via=who.via,
                                why=bad_name)
            raise StreamAbort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"Hello.node: {bad_name}: start the tracer with --node-name set to its "
                              "Kubernetes node's name")
        problem = version_mismatch(hello.api_version, f"tracer on node {hello.node or '(unnamed)'}")
        if problem:
            raise StreamAbort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        if not hello.node:
            raise StreamAbort(grpc.StatusCode.INVALID_ARGUMENT,
                              "Hello.node is empty: start the tracer with --node-name NAME")
        return hello

    def _speaks_for(self, node: str, who: Principal) -> None:
        """Node binding (docs/SECURITY.md, "Authorization", node binding), whatever the role rules say:
        a Hello is accepted only from `node:NAME` naming the Hello's node, or from a local uid the
        kernel names (unix socket, loopback) that is root or the collector's own: the host's tracer,
        bound to the collector's node when it has one (`ghostgpu up`). A user certificate, another
        uid or anonymous is no node: refused and audited (tracer.refused)."""
        why = node_binding_refusal(node, who, self.local_node, self.local_uids)
        if why is None:
            return
        self._audit_refused(who, "node binding", node=node, peer=who.peer, via=who.via, why=why)
        raise StreamAbort(grpc.StatusCode.PERMISSION_DENIED, f"permission denied: {why}")

    def _audit(self, action: str, subject: str, result: str, **detail: Any) -> None:
        if self.audit is not None:
            self.audit(action, subject, result, **detail)

    def _audit_refused(self, who: Principal, reason: str, **detail: Any) -> None:
        """tracer.refused, folded as denied RPCs are (collector/authz.py's DenialFold): one record per
        (subject, reason) per window, the next one with `repeats_folded`; a Hello flood costs a
        record per 10 s, not one per attempt."""
        repeats = self._refused((who.subject, reason))
        if repeats is not None:
            self._audit("tracer.refused", who.subject, "denied", reason=reason, repeats_folded=repeats,
                        **detail)

    @staticmethod
    def _parse(raw: bytes) -> stream_pb2.TracerMessage:
        if not raw:
            raise StreamAbort(grpc.StatusCode.INVALID_ARGUMENT, "empty TracerMessage")
        try:
            return stream_pb2.TracerMessage.FromString(raw)
        except DecodeError as e:
            raise StreamAbort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"malformed TracerMessage ({len(raw)} bytes): {e}") from None

    async def _open(self, hello: stream_pb2.Hello) -> IngestSession:
        node = hello.node
        state = self.nodes.setdefault(node, NodeView(node))
        session = IngestSession(hello, state)
        old = self.sessions.get(node)
        self.sessions[node] = session
        if old is not None:
            old.end(grpc.StatusCode.ABORTED, f"replaced by a newer stream from node {node}")
        try:
            if self.store.failed is not None:
                raise StreamAbort(grpc.StatusCode.UNAVAILABLE,
                                  f"collector cannot store events: {self.store.failed}")
            # What the older stream handed the writer is committed (or failed) before acked_seq is read:
            # the lease is taken after it, in a transaction that reads the positions as committed.
            taken = await self._take_lease(node)
            if self.sessions.get(node) is not session:
                raise StreamAbort(grpc.StatusCode.ABORTED, f"replaced by a newer stream from node {node}")
        except BaseException:
            self._close(session)
            raise
        if taken is not None:
            self._adopt(state, taken)
        key = (node, hello.boot_id, hello.instance_id)
        for stale in state.forget_instances(key, time.time_ns() - int(self.store.retention_s * 1e9)):
            self.durable.pop(stale, None)
        pos = state.positions.get(key) or Position(node, hello.boot_id, hello.instance_id)
        pos.delivered_seq = self.durable.get(key, 0)
        state.begin(hello, pos)
        self.store.submit([Store.op_position(pos)], fence=self._fence(node))
        log.info("node %s connected (tracer %s, instance %s, acked seq %d)", node, hello.tracer_version,
                 hello.instance_id, pos.delivered_seq)
        return session

    async def _take_lease(self, node: str) -> TakenLease | None:
        if self.leases is None:
            await asyncio.wrap_future(self.store.barrier())
            return None
        try:
            return await asyncio.wrap_future(self.leases.take(node))
        except _STORE_ERRORS as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise StreamAbort(grpc.StatusCode.UNAVAILABLE, f"collector cannot reach its database to take "
                              f"node {node}'s stream ({first}); the tracer retries") from None

    def _adopt(self, state: NodeView, taken: TakenLease) -> None:
        """The lease is this replica's: go on from what the store committed for the node. From another
        replica's hands, or from this replica id's previous process, its positions and open findings
        replace what this replica remembers of it."""
        assert self.leases is not None
        self.leases.adopt(taken)
        if not taken.previous_owner:
            return  # no replica applied the node before
        if taken.previous_owner == self.leases.owner and state.position is not None:
            return  # this process applied it last: its memory is the committed state (or newer)
        # The same owner with no memory of the node: this replica id's process was started again (a
        # container restarted in its pod keeps --replica-id=$(POD_NAME)), and knows only the rows.
        for pos in taken.positions:
            state.positions[pos.key] = pos
            self.durable[pos.key] = pos.delivered_seq
        self.cluster.adopt_open(state.node, taken.open_findings)
        log.info("node %s taken over from replica %s (lease token %d)", state.node, taken.previous_owner,
                 taken.token)

    def _fence(self, node: str) -> tuple[str, int] | None:
        return self.leases.fence(node) if self.leases is not None else None

    def moved(self, node: str, why: str) -> None:
        """Another replica applies `node` now (or this one may no longer): end its stream here and drop
        its state from memory, without resolving anything (the owner has it)."""
        session = self.sessions.get(node)
        if session is not None:
            session.end(grpc.StatusCode.ABORTED, why)
            self._close(session)
        if self.leases is not None:
            self.leases.drop(node)
        self.cluster.forget_node(node)
        if self.store.engine != "sqlite":
            self.nodes.pop(node, None)

    async def keep_leases(self) -> None:
        """Renew this replica's leases every ttl/3; end the streams of nodes that moved; past a whole
        ttl without reaching the database, end every stream (UNAVAILABLE) so the tracers move to a
        replica that can write them. A renewal waits behind the writer, which retries for as long as
        the database is out of reach (collector/store.py): so the wait is bounded here, and the ttl
        counts from the last renewal that committed."""
        leases = self.leases
        if leases is None:
            return
        tick_s = leases.ttl_s / 3
        pending: Future[list[str]] | None = None
        while True:
            await asyncio.sleep(tick_s)
            if pending is None:
                pending = leases.renew()
            lost: list[str] = []
            try:
                lost = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(pending)), tick_s)
                pending = None
            except TimeoutError:
                pass  # the writer is still waiting for the database
            except _STORE_ERRORS:
                pending = None
            if leases.overdue() and leases.held:
                self._give_up_leases(leases)
            for node in lost:
                self.moved(node, f"node {node}: its stream moved to another collector replica")

    def _give_up_leases(self, leases: Leases) -> None:
        log.error("cannot renew node leases for %g s (database out of reach): ending %d stream(s) so "
                  "their tracers move to another replica", leases.ttl_s, len(leases.held))
        for node in leases.owned_nodes():
            session = self.sessions.get(node)
            if session is not None:
                session.end(grpc.StatusCode.UNAVAILABLE, f"this collector replica lost its database for "
                            f"{leases.ttl_s:g} s; reconnect (to another replica)")
            leases.drop(node)

    def _close(self, session: IngestSession) -> None:
        session.active = False
        self.relay.stream_ended(session)
        if self.traces is not None:
            self.traces.stream_ended(session)
        if self.remediation is not None:
            self.remediation.stream_ended(session)
        if self.sessions.get(session.node) is session:
            del self.sessions[session.node]
            # The lease stays this replica's until another replica takes the node: the last replica that
            # served a node is the one that exports it as disconnected (ghostgpu_tracer_connected 0,
            # the GhostGPUTracerDisconnected alert), and no other does.
            session.state.end()
            log.info("node %s disconnected", session.node)
        who = session.who
        if who is not None:
            session.who = None  # _close runs more than once for a stream; the audit says it once
            self._audit("tracer.disconnect", who.subject, "ok", node=session.node, peer=who.peer)

    async def _write(self, session: IngestSession, context: grpc.aio.ServicerContext) -> None:
        while True:
            item = await session.out.get()
            if item is _ACK:
                session.ack_queued = False
                if session.committed_seq > session.acked_seq:
                    session.acked_seq = session.committed_seq
                    ack = stream_pb2.Ack(seq=session.acked_seq)
                    await context.write(stream_pb2.CollectorMessage(ack=ack))
            elif item is None:
                return
            elif isinstance(item, StreamAbort):
                await context.abort(item.code, item.details)
            else:
                await context.write(item)

    async def _read(self, session: IngestSession, it: AsyncIterator[bytes]) -> None:
        try:
            async for raw in it:
                if not session.active:
                    return
                self._handle(session, raw)
                if session.inflight >= MAX_INFLIGHT_BATCHES or self.store.pending_bytes > PENDING_BYTES_MAX:
                    await session.drained.wait()
            await session.drained.wait()  # the tracer half-closed: ack what it sent, then end OK
            if session.active:
                session.queue_ack()
                session.end(None)
        except StreamAbort as e:
            session.end(e.code, e.details)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AbortError:
            pass  # the writer ended the stream (replaced, shutting down, a bad message): reads stop too
        except Exception as e:
            if not session.active:
                return  # the stream was already ending: whatever the read raised does not matter
            log.exception("stream of node %s failed", session.node)
            session.end(grpc.StatusCode.INTERNAL, f"collector error: {e}")

    # ---- messages ------------------------------------------------------------------------------

    def _store_position(self, state: NodeView) -> None:
        pos = state.position
        assert pos is not None  # NodeView.begin() set it at the stream's Hello
        self.store.submit([Store.op_position(pos)], fence=self._fence(state.node))

    def _handle(self, session: IngestSession, raw: bytes) -> None:
        msg = self._parse(raw)
        kind = msg.WhichOneof("msg")
        state = session.state
        # Last heard, by the collector's clock: a busy tracer never sends a Heartbeat (only on silence).
        state.last_heartbeat_unix_ns = time.time_ns()
        if kind == "events":
            self._batch(session, msg.events, raw)
        elif kind == "snapshot":
            snap = msg.snapshot
            delivered = state.position.delivered_seq if state.position is not None else 0
            if snap.seq < delivered:
                # A snapshot reflects every event up to its seq, and the tracer sends it with its last
                # seq after the Welcome: one older than events already received would roll state back.
                raise StreamAbort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"node {session.node}: Snapshot seq {snap.seq} is behind seq {delivered} "
                                  "already received on this tracer's stream; send snapshots in order")
            self.cluster.update(state, state.apply_snapshot(snap))
            self._store_position(state)
        elif kind == "heartbeat":
            if msg.heartbeat.HasField("stats"):
                state.set_stats(msg.heartbeat.stats)
                self._store_position(state)
        elif kind == "result":
            if self.remediation is not None and self.remediation.answer(session, msg.result):
                pass  # a RemediateResult (collector/remediation_commands.py)
            elif self.traces is None or not self.traces.answer(session, msg.result):
                self.relay.answer(session, msg.result)
        elif kind == "trace":
            if self.traces is not None:
                self.traces.batch(session, msg.trace)
            else:
                log.debug("node %s sent trace records; this collector runs no trace sessions", session.node)
        elif kind == "hello":
            raise StreamAbort(grpc.StatusCode.FAILED_PRECONDITION, "Hello sent twice on one stream")
        else:
            log.debug("node %s sent a message this collector does not know; ignored", session.node)

    def _batch(self, session: IngestSession, batch: stream_pb2.EventBatch, raw: bytes) -> None:
        events = batch.events
        try:
            seqs, bodies = validate_batch(events, MAX_BATCH_EVENTS)
        except BatchError as e:
            raise StreamAbort(grpc.StatusCode.INVALID_ARGUMENT, f"node {session.node}: {e}") from None
        state = session.state
        pos = state.position
        assert pos is not None
        first_new = state.accept(seqs)
        n = len(seqs)
        ops: list[Op] = []
        size = 0
        if first_new < n and self.event_log_max > 0:
            start = max(first_new, n - self.event_log_max)
            if start == 0:
                blob = raw  # every event is new: store the bytes as they came
            else:
                part = stream_pb2.EventBatch(events=events[start:])
                blob = stream_pb2.TracerMessage(events=part).SerializeToString()
            ops.append(Store.op_events(pos, seqs[start], seqs[-1], n - start, blob))
            size = len(blob)
        taken: list[Taken] = []
        if first_new < n and self.faults is not None and "fault" in bodies:
            # In the batch's transaction, before the position that acks it: a fault is stored once,
            # and counted and told (FaultBook.committed) only once that transaction committed.
            taken = [self.faults.take(session.node, session.hello.boot_id, events[i])
                     for i in range(first_new, n) if bodies[i] == "fault"]
            ops.extend(t.op for t in taken)
        ops.append(Store.op_position(pos))
        session.inflight += 1
        session.drained.clear()
        self.store.submit(ops, partial(self._committed_elsewhere, session, pos.key, seqs[-1], taken), size,
                          fence=self._fence(session.node))
        if first_new < n:
            changes = state.apply_events(events, seqs, bodies, first_new)
            if changes.keys or changes.full:
                self.cluster.update(state, changes)

    def _committed_elsewhere(self, session: IngestSession, key: tuple[str, str, str], seq: int,
                             taken: list[Taken], error: BaseException | None) -> None:
        """Writer thread: hand the commit to the loop, waking it once per group commit rather than
        once per batch (each wake-up is a write to the loop's self-pipe)."""
        with self._done_lock:
            self._done.append((session, key, seq, taken, error))
            if self._drain_scheduled:
                return
            self._drain_scheduled = True
        loop = self.loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop stopped meanwhile: nobody is left to ack
                loop.call_soon_threadsafe(self._drain_committed)

    def _drain_committed(self) -> None:
        with self._done_lock:
            done, self._done = self._done, []
            self._drain_scheduled = False
        for args in done:
            self._committed(*args)

    def _committed(self, session: IngestSession, key: tuple[str, str, str], seq: int, taken: list[Taken],
                   error: BaseException | None) -> None:
        session.inflight -= 1
        if isinstance(error, LeaseLost):
            if session.active:
                self.moved(session.node, str(error))
        elif error is not None:
            session.end(grpc.StatusCode.UNAVAILABLE, f"collector cannot store events: {error}")
        else:
            if taken and self.faults is not None:
                self.faults.committed(taken)
            self.durable[key] = max(seq, self.durable.get(key, 0))
            if seq > session.committed_seq:
                session.committed_seq = seq
                if session.active:
                    session.queue_ack()
        if session.inflight == 0:
            session.drained.set()

    def shutdown(self) -> None:
        for session in list(self.sessions.values()):
            session.end(grpc.StatusCode.UNAVAILABLE, "collector shutting down; reconnect later")

