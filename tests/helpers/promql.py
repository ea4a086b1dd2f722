"""Just enough PromQL lexing for tests to list the metric names an expression reads.

Parse errors are the real Prometheus's job (tests/helpers/promstack.py); this only answers "which
identifiers are metric names": strings, label matchers, `by`/`without`/`on`/`ignoring`/`group_*`
label lists, range and subquery brackets and numbers (durations included) are dropped; what is left
is a function or aggregation (followed by "("), a keyword, or a metric name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

KEYWORDS = frozenset({
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
    "offset", "inf", "nan", "Inf", "NaN",
})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_TOKEN = re.compile(r"(?P<number>(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)[a-zA-Z]*)"
                    r"|(?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)|(?P<other>\S)")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def metric_names(expr: str) -> set[str]:
    """Metric names read by `expr` (after Grafana variables were substituted)."""
    text = _STRING.sub(" ", expr)
    text = _MATCHERS.sub(" ", text)
    text = _BRACKETS.sub(" ", text)
    text = _LABEL_LIST.sub(r"\1 ", text)  # keep the keyword, drop its label list
    names: set[str] = set()
    tokens = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(text)]
    for i, (kind, tok) in enumerate(tokens):
        if kind != "ident" or tok in KEYWORDS:
            continue
        following = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if following in ("(", "by", "without"):
            continue  # a function, or an aggregation (`sum by (x) (...)`)
        names.add(tok)
    return names


def unknown_metrics(names: Iterable[str], families: Mapping[str, tuple[str, str]]) -> set[str]:
    """The names that are neither a family of `families` (name -> (type, help), counters with their
    _total) nor the _bucket/_sum/_count series of a histogram family."""
    unknown: set[str] = set()
    for name in names:
        if name in families:
            continue
        base = next((name.removesuffix(s) for s in HISTOGRAM_SUFFIXES if name.endswith(s)), None)
        if base is not None and families.get(base, ("",))[0] == "histogram":
            continue
        unknown.add(name)
    return unknown
