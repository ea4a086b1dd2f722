"""Reading a collector's audit log (JSON lines, docs/SECURITY.md) in tests, and the security options of
an in-process collector with the test PKI, a policy and an audit log."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ghostgpu.collector.config import CollectorConfig
from ghostgpu.collector.security import SecurityOptions

from tests.helpers.certs import Pki


def audit_records(path: Path, action: str | None = None) -> list[dict[str, Any]]:
    """The log's records (none while the file does not exist yet); only those of `action` when given."""
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, filter(str.strip, lines)) if action is None or r["action"] == action]


def secure_options(tmp_path: Path, policy: str) -> tuple[Pki, SecurityOptions, Path]:
    """A test CA under tmp_path/pki, the collector's certificate, `policy` (YAML text) and an audit log:
    the PKI, the collector's SecurityOptions and the audit log's path."""
    pki = Pki(tmp_path / "pki")
    policy_path = tmp_path / "policy.yaml"
    policy_path.write_text(policy)
    audit = tmp_path / "audit.jsonl"
    tls = pki.write("collector", pki.collector())
    opts = CollectorConfig(tls_cert=tls.cert, tls_key=tls.key, tls_ca=tls.ca, policy_path=str(policy_path),
                           audit_log=str(audit)).security_options()
    return pki, opts, audit
