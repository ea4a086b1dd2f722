"""tests/helpers/postgres.py against the real PostgreSQL 15: a fresh database per test, psycopg
connects, the server comes back on the same port after a restart and after a SIGKILL with the
committed rows, a password role must give its password, and a bad start fails with the log's lines."""

from __future__ import annotations

import psycopg
import pytest

from tests.helpers.postgres import PostgresError, PostgresServer, server_or_skip

pytestmark = pytest.mark.postgres


def test_each_test_gets_a_fresh_database_psycopg_can_use(postgres_dsn: str,
                                                         postgres_server: PostgresServer) -> None:
    assert postgres_dsn.startswith(f"postgresql://postgres@127.0.0.1:{postgres_server.port}/t")
    with psycopg.connect(postgres_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").fetchone() == (0,)
        conn.execute("CREATE TABLE t (i int)")
        conn.execute("INSERT INTO t VALUES (1)")
        assert conn.execute("SHOW fsync").fetchone() == ("on",)  # real commits, as in production
    dbname = postgres_dsn.rsplit("/", 1)[1]
    assert postgres_server.psql("SELECT count(*) FROM t", dbname=dbname) == "1"


def test_the_next_test_does_not_see_the_previous_ones_rows(postgres_dsn: str) -> None:
    with psycopg.connect(postgres_dsn) as conn:
        assert conn.execute("SELECT to_regclass('public.t')").fetchone() == (None,)


def test_restart_and_sigkill_keep_the_port_and_the_committed_rows(own_postgres: PostgresServer) -> None:
    pg = own_postgres
    dsn = pg.create_database("app")
    port = pg.port
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (i int)")
        conn.execute("INSERT INTO t VALUES (1)")
    held = psycopg.connect(dsn, autocommit=True)
    try:
        pg.restart()
        assert pg.is_running and pg.port == port
        with pytest.raises(psycopg.OperationalError):
            held.execute("SELECT 1")  # the fast shutdown closed it
    finally:
        held.close()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO t VALUES (2)")
        pid = pg.pid
        pg.kill()
        assert not pg.is_running
        with pytest.raises(psycopg.OperationalError):
            conn.execute("SELECT 1")  # its backend exited with the postmaster
    pg.start()  # crash recovery replays the WAL
    assert pg.pid != pid and pg.port == port
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT array_agg(i ORDER BY i) FROM t").fetchone() == ([1, 2],)
    pg.stop("immediate")
    assert not pg.is_running
    assert pg.start().psql("SELECT count(*) FROM t", dbname="app") == "2"


@pytest.mark.parametrize("method", ["scram-sha-256", "md5"])
def test_a_password_role_logs_in_only_with_its_password(postgres_server: PostgresServer, method: str) -> None:
    role = f"pw_{method.split('-')[0]}"
    dsn = postgres_server.add_password_role(role, "s3cr'et", method=method)
    assert dsn == f"postgresql://{role}@127.0.0.1:{postgres_server.port}/postgres"
    with pytest.raises(psycopg.OperationalError, match="no password supplied"):
        psycopg.connect(dsn)
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(dsn, password="wrong")
    with psycopg.connect(dsn, password="s3cr'et") as conn:
        assert conn.execute("SELECT current_user").fetchone() == (role,)
    stored = postgres_server.psql(f"SELECT rolpassword FROM pg_authid WHERE rolname = '{role}'")
    assert stored.startswith("SCRAM-SHA-256$" if method == "scram-sha-256" else "md5")


def test_a_start_that_fails_says_why_with_the_log_and_leaves_nothing() -> None:
    pg = server_or_skip(settings={"shared_buffers": "'lots'"})
    why = r'(?s)exited with 1 .*invalid value for parameter "shared_buffers"'
    with pytest.raises(PostgresError, match=why):
        pg.start()
    assert not pg.is_running
    pg.close()
    assert not pg.dir.exists()
