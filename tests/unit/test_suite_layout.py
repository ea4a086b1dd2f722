"""The suite itself: pytest imports test files by basename (no packages under tests/), so two files
of one name in tests/unit and tests/integration stop the whole run at collection."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def test_every_test_file_name_is_unique_across_the_suite() -> None:
    names = Counter(p.name for p in TESTS.rglob("test_*.py") if "build" not in p.parts)
    assert [name for name, n in names.items() if n > 1] == []
