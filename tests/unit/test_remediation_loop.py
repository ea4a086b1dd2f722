"""The collector's main loop survives a failing unaccounted-memory check (collector/main.py): the
isolation trigger's check raising is logged, and the loop goes on calling it (and everything else it
runs each pass) on the next pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.helpers.collector_env import running_collector
from tests.helpers.polling import wait_until


def test_a_failing_memory_check_does_not_end_the_collectors_loop(tmp_path: Path) -> None:
    with running_collector(tmp_path) as c:
        calls: list[int] = []

        def broken(*args: Any) -> list[Any]:
            calls.append(1)
            raise RuntimeError("a bug in the memory trigger")

        c.isolator.check_memory = broken  # type: ignore[method-assign]
        wait_until(lambda: len(calls) >= 3, "the loop calling the check again after it raised", 30)
