"""The audit trail's records and their hash chain: pure functions, no I/O, shared by the collector
(which writes them, collector/audit.py) and `ghostgpu audit --verify` (which checks them).

A record is a JSON object

    {"seq", "ts_unix_ns", "action", "subject", "result", "detail": {...}, "prev_sha256", "sha256"}

where `sha256` is the SHA-256 (hex) of the record's canonical JSON without "sha256" (keys sorted,
separators "," and ":", ASCII escapes). It covers `prev_sha256`, the previous record's sha256 (64
zeros before record 1), so editing, removing or reordering any record breaks the chain at that
record or the next, and a reader can say which. The chain is tamper-evident, not tamper-proof: whoever
can rewrite the whole file from the edited record on can forge it; ship the file off the node (or
keep the last sha256 elsewhere) to close that.

Each run of the collector opens with `collector.start` (detail: `resumed_seq`, `resumed_sha256`, the
head it took the chain up from) and, stopped cleanly, ends with `collector.stop` (`started_seq`,
`resumed_seq`). A start whose previous record is no stop, but whose resumed head is that record, is
an unclean stop: the collector crashed, was killed or ran out of memory, or the tail was cut while it
was stopped (the next start takes up whatever head it finds). `check` reports it as a warning, not a
break: a crash must not make the trail unverifiable forever, and the chain itself cannot tell the two
apart. A start whose resumed head is not the record before it is a break (records removed and the
chain forged). A cut after which the collector never starts again, or one that ends exactly at a stop
record, leaves nothing in the chain to see either: only a witness outside the node can tell (the
metric ghostgpu_audit_head_seq in Prometheus, the file shipped away). `compare` checks the store's
copy and the file's against each other.

Collector replicas sharing a PostgreSQL store write one chain between them (collector/audit.py builds
each record on the head it reads in the write transaction). Their collector.start and collector.stop
records name the `replica`; a start naming one is checked against that replica's runs only (an
unclean stop: its previous start has no stop), as the other replicas' records come in between. A
replica's own audit file is then a witness, not a chain: `compare_witness` holds it against the store.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

GENESIS_SHA256 = "0" * 64
FIELDS = ("seq", "ts_unix_ns", "action", "subject", "result", "detail", "prev_sha256", "sha256")
# Every action the collector audits (docs/SECURITY.md, "Audit"). An unknown one still verifies: a
# newer collector may add actions, and the chain does not depend on their names.
ACTIONS = ("trace.start", "trace.stop", "trace.expire", "denied", "policy.reload", "policy.reload_error",
           "tls.reload", "tls.reload_error", "tracer.connect", "tracer.disconnect", "tracer.refused",
           "collector.start", "collector.stop")
START, STOP = "collector.start", "collector.stop"


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def normalize_detail(detail: Mapping[str, Any]) -> dict[str, Any]:
    """The detail as it reads back from JSON (tuples become lists, other objects their str()), so a
    record hashes the same in memory, in the file and in the store."""
    normal: dict[str, Any] = json.loads(json.dumps(dict(detail), default=str, allow_nan=False))
    return normal


def record_sha256(body: Mapping[str, Any]) -> str:
    """The sha256 of a record's fields other than "sha256"."""
    payload = {k: body[k] for k in FIELDS if k != "sha256"}
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()


@dataclass(frozen=True)
class AuditRecord:
    seq: int
    ts_unix_ns: int
    action: str
    subject: str
    result: str
    detail: dict[str, Any] = field(default_factory=dict)
    prev_sha256: str = GENESIS_SHA256
    sha256: str = ""

    @classmethod
    def make(cls, seq: int, ts_unix_ns: int, action: str, subject: str, result: str,
             detail: Mapping[str, Any], prev_sha256: str) -> AuditRecord:
        """A new record, its sha256 computed."""
        normal = normalize_detail(detail)
        body = {"seq": seq, "ts_unix_ns": ts_unix_ns, "action": action, "subject": subject,
                "result": result, "detail": normal, "prev_sha256": prev_sha256}
        return cls(seq=seq, ts_unix_ns=ts_unix_ns, action=action, subject=subject, result=result,
                   detail=normal, prev_sha256=prev_sha256, sha256=record_sha256(body))

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "ts_unix_ns": self.ts_unix_ns, "action": self.action,
                "subject": self.subject, "result": self.result, "detail": self.detail,
                "prev_sha256": self.prev_sha256, "sha256": self.sha256}

    def line(self) -> str:
        """The record as one line of the JSON lines file (canonical, without the newline)."""
        return canonical_json(self.to_json())

    @property
    def intact(self) -> bool:
        """Its sha256 matches its content."""
        return self.sha256 == record_sha256(self.to_json())

    @classmethod
    def from_json(cls, obj: object) -> AuditRecord:
        """A record from a parsed JSON object; ValueError naming the field that is missing or wrong."""
        if not isinstance(obj, dict):
            raise ValueError("not a JSON object")
        missing = [k for k in FIELDS if k not in obj]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        extra = sorted(set(obj) - set(FIELDS))
        if extra:
            raise ValueError(f"unknown field {', '.join(extra)}")
        for name, kind in (("seq", int), ("ts_unix_ns", int), ("action", str), ("subject", str),
                           ("result", str), ("detail", dict), ("prev_sha256", str), ("sha256", str)):
            value = obj[name]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"{name} is not a{'n' if kind is int else ''} {kind.__name__}")
        return cls(**obj)


@dataclass(frozen=True)
class BadLine:
    """A line of the JSON lines file that is no audit record (cut short, edited into bad JSON)."""

    line_no: int
    why: str


def parse_line(text: str, line_no: int) -> AuditRecord | BadLine:
    try:
        return AuditRecord.from_json(json.loads(text))
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        return BadLine(line_no, f"line {line_no} is not an audit record ({str(e).splitlines()[0]})")


def parse_lines(lines: Iterable[str]) -> list[AuditRecord | BadLine]:
    """Every non-empty line of a JSON lines file, in order."""
    return [parse_line(text, n) for n, text in enumerate(lines, 1) if text.strip()]


class Verdict(NamedTuple):
    ok: bool
    first_bad_seq: int | None  # the first record whose chain breaks (by position when its own seq lies)
    why: str


def verify(records: Iterable[AuditRecord | BadLine], from_start: bool = False,
           rotated_ok: bool = False) -> Verdict:
    """check()'s verdict, without its warnings."""
    return check(records, from_start, rotated_ok)[0]


def check(records: Iterable[AuditRecord | BadLine], from_start: bool = False,
          rotated_ok: bool = False) -> tuple[Verdict, list[str]]:
    """Check the chain: its verdict, and one warning line per unclean stop before any break. The
    first record may start mid-chain (a --since window): its own prev_sha256 cannot be checked then,
    unless it is record 1. `from_start`: the whole trail, so it must begin at record 1 (a store is
    never pruned: a later first record means its head records were deleted); `rotated_ok` lets it
    begin at a collector.start instead (an audit file moved away while the collector was stopped,
    docs/SECURITY.md). A broken record is named by the seq its place in the chain gives it (the
    previous record's seq + 1), so an edit of the seq itself still names the right record. A
    collector.start after a run that had one takes the chain up from the record before it; without a
    collector.stop between them, that is an unclean stop (see the module doc)."""
    prev: AuditRecord | None = None
    count = 0
    seen_start = False
    open_runs: dict[str, int] = {}  # replica -> the seq of its collector.start while no stop followed
    warnings: list[str] = []
    for item in records:
        expected = prev.seq + 1 if prev is not None else None
        if isinstance(item, BadLine):
            # A bad first line: a file the collector wrote holds record N on line N.
            seq = expected if expected is not None else item.line_no
            return Verdict(False, seq, f"record {seq}: {item.why}"), warnings
        seq = expected if expected is not None else item.seq
        if not item.intact:
            why = f"record {seq}: its content does not match its sha256 (edited)"
            return Verdict(False, seq, why), warnings
        if prev is None:
            if item.seq == 1 and item.prev_sha256 != GENESIS_SHA256:
                why = "record 1: prev_sha256 is not the chain's start (64 zeros)"
                return Verdict(False, 1, why), warnings
            if from_start and item.seq != 1 and not (rotated_ok and item.action == START):
                return Verdict(False, 1, f"records 1..{item.seq - 1} are missing: the trail begins at record "
                               f"{item.seq} (its first records were deleted)"), warnings
        elif expected is not None and item.seq != expected:  # always set here: prev is
            why = (f"records {expected}..{item.seq - 1} are missing" if item.seq > expected
                   else f"seq {item.seq} comes again or out of order")
            return Verdict(False, expected, f"record {expected}: {why} (after record {prev.seq})"), warnings
        elif item.prev_sha256 != prev.sha256:
            return Verdict(False, seq, f"record {seq}: prev_sha256 is not record {prev.seq}'s sha256 "
                           "(a record was edited, removed or put in its place)"), warnings
        replica = item.detail.get("replica")
        if item.action == START:
            if isinstance(replica, str):
                why, unclean = _replica_start_problem(item, prev, replica, open_runs.get(replica))
                open_runs[replica] = seq
            else:
                why, unclean = _start_problem(item, prev, seen_start)
            if why:
                return Verdict(False, seq, f"record {seq}: {why}"), warnings
            if unclean:
                warnings.append(f"record {seq}: {unclean}")
            seen_start = True
        elif item.action == STOP and isinstance(replica, str):
            open_runs.pop(replica, None)
        prev, count = item, count + 1
    return Verdict(True, None, f"audit chain intact: {count} records"), warnings


def _start_problem(start: AuditRecord, prev: AuditRecord | None, seen_start: bool) -> tuple[str, str]:
    """Why a collector.start record does not fit where it is, and why it warns ("" for neither)."""
    if prev is None:
        return "", ""
    resumed = start.detail.get("resumed_seq")
    if resumed is not None and (resumed != prev.seq or start.detail.get("resumed_sha256") != prev.sha256):
        return (f"the collector says it took the chain up after record {resumed}, but record {prev.seq} "
                "comes before it (records were removed and the chain forged)"), ""
    if not seen_start or prev.action == STOP:
        return "", ""
    if resumed is None:  # no head to say the chain was taken up where the last run left it
        return (f"the collector started again after record {prev.seq}, which is no collector.stop, and "
                "does not say which head it took the chain up from"), ""
    return "", (f"unclean stop: the collector started again after record {prev.seq}, which is no "
                "collector.stop: it crashed, was killed or ran out of memory, or the records after "
                f"{prev.seq} were cut while it was stopped; compare the head Prometheus saw last "
                "(ghostgpu_audit_head_seq) before trusting the trail")


def _replica_start_problem(start: AuditRecord, prev: AuditRecord | None, replica: str,
                           open_since: int | None) -> tuple[str, str]:
    """_start_problem for a chain several collector replicas share (a collector.start naming its
    `replica`): the other replicas' records come between a replica's runs, so an unclean stop is a
    start of a replica whose previous run (`open_since`: its start's seq) has no collector.stop."""
    resumed = start.detail.get("resumed_seq")
    if prev is not None and (resumed != prev.seq or start.detail.get("resumed_sha256") != prev.sha256):
        return (f"replica {replica} says it took the chain up after record {resumed}, but record "
                f"{prev.seq} comes before it (records were removed and the chain forged)"), ""
    if open_since is None:
        return "", ""
    return "", (f"unclean stop: replica {replica} started again, and its run from record {open_since} "
                "has no collector.stop: it crashed, was killed or ran out of memory; compare the head "
                "Prometheus saw last (ghostgpu_audit_head_seq) before trusting the trail")


def compare(store: list[AuditRecord | BadLine], file: list[AuditRecord | BadLine],
            file_name: str = "the audit file") -> Verdict:
    """The store's copy of the chain against the file's (both already verified on their own): the
    first record one has and the other lacks, or that differs. The file may lack the store's first
    records when it begins at a collector.start (it was moved away while the collector was
    stopped); past its first record it must hold every record the store holds, and the store every
    record it holds."""
    in_store = {r.seq: r for r in store if isinstance(r, AuditRecord)}
    in_file = {r.seq: r for r in file if isinstance(r, AuditRecord)}
    file_first = min(in_file, default=None)
    rotated = file_first is not None and in_file[file_first].action == START
    for seq in sorted(in_store.keys() | in_file.keys()):
        s, f = in_store.get(seq), in_file.get(seq)
        if s is not None and f is None:
            if rotated and file_first is not None and seq < file_first:
                continue
            return Verdict(False, seq, f"record {seq} ({s.action}) is in the store but not in {file_name} "
                           "(cut from the file, or the file is another collector's)")
        if f is not None and s is None:
            return Verdict(False, seq, f"record {seq} ({f.action}) is in {file_name} but not in the store "
                           "(cut from the store, or lost by a crash before the store committed it)")
        if s is not None and f is not None and s.sha256 != f.sha256:
            return Verdict(False, seq, f"record {seq} differs between the store and {file_name}")
    return Verdict(True, None, f"{len(in_store)} records in the store, {len(in_file)} in {file_name}, "
                   "each in both")


def compare_witness(store: list[AuditRecord | BadLine], file: list[AuditRecord | BadLine],
                    file_name: str = "the audit file") -> Verdict:
    """A replica's audit file against the chain the replicas share (the store's, already verified):
    the file holds only that replica's records, as they were committed, so it is no chain by itself;
    each of its records must be intact, come after the one before it, and be in the store as it is in
    the file. The store's records after the file's last one are not held against it (another replica's,
    or this one's after a file was moved away)."""
    in_store = {r.seq: r for r in store if isinstance(r, AuditRecord)}
    first_stored = min(in_store, default=None)
    last = 0
    for item in file:
        if isinstance(item, BadLine):
            return Verdict(False, None, f"{file_name}: {item.why}")
        if not item.intact:
            return Verdict(False, item.seq, f"record {item.seq} in {file_name}: its content does not match "
                           "its sha256 (edited)")
        if item.seq <= last:
            return Verdict(False, item.seq, f"record {item.seq} in {file_name} comes after record {last}: "
                           "again or out of order")
        last = item.seq
        if first_stored is not None and item.seq < first_stored:
            continue  # before a --since window
        s = in_store.get(item.seq)
        if s is None:
            return Verdict(False, item.seq, f"record {item.seq} ({item.action}) is in {file_name} but not in "
                           "the store (cut from the store)")
        if s.sha256 != item.sha256:
            return Verdict(False, item.seq, f"record {item.seq} differs between the store and {file_name} "
                           "(the store's was rewritten)")
    held = sum(1 for r in file if isinstance(r, AuditRecord))
    return Verdict(True, None, f"the {held} records of {file_name} are in the store as written")
