"""Findings other replicas opened, changed or resolved, pushed to this replica's WatchFindings watchers.

    remote = RemoteFindings(cluster, store, notifier)   # subscribes to ghostgpu_findings
    remote.start()                                      # on the loop: the reader task

With replicas sharing a PostgreSQL store, each applies the streams of the nodes it holds the leases
of (collector/leases.py), and its ClusterTable (collector/cluster.py) sees only those nodes' findings.
Each write of a finding row carries a NOTIFY on ghostgpu_findings in its transaction (the writer's
replica id and, per finding id, how it changed: collector/notices.py). Here, on every other replica,
the ids are read back from the findings table (after that commit, so the rows are there) and each
change goes to the local watchers as the FindingEvent the writer's own watchers got: the same kind
(opened, changed, resolved), the same filters (node, namespace, classes). A finding's kinds come
in its life's order; an OPENED or CHANGED event read after the finding resolved carries it still open
(the RESOLVED event follows). Notifications of this replica's own writes are skipped (its watchers had
them from memory). Watchers marked `local_only` (the Alertmanager pusher: each replica pushes the
alerts of its own nodes) get none.

The findings open on other replicas' nodes are kept here too (`open`), so a watch with include_open
replays them after the local ones (ClusterTable.also_open). After the listener (re)connects it may
have missed notifications ("resync"): the open findings are read again and the difference goes out
as events (a finding gone from the open set is read to tell resolved from pruned).

One reader task on the loop: notifications queue while a read is out and the next read takes them
all together, so a burst costs one read per round trip and events keep the order they were committed in.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ghostgpu.collector.cluster import ClusterTable, FindingRec
from ghostgpu.collector.db import Conn, db_errors
from ghostgpu.collector.notices import (
    CHANGED,
    FINDINGS_CHANNEL,
    OPENED,
    RESOLVED,
    Change,
    NoticeError,
    decode_findings,
)
from ghostgpu.collector.notify import Notifications
from ghostgpu.collector.store import FindingRow, Store

from ghostgpu.common.wire.convert import cluster_consumer_from_proto
from ghostgpu.v1 import query_pb2

log = logging.getLogger(__name__)

RESOLVED_KEPT = 10_000
IDS_PER_SELECT = 500  # ids in one `id IN (...)` (SQLite's bound-parameter limit is 32766)


@dataclass
class _Pending:
    own: bool  # this replica wrote them: nothing to deliver, only to forget
    changes: list[Change]


def select_finding_ids(ids: Sequence[int]) -> Callable[[Conn], dict[int, FindingRow]]:
    """A read for Store.read(): the rows of these finding ids (those still stored), by id."""

    def run(conn: Conn) -> dict[int, FindingRow]:
        out: dict[int, FindingRow] = {}
        for i in range(0, len(ids), IDS_PER_SELECT):
            chunk = ids[i:i + IDS_PER_SELECT]
            sql = f"SELECT * FROM findings WHERE id IN ({', '.join('?' * len(chunk))})"
            for r in conn.execute(sql, list(chunk)).fetchall():
                out[r[0]] = FindingRow(*r)
        return out

    return run


def select_open_and(ids: Sequence[int]) -> Callable[[Conn], tuple[list[FindingRow], dict[int, FindingRow]]]:
    """A read for a resync: every open finding, and the rows of `ids` (the ones held open here)."""
    by_id = select_finding_ids(ids)

    def run(conn: Conn) -> tuple[list[FindingRow], dict[int, FindingRow]]:
        rows = conn.execute("SELECT * FROM findings WHERE resolved_unix_ns = 0 ORDER BY id").fetchall()
        return [FindingRow(*r) for r in rows], by_id(conn)

    return run


def finding_rec(row: FindingRow) -> FindingRec:
    cc = cluster_consumer_from_proto(query_pb2.ClusterConsumer.FromString(row.consumer))
    return FindingRec(row.id, row.node, cc.consumer.key, row.cls, row.opened_unix_ns, cc,
                      row.resolved_unix_ns)


class RemoteFindings:
    """See the module docstring; every method runs on the collector's event loop."""

    def __init__(self, cluster: ClusterTable, store: Store, notifier: Notifications) -> None:
        self.cluster = cluster
        self.store = store
        self.replica_id = store.replica_id
        self.open: dict[int, FindingRec] = {}  # open findings other replicas wrote, by id
        self._consumer: dict[int, bytes] = {}  # their consumer as stored, to tell a change at a resync
        self._resolved: dict[int, None] = {}  # the ids resolved lately, oldest first: told once
        self.delivered_total = 0  # events pushed to watchers (each event once, however many watchers)
        self._pending: list[_Pending] = []
        self._resync = False
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None  # set while nothing is pending or being read
        self._task: asyncio.Task[None] | None = None
        self._unsubscribe = notifier.subscribe(FINDINGS_CHANNEL, self._on_notice)
        cluster.also_open = self.open_findings

    def start(self) -> None:
        """On the loop: start the reader task."""
        self._wake, self._idle = asyncio.Event(), asyncio.Event()
        if self._pending or self._resync:
            self._wake.set()
        self._task = asyncio.get_running_loop().create_task(self._run())

    def close(self) -> None:
        self._unsubscribe()
        if self._task is not None:
            self._task.cancel()

    def open_findings(self) -> list[FindingRec]:
        """The open findings other replicas wrote (those of the nodes this one applies excluded)."""
        local = {rec.id for opens in self.cluster.open.values() for rec in opens.values()}
        return [rec for fid, rec in sorted(self.open.items()) if fid not in local]

    # ---- notifications -----------------------------------------------------------------------

    def _on_notice(self, payload: str | None) -> None:
        if payload is None:
            self._resync = True
        else:
            try:
                notice = decode_findings(payload)
            except NoticeError as e:
                log.warning("%s: %s; skipped (a collector of another version?)", FINDINGS_CHANNEL, e)
                return
            self._pending.append(_Pending(notice.source == self.replica_id, notice.changes))
        if self._wake is not None and self._idle is not None:
            self._idle.clear()
            self._wake.set()

    async def drained(self) -> None:
        """Until every notice heard so far is delivered (tests, and a stop that wants them out)."""
        assert self._idle is not None, "start() first"
        await self._idle.wait()

    async def _run(self) -> None:
        assert self._wake is not None and self._idle is not None
        while True:
            if not self._pending and not self._resync:
                self._idle.set()
            await self._wake.wait()
            self._wake.clear()
            self._idle.clear()
            try:
                # What was heard first, then the resync's read: it sees every commit before it, and
                # _event drops what the notices already told.
                if self._pending:
                    pending, self._pending = self._pending, []
                    await self._apply(pending)
                if self._resync:
                    self._resync = False
                    await self._do_resync()
            except db_errors() as e:  # the store retries its own connection; the next notice reads again
                log.warning("findings of other replicas: cannot read them now (%s); again at the next "
                            "notification", str(e).strip().splitlines()[0] if str(e).strip() else e)
                self._resync = True
            except Exception:  # a bug here must not stop every later delivery
                log.exception("findings of other replicas: delivery failed")

    async def _apply(self, pending: list[_Pending]) -> None:
        ids = sorted({fid for p in pending if not p.own for fid, _ in p.changes})
        rows: dict[int, FindingRow] = {}
        if ids:
            rows = await asyncio.wrap_future(self.store.read(select_finding_ids(ids)))
        seen: set[Change] = set()
        for p in pending:
            if p.own:  # this replica applies the node now: its memory has these findings
                for fid, _ in p.changes:
                    self._forget(fid)
                continue
            for change in p.changes:
                row = rows.get(change[0])
                if change in seen or row is None:  # said twice in this read, or pruned since
                    continue
                seen.add(change)
                self._event(change[1], row)

    def _event(self, kind: int, row: FindingRow) -> None:
        """Remember and deliver one change, unless told already (a resync and a notice can tell the
        same). `row` is as read now: for an OPENED or CHANGED that resolved since, the event shows the
        finding as it was then, still open (its RESOLVED follows)."""
        fid = row.id
        if ((kind == OPENED and fid in self.open) or (kind == RESOLVED and fid in self._resolved)
                or (kind == CHANGED and row.resolved_unix_ns and fid not in self.open)):
            return
        rec = finding_rec(row)
        if kind == RESOLVED:
            self._forget(rec.id)
            self._resolved[fid] = None
            if len(self._resolved) > RESOLVED_KEPT:
                del self._resolved[next(iter(self._resolved))]
        else:
            rec.resolved_unix_ns = 0
            self.open[rec.id] = rec
            self._consumer[rec.id] = row.consumer
        self._deliver(kind, rec)

    def _forget(self, fid: int) -> None:
        self.open.pop(fid, None)
        self._consumer.pop(fid, None)

    def _deliver(self, kind: int, rec: FindingRec) -> None:
        event = None
        for w in self.cluster.watchers:
            if not w.local_only and w.matches(rec):
                if event is None:
                    event = query_pb2.FindingEvent(kind=kind, finding=rec.to_proto())  # type: ignore[arg-type]
                w.push(event)
        self.delivered_total += 1

    async def _do_resync(self) -> None:
        """Read the open findings again: what opened, changed or went while nobody listened."""
        held = sorted(self.open)
        open_rows, held_rows = await asyncio.wrap_future(self.store.read(select_open_and(held)))
        local = {rec.id for opens in self.cluster.open.values() for rec in opens.values()}
        now_open = {row.id: row for row in open_rows if row.id not in local}
        for fid in held:
            if fid in now_open:
                continue
            row = held_rows.get(fid)
            if row is not None and row.resolved_unix_ns:
                self._event(RESOLVED, row)
            else:  # pruned, or this replica applies its node now
                self._forget(fid)
        for fid, row in now_open.items():
            if fid not in self.open:
                self._event(OPENED, row)
            elif self._consumer.get(fid) != row.consumer:
                self._event(CHANGED, row)

