"""The Query service (proto/ghostgpu/v1/query.proto): what `ghostgpu ps`, `findings` and
dashboards ask the collector.

Live state (consumers, open findings, node status) is answered from memory on the event loop, so
an answer is one consistent moment. With replicas sharing a PostgreSQL store (`owned_nodes` set),
memory holds only the nodes this replica applies: ListConsumers and NodeStatus answer for the whole
cluster from the store's node_state rows (collector/node_state.py), its own nodes from memory.
History (findings, the event log) is read from SQLite on the
store's thread, after every write queued before the call, so a finding just opened is already in
ListFindings. The API-version check happens before these handlers (collector/server.py).

Remediate and RemediationControl are the remediation engine's (collector/remediation.py), the caller
its audit subject; ListFindings gives each finding its remediation state from the store.

Trace sessions (StartTrace, StopTrace, ListTraces, WatchTrace) are the book's (collector/traces.py);
here the caller (collector/authz.py, already admitted to the method's role) is checked against its
trace-operator rules' namespaces and maximum duration, and becomes `requested_by`: "user:alice",
"node:n1", "uid:0" or "anonymous".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Sequence
from typing import TypeVar

import grpc
from ghostgpu.collector.aio_handlers import Context
from ghostgpu.collector.audit import AuditFn, record_from_row, select_audit
from ghostgpu.collector.authz import current_principal
from ghostgpu.collector.cluster import ClusterTable, Watcher
from ghostgpu.collector.db import Conn, db_errors
from ghostgpu.collector.faults import select_faults
from ghostgpu.collector.node_state import NodeStateRow, merged_consumers, merged_statuses, select_node_states
from ghostgpu.collector.nodes import NodeView
from ghostgpu.collector.remediation import RemediationError, Remediator
from ghostgpu.collector.remediation_store import select_states
from ghostgpu.collector.store import FindingRow, Store, decode_blob
from ghostgpu.collector.trace_access import read_refusal, stop_refusal
from ghostgpu.collector.trace_scope import TraceError
from ghostgpu.collector.traces import TraceBook
from google.protobuf.message import Message

from ghostgpu import __version__
from ghostgpu.common.audit.chain import AuditRecord
from ghostgpu.common.model.remediation import RemediationState
from ghostgpu.common.transport.principal import Principal
from ghostgpu.common.wire.convert import class_from_proto, cluster_consumer_to_proto, remediation_to_proto
from ghostgpu.common.wire.convert_audit import audit_record_to_proto
from ghostgpu.common.wire.convert_trace import scope_from_proto, session_to_proto
from ghostgpu.common.wire.protocol import MAX_MESSAGE_BYTES
from ghostgpu.v1 import query_pb2, query_pb2_grpc, stream_pb2, trace_pb2

T = TypeVar("T")
DEFAULT_LIMIT = 1000
MAX_LIMIT = 100_000
# A ListEvents answer stays within what every client receives (MAX_MESSAGE_BYTES, the default of
# ghostgpu.common.wire.protocol.channel_options), with room to spare: 1,000 holder events of
# processes with 10 KB command lines are 10 MB. A client pages on with after_seq, so a shorter page
# loses nothing.
EVENTS_RESPONSE_BYTES = MAX_MESSAGE_BYTES // 2
# The policy's word on a trace: (caller, namespace or None, duration in seconds) -> None when allowed,
# else the line saying which limit it passes (collector/policy.py Policy.trace_denial).
TraceDenial = Callable[[Principal, str | None, float], str | None]
_Verb = query_pb2.RemediationControlRequest.Verb
_CONTROL_VERBS = {_Verb.VERB_UNSPECIFIED: "status", _Verb.VERB_PAUSE: "pause", _Verb.VERB_RESUME: "resume",
                  _Verb.VERB_SET_MODE: "mode"}


def select_findings(since_unix_ns: int, node: str, namespace: str, classes: Sequence[str],
                    limit: int) -> Callable[[Conn], list[FindingRow]]:
    """A read for Store.read(): findings opened or resolved at or after `since`, or open now;
    the newest `limit` of them, oldest first."""
    where = ["(opened_unix_ns >= ? OR resolved_unix_ns >= ? OR resolved_unix_ns = 0)"]
    args: list[int | str] = [since_unix_ns, since_unix_ns]
    for column, value in (("node", node), ("namespace", namespace)):
        if value:
            where.append(f"{column} = ?")
            args.append(value)
    if classes:
        where.append(f"class IN ({', '.join('?' * len(classes))})")
        args.extend(classes)
    sql = f"SELECT * FROM findings WHERE {' AND '.join(where)} ORDER BY id DESC LIMIT ?"

    def run(conn: Conn) -> list[FindingRow]:
        rows = conn.execute(sql, (*args, limit)).fetchall()
        return [FindingRow(*r) for r in reversed(rows)]

    return run


EventRow = tuple[str, str, str, int, bytes]  # node, boot_id, instance_id, codec, blob


def select_events(node: str, instance_id: str, after_seq: int,
                  limit: int) -> Callable[[Conn], list[EventRow]]:
    """A read for Store.read(): with instance_id, the stored rows of that instance holding seqs
    after `after_seq`, oldest first; without, the newest rows (enough for `limit` events)."""

    def run(conn: Conn) -> list[EventRow]:
        cols = "node, boot_id, instance_id, codec, blob, count"
        if instance_id:
            args: list[int | str] = [instance_id, after_seq]
            sql = f"SELECT {cols} FROM events WHERE instance_id = ? AND last_seq > ?"
            if node:
                sql += " AND node = ?"
                args.append(node)
            cursor = conn.execute(sql + " ORDER BY id", args)
        else:
            sql = f"SELECT {cols} FROM events" + (" WHERE node = ?" if node else "") + " ORDER BY id DESC"
            cursor = conn.execute(sql, (node,) if node else ())
        rows: list[EventRow] = []
        total = 0
        for row_node, boot_id, row_instance, codec, blob, count in cursor:
            rows.append((row_node, boot_id, row_instance, codec, blob))
            total += count
            if total >= limit:
                break
        return rows if instance_id else rows[::-1]

    return run


def _classes(values: Iterable[int]) -> list[str]:
    return [str(class_from_proto(v)) for v in values]


def _remediation(states: dict[int, RemediationState], finding_id: int) -> query_pb2.Remediation | None:
    state = states.get(finding_id)
    return remediation_to_proto(state) if state is not None else None


def _limit(value: int) -> int:
    return min(value or DEFAULT_LIMIT, MAX_LIMIT)


def _stored_events(rows: list[EventRow], instance_id: str, after_seq: int,
                   limit: int) -> list[query_pb2.StoredEvent]:
    out: list[query_pb2.StoredEvent] = []
    for node, boot_id, inst, codec, blob in rows:
        batch = stream_pb2.TracerMessage.FromString(decode_blob(codec, blob)).events
        for ev in batch.events:
            if instance_id and ev.seq <= after_seq:
                continue
            out.append(query_pb2.StoredEvent(node=node, boot_id=boot_id, instance_id=inst, event=ev))
    # With instance_id a page runs on from after_seq (cut at its end); without, it is the newest.
    if instance_id:
        return out[:limit][:within_bytes(out[:limit], EVENTS_RESPONSE_BYTES)]
    page = out[-limit:][::-1]
    return page[:within_bytes(page, EVENTS_RESPONSE_BYTES)][::-1]


def within_bytes(items: Sequence[Message], budget_bytes: int) -> int:
    """How many of `items`, from the first, fit an answer of `budget_bytes` as a repeated field;
    at least one (a single item over the budget goes alone: the message limit is twice the budget)."""
    size = 0
    for n, item in enumerate(items):
        size += item.ByteSize() + 8  # the field's tag and length prefix
        if n and size > budget_bytes:
            return n
    return len(items)


class QueryService(query_pb2_grpc.QueryServicer):
    def __init__(self, nodes: dict[str, NodeView], cluster: ClusterTable, store: Store,
                 cri_failures: Callable[[str], int] | None = None, traces: TraceBook | None = None) -> None:
        self.nodes = nodes
        self.cluster = cluster
        self.store = store
        self.cri_failures = cri_failures
        self.traces = traces
        self.trace_denial: TraceDenial | None = None  # the Collector sets it from the policy
        self.is_admin: Callable[[Principal], bool] | None = None  # the Collector sets it from the policy
        self.audit: AuditFn | None = None  # AuditLog.append, for refused traces
        # With replicas (a PostgreSQL store) the Collector sets it: the nodes this replica holds the
        # leases of. ListConsumers and NodeStatus then read every other node's node_state row.
        self.owned_nodes: Callable[[], Collection[str]] | None = None
        self.remediator: Remediator | None = None  # the Collector sets it: Remediate, RemediationControl
        self._closing = False

    async def ListConsumers(self, request: query_pb2.ListConsumersRequest,
                            context: Context) -> query_pb2.ListConsumersResponse:
        classes = _classes(request.classes)
        if self.owned_nodes is None:  # one collector: memory holds every node
            rows = self.cluster.consumers(request.node, request.namespace, request.pod, classes)
            return query_pb2.ListConsumersResponse(consumers=[cluster_consumer_to_proto(c) for c in rows],
                                                   ts_unix_ns=time.time_ns())
        stored = await self._read(select_node_states(request.node), context)
        # Owned after the read: each node comes from memory or from its row, never both or neither.
        # From memory too: a node whose stream ended here before its first row was written.
        owned, written = frozenset(self.owned_nodes()), {r.node for r in stored}
        local = [n for n in sorted(self.cluster.rows) if (n in owned or n not in written)
                 and (not request.node or n == request.node)]
        mine = [cluster_consumer_to_proto(c) for n in local
                for c in self.cluster.consumers(n, request.namespace, request.pod, classes)]
        others = [r for r in stored if r.node not in owned]
        consumers = await asyncio.to_thread(merged_consumers, mine, others, request.namespace, request.pod,
                                            classes)
        return query_pb2.ListConsumersResponse(consumers=consumers, ts_unix_ns=time.time_ns())

    async def WatchFindings(self, request: query_pb2.WatchFindingsRequest,
                            context: Context) -> AsyncIterator[query_pb2.FindingEvent]:
        watcher = Watcher(request.node, request.namespace, _classes(request.classes))
        self.cluster.watch(watcher, request.include_open)
        try:
            while True:
                if self._closing:
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        "collector shutting down; watch again later")
                if watcher.dropped:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"this watcher fell {watcher.max_queue} finding events behind "
                                        "and was dropped; watch again with include_open to catch up")
                if watcher.items:
                    yield watcher.items.popleft()
                    continue
                watcher.wake.clear()
                await watcher.wake.wait()
        finally:
            self.cluster.unwatch(watcher)

    async def ListFindings(self, request: query_pb2.ListFindingsRequest,
                           context: Context) -> query_pb2.ListFindingsResponse:
        read = select_findings(request.since_unix_ns, request.node, request.namespace,
                               _classes(request.classes), _limit(request.limit))
        self.cluster.flush_changed()
        rows = await self._read(read, context)
        # Each finding's remediation (collector/remediation.py), as its newest incident stands
        states = await self._read(select_states(r.id for r in rows), context) if rows else {}
        findings = [query_pb2.Finding(id=r.id, node=r.node,
                                      consumer=query_pb2.ClusterConsumer.FromString(r.consumer),
                                      opened_unix_ns=r.opened_unix_ns, resolved_unix_ns=r.resolved_unix_ns,
                                      remediation=_remediation(states, r.id))
                    for r in rows]
        return query_pb2.ListFindingsResponse(findings=findings)

    async def ListFaults(self, request: query_pb2.ListFaultsRequest,
                         context: Context) -> query_pb2.ListFaultsResponse:
        """GPU faults (collector/faults.py) read at or after `since`, of a node, that hit a pod of a
        namespace; the newest `limit`, oldest first. The store holds every one committed."""
        read = select_faults(request.since_unix_ns, request.node, request.namespace, _limit(request.limit))
        faults = await self._read(read, context)
        # Within what every client receives, as ListEvents: the newest that fit (a fault carries its
        # kernel log line and every process it hit); the answer says how many older ones it left out.
        kept = within_bytes(faults[::-1], EVENTS_RESPONSE_BYTES)
        return query_pb2.ListFaultsResponse(faults=faults[len(faults) - kept:], left_out=len(faults) - kept)

    async def NodeStatus(self, request: query_pb2.NodeStatusRequest,
                         context: Context) -> query_pb2.NodeStatusResponse:
        stored: list[NodeStateRow] = []
        if self.owned_nodes is not None:  # replicas: every node's row; memory has this replica's
            stored = await self._read(select_node_states(request.node), context)
        names = [request.node] if request.node else sorted(self.nodes)
        out = []
        for name in names:
            state = self.nodes.get(name)
            if state is None:
                continue
            failures = self.cri_failures(name) if self.cri_failures else 0
            out.append(state.status(cri_failures_total=failures))
        if self.owned_nodes is not None:
            out = await asyncio.to_thread(merged_statuses, stored, out, frozenset(self.owned_nodes()),
                                          time.time_ns())
        if request.node and not out:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no tracer of node {request.node} ever connected")
        return query_pb2.NodeStatusResponse(nodes=out, collector_version=__version__)

    async def ListEvents(self, request: query_pb2.ListEventsRequest,
                         context: Context) -> query_pb2.ListEventsResponse:
        limit = _limit(request.limit)
        read = select_events(request.node, request.instance_id, request.after_seq, limit)
        rows = await self._read(read, context)
        events = await asyncio.to_thread(_stored_events, rows, request.instance_id, request.after_seq, limit)
        return query_pb2.ListEventsResponse(events=events)

    # ---- trace sessions (collector/traces.py) ------------------------------------------------------

    async def _book(self, context: Context) -> TraceBook:
        if self.traces is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this collector runs no trace sessions")
        return self.traces

    async def StartTrace(self, request: trace_pb2.StartTraceRequest,
                         context: Context) -> trace_pb2.StartTraceResponse:
        book = await self._book(context)
        who = current_principal()
        try:
            scope = scope_from_proto(request.scope)
            duration_s = book.limits.duration_ms(request.duration_ms) / 1000
            await self._may_trace(context, "StartTrace", who, scope.namespace, duration_s)
            # Not admin: the scope must lie inside the caller's namespaces, a pid's or container id's
            # confirmed by the node and CRI (collector/trace_access.py confine).
            in_namespace = None if self._admin(who) else (
                lambda ns: self.trace_denial is None or self.trace_denial(who, ns, duration_s) is None)
            s = await book.start(scope, request.duration_ms, request.max_records, who.subject, in_namespace)
        except TraceError as e:
            if e.code == grpc.StatusCode.PERMISSION_DENIED:
                self._audit_denied("StartTrace", who, e.line, scope=scope.describe())
            await context.abort(e.code, e.line)
        if self.store.engine != "sqlite":
            # Replicas: the session's row is committed before the answer, so a WatchTrace or `trace
            # show` the client sends next to any other replica finds it (they read it from the store).
            await self._read(lambda conn: None, context)
        return trace_pb2.StartTraceResponse(session=session_to_proto(s))

    def _admin(self, who: Principal) -> bool:
        """Admin, or no policy at all (a QueryService outside a Collector)."""
        if self.trace_denial is None:
            return True
        return self.is_admin is not None and self.is_admin(who)

    def _in_namespace(self, who: Principal) -> Callable[[str | None], bool]:
        return lambda ns: self.trace_denial is None or self.trace_denial(who, ns, 0.0) is None

    def _audit_denied(self, method: str, who: Principal, why: str, **detail: object) -> None:
        if self.audit is not None:
            self.audit("denied", who.subject, "denied", method=f"/ghostgpu.v1.Query/{method}", why=why,
                       peer=who.peer, **detail)

    async def _deny(self, context: Context, method: str, who: Principal, why: str,
                    session: str) -> None:
        """PERMISSION_DENIED for a session the caller may not read or stop, audited."""
        self._audit_denied(method, who, why, session=session)
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"permission denied: {method}: {why}")

    async def StopTrace(self, request: trace_pb2.StopTraceRequest,
                        context: Context) -> trace_pb2.StopTraceResponse:
        book = await self._book(context)
        who = current_principal()
        try:
            session = await book.find(request.id)  # on any replica: its home ends it
            await self._may_trace(context, "StopTrace", who, session.scope.namespace, 0.0)
            if (why := stop_refusal(who.subject, self._admin(who), session)) is not None:
                await self._deny(context, "StopTrace", who, why, request.id)
            s = await book.stop(request.id, who.subject)
        except TraceError as e:
            await context.abort(e.code, e.line)
        return trace_pb2.StopTraceResponse(session=session_to_proto(s))

    async def _may_trace(self, context: Context, method: str, who: Principal,
                         namespace: str | None, duration_s: float) -> None:
        """PERMISSION_DENIED (audited) for a trace outside the caller's namespaces or duration."""
        why = self.trace_denial(who, namespace or None, duration_s) if self.trace_denial else None
        if why is None:
            return
        if self.audit is not None:
            self.audit("denied", who.subject, "denied", method=f"/ghostgpu.v1.Query/{method}",
                       namespace=namespace or "", duration_s=duration_s, why=why, peer=who.peer)
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"permission denied: {method}: {why}")

    async def ListTraces(self, request: trace_pb2.ListTracesRequest,
                         context: Context) -> trace_pb2.ListTracesResponse:
        book = await self._book(context)
        who = current_principal()
        admin, in_namespace = self._admin(who), self._in_namespace(who)
        try:
            sessions = await book.list_all()  # with replicas: every replica's
        except TraceError as e:
            await context.abort(e.code, e.line)
        readable = [s for s in sessions if read_refusal(who.subject, admin, in_namespace, s) is None]
        return trace_pb2.ListTracesResponse(sessions=[session_to_proto(s) for s in readable])

    async def WatchTrace(self, request: trace_pb2.WatchTraceRequest,
                         context: Context) -> AsyncIterator[trace_pb2.TraceWatchMessage]:
        book = await self._book(context)
        who = current_principal()
        try:
            session = await book.find(request.id)  # on any replica, whichever runs it
            why = read_refusal(who.subject, self._admin(who), self._in_namespace(who), session)
            if why is not None:
                await self._deny(context, "WatchTrace", who, why, request.id)
            async for msg in book.watch(request.id, request.follow):
                yield msg
        except TraceError as e:
            await context.abort(e.code, e.line)

    # ---- remediation (collector/remediation.py); role remediator, checked before this runs ------------

    async def _remediator(self, context: Context) -> Remediator:
        if self.remediator is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this collector runs no remediation")
        return self.remediator

    async def Remediate(self, request: query_pb2.RemediateRequest,
                        context: Context) -> query_pb2.RemediateResponse:
        engine = await self._remediator(context)
        who = current_principal()
        try:
            state, detail = await engine.remediate(request.finding, request.dry_run, who.subject)
        except RemediationError as e:
            await context.abort(getattr(grpc.StatusCode, e.code), e.line)
        return query_pb2.RemediateResponse(remediation=remediation_to_proto(state), detail=detail)

    async def RemediationControl(self, request: query_pb2.RemediationControlRequest,
                                 context: Context) -> query_pb2.RemediationStatus:
        engine = await self._remediator(context)
        who = current_principal()
        verb = _CONTROL_VERBS.get(request.verb, "")
        if not verb:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"RemediationControl verb {request.verb}: "
                                "use pause, resume, set mode, or none for the status")
        try:
            view = await engine.control(verb, who.subject, request.reason, request.mode)
        except RemediationError as e:
            await context.abort(getattr(grpc.StatusCode, e.code), e.line)
        return view.to_proto()

    # ---- the audit trail (collector/audit.py); admin only, checked before this runs ------------------

    async def ListAudit(self, request: query_pb2.ListAuditRequest,
                        context: Context) -> query_pb2.ListAuditResponse:
        rows = await self._read(select_audit(request.since_unix_ns, request.after_seq,
                                             _limit(request.limit)), context)
        out = []
        for row in rows:
            r = record_from_row(row)
            # A row whose detail no longer parses still goes out as stored: the client's --verify names it.
            out.append(audit_record_to_proto(r) if isinstance(r, AuditRecord) else query_pb2.AuditRecord(
                seq=row.seq, ts_unix_ns=row.ts_unix_ns, action=row.action, subject=row.subject,
                result=row.result, detail_json=row.detail, prev_sha256=row.prev_sha256, sha256=row.sha256))
        return query_pb2.ListAuditResponse(records=out)

    async def _read(self, read: Callable[[Conn], T], context: Context) -> T:
        try:
            return await asyncio.wrap_future(self.store.read(read))
        except db_errors() as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"collector cannot read its database "
                                f"{self.store.path}: {e}")
            raise  # abort raised already; this line only tells type checkers so

    def shutdown(self) -> None:
        """End every watch with UNAVAILABLE (the collector is stopping)."""
        self._closing = True
        for watcher in list(self.cluster.watchers):
            watcher.wake.set()
