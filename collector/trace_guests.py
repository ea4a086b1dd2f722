"""The parts of trace sessions another collector replica started, on the nodes this replica serves.

A session lives at the replica the user called, its home (collector/traces.py): the policy, the
audit, the trace_sessions row, the deadline and the session's end are the home's. When one of its
nodes streams to another replica, the home sends that replica the node's trace_start (trace_update,
trace_stop) through the store (collector/replica_commands.py). This replica then keeps a `Guest` for
the part: it sends the command down the tracer's stream and answers with the tracer's error line,
names and stores the tracer's records in trace_records (the shared store, where WatchTrace on any
replica reads them) within the session's bound, and tells the home how the part stands with a
`trace_part` message to it: the counters at most every PROGRESS_S while records come, and the part's
end (the tracer's last batch; "node lost" when the stream ends or this replica stops). The home
sums the counters into the session and ends it as it ends one whose nodes are its own. Past the
deadline and end_grace_s with no last batch, the guest sends its last counters and is forgotten:
the home ends the session by its own deadline.

Everything here runs on the collector's event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ghostgpu.collector.replica_commands import ReplicaCommand, ReplicaCommandError, ReplicaCommands
from ghostgpu.collector.trace_commands import TraceCommands
from ghostgpu.collector.trace_scope import Names, capability_problem, name_records
from ghostgpu.collector.trace_store import TraceStore

from ghostgpu.v1 import stream_pb2, trace_pb2

if TYPE_CHECKING:
    from ghostgpu.collector.ingest import IngestSession

log = logging.getLogger(__name__)

PROGRESS_S = 1.0  # a guest's counters reach its home at most this often while records come
REPORT_DEADLINE_S = 60.0  # a trace_part message not run by then is dropped (its home is gone)
COMMANDS = ("trace_start", "trace_update", "trace_stop")
PART = "trace_part"  # the message kind: a guest's state, to its home


@dataclass
class Guest:
    """One node's part of a session whose home is another replica."""

    session: str
    node: str
    home: str  # the replica that started it
    stream: Any  # the IngestSession it runs on
    deadline_unix_ns: int
    max_records: int
    names: dict[str, Names] = field(default_factory=dict)
    stored: int = 0  # records stored here
    dropped_store: int = 0  # records the session's bound kept out
    dropped_limit: int = 0  # the tracer's running totals, from its latest batch
    dropped_ringbuf: int = 0
    dropped_transport: int = 0
    dirty: bool = False  # counters changed since the home last heard
    next_report_mono: float = 0.0

    def state(self, ended: bool, end_reason: str) -> dict[str, Any]:
        """What the home applies (collector/traces.py TraceBook.remote_part)."""
        return {"session": self.session, "node": self.node, "stored": self.stored,
                "dropped_store": self.dropped_store, "dropped_limit": self.dropped_limit,
                "dropped_ringbuf": self.dropped_ringbuf, "dropped_transport": self.dropped_transport,
                "ended": ended, "end_reason": end_reason}


def _result(session: str, error: str) -> bytes:
    return trace_pb2.TraceCommandResult(session=session, error=error).SerializeToString()


class TraceGuests:
    """The guests of this replica, by session; it answers the home replicas' trace commands."""

    def __init__(self, local: Mapping[str, IngestSession], store: TraceStore, commands: TraceCommands,
                 replica: ReplicaCommands, end_grace_s: float,
                 resolve_names: Callable[[str, str], Any] | None = None) -> None:
        self.local = local  # this replica's own streams (Ingest.sessions)
        self.store = store
        self.commands = commands
        self.replica = replica
        self.end_grace_s = end_grace_s
        self.resolve_names = resolve_names  # the CRI resolver's cache, for ids the home did not name
        self.guests: dict[str, Guest] = {}
        for kind in COMMANDS:
            replica.handle(kind, self.command)

    async def command(self, cmd: ReplicaCommand) -> bytes:
        """A home's trace command for a node of this replica: the tracer's TraceCommandResult."""
        c = stream_pb2.Command.FromString(cmd.payload)
        kind = c.WhichOneof("body")
        if kind not in COMMANDS:
            raise ReplicaCommandError(f"gone: a {cmd.kind} row carried a {kind or 'empty'} command")
        body = getattr(c, kind)
        sid, node, me = body.session, cmd.node, self.replica.replica_id
        stream = self.local.get(node)
        if stream is None or not stream.active:
            return _result(sid, f"gone: node {node}'s tracer is no longer connected to replica {me}")
        named = dict(cmd.meta.get("names") or {})
        names = {cid: (n[0], n[1], n[2]) for cid, n in named.items() if len(n) == 3}
        if kind != "trace_start":
            if (running := self.guests.get(sid)) is not None:
                running.names.update(names)  # an update's containers new to the session
            return _result(sid, await self.commands.call(stream, **{kind: body}))
        if (problem := capability_problem(self.local, node)) is not None:
            return _result(sid, problem.line)
        guest = self.guests[sid] = Guest(sid, node, cmd.from_replica, stream, body.deadline_unix_ns,
                                         body.max_records, names)  # from here: early batches are kept
        error = await self.commands.call(stream, trace_start=body)
        if error:
            if self.guests.get(sid) is guest:
                self._forget(guest)
            if error.startswith("timeout:") and stream.active:  # it may start late: tell it not to
                self.commands.send(stream, trace_stop=trace_pb2.TraceStop(session=sid))
        return _result(sid, error)

    def batch(self, stream: IngestSession, tb: trace_pb2.TraceBatch) -> bool:
        """A TraceBatch of a guest (True), stored and counted here; False when it is no guest's."""
        guest = self.guests.get(tb.session)
        if guest is None or guest.node != stream.node:
            return False
        if guest.stream is not stream:
            return True  # an older stream's: the part ended with it
        records, node = tb.records, stream.node
        name_records(records, node, lambda cid: self._names(guest, cid))
        n = len(records)
        fit = self.store.fit(guest.session, n, guest.max_records)
        if fit < n:
            del records[fit:]
        if fit:
            self.store.add(guest.session, node, records[0].seq, records[-1].seq, fit, tb.SerializeToString())
        guest.stored += fit
        guest.dropped_store += n - fit
        guest.dropped_limit = max(guest.dropped_limit, tb.dropped_limit_total)
        guest.dropped_ringbuf = max(guest.dropped_ringbuf, tb.dropped_ringbuf_total)
        guest.dropped_transport = max(guest.dropped_transport, tb.dropped_transport_total)
        guest.dirty = True
        if tb.ended:
            self._end(guest, True, tb.end_reason or "deadline")
        return True

    def stream_ended(self, stream: IngestSession) -> None:
        for guest in [g for g in self.guests.values() if g.stream is stream]:
            self._end(guest, True, "node lost")

    def tick(self) -> None:
        """Counters to the homes; guests past their deadline and end_grace_s forgotten."""
        now, mono = time.time_ns(), time.monotonic()
        for guest in list(self.guests.values()):
            if now >= guest.deadline_unix_ns + int(self.end_grace_s * 1e9):
                self._end(guest, False, "")
            elif guest.dirty and mono >= guest.next_report_mono:
                self._report(guest, False, "")

    def shutdown(self) -> None:
        """This replica stops: the tracers are told to stop, the homes that their parts are lost."""
        for guest in list(self.guests.values()):
            if guest.stream.active:
                self.commands.send(guest.stream, trace_stop=trace_pb2.TraceStop(session=guest.session))
            self._end(guest, True, "node lost")

    def _end(self, guest: Guest, ended: bool, end_reason: str) -> None:
        self._forget(guest)
        self._report(guest, ended, end_reason)

    def _forget(self, guest: Guest) -> None:
        self.guests.pop(guest.session, None)
        # The session's records count against its home's bound, not this replica's total.
        self.store.total -= self.store.counts.pop(guest.session, 0)

    def _report(self, guest: Guest, ended: bool, end_reason: str) -> None:
        guest.dirty, guest.next_report_mono = False, time.monotonic() + PROGRESS_S
        self.replica.post(f"@{guest.home}", PART, deadline_s=REPORT_DEADLINE_S,
                          meta=guest.state(ended, end_reason))

    def _names(self, guest: Guest, cid: str) -> Names | None:
        names = guest.names.get(cid)
        if names is None and self.resolve_names is not None:
            info = self.resolve_names(guest.node, cid)  # a cached answer, or a lookup started for next time
            if info.resolution == "resolved":
                names = guest.names[cid] = (info.namespace, info.pod, info.container)
        return names
