"""The metrics, Alertmanager and health flags of `ghostgpu collector`, `up` and `tracer`: parsing,
what reaches the Collector and the tracer child, and one line with exit 2 for a bad value."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from ghostgpu.cli import main as cli
from ghostgpu.cli import up
from ghostgpu.collector.config import CollectorConfig, collector_config
from ghostgpu.collector.heap import HeapPolicy
from ghostgpu.collector.run import run_collector

from ghostgpu.common.system.settings import flag_values

COLLECTOR_FLAGS = ["--metrics-listen", "127.0.0.1:0", "--metrics-max-process-series", "5",
                   "--alertmanager", "http://a:9093,http://b:9093", "--alertmanager", "http://c:9093",
                   "--alertmanager-resend-s", "15", "--alert-label", "cluster=eu-1",
                   "--alert-label", "env=a=b", "--web-config-file", "/etc/ghostgpu/web.yml",
                   "--http-max-connections", "64", "--http-max-connections-per-source", "8"]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def parse(*argv: str) -> argparse.Namespace:
    return cli._build_parser().parse_args(list(argv))


def settings(*argv: str) -> CollectorConfig:
    """The collector's settings from these flags (`up` has no collector config file)."""
    return CollectorConfig(**flag_values(CollectorConfig, parse(*argv)))


def metrics_settings(cfg: CollectorConfig) -> dict[str, Any]:
    return {k: getattr(cfg, k) for k in ("metrics_listen", "metrics_max_process_series", "alertmanager",
                                         "alert_resend_s", "alert_labels", "web_config_file",
                                         "http_max_connections", "http_max_connections_per_source")}


@pytest.mark.parametrize("command", ["collector", "up"])
def test_collector_and_up_take_the_metrics_and_alertmanager_flags(command: str) -> None:
    assert metrics_settings(settings(command, *COLLECTOR_FLAGS)) == {
        "metrics_listen": "127.0.0.1:0", "metrics_max_process_series": 5,
        "alertmanager": ("http://a:9093", "http://b:9093", "http://c:9093"),
        "alert_resend_s": 15.0, "alert_labels": {"cluster": "eu-1", "env": "a=b"},
        "web_config_file": "/etc/ghostgpu/web.yml", "http_max_connections": 64,
        "http_max_connections_per_source": 8}


def test_defaults_serve_nothing_and_push_nothing() -> None:
    assert metrics_settings(collector_config(parse("collector"))) == {
        "metrics_listen": None, "metrics_max_process_series": 1000, "alertmanager": (),
        "alert_resend_s": 60.0, "alert_labels": {}, "web_config_file": None, "http_max_connections": None,
        "http_max_connections_per_source": None}
    assert parse("tracer").health_listen is None and parse("up").health_listen is None


def test_url_and_label_lists() -> None:
    cfg = settings("collector", "--alertmanager", " http://a:1 , ", "--alertmanager", "http://b:2,http://a:1")
    assert cfg.alertmanager == ("http://a:1", "http://b:2")
    for bad, message in ((["--alert-label", "cluster"], r"^--alert-label 'cluster': use KEY=VALUE"),
                         (["--alert-label", "=x"], r"^--alert-label"),
                         ([], r"^--alertmanager 'ftp://x'")):
        with pytest.raises(ValueError, match=message):
            url = "http://a:1" if bad else "ftp://x"
            settings("collector", "--alertmanager", url, *bad)
    with pytest.raises(ValueError, match=r"^--alert-label: labels go on alerts pushed to Alertmanager"):
        settings("collector", "--alert-label", "cluster=eu")


def test_up_passes_health_listen_to_its_tracer() -> None:
    args = parse("up", "--health-listen", "127.0.0.1:9401", "--node-name", "n1")
    cmd = up.tracer_command(args, "127.0.0.1:7450", "n1", None)
    assert cmd[cmd.index("--health-listen") + 1] == "127.0.0.1:9401"
    assert "--health-listen" not in up.tracer_command(parse("up"), "127.0.0.1:7450", "n1", None)


def test_up_passes_the_http_caps_and_insecure_to_its_tracer() -> None:
    args = parse("up", "--health-listen", "0.0.0.0:9401", "--insecure", "--http-max-connections", "64",
                 "--http-max-connections-per-source", "4")
    cmd = up.tracer_command(args, "127.0.0.1:7450", "n1", None)
    assert cmd[cmd.index("--http-max-connections") + 1] == "64"
    assert cmd[cmd.index("--http-max-connections-per-source") + 1] == "4"
    assert "--insecure" in cmd
    plain = up.tracer_command(parse("up"), "127.0.0.1:7450", "n1", None)
    assert not {"--insecure", "--http-max-connections", "--http-max-connections-per-source"} & set(plain)


def test_tracer_health_listen_reaches_the_config() -> None:
    cfg = cli._config(parse("tracer", "--health-listen", "127.0.0.1:9401", "--node-name", "n1"))
    assert cfg.health_listen == "127.0.0.1:9401"


def test_a_bad_tracer_health_listen_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["tracer", "--node-name", "n1", "--health-listen", "9401"]) == 2
    err = capsys.readouterr().err
    assert "--health-listen" in err and err.count("\n") == 1


def _collector_args(tmp_path: Path, *flags: str) -> argparse.Namespace:
    return parse("collector", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "c.db"), *flags)


@pytest.mark.parametrize(("flags", "expected"), [
    (["--metrics-listen", "localhost"], "ghostgpu: collector: --metrics-listen 'localhost': use HOST:PORT"),
    (["--metrics-listen", "127.0.0.1:99999"], "--metrics-listen '127.0.0.1:99999': use HOST:PORT"),
    (["--metrics-max-process-series", "-1"], "--metrics-max-process-series -1: must be 0 or more"),
    (["--alertmanager-resend-s", "0", "--alertmanager", "http://a:1"],
     "--alertmanager-resend-s 0.0: must be"),
    (["--alertmanager", "http://127.0.0.1:9", "--alert-label", "cluster"],
     "--alert-label 'cluster': use KEY=VALUE"),
    (["--alert-label", "cluster=eu"], "--alert-label: labels go on alerts pushed to Alertmanager"),
])
def test_bad_collector_flags_are_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      flags: list[str], expected: str) -> None:
    assert run_collector(_collector_args(tmp_path, *flags), install_signals=lambda stop: None) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1


def test_a_busy_metrics_port_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   busy_port: int) -> None:
    args = _collector_args(tmp_path, "--metrics-listen", f"127.0.0.1:{busy_port}")
    assert run_collector(args, install_signals=lambda stop: None) == 2
    err = capsys.readouterr().err
    assert f"--metrics-listen 127.0.0.1:{busy_port}: cannot bind" in err and err.count("\n") == 1


def test_collector_says_where_metrics_are(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def stop_at_once(stop: object) -> None:
        stop()  # type: ignore[operator]

    args = _collector_args(tmp_path, "--metrics-listen", "127.0.0.1:0")
    assert run_collector(args, install_signals=stop_at_once) == 0
    assert "; metrics http://127.0.0.1:" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--metrics-listen", "nowhere"], ["--alert-label", "x"]])
def test_up_refuses_a_bad_metrics_or_alert_flag_with_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str]) -> None:
    args = parse("up", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "u.db"), *flags)
    assert up.run_up(SimpleNamespace(node_name="n1"), args, install_signals=lambda stop: None) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ghostgpu: {flags[0]}") and err.count("\n") == 1


def test_up_refuses_a_busy_metrics_port_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   busy_port: int) -> None:
    args = parse("up", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "u.db"),
                 "--metrics-listen", f"127.0.0.1:{busy_port}")
    assert up.run_up(SimpleNamespace(node_name="n1"), args, install_signals=lambda stop: None) == 2
    err = capsys.readouterr().err
    assert "cannot bind" in err and err.count("\n") == 1


def test_collector_never_prints_an_alertmanager_password(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    def stop_at_once(stop: object) -> None:
        stop()  # type: ignore[operator]

    args = _collector_args(tmp_path, "--alertmanager", "http://ops:s3cret@127.0.0.1:9")
    assert run_collector(args, install_signals=stop_at_once) == 0
    err = capsys.readouterr().err
    assert "; alerts to http://127.0.0.1:9" in err and "s3cret" not in err


def test_collector_and_up_give_their_collector_the_commands_gc_policy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both commands build the Collector with the HeapPolicy (gc state is process-wide: the commands
    own it, collector/heap.py): a stand-in Collector records what it was given and refuses to start."""
    given: list[object] = []

    def stand_in(config: CollectorConfig, **collaborators: object) -> None:
        given.append(collaborators.get("heap"))
        raise ValueError("stand-in collector: not started")

    monkeypatch.setattr("ghostgpu.collector.run.Collector", stand_in)
    monkeypatch.setattr("ghostgpu.collector.main.Collector", stand_in)
    assert run_collector(parse("collector", "--db", str(tmp_path / "c.db")), lambda _stop: None) == 2
    with pytest.raises(up.FlagError, match="stand-in collector"):
        up._start_collector(parse("up"), "127.0.0.1:0", "n1", None, str(tmp_path / "up.db"))
    assert len(given) == 2 and all(isinstance(heap, HeapPolicy) for heap in given)
