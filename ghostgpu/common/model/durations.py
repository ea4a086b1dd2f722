"""Durations as people type them, parsed by one function, and printed back as the flags take them.

Two syntaxes, each a row of data rather than a parser of its own:

- FLAG_DURATION (`trace --for`, `--trace-max-duration`, the policy's max_duration, a web config's
  rate_limit.interval): 30s, 2m, 1h30m, 500ms, 1.5h, or plain seconds; any case; above 0.
- LOOK_BACK (`findings --since`, `audit --since/--until`): one number and one unit of s, m, h or d
  (30s, 15m, 1h, 7d, 1.5h); 0 allowed.

A bad value is a ValueError of one line naming the flag (or key) and the value as given.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class DurationSyntax:
    """What one kind of duration accepts."""

    number: str  # the regex of one number
    units_s: Mapping[str, float]  # unit -> seconds
    bare_seconds: bool  # a number alone is seconds
    compound: bool  # several parts add up: 1h30m
    any_case: bool  # 30S reads as 30s
    zero_allowed: bool
    hint: str  # the error line's advice: "{flag} {value!r}: {hint}"


FLAG_DURATION = DurationSyntax(
    number=r"\d+(?:\.\d*)?|\.\d+", units_s={"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0},
    bare_seconds=True, compound=True, any_case=True, zero_allowed=False,
    hint="use a duration like 30s, 2m, 1h30m, 500ms or plain seconds")
LOOK_BACK = DurationSyntax(
    number=r"\d+(?:\.\d+)?", units_s={"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0},
    bare_seconds=False, compound=False, any_case=False, zero_allowed=True,
    hint="use a number and a unit s, m, h or d (e.g. 30s, 15m, 1h, 7d)")


def parse_duration_s(value: object, flag: str, syntax: DurationSyntax = FLAG_DURATION) -> float:
    """Seconds of a duration written in `syntax`; ValueError with one line naming `flag` otherwise."""
    text = str(value).strip()
    if syntax.any_case:
        text = text.lower()
    units = "|".join(sorted(syntax.units_s, key=len, reverse=True))  # ms before m
    part = rf"({syntax.number})({units})"
    seconds: float | None = None
    if syntax.bare_seconds and re.fullmatch(syntax.number, text):
        seconds = float(text)
    elif re.fullmatch(rf"(?:{part})+" if syntax.compound else part, text):
        seconds = sum(float(n) * syntax.units_s[u] for n, u in re.findall(part, text))
    if seconds is None:
        raise ValueError(f"{flag} {value!r}: {syntax.hint}")
    if seconds <= 0 and not syntax.zero_allowed:
        raise ValueError(f"{flag} {value!r}: must be above 0")
    return seconds


def format_ms(ms: int) -> str:
    """20m, 90s, 1h, 1500ms: as FLAG_DURATION takes them, in the largest unit that divides evenly."""
    for unit, size in (("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def duration_flag(flag: str) -> Callable[[object], float]:
    """parse_duration_s for one flag's values (a config field's `parse`)."""
    return lambda value: parse_duration_s(value, flag)


def format_s(seconds: float) -> str:
    """A duration in seconds as the flags take it (10m, 30s): a default in a flag's help."""
    return format_ms(round(seconds * 1000))
