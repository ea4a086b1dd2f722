"""The one duration parser (ghostgpu/common/model/durations.py): every form each syntax accepts, and
every error line, as the flags and config keys that take them have always had them."""

from __future__ import annotations

import pytest

from ghostgpu.common.model.durations import (
    FLAG_DURATION,
    LOOK_BACK,
    DurationSyntax,
    format_ms,
    parse_duration_s,
)

# (syntax, value, seconds): accepted.
ACCEPTED: list[tuple[DurationSyntax, object, float]] = [
    # FLAG_DURATION: trace --for, --trace-max-duration, --trace-default-duration, policy max_duration,
    # web config rate_limit.interval
    (FLAG_DURATION, "30s", 30),
    (FLAG_DURATION, "2m", 120),
    (FLAG_DURATION, "10m", 600),
    (FLAG_DURATION, "1h", 3600),
    (FLAG_DURATION, "500ms", 0.5),
    (FLAG_DURATION, "1h30m", 5400),
    (FLAG_DURATION, "1m30s", 90),
    (FLAG_DURATION, "1h1m1s1ms", 3661.001),
    (FLAG_DURATION, "1.5h", 5400),
    (FLAG_DURATION, "1.5m", 90),
    (FLAG_DURATION, "1.s", 1),
    (FLAG_DURATION, ".5s", 0.5),
    (FLAG_DURATION, "45", 45),  # plain seconds
    (FLAG_DURATION, "2.5", 2.5),
    (FLAG_DURATION, ".25", 0.25),
    (FLAG_DURATION, "3.", 3),
    (FLAG_DURATION, 600.0, 600),  # a number from a TOML or YAML file
    (FLAG_DURATION, 45, 45),
    (FLAG_DURATION, " 30s ", 30),
    (FLAG_DURATION, "30S", 30),  # any case
    (FLAG_DURATION, "1H30M", 5400),
    (FLAG_DURATION, "500MS", 0.5),
    (FLAG_DURATION, "0.001s", 0.001),
    (FLAG_DURATION, "30s30s", 60),  # parts add up
    # LOOK_BACK: findings --since, audit --since
    (LOOK_BACK, "30s", 30),
    (LOOK_BACK, "15m", 900),
    (LOOK_BACK, "1h", 3600),
    (LOOK_BACK, "7d", 604800),
    (LOOK_BACK, "1.5h", 5400),
    (LOOK_BACK, "0.5d", 43200),
    (LOOK_BACK, " 2m ", 120),
    (LOOK_BACK, "0s", 0),  # zero: from now on
    (LOOK_BACK, "0.0h", 0),
]

# (syntax, value, the whole error line for flag "--x").
REFUSED: list[tuple[DurationSyntax, object, str]] = [
    (FLAG_DURATION, "ten", "--x 'ten': use a duration like 30s, 2m, 1h30m, 500ms or plain seconds"),
    (FLAG_DURATION, "", "--x '': use a duration like 30s, 2m, 1h30m, 500ms or plain seconds"),
    (FLAG_DURATION, "   ", "--x '   ': use a duration like 30s, 2m, 1h30m, 500ms or plain seconds"),
    (FLAG_DURATION, "7d", "--x '7d': use a duration like 30s, 2m, 1h30m, 500ms or plain seconds"),
    (FLAG_DURATION, "-5s", "--x '-5s': use a duration like 30s, 2m, 1h30m, 500ms or plain seconds"),
    (FLAG_DURATION, "-5", "--x '-5': use a duration like 30s, 2m, 1h30m, 500ms or plain seconds"),
    (FLAG_DURATION, "1h 30m", "--x '1h 30m': use a duration like 30s, 2m, 1h30m, 500ms or plain seconds"),
    (FLAG_DURATION, "s", "--x 's': use a duration like 30s, 2m, 1h30m, 500ms or plain seconds"),
    (FLAG_DURATION, ".s", "--x '.s': use a duration like 30s, 2m, 1h30m, 500ms or plain seconds"),
    (FLAG_DURATION, "1e3", "--x '1e3': use a duration like 30s, 2m, 1h30m, 500ms or plain seconds"),
    (FLAG_DURATION, "0", "--x '0': must be above 0"),
    (FLAG_DURATION, "0s", "--x '0s': must be above 0"),
    (FLAG_DURATION, "0h0m", "--x '0h0m': must be above 0"),
    (FLAG_DURATION, 0.0, "--x 0.0: must be above 0"),
    (LOOK_BACK, "", "--x '': use a number and a unit s, m, h or d (e.g. 30s, 15m, 1h, 7d)"),
    (LOOK_BACK, "1", "--x '1': use a number and a unit s, m, h or d (e.g. 30s, 15m, 1h, 7d)"),
    (LOOK_BACK, "h", "--x 'h': use a number and a unit s, m, h or d (e.g. 30s, 15m, 1h, 7d)"),
    (LOOK_BACK, "1w", "--x '1w': use a number and a unit s, m, h or d (e.g. 30s, 15m, 1h, 7d)"),
    (LOOK_BACK, "-1h", "--x '-1h': use a number and a unit s, m, h or d (e.g. 30s, 15m, 1h, 7d)"),
    (LOOK_BACK, "1h30m", "--x '1h30m': use a number and a unit s, m, h or d (e.g. 30s, 15m, 1h, 7d)"),
    (LOOK_BACK, "abc", "--x 'abc': use a number and a unit s, m, h or d (e.g. 30s, 15m, 1h, 7d)"),
    (LOOK_BACK, "500ms", "--x '500ms': use a number and a unit s, m, h or d (e.g. 30s, 15m, 1h, 7d)"),
    (LOOK_BACK, "1H", "--x '1H': use a number and a unit s, m, h or d (e.g. 30s, 15m, 1h, 7d)"),
    (LOOK_BACK, ".5h", "--x '.5h': use a number and a unit s, m, h or d (e.g. 30s, 15m, 1h, 7d)"),
    (LOOK_BACK, "1.h", "--x '1.h': use a number and a unit s, m, h or d (e.g. 30s, 15m, 1h, 7d)"),
]


@pytest.mark.parametrize(("syntax", "value", "seconds"), ACCEPTED)
def test_accepted(syntax: DurationSyntax, value: object, seconds: float) -> None:
    assert parse_duration_s(value, "--x", syntax) == pytest.approx(seconds)


@pytest.mark.parametrize(("syntax", "value", "line"), REFUSED)
def test_refused_with_one_line(syntax: DurationSyntax, value: object, line: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_duration_s(value, "--x", syntax)
    assert str(err.value) == line


def test_flag_durations_are_the_default_syntax() -> None:
    assert parse_duration_s("1h30m", "--for") == 5400
    with pytest.raises(ValueError, match=r"^--for 'soon': use a duration like"):
        parse_duration_s("soon", "--for")


@pytest.mark.parametrize(("ms", "text"), [(600_000, "10m"), (1_200_000, "20m"), (90_000, "90s"),
                                          (3_600_000, "1h"), (7_200_000, "2h"), (30_000, "30s"),
                                          (1500, "1500ms"), (0, "0ms")])
def test_format_ms_prints_what_the_flags_take(ms: int, text: str) -> None:
    assert format_ms(ms) == text
    if ms:
        assert parse_duration_s(text, "--x") * 1000 == ms
