"""Commands that cross collector replicas: a trace start, update or stop, or a CRI call, for a node
whose tracer streams to another replica than the one the user called.

    replica = ReplicaCommands(store, notifier, "collector-0", ingest.sessions, fence=leases.fence)
    replica.serve_cri(local_transport_for)     # this replica answers CRI calls for the nodes it serves
    replica.start()                            # on the loop: the LISTEN subscription and the sweep
    raw = await replica.send("gpu-7", "cri", request, deadline_s=7.0)
    replica.transport("gpu-7")                 # a CriTransport through the replica serving gpu-7, or None

The replica the user called (A) checks authorization, policy and audit as it always does; only the
node-facing part goes to the replica serving the node's stream (B), through the shared store: A
inserts a row into `replica_commands` (id, node, kind, body, from_replica, created_unix_ns,
answered_unix_ns, result) and, in the same transaction, `NOTIFY ghostgpu_commands 'q ID NODE'`. B
claims the row (an UPDATE of an open row, fenced by B's lease token on the node: only the replica
holding the node's lease runs it, once), runs it on the tracer's stream (the handler registered for
its kind), writes the result into the row and `NOTIFY ghostgpu_commands 'a ID A'`. A wakes on that
notice and reads the row; it also polls the row with a growing back-off, so a notice lost (the
listener reconnecting) costs a poll's delay, not the command. B sweeps for open rows of its nodes
every `sweep_s` for the same reason. The node's tracer still enforces its own limits. A sender may
ask for its row to be claimed within `claim_s` (a stop for a session's home, collector/trace_homes.py):
a replica that is there claims within a sweep, so an unclaimed row means it is gone, and the sender
gives up then rather than at the deadline. `stats` counts the commands sent and run, by kind and
result, for /metrics (ghostgpu_collector_replica_commands_total).

A row's state is its answered_unix_ns: 0 open; negative claimed (minus the claim's time, `result`
naming the claiming replica); positive answered (`result` the answer). A sender whose deadline
passes marks its row answered if still open, so a row nobody claimed in time never runs late; a
replica also refuses a row whose deadline (in its body) has passed. `node` is the node whose
serving replica runs the row, or `@REPLICA` for a message to that replica (the trace parts' progress,
collector/trace_guests.py): node names are DNS-1123 subdomains, which never start with `@`.

The body: an 8-byte deadline (unix ns, big-endian), a 4-byte length and that many bytes of JSON
metadata (the container names of a trace start, a part's counters), then the payload (a serialized
ghostgpu.v1.Command, or CriRequest). The result: one tag byte, 0 then the payload (the serialized
TraceCommandResult or CriResponse), 1 then an error line the replica running it wrote.

With SQLite one collector serves every node: nothing is ever remote, no row is written (the
Collector builds no ReplicaCommands). Everything here runs on the collector's event loop but
`transport()`'s calls (worker threads); the SQL runs on the store's writer thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import sqlite3
import struct
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import grpc
from ghostgpu.collector.cri_fetch import CriCallError, CriTransport
from ghostgpu.collector.db import Conn, db_errors
from ghostgpu.collector.notices import COMMANDS_CHANNEL
from ghostgpu.collector.store import StoreError

from ghostgpu.v1 import stream_pb2, trace_pb2

log = logging.getLogger(__name__)

CHANNEL = COMMANDS_CHANNEL
_HEAD = struct.Struct(">QI")  # deadline_unix_ns, metadata length
OK, ERROR = 0, 1  # the result's tag byte
CLAIM_WINDOW_NS = 600 * 1_000_000_000  # rows older than this are never claimed (the store prunes them)
_CODES = {c.value[0]: c for c in grpc.StatusCode}
_COLUMNS = "id, node, kind, body, from_replica, created_unix_ns"
_STORE_ERRORS = (*db_errors(), StoreError)
ANY_TOKEN = -1  # claim a row of a node whose lease this replica holds, whatever the token (tokens are >= 1)


class ReplicaCommandError(Exception):
    """A command that got no answer from the node's replica: one line with the trace commands'
    prefix (collector/trace_commands.py): "timeout: ..." or "gone: ...". `answered`: False when
    the replica answered with this error line, None when no answer came (or none was handed over)."""

    def __init__(self, line: str, *, timeout: bool = False, answered: bool | None = False) -> None:
        super().__init__(line)
        self.line, self.timeout, self.answered = line, timeout, answered


@dataclass(frozen=True)
class ReplicaTiming:
    """Polls and sweeps: not settings (tests shorten them)."""

    sweep_s: float = 1.0  # open rows of this replica's nodes looked for, and who serves which node
    sweep_unlistened_s: float = 0.1  # the same without a notifier: the sweep is how rows are found
    first_poll_s: float = 0.05  # a sender reads its row this soon, then twice as late each time...
    max_poll_s: float = 1.0  # ...up to this (a notice wakes it at once)
    hop_s: float = 2.0  # waited for past the node's own wait: two store round trips and a notice


@dataclass(frozen=True)
class ReplicaCommand:
    """One row, as the replica running it reads it."""

    id: int
    node: str  # the node, or "@REPLICA" for a message to a replica
    kind: str  # "cri", "trace_start", "trace_update", "trace_stop", "trace_part"
    from_replica: str
    created_unix_ns: int
    deadline_unix_ns: int
    meta: dict[str, Any]
    payload: bytes


Handler = Callable[[ReplicaCommand], Awaitable[bytes]]


# ---- the row's bytes -------------------------------------------------------------------------------


def encode_body(deadline_unix_ns: int, meta: Mapping[str, Any], payload: bytes) -> bytes:
    head = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode() if meta else b""
    return _HEAD.pack(deadline_unix_ns, len(head)) + head + payload


def decode_body(body: bytes) -> tuple[int, dict[str, Any], bytes]:
    """(deadline_unix_ns, meta, payload); ValueError for bytes that are no body."""
    if len(body) < _HEAD.size:
        raise ValueError(f"replica command body of {len(body)} bytes is shorter than its header")
    deadline, n = _HEAD.unpack_from(body)
    end = _HEAD.size + n
    if end > len(body):
        raise ValueError(f"replica command body: metadata of {n} bytes runs past its {len(body)} bytes")
    meta = json.loads(body[_HEAD.size:end]) if n else {}
    if not isinstance(meta, dict):
        raise ValueError("replica command body: its metadata is not a JSON object")
    return deadline, meta, bytes(body[end:])


def encode_result(payload: bytes = b"", error: str = "") -> bytes:
    return bytes([ERROR]) + error.encode() if error else bytes([OK]) + payload


def decode_result(result: bytes) -> bytes:
    """The payload of an answer; ReplicaCommandError for an error line (or bytes that are no answer)."""
    if result[:1] == bytes([OK]):
        return bytes(result[1:])
    line = bytes(result[1:]).decode(errors="replace") if result[:1] == bytes([ERROR]) else ""
    raise ReplicaCommandError(line or f"gone: a replica answered with {len(result)} bytes that are no answer",
                              timeout=line.startswith("timeout:"))


def _row(r: Any) -> ReplicaCommand:
    cid, node, kind, body, sender, created = r
    deadline, meta, payload = decode_body(bytes(body))
    return ReplicaCommand(int(cid), node, kind, sender, int(created), deadline, meta, payload)


# ---- the SQL (Store.read / Store.read_write functions; portable) -----------------------------------------


def _notify(conn: Conn, payload: str) -> None:
    """NOTIFY in the caller's transaction (PostgreSQL sends it at the commit); SQLite has none."""
    if not isinstance(conn, sqlite3.Connection):
        conn.execute("SELECT pg_notify(?, ?)", (CHANNEL, payload))


def insert_command(conn: Conn, node: str, kind: str, body: bytes, sender: str, now_unix_ns: int) -> int:
    """A new open row; its id. The notice goes out when the transaction commits."""
    cid = int(conn.execute(
        "INSERT INTO replica_commands (node, kind, body, from_replica, created_unix_ns, answered_unix_ns, "
        "result) VALUES (?, ?, ?, ?, ?, 0, ?) RETURNING id", (node, kind, body, sender, now_unix_ns, b""),
    ).fetchone()[0])
    _notify(conn, f"q {cid} {node}")
    return cid


def claim(conn: Conn, cid: int, node: str, replica: str, token: int | None, now_unix_ns: int,
          ) -> ReplicaCommand | None:
    """Claim one open row for `node` (or this replica's "@REPLICA"): with a `token`, only while this
    replica holds the node's lease with it (ANY_TOKEN: holds it with any token); the row, or None
    when it is not (or no longer) open, or not this replica's to run."""
    sql = ("UPDATE replica_commands SET answered_unix_ns = ?, result = ? WHERE id = ? AND node = ? "
           "AND answered_unix_ns = 0 AND created_unix_ns > ?")
    args: list[Any] = [-now_unix_ns, replica.encode(), cid, node, now_unix_ns - CLAIM_WINDOW_NS]
    if token == ANY_TOKEN:
        sql += " AND EXISTS (SELECT 1 FROM node_leases WHERE node = ? AND owner = ?)"
        args += [node, replica]
    elif token is not None:
        sql += " AND EXISTS (SELECT 1 FROM node_leases WHERE node = ? AND owner = ? AND token = ?)"
        args += [node, replica, token]
    row = conn.execute(f"{sql} RETURNING {_COLUMNS}", args).fetchone()
    if row is None:
        return None
    try:
        return _row(row)
    except ValueError as e:  # a writer that is no ghostgpu of this version: answered, never run
        answer(conn, cid, row[4], encode_result(error=f"gone: {e}"), now_unix_ns)
        return None


def claim_open(conn: Conn, targets: Mapping[str, int | None], replica: str, now_unix_ns: int,
               ) -> list[ReplicaCommand]:
    """Claim every open row of `targets` (node -> lease token, ANY_TOKEN, or None: no fence), oldest
    first."""
    if not targets:
        return []
    nodes = sorted(targets)
    marks = ", ".join("?" * len(nodes))
    open_rows = conn.execute(
        f"SELECT id, node FROM replica_commands WHERE node IN ({marks}) AND answered_unix_ns = 0 "
        "AND created_unix_ns > ? ORDER BY id", (*nodes, now_unix_ns - CLAIM_WINDOW_NS)).fetchall()
    out = []
    for cid, node in open_rows:
        got = claim(conn, int(cid), node, replica, targets[node], now_unix_ns)
        if got is not None:
            out.append(got)
    return out


def answer(conn: Conn, cid: int, sender: str, result: bytes, now_unix_ns: int) -> bool:
    """Write the answer of a row this replica claimed (or that no one did); False when it was
    answered already (its sender gave up on it)."""
    done = conn.execute("UPDATE replica_commands SET answered_unix_ns = ?, result = ? WHERE id = ? "
                        "AND answered_unix_ns <= 0", (now_unix_ns, result, cid)).rowcount == 1
    if done:
        _notify(conn, f"a {cid} {sender}")
    return done


def read_answer(conn: Conn, cid: int) -> bytes | None:
    """The row's result once answered; None while open or claimed (or gone)."""
    row = conn.execute("SELECT answered_unix_ns, result FROM replica_commands WHERE id = ?",
                       (cid,)).fetchone()
    return bytes(row[1]) if row is not None and row[0] > 0 else None


def give_up_open(conn: Conn, cid: int, line: str, now_unix_ns: int) -> bool:
    """Answer a row still open (claimed by nobody) with `line`, so that it never runs; whether it was."""
    done = conn.execute("UPDATE replica_commands SET answered_unix_ns = ?, result = ? WHERE id = ? "
                        "AND answered_unix_ns = 0", (now_unix_ns, encode_result(error=line), cid))
    return bool(done.rowcount == 1)


def give_up(conn: Conn, cid: int, line: str, now_unix_ns: int) -> bytes | None:
    """The sender's deadline passed: an open row is answered with `line` (never to run); the answer of
    one answered meanwhile; None for one still running (claimed)."""
    if give_up_open(conn, cid, line, now_unix_ns):
        return None
    return read_answer(conn, cid)


def live_owners(conn: Conn, now_unix_ns: int) -> dict[str, str]:
    """node -> the replica whose lease on it is live."""
    rows = conn.execute("SELECT node, owner FROM node_leases WHERE expires_unix_ns > ?",
                        (now_unix_ns,)).fetchall()
    return {node: owner for node, owner in rows}


# ---- a node another replica serves ------------------------------------------------------------------------


class RemoteStream:
    """A node's stream as another replica serves it: what the trace book (collector/traces.py)
    needs of an IngestSession, its commands sent through that replica (collector/trace_commands.py
    calls `call_remote` / `send_remote` for a stream that has them)."""

    hello = None  # the owner checks the tracer's capabilities itself
    cri_relay = True

    def __init__(self, replica: ReplicaCommands, node: str, owner: str) -> None:
        self.replica, self.node, self.owner = replica, node, owner

    @property
    def active(self) -> bool:
        return self.replica.owners.get(self.node) == self.owner and not self.replica.serves(self.node)

    async def call_remote(self, timeout_s: float, meta: Mapping[str, Any] | None = None, **body: Any) -> str:
        """A trace command answered by the node's tracer through its replica: the error line, "" when done."""
        kind = next(iter(body))
        payload = stream_pb2.Command(**body).SerializeToString()
        try:
            wait_s = timeout_s + self.replica.timing.hop_s
            raw = await self.replica.send(self.node, kind, payload, wait_s, meta)
            return trace_pb2.TraceCommandResult.FromString(raw).error
        except ReplicaCommandError as e:
            return e.line
        except Exception as e:  # undecodable answer: this part's failure alone
            return (f"gone: replica {self.owner} answered {kind} for node {self.node} with what is not "
                    f"one: {e}")

    def send_remote(self, **body: Any) -> None:
        """A trace command nobody waits for (a stop at shutdown, after a start that timed out)."""
        kind = next(iter(body))
        self.replica.post(self.node, kind, stream_pb2.Command(**body).SerializeToString())


class ClusterStreams(Mapping[str, Any]):
    """Every node's stream the trace book may use: this replica's own (the IngestSessions), then a
    RemoteStream for each node another replica serves (a live lease)."""

    def __init__(self, local: Mapping[str, Any], replica: ReplicaCommands) -> None:
        self.local, self.replica = local, replica

    def __getitem__(self, node: str) -> Any:
        stream = self.local.get(node)
        if stream is not None:
            return stream
        remote = self.replica.remote_stream(node)
        if remote is None:
            raise KeyError(node)
        return remote

    def __iter__(self) -> Iterator[str]:
        yield from list(self.local)
        yield from [n for n in self.replica.owners if n not in self.local]

    def __len__(self) -> int:
        return len(self.local) + sum(1 for n in self.replica.owners if n not in self.local)


# ---- the replica's side ------------------------------------------------------------------------------


SENT, RUN = "sent", "run"  # a count's role: handed to another replica, or claimed and run here
# A count's result. Sent: answered with a payload (ok) or an error line (error, a hand-over that failed
# included), no answer in time (timeout), nobody waits for one (posted). Run: the answer written.
RESULTS = {SENT: ("ok", "error", "timeout", "posted"), RUN: ("ok", "error")}
OTHER_KIND = "other"  # a row of a kind this replica runs no handler for (a mixed rollout)


@dataclass
class _Stats:
    """Commands by (role, kind, result), for /metrics (collector/metrics.py). Kinds are this
    version's handlers' (a row of any other counts as OTHER_KIND), so the label set stays bounded.
    Written on the loop; a scrape copies the dict (one C-level copy under the GIL)."""

    counts: dict[tuple[str, str, str], int] = field(default_factory=dict)

    def add(self, role: str, kind: str, result: str) -> None:
        key = (role, kind, result)
        self.counts[key] = self.counts.get(key, 0) + 1

    def total(self, role: str, result: str | None = None) -> int:
        return sum(n for (r, _, res), n in self.counts.items() if r == role and result in (None, res))

    @property
    def sent_total(self) -> int:
        return self.total(SENT)

    @property
    def run_total(self) -> int:
        return self.total(RUN)

    @property
    def timeouts_total(self) -> int:
        return self.total(SENT, "timeout")


class ReplicaCommands:
    """See the module docstring. `local_sessions`: the nodes whose streams this replica serves
    (Ingest.sessions); `fence(node)`: (node, lease token) while this replica holds the node's lease
    (collector/leases.py Leases.fence), None otherwise; without it, a connected stream is enough."""

    def __init__(self, store: Any, notifier: Any, replica_id: str, local_sessions: Mapping[str, Any], *,
                 fence: Callable[[str], tuple[str, int] | None] | None = None,
                 timing: ReplicaTiming | None = None) -> None:
        self.store = store
        self.notifier = notifier
        self.replica_id = replica_id
        self.address = f"@{replica_id}"  # the `node` of rows for this replica itself
        self.local = local_sessions
        self.fence = fence
        self.timing = timing or ReplicaTiming()
        self.owners: dict[str, str] = {}  # node -> the replica serving it (other replicas' nodes)
        self.lapsed: set[str] = set()  # nodes whose lease is this replica's, their stream gone (_learn)
        self.stats = _Stats()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._handlers: dict[str, Handler] = {}
        self._waiting: dict[int, asyncio.Event] = {}  # sent rows -> woken by their answer's notice
        self._running: set[int] = set()  # rows claimed here and running
        self._remote: dict[tuple[str, str], RemoteStream] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._unsubscribe: Callable[[], None] | None = None

    # ---- wiring --------------------------------------------------------------------------------------

    def handle(self, kind: str, handler: Handler) -> None:
        """Run `handler` for rows of `kind` this replica claims; what it returns is the answer's
        payload, ReplicaCommandError its error line."""
        self._handlers[kind] = handler

    def serve_cri(self, transport_for: Callable[[str], CriTransport | None]) -> None:
        """Answer CRI calls for the nodes this replica serves, through `transport_for` (the node's
        tracer relay, or the collector's own socket; never back through the store)."""
        self.handle("cri", partial(self._run_cri, transport_for))

    @property
    def listening(self) -> bool:
        """Notices come (PostgreSQL's LISTEN, collector/notify.py): the polls and sweeps are only the
        fallback for a lost one."""
        return self.notifier is not None and getattr(self.notifier, "engine", "postgresql") == "postgresql"

    def start(self) -> None:
        """On the loop: listen for notices (with a notifier) and sweep."""
        self.loop = asyncio.get_running_loop()
        if self.notifier is not None:
            self._unsubscribe = self.notifier.subscribe(CHANNEL, self._notified)
        self._sweeper = self.loop.create_task(self._sweep_loop())

    def close(self) -> None:
        """Stop sweeping; senders still waiting give up at their deadlines."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._unsubscribe is not None:
            self._unsubscribe()
        for task in list(self._tasks):
            task.cancel()

    # ---- who serves a node ---------------------------------------------------------------------------

    def serves(self, node: str) -> bool:
        """This replica applies the node's stream now (and holds its lease, with a fence)."""
        stream = self.local.get(node)
        return (stream is not None and getattr(stream, "active", True)
                and (self.fence is None or self.fence(node) is not None))

    def remote_stream(self, node: str) -> RemoteStream | None:
        owner = self.owners.get(node)
        if owner is None or node in self.local:
            return None
        key = (node, owner)
        if key not in self._remote:
            self._remote = {k: v for k, v in self._remote.items() if self.owners.get(k[0]) == k[1]}
            self._remote[key] = RemoteStream(self, node, owner)
        return self._remote[key]

    def transport(self, node: str) -> CriTransport | None:
        """A blocking CRI transport through the replica serving `node` (worker threads only), or None
        for a node this replica serves or nobody does."""
        if node in self.local or node not in self.owners:
            return None
        return partial(self._cri_call, node)

    async def refresh(self) -> None:
        """Read who serves which node now (before a trace start resolves its scope)."""
        self._learn(await asyncio.wrap_future(self.store.read(_owners_now)))

    def _learn(self, live: Mapping[str, str]) -> None:
        self.owners = {node: owner for node, owner in live.items() if owner != self.replica_id}
        # This replica's leases on nodes whose stream it no longer serves (gone, the lease not yet run
        # out): it still takes their rows, to answer that the tracer left rather than let them wait.
        self.lapsed = {node for node, owner in live.items()
                       if owner == self.replica_id and node not in self.local}

    # ---- the sender's side ---------------------------------------------------------------------------

    async def send(self, node: str, kind: str, payload: bytes, deadline_s: float,
                   meta: Mapping[str, Any] | None = None, *, claim_s: float | None = None) -> bytes:
        """Have the replica serving `node` (or "@REPLICA") run a command; its answer's payload within
        `deadline_s`, else ReplicaCommandError ("timeout: ..." or "gone: ..."). With `claim_s`, a
        row still unclaimed after claim_s is given up at once: a replica that is there claims a row
        within a sweep, so its replica is gone (or cut off from the store)."""
        try:
            result = await self._send(node, kind, payload, deadline_s, meta, claim_s)
        except ReplicaCommandError as e:
            self.stats.add(SENT, kind, "timeout" if e.answered is None else "error")
            raise
        self.stats.add(SENT, kind, "ok")
        return result

    async def _send(self, node: str, kind: str, payload: bytes, deadline_s: float,
                    meta: Mapping[str, Any] | None, claim_s: float | None) -> bytes:
        deadline_mono = time.monotonic() + deadline_s
        claim_by = deadline_mono if claim_s is None else time.monotonic() + claim_s
        owner = node[1:] if node.startswith("@") else self.owners.get(node, "serving it")
        what = kind if node.startswith("@") else f"{kind} for node {node}"
        cid = await self._insert(node, kind, payload, deadline_s, meta)
        wake = self._waiting[cid] = asyncio.Event()
        delay = self.timing.first_poll_s if self.listening else self.timing.first_poll_s / 2
        max_delay = self.timing.max_poll_s if self.listening else self.timing.max_poll_s / 4
        try:
            while (remaining := deadline_mono - time.monotonic()) > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), max(0.0, min(delay, remaining,
                                                                     claim_by - time.monotonic())))
                wake.clear()
                delay = min(delay * 2, max_delay)
                with contextlib.suppress(*_STORE_ERRORS):  # the store out of reach: poll again
                    result = await asyncio.wrap_future(self.store.read(partial(read_answer, cid=cid)))
                    if result is not None:
                        return decode_result(result)
                if claim_by < deadline_mono and time.monotonic() >= claim_by:  # with claim_s: once
                    claim_by = deadline_mono
                    line = (f"timeout: replica {owner} did not take {what} within {claim_s:g} s "
                            "(is it running?)")
                    with contextlib.suppress(*_STORE_ERRORS):
                        if await asyncio.wrap_future(self.store.read_write(
                                partial(give_up_open, cid=cid, line=line, now_unix_ns=time.time_ns()))):
                            raise ReplicaCommandError(line, timeout=True, answered=None)
            line = f"timeout: replica {owner} did not answer {what} within {deadline_s:g} s"
            with contextlib.suppress(*_STORE_ERRORS):
                result = await asyncio.wrap_future(self.store.read_write(
                    partial(give_up, cid=cid, line=line, now_unix_ns=time.time_ns())))
                if result is not None:
                    return decode_result(result)
            raise ReplicaCommandError(line, timeout=True, answered=None)
        finally:
            self._waiting.pop(cid, None)

    def post(self, node: str, kind: str, payload: bytes = b"", deadline_s: float = 60.0,
             meta: Mapping[str, Any] | None = None) -> None:
        """A command or message nobody waits for (node "@REPLICA" for a replica)."""
        body = encode_body(time.time_ns() + int(deadline_s * 1e9), meta or {}, payload)
        fut = self.store.read_write(partial(insert_command, node=node, kind=kind, body=body,
                                            sender=self.replica_id, now_unix_ns=time.time_ns()))
        fut.add_done_callback(partial(_log_failure, f"{kind} for {node}"))
        self.stats.add(SENT, kind, "posted")

    async def _insert(self, node: str, kind: str, payload: bytes, deadline_s: float,
                      meta: Mapping[str, Any] | None) -> int:
        body = encode_body(time.time_ns() + int(deadline_s * 1e9), meta or {}, payload)
        try:
            return await asyncio.wrap_future(self.store.read_write(partial(
                insert_command, node=node, kind=kind, body=body, sender=self.replica_id,
                now_unix_ns=time.time_ns())))
        except Exception as e:  # the store out of reach, or failed for good
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            to = (f"to replica {node[1:]}" if node.startswith("@")
                  else f"for node {node} to the replica serving it")
            raise ReplicaCommandError(f"gone: cannot hand {kind} {to} ({first})") from None

    def _cri_call(self, node: str, method: str, request: bytes, timeout_s: float) -> bytes:
        """One CRI call through the node's replica (blocking: a worker thread's)."""
        loop = self.loop
        if loop is None or loop.is_closed():
            raise CriCallError(grpc.StatusCode.UNAVAILABLE, f"node {node}: this collector is not serving")
        from ghostgpu.collector.relay import ROUND_TRIP_S

        req = stream_pb2.CriRequest(method=method, request=request, timeout_ms=max(1, int(timeout_s * 1000)))
        wait_s = timeout_s + ROUND_TRIP_S + self.timing.hop_s
        fut = asyncio.run_coroutine_threadsafe(self.send(node, "cri", req.SerializeToString(), wait_s), loop)
        try:
            error = fut.exception(wait_s + 1.0)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            error = ReplicaCommandError(f"timeout: CRI {method} for node {node} took over {wait_s:g} s",
                                        timeout=True)
        if isinstance(error, ReplicaCommandError):  # a new error: see collector/relay.py answer_of
            code = grpc.StatusCode.DEADLINE_EXCEEDED if error.timeout else grpc.StatusCode.UNAVAILABLE
            raise CriCallError(code, error.line)
        if error is not None:
            raise CriCallError(grpc.StatusCode.INTERNAL, f"CRI {method} for node {node}: {error}")
        r = stream_pb2.CriResponse.FromString(fut.result())
        if r.code == 0:
            return bytes(r.response)
        raise CriCallError(_CODES.get(r.code, grpc.StatusCode.UNKNOWN), r.message)

    # ---- the serving side ----------------------------------------------------------------------------

    def _notified(self, payload: str | None) -> None:
        """The notifier's callback, on the loop. None: the listener (re)connected, and what was
        sent meanwhile went unheard: sweep now, and every waiting sender reads its row."""
        if payload is None:
            for waiting in self._waiting.values():
                waiting.set()
            self._spawn(self.sweep())
            return
        what, _, rest = payload.partition(" ")
        cid_text, _, target = rest.partition(" ")
        if not cid_text.isdigit():
            log.debug("replica commands: a notice that is none of ours: %r", payload[:80])
            return
        cid = int(cid_text)
        if what == "a" and target == self.replica_id:
            wake = self._waiting.get(cid)
            if wake is not None:
                wake.set()
        elif what == "q" and cid not in self._running:
            ours, token = self._fence_of(target)
            if ours:
                self._spawn(self._claim_one(cid, target, token))

    def _fence_of(self, node: str) -> tuple[bool, int | None]:
        """(whether this replica runs rows of `node`, the lease token to claim them with, None: no fence)."""
        if node == self.address:
            return True, None
        if not self.serves(node):
            return node in self.lapsed, ANY_TOKEN
        fenced = self.fence(node) if self.fence is not None else None
        return True, (fenced[1] if fenced is not None else None)

    async def _claim_one(self, cid: int, node: str, token: int | None) -> None:
        got = await asyncio.wrap_future(self.store.read_write(partial(
            claim, cid=cid, node=node, replica=self.replica_id, token=token, now_unix_ns=time.time_ns())))
        if got is not None:
            await self._run(got)

    async def _sweep_loop(self) -> None:
        every_s = self.timing.sweep_s if self.listening else self.timing.sweep_unlistened_s
        while True:
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the store out of reach: the next sweep tries again
                log.debug("replica commands: sweep failed: %s", e)
            await asyncio.sleep(every_s)

    async def sweep(self) -> None:
        """Who serves which node, and the open rows of this replica's nodes (a notice missed)."""
        targets: dict[str, int | None] = {self.address: None}
        for node in [*self.local, *self.lapsed]:
            ours, token = self._fence_of(node)
            if ours:
                targets[node] = token
        live, rows = await asyncio.wrap_future(self.store.read_write(partial(
            _sweep, targets=targets, replica=self.replica_id, now_unix_ns=time.time_ns())))
        self._learn(live)
        for row in rows:
            if row.id not in self._running:
                self._spawn(self._run(row))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)  # the loop keeps only a weak reference
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.warning("replica commands: %s", error)

    async def _run(self, cmd: ReplicaCommand) -> None:
        """Run a claimed row and write its answer."""
        self._running.add(cmd.id)
        try:
            result = await self._result(cmd)
            self.stats.add(RUN, cmd.kind if cmd.kind in self._handlers else OTHER_KIND,
                           "ok" if result[:1] == bytes([OK]) else "error")
            await asyncio.wrap_future(self.store.read_write(partial(
                answer, cid=cmd.id, sender=cmd.from_replica, result=result, now_unix_ns=time.time_ns())))
        finally:
            self._running.discard(cmd.id)

    async def _result(self, cmd: ReplicaCommand) -> bytes:
        me, where = self.replica_id, cmd.node
        remaining_s = (cmd.deadline_unix_ns - time.time_ns()) / 1e9
        handler = self._handlers.get(cmd.kind)
        if remaining_s <= 0:
            return encode_result(error=f"timeout: {cmd.kind} for {where} reached replica {me} past its "
                                 "deadline")
        if handler is None:
            return encode_result(error=f"gone: replica {me} runs no {cmd.kind} commands (a mixed rollout? "
                                 "run one ghostgpu version on every replica)")
        try:
            return encode_result(await asyncio.wait_for(handler(cmd), remaining_s))
        except TimeoutError:
            return encode_result(error=f"timeout: replica {me} did not finish {cmd.kind} for {where} "
                                 f"within {remaining_s:.3g} s")
        except ReplicaCommandError as e:
            return encode_result(error=e.line)
        except Exception as e:
            log.exception("replica commands: %s for %s failed", cmd.kind, where)
            return encode_result(error=f"gone: replica {me} failed to run {cmd.kind} for {where}: {e}")

    async def _run_cri(self, transport_for: Callable[[str], CriTransport | None],
                       cmd: ReplicaCommand) -> bytes:
        from ghostgpu.collector.relay import ROUND_TRIP_S

        req = stream_pb2.CriRequest.FromString(cmd.payload)
        transport = transport_for(cmd.node) if self.serves(cmd.node) else None
        if transport is None:
            return stream_pb2.CriResponse(code=grpc.StatusCode.UNAVAILABLE.value[0], message=(
                f"node {cmd.node} has no tracer offering cri-relay at replica {self.replica_id}")
            ).SerializeToString()
        left_s = (cmd.deadline_unix_ns - time.time_ns()) / 1e9 - ROUND_TRIP_S
        timeout_s = max(0.05, min(req.timeout_ms / 1000 if req.timeout_ms else left_s, left_s))
        try:
            raw = await asyncio.to_thread(transport, req.method, bytes(req.request), timeout_s)
            return stream_pb2.CriResponse(code=0, response=raw).SerializeToString()
        except CriCallError as e:
            return stream_pb2.CriResponse(code=e.code.value[0], message=e.message).SerializeToString()


def _owners_now(conn: Conn) -> dict[str, str]:
    return live_owners(conn, time.time_ns())


def _sweep(conn: Conn, targets: Mapping[str, int | None], replica: str,
           now_unix_ns: int) -> tuple[dict[str, str], list[ReplicaCommand]]:
    return live_owners(conn, now_unix_ns), claim_open(conn, targets, replica, now_unix_ns)


def _log_failure(what: str, fut: concurrent.futures.Future[Any]) -> None:
    if (error := fut.exception()) is not None:
        log.warning("replica commands: %s not handed over: %s", what, error)
