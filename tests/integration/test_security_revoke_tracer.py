"""Revocation with the real processes (docs/SECURITY.md, "Revocation"): the real
`ghostgpu collector` serving mTLS, the real `ghostgpu tracer` streaming with its node certificate, and
a real SIGHUP after the policy file lost the tracer's rule. The open stream ends within 1 s of the
reload (both times read from the collector's audit trail), and the tracer, refused when it comes
back, says so once and keeps running. tests/unit/test_security_revoke.py covers the query streams,
certificate expiry and the tracer's backoff in one process."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.audit_log import audit_records
from tests.helpers.certs import Pki
from tests.helpers.collector_proc import CollectorProcess, tls_flags
from tests.helpers.polling import wait_until
from tests.helpers.tracer_proc import TracerProcess

NODE = "node-rev"
DEADLINE_S = 30.0  # Python start-up of two programs on a 2-core VM shared with other tests
POLICY = """
rules:
  - role: tracer
    subjects: ["node:*"]
"""
REVOKED = """
rules:
  - role: tracer
    subjects: ["node:some-other-node"]
"""


def audit_file(col: CollectorProcess, action: str) -> list[dict[str, Any]]:
    return audit_records(col.db_path.with_suffix(".audit.jsonl"), action)


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    return path


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "pki")


@pytest.fixture
def tls_collector(tmp_path: Path, pki: Pki, policy: Path) -> Iterator[CollectorProcess]:
    server = pki.write("collector", pki.collector())
    with CollectorProcess(tmp_path / "collector", unix=False,
                          args=[*tls_flags(server), "--policy", str(policy)]) as col:
        yield col


def test_sighup_revokes_a_real_tracers_stream_and_the_tracer_backs_off(
        tmp_path: Path, pki: Pki, policy: Path, tls_collector: CollectorProcess) -> None:
    node = tls_flags(pki.write(f"node-{NODE}", pki.node(NODE)))
    (tmp_path / "tracer").mkdir()
    args = ["--bpf", "off", *node]  # no BPF needed: the stream is what is revoked
    with TracerProcess(tmp_path / "tracer", args, {}, NODE, tls_collector.address) as tracer:
        wait_until(lambda: audit_file(tls_collector, "tracer.connect"), "the tracer's stream", DEADLINE_S)
        tmp = policy.with_name("policy.new")
        tmp.write_text(REVOKED)
        tmp.replace(policy)
        assert tls_collector.proc is not None
        os.kill(tls_collector.proc.pid, signal.SIGHUP)
        wait_until(lambda: audit_file(tls_collector, "stream.revoked"), "the stream revoked", DEADLINE_S)
        wait_until(lambda: "refused this tracer" in tracer.stderr(), "the tracer told it is refused",
                   DEADLINE_S)
        assert tracer.proc.poll() is None, f"the refused tracer exited: {tracer.stderr()}"
    reload = audit_file(tls_collector, "policy.reload")[0]
    revoked = audit_file(tls_collector, "stream.revoked")
    assert [(r["subject"], r["result"], r["detail"]["method"], r["detail"]["status"]) for r in revoked] == [
        (f"node:{NODE}", "denied", "/ghostgpu.v1.NodeStream/Connect", "PERMISSION_DENIED")]
    after_s = (revoked[0]["ts_unix_ns"] - reload["ts_unix_ns"]) / 1e9
    assert 0 <= after_s <= 1.0, f"the stream ended {after_s:.3f} s after the reload"
    disconnect = audit_file(tls_collector, "tracer.disconnect")
    assert disconnect and disconnect[0]["subject"] == f"node:{NODE}"
    lines = tracer.stderr().splitlines()
    refusals = [line for line in lines if "refused this tracer" in line]
    assert len(refusals) == 1, lines  # said once; the sender backs off (backoff_max_s) and retries quietly
    assert "permission denied" in refusals[0] and f"node:{NODE}" in refusals[0], refusals[0]
