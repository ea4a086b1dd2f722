"""The collector's /readyz on a PostgreSQL store (collector/health.py): a replica whose database goes
away says so in one line naming --store, and is ready again once the database is back; /healthz stays
200 throughout (a lost database is no reason to restart the pod)."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.collector_env import running_collector
from tests.helpers.polling import wait_until
from tests.helpers.postgres import PostgresServer

pytestmark = pytest.mark.postgres

LEASE_TTL_S = 1.0  # renewals every ttl/3: a quiet replica notices the database gone within a ttl or so
DEADLINE_S = 60.0


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_readyz_follows_the_database(own_postgres: PostgresServer, tmp_path: Path) -> None:
    dsn = own_postgres.create_database("probes")
    with running_collector(tmp_path, store_url=dsn, replica_id="collector-p", lease_ttl_s=LEASE_TTL_S,
                           metrics_listen="127.0.0.1:0") as c:
        base = f"http://{c.metrics_address}"
        assert get(f"{base}/readyz") == (200, "ok: serving; the store takes writes\n")
        own_postgres.stop()
        wait_until(lambda: get(f"{base}/readyz")[0] == 503, "/readyz 503 with the database stopped",
                   timeout_s=DEADLINE_S)
        status, body = get(f"{base}/readyz")
        assert status == 503 and body.count("\n") == 1
        assert body.startswith("store: ") and f"(--store {dsn}" in body
        assert get(f"{base}/healthz")[0] == 200
        own_postgres.start()
        wait_until(lambda: get(f"{base}/readyz")[0] == 200, "/readyz 200 with the database back",
                   timeout_s=DEADLINE_S)
