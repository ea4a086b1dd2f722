"""Every metric ghostgpu exports has a row in docs/METRICS.md with its type, and docs/METRICS.md
documents no metric that does not exist: the reference users write their queries and alerts from."""

from __future__ import annotations

import re
from pathlib import Path

from ghostgpu.collector.metrics import COLLECTOR_METRICS
from ghostgpu.tracer.health import TRACER_METRICS

METRICS = Path(__file__).resolve().parents[2] / "docs" / "METRICS.md"
ROW = re.compile(r"^\| `(ghostgpu_[a-z0-9_]+)` \| ([a-z]+)", re.MULTILINE)


def documented() -> dict[str, list[str]]:
    rows: dict[str, list[str]] = {}
    for name, kind in ROW.findall(METRICS.read_text()):
        rows.setdefault(name, []).append(kind)
    return rows


def test_every_exported_metric_has_a_row_with_its_type() -> None:
    rows = documented()
    exported = {**COLLECTOR_METRICS, **TRACER_METRICS}
    missing = sorted(set(exported) - set(rows))
    assert not missing, f"docs/METRICS.md has no row for {missing}"
    for name, (kind, _help) in exported.items():
        assert kind in rows[name], f"docs/METRICS.md says {name} is a {rows[name]}, the code exports a {kind}"


def test_the_docs_document_no_metric_that_is_not_exported() -> None:
    exported = {*COLLECTOR_METRICS, *TRACER_METRICS}
    assert sorted(set(documented()) - exported) == []
