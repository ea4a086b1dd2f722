"""Action 2 of remediation (docs/REMEDIATION.md, "Node isolation"): a node whose GPU is in a fatal
state is tainted ghostgpu.io/gpu-unhealthy=<trigger>:NoSchedule (or cordoned) through the Kubernetes
API, with a Warning Event on the Node (and on the pod, where one is known) saying what a human should
do next. Never a drain, never a GPU reset: those stop work that may still be healthy, and a reset needs
a GPU no process holds, which only a human who drained the node can promise.

Triggers, each a Trigger with its incident key:
- a critical Xid: a FaultBook listener (`on_fault`), a fault of severity critical the driver logged
  (origin kernel: a line user space wrote to /dev/kmsg is a drill and isolates nothing);
- an unkillable holder: the engine's seam (`isolate_unkillable`, collector/remediation.py) once the
  tracer reported the process stuck in the driver;
- memory no process owns: `check_memory(nodes)` on each tick, a GPU's unaccounted_bytes above
  IsolationSettings.unaccounted_bytes for unaccounted_for_s without a break (MemoryWatch).

Guards, in order, each ending the incident `skipped` with its reason: the mode (off: nothing at all;
dry-run, paused or the breaker open: audited and `proposed`, nothing sent), the node already isolated
by ghostgpu (isolated_nodes, or the taint on the node), the node's opt-out (its label
ghostgpu.io/remediation, or its tracer's --remediation off), minHealthy (at most max_isolated_nodes_pct
of the GPU nodes isolated by ghostgpu at once; collector/remediation_guards.py holds both rules), and
the incident key: stored before the PATCH (remediation_store.insert_incident),
so a replica taking over after a failover finds it and does not isolate twice. Each step goes to the
audit chain ("remediation.decided", "re-checked", "acted", "outcome") and to the incident's
remediation_steps. The Kubernetes calls block and run on a small executor of their own, off the event
loop.

Between the re-check's GET and the PATCH: the mode, the pause and the policy are read again, and the
node's labels by a fresh GET (NodeLabels.labels_now; labels that cannot be read hold the act back
too); a change leaves the incident proposed. Then minHealthy's slot is claimed in the store (its
isolated_nodes row, inserted only under the cap, serialized across replicas:
remediation_store.claim_isolated; given back if recording the act or the PATCH fails), mark_acted
records the act under the store's switches and the breaker, and the acted step is committed before
the PATCH goes out. Any error after that ends the incident failed. Each re-check drops the
isolated_nodes rows of nodes a human has untainted since (a GET each), and settle() ends the
isolations a dead replica acted on without an outcome, from the node as it stands: only the replica
whose conditional update stored the outcome (remediation_store.settle_isolation) audits it and files
its ticket. An isolation acted on files a ticket (`ticket`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ghostgpu.collector.audit import AuditFn
from ghostgpu.collector.kube_api import KubeApi, KubeError, NodeLabels, NodeState, ObjectRef, node_ref
from ghostgpu.collector.node_state import NodeStateRow, select_node_states
from ghostgpu.collector.nodes import NodeView
from ghostgpu.collector.remediation import COLLECTOR, RemediationView
from ghostgpu.collector.remediation_guards import isolation_cap, min_healthy, node_opt_out
from ghostgpu.collector.remediation_policy import RemediationPolicy
from ghostgpu.collector.remediation_store import (
    ActGuard,
    IncidentRow,
    IsolatedNode,
    add_step,
    claim_isolated,
    insert_incident,
    mark_acted,
    release_isolated,
    select_isolated_nodes,
    select_steps_of,
    select_unsettled_isolations,
    set_state,
    settle_isolation,
    store_read,
    store_write,
)
from ghostgpu.collector.store import Store
from google.protobuf.message import DecodeError

from ghostgpu.common.model.remediation import (
    ACTED,
    CAPABILITY,
    DECIDED,
    DONE,
    FAILED,
    ISOLATE_NODE,
    MODE_DRY_RUN,
    MODE_OFF,
    MODE_ON,
    OUTCOME,
    PROPOSED,
    RECHECKED,
    SKIPPED,
    TAINT_KEY,
    TRIGGER_UNACCOUNTED_MEMORY,
    TRIGGER_UNKILLABLE,
    TRIGGER_XID,
    incident_key,
)
from ghostgpu.v1 import query_pb2, stream_pb2

log = logging.getLogger(__name__)
T = TypeVar("T")

# Trigger.kind
XID, UNKILLABLE_HOLDER, UNACCOUNTED_MEMORY = TRIGGER_XID, TRIGGER_UNKILLABLE, TRIGGER_UNACCOUNTED_MEMORY
EVENT_REASON = "GPUUnhealthy"
TAINT_EFFECT = "NoSchedule"
GIB = 1 << 30
UNDO = {"taint": f"then untaint it: kubectl taint nodes {{node}} {TAINT_KEY}:{TAINT_EFFECT}-",
        "cordon": "then uncordon it: kubectl uncordon {node}"}


@dataclass(frozen=True)
class Trigger:
    """One reason to isolate one node."""

    kind: str  # XID | UNKILLABLE_HOLDER | UNACCOUNTED_MEMORY
    node: str
    incident: str  # stored before the act: one isolation per incident, replicas and restarts included
    reason: str  # what was seen, one line
    advice: str  # what a human should do next (the Event's message ends with it)
    taint_value: str  # a label value: the trigger, e.g. xid-79
    finding_id: int = 0  # 0: no finding (a fault, memory)
    namespace: str = ""
    pods: tuple[tuple[str, str], ...] = ()  # (namespace, pod): each gets the Event too

    def message(self, how: str = "taint") -> str:
        undo = UNDO.get(how, UNDO["taint"]).format(node=self.node)
        return f"{self.reason}. ghostgpu isolated the node and did nothing else: {self.advice}; {undo}"


@dataclass(frozen=True)
class Outcome:
    state: str  # PROPOSED (dry run) | SKIPPED | DONE | FAILED
    reason: str
    events: tuple[str, ...] = ()  # the Events posted


# ---- triggers -------------------------------------------------------------------------------------

def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def xid_trigger(cf: query_pb2.ClusterFault) -> Trigger | None:
    """A fault that isolates its node: a critical Xid from the driver; None for any other."""
    f = cf.fault
    if f.severity != "critical" or f.origin == "user":
        return None
    gpu = f"GPU {f.gpu}" if f.gpu >= 0 else f"the GPU at {f.pci_bus_id or '?'}"
    reset = f"nvidia-smi -r -i {f.gpu}" if f.gpu >= 0 else "nvidia-smi -r"
    pods = tuple(dict.fromkeys((h.k8s.namespace, h.k8s.pod) for h in cf.hits if h.k8s.pod))
    return Trigger(
        kind=XID, node=cf.node, incident=f"x{cf.id}/{ISOLATE_NODE}",
        reason=f"{gpu} logged Xid {f.xid} ({f.meaning or 'critical'})",
        advice=(f"drain the node, then reset the GPU once no process holds it ({reset}; with persistence "
                "mode on, nvidia-smi -pm 0 first) or reboot the node"),
        taint_value=f"xid-{f.xid}" if f.xid >= 0 else "xid", namespace=pods[0][0] if pods else "", pods=pods)


def unkillable_trigger(node: str, reason: str, incident: str,
                       pods: Iterable[tuple[str, str]] = ()) -> Trigger:
    """The engine's unkillable holder (its incident "f<finding>/kill_orphan"): isolate its node."""
    finding_id = 0
    head = incident.split("/", 1)[0]
    if head.startswith("f") and head[1:].isdigit():
        finding_id = int(head[1:])
    pods = tuple(pods)
    return Trigger(
        kind=UNKILLABLE_HOLDER, node=node,
        incident=incident_key(finding_id, ISOLATE_NODE) if finding_id else f"{incident}/{ISOLATE_NODE}",
        reason=f"a process stuck in the driver holds a GPU and no signal frees it ({reason})",
        advice=("drain the node, then reboot it: a GPU reset needs no process holding the GPU, and this one "
                "cannot be ended"),
        taint_value=UNKILLABLE_HOLDER, finding_id=finding_id, namespace=pods[0][0] if pods else "", pods=pods)


def memory_trigger(node: str, gpu: stream_pb2.Gpu, since_unix_s: float, for_s: float) -> Trigger:
    held = _gib(gpu.unaccounted_bytes)
    return Trigger(
        kind=UNACCOUNTED_MEMORY, node=node,
        incident=f"m{node}/gpu{gpu.index}/{int(since_unix_s)}/{ISOLATE_NODE}",
        reason=f"GPU {gpu.index} holds {held} no process owns, for {for_s / 60:.0f} min",
        advice=(f"drain the node, then reset the GPU (nvidia-smi -r -i {gpu.index}): a reset needs no "
                "clients, and with persistence mode on, nvidia-smi -pm 0 first; or reboot the node"),
        taint_value=UNACCOUNTED_MEMORY)


@dataclass
class MemoryWatch:
    """Since when each GPU's unaccounted memory has stayed above the threshold; a trigger once it has
    for long enough, and again only after it fell below."""

    since_s: dict[tuple[str, str], float] = field(default_factory=dict)  # (node, gpu uuid or index)
    fired: set[tuple[str, str]] = field(default_factory=set)

    def observe(self, nodes: Mapping[str, NodeView], threshold_bytes: int, for_s: float,
                now_unix_s: float) -> list[Trigger]:
        out: list[Trigger] = []
        seen: set[tuple[str, str]] = set()
        if threshold_bytes <= 0:
            self.since_s.clear()
            self.fired.clear()
            return out
        for name, view in nodes.items():
            if view.info is None:
                continue
            for gpu in view.info.gpus:
                if not gpu.HasField("unaccounted_bytes") or gpu.unaccounted_bytes <= threshold_bytes:
                    continue
                key = (name, gpu.uuid or str(gpu.index))
                seen.add(key)
                since = self.since_s.setdefault(key, now_unix_s)
                if now_unix_s - since >= for_s and key not in self.fired:
                    self.fired.add(key)
                    out.append(memory_trigger(name, gpu, since, now_unix_s - since))
        for key in set(self.since_s) - seen:  # fell below (or went away): the clock starts over
            del self.since_s[key]
            self.fired.discard(key)
        return out


# ---- guards (the rules themselves: collector/remediation_guards.py) --------------------------------

def gpu_node_count(nodes: Mapping[str, NodeView], stored: Iterable[NodeStateRow] = ()) -> int:
    """The cluster's GPU nodes, minHealthy's denominator: the nodes whose tracer reports a GPU, in this
    collector's NodeViews and in the node_state rows every replica writes for the nodes it owns
    (collector/node_state.py; with one collector, its own): the same nodes the isolated_nodes rows
    count, whichever replica isolated them."""
    names = {name for name, v in nodes.items() if v.info is not None and len(v.info.gpus) > 0}
    for row in stored:
        if row.node in names:
            continue
        try:
            status = query_pb2.TracerStatus.FromString(row.status)
        except DecodeError:
            continue  # a row being rewritten by a newer collector: counted from its own views there
        if len(status.info.gpus) > 0:
            names.add(row.node)
    return len(names)


def _isolated_still(node: NodeState, how: str) -> bool:
    """The node still carries ghostgpu's taint (any value) or, for a cordon, is still unschedulable."""
    if how == "cordon":
        return node.unschedulable
    return any(t.key == TAINT_KEY for t in node.taints)


# ---- the isolator ---------------------------------------------------------------------------------

# An isolated_nodes row this young may be a claim whose PATCH is still on its way (TIMEOUT_S per call,
# a GET and a PATCH per conflict retry): not taken for a human's untaint.
CLAIM_GRACE_S = 300.0
# An isolation acted on this long ago with no outcome: the replica acting on it stopped (settle()).
SETTLE_AFTER_S = 300.0
SETTLE_EVERY_S = 30.0


class Isolator:
    """See the module docstring. Every method runs on the collector's event loop."""

    def __init__(self, store: Store, policy: Callable[[], RemediationPolicy], *,
                 nodes: Mapping[str, NodeView] | None = None, audit: AuditFn | None = None,
                 view: Callable[[], RemediationView] | None = None, replica_id: str = COLLECTOR,
                 api: KubeApi | None = None, gpu_nodes: Callable[[], int] | None = None,
                 clock: Callable[[], float] = time.time,
                 refresh: Callable[[], Awaitable[object]] | None = None,
                 labels: NodeLabels | None = None,
                 ticket: Callable[[dict[str, object]], None] | None = None) -> None:
        """policy: the remediation section in force; nodes: the collector's NodeViews (GPU nodes for
        minHealthy, GPUs for the memory trigger); view: the engine's view (mode override, pause, breaker;
        None: the config's mode alone); api: a KubeApi (None: made from the policy's kubeconfig at the
        first act); gpu_nodes: how many GPU nodes the cluster has (default: gpu_node_count over the
        NodeViews and the node_state rows); refresh: brings `view` up to date (the engine's fresh_view),
        awaited before each isolation reads the mode and again right before the PATCH; labels: the
        node-label cache shared with the kill engine (each GET here refreshes it); ticket: files an
        incident's ticket document (TicketDesk.submit), called once per isolation acted on."""
        self.store, self.policy, self.audit, self.replica_id = store, policy, audit, replica_id
        self.nodes: Mapping[str, NodeView] = nodes if nodes is not None else {}
        self.view, self.refresh = view, refresh
        self.gpu_nodes = gpu_nodes
        self.clock = clock
        self.labels, self.ticket = labels, ticket
        self.memory = MemoryWatch()
        self.outcomes_total: dict[tuple[str, str], int] = {}  # (trigger kind, state) -> incidents
        self._api = api
        self._api_config = ""
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ghostgpu-kube")
        self._busy: set[str] = set()  # nodes an isolation works on now
        self._acting: set[str] = set()  # incidents this process acts on now: not for settle()
        self._settled_at = 0.0
        self._tasks: set[asyncio.Task[Any]] = set()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- triggers in -----------------------------------------------------------------------------

    def on_fault(self, cf: query_pb2.ClusterFault) -> None:
        """A FaultBook listener (on the loop): a critical Xid isolates its node."""
        trigger = xid_trigger(cf)
        if trigger is not None and self._enabled():
            self._spawn(self.isolate(trigger))

    async def isolate_unkillable(self, node: str, trigger: str, reason: str, incident: str,
                                 pods: Iterable[tuple[str, str]] = ()) -> Outcome:
        """The engine's isolation seam (Remediator(isolate=...)): an unkillable holder on `node`; each of
        `pods` (namespace, pod) gets the Event too."""
        return await self.isolate(unkillable_trigger(node, reason, incident, pods))

    def check_memory(self) -> list[Trigger]:
        """On each tick: memory no process owns past the threshold for long enough isolates the node;
        every SETTLE_EVERY_S, the isolations left without an outcome are settled."""
        policy = self.policy()
        iso = policy.isolation
        now = self.clock()
        triggers = self.memory.observe(self.nodes, iso.unaccounted_bytes, iso.unaccounted_for_s, now)
        if self._enabled():
            for t in triggers:
                self._spawn(self.isolate(t))
        if policy.isolate_node and now - self._settled_at >= SETTLE_EVERY_S:
            self._settled_at = now
            self._spawn(self.settle())
        return triggers

    def _enabled(self) -> bool:
        policy = self.policy()
        if self.refresh is not None:  # the view may be stale: isolate() reads the mode once refreshed
            return policy.isolate_node
        return policy.isolate_node and self._mode(policy) != MODE_OFF

    def _mode(self, policy: RemediationPolicy) -> str:
        return self.view().mode if self.view is not None else policy.mode

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            log.error("node isolation: a task failed: %s", exc, exc_info=exc)

    async def idle(self) -> None:
        """Wait for the isolations in flight (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # ---- one isolation ---------------------------------------------------------------------------

    async def isolate(self, t: Trigger) -> Outcome:
        if self.refresh is not None:
            await self.refresh()
        policy = self.policy()
        mode = self._mode(policy)
        if mode == MODE_OFF or not policy.isolate_node:
            return Outcome(SKIPPED, f"mode {mode}" if mode == MODE_OFF else "actions.isolate_node is off")
        if t.node in self._busy:
            return Outcome(SKIPPED, f"node {t.node} is being isolated already")
        self._busy.add(t.node)
        self._acting.add(t.incident)
        try:
            return await self._isolate(t, policy, mode)
        finally:
            self._busy.discard(t.node)
            self._acting.discard(t.incident)

    async def _isolate(self, t: Trigger, policy: RemediationPolicy, mode: str) -> Outcome:
        how = policy.isolation.how
        action = f"taint {TAINT_KEY}={t.taint_value}:{TAINT_EFFECT}" if how == "taint" else "cordon"
        dry_why = self._dry_run_why(mode, t.node)
        run_mode = MODE_DRY_RUN if dry_why else MODE_ON
        now_ns = time.time_ns()
        row = IncidentRow(t.incident, t.finding_id, t.node, t.namespace, ISOLATE_NODE, PROPOSED, run_mode,
                          t.reason, now_ns, now_ns, 0, self.replica_id, 0,
                          json.dumps({"trigger": t.kind, "how": how}, sort_keys=True))
        if not await store_write(self.store, insert_incident(row)):
            return Outcome(SKIPPED, f"incident {t.incident} is recorded already (another replica, or "
                                    "before a restart): not isolated twice")
        self._step(t, DECIDED, PROPOSED, f"would {action} on node {t.node}: {t.reason}", run_mode, how=how)
        refusal, node, gpu_nodes = await self._recheck(t, policy, how)
        if refusal:
            return self._end(t, SKIPPED, refusal, run_mode)
        self._step(t, RECHECKED, PROPOSED, "every guard passed", run_mode)
        if dry_why:
            return self._end(t, PROPOSED, f"dry run ({dry_why}): would {action} and post an Event: "
                                          f"{t.message(how)}", run_mode, step=True)
        assert node is not None
        # The re-check took a GET (up to TIMEOUT_S): read the mode, the pause and the policy again, so a
        # `remediate pause`, a mode change or a config reload in that window holds the PATCH back.
        held_back = await self._held_back(t.node) or await self._opted_out_now(t.node)
        if held_back:
            return self._end(t, PROPOSED, f"not acted on: {held_back}", run_mode)
        policy = self.policy()
        # minHealthy's slot, claimed in the store before the PATCH: counted and inserted in one
        # transaction serialized across replicas; given back if the PATCH fails.
        cap = isolation_cap(gpu_nodes, policy.breaker.max_isolated_nodes_pct)
        claimed, held = await store_write(self.store, claim_isolated(
            IsolatedNode(t.node, how, t.kind, t.reason, time.time_ns(), t.incident), cap))
        if not claimed:
            healthy = min_healthy(gpu_nodes, held, policy.breaker.max_isolated_nodes_pct)
            why = (f"minHealthy: {healthy.reason}" if not healthy.allowed
                   else f"node {t.node} is isolated by ghostgpu already")
            return self._end(t, SKIPPED, why, run_mode)
        window_start_ns = time.time_ns() - int(policy.breaker.window_s * 1e9)
        try:
            claim = await store_write(self.store, mark_acted(t.incident, time.time_ns(), ActGuard(
                t.node, window_start_ns, policy.breaker.max_actions, policy.breaker.max_per_node,
                policy.mode)))
        except Exception as e:  # its transaction rolled back: nothing recorded, so the slot goes back
            await self._release(t)
            log.exception("node isolation %s: recording the act failed", t.incident)
            return self._end(t, PROPOSED, f"not acted on: the act could not be recorded "
                                          f"({type(e).__name__}: {e}); nothing sent", run_mode)
        if not claim:
            await store_write(self.store, release_isolated(t.node, t.incident))
            if claim.refused:
                return self._end(t, PROPOSED, f"not acted on: {claim.refused}", run_mode)
            return self._end(t, SKIPPED, "the act was recorded already", run_mode, step=False)
        self._step(t, ACTED, PROPOSED, f"{action} on node {t.node}", run_mode)
        # The acted record committed before the PATCH goes out: a replica taking over after a crash
        # here finds the act and settles it (settle()) rather than take it for one never made.
        await asyncio.wrap_future(self.store.barrier())
        try:
            api = await self._off_loop(self._client, policy)
            if how == "taint":
                await self._off_loop(api.taint, t.node, TAINT_KEY, t.taint_value, TAINT_EFFECT)
            else:
                await self._off_loop(api.cordon, t.node)
        except Exception as e:  # an act recorded ends failed, whatever went wrong
            await self._release(t)
            if not isinstance(e, KubeError):
                log.exception("node isolation %s: the PATCH failed", t.incident)
            out = self._end(t, FAILED, str(e) if isinstance(e, KubeError) else f"{type(e).__name__}: {e}",
                            run_mode)
            await self._file_ticket(t, out, run_mode)
            return out
        try:
            events = await self._events(api, t, node, how)
        except Exception as e:  # the node is isolated: an Event lost is logged
            log.exception("node isolation %s: posting the Events failed", t.incident)
            out = self._end(t, DONE, f"{action} on node {t.node}; Events failed ({type(e).__name__})",
                            run_mode)
        else:
            out = self._end(t, DONE, f"{action} on node {t.node}; Events: {', '.join(events) or 'none'}",
                            run_mode, events=events)
        await self._file_ticket(t, out, run_mode)
        return out

    async def _release(self, t: Trigger) -> None:
        try:
            await store_write(self.store, release_isolated(t.node, t.incident))
        except Exception:
            log.exception("node isolation %s: giving back the minHealthy slot failed", t.incident)

    def _dry_run_why(self, mode: str, node: str) -> str:
        if self.view is None:
            return "" if mode == MODE_ON else f"mode {mode}"
        return self.view().dry_run_why(node)

    async def _held_back(self, node: str) -> str:
        """Why the act may not go out now ("" when it may): the mode, the pause, the breaker and
        actions.isolate_node as they stand now (mark_acted checks the store's switches again in its
        transaction)."""
        if self.refresh is not None:
            await self.refresh()
        policy = self.policy()
        if not policy.isolate_node:
            return "actions.isolate_node was turned off before the act"
        mode = self._mode(policy)
        if mode == MODE_OFF:
            return "mode off before the act"
        why = self._dry_run_why(mode, node)
        return f"{why} before the act" if why else ""

    async def _opted_out_now(self, node: str) -> str:
        """The node's labels read afresh right before the act (the re-check's GET may be seconds old):
        why the act is held back, "" when it may go out. Labels that cannot be read hold it back too:
        the node may have opted out since."""
        if self.labels is None:
            return ""
        labels, why = await self.labels.labels_now(node)
        if why:
            return f"node labels could not be read: {why}"
        view = self.nodes.get(node)
        capabilities = (view.hello.capabilities if view is not None and view.hello is not None
                        else (CAPABILITY,))
        return node_opt_out(node, capabilities, labels) or ""

    async def _recheck(self, t: Trigger, policy: RemediationPolicy,
                       how: str) -> tuple[str, NodeState | None, int]:
        """("", the node, the GPU nodes) when every guard passes; else why not."""
        try:
            api = await self._off_loop(self._client, policy)  # the first imports the client: off the loop
            node = await self._off_loop(api.node, t.node)
        except KubeError as e:
            return str(e), None, 0
        if self.labels is not None:
            self.labels.put(node)
        isolated = await self._isolated(api, exclude=t.node)
        if t.node in isolated:
            return f"node {t.node} is isolated by ghostgpu already", None, 0
        if (node.has_taint(TAINT_KEY, TAINT_EFFECT) if how == "taint" else node.unschedulable):
            return f"node {t.node} is {'tainted' if how == 'taint' else 'cordoned'} already", None, 0
        view = self.nodes.get(t.node)
        # The collector acts here, not the tracer: a node whose tracer is not connected (a wedged node)
        # is judged by its label alone; a tracer started with --remediation off opts its node out.
        capabilities = (view.hello.capabilities if view is not None and view.hello is not None
                        else (CAPABILITY,))
        opted_out = node_opt_out(t.node, capabilities, node.labels)
        if opted_out:
            return opted_out, node, 0
        gpu_nodes = await self._gpu_nodes()
        healthy = min_healthy(gpu_nodes, len(isolated), policy.breaker.max_isolated_nodes_pct)
        return ("" if healthy.allowed else f"minHealthy: {healthy.reason}"), node, gpu_nodes

    async def _gpu_nodes(self) -> int:
        if self.gpu_nodes is not None:
            return self.gpu_nodes()
        stored = await store_read(self.store, select_node_states())
        return gpu_node_count(self.nodes, stored)

    async def _isolated(self, api: KubeApi, exclude: str = "") -> list[str]:
        """The nodes isolated by ghostgpu, after dropping those a human has cleared since: each row (but
        `exclude`'s, read by the caller, and claims younger than CLAIM_GRACE_S) is checked with a GET;
        a node without the taint (or no longer cordoned) loses its row, audited."""
        rows = await store_read(self.store, select_isolated_nodes)
        young_ns = time.time_ns() - int(CLAIM_GRACE_S * 1e9)
        out: list[str] = []
        for row in rows:
            if row.node == exclude or row.since_unix_ns > young_ns or row.incident in self._acting:
                out.append(row.node)
                continue
            try:
                state = await self._off_loop(api.node, row.node)
            except KubeError as e:
                if "404" not in str(e):  # unknown: keep counting it
                    out.append(row.node)
                    continue
                state = None  # the node is gone from the cluster: nothing isolates it any more
            if state is not None and _isolated_still(state, row.how):
                out.append(row.node)
                continue
            if await store_write(self.store, release_isolated(row.node, row.incident)):
                self._cleared(row, "gone from the cluster" if state is None else
                              ("untainted" if row.how == "taint" else "uncordoned"))
        return out

    def _cleared(self, row: IsolatedNode, what: str) -> None:
        reason = f"cleared by a human: node {row.node} {what} since ghostgpu isolated it"
        record = None
        if self.audit is not None:
            record = self.audit(f"remediation.{OUTCOME}", COLLECTOR, DONE, remediation=ISOLATE_NODE,
                                node=row.node, incident=row.incident, trigger=row.trigger_kind, reason=reason)
        seq = int(getattr(record, "seq", 0) or 0)
        detail = json.dumps({"reason": reason, "trigger": row.trigger_kind}, sort_keys=True)
        self.store.submit([Store.op_call(add_step(row.incident, 0, time.time_ns(), OUTCOME, DONE, detail,
                                                  seq))])
        log.info("node isolation %s: %s", row.incident, reason)

    # ---- settling an act whose outcome never came ------------------------------------------------

    async def settle(self) -> int:
        """The isolations acted on more than SETTLE_AFTER_S ago with no outcome stored (the replica
        acting on them stopped): the node carries the taint or the cordon → done, else failed (and its
        minHealthy slot is given back). How many were settled; an API error leaves them for next time."""
        rows = await store_read(self.store, select_unsettled_isolations(
            time.time_ns() - int(SETTLE_AFTER_S * 1e9)))
        rows = [r for r in rows if r.incident not in self._acting]
        if not rows:
            return 0
        policy = self.policy()
        settled = 0
        for row in rows:
            how = str(row.details().get("how", "taint"))
            try:
                api = await self._off_loop(self._client, policy)
                state = await self._off_loop(api.node, row.node)
            except KubeError as e:
                log.warning("node isolation %s: cannot settle it yet: %s", row.incident, e)
                continue
            done = _isolated_still(state, how)
            t = Trigger(kind=str(row.details().get("trigger", "")), node=row.node, incident=row.incident,
                        reason=row.reason, advice="", taint_value="", finding_id=row.finding_id,
                        namespace=row.namespace)
            what = ("tainted" if how == "taint" else "cordoned") if done else (
                "not tainted" if how == "taint" else "not cordoned")
            reason = f"settled after the replica acting on it stopped: node {row.node} is {what}"
            # Every replica settles: only the one whose update hit the row records the outcome.
            if not await store_write(self.store, settle_isolation(row.incident, DONE if done else FAILED,
                                                                  reason, time.time_ns())):
                continue
            if not done:
                await self._release(t)
            out = self._end(t, DONE if done else FAILED, reason, row.mode or MODE_ON)
            await self._file_ticket(t, out, row.mode or MODE_ON)
            settled += 1
        return settled

    # ---- the ticket ------------------------------------------------------------------------------

    async def _file_ticket(self, t: Trigger, out: Outcome, mode: str) -> None:
        """The incident's ticket (collector/tickets.py): its actions are the incident's steps."""
        if self.ticket is None:
            return
        from ghostgpu.collector.tickets import TicketFinding, ticket_document

        try:
            steps = await store_read(self.store, select_steps_of(t.incident, ISOLATE_NODE))
            ns, pod = t.pods[0] if t.pods else (t.namespace, "")
            finding = TicketFinding(id=t.finding_id, cls="", node=t.node, namespace=ns, pod=pod, container="",
                                    container_id="", pid=0, comm="", exe="", gpu=None, opened_unix_ns=0)
            seq = max((s.audit_seq for s in steps), default=0)
            doc = ticket_document(
                incident=t.incident, audit_seq=seq, mode=mode, finding=finding,
                pods=[{"namespace": n, "pod": p} for n, p in t.pods],
                evidence={"trigger": t.kind, "reason": t.reason, "advice": t.advice, "outcome": out.state,
                          "outcome_reason": out.reason, "events": list(out.events)},
                actions=steps)
            self.ticket(doc)
        except Exception:
            log.exception("node isolation %s: filing its ticket failed", t.incident)

    async def _events(self, api: KubeApi, t: Trigger, node: NodeState, how: str) -> tuple[str, ...]:
        """The Event on the Node, and on each pod known; one that fails is logged, the isolation stands."""
        names: list[str] = []
        about = [node_ref(node), *(ObjectRef("Pod", pod, ns) for ns, pod in t.pods)]
        for ref in about:
            try:
                names.append(await self._off_loop(api.event, ref, EVENT_REASON, t.message(how), self.clock(),
                                                  self.replica_id))
            except KubeError as e:
                log.error("node isolation: %s", e)
        return tuple(names)

    def _client(self, policy: RemediationPolicy) -> KubeApi:
        kubeconfig = policy.isolation.kubeconfig
        if self._api is None or kubeconfig != self._api_config:
            self._api, self._api_config = KubeApi(kubeconfig), kubeconfig
        return self._api

    # ---- steps -----------------------------------------------------------------------------------

    def _step(self, t: Trigger, step: str, state: str, reason: str, mode: str, **extra: Any) -> int:
        record = None
        if self.audit is not None:
            record = self.audit(f"remediation.{step}", COLLECTOR, state, remediation=ISOLATE_NODE,
                                node=t.node, incident=t.incident, trigger=t.kind, finding=t.finding_id,
                                mode=mode, reason=reason, **extra)
        seq = int(getattr(record, "seq", 0) or 0)
        detail = json.dumps({"reason": reason, "mode": mode, "trigger": t.kind, **extra}, sort_keys=True)
        now = time.time_ns()
        self.store.submit([Store.op_call(add_step(t.incident, t.finding_id, now, step, state, detail, seq)),
                           Store.op_call(set_state(t.incident, state, reason, mode, now, seq))])
        return seq

    def _end(self, t: Trigger, state: str, reason: str, mode: str, step: bool = True,
             events: tuple[str, ...] = ()) -> Outcome:
        if step:
            self._step(t, OUTCOME, state, reason, mode, **({"events": list(events)} if events else {}))
        key = (t.kind, state)
        self.outcomes_total[key] = self.outcomes_total.get(key, 0) + 1
        level = logging.WARNING if state in (DONE, FAILED) else logging.INFO
        log.log(level, "node isolation %s: %s: %s", t.incident, state, reason)
        return Outcome(state, reason, events)

    # ---- off the loop ----------------------------------------------------------------------------

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
