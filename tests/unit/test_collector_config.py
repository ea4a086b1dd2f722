"""The collector's config file (`ghostgpu collector --config FILE`, collector/config.py, read by
ghostgpu/common/system/configfile.py): what a good file sets, one line naming the file and the key for
each bad input, and a flag beating the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ghostgpu.cli import main as cli
from ghostgpu.collector.config import CollectorConfig, collector_config

from ghostgpu.common.system.configfile import ConfigError, parse_config_text

GOOD = """\
[collector]
listen = ["127.0.0.1:7450", "unix:///run/ghostgpu.sock"]
db_path = ":memory:"
retention_days = 3
event_log_max = 0
metrics_listen = "127.0.0.1:9400"
alertmanager = "http://a:9093, http://b:9093"
alert_resend_s = 15.5
trace_max_duration_s = 1200
insecure = false

[collector.alert_labels]
cluster = "eu-1"
"""


def parse(text: str) -> dict[str, Any]:
    return parse_config_text(text, CollectorConfig, "collector", where="--config c.toml")


@pytest.mark.parametrize(("text", "expected"), [
    (GOOD, {"listen": ("127.0.0.1:7450", "unix:///run/ghostgpu.sock"), "db_path": ":memory:",
            "retention_days": 3.0, "event_log_max": 0, "metrics_listen": "127.0.0.1:9400",
            "alertmanager": ("http://a:9093", "http://b:9093"), "alert_resend_s": 15.5,
            "trace_max_duration_s": 1200.0, "insecure": False, "alert_labels": {"cluster": "eu-1"}}),
    ("retention_days = 2.5\n", {"retention_days": 2.5}),  # keys at the top level: no [collector] table
    ("[tracer]\ngrace_s = 1\n[collector]\ncri_ttl_s = 5\n", {"cri_ttl_s": 5.0}),  # the tracer's table skipped
    ("", {}),
])
def test_a_good_file_sets_its_keys(text: str, expected: dict[str, Any]) -> None:
    values = parse(text)
    assert values == expected
    cfg = CollectorConfig(**values)
    assert {k: getattr(cfg, k) for k in expected} == expected


@pytest.mark.parametrize(("text", "line"), [
    ("retention_dayz = 3\n",
     "--config c.toml: retention_dayz: unknown key; known keys: alert_fault_hold_s, alert_labels, "),
    ("node_name = 'n1'\n", "--config c.toml: node_name: unknown key"),  # code sets it (`up`), not the file
    ("retention_days = '3'\n", "--config c.toml: retention_days: expected a number, got a string"),
    ("event_log_max = 1.5\n", "--config c.toml: event_log_max: expected a whole number, got a number"),
    ("event_log_max = true\n", "--config c.toml: event_log_max: expected a whole number, got a boolean"),
    ("insecure = 1\n", "--config c.toml: insecure: expected true or false, got a number"),
    ("listen = 7450\n", "--config c.toml: listen: expected a list of strings, got a number"),
    ("alert_labels = ['cluster=eu']\n", "--config c.toml: alert_labels: expected a table of strings"),
    ("db_path = ['a']\n", "--config c.toml: db_path: expected a string, got a list"),
    ("retention_days = 1\nretention_days = 2\n", "--config c.toml: retention_days: set twice (line 2)"),
    ("[collector]\na = 1\n[collector]\n", "--config c.toml: collector: set twice (line 3)"),
    ("retention_days = \n", "--config c.toml: not valid TOML (Invalid value (at line 1, column 18))"),
    ("collector = 3\n", "--config c.toml: collector: expected a table, got a value"),
    ("retention_days = 0\n", "--config c.toml: retention_days: --retention-days 0.0: must be more than 0"),
    ("listen = ['localhost']\n", "--config c.toml: listen: --listen 'localhost': use HOST:PORT"),
    ("metrics_max_process_series = -1\n",
     "--config c.toml: metrics_max_process_series: --metrics-max-process-series -1: must be 0 or more"),
])
def test_each_bad_input_is_one_line_naming_the_file_and_key(text: str, line: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(text)
    assert str(err.value).startswith(line) and "\n" not in str(err.value)


def test_a_missing_or_unreadable_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=rf"^--config {tmp_path}/none.toml: no such file$"):
        collector_config(cli._build_parser().parse_args(["collector", "--config", f"{tmp_path}/none.toml"]))
    with pytest.raises(ConfigError, match=rf"^--config {tmp_path}: cannot read it \("):
        collector_config(cli._build_parser().parse_args(["collector", "--config", str(tmp_path)]))


def test_a_flag_beats_the_file_and_the_file_beats_the_default(tmp_path: Path) -> None:
    path = tmp_path / "collector.toml"
    path.write_text("[collector]\nretention_days = 3\ncri_ttl_s = 10\ntrace_default_duration_s = 60\n")
    args = cli._build_parser().parse_args(["collector", "--config", str(path), "--retention-days", "5",
                                           "--trace-default-duration", "2m"])
    cfg = collector_config(args)
    assert (cfg.retention_days, cfg.trace_default_duration_s) == (5.0, 120.0)  # the flags
    assert cfg.cri_ttl_s == 10.0  # the file
    assert cfg.event_log_max == 1_000_000  # the default


def test_a_bad_file_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "collector.toml"
    path.write_text("[collector]\nretention_days = 'a week'\n")
    assert cli.main(["collector", "--config", str(path), "--listen", "127.0.0.1:0"]) == 2
    err = capsys.readouterr().err
    assert err == (f"ghostgpu: collector: --config {path}: retention_days: expected a number, "
                   "got a string\n")


def test_every_flag_default_and_help_comes_from_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert collector_config(cli._build_parser().parse_args(["collector"])) == CollectorConfig()
    with pytest.raises(SystemExit):
        cli._build_parser().parse_args(["collector", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for line in ("(default 7)", "(default 1000000; 0 keeps none)", "(default 10m; 30s, 10m, 1h)",
                 "(default 30s)", "(default 100000)", "(default 24)",
                 "(default /var/lib/ghostgpu/collector.db;"):
        assert line in help_text
