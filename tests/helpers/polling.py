"""Deadline polling for tests: a test never sleeps to wait for a result, it polls a condition."""

from __future__ import annotations

import time
from collections.abc import Callable

POLL_INTERVAL_S = 0.005


def poll(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """True as soon as predicate() holds, False once the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_INTERVAL_S)
    return True


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    """Return once predicate() holds; fail the test naming `what` past the deadline."""
    if not poll(predicate, timeout_s):
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
