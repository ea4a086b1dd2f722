"""The one mapping between audit records (ghostgpu.common.audit.chain) and the API (query.proto's
AuditRecord), both ways. `detail` travels as its canonical JSON text, so the client hashes exactly
what the collector hashed."""

from __future__ import annotations

import json

from ghostgpu.common.audit.chain import AuditRecord, canonical_json
from ghostgpu.v1 import query_pb2


def audit_record_to_proto(r: AuditRecord) -> query_pb2.AuditRecord:
    return query_pb2.AuditRecord(seq=r.seq, ts_unix_ns=r.ts_unix_ns, action=r.action, subject=r.subject,
                                 result=r.result, detail_json=canonical_json(r.detail),
                                 prev_sha256=r.prev_sha256, sha256=r.sha256)


def audit_record_from_proto(m: query_pb2.AuditRecord) -> AuditRecord:
    """ValueError if detail_json is no JSON object (the record then fails verification anyway)."""
    detail = json.loads(m.detail_json) if m.detail_json else {}
    if not isinstance(detail, dict):
        raise ValueError(f"audit record {m.seq}: detail_json is not a JSON object")
    return AuditRecord(seq=m.seq, ts_unix_ns=m.ts_unix_ns, action=m.action, subject=m.subject,
                       result=m.result, detail=detail, prev_sha256=m.prev_sha256, sha256=m.sha256)
