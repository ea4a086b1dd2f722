"""What the direct Alertmanager push sends: alert names, labels and texts per finding and per GPU
fault, and the book of alerts (label set -> latest state) with what each Alertmanager has taken.

A GPU fault (Xid, collector/faults.py) is an instant, not a state: its alert (GhostGPUXid, one per
fault: its kernel log record's identity is a label) is sent with endsAt `fault_hold_s` after the later
of the fault and its storing (a fault delivered late still notifies), re-sent like any alert until
then, and Alertmanager resolves it at endsAt by itself. Its annotations name the pods the
fault hit; a fault whose CRI lookups are still running waits up to settle_s for those names.

Labels are an alert's identity in Alertmanager, so a finding whose labels change (CRI names that
arrive late) resolves its old label set and fires the new one. Empty label values are left out,
as Alertmanager drops them anyway (removeEmptyLabels in its v2 handler): identity is computed on
what Alertmanager will store. Not thread-safe: AlertPusher holds its lock around every call.
"""

from __future__ import annotations

import logging
import re
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import islice

from ghostgpu.collector.cri import PENDING_ERROR
from ghostgpu.collector.faults import fault_key
from ghostgpu.collector.faults import names_pending as hit_names_pending

from ghostgpu.common.model.display import hit_notes, hit_where
from ghostgpu.common.wire.convert import class_from_proto
from ghostgpu.v1 import query_pb2, stream_pb2

log = logging.getLogger("ghostgpu.alertpush")

SOURCE = "ghostgpu-collector"
# class -> (alertname, severity); deploy/prometheus/ghostgpu-rules.yaml uses the same.
FINDING_ALERTS: dict[str, tuple[str, str]] = {
    "hidden": ("GhostGPUHiddenConsumer", "critical"),
    "orphaned": ("GhostGPUOrphanedConsumer", "critical"),
    "ghost": ("GhostGPUGhostMemory", "warning"),
    "unallocated": ("GhostGPUUnallocatedAccess", "warning"),
    "unattributed": ("GhostGPUUnattributedConsumer", "warning"),
}
# alertname -> annotations. Plain str.format fields only, each one a label: {x} here is
# {{ $labels.x }} in the rules file (a test compares the two), so both paths say the same words.
_WHERE = "node {node} GPU {gpu} ({gpu_uuid}), pod {namespace}/{pod}, PID {pid} ({comm})"
# Hidden, orphaned and unattributed consumers may hold node-wide devices only; their gpu label is empty.
_NODE_WIDE = (" An empty GPU means it holds only node-wide NVIDIA devices (nvidiactl, nvidia-uvm): no GPU "
              "memory, but the driver cannot be reloaded or upgraded while it does.")
ALERT_ANNOTATIONS: dict[str, dict[str, str]] = {
    "GhostGPUHiddenConsumer": {
        "summary": "Hidden GPU consumer on " + _WHERE,
        "description": (
            "PID {pid} ({comm}) in container {container} of pod {namespace}/{pod} holds GPU {gpu} "
            "({gpu_uuid}) on node {node}, but the NVIDIA driver does not list it: nvidia-smi, NVML and "
            "dcgm-exporter cannot see it or its memory. Check that the pod requested this GPU "
            "(ghostgpu ps --node {node} -o wide shows its devices and allocation); stop the process if "
            "it should not have the GPU." + _NODE_WIDE),
    },
    "GhostGPUOrphanedConsumer": {
        "summary": "Orphaned GPU consumer on " + _WHERE,
        "description": (
            "PID {pid} ({comm}) still holds GPU {gpu} ({gpu_uuid}) on node {node} although its owner is "
            "gone: container {container} of pod {namespace}/{pod} exited or was removed, or its parent "
            "died. The GPU and its memory stay taken until it ends: kill PID {pid} on node {node} (drain "
            "and reboot the node if it cannot be killed) and find why the runtime left it behind."
            + _NODE_WIDE),
    },
    "GhostGPUGhostMemory": {
        "summary": "Ghost GPU memory on " + _WHERE,
        "description": (
            "The NVIDIA driver lists PID {pid} on GPU {gpu} ({gpu_uuid}) of node {node}, but no such "
            "process exists (or the PID was reused): GPU memory is held by a process that is gone. Look "
            "for a leaked context or a stuck process, then reset GPU {gpu} (nvidia-smi --gpu-reset) or "
            "drain and reboot node {node}."),
    },
    "GhostGPUUnallocatedAccess": {
        "summary": "Unallocated GPU access on " + _WHERE,
        "description": (
            "The kubelet did not allocate GPU {gpu} ({gpu_uuid}) to container {container} of pod "
            "{namespace}/{pod}, yet its PID {pid} ({comm}) opened it on node {node}: it bypasses the "
            "device plugin (privileged, a hostPath /dev mount, NVIDIA_VISIBLE_DEVICES=all) and can "
            "collide with the pod the GPU was given to. Remove that access and request the GPU through "
            "resources.limits."),
    },
    "GhostGPUUnattributedConsumer": {
        "summary": "Unattributed GPU consumer on " + _WHERE,
        "description": (
            "PID {pid} ({comm}) holds GPU {gpu} ({gpu_uuid}) on node {node} from outside any container, "
            "and the NVIDIA driver does not list it. Find what started it (ps -o pid,user,args -p {pid} "
            "on the node); if it is a node daemon that holds GPUs by design, add it to the tracer's "
            "system_allowlist, else stop it." + _NODE_WIDE),
    },
}
PLACEHOLDERS = ("node", "gpu", "gpu_uuid", "namespace", "pod", "container", "pid", "comm")
# One alert per GPU fault; its severity is the Xid catalogue's (tracer/xid_catalog.py), an Xid the
# catalogue does not know (or a line that did not parse) a warning: Alertmanager routes by severity.
FAULT_ALERT = "GhostGPUXid"
FAULT_SEVERITIES = frozenset({"critical", "warning", "info"})
BUILTIN_LABELS = ("alertname", "severity", "node", "gpu", "gpu_uuid", "class", "namespace", "pod",
                  "container", "pid", "comm", "source", "xid", "fault_id", "origin")
MAX_FAULT_ALERTS = 10_000  # fault alerts kept for re-sending; past this the oldest go first
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")  # the legacy charset every Alertmanager accepts
MAX_RESOLVED_ALERTS = 10_000  # resolved alerts kept for re-sending; past this the oldest go first

Key = tuple[tuple[str, str], ...]
Due = tuple[Key, int, dict[str, object]]  # label set, version, the JSON object to POST


def check_label_name(name: str, flag: str) -> None:
    if not _LABEL_NAME.fullmatch(name) or name.startswith("__"):
        raise ValueError(f"{flag} {name!r}: a label name is letters, digits and _ (not first a digit, "
                         "not starting with __)")


def rfc3339(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def finding_labels(f: query_pb2.Finding, extra: dict[str, str]) -> dict[str, str] | None:
    """The alert's labels (empty values left out); None for a class that has no alert."""
    cc = f.consumer
    c, k8s = cc.consumer, cc.k8s
    cls = str(class_from_proto(getattr(c, "class")))
    if cls not in FINDING_ALERTS:
        return None
    alertname, severity = FINDING_ALERTS[cls]
    labels = {"alertname": alertname, "severity": severity, "node": f.node or c.node,
              "gpu": "" if c.gpu == -1 else str(c.gpu), "gpu_uuid": c.gpu_uuid, "class": cls,
              "namespace": k8s.namespace, "pod": k8s.pod, "container": k8s.container,
              "pid": str(c.process.pid), "comm": c.process.comm, "source": SOURCE, **extra}
    return {k: v for k, v in labels.items() if v}


def alert_annotations(labels: dict[str, str]) -> dict[str, str]:
    values = {k: labels.get(k, "") for k in PLACEHOLDERS}
    return {name: text.format_map(values) for name, text in ALERT_ANNOTATIONS[labels["alertname"]].items()}


def fault_labels(cf: query_pb2.ClusterFault, extra: dict[str, str]) -> dict[str, str]:
    """A fault's alert labels (empty values left out): where, which Xid, how bad, and its identity from
    the kernel log record (collector/faults.py fault_key), so that each fault is an alert of its own
    (two Xids of one kind on one GPU are two events) and one fault is one alert, however often it is
    offered (a restart, new pod names). `origin` says who wrote the kernel log line: "kernel" (the
    driver) or "user" (user space wrote it to /dev/kmsg: a drill or a test; tracer/faults.py), so a
    route can keep drills from paging."""
    f = cf.fault
    severity = f.severity if f.severity in FAULT_SEVERITIES else "warning"
    labels = {"alertname": FAULT_ALERT, "severity": severity, "node": cf.node,
              "gpu": "" if f.gpu < 0 else str(f.gpu), "gpu_uuid": f.gpu_uuid,
              "xid": "" if f.xid < 0 else str(f.xid), "fault_id": fault_key(cf), "origin": fault_origin(f),
              "source": SOURCE, **extra}
    return {k: v for k, v in labels.items() if v}


def fault_origin(f: stream_pb2.Fault) -> str:
    """Who wrote the fault's kernel log line: "kernel" (unset on the wire from an older tracer: the
    driver) or "user"."""
    return f.origin or "kernel"


def hit_name(hit: query_pb2.FaultHit) -> str:
    """namespace/pod when CRI named it, else the container ID's prefix, else "host"."""
    return hit_where(hit.k8s.namespace, hit.k8s.pod, hit.consumer.process.container_id)


def hit_pods(cf: query_pb2.ClusterFault) -> str:
    """The pods (or containers, or the host) a fault hit, each once, the named process's first."""
    return ", ".join(dict.fromkeys(hit_name(h) for h in cf.hits)) or "no process held the GPU"


def hit_detail(hit: query_pb2.FaultHit) -> str:
    """One hit as a phrase: PID (comm) in where, and what became of it (cli/faults.py's notes)."""
    k8s, c = hit.k8s, hit.consumer
    p = c.process
    where = hit_name(hit)
    if k8s.container:
        where = f"container {k8s.container} of pod {where}"
    notes = ["named by the driver"] if c.named else []
    notes += hit_notes(c.exited, k8s.resolution, k8s.container_state, p.container_id)
    tail = f" ({', '.join(notes)})" if notes else ""
    return f"PID {p.pid} ({p.comm or '?'}) in {where}{tail}"


def fault_annotations(cf: query_pb2.ClusterFault) -> dict[str, str]:
    f = cf.fault
    xid = f"Xid {f.xid}" if f.xid >= 0 else "An Xid line that did not parse"
    gpu = f"GPU {f.gpu}" if f.gpu >= 0 else "a GPU NVML did not match"
    ids = ", ".join(x for x in (f.gpu_uuid, f"PCI {f.pci_bus_id}" if f.pci_bus_id else "") if x)
    where = f"{gpu} ({ids})" if ids else gpu
    meaning = f.meaning or "not in the Xid catalogue"
    pods = hit_pods(cf)
    hits = "; ".join(hit_detail(h) for h in cf.hits) or "no process held the GPU"
    user = fault_origin(f) == "user"
    # A line user space wrote to /dev/kmsg is not the driver's word: the texts say so up front.
    writer = (f"A line user space (not the driver) wrote to node {cf.node}'s kernel log names" if user
              else f"The NVIDIA driver on node {cf.node} reported")
    drill = "User-written line: " if user else ""
    return {
        "summary": f"{drill}{xid} on node {cf.node} {gpu}: {meaning}; hit {pods}",
        "description": (
            f"{writer} {xid} for {where}: {meaning}. Its message: "
            f"{f.message or f.raw or '(none)'}. It hit {hits}. See NVIDIA's Xid catalogue for what to do; "
            f"`ghostgpu faults --node {cf.node} -o wide` lists it with the pods."),
        "pods": pods,
        "meaning": meaning,
        "message": f.message or f.raw,
    }


def names_pending(f: query_pb2.Finding) -> bool:
    """The CRI lookup for its container is running: names may come a moment later (about 10 ms
    through a tracer's relay). CRI unreachable or absent is not worth waiting for: send at once."""
    k8s = f.consumer.k8s
    return k8s.resolution == "unresolved" and not k8s.pod and k8s.error == PENDING_ERROR


@dataclass
class _Alert:
    body: dict[str, object]  # the JSON object POSTed
    version: int
    owner: int  # finding ID: a newer finding with the same labels takes the alert over


@dataclass
class _Finding:
    id: int
    starts_unix_s: float
    fired: list[Key] = field(default_factory=list)  # label sets sent firing, not yet resolved
    labels: dict[str, str] = field(default_factory=dict)


# While remediation is paused, or its breaker is open, every act is a dry run (collector/remediation.py):
# one alert for the cluster (each replica sends the same label set), resolved when neither holds.
PAUSED_ALERT = "GhostGPURemediationPaused"
PAUSED_ANNOTATIONS = {
    "summary": "ghostgpu remediation acts only in dry-run: {why}",
    "description": ("Remediation is paused (`ghostgpu remediate pause`) or its circuit breaker is open (too "
                    "many acts in its window): every orphaned GPU holder is only reported, none is killed. "
                    "Now: {why}. `ghostgpu remediate status` says more; `ghostgpu remediate resume` ends a "
                    "pause; an open breaker closes by itself as its window passes."),
}


class AlertBook:
    """Per Alertmanager, `unsent` holds the label sets whose latest version it has not taken (sent
    first, at once), and `resend` the rest, queued every resend_s: a loop step costs what changed,
    not the whole book, however many findings are open."""

    def __init__(self, targets: list[str], extra_labels: dict[str, str], *, resend_s: float,
                 resolved_keep_s: float, settle_s: float) -> None:
        self.extra = extra_labels
        self.resend_s, self.resolved_keep_s, self.settle_s = resend_s, resolved_keep_s, settle_s
        self.alerts: dict[Key, _Alert] = {}
        self.findings: dict[int, _Finding] = {}
        self.held: dict[int, float] = {}  # finding ID -> when to stop waiting for its names (mono)
        self.resolved: dict[Key, float] = {}  # resolved alerts in resolution order (mono time)
        self.unsent: dict[str, dict[Key, None]] = {t: {} for t in targets}  # an ordered set per target
        self.taken_by: dict[str, dict[Key, float]] = {t: {} for t in targets}  # when it took it (mono)
        self.resend: dict[str, deque[Key]] = {t: deque() for t in targets}
        self.cycle_mono: dict[str, float] = dict.fromkeys(targets, 0.0)
        self.next_cycle_mono: dict[str, float] = dict.fromkeys(targets, 0.0)
        self._version = 0
        self._now = 0.0
        self._unknown_classes: set[str] = set()
        self.fault_hold_s = 3600.0  # AlertPusher sets it from --alert-fault-hold
        self.faults_held: dict[int, tuple[query_pb2.ClusterFault, float]] = {}  # ID -> (fault, until mono)
        self.fault_ends: dict[Key, float] = {}  # fault alerts -> their endsAt (unix s), oldest first
        # Finding ID -> what remediation did or would do: the alert's `remediation` annotation
        self.notes: dict[int, str] = {}
        self.paused_since_unix_s = 0.0  # the GhostGPURemediationPaused alert fires since; 0: it does not

    # ---- findings in ----------------------------------------------------------------------------

    def apply(self, events: Iterable[query_pb2.FindingEvent], now_mono: float) -> bool:
        """Take finding events (the latest per finding) and due holds; True when an alert changed."""
        self._now = now_mono
        changed = False
        for event in events:
            changed |= self._event(event)
        for fid in [fid for fid, until in self.held.items() if until <= now_mono]:
            del self.held[fid]  # settle_s passed without names: send what is known
            self._fire(self.findings[fid])
            changed = True
        if self.resolved and (len(self.resolved) > MAX_RESOLVED_ALERTS
                              or self._first_resolved_mono() + self.resolved_keep_s <= now_mono):
            self._expire(now_mono)
        return changed

    # ---- remediation in ------------------------------------------------------------------------------

    def apply_notes(self, notes: dict[int, str]) -> bool:
        """Take remediation notes (the latest per finding): a firing alert is sent again with its
        `remediation` annotation; True when one changed."""
        changed = False
        for fid, note in notes.items():
            if self.notes.get(fid) == note:
                continue
            self.notes[fid] = note
            st = self.findings.get(fid)
            if st is not None and st.fired and fid not in self.held:
                for key in st.fired:
                    self._put(key, st.labels, st, None)
                changed = True
        return changed

    def set_paused(self, reason: str, now_mono: float) -> bool:
        """Fire the GhostGPURemediationPaused alert with `reason`, or resolve it ("" ); True on a change."""
        self._now = now_mono
        labels = {"alertname": PAUSED_ALERT, "severity": "warning", "source": SOURCE, **self.extra}
        key = _key(labels)
        now_s = time.time()
        if reason:
            self.paused_since_unix_s = self.paused_since_unix_s or now_s
            annotations = {k: v.format(why=reason) for k, v in PAUSED_ANNOTATIONS.items()}
            body: dict[str, object] = {"labels": labels, "annotations": annotations,
                                       "startsAt": rfc3339(self.paused_since_unix_s)}
            self.resolved.pop(key, None)
        elif self.paused_since_unix_s and key in self.alerts:
            body = dict(self.alerts[key].body)
            body["endsAt"] = rfc3339(max(now_s, self.paused_since_unix_s))
            self.paused_since_unix_s = 0.0
            self.resolved[key] = now_mono
        else:
            return False
        self._version += 1
        self.alerts[key] = _Alert(body, self._version, 0)
        for unsent in self.unsent.values():
            unsent[key] = None
        return True

    # ---- GPU faults in ------------------------------------------------------------------------------

    def apply_faults(self, faults: Iterable[query_pb2.ClusterFault], now_mono: float) -> bool:
        """Take faults (the latest state of each) and due holds; True when an alert changed."""
        self._now = now_mono
        changed = False
        for cf in faults:
            pending = any(hit_names_pending(h.k8s) for h in cf.hits)
            held = cf.id in self.faults_held
            if pending and self.settle_s > 0 and (held or _fault_key(cf, self.extra) not in self.alerts):
                until = self.faults_held[cf.id][1] if held else now_mono + self.settle_s
                self.faults_held[cf.id] = (cf, until)
                continue
            self.faults_held.pop(cf.id, None)
            self._put_fault(cf)
            changed = True
        for fid in [fid for fid, (_, until) in self.faults_held.items() if until <= now_mono]:
            self._put_fault(self.faults_held.pop(fid)[0])  # settle_s passed without names: send what is known
            changed = True
        if self.fault_ends:
            self._expire_faults(time.time())
        return changed

    def _put_fault(self, cf: query_pb2.ClusterFault) -> None:
        labels = fault_labels(cf, self.extra)
        key = _key(labels)
        starts_unix_s = cf.ts_unix_ns / 1e9 or time.time()
        # The hold runs from when the collector stored it when that is later: a fault delivered late
        # (the tracer spooled it through a collector or Alertmanager outage) must still notify, and
        # an endsAt already past would have Alertmanager take it as resolved at once.
        ends_unix_s = max(starts_unix_s, cf.stored_unix_ns / 1e9) + self.fault_hold_s
        self._version += 1
        body: dict[str, object] = {"labels": labels, "annotations": fault_annotations(cf),
                                   "startsAt": rfc3339(starts_unix_s), "endsAt": rfc3339(ends_unix_s)}
        self.alerts[key] = _Alert(body, self._version, 0)
        self.fault_ends.pop(key, None)
        self.fault_ends[key] = ends_unix_s
        for unsent in self.unsent.values():
            unsent[key] = None
        while len(self.fault_ends) > MAX_FAULT_ALERTS:
            self._forget(next(iter(self.fault_ends)))

    def _expire_faults(self, now_unix_s: float) -> None:
        """Forget fault alerts resolved_keep_s past their endsAt that every Alertmanager took (it
        resolved them at endsAt by itself); ones not yet taken stay, to be sent as resolved."""
        for key, ends_unix_s in list(self.fault_ends.items()):
            if ends_unix_s + self.resolved_keep_s > now_unix_s:
                break  # in storing order, held from storing (or reading, if later): the rest end later
            if self._everywhere(key):
                self._forget(key)

    def _forget(self, key: Key) -> None:
        self.fault_ends.pop(key, None)
        self.alerts.pop(key, None)
        for target in self.unsent:
            self.unsent[target].pop(key, None)
            self.taken_by[target].pop(key, None)

    def release(self, finding_ids: Iterable[int]) -> bool:
        """Stop sending these findings' alerts, resolving nothing: another collector replica owns their
        node now and sends the same label sets (Alertmanager keeps one alert per label set)."""
        changed = False
        for fid in finding_ids:
            self.held.pop(fid, None)
            self.notes.pop(fid, None)
            st = self.findings.pop(fid, None)
            if st is None:
                continue
            for key in st.fired:
                alert = self.alerts.get(key)
                if alert is not None and alert.owner == fid:
                    self.resolved.pop(key, None)
                    self._forget(key)
                    changed = True
        return changed

    def _first_resolved_mono(self) -> float:
        return next(iter(self.resolved.values()))

    def _event(self, event: query_pb2.FindingEvent) -> bool:
        f = event.finding
        labels = finding_labels(f, self.extra)
        if labels is None:
            cls = str(class_from_proto(getattr(f.consumer.consumer, "class")))
            if cls not in self._unknown_classes:
                self._unknown_classes.add(cls)
                log.warning("alertpush: finding class %r has no alert; findings of it are not pushed", cls)
            return False
        st = self.findings.get(f.id)
        if event.kind == query_pb2.FindingEvent.KIND_RESOLVED:
            ends_unix_s = f.resolved_unix_ns / 1e9 if f.resolved_unix_ns else time.time()
            if st is None:
                st = _Finding(f.id, f.opened_unix_ns / 1e9 or ends_unix_s)
            self.findings.pop(f.id, None)
            self.held.pop(f.id, None)
            if not st.fired:  # resolved while held (or before we saw it open): one resolved alert
                st.labels = labels
                self._put(_key(labels), labels, st, ends_unix_s)
            for key in st.fired:
                self._resolve(key, st, ends_unix_s)
            self.notes.pop(f.id, None)
            return True
        if st is None:  # OPENED, or CHANGED of a finding opened before this watcher
            st = self.findings[f.id] = _Finding(f.id, f.opened_unix_ns / 1e9 or time.time(), labels=labels)
            if self.settle_s > 0 and names_pending(f):
                self.held[f.id] = self._now + self.settle_s
                return False
            self._fire(st)
            return True
        st.labels = labels
        if f.id in self.held:
            if names_pending(f):
                return False
            del self.held[f.id]
            self._fire(st)
            return True
        if _key(labels) in st.fired:
            return False  # a change the labels do not show (memory, reason): nothing to send
        for key in st.fired:  # labels are identity: the old set ends now, the new one fires
            self._resolve(key, st, max(time.time(), st.starts_unix_s))
        self._fire(st)
        return True

    def _fire(self, st: _Finding) -> None:
        key = _key(st.labels)
        st.fired = [key]
        self._put(key, st.labels, st, None)

    def _resolve(self, key: Key, st: _Finding, ends_unix_s: float) -> None:
        alert = self.alerts.get(key)
        if alert is not None and alert.owner == st.id:  # not a newer finding's alert with the same labels
            self._put(key, dict(key), st, ends_unix_s)

    def _put(self, key: Key, labels: dict[str, str], st: _Finding, ends_unix_s: float | None) -> None:
        self._version += 1
        annotations = alert_annotations(labels)
        if note := self.notes.get(st.id):
            annotations["remediation"] = note
        body: dict[str, object] = {"labels": labels, "annotations": annotations,
                                   "startsAt": rfc3339(st.starts_unix_s)}
        if ends_unix_s is not None:
            body["endsAt"] = rfc3339(max(ends_unix_s, st.starts_unix_s))
        self.alerts[key] = _Alert(body, self._version, st.id)
        self.resolved.pop(key, None)
        if ends_unix_s is not None:
            self.resolved[key] = self._now
        for unsent in self.unsent.values():
            unsent[key] = None

    def _expire(self, now_mono: float) -> None:
        """Forget resolved alerts every Alertmanager took and kept past resolved_keep_s; past
        MAX_RESOLVED_ALERTS, the oldest whatever happened to them (bounded memory)."""
        over = len(self.resolved) - MAX_RESOLVED_ALERTS
        for key, resolved_mono in list(self.resolved.items()):
            if over > 0:
                over -= 1
            elif now_mono - resolved_mono < self.resolved_keep_s:
                break  # in resolution order: the rest are younger
            elif not self._everywhere(key):
                continue
            del self.resolved[key]
            del self.alerts[key]
            for target in self.unsent:
                self.unsent[target].pop(key, None)
                self.taken_by[target].pop(key, None)

    def _everywhere(self, key: Key) -> bool:
        return not any(key in unsent for unsent in self.unsent.values())

    # ---- alerts out -------------------------------------------------------------------------------

    def due(self, target: str, now_mono: float, max_batch: int) -> tuple[list[Due], float]:
        """(up to max_batch alerts `target` should get now, when to look again if none)."""
        unsent, taken, resend = self.unsent[target], self.taken_by[target], self.resend[target]
        if now_mono >= self.next_cycle_mono[target]:
            self.cycle_mono[target] = now_mono
            self.next_cycle_mono[target] = now_mono + self.resend_s
            resend.clear()
            resend.extend(k for k in self.alerts if k not in unsent)
        batch = [(k, self.alerts[k].version, self.alerts[k].body) for k in islice(unsent, max_batch)]
        cycle = self.cycle_mono[target]
        while resend and (resend[0] not in self.alerts or taken.get(resend[0], 0.0) >= cycle):
            resend.popleft()  # re-sent already (or gone): the queue's front is what is still due
        for key in resend:
            if len(batch) >= max_batch:
                break
            if key in self.alerts and key not in unsent and taken.get(key, 0.0) < cycle:
                batch.append((key, self.alerts[key].version, self.alerts[key].body))
        next_mono = self.next_cycle_mono[target]
        if self.held:
            next_mono = min(next_mono, min(self.held.values()))
        if self.faults_held:
            next_mono = min(next_mono, min(until for _, until in self.faults_held.values()))
        if self.resolved and (expire_mono := self._first_resolved_mono() + self.resolved_keep_s) > now_mono:
            next_mono = min(next_mono, expire_mono)
        return batch, next_mono

    def unsent_resolutions(self, target: str, max_batch: int) -> list[Due]:
        out = [(k, self.alerts[k].version, self.alerts[k].body) for k in self.unsent[target]
               if k in self.resolved]
        return out[-max_batch:]

    def taken(self, target: str, sent: list[tuple[Key, int]], now_mono: float) -> None:
        unsent, taken = self.unsent[target], self.taken_by[target]
        for key, version in sent:
            alert = self.alerts.get(key)
            if alert is not None:
                taken[key] = now_mono
                if alert.version == version:  # else it changed while in flight: still unsent
                    unsent.pop(key, None)

    def pending(self) -> int:
        """Alerts some Alertmanager has not taken at their latest version, plus findings held to settle."""
        return len(self.held) + len(self.faults_held) + len(set().union(*self.unsent.values()))


def _key(labels: dict[str, str]) -> Key:
    return tuple(sorted(labels.items()))


def _fault_key(cf: query_pb2.ClusterFault, extra: dict[str, str]) -> Key:
    return _key(fault_labels(cf, extra))
