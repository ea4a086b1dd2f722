"""The collector's probes (collector/health.py) beside /metrics: /readyz is 503 with one line naming the
store while its database is out of reach or after a write failed for good, and ready again when it is
back; /healthz fails only for a wedged event loop (a stamp handed to it and not set within the
window), never for the database."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from ghostgpu.collector.health import CollectorHealth

from tests.helpers.collector_env import running_collector
from tests.unit.test_metrics import FakeStore


class FakeLoop:
    """An event loop that runs what it is handed only when the test says so."""

    def __init__(self) -> None:
        self.handed: list[Callable[[], None]] = []
        self.closed = False

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        self.handed.append(fn)

    def is_closed(self) -> bool:
        return self.closed

    def run(self) -> None:
        handed, self.handed = self.handed, []
        for fn in handed:
            fn()


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def health(store: FakeStore, loop: FakeLoop | None, clock: Clock, serving: bool = True) -> CollectorHealth:
    return CollectorHealth(store, loop=lambda: loop, serving=lambda: serving,  # type: ignore[arg-type,return-value]
                           clock=clock)


def test_readiness_names_the_store_while_its_database_is_out_of_reach() -> None:
    store, clock = FakeStore("postgresql"), Clock()
    h = health(store, FakeLoop(), clock)
    assert h.readiness() == (True, ["ok: serving; the store takes writes"])
    store.db_down_since = clock.now_s - 12.4
    assert h.readiness() == (False, ["store: database out of reach for 12 s "
                                     "(--store postgresql://ghostgpu@db/ghostgpu)"])
    store.db_down_since = None  # back: ready again
    assert h.readiness()[0]
    store.failed = RuntimeError("--store postgresql://ghostgpu@db/ghostgpu: write failed (disk full); fix "
                                "the disk or the database and restart the collector")
    ok, lines = h.readiness()
    assert not ok and lines == [f"store: {store.failed}"]
    assert health(FakeStore(), FakeLoop(), clock, serving=False).readiness() == (
        False, ["collector: not serving (starting, or stopping)"])


def test_a_quiet_replica_learns_of_a_lost_database_from_its_lease_renewals() -> None:
    store, clock = FakeStore("postgresql"), Clock()
    leases = SimpleNamespace(ttl_s=10.0, renewed_mono=clock.now_s)
    h = CollectorHealth(store, loop=lambda: None, serving=lambda: True, leases=leases,  # type: ignore[arg-type]
                        clock=clock)
    clock.now_s += 10  # the next renewal is due every ttl/3: within a ttl, still ready
    assert h.readiness()[0]
    clock.now_s += 2.4
    assert h.readiness() == (False, ["store: no lease renewal reached the database for 12 s "
                                     "(--store postgresql://ghostgpu@db/ghostgpu; --lease-ttl 10)"])
    leases.renewed_mono = clock.now_s
    assert h.readiness()[0]


def test_liveness_fails_for_a_wedged_loop_only() -> None:
    store, clock, loop = FakeStore("postgresql"), Clock(), FakeLoop()
    h = health(store, loop, clock)
    store.db_down_since = clock.now_s - 600  # the database is no reason to restart the pod
    assert h.liveness() == (True, "ok: collector loop asked to answer (first probe)")
    assert len(loop.handed) == 1
    loop.run()
    clock.now_s += 10
    assert h.liveness() == (True, "ok: collector loop answered 10.0 s ago")
    clock.now_s += 10
    assert h.liveness()[0]  # the stamp asked for at the last probe is still out: within the window
    assert len(loop.handed) == 1  # one stamp out at a time, however often kubelet probes
    clock.now_s += 31
    ok, line = h.liveness()
    assert not ok and line.startswith("collector loop has not run for 41.0 s (limit 30 s): wedged")
    loop.run()
    assert h.liveness()[0]
    assert health(store, None, clock).liveness() == (True, "ok: the collector is starting or stopping")


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_the_probes_are_served_beside_metrics(tmp_path: Path) -> None:
    with running_collector(tmp_path, metrics_listen="127.0.0.1:0") as c:
        base = f"http://{c.metrics_address}"
        assert get(f"{base}/readyz") == (200, "ok: serving; the store takes writes\n")
        status, body = get(f"{base}/healthz")
        assert status == 200 and body.startswith("ok: ")
        c.store.db_down_since = c.health._clock() - 3.0  # as the writer thread sets it
        status, body = get(f"{base}/readyz")
        assert status == 503
        assert body.startswith("store: database out of reach for 3 s (--db ") and body.count("\n") == 1
        c.store.db_down_since = None
        assert get(f"{base}/readyz")[0] == 200


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
def test_a_probe_before_the_loop_serves(tmp_path: Path, path: str) -> None:
    from ghostgpu.collector.config import CollectorConfig
    from ghostgpu.collector.main import Collector

    c = Collector(CollectorConfig(listen=("127.0.0.1:0",), db_path=str(tmp_path / "c.db"),
                                  metrics_listen="127.0.0.1:0"))
    c._build()  # the metrics port is bound and answering; the loop does not run yet
    try:
        status, body = get(f"http://{c.metrics_address}{path}")
        expected = ((503, "collector: not serving (starting, or stopping)\n") if path == "/readyz"
                    else (200, "ok: the collector is starting or stopping\n"))
        assert (status, body) == expected
    finally:
        c._close_helpers()
