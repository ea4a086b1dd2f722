"""The one reader of a process's config file (TOML) and environment into its config dataclass's fields.

Both processes read their settings this way (tracer/config.py, collector/config.py): the file's keys are
the dataclass's field names, in the process's table (`[tracer]`, `[collector]`) or at the top level
when the file has none, so one file can serve both. Each value becomes its field's type and passes its
field's check, if the field has one (settings.py's meta). A file's values have TOML's types and must
match the field; an environment variable's (GHOSTGPU_GRACE_S=2) is text, parsed into the same types.

    read_config_file(path, TracerConfig, "tracer", where=f"--config {path}")   # {"grace_s": 5.0, ...}
    environment_values(TracerConfig, os.environ, "GHOSTGPU_")                   # {"node_name": "n1", ...}

Every error is a ConfigError of one line naming where the value was set (the file as it was given, or
the variable) and the key, and what was expected.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, get_args, get_origin, get_type_hints

MAX_FILE_BYTES = 1 << 20  # a config file is small: a megabyte is plenty


class ConfigError(ValueError):
    """A setting is wrong: one line naming where it was set (a file, a variable) and the key."""


# ---- one value ------------------------------------------------------------------------------------------


def _kind(value: object) -> str:
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "a table"}.get(type(value), type(value).__name__)


def comma_list(text: str) -> list[str]:
    """A comma-separated list, as a flag or an environment variable writes one: items stripped,
    empty ones dropped."""
    return [part.strip() for part in text.split(",") if part.strip()]


def _strings(hint: object) -> Callable[[list[str]], list[str] | tuple[str, ...]] | None:
    """list or tuple for list[str] and tuple[str, ...]; None for any other hint."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is list and args == (str,):
        return list
    if origin is tuple and args == (str, ...):
        return tuple
    return None


def _from_text(hint: object, text: str) -> object:
    """Text (an environment variable's) as `hint`: numbers as int() and float() read them, a boolean
    true or false, a list comma-separated. ValueError saying what was expected."""
    if hint is str:
        return text
    try:
        if hint is int:
            return int(text)
        if hint is float:
            return float(text)
    except ValueError:
        what = "a whole number" if hint is int else "a number"
        raise ValueError(f"expected {what}, got {text!r}") from None
    if hint is bool:
        flag = {"true": True, "false": False}.get(text.strip().lower())
        if flag is None:
            raise ValueError(f"expected true or false, got {text!r}")
        return flag
    if (kind := _strings(hint)) is not None:
        return kind(comma_list(text))
    raise ValueError("expected a table, which only the config file can set")


def _from_toml(hint: object, raw: object) -> object:
    """A TOML value as `hint`: it must have the field's type (an integer does for a float), except that a
    list of strings may be one comma-separated string, as its flag takes it. ValueError otherwise."""
    if (kind := _strings(hint)) is not None:
        if isinstance(raw, str):
            return kind(comma_list(raw))
        if isinstance(raw, list) and all(isinstance(x, str) for x in raw):
            return kind(raw)
        raise ValueError(f"expected a list of strings, got {_kind(raw)}")
    if get_origin(hint) is dict:
        if isinstance(raw, dict) and all(isinstance(v, str) for v in raw.values()):
            return dict(raw)
        raise ValueError(f"expected a table of strings (KEY = \"VALUE\"), got {_kind(raw)}")
    if hint is bool:
        if isinstance(raw, bool):
            return raw
        raise ValueError(f"expected true or false, got {_kind(raw)}")
    if hint is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        raise ValueError(f"expected a number, got {_kind(raw)}")
    if hint is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        raise ValueError(f"expected a whole number, got {_kind(raw)}")
    if isinstance(raw, str):  # hint is str: supported() let nothing else through
        return raw
    raise ValueError(f"expected a string, got {_kind(raw)}")


def _optional_of(hint: object) -> object:
    """X for `X | None` (a file or a variable cannot say None: it leaves the key out); else the hint."""
    if get_origin(hint) in (types.UnionType, typing.Union):
        args = [a for a in get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def supported(hint: object) -> bool:
    """Whether a field of this type can be read: str, int, float, bool, list[str], tuple[str, ...],
    dict[str, str], or one of them `| None`."""
    hint = _optional_of(hint)
    return (hint in (str, int, float, bool) or _strings(hint) is not None
            or (get_origin(hint) is dict and get_args(hint) == (str, str)))


def typed_value(hint: object, raw: object, *, text: bool = False) -> Any:
    """`raw` as a field of type `hint` (see supported): a TOML value, or with `text` an environment
    variable's string. ValueError (one line) saying what was expected; TypeError for a type no reader
    takes (a field's type: the code's mistake, not the user's)."""
    if not supported(hint):
        raise TypeError(f"a setting of type {hint} cannot be read from a file or the environment")
    hint = _optional_of(hint)
    if text:
        if not isinstance(raw, str):
            raise TypeError(f"text expected, got {type(raw).__name__}")
        return _from_text(hint, raw)
    return _from_toml(hint, raw)


# ---- a config dataclass's settable fields --------------------------------------------------------------


def _settable(cls: type) -> dict[str, dataclasses.Field[Any]]:
    """The fields a file or the environment may set (meta's in_file; a field without metadata may)."""
    return {f.name: f for f in dataclasses.fields(cls) if f.metadata.get("in_file", True)}


def _checked(f: dataclasses.Field[Any], hint: object, raw: object, *, text: bool) -> Any:
    value = typed_value(hint, raw, text=text)
    check: Callable[[Any], None] | None = f.metadata.get("check")
    if check is not None:
        check(value)
    return value


# ---- the file ------------------------------------------------------------------------------------------

_AT_LINE = re.compile(r"\(at line (\d+), column \d+\)")
_KEY = re.compile(r"\s*\[*\s*([A-Za-z0-9_.\"'-]+)")


def _duplicate_key(text: str, message: str) -> str | None:
    """The key tomllib's "Cannot overwrite a value" / "Cannot declare ... twice" names, else the one on
    the line it names; None when the message is about something else."""
    if not message.startswith(("Cannot overwrite", "Cannot declare")):
        return None
    if (m := re.search(r"\(((?:'[^']+',?\s*)+)\)", message)) is not None:  # ('demo', 'labels'): a table
        return ".".join(re.findall(r"'([^']+)'", m.group(1)))
    if (at := _AT_LINE.search(message)) is not None:
        lines = text.splitlines()
        line = int(at.group(1))
        if 0 < line <= len(lines) and (k := _KEY.match(lines[line - 1])) is not None:
            return k.group(1).strip("\"'")
    return "a key"


def _toml(text: str, where: str) -> dict[str, Any]:
    import tomllib  # only when a config file is read: not on every command's start

    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        key = _duplicate_key(text, str(exc))
        if key is not None:
            at = _AT_LINE.search(str(exc))
            line = f" (line {at.group(1)})" if at else ""
            raise ConfigError(f"{where}: {key}: set twice{line}") from None
        raise ConfigError(f"{where}: not valid TOML ({exc})") from None


def parse_config_text(text: str, cls: type, table: str, *, where: str) -> dict[str, Any]:
    """The settings a config file's text sets for `cls`, each typed and checked: its `[table]`, or its
    top level when it has none. ConfigError "WHERE: KEY: problem" (`where` names the file as the user
    gave it, e.g. "--config c.toml")."""
    data = _toml(text, where)
    section = data.get(table, data)
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: {table}: expected a table, got a value")
    hints = get_type_hints(cls)
    settable = _settable(cls)
    values: dict[str, Any] = {}
    for key, raw in section.items():
        if key not in settable:
            raise ConfigError(f"{where}: {key}: unknown key; known keys: {', '.join(sorted(settable))}")
        try:
            values[key] = _checked(settable[key], hints[key], raw, text=False)
        except ValueError as exc:
            raise ConfigError(f"{where}: {key}: {exc}") from None
    return values


def read_config_file(path: str, cls: type, table: str, *, where: str) -> dict[str, Any]:
    """parse_config_text of the file at `path`; ConfigError naming `where` when it cannot be read, is not
    UTF-8 or is larger than MAX_FILE_BYTES."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{where}: larger than {MAX_FILE_BYTES >> 20} MiB; a config file sets a few keys")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: cannot read it ({exc})") from None
    return parse_config_text(text, cls, table, where=where)


# ---- the environment -----------------------------------------------------------------------------------


def environment_values(cls: type, env: Mapping[str, str], prefix: str) -> dict[str, Any]:
    """The settings `env` sets for `cls`: PREFIX + the field's name in capitals (GHOSTGPU_GRACE_S), each
    parsed from its text and checked. ConfigError "VARIABLE: problem"."""
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for name, f in _settable(cls).items():
        variable = f"{prefix}{name.upper()}"
        raw = env.get(variable)
        if raw is None:
            continue
        try:
            values[name] = _checked(f, hints[name], raw, text=True)
        except ValueError as exc:
            raise ConfigError(f"{variable}: {exc}") from None
    return values
