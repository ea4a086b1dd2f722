"""What an attacker's input may cost: node names checked before they are
kept (ghostgpu/common/model/names.py), audit details capped at 4 KiB (collector/audit.py), refusals
folded per key and window (collector/authz.py's DenialFold), and a policy reload that fails in any
way kept to one bounded line (collector/policy.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from ghostgpu.collector import policy as policy_mod
from ghostgpu.collector.audit import DETAIL_MAX_BYTES, AuditLog, bound_detail
from ghostgpu.collector.authz import DenialFold
from ghostgpu.collector.policy import ADMIN, RELOAD_LINE_MAX, PolicyWatcher

from ghostgpu.common.audit.chain import canonical_json, parse_line, verify
from ghostgpu.common.model.names import NODE_NAME_MAX, node_name_problem, one_line
from ghostgpu.common.transport.principal import Principal

BOB = Principal("user", "bob")


@pytest.mark.parametrize(("name", "needle"), [
    ("gpu-node-1", None),
    ("ip-10-0-0-5.ec2.internal", None),
    ("a", None),
    ("0", None),
    ("a" * 63 + "." + "b" * 63 + "." + "c" * 63 + "." + "d" * 61, None),  # 253 characters
    ("a" * 63 + "." + "b" * 63 + "." + "c" * 63 + "." + "d" * 62, "longer than 253 characters"),
    ("x" * (1 << 20), "longer than 253 characters"),
    ("", "empty"),
    ("Node-A", "not a DNS-1123 subdomain"),
    ("node_a", "not a DNS-1123 subdomain"),
    ("-node", "not a DNS-1123 subdomain"),
    ("node-", "not a DNS-1123 subdomain"),
    ("node..a", "not a DNS-1123 subdomain"),
    (".node", "not a DNS-1123 subdomain"),
    ("node a", "not a DNS-1123 subdomain"),
    ("node\nb", "not a DNS-1123 subdomain"),
    ("nöde", "not a DNS-1123 subdomain"),
    ("../../etc", "not a DNS-1123 subdomain"),
])
def test_node_names_are_dns1123_subdomains(name: str, needle: str | None) -> None:
    problem = node_name_problem(name)
    if needle is None:
        assert problem is None
        return
    assert problem is not None and needle in problem
    assert len(problem) < 250 and "\n" not in problem  # a 1 MiB name is said in 40 characters
    assert NODE_NAME_MAX == 253


@pytest.mark.parametrize(("text", "limit", "expected"), [
    ("short", 10, "short"),
    ("a\nb\r\n\tc", 10, "a b c"),
    ("x" * 20, 10, "xxxxxxx..."),
    ("y" * (1 << 20), 300, "y" * 297 + "..."),
])
def test_one_line(text: str, limit: int, expected: str) -> None:
    assert one_line(text, limit) == expected


@pytest.mark.parametrize(("detail", "kept"), [
    ({"node": "n1", "why": "x"}, {"node": "n1", "why": "x"}),
    ({"node": "x" * (1 << 20), "peer": "ipv4:1.2.3.4:5"}, None),
    ({"node": "é" * 5000}, None),  # 6 bytes each as canonical JSON
    ({f"k{i}": "v" * 300 for i in range(100)}, None),  # many values, each over the cut
    ({"scope": ["ns"] * 5000, "n": 3}, None),  # a long list
    ({"text": '"\\' * 10_000}, None),  # escapes double its size
])
def test_audit_details_are_capped_at_4_kib(detail: dict[str, object], kept: dict[str, object] | None) -> None:
    bounded = bound_detail(detail)
    assert len(canonical_json(bounded)) <= DETAIL_MAX_BYTES
    if kept is not None:
        assert bounded == kept
    else:
        assert bounded["detail_bytes"] == len(canonical_json(detail)) > DETAIL_MAX_BYTES


def test_a_capped_record_still_chains(tmp_path: Path) -> None:
    log = AuditLog(str(tmp_path / "audit.jsonl"), None)
    log.append("tracer.refused", "node:a", "denied", node="x" * (1 << 20), peer="p")
    log.append("tracer.refused", "node:a", "denied", node="ok")
    lines = (tmp_path / "audit.jsonl").read_text().splitlines()
    assert all(len(line) < DETAIL_MAX_BYTES + 1024 for line in lines)
    first = json.loads(lines[0])["detail"]
    assert first["node"].startswith("x" * 256 + "...") and first["node"].endswith(f"({1 << 20} characters)")
    assert first["peer"] == "p"
    assert verify([parse_line(line, n) for n, line in enumerate(lines, 1)]).ok


def test_denials_fold_per_key_and_window() -> None:
    now = [100.0]
    fold = DenialFold(window_s=10.0, clock=lambda: now[0])
    assert fold(("node:a", "node binding")) == 0  # the first: a record
    assert [fold(("node:a", "node binding")) for _ in range(199)] == [None] * 199  # folded
    assert fold(("node:a", "node name")) == 0  # another reason: its own record
    assert fold(("node:b", "node binding")) == 0  # another subject: its own record
    now[0] += 9.9
    assert fold(("node:a", "node binding")) is None
    now[0] += 0.2
    assert fold(("node:a", "node binding")) == 200  # the next window's record says how many were folded
    assert fold(("node:a", "node binding")) is None


def test_denial_fold_forgets_old_windows_past_its_key_limit() -> None:
    now = [0.0]
    fold = DenialFold(window_s=10.0, keys_max=100, clock=lambda: now[0])
    for i in range(100):
        assert fold((f"node:n{i}", "r")) == 0
    now[0] += 11.0
    assert fold(("node:new", "r")) == 0
    assert len(fold._seen) == 1


def test_denial_fold_never_holds_more_than_its_key_limit() -> None:
    now = [0.0]
    fold = DenialFold(window_s=10.0, keys_max=100, clock=lambda: now[0])
    assert fold(("node:n0", "r")) == 0
    now[0] += 1.0
    assert fold(("node:n1", "r")) == 0
    now[0] += 1.0
    assert fold(("node:n0", "r")) is None  # folded: n0's window still began first
    for i in range(2, 300):  # every window still open when the table is full
        assert fold((f"node:n{i}", "r")) == 0
        assert len(fold._seen) <= 100
    assert len(fold._seen) == 100
    assert ("node:n0", "r") not in fold._seen and ("node:n299", "r") in fold._seen  # the oldest went
    assert fold(("node:n0", "r")) == 0  # recorded again, its forgotten window's count lost
    assert len(fold._seen) == 100
    now[0] += 10.0
    assert fold(("node:n299", "r")) == 0  # a key whose window ended is re-recorded in place
    assert len(fold._seen) == 100


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.mark.parametrize("error", [MemoryError(), RecursionError("maximum recursion depth exceeded"),
                                   ValueError("x\n" * 100_000), KeyError("k")])
def test_a_reload_failing_in_any_way_keeps_the_policy_in_one_bounded_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        error: Exception) -> None:
    path = tmp_path / "policy.yaml"
    _write(path, "rules:\n  - {role: admin, subjects: [user:bob]}")
    events: list[tuple[str, str]] = []
    w = PolicyWatcher(str(path), on_event=lambda a, d: events.append((a, d)))

    def boom(_path: str) -> object:
        raise error

    monkeypatch.setattr(policy_mod.Policy, "load", staticmethod(boom))
    _write(path, "rules: []")
    caplog.clear()
    assert w.reload() is False and w.policy.roles(BOB) == {ADMIN}
    assert w.maybe_reload() is False and w.reload() is False  # the same file, the same error: said once
    assert [a for a, _ in events] == ["policy.reload_error"]
    line = events[0][1]
    assert len(line) <= RELOAD_LINE_MAX and "\n" not in line
    assert line.endswith("; the old policy stays in force")
    assert type(error).__name__ in line and str(path) in line
    assert [r.getMessage() for r in caplog.records] == [line]


def test_a_long_policy_error_is_cut_to_one_bounded_line(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    _write(path, "rules:\n  - {role: admin, subjects: [user:bob]}")
    events: list[tuple[str, str]] = []
    w = PolicyWatcher(str(path), on_event=lambda a, d: events.append((a, d)))
    _write(path, f"rules:\n  - {{role: '{'boss ' * 10_000}', subjects: [user:bob]}}")
    assert w.reload() is False and w.policy.roles(BOB) == {ADMIN}
    line = events[-1][1]
    assert len(line) <= RELOAD_LINE_MAX and line.startswith(f"policy {path}: rules[0].role: 'boss boss")
    assert line.endswith("...; the old policy stays in force")
