"""tests/helpers/promstack.py itself: the daemons come up on loopback, a bad config is one clear error
with the daemon's own words, and nothing is left running."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.helpers.promstack import Alertmanager, Prometheus

pytestmark = pytest.mark.prometheus


def test_a_bad_rule_file_fails_with_prometheus_s_error_line(tmp_path: Path) -> None:
    rules = tmp_path / "bad-rules.yaml"
    rules.write_text('groups: [{name: g, rules: [{alert: Broken, expr: "sum("}]}]\n')
    with pytest.raises(AssertionError) as err:
        Prometheus(tmp_path / "prom", rule_files=[rules])
    text = str(err.value)
    assert "prometheus exited with 1" in text, text
    assert "Broken" in text and "parse error" in text, text
    assert "Stopping" not in text, "shutdown chatter instead of the cause"


def test_prometheus_queries_and_stops(tmp_path: Path) -> None:
    with Prometheus(tmp_path / "prom", interval_s=1) as prom:
        assert prom.address.startswith("127.0.0.1:")
        assert prom.query("1 + 1")[0]["value"][1] == "2"
        status, body = prom.query_raw("sum(")
        assert status == 400 and body["errorType"] == "bad_data"
        proc = prom.proc
    assert proc is not None and proc.poll() is not None, "Prometheus still running after the with block"


def test_alertmanager_takes_an_alert_and_drops_it_once_resolved(tmp_path: Path) -> None:
    with Alertmanager(tmp_path / "am") as am:
        now = datetime.now(UTC)
        alert = {"labels": {"alertname": "PromstackSelfTest", "pod": "p-1"},
                 "startsAt": (now - timedelta(seconds=5)).isoformat()}
        assert am.post_alerts([alert])[0] == 200
        got = am.wait_alert("PromstackSelfTest", pod="p-1", timeout_s=10)
        assert got["labels"] == {"alertname": "PromstackSelfTest", "pod": "p-1"}
        assert am.alerts(pod="p-2") == []
        assert am.post_alerts([alert | {"endsAt": now.isoformat()}])[0] == 200
        am.wait_gone("PromstackSelfTest", timeout_s=10)
        proc = am.proc
    assert proc is not None and proc.poll() is not None
