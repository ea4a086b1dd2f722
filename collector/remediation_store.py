"""Remediation's rows in the collector's store (schema 4, collector/migrations.py), one SQL for both
engines: each function here is a `fn(conn)` for Store.read / Store.read_write, so it runs on the
store's writer thread, after every write queued before it (collector/store.py).

Two statements carry the engine's promise never to act twice (collector/remediation.py):

- `insert_incident` is an INSERT ... ON CONFLICT DO NOTHING of the incident key ("f<finding>/<action>"),
  committed before anything is sent for it: only the writer whose row went in owns the incident; any
  other (a second replica, the same one after a restart) finds it there.
- `mark_acted` is a conditional UPDATE (... WHERE incident = ? AND acted_unix_ns = 0), committed
  before the kill is sent: only the writer whose update hit the row sends it.

The breaker counts acts from `acted_unix_ns`, so replicas sharing a PostgreSQL store share the count.
`remediation_control` holds the cluster-wide switches: `paused` (value: the reason) and `mode` (the
override of the config file's mode); a missing row is "not paused" and "no override".
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ghostgpu.collector.db import Conn

from ghostgpu.common.model.remediation import PROPOSED, RemediationState

PAUSED, MODE_OVERRIDE = "paused", "mode"  # remediation_control's keys
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


def mark_acted(incident: str, now_unix_ns: int) -> Callable[[Conn], bool]:
    """True for the one writer whose update hit the row: it, and only it, sends the act."""

    def run(conn: Conn) -> bool:
        cur = conn.execute("UPDATE remediation_incidents SET acted_unix_ns = ?, updated_unix_ns = ? "
                           "WHERE incident = ? AND acted_unix_ns = 0", (now_unix_ns, now_unix_ns, incident))
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
        by_node = {str(node): int(n) for node, n in conn.execute(
            "SELECT node, COUNT(*) FROM remediation_incidents WHERE acted_unix_ns >= ? AND acted_unix_ns > 0 "
            "GROUP BY node", (window_start_unix_ns,)).fetchall()}
        found: dict[str, IncidentRow] = {}
        for chunk in _chunks(incidents, 500):
            marks = ", ".join("?" * len(chunk))
            for r in conn.execute(f"SELECT {_INCIDENT_COLUMNS} FROM remediation_incidents "
                                  f"WHERE incident IN ({marks})", tuple(chunk)).fetchall():
                found[r[0]] = IncidentRow(*r)
        unsettled = [IncidentRow(*r) for r in conn.execute(
            f"SELECT {_INCIDENT_COLUMNS} FROM remediation_incidents WHERE acted_unix_ns > 0 AND state = ? "
            "ORDER BY acted_unix_ns LIMIT 100", (PROPOSED,)).fetchall()]
        isolated = [str(r[0]) for r in conn.execute(
            "SELECT node FROM isolated_nodes ORDER BY node").fetchall()]
        return Tally(read_control(conn), sum(by_node.values()), by_node, found, unsettled, isolated)

    return run


def select_states(finding_ids: Iterable[int]) -> Callable[[Conn], dict[int, RemediationState]]:
    """The latest remediation state of each finding that has one (the newest incident's)."""
    ids = list(dict.fromkeys(finding_ids))

    def run(conn: Conn) -> dict[int, RemediationState]:
        out: dict[int, RemediationState] = {}
        for chunk in _chunks(ids, 500):
            marks = ", ".join("?" * len(chunk))
            rows = conn.execute(f"SELECT {_INCIDENT_COLUMNS} FROM remediation_incidents WHERE finding_id IN "
                                f"({marks}) ORDER BY updated_unix_ns", tuple(chunk)).fetchall()
            for r in rows:
                row = IncidentRow(*r)
                out[row.finding_id] = row.state_of()
        return out

    return run


def _chunks(items: Sequence[Any], n: int) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), n):
        yield items[i:i + n]
