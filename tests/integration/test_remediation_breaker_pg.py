"""The breaker across collector replicas sharing PostgreSQL (collector/remediation_store.py): mark_acted
counts the acts in the window and records its own in one transaction, under an advisory lock of its
own, so that replicas racing to act on different nodes never pass max_actions between them."""

from __future__ import annotations

import threading
import time

import pytest
from ghostgpu.collector.remediation_store import ActGuard, Claim, IncidentRow, insert_incident, mark_acted
from ghostgpu.collector.store import Store

pytestmark = pytest.mark.postgres

NODES = 8
MAX_ACTIONS = 3


def test_two_replicas_racing_to_act_stop_at_max_actions(stores: tuple[Store, Store]) -> None:
    a, b = stores
    now = time.time_ns()
    for i in range(NODES):
        row = IncidentRow(f"f{i}/kill_orphan", i, f"n{i}", "ml", "kill_orphan", "proposed", "on", "kill",
                          now, now, 0, "collector-a", 0, "{}")
        assert a.read_write(insert_incident(row)).result(30)
    go = threading.Event()
    claims: list[Claim] = []
    lock = threading.Lock()

    def act(store: Store, i: int) -> None:
        guard = ActGuard(node=f"n{i}", window_start_unix_ns=now - 3600 * 10**9, max_actions=MAX_ACTIONS,
                         max_per_node=5, config_mode="on")
        go.wait()
        claim = store.read_write(mark_acted(f"f{i}/kill_orphan", time.time_ns(), guard)).result(60)
        with lock:
            claims.append(claim)

    threads = [threading.Thread(target=act, args=(a if i % 2 else b, i)) for i in range(NODES)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(120)
    assert len(claims) == NODES
    assert sum(c.acted for c in claims) == MAX_ACTIONS
    refused = [c.refused for c in claims if not c.acted]
    assert all(r.startswith(f"breaker open: {MAX_ACTIONS} acts in the window") for r in refused), refused
