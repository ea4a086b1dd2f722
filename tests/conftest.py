"""Shared pytest wiring.

Tests skip with a reason where something they need is missing: root, BPF, namespaces, containerd,
Prometheus's binaries, promtool, strace. CI can run them all, so .ci/run sets
GHOSTGPU_REQUIRE_INTEGRATION=1 and the hooks below turn every skip into a failure, wherever the
test lives (tests/unit too) and whenever it skips: in a fixture, in the test, through a `skipif` or
`skip` mark, or while its module is collected (`pytest.importorskip`, a module-level `pytest.skip`).
The only skips that stay skips are those ALLOWED_SKIPS names: each is about a real GPU or driver
being *present* on the machine, which a CI machine without one never hits and which no install
step can undo. An expected failure (xfail) is not a skip and is left alone.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.postgres import own_postgres, postgres, postgres_dsn, postgres_server  # noqa: F401 (fixtures)

STRICT_ENV = "GHOSTGPU_REQUIRE_INTEGRATION"

# Skip reasons (regular expressions, matched against the whole reason) that stay skips under
# GHOSTGPU_REQUIRE_INTEGRATION=1, each with where it comes from and why it is not a missing component.
ALLOWED_SKIPS: dict[str, str] = {
    r"/dev/nvidia\d+ exists on this host; refusing to touch it":
        "tests/integration/test_tracer.py: a real GPU device node sits where the test would plant one",
    r"a real NVML \(.*\) is installed here, so its absence cannot be simulated":
        "tests/integration/test_nvml_fake.py: a real NVIDIA driver library is installed on this machine",
}


def require_integration() -> bool:
    """Read at each report, so a test of these hooks can set it."""
    return os.environ.get(STRICT_ENV) == "1"


def skip_reason(longrepr: Any) -> str:
    """The reason of a skip report: (path, lineno, "Skipped: REASON"), or whatever else pytest put there."""
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


def allowed_skip(reason: str) -> bool:
    return any(re.fullmatch(pattern, reason) for pattern in ALLOWED_SKIPS)


def _refuse(report: pytest.TestReport | pytest.CollectReport, where: str) -> None:
    reason = skip_reason(report.longrepr)
    if allowed_skip(reason):
        return
    report.outcome = "failed"
    report.longrepr = (f"skipped {where} while {STRICT_ENV}=1 (CI can run everything; install what is "
                       f"missing or allow the reason in tests/conftest.py ALLOWED_SKIPS): {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """A skip in setup (fixtures, skip/skipif marks), in the test or in teardown."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail") and require_integration():
        _refuse(report, f"in {report.when}")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):  # type: ignore[no-untyped-def]
    """A skip while a module is collected: pytest.importorskip or pytest.skip(allow_module_level=True)."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and require_integration():
        _refuse(report, "at collection")


def require_root() -> None:
    """Skip (or, under CI, fail) a test that needs root."""
    if os.geteuid() != 0:
        pytest.skip("needs root (BPF, mknod, namespaces); run as root or via scripts/bootstrap.sh test")


@pytest.fixture
def open_sockets() -> Iterator[list[socket.socket]]:
    """Client sockets a test opens (a flood, a backlog): all closed at its end, whatever happened."""
    socks: list[socket.socket] = []
    try:
        yield socks
    finally:
        for s in socks:
            s.close()
