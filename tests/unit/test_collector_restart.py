"""What survives a collector restart (positions, the event log, findings history), the store's
bounds, and `ghostgpu collector` itself: its errors and its life as a real process."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from ghostgpu.collector.config import CollectorConfig
from ghostgpu.collector.main import Collector
from ghostgpu.collector.run import run_collector
from ghostgpu.collector.server import ListenError
from ghostgpu.collector.store import FindingRow, Store, StoreError

from ghostgpu.common.model.consumers import ConsumerClass
from tests.helpers.collector_env import QueryClient, running_collector
from tests.helpers.polling import wait_until
from tests.helpers.sim_tracer import SimTracer, StreamEnded, finding, holder, make_consumer

ROOT = Path(__file__).resolve().parents[2]


def _seqs(q: QueryClient, instance_id: str) -> list[int]:
    return [e.event.seq for e in q.events(instance_id=instance_id, limit=100_000)]


def test_every_event_stored_once_across_a_collector_restart(tmp_path: Path) -> None:
    instance = "a1b2c3"
    with running_collector(tmp_path) as c1:
        t = SimTracer(c1.address, "n1", instance_id=instance)
        t.connect()
        for start in range(1, 101, 20):
            t.send_events([holder(s, 7) for s in range(start, start + 20)])
        t.wait_acked(100)
        t.send_events([holder(s, 7) for s in range(101, 151)])  # may or may not be stored: no ack waited
    t.stop()  # the collector stopped under the tracer's feet
    with running_collector(tmp_path) as c2, QueryClient(c2.address) as q:
        t = SimTracer(c2.address, "n1", instance_id=instance)
        acked = t.connect().acked_seq
        assert acked in (100, 150)
        # The tracer resends what it holds unacknowledged, and (as after a lost Ack) some already stored.
        for start in range(81, 181, 20):
            t.send_events([holder(s, 7) for s in range(start, start + 20)])
        t.wait_acked(180)
        t.stop()
        assert _seqs(q, instance) == list(range(1, 181))
        st = q.node("n1")
        assert (st.events_ingested_total, st.events_lost_total, st.last_seq) == (180, 0, 180)
        assert st.duplicates_total == acked - 80  # 81..acked were resent and dropped


def test_findings_survive_a_restart_and_open_ones_resolve_on_the_next_snapshot(tmp_path: Path) -> None:
    a = make_consumer("n1", 1, container_id="aa" * 32)
    b = make_consumer("n1", 2, container_id="bb" * 32)
    with running_collector(tmp_path) as c1, QueryClient(c1.address) as q:
        with SimTracer(c1.address, "n1") as t:
            t.connect()
            t.send_events([finding(1, a), finding(2, b)])
            t.send_events([finding(3, replace(b, cls=ConsumerClass.VISIBLE))])
            t.wait_acked(3)
        before = {f.id: f for f in q.findings()}
    assert before[1].resolved_unix_ns == 0 and before[2].resolved_unix_ns > 0
    with running_collector(tmp_path) as c2, QueryClient(c2.address) as q:
        assert {f.id: f for f in q.findings()} == before
        watch = iter(q.watch(include_open=True))
        assert next(watch).finding.id == 1  # still open
        with SimTracer(c2.address, "n1") as t:  # the node's tracer restarted too: a's process is gone
            t.connect()
            t.send_snapshot([replace(b, cls=ConsumerClass.VISIBLE)], seq=0)
            t.send_events([holder(1, 2)])
            t.wait_acked(1)
        after = {f.id: f for f in q.findings()}
        assert sorted(after) == [1, 2] and after[1].resolved_unix_ns > 0
        ev = next(watch)
        assert (ev.kind, ev.finding.id) == (3, 1)  # KIND_RESOLVED, same finding, not a new one
        new = make_consumer("n1", 3, container_id="cc" * 32)
        with SimTracer(c2.address, "n1") as t:
            t.connect()
            t.send_events([finding(1, new)])
            t.wait_acked(1)
        assert [f.id for f in q.findings()] == [1, 2, 3]  # ids go on after a restart


def test_event_log_keeps_the_newest_events_within_its_bound(tmp_path: Path) -> None:
    with running_collector(tmp_path, event_log_max=50) as c, QueryClient(c.address) as q:
        with SimTracer(c.address, "n1") as t:
            t.connect()
            for start in range(1, 201, 30):
                t.send_events([holder(s, 7) for s in range(start, min(start + 30, 201))])
            t.send_events([holder(s, 7) for s in range(201, 281)])  # one batch larger than the whole log
            t.wait_acked(280)
        seqs = [e.event.seq for e in q.events(limit=1000)]
        assert seqs == list(range(231, 281)) and c.store.event_log_count == 50
        assert q.node("n1").events_ingested_total == 280  # positions do not depend on the log
    with running_collector(tmp_path, db_name="none.db", event_log_max=0) as c, QueryClient(c.address) as q:
        with SimTracer(c.address, "n1") as t:
            t.connect()
            t.send_events([holder(1, 7)])
            t.wait_acked(1)
        assert q.events() == [] and q.node("n1").events_ingested_total == 1


def test_resolved_findings_older_than_the_retention_are_forgotten(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "c.db"), event_log_max=10, retention_days=1)
    now = time.time_ns()
    day_ns = 86400 * 10**9
    rows = [FindingRow(1, "n1", "", "hidden", "1/0/", now - 3 * day_ns, now - 2 * day_ns, b""),
            FindingRow(2, "n1", "", "hidden", "2/0/", now - 3 * day_ns, now - day_ns // 2, b""),
            FindingRow(3, "n1", "", "hidden", "3/0/", now - 3 * day_ns, 0, b"")]
    store.submit([Store.op_finding(r) for r in rows])
    store.close()
    store = Store(str(tmp_path / "c.db"), event_log_max=10, retention_days=1)
    ids = store.read(lambda conn: [r[0] for r in conn.execute("SELECT id FROM findings ORDER BY id")])
    assert ids.result(5) == [2, 3]
    store.close()


def _args(tmp_path: Path, **kw: object) -> argparse.Namespace:
    base = {"listen": "127.0.0.1:0", "db": str(tmp_path / "c.db"), "retention_days": 7.0,
            "event_log_max": 1000, "collector_cri_endpoint": None, "cri_ttl_s": 30.0}
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize(("flags", "expected"), [
    ({"listen": "localhost"}, "--listen 'localhost': use HOST:PORT"),
    ({"listen": "unix:relative.sock"}, "unix:///absolute/path"),
    ({"listen": "203.0.113.9:7450"}, "--listen 203.0.113.9:7450: plaintext on an address others can reach; "
     "pass --tls-cert, --tls-key and --tls-ca"),
    ({"db": "/proc/version/collector.db"}, "--db /proc/version/collector.db: cannot open or write it"),
    ({"retention_days": 0.0}, "--retention-days 0.0: must be more than 0"),
    ({"collector_cri_endpoint": "containerd.sock"},
     "--collector-cri-endpoint: CRI endpoint 'containerd.sock'"),
])
def test_bad_flags_exit_2_with_one_line_naming_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        flags: dict[str, object], expected: str) -> None:
    assert run_collector(_args(tmp_path, **flags), install_signals=lambda stop: None) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1


def test_a_busy_port_is_refused_not_shared(tmp_path: Path) -> None:
    with running_collector(tmp_path) as c:
        other = Collector(CollectorConfig(listen=(c.address,), db_path=str(tmp_path / "other.db")))
        with pytest.raises(ListenError, match="cannot listen there"):
            other.start()


def test_a_start_that_fails_closes_what_it_opened(tmp_path: Path) -> None:
    c = Collector(CollectorConfig(listen=("127.0.0.1:0",), db_path="/proc/version/collector.db",
                                  cri_endpoint=f"unix://{tmp_path}/cri.sock"))
    with pytest.raises(StoreError, match="cannot open or write it"):
        c.start()
    with pytest.raises(ValueError, match="closed channel"):  # the CRI socket's channel is closed
        c._direct("Version", b"", 1.0)


def test_a_database_that_cannot_be_written_ends_streams_and_stays_failed(tmp_path: Path) -> None:
    with running_collector(tmp_path) as c:
        with SimTracer(c.address, "n1") as t:
            t.connect()
            t.send_events([holder(1, 1)])
            t.wait_acked(1)
            c.store._conn.close()  # the database goes away under the writer (as a dead disk would)
            t.send_events([holder(2, 1)])
            code, details = t.wait_ended()
            assert code == grpc.StatusCode.UNAVAILABLE and "collector cannot store events" in details
            assert t.acked_seq == 1  # nothing unstored was acknowledged
        assert c.failed is not None and "write failed" in str(c.failed)
        with QueryClient(c.address) as q, pytest.raises(grpc.RpcError) as rpc_err:
            q.findings()
        assert rpc_err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "cannot read its database" in rpc_err.value.details()
        with SimTracer(c.address, "n1") as t, pytest.raises(StreamEnded) as err:
            t.connect()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_store_refuses_a_database_of_another_schema(tmp_path: Path) -> None:
    Store(str(tmp_path / "c.db"), 10, 1).close()
    import sqlite3

    with sqlite3.connect(tmp_path / "c.db") as conn:
        conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema'")
    with pytest.raises(StoreError, match="schema version 99"):
        Store(str(tmp_path / "c.db"), 10, 1)


def test_ghostgpu_collector_process_serves_then_stops_on_sigterm(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "ghostgpu.cli", "collector", "--listen", f"127.0.0.1:0,unix://{tmp_path}/c.sock",
           "--db", str(tmp_path / "state" / "c.db")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "listening on 127.0.0.1:" in line and f"unix://{tmp_path}/c.sock" in line
        with SimTracer(f"unix://{tmp_path}/c.sock", "n1") as t:
            t.connect()
            t.send_events([holder(1, 1)])
            t.wait_acked(1)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
            code, details = t.wait_ended()
            assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in details
        assert (tmp_path / "state" / "c.db").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wait_until(lambda: proc.returncode is not None, "the collector process to end")


def test_an_insecure_listener_that_cannot_bind_says_so_after_its_warning(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_collector(_args(tmp_path, listen="203.0.113.9:7450", insecure=True),
                         install_signals=lambda stop: None) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("ghostgpu: collector: INSECURE: 203.0.113.9:7450 serves plaintext gRPC")
    assert lines[-1].startswith("ghostgpu: collector: --listen 203.0.113.9:7450: cannot listen there")
    assert len(lines) == 2

