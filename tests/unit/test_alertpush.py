"""collector.alertpush: findings from the real cluster table POSTed to a fake Alertmanager on loopback
(real HTTP): the JSON, resolution, re-sending, settling names, retries, 400s, HA pairs, and push()
staying O(1) while an Alertmanager hangs. The real Alertmanager 0.25 is in
tests/integration/test_alertmanager_real.py."""

from __future__ import annotations

import itertools
import logging
import string
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime

import pytest
from ghostgpu.collector.alertbook import AlertBook, fault_annotations, fault_labels
from ghostgpu.collector.alertpush import (
    ALERT_ANNOTATIONS,
    FINDING_ALERTS,
    AlertPusher,
    parse_alert_labels,
    parse_alertmanager_urls,
)
from ghostgpu.collector.alertsend import Endpoint

from ghostgpu.common.model.consumers import ConsumerClass, K8sInfo
from ghostgpu.v1 import query_pb2
from tests.helpers.alertpush_env import FakeAlertmanager, FindingTable, k8s
from tests.helpers.polling import wait_until
from tests.helpers.promstack import free_port
from tests.helpers.sim_tracer import make_consumer

CID_A, CID_B = "aa" * 32, "bb" * 32
HIDDEN_LABELS = {
    "alertname": "GhostGPUHiddenConsumer", "severity": "critical", "node": "n1", "gpu": "0",
    "gpu_uuid": "GPU-00000000-0000-4000-8000-000000000000", "class": "hidden", "namespace": "team-a",
    "pod": "train-0", "container": "trainer", "pid": "4242", "comm": "python3",
    "source": "ghostgpu-collector",
}


@pytest.fixture
def am() -> Iterator[FakeAlertmanager]:
    fake = FakeAlertmanager().start()
    yield fake
    fake.stop()


@pytest.fixture
def table() -> FindingTable:
    t = FindingTable("n1")
    t.names[CID_A] = k8s("team-a", "train-0", "trainer")
    return t


def _pusher(table: FindingTable, urls: list[str], **kw: object) -> AlertPusher:
    kw.setdefault("resend_s", 60.0)
    pusher = AlertPusher(urls, **kw)  # type: ignore[arg-type]
    table.table.watch(pusher.watcher, include_open=True)
    pusher.start()
    return pusher


def _unix(rfc3339: str) -> float:
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


def test_an_opened_finding_is_posted_at_once_with_labels_and_texts(am: FakeAlertmanager,
                                                                   table: FindingTable) -> None:
    pusher = _pusher(table, [am.url], extra_labels={"cluster": "eu-1"})
    try:
        t0 = time.monotonic()
        table.add(make_consumer("n1", 4242, container_id=CID_A))
        am.wait("the hidden consumer's alert", lambda: am.firing(pid="4242"))
        latency_s = am.posts[0].at_mono - t0
        post = am.posts[0]
        assert post.path == "/api/v2/alerts" and post.headers["Content-Type"] == "application/json"
        (alert,) = post.alerts
        assert alert["labels"] == HIDDEN_LABELS | {"cluster": "eu-1"}
        assert alert["annotations"]["summary"] == (
            "Hidden GPU consumer on node n1 GPU 0 (GPU-00000000-0000-4000-8000-000000000000), "
            "pod team-a/train-0, PID 4242 (python3)")
        assert "container trainer of pod team-a/train-0" in alert["annotations"]["description"]
        rec = table.table.open_findings()[0]
        assert abs(_unix(alert["startsAt"]) - rec.opened_unix_ns / 1e9) < 0.002
        assert "endsAt" not in alert and latency_s < 1.0
        print(f"finding opened -> POST received in {latency_s * 1000:.1f} ms")
    finally:
        pusher.stop()


def test_a_resolved_finding_is_sent_with_endsAt_and_resent_for_resolved_keep_s(
        am: FakeAlertmanager, table: FindingTable) -> None:
    pusher = _pusher(table, [am.url], resend_s=0.1, resolved_keep_s=0.5)
    try:
        c = make_consumer("n1", 4242, container_id=CID_A)
        table.add(c)
        am.wait("the firing alert", lambda: am.firing(pid="4242"))
        table.remove(c)
        am.wait("the resolution", lambda: am.resolved(pid="4242"))
        (alert,) = am.alerts(pid="4242")
        assert alert["labels"] == HIDDEN_LABELS
        assert _unix(alert["endsAt"]) >= _unix(alert["startsAt"])
        assert abs(_unix(alert["endsAt"]) - time.time()) < 5
        # Re-sent with endsAt (a restarted Alertmanager still learns it resolved), then forgotten.
        am.wait("the resolution re-sent", lambda: sum("endsAt" in a for p in am.ok_posts_with(pid="4242")
                                                      for a in p.alerts) >= 3)
        wait_until(lambda: not pusher._book.alerts, "the pusher to forget the resolved alert", 5)
        assert pusher.stats().pending == 0
    finally:
        pusher.stop()


def test_firing_alerts_are_resent_every_resend_s_without_endsAt(am: FakeAlertmanager,
                                                                table: FindingTable) -> None:
    resend_s = 0.2
    pusher = _pusher(table, [am.url], resend_s=resend_s)
    try:
        table.add(make_consumer("n1", 4242, container_id=CID_A))
        am.wait("four sends", lambda: len(am.ok_posts_with(pid="4242")) >= 4)
        posts = am.ok_posts_with(pid="4242")
        gaps = [b.at_mono - a.at_mono for a, b in itertools.pairwise(posts)]
        assert all(g >= resend_s * 0.9 for g in gaps[1:]), gaps  # the first re-send may align to the cycle
        assert all(g < resend_s * 5 for g in gaps), gaps
        assert all("endsAt" not in a for p in posts for a in p.alerts)
        wait_until(lambda: pusher.stats().alerts_sent_total >= 4, "four alerts counted as sent")
    finally:
        pusher.stop()


def test_a_finding_waiting_for_its_cri_names_is_held_then_sent_with_them(am: FakeAlertmanager,
                                                                         table: FindingTable) -> None:
    pusher = _pusher(table, [am.url], settle_s=10.0)
    try:
        t0 = time.monotonic()
        table.add(make_consumer("n1", 7, container_id=CID_B))  # CRI has not answered for CID_B
        wait_until(lambda: pusher.stats().pending == 1, "the finding held")
        table.set_names(CID_B, k8s("team-b", "infer-0", "server"))
        am.wait("the alert with its names", lambda: am.firing(pid="7", pod="infer-0"))
        assert time.monotonic() - t0 < 5.0  # the names released it, not the 10 s settle
        assert all(a["labels"].get("pod") == "infer-0" for p in am.posts for a in p.alerts)
    finally:
        pusher.stop()


def test_a_finding_whose_cri_is_unreachable_is_not_held(am: FakeAlertmanager, table: FindingTable) -> None:
    """Only a lookup in flight is worth waiting for: with CRI down the alert goes out at once."""
    pusher = _pusher(table, [am.url], settle_s=10.0)
    try:
        t0 = time.monotonic()
        table.set_names(CID_B, K8sInfo("unresolved", error="no CRI path to node n1"))
        table.add(make_consumer("n1", 8, container_id=CID_B))
        am.wait("the alert without names", lambda: am.firing(pid="8"))
        assert time.monotonic() - t0 < 5.0
        assert all("pod" not in a["labels"] for p in am.posts for a in p.alerts)
    finally:
        pusher.stop()


def test_names_that_come_after_settle_s_resolve_the_old_label_set_and_fire_the_new(
        am: FakeAlertmanager, table: FindingTable) -> None:
    pusher = _pusher(table, [am.url], settle_s=0.2)
    try:
        t0 = time.monotonic()
        table.add(make_consumer("n1", 7, container_id=CID_B))
        am.wait("the alert sent without names", lambda: am.firing(pid="7"))
        assert am.posts[0].at_mono - t0 >= 0.2
        (bare,) = am.firing(pid="7")
        assert not {"namespace", "pod", "container"} & set(bare["labels"])  # empty values left out
        table.set_names(CID_B, k8s("team-b", "infer-0", "server"))
        am.wait("the new label set", lambda: am.firing(pid="7", pod="infer-0"))
        am.wait("the old label set resolved", lambda: any(
            "pod" not in a["labels"] for a in am.resolved(pid="7")))
        assert len(am.firing(pid="7")) == 1
    finally:
        pusher.stop()


def test_a_finding_resolved_while_held_is_sent_once_resolved(am: FakeAlertmanager,
                                                            table: FindingTable) -> None:
    pusher = _pusher(table, [am.url], settle_s=10.0)
    try:
        c = make_consumer("n1", 7, container_id=CID_B)
        table.add(c)
        table.remove(c)  # a short-lived consumer: gone before CRI answered
        am.wait("the resolved alert", lambda: am.resolved(pid="7"), timeout_s=2.0)
        assert not any("endsAt" not in a for p in am.posts for a in p.alerts)  # never sent firing
    finally:
        pusher.stop()


def test_a_new_finding_with_the_same_labels_fires_again_and_is_not_resolved_by_the_old(
        am: FakeAlertmanager, table: FindingTable) -> None:
    pusher = _pusher(table, [am.url], resend_s=0.1)
    try:
        c = make_consumer("n1", 4242, container_id=CID_A)
        table.add(c)
        am.wait("the first firing", lambda: am.firing(pid="4242"))
        table.add(replace(c, cls=ConsumerClass.VISIBLE))  # the driver lists it now: resolved
        table.add(c)  # hidden again: a new finding, the same label set
        (rec,) = table.table.open_findings()
        assert rec.id == 2
        sends = len(am.ok_posts_with(pid="4242"))
        am.wait("re-sends after the second finding opened",
                lambda: len(am.ok_posts_with(pid="4242")) >= sends + 3)
        (alert,) = am.firing(pid="4242")  # the latest state: firing, since the second finding opened
        assert abs(_unix(alert["startsAt"]) - rec.opened_unix_ns / 1e9) < 0.002
    finally:
        pusher.stop()


def test_an_alertmanager_down_then_up_gets_the_alert(table: FindingTable) -> None:
    port = free_port()
    pusher = _pusher(table, [f"http://127.0.0.1:{port}"], timeout_s=1.0)
    am = FakeAlertmanager(port=port)
    try:
        table.add(make_consumer("n1", 4242, container_id=CID_A))
        wait_until(lambda: pusher.stats().posts_failed_total >= 2, "failed attempts while it is down")
        stats = pusher.stats()
        assert stats.pending == 1 and stats.posts_ok_total == 0
        assert f"127.0.0.1:{port}" in stats.last_error and "\n" not in stats.last_error
        am.start()
        am.wait("the alert after the Alertmanager came up", lambda: am.firing(pid="4242"), timeout_s=10)
        wait_until(lambda: pusher.stats().pending == 0, "nothing pending")
        assert pusher.stats().last_success_unix_s > 0
    finally:
        pusher.stop()
        am.stop()


def test_a_kept_alive_connection_the_peer_closed_is_not_a_failure(am: FakeAlertmanager,
                                                                  table: FindingTable) -> None:
    am.drop_keepalive = True
    pusher = _pusher(table, [am.url], resend_s=0.05)
    try:
        table.add(make_consumer("n1", 4242, container_id=CID_A))
        am.wait("five sends", lambda: len(am.ok_posts_with(pid="4242")) >= 5)
        assert pusher.stats().posts_failed_total == 0, pusher.stats().last_error
    finally:
        pusher.stop()


def test_5xx_is_retried_with_backoff_and_the_latest_state_is_kept(am: FakeAlertmanager,
                                                                  table: FindingTable) -> None:
    am.always = (500, b'"store failure"')
    pusher = _pusher(table, [am.url], resend_s=60.0)
    try:
        c = make_consumer("n1", 4242, container_id=CID_A)
        table.add(c)
        wait_until(lambda: pusher.stats().posts_failed_total >= 3, "three failed POSTs", 10)
        table.remove(c)  # resolves while the Alertmanager fails: the resolution must not be lost
        am.always = None
        am.wait("the resolution after the errors", lambda: am.resolved(pid="4242"), timeout_s=10)
        times = [p.at_mono for p in am.posts]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        # 0.5 s doubling, each delay drawn from [half, full]
        assert gaps[0] >= 0.25 * 0.9 and gaps[1] >= 0.5 * 0.9, gaps
        assert "answered 500: store failure" in pusher.stats().last_error
    finally:
        pusher.stop()


def test_400_is_counted_logged_once_and_not_retried_in_a_loop(am: FakeAlertmanager, table: FindingTable,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    am.always = (400, b'"invalid label set: invalid name \\"bad-name\\""')
    caplog.set_level(logging.WARNING, logger="ghostgpu.alertpush")
    pusher = _pusher(table, [am.url], resend_s=0.1)
    try:
        table.add(make_consumer("n1", 4242, container_id=CID_A))
        wait_until(lambda: pusher.stats().posts_rejected_total >= 3, "three refused POSTs")
        stats = pusher.stats()
        assert stats.posts_failed_total >= stats.posts_rejected_total >= 3 and stats.posts_ok_total == 0
        assert stats.pending == 0  # the batch's valid alerts are stored by Alertmanager: taken
        lines = [r.getMessage() for r in caplog.records if 'invalid name "bad-name"' in r.getMessage()]
        assert len(lines) == 1, lines
        times = [p.at_mono for p in am.posts]
        assert all(b - a >= 0.05 for a, b in itertools.pairwise(times[1:]))  # the resend pace, no storm
    finally:
        pusher.stop()


def test_push_stays_o1_while_the_alertmanager_hangs_and_stop_is_bounded(am: FakeAlertmanager,
                                                                        table: FindingTable) -> None:
    am.hanging = True
    pusher = _pusher(table, [am.url], timeout_s=30.0)
    try:
        table.add(make_consumer("n1", 4242, container_id=CID_A))
        wait_until(lambda: am.in_flight == 1, "the sender stuck in a POST")
        template = table.table.open_findings()[0].to_proto()
        events = []
        for i in range(10_000):
            f = query_pb2.Finding()
            f.CopyFrom(template)
            f.id = 1000 + i % 100  # 100 findings changing over and over
            events.append(query_pb2.FindingEvent(kind=query_pb2.FindingEvent.KIND_CHANGED, finding=f))
        t0 = time.perf_counter()
        for e in events:
            pusher.watcher.push(e)
        elapsed_s = time.perf_counter() - t0
        print(f"10,000 push() calls with the Alertmanager hanging: {elapsed_s * 1000:.1f} ms "
              f"({elapsed_s / 10_000 * 1e6:.2f} us each)")
        assert elapsed_s < 0.5
        assert len(pusher._inbox) <= 100  # the latest event per finding, not a queue of 10,000
        t0 = time.monotonic()
        pusher.stop(timeout_s=0.5)
        assert time.monotonic() - t0 < 1.5
    finally:
        am.release.set()
        pusher.stop(timeout_s=0.1)


def test_each_alertmanager_of_an_ha_pair_gets_every_alert_and_a_hung_one_delays_no_other(
        table: FindingTable) -> None:
    stuck, a, b = FakeAlertmanager().start(), FakeAlertmanager().start(), FakeAlertmanager().start()
    stuck.hanging = True
    pusher = _pusher(table, [f"{stuck.url},{a.url}", b.url], timeout_s=30.0)
    try:
        assert len(pusher.urls) == 3
        table.add(make_consumer("n1", 4242, container_id=CID_A), make_consumer("n1", 43, container_id=CID_A))
        for fake in (a, b):
            fake.wait("both alerts", lambda f=fake: len(f.firing()) == 2, timeout_s=2.0)
        wait_until(lambda: stuck.in_flight == 1, "the first Alertmanager to hold the POST")
    finally:
        stuck.release.set()
        pusher.stop(timeout_s=0.5)
        for fake in (stuck, a, b):
            fake.stop()


def test_stop_makes_one_last_attempt_to_deliver_resolutions(am: FakeAlertmanager,
                                                            table: FindingTable) -> None:
    pusher = _pusher(table, [am.url], resend_s=60.0)
    c = make_consumer("n1", 4242, container_id=CID_A)
    table.add(c)
    am.wait("the firing alert", lambda: am.firing(pid="4242"))
    am.always = (503, b"")
    table.remove(c)
    wait_until(lambda: pusher.stats().posts_failed_total >= 3, "the resolution failing (backoff >= 1 s)", 10)
    am.always = None
    t0 = time.monotonic()
    pusher.stop(timeout_s=2.0)
    assert time.monotonic() - t0 < 2.5
    assert am.resolved(pid="4242")


def test_batches_hold_at_most_max_batch_alerts_and_open_findings_are_included(
        am: FakeAlertmanager, table: FindingTable) -> None:
    consumers = [make_consumer("n1", 100 + i, container_id=CID_A) for i in range(5)]
    table.add(*consumers)  # opened before the pusher watches: include_open brings them
    table.add(make_consumer("n1", 9, cls=ConsumerClass.VISIBLE, container_id=CID_A))  # no finding
    pusher = _pusher(table, [am.url], max_batch=2)
    try:
        am.wait("five alerts", lambda: len(am.firing()) == 5)
        assert max(len(p.alerts) for p in am.posts) == 2
        assert not am.alerts(pid="9")
    finally:
        pusher.stop()


def test_url_prefix_and_basic_auth(am: FakeAlertmanager, table: FindingTable) -> None:
    pusher = _pusher(table, [f"http://ops:s3cret@127.0.0.1:{am.port}/alertmanager/"])
    try:
        assert pusher.urls == [f"http://127.0.0.1:{am.port}/alertmanager"]  # no password in logs
        table.add(make_consumer("n1", 4242, container_id=CID_A))
        am.wait("the alert", lambda: am.posts)
        assert am.posts[0].path == "/alertmanager/api/v2/alerts"
        assert am.posts[0].headers["Authorization"] == "Basic b3BzOnMzY3JldA=="
    finally:
        pusher.stop()


@pytest.mark.parametrize("url", ["ftp://am:9093", "am:9093", "http://am:99999", "http://am:9093/?x=1",
                                 "http://", ""])
def test_a_bad_alertmanager_url_is_one_line_naming_the_flag(url: str) -> None:
    with pytest.raises(ValueError) as e:
        AlertPusher([url], resend_s=60.0)
    assert str(e.value).startswith("--alertmanager") and "\n" not in str(e.value)


@pytest.mark.parametrize("value", ["cluster", "bad-name=x", "9lives=x", "__meta=x", "alertname=x", "pod=x",
                                   "cluster="])
def test_a_bad_alert_label_is_one_line_naming_the_flag(value: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_alert_labels([value])
    assert str(e.value).startswith("--alert-label") and "\n" not in str(e.value)
    key, _, val = value.partition("=")
    with pytest.raises(ValueError, match=r"^--alert-label"):
        AlertPusher(["http://127.0.0.1:9093"], resend_s=60.0,
                    extra_labels={key: val} if "=" in value else {"a-b": "x"})


def test_flags_parse() -> None:
    assert parse_alert_labels(["cluster=prod=eu", "team=gpu"]) == {"cluster": "prod=eu", "team": "gpu"}
    assert parse_alertmanager_urls(["http://a:9093, http://b:9093", "http://a:9093/"]) == [
        "http://a:9093", "http://b:9093"]
    assert Endpoint.parse("https://am.example/api/v2/alerts").path == "/api/v2/alerts"
    assert Endpoint.parse("https://am.example").port == 443


def test_every_finding_class_has_an_alert_and_texts_with_label_placeholders_only() -> None:
    assert set(FINDING_ALERTS) == {"hidden", "ghost", "orphaned", "unallocated", "unattributed"}
    assert {name for name, _ in FINDING_ALERTS.values()} == set(ALERT_ANNOTATIONS)
    fields = {"node", "gpu", "gpu_uuid", "namespace", "pod", "container", "pid", "comm"}
    for texts in ALERT_ANNOTATIONS.values():
        assert set(texts) == {"summary", "description"}
        for text in texts.values():
            used = {f for _, f, spec, conv in string.Formatter().parse(text) if f is not None}
            assert used <= fields, used
        summary_fields = {f for _, f, _, _ in string.Formatter().parse(texts["summary"]) if f}
        assert {"node", "gpu", "pod", "pid"} <= summary_fields


# ---- GPU faults: one alert per fault, held for --alert-fault-hold -----------------------------------------


BOOT_ID = "0b00d1d5-7e57-4000-8000-000000000000"


def _fid(kmsg_seq: int) -> str:
    """The fault_id label of a fault of BOOT_ID's record `kmsg_seq` (collector/faults.py fault_key)."""
    return f"0b00d1d5-{kmsg_seq}"


def _cluster_fault(fid: int = 1, *, xid: int = 79, severity: str = "critical",
                   pods: tuple[str, ...] = ("train-0",), pending: bool = False,
                   ts_unix_ns: int = 0, stored_unix_ns: int = 0, origin: str = "") -> query_pb2.ClusterFault:
    cf = query_pb2.ClusterFault(id=fid, node="n1", ts_unix_ns=ts_unix_ns or time.time_ns(), boot_id=BOOT_ID,
                                stored_unix_ns=stored_unix_ns or ts_unix_ns or time.time_ns())
    f = cf.fault
    f.kmsg_seq = fid  # one kernel log record per fault
    f.xid, f.gpu, f.gpu_uuid, f.pci_bus_id, f.severity = xid, 0, "GPU-0", "0000:3b:00", severity
    f.meaning = "GPU has fallen off the bus" if xid == 79 else ""
    f.origin = origin  # "": unset, as from a tracer that predates the field (the driver's)
    f.message = "GPU has fallen off the bus."  # as tracer/xid.py hands it on: pid= and name= read apart
    for i, pod in enumerate(pods):
        h = cf.hits.add()
        h.consumer.process.pid, h.consumer.process.comm = 4242 + i, "python3"
        h.consumer.process.container_id = CID_A
        h.consumer.named = i == 0
        if pending:
            h.k8s.resolution, h.k8s.error = "unresolved", "CRI lookup pending"
        else:
            h.k8s.resolution, h.k8s.namespace = "resolved", "team-a"
            h.k8s.pod, h.k8s.container = pod, "trainer"
    return cf


@pytest.mark.parametrize(("fault", "labels"), [
    (_cluster_fault(), {"alertname": "GhostGPUXid", "severity": "critical", "node": "n1", "gpu": "0",
                        "gpu_uuid": "GPU-0", "xid": "79", "fault_id": _fid(1), "origin": "kernel",
                        "source": "ghostgpu-collector"}),
    (_cluster_fault(4, origin="user"), {"severity": "critical", "origin": "user", "fault_id": _fid(4)}),
    (_cluster_fault(2, xid=13, severity="unknown"),
     {"severity": "warning", "xid": "13", "fault_id": _fid(2)}),
    (_cluster_fault(3, xid=-1, severity="unknown"), {"severity": "warning", "fault_id": _fid(3)}),  # no xid
])
def test_fault_labels(fault: query_pb2.ClusterFault, labels: dict[str, str]) -> None:
    got = fault_labels(fault, {"cluster": "eu"})
    assert labels.items() <= got.items() and got["cluster"] == "eu"
    assert ("xid" in got) == (fault.fault.xid >= 0)


def test_fault_annotations_name_the_pods_the_meaning_and_the_message() -> None:
    a = fault_annotations(_cluster_fault(pods=("train-0", "eval-1")))
    assert a["pods"] == "team-a/train-0, team-a/eval-1"
    assert a["meaning"] == "GPU has fallen off the bus"
    assert a["message"] == "GPU has fallen off the bus."
    assert a["summary"] == ("Xid 79 on node n1 GPU 0: GPU has fallen off the bus; hit team-a/train-0, "
                            "team-a/eval-1")
    named = "PID 4242 (python3) in container trainer of pod team-a/train-0 (named by the driver)"
    assert named in a["description"]


def test_the_annotations_of_a_user_written_line_say_it_is_not_the_drivers() -> None:
    a = fault_annotations(_cluster_fault(origin="user"))
    assert a["summary"].startswith("User-written line: Xid 79 on node n1 GPU 0")
    assert a["description"].startswith("A line user space (not the driver) wrote to node n1's kernel log")
    assert not fault_annotations(_cluster_fault(origin="kernel"))["summary"].startswith("User")
    assert fault_annotations(_cluster_fault(pods=()))["pods"] == "no process held the GPU"


def test_a_fault_is_one_alert_ending_fault_hold_s_after_it(am: FakeAlertmanager, table: FindingTable) -> None:
    pusher = _pusher(table, [am.url], fault_hold_s=7200.0)
    try:
        first, second = _cluster_fault(1), _cluster_fault(2)
        pusher.offer_fault(first)
        pusher.offer_fault(second)  # the same Xid on the same GPU again: an alert of its own
        am.wait("both faults' alerts", lambda: len(am.alerts(alertname="GhostGPUXid")) == 2)
        alert = am.alerts(fault_id=_fid(1))[0]
        starts = _unix(alert["startsAt"])
        assert abs(starts - first.ts_unix_ns / 1e9) < 0.002
        assert abs(_unix(alert["endsAt"]) - starts - 7200.0) < 0.002
        assert alert["annotations"]["pods"] == "team-a/train-0"
    finally:
        pusher.stop()


@pytest.mark.parametrize(("late_s", "hold_from"), [
    (0.0, "fault"),  # stored as it was read: held from the fault
    (3 * 3600.0, "stored"),  # spooled through a 3 h outage, longer than the hold: held from its storing
])
def test_a_fault_delivered_late_is_held_from_when_it_was_stored(late_s: float, hold_from: str) -> None:
    book = AlertBook(["am"], {}, resend_s=60.0, resolved_keep_s=60.0, settle_s=0.0)
    book.fault_hold_s = 3600.0
    stored_ns = time.time_ns()
    cf = _cluster_fault(ts_unix_ns=stored_ns - int(late_s * 1e9), stored_unix_ns=stored_ns)
    assert book.apply_faults([cf], time.monotonic())
    (body,) = [a.body for a in book.alerts.values()]
    starts, ends = _unix(str(body["startsAt"])), _unix(str(body["endsAt"]))
    assert abs(starts - cf.ts_unix_ns / 1e9) < 0.002  # it started when the driver wrote it
    held_from = {"fault": cf.ts_unix_ns, "stored": stored_ns}[hold_from] / 1e9
    assert abs(ends - held_from - 3600.0) < 0.002
    assert ends > time.time()  # not ended on arrival: Alertmanager notifies


def test_a_fault_waits_for_its_pod_names_then_settle_s(am: FakeAlertmanager, table: FindingTable) -> None:
    pusher = _pusher(table, [am.url], settle_s=30.0)
    try:
        pusher.offer_fault(_cluster_fault(1, pending=True))
        wait_until(lambda: pusher.stats().pending == 1, "the fault held for its names")
        assert am.alerts(alertname="GhostGPUXid") == []
        pusher.offer_fault(_cluster_fault(1))  # CRI answered: the fault book offers it again
        am.wait("the fault with its pods", lambda: am.alerts(fault_id=_fid(1)))
        assert am.alerts(fault_id=_fid(1))[0]["annotations"]["pods"] == "team-a/train-0"
    finally:
        pusher.stop()
    quick = _pusher(table, [am.url], settle_s=0.2)
    try:
        quick.offer_fault(_cluster_fault(5, pending=True))
        am.wait("the fault sent without names after settle_s", lambda: am.alerts(fault_id=_fid(5)))
        assert am.alerts(fault_id=_fid(5))[0]["annotations"]["pods"] == "container aaaaaaaaaaaaa"
    finally:
        quick.stop()


def test_a_fault_alert_is_forgotten_after_it_ended_and_was_taken(am: FakeAlertmanager,
                                                                 table: FindingTable) -> None:
    pusher = _pusher(table, [am.url], resend_s=0.1, fault_hold_s=0.3, resolved_keep_s=0.2)
    try:
        pusher.offer_fault(_cluster_fault(1))
        am.wait("the fault's alert", lambda: am.alerts(fault_id=_fid(1)))
        wait_until(lambda: not pusher._book.alerts and pusher.stats().pending == 0,
                   "the pusher to forget the ended fault alert", 5)
    finally:
        pusher.stop()


def test_a_fault_hold_of_0_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match=r"^--alert-fault-hold 0: must be above 0"):
        AlertPusher(["http://127.0.0.1:9093"], resend_s=60.0, fault_hold_s=0)


def test_a_node_that_moves_to_another_replica_stops_being_pushed_here_and_is_pushed_by_its_new_owner(
        am: FakeAlertmanager, table: FindingTable) -> None:
    """Replicas: the old owner forgets the node's findings (no resolution sent) and stops re-sending
    their alerts; the new owner adopts the open rows and fires the same label set."""
    old = _pusher(table, [am.url], resend_s=0.1)
    old.watcher.local_only = True
    table.table.on_forget.append(old.release_findings)
    new_table = FindingTable("n1")
    new = _pusher(new_table, [am.url], resend_s=0.1)
    new.watcher.local_only = True
    try:
        table.add(make_consumer("n1", 4242, container_id=CID_A))
        am.wait("the old owner's alert", lambda: am.firing(pid="4242"))
        rows = [rec.row() for rec in table.table.open_findings()]
        table.table.forget_node("n1")
        wait_until(lambda: not old._book.alerts, "the old owner to drop the alert", 5)
        sent_before = len(am.ok_posts_with(pid="4242"))
        new_table.table.adopt_open("n1", rows)  # the rows the store gives the new owner with the lease
        am.wait("the new owner's re-send", lambda: len(am.ok_posts_with(pid="4242")) >= sent_before + 3)
        assert not am.resolved(pid="4242")  # never resolved in the move
        assert {a["labels"]["pid"] for p in am.ok_posts_with(pid="4242") for a in p.alerts} == {"4242"}
        assert old.stats().pending == 0 and not old._book.findings
    finally:
        old.stop()
        new.stop()
