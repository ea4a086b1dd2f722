"""tests/helpers/postgres.py's search for the server binaries: the highest installed major version,
and one line naming the package when there is none (the fixtures turn it into a skip)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import postgres


def _fake_bindir(root: Path, version: str) -> Path:
    bindir = root / version / "bin"
    bindir.mkdir(parents=True)
    for name in ("initdb", "postgres", "psql"):
        (bindir / name).write_text("#!/bin/sh\n")
        (bindir / name).chmod(0o755)
    return bindir


@pytest.fixture
def no_pg_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No pg_config on the PATH, no override, /usr/lib/postgresql stood in for by an empty tmp dir."""
    monkeypatch.delenv("GHOSTGPU_PG_BINDIR", raising=False)
    monkeypatch.setattr(postgres.shutil, "which", lambda name: None)
    monkeypatch.setattr(postgres, "PG_LIB_DIR", tmp_path)
    return tmp_path


def test_the_highest_installed_version_is_used(no_pg_config: Path) -> None:
    _fake_bindir(no_pg_config, "9.6")
    newest = _fake_bindir(no_pg_config, "15")
    _fake_bindir(no_pg_config, "13")
    (no_pg_config / "16" / "bin").mkdir(parents=True)  # a leftover directory without the binaries
    assert postgres.find_bindir() == newest


def test_the_override_wins(no_pg_config: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_bindir(no_pg_config, "15")
    chosen = _fake_bindir(tmp_path / "elsewhere", "14")
    monkeypatch.setenv("GHOSTGPU_PG_BINDIR", str(chosen))
    assert postgres.find_bindir() == chosen


def test_without_the_binaries_one_line_names_the_package(no_pg_config: Path) -> None:
    with pytest.raises(postgres.PostgresUnavailable) as err:
        postgres.find_bindir()
    message = str(err.value)
    assert "\n" not in message
    assert "apt-get install postgresql" in message


def test_bad_names_and_modes_are_refused_before_any_sql() -> None:
    server = postgres.server_or_skip()
    try:
        with pytest.raises(ValueError, match="database name 'Bad-Name'"):
            server.create_database("Bad-Name")
        with pytest.raises(ValueError, match="stop mode 'gentle'"):
            server.stop("gentle")
        with pytest.raises(ValueError, match="password method 'plain'"):
            server.add_password_role("r", "p", method="plain")
    finally:
        server.close()
    assert not server.dir.exists()
