"""Collector /metrics rendered from the collector's own tables (collector/metrics.py, metrics_render.py):
the page parses (prometheus_client's parser and promtool), label values are escaped, the per-node cache
never serves a stale line, the process cap keeps the oldest findings, the findings counters move, and
the CRI latency histogram counts calls. The real HTTP path with a simulated tracer is test_metrics_http.py.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
from ghostgpu.collector import metrics_render
from ghostgpu.collector.cluster import ClusterTable
from ghostgpu.collector.config import CollectorConfig
from ghostgpu.collector.cri import CALL_LATENCY_BUCKETS_S, CriCallError, CriResolver, CriStats
from ghostgpu.collector.db import parse_store_url
from ghostgpu.collector.metrics import ALERTMANAGER_METRICS, COLLECTOR_METRICS, CollectorMetrics
from ghostgpu.collector.metrics_render import escape
from ghostgpu.collector.nodes import Changes, NodeView
from ghostgpu.collector.remediation import RemediationView
from ghostgpu.collector.store import Position
from prometheus_client.parser import text_string_to_metric_families

from ghostgpu.common.model.consumers import ClusterConsumer, Consumer, ConsumerClass, K8sInfo
from ghostgpu.common.system.settings import default_of
from ghostgpu.v1 import stream_pb2
from tests.helpers.polling import wait_until
from tests.helpers.sim_tracer import make_consumer

C = ConsumerClass


class Cri:
    """K8sInfo per container ID; a test changes an answer and calls ClusterTable.on_cri_change."""

    def __init__(self) -> None:
        self.answers: dict[str, K8sInfo] = {}

    def get(self, node: str, container_id: str) -> K8sInfo:
        return self.answers.get(container_id, K8sInfo("unresolved", error="CRI lookup pending"))


def node_info(gpus: int = 2, bpf: bool = True, name: str = "NVIDIA H100 80GB HBM3") -> stream_pb2.NodeInfo:
    return stream_pb2.NodeInfo(bpf=bpf, nvml=True, driver_version="550.54.15", gpus=[
        stream_pb2.Gpu(index=i, uuid=f"GPU-{i:08x}-0000-4000-8000-000000000000", name=name, minor=i,
                       memory_total_bytes=80 << 30) for i in range(gpus)])


class World:
    """Nodes, a ClusterTable and a resolver, changed the way ingest changes them."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeView] = {}
        self.cri = Cri()
        self.table = ClusterTable(self.nodes, self.cri.get, None)

    def node(self, name: str, version: str = "0.4.0") -> NodeView:
        ns = self.nodes.get(name)
        if ns is None:
            ns = self.nodes[name] = NodeView(name)
            ns.begin(stream_pb2.Hello(node=name, tracer_version=version, instance_id="i-" + name),
                     Position(name, "boot", "i-" + name))
            ns.info = node_info()
        return ns

    def put(self, c: Consumer) -> None:
        ns = self.node(c.node)
        ns.consumers[c.key] = c
        self.table.update(ns, Changes(keys=[c.key]))

    def drop(self, c: Consumer) -> None:
        ns = self.node(c.node)
        ns.consumers.pop(c.key, None)
        self.table.update(ns, Changes(keys=[c.key]))

    def metrics(self, **kw: object) -> CollectorMetrics:
        kw.setdefault("max_process_series", default_of(CollectorConfig, "metrics_max_process_series"))
        return CollectorMetrics(self.nodes, self.table, **kw)  # type: ignore[arg-type]


class FakeStore:
    """collector/store.py's Store as /metrics and the probes read it."""

    def __init__(self, engine: str = "sqlite", replica_id: str = "collector-0") -> None:
        self.engine, self.replica_id = engine, replica_id
        self.commit_seconds: list[float] = []
        self.errors_total = 0
        self.db_down_since: float | None = None
        self.pending_bytes = 0
        self.failed: BaseException | None = None
        self.url = parse_store_url("postgresql://ghostgpu@db/ghostgpu" if engine == "postgresql" else "/c.db")


class FakeLeases:
    """collector/leases.py's Leases as /metrics reads it."""

    def __init__(self, held: dict[str, int], steals_total: int = 0) -> None:
        self.held, self.steals_total = held, steals_total


class FakeNotifier:
    """collector/notify.py's Notifier as /metrics reads it."""

    def __init__(self) -> None:
        self.notifications_by_channel = {"ghostgpu_commands": 0, "ghostgpu_findings": 0, "ghostgpu_trace": 0}
        self.reconnects_total = 0
        self.down_since: float | None = None
        self.listening = True


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)], through prometheus_client's own parser."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def typed_families(text: str) -> dict[str, str]:
    """# TYPE lines: family name -> type, as Prometheus reads them."""
    return {parts[2]: parts[3] for line in text.splitlines() if line.startswith("# TYPE ")
            for parts in [line.split()]}


def by_family(text: str) -> list[tuple[str, list[str]]]:
    """The page as [(HELP/TYPE header, its sample lines sorted)], in page order: what a scrape means
    (Prometheus does not care about the order of one family's lines, only that they are together)."""
    out: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("# HELP "):
            out.append((line, []))
        elif not line.startswith("#"):
            out[-1][1].append(line)
    return [(head, sorted(lines)) for head, lines in out]


def busy_world() -> World:
    w = World()
    w.cri.answers["aa" * 32] = K8sInfo("resolved", "ml", "train-0", container="trainer")
    w.cri.answers["bb" * 32] = K8sInfo("resolved", "ml", "infer-0", container="server")
    w.put(make_consumer("n1", 10, gpu=0, cls=C.HIDDEN, container_id="aa" * 32, gpu_memory_bytes=3 << 30,
                        allocated_bytes=2 << 30))
    w.put(make_consumer("n1", 11, gpu=1, cls=C.VISIBLE, container_id="bb" * 32, gpu_memory_bytes=1 << 30))
    w.put(make_consumer("n1", 12, gpu=1, cls=C.UNATTRIBUTED))
    w.put(make_consumer("n1", 13, gpu=1, cls=C.UNATTRIBUTED))  # same label set as pid 12: counted 2
    gone = make_consumer("n2", 20, gpu=0, cls=C.HIDDEN, container_id="aa" * 32)
    w.put(gone)
    w.drop(gone)  # opened and resolved on n2
    w.node("n3").info = None  # connected, no NodeInfo yet
    w.nodes["n1"].info.gpus[0].unaccounted_bytes = 1 << 30  # n1's GPU 1 and n2's: not known
    w.nodes["n1"].set_stats(stream_pb2.TracerStats(memory_objects_dropped_total=2, kmsg_records_lost_total=5))
    return w


# ---- format ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("raw", "written"), [
    ("plain", "plain"),
    ('say "hi"', 'say \\"hi\\"'),
    ("C:\\dir", "C:\\\\dir"),
    ("two\nlines", "two\\nlines"),
    ('\\"\n', '\\\\\\"\\n'),
    ("tab\tand ünï €", "tab\tand ünï €"),  # only \\, " and line feed are escaped
    ("", ""),
])
def test_label_values_are_escaped_as_the_text_format_wants(raw: str, written: str) -> None:
    assert escape(raw) == written
    w = World()
    w.cri.answers["aa" * 32] = K8sInfo("resolved", raw, raw, container=raw)
    w.put(make_consumer(f"node-{raw}", 7, cls=C.HIDDEN, container_id="aa" * 32, comm=raw, gpu_memory_bytes=5))
    got = samples(w.metrics().render_nodes())
    (labels, value), = got["ghostgpu_nonvisible_consumer_info"]
    assert value == 1
    assert {k: labels[k] for k in ("node", "namespace", "pod", "container", "comm")} == {
        "node": f"node-{raw}", "namespace": raw, "pod": raw, "container": raw, "comm": raw}


def test_page_parses_and_every_family_is_declared() -> None:
    w = busy_world()
    m = w.metrics(cri_stats=lambda: CriStats(calls_total=3, call_seconds_total=0.02,
                                             call_latency_bucket_counts=(1,) * 3 + (3,) * 9),
                  audit_head=lambda: (41, 3),  # the audit chain's head: a witness outside the collector
                  store=FakeStore(), leases=FakeLeases({"n1": 1, "n2": 4, "n3": 2}),
                  notifier=FakeNotifier(), replica=SimpleNamespace(counts={("sent", "cri", "ok"): 1}),
                  remediation=SimpleNamespace(incidents_total={("kill_orphan", "done", "on"): 2},
                                              view=RemediationView(mode="on", paused=True)),
                  tickets=lambda: {"sent": 3, "failed": 1, "dropped": 0, "retries": 2, "queued": 0},
                  isolations=lambda: {("xid", "done"): 1})
    text = m.page().decode()
    assert text.endswith("\n")
    remediation = samples(text)
    incidents = {(s["state"], s["mode"]): v for s, v in remediation["ghostgpu_remediation_incidents_total"]}
    assert incidents[("done", "on")] == 2 and incidents[("proposed", "dry-run")] == 0 and len(incidents) == 15
    assert {s["mode"]: v for s, v in remediation["ghostgpu_remediation_mode"]} == {"off": 0, "dry-run": 0,
                                                                                  "on": 1}
    assert remediation["ghostgpu_remediation_paused"] == [({}, 1)]
    assert sorted(remediation["ghostgpu_remediation_tickets_total"], key=str) == [
        ({"result": "dropped"}, 0), ({"result": "failed"}, 1), ({"result": "sent"}, 3)]
    assert remediation["ghostgpu_remediation_ticket_retries_total"] == [({}, 2)]
    isolations = {(s["trigger"], s["state"]): v
                  for s, v in remediation["ghostgpu_remediation_isolations_total"]}
    assert isolations[("xid", "done")] == 1 and isolations[("unkillable", "proposed")] == 0
    assert len(isolations) == 12
    got_audit = samples(text)
    assert got_audit["ghostgpu_audit_head_seq"] == [({}, 41)]
    assert got_audit["ghostgpu_audit_records_total"] == [({}, 3)]
    got = samples(text)
    consumers = {(s["node"], s["gpu"], s["class"]): v for s, v in got["ghostgpu_consumers"]}
    assert consumers == {("n1", "0", "hidden"): 1, ("n1", "1", "visible"): 1, ("n1", "1", "unattributed"): 2}
    infos = {s["pid"]: s for s, _ in got["ghostgpu_nonvisible_consumer_info"]}
    assert sorted(infos) == ["10", "12", "13"]  # hidden and unattributed are findings, visible is not
    info = infos["10"]
    assert info == {"node": "n1", "gpu": "0", "gpu_uuid": "GPU-00000000-0000-4000-8000-000000000000",
                    "class": "hidden", "namespace": "ml", "pod": "train-0", "container": "trainer",
                    "pid": "10", "comm": "python3"}
    assert got["ghostgpu_nonvisible_consumer_memory_bytes"] == [(info, 3 << 30)]  # NVML said only for pid 10
    aggregate = {(s["class"], s["gpu"]): v for s, v in got["ghostgpu_nonvisible_memory_bytes"]}
    assert aggregate == {("hidden", "0"): 3 << 30, ("unattributed", "1"): 0}
    assert {s["node"] for s, _ in got["ghostgpu_tracer_connected"]} == {"n1", "n2", "n3"}
    assert {s["node"] for s, _ in got["ghostgpu_tracer_bpf_attached"]} == {"n1", "n2"}  # n3: no NodeInfo
    assert ({"node": "n1", "gpu": "1", "gpu_uuid": "GPU-00000001-0000-4000-8000-000000000000",
             "name": "NVIDIA H100 80GB HBM3", "driver_version": "550.54.15"}, 1) in got["ghostgpu_gpu_info"]
    assert got["ghostgpu_cri_call_duration_seconds_count"] == [({}, 3)]
    assert ({"le": "0.005"}, 1) in got["ghostgpu_cri_call_duration_seconds_bucket"]
    assert got["ghostgpu_build_info"][0][0]["api_version"] == "1"
    assert "process_cpu_seconds_total" in got  # the process collector of the Collector's own registry
    families = {n for n in typed_families(text) if n.startswith("ghostgpu_")}
    assert families == set(COLLECTOR_METRICS) - ALERTMANAGER_METRICS
    for name, kind in typed_families(text).items():
        if name in COLLECTOR_METRICS:
            assert kind == COLLECTOR_METRICS[name][0], name


@pytest.mark.prometheus
def test_promtool_check_metrics_prints_nothing() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is missing: apt-get install prometheus (scripts/bootstrap.sh)")
    w = busy_world()
    w.cri.answers["cc" * 32] = K8sInfo("resolved", 'we"ird\\ns', "pod\nx", container="c")
    w.put(make_consumer("n4", 40, cls=C.HIDDEN, container_id="cc" * 32, comm='a"b\\c'))
    store = FakeStore("postgresql")
    store.commit_seconds += [0.002, 0.2]
    body = w.metrics(cri_stats=CriStats, store=store, leases=FakeLeases({"n1": 1, "n4": 1})).page()
    done = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, timeout=60)
    assert (done.returncode, done.stdout + done.stderr) == (0, b"")


# ---- cache ---------------------------------------------------------------------------------------

def test_the_cache_never_serves_a_stale_line() -> None:
    rng = random.Random(4)
    w = World()
    cached = w.metrics(max_process_series=6)
    classes = [C.HIDDEN, C.VISIBLE, C.ORPHANED, C.UNATTRIBUTED, C.PENDING]
    cids = [f"{i:02x}" * 32 for i in range(4)]
    live: dict[tuple[str, int], Consumer] = {}
    for step in range(600):
        node = f"n{rng.randrange(5)}"
        op = rng.randrange(8)
        if op <= 2 or not live:  # a new consumer, or a new state of one (class, memory, comm)
            pid = rng.randrange(1, 8)
            c = make_consumer(node, pid, gpu=rng.randrange(2), cls=rng.choice(classes),
                              container_id=rng.choice([*cids, ""]),
                              gpu_memory_bytes=rng.choice([None, pid << 20]),
                              comm=rng.choice(["python3", "tor\"ch"]))
            live[node, pid] = c
            w.put(c)
        elif op == 3:
            w.drop(live.pop(rng.choice(sorted(live))))
        elif op == 4:  # CRI's answer for a container changed
            cid = rng.choice(cids)
            w.cri.answers[cid] = K8sInfo("resolved", "ns", f"pod-{step}", container="c")
            for n in list(w.nodes):
                w.table.on_cri_change(n, cid)
        elif op == 5:  # NodeInfo replaced (a GPU appeared, BPF went away)
            w.node(node).info = node_info(gpus=rng.randrange(1, 3), bpf=rng.random() < 0.5)
        elif op == 6:  # a new tracer instance (version label), counters moving
            ns = w.node(node)
            ns.begin(stream_pb2.Hello(node=node, tracer_version=f"0.{step}"), Position(node, "b", f"i{step}"))
            ns.position.ingested_total += step  # type: ignore[union-attr]
        else:
            w.node(node).connected = rng.random() < 0.5
        if rng.random() < 0.5:
            continue  # several changes between two scrapes (a row gone and back moves in the table)
        fresh = w.metrics(max_process_series=6)
        assert by_family(cached.render_nodes()) == by_family(fresh.render_nodes()), f"step {step}, op {op}"
        assert cached.capped == fresh.capped


def test_only_changed_rows_are_written_again(monkeypatch: pytest.MonkeyPatch) -> None:
    w = World()
    for n in ("a", "b"):
        w.put(make_consumer(n, 1, cls=C.HIDDEN, container_id="aa" * 32))
    m = w.metrics()
    m.render_nodes()
    written: list[tuple[str, int]] = []
    real = metrics_render._consumer_labels

    def spy(node: str, nl: str, cc: ClusterConsumer) -> object:
        written.append((node, cc.consumer.pid))
        return real(node, nl, cc)

    monkeypatch.setattr(metrics_render, "_consumer_labels", spy)
    m.render_nodes()
    assert written == []
    w.put(make_consumer("b", 2, cls=C.VISIBLE))
    w.put(make_consumer("b", 2, cls=C.VISIBLE))  # the same again: the row is kept, nothing to write
    text = m.render_nodes()
    assert written == [("b", 2)]
    assert sum(v for _, v in samples(text)["ghostgpu_consumers"]) == 3


# ---- cap -----------------------------------------------------------------------------------------

def test_the_cap_keeps_the_oldest_findings_and_counts_the_rest() -> None:
    w = World()
    for pid in range(1, 6):  # opened one after another: pid 1 is the oldest
        w.put(make_consumer(f"n{pid % 2}", pid, cls=C.HIDDEN, gpu_memory_bytes=pid << 20,
                            allocated_bytes=pid << 21))
        wait_until(lambda: time.time_ns() > max(r.since_unix_ns for rows in w.table.rows.values()
                                                for r in rows.values()), "the clock to move on")
    w.put(make_consumer("n0", 9, cls=C.VISIBLE))
    m = w.metrics(max_process_series=3)
    got = samples(m.page().decode())
    assert sorted(int(s["pid"]) for s, _ in got["ghostgpu_nonvisible_consumer_info"]) == [1, 2, 3]
    assert sorted(int(s["pid"]) for s, _ in got["ghostgpu_nonvisible_consumer_memory_bytes"]) == [1, 2, 3]
    allocated = {int(s["pid"]): v for s, v in got["ghostgpu_consumer_gpu_memory_allocated_bytes"]}
    assert allocated == {1: 1 << 21, 2: 2 << 21, 3: 3 << 21}  # under the same cap
    assert got["ghostgpu_metrics_process_series_capped"] == [({}, 2)]
    assert sum(v for _, v in got["ghostgpu_consumers"]) == 6  # the aggregates stay complete
    assert sum(v for _, v in got["ghostgpu_nonvisible_memory_bytes"]) == sum(p << 20 for p in range(1, 6))
    w.drop(make_consumer("n1", 1, cls=C.HIDDEN))  # the oldest resolves: pid 4 gets in
    got = samples(m.page().decode())
    assert sorted(int(s["pid"]) for s, _ in got["ghostgpu_nonvisible_consumer_info"]) == [2, 3, 4]
    assert got["ghostgpu_metrics_process_series_capped"] == [({}, 1)]
    none = samples(w.metrics(max_process_series=0).page().decode())
    assert "ghostgpu_nonvisible_consumer_info" not in none
    assert "ghostgpu_consumer_gpu_memory_allocated_bytes" not in none
    assert none["ghostgpu_metrics_process_series_capped"] == [({}, 4)]
    with pytest.raises(ValueError, match="--metrics-max-process-series -1: must be 0 or more"):
        CollectorConfig(metrics_max_process_series=-1)


# ---- counters ------------------------------------------------------------------------------------

def test_findings_counters_move_on_open_and_resolve() -> None:
    w = World()
    m = w.metrics()

    def counts(name: str) -> dict[tuple[str, str], float]:
        return {(s["node"], s["class"]): v for s, v in samples(m.render_nodes()).get(name, [])}

    c = make_consumer("n1", 5, cls=C.HIDDEN, container_id="aa" * 32)
    w.put(c)
    assert counts("ghostgpu_findings_opened_total") == {("n1", "hidden"): 1}
    assert counts("ghostgpu_findings_resolved_total") == {}
    w.put(replace(c, gpu_memory_bytes=1 << 20))  # a change, not a new finding
    assert counts("ghostgpu_findings_opened_total") == {("n1", "hidden"): 1}
    w.cri.answers["aa" * 32] = K8sInfo("resolved", "ml", "p", container="c",
                                       container_state="CONTAINER_EXITED")
    w.table.on_cri_change("n1", "aa" * 32)  # hidden -> orphaned: one resolves, another opens
    assert counts("ghostgpu_findings_opened_total") == {("n1", "hidden"): 1, ("n1", "orphaned"): 1}
    assert counts("ghostgpu_findings_resolved_total") == {("n1", "hidden"): 1}
    w.drop(c)
    assert counts("ghostgpu_findings_resolved_total") == {("n1", "hidden"): 1, ("n1", "orphaned"): 1}


def test_node_counters_sum_every_tracer_instance() -> None:
    w = World()
    ns = w.node("n1")
    old = ns.position
    assert old is not None
    old.ingested_total, old.duplicates_total, old.gaps_total, old.spool_dropped_total = 100, 4, 7, 5
    ns.begin(stream_pb2.Hello(node="n1", tracer_version="0.5"), Position("n1", "boot2", "i2"))
    new = ns.position
    assert new is not None
    new.ingested_total, new.spool_dropped_total, new.ringbuf_dropped_total = 10, 2, 3
    got = samples(w.metrics().render_nodes())
    assert got["ghostgpu_tracer_events_ingested_total"] == [({"node": "n1"}, 110)]
    assert got["ghostgpu_tracer_events_duplicate_total"] == [({"node": "n1"}, 4)]
    lost = {s["reason"]: v for s, v in got["ghostgpu_tracer_events_lost_total"]}
    assert lost == {"spool_overflow": 7 + 2, "ringbuf": 3}  # a gap and the spool count are one loss
    assert got["ghostgpu_tracer_info"] == [({"node": "n1", "version": "0.5"}, 1)]


TRACER_STATS = ("ghostgpu_tracer_memory_objects_dropped_total", "ghostgpu_tracer_kmsg_unparsed_total",
                "ghostgpu_tracer_faults_dropped_total", "ghostgpu_tracer_kmsg_records_lost_total")


def test_tracer_drop_counters_are_the_tracers_latest_report_and_absent_before_one() -> None:
    w = World()
    reported = w.node("n1")
    reported.set_stats(stream_pb2.TracerStats(memory_objects_dropped_total=7, kmsg_unparsed_total=1,
                                              faults_dropped_total=2, kmsg_records_lost_total=3))
    w.node("n2")  # its stream opened, no snapshot nor heartbeat yet: the counts are not known
    quiet = w.node("n3")
    quiet.apply_snapshot(stream_pb2.Snapshot(seq=4))  # a snapshot without stats: nothing dropped
    w.nodes["n4"] = NodeView("n4")  # known from the database only, its tracer not back yet
    m = w.metrics()

    def counts() -> dict[tuple[str, str], float]:
        got = samples(m.render_nodes())
        return {(name, s["node"]): v for name in TRACER_STATS for s, v in got.get(name, [])}

    assert counts() == {
        **{(name, "n1"): v for name, v in zip(TRACER_STATS, (7, 1, 2, 3), strict=True)},
        **{(name, "n3"): 0 for name in TRACER_STATS}}
    # A new tracer process counts from 0 again: the series says so (Prometheus reads a reset).
    reported.begin(stream_pb2.Hello(node="n1", tracer_version="0.5"), Position("n1", "boot", "i2"))
    assert counts()[("ghostgpu_tracer_memory_objects_dropped_total", "n1")] == 7  # its last report stands
    reported.apply_snapshot(stream_pb2.Snapshot(seq=1, stats=stream_pb2.TracerStats(kmsg_unparsed_total=4)))
    got = counts()
    assert [got[(name, "n1")] for name in TRACER_STATS] == [0, 4, 0, 0]


def test_cri_call_latency_histogram_counts_each_call() -> None:
    def slow_refusal(method: str, request: bytes, timeout_s: float) -> bytes:
        time.sleep(0.03)  # the runtime's latency being measured, not a wait for a result
        raise CriCallError(__import__("grpc").StatusCode.UNAVAILABLE, "runtime away")

    r = CriResolver(lambda node: slow_refusal, lambda node, cid: None, ttl_s=30.0, retry_initial_s=5.0)
    try:
        r.get("n1", "ab" * 32)
        wait_until(lambda: r.stats().calls_total >= 1, "one CRI call")
        st = r.stats()
    finally:
        r.close()
    buckets = dict(zip(CALL_LATENCY_BUCKETS_S, st.call_latency_bucket_counts, strict=True))
    assert buckets[0.025] == 0 and buckets[5.0] == st.calls_total
    assert list(st.call_latency_bucket_counts) == sorted(st.call_latency_bucket_counts)  # cumulative
    assert st.failures_by_node == {"n1": st.calls_total}


def test_node_counters_never_go_back_when_an_old_tracer_instance_is_forgotten() -> None:
    """Ingest forgets a tracer instance silent past the retention (NodeView.forget_instances); its
    events stay counted, else the counters drop and Prometheus reads a reset (GhostGPUEventsLost's
    increase() would count the survivors' past losses as new)."""
    w = World()
    ns = w.node("n1")
    old = ns.position
    assert old is not None
    old.ingested_total, old.duplicates_total, old.gaps_total, old.ringbuf_dropped_total = 100, 4, 7, 2
    ns.begin(stream_pb2.Hello(node="n1", tracer_version="0.5"), Position("n1", "boot2", "i2"))
    assert ns.position is not None
    ns.position.ingested_total, ns.position.ringbuf_dropped_total = 10, 1
    m = w.metrics()
    names = ("ghostgpu_tracer_events_ingested_total", "ghostgpu_tracer_events_lost_total",
             "ghostgpu_tracer_events_duplicate_total")

    def counters() -> dict[tuple[str, str], float]:
        got = samples(m.render_nodes())
        return {(n, s.get("reason", "")): v for n in names for s, v in got[n]}

    before = counters()
    assert ns.forget_instances(ns.position.key, time.time_ns() + 1) == [old.key]
    assert counters() == before == {
        ("ghostgpu_tracer_events_ingested_total", ""): 110, ("ghostgpu_tracer_events_duplicate_total", ""): 4,
        ("ghostgpu_tracer_events_lost_total", "spool_overflow"): 7,
        ("ghostgpu_tracer_events_lost_total", "ringbuf"): 3}


def test_changed_rows_are_kept_only_for_a_reader_and_stay_bounded_between_scrapes() -> None:
    w = World()
    for pid in range(1, 2001):  # short-lived processes: every one a new ConsumerKey
        c = make_consumer("n1", pid, cls=C.VISIBLE)
        w.put(c)
        w.drop(c)
    assert not w.table.changed_rows  # no /metrics: nothing is kept for it
    m = w.metrics()
    m.render_nodes()
    w.put(make_consumer("n1", 1, cls=C.HIDDEN))
    for pid in range(3000, 5000):  # no scrape meanwhile
        c = make_consumer("n1", pid, cls=C.HIDDEN)
        w.put(c)
        w.drop(c)
    w.put(make_consumer("n2", 1, cls=C.HIDDEN))
    assert sum(len(keys) for keys in w.table.changed_rows.values()) < 200
    assert by_family(m.render_nodes()) == by_family(w.metrics().render_nodes())


def test_node_wide_holders_and_monitors() -> None:
    """A holder of node-wide devices only has gpu="" (and gpu_uuid=""): counted, and a finding's
    per-process series like any other. A monitor is counted and has no per-process series."""
    w = World()
    w.cri.answers["aa" * 32] = K8sInfo("resolved", "ml", "leftover-0", container="main")
    w.cri.answers["bb" * 32] = K8sInfo("resolved", "gpu-operator", "dcgm-0", container="exporter")
    w.put(replace(make_consumer("n1", 10, cls=C.HIDDEN, container_id="aa" * 32), gpu=None, gpu_uuid="",
                  gpu_minor=None, devices=["/dev/nvidia-uvm", "/dev/nvidiactl"]))
    w.put(make_consumer("n1", 11, gpu=0, cls=C.MONITOR, container_id="bb" * 32))
    got = samples(w.metrics().render_nodes())
    consumers = {(s["gpu"], s["gpu_uuid"], s["class"]): v for s, v in got["ghostgpu_consumers"]}
    assert consumers == {("", "", "hidden"): 1,
                         ("0", "GPU-00000000-0000-4000-8000-000000000000", "monitor"): 1}
    [(info, _)] = got["ghostgpu_nonvisible_consumer_info"]
    assert (info["pid"], info["gpu"], info["gpu_uuid"], info["class"]) == ("10", "", "", "hidden")
    assert {s["class"] for s, _ in got["ghostgpu_nonvisible_memory_bytes"]} == {"hidden"}


# ---- GPU memory and faults -----------------------------------------------------------------------------

def test_unaccounted_memory_is_written_only_where_known_and_allocated_only_for_known_figures() -> None:
    w = busy_world()
    w.put(make_consumer("n1", 14, gpu=0, cls=C.HIDDEN))  # allocated_bytes unknown: no series, never 0
    got = samples(w.metrics().page().decode())
    assert got["ghostgpu_gpu_memory_unaccounted_bytes"] == [
        ({"node": "n1", "gpu": "0", "gpu_uuid": "GPU-00000000-0000-4000-8000-000000000000"}, 1 << 30)]
    allocated = got["ghostgpu_consumer_gpu_memory_allocated_bytes"]
    assert [(s["pid"], v) for s, v in allocated] == [("10", 2 << 30)]


def test_xid_errors_are_counted_per_node_gpu_and_xid_from_the_fault_book() -> None:
    from ghostgpu.collector.faults import FaultBook

    w = busy_world()
    book = FaultBook(None, None, 10)
    book.counts = {("n1", "0", "79"): 2, ("n1", "", ""): 1, ('n"2', "1", "48"): 1}
    m = w.metrics(faults=book)
    got = samples(m.page().decode())
    assert sorted((s["node"], s["gpu"], s["xid"], v) for s, v in got["ghostgpu_xid_errors_total"]) == [
        ('n"2', "1", "48", 1), ("n1", "", "", 1), ("n1", "0", "79", 2)]
    book.counts[("n1", "0", "79")] = 3  # a new fault: the next scrape has it
    again = samples(m.page().decode())["ghostgpu_xid_errors_total"]
    assert ({"node": "n1", "gpu": "0", "xid": "79"}, 3) in again
    assert typed_families(m.page().decode())["ghostgpu_xid_errors_total"] == "counter"


# ---- the store and the replica's leases --------------------------------------------------------------

def test_store_families_say_the_engine_its_reach_and_each_commit_once() -> None:
    w = busy_world()
    store = FakeStore("postgresql", "collector-1")
    now = [1000.0]
    m = w.metrics(store=store, leases=FakeLeases({"n1": 7}, steals_total=2), clock=lambda: now[0])
    store.commit_seconds += [0.0004, 0.003, 0.003, 20.0]
    store.errors_total, store.pending_bytes = 3, 4096
    got = samples(m.page().decode())
    assert got["ghostgpu_store_info"] == [({"engine": "postgresql", "replica": "collector-1"}, 1)]
    assert got["ghostgpu_store_up"] == [({}, 1)] and got["ghostgpu_store_down_seconds"] == [({}, 0)]
    assert got["ghostgpu_store_errors_total"] == [({}, 3)]
    assert got["ghostgpu_store_pending_bytes"] == [({}, 4096)]
    buckets = {s["le"]: v for s, v in got["ghostgpu_store_commit_seconds_bucket"]}
    assert (buckets["0.0005"], buckets["0.0025"], buckets["0.005"], buckets["10.0"], buckets["+Inf"]) == (
        1, 1, 3, 3, 4)
    assert got["ghostgpu_store_commit_seconds_count"] == [({}, 4)]
    assert got["ghostgpu_store_commit_seconds_sum"][0][1] == pytest.approx(20.0064)
    assert store.commit_seconds == []  # taken: the next scrape counts only what came since
    assert got["ghostgpu_collector_owned_nodes"] == [({}, 1)]
    assert got["ghostgpu_collector_lease_takeovers_total"] == [({}, 2)]

    store.commit_seconds.append(0.001)
    store.db_down_since = now[0] - 12.5  # PostgreSQL out of reach: retried, nothing acknowledged
    got = samples(m.page().decode())
    assert got["ghostgpu_store_commit_seconds_count"] == [({}, 5)]  # cumulative across scrapes
    assert got["ghostgpu_store_up"] == [({}, 0)] and got["ghostgpu_store_down_seconds"] == [({}, 12.5)]
    store.db_down_since, store.failed = None, RuntimeError("--db /c.db: write failed")
    assert samples(m.page().decode())["ghostgpu_store_up"] == [({}, 0)]  # failed for good: down too


def test_the_listener_and_the_replica_commands_are_counted() -> None:
    w = busy_world()
    notifier, now = FakeNotifier(), [500.0]
    replica = SimpleNamespace(counts={("sent", "trace_start", "ok"): 3, ("sent", "cri", "timeout"): 1,
                                      ("run", "trace_part", "ok"): 7, ("run", "other", "error"): 1})
    m = w.metrics(store=FakeStore("postgresql"), leases=FakeLeases({}), notifier=notifier, replica=replica,
                  clock=lambda: now[0])
    notifier.notifications_by_channel["ghostgpu_findings"] = 12
    got = samples(m.page().decode())
    assert sorted((s["channel"], v) for s, v in got["ghostgpu_collector_notifications_total"]) == [
        ("ghostgpu_commands", 0), ("ghostgpu_findings", 12), ("ghostgpu_trace", 0)]
    assert got["ghostgpu_collector_notify_up"] == [({}, 1)]
    assert got["ghostgpu_collector_notify_down_seconds"] == [({}, 0)]
    assert got["ghostgpu_collector_notify_reconnects_total"] == [({}, 0)]
    assert sorted((s["role"], s["kind"], s["result"], v)
                  for s, v in got["ghostgpu_collector_replica_commands_total"]) == [
        ("run", "other", "error", 1), ("run", "trace_part", "ok", 7), ("sent", "cri", "timeout", 1),
        ("sent", "trace_start", "ok", 3)]

    notifier.listening, notifier.down_since = False, now[0] - 4.0  # the listener lost its connection
    got = samples(m.page().decode())
    assert got["ghostgpu_collector_notify_up"] == [({}, 0)]
    assert got["ghostgpu_collector_notify_down_seconds"] == [({}, 4.0)]
    notifier.listening, notifier.down_since, notifier.reconnects_total = True, None, 1  # back
    got = samples(m.page().decode())
    assert (got["ghostgpu_collector_notify_up"], got["ghostgpu_collector_notify_reconnects_total"]) == (
        [({}, 1)], [({}, 1)])
    # SQLite: no listener, no replica commands, none of their families
    text = w.metrics(store=FakeStore("sqlite"), leases=FakeLeases({})).page().decode()
    assert "ghostgpu_collector_notif" not in text and "ghostgpu_collector_replica_commands" not in text


def test_a_replica_writes_the_series_of_the_nodes_it_holds_only() -> None:
    w = busy_world()
    w.put(make_consumer("n4", 40, gpu=0, cls=C.HIDDEN))
    faults = SimpleNamespace(count_rows=lambda: [(("n1", "0", "79"), 2), (("n4", "1", "48"), 1)],
                             dropped_total=0)
    leases = FakeLeases({"n1": 3})
    m = w.metrics(store=FakeStore("postgresql"), leases=leases, faults=faults)
    got = samples(m.page().decode())
    for family in ("ghostgpu_consumers", "ghostgpu_tracer_connected", "ghostgpu_gpu_info",
                   "ghostgpu_tracer_events_ingested_total", "ghostgpu_xid_errors_total"):
        assert {s["node"] for s, _ in got[family]} == {"n1"}, family
    assert got["ghostgpu_tracers_connected"] == [({}, 4)]  # this replica's streams, whatever it holds
    leases.held["n4"] = 1  # took n4's lease: its series come here, written from scratch
    del leases.held["n1"]  # lost n1's: they go (the new owner writes them)
    got = samples(m.page().decode())
    assert {s["node"] for s, _ in got["ghostgpu_consumers"]} == {"n4"}
    assert {s["node"] for s, _ in got["ghostgpu_xid_errors_total"]} == {"n4"}
    assert [s["pid"] for s, _ in got["ghostgpu_nonvisible_consumer_info"]] == ["40"]
    # One collector on SQLite writes every node it knows, leases or not.
    sqlite = samples(w.metrics(store=FakeStore("sqlite"), leases=FakeLeases({"n1": 1})).page().decode())
    assert {s["node"] for s, _ in sqlite["ghostgpu_tracer_connected"]} == {"n1", "n2", "n3", "n4"}
