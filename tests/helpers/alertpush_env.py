"""Test peers for collector.alertpush: a cluster table fed directly, and a fake Alertmanager.

FindingTable drives collector.cluster.ClusterTable the way the collector does (NodeView consumers,
`update`, `on_cri_change`), on the calling thread, which plays the collector's event loop; CRI
answers come from a dict, so a test decides when a container's names "arrive".

FakeAlertmanager is a real HTTP server on loopback that takes POST /api/v2/alerts, records every
request, keeps the latest state per label set like Alertmanager, and can be told to answer an
error status, or to hang, for the next requests.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ghostgpu.collector.cluster import ClusterTable
from ghostgpu.collector.nodes import Changes, NodeView

from ghostgpu.common.model.consumers import Consumer, K8sInfo
from tests.helpers.polling import wait_until

PENDING = K8sInfo("unresolved", error="CRI lookup pending")
HANG_MAX_S = 30.0  # a hanging request is released at teardown at the latest


def k8s(namespace: str, pod: str, container: str) -> K8sInfo:
    return K8sInfo("resolved", namespace, pod, f"uid-{pod}", container, "img:1", "CONTAINER_RUNNING",
                   "SANDBOX_READY", runtime="containerd 1.6.20")


class FindingTable:
    """One node's consumers through the real ClusterTable; CRI names by container ID from `names`."""

    def __init__(self, node: str = "n1") -> None:
        self.node = node
        self.names: dict[str, K8sInfo] = {}
        self.ns = NodeView(node)
        self.table = ClusterTable({node: self.ns}, self._resolve, store=None)

    def _resolve(self, node: str, container_id: str) -> K8sInfo:
        return self.names.get(container_id, PENDING)

    def add(self, *consumers: Consumer) -> None:
        for c in consumers:
            self.ns.consumers[c.key] = c
        self.table.update(self.ns, Changes(keys=[c.key for c in consumers]))

    def remove(self, *consumers: Consumer) -> None:
        for c in consumers:
            self.ns.consumers.pop(c.key, None)
        self.table.update(self.ns, Changes(keys=[c.key for c in consumers]))

    def set_names(self, container_id: str, info: K8sInfo) -> None:
        """CRI answered for a container: its consumers are enriched again (CHANGED events)."""
        self.names[container_id] = info
        self.table.on_cri_change(self.node, container_id)


@dataclass
class Post:
    path: str
    headers: dict[str, str]
    alerts: list[dict[str, Any]]
    at_mono: float
    status: int


@dataclass
class FakeAlertmanager:
    port: int = 0
    posts: list[Post] = field(default_factory=list)
    latest: dict[tuple[tuple[str, str], ...], dict[str, Any]] = field(default_factory=dict)
    # (status, body) answered to the next requests, one per request; then 200.
    script: list[tuple[int, bytes]] = field(default_factory=list)
    always: tuple[int, bytes] | None = None  # answered to every request while set
    hanging: bool = False
    drop_keepalive: bool = False  # close each connection after answering, without saying so
    in_flight: int = 0

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        self.release = threading.Event()
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> FakeAlertmanager:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with fake.lock:
                    fake.in_flight += 1
                    hang = fake.hanging
                if hang:
                    fake.release.wait(HANG_MAX_S)
                status, body = fake._answer(self.path, dict(self.headers.items()), raw)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                if fake.drop_keepalive:
                    self.close_connection = True

            def log_message(self, format: str, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self._server = server
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def _answer(self, path: str, headers: dict[str, str], raw: bytes) -> tuple[int, bytes]:
        alerts = json.loads(raw)
        with self.lock:
            self.in_flight -= 1
            status, body = self.always or (self.script.pop(0) if self.script else (200, b""))
            self.posts.append(Post(path, headers, alerts, time.monotonic(), status))
            if status in (200, 400):  # a 400 still stores the valid alerts
                for a in alerts:
                    self.latest[tuple(sorted(a["labels"].items()))] = a
        return status, body

    def stop(self) -> None:
        self.release.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alerts(self, **labels: str) -> list[dict[str, Any]]:
        with self.lock:
            return [a for a in self.latest.values()
                    if all(a["labels"].get(k) == v for k, v in labels.items())]

    def firing(self, **labels: str) -> list[dict[str, Any]]:
        return [a for a in self.alerts(**labels) if "endsAt" not in a]

    def resolved(self, **labels: str) -> list[dict[str, Any]]:
        return [a for a in self.alerts(**labels) if "endsAt" in a]

    def ok_posts_with(self, **labels: str) -> list[Post]:
        with self.lock:
            return [p for p in self.posts if p.status == 200
                    and any(all(a["labels"].get(k) == v for k, v in labels.items()) for a in p.alerts)]

    def wait(self, what: str, predicate: Any, timeout_s: float = 5.0) -> None:
        wait_until(predicate, f"{what} at the fake Alertmanager (posts: {len(self.posts)})", timeout_s)
