"""The authorization policy (collector/policy.py): parse errors name the file and the key, roles and
globs, the method table (every RPC of the API decided), trace limits, the built-in default, and
reloads (a bad file keeps the old policy, reported once)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from ghostgpu.collector.policy import (
    ADMIN,
    METHOD_ROLES,
    ROLES,
    TRACE_OPERATOR,
    TRACER,
    VIEWER,
    Policy,
    PolicyError,
    PolicyWatcher,
    format_duration,
)

from ghostgpu.common.transport.principal import ANONYMOUS, Principal
from ghostgpu.v1 import query_pb2, stream_pb2

SRC = "/etc/ghostgpu/policy.yaml"
ALICE = Principal("user", "alice", groups=("ml",), via="mtls")
BOB = Principal("user", "bob", groups=("ops",), via="mtls")
N1 = Principal("node", "n1", via="mtls")
ROOT = Principal("uid", "0", via="unix")
UID_1000 = Principal("uid", "1000", via="unix")
Q = "/ghostgpu.v1.Query/"

POLICY = """
rules:
  - role: viewer
    subjects: [group:ops, "uid:10*"]
  - role: trace-operator
    subjects: [user:alice]
    namespaces: [ml-*, research]
    max_duration: 10m
  - role: trace-operator
    subjects: [group:ml]
    namespaces: [research]
    max_duration: 1h
  - role: tracer
    subjects: ["node:*"]
  - role: admin
    subjects: [user:root-*]
"""


def policy() -> Policy:
    return Policy.parse(POLICY, SRC)


@pytest.mark.parametrize(("text", "line"), [
    ("rules:\n  - role: boss\n    subjects: [user:a]",
     "rules[0].role: 'boss' is not a role; use one of viewer, tracer, trace-operator, remediator, admin"),
    ("rules:\n  - {role: viewer, subjects: [user:a]}\n  - subjects: [user:b]",
     "rules[1].role: is missing; use one of viewer, tracer, trace-operator, remediator, admin"),
    ("rules:\n  - {role: viewer, subjects: [user:a], who: me}",
     "rules[0].who: unknown key; use role, subjects, namespaces, max_duration"),
    ("rules:\n  - {role: viewer, subjects: [alice]}",
     "rules[0].subjects[0]: 'alice' is not a subject; write user:NAME, node:NAME, group:NAME, uid:N or "
     "anonymous (NAME may be a glob)"),
    ("rules:\n  - {role: viewer, subjects: [uid:root]}", "rules[0].subjects[0]: 'uid:root' is not a subject"),
    ("rules:\n  - {role: viewer, subjects: user:a}", "rules[0].subjects: use a non-empty list"),
    ("rules:\n  - {role: viewer, subjects: []}", "rules[0].subjects: use a non-empty list"),
    ("rules:\n  - {role: viewer}", "rules[0].subjects: is missing; list who has role viewer"),
    ("rules:\n  - {role: viewer, subjects: [user:a], namespaces: [x]}",
     "rules[0].namespaces: only a trace-operator rule takes namespaces; remove it from this viewer rule"),
    ("rules:\n  - {role: admin, subjects: [user:a], max_duration: 5m}",
     "rules[0].max_duration: only a trace-operator rule takes max_duration"),
    ("rules:\n  - {role: trace-operator, subjects: [user:a], max_duration: 10x}",
     "rules[0].max_duration '10x': use a duration like 30s"),
    ("rules:\n  - {role: trace-operator, subjects: [user:a], max_duration: 0}",
     "rules[0].max_duration 0: must be above 0"),
    ("rules:\n  - {role: trace-operator, subjects: [user:a], namespaces: [ml, '']}",
     "rules[0].namespaces[1]: '' is not a non-empty string"),
    ("rules:\n  - viewer", "rules[0]: use a mapping with keys role, subjects, namespaces, max_duration"),
    ("rule:\n  - {role: viewer, subjects: [user:a]}", "rule: unknown key; the file holds only `rules:`"),
    ("rules:", "rules: use a list of {role, subjects, namespaces, max_duration}"),
    ("", "empty or not a mapping; write `rules:`"),
    ("rules: [\n  - role", "line 2 column 3: not valid YAML"),
])
def test_parse_errors_name_the_file_and_the_key(text: str, line: str) -> None:
    with pytest.raises(PolicyError) as err:
        Policy.parse(text, SRC)
    message = str(err.value)
    assert message.startswith(f"policy {SRC}: {line}"), message
    assert "\n" not in message


def test_an_unreadable_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=r"^policy .*/nope.yaml: cannot read it \(No such file"):
        Policy.load(str(tmp_path / "nope.yaml"))


def test_empty_rules_allow_nobody() -> None:
    p = Policy.parse("rules: []", SRC)
    assert p.roles(ROOT) == frozenset()
    assert p.check(ROOT, Q + "ListConsumers") == "role viewer"


@pytest.mark.parametrize(("who", "roles"), [
    (ALICE, {TRACE_OPERATOR}),  # user:alice and group:ml: two trace-operator rules
    (BOB, {VIEWER}),  # group:ops
    (UID_1000, {VIEWER}),  # uid:10* glob
    (Principal("uid", "1", via="unix"), set()),
    (N1, {TRACER}),
    (Principal("user", "root-ops"), {ADMIN}),
    (Principal("user", "n1"), set()),  # the kind is part of the subject: user:n1 is no node:n1
    (Principal("node", "alice"), {TRACER}),
    (ANONYMOUS, set()),
])
def test_roles_and_globs(who: Principal, roles: set[str]) -> None:
    assert policy().roles(who) == frozenset(roles)


def test_anonymous_is_a_subject_of_its_own() -> None:
    p = Policy.parse("rules:\n  - {role: viewer, subjects: [anonymous]}", SRC)
    assert p.roles(ANONYMOUS) == {VIEWER}
    assert p.roles(BOB) == frozenset()


def test_every_rpc_of_the_api_has_a_role() -> None:
    """A new RPC must be decided here: otherwise it is admin only, which this test makes visible."""
    methods = {f"/ghostgpu.v1.{svc.name}/{m.name}"
               for fd in (query_pb2.DESCRIPTOR, stream_pb2.DESCRIPTOR)
               for svc in fd.services_by_name.values() for m in svc.methods}
    assert methods == set(METHOD_ROLES)
    assert all(set(roles) <= set(ROLES) for roles in METHOD_ROLES.values())


@pytest.mark.parametrize(("who", "method", "missing"), [
    (BOB, Q + "ListConsumers", None),
    (BOB, Q + "WatchFindings", None),
    (BOB, Q + "ListTraces", None),
    (BOB, Q + "StartTrace", "role trace-operator"),
    (BOB, Q + "ListAudit", "role admin"),
    (BOB, "/ghostgpu.v1.NodeStream/Connect", "role tracer"),
    (ALICE, Q + "StartTrace", None),
    (ALICE, Q + "StopTrace", None),
    (ALICE, Q + "WatchTrace", None),  # trace-operator may watch what it started
    (ALICE, Q + "ListConsumers", "role viewer"),
    (N1, "/ghostgpu.v1.NodeStream/Connect", None),
    (N1, Q + "ListConsumers", "role viewer"),
    (Principal("user", "root-x"), Q + "ListAudit", None),  # admin may do everything,
    (Principal("user", "root-x"), "/ghostgpu.v1.NodeStream/Connect", None),
    (Principal("user", "root-x"), "/grpc.health.v1.Health/Check", None),  # unknown methods too
    (BOB, "/grpc.health.v1.Health/Check", "role admin"),  # which nobody else may call
])
def test_method_table(who: Principal, method: str, missing: str | None) -> None:
    assert policy().check(who, method) == missing


def test_denial_names_method_subject_and_role() -> None:
    line = policy().denial(BOB, Q + "StartTrace")
    assert line == (f"{Q}StartTrace denied to user:bob: it needs role trace-operator (policy {SRC}); "
                    "ask an admin to grant it")
    assert policy().denial(ALICE, Q + "StartTrace") is None


@pytest.mark.parametrize(("who", "namespace", "duration_s", "why"), [
    (ALICE, "ml-train", 600, None),  # at the limit
    (ALICE, "ml-train", 601, "601s is over user:alice's limit of 10m for namespace 'ml-train' "
     f"(policy {SRC}: rules[1].max_duration); ask for a shorter trace"),
    (ALICE, "research", 3600, None),  # group:ml's rule allows research for 1h
    (ALICE, "research", 7200, "2h is over user:alice's limit of 1h for namespace 'research' "
     f"(policy {SRC}: rules[2].max_duration)"),
    (ALICE, "prod", 30, "namespace 'prod' is outside user:alice's trace namespaces (ml-*, research)"),
    (ALICE, None, 30, "a trace without a namespace (by node or pid) needs role admin or a trace-operator "
     "rule with namespaces [\"*\"]; user:alice has neither"),
    (ALICE, "", 30, "a trace without a namespace"),
    (BOB, "ml-train", 30, "user:bob may not start or stop trace sessions: it needs role trace-operator"),
    (Principal("user", "root-1"), None, 10**6, None),  # admin: no limits
])
def test_trace_denial(who: Principal, namespace: str | None, duration_s: float, why: str | None) -> None:
    got = policy().trace_denial(who, namespace, duration_s)
    if why is None:
        assert got is None
    else:
        assert got is not None and got.startswith(why), got


def test_trace_operator_defaults_all_namespaces_no_limit() -> None:
    p = Policy.parse("rules:\n  - {role: trace-operator, subjects: [user:bob]}", SRC)
    assert p.rules[0].namespaces == ("*",)
    assert p.trace_denial(BOB, None, 10**6) is None  # namespaces ["*"] covers node/pid traces
    assert p.trace_denial(BOB, "anything", 10**6) is None


def test_format_duration() -> None:
    assert [format_duration(s) for s in (30, 90, 600, 3600, 5400, 1.5)] == ["30s", "90s", "10m", "1h",
                                                                            "90m", "1.5s"]


def test_default_policy() -> None:
    p = Policy.default(own_uid=1234)
    assert p.roles(ROOT) == {ADMIN}
    assert p.roles(Principal("uid", "1234", via="unix")) == {ADMIN}
    assert p.roles(UID_1000) == frozenset()
    assert p.roles(N1) == {TRACER}
    assert p.roles(BOB) == frozenset()
    assert p.roles(ANONYMOUS) == frozenset()
    assert Policy.default(own_uid=0).rules[0].subjects == ("uid:0",)
    assert Policy.default().roles(Principal("uid", str(os.getuid()))) == {ADMIN}


def _write(path: Path, text: str) -> None:
    """Replace the file as an editor or a ConfigMap update does (a new inode), so the change shows
    even within one mtime tick."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_watcher_reloads_on_change_and_keeps_the_old_policy_on_a_bad_one(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    _write(path, "rules:\n  - {role: viewer, subjects: [user:bob]}")
    events: list[tuple[str, str]] = []
    w = PolicyWatcher(str(path), on_event=lambda a, d: events.append((a, d)))
    assert w.policy.roles(BOB) == {VIEWER}
    assert w.maybe_reload() is False and events == []  # nothing changed

    _write(path, "rules:\n  - {role: admin, subjects: [user:bob]}")
    assert w.maybe_reload() is True
    assert w.policy.roles(BOB) == {ADMIN}
    assert events == [("policy.reload", f"policy {path}: reloaded, 1 rules in force")]

    _write(path, "rules:\n  - {role: boss, subjects: [user:bob]}")
    assert w.maybe_reload() is False
    assert w.policy.roles(BOB) == {ADMIN}  # the old policy stays in force
    assert events[-1] == ("policy.reload_error", f"policy {path}: rules[0].role: 'boss' is not a role; use "
                          "one of viewer, tracer, trace-operator, remediator, admin; the old policy stays in "
                          "force")
    assert w.maybe_reload() is False and len(events) == 2  # reported once per change, not per look

    path.unlink()  # a ConfigMap mid-swap: the old policy stays, said once
    assert w.maybe_reload() is False
    assert w.maybe_reload() is False
    assert [a for a, _ in events] == ["policy.reload", "policy.reload_error", "policy.reload_error"]
    assert "cannot read it" in events[-1][1]

    _write(path, "rules:\n  - {role: viewer, subjects: [user:alice]}")
    assert w.reload() is True  # SIGHUP
    assert w.policy.roles(ALICE) == {VIEWER} and w.policy.roles(BOB) == frozenset()


def test_watcher_start_with_a_bad_file_fails(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("rules:\n  - {role: viewer, subjects: [bob]}")
    with pytest.raises(PolicyError, match=r"rules\[0\]\.subjects\[0\]"):
        PolicyWatcher(str(path))


def test_watcher_without_a_file_uses_the_default() -> None:
    w = PolicyWatcher(None, own_uid=4321)
    assert w.policy.roles(Principal("uid", "4321")) == {ADMIN}
    assert w.maybe_reload() is False and w.reload() is False
