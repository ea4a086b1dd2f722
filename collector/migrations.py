"""The store's schema, as numbered migrations for each engine, applied at start.

    version = migrate(conn, "postgresql", shown="--store postgresql://...")

`meta.schema` holds the version a database is at. At start the collector applies the migrations past it
in order, each in its own transaction, while it holds the migration lock: PostgreSQL's session advisory
lock MIGRATION_LOCK (replicas starting together migrate once, the others wait and find nothing to do),
SQLite's write lock (BEGIN IMMEDIATE). A database at a version newer than this collector knows was
written by a newer ghostgpu: start refuses it with one line rather than write rows it would misread.

Both engines hold the same tables with the same columns in the same order (the callers' `SELECT *`
and `INSERT ... VALUES` read and write both), in each engine's types: PostgreSQL's BIGINT where a
nanosecond time would overflow INTEGER, BYTEA for blobs, identity columns for SQLite's rowid keys.
PostgreSQL adds what several writers need: an exclusion constraint that keeps every (node, boot,
instance, seq) of the event log in one row at most (btree_gist, a trusted extension since
PostgreSQL 13, so the database's owner may create it), and a sequence the replicas draw finding id
blocks from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ghostgpu.collector.db import Conn, Engine

MIGRATION_LOCK = 0x67686F7374677075  # "ghostgpu": the advisory lock key all replicas agree on
FINDING_ID_BLOCK = 1 << 16  # ids a replica takes from PostgreSQL's finding_ids sequence at once

_SQLITE_V1 = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS positions (
  node TEXT NOT NULL, boot_id TEXT NOT NULL, instance_id TEXT NOT NULL,
  delivered_seq INTEGER NOT NULL, ingested_total INTEGER NOT NULL, duplicates_total INTEGER NOT NULL,
  gaps_total INTEGER NOT NULL, spool_dropped_total INTEGER NOT NULL, ringbuf_dropped_total INTEGER NOT NULL,
  updated_unix_ns INTEGER NOT NULL, PRIMARY KEY (node, boot_id, instance_id));
CREATE TABLE IF NOT EXISTS events (
  id INTEGER PRIMARY KEY, node TEXT NOT NULL, boot_id TEXT NOT NULL, instance_id TEXT NOT NULL,
  first_seq INTEGER NOT NULL, last_seq INTEGER NOT NULL, count INTEGER NOT NULL,
  stored_unix_ns INTEGER NOT NULL, codec INTEGER NOT NULL, blob BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS events_by_instance ON events (node, instance_id, last_seq);
CREATE TABLE IF NOT EXISTS findings (
  id INTEGER PRIMARY KEY, node TEXT NOT NULL, namespace TEXT NOT NULL, class TEXT NOT NULL,
  consumer_key TEXT NOT NULL, opened_unix_ns INTEGER NOT NULL, resolved_unix_ns INTEGER NOT NULL,
  consumer BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS findings_by_resolved ON findings (resolved_unix_ns);
CREATE TABLE IF NOT EXISTS trace_sessions (
  id TEXT PRIMARY KEY, started_unix_ns INTEGER NOT NULL, ended_unix_ns INTEGER NOT NULL,
  session BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS trace_records (
  id INTEGER PRIMARY KEY, session TEXT NOT NULL, node TEXT NOT NULL, first_seq INTEGER NOT NULL,
  last_seq INTEGER NOT NULL, count INTEGER NOT NULL, codec INTEGER NOT NULL, blob BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS trace_records_by_session ON trace_records (session, id);
CREATE TABLE IF NOT EXISTS trace_audit (
  id INTEGER PRIMARY KEY, ts_unix_ns INTEGER NOT NULL, session TEXT NOT NULL, action TEXT NOT NULL,
  who TEXT NOT NULL, detail TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS audit (
  seq INTEGER PRIMARY KEY, ts_unix_ns INTEGER NOT NULL, action TEXT NOT NULL, subject TEXT NOT NULL,
  result TEXT NOT NULL, detail TEXT NOT NULL, prev_sha256 TEXT NOT NULL, sha256 TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS audit_by_ts ON audit (ts_unix_ns);
CREATE TABLE IF NOT EXISTS faults (
  id INTEGER PRIMARY KEY, node TEXT NOT NULL, ts_unix_ns INTEGER NOT NULL, gpu TEXT NOT NULL,
  xid TEXT NOT NULL, namespaces TEXT NOT NULL, fault BLOB NOT NULL, boot_id TEXT NOT NULL,
  kmsg_seq INTEGER NOT NULL, log_ts_ns INTEGER NOT NULL, stored_unix_ns INTEGER NOT NULL,
  UNIQUE (node, boot_id, kmsg_seq, log_ts_ns));
CREATE INDEX IF NOT EXISTS faults_by_ts ON faults (ts_unix_ns);
CREATE INDEX IF NOT EXISTS faults_by_stored ON faults (stored_unix_ns);
CREATE TABLE IF NOT EXISTS fault_counts (
  node TEXT NOT NULL, gpu TEXT NOT NULL, xid TEXT NOT NULL, count INTEGER NOT NULL,
  PRIMARY KEY (node, gpu, xid));
"""

# The replicas' tables (collector/leases.py, node_state.py, replica_commands.py). SQLite has them too:
# one collector takes its nodes' leases as replicas do, and the contract tests run the same on both.
_SQLITE_V2 = """
CREATE TABLE IF NOT EXISTS node_leases (
  node TEXT PRIMARY KEY, owner TEXT NOT NULL, token INTEGER NOT NULL, expires_unix_ns INTEGER NOT NULL,
  taken_unix_ns INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS node_state (
  node TEXT PRIMARY KEY, owner TEXT NOT NULL, token INTEGER NOT NULL, updated_unix_ns INTEGER NOT NULL,
  consumers BLOB NOT NULL, status BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS replica_commands (
  id INTEGER PRIMARY KEY, node TEXT NOT NULL, kind TEXT NOT NULL, body BLOB NOT NULL,
  from_replica TEXT NOT NULL, created_unix_ns INTEGER NOT NULL, answered_unix_ns INTEGER NOT NULL,
  result BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS replica_commands_open ON replica_commands (node, answered_unix_ns);
"""

_PG_V1 = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE positions (
  node TEXT NOT NULL, boot_id TEXT NOT NULL, instance_id TEXT NOT NULL,
  delivered_seq BIGINT NOT NULL, ingested_total BIGINT NOT NULL, duplicates_total BIGINT NOT NULL,
  gaps_total BIGINT NOT NULL, spool_dropped_total BIGINT NOT NULL, ringbuf_dropped_total BIGINT NOT NULL,
  updated_unix_ns BIGINT NOT NULL, PRIMARY KEY (node, boot_id, instance_id));
CREATE EXTENSION IF NOT EXISTS btree_gist;
CREATE TABLE events (
  id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, node TEXT NOT NULL, boot_id TEXT NOT NULL,
  instance_id TEXT NOT NULL, first_seq BIGINT NOT NULL, last_seq BIGINT NOT NULL, count INTEGER NOT NULL,
  stored_unix_ns BIGINT NOT NULL, codec SMALLINT NOT NULL, blob BYTEA NOT NULL,
  CONSTRAINT events_seq_once EXCLUDE USING gist (
    node WITH =, boot_id WITH =, instance_id WITH =, int8range(first_seq, last_seq, '[]') WITH &&));
CREATE INDEX events_by_instance ON events (node, instance_id, last_seq);
CREATE TABLE findings (
  id BIGINT PRIMARY KEY, node TEXT NOT NULL, namespace TEXT NOT NULL, class TEXT NOT NULL,
  consumer_key TEXT NOT NULL, opened_unix_ns BIGINT NOT NULL, resolved_unix_ns BIGINT NOT NULL,
  consumer BYTEA NOT NULL);
CREATE INDEX findings_by_resolved ON findings (resolved_unix_ns);
CREATE SEQUENCE finding_ids;
CREATE TABLE trace_sessions (
  id TEXT PRIMARY KEY, started_unix_ns BIGINT NOT NULL, ended_unix_ns BIGINT NOT NULL,
  session BYTEA NOT NULL);
CREATE TABLE trace_records (
  id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, session TEXT NOT NULL, node TEXT NOT NULL,
  first_seq BIGINT NOT NULL, last_seq BIGINT NOT NULL, count INTEGER NOT NULL, codec SMALLINT NOT NULL,
  blob BYTEA NOT NULL);
CREATE INDEX trace_records_by_session ON trace_records (session, id);
CREATE TABLE trace_audit (
  id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, ts_unix_ns BIGINT NOT NULL, session TEXT NOT NULL,
  action TEXT NOT NULL, who TEXT NOT NULL, detail TEXT NOT NULL);
CREATE TABLE audit (
  seq BIGINT PRIMARY KEY, ts_unix_ns BIGINT NOT NULL, action TEXT NOT NULL, subject TEXT NOT NULL,
  result TEXT NOT NULL, detail TEXT NOT NULL, prev_sha256 TEXT NOT NULL, sha256 TEXT NOT NULL);
CREATE INDEX audit_by_ts ON audit (ts_unix_ns);
CREATE TABLE faults (
  id BIGINT PRIMARY KEY, node TEXT NOT NULL, ts_unix_ns BIGINT NOT NULL, gpu TEXT NOT NULL,
  xid TEXT NOT NULL, namespaces TEXT NOT NULL, fault BYTEA NOT NULL, boot_id TEXT NOT NULL,
  kmsg_seq BIGINT NOT NULL, log_ts_ns BIGINT NOT NULL, stored_unix_ns BIGINT NOT NULL,
  UNIQUE (node, boot_id, kmsg_seq, log_ts_ns));
CREATE INDEX faults_by_ts ON faults (ts_unix_ns);
CREATE INDEX faults_by_stored ON faults (stored_unix_ns);
CREATE TABLE fault_counts (
  node TEXT NOT NULL, gpu TEXT NOT NULL, xid TEXT NOT NULL, count BIGINT NOT NULL,
  PRIMARY KEY (node, gpu, xid));
CREATE TABLE node_leases (
  node TEXT PRIMARY KEY, owner TEXT NOT NULL, token BIGINT NOT NULL, expires_unix_ns BIGINT NOT NULL,
  taken_unix_ns BIGINT NOT NULL);
CREATE TABLE node_state (
  node TEXT PRIMARY KEY, owner TEXT NOT NULL, token BIGINT NOT NULL, updated_unix_ns BIGINT NOT NULL,
  consumers BYTEA NOT NULL, status BYTEA NOT NULL);
CREATE TABLE replica_commands (
  id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, node TEXT NOT NULL, kind TEXT NOT NULL,
  body BYTEA NOT NULL, from_replica TEXT NOT NULL, created_unix_ns BIGINT NOT NULL,
  answered_unix_ns BIGINT NOT NULL, result BYTEA NOT NULL);
CREATE INDEX replica_commands_open ON replica_commands (node, answered_unix_ns);
"""


def _script(sql: str) -> Callable[[Conn], None]:
    def run(conn: Conn) -> None:
        for statement in sql.split(";"):
            if statement.strip():
                conn.execute(statement)
    return run


# A trace session's home: the replica that runs its policy, deadline and end (collector/traces.py),
# so that a replica starting up ends only the sessions it ran itself (collector/trace_store.py).
_V3 = "ALTER TABLE trace_sessions ADD COLUMN home TEXT NOT NULL DEFAULT ''"

# Remediation (collector/remediation.py, docs/REMEDIATION.md). An incident ("f<finding>/<action>") is
# stored before anything is done for it, so a replica taking over a node after a failover finds it
# and does not act twice; its steps are the finding's remediation history (each also in the audit
# chain). remediation_control holds the cluster-wide switches (pause, the mode override);
# isolated_nodes the nodes ghostgpu tainted or cordoned, for the minHealthy guard.
_V4_TABLES = """
CREATE TABLE remediation_incidents (
  incident TEXT PRIMARY KEY, finding_id BIGINT NOT NULL, node TEXT NOT NULL, namespace TEXT NOT NULL,
  action TEXT NOT NULL, state TEXT NOT NULL, mode TEXT NOT NULL, reason TEXT NOT NULL,
  decided_unix_ns BIGINT NOT NULL, updated_unix_ns BIGINT NOT NULL, acted_unix_ns BIGINT NOT NULL,
  owner TEXT NOT NULL, audit_seq BIGINT NOT NULL, detail TEXT NOT NULL);
CREATE INDEX remediation_incidents_by_finding ON remediation_incidents (finding_id);
CREATE INDEX remediation_incidents_by_acted ON remediation_incidents (acted_unix_ns);
CREATE TABLE remediation_control (
  key TEXT PRIMARY KEY, value TEXT NOT NULL, who TEXT NOT NULL, at_unix_ns BIGINT NOT NULL);
CREATE TABLE isolated_nodes (
  node TEXT PRIMARY KEY, how TEXT NOT NULL, trigger_kind TEXT NOT NULL, reason TEXT NOT NULL,
  since_unix_ns BIGINT NOT NULL, incident TEXT NOT NULL);
"""
_V4_STEPS = {
    "sqlite": "CREATE TABLE remediation_steps (id INTEGER PRIMARY KEY, ",
    "postgresql": "CREATE TABLE remediation_steps (id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, ",
}
_V4_STEP_COLUMNS = """incident TEXT NOT NULL, finding_id BIGINT NOT NULL,
  ts_unix_ns BIGINT NOT NULL, step TEXT NOT NULL, state TEXT NOT NULL, detail TEXT NOT NULL,
  audit_seq BIGINT NOT NULL);
CREATE INDEX remediation_steps_by_finding ON remediation_steps (finding_id, id);
"""


def _v4(engine: Engine) -> Callable[[Conn], None]:
    return _script(_V4_TABLES + _V4_STEPS[engine] + _V4_STEP_COLUMNS)


# (version, what it does); versions start at 1 and run on with no gap.
MIGRATIONS: dict[str, list[tuple[int, Callable[[Conn], None]]]] = {
    "sqlite": [(1, _script(_SQLITE_V1)), (2, _script(_SQLITE_V2)), (3, _script(_V3)), (4, _v4("sqlite"))],
    # PostgreSQL began with version 2's tables
    "postgresql": [(1, _script(_PG_V1)), (2, lambda conn: None), (3, _script(_V3)), (4, _v4("postgresql"))],
}
SCHEMA_VERSION = max(v for v, _ in MIGRATIONS["sqlite"])
assert max(v for v, _ in MIGRATIONS["postgresql"]) == SCHEMA_VERSION


class SchemaError(Exception):
    """A database this collector must not write (a newer schema), or a migration that failed."""


def schema_version(conn: Conn) -> int:
    """The database's schema version; 0 for one with no meta table yet."""
    try:
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
    except Exception:  # no meta table: an empty database (each engine raises its own error)
        return 0
    return int(row[0]) if row is not None else 0


def migrate(conn: Any, engine: Engine, shown: str) -> int:
    """Bring the database to SCHEMA_VERSION under the migration lock; the version it is at now.
    `conn` is in autocommit mode (the store's connections are): each migration is its own transaction."""
    if engine == "postgresql":
        conn.execute("SELECT pg_advisory_lock(?)", (MIGRATION_LOCK,))
    try:
        return _migrate_locked(conn, engine, shown)
    finally:
        if engine == "postgresql":
            conn.execute("SELECT pg_advisory_unlock(?)", (MIGRATION_LOCK,))


def _migrate_locked(conn: Any, engine: Engine, shown: str) -> int:
    # meta first, alone: a failed SELECT inside a PostgreSQL transaction would abort the transaction
    conn.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    at = _checked_version(conn, shown)
    for version, step in MIGRATIONS[engine]:
        if version <= at:
            continue
        conn.execute("BEGIN IMMEDIATE" if engine == "sqlite" else "BEGIN")
        try:
            if _checked_version(conn, shown) >= version:  # another replica ran it meanwhile
                conn.execute("ROLLBACK")
                continue
            step(conn)
            conn.execute("INSERT INTO meta (key, value) VALUES ('schema', ?) ON CONFLICT (key) DO UPDATE "
                         "SET value = excluded.value", (str(version),))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        at = version
    return at


def _checked_version(conn: Conn, shown: str) -> int:
    at = schema_version(conn)
    if at > SCHEMA_VERSION:
        raise SchemaError(f"{shown}: schema version {at} was written by a newer ghostgpu (this one knows "
                          f"{SCHEMA_VERSION}); run the newer collector, or give this one another database")
    return at
