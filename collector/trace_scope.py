"""Where a trace scope runs: (namespace, pod, container) -> the nodes and container ids it covers.

Each node's runtime is asked through the collector's CRI transport for that node (the tracer's
relay, collector/relay.py, or the collector's own socket): one ListContainers filtered by the
kubelet's labels (io.kubernetes.pod.namespace, io.kubernetes.pod.name), or by id when the scope
names a container id (prefix) alone. The labels are checked again here, as a runtime may ignore
a selector. Containers CREATED or RUNNING are in scope; exited ones only prove that the pod or
namespace exists, so that the refusal can say what is missing: the pod, the container in it, or
a running container. What a node with no connected tracer is remembered to run (the cluster
table's names, PodResources' allocations) turns "not found" into "that node has no tracer".

The blocking CRI calls run on worker threads (asyncio.to_thread); the rest on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from ghostgpu.collector.cri_fetch import (
    LABEL_CONTAINER_NAME,
    LABEL_POD_NAME,
    LABEL_POD_NAMESPACE,
    CriCallError,
    CriTransport,
    normalize_container_id,
)

from ghostgpu.common.model.trace import TraceScope
from ghostgpu.k8s import cri_runtime_v1_pb2 as cri
from ghostgpu.v1 import trace_pb2

if TYPE_CHECKING:
    from ghostgpu.collector.ingest import IngestSession
    from ghostgpu.collector.nodes import NodeView

    from ghostgpu.common.model.consumers import ClusterConsumer, ConsumerKey

ACTIVE_STATES = (cri.CONTAINER_CREATED, cri.CONTAINER_RUNNING)
CAPABILITY = "trace"  # what a tracer's Hello offers when it can run sessions
CRI_TIMEOUT_S = 5.0
Names = tuple[str, str, str]  # namespace, pod, container
Memory = tuple[str, str, str, str, str]  # node, namespace, pod, container, container id


class TraceError(Exception):
    """A refused trace request: the gRPC code and one line naming the thing and what to do."""

    def __init__(self, code: grpc.StatusCode, line: str) -> None:
        super().__init__(line)
        self.code, self.line = code, line


@dataclass
class Resolution:
    """What the connected nodes' runtimes said about a scope."""

    containers: dict[str, dict[str, Names]] = field(default_factory=dict)  # node -> active id -> names
    in_scope: list[cri.Container] = field(default_factory=list)  # any state
    in_pod: list[cri.Container] = field(default_factory=list)  # the pod's (or namespace's), any state
    failures: dict[str, str] = field(default_factory=dict)  # node -> why its runtime did not answer


def names_of(c: cri.Container) -> Names:
    labels = c.labels
    return (labels.get(LABEL_POD_NAMESPACE, ""), labels.get(LABEL_POD_NAME, ""),
            labels.get(LABEL_CONTAINER_NAME, "") or c.metadata.name)


def _request(scope: TraceScope) -> cri.ListContainersRequest:
    selector = {k: v for k, v in ((LABEL_POD_NAMESPACE, scope.namespace), (LABEL_POD_NAME, scope.pod)) if v}
    by_id = normalize_container_id(scope.container) if scope.container and not scope.namespace else ""
    return cri.ListContainersRequest(filter=cri.ContainerFilter(id=by_id, label_selector=selector))


def list_on_node(scope: TraceScope, transport: CriTransport) -> list[cri.Container]:
    """The node's containers of the scope's namespace and pod (every one of its containers: the
    container part is matched by the caller). Blocking; raises CriCallError."""
    req = _request(scope)
    raw = transport("ListContainers", req.SerializeToString(), CRI_TIMEOUT_S)
    out = []
    for c in cri.ListContainersResponse.FromString(raw).containers:
        ns, pod, _ = names_of(c)
        if (scope.namespace and ns != scope.namespace) or (scope.pod and pod != scope.pod):
            continue
        if req.filter.id and not c.id.startswith(req.filter.id):
            continue
        out.append(c)
    return out


async def resolve(scope: TraceScope, nodes: Iterable[str],
                  transport_for: Callable[[str], CriTransport | None]) -> Resolution:
    """Ask every node at once; a node whose runtime does not answer is named in `failures`."""

    def one(node: str) -> list[cri.Container] | str:
        transport = transport_for(node)
        if transport is None:
            return f"node {node}'s tracer offers no CRI relay"
        try:
            return list_on_node(scope, transport)
        except CriCallError as e:
            return str(e)
        except Exception as e:  # garbage from a runtime (undecodable bytes): that node's failure alone
            return f"CRI answered ListContainers with what is not one: {e}"

    names = sorted(set(nodes))
    answers = await asyncio.gather(*(asyncio.to_thread(one, n) for n in names))
    out = Resolution()
    listed: list[tuple[str, cri.Container]] = []
    for node, answer in zip(names, answers, strict=True):
        if isinstance(answer, str):
            out.failures[node] = answer
        else:
            out.in_pod.extend(answer)
            listed.extend((node, c) for c in answer)
    if scope.container:  # a container name, else an id (prefix): a name that is also hex stays a name
        by_name = [(n, c) for n, c in listed if names_of(c)[2] == scope.container]
        prefix = normalize_container_id(scope.container)
        listed = by_name or [(n, c) for n, c in listed if c.id.startswith(prefix)]
    for node, c in listed:
        out.in_scope.append(c)
        if c.state in ACTIVE_STATES:
            out.containers.setdefault(node, {})[c.id] = names_of(c)
    return out


def name_records(records: Iterable[trace_pb2.TraceRecord], node: str,
                 names_of_id: Callable[[str], Names | None]) -> None:
    """Fill in each record's node and its container's names (looked up once per container id)."""
    known: dict[str, Names | None] = {}
    for r in records:
        r.node = r.node or node
        if r.container_id and not r.namespace:
            if r.container_id not in known:
                known[r.container_id] = names_of_id(r.container_id)
            if names := known[r.container_id]:
                r.namespace, r.pod, r.container = names


def what(scope: TraceScope) -> str:
    """The scope as the refusal lines name it: pod default/x, namespace ml, container abc in ..."""
    if scope.pod:
        where = f"pod {scope.namespace}/{scope.pod}"
    elif scope.namespace:
        where = f"namespace {scope.namespace}"
    else:
        where = ""
    if scope.container:
        return f"container {scope.container}" + (f" in {where}" if where else "")
    return where or f"pid {scope.pid}"


def remembered(scope: TraceScope, memories: Iterable[Memory]) -> str | None:
    """A node (no tracer connected) the cluster remembers running something in scope, or None."""
    cid = normalize_container_id(scope.container)
    for node, ns, pod, container, container_id in memories:
        if (scope.namespace and ns != scope.namespace) or (scope.pod and pod != scope.pod):
            continue
        if scope.container and container != scope.container and not (
                container_id and normalize_container_id(container_id).startswith(cid)):
            continue
        return node
    return None


def cluster_memories(disconnected: Sequence[str],
                     cluster_rows: Mapping[str, Mapping[ConsumerKey, ClusterConsumer]],
                     nodes: Mapping[str, NodeView]) -> list[Memory]:
    """What the cluster table (names CRI gave) and PodResources (allocations) remember of nodes
    whose tracer is not connected."""
    out: list[Memory] = []
    for node in disconnected:
        for cc in cluster_rows.get(node, {}).values():
            k = cc.k8s
            out.append((node, k.namespace, k.pod, k.container, cc.consumer.container_id))
        view = nodes.get(node)
        allocs = getattr(view, "allocations_pb", None)
        if allocs is not None:
            out.extend((node, a.namespace, a.pod, a.container, "") for a in allocs.containers)
    return out


def refusal(scope: TraceScope, res: Resolution, lost_node: str | None) -> TraceError | None:
    """Why nothing in scope can be traced now, or None when a namespace scope may start empty (the
    namespace exists; containers it starts later are taken in)."""
    if res.in_scope:
        if scope.namespace and not scope.pod and not scope.container:
            return None
        states = sorted({cri.ContainerState.Name(c.state) for c in res.in_scope})
        return TraceError(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{what(scope)} has no running container ({', '.join(states)}); "
                          "start it, or trace its namespace to catch it when it starts")
    if lost_node is not None:
        return TraceError(grpc.StatusCode.FAILED_PRECONDITION,
                          f"node {lost_node} has no connected tracer: {what(scope)} cannot be traced there")
    if res.in_pod and scope.container:
        have = sorted({names_of(c)[2] for c in res.in_pod})
        return TraceError(grpc.StatusCode.NOT_FOUND, f"container {scope.container} not found in "
                          f"{what(TraceScope(scope.namespace, scope.pod))} (it has: {', '.join(have)})")
    if res.failures:
        node, why = sorted(res.failures.items())[0]
        return TraceError(grpc.StatusCode.UNAVAILABLE, f"cannot look up {what(scope)} on node {node}: {why}")
    if scope.pod:
        hint = "ghostgpu ps lists pods with GPU consumers"
    elif scope.namespace:
        hint = "no container of it runs on a node with a connected tracer"
    else:
        hint = "ghostgpu ps -o wide lists container ids"
    return TraceError(grpc.StatusCode.NOT_FOUND, f"{what(scope)} not found ({hint})")


def capability_problem(streams: Mapping[str, IngestSession], node: str) -> TraceError | None:
    """FAILED_PRECONDITION for a node whose tracer's Hello does not offer "trace"."""
    hello = getattr(streams.get(node), "hello", None)
    if hello is None or CAPABILITY in hello.capabilities:
        return None
    return TraceError(grpc.StatusCode.FAILED_PRECONDITION, f"node {node}'s tracer cannot trace (version "
                      f"{hello.tracer_version or 'unknown'}): upgrade it to one that offers \"{CAPABILITY}\"")


async def targets(scope: TraceScope, streams: Mapping[str, IngestSession],
                  transport_for: Callable[[str], CriTransport | None], nodes: Mapping[str, NodeView],
                  cluster_rows: Mapping[str, Mapping[ConsumerKey, ClusterConsumer]],
                  ) -> tuple[dict[str, set[str]], dict[str, Names]]:
    """node -> the container ids in scope now (a pid scope: its node, no ids), and their names;
    TraceError when nothing can be traced. `streams`: each node's connected stream."""
    connected = [n for n, st in streams.items() if st.active]
    if scope.node and scope.node not in connected:
        raise TraceError(grpc.StatusCode.FAILED_PRECONDITION, f"node {scope.node} has no connected tracer: "
                         f"{what(scope)} cannot be traced there")
    out: dict[str, set[str]] = {}
    names: dict[str, Names] = {}
    if scope.namespace or scope.pod or scope.container:
        res = await resolve(scope, [scope.node] if scope.node else connected, transport_for)
        for node, found in res.containers.items():
            out[node] = set(found)
            names.update(found)
        if not out and not scope.pid:
            away = [n for n in nodes if n not in connected] if not scope.node else []
            lost = remembered(scope, cluster_memories(away, dict(cluster_rows), dict(nodes)))
            if (error := refusal(scope, res, lost)) is not None:
                raise error
    if scope.pid:
        out.setdefault(scope.node, set())
    for node in out:
        if (problem := capability_problem(streams, node)) is not None:
            raise problem
    return out, names
