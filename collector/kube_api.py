"""The collector's few calls to the Kubernetes API, for node isolation (collector/isolation.py,
docs/REMEDIATION.md), over the official Python client (`kubernetes`), typed.

    api = KubeApi(kubeconfig="")           # "": the pod's service account (in-cluster config)
    api.node("gpu-7")                      # NodeState: labels, taints, unschedulable
    api.taint("gpu-7", TAINT_KEY, "xid-79", "NoSchedule")
    api.cordon("gpu-7")
    api.event(node_ref(state), "GPUUnhealthy", "GPU 0 ...")  # a core/v1 Event, type Warning

Nothing else: the ClusterRole ghostgpu-node-isolation (deploy/kubernetes/isolation-rbac.yaml) grants
exactly nodes get and patch, events create. The package is imported on the first KubeApi (isolation
on), never at the collector's start: a collector without it starts as before, and isolation says in
one line which package to install.

A taint is a GET then a JSON merge PATCH of the whole spec.taints list with the GET's
metadata.resourceVersion, which the API server takes as a precondition: spec.taints has no merge key
(k8s.io/api core/v1), so a patch replaces the list, and a writer in between (another taint, kubelet,
an operator's kubectl) makes it 409 Conflict instead of being overwritten; then the GET and PATCH run
again, CONFLICT_RETRIES times at most. `kubectl taint` does the same. A cordon is kubectl's strategic
merge patch {"spec": {"unschedulable": true}}. Every call blocks: the caller runs them off the event
loop (an executor). Every failure is a KubeError of one line naming the API server, the call and
what to do.

The client's own patch content type is not used: its generator picks the first JSON type of the
operation's list, json-patch+json (kubernetes 37), for any body; each PATCH here names its type.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

log = logging.getLogger(__name__)

CLUSTER_ROLE = "ghostgpu-node-isolation"
RBAC_MANIFEST = "deploy/kubernetes/isolation-rbac.yaml"
CONFLICT_RETRIES = 5
TIMEOUT_S = 10.0
EVENT_COMPONENT = "ghostgpu"
NODE_EVENTS_NAMESPACE = "default"  # where kubelet posts a Node's events: a Node has no namespace
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


class KubeError(Exception):
    """One line: the API server, the call, what went wrong and what to do."""


class KubeUnconfigured(KubeError):
    """No Kubernetes API is configured at all: the client package is missing, or no kubeconfig is set
    and the collector runs outside a cluster (no KUBERNETES_SERVICE_HOST). Any other KubeError means an
    API is configured but could not be used."""


@dataclass(frozen=True)
class Taint:
    key: str
    value: str
    effect: str  # NoSchedule | PreferNoSchedule | NoExecute

    def to_json(self) -> dict[str, str]:
        out = {"key": self.key, "effect": self.effect}
        if self.value:
            out["value"] = self.value
        return out


@dataclass(frozen=True)
class NodeState:
    name: str
    uid: str
    resource_version: str
    labels: dict[str, str]
    taints: tuple[Taint, ...]
    unschedulable: bool
    raw_taints: tuple[dict[str, Any], ...] = ()  # as the server sent them (timeAdded kept)

    def has_taint(self, key: str, effect: str) -> bool:
        return any(t.key == key and t.effect == effect for t in self.taints)


@dataclass(frozen=True)
class ObjectRef:
    """What an Event is about: a Node (no namespace) or a Pod."""

    kind: str
    name: str
    namespace: str = ""
    uid: str = ""


def node_state(obj: dict[str, Any]) -> NodeState:
    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    raw = tuple(spec.get("taints") or ())
    return NodeState(name=meta.get("name", ""), uid=meta.get("uid", ""),
                     resource_version=meta.get("resourceVersion", ""), labels=dict(meta.get("labels") or {}),
                     taints=tuple(Taint(t.get("key", ""), t.get("value", ""), t.get("effect", ""))
                                  for t in raw),
                     unschedulable=bool(spec.get("unschedulable")), raw_taints=raw)


def node_ref(node: NodeState) -> ObjectRef:
    return ObjectRef("Node", node.name, "", node.uid)


def taint_patch(node: NodeState, taint: Taint) -> dict[str, Any] | None:
    """The merge patch that adds `taint` (replacing one of its key and effect), with the node's
    resourceVersion as the precondition; None when the node carries it already."""
    if any(t == taint for t in node.taints):
        return None
    kept = [dict(raw) for raw, t in zip(node.raw_taints, node.taints, strict=True)
            if not (t.key == taint.key and t.effect == taint.effect)]
    return {"metadata": {"resourceVersion": node.resource_version},
            "spec": {"taints": [*kept, taint.to_json()]}}


def cordon_patch() -> dict[str, Any]:
    return {"spec": {"unschedulable": True}}


def _timestamp(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def event_body(about: ObjectRef, reason: str, message: str, now_unix_s: float,
               host: str = "") -> dict[str, Any]:
    """A core/v1 Event, type Warning, from component ghostgpu (kubectl describe shows it on the object)."""
    namespace = about.namespace or NODE_EVENTS_NAMESPACE
    involved: dict[str, str] = {"apiVersion": "v1", "kind": about.kind, "name": about.name}
    if about.namespace:
        involved["namespace"] = about.namespace
    if about.uid:
        involved["uid"] = about.uid
    stamp = _timestamp(now_unix_s)
    source = {"component": EVENT_COMPONENT, **({"host": host} if host else {})}
    return {
        # kubelet's form: the object's name, a dot, the time in hex (unique enough; a clash is a 409)
        "metadata": {"name": f"{about.name}.{int(now_unix_s * 1e9):x}", "namespace": namespace},
        "involvedObject": involved, "reason": reason, "message": message[:1024], "type": "Warning",
        "source": source, "reportingComponent": EVENT_COMPONENT, "reportingInstance": host or EVENT_COMPONENT,
        "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
    }


def _client_module() -> Any:
    try:
        import kubernetes  # the official client; imported only once isolation is on
    except ImportError:
        raise KubeUnconfigured("node isolation needs the Python package `kubernetes` (the official client), "
                               "which is not installed: pip install kubernetes, or turn "
                               "remediation.actions.isolate_node off") from None
    return kubernetes


class KubeApi:
    """See the module docstring. kubeconfig: a kubeconfig file's path; "" for the in-cluster config."""

    def __init__(self, kubeconfig: str = "", timeout_s: float = TIMEOUT_S,
                 conflict_retries: int = CONFLICT_RETRIES) -> None:
        k8s = _client_module()
        self.timeout_s, self.conflict_retries = timeout_s, conflict_retries
        self._exception = k8s.client.exceptions.ApiException
        try:
            if kubeconfig:
                client = k8s.config.new_client_from_config(config_file=kubeconfig)
            else:
                cfg = k8s.client.Configuration()
                k8s.config.load_incluster_config(client_configuration=cfg)
                client = k8s.client.ApiClient(cfg)
        except (k8s.config.ConfigException, OSError, ValueError, TypeError) as e:
            where = f"kubeconfig {kubeconfig}" if kubeconfig else "the in-cluster service account"
            # Outside a cluster, with no kubeconfig, there is no API to reach: not an error of one.
            in_cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
            error = KubeError if kubeconfig or in_cluster else KubeUnconfigured
            raise error(f"kubernetes: cannot load {where} ({str(e).splitlines()[0] if str(e) else e!r}); "
                        "run the collector with the ghostgpu-collector ServiceAccount "
                        f"({RBAC_MANIFEST}) or set remediation.isolation.kubeconfig") from None
        self.server = str(client.configuration.host)
        self._core = k8s.client.CoreV1Api(client)

    # ---- the calls -------------------------------------------------------------------------------

    def node(self, name: str) -> NodeState:
        return node_state(self._call("get node", name, lambda: self._core.read_node(
            name, _preload_content=False, _request_timeout=self.timeout_s)))

    def taint(self, name: str, key: str, value: str, effect: str = "NoSchedule") -> bool:
        """Put the taint on; False when the node had it already (nothing sent)."""
        wanted = Taint(key, value, effect)
        for _ in range(self.conflict_retries + 1):
            patch = taint_patch(self.node(name), wanted)
            if patch is None:
                return False
            try:
                self._patch("patch node (taint)", name, patch, MERGE_PATCH)
                return True
            except _Conflict:
                continue  # someone wrote the node between the GET and the PATCH: read it again
        raise KubeError(f"kubernetes {self.server}: patch node {name} (taint): still 409 Conflict after "
                        f"{self.conflict_retries} retries (the node is written to constantly); try again "
                        "later")

    def cordon(self, name: str) -> bool:
        """Mark the node unschedulable; False when it was already."""
        if self.node(name).unschedulable:
            return False
        self._patch("patch node (cordon)", name, cordon_patch(), STRATEGIC_MERGE_PATCH)
        return True

    def event(self, about: ObjectRef, reason: str, message: str, now_unix_s: float, host: str = "") -> str:
        """Post a Warning Event about a Node or a Pod; its name."""
        body = event_body(about, reason, message, now_unix_s, host)
        namespace = body["metadata"]["namespace"]
        self._call("create event", f"{about.kind.lower()}/{about.name}",
                   lambda: self._core.create_namespaced_event(namespace, body, _preload_content=False,
                                                              _request_timeout=self.timeout_s))
        return str(body["metadata"]["name"])

    def _patch(self, what: str, name: str, body: dict[str, Any], content_type: str) -> dict[str, Any]:
        return self._call(what, name, lambda: self._core.patch_node(
            name, body, _content_type=content_type, _preload_content=False, _request_timeout=self.timeout_s))

    # ---- errors ----------------------------------------------------------------------------------

    def _call(self, what: str, name: str, fn: Any) -> dict[str, Any]:
        try:
            response = fn()
        except self._exception as e:
            if e.status == 409 and what.startswith("patch node (taint)"):
                raise _Conflict() from None
            raise KubeError(self._explain(what, name, int(e.status or 0), _status_message(e.body))) from None
        except Exception as e:  # urllib3's connection errors, timeouts: no HTTP answer at all
            raise KubeError(f"kubernetes {self.server}: {what} {name}: no answer ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}); check that the API server is "
                            "reachable from the collector") from None
        data = getattr(response, "data", b"") or b"{}"
        try:
            out = json.loads(data)
        except ValueError:
            raise KubeError(f"kubernetes {self.server}: {what} {name}: the answer is not JSON") from None
        return out if isinstance(out, dict) else {}

    def _explain(self, what: str, name: str, status: int, message: str) -> str:
        head = f"kubernetes {self.server}: {what} {name}: {status}"
        if status == 403:
            return (f"{head} Forbidden ({message}); bind the collector's ServiceAccount to the ClusterRole "
                    f"{CLUSTER_ROLE}: kubectl apply -f {RBAC_MANIFEST}")
        if status == 401:
            return f"{head} Unauthorized ({message}); the collector's credentials were refused: check them"
        if status == 404:
            return f"{head} Not Found ({message}); is {name} a node of this cluster?"
        return f"{head} ({message or 'no message'}); see the API server's log"


class _Conflict(Exception):
    pass


def _status_message(body: Any) -> str:
    try:
        status = json.loads(body or "{}")
    except (TypeError, ValueError):
        return str(body or "")[:200]
    return str(status.get("message", ""))[:300] if isinstance(status, dict) else ""


# ---- node labels, cached: the opt-out label for both engines ---------------------------------------------

LABELS_TTL_S = 30.0


class NodeLabels:
    """A node's labels from the API server (its opt-out label ghostgpu.io/remediation, for the kill
    engine and for isolation), cached per node for `ttl_s`:

        labels = NodeLabels(lambda: KubeApi(policy().isolation.kubeconfig))
        await labels.labels("gpu-7")   # {"ghostgpu.io/remediation": "off", ...}, or None
        await labels.labels_now("gpu-7")  # a fresh GET, right before an act: (labels, why not)

    None when the API is not configured (api_factory raised KubeError: no client package, no kubeconfig,
    not in a cluster) or not reachable; each kind of failure (unconfigured, unreachable) is logged once
    per node until a read succeeds. The GET blocks: it runs on an executor of its own, off the event
    loop. A failed read is cached for the TTL too, so a collector without an API server does not try
    on every tick. The api is made on the first read, and again after any failure (api_factory may
    read a reloaded kubeconfig)."""

    def __init__(self, api_factory: Callable[[], KubeApi], ttl_s: float = LABELS_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.api_factory, self.ttl_s, self.clock = api_factory, ttl_s, clock
        self._api: KubeApi | None = None
        self._cache: dict[str, tuple[float, dict[str, str] | None]] = {}  # node -> (read at, labels)
        self._logged: set[tuple[str, str]] = set()  # (node, kind of failure) logged since its last read
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ghostgpu-kube-labels")

    async def labels(self, node: str) -> Mapping[str, str] | None:
        now = self.clock()
        hit = self._cache.get(node)
        if hit is not None and now - hit[0] < self.ttl_s:
            return hit[1]
        labels = await asyncio.get_running_loop().run_in_executor(self._executor, self._read, node)
        self._cache[node] = (self.clock(), labels)
        return labels

    async def labels_now(self, node: str) -> tuple[Mapping[str, str] | None, str]:
        """A fresh GET, whatever the cache holds (and the cache updated), for the moment of acting:
        (labels, "") once read; (None, "") when no API is configured (KubeUnconfigured: there is no
        label to honour); (None, why) when one is configured but the read failed: the caller holds the
        act back rather than act on a node that may have opted out."""
        labels, why = await asyncio.get_running_loop().run_in_executor(self._executor, self._read_why, node)
        self._cache[node] = (self.clock(), labels)
        return labels, why

    def put(self, state: NodeState) -> None:
        """A node read elsewhere (isolation's own GET): fresh labels for the cache."""
        self._cache[state.name] = (self.clock(), dict(state.labels))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _read(self, node: str) -> dict[str, str] | None:
        return self._read_why(node)[0]

    def _read_why(self, node: str) -> tuple[dict[str, str] | None, str]:
        try:
            if self._api is None:
                self._api = self.api_factory()
            labels = dict(self._api.node(node).labels)
        except KubeError as e:
            self._log_once(node, "unconfigured" if self._api is None else "unreachable", str(e))
            self._api = None
            return None, "" if isinstance(e, KubeUnconfigured) else str(e)
        self._logged = {k for k in self._logged if k[0] != node}
        return labels, ""

    def _log_once(self, node: str, kind: str, line: str) -> None:
        if (node, kind) not in self._logged:
            self._logged.add((node, kind))
            log.warning("node labels of %s: %s (the opt-out label cannot be read; logged once until a "
                        "read succeeds)", node, line)
