"""One audit chain for collector replicas sharing PostgreSQL (collector/audit.py): appends of several
replicas at once, each built on the head read under the chain's lock in its own write transaction,
make one chain with contiguous seqs; each replica's start and stop are checked apart (a crashed
replica is an unclean stop, the others' records between its runs are not); a replica's own audit
file is a witness `ghostgpu audit --store URL --verify --file FILE` holds against the shared chain,
and a chain rewritten in the database from an old record on (hashes forged) fails that witness."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from ghostgpu.cli.main import main
from ghostgpu.collector.audit import AuditLog, record_from_row, row_from_record, select_audit
from ghostgpu.collector.store import Store

from ghostgpu.common.audit.chain import AuditRecord, check
from tests.helpers.postgres import PostgresServer

pytestmark = pytest.mark.postgres

THREADS_PER_REPLICA = 4
APPENDS_PER_THREAD = 40


def chain(store: Store) -> list[AuditRecord]:
    items = [record_from_row(r) for r in store.read(select_audit()).result(30)]
    assert all(isinstance(i, AuditRecord) for i in items)
    return [i for i in items if isinstance(i, AuditRecord)]


def settle(*stores: Store) -> None:
    for s in stores:
        s.barrier().result(60)  # every append queued before has committed (or failed)


def test_two_replicas_appending_at_once_make_one_chain(stores: tuple[Store, Store]) -> None:
    a, b = stores
    logs = [AuditLog(None, a), AuditLog(None, b)]
    assert all(log.shared for log in logs)
    go = threading.Event()

    def work(log: AuditLog, n: int) -> None:
        go.wait()
        for i in range(APPENDS_PER_THREAD):
            assert log.append("tracer.connect", f"node:n{n}-{i}", "ok", thread=n, i=i) is None

    threads = [threading.Thread(target=work, args=(log, n))
               for n, log in enumerate(logs * THREADS_PER_REPLICA)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(60)
    settle(a, b)
    records = chain(a)
    total = 2 * THREADS_PER_REPLICA * APPENDS_PER_THREAD
    assert [r.seq for r in records] == list(range(1, total + 1))
    assert check(records, from_start=True) == ((True, None, f"audit chain intact: {total} records"), [])
    asked = [f"node:n{n}-{i}" for n in range(2 * THREADS_PER_REPLICA) for i in range(APPENDS_PER_THREAD)]
    assert sorted(r.subject for r in records) == sorted(asked)
    assert [log.appended_total for log in logs] == [total // 2, total // 2]
    assert max(log.seq for log in logs) == total  # each replica's head: the newest record it committed


def test_each_replica_run_is_checked_apart_and_a_crash_is_an_unclean_stop(
        stores: tuple[Store, Store]) -> None:
    a, b = stores
    log_a, log_b = AuditLog(None, a), AuditLog(None, b)
    start_a = log_a.start(replica="collector-a")
    assert (start_a.seq, start_a.detail["resumed_seq"]) == (1, 0)
    log_a.append("trace.start", "user:alice", "ok")
    start_b = log_b.start(replica="collector-b")  # after a's records, with no stop between: not unclean
    settle(a)
    assert start_b.detail["resumed_seq"] == start_b.seq - 1
    log_b.append("denied", "user:mallory", "denied")
    log_b.append("collector.stop", "collector", "ok", replica="collector-b", started_seq=start_b.seq)
    settle(b)
    assert check(chain(a), from_start=True)[1] == []
    log_b2 = AuditLog(None, b)  # b restarted cleanly: no warning
    log_b2.start(replica="collector-b")
    log_a2 = AuditLog(None, a)  # a "crashed": started again with its run still open
    again = log_a2.start(replica="collector-a")
    settle(a, b)
    verdict, warnings = check(chain(a), from_start=True)
    assert verdict.ok
    assert warnings == [f"record {again.seq}: unclean stop: replica collector-a started again, and its run "
                        f"from record {start_a.seq} has no collector.stop: it crashed, was killed or ran out "
                        "of memory; compare the head Prometheus saw last (ghostgpu_audit_head_seq) before "
                        "trusting the trail"]


def test_a_replica_file_is_a_witness_of_the_shared_chain(stores: tuple[Store, Store], postgres_dsn: str,
                                                         postgres_server: PostgresServer, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    a, b = stores
    witness = tmp_path / "a.audit.jsonl"
    log_a, log_b = AuditLog(str(witness), a), AuditLog(None, b)
    log_a.start(replica="collector-a")
    for i in range(5):
        log_b.append("tracer.connect", f"node:b{i}", "ok")
        log_a.append("tracer.connect", f"node:a{i}", "ok")
    settle(a, b)
    log_a.close()
    mine = [r for r in chain(a) if r.subject != "collector" and r.subject.startswith("node:a")]
    lines = witness.read_text().splitlines()
    assert len(lines) == 6 and all(r.line() in lines for r in mine)  # as stored, in commit order
    assert main(["audit", "--store", postgres_dsn, "--verify", "--file", str(witness)]) == 0
    out = capsys.readouterr().out
    assert "audit chain intact: 11 records" in out and f"the 6 records of {witness} are in the store" in out
    assert main(["audit", "--store", postgres_dsn, "-o", "json"]) == 0
    assert '"subject": "node:b4"' in capsys.readouterr().out

    # Whoever can write the database rewrites the chain from record 3 on, every hash forged: the chain
    # alone verifies again, the replica's file does not.
    rows = chain(a)
    forged: list[AuditRecord] = rows[:2]
    for r in rows[2:]:
        subject = "node:hidden" if r.seq == 3 else r.subject
        forged.append(AuditRecord.make(r.seq, r.ts_unix_ns, r.action, subject, r.result, r.detail,
                                       forged[-1].sha256))
    name = postgres_dsn.rsplit("/", 1)[1]
    postgres_server.psql("DELETE FROM audit WHERE seq >= 3", dbname=name)
    a.submit([Store.op_audit(row_from_record(r)) for r in forged[2:]])
    settle(a)
    assert check(chain(a), from_start=True)[0].ok
    assert main(["audit", "--store", postgres_dsn, "--verify", "--file", str(witness)]) == 1
    assert "differs between the store and" in capsys.readouterr().out


def test_a_store_that_cannot_be_read_is_one_line(postgres_server: PostgresServer,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    missing = postgres_server.dsn_for("no_such_database")
    assert main(["audit", "--store", missing, "--verify"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ghostgpu: --store {missing}: cannot connect (") and err.count("\n") == 1
    assert main(["audit", "--store", "mysql://x/y"]) == 2
    assert "not a store this collector speaks" in capsys.readouterr().err


def test_replicas_start_and_stop_in_one_chain_without_a_file_by_default(stores: tuple[Store, Store],
                                                                         tmp_path: Path) -> None:
    from ghostgpu.collector.config import CollectorConfig
    from ghostgpu.collector.security import Security

    a, b = stores
    db_path = str(tmp_path / "collector.db")  # the --db default stays beside: no file is made there
    opts = CollectorConfig(listen=("127.0.0.1:0",), db_path=db_path).security_options()
    sec_a = Security(opts, a, db_path, say=lambda line: None)
    sec_b = Security(opts, b, db_path, say=lambda line: None)
    assert [sec.started.detail["replica"] for sec in (sec_a, sec_b)] == ["collector-a", "collector-b"]
    assert sec_b.started.detail["resumed_seq"] == sec_b.started.seq - 1
    sec_a.audit("denied", "user:mallory", "denied", method="/ghostgpu.v1.Query/StartTrace")
    sec_b.stopping()
    sec_a.stopping()
    settle(a, b)
    records = chain(a)
    # The two stores commit in their own order: the denied record and b's stop may come either way.
    assert sorted((r.action, r.detail.get("replica", "")) for r in records) == [
        ("collector.start", "collector-a"), ("collector.start", "collector-b"),
        ("collector.stop", "collector-a"), ("collector.stop", "collector-b"), ("denied", "")]
    stop_a = next(r for r in records if r.action == "collector.stop" and r.detail["replica"] == "collector-a")
    assert sec_a.audit_head() == (stop_a.seq, 3)  # its newest committed record; start, denied, stop
    assert stop_a.detail["started_seq"] == sec_a.started.seq
    assert check(records, from_start=True) == ((True, None, "audit chain intact: 5 records"), [])
    assert list(tmp_path.iterdir()) == []
    sec_a.close()
    sec_b.close()
