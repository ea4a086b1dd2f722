"""A typed config's fields as command-line flags: each process's config dataclass (tracer/config.py,
collector/config.py) is the one place a setting's default, check and unit are written, and its
field's metadata says what the command line needs, so a flag's help can never name another default
than the one the process uses.

    node_name: str = setting("", flag="--node-name", help="node name (default {default})")
    add_flag(parser, TracerConfig, "node_name")     # argparse default None: not given is not set
    flag_values(TracerConfig, args)                 # {"node_name": ...} for the flags that were given

This module is imported when a parser is built, by every command: nothing heavy here.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any


def meta(*, flag: str = "", dest: str = "", help: str = "", check: Callable[[Any], None] | None = None,
         parse: Callable[[Any], Any] | None = None, show: Callable[[Any], str] | None = None,
         in_file: bool = True, **argparse_kw: Any) -> dict[str, Any]:
    """A config field's metadata. flag/dest: its command-line flag and that flag's argparse dest
    (default the field's name); help: the flag's help, "{default}" replaced by show(default)
    (default: :g for a float, str otherwise); check: raises ValueError (one line) for a bad value;
    parse: the flag's value to the field's; in_file: whether a config file may set it; argparse_kw:
    type, metavar, action, choices of the flag."""
    return {"flag": flag, "dest": dest, "help": help, "check": check, "parse": parse, "show": show,
            "in_file": in_file, "argparse": argparse_kw}


def setting(default: Any = None, **kw: Any) -> Any:
    """A config field with an immutable default and meta(**kw)."""
    return dataclasses.field(default=default, metadata=meta(**kw))


def _field(cls: type, name: str) -> dataclasses.Field[Any]:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def default_of(cls: type, name: str) -> Any:
    """A field's default (a fresh one for a factory field)."""
    f = _field(cls, name)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _show(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def flag_help(cls: type, name: str) -> str:
    """The help line of a setting's flag, its default filled in from the field."""
    f = _field(cls, name)
    text = str(f.metadata["help"])
    if "{default}" not in text:
        return text  # no default to work out (node_name's asks the host for its name)
    show = f.metadata.get("show") or _show
    return text.replace("{default}", show(default_of(cls, name)))


def add_flag(p: argparse.ArgumentParser, cls: type, name: str) -> None:
    """Declare a setting's flag on a parser. Its argparse default is None, so a flag that is not given
    leaves the file's value (or the environment's) or the field's default in place."""
    f = _field(cls, name)
    help_text = flag_help(cls, name) if f.metadata["help"] else None
    p.add_argument(f.metadata["flag"], dest=f.metadata["dest"] or f.name, help=help_text,
                   **f.metadata["argparse"])


def flag_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags (those left at None are not given), in the fields' units."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.metadata.get("flag"):
            continue
        raw = getattr(args, f.metadata["dest"] or f.name, None)
        if raw is None or raw is False:  # store_true flags: not given
            continue
        parse = f.metadata["parse"]
        values[f.name] = parse(raw) if parse is not None else raw
    return values
