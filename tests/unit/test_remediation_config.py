"""The remediation policy in force (collector/remediation_config.py): re-read when the config file
changes or on SIGHUP, a bad file keeping the old policy with one line said once, the on_change hook
with the old and the new policy, and the collector wiring both reloads."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.collector.config import CollectorConfig
from ghostgpu.collector.main import Collector
from ghostgpu.collector.remediation_config import RELOAD_LINE_MAX, RemediationConfig
from ghostgpu.collector.remediation_policy import RemediationPolicy
from ghostgpu.collector.run import reload_on_hangup

from ghostgpu.common.model.remediation import MODE_DRY_RUN, MODE_OFF, MODE_ON
from ghostgpu.common.system.configfile import ConfigError
from tests.helpers.polling import wait_until

KEPT = "; the old remediation policy stays in force"


def _write(path: Path, text: str) -> None:
    """Replace the file as an editor or a ConfigMap update does (a new inode), so the change shows
    even within one mtime tick."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.fixture
def hooks() -> tuple[list[tuple[RemediationPolicy, RemediationPolicy]], list[str]]:
    return [], []


def watched(path: Path, changed: list[tuple[RemediationPolicy, RemediationPolicy]],
            refused: list[str]) -> RemediationConfig:
    config = RemediationConfig(str(path))
    config.on_change.append(lambda old, new: changed.append((old, new)))
    config.on_refused.append(refused.append)
    return config


def test_a_changed_file_is_reloaded_and_a_bad_one_keeps_the_old_policy(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "collector.yaml"
    _write(path, "collector: {retention_days: 3}\nremediation: {mode: dry-run}\n")
    changed: list[tuple[RemediationPolicy, RemediationPolicy]] = []
    refused: list[str] = []
    config = watched(path, changed, refused)
    assert config().mode == MODE_DRY_RUN
    assert config.maybe_reload() is False and changed == refused == []  # nothing changed

    caplog.set_level(logging.WARNING, "ghostgpu.collector.remediation_config")
    _write(path, "collector: {retention_days: 3}\nremediation: {mode: on, breaker: {window: 30m}}\n")
    assert config.maybe_reload() is True
    assert config().mode == MODE_ON and config().breaker.window_s == 1800
    assert [(old.mode, new.mode) for old, new in changed] == [(MODE_DRY_RUN, MODE_ON)]
    assert caplog.messages == [f"--config {path}: remediation reloaded: mode: dry-run -> on; breaker.window: "
                               "1h -> 30m"]

    caplog.clear()
    _write(path, "remediation: {mode: on, breaker: {window: 1x}}\n")
    assert config.maybe_reload() is False
    assert config().mode == MODE_ON and config().breaker.window_s == 1800  # the old policy stays in force
    assert refused == [f"--config {path}: remediation.breaker.window: '1x': use a duration like 30s, 5m or "
                       f"1h (a number alone is seconds; above 0), e.g. 1h{KEPT}"]
    assert caplog.messages == refused  # one line, logged once ...
    assert config.maybe_reload() is False and config.reload() is False  # ... not per look, nor per SIGHUP
    assert len(refused) == 1 and len(caplog.messages) == 1

    path.unlink()  # a ConfigMap mid-swap: the old policy stays, said once
    assert config.maybe_reload() is False and config.maybe_reload() is False
    assert refused[-1] == f"--config {path}: no such file{KEPT}" and len(refused) == 2

    _write(path, "remediation: {mode: on, breaker: {window: 30m}}\n")  # the same policy as in force
    assert config.maybe_reload() is False and len(changed) == 1  # re-read, nothing changed: no hook

    _write(path, "retention_days: 9\n")  # the section gone: the defaults (off)
    assert config.reload() is True  # SIGHUP
    assert config() == RemediationPolicy() and changed[-1][1].mode == MODE_OFF


def test_only_the_section_is_reloaded(tmp_path: Path) -> None:
    """The collector's other keys are read at start only: a bad one in a re-read does not refuse the
    remediation section beside it."""
    path = tmp_path / "c.toml"
    _write(path, "[collector]\nretention_days = 3\n")
    config = RemediationConfig(str(path))
    _write(path, "[collector]\nretention_days = 'a week'\n[collector.remediation]\nmode = 'dry-run'\n")
    assert config.maybe_reload() is True and config().mode == MODE_DRY_RUN


def test_a_refused_line_is_bounded_whatever_the_file_holds(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    _write(path, "remediation: {mode: off}\n")
    changed: list[tuple[RemediationPolicy, RemediationPolicy]] = []
    refused: list[str] = []
    config = watched(path, changed, refused)
    _write(path, "remediation:\n  " + "x" * 5000 + ": 1\n")
    assert config.maybe_reload() is False
    assert len(refused) == 1 and len(refused[0]) <= RELOAD_LINE_MAX and "\n" not in refused[0]
    assert refused[0].endswith(KEPT)


def test_a_hook_that_raises_does_not_stop_the_reload_or_the_others(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    _write(path, "remediation: {mode: off}\n")
    config = RemediationConfig(str(path))
    seen: list[str] = []

    def broken(_old: RemediationPolicy, _new: RemediationPolicy) -> None:
        raise RuntimeError("audit store down")

    config.on_change += [broken, lambda _old, new: seen.append(new.mode)]
    _write(path, "remediation: {mode: on}\n")
    assert config.maybe_reload() is True and config().mode == MODE_ON and seen == [MODE_ON]


def test_at_start_a_bad_section_or_file_is_fatal_and_no_file_is_off(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("remediation: {mode: sometimes}\n")
    with pytest.raises(ConfigError, match=rf"^--config {path}: remediation.mode: 'sometimes' is not a mode"):
        RemediationConfig(str(path))
    with pytest.raises(ConfigError, match=rf"^--config {tmp_path}: not a regular file; the collector "):
        RemediationConfig(str(tmp_path))
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # never blocks: opened without waiting for a writer, refused as not a regular file
    with pytest.raises(ConfigError, match=r": not a regular file;"):
        RemediationConfig(str(fifo))
    none = RemediationConfig(None)
    assert none() == RemediationPolicy() and none().mode == MODE_OFF
    assert none.maybe_reload() is False and none.reload() is False


def test_the_ticket_headers_file_is_checked_at_load(tmp_path: Path) -> None:
    path, headers = tmp_path / "c.yaml", tmp_path / "ticket-headers"
    path.write_text("remediation:\n  actions:\n    ticket: {url: 'https://t.example/h', "
                    f"headers_file: {headers}}}\n")
    with pytest.raises(ConfigError, match=rf"^--config {path}: remediation.actions.ticket.headers_file "
                                          rf"{headers}: cannot read it \("):
        RemediationConfig(str(path))
    headers.write_text("# rotated by the Secret\nAuthorization: Bearer t0k\n")
    assert RemediationConfig(str(path))().ticket.headers_file == str(headers)
    headers.write_text("Authorization Bearer t0k\n")
    with pytest.raises(ConfigError, match=r"headers_file .* line 1: not a \"Name: value\" header line"):
        RemediationConfig(str(path))


# ---- the collector's wiring -----------------------------------------------------------------------------


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[tuple[Collector, Path]]:
    path = tmp_path / "collector.yaml"
    _write(path, "remediation: {mode: dry-run}\n")
    c = Collector(CollectorConfig(listen=("127.0.0.1:0",), db_path=":memory:", config_path=str(path))).start()
    try:
        yield c, path
    finally:
        c.stop()


def test_the_collector_reloads_a_changed_section_on_its_loop(collector: tuple[Collector, Path]) -> None:
    c, path = collector
    policy: Callable[[], RemediationPolicy] = c.remediation_config  # what the engine takes
    assert policy().mode == MODE_DRY_RUN
    _write(path, "remediation: {mode: on}\n")
    wait_until(lambda: policy().mode == MODE_ON, "the loop's once-a-second look to reload the section")


class _Loop:
    def __init__(self) -> None:
        self.calls: list[Callable[[], Any]] = []

    def is_closed(self) -> bool:
        return False

    def call_soon_threadsafe(self, fn: Callable[[], Any]) -> None:
        self.calls.append(fn)


class _Security:
    def __init__(self) -> None:
        self.reloads = 0

    def reload(self) -> None:
        self.reloads += 1


def test_sighup_reloads_the_section_beside_the_policy(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    _write(path, "remediation: {mode: off}\n")
    fake: Any = type("FakeCollector", (), {})()
    fake.loop, fake.security, fake.remediation_config = _Loop(), _Security(), RemediationConfig(str(path))
    previous = signal.getsignal(signal.SIGHUP)
    try:
        reload_on_hangup(fake)
        handler = signal.getsignal(signal.SIGHUP)
        assert callable(handler)
        _write(path, "remediation: {mode: on}\n")
        handler(signal.SIGHUP, None)
    finally:
        signal.signal(signal.SIGHUP, previous)
    for call in fake.loop.calls:  # what the loop runs next
        call()
    assert fake.security.reloads == 1 and fake.remediation_config().mode == MODE_ON
