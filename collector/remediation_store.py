"""Remediation's rows in the collector's store (schema 4, collector/migrations.py), one SQL for both
engines: each function here is a `fn(conn)` for Store.read / Store.read_write, so it runs on the
store's writer thread, after every write queued before it (collector/store.py).

Two statements carry the engine's promise never to act twice (collector/remediation.py):

- `insert_incident` is an INSERT ... ON CONFLICT DO NOTHING of the incident key ("f<finding>/<action>"),
  committed before anything is sent for it: only the writer whose row went in owns the incident; any
  other (a second replica, the same one after a restart) finds it there.
- `mark_acted` is a conditional UPDATE (... WHERE incident = ? AND acted_unix_ns = 0), committed
  before the kill is sent: only the writer whose update hit the row sends it. Given an ActGuard, the
  same transaction first refuses while paused, while the override is not a mode that acts, and while
  the breaker is full (acts in the window, cluster-wide and on the node, counted from
  `acted_unix_ns`), so that the switches and the limit hold at the moment of acting, across replicas:
  on PostgreSQL the check and the UPDATE run under an advisory lock of their own (ACT_LOCK), as the
  audit chain's head does, in a READ COMMITTED transaction (set explicitly: under REPEATABLE READ the
  count would come from the snapshot taken before the lock, missing the act the previous holder just
  committed); SQLite's single writer serializes them already. `unmark_acted` takes a claim back when
  its act was never started (not sent, or the tracer did not start it): it may be tried again.

The breaker counts acts from `acted_unix_ns`, so replicas sharing a PostgreSQL store share the count:
cluster-wide every action, per node each action apart (an unkillable holder's node isolation is not
refused because the kill that found it used the node's budget).
`remediation_control` holds the cluster-wide switches: `paused` (value: the reason) and `mode` (the
override of the config file's mode); a missing row is "not paused" and "no override".
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, TypeVar

from ghostgpu.collector.db import Conn, serialize_writers

from ghostgpu.common.model.remediation import ISOLATE_NODE, KILL_ORPHAN, PROPOSED, RemediationState

T = TypeVar("T")

PAUSED, MODE_OVERRIDE = "paused", "mode"  # remediation_control's keys
ACT_LOCK = 0x67686F7374616374  # "ghostact": the breaker's count and the act it admits, one writer at a time
_INCIDENT_COLUMNS = ("incident, finding_id, node, namespace, action, state, mode, reason, decided_unix_ns, "
                     "updated_unix_ns, acted_unix_ns, owner, audit_seq, detail")


class IncidentRow(NamedTuple):
    """One row of remediation_incidents (its columns in table order)."""

    incident: str
    finding_id: int
    node: str
    namespace: str
    action: str
    state: str
    mode: str
    reason: str
    decided_unix_ns: int
    updated_unix_ns: int
    acted_unix_ns: int  # 0: no act was sent (or is about to be) for it
    owner: str  # the replica that stored it
    audit_seq: int  # the audit record of its latest state (0 with a shared chain: seqs come at the commit)
    detail: str  # JSON: what the engine decided on (pid, start time, exe, container, devices)

    def state_of(self) -> RemediationState:
        return RemediationState(self.state, self.action, self.updated_unix_ns, self.reason, self.mode,
                                self.incident, self.audit_seq)

    def details(self) -> dict[str, Any]:
        try:
            out = json.loads(self.detail or "{}")
        except ValueError:
            return {}
        return out if isinstance(out, dict) else {}


class ControlRow(NamedTuple):
    key: str
    value: str
    who: str
    at_unix_ns: int


@dataclass(frozen=True)
class Tally:
    """What one engine tick reads, in one store read: the switches, the acts in the breaker's window
    (cluster-wide and per node), and the incidents of the findings it looks at."""

    control: dict[str, ControlRow]
    acts_in_window: int
    acts_by_node: dict[str, int]
    incidents: dict[str, IncidentRow]  # by incident key
    unsettled: list[IncidentRow]  # acted, with no outcome stored
    isolated_nodes: list[str]


def insert_incident(row: IncidentRow) -> Callable[[Conn], bool]:
    """True when this writer stored the incident (it owns it); False when its key was there already."""

    def run(conn: Conn) -> bool:
        cur = conn.execute(f"INSERT INTO remediation_incidents ({_INCIDENT_COLUMNS}) VALUES "
                           "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (incident) DO NOTHING",
                           row)
        return bool(cur.rowcount == 1)

    return run


def get_incident(incident: str) -> Callable[[Conn], IncidentRow | None]:
    def run(conn: Conn) -> IncidentRow | None:
        r = conn.execute(f"SELECT {_INCIDENT_COLUMNS} FROM remediation_incidents WHERE incident = ?",
                         (incident,)).fetchone()
        return IncidentRow(*r) if r else None

    return run


@dataclass(frozen=True)
class ActGuard:
    """What mark_acted checks in its transaction before it records an act: the pause row absent, the
    mode asked for (the override where one is stored, else config_mode: the config file's, read right
    before) one of `overrides`, and fewer than max_actions acts since
    window_start_unix_ns cluster-wide and fewer than max_per_node on `node`."""

    node: str
    window_start_unix_ns: int
    max_actions: int
    max_per_node: int
    config_mode: str
    overrides: tuple[str, ...] = ("on",)  # the modes asked for under which this act may go out
    action: str = ""  # counted per node against acts of this action ("": the incident's own action)


@dataclass(frozen=True)
class Claim:
    """mark_acted's answer: acted (this writer records the act and sends it), or not; `refused` says
    why a guard held it back ("" when the row was acted on already, or is not there)."""

    acted: bool
    refused: str = ""

    def __bool__(self) -> bool:
        return self.acted


def _guard_refusal(conn: Conn, g: ActGuard, action: str) -> str:
    control = read_control(conn)
    if PAUSED in control:
        paused = control[PAUSED]
        return (f"paused by {paused.who}" + (f" ({paused.value})" if paused.value else "")
                + " at the moment of acting: `ghostgpu remediate resume` ends the pause")
    override = control[MODE_OVERRIDE].value if MODE_OVERRIDE in control else ""
    asked = override or g.config_mode
    if asked not in g.overrides:
        source = "ghostgpu remediate mode" if override else "config file"
        return f"mode {asked} ({source}) at the moment of acting: not acted on"
    total, on_node = conn.execute(
        "SELECT COUNT(*), COALESCE(SUM(CASE WHEN node = ? AND action = ? THEN 1 ELSE 0 END), 0) "
        "FROM remediation_incidents WHERE acted_unix_ns > 0 AND acted_unix_ns >= ?",
        (g.node, action, g.window_start_unix_ns)).fetchone()
    if int(total) >= g.max_actions:
        return f"breaker open: {int(total)} acts in the window (max_actions {g.max_actions}); not acted on"
    if int(on_node) >= g.max_per_node:
        return (f"breaker open: {int(on_node)} acts on node {g.node} in the window (max_per_node "
                f"{g.max_per_node}); not acted on")
    return ""


def read_committed(conn: Conn) -> None:
    """On PostgreSQL, make this transaction READ COMMITTED whatever the database's default: a count read
    under an advisory lock must see what the lock's previous holder committed. Must come before the
    transaction's first query. SQLite serializes its writers: nothing to do."""
    if not isinstance(conn, sqlite3.Connection):
        conn.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")


def mark_acted(incident: str, now_unix_ns: int, guard: ActGuard | None = None,
               grace_ms: int | None = None) -> Callable[[Conn], Claim]:
    """Claim(acted=True) for the one writer whose update hit the row: it, and only it, sends the act.
    With a guard, refused (Claim.refused) while paused, overridden off, or the breaker is full.
    grace_ms: the grace the act is sent with, kept in the row's detail (what settling it waits for)."""

    def run(conn: Conn) -> Claim:
        read_committed(conn)
        if guard is not None:
            serialize_writers(conn, ACT_LOCK)
            action = guard.action
            if not action:
                r = conn.execute("SELECT action FROM remediation_incidents WHERE incident = ?",
                                 (incident,)).fetchone()
                action = str(r[0]) if r else ""
            if why := _guard_refusal(conn, guard, action):
                return Claim(False, why)
        cur = conn.execute("UPDATE remediation_incidents SET acted_unix_ns = ?, updated_unix_ns = ? "
                           "WHERE incident = ? AND acted_unix_ns = 0", (now_unix_ns, now_unix_ns, incident))
        if cur.rowcount != 1:
            return Claim(False)
        if grace_ms is not None:
            r = conn.execute("SELECT detail FROM remediation_incidents WHERE incident = ?",
                             (incident,)).fetchone()
            try:
                kept = json.loads(str(r[0]) if r and r[0] else "{}")
            except ValueError:
                kept = {}
            kept = kept if isinstance(kept, dict) else {}
            conn.execute("UPDATE remediation_incidents SET detail = ? WHERE incident = ?",
                         (json.dumps({**kept, "grace_ms": int(grace_ms)}, sort_keys=True), incident))
        return Claim(True)

    return run


def unmark_acted(incident: str, acted_unix_ns: int) -> Callable[[Conn], bool]:
    """Take back the claim mark_acted made at acted_unix_ns (only that one): its act was never started.
    True when it was still this claim."""

    def run(conn: Conn) -> bool:
        cur = conn.execute("UPDATE remediation_incidents SET acted_unix_ns = 0 WHERE incident = ? "
                           "AND acted_unix_ns = ?", (incident, acted_unix_ns))
        return bool(cur.rowcount == 1)

    return run


def set_state(incident: str, state: str, reason: str, mode: str, now_unix_ns: int,
              audit_seq: int) -> Callable[[Conn], None]:
    def run(conn: Conn) -> None:
        conn.execute("UPDATE remediation_incidents SET state = ?, reason = ?, mode = ?, updated_unix_ns = ?, "
                     "audit_seq = ? WHERE incident = ?",
                     (state, reason, mode, now_unix_ns, audit_seq, incident))

    return run


def add_step(incident: str, finding_id: int, ts_unix_ns: int, step: str, state: str, detail: str,
             audit_seq: int) -> Callable[[Conn], None]:
    def run(conn: Conn) -> None:
        conn.execute("INSERT INTO remediation_steps (incident, finding_id, ts_unix_ns, step, state, detail, "
                     "audit_seq) VALUES (?, ?, ?, ?, ?, ?, ?)",
                     (incident, finding_id, ts_unix_ns, step, state, detail, audit_seq))

    return run


def select_steps(finding_id: int) -> Callable[[Conn], list[tuple[Any, ...]]]:
    """The finding's remediation history, oldest first: (incident, ts_unix_ns, step, state, detail,
    audit_seq)."""

    def run(conn: Conn) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in conn.execute(
            "SELECT incident, ts_unix_ns, step, state, detail, audit_seq FROM remediation_steps "
            "WHERE finding_id = ? ORDER BY id", (finding_id,)).fetchall()]

    return run


def set_control(key: str, value: str | None, who: str, now_unix_ns: int) -> Callable[[Conn], None]:
    """Set a switch (value None: remove its row)."""

    def run(conn: Conn) -> None:
        if value is None:
            conn.execute("DELETE FROM remediation_control WHERE key = ?", (key,))
            return
        conn.execute("INSERT INTO remediation_control (key, value, who, at_unix_ns) VALUES (?, ?, ?, ?) "
                     "ON CONFLICT (key) DO UPDATE SET value = excluded.value, who = excluded.who, "
                     "at_unix_ns = excluded.at_unix_ns", (key, value, who, now_unix_ns))

    return run


def read_control(conn: Conn) -> dict[str, ControlRow]:
    return {r[0]: ControlRow(*r) for r in conn.execute(
        "SELECT key, value, who, at_unix_ns FROM remediation_control").fetchall()}


def select_tally(window_start_unix_ns: int, incidents: Sequence[str]) -> Callable[[Conn], Tally]:
    def run(conn: Conn) -> Tally:
        # Per node, the kills only (the breaker counts each action apart per node: _guard_refusal).
        total = 0
        by_node: dict[str, int] = {}
        for node, action, n in conn.execute(
                "SELECT node, action, COUNT(*) FROM remediation_incidents WHERE acted_unix_ns >= ? "
                "AND acted_unix_ns > 0 GROUP BY node, action", (window_start_unix_ns,)).fetchall():
            total += int(n)
            if action == KILL_ORPHAN:
                by_node[str(node)] = by_node.get(str(node), 0) + int(n)
        found: dict[str, IncidentRow] = {}
        for chunk in _chunks(incidents, 500):
            marks = ", ".join("?" * len(chunk))
            for r in conn.execute(f"SELECT {_INCIDENT_COLUMNS} FROM remediation_incidents "
                                  f"WHERE incident IN ({marks})", tuple(chunk)).fetchall():
                found[r[0]] = IncidentRow(*r)
        unsettled = [IncidentRow(*r) for r in conn.execute(
            f"SELECT {_INCIDENT_COLUMNS} FROM remediation_incidents WHERE acted_unix_ns > 0 AND state = ? "
            "AND action = ? ORDER BY acted_unix_ns LIMIT 100", (PROPOSED, KILL_ORPHAN)).fetchall()]
        isolated = [row.node for row in select_isolated_nodes(conn)]
        return Tally(read_control(conn), total, by_node, found, unsettled, isolated)

    return run


def select_states(finding_ids: Iterable[int]) -> Callable[[Conn], dict[int, RemediationState]]:
    """The remediation state of each finding that has one: its kill's (action 1 is the finding's own
    remediation: `unkillable` must not read as the `done` of the isolation that followed it), the
    node isolation it led to named in the reason; else its newest incident's."""
    ids = list(dict.fromkeys(finding_ids))

    def run(conn: Conn) -> dict[int, RemediationState]:
        kills: dict[int, RemediationState] = {}
        others: dict[int, RemediationState] = {}
        for chunk in _chunks(ids, 500):
            marks = ", ".join("?" * len(chunk))
            rows = conn.execute(f"SELECT {_INCIDENT_COLUMNS} FROM remediation_incidents WHERE finding_id IN "
                                f"({marks}) ORDER BY updated_unix_ns", tuple(chunk)).fetchall()
            for r in rows:
                row = IncidentRow(*r)
                (kills if row.action == KILL_ORPHAN else others)[row.finding_id] = row.state_of()
        out = dict(others)
        for finding, kill in kills.items():
            then = others.get(finding)
            if then is not None and then.action == ISOLATE_NODE:
                kill = replace(kill, reason=f"{kill.reason}; then node isolation: {then.state} "
                                            f"({then.reason})")
            out[finding] = kill
        return out

    return run


def _chunks(items: Sequence[Any], n: int) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


# ---- node isolation (collector/isolation.py); the store helpers both engines share -----------------------

ISOLATION_LOCK = 0x67686F737469736F  # "ghostiso": isolated_nodes' count and insert, one replica at a time
_ISOLATED_COLUMNS = "node, how, trigger_kind, reason, since_unix_ns, incident"


class IsolatedNode(NamedTuple):
    """One row of isolated_nodes: a node ghostgpu tainted or cordoned (or is about to: claimed)."""

    node: str
    how: str  # taint | cordon
    trigger_kind: str
    reason: str
    since_unix_ns: int
    incident: str


def select_isolated_nodes(conn: Conn) -> list[IsolatedNode]:
    """Every node isolated by ghostgpu, by node (minHealthy's numerator, RemediationStatus)."""
    return [IsolatedNode(str(n), str(how), str(kind), str(reason), int(since), str(incident))
            for n, how, kind, reason, since, incident in conn.execute(
                f"SELECT {_ISOLATED_COLUMNS} FROM isolated_nodes ORDER BY node").fetchall()]


def claim_isolated(row: IsolatedNode, cap: int) -> Callable[[Conn], tuple[bool, int]]:
    """(True, count before) when `row` went in: fewer than `cap` nodes were isolated, counted and
    inserted in one transaction, serialized across replicas (ISOLATION_LOCK), so two replicas isolating
    two nodes at once cannot both take the last slot; (False, count) when the cap is reached or the node
    has a row already. Written before the PATCH; release_isolated takes it back if the PATCH fails."""

    def run(conn: Conn) -> tuple[bool, int]:
        read_committed(conn)  # the count under the lock sees what its last holder committed
        serialize_writers(conn, ISOLATION_LOCK)
        held = int(conn.execute("SELECT COUNT(*) FROM isolated_nodes").fetchone()[0])
        if held >= cap:
            return False, held
        cur = conn.execute(f"INSERT INTO isolated_nodes ({_ISOLATED_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?) "
                           "ON CONFLICT (node) DO NOTHING", tuple(row))
        return bool(cur.rowcount == 1), held

    return run


def release_isolated(node: str, incident: str = "") -> Callable[[Conn], bool]:
    """Delete the node's row (only the one `incident` claimed, when given); True when one went."""

    def run(conn: Conn) -> bool:
        if incident:
            cur = conn.execute("DELETE FROM isolated_nodes WHERE node = ? AND incident = ?", (node, incident))
        else:
            cur = conn.execute("DELETE FROM isolated_nodes WHERE node = ?", (node,))
        return bool(cur.rowcount == 1)

    return run


def select_unsettled_isolations(acted_before_unix_ns: int) -> Callable[[Conn], list[IncidentRow]]:
    """isolate_node incidents acted on before the time given with no outcome stored: the replica acting
    on them stopped between the act and its outcome."""

    def run(conn: Conn) -> list[IncidentRow]:
        return [IncidentRow(*r) for r in conn.execute(
            f"SELECT {_INCIDENT_COLUMNS} FROM remediation_incidents WHERE action = ? AND acted_unix_ns > 0 "
            "AND acted_unix_ns < ? AND state = ? ORDER BY acted_unix_ns LIMIT 100",
            (ISOLATE_NODE, acted_before_unix_ns, PROPOSED)).fetchall()]

    return run


def settle_isolation(incident: str, state: str, reason: str, now_unix_ns: int) -> Callable[[Conn], bool]:
    """Store an unsettled isolation's outcome (select_unsettled_isolations): True for the one writer whose
    update hit the row, still proposed and acted on; it alone audits the outcome and files the ticket,
    so two replicas settling the same row at once record one outcome."""

    def run(conn: Conn) -> bool:
        cur = conn.execute("UPDATE remediation_incidents SET state = ?, reason = ?, updated_unix_ns = ? "
                           "WHERE incident = ? AND state = ? AND acted_unix_ns > 0",
                           (state, reason, now_unix_ns, incident, PROPOSED))
        return bool(cur.rowcount == 1)

    return run


def select_steps_of(incident: str, action: str) -> Callable[[Conn], list[RemediationState]]:
    """The incident's steps, oldest first, as states of `action` (a ticket's `actions`)."""

    def run(conn: Conn) -> list[RemediationState]:
        rows = conn.execute("SELECT ts_unix_ns, step, state, detail, audit_seq FROM remediation_steps "
                            "WHERE incident = ? ORDER BY id", (incident,)).fetchall()
        out: list[RemediationState] = []
        for ts, step, state, detail, seq in rows:
            try:
                d = json.loads(detail or "{}")
            except ValueError:
                d = {}
            d = d if isinstance(d, dict) else {}
            out.append(RemediationState(str(state), action, int(ts), f"{step}: {d.get('reason', '')}",
                                        str(d.get("mode", "")), incident, int(seq)))
        return out

    return run


async def store_read(store: Any, fn: Callable[[Conn], T]) -> T:
    """Store.read(fn), awaited on the event loop."""
    return await asyncio.wrap_future(store.read(fn))


async def store_write(store: Any, fn: Callable[[Conn], T]) -> T:
    """Store.read_write(fn): fn in a transaction of its own, awaited on the event loop."""
    return await asyncio.wrap_future(store.read_write(fn))
