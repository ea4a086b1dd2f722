"""The one reader of a process's config file (TOML or YAML) and environment into its config dataclass's
fields.

Both processes read their settings this way (tracer/config.py, collector/config.py): the file's keys are
the dataclass's field names, in the process's table (`[tracer]`, `[collector]`) or at the top level
when the file has none, so one file can serve both. Each value becomes its field's type and passes its
field's check, if the field has one (settings.py's meta). A file's values have TOML's types and must
match the field; an environment variable's (GHOSTGPU_GRACE_S=2) is text, parsed into the same types.

A file whose name ends in .yaml or .yml is read as YAML (ghostgpu/common/system/safe_yaml.py's loader:
no anchors, aliases, merge keys or duplicate keys), with the same keys and the same types: only `true`
and `false` are booleans there, as in TOML, so `mode: on` is the string "on" and `kill: yes` is refused
as a string, not read as YAML 1.1's boolean. A section another reader owns (the collector's
`remediation`, collector/remediation_policy.py) is named in `sections`: this reader skips it.

    read_config_file(path, TracerConfig, "tracer", where=f"--config {path}")   # {"grace_s": 5.0, ...}
    environment_values(TracerConfig, os.environ, "GHOSTGPU_")                   # {"node_name": "n1", ...}

Every error is a ConfigError of one line naming where the value was set (the file as it was given, or
the variable) and the key, and what was expected.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import stat
import types
import typing
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, get_args, get_origin, get_type_hints

if TYPE_CHECKING:
    from ghostgpu.common.system.safe_yaml import StrictLoader

MAX_FILE_BYTES = 1 << 20  # a config file is small: a megabyte is plenty


class ConfigError(ValueError):
    """A setting is wrong: one line naming where it was set (a file, a variable) and the key."""


# ---- one value ------------------------------------------------------------------------------------------


def _kind(value: object) -> str:
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "a table", type(None): "an empty value"}.get(type(value), type(value).__name__)


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


_YAML_SUFFIXES = (".yaml", ".yml")
# YAML 1.2's booleans (true, false, in three spellings), not YAML 1.1's yes/no/on/off, which PyYAML 6
# still reads as booleans: in a config file `mode: on` is a mode, and a boolean key takes what TOML's does.
_YAML_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_YAML_BOOL_TAG = "tag:yaml.org,2002:bool"


def is_yaml_name(path: str) -> bool:
    """Whether a config file is read as YAML: its name ends in .yaml or .yml (any case)."""
    return path.lower().endswith(_YAML_SUFFIXES)


@functools.cache
def _yaml_loader() -> type[StrictLoader]:
    """safe_yaml's StrictLoader with YAML 1.2's booleans only (made on first use: PyYAML is not imported
    by a command that reads no YAML)."""
    from ghostgpu.common.system.safe_yaml import StrictLoader

    class ConfigLoader(StrictLoader):
        pass

    # The resolver table copied without its boolean rows (PyYAML 6 has no call that removes a resolver),
    # so StrictLoader's own, which the security policy and the web config are read with, keeps YAML
    # 1.1's booleans.
    ConfigLoader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in rows if tag != _YAML_BOOL_TAG]
        for first, rows in StrictLoader.yaml_implicit_resolvers.items()}
    ConfigLoader.add_implicit_resolver(_YAML_BOOL_TAG, _YAML_BOOL, list("tTfF"))
    return ConfigLoader


def _yaml(text: str, where: str) -> object:
    import yaml  # only when a YAML config file is read

    from ghostgpu.common.system.safe_yaml import YamlRefused

    loader = _yaml_loader()(text)
    try:
        return loader.get_single_data()
    except YamlRefused as exc:  # an anchor, an alias, a key given twice: "line L column C: ..."
        raise ConfigError(f"{where}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"line {mark.line + 1} column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: {at}not valid YAML ({problem})") from None
    finally:
        loader.dispose()


def parse_document(text: str, *, where: str, yaml: bool = False) -> dict[str, Any]:
    """A config file's whole document: TOML, or YAML with `yaml`; an empty YAML file is {} as an empty
    TOML one is. ConfigError "WHERE: ..." for a syntax error or a YAML document that is not a mapping."""
    if not yaml:
        return _toml(text, where)
    doc = _yaml(text, where)
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: expected a mapping of keys at the top of the file, got {_kind(doc)}")
    return doc


def config_table(doc: Mapping[str, Any], table: str, *, where: str) -> dict[str, Any]:
    """The process's `[table]` of a document, or its top level when it has none."""
    section = doc.get(table, doc)
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: {table}: expected a table, got a value")
    return dict(section)


def table_values(section: Mapping[str, Any], cls: type, *, where: str,
                 sections: Collection[str] = ()) -> dict[str, Any]:
    """The settings one table sets for `cls`, each typed and checked; the keys in `sections` belong to
    another reader and are skipped. ConfigError "WHERE: KEY: problem"."""
    hints = get_type_hints(cls)
    settable = _settable(cls)
    values: dict[str, Any] = {}
    for key, raw in section.items():
        if key in sections:
            continue
        if key not in settable:
            known = ", ".join(sorted([*settable, *sections]))
            raise ConfigError(f"{where}: {key}: unknown key; known keys: {known}")
        try:
            values[key] = _checked(settable[key], hints[key], raw, text=False)
        except ValueError as exc:
            raise ConfigError(f"{where}: {key}: {exc}") from None
    return values


def parse_config_text(text: str, cls: type, table: str, *, where: str, yaml: bool = False,
                      sections: Collection[str] = ()) -> dict[str, Any]:
    """The settings a config file's text (TOML, or YAML with `yaml`) sets for `cls`, each typed and
    checked: its `[table]`, or its top level when it has none; the keys in `sections` are left to their
    own reader. ConfigError "WHERE: KEY: problem" (`where` names the file as the user gave it, e.g.
    "--config c.toml")."""
    doc = parse_document(text, where=where, yaml=yaml)
    return table_values(config_table(doc, table, where=where), cls, where=where, sections=sections)


def read_config_text(path: str, *, where: str, regular_only: str = "") -> str:
    """The file's text; ConfigError naming `where` when it cannot be read, is not UTF-8 or is larger
    than MAX_FILE_BYTES. It is opened without blocking (a FIFO never hangs the reader); with
    `regular_only` (the advice to give), anything but a regular file is refused too."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    try:
        if regular_only and not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"{where}: not a regular file; {regular_only}")
        chunks, left = [], MAX_FILE_BYTES + 1
        while left > 0 and (chunk := os.read(fd, left)):
            chunks.append(chunk)
            left -= len(chunk)
    except BlockingIOError:  # a FIFO or socket with nothing to read yet: not a config file
        raise ConfigError(f"{where}: cannot read it (nothing to read without waiting); "
                          "point it at a regular file") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{where}: larger than {MAX_FILE_BYTES >> 20} MiB; a config file sets a few keys")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: cannot read it ({exc})") from None


def read_config_document(path: str, *, where: str) -> dict[str, Any]:
    """The whole document of the file at `path`: YAML when its name says so (is_yaml_name), else TOML."""
    return parse_document(read_config_text(path, where=where), where=where, yaml=is_yaml_name(path))


def read_config_file(path: str, cls: type, table: str, *, where: str,
                     sections: Collection[str] = ()) -> dict[str, Any]:
    """parse_config_text of the file at `path` (YAML when its name ends in .yaml or .yml); ConfigError
    naming `where` when it cannot be read, is not UTF-8 or is larger than MAX_FILE_BYTES."""
    doc = read_config_document(path, where=where)
    return table_values(config_table(doc, table, where=where), cls, where=where, sections=sections)


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
