"""The remediation engine (docs/REMEDIATION.md): action 1, the orphaned GPU holder killed on its node,
dry-run first, guarded, every step audited.

    r = Remediator(store, cluster, streams, policy=lambda: policy, audit=audit_log.append,
                   replica_id="collector-0")
    await r.tick()                         # the collector's loop calls it every second
    state, detail = await r.remediate(finding_id, dry_run=True, who="user:oncall")   # by hand
    await r.control("pause", who="user:oncall", reason="maintenance")

The mode in force: the override `ghostgpu remediate mode` stored (remediation_control), else the
config file's; `off` considers nothing. Paused, or the breaker open (too many acts in its window,
cluster-wide or on one node), every act becomes a dry run and the GhostGPURemediationPaused alert
fires until neither holds.

A candidate is an open finding of class orphaned on a node this replica applies (all of them with one
collector; with replicas the nodes whose lease it holds), in a Kubernetes pod (a container and a pod
UID: a host process is never one), at least min_age old, its namespace admitted, not allowlisted, its
node not opted out (its tracer's switch; its label, read through `labels` at decided and again before
the act). Its incident, "f<finding>/kill_orphan", is stored (remediation_store.insert_incident)
before anything is sent: a key already there is someone's already, and nothing acts on it twice, after
a failover too. Then, each step an audit record ("remediation.<step>") and a remediation_steps row:

1. decided: what would be done, and why;
2. re-checked: a dry-run RemediateCommand to the node's tracer, which re-checks the holder at that
   moment (CRI still reports no running container, it still holds the device, pid, start time and exe
   unchanged). Anything but "all pass" ends the incident (skipped, with the tracer's reason);
3. acted (mode on only): the conditional UPDATE of acted_unix_ns is committed first, in one transaction
   with the guards as they stand then (no pause, the mode asked for still on, the breaker not full:
   remediation_store.ActGuard), and only the writer whose update hit the row sends the real command,
   once the acted audit record is committed; a guard that refuses leaves the incident proposed (an
   outcome record says why). The command carries a start deadline (deadline_ms); one the tracer never
   started (not sent, past its deadline, its queue full: RemediateResult.not_started) gives its claim
   back (remediation_store.unmark_acted) and stays proposed. One act in flight per node;
4. outcome: the tracer's RemediateResult (done, failed, unkillable, skipped).

In dry-run the incident stays `proposed` (it may be acted on later if the mode turns on: same key),
and the finding's alert gets a `remediation` annotation saying what would be done. An incident whose
act was recorded but whose outcome never came (the replica acting on it stopped) is never sent again:
a dry-run re-check settles it once the tracer is surely done with it (the process gone, per the
tracer's `exited`: done; anything else: failed).

Unkillable holders go to the isolation seam (`isolate`: collector/isolation.py's
Isolator.isolate_unkillable) when actions.isolate_node is on; each incident acted on goes to the
ticket seam (`ticket`: collector/tickets.py's TicketSender.submit) when a ticket URL is set.
Everything runs on the collector's event loop; the SQL on the store's writer thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from ghostgpu.collector.audit import AuditFn
from ghostgpu.collector.cluster import ClusterTable, FindingRec
from ghostgpu.collector.remediation_commands import (
    NO_ANSWER,
    CommandStream,
    RemediateCalls,
)
from ghostgpu.collector.remediation_guards import (
    ActCounts,
    Candidate,
    breaker,
    effective_mode,
    eligible,
    node_opt_out,
)
from ghostgpu.collector.remediation_policy import RemediationPolicy, changes
from ghostgpu.collector.remediation_store import (
    MODE_OVERRIDE,
    PAUSED,
    ActGuard,
    IncidentRow,
    Tally,
    add_step,
    get_incident,
    insert_incident,
    mark_acted,
    select_steps,
    select_tally,
    set_control,
    set_state,
    store_read,
    store_write,
    unmark_acted,
)
from ghostgpu.collector.store import Store

from ghostgpu.common.model.consumers import ClusterConsumer, Consumer, ConsumerClass
from ghostgpu.common.model.remediation import (
    ACTED,
    CAPABILITY,
    CRI_CALLS,
    CRI_TIMEOUT_S,
    DECIDED,
    DONE,
    ENDED,
    FAILED,
    KILL_ORPHAN,
    KILL_WAIT_S,
    MAX_GRACE_S,
    MODE_DRY_RUN,
    MODE_MANUAL,
    MODE_OFF,
    MODE_ON,
    MODES,
    OUTCOME,
    PROPOSED,
    RECHECKED,
    SKIPPED,
    UNKILLABLE,
    RemediationState,
    incident_key,
)
from ghostgpu.common.wire.convert import remediation_from_proto, remediation_to_proto
from ghostgpu.v1 import node_pb2, query_pb2, stream_pb2

log = logging.getLogger(__name__)
T = TypeVar("T")
ONLY_ORPHANED = "only orphaned holders are killed"
LABELS_TIMEOUT_S = 5.0  # a node's labels not read by then: not read (before the act: held back)
LABELS_RETRY_S = 30.0  # an act held back because the labels could not be read is tried again after this
COLLECTOR = "collector"  # the audit subject of what the engine does by itself
PAUSED_ALERT = "GhostGPURemediationPaused"


class RemediationError(Exception):
    """A Remediate or RemediationControl call refused: its gRPC code's name and one line."""

    def __init__(self, code: str, line: str) -> None:
        super().__init__(line)
        self.code, self.line = code, line


# (node, a serialized RemediateRequest, the caller's subject) -> the serialized RemediateResponse, run
# by the replica serving the node (collector/replica_commands.py, kind "remediate"); raises
# RemediationError with that replica's refusal, or when no answer came.
Forward = Callable[[str, bytes, str], Awaitable[bytes]]


class AlertSeam(Protocol):
    """What the engine tells the Alertmanager pusher (collector/alertpush.py)."""

    def offer_remediation(self, finding_id: int, note: str) -> None: ...

    def set_remediation_paused(self, reason: str) -> None: ...


@dataclass(frozen=True)
class RemediationTiming:
    """The engine's waits: not settings (tests shorten them)."""

    tick_s: float = 1.0
    recheck_timeout_s: float = 10.0  # for a dry-run re-check's answer (also its deadline_ms)
    act_start_s: float = 5.0  # RemediateCommand.deadline_ms of an act: started by then, or not at all
    act_margin_s: float = 15.0  # waited past the tracer's own waits for the outcome

    def act_wait_s(self, grace_s: float) -> float:
        """How long an act sent with this grace may take at the tracer, the margin included: its start
        deadline, its CRI calls, the grace, SIGKILL's wait."""
        return self.act_start_s + CRI_CALLS * CRI_TIMEOUT_S + grace_s + KILL_WAIT_S + self.act_margin_s


@dataclass
class RemediationView:
    """Where remediation stands, as the last tick saw it: RemediationStatus, /metrics."""

    mode: str = MODE_OFF  # in force (off | dry-run | on): dry-run while paused or the breaker is open
    config_mode: str = MODE_OFF
    override_mode: str = ""
    paused: bool = False
    paused_by: str = ""
    paused_reason: str = ""
    paused_unix_ns: int = 0
    breaker_open: bool = False
    breaker_reason: str = ""
    acts_in_window: int = 0
    max_actions: int = 0
    nodes_over: tuple[str, ...] = ()  # nodes past max_per_node in the window
    isolated_nodes: tuple[str, ...] = ()
    asked: str = MODE_OFF  # the mode asked for: the override's, else the config file's
    why: str = ""  # the mode in force, and why (effective_mode's line)

    def dry_run_why(self, node: str, node_over: bool | None = None) -> str:
        """Why an act on `node` would be a dry run now ("" when it would act); node_over: whether the
        node is past its own breaker (default: as this view saw it)."""
        if self.mode != MODE_ON:
            return self.why or f"mode {self.mode}"
        if node in self.nodes_over if node_over is None else node_over:
            return f"breaker open for node {node}: {self.breaker_reason}"
        return ""

    def to_proto(self) -> query_pb2.RemediationStatus:
        return query_pb2.RemediationStatus(
            mode=self.mode, config_mode=self.config_mode, override_mode=self.override_mode,
            paused=self.paused, paused_by=self.paused_by, paused_unix_ns=self.paused_unix_ns,
            breaker_open=self.breaker_open or bool(self.nodes_over), breaker_reason=self.breaker_reason,
            actions_in_window=self.acts_in_window, max_actions=self.max_actions,
            isolated_nodes=list(self.isolated_nodes))


@dataclass
class _Case:
    """One incident on its way through the steps."""

    rec: FindingRec
    key: str
    mode: str  # dry-run | on | manual
    actor: str
    dry_run_why: str = ""  # set: only a dry run (the mode, pause, breaker, or asked for)
    skip_why: str = ""  # set: decided, then skipped at once (the node opted out)
    state: str = PROPOSED
    reason: str = ""
    audit_seq: int = 0
    detail: str = ""  # the tracer's report, for RemediateResponse.detail
    steps: list[str] = field(default_factory=list)


def _process_of(rec: FindingRec) -> node_pb2.Process:
    c = rec.consumer.consumer
    return node_pb2.Process(pid=c.pid, comm=c.comm, exe=c.exe, start_time_ns=c.start_time_ns or 0,
                            container_id=c.container_id, pod_uid=_pod_uid(rec))


def _pod_uid(rec: FindingRec) -> str:
    """The consumer's pod UID: the tracer's (from the cgroup path), else the one CRI enrichment found."""
    return rec.consumer.consumer.pod_uid or rec.consumer.k8s.pod_uid


def _not_orphaned(finding_id: int, cls: str) -> RemediationError:
    return RemediationError("FAILED_PRECONDITION",
                            f"finding {finding_id} is {cls}, not {ConsumerClass.ORPHANED}: {ONLY_ORPHANED}")


def _who(rec: FindingRec) -> str:
    c = rec.consumer.consumer
    return f"pid {c.pid} ({c.comm or '?'})"


def _report(r: stream_pb2.RemediateResult) -> str:
    """The tracer's report in one line: what it sent, whether the device was released, where it waits."""
    parts = [r.reason]
    if r.signals:
        parts.append("sent " + ", ".join(r.signals))
    if r.released:
        parts.append("device released")
    if r.proc_state:
        parts.append(f"state {r.proc_state}")
    if r.wchan:
        parts.append(f"wchan {r.wchan}")
    if r.stuck_tids:
        parts.append("stuck threads " + ",".join(map(str, r.stuck_tids)))
    return "; ".join(p for p in parts if p)


class Remediator:
    """See the module docstring. Every method runs on the collector's event loop."""

    def __init__(self, store: Store, cluster: ClusterTable, streams: Mapping[str, CommandStream], *,
                 policy: Callable[[], RemediationPolicy], replica_id: str = COLLECTOR,
                 audit: AuditFn | None = None, applies: Callable[[str], bool] | None = None,
                 owner_of: Callable[[str], str | None] | None = None, calls: RemediateCalls | None = None,
                 alerts: AlertSeam | None = None, isolate: Callable[..., Any] | None = None,
                 ticket: Callable[[dict[str, object]], Any] | None = None,
                 forward: Forward | None = None, timing: RemediationTiming | None = None,
                 labels: Callable[[str], Awaitable[Mapping[str, str] | None]] | None = None,
                 labels_now: Callable[[str], Awaitable[tuple[Mapping[str, str] | None, str]]] | None = None,
                 ) -> None:
        """streams: the connected tracers by node (Ingest.sessions); policy: the config's remediation
        section as now in force (reloaded); applies(node): this replica acts for the node (with replicas:
        it holds the node's lease; None: every node); owner_of(node): the replica that does, for a
        Remediate this one cannot run; alerts: the Alertmanager pusher; isolate(node, trigger, reason,
        incident, pods=[(namespace, pod)]), awaited when it is a coroutine, and ticket(document),
        called on the loop: actions 2 and 3 (None: not built); forward(node, RemediateRequest bytes,
        caller): with replicas, a Remediate for a node another replica serves, run there
        (serve_forwarded) and its RemediateResponse bytes back; labels(node): the Node's labels
        (collector/kube_api.py's NodeLabels.labels; None: not known, as without the Kubernetes API), for
        the opt-out label, read at decided; labels_now(node): (labels, why not), read afresh just before
        the act (NodeLabels.labels_now; see _labels_held_back); without it, labels again."""
        self.labels, self.labels_now = labels, labels_now
        self.store, self.cluster, self.streams = store, cluster, streams
        self.policy, self.replica_id, self.audit = policy, replica_id, audit
        self.applies = applies or (lambda node: True)
        self.owner_of = owner_of
        self.calls = calls or RemediateCalls(streams)
        self.alerts, self.isolate, self.ticket = alerts, isolate, ticket
        self.forward = forward
        self.timing = timing or RemediationTiming()
        self.view = RemediationView()
        self.incidents_total: dict[tuple[str, str, str], int] = {}  # (action, state, mode) -> reached
        self._busy: set[str] = set()  # incidents a task of this engine works on now
        self._reserved: dict[str, int] = {}  # node -> acts its running tasks may still send
        self._held_until: dict[str, float] = {}  # incident -> monotonic time its act may be tried again
        self._tasks: set[asyncio.Task[Any]] = set()
        self._alert_reason = ""
        self._ticking: asyncio.Task[None] | None = None
        self._nudged: asyncio.Event | None = None  # set by start_ticking, on the loop

    # ---- the loop ----------------------------------------------------------------------------------

    def start_ticking(self) -> None:
        self._nudged = asyncio.Event()
        self._ticking = asyncio.get_running_loop().create_task(self._tick_loop())

    def on_finding(self, rec: FindingRec) -> None:
        """ClusterTable.on_finding: an orphaned finding opened or changed here, so tick now."""
        if rec.cls == ConsumerClass.ORPHANED:
            self.nudge()

    def nudge(self) -> None:
        """Findings changed: tick now rather than at the next second."""
        if self._nudged is not None:
            self._nudged.set()

    async def _tick_loop(self) -> None:
        assert self._nudged is not None
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._nudged.wait(), self.timing.tick_s)
            self._nudged.clear()
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug or a store error must not end remediation for good: next tick
                log.exception("remediation: a tick failed")

    def shutdown(self) -> None:
        if self._ticking is not None:
            self._ticking.cancel()
        for task in list(self._tasks):
            task.cancel()

    async def idle(self) -> None:
        """Wait for every incident task this engine started (tests)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def fresh_view(self) -> RemediationView:
        """The view as of now, read from the store (the override, the pause, the breaker): for a caller that
        must not act on the last tick's view, such as node isolation on a fault heard before the first tick
        (when the view is still the default, off)."""
        policy = self.policy()
        tally = await self._read(select_tally(time.time_ns() - int(policy.breaker.window_s * 1e9), []))
        return self._see(policy, tally)

    async def tick(self) -> None:
        """Look at the candidates once: start the incidents due, settle the acts left without outcome."""
        policy = self.policy()
        now = time.time_ns()
        candidates = [r for r in self.cluster.open_findings()
                      if r.cls == ConsumerClass.ORPHANED and self.applies(r.node)]
        tally = await self._read(select_tally(now - int(policy.breaker.window_s * 1e9),
                                              [incident_key(r.id, KILL_ORPHAN) for r in candidates]))
        view = self._see(policy, tally)
        if view.mode == MODE_OFF:
            return
        # An act is settled only once the tracer is surely done with it: the grace it was sent with (kept
        # in the row; a reload since does not shorten it), the tracer's other waits and the margin.
        for left in tally.unsettled:
            grace_ms = left.details().get("grace_ms")
            grace_s = float(grace_ms) / 1000 if isinstance(grace_ms, (int, float)) else MAX_GRACE_S
            if left.acted_unix_ns + int(self.timing.act_wait_s(grace_s) * 1e9) > now:
                continue
            if left.incident not in self._busy and self.applies(left.node):
                self._spawn(left.incident, self._settle(left))
        if not policy.kill_orphans:
            return
        # The breaker's budget for this tick: the acts committed in the window, plus those this engine
        # may still send (its incidents in mode on, not ended), each taken as it is started here, so
        # that candidates started together never pass K between them.
        b = policy.breaker
        acts = tally.acts_in_window + sum(self._reserved.values())
        by_node = dict(tally.acts_by_node)
        for node, n in self._reserved.items():
            by_node[node] = by_node.get(node, 0) + n
        for rec in candidates:
            key = incident_key(rec.id, KILL_ORPHAN)
            if key in self._busy or self._admits(policy, rec, now) is not None:
                continue
            if key in self._held_until:
                if self._held_until[key] > time.monotonic():
                    continue  # held back (its node's labels could not be read): not re-checked every tick
                del self._held_until[key]
            row = tally.incidents.get(key)
            if row is not None and not (row.state == PROPOSED and row.acted_unix_ns == 0):
                continue  # ended, or acted on: never again
            if row is None and (opted_out := self._opted_out(rec.node)) is not None:
                if rec.node in self.streams:  # its tracer said no: the incident ends, skipped, once
                    case = _Case(rec, key, view.mode, COLLECTOR, skip_why=opted_out)
                    self._spawn(key, self._run(case, None))
                continue  # no tracer connected: it waits for one
            why = view.dry_run_why(rec.node, node_over=False)
            if not why:
                verdict = breaker(ActCounts(acts, by_node), b, rec.node)
                why = "" if verdict.allowed else f"breaker open: {verdict.reason}"
            if row is not None and why:
                continue  # proposed already: it waits, as it is, for the mode to turn on
            if not why and rec.node in self._reserved:
                continue  # one act in flight per node: the next waits for it (its answer, its deadline)
            if not why:
                acts += 1
                by_node[rec.node] = by_node.get(rec.node, 0) + 1
            mode = MODE_ON if view.mode == MODE_ON else MODE_DRY_RUN
            # A new incident starts at decided; one proposed in a dry run (or stopped before its act)
            # goes on, under the same key, now that the mode is on.
            self._spawn(key, self._run(_Case(rec, key, mode, COLLECTOR, dry_run_why=why), row),
                        reserve=rec.node if not why else None)

    def _spawn(self, key: str, coro: Awaitable[Any], reserve: str | None = None) -> None:
        """Run one incident's task; `reserve`: the node of an act it may send, counted against the
        breaker until the task ends (by then its act, if any, is committed and counted from the store)."""
        self._busy.add(key)
        if reserve is not None:
            self._reserved[reserve] = self._reserved.get(reserve, 0) + 1
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            self._busy.discard(key)
            if reserve is not None:
                self._reserved[reserve] -= 1
                if not self._reserved[reserve]:
                    del self._reserved[reserve]
            if not t.cancelled() and t.exception() is not None:
                log.error("remediation: incident %s failed: %s", key, t.exception())

        task.add_done_callback(done)

    # ---- guards (collector/remediation_guards.py) --------------------------------------------------

    def _admits(self, policy: RemediationPolicy, rec: FindingRec, now_unix_ns: int,
                manual: bool = False) -> str | None:
        """None when the finding is a candidate (eligible(), its node's part aside: _opted_out); else why
        not, one line. By hand, min_age does not apply."""
        c, k8s = rec.consumer.consumer, rec.consumer.k8s
        candidate = Candidate(finding_id=rec.id, node=rec.node, cls=rec.cls,
                              opened_unix_ns=rec.opened_unix_ns, resolved_unix_ns=rec.resolved_unix_ns,
                              namespace=k8s.namespace, exe=c.exe, comm=c.comm,
                              container_id=c.container_id, pod_uid=_pod_uid(rec))
        return eligible(candidate, replace(policy, min_age_s=0.0) if manual else policy, now_unix_ns,
                        capabilities=(CAPABILITY,))

    def _opted_out(self, node: str) -> str | None:
        """Why the node takes no part (its tracer's --remediation off, or no tracer connected), or None."""
        stream = self.streams.get(node)
        return node_opt_out(node, stream.hello.capabilities if stream is not None else None, None)

    async def _label_opt_out(self, node: str) -> str | None:
        """Why the node's label keeps it out (OPT_OUT_LABEL), or None. The labels are read through the
        seam (its own thread or cache, never blocking the loop); none known (no seam, the Kubernetes API
        not configured or not reachable, no answer within LABELS_TIMEOUT_S): not opted out by label, as
        docs/REMEDIATION.md says (the tracer's --remediation off still holds)."""
        if self.labels is None:
            return None
        try:
            labels = await asyncio.wait_for(self.labels(node), LABELS_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("remediation: node %s's labels not read (%s): not opted out by label", node, e)
            return None
        if labels is None:
            return None
        return node_opt_out(node, (CAPABILITY,), labels)

    async def _labels_held_back(self, node: str) -> str | None:
        """Right before the act: why it is held back by the node's labels, read fresh (the seam's
        labels_now, a GET that bypasses the cache): opted out by label, or the labels could not be read
        while the Kubernetes API is configured ("node labels could not be read: why"); None: act. Without
        labels_now: _label_opt_out."""
        labels_now = self.labels_now
        if labels_now is None:
            return await self._label_opt_out(node)
        try:
            labels, why = await asyncio.wait_for(labels_now(node), LABELS_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            labels, why = None, f"no answer within {LABELS_TIMEOUT_S:g} s"
        except Exception as e:
            labels, why = None, f"{type(e).__name__}: {e}"
        if why:
            return f"node labels could not be read: {why}"
        if labels is None:
            return None  # no Kubernetes API configured: the tracer's switch is the opt-out
        return node_opt_out(node, (CAPABILITY,), labels)

    def _see(self, policy: RemediationPolicy, tally: Tally) -> RemediationView:
        """The view this tick: the mode in force (effective_mode), pause, breaker; the paused alert fired
        or resolved to match (while mode on is asked for and held back, or a node's breaker is open)."""
        control = tally.control
        override = control[MODE_OVERRIDE].value if MODE_OVERRIDE in control else ""
        paused = control.get(PAUSED)
        b = policy.breaker
        counts = ActCounts(tally.acts_in_window, tally.acts_by_node)
        cluster = breaker(counts, b)
        node_verdicts = {n: breaker(ActCounts(0, counts.by_node), b, n) for n in sorted(counts.by_node)}
        over = tuple(n for n, v in node_verdicts.items() if not v.allowed)
        by = f"by {paused.who}" + (f": {paused.value}" if paused.value else "") if paused is not None else ""
        effective = effective_mode(policy.mode, override or None, paused is not None, by, cluster)
        reasons = [] if cluster.allowed else [cluster.reason]
        reasons += [node_verdicts[n].reason for n in over]
        view = RemediationView(
            mode=effective.mode, config_mode=policy.mode, override_mode=override, paused=paused is not None,
            paused_by=paused.who if paused else "", paused_reason=paused.value if paused else "",
            paused_unix_ns=paused.at_unix_ns if paused else 0, breaker_open=not cluster.allowed,
            breaker_reason="; ".join(reasons), acts_in_window=tally.acts_in_window, max_actions=b.max_actions,
            nodes_over=over, isolated_nodes=tuple(tally.isolated_nodes), asked=effective.asked,
            why=effective.why)
        self.view = view
        reason = ""
        if effective.held_back:
            reason = effective.why
        elif effective.mode == MODE_ON and over:
            reason = f"breaker open: {view.breaker_reason}"
        if reason != self._alert_reason:
            self._alert_reason = reason
            if self.alerts is not None:
                self.alerts.set_remediation_paused(reason)
        return view

    # ---- one incident -----------------------------------------------------------------------------

    async def _run(self, case: _Case, row: IncidentRow | None) -> _Case:
        """decided (a new incident) → re-checked → acted → outcome; a dry run stops after re-checked."""
        rec, node = case.rec, case.rec.node
        if row is None:
            now = time.time_ns()
            c = rec.consumer.consumer
            detail = json.dumps({"pid": c.pid, "comm": c.comm, "exe": c.exe, "start_time_ns": c.start_time_ns,
                                 "container_id": c.container_id, "pod_uid": _pod_uid(rec),
                                 "devices": list(c.devices)}, sort_keys=True)
            plan = (f"orphaned: {c.reason}; kill {_who(rec)}: SIGTERM, SIGKILL after "
                    f"{self.policy().grace_s:g} s")
            new = IncidentRow(case.key, rec.id, node, rec.consumer.k8s.namespace, KILL_ORPHAN, PROPOSED,
                              case.mode, plan, now, now, 0, self.replica_id, 0, detail)
            if not await self._write(insert_incident(new)):
                stored = await self._read(get_incident(case.key))
                if stored is not None:  # someone's already: never acted on twice
                    return self._as_stored(case, stored)
                return case
            case.reason = plan
            if not case.skip_why:
                case.skip_why = await self._label_opt_out(node) or ""
            self._step(case, DECIDED, PROPOSED, plan)
            if case.skip_why:
                return self._end(case, SKIPPED, case.skip_why)
        command = stream_pb2.RemediateCommand(incident=case.key, process=_process_of(rec),
                                              container_id=rec.consumer.consumer.container_id,
                                              devices=list(rec.consumer.consumer.devices),
                                              grace_ms=int(self.policy().grace_s * 1000), dry_run=True,
                                              deadline_ms=int(self.timing.recheck_timeout_s * 1000))
        check = await self.calls.call(node, command, self.timing.recheck_timeout_s)
        case.detail = _report(check)
        if check.outcome != PROPOSED:
            state = check.outcome if check.outcome in ENDED else SKIPPED
            why = check.reason if check.outcome != NO_ANSWER else f"no re-check: {check.reason}"
            self._step(case, RECHECKED, state, why, evidence=case.detail)
            return self._end(case, state, why, step=False)
        if case.dry_run_why:
            grace = self.policy().grace_s
            plan = (f"dry-run: would SIGTERM {_who(rec)}, SIGKILL after {grace:g} s ({case.dry_run_why}); "
                    f"re-check: {check.reason or 'every check passed'}")
            self._step(case, RECHECKED, PROPOSED, plan, evidence=case.detail)
            self._state(case, PROPOSED, plan)
            if self.alerts is not None:
                self.alerts.offer_remediation(rec.id, plan)
            return case
        self._step(case, RECHECKED, PROPOSED, check.reason or "every check passed", evidence=case.detail)
        return await self._act(case, command)

    async def _act(self, case: _Case, command: stream_pb2.RemediateCommand) -> _Case:
        """Record the act (mark_acted, its guards in the same transaction), audit it, then send it."""
        rec, node = case.rec, case.rec.node
        if (held := await self._labels_held_back(node)) is not None:
            if held.startswith("node labels could not be read"):
                self._step(case, OUTCOME, PROPOSED, held)  # not known to be opted out: it may act later
                self._held_until[case.key] = time.monotonic() + LABELS_RETRY_S
                return case
            return self._end(case, SKIPPED, held)
        policy = self.policy()  # read right before: a reload since the tick started holds
        manual = case.mode == MODE_MANUAL
        if not policy.kill_orphans:
            self._step(case, OUTCOME, PROPOSED, "actions.kill_orphans is false at the moment of acting: "
                       "not acted on")
            return case
        now = time.time_ns()
        b = policy.breaker
        guard = ActGuard(node=node, window_start_unix_ns=now - int(b.window_s * 1e9),
                         max_actions=b.max_actions, max_per_node=b.max_per_node, config_mode=policy.mode,
                         overrides=(MODE_ON, MODE_DRY_RUN) if manual else (MODE_ON,))
        grace_s = policy.grace_s
        command.grace_ms = int(grace_s * 1000)
        claim = await self._write(mark_acted(case.key, now, guard, grace_ms=command.grace_ms))
        if not claim:
            if claim.refused:  # paused, turned off or the breaker full since the tick: it waits, proposed
                self._step(case, OUTCOME, PROPOSED, claim.refused)
                return case
            stored = await self._read(get_incident(case.key))
            return self._as_stored(case, stored) if stored is not None else case
        self._step(case, ACTED, PROPOSED, f"SIGTERM {_who(rec)}, SIGKILL after {grace_s:g} s")
        # The acted record is in the audit chain (and its steps row stored) before the kill goes out:
        # the store runs its queue in order, so this barrier returns once both are committed.
        await asyncio.wrap_future(self.store.barrier())
        command.dry_run = False
        command.deadline_ms = int(self.timing.act_start_s * 1000)
        result = await self.calls.call(node, command, self.timing.act_wait_s(grace_s))
        case.detail = _report(result)
        if result.not_started:
            # Never sent, or the tracer did not start it (its queue full, its deadline past): the claim
            # goes back (only this one), out of the breaker's count, and the incident may be tried again.
            await self._write(unmark_acted(case.key, now))
            self._step(case, OUTCOME, PROPOSED, f"not sent: {result.reason}", evidence=case.detail)
            return case
        if result.outcome in ENDED:
            state, why = result.outcome, result.reason
        else:
            state = FAILED
            why = (f"no outcome: {result.reason}; it is not sent again" if result.outcome == NO_ANSWER
                   else f"the tracer answered {result.outcome!r}: {result.reason}")
        self._step(case, OUTCOME, state, why, evidence=case.detail, signals=list(result.signals),
                   released=result.released, wchan=result.wchan, stack=result.stack)
        self._end(case, state, why, step=False)
        await self._follow_up(case, result)
        return case

    async def _settle(self, row: IncidentRow) -> None:
        """An act recorded without an outcome (its replica stopped): a dry-run re-check says how it ended;
        the kill is never sent again."""
        d = row.details()
        rec = self._rec_of(row)
        case = _Case(rec, row.incident, row.mode, COLLECTOR, audit_seq=row.audit_seq)
        process = node_pb2.Process(pid=int(d.get("pid") or 0), comm=str(d.get("comm", "")),
                                   exe=str(d.get("exe", "")), start_time_ns=int(d.get("start_time_ns") or 0),
                                   container_id=str(d.get("container_id", "")),
                                   pod_uid=str(d.get("pod_uid", "")))
        command = stream_pb2.RemediateCommand(
            incident=row.incident, process=process,
            container_id=str(d.get("container_id", "")), devices=[str(x) for x in d.get("devices", [])],
            dry_run=True)
        check = await self.calls.call(row.node, command, self.timing.recheck_timeout_s)
        if check.outcome == NO_ANSWER:
            return  # its tracer is away: the next tick tries again
        case.detail = _report(check)
        if check.exited:
            state, why = DONE, f"settled after the replica acting on it stopped: {check.reason}"
        elif check.outcome == PROPOSED:
            state, why = FAILED, ("the replica acting on it stopped before the outcome; it was not signalled "
                                  "twice, and the process is still there")
        else:
            state, why = FAILED, ("the replica acting on it stopped before the outcome; it was not signalled "
                                  f"twice, and its re-check cannot say the process is gone: {check.outcome}: "
                                  f"{check.reason}")
        self._step(case, OUTCOME, state, why, evidence=case.detail)
        self._end(case, state, why, step=False)

    def _rec_of(self, row: IncidentRow) -> FindingRec:
        for rec in self.cluster.open.get(row.node, {}).values():
            if rec.id == row.finding_id:
                return rec
        # Its finding is not open here any more (resolved, or its node moved): what the row kept of it.
        d = row.details()
        consumer = Consumer(node=row.node, pid=int(d.get("pid") or 0), ns_pid=None,
                            comm=str(d.get("comm", "")), gpu=None, gpu_uuid="", gpu_minor=None, devices=[],
                            container_id="", pod_uid="", runtime="", cls=ConsumerClass.ORPHANED, reason="",
                            gpu_memory_bytes=None, exe=str(d.get("exe", "")))
        return FindingRec(row.finding_id, row.node, (consumer.pid, -1, ""), ConsumerClass.ORPHANED,
                          row.decided_unix_ns, ClusterConsumer(consumer))

    async def _follow_up(self, case: _Case, result: stream_pb2.RemediateResult) -> None:
        """Actions 2 and 3: isolate the node of an unkillable holder (actions.isolate_node), and a ticket
        for the incident (a ticket URL set). A failing seam is logged; the incident stands as it ended."""
        policy = self.policy()
        if case.state == UNKILLABLE and policy.isolate_node and self.isolate is not None:
            try:
                k8s = case.rec.consumer.k8s  # its pod gets the Event too, where one is known
                pods = [(k8s.namespace, k8s.pod)] if k8s.pod else []
                out = self.isolate(case.rec.node, UNKILLABLE, case.reason, case.key, pods=pods)
                if inspect.isawaitable(out):
                    await out
            except Exception as e:
                log.error("remediation: isolating node %s for %s failed: %s", case.rec.node, case.key, e)
        if policy.ticket.url and self.ticket is not None:
            try:
                history = await self._history(case)
                self.ticket(self.ticket_for(case, result, history))  # TicketDesk.submit: O(1), on the loop
            except Exception as e:
                log.error("remediation: the ticket for %s was not filed: %s", case.key, e)

    async def _history(self, case: _Case) -> list[RemediationState]:
        """The incident's steps as stored (remediation_steps, oldest first): the ticket's `actions`."""
        rows = await self._read(select_steps(case.rec.id))
        out: list[RemediationState] = []
        for incident, ts_unix_ns, _step, state, detail, audit_seq in rows:
            if incident != case.key:
                continue
            try:
                d = json.loads(detail or "{}")
            except ValueError:
                d = {}
            d = d if isinstance(d, dict) else {}
            out.append(RemediationState(str(state), KILL_ORPHAN, int(ts_unix_ns), str(d.get("reason", "")),
                                        str(d.get("mode", case.mode)), case.key, int(audit_seq or 0)))
        return out

    def ticket_for(self, case: _Case, result: stream_pb2.RemediateResult,
                   history: list[RemediationState] | None = None) -> dict[str, object]:
        """The incident's ticket (collector/tickets.py has its shape): the finding, the node, the pods,
        the evidence (the tracer's report), what was done (its steps: `history`, else only how it
        ended) and the audit record of it."""
        from ghostgpu.collector.tickets import TicketFinding, ticket_document

        rec = case.rec
        c, k8s = rec.consumer.consumer, rec.consumer.k8s
        pods = [{"namespace": k8s.namespace, "pod": k8s.pod, "container": k8s.container}] if k8s.pod else []
        evidence: dict[str, object] = {
            "finding_reason": c.reason, "tracer": result.reason, "outcome": result.outcome,
            "signals": list(result.signals), "released": result.released, "proc_state": result.proc_state,
            "wchan": result.wchan, "stack": result.stack, "stuck_tids": list(result.stuck_tids),
            "elapsed_ms": result.elapsed_ms}
        done = RemediationState(case.state, KILL_ORPHAN, time.time_ns(), case.reason, case.mode, case.key,
                                case.audit_seq)
        return ticket_document(incident=case.key, audit_seq=case.audit_seq, mode=case.mode,
                               finding=TicketFinding.from_proto(rec.to_proto()), pods=pods, evidence=evidence,
                               actions=history or [done])

    # ---- steps: the audit chain, the finding's history, the incident's row ---------------------------

    def _step(self, case: _Case, step: str, state: str, reason: str, **extra: Any) -> None:
        rec = case.rec
        record = None
        if self.audit is not None:
            record = self.audit(f"remediation.{step}", case.actor, state, finding=rec.id, node=rec.node,
                                pid=rec.consumer.consumer.pid, incident=case.key, mode=case.mode,
                                reason=reason, **{k: v for k, v in extra.items() if v not in ("", [], None)})
        seq = int(getattr(record, "seq", 0) or 0)
        case.audit_seq = seq or case.audit_seq
        case.steps.append(step)
        detail = json.dumps({"reason": reason, "mode": case.mode, "actor": case.actor,
                             **{k: v for k, v in extra.items() if v not in ("", [], None)}}, sort_keys=True)
        step_row = add_step(case.key, rec.id, time.time_ns(), step, state, detail, seq)
        self.store.submit([Store.op_call(step_row)])
        self._state(case, state, reason)

    def _state(self, case: _Case, state: str, reason: str) -> None:
        case.state, case.reason = state, reason
        self.store.submit([Store.op_call(set_state(case.key, state, reason, case.mode, time.time_ns(),
                                                   case.audit_seq))])

    def _end(self, case: _Case, state: str, reason: str, step: bool = True) -> _Case:
        if step:
            self._step(case, OUTCOME, state, reason)
        else:
            self._state(case, state, reason)
        key = (KILL_ORPHAN, state, case.mode)
        self.incidents_total[key] = self.incidents_total.get(key, 0) + 1
        if self.alerts is not None and state != PROPOSED:
            self.alerts.offer_remediation(case.rec.id, f"{state}: {reason}")
        return case

    @staticmethod
    def _as_stored(case: _Case, row: IncidentRow) -> _Case:
        case.state, case.reason, case.mode, case.audit_seq = row.state, row.reason, row.mode, row.audit_seq
        return case

    # ---- the config file's section reloaded (collector/remediation_config.py hooks) --------------------

    def config_changed(self, old: RemediationPolicy, new: RemediationPolicy) -> None:
        """A reloaded remediation section in force: audited (remediation.config), the view seen anew."""
        if self.audit is not None:
            self.audit("remediation.config", COLLECTOR, "ok", changed=changes(old, new), mode=new.mode)
        self.nudge()

    def config_refused(self, line: str) -> None:
        """A reload the old policy outlived (a bad file): audited, the old stays in force."""
        if self.audit is not None:
            self.audit("remediation.config", COLLECTOR, "refused", why=line)

    # ---- by hand: Remediate, RemediationControl ------------------------------------------------------

    async def remediate(self, finding_id: int, dry_run: bool, who: str) -> tuple[RemediationState, str]:
        """`ghostgpu remediate --finding ID [--dry-run]`: the same path, mode "manual" (min_age does not
        apply; the re-checks do). RemediationError(code, line) when it cannot run."""
        rec = self._open_finding(finding_id)
        if rec is None:
            node = await self._not_here(finding_id)
            return await self._forwarded(node, finding_id, dry_run, who)
        if rec.cls != ConsumerClass.ORPHANED:
            raise _not_orphaned(finding_id, rec.cls)
        if not self.applies(rec.node):
            return await self._forwarded(rec.node, finding_id, dry_run, who)
        policy = self.policy()
        now = time.time_ns()
        tally = await self._read(select_tally(now - int(policy.breaker.window_s * 1e9), []))
        view = self._see(policy, tally)
        if view.asked == MODE_OFF and not dry_run:
            raise RemediationError("FAILED_PRECONDITION", "remediation is off: set remediation.mode or "
                                   "`ghostgpu remediate mode`; --dry-run still works")
        if view.paused and not dry_run:
            raise RemediationError("FAILED_PRECONDITION", f"remediation is paused by {view.paused_by}"
                                   + (f" ({view.paused_reason})" if view.paused_reason else "")
                                   + ": `ghostgpu remediate resume` ends the pause; --dry-run still works")
        why = self._admits(policy, rec, now, manual=True) or self._opted_out(rec.node)
        if why is None:
            why = await self._label_opt_out(rec.node)
        if why is not None:
            raise RemediationError("FAILED_PRECONDITION", why)
        key = incident_key(rec.id, KILL_ORPHAN)
        if key in self._busy:
            raise RemediationError("FAILED_PRECONDITION", f"incident {key} is in progress; see `ghostgpu "
                                   "findings -o json` for its state")
        row = await self._read(get_incident(key))
        # Acted on, or ended otherwise than skipped: shown as it is. One skipped without an act (a re-check
        # that did not pass, a tracer that did not answer) is how a person tries it again, by hand.
        if row is not None and (row.acted_unix_ns or (row.state in ENDED and row.state != SKIPPED)):
            return row.state_of(), "already remediated: an incident is acted on once"
        case = _Case(rec, key, MODE_MANUAL, who, dry_run_why="asked for" if dry_run else "")
        self._busy.add(key)
        try:
            case = await self._run(case, row)
        finally:
            self._busy.discard(key)
        return RemediationState(case.state, KILL_ORPHAN, time.time_ns(), case.reason, case.mode, key,
                                case.audit_seq), case.detail

    def _open_finding(self, finding_id: int) -> FindingRec | None:
        for rec in self.cluster.open_findings():
            if rec.id == finding_id:
                return rec
        return None

    async def _forwarded(self, node: str, finding_id: int, dry_run: bool,
                         who: str) -> tuple[RemediationState, str]:
        """A Remediate for a node another replica serves: run there, through the store (its audit
        records name the caller); FAILED_PRECONDITION naming that replica when it cannot be."""
        owner = self.owner_of(node) if self.owner_of is not None else None
        if self.forward is None:
            raise RemediationError("FAILED_PRECONDITION", f"finding {finding_id} is on node {node}, which "
                                   f"collector replica {owner or '(none now)'} serves: call that replica")
        request = query_pb2.RemediateRequest(finding=finding_id, dry_run=dry_run)
        answer = query_pb2.RemediateResponse.FromString(
            await self.forward(node, request.SerializeToString(), who))
        state = remediation_from_proto(answer.remediation)
        if state is None:
            raise RemediationError("UNAVAILABLE", f"replica {owner or 'serving node ' + node} answered "
                                   f"finding {finding_id}'s remediation without a state")
        return state, answer.detail

    async def serve_forwarded(self, node: str, payload: bytes, who: str) -> bytes:
        """The serving replica's side of _forwarded: the RemediateResponse, or RemediationError."""
        request = query_pb2.RemediateRequest.FromString(payload)
        if self._open_finding(request.finding) is None:
            raise RemediationError("FAILED_PRECONDITION", f"finding {request.finding} is not open on this "
                                   f"replica ({self.replica_id}), which serves node {node}")
        state, detail = await self.remediate(request.finding, request.dry_run, who)
        return query_pb2.RemediateResponse(remediation=remediation_to_proto(state),
                                           detail=detail).SerializeToString()

    async def _not_here(self, finding_id: int) -> str:
        """A finding not open in this replica's memory: NOT_FOUND, or resolved, or not orphaned
        (RemediationError); else the node it is open on, which another replica serves."""
        def read(conn: Any) -> tuple[str, str, int] | None:
            r = conn.execute("SELECT node, class, resolved_unix_ns FROM findings WHERE id = ?",
                             (finding_id,)).fetchone()
            return (str(r[0]), str(r[1]), int(r[2])) if r else None

        found = await self._read(read)
        if found is None:
            raise RemediationError("NOT_FOUND", f"no finding {finding_id}; `ghostgpu findings` lists them")
        node, cls, resolved = found
        if resolved:
            raise RemediationError("FAILED_PRECONDITION",
                                   f"finding {finding_id} is resolved: nothing to remediate")
        if cls != ConsumerClass.ORPHANED:
            raise _not_orphaned(finding_id, cls)
        return node

    async def control(self, verb: str, who: str, reason: str = "", mode: str = "") -> RemediationView:
        """pause | resume | mode (mode "" clears the override) | status; each change audited."""
        now = time.time_ns()
        if verb == "pause":
            await self._write(set_control(PAUSED, reason, who, now))
        elif verb == "resume":
            await self._write(set_control(PAUSED, None, who, now))
        elif verb == "mode":
            if mode and mode not in MODES:
                raise RemediationError("INVALID_ARGUMENT", f"mode {mode!r}: use one of {', '.join(MODES)}, "
                                       "or \"\" to go back to the config file's")
            await self._write(set_control(MODE_OVERRIDE, mode or None, who, now))
        elif verb != "status":
            raise RemediationError("INVALID_ARGUMENT", f"verb {verb!r}: use pause, resume, mode or status")
        if verb != "status" and self.audit is not None:
            self.audit(f"remediation.{verb}", who, "ok", reason=reason, **({"mode": mode or "config"}
                                                                          if verb == "mode" else {}))
        policy = self.policy()
        tally = await self._read(select_tally(now - int(policy.breaker.window_s * 1e9), []))
        return self._see(policy, tally)

    # ---- the store ------------------------------------------------------------------------------------

    async def _read(self, fn: Callable[[Any], T]) -> T:
        return await store_read(self.store, fn)

    async def _write(self, fn: Callable[[Any], T]) -> T:
        return await store_write(self.store, fn)


# ---- with replicas: Remediate for a node another replica serves (collector/replica_commands.py) ----------

REPLICA_KIND = "remediate"  # the replica_commands rows' kind
# A forwarded Remediate waits for the other replica's label read at decided, its re-check, the label read
# right before the act, and the act itself at the longest grace (RemediationTiming's defaults).
FORWARD_DEADLINE_S = (2 * LABELS_TIMEOUT_S + RemediationTiming().recheck_timeout_s
                      + RemediationTiming().act_wait_s(MAX_GRACE_S))
_LINE_PREFIX = {"NOT_FOUND": "not found: ", "INVALID_ARGUMENT": "invalid: "}  # trace_commands.line_error's


def replica_forward(replica: Any) -> Forward:
    """Forward through ReplicaCommands.send: the serving replica's refusal comes back as its code."""
    from ghostgpu.collector.replica_commands import ReplicaCommandError
    from ghostgpu.collector.trace_commands import line_error

    async def forward(node: str, payload: bytes, who: str) -> bytes:
        try:
            answer: bytes = await replica.send(node, REPLICA_KIND, payload, FORWARD_DEADLINE_S, {"who": who})
        except ReplicaCommandError as e:
            refused = line_error(e.line)
            raise RemediationError(refused.code.name, refused.line) from None
        return answer

    return forward


def replica_handler(engine: Remediator) -> Callable[[Any], Awaitable[bytes]]:
    """ReplicaCommands.handle's handler for REPLICA_KIND rows: the engine's serve_forwarded, its refusal
    an error line whose prefix carries the code back."""
    from ghostgpu.collector.replica_commands import ReplicaCommandError

    async def handle(cmd: Any) -> bytes:
        try:
            return await engine.serve_forwarded(cmd.node, cmd.payload, str(cmd.meta.get("who", "")))
        except RemediationError as e:
            raise ReplicaCommandError(_LINE_PREFIX.get(e.code, "") + e.line) from None

    return handle
