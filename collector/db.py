"""The two engines the collector's store runs on, behind one connection shape.

    url = parse_store_url("postgresql://ghostgpu@db.example/ghostgpu?sslmode=verify-full")
    url.engine            # "postgresql" ("sqlite" for sqlite:///PATH or a --db PATH)
    conn = connect_postgresql(url, password_file="/etc/ghostgpu/db/password")
    conn.execute("SELECT value FROM meta WHERE key = ?", ("schema",)).fetchone()

SQLite is the embedded default (one collector, `--db PATH`); PostgreSQL (15+) is what several
replicas share (`--store postgresql://...`). The store and its callers (collector/faults.py,
trace_store.py, audit.py, query.py) write one SQL for both: `?` placeholders, which `PgConn` turns into
psycopg's `%s`, and the SQL both engines speak (`INSERT ... ON CONFLICT (...) DO NOTHING | DO UPDATE`
with `excluded.`, which SQLite has since 3.24).

The PostgreSQL driver is psycopg 3 (bench/bench_pg_driver.py compares it with asyncpg side by side):
the store's writes run on one writer thread, so a synchronous driver fits without a second event loop,
and libpq gives the DSN's sslmode=verify-full, PGPASSFILE and service files the way operators expect.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

Engine = Literal["sqlite", "postgresql"]


class StoreUrlError(ValueError):
    """A --store / GHOSTGPU_STORE / --db value that names no store this collector can open."""


class Cursor(Protocol):
    rowcount: int

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


class Conn(Protocol):
    """What the store's read and write functions get: sqlite3.Connection has this shape, PgConn too."""

    def execute(self, sql: str, parameters: Sequence[Any] = ..., /) -> Any: ...

    def executemany(self, sql: str, parameters: Iterable[Sequence[Any]], /) -> Any: ...


@dataclass(frozen=True)
class StoreUrl:
    engine: Engine
    target: str  # the SQLite path (":memory:" too), or the PostgreSQL DSN as given

    def shown(self) -> str:
        """The URL without its password, for logs and errors."""
        if self.engine == "sqlite":
            return self.target
        parts = urlsplit(self.target)
        if parts.password is None:
            return self.target
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return parts._replace(netloc=netloc).geturl()

    @property
    def flag(self) -> str:
        """How errors name the setting: --db for a SQLite path, --store for a URL."""
        return f"--db {self.target}" if self.engine == "sqlite" else f"--store {self.shown()}"


def parse_store_url(value: str) -> StoreUrl:
    """`sqlite:///PATH`, `sqlite://:memory:`, a bare path (the --db form), or `postgresql://` /
    `postgres://` (libpq's URI forms, query parameters such as sslmode kept as given)."""
    if not value:
        raise StoreUrlError("--store: empty; give sqlite:///PATH or postgresql://USER@HOST/DB")
    if value.startswith(("postgresql://", "postgres://")):
        parts = urlsplit(value)
        if not parts.path.strip("/") and "dbname=" not in parts.query:
            raise StoreUrlError(f"--store {StoreUrl('postgresql', value).shown()}: names no database; "
                                "write postgresql://USER@HOST[:PORT]/DATABASE")
        return StoreUrl("postgresql", value)
    if value.startswith("sqlite://"):
        path = value[len("sqlite://"):]
        if path.startswith("/") and path != "/:memory:":
            path = path[1:] if path.startswith("//") else path  # sqlite:///abs/path -> /abs/path
        if path in (":memory:", "/:memory:"):
            return StoreUrl("sqlite", ":memory:")
        if not path:
            raise StoreUrlError("--store sqlite://: names no file; write sqlite:///PATH")
        return StoreUrl("sqlite", path)
    if "://" in value:
        scheme = value.split("://", 1)[0]
        raise StoreUrlError(f"--store {scheme}://...: not a store this collector speaks; give "
                            "sqlite:///PATH or postgresql://USER@HOST/DB")
    return StoreUrl("sqlite", value)


def read_password_file(path: str) -> str:
    """The database password from --store-password-file (a mounted Secret): its first line."""
    try:
        with open(path, encoding="utf-8") as f:
            line = f.readline().rstrip("\r\n")
    except OSError as e:
        raise StoreUrlError(f"--store-password-file {path}: cannot read it ({e.strerror}); mount the "
                            "database password there") from None
    if not line:
        raise StoreUrlError(f"--store-password-file {path}: empty; write the database password on its "
                            "first line")
    return line


_PLACEHOLDERS: dict[str, str] = {}


def pg_sql(sql: str) -> str:
    """The portable SQL's `?` placeholders as psycopg's `%s` (and a literal `%` doubled). The callers'
    SQL holds no `?` or `%` inside string literals."""
    out = _PLACEHOLDERS.get(sql)
    if out is None:
        out = sql.replace("%", "%%").replace("?", "%s")
        if len(_PLACEHOLDERS) < 4096:  # the statements are a fixed set; a bound in case one is built per call
            _PLACEHOLDERS[sql] = out
    return out


class PgConn:
    """A psycopg 3 connection in autocommit mode (the store sends BEGIN/COMMIT itself), with
    sqlite3.Connection's execute/executemany over the portable SQL."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def execute(self, sql: str, parameters: Sequence[Any] = (), /) -> Any:
        return self.raw.execute(pg_sql(sql), parameters or None, prepare=None)

    def executemany(self, sql: str, parameters: Iterable[Sequence[Any]], /) -> Any:
        cur = self.raw.cursor()
        cur.executemany(pg_sql(sql), list(parameters))
        return cur

    def close(self) -> None:
        self.raw.close()

    @property
    def closed(self) -> bool:
        return bool(self.raw.closed)


PARTITION_TIMEOUT_MS = 5000


def connect_postgresql(url: StoreUrl, password_file: str | None = None, *, application_name: str = "ghostgpu",
                       connect_timeout_s: int = 5) -> PgConn:
    """A PgConn to the URL's database; psycopg.OperationalError when it cannot be reached."""
    import psycopg  # only with a postgresql:// store: the SQLite default needs no driver

    kwargs: dict[str, Any] = {"autocommit": True, "application_name": application_name,
                              "connect_timeout": connect_timeout_s}
    if password_file:
        kwargs["password"] = read_password_file(password_file)
    # TCP keepalives and tcp_user_timeout: a replica cut off from the database (a partition, not a
    # refused connection) learns it in seconds rather than at the kernel's two-hour default.
    kwargs.update(keepalives=1, keepalives_idle=5, keepalives_interval=2, keepalives_count=3,
                  tcp_user_timeout=PARTITION_TIMEOUT_MS)
    # And the server side of a partition: a replica cut off inside a write transaction holds its share
    # locks on lease rows (collector/store.py's fence), which would stall the replica taking its nodes
    # until the server's own keepalive gives up (hours). The server ends such a session after
    # PARTITION_TIMEOUT_MS idle in a transaction (the store's transactions take milliseconds), and a
    # lease take waits at most as long for a lock before its Hello is refused and retried.
    # The server's own keepalives on this session (its default is the kernel's two hours) end it when
    # the replica's host or network is gone, taking its locks with it.
    kwargs["options"] = (f"-c idle_in_transaction_session_timeout={PARTITION_TIMEOUT_MS} "
                         f"-c lock_timeout={PARTITION_TIMEOUT_MS} "
                         "-c tcp_keepalives_idle=5 -c tcp_keepalives_interval=2 -c tcp_keepalives_count=3 "
                         f"-c tcp_user_timeout={PARTITION_TIMEOUT_MS}")
    return PgConn(psycopg.connect(url.target, **kwargs))


# A collector's session inside a transaction, waiting on its client for longer than any store
# transaction takes. idle_in_transaction_session_timeout does not cover a session cut off between two
# messages of one extended-protocol exchange (psycopg's pipelined executemany; PostgreSQL 15 arms the
# idle timeouts only once it answers ReadyForQuery, at Sync), nor does the server's keepalive while
# the peer's kernel still answers it: such a session keeps its locks until TCP gives up.
_STALLED_SESSIONS = (
    "SELECT pid, application_name FROM pg_stat_activity "
    "WHERE pid <> pg_backend_pid() AND datname = current_database() AND backend_type = 'client backend' "
    "AND application_name LIKE 'ghostgpu-collector %' AND xact_start IS NOT NULL "
    "AND wait_event_type = 'Client' AND wait_event = 'ClientRead' "
    "AND state_change < clock_timestamp() - make_interval(secs => ?)")


def lock_wait_ran_out(error: BaseException) -> bool:
    """PostgreSQL's lock_timeout cut a statement short (SQLSTATE 55P03)."""
    return getattr(error, "sqlstate", None) == "55P03"


def end_stalled_sessions(conn: Conn, stalled_s: float = PARTITION_TIMEOUT_MS / 1000) -> list[str]:
    """PostgreSQL, outside a transaction: end every collector session stalled inside a transaction on
    its client for `stalled_s` (see _STALLED_SESSIONS), after a lock wait ran out on one. Its
    transaction rolls back; the lease fence (collector/store.py) already refuses what its replica
    would commit. The sessions ended, as "pid (application_name)"; a role that may not end them
    (pg_signal_backend, or the same role) ends none and the lock wait is just tried again."""
    ended: list[str] = []
    for pid, name in conn.execute(_STALLED_SESSIONS, (stalled_s,)).fetchall():
        if conn.execute("SELECT pg_terminate_backend(?)", (pid,)).fetchone()[0]:
            ended.append(f"{pid} ({name})")
    return ended


def db_errors() -> tuple[type[BaseException], ...]:
    """The exceptions a store read or write can raise from either engine."""
    errors: tuple[type[BaseException], ...] = (sqlite3.Error,)
    try:
        import psycopg
    except ImportError:
        return errors
    return (*errors, psycopg.Error)


def is_transient(error: BaseException) -> bool:
    """A PostgreSQL error that passes: the server restarting or out of reach, a serialization failure
    or deadlock, a session the server ended after a partition, a lock wait or statement cut short
    (SQLSTATE class 08, 40, 57P0x, 53300, 25P03, 55P03, 57014). The store keeps retrying these without acking,
    as the tracers keep spooling; anything else is a bug or a full disk, and fails the write."""
    sqlstate = getattr(error, "sqlstate", None)
    if sqlstate is None:
        try:
            import psycopg
        except ImportError:
            return False
        return isinstance(error, psycopg.OperationalError)  # no SQLSTATE: the connection itself broke
    return sqlstate.startswith(("08", "40", "57P0")) or sqlstate in ("53300", "25P03", "55P03", "57014")


def upsert_sql(table: str, columns: Sequence[str], key: Sequence[str]) -> str:
    """INSERT of every column that replaces the row with the same key: SQLite's INSERT OR REPLACE in
    the SQL both engines speak."""
    rest = [c for c in columns if c not in key]
    return (f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))}) "
            f"ON CONFLICT ({', '.join(key)}) DO UPDATE SET " + ", ".join(f"{c} = excluded.{c}" for c in rest))


def connection_lost(error: BaseException) -> bool:
    """A transient error (is_transient) that broke the connection or found the server gone (SQLSTATE
    class 08, 57P0x, 25P03: the server ended the session; or no SQLSTATE at all), rather than one the
    same connection may simply try again (a deadlock, a serialization failure, a lock wait cut short)."""
    sqlstate = getattr(error, "sqlstate", None)
    return sqlstate is None or sqlstate.startswith(("08", "57P0")) or sqlstate in ("25P03", "53300")


def serialize_writers(conn: Conn, key: int) -> None:
    """Serialize the transactions of several replicas that read-then-write one thing (the next fault id,
    the audit chain's head): PostgreSQL's transaction-scoped advisory lock `key`, held to the commit.
    SQLite has one writer already: nothing to do."""
    if not isinstance(conn, sqlite3.Connection):
        conn.execute("SELECT pg_advisory_xact_lock(?)", (key,))
