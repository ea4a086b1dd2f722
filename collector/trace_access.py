"""Who may see, stop and scope which trace sessions (docs/SECURITY.md, "Trace sessions and
namespaces"), beyond the method's role that collector/authz.py checked.

- **Reading** (ListTraces, WatchTrace: `trace list`, `trace show`): an admin reads every session;
  anyone else the sessions they started, and those whose scope lies inside their trace-operator
  namespaces (a session without a namespace, by pid or container id, only with namespaces ["*"]).
  The viewer role alone reads none: trace records are a namespace's calls, read by those who may
  trace that namespace. ListTraces leaves the others out; WatchTrace is denied (audited).
- **Stopping**: an admin stops any session; anyone else only their own.
- **Scoping a start** (`confine`): for a caller who is not admin, a bare container-id scope must
  cover only containers of the caller's namespaces (CRI's labels say whose), and a `--pid` scope is
  sent to the node with the ids of the node's containers of the caller's namespaces (from CRI, at
  start): the tracer starts it only when the process is in one of them (TraceStart.pid_containers,
  its cgroup says which). Whatever cannot be confirmed is refused: no tracer (or one that cannot
  check: no "trace-confine" in its Hello), the runtime not answering, no such container.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import grpc
from ghostgpu.collector.trace_scope import Names, TraceError, resolve

from ghostgpu.common.model.trace import TraceScope, TraceSession

if TYPE_CHECKING:
    from ghostgpu.collector.cri_fetch import CriTransport
    from ghostgpu.collector.ingest import IngestSession

CONFINE = "trace-confine"  # a tracer's Hello capability: it checks TraceStart.pid_containers
InNamespace = Callable[[str | None], bool]  # may the caller trace this namespace (None: no namespace)


def read_refusal(who: str, admin: bool, in_namespace: InNamespace, session: TraceSession) -> str | None:
    """None when `who` may list and read `session`; else why not (one clause)."""
    if admin or session.requested_by == who:
        return None
    ns = session.scope.namespace or None
    if in_namespace(ns):
        return None
    where = f"namespace {ns!r}" if ns else "no namespace (by pid or container id)"
    return (f"trace session {session.id} ({session.scope.describe()}) has {where}, outside {who}'s trace "
            "namespaces; only its starter and admins read it")


def stop_refusal(who: str, admin: bool, session: TraceSession) -> str | None:
    """None when `who` may stop `session`: admins any, everyone else their own."""
    if admin or session.requested_by == who:
        return None
    return (f"trace session {session.id} was started by {session.requested_by or 'someone else'}; "
            f"{who} may stop only its own sessions (admins stop any)")


async def confine(scope: TraceScope, who: str, in_namespace: InNamespace, names: Mapping[str, Names],
                  streams: Mapping[str, IngestSession],
                  transport_for: Callable[[str], CriTransport | None]) -> frozenset[str]:
    """For a caller who is not admin: TraceError unless the scope lies inside `in_namespace`; the
    container ids the `--pid` process must be in (empty for a scope without a pid)."""
    denied = grpc.StatusCode.PERMISSION_DENIED
    if scope.container and not scope.namespace:  # a bare container (id or name): CRI names its namespace
        for cid, (ns, pod, _name) in sorted(names.items()):
            if not ns or not in_namespace(ns):
                raise TraceError(denied, f"container {cid[:12]} is in namespace {ns or '(none)'!r} (pod "
                                 f"{pod or '-'}), outside {who}'s trace namespaces")
    if not scope.pid:
        return frozenset()
    node = scope.node
    what = f"pid {scope.pid} on node {node}"
    stream = streams.get(node)
    hello = getattr(stream, "hello", None)
    if stream is None or not stream.active or hello is None:
        raise TraceError(grpc.StatusCode.FAILED_PRECONDITION,
                         f"node {node} has no connected tracer: cannot confirm which container {what} is in")
    if CONFINE not in hello.capabilities:
        raise TraceError(grpc.StatusCode.FAILED_PRECONDITION,
                         f"node {node}'s tracer (version {hello.tracer_version or 'unknown'}) cannot confirm "
                         f"which container {what} is in: upgrade it to one that offers \"{CONFINE}\" "
                         "(until then only an admin traces by pid there)")
    res = await resolve(TraceScope(namespace=scope.namespace), [node], transport_for)
    if node in res.failures:
        raise TraceError(grpc.StatusCode.UNAVAILABLE, f"cannot confirm that {what} is in a container of "
                         f"{who}'s namespaces: node {node}'s runtime did not answer ({res.failures[node]})")
    ids = frozenset(cid for cid, (ns, _pod, _name) in res.containers.get(node, {}).items()
                    if ns and in_namespace(ns) and (not scope.namespace or ns == scope.namespace))
    if not ids:
        where = f"namespace {scope.namespace}" if scope.namespace else f"{who}'s trace namespaces"
        raise TraceError(denied, f"{what} cannot be in a container of {where}: none runs on node {node} "
                         "(ghostgpu ps lists GPU consumers with their pods)")
    return ids
