"""The trace session book: StartTrace, StopTrace, ListTraces, WatchTrace (docs/TRACE.md).

A session is started by resolving its scope to (node -> container ids) through CRI
(collector/trace_scope.py), then sending each node's tracer `Command.trace_start` on its stream
and waiting, bounded, for every `CommandResult.trace`. Tracers send the records as TraceBatches;
the book names them (the CRI answers it already has), stores them within the bounds
(collector/trace_store.py), sums the counters and hands them to watchers. A session ends when
every node sent its last batch (`ended`), when its deadline is `end_grace_s` past and a tracer
stayed silent, when a user stops it, or when a node's stream ends under it (node lost: the other
nodes are told to stop; what was stored is kept). A namespace scope is resolved again every
`reresolve_s` while it runs: nodes whose set changed get `trace_update`, new nodes `trace_start`.

With collector replicas on one PostgreSQL store, a node another replica serves takes part through
that replica (collector/replica_commands.py: its CRI calls and trace commands go as rows of
`replica_commands`): the replica the user called stays the session's home (policy, audit, the
trace_sessions row, the deadline, the end), the serving replica runs the node's part and stores its
records (collector/trace_guests.py), telling the home the part's counters and end (`remote_part`).
A stop may come to any replica: it is handed to the home, and a home that is gone has its sessions
ended by another replica past their deadline; ListTraces lists every replica's sessions
(collector/trace_homes.py).

A tracer's error line becomes the client's gRPC error by its prefix (collector/trace_commands.py).
Every start, stop, expiry, node loss, refusal and mid-session error is a trace_audit row (actions
start, stop, expire, node-lost, refused, error). Everything here runs on the collector's event loop.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import grpc
from ghostgpu.collector.db import db_errors
from ghostgpu.collector.replica_commands import ClusterStreams, ReplicaCommand
from ghostgpu.collector.store import StoreError
from ghostgpu.collector.trace_access import InNamespace, confine
from ghostgpu.collector.trace_commands import TraceCommands, TraceLimits, node_error, validate
from ghostgpu.collector.trace_follow import TraceFollow
from ghostgpu.collector.trace_guests import PART, TraceGuests
from ghostgpu.collector.trace_homes import TraceHomes
from ghostgpu.collector.trace_scope import (
    Names,
    TraceError,
    capability_problem,
    name_records,
    resolve,
    targets,
)
from ghostgpu.collector.trace_store import TraceStore
from ghostgpu.collector.trace_watch import LiveSession, NodePart, TraceWatcher, watch_messages

from ghostgpu.common.model.durations import format_ms
from ghostgpu.common.model.trace import TraceScope, TraceSession, TraceStatus
from ghostgpu.common.wire.convert_trace import session_to_proto
from ghostgpu.v1 import trace_pb2

if TYPE_CHECKING:
    from ghostgpu.collector.cri_fetch import CriTransport
    from ghostgpu.collector.ingest import IngestSession
    from ghostgpu.collector.nodes import NodeView
    from ghostgpu.collector.replica_commands import ReplicaCommands

    from ghostgpu.common.model.consumers import ClusterConsumer, ConsumerKey

log = logging.getLogger(__name__)

RETENTION_CHECK_S = 60.0
STOPPED = "the collector stopped while it ran; records so far are kept"
MAX_KEPT_SESSIONS = 10_000  # ended sessions in memory and in the table; the oldest go first
_STORE_ERRORS: tuple[type[BaseException], ...] = (*db_errors(), StoreError)


class TraceBook:
    def __init__(self, streams: Mapping[str, IngestSession], store: TraceStore,
                 limits: TraceLimits, *,
                 transport_for: Callable[[str], CriTransport | None] | None = None,
                 nodes: Mapping[str, NodeView] | None = None,
                 cluster_rows: Mapping[str, Mapping[ConsumerKey, ClusterConsumer]] | None = None,
                 resolve_names: Callable[[str, str], Any] | None = None,
                 replica: ReplicaCommands | None = None) -> None:
        """replica: with collector replicas (collector/replica_commands.py), the nodes other replicas
        serve take part through them, and this replica runs their sessions' parts on its own nodes."""
        self.replica = replica
        # node -> its current stream (Ingest.sessions), and with replicas the other replicas' nodes
        self.streams: Mapping[str, Any] = ClusterStreams(streams, replica) if replica is not None else streams
        self.store = store
        self.limits = limits
        self.transport_for = transport_for or (lambda node: None)
        self.nodes = nodes if nodes is not None else {}  # NodeViews of every node ever connected
        self.cluster_rows = cluster_rows if cluster_rows is not None else {}
        self.resolve_names = resolve_names  # the CRI resolver's cache (never blocks), for a pid scope
        self.commands = TraceCommands(self.limits.timing.command_timeout_s)
        self.answer = self.commands.answer  # a CommandResult from a stream: True when it was ours
        # the parts of other replicas' sessions on this replica's nodes (collector/trace_guests.py)
        self.guests: TraceGuests | None = None
        # stops handed to a session's home, sessions of a home that is gone (collector/trace_homes.py)
        self.homes: TraceHomes | None = None
        if replica is not None:
            self.guests = TraceGuests(streams, store, self.commands, replica, limits.timing.end_grace_s,
                                      resolve_names)
            replica.handle(PART, self.remote_part)
            self.homes = TraceHomes(store, replica, limits.timing, self.stop_for_home)
        self.sessions: dict[str, TraceSession] = {s.id: s for s in store.load()}
        self._live: dict[str, LiveSession] = {}
        self._running: dict[str, LiveSession] = {}
        self._dirty: set[str] = set()  # counters changed since the row was written
        self._task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._next_prune = 0.0
        self._next_home_check = 0.0
        self._checking_homes = False
        # Replicas sharing a PostgreSQL store: WatchTrace is answered from the store, on any replica,
        # as the nodes' records may be stored by other replicas (collector/trace_follow.py); the
        # Collector sets it.
        self.follow: TraceFollow | None = None

    # ---- the Query RPCs -------------------------------------------------------------------------

    async def start(self, scope: TraceScope, duration_ms: int, max_records: int, who: str,
                    in_namespace: InNamespace | None = None) -> TraceSession:
        """`in_namespace`: for a caller who is not admin, whether it may trace a namespace; the
        scope must then lie inside its namespaces (collector/trace_access.py confine)."""
        pid_containers: frozenset[str] = frozenset()
        if self.replica is not None:
            with contextlib.suppress(Exception):  # the store out of reach: who served whom a moment ago
                await self.replica.refresh()
        try:
            duration_ms, max_records = validate(scope, duration_ms, max_records, self.limits)
            where, names = await targets(scope, self.streams, self.transport_for, self.nodes,
                                         self.cluster_rows)
            if in_namespace is not None:
                pid_containers = await confine(scope, who, in_namespace, names, self.streams,
                                               self.transport_for)
        except TraceError as e:
            self.store.audit("", "refused", who, f"{scope.describe()}: {e.line}")
            raise
        now = time.time_ns()
        ids = tuple(sorted(set().union(*where.values())))
        s = TraceSession(id=self._new_id(), scope=scope, requested_by=who, started_unix_ns=now,
                         deadline_unix_ns=now + duration_ms * 1_000_000, max_records=max_records,
                         nodes=tuple(sorted(where)), container_ids=ids)
        live = self._live[s.id] = self._running[s.id] = LiveSession(s, names)
        live.next_resolve = time.monotonic() + self.limits.timing.reresolve_s
        self.sessions[s.id] = s
        self.store.save(s)  # running from here: batches sent before the answers are kept
        # A client that goes away while the tracers answer changes nothing: the start runs on.
        return await asyncio.shield(self._launch(live, where, who, f"for {format_ms(duration_ms)}",
                                                 pid_containers))

    async def _launch(self, live: LiveSession, where: dict[str, set[str]], who: str,
                      length: str, pid_containers: frozenset[str] = frozenset()) -> TraceSession:
        errors = await self._start_parts(live, where, pid_containers)
        if where and len(errors) == len(where):
            first = errors[min(errors)]
            more = f" (and {len(errors) - 1} more nodes)" if len(errors) > 1 else ""
            self._end(live, TraceStatus.FAILED, "; ".join(e.line for e in errors.values()), "refused", who)
            raise TraceError(first.code, first.line + more)
        self._update(live)
        s, on = live.session, ", ".join(live.session.nodes) or "no node yet"
        self.store.audit(s.id, "start", who, f"{s.scope.describe()} {length} on {on}")
        return s

    async def stop(self, sid: str, who: str) -> TraceSession:
        """Stop a session: here when this replica is its home, else handed to its home."""
        if self.homes is not None and sid not in self.sessions:
            stored = await self.homes.session(sid)
            if stored is None:
                return self.get(sid)  # NOT_FOUND
            s, home = stored
            if s.status.ended or home in ("", self.store.home):
                return s  # ended already (or ended here at a restart): stopping it changes nothing
            return await self.homes.stop(s, home, who)
        return await self._stop(sid, who, audit=True)

    async def stop_for_home(self, sid: str, who: str) -> TraceSession:
        """Another replica's stop of a session whose home this replica is: it audited the stop."""
        if sid not in self._running:
            return self.get(sid)  # ended already, or NOT_FOUND
        return await self._stop(sid, who, audit=False)

    async def _stop(self, sid: str, who: str, audit: bool) -> TraceSession:
        s = self.get(sid)
        live = self._running.get(sid)
        if live is None:
            return s  # ended already: stopping it again changes nothing
        if not live.stopping_by:
            live.stopping_by = who
            if audit:
                self.store.audit(sid, "stop", who, f"stopped by {who}")
            parts = {n: p for n, p in live.parts.items() if not p.ended}
            stop = trace_pb2.TraceStop(session=sid)
            answers = await asyncio.gather(*(self.commands.call(p.stream, trace_stop=stop)
                                             for p in parts.values()))
            for (node, part), error in zip(parts.items(), answers, strict=True):
                if error and not part.ended:  # it has no such session (ended meanwhile), or is gone
                    part.ended, part.end_reason = True, node_error(node, error).line
        if all(p.ended for p in live.parts.values()):
            self._finish_if_done(live)
        else:
            with contextlib.suppress(TimeoutError):  # their final batches
                await asyncio.wait_for(live.done.wait(), self.limits.timing.end_grace_s)
        self._end(live, TraceStatus.STOPPED, f"stopped by {who}")
        return live.session

    def get(self, sid: str) -> TraceSession:
        s = self.sessions.get(sid)
        if s is None:
            raise TraceError(grpc.StatusCode.NOT_FOUND,
                             f"trace session {sid} not found (ghostgpu trace list)")
        return s

    async def find(self, sid: str) -> TraceSession:
        """get(), or on a shared store a session another replica started (as stored)."""
        s = self.sessions.get(sid)
        if s is None and self.follow is not None:
            s = await self.follow.session(sid)
        return s if s is not None else self.get(sid)

    def list(self) -> list[TraceSession]:
        """Running and kept sessions of this collector, newest first."""
        return sorted(self.sessions.values(), key=lambda s: (s.started_unix_ns, s.id), reverse=True)

    async def list_all(self) -> builtins.list[TraceSession]:
        """list(), and with replicas every replica's sessions as stored (this replica's running ones
        as it counts them now: fresher than their rows). TraceError UNAVAILABLE: store out of reach."""
        if self.homes is None:
            return self.list()
        by_id = {s.id: s for s in await self.homes.sessions()}
        by_id.update({sid: self.sessions[sid] for sid in self._running})
        return sorted(by_id.values(), key=lambda s: (s.started_unix_ns, s.id), reverse=True)

    async def watch(self, sid: str, follow: bool) -> AsyncIterator[trace_pb2.TraceWatchMessage]:
        if self.follow is not None:  # replicas: the store has every node's records, whoever stored them
            async for msg in self.follow.watch(sid, follow):
                yield msg
            return
        self.get(sid)
        live = self._running.get(sid)
        watcher = TraceWatcher() if follow and live is not None else None
        if watcher is not None and live is not None:
            live.watchers.add(watcher)
        stored = self.store.records(sid)  # queued in the same loop step: every batch is here or there
        try:
            rows = await asyncio.wrap_future(stored)
            async for msg in watch_messages(rows, watcher, lambda: session_to_proto(self.get(sid))):
                yield msg
        finally:
            if watcher is not None and live is not None:
                live.watchers.discard(watcher)

    def audit(self, session: str = "", since_unix_ns: int = 0,
              limit: int = 1000) -> Future[builtins.list[trace_pb2.TraceAuditEntry]]:
        """The audit rows, oldest first (thread-safe: a Store read), for `ghostgpu trace audit` to come."""
        return self.store.audit_rows(session, since_unix_ns, limit)

    # ---- from the tracers' streams (collector/ingest.py) -----------------------------------------

    def batch(self, stream: IngestSession, tb: trace_pb2.TraceBatch) -> None:
        live = self._live.get(tb.session)
        part = live.parts.get(stream.node) if live is not None else None
        if live is None and self.guests is not None and self.guests.batch(stream, tb):
            return  # a part of another replica's session
        if live is None or part is None:
            log.debug("node %s sent records of trace session %s, not running there", stream.node, tb.session)
            return
        node, s, records = stream.node, live.session, tb.records
        name_records(records, node, lambda cid: self._names(live, node, cid))
        n = len(records)
        fit = self.store.fit(s.id, n, s.max_records)
        if fit < n and not s.status.ended:
            ended = [(x.id, x.ended_unix_ns) for x in self.sessions.values() if x.status.ended]
            self._forget(self.store.make_room(s.id, n, s.max_records, ended), "room for running sessions")
            fit = self.store.fit(s.id, n, s.max_records)
        if fit < n:
            del records[fit:]
        if fit:
            self.store.add(s.id, node, records[0].seq, records[-1].seq, fit, tb.SerializeToString())
        # Running totals: the newest is the count (max: a batch that repeats an older total is no step back).
        part.dropped_limit = max(part.dropped_limit, tb.dropped_limit_total)
        part.dropped_ringbuf = max(part.dropped_ringbuf, tb.dropped_ringbuf_total)
        part.dropped_transport = max(part.dropped_transport, tb.dropped_transport_total)
        parts = live.parts.values()
        live.session = self.sessions[s.id] = replace(
            s, records_total=s.records_total + fit, dropped_store_total=s.dropped_store_total + n - fit,
            dropped_limit_total=sum(p.dropped_limit for p in parts),
            dropped_ringbuf_total=sum(p.dropped_ringbuf for p in parts),
            dropped_transport_total=sum(p.dropped_transport for p in parts))
        self._dirty.add(s.id)
        if fit and live.watchers and not s.status.ended:
            current = session_to_proto(live.session)
            for w in live.watchers:
                w.push(list(records), current)
        if tb.ended and not part.ended:
            part.ended, part.end_reason = True, tb.end_reason or "deadline"
            self._finish_if_done(live)

    def stream_ended(self, stream: IngestSession) -> None:
        """A tracer's stream ended: sessions running on it end as node lost, records kept."""
        self.commands.stream_ended(stream)
        if self.guests is not None:
            self.guests.stream_ended(stream)
        for live in list(self._running.values()):
            part = live.parts.get(stream.node)
            if part is None or part.stream is not stream or part.ended or not part.started:
                continue
            self._node_lost(live, part, stream.node)

    def _node_lost(self, live: LiveSession, part: NodePart, node: str) -> None:
        part.ended, part.end_reason = True, "node lost"
        for other in live.parts.values():  # the session is over: nobody would see what they trace
            if not other.ended and other.stream is not None and other.stream.active:
                self.commands.send(other.stream, trace_stop=trace_pb2.TraceStop(session=live.session.id))
        detail = f"node {node}'s tracer disconnected mid-session; records so far are kept"
        self._end(live, TraceStatus.NODE_LOST, detail, "node-lost", f"node {node}")

    async def remote_part(self, cmd: ReplicaCommand) -> bytes:
        """A part's state from the replica running it (collector/trace_guests.py): its counters into
        the session, its end as a last batch's (or a lost stream's)."""
        m = cmd.meta
        node, live = str(m.get("node", "")), self._running.get(str(m.get("session", "")))
        part = live.parts.get(node) if live is not None else None
        if (live is None or part is None or part.ended
                or getattr(part.stream, "owner", None) != cmd.from_replica):
            return b""  # ended, or the part's node moved since: not this replica's word any more
        stored = max(0, int(m.get("stored", 0)) - part.stored)
        kept_out = max(0, int(m.get("dropped_store", 0)) - part.dropped_store)
        part.stored, part.dropped_store = part.stored + stored, part.dropped_store + kept_out
        part.dropped_limit = max(part.dropped_limit, int(m.get("dropped_limit", 0)))
        part.dropped_ringbuf = max(part.dropped_ringbuf, int(m.get("dropped_ringbuf", 0)))
        part.dropped_transport = max(part.dropped_transport, int(m.get("dropped_transport", 0)))
        s, parts = live.session, live.parts.values()
        live.session = self.sessions[s.id] = replace(
            s, records_total=s.records_total + stored, dropped_store_total=s.dropped_store_total + kept_out,
            dropped_limit_total=sum(p.dropped_limit for p in parts),
            dropped_ringbuf_total=sum(p.dropped_ringbuf for p in parts),
            dropped_transport_total=sum(p.dropped_transport for p in parts))
        self._dirty.add(s.id)
        if m.get("ended"):
            reason = str(m.get("end_reason") or "deadline")
            if reason == "node lost" and part.started:
                self._node_lost(live, part, node)
            else:
                part.ended, part.end_reason = True, reason
                self._finish_if_done(live)
        return b""

    # ---- life cycle -----------------------------------------------------------------------------

    def start_ticking(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._tick_loop())

    def shutdown(self) -> None:
        """The collector stops (before the streams end): running sessions end as node lost, their
        tracers are told to stop, watches end (UNAVAILABLE)."""
        if self._task is not None:
            self._task.cancel()
        if self.follow is not None:
            self.follow.close()
        if self.guests is not None:
            self.guests.shutdown()
        self._flush()
        for live in list(self._running.values()):
            for part in live.parts.values():
                if not part.ended and part.stream is not None and part.stream.active:
                    self.commands.send(part.stream, trace_stop=trace_pb2.TraceStop(session=live.session.id))
            self._end(live, TraceStatus.NODE_LOST, STOPPED, "node-lost", "collector")
        for live in self._live.values():
            for w in live.watchers:
                w.close()

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.limits.timing.tick_s)
            try:
                self.tick()
            except Exception:  # a bug here must not stop every later deadline
                log.exception("trace sessions: tick failed")

    def tick(self) -> None:
        """Deadlines the tracers did not confirm, namespace scopes again, counters and retention."""
        now, mono = time.time_ns(), time.monotonic()
        for live in list(self._running.values()):
            s = live.session
            if now >= s.deadline_unix_ns + int(self.limits.timing.end_grace_s * 1e9):
                silent = sorted(n for n, p in live.parts.items() if not p.ended)
                detail = "deadline" + (f"; no final batch from node {', '.join(silent)}" if silent else "")
                self._end(live, TraceStatus.COMPLETED, detail, "expire", "collector")
            elif (s.scope.namespace and not (live.resolving or live.stopping_by)
                  and mono >= live.next_resolve and now < s.deadline_unix_ns):
                live.resolving = True
                task = asyncio.get_running_loop().create_task(self._reresolve(live))
                self._tasks.add(task)  # the loop keeps only a weak reference
                task.add_done_callback(self._tasks.discard)
        if self.guests is not None:
            self.guests.tick()
        if self.homes is not None and mono >= self._next_home_check and not self._checking_homes:
            self._next_home_check = mono + self.limits.timing.home_gone_check_s
            self._checking_homes = True
            task = asyncio.get_running_loop().create_task(self._end_orphans(self.homes))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._flush()
        if mono >= self._next_prune:
            self._next_prune = mono + RETENTION_CHECK_S
            ended = [(s.id, s.ended_unix_ns) for s in self.sessions.values() if s.status.ended]
            self._forget(self.store.expired(ended, now, MAX_KEPT_SESSIONS), "retention (--trace-retention-h)")
            self.store.prune_audit(now - int(self.store.store.retention_s * 1e9))

    async def _end_orphans(self, homes: TraceHomes) -> None:
        """The sessions of home replicas that are gone, ended; kept here from now on (this replica
        took their rows over), so that its retention deletes them in time."""
        try:
            for s in await homes.end_orphans():
                self.sessions[s.id] = s
        except _STORE_ERRORS as e:  # the store out of reach (it says so): the next check tries again
            log.debug("trace sessions: no look for sessions of home replicas that are gone: %s", e)
        except Exception:
            log.exception("trace sessions: looking for sessions of home replicas that are gone failed")
        finally:
            self._checking_homes = False

    # ---- inside ---------------------------------------------------------------------------------

    async def _start_parts(self, live: LiveSession, targets: dict[str, set[str]],
                           pid_containers: frozenset[str] = frozenset()) -> dict[str, TraceError]:
        """trace_start on each node at once; the nodes that refused (or did not answer) and why.
        `pid_containers`: the containers the pid must be in (a caller who is not admin)."""
        s, errors, todo = live.session, {}, list(targets)
        for node in todo:
            live.parts[node] = NodePart(self.streams.get(node), frozenset(targets[node]))
        starts = [trace_pb2.TraceStart(
            session=s.id, container_ids=sorted(targets[n]), pid=s.scope.pid if n == s.scope.node else 0,
            pid_containers=sorted(pid_containers) if n == s.scope.node and s.scope.pid else (),
            gpu=s.scope.gpu, deadline_unix_ns=s.deadline_unix_ns, max_records=s.max_records) for n in todo]
        answers = await asyncio.gather(*(self.commands.call(live.parts[n].stream, self._names_for(live, n),
                                                            trace_start=start)
                                         for n, start in zip(todo, starts, strict=True)))
        for node, error in zip(todo, answers, strict=True):
            if error:
                errors[node] = live.notes[node] = node_error(node, error)
                stream = live.parts.pop(node).stream
                if error.startswith("timeout:") and stream is not None and stream.active:
                    # It may still start there (a slow tracer): tell it not to, or to stop at once.
                    self.commands.send(stream, trace_stop=trace_pb2.TraceStop(session=s.id))
            else:
                live.parts[node].started = True
        return errors

    def _names_for(self, live: LiveSession, node: str) -> dict[str, Any] | None:
        """For a node another replica serves: the names of its containers in scope, which that
        replica gives the node's records (collector/trace_guests.py)."""
        part = live.parts[node]
        if getattr(part.stream, "call_remote", None) is None:
            return None
        return {"names": {cid: list(live.names[cid]) for cid in part.container_ids if cid in live.names}}

    async def _reresolve(self, live: LiveSession) -> None:
        """The scope again: trace_update where a node's set changed, trace_start on new nodes."""
        s = live.session
        try:
            nodes = [n for n, st in self.streams.items() if st.active and n not in live.notes
                     and (not s.scope.node or n == s.scope.node)]
            res = await resolve(s.scope, nodes, self.transport_for)
            if live.session.status.ended or live.stopping_by:
                return
            new: dict[str, set[str]] = {}
            updates = []
            for node in nodes:
                if node in res.failures:
                    continue  # its runtime did not answer: its set stays as it is
                found = res.containers.get(node, {})
                live.names.update(found)
                part = live.parts.get(node)
                if part is not None and (not part.started or part.stream is None):
                    continue  # its trace_start is still out
                if part is None and found:
                    if (problem := capability_problem(self.streams, node)) is not None:
                        live.notes[node] = problem
                    else:
                        new[node] = set(found)
                elif part is not None and not part.ended and part.container_ids != set(found):
                    part.container_ids = frozenset(found)
                    update = trace_pb2.TraceUpdate(session=s.id, container_ids=sorted(found))
                    updates.append(self.commands.call(part.stream, self._names_for(live, node),
                                                      trace_update=update))
            for error in await asyncio.gather(*updates):
                if error:
                    log.warning("trace session %s: trace_update: %s", s.id, error)
            if new and not live.session.status.ended:
                await self._start_parts(live, new)
            self._update(live)
        finally:
            live.resolving = False
            live.next_resolve = time.monotonic() + self.limits.timing.reresolve_s

    def _update(self, live: LiveSession) -> None:
        """Nodes, container ids (every one ever in scope) and why nodes were left out, into the session."""
        s = live.session
        if s.status.ended:
            return
        ids = set(s.container_ids).union(*(p.container_ids for p in live.parts.values()))
        detail = "; ".join(e.line for e in live.notes.values())
        live.session = self.sessions[s.id] = replace(s, nodes=tuple(sorted(live.parts)),
                                                     container_ids=tuple(sorted(ids)), status_detail=detail)
        self._dirty.add(s.id)

    def _finish_if_done(self, live: LiveSession) -> None:
        if not live.parts or not all(p.ended for p in live.parts.values()):
            return
        if live.stopping_by:
            self._end(live, TraceStatus.STOPPED, f"stopped by {live.stopping_by}")
            return
        odd = {n: p.end_reason for n, p in live.parts.items() if p.end_reason != "deadline"}
        lines = [f"node {n}: {r}" for n, r in sorted(odd.items())] + [e.line for e in live.notes.values()]
        if len(odd) == len(live.parts) and all(r.startswith("error") for r in odd.values()):
            self._end(live, TraceStatus.FAILED, "; ".join(lines), "error", "collector")
        else:
            self._end(live, TraceStatus.COMPLETED, "; ".join(["deadline", *lines]), "expire", "collector")

    def _end(self, live: LiveSession, status: TraceStatus, detail: str, action: str = "",
             who: str = "") -> None:
        if live.session.status.ended:
            return
        s = live.session = self.sessions[live.session.id] = live.session.ended(status, detail, time.time_ns())
        self._running.pop(s.id, None)
        self._dirty.discard(s.id)
        self.store.save(s)
        if action:
            self.store.audit(s.id, action, who, detail)
        final = session_to_proto(s)
        for w in live.watchers:
            w.push([], final)
        live.done.set()
        for part in live.parts.values():  # an ended session holds no stream (and its queue) alive
            part.stream = None

    def _forget(self, ids: builtins.list[str], why: str) -> None:
        for sid in ids:
            self.sessions.pop(sid, None)
            self._live.pop(sid, None)
        if ids:
            self.store.delete(ids)
            log.info("trace sessions %s deleted: %s", ", ".join(ids), why)

    def _names(self, live: LiveSession, node: str, cid: str) -> Names | None:
        names = live.names.get(cid)
        if names is None and self.resolve_names is not None:
            info = self.resolve_names(node, cid)  # a cached answer, or a lookup started for next time
            if info.resolution == "resolved":
                names = live.names[cid] = (info.namespace, info.pod, info.container)
        return names

    def _flush(self) -> None:
        for sid in self._dirty:
            if (s := self.sessions.get(sid)) is not None:
                self.store.save(s)
        self._dirty.clear()

    def _new_id(self) -> str:
        while (sid := f"t-{secrets.token_hex(4)}") in self.sessions:
            pass
        return sid
