"""The tracer's flags come from TracerConfig's fields (ghostgpu/common/system/settings.py): each help
names the field's default, a flag not given leaves the file's or the environment's value, and the
units are the field's."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from ghostgpu.cli.main import _build_parser
from ghostgpu.tracer.config import TracerConfig, tracer_config

from ghostgpu.common.model.trace_limits import TRACE_MAX_DURATION_S, TRACE_MAX_RECORDS
from ghostgpu.common.system.settings import default_of, flag_help, flag_values


def helps(command: str) -> dict[str, str]:
    sub = next(a for a in _build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {flag: action.help or "" for action in sub.choices[command]._actions
            for flag in action.option_strings}


@pytest.mark.parametrize(("flag", "help_text"), [
    ("--grace-s", "seconds a holder may go unlisted by NVML before it is hidden (default 2)"),
    ("--scan-interval-s", "seconds between /proc scans (default 30)"),
    ("--trace-max-sessions", "trace sessions at once on this node (default 4, at most 8)"),
    ("--trace-max-duration", "longest trace session (default 10m; 30s, 10m, 1h)"),
    ("--trace-max-records", "records kept per trace session; calls past it are counted (default 100000)"),
    ("--vendor", "device families to watch (repeatable; default nvidia)"),
    ("--bpf", "kernel tracing (default auto)"),
    ("--spool-events", "events kept unacknowledged while the collector is out (default 100000, ~40MB)"),
    ("--health-listen", "the tracer serves /healthz, /readyz and /metrics here (default off; "
     "env GHOSTGPU_HEALTH_LISTEN)"),
])
def test_help_names_the_fields_default(flag: str, help_text: str) -> None:
    assert helps("tracer")[flag] == help_text


def test_the_trace_limits_are_the_shared_ones() -> None:
    assert default_of(TracerConfig, "trace_max_duration_s") == TRACE_MAX_DURATION_S
    assert default_of(TracerConfig, "trace_max_records") == TRACE_MAX_RECORDS
    assert flag_help(TracerConfig, "trace_max_duration_s").startswith("longest trace session (default 10m;")


def test_flags_not_given_leave_the_file_and_environment(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "tracer.toml"
    config.write_text("grace_s = 5\nspool_events = 7\ntrace_max_duration_s = 120\n")
    monkeypatch.setenv("GHOSTGPU_SCAN_INTERVAL_S", "12")
    args = _build_parser().parse_args(["tracer", "--config", str(config), "--node-name", "n1"])
    assert flag_values(TracerConfig, args) == {"node_name": "n1"}
    cfg = tracer_config(args)
    assert (cfg.grace_s, cfg.spool_events, cfg.trace_max_duration_s, cfg.scan_interval_s) == (
        5.0, 7, 120.0, 12.0)
    assert cfg.bpf == "auto" and cfg.trace_max_records == TRACE_MAX_RECORDS


def test_flags_given_win_in_the_fields_units(tmp_path: Path) -> None:
    config = tmp_path / "tracer.toml"
    config.write_text("grace_s = 5\n")
    args = _build_parser().parse_args(["tracer", "--config", str(config), "--node-name", "n1",
                                       "--grace-s", "1.5", "--trace-max-duration", "2m", "--vendor", "amd",
                                       "--spool-events", "9"])
    cfg = tracer_config(args)
    assert (cfg.grace_s, cfg.trace_max_duration_s, cfg.vendors, cfg.spool_events) == (1.5, 120.0, ["amd"], 9)


def test_a_bad_duration_flag_is_one_line_naming_it() -> None:
    args = _build_parser().parse_args(["tracer", "--node-name", "n1", "--trace-max-duration", "soon"])
    with pytest.raises(ValueError, match=r"^--trace-max-duration 'soon': use a duration like"):
        tracer_config(args)
