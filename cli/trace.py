"""`ghostgpu trace` and `ghostgpu trace list|show|stop`: trace sessions at the collector (docs/TRACE.md).

    ghostgpu trace [-n NS] [--pod POD] [--container NAME] [--pid PID --node NODE] [--gpu GPU] [--for 30s]
                   [-o table|json|jsonl] [--summary | --summary-with-calls] [--chrome-trace FILE] [--detach]

starts a session (StartTrace), prints its records as they arrive (WatchTrace, follow) and ends when
the session does: at its deadline, or when the user presses Ctrl-C and answers the question
"stop session t-... ? [Y/n]" (read from the terminal; without one the session is stopped). With
--detach the id and how to see it later come first, and Ctrl-C leaves the session running without
asking. `trace show ID` prints a session's stored records exactly as the live command would.

As strace's -c and -C: --summary prints only the summary at the end (table: the table; -o jsonl:
its rows as JSON lines; -o json: the document without "records"), --summary-with-calls the calls
as they come and then the summary (-o jsonl: the summary table on stderr; -o json: "records" and
"summary"); given both, --summary-with-calls wins.

stdout carries only the output asked for (the table, JSON lines, the JSON document, the summary);
every status line goes to stderr. A refusal by the collector is its one line and exit status 2, an
unreachable collector one line and exit status 1 (as for `ghostgpu ps`), a bad --for exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO

from ghostgpu.cli import trace_view
from ghostgpu.cli.chrome_trace import chrome_trace
from ghostgpu.cli.client import ClientError, Query, TraceRefused

from ghostgpu.common.model.durations import parse_duration_s
from ghostgpu.common.model.trace import TraceRecord, TraceScope, TraceSession, TraceStatus

END_GRACE_S = 15.0  # past its deadline, a session the collector has not ended is given up on
STOP_GRACE_S = 10.0  # after StopTrace, how long the last records may take to arrive
SCOPE_FLAGS = ("namespace", "pod", "container", "pid", "node", "gpu", "duration", "detach", "max_records")


def parse_duration(text: str) -> float:
    """`--for`: '30s', '2m', '1h30m', '500ms', '1.5m', or plain seconds -> seconds (> 0)."""
    return parse_duration_s(text, "--for")


def scope_from_args(args: argparse.Namespace) -> TraceScope:
    """A pod without -n is in "default", as kubectl has it."""
    namespace = args.namespace or ("default" if args.pod else "")
    return TraceScope(namespace=namespace, pod=args.pod or "", container=args.container or "",
                      node=args.node or "", pid=args.pid or 0, gpu=args.gpu or "")


class Output:
    """Everything one trace prints: records as they come (deduplicated by node and seq; unless
    `calls` is off), then at the end the summary, the JSON document and the Chrome trace file."""

    def __init__(self, mode: str, summary: bool = False, chrome_path: str | None = None,
                 out: TextIO | None = None, err: TextIO | None = None, calls: bool = True) -> None:
        self.mode, self.summary, self.calls, self.chrome_path = mode, summary, calls, chrome_path
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.records: list[TraceRecord] = []
        self.seen: set[tuple[str, int]] = set()
        self.session: TraceSession | None = None
        self.table = trace_view.LiveTable()

    def add(self, records: Sequence[TraceRecord], session: TraceSession) -> None:
        self.session = session
        new = [r for r in records if (r.node, r.seq) not in self.seen]
        self.seen.update((r.node, r.seq) for r in new)
        self.records += new
        if not self.calls:
            return
        if self.mode == "jsonl":
            lines = [trace_view.jsonl_line(r) for r in new]
        elif self.mode == "table":
            lines = self.table.lines(new)
        else:
            return
        if lines:
            self.out.write("".join(line + "\n" for line in lines))
            self.out.flush()

    def note(self, line: str) -> None:
        print(line, file=self.err, flush=True)

    def finish(self) -> None:
        if self.mode == "json":
            doc: dict[str, object] = {"session": self.session.to_json() if self.session else None}
            if self.calls:
                doc["records"] = [r.to_json() for r in self.records]
            if self.summary:
                doc["summary"] = trace_view.summary_json(self.records)
            print(json.dumps(doc, indent=2), file=self.out, flush=True)
        elif self.summary and not self.calls:
            text = trace_view.summary_jsonl(self.records) if self.mode == "jsonl" else \
                trace_view.summary_only(self.records)
            print(text, file=self.out, flush=True)
        elif self.summary:
            where = self.out if self.mode == "table" else self.err  # jsonl: stdout is records only
            gap = "\n" if self.records and self.mode == "table" else ""
            print(gap + trace_view.summary_table(self.records), file=where, flush=True)
        if self.chrome_path:
            n = write_chrome_trace(self.chrome_path, self.records, self.session)
            self.note(f"wrote {self.chrome_path}: {n} trace events (open it in ui.perfetto.dev, "
                      "chrome://tracing or speedscope)")
        if self.session is not None:
            self.note(trace_view.session_line(self.session))


def output_from_args(args: argparse.Namespace) -> Output:
    """--summary: the summary only (strace -c); --summary-with-calls: the calls, then it (strace -C)."""
    summary = args.summary or args.summary_with_calls
    return Output(args.output, summary=summary, calls=args.summary_with_calls or not summary,
                  chrome_path=args.chrome_trace)


def write_chrome_trace(path: str, records: Sequence[TraceRecord], session: TraceSession | None) -> int:
    doc = chrome_trace(records, session)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    os.replace(tmp, path)
    return len(doc["traceEvents"])


def follow(query: Query, session_id: str, output: Output, give_up_unix_ns: int, follow_live: bool = True,
           ) -> bool:
    """Feed WatchTrace's messages to `output` until the stream ends; True when it ended because the
    session did. Past `give_up_unix_ns` (0: never) the stream is cancelled, as if the session ended."""
    messages, cancel = query.watch_trace(session_id, follow=follow_live)
    done, gave_up = threading.Event(), threading.Event()

    def watchdog() -> None:
        if not done.wait(max(0.0, (give_up_unix_ns - time.time_ns()) / 1e9)):
            gave_up.set()
            cancel()

    if give_up_unix_ns:
        threading.Thread(target=watchdog, name="ghostgpu-trace-deadline", daemon=True).start()
    try:
        for records, session in messages:
            output.add(records, session)
            if session.status.ended:  # the stream's last message by contract: do not wait for its end
                break
    finally:
        done.set()
        cancel()
    ended = output.session is not None and output.session.status.ended
    if gave_up.is_set():
        output.note(f"ghostgpu: the collector did not end trace {session_id} in time; "
                    f"showing what arrived (ghostgpu trace show {session_id})")
    elif follow_live and not ended:
        output.note(f"ghostgpu: the collector closed the stream before trace {session_id} ended; "
                    f"showing what arrived (ghostgpu trace show {session_id})")
    return ended


def confirm_stop(session_id: str, stdin: TextIO, err: TextIO) -> bool:
    """Ask on the terminal; without one (or on EOF, or a second Ctrl-C) the answer is yes."""
    if not stdin.isatty():
        return True
    err.write(f"\nstop session {session_id} ? [Y/n] ")
    err.flush()
    try:
        answer = stdin.readline()
    except KeyboardInterrupt:
        return True
    return not answer.strip().lower().startswith("n")


def _grace(unix_ns: int, seconds: float) -> int:
    return unix_ns + int(seconds * 1e9) if unix_ns else 0


def run_live(query: Query, args: argparse.Namespace, output: Output) -> int:
    duration_s = parse_duration(args.duration) if args.duration is not None else 0.0
    scope = scope_from_args(args)
    session = query.start_trace(scope, duration_ms=max(1, round(duration_s * 1000)) if duration_s else 0,
                                max_records=args.max_records or 0)
    output.session = session
    output.note(trace_view.session_line(session))
    if args.detach:
        output.note(f"{session.id}: detached, Ctrl-C leaves it running; see it with "
                    f"`ghostgpu trace show {session.id}`, end it with `ghostgpu trace stop {session.id}`")
    else:
        output.note(f"Ctrl-C to stop it or leave it running (ghostgpu trace show {session.id})")
    try:
        follow(query, session.id, output, _grace(session.deadline_unix_ns, END_GRACE_S))
    except KeyboardInterrupt:
        if args.detach or not confirm_stop(session.id, sys.stdin, output.err):
            output.note(f"trace {session.id} left running: `ghostgpu trace show {session.id}` shows it, "
                        f"`ghostgpu trace stop {session.id}` ends it")
        else:
            output.session = query.stop_trace(session.id)
            try:  # the records the tracer sent before it stopped, up to the message that ends the session
                follow(query, session.id, output, _grace(time.time_ns(), STOP_GRACE_S))
            except KeyboardInterrupt:
                output.note("ghostgpu: interrupted again: the last records may be missing here "
                            f"(ghostgpu trace show {session.id})")
    output.finish()
    return 1 if output.session is not None and output.session.status is TraceStatus.FAILED else 0


def run_show(query: Query, args: argparse.Namespace, output: Output) -> int:
    follow(query, args.id, output, 0, follow_live=False)
    output.finish()
    return 0


def run_list(query: Query, args: argparse.Namespace) -> int:
    sessions = query.list_traces()
    if args.output == "json":
        print(json.dumps([s.to_json() for s in sorted(sessions, key=lambda s: (s.started_unix_ns, s.id))],
                         indent=2))
    else:
        print(trace_view.session_table(sessions))
    return 0


def run_stop(query: Query, args: argparse.Namespace) -> int:
    print(trace_view.session_line(query.stop_trace(args.id)))
    return 0


def check_args(args: argparse.Namespace) -> None:
    """Flags of the live command given to list/show/stop, and outputs a verb cannot make: one line, exit 2."""
    verb = args.trace_command
    if args.chrome_trace and not os.path.isdir(os.path.dirname(os.path.abspath(args.chrome_trace))):
        raise ValueError(f"--chrome-trace {args.chrome_trace}: no such directory")
    if verb is None:
        if args.duration is not None:
            parse_duration(args.duration)  # a bad --for fails before any connection
        return
    stray = [f for f in SCOPE_FLAGS if getattr(args, f, None) not in (None, False)]
    if stray:
        flags = ", ".join("--for" if f == "duration" else "--" + f.replace("_", "-") for f in stray)
        raise ValueError(f"trace {verb}: {flags} apply to `ghostgpu trace` itself (starting a session)")
    if verb == "list" and args.output == "jsonl":
        raise ValueError("trace list -o jsonl: use -o table or -o json")
    if verb in ("list", "stop") and (args.summary or args.summary_with_calls or args.chrome_trace):
        raise ValueError(f"trace {verb}: --summary, --summary-with-calls and --chrome-trace go with "
                         "`trace` and `trace show`")


def cmd_trace(args: argparse.Namespace) -> int:
    check_args(args)
    query = Query.from_args(args)
    output = output_from_args(args)
    try:
        if args.trace_command == "list":
            return run_list(query, args)
        if args.trace_command == "stop":
            return run_stop(query, args)
        if args.trace_command == "show":
            return run_show(query, args, output)
        return run_live(query, args, output)
    except ClientError as exc:
        print(f"ghostgpu: {exc}", file=sys.stderr)
        if output.session is not None:  # the stream broke mid-way: still the outputs of what came
            output.finish()
        return 2 if isinstance(exc, TraceRefused) else 1
    except OSError as exc:  # the Chrome trace file
        print(f"ghostgpu: cannot write {args.chrome_trace}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # `show`, or a StartTrace/StopTrace call, interrupted
        return 130
    finally:
        query.close()
