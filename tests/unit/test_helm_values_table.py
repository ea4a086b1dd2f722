"""scripts/helm_values_table.py: the README's table of the chart's values is built from
values.schema.json and values.yaml (table-driven on a small schema here), refuses a value it cannot
document, and README.md's table is current."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from tests.helpers.scripts import load_script


@pytest.fixture(scope="module")
def hvt() -> ModuleType:
    return load_script("helm_values_table")


def obj(properties: dict[str, Any], description: str = "", closed: bool = True) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "object", "properties": properties}
    if closed:
        node["additionalProperties"] = False
    if description:
        node["description"] = description
    return node


SCHEMA = obj({
    "image": obj({
        "repository": {"type": "string", "description": "The image's repository."},
        "pullPolicy": {"type": "string", "enum": ["Always", "Never"], "description": "When to pull."},
    }, "The image."),
    "collector": obj({
        "store": obj({"scheme": {"$ref": "#/definitions/scheme"}}),
        "retentionDays": {"type": "number", "exclusiveMinimum": 0, "description": "Days | kept."},
        "maxUnavailable": {"type": ["integer", "string"], "description": "A number\n  or a percentage."},
        "capabilities": {"type": "array", "items": {"type": "string", "enum": ["BPF", "KILL"]},
                         "description": "Added capabilities."},
        "urls": {"type": "array", "items": {"type": "string"}, "description": "Alertmanagers."},
    }),
    "policy": {"type": ["string", "object"], "description": "The policy."},
    "labels": {"type": "object", "additionalProperties": {"type": "string"}, "description": "Labels."},
    "config": obj({"mode": {"type": "string", "description": "The mode."}}, "Free-form config.",
                  closed=False),
    "unset": {"type": "object", "description": "Not in values.yaml."},
})
SCHEMA["definitions"] = {"scheme": {"type": "string", "enum": ["sqlite", "postgresql"],
                                    "description": "The store."}}
VALUES = {
    "image": {"repository": "ghcr.io/ghostgpu/ghostgpu", "pullPolicy": "Never"},
    "collector": {"store": {"scheme": "sqlite"}, "retentionDays": 7, "maxUnavailable": "10%",
                  "capabilities": ["BPF"], "urls": ["http://am:9093/" + "x" * 80]},
    "policy": "rules:\n  - role: admin\n",
    "labels": {"release": "prometheus"},
    "config": {"mode": "dry-run", "extra": 1},
}
# key -> (type, default, description), in the schema's order.
ROWS = [
    ("image.repository", "string", '`"ghcr.io/ghostgpu/ghostgpu"`', "The image's repository."),
    ("image.pullPolicy", 'one of `"Always"`, `"Never"`', '`"Never"`', "When to pull."),
    ("collector.store.scheme", 'one of `"sqlite"`, `"postgresql"`', '`"sqlite"`', "The store."),
    ("collector.retentionDays", "number", "`7`", "Days \\| kept."),
    ("collector.maxUnavailable", "integer or string", '`"10%"`', "A number or a percentage."),
    ("collector.capabilities", 'list of (one of `"BPF"`, `"KILL"`)', '`["BPF"]`', "Added capabilities."),
    ("collector.urls", "list of string", "see values.yaml", "Alertmanagers."),
    ("policy", "string or map", "2 lines, see values.yaml", "The policy."),
    ("labels", "map", '`{"release": "prometheus"}`', "Labels."),
    ("config", "map", '`{"mode": "dry-run", "extra": 1}`', "Free-form config."),  # open: a row too
    ("config.mode", "string", '`"dry-run"`', "The mode."),
    ("unset", "map", "(unset)", "Not in values.yaml."),
]


def test_the_rows_come_from_the_schema_and_the_defaults_from_values(hvt: ModuleType) -> None:
    rows, problems = hvt.rows(SCHEMA, VALUES)
    assert problems == []
    assert rows == ROWS


def test_the_table_is_markdown_one_row_per_value(hvt: ModuleType) -> None:
    lines = hvt.build_table(SCHEMA, VALUES).splitlines()
    assert lines[:2] == ["| Key | Type | Default | Description |", "|---|---|---|---|"]
    assert lines[2] == ('| `image.repository` | string | `"ghcr.io/ghostgpu/ghostgpu"` | '
                        "The image's repository. |")
    assert len(lines) == 2 + len(ROWS)


def test_a_value_it_cannot_document_is_refused_with_every_reason(hvt: ModuleType) -> None:
    schema = obj({"a": {"type": "string"}, "b": obj({"c": {"type": "integer"}}),
                  "d": obj({}, closed=False)})
    with pytest.raises(hvt.TableError) as e:
        hvt.build_table(schema, {"a": "x", "b": {"c": 1, "typo": 2}, "zz": 3})
    assert str(e.value).splitlines() == [
        "values.schema.json: a has no description: add one",
        "values.schema.json: b.c has no description: add one",
        "values.yaml: b.typo is not in values.schema.json: type and describe it there",
        "values.schema.json: d has no description: add one",
        "values.yaml: zz is not in values.schema.json: type and describe it there"]


def test_splice_replaces_only_what_is_between_the_markers(hvt: ModuleType) -> None:
    readme = f"# x\n\nbefore\n{hvt.START}\nold table\n{hvt.END}\nafter\n"
    spliced = hvt.splice(readme, "| t |\n")
    assert spliced.startswith(f"# x\n\nbefore\n{hvt.START}\n") and spliced.endswith(f"{hvt.END}\nafter\n")
    assert "old table" not in spliced and "| t |\n" in spliced
    assert hvt.splice(spliced, "| t |\n") == spliced  # idempotent
    for broken in ("no markers", f"{hvt.END}\n{hvt.START}\n", f"{hvt.START}\n{hvt.START}\n{hvt.END}\n"):
        with pytest.raises(hvt.TableError, match="helm-values:start"):
            hvt.splice(broken, "| t |\n")


def test_check_finds_a_stale_table_and_a_run_makes_it_current(hvt: ModuleType, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    chart = tmp_path / "chart"
    chart.mkdir()
    (chart / "values.schema.json").write_text(json.dumps(SCHEMA))
    (chart / "values.yaml").write_text(yaml.safe_dump(VALUES))
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{hvt.START}\n{hvt.END}\n")
    assert hvt.run(readme, chart, check=True) == 1
    assert "not current" in capsys.readouterr().err
    assert hvt.run(readme, chart, check=False) == 0
    assert "| `config.mode` |" in readme.read_text()
    assert hvt.run(readme, chart, check=True) == 0
    (chart / "values.yaml").write_text("{{")
    assert hvt.run(readme, chart, check=True) == 2
    assert "cannot read values.schema.json and values.yaml" in capsys.readouterr().err


def test_the_readme_table_is_current(hvt: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    status = hvt.run(hvt.README, hvt.CHART, check=True)
    assert status == 0, capsys.readouterr().err
