"""`ghostgpu audit`: read the collector's security audit trail, and check its hash chain.

    ghostgpu audit [--collector ADDR | --db PATH | --store URL | --file PATH] [--since 1h] [-o table|json]
                   [--verify]

Four sources: the collector's ListAudit (admin only), its store file read-only (`--db`, no
collector needed: the table the collector writes), the database collector replicas share, read-only
(`--store postgresql://...`: their one chain), or its JSON lines file (`--file`, the collector's
audit file: what a byte-level edit shows in). `--verify` checks the chain
(ghostgpu.common.audit.chain) and prints "audit chain intact: N records", or the first broken
record's seq and why, with exit status 1. With `--db`, `--verify` checks the store's chain and the
audit file beside it (or `--file`) each on its own and against each other, naming the first record
one has and the other lacks: a tail cut from one of them shows. With `--store`, `--verify --file
FILE` holds a replica's audit file (its own records only) against the shared chain. An unreachable
collector or unreadable file is one line and exit status 1; a bad flag 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ghostgpu.cli.tls_flags import add_collector_uid_flag, add_tls_flags, add_tls_server_name_flag

from ghostgpu.common.audit.chain import (
    AuditRecord,
    BadLine,
    Verdict,
    check,
    compare,
    compare_witness,
    parse_lines,
    verify,
)
from ghostgpu.common.transport.addresses import DEFAULT_COLLECTOR
from ghostgpu.common.transport.collector_target import FORMS as COLLECTOR_FORMS

if TYPE_CHECKING:
    from ghostgpu.cli.client import Query  # imports grpc: only when a collector is asked

PAGE_RECORDS = 5000  # per ListAudit call; the collector caps a page at 100,000
DEFAULT_SINCE = "1h"
Item = AuditRecord | BadLine


def add_parser(sub: Any) -> None:
    p = sub.add_parser("audit", help="the security audit trail: trace sessions, denied calls, reloads, "
                       "tracer connects; --verify checks its hash chain",
                       description="Read the collector's audit trail through the collector, its store "
                       "file or its JSON lines file; --verify checks that no record was edited or removed.")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--collector", help=f"collector address: {COLLECTOR_FORMS} "
                        f"(default $GHOSTGPU_COLLECTOR or {DEFAULT_COLLECTOR}); needs role admin")
    source.add_argument("--db", metavar="PATH", help="read a collector's store file directly, read-only "
                        "(its --db); no collector needed. With --verify the audit file beside it (or "
                        "--file) is checked against it")
    source.add_argument("--store", metavar="URL", help="read the database collector replicas share, "
                        "read-only (their --store postgresql://USER@HOST/DB); with --verify and --file, a "
                        "replica's audit file is checked against it")
    p.add_argument("--store-password-file", metavar="PATH", help="the --store database's password, on "
                   "the file's first line")
    p.add_argument("--file", metavar="PATH", help="read the collector's audit JSON lines file "
                   "(its --audit-log)")
    p.add_argument("--since", help=f"how far back: 30s, 15m, 1h, 7d (default {DEFAULT_SINCE}; with "
                   "--verify the whole trail)")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    p.add_argument("--verify", action="store_true", help="check the hash chain: print the first broken "
                   "record's seq and why, and exit 1")
    add_tls_flags(p)
    add_collector_uid_flag(p)
    add_tls_server_name_flag(p)


def _since_ns(args: argparse.Namespace) -> int:
    from ghostgpu.common.model.durations import LOOK_BACK, parse_duration_s

    text = args.since if args.since is not None else (None if args.verify else DEFAULT_SINCE)
    return 0 if text is None else int((time.time() - parse_duration_s(text, "--since", LOOK_BACK)) * 1e9)


def read_file(path: str, since_unix_ns: int = 0) -> list[Item]:
    """The records (and bad lines) of an audit JSON lines file, from the first record at or after
    `since` on; OSError for a file that cannot be read."""
    with open(path, encoding="utf-8", errors="replace") as f:
        items = parse_lines(f)
    first = next((i for i, r in enumerate(items)
                  if isinstance(r, AuditRecord) and r.ts_unix_ns >= since_unix_ns), len(items))
    if since_unix_ns == 0 or first == 0:
        return items
    return items[first:]


def read_db(path: str, since_unix_ns: int = 0) -> list[Item]:
    from ghostgpu.collector.audit import read_audit_file, record_from_row

    return [record_from_row(row) for row in read_audit_file(path, since_unix_ns)]


def read_store(url: str, password_file: str | None, since_unix_ns: int = 0) -> list[Item]:
    from ghostgpu.collector.audit import read_audit_store, record_from_row

    return [record_from_row(row) for row in read_audit_store(url, password_file, since_unix_ns)]


def read_collector(query: Query, since_unix_ns: int = 0) -> list[Item]:
    """Every record at or after `since`, page by page, through a ghostgpu.cli.client.Query (whose
    _call phrases a failure, TLS ones included, as a ClientError line)."""
    from ghostgpu.common.wire.convert_audit import audit_record_from_proto
    from ghostgpu.v1 import query_pb2

    out: list[Item] = []
    after_seq = 0
    while True:
        req = query_pb2.ListAuditRequest(since_unix_ns=since_unix_ns, after_seq=after_seq, limit=PAGE_RECORDS)
        resp = query._call(query.stub.ListAudit, req)
        for m in resp.records:
            try:
                out.append(audit_record_from_proto(m))
            except ValueError as e:
                out.append(BadLine(m.seq, str(e)))
        if len(resp.records) < PAGE_RECORDS or resp.records[-1].seq <= after_seq:
            return out
        after_seq = resp.records[-1].seq


def _detail_text(detail: dict[str, Any]) -> str:
    return " ".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in sorted(detail.items()))


def render_table(records: list[AuditRecord]) -> str:
    from ghostgpu.cli.view import table

    def stamp(r: AuditRecord) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.ts_unix_ns / 1e9))

    columns: list[tuple[str, Callable[[AuditRecord], str]]] = [
        ("SEQ", lambda r: str(r.seq)), ("TIME", stamp), ("ACTION", lambda r: r.action),
        ("SUBJECT", lambda r: r.subject or "-"), ("RESULT", lambda r: r.result or "-"),
        ("DETAIL", lambda r: _detail_text(r.detail)),
    ]
    return table(columns, records, "(no audit records in this window)")


def render_verdict(verdict: Verdict, items: list[Item], output: str,
                   warnings: list[str] | None = None) -> str:
    """The verdict's line, then one `warning: ` line per warning (an unclean stop: check())."""
    records = [r for r in items if isinstance(r, AuditRecord)]
    if output == "json":
        return json.dumps({"ok": verdict.ok, "first_bad_seq": verdict.first_bad_seq, "why": verdict.why,
                           "warnings": warnings or [], "records": len(items),
                           "first_seq": records[0].seq if records else None,
                           "last_seq": records[-1].seq if records else None}, indent=2)
    return "\n".join([_verdict_line(verdict, records), *(f"warning: {w}" for w in warnings or ())])


def _verdict_line(verdict: Verdict, records: list[AuditRecord]) -> str:
    if not verdict.ok and verdict.first_bad_seq is None:
        return f"audit chain not verified: {verdict.why}"
    if not verdict.ok:
        return f"audit chain broken at record {verdict.first_bad_seq}: {verdict.why}"
    if records and records[0].seq > 1:  # a --since window, or a store that starts mid-chain
        return f"{verdict.why} (seq {records[0].seq}..{records[-1].seq}; earlier records not read)"
    return verdict.why


def run(args: argparse.Namespace, query_factory: Callable[[argparse.Namespace], Query] | None = None) -> int:
    """`query_factory(args)` builds the client (ghostgpu.cli.client.Query.from_args by default: --collector
    and the TLS flags)."""
    since_ns = _since_ns(args)  # a bad --since fails before any connection (ValueError: exit 2)
    store = getattr(args, "store", None)
    if args.file and (args.collector or ((args.db or store) and not args.verify)):
        raise ValueError("--file: give it alone, or with --db or --store and --verify (the file checked "
                         "against the store)")
    if getattr(args, "store_password_file", None) and not store:
        raise ValueError("--store-password-file: give it with --store")
    if store:
        from ghostgpu.collector.db import parse_store_url

        parse_store_url(store)  # StoreUrlError (a ValueError, exit 2) for a URL that names no store
    if args.db and args.verify:
        return verify_db(args.db, args.file, since_ns, args.output)
    if store and args.verify:
        return verify_store(store, args.store_password_file, args.file, since_ns, args.output)
    try:
        if args.file:
            items = read_file(args.file, since_ns)
        elif args.db:
            items = read_db(args.db, since_ns)
        elif store:
            items = read_store(store, args.store_password_file, since_ns)
        else:
            from ghostgpu.cli.client import Query

            query = (query_factory or Query.from_args)(args)
            try:
                items = read_collector(query, since_ns)
            finally:
                query.close()
    except OSError as exc:
        print(f"ghostgpu: --file {args.file}: cannot read it ({exc.strerror})", file=sys.stderr)
        return 1
    except Exception as exc:  # ClientError and StoreError: already one line
        if type(exc).__name__ not in ("ClientError", "StoreError"):
            raise
        print(f"ghostgpu: {exc}", file=sys.stderr)
        return 1
    if args.verify:
        # The whole trail (no --since) must begin at record 1; a file moved away while the collector
        # was stopped may begin at a collector.start instead.
        verdict, warnings = check(items, from_start=since_ns == 0, rotated_ok=bool(args.file))
        print(render_verdict(verdict, items, args.output, warnings))
        return 0 if verdict.ok else 1
    for bad in (i for i in items if isinstance(i, BadLine)):
        print(f"ghostgpu: audit: {bad.why}; `ghostgpu audit --verify` checks the chain", file=sys.stderr)
    records = [r for r in items if isinstance(r, AuditRecord)]
    if args.output == "json":
        print(json.dumps([r.to_json() for r in records], indent=2))
    else:
        print(render_table(records))
    return 0


def default_file_of(db: str) -> str:
    """The audit file a collector writes beside its --db when not given --audit-log."""
    from ghostgpu.collector.security import default_audit_path

    return default_audit_path(db) or ""


def verify_db(db: str, file: str | None, since_ns: int, output: str) -> int:
    """`--db PATH --verify`: the store's chain, the audit file's chain, and the two against each other
    (docs/SECURITY.md, "Audit"). Exit status 1 at the first problem, naming it."""
    from ghostgpu.collector.store import StoreError

    path = file or default_file_of(db)
    try:
        stored = read_db(db, since_ns)
    except StoreError as exc:
        print(f"ghostgpu: {exc}", file=sys.stderr)
        return 1
    whole = since_ns == 0
    verdict, warnings = check(stored, from_start=whole)  # the file's are the same records (compare)
    if not verdict.ok:
        print(render_verdict(Verdict(False, verdict.first_bad_seq, f"in the store: {verdict.why}"), stored,
                             output))
        return 1
    try:
        filed = read_file(path)
    except FileNotFoundError:
        if not stored:  # an empty trail: nothing was ever written to either
            print(render_verdict(verdict, stored, output))
            return 0
        filed = None
    except OSError:
        filed = None
    if filed is None:
        why = (f"audit file {path}: cannot read it: the store cannot be checked against it (deleted?); "
               "pass the collector's --audit-log as --file")
        print(render_verdict(Verdict(False, None, why), stored, output))
        return 1
    if not whole:  # the store's window: the file's records from the window's first seq on
        first = next((r.seq for r in stored if isinstance(r, AuditRecord)), None)
        filed = [r for r in filed if not isinstance(r, AuditRecord) or first is None or r.seq >= first]
        if first is None:
            filed = [r for r in filed if isinstance(r, AuditRecord) and r.ts_unix_ns >= since_ns]
    file_verdict = verify(filed, from_start=whole, rotated_ok=True)
    if not file_verdict.ok:
        print(render_verdict(Verdict(False, file_verdict.first_bad_seq, f"in {path}: {file_verdict.why}"),
                             filed, output))
        return 1
    both = compare(stored, filed, path)
    if not both.ok:
        print(render_verdict(both, stored, output))
        return 1
    print(render_verdict(Verdict(True, None, f"{verdict.why}; audit file {path} agrees"), stored, output,
                         warnings))
    return 0


def verify_store(url: str, password_file: str | None, file: str | None, since_ns: int, output: str) -> int:
    """`--store URL --verify`: the chain the replicas share, and with `--file` a replica's audit file
    (its own records, as committed) against it. Exit status 1 at the first problem, naming it."""
    from ghostgpu.collector.store import StoreError

    try:
        stored = read_store(url, password_file, since_ns)
    except StoreError as exc:
        print(f"ghostgpu: {exc}", file=sys.stderr)
        return 1
    verdict, warnings = check(stored, from_start=since_ns == 0)
    if not verdict.ok or file is None:
        print(render_verdict(verdict, stored, output, warnings))
        return 0 if verdict.ok else 1
    try:
        filed = read_file(file)
    except OSError as exc:
        print(f"ghostgpu: --file {file}: cannot read it ({exc.strerror})", file=sys.stderr)
        return 1
    witness = compare_witness(stored, filed, file)
    if not witness.ok:
        print(render_verdict(witness, stored, output))
        return 1
    print(render_verdict(Verdict(True, None, f"{verdict.why}; {witness.why}"), stored, output, warnings))
    return 0
