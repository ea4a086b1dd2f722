"""Attacks on the policy file and the Hello, against the real `ghostgpu collector` over real mTLS
(docs/SECURITY.md, "Threats and what stops them").

- A duplicate `role` key: `role: viewer` then `role: admin` in one rule must not make an admin; the
  collector refuses the file at start (exit 2, one line naming the key) and at reload (old policy kept).
- An alias bomb reloaded with SIGHUP: the collector stays responsive, keeps the old policy, logs one
  line of at most 300 characters and writes one audit record of bounded size.
- A flood of refused Hellos (a node certificate for node A speaking for node B): one folded audit
  record per 10 s window, the next one saying how many were folded.
- A 1 MiB node name: refused before anything stores it; no audit record over 4 KiB.

No root needed: the collector, its PKI and the clients are the real programs on loopback. Nothing
sleeps to wait for a result: every wait polls with a deadline.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from ghostgpu.common.transport.dial import open_channel
from ghostgpu.common.transport.tls import TlsFiles
from ghostgpu.common.wire.protocol import API_VERSION, API_VERSION_METADATA, channel_options
from ghostgpu.v1 import stream_pb2
from tests.helpers.audit_log import audit_records
from tests.helpers.certs import Pki
from tests.helpers.collector_proc import CollectorProcess, ghostgpu_cli, tls_flags
from tests.helpers.polling import wait_until

DEADLINE_S = 30.0
NODE_A, NODE_B = "node-a", "node-b"
POLICY = """rules:
  - role: viewer
    subjects: ["user:bob"]
  - role: admin
    subjects: ["user:ops"]
  - role: tracer
    subjects: ["node:*"]
"""
# The duplicate-key attack: the second `role` wins in PyYAML, silently.
DUPLICATE_ROLE = """rules:
  - role: viewer
    subjects: ["user:bob"]
    role: admin
  - role: tracer
    subjects: ["node:*"]
"""
LOG_LINE_MAX = 300
AUDIT_DETAIL_MAX = 4096


def alias_bomb(levels: int = 7) -> str:
    """A few hundred bytes of YAML whose `role` expands to 10**levels strings through aliases."""
    names = "abcdefghij"[:levels]
    lists = [f"&{names[0]} [{', '.join(['lol'] * 10)}]"]
    lists += [f"&{c} [{', '.join([f'*{p}'] * 10)}]" for p, c in itertools.pairwise(names)]
    return (POLICY + f"  - role: [{', '.join(lists)}]\n" + '    subjects: ["user:mallory"]\n')


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Env:
    def __init__(self, tmp_path: Path) -> None:
        self.pki = Pki(tmp_path / "pki")
        self.server = self.pki.write("collector", self.pki.collector())
        self.bob = self.pki.write("user-bob", self.pki.user("bob"))
        self.ops = self.pki.write("user-ops", self.pki.user("ops"))
        self.node_a = self.pki.write(f"node-{NODE_A}", self.pki.node(NODE_A))
        self.policy = tmp_path / "policy.yaml"
        write_atomic(self.policy, POLICY)
        self.col = CollectorProcess(tmp_path / "collector", unix=False,
                                    args=[*tls_flags(self.server), "--policy", str(self.policy)])

    def audit(self, action: str | None = None) -> list[dict[str, Any]]:
        return audit_records(self.col.db_path.with_suffix(".audit.jsonl"), action)

    def audit_lines(self) -> list[str]:
        path = self.col.db_path.with_suffix(".audit.jsonl")
        return path.read_text().splitlines() if path.exists() else []

    def stderr_from(self, offset: int) -> str:
        return self.col._stderr_path.read_bytes()[offset:].decode(errors="replace")

    def stderr_size(self) -> int:
        return self.col._stderr_path.stat().st_size

    def cli(self, who: TlsFiles, *args: str, timeout_s: float = DEADLINE_S) -> tuple[int, str]:
        out = ghostgpu_cli(*args, "--collector", self.col.address, *tls_flags(who), timeout_s=timeout_s)
        return out.returncode, out.stderr.strip()


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    e = Env(tmp_path)
    try:
        yield e
    finally:
        e.col.stop()


def _bob_is_viewer_only(env: Env) -> None:
    rc, err = env.cli(env.bob, "ps", "-o", "json")
    assert rc == 0, f"bob (viewer) cannot ps: {err}"
    rc, err = env.cli(env.bob, "audit")  # ListAudit needs admin
    assert rc == 1 and "permission denied" in err and "user:bob" in err, (rc, err)


# ---- duplicate keys -----------------------------------------------------------------------------

def test_a_duplicate_role_key_stops_the_collector_at_start(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(DUPLICATE_ROLE)
    pki = Pki(tmp_path / "pki")
    server = pki.write("collector", pki.collector())
    try:
        out = ghostgpu_cli("collector", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "c.db"),
                           *tls_flags(server), "--policy", str(policy), timeout_s=DEADLINE_S)
    except Exception as e:  # subprocess.TimeoutExpired: it started and served the file
        raise AssertionError(f"the collector started with a duplicate role key: {e}") from None
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert str(policy) in lines[0] and "line 4" in lines[0] and "duplicate key 'role'" in lines[0], lines[0]


def test_a_duplicate_role_key_at_reload_keeps_the_old_policy(env: Env) -> None:
    _bob_is_viewer_only(env)
    write_atomic(env.policy, DUPLICATE_ROLE)
    env.col.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: env.audit("policy.reload_error") or env.audit("policy.reload"), "the reload's record",
               DEADLINE_S)
    assert env.audit("policy.reload") == [], "the file with a duplicate key was taken"
    [record] = env.audit("policy.reload_error")
    assert "duplicate key 'role'" in record["detail"]["detail"] and "line 4" in record["detail"]["detail"]
    _bob_is_viewer_only(env)  # not admin: the old policy stays in force


# ---- the alias bomb -----------------------------------------------------------------------------

def test_an_alias_bomb_reloaded_keeps_the_collector_responsive_and_quiet(env: Env) -> None:
    bomb = alias_bomb()
    assert len(bomb) < 700  # a few hundred bytes
    _bob_is_viewer_only(env)
    offset = env.stderr_size()
    records_before = len(env.audit_lines())
    write_atomic(env.policy, bomb)
    env.col.proc.send_signal(signal.SIGHUP)
    started = time.monotonic()
    rc, err = env.cli(env.ops, "ps", "-o", "json", timeout_s=DEADLINE_S)  # answers while it reloads
    assert rc == 0, err
    assert time.monotonic() - started < 15.0, "ps took more than 15 s during the reload"

    def refused() -> bool:
        return bool(env.audit("policy.reload_error") or env.audit("policy.reload"))

    wait_until(refused, "the reload's audit record", DEADLINE_S)
    assert env.col.running, env.stderr_from(offset)[-2000:]
    _bob_is_viewer_only(env)  # the old policy, still in force
    [record] = env.audit("policy.reload_error")
    new_lines = env.audit_lines()[records_before:]
    assert all(len(line) <= AUDIT_DETAIL_MAX + 1024 for line in new_lines), [len(x) for x in new_lines]
    assert len(record["detail"]["detail"]) <= LOG_LINE_MAX
    assert "anchor &a refused" in record["detail"]["detail"], record["detail"]["detail"]
    said = [line for line in env.stderr_from(offset).splitlines() if "policy" in line]
    assert len(said) == 1 and len(said[0]) <= LOG_LINE_MAX, [line[:200] for line in said]
    assert all(len(line) <= LOG_LINE_MAX for line in env.stderr_from(offset).splitlines())


# ---- refused Hellos -----------------------------------------------------------------------------

class Hellos:
    """NodeStream.Connect calls on one mTLS channel, each a lone Hello; the status each ends with."""

    def __init__(self, address: str, tls: TlsFiles) -> None:
        self.channel = open_channel(address, tls, channel_options())
        self.stub = self.channel.stream_stream("/ghostgpu.v1.NodeStream/Connect", request_serializer=None,
                                               response_deserializer=stream_pb2.CollectorMessage.FromString)
        self.sent = 0

    def send(self, node: str) -> tuple[grpc.StatusCode, str]:
        hello = stream_pb2.TracerMessage(hello=stream_pb2.Hello(
            api_version=API_VERSION, node=node, boot_id="b", instance_id="i", tracer_version="attack"))
        call = self.stub(iter([hello.SerializeToString()]), timeout=DEADLINE_S,
                         metadata=[(API_VERSION_METADATA, str(API_VERSION))])
        self.sent += 1
        try:
            for _ in call:
                pass
        except grpc.RpcError as e:
            return e.code(), e.details() or ""
        return grpc.StatusCode.OK, ""

    def close(self) -> None:
        self.channel.close()


def test_a_flood_of_refused_hellos_is_one_folded_record_per_window(env: Env) -> None:
    hellos = Hellos(env.col.address, env.node_a)
    try:
        started = time.monotonic()
        for _ in range(200):
            code, details = hellos.send(NODE_B)
            assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)
        elapsed = time.monotonic() - started
        assert elapsed < 10.0, f"200 refused Hellos took {elapsed:.1f} s: more than one 10 s window"
        wait_until(lambda: env.audit("tracer.refused"), "the first tracer.refused record", DEADLINE_S)
        refused = env.audit("tracer.refused")
        assert len(refused) == 1, f"{len(refused)} tracer.refused records for 200 refused Hellos"
        assert refused[0]["subject"] == f"node:{NODE_A}" and refused[0]["detail"]["node"] == NODE_B

        # The attack goes on, slower, until the next window opens: its first refusal is recorded
        # (the file is written before the refusal is answered), counting the ones folded before it.
        deadline = time.monotonic() + DEADLINE_S
        while len(env.audit("tracer.refused")) < 2:
            assert time.monotonic() < deadline, "no second tracer.refused record after the 10 s window"
            hellos.send(NODE_B)
            time.sleep(0.2)  # the attacker's pace, not a wait for a result
        assert len(env.audit("tracer.refused")) == 2
        second = env.audit("tracer.refused")[1]
        # Every refusal is in the trail: two records, the second counting all the others.
        assert second["detail"]["repeats_folded"] == hellos.sent - 2, (second, hellos.sent)
    finally:
        hellos.close()
    assert env.col.running


def test_a_1_mib_node_name_is_refused_before_anything_keeps_it(env: Env) -> None:
    huge = "x" * (1 << 20)
    hellos = Hellos(env.col.address, env.node_a)
    try:
        answers = [hellos.send(huge) for _ in range(3)]
    finally:
        hellos.close()
    wait_until(lambda: env.audit("tracer.refused"), "the refusal's audit record", DEADLINE_S)
    assert all(len(line) <= AUDIT_DETAIL_MAX + 1024 for line in env.audit_lines()), \
        [len(line) for line in env.audit_lines()]
    assert len(env.audit("tracer.refused")) == 1  # three attempts, one record
    for code, details in answers:  # refused with a short line (an echoed name would not even fit a status)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details[:200])
        assert len(details) < 1024 and "longer than 253 characters" in details, details
    rc, err = env.cli(env.ops, "ps", "-o", "json")
    assert rc == 0, err
    env.col.stop()  # the store and its WAL, as written
    for path in env.col.workdir.iterdir():
        if path.is_file():
            assert b"x" * 4096 not in path.read_bytes(), f"{path.name} holds the 1 MiB node name"
