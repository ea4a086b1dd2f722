"""ghostgpu/common/system/safe_yaml.py: the config files' YAML loader refuses what a hostile file would use
(anchors, aliases, merge keys, duplicate keys, deep nesting, a huge file) in one line with the line
number, and the policy and the web config both read through it."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from ghostgpu.collector.policy import Policy, PolicyError

from ghostgpu.common.system import safe_yaml
from ghostgpu.common.system.safe_yaml import MAX_CONFIG_BYTES, MAX_DEPTH, YamlRefused, load, read_capped
from ghostgpu.common.web.webconfig import WebConfigError, load_web_config, parse_web_config

# A few hundred bytes that expand to 10**9 strings (the "billion laughs"), as the attack used.
ALIAS_BOMB = "a: &a [x,x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n"
    for p, c in zip("abcdefgh", "bcdefghi", strict=True)) + "rules: [*i]\n"
NESTED: list[object] = []
for _ in range(MAX_DEPTH - 1):
    NESTED = [NESTED]


@pytest.mark.parametrize(("text", "needle", "line"), [
    ("a: &x 1\nb: 2\n", "anchor &x refused", 1),
    ("a: 1\nb: *x\n", "alias *x refused", 2),
    ("a: [1]\nb: &x {c: 1}\n", "anchor &x refused", 2),
    (ALIAS_BOMB, "anchor &a refused", 1),
    ("a: {b: 1, <<: {c: 2}}\n", "merge key << refused", 1),
    ("rules:\n  - role: viewer\n    subjects: [user:bob]\n    role: admin\n",
     "duplicate key 'role' (first at line 2)", 4),
    ("a: 1\n'a': 2\n", "duplicate key 'a' (first at line 1)", 2),
    ("x: {k: 1, k: 2}\n", "duplicate key 'k' (first at line 1)", 1),
    ("1: a\n1: b\n", "duplicate key 1 (first at line 1)", 2),
    ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), f"nested more than {MAX_DEPTH} levels deep", 1),
    (f"{'k' * 500}: 1\n{'k' * 500}: 2\n", "duplicate key 'kkkk", 2),
])
def test_refused_in_one_line_with_its_line(text: str, needle: str, line: int) -> None:
    with pytest.raises(YamlRefused) as e:
        load(text)
    message = str(e.value)
    assert needle in message and "\n" not in message and len(message) < 250, message
    assert message.startswith(f"line {line} column ") and e.value.line == line


@pytest.mark.parametrize(("text", "expected"), [
    ("rules:\n  - {role: viewer, subjects: [user:bob]}\n",
     {"rules": [{"role": "viewer", "subjects": ["user:bob"]}]}),
    ("", None),
    ("a: 1\nb: {a: 2}\nc: [{a: 3}, {a: 4}]\n",  # one key in several mappings
     {"a": 1, "b": {"a": 2}, "c": [{"a": 3}, {"a": 4}]}),
    ("[" * MAX_DEPTH + "]" * MAX_DEPTH, NESTED),  # as deep as allowed
    ("s: 'a & b * c'\n", {"s": "a & b * c"}),  # & and * inside a string are text
])
def test_plain_documents_load_as_safe_load_does(text: str, expected: object) -> None:
    assert load(text) == expected == yaml.safe_load(text)


def test_a_syntax_error_is_yamls_own() -> None:
    with pytest.raises(yaml.YAMLError):
        load("a: [1\n")
    with pytest.raises(yaml.constructor.ConstructorError):
        load("!!python/object:os.system {}\n")  # still SafeLoader underneath


def test_read_capped_reads_at_most_the_cap(tmp_path: Path) -> None:
    ok = tmp_path / "ok.yaml"
    ok.write_text("a: 1\n" + "#" * (MAX_CONFIG_BYTES - 6) + "\n")
    assert read_capped(str(ok)).startswith("a: 1")
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(YamlRefused, match=r"^larger than 64 KiB"):
        read_capped(str(big))
    with pytest.raises(YamlRefused, match=r"^not a regular file \(a character device\)"):
        read_capped("/dev/zero")  # endless: refused before any read
    with pytest.raises(UnicodeDecodeError):
        (tmp_path / "bin").write_bytes(b"\xff\xfe")
        read_capped(str(tmp_path / "bin"))


def test_the_biggest_file_allowed_loads_quickly() -> None:
    text = "rules: [" + ",".join(["x"] * (MAX_CONFIG_BYTES // 2 - 8)) + "]\n"
    assert len(text) <= MAX_CONFIG_BYTES
    start = time.monotonic()
    load(text)
    assert time.monotonic() - start < 5.0  # pure Python on a slow 2-core VM: about 0.6 s


@pytest.mark.parametrize(("text", "needle"), [
    ("rules:\n  - role: viewer\n    role: admin\n    subjects: [user:bob]\n",
     "line 3 column 5: duplicate key 'role' (first at line 2)"),
    ("rules:\n  - {role: viewer, subjects: [user:bob]}\nrules: []\n",
     "line 3 column 1: duplicate key 'rules' (first at line 1)"),
    (ALIAS_BOMB, "line 1 column 4: anchor &a refused"),
])
def test_the_policy_refuses_them_naming_the_key(text: str, needle: str) -> None:
    with pytest.raises(PolicyError) as e:
        Policy.parse(text, "/etc/ghostgpu/policy.yaml")
    line = str(e.value)
    assert line.startswith("policy /etc/ghostgpu/policy.yaml: ") and needle in line, line


def test_the_policy_and_the_web_config_are_read_capped(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("rules: []\n" + "#" * MAX_CONFIG_BYTES)
    with pytest.raises(PolicyError, match=r"^policy .*big.yaml: larger than 64 KiB"):
        Policy.load(str(big))
    with pytest.raises(WebConfigError, match=r"^web config .*big.yaml: larger than 64 KiB"):
        load_web_config(str(big))


@pytest.mark.parametrize(("make", "kind"), [
    (os.mkfifo, "a FIFO"),  # no writer: a blocking open would wait forever
    (os.mkdir, "a directory"),
])
def test_read_capped_refuses_what_is_not_a_regular_file_at_once(tmp_path: Path, make: Callable[[Path], None],
                                                                kind: str) -> None:
    odd = tmp_path / "policy.yaml"
    make(odd)
    refused = rf"not a regular file \({kind}\)"
    with pytest.raises(YamlRefused, match=rf"^{refused}; point it at the YAML file itself$"):
        read_capped(str(odd))
    with pytest.raises(PolicyError, match=rf"^policy {re.escape(str(odd))}: {refused}"):
        Policy.load(str(odd))
    with pytest.raises(WebConfigError, match=rf"^web config {re.escape(str(odd))}: {refused}"):
        load_web_config(str(odd))


@pytest.mark.parametrize(("text", "needle"), [
    ("basic_auth_users:\n  prometheus: $2y$10$a\n  prometheus: $2y$10$b\n",
     "line 3 column 3: duplicate key 'prometheus' (first at line 2)"),
    ("tls_server_config: {cert_file: &c a.crt, key_file: *c}\n", "anchor &c refused"),
])
def test_the_web_config_refuses_them_naming_the_key(text: str, needle: str) -> None:
    with pytest.raises(WebConfigError) as e:
        parse_web_config(text, "/etc/ghostgpu/web.yml")
    line = str(e.value)
    assert line.startswith("web config /etc/ghostgpu/web.yml: ") and needle in line, line


def test_no_config_loader_of_the_project_uses_yaml_directly() -> None:
    """Every YAML the project reads from a user goes through safe_yaml (grep `yaml.` in the code)."""
    repo = Path(safe_yaml.__file__).resolve().parents[2]
    direct = re.compile(r"(?<![\w.])yaml\.(safe_|full_|unsafe_)?load(_all)?\(|Loader\b")
    offenders = [str(p.relative_to(repo)) for folder in ("ghostgpu", "tracer", "collector")
                 for p in (repo / folder).rglob("*.py")
                 if p.name != "safe_yaml.py" and direct.search(p.read_text())]
    assert offenders == []
