"""The remediation engine (collector/remediation.py) against a fake command sender and a real SQLite
store: decided → re-checked → acted → outcome with every step in a hash chain that verifies, dry-run
only proposing, never acting twice (a second engine over the same store, an act whose outcome never
came), the breaker tripping at K with its alert, pause and resume audited, min_age, the namespace
filter, a node that opted out, and Remediate's refusals."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.collector.audit import AuditLog, record_from_row, select_audit
from ghostgpu.collector.cluster import ClusterTable, FindingRec
from ghostgpu.collector.remediation import (
    FORWARD_DEADLINE_S,
    LABELS_TIMEOUT_S,
    RemediationError,
    RemediationTiming,
    Remediator,
)
from ghostgpu.collector.remediation_commands import RemediateCalls, no_answer
from ghostgpu.collector.remediation_policy import Breaker, RemediationPolicy
from ghostgpu.collector.remediation_store import (
    PAUSED,
    ActGuard,
    IncidentRow,
    get_incident,
    insert_incident,
    mark_acted,
    select_steps,
    select_tally,
    set_control,
)
from ghostgpu.collector.store import Store

from ghostgpu.common.audit.chain import verify
from ghostgpu.common.model.consumers import ClusterConsumer, Consumer, ConsumerClass, K8sInfo
from ghostgpu.common.model.remediation import (
    CAPABILITY,
    DONE,
    FAILED,
    MODE_DRY_RUN,
    MODE_ON,
    OPT_OUT_LABEL,
    PROPOSED,
    SKIPPED,
    incident_key,
)
from ghostgpu.v1 import stream_pb2

Answer = Callable[[stream_pb2.RemediateCommand], stream_pb2.RemediateResult]
POD_UID = "6d1f2a3b-0000-4000-8000-000000000001"


def passes(cmd: stream_pb2.RemediateCommand) -> stream_pb2.RemediateResult:
    """A tracer whose re-checks pass and whose kill works."""
    if cmd.dry_run:
        return stream_pb2.RemediateResult(incident=cmd.incident, outcome=PROPOSED,
                                          reason="every check passed")
    return stream_pb2.RemediateResult(incident=cmd.incident, outcome=DONE, reason="ended after SIGTERM",
                                      signals=["SIGTERM"], released=True)


class FakeCalls(RemediateCalls):
    def __init__(self, answer: Answer = passes) -> None:
        super().__init__({})
        self.answer_with = answer
        self.sent: list[tuple[str, stream_pb2.RemediateCommand]] = []

    async def call(self, node: str, command: stream_pb2.RemediateCommand,
                   timeout_s: float) -> stream_pb2.RemediateResult:
        copy = stream_pb2.RemediateCommand()
        copy.CopyFrom(command)
        self.sent.append((node, copy))
        return self.answer_with(copy)

    def kills(self) -> list[str]:
        return [c.incident for _, c in self.sent if not c.dry_run]


class FakeStream:
    def __init__(self, node: str, remediation: bool = True) -> None:
        self.node, self.active = node, True
        self.hello = stream_pb2.Hello(node=node, capabilities=["bpf", *([CAPABILITY] if remediation else [])])
        self.out: asyncio.Queue[Any] = asyncio.Queue()


class FakeAlerts:
    def __init__(self) -> None:
        self.notes: dict[int, str] = {}
        self.paused: list[str] = []

    def offer_remediation(self, finding_id: int, note: str) -> None:
        self.notes[finding_id] = note

    def set_remediation_paused(self, reason: str) -> None:
        self.paused.append(reason)


def orphan(fid: int, node: str = "n1", namespace: str = "ml", pid: int = 4242, age_s: float = 600.0,
           cls: str = "orphaned") -> FindingRec:
    c = Consumer(node=node, pid=pid, ns_pid=None, comm="python", gpu=0, gpu_uuid="GPU-0", gpu_minor=0,
                 devices=["/dev/nvidia0"], container_id="c0ffee", pod_uid=POD_UID, runtime="",
                 cls=ConsumerClass(cls), reason="CRI does not know this container", gpu_memory_bytes=None,
                 exe="/usr/bin/python3", start_time_ns=777)
    cc = ClusterConsumer(c, K8sInfo(resolution="not_found", namespace=namespace, pod="train-0"))
    return FindingRec(fid, node, (pid, 0, "GPU-0"), cls, time.time_ns() - int(age_s * 1e9), cc)


class Env:
    """A store, an audit chain, a cluster table holding the given findings, streams, and engines."""

    def __init__(self, tmp_path: Path) -> None:
        self.db_path = tmp_path / "c.db"
        self.store = Store(str(self.db_path), event_log_max=1000, retention_days=7)
        self.audit = AuditLog(None, self.store)
        self.cluster = ClusterTable({}, None, self.store)
        self.streams: dict[str, Any] = {}
        self.policy = RemediationPolicy(mode=MODE_ON, grace_s=1.0)
        self.alerts = FakeAlerts()

    def add(self, *recs: FindingRec, remediation: bool = True) -> None:
        for rec in recs:
            self.cluster.open.setdefault(rec.node, {})[rec.key] = rec
            self.streams.setdefault(rec.node, FakeStream(rec.node, remediation))

    def engine(self, calls: FakeCalls, replica: str = "collector") -> Remediator:
        return Remediator(self.store, self.cluster, self.streams, policy=lambda: self.policy,
                          audit=self.audit.append, replica_id=replica, calls=calls, alerts=self.alerts)

    def incident(self, fid: int) -> IncidentRow | None:
        return self.store.read(get_incident(incident_key(fid, "kill_orphan"))).result(10)

    def steps(self, fid: int) -> list[str]:
        return [s[2] for s in self.store.read(select_steps(fid)).result(10)]

    def audit_actions(self) -> list[str]:
        return [r.action for r in self.store.read(select_audit()).result(10)]

    def committed_audit_actions(self) -> list[str]:
        """The audit actions committed now, read through a connection of its own: unlike store.read(), it
        does not wait for the writes still queued."""
        conn = sqlite3.connect(self.db_path)
        try:
            return [str(r[0]) for r in conn.execute("SELECT action FROM audit ORDER BY seq").fetchall()]
        finally:
            conn.close()

    def chain_ok(self) -> bool:
        records = [record_from_row(r) for r in self.store.read(select_audit()).result(10)]
        return verify(records, from_start=True).ok


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    e = Env(tmp_path)
    yield e
    e.store.close()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def tick(engine: Remediator) -> None:
    await engine.tick()
    await engine.idle()


def test_mode_on_goes_decided_rechecked_acted_outcome_and_the_chain_verifies(env: Env) -> None:
    env.add(orphan(7))
    calls = FakeCalls()
    run(tick(env.engine(calls)))
    assert [c.dry_run for _, c in calls.sent] == [True, False]  # the re-check, then the act
    cmd = calls.sent[1][1]
    assert (cmd.process.pid, cmd.process.start_time_ns, cmd.process.exe) == (4242, 777, "/usr/bin/python3")
    assert cmd.container_id == "c0ffee" and list(cmd.devices) == ["/dev/nvidia0"] and cmd.grace_ms == 1000
    assert cmd.process.pod_uid == POD_UID  # the tracer corroborates the pod with CRI
    row = env.incident(7)
    assert row is not None and row.state == DONE and row.acted_unix_ns > 0 and row.mode == MODE_ON
    assert env.steps(7) == ["decided", "re-checked", "acted", "outcome"]
    assert env.audit_actions() == ["remediation.decided", "remediation.re-checked", "remediation.acted",
                                   "remediation.outcome"]
    assert row.audit_seq == 4  # the outcome's record
    assert env.chain_ok()
    assert env.alerts.notes[7].startswith("done:")


def test_dry_run_only_proposes_and_annotates_the_alert(env: Env) -> None:
    env.policy = replace(env.policy, mode=MODE_DRY_RUN)
    env.add(orphan(7))
    calls = FakeCalls()
    engine = env.engine(calls)
    run(tick(engine))
    assert calls.kills() == [] and len(calls.sent) == 1
    row = env.incident(7)
    assert row is not None and row.state == PROPOSED and row.acted_unix_ns == 0
    assert env.steps(7) == ["decided", "re-checked"]
    assert env.alerts.notes[7].startswith("dry-run: would SIGTERM pid 4242 (python), SIGKILL after 1 s")
    run(tick(engine))  # proposed once: not re-checked at every tick
    assert len(calls.sent) == 1
    # The mode turns on: the same incident is acted on, under the same key.
    env.policy = replace(env.policy, mode=MODE_ON)
    run(tick(engine))
    assert calls.kills() == [incident_key(7, "kill_orphan")]
    row = env.incident(7)
    assert row is not None and row.state == DONE
    assert env.chain_ok()


def test_a_second_engine_over_the_same_store_never_acts_again(env: Env) -> None:
    env.add(orphan(7))
    first = FakeCalls()
    run(tick(env.engine(first, "collector-0")))
    assert len(first.kills()) == 1
    second = FakeCalls()  # after a failover: another replica, the finding still open in its memory
    run(tick(env.engine(second, "collector-1")))
    assert second.sent == []


def _acted_row(env: Env, fid: int, acted_ago_s: float, action: str = "kill_orphan") -> None:
    """An act committed by a replica that died before the outcome."""
    now = time.time_ns()
    acted = now - int(acted_ago_s * 1e9)
    detail = ('{"pid": 4242, "comm": "python", "exe": "/usr/bin/python3", "start_time_ns": 777, '
              f'"container_id": "c0ffee", "pod_uid": "{POD_UID}", "devices": ["/dev/nvidia0"]}}')
    assert env.store.read_write(insert_incident(IncidentRow(
        incident_key(fid, action), fid, "n1", "ml", action, PROPOSED, MODE_ON, "kill", acted, acted, acted,
        "collector-0", 0, detail))).result(10)


def settled_by(exited: bool, outcome: str, reason: str) -> Answer:
    def answer(cmd: stream_pb2.RemediateCommand) -> stream_pb2.RemediateResult:
        return stream_pb2.RemediateResult(incident=cmd.incident, outcome=outcome, reason=reason,
                                          exited=exited)
    return answer


@pytest.mark.parametrize(("answer", "state", "said"), [
    (settled_by(False, PROPOSED, "every check passed"), FAILED, "the process is still there"),
    (settled_by(True, SKIPPED, "process 4242 exited"), DONE, "settled after the replica"),
    # "cannot confirm with CRI" is no proof the process is gone: failed, naming what was seen
    (settled_by(False, SKIPPED, "cannot confirm with CRI"), FAILED, "skipped: cannot confirm with CRI"),
])
def test_an_act_without_outcome_is_settled_by_a_recheck_never_sent_twice(env: Env, answer: Answer, state: str,
                                                                          said: str) -> None:
    env.add(orphan(7))
    _acted_row(env, 7, acted_ago_s=120.0)
    calls = FakeCalls(answer)
    run(tick(env.engine(calls, "collector-1")))
    assert calls.kills() == [] and [c.dry_run for _, c in calls.sent] == [True]
    assert calls.sent[0][1].process.pod_uid == POD_UID
    row = env.incident(7)
    assert row is not None and row.state == state and said in row.reason and "not signalled twice" in (
        row.reason if state == FAILED else "not signalled twice")


def test_an_act_is_not_settled_while_the_tracer_may_still_be_on_it_nor_an_isolation(env: Env) -> None:
    """Settled only past grace + SIGKILL's wait + CRI's timeout + the margin; an isolation incident is
    never settled by the kill engine (no pid-0 command)."""
    env.add(orphan(7), orphan(8, pid=8))
    _acted_row(env, 7, acted_ago_s=2.0)
    _acted_row(env, 8, acted_ago_s=600.0, action="isolate_node")
    calls = FakeCalls()
    env.policy = replace(env.policy, kill_orphans=False)
    run(tick(env.engine(calls)))
    assert calls.sent == []
    assert env.incident(7) is not None and env.incident(7).state == PROPOSED  # type: ignore[union-attr]


def test_the_breaker_trips_at_k_and_the_paused_alert_fires(env: Env) -> None:
    env.policy = replace(env.policy, breaker=Breaker(max_actions=2, window_s=3600, max_per_node=5))
    env.add(orphan(1, node="n1", pid=1), orphan(2, node="n2", pid=2), orphan(3, node="n3", pid=3))
    calls = FakeCalls()
    engine = env.engine(calls)
    run(tick(engine))  # three candidates in one tick: two acts, the third only proposed
    run(tick(engine))  # the next tick reads two acts in the window: the breaker is open
    assert len(calls.kills()) == 2
    third = [env.incident(i) for i in (1, 2, 3)]
    assert [r.state for r in third if r] == [DONE, DONE, PROPOSED]
    assert third[2] is not None and "breaker open" in third[2].reason
    assert env.alerts.paused and "breaker open: 2 acts" in env.alerts.paused[-1]
    assert engine.view.to_proto().breaker_open


def test_per_node_breaker(env: Env) -> None:
    env.policy = replace(env.policy, breaker=Breaker(max_actions=10, window_s=3600, max_per_node=1))
    env.add(orphan(1, pid=1))
    calls = FakeCalls()
    engine = env.engine(calls)
    run(tick(engine))
    env.add(orphan(2, pid=2))
    run(tick(engine))
    assert len(calls.kills()) == 1
    row = env.incident(2)
    assert row is not None and row.state == PROPOSED and "1 acts on node n1" in row.reason


def test_pause_and_resume_are_audited_and_pause_refuses_a_manual_kill(env: Env) -> None:
    env.add(orphan(7))
    calls = FakeCalls()
    engine = env.engine(calls)

    async def scenario() -> None:
        view = await engine.control("pause", who="user:oncall", reason="maintenance")
        assert view.paused and view.paused_by == "user:oncall"
        with pytest.raises(RemediationError) as e:
            await engine.remediate(7, dry_run=False, who="user:oncall")
        assert e.value.code == "FAILED_PRECONDITION"
        assert "paused by user:oncall (maintenance)" in e.value.line
        assert "ghostgpu remediate resume" in e.value.line
        await tick(engine)  # paused: the tick only proposes
        assert calls.kills() == []
        view = await engine.control("resume", who="user:oncall")
        assert not view.paused
        await tick(engine)

    run(scenario())
    assert len(calls.kills()) == 1
    actions = env.audit_actions()
    assert actions[0] == "remediation.pause" and "remediation.resume" in actions
    assert "paused (by user:oncall: maintenance)" in env.alerts.paused[0] and env.alerts.paused[-1] == ""
    assert env.chain_ok()


def test_mode_override_wins_over_the_config_and_clears(env: Env) -> None:
    env.policy = replace(env.policy, mode="off")
    env.add(orphan(7))
    calls = FakeCalls()
    engine = env.engine(calls)

    async def scenario() -> None:
        await tick(engine)
        assert calls.sent == []
        view = await engine.control("mode", who="user:oncall", mode=MODE_DRY_RUN)
        assert (view.mode, view.config_mode, view.override_mode) == (MODE_DRY_RUN, "off", MODE_DRY_RUN)
        await tick(engine)
        assert len(calls.sent) == 1 and calls.kills() == []
        view = await engine.control("mode", who="user:oncall", mode="")
        assert view.mode == "off" and view.override_mode == ""
        with pytest.raises(RemediationError):
            await engine.control("mode", who="user:oncall", mode="yes")

    run(scenario())


def test_min_age_namespace_and_allowlist_keep_findings_out(env: Env) -> None:
    env.policy = replace(env.policy, allowlist=("*/dcgm*",))
    young = orphan(1, pid=1, age_s=10)
    system = orphan(2, pid=2, namespace="kube-system")
    allowed = orphan(3, pid=3)
    allowed.consumer = replace(allowed.consumer, consumer=replace(allowed.consumer.consumer,
                                                                   exe="/usr/bin/dcgm-exporter"))
    env.add(young, system, allowed)
    calls = FakeCalls()
    engine = env.engine(calls)
    run(tick(engine))
    assert calls.sent == []
    # By hand, min_age does not apply (the re-checks do).
    state, _ = run(engine.remediate(1, dry_run=False, who="user:oncall"))
    assert state.state == DONE and state.mode == "manual"
    assert calls.kills() == [incident_key(1, "kill_orphan")]
    records = env.store.read(select_audit()).result(10)
    assert {r.subject for r in records} == {"user:oncall"}


def test_a_node_that_opted_out_is_skipped(env: Env) -> None:
    env.add(orphan(7), remediation=False)
    calls = FakeCalls()
    run(tick(env.engine(calls)))
    assert calls.sent == []
    row = env.incident(7)
    assert row is not None and row.state == SKIPPED and "node n1 opted out" in row.reason


def test_a_failed_recheck_ends_the_incident_without_an_act(env: Env) -> None:
    env.add(orphan(7))

    def reused(cmd: stream_pb2.RemediateCommand) -> stream_pb2.RemediateResult:
        return stream_pb2.RemediateResult(incident=cmd.incident, outcome=SKIPPED,
                                          reason="pid 4242 was reused: start time 900, not 777")

    calls = FakeCalls(reused)
    run(tick(env.engine(calls)))
    assert calls.kills() == []
    row = env.incident(7)
    assert row is not None and row.state == SKIPPED and "reused" in row.reason
    assert env.steps(7) == ["decided", "re-checked"]


def test_a_transient_failure_ends_the_incident_skipped_and_a_person_retries_it_by_hand(env: Env) -> None:
    env.add(orphan(7))
    answers = iter([stream_pb2.RemediateResult(outcome=SKIPPED, reason="cannot confirm with CRI: deadline")])

    def flaky(cmd: stream_pb2.RemediateCommand) -> stream_pb2.RemediateResult:
        first = next(answers, None)
        return first if first is not None else passes(cmd)

    calls = FakeCalls(flaky)
    engine = env.engine(calls)
    run(tick(engine))
    run(tick(engine))  # the engine does not try it again by itself
    row = env.incident(7)
    assert row is not None and row.state == SKIPPED and len(calls.sent) == 1
    state, _ = run(engine.remediate(7, dry_run=False, who="user:oncall"))
    assert state.state == DONE and calls.kills() == [incident_key(7, "kill_orphan")]
    again, detail = run(engine.remediate(7, dry_run=False, who="user:oncall"))
    assert again.state == DONE and "already remediated" in detail and len(calls.kills()) == 1


def test_remediate_refusals(env: Env) -> None:
    env.add(orphan(7, cls="hidden"))
    engine = env.engine(FakeCalls())

    async def refused(fid: int) -> RemediationError:
        with pytest.raises(RemediationError) as e:
            await engine.remediate(fid, dry_run=True, who="user:oncall")
        return e.value

    hidden = run(refused(7))
    assert hidden.code == "FAILED_PRECONDITION"
    assert hidden.line == "finding 7 is hidden, not orphaned: only orphaned holders are killed"
    missing = run(refused(99))
    assert missing.code == "NOT_FOUND" and "no finding 99" in missing.line


def test_manual_dry_run_reports_and_leaves_it_proposed(env: Env) -> None:
    env.add(orphan(7))
    calls = FakeCalls()
    state, detail = run(env.engine(calls).remediate(7, dry_run=True, who="user:oncall"))
    assert state.state == PROPOSED and state.reason.startswith("dry-run: would SIGTERM pid 4242")
    assert calls.kills() == [] and detail == "every check passed"


def test_an_unkillable_holder_isolates_its_node_and_files_a_ticket(env: Env) -> None:
    env.policy = replace(env.policy, isolate_node=True,
                         ticket=replace(env.policy.ticket, url="http://127.0.0.1:1/tickets"))
    env.add(orphan(7))

    def stuck(cmd: stream_pb2.RemediateCommand) -> stream_pb2.RemediateResult:
        if cmd.dry_run:
            return passes(cmd)
        return stream_pb2.RemediateResult(incident=cmd.incident, outcome="unkillable", proc_state="D",
                                          reason="alive after SIGKILL, in the driver", wchan="nv_wait",
                                          stack="[<0>] nv_wait+0x10", signals=["SIGTERM", "SIGKILL"])

    isolated: list[tuple[Any, ...]] = []
    tickets: list[dict[str, object]] = []

    async def isolate(*args: Any, **kw: Any) -> None:
        isolated.append((*args, kw))

    engine = Remediator(env.store, env.cluster, env.streams, policy=lambda: env.policy,
                        audit=env.audit.append, calls=FakeCalls(stuck), isolate=isolate,
                        ticket=tickets.append)
    run(tick(engine))
    row = env.incident(7)
    assert row is not None and row.state == "unkillable"
    assert isolated == [("n1", "unkillable", "alive after SIGKILL, in the driver", "f7/kill_orphan",
                         {"pods": [("ml", "train-0")]})]
    (ticket,) = tickets
    assert ticket["incident"] == "f7/kill_orphan" and ticket["audit_seq"] == row.audit_seq
    evidence = ticket["evidence"]
    assert isinstance(evidence, dict) and evidence["wchan"] == "nv_wait" and evidence["proc_state"] == "D"
    assert ticket["node"] == "n1"
    # its history, each step as stored: decided, re-checked, acted (proposed), then unkillable
    actions = ticket["actions"]
    assert isinstance(actions, list) and [x["state"] for x in actions] == [PROPOSED] * 3 + ["unkillable"]
    assert actions[-1]["reason"] == "alive after SIGKILL, in the driver"
    assert ticket["pods"] == [{"namespace": "ml", "pod": "train-0", "container": ""}]


def test_the_alert_book_annotates_a_finding_and_fires_the_paused_alert() -> None:
    from ghostgpu.collector.alertbook import PAUSED_ALERT, AlertBook

    from ghostgpu.v1 import query_pb2

    book = AlertBook(["am"], {}, resend_s=60.0, resolved_keep_s=60.0, settle_s=0.0)
    f = orphan(7).to_proto()
    book.apply([query_pb2.FindingEvent(kind=query_pb2.FindingEvent.KIND_OPENED, finding=f)], 0.0)
    book.taken("am", [(k, v) for k, v, _ in book.due("am", 0.0, 100)[0]], 0.0)
    assert book.apply_notes({7: "dry-run: would SIGTERM pid 4242 (python)"})
    (due,) = book.due("am", 1.0, 100)[0]
    annotations = due[2]["annotations"]
    assert isinstance(annotations, dict) and annotations["remediation"].startswith("dry-run: would SIGTERM")
    assert book.set_paused("paused by user:oncall", 1.0)
    def paused(now: float) -> list[dict[str, object]]:
        return [b for _, _, b in book.due("am", now, 100)[0] if b["labels"] == {
            "alertname": PAUSED_ALERT, "severity": "warning", "source": "ghostgpu-collector"}]

    firing = paused(2.0)
    assert len(firing) == 1 and "endsAt" not in firing[0]
    assert book.set_paused("", 3.0)
    resolved = paused(3.0)
    assert len(resolved) == 1 and "endsAt" in resolved[0]
    assert not book.set_paused("", 4.0)  # resolved already: nothing to send


def test_a_reloaded_section_is_audited(env: Env) -> None:
    engine = env.engine(FakeCalls())
    engine.config_changed(env.policy, replace(env.policy, mode=MODE_DRY_RUN))
    engine.config_refused("--config c.yaml: remediation.mode: 'yes': ...; the old policy stays in force")
    records = env.store.read(select_audit()).result(10)
    assert [(r.action, r.result) for r in records] == [("remediation.config", "ok"),
                                                       ("remediation.config", "refused")]
    assert "mode: on -> dry-run" in records[0].detail


def test_remediate_on_a_replica_that_does_not_serve_the_node_runs_where_it_is_served(env: Env) -> None:
    from types import SimpleNamespace

    from ghostgpu.collector.remediation import replica_forward, replica_handler
    from ghostgpu.collector.replica_commands import ReplicaCommandError

    rec = orphan(7)
    env.add(rec)
    env.store.submit([Store.op_finding(rec.row())])
    serving_calls = FakeCalls()
    serving = env.engine(serving_calls, "collector-1")
    handler = replica_handler(serving)

    class Replica:  # ReplicaCommands.send as the caller sees it: the row run there, its error line back
        async def send(self, node: str, kind: str, payload: bytes, deadline_s: float,
                       meta: dict[str, str]) -> bytes:
            try:
                return await handler(SimpleNamespace(node=node, payload=payload, meta=meta))
            except ReplicaCommandError as e:
                raise ReplicaCommandError(e.line) from None

    calling = Remediator(env.store, ClusterTable({}, None, env.store), {}, policy=lambda: env.policy,
                         audit=env.audit.append, replica_id="collector-0", applies=lambda node: False,
                         calls=FakeCalls(), forward=replica_forward(Replica()))
    state, _ = run(calling.remediate(7, dry_run=False, who="user:oncall"))
    assert (state.state, state.mode) == (DONE, "manual")
    assert serving_calls.kills() == ["f7/kill_orphan"]
    assert {r.subject for r in env.store.read(select_audit()).result(10)} == {"user:oncall"}
    env.cluster.open.clear()  # the serving replica no longer holds it open: its refusal comes back
    with pytest.raises(RemediationError) as e:
        run(calling.remediate(7, dry_run=True, who="user:oncall"))
    assert e.value.code == "FAILED_PRECONDITION" and "collector-1" in e.value.line


# ---- the guards at the moment of acting ---------------------------------------------------------------


def test_a_pause_or_a_reload_to_off_during_the_recheck_stops_the_act(env: Env) -> None:
    """The pause row, the override and the config's mode are read again in the act's transaction."""
    env.add(orphan(7), orphan(8, node="n2", pid=8))

    def pause_then_pass(cmd: stream_pb2.RemediateCommand) -> stream_pb2.RemediateResult:
        if cmd.dry_run and cmd.incident == incident_key(7, "kill_orphan"):
            env.store.read_write(set_control(PAUSED, "maintenance", "user:oncall", time.time_ns())).result(10)
        return passes(cmd)

    calls = FakeCalls(pause_then_pass)
    run(tick(env.engine(calls)))
    assert calls.kills() == []
    for fid in (7, 8):
        row = env.incident(fid)
        assert row is not None and row.state == PROPOSED and row.acted_unix_ns == 0 and "paused" in row.reason

    env.store.read_write(set_control(PAUSED, None, "user:oncall", time.time_ns())).result(10)

    def reload_off(cmd: stream_pb2.RemediateCommand) -> stream_pb2.RemediateResult:
        if cmd.dry_run:
            env.policy = replace(env.policy, mode="off")
        return passes(cmd)

    calls = FakeCalls(reload_off)
    run(tick(env.engine(calls)))
    assert calls.kills() == []
    row = env.incident(7)
    assert row is not None and row.acted_unix_ns == 0 and "mode off (config file)" in row.reason


def test_two_engines_over_one_store_share_the_breaker(env: Env) -> None:
    """max_actions 2, four nodes, two replicas each serving two: two acts in all, not four."""
    env.policy = replace(env.policy, breaker=Breaker(max_actions=2, window_s=3600, max_per_node=5))
    env.add(*(orphan(i, node=f"n{i}", pid=i) for i in (1, 2, 3, 4)))
    calls = FakeCalls()
    a = Remediator(env.store, env.cluster, env.streams, policy=lambda: env.policy, audit=env.audit.append,
                   replica_id="a", calls=calls, applies=lambda n: n in ("n1", "n2"))
    b = Remediator(env.store, env.cluster, env.streams, policy=lambda: env.policy, audit=env.audit.append,
                   replica_id="b", calls=calls, applies=lambda n: n in ("n3", "n4"))

    async def both() -> None:
        await asyncio.gather(a.tick(), b.tick())
        await asyncio.gather(a.idle(), b.idle())

    run(both())
    assert len(calls.kills()) == 2
    rows = [env.incident(i) for i in (1, 2, 3, 4)]
    refused = [r for r in rows if r is not None and r.acted_unix_ns == 0]
    assert len(refused) == 2 and all(r.state == PROPOSED and "breaker open" in r.reason for r in refused)


def test_the_acted_record_is_in_the_chain_before_the_kill_is_sent(env: Env) -> None:
    seen: list[list[str]] = []

    def check(cmd: stream_pb2.RemediateCommand) -> stream_pb2.RemediateResult:
        if not cmd.dry_run:
            seen.append(env.committed_audit_actions())
        return passes(cmd)

    env.add(orphan(7))
    run(tick(env.engine(FakeCalls(check))))
    assert seen and seen[0][-1] == "remediation.acted"


def test_the_opt_out_label_is_read_at_decided_and_again_before_the_act(env: Env) -> None:
    labels: dict[str, dict[str, str] | None] = {"n1": {OPT_OUT_LABEL: "off"}, "n2": None}

    async def read(node: str) -> dict[str, str] | None:
        return labels.get(node)

    env.add(orphan(7), orphan(8, node="n2", pid=8), orphan(9, node="n3", pid=9))

    def flip(cmd: stream_pb2.RemediateCommand) -> stream_pb2.RemediateResult:
        if cmd.dry_run and cmd.incident == incident_key(9, "kill_orphan"):
            labels["n3"] = {OPT_OUT_LABEL: "off"}  # labelled while the re-check ran
        return passes(cmd)

    calls = FakeCalls(flip)
    engine = Remediator(env.store, env.cluster, env.streams, policy=lambda: env.policy,
                        audit=env.audit.append, calls=calls, labels=read)
    run(tick(engine))
    # n1: labelled off at decided; n2: labels unknown (no API): not opted out; n3: off before the act
    assert calls.kills() == [incident_key(8, "kill_orphan")]
    for fid in (7, 9):
        row = env.incident(fid)
        assert row is not None and row.state == SKIPPED and f"label {OPT_OUT_LABEL}=off" in row.reason
    assert [c.incident for _, c in calls.sent].count(incident_key(7, "kill_orphan")) == 0


def test_a_manual_kill_is_refused_while_the_mode_asked_for_is_off(env: Env) -> None:
    env.policy = replace(env.policy, mode="off")
    env.add(orphan(7))
    calls = FakeCalls()
    engine = env.engine(calls)
    with pytest.raises(RemediationError, match=r"remediation is off: set remediation\.mode"):
        run(engine.remediate(7, dry_run=False, who="user:oncall"))
    state, _ = run(engine.remediate(7, dry_run=True, who="user:oncall"))
    assert state.state == PROPOSED and calls.kills() == []


def test_one_act_in_flight_per_node_and_every_act_carries_its_start_deadline(env: Env) -> None:
    """Two orphans on one node: the second is not started while the first's act is in flight (it would
    queue behind that act's grace on the tracer); the act's deadline_ms and the wait for its answer."""
    env.add(orphan(1, pid=1), orphan(2, pid=2))
    gate = asyncio.Event()

    class Slow(FakeCalls):
        async def call(self, node: str, command: stream_pb2.RemediateCommand,
                       timeout_s: float) -> stream_pb2.RemediateResult:
            if not command.dry_run:
                self.timeouts.append(timeout_s)
                await gate.wait()
            return await super().call(node, command, timeout_s)

    calls = Slow()
    calls.timeouts = []  # type: ignore[attr-defined]
    engine = env.engine(calls)

    async def go() -> None:
        await engine.tick()
        for _ in range(50):
            await asyncio.sleep(0)  # let the first incident reach its act (no time passes)
        await engine.tick()  # the act is in flight: the second orphan's node is busy
        started = {c.incident for _, c in calls.sent}
        assert incident_key(2, "kill_orphan") not in started
        gate.set()
        await engine.idle()
        await engine.tick()
        await engine.idle()

    run(go())
    assert calls.kills() == [incident_key(1, "kill_orphan"), incident_key(2, "kill_orphan")]
    acts = [c for _, c in calls.sent if not c.dry_run]
    t = RemediationTiming()
    assert all(c.deadline_ms == int(t.act_start_s * 1000) for c in acts)
    assert all(c.deadline_ms == int(t.recheck_timeout_s * 1000) for _, c in calls.sent if c.dry_run)
    assert calls.timeouts[0] == t.act_wait_s(1.0) >= 1.0 + 2 * 5.0 + 5.0  # type: ignore[attr-defined]


@pytest.mark.parametrize("how", ["no stream", "tracer did not start it"])
def test_an_act_never_started_gives_its_claim_back_and_can_be_tried_again(env: Env, how: str) -> None:
    env.add(orphan(7))

    def not_started(cmd: stream_pb2.RemediateCommand) -> stream_pb2.RemediateResult:
        if cmd.dry_run:
            return passes(cmd)
        if how == "no stream":
            del env.streams["n1"]  # gone before the act: RemediateCalls answers it not sent
            return no_answer(cmd.incident, "node n1's tracer is not connected", not_sent=True)
        return stream_pb2.RemediateResult(incident=cmd.incident, outcome=SKIPPED, not_started=True,
                                          reason="arrived after its deadline (5000 ms); nothing signalled")

    calls = FakeCalls(not_started)
    engine = env.engine(calls)
    run(tick(engine))
    row = env.incident(7)
    assert row is not None and row.acted_unix_ns == 0 and row.state == PROPOSED
    assert row.reason.startswith("not sent: ")
    assert env.audit_actions()[-1] == "remediation.outcome" and env.chain_ok()
    env.add(orphan(7))  # its tracer is back
    calls.answer_with = passes
    state, _ = run(engine.remediate(7, dry_run=False, who="user:oncall"))
    assert state.state == DONE and calls.kills() == [incident_key(7, "kill_orphan")] * 2


def test_no_stream_is_answered_not_started() -> None:
    async def go() -> stream_pb2.RemediateResult:
        command = stream_pb2.RemediateCommand(incident="f1/kill_orphan")
        return await RemediateCalls({}).call("n1", command, 1.0)

    result = run(go())
    assert result.not_started and result.outcome == ""


class FreshLabels:
    """A stand-in for collector/kube_api.py's NodeLabels: a cached read and a fresh one."""

    def __init__(self) -> None:
        self.cached: dict[str, str] | None = None
        self.now: tuple[dict[str, str] | None, str] = (None, "")
        self.fresh_reads = 0

    async def labels(self, node: str) -> dict[str, str] | None:
        return self.cached

    async def labels_now(self, node: str) -> tuple[dict[str, str] | None, str]:
        self.fresh_reads += 1
        return self.now


@pytest.mark.parametrize(("now", "state", "said"), [
    (({OPT_OUT_LABEL: "off"}, ""), SKIPPED, f"label {OPT_OUT_LABEL}=off"),
    ((None, "GET /api/v1/nodes/n1: connection refused"), PROPOSED,
     "node labels could not be read: GET /api/v1/nodes/n1: connection refused"),
])
def test_the_labels_are_read_fresh_right_before_the_act(env: Env, now: Any, state: str, said: str) -> None:
    """The cache says nothing (not opted out); the fresh GET right before the act says off, or fails
    with the API configured: no kill either way; a failed read leaves it proposed, audited."""
    seam = FreshLabels()
    seam.now = now
    env.add(orphan(7))
    calls = FakeCalls()
    engine = Remediator(env.store, env.cluster, env.streams, policy=lambda: env.policy,
                        audit=env.audit.append, calls=calls, labels=seam.labels,
                        labels_now=seam.labels_now)
    run(tick(engine))
    assert calls.kills() == [] and seam.fresh_reads == 1
    row = env.incident(7)
    assert row is not None and row.state == state and said in row.reason and row.acted_unix_ns == 0
    assert env.audit_actions()[-1] == "remediation.outcome"
    records = len(env.audit_actions())
    run(tick(engine))  # held back: not re-checked (nor audited) again at the next tick
    assert len(env.audit_actions()) == records and seam.fresh_reads == 1


def test_a_refusal_at_the_moment_of_acting_is_audited(env: Env) -> None:
    env.add(orphan(7), orphan(8, node="n2", pid=8))

    def pause_or_stop(cmd: stream_pb2.RemediateCommand) -> stream_pb2.RemediateResult:
        if cmd.dry_run and cmd.incident == incident_key(7, "kill_orphan"):
            env.store.read_write(set_control(PAUSED, "maintenance", "user:oncall", time.time_ns())).result(10)
        return passes(cmd)

    run(tick(env.engine(FakeCalls(pause_or_stop))))
    records = [record_from_row(r) for r in env.store.read(select_audit()).result(10)]
    outcomes = [r for r in records if r.action == "remediation.outcome"]
    assert len(outcomes) == 2 and all(r.result == PROPOSED and "paused" in str(r.detail) for r in outcomes)

    env.store.read_write(set_control(PAUSED, None, "user:oncall", time.time_ns())).result(10)
    env.add(orphan(9, node="n3", pid=9))

    def stop_kills(cmd: stream_pb2.RemediateCommand) -> stream_pb2.RemediateResult:
        if cmd.dry_run:
            env.policy = replace(env.policy, kill_orphans=False)
        return passes(cmd)

    run(tick(env.engine(FakeCalls(stop_kills))))
    last = record_from_row(env.store.read(select_audit()).result(10)[-1])
    assert last.action == "remediation.outcome" and "kill_orphans is false" in str(last.detail)


def test_settling_waits_for_the_grace_the_act_was_sent_with(env: Env) -> None:
    """The act's grace is kept in its row: a reload to a shorter grace does not settle it early."""
    env.policy = replace(env.policy, grace_s=60.0)
    env.add(orphan(7))
    key = incident_key(7, "kill_orphan")
    now = time.time_ns()
    env.store.read_write(insert_incident(IncidentRow(key, 7, "n1", "ml", "kill_orphan", PROPOSED, MODE_ON,
                                                     "x", now, now, 0, "a", 0, "{}"))).result(10)
    acted_ns = now - int(40 * 1e9)  # 40 s ago: past 1 s + the other waits, not past 60 s + them
    assert env.store.read_write(mark_acted(key, acted_ns, grace_ms=60_000)).result(10)
    row = env.incident(7)
    assert row is not None and row.details()["grace_ms"] == 60_000
    env.policy = replace(env.policy, grace_s=1.0, kill_orphans=False)
    calls = FakeCalls()
    run(tick(env.engine(calls)))
    assert calls.sent == []


def test_the_forward_deadline_covers_the_worst_case() -> None:
    t = RemediationTiming()
    # two label reads, the re-check, the act's start deadline, two CRI calls, the longest grace, SIGKILL's
    # wait, the margin
    worst_s = 2 * LABELS_TIMEOUT_S + t.recheck_timeout_s + t.act_start_s + 2 * 5.0 + 60.0 + 5.0 + 15.0
    assert worst_s <= FORWARD_DEADLINE_S


def test_the_per_node_budget_counts_each_action_apart(env: Env) -> None:
    """max_per_node 1: the kill that found an unkillable holder does not use up its node isolation's
    budget; a second kill on the node is refused; max_actions counts both."""
    now = time.time_ns()
    for fid, action in ((1, "kill_orphan"), (2, "isolate_node"), (3, "kill_orphan")):
        row = IncidentRow(f"f{fid}/{action}", fid, "n1", "ml", action, PROPOSED, MODE_ON, "x", now, now, 0,
                          "a", 0, "{}")
        env.store.read_write(insert_incident(row)).result(10)

    def guard(max_actions: int) -> ActGuard:
        return ActGuard("n1", now - int(3600e9), max_actions=max_actions, max_per_node=1, config_mode=MODE_ON)

    assert env.store.read_write(mark_acted("f1/kill_orphan", now, guard(10))).result(10)
    assert env.store.read_write(mark_acted("f2/isolate_node", now, guard(10))).result(10)
    third = env.store.read_write(mark_acted("f3/kill_orphan", now, guard(10))).result(10)
    assert not third and "1 acts on node n1" in third.refused
    tally = env.store.read(select_tally(now - int(3600e9), [])).result(10)
    assert tally.acts_in_window == 2 and tally.acts_by_node == {"n1": 1}
    assert not env.store.read_write(mark_acted("f3/kill_orphan", now, guard(2))).result(10)


def test_mark_acted_asks_postgresql_for_read_committed_first() -> None:
    """Under REPEATABLE READ the count would come from a snapshot older than the lock: the transaction
    says READ COMMITTED before its first query (a recording stand-in for a PostgreSQL connection)."""
    class Recorder:
        def __init__(self) -> None:
            self.sql: list[str] = []

        def execute(self, sql: str, params: Any = ()) -> Any:
            self.sql.append(sql)
            outer = self

            class Cur:
                rowcount = 0

                def fetchone(self) -> Any:
                    return ("kill_orphan",) if "SELECT action" in outer.sql[-1] else (0, 0)

                def fetchall(self) -> list[Any]:
                    return []

            return Cur()

    conn = Recorder()
    guard = ActGuard("n1", 0, max_actions=1, max_per_node=1, config_mode=MODE_ON)
    mark_acted("f1/kill_orphan", 1, guard)(conn)  # type: ignore[arg-type]
    assert conn.sql[0] == "SET TRANSACTION ISOLATION LEVEL READ COMMITTED"
    assert "pg_advisory_xact_lock" in conn.sql[1]
