"""Shared pytest wiring.

Integration tests skip with a reason where root, BPF or namespaces are missing. CI can run them
all, so .ci/run sets GHOSTGPU_REQUIRE_INTEGRATION=1 and this hook turns any such skip into a failure.
"""

from __future__ import annotations

import os

import pytest

REQUIRE_INTEGRATION = os.environ.get("GHOSTGPU_REQUIRE_INTEGRATION") == "1"
STRICT_MARKERS = ("root", "bpf", "netns", "containerd", "prometheus")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if not (REQUIRE_INTEGRATION and report.skipped):
        return
    strict = "integration" in item.path.parts or any(item.get_closest_marker(m) for m in STRICT_MARKERS)
    if strict:
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"skipped while GHOSTGPU_REQUIRE_INTEGRATION=1: {reason}"


def require_root() -> None:
    """Skip (or, under CI, fail) a test that needs root."""
    if os.geteuid() != 0:
        pytest.skip("needs root (BPF, mknod, namespaces); run as root or via scripts/bootstrap.sh test")
