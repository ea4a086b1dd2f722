"""collector/db.py's pure parts: --store URLs, the portable SQL's placeholders and upserts, and which
PostgreSQL errors the store waits out (and which of those broke the connection)."""

from __future__ import annotations

from pathlib import Path

import pytest
from ghostgpu.collector.db import (
    StoreUrl,
    StoreUrlError,
    connection_lost,
    is_transient,
    parse_store_url,
    pg_sql,
    read_password_file,
    upsert_sql,
)


@pytest.mark.parametrize(("value", "engine", "target"), [
    ("/var/lib/ghostgpu/collector.db", "sqlite", "/var/lib/ghostgpu/collector.db"),  # the --db form
    ("collector.db", "sqlite", "collector.db"),
    (":memory:", "sqlite", ":memory:"),
    ("sqlite:///var/lib/ghostgpu/c.db", "sqlite", "/var/lib/ghostgpu/c.db"),
    ("sqlite://:memory:", "sqlite", ":memory:"),
    ("postgresql://ghostgpu@db.example/ghostgpu", "postgresql", "postgresql://ghostgpu@db.example/ghostgpu"),
    ("postgres://u@h:5433/d?sslmode=verify-full", "postgresql", "postgres://u@h:5433/d?sslmode=verify-full"),
    ("postgresql://u@h/?dbname=d", "postgresql", "postgresql://u@h/?dbname=d"),
])
def test_store_urls(value: str, engine: str, target: str) -> None:
    assert parse_store_url(value) == StoreUrl(engine, target)  # type: ignore[arg-type]


@pytest.mark.parametrize(("value", "says"), [
    ("", "--store: empty"),
    ("postgresql://u@h", "names no database"),
    ("postgresql://u@h/", "names no database"),
    ("mysql://u@h/d", "--store mysql://...: not a store this collector speaks"),
    ("sqlite://", "names no file"),
])
def test_bad_store_urls_are_one_line_naming_the_flag(value: str, says: str) -> None:
    with pytest.raises(StoreUrlError) as e:
        parse_store_url(value)
    assert says in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("--store")


@pytest.mark.parametrize(("value", "shown"), [
    ("postgresql://u:s3cret@h/d", "postgresql://u:***@h/d"),
    ("postgresql://u@h/d", "postgresql://u@h/d"),
    ("/tmp/c.db", "/tmp/c.db"),
])
def test_a_url_is_shown_without_its_password(value: str, shown: str) -> None:
    url = parse_store_url(value)
    assert url.shown() == shown and "s3cret" not in url.flag


@pytest.mark.parametrize(("sql", "pg"), [
    ("SELECT * FROM t WHERE a = ? AND b = ?", "SELECT * FROM t WHERE a = %s AND b = %s"),
    ("SELECT 1", "SELECT 1"),
    ("SELECT a % 2 FROM t WHERE b = ?", "SELECT a %% 2 FROM t WHERE b = %s"),
])
def test_placeholders_become_psycopgs(sql: str, pg: str) -> None:
    assert pg_sql(sql) == pg


def test_upsert_replaces_every_column_but_the_key() -> None:
    assert upsert_sql("t", ("k1", "k2", "a", "b"), ("k1", "k2")) == (
        "INSERT INTO t (k1, k2, a, b) VALUES (?, ?, ?, ?) ON CONFLICT (k1, k2) DO UPDATE SET "
        "a = excluded.a, b = excluded.b")


class PgError(Exception):
    def __init__(self, sqlstate: str | None) -> None:
        super().__init__(sqlstate or "no sqlstate")
        self.sqlstate = sqlstate


@pytest.mark.parametrize(("sqlstate", "transient", "lost"), [
    ("08006", True, True),   # connection_failure
    ("57P01", True, True),   # admin_shutdown: the server restarts
    ("57P03", True, True),   # cannot_connect_now: still starting
    ("25P03", True, True),   # idle_in_transaction_session_timeout: the server ended the session
    ("53300", True, True),   # too_many_connections
    ("40P01", True, False),  # deadlock_detected: the same connection tries again
    ("40001", True, False),  # serialization_failure
    ("55P03", True, False),  # lock_not_available (lock_timeout)
    ("57014", True, False),  # query_canceled
    ("23505", False, False),  # unique_violation: a bug, not a moment
    ("42P01", False, False),  # undefined_table
])
def test_which_errors_the_store_waits_out(sqlstate: str, transient: bool, lost: bool) -> None:
    err = PgError(sqlstate)
    assert is_transient(err) is transient
    if transient:
        assert connection_lost(err) is lost


def test_the_password_file_gives_its_first_line(tmp_path: Path) -> None:
    f = tmp_path / "password"
    f.write_text("s3cret\nignored\n")
    assert read_password_file(str(f)) == "s3cret"
    f.write_text("\n")
    with pytest.raises(StoreUrlError, match=r"--store-password-file .*: empty"):
        read_password_file(str(f))
    with pytest.raises(StoreUrlError, match="cannot read it"):
        read_password_file(str(tmp_path / "missing"))
