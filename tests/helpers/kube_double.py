"""A TEST DOUBLE of the Kubernetes API server: not Kubernetes, only the few calls ghostgpu's node
isolation (collector/kube_api.py) and `kubectl taint` / `kubectl cordon` make, each request checked
the way a real API server would check it.

    with KubeDouble(nodes=[node_object("gpu-1")]) as api:
        KubeApi(kubeconfig=api.write_kubeconfig(tmp_path)).taint("gpu-1", TAINT_KEY, "xid", "NoSchedule")
        assert api.node("gpu-1")["spec"]["taints"][0]["key"] == TAINT_KEY
        assert not api.errors          # every body validated (the fixture asserts this at its end)

No Kubernetes API server can run on the test machines, so this one serves, over plain HTTP on
loopback:
- discovery, enough for kubectl to map kinds to resources: /version, /api, /api/v1, /apis and
  /apis/rbac.authorization.k8s.io/v1 (the legacy documents; kubectl falls back to them when the
  aggregated form is not offered);
- GET /api/v1/nodes/NAME;
- PATCH /api/v1/nodes/NAME as strategic-merge (spec.taints has no merge key, so the list is replaced
  as a whole, as on a real server), JSON merge (RFC 7386) and JSON patch (RFC 6902), with
  metadata.resourceVersion as a precondition (a stale one: 409 Conflict);
- POST /api/v1/namespaces/NS/events (core/v1 Event).

EVERY request body and every object it would store is validated strictly (unknown fields fail)
against the OpenAPI schemas of Kubernetes K8S_VERSION with kubernetes-validate. A body that fails
gets 422 with a Status naming the field, and the failure is kept in `errors`, which the tests assert
empty: a request a real cluster would refuse fails the test here too. Every request is recorded in
`requests` (method, path, content type, parsed body) for assertions.
"""

from __future__ import annotations

import copy
import json
import threading
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kubernetes_validate

# The schemas' version, and the one /version reports (the Debian image's kubectl dispatcher picks by it).
K8S_VERSION = "1.32.0"
SMP, MERGE, JSON_PATCH = ("application/strategic-merge-patch+json", "application/merge-patch+json",
                          "application/json-patch+json")


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    content_type: str
    body: Any  # the parsed JSON body; None when there was none
    status: int  # what the double answered


def node_object(name: str, labels: dict[str, str] | None = None,
                taints: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """A Node as a real cluster would hold it (the fields these tests read)."""
    node: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "uid": str(uuid.uuid4()), "resourceVersion": "1",
                     "labels": {"kubernetes.io/hostname": name, **(labels or {})},
                     "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    }
    if taints:
        node["spec"]["taints"] = taints
    return node


class ValidationFailed(Exception):
    pass


def _validate(obj: Any, api_version: str, kind: str) -> None:
    if not isinstance(obj, dict):
        raise ValidationFailed(f"{kind}: the body is a {type(obj).__name__}, not an object")
    doc = {**obj, "apiVersion": obj.get("apiVersion", api_version), "kind": obj.get("kind", kind)}
    if (doc["apiVersion"], doc["kind"]) != (api_version, kind):
        raise ValidationFailed(f"{kind}: the body says {doc['apiVersion']}/{doc['kind']}")
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = ".".join(map(str, e.path))
        raise ValidationFailed(f"{kind}: {str(e).splitlines()[0]} (at {where})") from None


def _without_nulls(value: Any) -> Any:
    """A merge patch's nulls delete; the schema describes what is set."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return value


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386; also the strategic merge for the Node fields used here (maps merge, lists replace:
    spec.taints carries no patchMergeKey in k8s.io/api core/v1, so a real server replaces it whole)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            raise ValidationFailed(f"patch directive {key} is not implemented by this double")
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise ValidationFailed(f"json patch path {path!r} must start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def json_patch(target: dict[str, Any], ops: Any) -> dict[str, Any]:
    """RFC 6902: add, remove, replace, test."""
    if not isinstance(ops, list):
        raise ValidationFailed("a json patch is a list of operations")
    doc = copy.deepcopy(target)
    for op in ops:
        if not isinstance(op, dict) or set(op) - {"op", "path", "value", "from"} or "path" not in op:
            raise ValidationFailed(f"json patch operation {op!r} is malformed")
        *parents, last = _pointer(op["path"])
        parent: Any = doc
        for part in parents:
            parent = parent[int(part)] if isinstance(parent, list) else parent.setdefault(part, {})
        kind = op.get("op")
        if kind == "test":
            current = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            if current != op.get("value"):
                raise ValidationFailed(f"json patch test at {op['path']} failed")
        elif kind in ("add", "replace"):
            if "value" not in op:
                raise ValidationFailed(f"json patch {kind} at {op['path']} has no value")
            if isinstance(parent, list):
                index = len(parent) if last == "-" else int(last)
                if kind == "add":
                    parent.insert(index, op["value"])
                else:
                    parent[index] = op["value"]
            else:
                parent[last] = op["value"]
        elif kind == "remove":
            if isinstance(parent, list):
                del parent[int(last)]
            else:
                parent.pop(last)
        else:
            raise ValidationFailed(f"json patch op {kind!r} is not implemented by this double")
    return doc


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class KubeDouble:
    """See the module docstring. A context manager: the server runs on its own thread meanwhile."""

    def __init__(self, nodes: list[dict[str, Any]] | None = None, forbid: set[tuple[str, str]] | None = None,
                 conflicts: int = 0) -> None:
        self.nodes = {n["metadata"]["name"]: n for n in (nodes or [])}
        self.events: list[dict[str, Any]] = []
        self.requests: list[Request] = []
        self.errors: list[str] = []
        self.forbid = forbid or set()  # (method, resource): answer 403, as RBAC would
        self.conflicts = conflicts  # answer this many PATCHes with 409 first, as a concurrent writer would
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="kube-double", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> KubeDouble:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def node(self, name: str) -> dict[str, Any]:
        with self._lock:
            return copy.deepcopy(self.nodes[name])

    def patches(self) -> list[Request]:
        return [r for r in self.requests if r.method == "PATCH"]

    def write_kubeconfig(self, directory: Path) -> Path:
        """A kubeconfig naming this server (plain HTTP, a token no one checks)."""
        path = directory / "kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "double",
            "clusters": [{"name": "double", "cluster": {"server": self.url}}],
            "users": [{"name": "ghostgpu", "user": {"token": "test-double"}}],
            "contexts": [{"name": "double", "context": {"cluster": "double", "user": "ghostgpu"}}],
        }))
        return path

    # ---- the API -----------------------------------------------------------------------------

    def answer(self, method: str, path: str, content_type: str, body: Any) -> tuple[int, Any]:
        path = path.split("?", 1)[0].rstrip("/") or "/"
        parts = path.strip("/").split("/")
        if method == "GET" and path in DISCOVERY:
            return 200, DISCOVERY[path](self)
        if parts[:3] == ["api", "v1", "nodes"] and len(parts) == 4:
            if ("get" if method == "GET" else method.lower(), "nodes") in self.forbid:
                return 403, _status(403, "Forbidden", f'nodes "{parts[3]}" is forbidden: User cannot '
                                    f'{method.lower()} resource "nodes"')
            with self._lock:
                node = self.nodes.get(parts[3])
                if node is None:
                    return 404, _status(404, "NotFound", f'nodes "{parts[3]}" not found')
                if method == "GET":
                    return 200, copy.deepcopy(node)
                if method == "PATCH":
                    return self._patch(node, content_type, body)
        if (method == "POST" and len(parts) == 5 and parts[:3] == ["api", "v1", "namespaces"]
                and parts[4] == "events"):
            if ("create", "events") in self.forbid:
                return 403, _status(403, "Forbidden", 'events is forbidden: User cannot create resource '
                                    '"events"')
            return self._event(parts[3], body)
        return 404, _status(404, "NotFound", f"the server could not find the requested resource "
                                             f"({method} {path})")

    def _patch(self, node: dict[str, Any], content_type: str, body: Any) -> tuple[int, Any]:
        ct = content_type.split(";")[0].strip()
        if ct == JSON_PATCH:
            new = json_patch(node, body)
        elif ct in (SMP, MERGE):
            _validate(_without_nulls(body), "v1", "Node")  # the patch itself: a partial Node
            new = merge_patch(node, body)
        else:
            return 415, _status(415, "UnsupportedMediaType", f"the body's format is unknown here ({ct})")
        if self.conflicts > 0:
            self.conflicts -= 1
            return 409, _status(409, "Conflict", "the object has been modified; please apply your changes "
                                "to the latest version and try again")
        wanted = new["metadata"].get("resourceVersion")
        if wanted != node["metadata"]["resourceVersion"]:
            return 409, _status(409, "Conflict", "the object has been modified; please apply your changes "
                                "to the latest version and try again")
        new["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)
        _validate(new, "v1", "Node")
        node.clear()
        node.update(new)
        return 200, copy.deepcopy(node)

    def _event(self, namespace: str, body: Any) -> tuple[int, Any]:
        _validate(body, "v1", "Event")
        meta = body.get("metadata", {})
        if meta.get("namespace", namespace) != namespace:
            return 400, _status(400, "BadRequest", "the namespace of the object does not match the URL's")
        if not meta.get("name") and not meta.get("generateName"):
            return 422, _status(422, "Invalid", "metadata.name: Required value: name or generateName")
        for field in ("involvedObject", "reason", "message", "type", "source"):
            if not body.get(field):
                return 422, _status(422, "Invalid", f"{field}: Required value")
        if body["type"] not in ("Normal", "Warning"):
            return 422, _status(422, "Invalid", f"type: Unsupported value: {body['type']!r}")
        stored = copy.deepcopy(body)
        stored["metadata"] = {**meta, "namespace": namespace, "uid": str(uuid.uuid4()),
                              "resourceVersion": "1", "creationTimestamp": _now(),
                              "name": meta.get("name") or meta["generateName"] + uuid.uuid4().hex[:5]}
        stored.pop("apiVersion", None)
        stored.pop("kind", None)
        _validate(stored, "v1", "Event")
        with self._lock:
            self.events.append(stored)
        return 201, {"apiVersion": "v1", "kind": "Event", **stored}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        double = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                content_type = self.headers.get("Content-Type") or ""
                body: Any = None
                try:
                    body = json.loads(raw) if raw else None
                    status, answer = double.answer(self.command, self.path, content_type, body)
                except (ValidationFailed, json.JSONDecodeError, KeyError, IndexError, ValueError) as e:
                    status, answer = 422, _status(422, "Invalid", str(e))
                    double.errors.append(f"{self.command} {self.path}: {e}")
                with double._lock:
                    double.requests.append(Request(self.command, self.path.split("?", 1)[0], content_type,
                                                   body, status))
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _serve

        return Handler


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


def _resource(name: str, kind: str, namespaced: bool, verbs: list[str], short: list[str] | None = None,
              ) -> dict[str, Any]:
    r: dict[str, Any] = {"name": name, "singularName": kind.lower(), "namespaced": namespaced, "kind": kind,
                         "verbs": verbs}
    if short:
        r["shortNames"] = short
    return r


_ALL = ["create", "delete", "get", "list", "patch", "update", "watch"]
DISCOVERY: dict[str, Any] = {
    "/version": lambda d: {"major": "1", "minor": K8S_VERSION.split(".")[1], "gitVersion": f"v{K8S_VERSION}",
                           "gitCommit": "test-double", "gitTreeState": "clean",
                           "buildDate": "2026-01-01T00:00:00Z",
                           "goVersion": "go1.23", "compiler": "gc", "platform": "linux/amd64"},
    "/api": lambda d: {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
        {"clientCIDR": "0.0.0.0/0", "serverAddress": d.url.removeprefix("http://")}]},
    "/api/v1": lambda d: {"kind": "APIResourceList", "groupVersion": "v1", "resources": [
        _resource("nodes", "Node", False, _ALL, ["no"]),
        _resource("events", "Event", True, _ALL, ["ev"]),
        _resource("namespaces", "Namespace", False, _ALL, ["ns"]),
        _resource("serviceaccounts", "ServiceAccount", True, _ALL, ["sa"]),
        _resource("pods", "Pod", True, _ALL, ["po"])]},
    "/apis": lambda d: {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
        {"name": "rbac.authorization.k8s.io",
         "versions": [{"groupVersion": "rbac.authorization.k8s.io/v1", "version": "v1"}],
         "preferredVersion": {"groupVersion": "rbac.authorization.k8s.io/v1", "version": "v1"}}]},
    "/apis/rbac.authorization.k8s.io/v1": lambda d: {
        "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "rbac.authorization.k8s.io/v1",
        "resources": [_resource("clusterroles", "ClusterRole", False, _ALL),
                      _resource("clusterrolebindings", "ClusterRoleBinding", False, _ALL),
                      _resource("roles", "Role", True, _ALL),
                      _resource("rolebindings", "RoleBinding", True, _ALL)]},
}
