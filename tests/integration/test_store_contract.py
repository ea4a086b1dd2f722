"""The store's contract (collector/store.py, db.py, migrations.py, leases.py), the same tests on both
engines: a SQLite file in the test's tmp_path, and a fresh database on a real PostgreSQL 15 started by
the tests (tests/helpers/postgres.py; skipped with the reason where its binaries are missing, a failure
under GHOSTGPU_REQUIRE_INTEGRATION=1).

What each engine guarantees about the event log's key (node, boot_id, instance_id, seq):
- PostgreSQL holds each seq in one row at most, whoever writes it: the `events_seq_once` exclusion
  constraint, and the store inserts with ON CONFLICT DO NOTHING, so a slice overlapping a stored one is
  dropped whole (several replicas may race for a node for an instant; the database settles it).
- SQLite's table has no such key: one collector writes the file, and ingest drops every seq at or below
  the instance's stored position (`delivered_seq`) before it reaches the store. The store itself keeps
  an overlapping slice it is handed; through ingest, a resent slice is stored once on both engines.

A second connection (`other_client`) plays another process reading the database: it sees what was
committed and nothing else.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.collector.audit import AuditRow, select_audit
from ghostgpu.collector.db import Conn, connect_postgresql, parse_store_url
from ghostgpu.collector.faults import FaultBook
from ghostgpu.collector.leases import Leases
from ghostgpu.collector.migrations import SCHEMA_VERSION, migrate, schema_version
from ghostgpu.collector.query import select_events
from ghostgpu.collector.store import FindingRow, LeaseLost, Position, Store, StoreError, decode_blob
from ghostgpu.collector.trace_store import TraceStore, decode_records

from ghostgpu.common.model.trace import TraceScope, TraceSession, TraceStatus
from ghostgpu.v1 import stream_pb2, trace_pb2
from tests.helpers.collector_env import QueryClient, running_collector
from tests.helpers.fault_events import fault_event, fault_record
from tests.helpers.polling import wait_until
from tests.helpers.sim_tracer import SimTracer, batch_bytes, holder, trace_record

ENGINES = [pytest.param("sqlite", id="sqlite"),
           pytest.param("postgresql", id="postgresql", marks=pytest.mark.postgres)]
TIMEOUT_S = 30.0  # a future's wait: a 2-core VM shared with other test runs
DAY_NS = 86_400 * 10**9
TABLES = {"meta", "positions", "events", "findings", "trace_sessions", "trace_records", "trace_audit",
          "audit", "faults", "fault_counts", "node_leases", "node_state", "replica_commands"}


@pytest.fixture(params=ENGINES)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The store's URL: a SQLite file of this test, or a fresh PostgreSQL database of this test."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/collector.db"
    dsn: str = request.getfixturevalue("postgres_dsn")
    return dsn


def open_store(url: str, *, event_log_max: int = 1_000_000, retention_days: float = 7.0,
               replica_id: str = "r1") -> Store:
    return Store(url, event_log_max, retention_days, replica_id=replica_id)


@pytest.fixture
def store(url: str) -> Iterator[Store]:
    s = open_store(url)
    yield s
    s.close()


@contextlib.contextmanager
def other_client(url: str) -> Iterator[Conn]:
    """A connection of its own, as another process has: autocommit, the portable `?` SQL."""
    parsed = parse_store_url(url)
    conn: Any
    if parsed.engine == "sqlite":
        conn = sqlite3.connect(parsed.target, isolation_level=None, timeout=TIMEOUT_S)
    else:
        conn = connect_postgresql(parsed)
    try:
        yield conn
    finally:
        conn.close()


def scalar(url: str, sql: str, params: tuple[Any, ...] = ()) -> Any:
    with other_client(url) as conn:
        return conn.execute(sql, params).fetchone()[0]


def rows(url: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with other_client(url) as conn:
        return [tuple(r) for r in conn.execute(sql, params).fetchall()]


def committed(store: Store, ops: list[Any], fence: tuple[str, int] | None = None) -> BaseException | None:
    """Submit and wait for the job's done(error); the error (None once committed)."""
    fut: Future[BaseException | None] = Future()
    store.submit(ops, fut.set_result, fence=fence)
    return fut.result(TIMEOUT_S)


@contextlib.contextmanager
def one_group(store: Store, commits: bool = True) -> Iterator[None]:
    """Hold the writer thread on a read while the block submits: what it submits commits as one group
    once the block ends (the writer takes everything queued at once, collector/store.py _run);
    commits=False for a group that fails."""
    started, release = threading.Event(), threading.Event()

    def hold(conn: Any) -> None:
        started.set()
        release.wait(TIMEOUT_S)

    held = store.read(hold)
    assert started.wait(TIMEOUT_S), "the writer thread never ran the holding read"
    commits_before = len(store.commit_seconds)
    try:
        yield
    finally:
        release.set()
        held.result(TIMEOUT_S)
    store.barrier().result(TIMEOUT_S)
    if commits:
        assert len(store.commit_seconds) == commits_before + 1, "the block's writes were not one group commit"


def events_op(pos: Position, first: int, last: int) -> Any:
    return Store.op_events(pos, first, last, last - first + 1,
                           batch_bytes([holder(s, 7) for s in range(first, last + 1)]))


def stored_seqs(store: Store, node: str, instance_id: str) -> list[int]:
    """The seqs ListEvents would return for the instance (query.select_events, every row decoded)."""
    found = store.read(select_events(node, instance_id, 0, 1_000_000)).result(TIMEOUT_S)
    return [e.seq for *_, codec, blob in found
            for e in stream_pb2.TracerMessage.FromString(decode_blob(codec, blob)).events.events]


def finding_row(fid: int, node: str = "n1", opened_ns: int = 0, resolved_ns: int = 0) -> FindingRow:
    return FindingRow(fid, node, "ml", "hidden", f"{node}/ctr-{fid}", opened_ns or time.time_ns(),
                      resolved_ns, b"consumer-" + str(fid).encode())


# ---- the schema ----------------------------------------------------------------------------------


def test_migrations_make_every_table_and_running_them_again_changes_nothing(url: str) -> None:
    s = open_store(url)
    assert committed(s, [Store.op_finding(finding_row(1))]) is None
    s.close()
    if url.startswith("sqlite"):
        names = {r[0] for r in rows(url, "SELECT name FROM sqlite_master WHERE type = 'table'")}
    else:
        names = {r[0] for r in rows(url, "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert names >= TABLES
    with other_client(url) as conn:
        assert schema_version(conn) == SCHEMA_VERSION
        assert migrate(conn, parse_store_url(url).engine, "test") == SCHEMA_VERSION  # nothing left to run
    s = open_store(url)  # and a collector starting again on it
    try:
        assert [f.id for f in s.load_open_findings()] == [1]
    finally:
        s.close()
    assert rows(url, "SELECT value FROM meta WHERE key = 'schema'") == [(str(SCHEMA_VERSION),)]


@pytest.mark.postgres
def test_replicas_starting_together_migrate_once(postgres_dsn: str) -> None:
    url = postgres_dsn
    opened: list[Store] = []
    errors: list[BaseException] = []

    def start(i: int) -> None:
        try:
            opened.append(open_store(url, replica_id=f"r{i}"))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    try:
        assert errors == [] and len(opened) == 3
        assert rows(url, "SELECT value FROM meta WHERE key = 'schema'") == [(str(SCHEMA_VERSION),)]
    finally:
        for s in opened:
            s.close()


def test_a_newer_schema_is_refused_with_one_line_naming_the_store(url: str) -> None:
    open_store(url).close()
    with other_client(url) as conn:
        conn.execute("UPDATE meta SET value = ? WHERE key = 'schema'", (str(SCHEMA_VERSION + 1),))
    with pytest.raises(StoreError) as e:
        open_store(url)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(parse_store_url(url).flag + ":"), message
    assert f"schema version {SCHEMA_VERSION + 1}" in message and "newer ghostgpu" in message
    assert scalar(url, "SELECT value FROM meta WHERE key = 'schema'") == str(SCHEMA_VERSION + 1)  # untouched


# ---- the event log -------------------------------------------------------------------------------


def test_events_are_stored_and_read_back_as_list_events_reads_them(url: str, store: Store) -> None:
    a, b = Position("n1", "boot-1", "inst-a"), Position("n2", "boot-1", "inst-b")
    assert committed(store, [events_op(a, 1, 10), events_op(b, 1, 3), events_op(a, 11, 15)]) is None
    assert stored_seqs(store, "n1", "inst-a") == list(range(1, 16))
    assert stored_seqs(store, "", "inst-b") == [1, 2, 3]
    after = store.read(select_events("n1", "inst-a", 10, 100)).result(TIMEOUT_S)
    assert len(after) == 1  # only the row holding seqs past 10
    newest = store.read(select_events("", "", 0, 6)).result(TIMEOUT_S)  # no instance: the newest rows
    assert [(r[0], r[2]) for r in newest] == [("n2", "inst-b"), ("n1", "inst-a")]
    assert rows(url, "SELECT node, first_seq, last_seq, count, codec FROM events ORDER BY id") == [
        ("n1", 1, 10, 10, 1), ("n2", 1, 3, 3, 1), ("n1", 11, 15, 5, 1)]  # zlib, one row per slice


def test_an_overlapping_slice_of_the_same_instance_is_kept_once_by_postgresql_only(url: str,
                                                                                   store: Store) -> None:
    pos = Position("n1", "boot-1", "inst-a")
    assert committed(store, [events_op(pos, 1, 10)]) is None
    # Another slice of seqs 5..15 (a replica fenced out an instant too late, a resend) and a slice
    # right after the first: adjacent ranges do not overlap.
    assert committed(store, [events_op(pos, 5, 15)]) is None
    assert committed(store, [events_op(pos, 11, 12)]) is None
    if store.engine == "postgresql":
        assert stored_seqs(store, "n1", "inst-a") == list(range(1, 13))  # 5..15 dropped whole
    else:  # no key in the table: ingest's positions dedupe (test_a_resent_slice_is_stored_once...)
        assert stored_seqs(store, "n1", "inst-a") == [*range(1, 11), *range(5, 16), 11, 12]
    # The same seqs of another instance, boot or node are other events.
    for other in (Position("n1", "boot-1", "inst-b"), Position("n1", "boot-2", "inst-a"),
                  Position("n2", "boot-1", "inst-a")):
        assert committed(store, [events_op(other, 1, 10)]) is None
    stored = rows(url, "SELECT first_seq, last_seq FROM events WHERE node = 'n1' AND boot_id = 'boot-1' "
                       "AND instance_id = 'inst-a' ORDER BY id")
    assert stored == ([(1, 10), (11, 12)] if store.engine == "postgresql" else [(1, 10), (5, 15), (11, 12)])
    assert scalar(url, "SELECT COUNT(*) FROM events") == len(stored) + 3


def test_a_resent_slice_is_stored_once_through_ingest(url: str, tmp_path: Path) -> None:
    """The guarantee SQLite has (and PostgreSQL too): the stream position drops seqs already stored."""
    with running_collector(tmp_path, store_url=url, replica_id="r1") as c, QueryClient(c.address) as q:
        with SimTracer(c.address, "n1", instance_id="inst-a") as t:
            t.connect()
            t.wait_acked(t.send_events([holder(s, 7) for s in range(1, 21)]))
        with SimTracer(c.address, "n1", instance_id="inst-a") as t:
            assert t.connect().acked_seq == 20
            t.wait_acked(t.send_events([holder(s, 7) for s in range(11, 31)]))  # 11..20 again, then 21..30
        assert [e.event.seq for e in q.events(instance_id="inst-a", limit=1000)] == list(range(1, 31))
        assert q.node("n1").duplicates_total == 10
    assert sum(last - first + 1 for first, last in rows(url, "SELECT first_seq, last_seq FROM events")) == 30


def test_the_event_log_keeps_the_newest_events_within_its_bound(url: str) -> None:
    s = open_store(url, event_log_max=30)
    pos = Position("n1", "boot-1", "inst-a")
    for first in range(1, 51, 10):
        assert committed(s, [events_op(pos, first, first + 9)]) is None
    s.close()
    # SQLite bounds the log at each group commit; PostgreSQL (several writers) in the retention prune,
    # one replica at a time, which a start runs too.
    open_store(url, event_log_max=30).close()
    assert rows(url, "SELECT first_seq, last_seq FROM events ORDER BY id") == [(21, 30), (31, 40), (41, 50)]


# ---- positions, findings, faults, audit, traces --------------------------------------------------


def test_positions_are_upserted_per_instance_the_latest_counters_winning(url: str, store: Store) -> None:
    pos = Position("n1", "boot-1", "inst-a", delivered_seq=10, ingested_total=10, updated_unix_ns=1)
    assert committed(store, [Store.op_position(pos)]) is None
    pos.delivered_seq, pos.ingested_total, pos.duplicates_total = 20, 20, 3
    first = Store.op_position(pos)
    pos.delivered_seq, pos.gaps_total, pos.updated_unix_ns = 25, 1, time.time_ns()
    other = Position("n1", "boot-1", "inst-b", delivered_seq=7, updated_unix_ns=time.time_ns())
    assert committed(store, [first, Store.op_position(pos), Store.op_position(other)]) is None
    later = open_store(url, replica_id="r2")  # another replica, or this collector after a restart
    try:
        assert {p.key: p for p in later.load_positions()} == {pos.key: pos, other.key: other}
    finally:
        later.close()
    assert scalar(url, "SELECT COUNT(*) FROM positions") == 2


def test_findings_are_upserted_by_id_and_ids_are_never_handed_out_twice(url: str, store: Store) -> None:
    opened = finding_row(store.next_finding_id())
    second = finding_row(store.next_finding_id())
    assert committed(store, [Store.op_finding(opened), Store.op_finding(second)]) is None
    assert committed(store, [Store.op_finding(opened._replace(resolved_unix_ns=time.time_ns(),
                                                              consumer=b"last"))]) is None
    got = {r[0]: r for r in rows(url, "SELECT id, resolved_unix_ns, consumer FROM findings")}
    assert len(got) == 2 and got[opened.id][1] > 0 and bytes(got[opened.id][2]) == b"last"
    if store.engine == "sqlite":
        store.close()  # one collector writes a SQLite file: its next ids are those after a restart
    other = open_store(url, replica_id="r2")
    try:
        assert [f.id for f in other.load_open_findings()] == [opened.id + 1]
        theirs = {other.next_finding_id() for _ in range(5)}
        mine = {store.next_finding_id() for _ in range(5)} if store.engine == "postgresql" else set()
        # PostgreSQL: each replica draws its own block of ids from the finding_ids sequence
        assert len(mine | theirs) == len(mine) + len(theirs)
        assert not {opened.id, opened.id + 1} & (mine | theirs)
    finally:
        other.close()


def test_a_fault_is_inserted_once_by_its_kernel_log_record(url: str, store: Store) -> None:
    book = FaultBook(store, None, max_kept=100)
    store.load(book.load)
    record = fault_record(node="n1", kmsg_seq=77)
    first = book.take("n1", "boot-1", fault_event(1, record))
    again = book.take("n1", "boot-1", fault_event(9, record))  # the same record under another seq
    assert committed(store, [first.op]) is None and committed(store, [again.op]) is None
    assert (first.stored, again.stored) == (True, False)
    other_boot = book.take("n1", "boot-2", fault_event(2, record))  # the same seq after a reboot: new
    assert committed(store, [other_boot.op]) is None and other_boot.stored
    assert rows(url, "SELECT id, boot_id, kmsg_seq FROM faults ORDER BY id") == [(1, "boot-1", 77),
                                                                                  (2, "boot-2", 77)]
    assert rows(url, "SELECT node, gpu, xid, count FROM fault_counts") == [("n1", "1", "79", 2)]


def test_audit_rows_are_appended_and_a_seq_already_stored_is_not_written_again(store: Store) -> None:
    row = AuditRow(1, time.time_ns(), "collector.start", "collector", "ok", "{}", "0" * 64, "a" * 64)
    second = AuditRow(2, time.time_ns(), "tracer.connect", "node:n1", "ok", '{"node": "n1"}', "a" * 64,
                      "b" * 64)
    assert committed(store, [Store.op_audit(row), Store.op_audit(second)]) is None
    assert committed(store, [Store.op_audit(row._replace(action="forged"))]) is None  # DO NOTHING
    assert store.read(select_audit()).result(TIMEOUT_S) == [row, second]
    assert store.read(select_audit(after_seq=1)).result(TIMEOUT_S) == [second]


def test_trace_sessions_and_records_are_stored_and_deleted_together(store: Store) -> None:
    ts = TraceStore(store, 1_000_000, 3600.0)
    session = TraceSession(id="t-1", scope=TraceScope(namespace="ml"), requested_by="uid 0 (claimed)",
                           started_unix_ns=time.time_ns(), deadline_unix_ns=time.time_ns() + 3600 * 10**9,
                           status=TraceStatus.RUNNING, max_records=100)
    ts.save(session)
    for first, n in ((1, 3), (4, 2)):
        records = [trace_record(seq=first + i, node="n1") for i in range(n)]
        ts.add("t-1", "n1", first, first + n - 1, n,
               trace_pb2.TraceBatch(session="t-1", records=records).SerializeToString())
    ts.audit("t-1", "start", "uid 0", "namespace ml")
    assert [r.seq for r in decode_records(ts.records("t-1").result(TIMEOUT_S))] == [1, 2, 3, 4, 5]
    assert [(e.session, e.action) for e in ts.audit_rows("t-1").result(TIMEOUT_S)] == [("t-1", "start")]
    again = TraceStore(store, 1_000_000, 3600.0)  # a collector starting on this store
    (loaded,) = again.load()
    assert loaded.id == "t-1" and loaded.status == TraceStatus.NODE_LOST and again.counts == {"t-1": 5}
    again.delete(["t-1"])
    assert again.records("t-1").result(TIMEOUT_S) == [] and again.load() == []


# ---- group commit --------------------------------------------------------------------------------


def test_done_runs_only_once_its_group_committed(url: str, store: Store) -> None:
    """Each callback of a group sees every row of the group from another connection: the Ack that a
    callback sends never covers an event that is not on disk."""
    pos = Position("n1", "boot-1", "inst-a")
    seen: list[tuple[int, int]] = []
    errors: list[BaseException | None] = []
    done = threading.Event()

    def check(error: BaseException | None) -> None:
        errors.append(error)
        seen.append((scalar(url, "SELECT COUNT(*) FROM events"),
                     scalar(url, "SELECT COUNT(*) FROM findings")))
        if len(errors) == 3:
            done.set()

    with one_group(store):
        store.submit([events_op(pos, 1, 5)], check)
        store.submit([Store.op_finding(finding_row(1))], check)
        store.submit([events_op(pos, 6, 9), Store.op_position(pos)], check, size_bytes=100)
        assert store.pending_bytes == 100
    assert done.wait(TIMEOUT_S)
    assert errors == [None, None, None] and seen == [(2, 1)] * 3
    assert store.pending_bytes == 0


def test_a_group_that_fails_commits_nothing_and_the_store_stays_failed(url: str, store: Store) -> None:
    pos = Position("n1", "boot-1", "inst-a")
    results: list[BaseException | None] = []
    done = threading.Event()

    def note(error: BaseException | None) -> None:
        results.append(error)
        if len(results) == 2:
            done.set()

    def broken(conn: Any) -> None:
        conn.execute("INSERT INTO no_such_table VALUES (1)")  # a bug, not a passing outage

    with one_group(store, commits=False):
        store.submit([events_op(pos, 1, 5)], note)
        store.submit([Store.op_call(broken)], note)
    assert done.wait(TIMEOUT_S)
    assert all(isinstance(e, StoreError) for e in results), results
    assert "no_such_table" in str(results[0]) and "\n" not in str(results[0])
    assert scalar(url, "SELECT COUNT(*) FROM events") == 0
    assert isinstance(committed(store, [events_op(pos, 6, 7)]), StoreError)  # sticky: nothing after it
    assert scalar(url, "SELECT COUNT(*) FROM events") == 0


# ---- leases and fencing --------------------------------------------------------------------------


@pytest.fixture
def second_replica(url: str) -> Iterator[Store]:
    """Another replica's store on the same database."""
    s = open_store(url, replica_id="r2")
    yield s
    s.close()


def test_a_stale_token_is_refused_while_the_current_one_commits_in_the_same_group(
        url: str, store: Store, second_replica: Store) -> None:
    mine, theirs = Leases(store, "r1", 10.0), Leases(second_replica, "r2", 10.0)
    mine.adopt(mine.take("n1").result(TIMEOUT_S))
    theirs.adopt(theirs.take("n1").result(TIMEOUT_S))  # the node's stream moved to r2
    stale, current = mine.fence("n1"), theirs.fence("n1")
    assert stale == ("n1", 1) and current == ("n1", 2)
    outcomes: dict[str, BaseException | None] = {}
    pos = Position("n1", "boot-1", "inst-a")
    with one_group(store):
        store.submit([events_op(pos, 1, 5)], lambda e: outcomes.__setitem__("stale", e), fence=stale)
        store.submit([events_op(pos, 6, 9)], lambda e: outcomes.__setitem__("current", e), fence=current)
        store.submit([Store.op_finding(finding_row(1))], lambda e: outcomes.__setitem__("unfenced", e))
        store.submit([events_op(Position("n9", "b", "i"), 1, 2)],
                     lambda e: outcomes.__setitem__("no-lease", e), fence=("n9", 1))
    lost = outcomes["stale"]
    assert isinstance(lost, LeaseLost) and (lost.node, lost.token, lost.current) == ("n1", 1, 2)
    assert "moved to another collector replica" in str(lost)
    assert outcomes["current"] is None and outcomes["unfenced"] is None
    gone = outcomes["no-lease"]
    assert isinstance(gone, LeaseLost) and gone.current is None
    assert rows(url, "SELECT node, first_seq FROM events ORDER BY id") == [("n1", 6)]
    assert scalar(url, "SELECT COUNT(*) FROM findings") == 1
    # The replica that lost the node: its next write is refused too, whatever it carries.
    assert isinstance(committed(second_replica, [Store.op_position(pos)], fence=stale), LeaseLost)


@pytest.mark.postgres
def test_no_lease_moves_under_a_fenced_group_in_flight(postgres_dsn: str) -> None:
    """PostgreSQL: the group's check of its token share-locks the lease row to its commit, so another
    replica's take waits for that commit; the group commits under the token it checked, and the
    replica's next write is refused."""
    url = postgres_dsn
    a, b = open_store(url, replica_id="ra"), open_store(url, replica_id="rb")
    try:
        mine, theirs = Leases(a, "ra", 10.0), Leases(b, "rb", 10.0)
        mine.adopt(mine.take("n1").result(TIMEOUT_S))
        inside, release = threading.Event(), threading.Event()

        def hold(conn: Any) -> None:  # the group's transaction stays open, its share lock held
            inside.set()
            release.wait(TIMEOUT_S)

        done: Future[BaseException | None] = Future()
        pos = Position("n1", "boot-1", "inst-a")
        a.submit([events_op(pos, 1, 5), Store.op_call(hold)], done.set_result, fence=mine.fence("n1"))
        assert inside.wait(TIMEOUT_S)
        taking = theirs.take("n1")
        waiting = ("SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = 'ghostgpu-collector rb' "
                   "AND wait_event_type = 'Lock'")
        try:
            wait_until(lambda: scalar(url, waiting) == 1, "rb's take waiting on the lease row's lock", 10.0)
            assert not taking.done()
        finally:
            release.set()
        assert done.result(TIMEOUT_S) is None  # committed under token 1, checked in its own transaction
        assert taking.result(TIMEOUT_S).token == 2
        assert isinstance(committed(a, [events_op(pos, 6, 9)], fence=mine.fence("n1")), LeaseLost)
        assert rows(url, "SELECT first_seq, last_seq FROM events") == [(1, 5)]
    finally:
        a.close()
        b.close()


def test_taking_a_lease_bumps_its_token_and_reads_what_the_node_committed(
        url: str, store: Store, second_replica: Store) -> None:
    r1, r2 = Leases(store, "r1", 10.0), Leases(second_replica, "r2", 10.0)
    first = r1.take("n1").result(TIMEOUT_S)
    assert (first.token, first.previous_owner, first.positions, first.open_findings) == (1, "", [], [])
    r1.adopt(first)
    pos = Position("n1", "boot-1", "inst-a", delivered_seq=42, ingested_total=42,
                   updated_unix_ns=time.time_ns())
    assert committed(store, [Store.op_position(pos), Store.op_finding(finding_row(7)),
                             Store.op_finding(finding_row(8, resolved_ns=time.time_ns()))],
                     fence=r1.fence("n1")) is None
    taken = r2.take("n1").result(TIMEOUT_S)
    assert (taken.token, taken.previous_owner) == (2, "r1")
    assert taken.positions == [pos] and [f.id for f in taken.open_findings] == [7]
    r2.adopt(taken)
    assert r2.steals_total == 1 and r2.owned_nodes() == ["n1"]
    assert r1.take("n1").result(TIMEOUT_S).token == 3  # a Hello takes it whoever held it
    assert rows(url, "SELECT owner, token FROM node_leases") == [("r1", 3)]


def test_renew_extends_the_leases_held_and_names_the_nodes_another_replica_took(
        url: str, store: Store, second_replica: Store) -> None:
    r1, r2 = Leases(store, "r1", 10.0), Leases(second_replica, "r2", 10.0)
    for node in ("n1", "n2"):
        r1.adopt(r1.take(node).result(TIMEOUT_S))
    expires_before = dict(rows(url, "SELECT node, expires_unix_ns FROM node_leases"))
    assert r1.renew().result(TIMEOUT_S) == []
    expires_after = dict(rows(url, "SELECT node, expires_unix_ns FROM node_leases"))
    assert all(expires_after[n] > expires_before[n] for n in ("n1", "n2"))
    assert not r1.overdue()
    r2.adopt(r2.take("n2").result(TIMEOUT_S))
    assert r1.renew().result(TIMEOUT_S) == ["n2"]
    assert r2.renew().result(TIMEOUT_S) == []
    # r1's renewal did not extend the lease r2 holds now
    assert rows(url, "SELECT owner FROM node_leases WHERE node = 'n2'") == [("r2",)]
    r1.drop("n2", token=1)
    assert r1.owned_nodes() == ["n1"]
    assert r1.overdue(time.monotonic() + 11.0)  # no renewal for a whole ttl


# ---- read_write ----------------------------------------------------------------------------------


def test_read_write_runs_in_a_transaction_of_its_own(url: str, store: Store) -> None:
    def insert(fid: int) -> Callable[[Any], int]:
        def run(conn: Any) -> int:
            conn.execute("INSERT INTO findings VALUES (?, 'n1', 'ml', 'hidden', 'k', 1, 0, ?)", (fid, b"c"))
            return int(conn.execute("SELECT COUNT(*) FROM findings").fetchone()[0])
        return run

    def insert_then_fail(conn: Any) -> None:
        insert(2)(conn)
        raise ValueError("the caller changed its mind")

    assert committed(store, [Store.op_finding(finding_row(9))]) is None
    assert store.read_write(insert(1)).result(TIMEOUT_S) == 2  # it sees the write queued before it
    assert scalar(url, "SELECT COUNT(*) FROM findings WHERE id = 1") == 1  # committed when it returned
    with pytest.raises(ValueError, match="changed its mind"):
        store.read_write(insert_then_fail).result(TIMEOUT_S)
    assert scalar(url, "SELECT COUNT(*) FROM findings WHERE id = 2") == 0  # rolled back
    assert committed(store, [Store.op_finding(finding_row(3))]) is None  # the store goes on
    assert sorted(r[0] for r in rows(url, "SELECT id FROM findings")) == [1, 3, 9]


# ---- retention -----------------------------------------------------------------------------------


def test_retention_forgets_old_resolved_findings_positions_and_answered_commands(url: str) -> None:
    now = time.time_ns()
    s = open_store(url, retention_days=1.0)
    old_pos = Position("gone", "b", "i", delivered_seq=3, updated_unix_ns=now - 2 * DAY_NS)
    new_pos = Position("here", "b", "i", delivered_seq=4, updated_unix_ns=now)
    assert committed(s, [
        Store.op_finding(finding_row(1, opened_ns=now - 3 * DAY_NS, resolved_ns=now - 2 * DAY_NS)),
        Store.op_finding(finding_row(2, opened_ns=now - 3 * DAY_NS, resolved_ns=now - 3600 * 10**9)),
        Store.op_finding(finding_row(3, opened_ns=now - 9 * DAY_NS)),  # open: kept however old
        Store.op_position(old_pos), Store.op_position(new_pos)]) is None
    with other_client(url) as conn:
        conn.executemany("INSERT INTO replica_commands (node, kind, body, from_replica, created_unix_ns, "
                         "answered_unix_ns, result) VALUES (?, 'cri', ?, 'r2', ?, ?, ?)",
                         [("n1", b"", now - 2 * 3600 * 10**9, now - 2 * 3600 * 10**9, b""),
                          ("n1", b"", now, 0, b"")])
    s.close()
    s = open_store(url, retention_days=1.0)  # a start prunes (and then every few minutes)
    try:
        assert sorted(r[0] for r in rows(url, "SELECT id FROM findings")) == [2, 3]
        assert [p.node for p in s.load_positions()] == ["here"]
        assert rows(url, "SELECT created_unix_ns FROM replica_commands") == [(now,)]
    finally:
        s.close()
