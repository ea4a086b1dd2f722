"""Durations as people type them on a command line: 30s, 2m, 1h30m, 500ms, 1.5h, or plain seconds.
One parser for every flag that takes one (`trace --for`, `--trace-max-duration`, ...)."""

from __future__ import annotations

import re

_NUMBER = r"\d+(?:\.\d*)?|\.\d+"
_PART = re.compile(rf"({_NUMBER})(ms|h|m|s)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration_s(value: object, flag: str) -> float:
    """Seconds (> 0) of a duration; ValueError with one line naming `flag` otherwise."""
    text = str(value).strip().lower()
    seconds: float | None = None
    if re.fullmatch(_NUMBER, text):
        seconds = float(text)
    elif text and re.fullmatch(rf"(?:{_PART.pattern})+", text):
        seconds = sum(float(n) * _UNIT_S[u] for n, u in _PART.findall(text))
    if seconds is None:
        raise ValueError(f"{flag} {value!r}: use a duration like 30s, 2m, 1h30m, 500ms or plain seconds")
    if seconds <= 0:
        raise ValueError(f"{flag} {value!r}: must be above 0")
    return seconds
