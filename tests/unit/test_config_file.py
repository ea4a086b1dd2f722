"""The one reader of both processes' config files and the tracer's environment
(ghostgpu/common/system/configfile.py): every field type from a TOML value and from text, each bad input
as one line naming where and the key, the table, the known keys, the field's check, and the file's
own failures (missing, unreadable, too large, not TOML, a key set twice)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, get_type_hints

import pytest
from ghostgpu.cli import main as cli
from ghostgpu.collector.config import CollectorConfig
from ghostgpu.tracer.config import TracerConfig, load_config

from ghostgpu.common.system.configfile import (
    MAX_FILE_BYTES,
    ConfigError,
    environment_values,
    parse_config_text,
    read_config_file,
    supported,
    typed_value,
)
from ghostgpu.common.system.settings import setting


def _at_least_0(value: int) -> None:
    if value < 0:
        raise ValueError(f"--limit {value}: must be 0 or more")


@dataclasses.dataclass
class Demo:
    """A config with a field of every type the reader takes."""

    name: str = "x"
    limit: int = setting(1, check=_at_least_0)
    interval_s: float = 1.0
    on: bool = False
    path: str | None = None
    cap: int | None = None
    hosts: list[str] = dataclasses.field(default_factory=list)
    listen: tuple[str, ...] = ()
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    node: str | None = setting(in_file=False)  # code sets it, never a file or the environment


# ---- one value -------------------------------------------------------------------------------------------

# (type, a TOML value, the field's value, or the error's words)
FROM_TOML: list[tuple[Any, object, object]] = [
    (str, "a b", "a b"),
    (str, 1, "expected a string, got a number"),
    (str, ["a"], "expected a string, got a list"),
    (int, 3, 3),
    (int, -1, -1),
    (int, 1.5, "expected a whole number, got a number"),
    (int, True, "expected a whole number, got a boolean"),
    (int, "3", "expected a whole number, got a string"),
    (float, 2, 2.0),
    (float, 2.5, 2.5),
    (float, False, "expected a number, got a boolean"),
    (float, "2", "expected a number, got a string"),
    (bool, True, True),
    (bool, False, False),
    (bool, 1, "expected true or false, got a number"),
    (bool, "true", "expected true or false, got a string"),
    (str | None, "p", "p"),
    (str | None, 0, "expected a string, got a number"),
    (int | None, 7, 7),
    (int | None, 7.0, "expected a whole number, got a number"),
    (list[str], ["a", "b"], ["a", "b"]),
    (list[str], "a, b,,c ", ["a", "b", "c"]),  # one string: comma-separated, as the flags take it
    (list[str], "", []),
    (list[str], [], []),
    (list[str], ["a", 1], "expected a list of strings, got a list"),
    (list[str], 3, "expected a list of strings, got a number"),
    (list[str], {"a": "b"}, "expected a list of strings, got a table"),
    (tuple[str, ...], ["a", "b"], ("a", "b")),
    (tuple[str, ...], "a,b", ("a", "b")),
    (tuple[str, ...] | None, ["a"], ("a",)),
    (tuple[str, ...], True, "expected a list of strings, got a boolean"),
    (dict[str, str], {"k": "v"}, {"k": "v"}),
    (dict[str, str], {}, {}),
    (dict[str, str], {"k": 1}, "expected a table of strings (KEY = \"VALUE\"), got a table"),
    (dict[str, str], ["k=v"], "expected a table of strings (KEY = \"VALUE\"), got a list"),
]


@pytest.mark.parametrize(("hint", "raw", "expected"), FROM_TOML)
def test_a_toml_value_must_have_the_fields_type(hint: Any, raw: object, expected: object) -> None:
    if isinstance(expected, str) and expected.startswith("expected "):
        with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
            typed_value(hint, raw)
        return
    value = typed_value(hint, raw)
    assert value == expected and type(value) is type(expected)


# (type, an environment variable's text, the field's value, or the error's words)
FROM_TEXT: list[tuple[Any, str, object]] = [
    (str, " a b ", " a b "),
    (str, "", ""),
    (int, "12", 12),
    (int, " 12 ", 12),
    (int, "-1", -1),
    (int, "1.5", "expected a whole number, got '1.5'"),
    (int, "", "expected a whole number, got ''"),
    (float, "2.5", 2.5),
    (float, "3", 3.0),
    (float, "1e3", 1000.0),
    (float, "soon", "expected a number, got 'soon'"),
    (bool, "true", True),
    (bool, " False ", False),
    (bool, "yes", "expected true or false, got 'yes'"),
    (str | None, "p", "p"),
    (int | None, "3", 3),
    (list[str], "a, b,,c", ["a", "b", "c"]),
    (list[str], "", []),
    (tuple[str, ...], "a,b", ("a", "b")),
    (dict[str, str], "k=v", "expected a table, which only the config file can set"),
]


@pytest.mark.parametrize(("hint", "text", "expected"), FROM_TEXT)
def test_text_is_parsed_into_the_fields_type(hint: Any, text: str, expected: object) -> None:
    if isinstance(expected, str) and expected.startswith("expected "):
        with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
            typed_value(hint, text, text=True)
        return
    value = typed_value(hint, text, text=True)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("hint", [set[str], list[int], tuple[str, int], dict[str, int], int | str, bytes])
def test_a_type_no_reader_takes_is_the_codes_mistake(hint: Any) -> None:
    assert not supported(hint)
    with pytest.raises(TypeError):
        typed_value(hint, "x")


@pytest.mark.parametrize("cls", [TracerConfig, CollectorConfig, Demo])
def test_every_field_of_both_configs_can_be_read(cls: type) -> None:
    assert all(supported(hint) for hint in get_type_hints(cls).values())


# ---- a file's text ----------------------------------------------------------------------------------------

GOOD = """\
[other]
anything = "goes"

[demo]
name = "n"
limit = 0
interval_s = 2
on = true
path = "/p"
cap = 5
hosts = "a, b"
listen = ["x:1"]

[demo.labels]
team = "gpu"
"""


@pytest.mark.parametrize(("text", "expected"), [
    (GOOD, {"name": "n", "limit": 0, "interval_s": 2.0, "on": True, "path": "/p", "cap": 5,
            "hosts": ["a", "b"], "listen": ("x:1",), "labels": {"team": "gpu"}}),
    ("limit = 4\nlabels = { a = \"b\" }\n", {"limit": 4, "labels": {"a": "b"}}),  # no [demo]: the top level
    ("[demo]\n", {}),
    ("", {}),
])
def test_a_good_file_sets_its_keys(text: str, expected: dict[str, Any]) -> None:
    assert parse_config_text(text, Demo, "demo", where="--config d.toml") == expected


@pytest.mark.parametrize(("text", "line"), [
    ("limit = 'x'\n", "--config d.toml: limit: expected a whole number, got a string"),
    ("[demo]\non = 'yes'\n", "--config d.toml: on: expected true or false, got a string"),
    ("limit = -1\n", "--config d.toml: limit: --limit -1: must be 0 or more"),  # the field's check
    ("limt = 1\n", "--config d.toml: limt: unknown key; known keys: cap, hosts, interval_s, labels, limit, "
     "listen, name, on, path"),  # node: not settable
    ("node = 'n1'\n", "--config d.toml: node: unknown key; known keys: cap,"),
    ("[other]\nlimit = 1\n", "--config d.toml: other: unknown key"),  # no [demo]: the top level
    ("demo = 3\n", "--config d.toml: demo: expected a table, got a value"),
    ("limit = 1\nlimit = 2\n", "--config d.toml: limit: set twice (line 2)"),
    ("[demo]\nname = 'a'\n[demo]\n", "--config d.toml: demo: set twice (line 3)"),
    ("[demo.labels]\na = 'b'\n[demo.labels]\n", "--config d.toml: demo.labels: set twice (line 3)"),
    ("limit = \n", "--config d.toml: not valid TOML (Invalid value (at line 1, column 9))"),
    ("[demo\n", "--config d.toml: not valid TOML ("),
])
def test_each_bad_input_is_one_line_naming_where_and_the_key(text: str, line: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config_text(text, Demo, "demo", where="--config d.toml")
    assert str(err.value).startswith(line) and "\n" not in str(err.value)


# ---- the file ------------------------------------------------------------------------------------------


def test_the_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "d.toml"
    path.write_text("[demo]\nname = \"é\"\n", encoding="utf-8")
    assert read_config_file(str(path), Demo, "demo", where="W") == {"name": "é"}
    path.write_bytes(b"#" * (MAX_FILE_BYTES - 1) + b"\n")  # at the cap: still read
    assert read_config_file(str(path), Demo, "demo", where="W") == {}


def test_a_file_that_cannot_be_read_is_one_line(tmp_path: Path) -> None:
    def error(path: Path) -> str:
        with pytest.raises(ConfigError) as err:
            read_config_file(str(path), Demo, "demo", where=f"--config {path}")
        assert "\n" not in str(err.value)
        return str(err.value)

    assert error(tmp_path / "none.toml") == f"--config {tmp_path}/none.toml: no such file"
    assert error(tmp_path).startswith(f"--config {tmp_path}: cannot read it (")
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * MAX_FILE_BYTES + b"\n")
    assert error(big) == f"--config {big}: larger than 1 MiB; a config file sets a few keys"
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b"name = '\xe9'\n")
    assert error(latin).startswith(f"--config {latin}: cannot read it ('utf-8' codec can't decode")


# ---- the environment ---------------------------------------------------------------------------------------


def test_the_environment_sets_the_fields_it_names() -> None:
    env = {"DEMO_LIMIT": "3", "DEMO_HOSTS": "a,b", "DEMO_ON": "true", "DEMO_CAP": "9", "OTHER": "x",
           "DEMO_NODE": "n1", "DEMO_UNKNOWN": "1"}  # node is not settable, unknown not a field: both left
    assert environment_values(Demo, env, "DEMO_") == {"limit": 3, "hosts": ["a", "b"], "on": True, "cap": 9}
    assert environment_values(Demo, {}, "DEMO_") == {}


@pytest.mark.parametrize(("env", "line"), [
    ({"DEMO_LIMIT": "x"}, "DEMO_LIMIT: expected a whole number, got 'x'"),
    ({"DEMO_LIMIT": "-2"}, "DEMO_LIMIT: --limit -2: must be 0 or more"),  # the field's check
    ({"DEMO_INTERVAL_S": "1m"}, "DEMO_INTERVAL_S: expected a number, got '1m'"),
    ({"DEMO_LABELS": "a=b"}, "DEMO_LABELS: expected a table, which only the config file can set"),
])
def test_a_bad_variable_is_one_line_naming_it(env: dict[str, str], line: str) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(line)}$"):
        environment_values(Demo, env, "DEMO_")


# ---- both processes read their files the same way ----------------------------------------------------------


@pytest.mark.parametrize(("argv", "key", "prefix"), [
    (["tracer", "--node-name", "n1"], "grace_s", "ghostgpu: config: "),
    (["collector", "--listen", "127.0.0.1:0"], "retention_days", "ghostgpu: collector: "),
])
def test_both_processes_say_the_same_line_for_the_same_mistake(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], key: str, prefix: str) -> None:
    path = tmp_path / "both.toml"
    path.write_text(f"[{argv[0]}]\n{key} = 'a week'\n")
    assert cli.main([*argv, "--config", str(path)]) == 2
    assert capsys.readouterr().err == f"{prefix}--config {path}: {key}: expected a number, got a string\n"


def test_the_tracer_names_where_its_file_and_variables_were_set(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=rf"^GHOSTGPU_CONFIG {tmp_path}/none.toml: no such file$"):
        load_config(env={"GHOSTGPU_CONFIG": f"{tmp_path}/none.toml"})
    with pytest.raises(ConfigError, match=rf"^--config {tmp_path}/none.toml: no such file$"):
        load_config(tmp_path / "none.toml", env={"GHOSTGPU_CONFIG": "ignored.toml"})
    with pytest.raises(ConfigError, match=r"^GHOSTGPU_SPOOL_EVENTS: expected a whole number, got '1e5'$"):
        load_config(env={"GHOSTGPU_SPOOL_EVENTS": "1e5", "GHOSTGPU_NODE_NAME": "n1"})
    path = tmp_path / "t.toml"
    path.write_text("[tracer]\ngrace_s = 3\nvendors = \"nvidia, amd\"\n")
    cfg = load_config(env={"GHOSTGPU_CONFIG": str(path), "GHOSTGPU_GRACE_S": "4", "GHOSTGPU_NODE_NAME": "n1"},
                      overrides={"grace_s": None, "scan_interval_s": 9.0})
    assert (cfg.grace_s, cfg.vendors, cfg.scan_interval_s) == (4.0, ["nvidia", "amd"], 9.0)
