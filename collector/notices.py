"""What collector replicas tell each other through PostgreSQL NOTIFY: the channels and the payloads.

    payloads = encode_findings("collector-0", [(17, OPENED), (9, RESOLVED)])  # one or more JSON texts
    decode_findings(payloads[0])    # FindingsNotice("collector-0", [(17, OPENED), (9, RESOLVED)])
    encode_trace("collector-0", "t-1a2b3c4d")    # '{"v":1,"src":"collector-0","s":"t-1a2b3c4d"}'

A notification says only what changed and which replica wrote it: the finding ids and how each
changed (FindingEvent.Kind), a trace session's id. The receiver reads the rows themselves from the
store (collector/findings_remote.py, collector/trace_follow.py), which the NOTIFY's transaction had
committed before any listener heard of it. PostgreSQL 15 refuses a payload of 8000 bytes or more
("payload string too long"), and a refused NOTIFY would fail the whole write group, so the encoder
splits a long list of ids over several payloads, each within PAYLOAD_MAX_BYTES.

Pure functions, no I/O: the unit tests run them table-driven (tests/unit/test_notices.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from ghostgpu.v1 import query_pb2

FINDINGS_CHANNEL = "ghostgpu_findings"
TRACE_CHANNEL = "ghostgpu_trace"
COMMANDS_CHANNEL = "ghostgpu_commands"  # cross-replica commands (trace start/stop, CRI) use it
CHANNELS = (FINDINGS_CHANNEL, TRACE_CHANNEL, COMMANDS_CHANNEL)
PAYLOAD_MAX_BYTES = 7999  # PostgreSQL: "the payload must be shorter than 8000 bytes"
SOURCE_MAX_CHARS = 255  # a --replica-id longer than this would leave little room for ids
VERSION = 1

OPENED = query_pb2.FindingEvent.KIND_OPENED
CHANGED = query_pb2.FindingEvent.KIND_CHANGED
RESOLVED = query_pb2.FindingEvent.KIND_RESOLVED
# A finding's kinds within one payload go in its life's order: opened, changed, resolved.
_KEYS = ((OPENED, "o"), (CHANGED, "c"), (RESOLVED, "r"))
Change = tuple[int, int]  # (finding id, FindingEvent.Kind)


class NoticeError(ValueError):
    """A payload this collector cannot read (another version's, or not a ghostgpu one)."""


@dataclass(frozen=True)
class FindingsNotice:
    source: str  # the replica that wrote the rows (its --replica-id)
    changes: list[Change]  # the opened ones, then the changed, then the resolved


@dataclass(frozen=True)
class TraceNotice:
    source: str
    session: str


def check_source(source: str) -> None:
    """ValueError naming --replica-id when it cannot go into a payload with room for ids."""
    if not source or len(source) > SOURCE_MAX_CHARS:
        raise ValueError(f"--replica-id {source[:40]!r}: {len(source)} characters; give 1 to "
                         f"{SOURCE_MAX_CHARS} (the replicas' notifications carry it)")


def _dump(obj: object) -> str:
    # ensure_ascii: a payload's length in characters is its length in bytes, whatever the ids' source
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True)


def encode_findings(source: str, changes: Iterable[Change]) -> list[str]:
    """The payloads announcing `changes` (in order; a repeated (id, kind) once), each within
    PAYLOAD_MAX_BYTES; [] for no change."""
    check_source(source)
    by_kind: dict[int, dict[int, None]] = {kind: {} for kind, _ in _KEYS}
    for fid, kind in changes:
        if kind not in by_kind:
            raise ValueError(f"finding {fid}: kind {kind} is not opened, changed or resolved")
        by_kind[kind][fid] = None
    out: list[str] = []
    empty = {"v": VERSION, "src": source, **{key: [] for _, key in _KEYS}}
    base = len(_dump(empty))
    current: dict[str, list[int]] = {key: [] for _, key in _KEYS}
    size = base
    for kind, key in _KEYS:
        for fid in by_kind[kind]:
            grow = len(str(fid)) + 1  # the id and its comma
            if size + grow > PAYLOAD_MAX_BYTES and any(current.values()):
                out.append(_dump({"v": VERSION, "src": source, **current}))
                current, size = {k: [] for _, k in _KEYS}, base
            current[key].append(fid)
            size += grow
    if any(current.values()):
        out.append(_dump({"v": VERSION, "src": source, **current}))
    return out


def _object(payload: str) -> dict[str, object]:
    try:
        obj = json.loads(payload)
    except ValueError:
        raise NoticeError(f"not JSON: {payload[:60]!r}") from None
    if not isinstance(obj, dict) or obj.get("v") != VERSION or not isinstance(obj.get("src"), str):
        raise NoticeError(f"not a version {VERSION} ghostgpu notice: {payload[:60]!r}")
    return obj


def decode_findings(payload: str) -> FindingsNotice:
    """The notice in a ghostgpu_findings payload; NoticeError when it is not one."""
    obj = _object(payload)
    changes: list[Change] = []
    for kind, key in _KEYS:
        ids = obj.get(key, [])
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise NoticeError(f"findings notice: {key!r} is not a list of ids: {payload[:60]!r}")
        changes.extend((i, kind) for i in ids)
    return FindingsNotice(str(obj["src"]), changes)


def encode_trace(source: str, session: str) -> str:
    """The payload saying that a session's row or records changed. Identical payloads of one
    transaction reach the listeners once (PostgreSQL folds them), so a group of batches of one
    session costs one notification."""
    check_source(source)
    payload = _dump({"v": VERSION, "src": source, "s": session})
    if len(payload) > PAYLOAD_MAX_BYTES:
        raise ValueError(f"trace session id of {len(session)} characters: too long for a notification")
    return payload


def decode_trace(payload: str) -> TraceNotice:
    obj = _object(payload)
    session = obj.get("s")
    if not isinstance(session, str) or not session:
        raise NoticeError(f"trace notice without a session: {payload[:60]!r}")
    return TraceNotice(str(obj["src"]), session)
