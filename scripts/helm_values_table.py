#!/usr/bin/env python3
"""Write the README's table of the Helm chart's values, generated from the chart itself.

    .venv/bin/python scripts/helm_values_table.py           # rewrite the table in README.md
    .venv/bin/python scripts/helm_values_table.py --check   # exit 1 when README.md's table is stale

One row per value (key, type, default, description), nested keys dotted (`collector.store.scheme`):
the keys, types and descriptions from deploy/helm/ghostgpu/values.schema.json, the defaults from
values.yaml. A value whose schema is an object with listed properties is a section whose properties
are the rows; a section that also takes keys it does not list (an open map) is a row itself too.
The table goes between README.md's markers `<!-- helm-values:start -->` and
`<!-- helm-values:end -->`; tests/unit/test_helm_values_table.py checks it is current. A value
without a description, or a key of values.yaml the schema does not have, is refused with one line
each: the table documents every value or it is not written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "ghostgpu"
README = ROOT / "README.md"
START = "<!-- helm-values:start -->"
END = "<!-- helm-values:end -->"
# A default longer than this, or of several lines, is left to values.yaml: the table stays readable.
MAX_DEFAULT_CHARS = 80
MISSING = object()  # a key values.yaml does not set


class TableError(Exception):
    """What is wrong with the schema, values.yaml or the README, one line per problem."""


def _resolve(node: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """The node, or the node a local `$ref` ("#/definitions/x") points at."""
    ref = node.get("$ref")
    if not isinstance(ref, str):
        return node
    if not ref.startswith("#/"):
        raise TableError(f"values.schema.json: $ref {ref!r}: only local references (#/...) are followed")
    target: Any = schema
    for part in ref[2:].split("/"):
        target = target[part]
    return _resolve({**target, **{k: v for k, v in node.items() if k != "$ref"}}, schema)


def _code(value: str) -> str:
    return f"`{value}`".replace("|", "\\|")


def type_text(node: dict[str, Any], schema: dict[str, Any]) -> str:
    """The type column: `string`, `integer or string`, `one of ...`, `list of ...`."""
    node = _resolve(node, schema)
    if "enum" in node:
        return "one of " + ", ".join(_code(json.dumps(v)) for v in node["enum"])
    for combinator in ("oneOf", "anyOf"):
        if combinator in node:
            return " or ".join(type_text(alt, schema) for alt in node[combinator])
    kind = node.get("type", "any")
    kinds = kind if isinstance(kind, list) else [kind]
    words = ["list" if k == "array" else "map" if k == "object" else str(k) for k in kinds]
    text = " or ".join(words)
    items = node.get("items")
    if "array" in kinds and isinstance(items, dict):
        text += f" of ({type_text(items, schema)})" if "enum" in _resolve(items, schema) \
            else f" of {type_text(items, schema)}"
    return text


def default_text(value: Any) -> str:
    """The default column: the value as JSON, or a pointer to values.yaml when it is long."""
    if value is MISSING:
        return "(unset)"
    if isinstance(value, str) and "\n" in value:
        return f"{len(value.splitlines())} lines, see values.yaml"
    text = json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
    if len(text) > MAX_DEFAULT_CHARS:
        return "see values.yaml"
    return _code(text)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _is_section(node: dict[str, Any]) -> bool:
    return node.get("type") == "object" and isinstance(node.get("properties"), dict) \
        and bool(node["properties"])


Row = tuple[str, str, str, str]  # key, type, default, description


def rows(schema: dict[str, Any], values: dict[str, Any]) -> tuple[list[Row], list[str]]:
    """Every value's row, in the schema's order, and every problem that keeps one from the table."""
    out: list[Row] = []
    problems: list[str] = []

    def walk(node: dict[str, Any], values: Any, prefix: str) -> None:
        properties: dict[str, Any] = node.get("properties", {})
        for name, raw in properties.items():
            key = f"{prefix}{name}"
            child = _resolve(raw, schema)
            value = values.get(name, MISSING) if isinstance(values, dict) else MISSING
            section = _is_section(child)
            if not section or child.get("additionalProperties") is not False:  # a value, or an open map
                description = child.get("description")
                if isinstance(description, str) and description.strip():
                    out.append((key, type_text(child, schema), default_text(value), _cell(description)))
                else:
                    problems.append(f"values.schema.json: {key} has no description: add one")
            if section:
                walk(child, value, f"{key}.")
        if isinstance(values, dict) and node.get("additionalProperties") is False:
            problems.extend(f"values.yaml: {prefix}{name} is not in values.schema.json: type and describe "
                            "it there" for name in values if name not in properties)

    walk(schema, values, "")
    return out, problems


def build_table(schema: dict[str, Any], values: dict[str, Any]) -> str:
    """The Markdown table of every value; TableError listing every value it cannot document."""
    found, problems = rows(schema, values)
    if problems:
        raise TableError("\n".join(problems))
    lines = ["| Key | Type | Default | Description |", "|---|---|---|---|"]
    lines += [f"| {_code(key)} | {kind} | {default} | {description} |"
              for key, kind, default, description in found]
    return "\n".join(lines) + "\n"


def block(table: str) -> str:
    """What goes between the markers: a note on where it comes from, then the table, folded."""
    return ("<!-- generated by scripts/helm_values_table.py from deploy/helm/ghostgpu/values.schema.json "
            "and values.yaml: edit those, then run it -->\n"
            "<details><summary>Every value of the chart</summary>\n\n"
            f"{table}\n</details>\n")


def splice(readme: str, table: str) -> str:
    """The README with the block between its markers replaced."""
    if readme.count(START) != 1 or readme.count(END) != 1 or readme.index(START) > readme.index(END):
        raise TableError(f"README.md: needs one {START} and after it one {END}, around the values table")
    head, rest = readme.split(START)
    _, tail = rest.split(END)
    return f"{head}{START}\n{block(table)}{END}{tail}"


def load(chart: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    try:
        schema = json.loads((chart / "values.schema.json").read_text())
        values = yaml.safe_load((chart / "values.yaml").read_text()) or {}
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise TableError(f"{chart}: cannot read values.schema.json and values.yaml: {e}") from e
    return schema, values


def run(readme_path: Path, chart: Path, check: bool) -> int:
    """0 when the README is current (or was rewritten), 1 when --check finds it stale, 2 on an error."""
    try:
        schema, values = load(chart)
        readme = readme_path.read_text()
        wanted = splice(readme, build_table(schema, values))
    except (TableError, OSError) as e:
        print(e, file=sys.stderr)
        return 2
    if wanted == readme:
        return 0
    if check:
        print(f"{readme_path.name}: the Helm values table is not current: run "
              "`.venv/bin/python scripts/helm_values_table.py`", file=sys.stderr)
        return 1
    readme_path.write_text(wanted)
    print(f"{readme_path.name}: Helm values table rewritten")
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when README.md's table is not current")
    args = parser.parse_args(argv)
    return run(README, CHART, args.check)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
