"""A real Collector with --metrics-listen, fed by the simulated tracer over real gRPC, scraped over real
HTTP; and its Alertmanager pusher wiring (a stand-in with AlertPusher's interface, and the real class)."""

from __future__ import annotations

import gzip
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from ghostgpu.collector.cluster import Watcher
from ghostgpu.collector.config import CollectorConfig
from ghostgpu.collector.main import Collector
from ghostgpu.collector.metrics import ALERTMANAGER_METRICS, COLLECTOR_METRICS, SHARED_STORE_METRICS

from ghostgpu.common.model.consumers import ConsumerClass, K8sInfo
from ghostgpu.common.web.httpserve import PROMETHEUS_TEXT, HttpListenError
from ghostgpu.v1 import query_pb2, stream_pb2
from tests.helpers.collector_env import running_collector
from tests.helpers.fault_events import fault_event, fault_record, hit
from tests.helpers.polling import wait_until
from tests.helpers.sim_tracer import SimTracer, make_consumer, resolved
from tests.unit.test_metrics import node_info, samples, typed_families

CID = "ab" * 32
TRAINER = K8sInfo("resolved", "team-a", "train-0", "uid-a", "trainer", "img:1", "CONTAINER_RUNNING",
                  "SANDBOX_READY", runtime="containerd 1.7.2")


class OneContainer:
    """A resolver that knows one container (the collector's resolver_factory signature)."""

    def __init__(self, transport_for: Any, on_change: Any) -> None:
        pass

    def get(self, node: str, container_id: str) -> K8sInfo:
        return TRAINER if container_id == CID else K8sInfo("unresolved", error="CRI lookup pending")


class StandInPusher:
    """collector.alertpush.AlertPusher's interface, recording how the Collector drives it."""

    made: list[StandInPusher] = []

    def __init__(self, urls: list[str], *, extra_labels: dict[str, str] | None = None,
                 resend_s: float = 60.0, fault_hold_s: float = 3600.0) -> None:
        self.urls, self.extra_labels, self.resend_s = urls, extra_labels, resend_s
        self.fault_hold_s = fault_hold_s
        self.faults: list[query_pb2.ClusterFault] = []
        self.watcher = Watcher("", "", ())
        self.calls: list[str] = []
        StandInPusher.made.append(self)

    def start(self) -> None:
        self.calls.append("start")

    def offer_fault(self, fault: query_pb2.ClusterFault) -> None:
        self.faults.append(fault)

    def stop(self, timeout_s: float = 2.0) -> None:
        self.calls.append("stop")

    def stats(self) -> Any:
        return SimpleNamespace(posts_ok_total=2, posts_failed_total=1, posts_rejected_total=1,
                               alerts_sent_total=3, pending=1, last_success_unix_s=1.7e9, last_error="")


def scrape(c: Collector, gzip_ok: bool = False) -> tuple[str, str]:
    """(body, Content-Type) of GET /metrics."""
    req = urllib.request.Request(f"http://{c.metrics_address}/metrics",
                                 headers={"Accept-Encoding": "gzip"} if gzip_ok else {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        body = resp.read()
        if resp.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        return body.decode(), resp.headers["Content-Type"]


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[Collector]:
    with running_collector(tmp_path, resolver_factory=OneContainer, metrics_listen="127.0.0.1:0") as c:
        yield c


def test_a_planted_consumer_shows_on_a_real_scrape(collector: Collector) -> None:
    hidden = make_consumer("gpu-node-1", 4242, gpu=1, container_id=CID, gpu_memory_bytes=7 << 30,
                           allocated_bytes=5 << 30)
    gone = make_consumer("gpu-node-1", 77, gpu=0, container_id=CID)
    info = node_info(gpus=2)
    info.gpus[1].unaccounted_bytes = 2 << 30  # GPU 0's split is unknown: no series, never a 0
    expected = {"node": "gpu-node-1", "gpu": "1", "gpu_uuid": "GPU-00000001-0000-4000-8000-000000000000",
                "class": "hidden", "namespace": "team-a", "pod": "train-0", "container": "trainer",
                "pid": "4242", "comm": "python3"}
    with SimTracer(collector.address, "gpu-node-1", tracer_version="0.4.0-sim") as t:
        t.connect()
        t.send_snapshot([hidden, gone], seq=0, info=info,
                        stats=stream_pb2.TracerStats(spool_dropped_total=3, ringbuf_dropped_total=2))
        # Two Xids of one kind on one GPU (two kernel log records), and the first sent again: counted once.
        xid, again = (fault_record(affected=(hit(4242, CID, named=True),)) for _ in range(2))
        t.wait_acked(t.send_events([resolved(1, gone), fault_event(2, xid), fault_event(3, again),
                                    fault_event(4, xid)]))

        def planted() -> bool:
            infos = samples(scrape(collector)[0]).get("ghostgpu_nonvisible_consumer_info", [])
            return [labels for labels, _ in infos] == [expected]

        wait_until(planted, "the planted consumer's series on /metrics")
        text, content_type = scrape(collector, gzip_ok=True)
        assert content_type == PROMETHEUS_TEXT
        got = samples(text)
        assert got["ghostgpu_nonvisible_consumer_memory_bytes"] == [(expected, 7 << 30)]
        assert got["ghostgpu_consumer_gpu_memory_allocated_bytes"] == [(expected, 5 << 30)]
        assert got["ghostgpu_gpu_memory_unaccounted_bytes"] == [
            ({"node": "gpu-node-1", "gpu": "1", "gpu_uuid": expected["gpu_uuid"]}, 2 << 30)]
        assert got["ghostgpu_xid_errors_total"] == [({"node": "gpu-node-1", "gpu": "1", "xid": "79"}, 2)]
        assert got["ghostgpu_faults_dropped_total"] == [({}, 0)]
        assert got["ghostgpu_tracer_connected"] == [({"node": "gpu-node-1"}, 1)]
        assert got["ghostgpu_tracers_connected"] == [({}, 1)]
        assert got["ghostgpu_tracer_info"] == [({"node": "gpu-node-1", "version": "0.4.0-sim"}, 1)]
        lost = {s["reason"]: v for s, v in got["ghostgpu_tracer_events_lost_total"]}
        assert lost == {"spool_overflow": 3, "ringbuf": 2}
        assert got["ghostgpu_findings_resolved_total"] == [({"node": "gpu-node-1", "class": "hidden"}, 1)]
        (heartbeat,) = got["ghostgpu_tracer_last_heartbeat_timestamp_seconds"]
        assert heartbeat[1] > 1.7e9
        with_samples = {n for n in COLLECTOR_METRICS if any(s == n or s.startswith(n + "_") for s in got)}
        # each family has data here, but a shared store's (this collector is on SQLite)
        assert with_samples == set(COLLECTOR_METRICS) - ALERTMANAGER_METRICS - SHARED_STORE_METRICS
        assert {n for n in typed_families(text) if n.startswith("ghostgpu_")} == with_samples
    wait_until(lambda: samples(scrape(collector)[0])["ghostgpu_tracer_connected"][0][1] == 0,
               "the stream's end on /metrics")


def test_bad_or_busy_metrics_listen_is_one_line_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(HttpListenError, match=r"^--metrics-listen 'localhost': use HOST:PORT"):
        CollectorConfig(listen=("127.0.0.1:0",), db_path=str(tmp_path / "a.db"), metrics_listen="localhost")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        c = Collector(CollectorConfig(listen=("127.0.0.1:0",), db_path=str(tmp_path / "b.db"),
                                      metrics_listen=f"127.0.0.1:{port}"))
        with pytest.raises(HttpListenError, match=rf"^--metrics-listen 127.0.0.1:{port}: cannot bind"):
            c.start()
    assert c.metrics_address is None  # nothing left serving


def test_without_metrics_listen_nothing_is_served(tmp_path: Path) -> None:
    with running_collector(tmp_path) as c:
        assert c.metrics_address is None and c.metrics is None


def test_the_pusher_is_built_registered_started_stopped_and_counted(tmp_path: Path) -> None:
    StandInPusher.made.clear()
    with running_collector(tmp_path, resolver_factory=OneContainer, metrics_listen="127.0.0.1:0",
                           alertmanager=["http://127.0.0.1:9093"], alert_labels={"cluster": "eu"},
                           alert_resend_s=30.0, pusher_factory=StandInPusher) as c:
        (pusher,) = StandInPusher.made
        assert (pusher.urls, pusher.extra_labels, pusher.resend_s) == (["http://127.0.0.1:9093"],
                                                                       {"cluster": "eu"}, 30.0)
        assert pusher.calls == ["start"]
        assert c.call(lambda: pusher.watcher in c.cluster.watchers)
        with SimTracer(c.address, "n1") as t:
            t.connect()
            t.send_snapshot([make_consumer("n1", 5, container_id=CID)], seq=0)
            wait_until(lambda: c.call(lambda: len(pusher.watcher.items)) == 1, "the finding at the pusher")
        event = c.call(lambda: pusher.watcher.items[0])
        assert event.kind == query_pb2.FindingEvent.KIND_OPENED
        assert event.finding.consumer.k8s.pod == "train-0"
        got = samples(scrape(c)[0])
        assert {s["result"]: v for s, v in got["ghostgpu_alertmanager_posts_total"]} == {"ok": 2, "error": 1}
        assert got["ghostgpu_alertmanager_alerts_sent_total"] == [({}, 3)]
        assert got["ghostgpu_alertmanager_pending_alerts"] == [({}, 1)]
        assert got["ghostgpu_alertmanager_last_success_timestamp_seconds"] == [({}, 1.7e9)]
        families = {n for n in typed_families(scrape(c)[0]) if n.startswith("ghostgpu_")}
        assert families == set(COLLECTOR_METRICS) - SHARED_STORE_METRICS  # on SQLite
    assert pusher.calls == ["start", "stop"]


def test_the_real_pusher_is_imported_only_with_alertmanager(tmp_path: Path) -> None:
    db = str(tmp_path / "p.db")
    code = ("import sys; from ghostgpu.collector.main import Collector; "
            "from ghostgpu.collector.config import CollectorConfig; "
            f"c = Collector(CollectorConfig(listen=('127.0.0.1:0',), db_path={db!r}, "
            "metrics_listen='127.0.0.1:0')).start(); "
            "c.stop(grace_s=0.1); print('ghostgpu.collector.alertpush' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).parents[2])
    assert (done.returncode, done.stdout) == (0, "False\n"), done.stderr
    from ghostgpu.collector import alertpush

    with running_collector(tmp_path, metrics_listen="127.0.0.1:0",
                           alertmanager=["http://127.0.0.1:9,http://127.0.0.2:9"]) as c:
        assert isinstance(c.pusher, alertpush.AlertPusher)
        text = scrape(c)[0]
        assert set(typed_families(text)) >= ALERTMANAGER_METRICS
    with pytest.raises(ValueError, match="--alert"):
        CollectorConfig(listen=("127.0.0.1:0",), db_path=str(tmp_path / "x.db"), alertmanager=("http://h:1",),
                        alert_labels={"alertname": "x"})


def test_an_unknown_class_of_consumer_still_renders(collector: Collector) -> None:
    with SimTracer(collector.address, "n2") as t:
        t.connect()
        t.send_snapshot([make_consumer("n2", 9, cls=ConsumerClass.UNKNOWN)], seq=0)
        wait_until(lambda: any(s.get("class") == "unknown" for s, _ in
                               samples(scrape(collector)[0]).get("ghostgpu_consumers", [])),
                   "the unknown consumer on /metrics")


def test_a_scrape_before_the_loop_serves_is_503_and_logs_no_trace(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    c = Collector(CollectorConfig(listen=("127.0.0.1:0",), db_path=str(tmp_path / "c.db"),
                                  metrics_listen="127.0.0.1:0"))
    c._build()  # what start() does before the loop runs: the metrics port is bound and answering
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            scrape(c)
        assert e.value.code == 503
        assert e.value.read().decode().count("\n") == 1
        assert not [r for r in caplog.records if r.exc_info], "a 503 is not a handler failure"
    finally:
        c._close_helpers()
