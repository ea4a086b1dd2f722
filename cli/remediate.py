"""`ghostgpu remediate`: remediation by hand, and its cluster-wide switch (docs/REMEDIATION.md).

    ghostgpu remediate --finding ID [--dry-run]     # kill one orphaned holder, through the same re-checks
    ghostgpu remediate pause|resume [--reason TEXT]  # every act a dry run, cluster-wide, until resumed
    ghostgpu remediate mode off|dry-run|on|config    # override the config file's mode (config: clear it)
    ghostgpu remediate status [-o json]              # the mode in force, the pause, the breaker

Each needs the `remediator` role in the collector's policy (docs/SECURITY.md), and each is audited
with the caller as its subject. A refusal (a finding not orphaned, remediation paused, no such
finding) is the collector's one line and exit status 2; a collector that cannot be reached one line
and exit status 1; a bad flag one line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ghostgpu.cli.client import ClientError, Query, TraceRefused
from ghostgpu.cli.tls_flags import add_collector_uid_flag, add_tls_flags, add_tls_server_name_flag

from ghostgpu.common.model.remediation import MODES
from ghostgpu.common.transport.collector_target import FORMS as COLLECTOR_FORMS
from ghostgpu.v1 import query_pb2

VERBS = ("pause", "resume", "mode", "status")
OUTPUTS = ("text", "json")
CONFIG = "config"  # `remediate mode config`: back to the config file's mode
_Verb = query_pb2.RemediationControlRequest.Verb


def add_parser(sub: Any) -> None:
    p = sub.add_parser("remediate", help="kill an orphaned GPU holder by hand; pause, resume, or set the "
                       "remediation mode (role remediator)")
    p.add_argument("verb", nargs="?", metavar="VERB",
                   help="pause, resume, mode MODE or status; none with --finding")
    p.add_argument("value", nargs="?", metavar="MODE", help=f"with mode: {', '.join(MODES)} or {CONFIG} "
                   "(back to the config file's)")
    p.add_argument("--finding", type=int, metavar="ID", help="the orphaned finding to remediate "
                   "(`ghostgpu findings` lists them)")
    p.add_argument("--dry-run", action="store_true", help="with --finding: re-check and say what would be "
                   "done; signal nothing")
    p.add_argument("--reason", default="", help="kept in the audit record (pause, resume, mode)")
    p.add_argument("-o", "--output", default="text", help="text (default) or json")
    p.add_argument("--collector", help=f"collector address: {COLLECTOR_FORMS} (default: the local socket)")
    add_tls_flags(p)
    add_collector_uid_flag(p)
    add_tls_server_name_flag(p)


def check_args(args: argparse.Namespace) -> None:
    """ValueError (one line) for flags that do not go together."""
    if args.output not in OUTPUTS:
        raise ValueError(f"-o {args.output!r}: use one of {', '.join(OUTPUTS)}")
    if args.finding is not None:
        if args.verb:
            raise ValueError(f"remediate --finding takes no verb (got {args.verb!r}): give one or the other")
        if args.finding <= 0:
            raise ValueError(f"--finding {args.finding}: a finding id is 1 or more (`ghostgpu findings`)")
        return
    if not args.verb:
        raise ValueError("remediate: give --finding ID, or one of pause, resume, mode MODE, status")
    if args.verb not in VERBS:
        raise ValueError(f"remediate {args.verb!r}: use --finding ID, or one of {', '.join(VERBS)}")
    if args.dry_run:
        raise ValueError("--dry-run goes with --finding")
    if args.verb == "mode":
        if args.value not in (*MODES, CONFIG):
            raise ValueError(f"remediate mode {args.value or ''!r}: use one of {', '.join(MODES)}, or "
                             f"{CONFIG} to go back to the config file's")
    elif args.value:
        raise ValueError(f"remediate {args.verb} takes no value (got {args.value!r})")


def _stamp(unix_ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_ns / 1e9))


def status_json(s: query_pb2.RemediationStatus) -> dict[str, Any]:
    return {"mode": s.mode, "config_mode": s.config_mode, "override_mode": s.override_mode or None,
            "paused": s.paused, "paused_by": s.paused_by or None,
            "paused_at": s.paused_unix_ns / 1e9 if s.paused_unix_ns else None,
            "breaker_open": s.breaker_open, "breaker_reason": s.breaker_reason,
            "actions_in_window": s.actions_in_window, "max_actions": s.max_actions,
            "isolated_nodes": list(s.isolated_nodes)}


def status_text(s: query_pb2.RemediationStatus) -> str:
    override = f", override {s.override_mode}" if s.override_mode else ""
    lines = [f"mode      {s.mode} (config file: {s.config_mode}{override})"]
    lines.append(f"paused    yes, by {s.paused_by} since {_stamp(s.paused_unix_ns)}: every act is a dry run"
                 if s.paused else "paused    no")
    window = f"{s.actions_in_window} of {s.max_actions} acts in its window"
    lines.append(f"breaker   open ({s.breaker_reason}): acts are dry runs" if s.breaker_open
                 else f"breaker   closed ({window})")
    lines.append(f"isolated  {', '.join(s.isolated_nodes) or 'no node'}")
    return "\n".join(lines)


def remediation_text(finding: int, answer: query_pb2.RemediateResponse) -> str:
    r = answer.remediation
    seq = f", audit record {r.audit_seq}" if r.audit_seq else ""
    line = f"finding {finding}: {r.state}: {r.reason} (incident {r.incident}{seq})"
    return line + (f"\n  tracer: {answer.detail}" if answer.detail and answer.detail not in r.reason else "")


def remediation_json(answer: query_pb2.RemediateResponse) -> dict[str, Any]:
    r = answer.remediation
    return {"state": r.state, "action": r.action, "at": r.at_unix_ns / 1e9 if r.at_unix_ns else None,
            "reason": r.reason, "mode": r.mode, "incident": r.incident, "audit_seq": r.audit_seq,
            "detail": answer.detail}


def cmd_remediate(args: argparse.Namespace) -> int:
    check_args(args)  # bad flags fail before any connection
    query = Query.from_args(args)
    try:
        if args.finding is not None:
            answer = query.remediate(args.finding, args.dry_run)
            out = (json.dumps(remediation_json(answer), indent=2) if args.output == "json"
                   else remediation_text(args.finding, answer))
        else:
            verb = {"pause": _Verb.VERB_PAUSE, "resume": _Verb.VERB_RESUME, "mode": _Verb.VERB_SET_MODE,
                    "status": _Verb.VERB_UNSPECIFIED}[args.verb]
            mode = "" if args.value in (None, CONFIG) else args.value
            status = query.remediation_control(verb, mode=mode, reason=args.reason)
            out = json.dumps(status_json(status), indent=2) if args.output == "json" else status_text(status)
    except TraceRefused as exc:
        print(f"ghostgpu: remediate: {exc}", file=sys.stderr)
        return 2
    except ClientError as exc:
        print(f"ghostgpu: {exc}", file=sys.stderr)
        return 1
    finally:
        query.close()
    print(out)
    return 0
