"""The `remediation:` section of the collector's config file (collector/remediation_policy.py): the
issue's YAML pasted as is, the same keys in TOML, the defaults, and one line naming the file and the
key's full path for every bad input; the settings' reader leaves the section to it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ghostgpu.cli import main as cli
from ghostgpu.collector.config import CollectorConfig, collector_config
from ghostgpu.collector.remediation_config import load_remediation
from ghostgpu.collector.remediation_policy import (
    Breaker,
    IsolationSettings,
    NamespaceFilter,
    RemediationPolicy,
    TicketAction,
    changes,
    parse_remediation,
    remediation_section,
)

from ghostgpu.common.model.remediation import MODE_DRY_RUN, MODE_OFF, MODE_ON
from ghostgpu.common.system.configfile import ConfigError, parse_config_text, parse_document

# The contract, as the docs show it: pasted as is, comments and all.
CONTRACT_YAML = """\
remediation:
  mode: dry-run            # off (default) | dry-run | on
  min_age: 5m              # a finding this old, at least, before anything is done
  namespaces: {include: ["*"], exclude: ["kube-system"]}
  actions:
    kill_orphans: true     # action 1
    isolate_node: false    # action 2
    ticket: {url: "", headers_file: ""}   # action 3; empty url: off
  breaker: {max_actions: 10, window: 1h, max_per_node: 3, max_isolated_nodes_pct: 10}
"""

CONTRACT_TOML = """\
[collector]
retention_days = 3

[collector.remediation]
mode = "dry-run"
min_age = "5m"
namespaces = {include = ["*"], exclude = ["kube-system"]}

[collector.remediation.actions]
kill_orphans = true
isolate_node = false
ticket = {url = "", headers_file = ""}

[collector.remediation.breaker]
max_actions = 10
window = "1h"
max_per_node = 3
max_isolated_nodes_pct = 10
"""

EVERYTHING_YAML = """\
remediation:
  mode: on
  min_age: 90s
  namespaces: {include: ["ml-*", "research"], exclude: []}
  actions:
    kill_orphans: false
    isolate_node: true
    ticket: {url: "https://tickets.example/hook", headers_file: /etc/ghostgpu/ticket-headers}
  breaker: {max_actions: 4, window: 30m, max_per_node: 1, max_isolated_nodes_pct: 12.5}
  grace: 2s
  allowlist: ["nv-hostengine", "/usr/bin/dcgm*"]
  isolation: {how: cordon, unaccounted_bytes: 2GiB, unaccounted_for: 15m, kubeconfig: /etc/kube/config}
"""

EVERYTHING = RemediationPolicy(
    mode=MODE_ON, min_age_s=90.0, namespaces=NamespaceFilter(("ml-*", "research"), ()), kill_orphans=False,
    isolate_node=True, ticket=TicketAction("https://tickets.example/hook", "/etc/ghostgpu/ticket-headers"),
    breaker=Breaker(4, 1800.0, 1, 12.5),
    isolation=IsolationSettings("cordon", 2 << 30, 900.0, "/etc/kube/config"),
    grace_s=2.0, allowlist=("nv-hostengine", "/usr/bin/dcgm*"))
CONTRACT = RemediationPolicy(mode=MODE_DRY_RUN)  # every other key as its default


def from_yaml(text: str) -> RemediationPolicy:
    doc = parse_document(text, where="--config c.yaml", yaml=True)
    return parse_remediation(remediation_section(doc, "collector", "--config c.yaml"), "--config c.yaml")


def test_the_contracts_yaml_pasted_as_is_and_its_toml_mean_the_same(tmp_path: Path) -> None:
    yaml_file, toml_file = tmp_path / "c.yaml", tmp_path / "c.toml"
    yaml_file.write_text(CONTRACT_YAML)
    toml_file.write_text(CONTRACT_TOML)
    assert load_remediation(str(yaml_file)) == load_remediation(str(toml_file)) == CONTRACT
    assert from_yaml(EVERYTHING_YAML) == EVERYTHING


def test_the_defaults_are_the_contracts() -> None:
    policy = parse_remediation(None, "W")
    assert policy == RemediationPolicy() == parse_remediation({}, "W") == from_yaml("remediation:\n")
    assert policy.mode == MODE_OFF and policy.min_age_s == 300
    assert policy.kill_orphans and not policy.isolate_node and policy.ticket.url == ""
    assert policy.namespaces == NamespaceFilter(("*",), ("kube-system",))
    assert policy.breaker == Breaker(max_actions=10, window_s=3600.0, max_per_node=3,
                                     max_isolated_nodes_pct=10.0)
    assert policy.describe() == ("mode off, min_age 5m, actions kill_orphans, breaker 10 per 1h (3 per "
                                 "node), isolated nodes at most 10%")


@pytest.mark.parametrize(("yaml_mode", "mode"), [
    ("on", MODE_ON), ("off", MODE_OFF), ("dry-run", MODE_DRY_RUN), ("'on'", MODE_ON),
    ("Dry-Run", MODE_DRY_RUN)])
def test_mode_on_and_off_are_modes_not_yaml_11_booleans(yaml_mode: str, mode: str) -> None:
    assert from_yaml(f"remediation:\n  mode: {yaml_mode}\n").mode == mode


def test_min_age_may_be_0_and_durations_may_be_plain_seconds() -> None:
    policy = from_yaml("remediation:\n  min_age: 0\n  grace: 1.5\n  breaker: {window: 90}\n")
    assert (policy.min_age_s, policy.grace_s, policy.breaker.window_s) == (0.0, 1.5, 90.0)


@pytest.mark.parametrize(("section", "line"), [
    ("breaker: {window: 1x}", "remediation.breaker.window: '1x': use a duration like 30s, 5m or 1h (a number "
     "alone is seconds; above 0), e.g. 1h"),
    ("breaker: {window: 0}", "remediation.breaker.window: 0: use a duration like"),
    ("min_age: -5m", "remediation.min_age: '-5m': use a duration like 30s, 5m or 1h (a number alone is "
     "seconds; 0 or more), e.g. 5m"),
    ("min_age: [5m]", "remediation.min_age: ['5m']: expected a duration like 5m, got a list"),
    ("mode: maybe", "remediation.mode: 'maybe' is not a mode; use off, dry-run, on"),
    ("mode: true", "remediation.mode: True: expected one of off, dry-run, on, got a boolean"),
    ("modes: on", "remediation.modes: unknown key; known keys: actions, allowlist, breaker, grace, "
     "isolation, min_age, mode, namespaces"),
    ("breaker: {max_action: 3}", "remediation.breaker.max_action: unknown key; known keys: max_actions, "
     "max_isolated_nodes_pct, max_per_node, window"),
    ("actions: {kill_orphans: yes}", "remediation.actions.kill_orphans: 'yes': expected true or false, got a "
     "string"),
    ("actions: {isolate_node: 1}",
     "remediation.actions.isolate_node: 1: expected true or false, got a number"),
    ("actions: {ticket: {url: 'ftp://x'}}", "remediation.actions.ticket.url 'ftp://x': use http(s)://HOST"),
    ("actions: {ticket: {url: 'http://h:99999/'}}", "remediation.actions.ticket.url 'http://h:99999/': Port"),
    ("actions: {ticket: {url: 'https://bot:pw@h/'}}", "remediation.actions.ticket.url: credentials in the "
     "URL would be logged; put an Authorization line in remediation.actions.ticket.headers_file instead"),
    ("actions: {ticket: {uri: ''}}",
     "remediation.actions.ticket.uri: unknown key; known keys: headers_file, url"),
    ("actions: [kill_orphans]", "remediation.actions: expected a mapping like {kill_orphans: true, "),
    ("namespaces: {include: []}", "remediation.namespaces.include: an empty list admits no namespace; write "
     "[\"*\"] for every one (or mode: off to do nothing)"),
    ("namespaces: {exclude: kube-system}", "remediation.namespaces.exclude: expected a list of globs like "
     "[\"kube-system\"], got a string"),
    ("namespaces: {include: ['ml-*', '']}",
     "remediation.namespaces.include[1]: '' is not a non-empty string"),
    ("breaker: {max_actions: 0}", "remediation.breaker.max_actions: 0: must be 1 or more (to act never, set "
     "mode: dry-run)"),
    ("breaker: {max_per_node: 2.5}", "remediation.breaker.max_per_node: 2.5: expected a whole number, got a "
     "number"),
    ("breaker: {max_isolated_nodes_pct: 0}", "remediation.breaker.max_isolated_nodes_pct: 0: must be above 0 "
     "and at most 100 (to isolate no node, set actions.isolate_node: false)"),
    ("breaker: {max_isolated_nodes_pct: 101}", "remediation.breaker.max_isolated_nodes_pct: 101: must be"),
    ("breaker: {max_isolated_nodes_pct: ten}",
     "remediation.breaker.max_isolated_nodes_pct: 'ten': expected a number, got a string"),
    ("isolation: {how: drain}", "remediation.isolation.how: 'drain': use taint or cordon"),
    ("isolation: {unaccounted_bytes: 2GB}", "remediation.isolation.unaccounted_bytes: '2GB': use bytes (a "
     "whole number) or a size like 512MiB or 2GiB (0: no such trigger)"),
    ("isolation: {unaccounted_bytes: -1}", "remediation.isolation.unaccounted_bytes: -1: must be 0 or more"),
    ("grace: 0s", "remediation.grace: '0s': use a duration like"),
    ("grace: 2m", "remediation.grace: 2m is over the tracer's cap of 1m; use 60s or less, e.g. 10s"),
    ("allowlist: nv-hostengine", "remediation.allowlist: expected a list of globs like"),
])
def test_each_bad_input_is_one_line_naming_the_file_and_the_keys_path(section: str, line: str) -> None:
    with pytest.raises(ConfigError) as err:
        from_yaml(f"remediation:\n  {section}\n")
    assert str(err.value).startswith(f"--config c.yaml: {line}"), str(err.value)
    assert "\n" not in str(err.value)


def test_the_section_that_is_not_a_mapping_or_set_twice_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^--config c.yaml: remediation: expected a mapping like "
                                          r"\{mode: dry-run, min_age: 5m\}, got a list$"):
        from_yaml("remediation: [on]\n")
    with pytest.raises(ConfigError, match=r"^--config c.yaml: remediation: set twice \(at the top level and "
                                          r"in collector\); keep one$"):
        from_yaml("remediation: {mode: on}\ncollector: {remediation: {mode: off}}\n")


def test_the_section_may_sit_at_the_top_or_in_the_collector_table() -> None:
    assert from_yaml("collector: {retention_days: 2}\nremediation: {mode: on}\n").mode == MODE_ON
    assert from_yaml("collector:\n  remediation: {mode: on}\n").mode == MODE_ON
    assert from_yaml("collector: {retention_days: 2}\n").mode == MODE_OFF


# ---- the settings' reader leaves the section alone -------------------------------------------------------


@pytest.mark.parametrize("name", ["c.yaml", "c.toml"])
def test_the_collectors_settings_reader_skips_the_section(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text(CONTRACT_YAML.replace("remediation:", "retention_days: 3\nremediation:") if name.endswith(
        "yaml") else CONTRACT_TOML)
    config = collector_config(cli._build_parser().parse_args(["collector", "--config", str(path)]))
    assert config.retention_days == 3.0 and config.config_path == str(path)
    assert load_remediation(str(path)) == CONTRACT


def test_an_unknown_collector_key_lists_remediation_among_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"^--config c.toml: remediaton: unknown key; known keys: .*"
                                          r"policy_path, remediation, replica_id"):
        parse_config_text("[remediaton]\nmode = 'on'\n", CollectorConfig, "collector",
                          where="--config c.toml", sections=("remediation",))


def test_a_yaml_collector_file_takes_the_same_keys_and_types_as_toml() -> None:
    text = "collector:\n  retention_days: 2.5\n  listen: ['127.0.0.1:7450']\n  insecure: false\n"
    values: dict[str, Any] = parse_config_text(text, CollectorConfig, "collector", where="--config c.yml",
                                               yaml=True)
    assert values == {"retention_days": 2.5, "listen": ("127.0.0.1:7450",), "insecure": False}
    for text, line in [
        ("insecure: no\n", "insecure: expected true or false, got a string"),  # not YAML 1.1's boolean
        ("retention_days: 1\nretention_days: 2\n", "line 2 column 1: duplicate key 'retention_days'"),
        ("- 1\n", "expected a mapping of keys at the top of the file, got a list"),
        ("[a\n", "line 2 column 1: not valid YAML (expected ',' or ']'"),
    ]:
        with pytest.raises(ConfigError) as err:
            parse_config_text(text, CollectorConfig, "collector", where="--config c.yml", yaml=True)
        assert str(err.value).startswith(f"--config c.yml: {line}") and "\n" not in str(err.value)


def test_a_bad_section_stops_the_collector_with_one_line(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("remediation:\n  breaker: {window: 1x}\n")
    assert cli.main(["collector", "--config", str(path), "--listen", "127.0.0.1:0", "--db", ":memory:"]) == 2
    assert capsys.readouterr().err == (f"ghostgpu: collector: --config {path}: remediation.breaker.window: "
                                       "'1x': use a duration like 30s, 5m or 1h (a number alone is seconds; "
                                       "above 0), e.g. 1h\n")


# ---- what a reload says ----------------------------------------------------------------------------------


def test_changes_name_each_key_as_the_file_writes_it_and_hide_the_urls_secrets() -> None:
    new = from_yaml("remediation:\n  mode: on\n  breaker: {window: 30m}\n"
                    "  actions: {ticket: {url: 'https://tickets.example:8443/hook?token=t0k'}}\n")
    assert changes(RemediationPolicy(), new) == [
        "mode: off -> on", 'actions.ticket.url: "" -> https://tickets.example:8443/hook?...',
        "breaker.window: 1h -> 30m"]
    assert changes(new, new) == []
    assert "t0k" not in str(new.settings())
