"""`ghostgpu ps` and `ghostgpu findings`: clients of the collector's query service (and the
trace RPCs `ghostgpu trace` calls, cli/trace.py).

A collector that cannot be reached, or that refuses this client's API version, is one line on
stderr and exit status 1; a bad flag is one line and exit status 2 (raised as ValueError, which
ghostgpu.cli prints). A trace request the collector refuses (docs/TRACE.md: NOT_FOUND,
INVALID_ARGUMENT, FAILED_PRECONDITION, RESOURCE_EXHAUSTED) is its one line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypedDict, TypeVar, Unpack

import grpc
from ghostgpu.cli import view
from ghostgpu.cli.tls_flags import collector_uid_from_args, tls_from_args

from ghostgpu.common.model.consumers import ClusterConsumer, ConsumerClass
from ghostgpu.common.model.durations import LOOK_BACK, parse_duration_s
from ghostgpu.common.model.trace import TraceRecord, TraceScope, TraceSession
from ghostgpu.common.transport.collector_target import collector_address
from ghostgpu.common.transport.dial import CollectorRefused, open_channel
from ghostgpu.common.transport.tls import TlsFiles
from ghostgpu.common.transport.tls_explain import explain_connect_failure
from ghostgpu.common.wire.convert import class_to_proto, cluster_consumer_from_proto
from ghostgpu.common.wire.convert_trace import record_from_proto, scope_to_proto, session_from_proto
from ghostgpu.common.wire.protocol import API_VERSION, API_VERSION_METADATA, MAX_ANSWER_BYTES, channel_options
from ghostgpu.v1 import query_pb2, query_pb2_grpc, trace_pb2

CALL_TIMEOUT_S = 10.0
# A Remediate by hand waits for the tracer's re-check, then its SIGTERM .. SIGKILL grace and the
# device's release (collector/remediation.py RemediationTiming: 10 s + the grace + 15 s)
REMEDIATE_TIMEOUT_S = 120.0
WATCH_REDRAW_S = 2.0  # ages in the SINCE column move even when no finding does
RECONNECT_MAX_S = 2.0


T = TypeVar("T")


class Filters(TypedDict):
    """ps and findings' --node, --namespace and --class, as Query's methods take them."""

    node: str
    namespace: str
    classes: list[ConsumerClass]


class WatchFilters(TypedDict, total=False):
    """What Query.watch takes: the filters, and whether the findings open now come first."""

    node: str
    namespace: str
    classes: list[ConsumerClass]
    include_open: bool


class ClientError(Exception):
    """A collector failure already phrased as the one line to print."""


class TraceRefused(ClientError):
    """A trace request the collector refused: its one line (the status details), exit status 2."""


TRACE_REFUSALS = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
                            grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED})


def trace_error(exc: grpc.RpcError, address: str, tls: TlsFiles | None = None) -> ClientError:
    details = exc.details()
    if exc.code() in TRACE_REFUSALS and details:
        return TraceRefused(details.splitlines()[0])
    return ClientError(describe_rpc_error(exc, address, tls))


def parse_classes(values: list[str] | None) -> list[ConsumerClass]:
    out: list[ConsumerClass] = []
    for value in values or []:
        for name in value.split(","):  # --class hidden,ghost reads as two
            try:
                out.append(ConsumerClass(name.strip().lower()))
            except ValueError:
                known = ", ".join(c.value for c in ConsumerClass)
                raise ValueError(f"--class {name!r}: not a consumer class; use one of {known}") from None
    return out


def describe_rpc_error(exc: grpc.RpcError, address: str, tls: TlsFiles | None = None) -> str:
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE:
        # A TLS mismatch reads as "Socket closed": name the cause and the flag to pass instead.
        tls_line = explain_connect_failure(address, tls or TlsFiles(None, None, None), details)
        if tls_line:
            return tls_line
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        why = details.splitlines()[0] if details else code.name
        return (f"cannot reach the collector at {address} ({why}): start one with `ghostgpu collector` "
                f"or `ghostgpu up`, or pass --collector")
    if code == grpc.StatusCode.PERMISSION_DENIED:
        why = details.splitlines()[0] if details else "no reason given"
        return f"the collector at {address} refused: {why} (its policy decides: docs/SECURITY.md)"
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return details or f"the collector at {address} refused this client (FAILED_PRECONDITION)"
    return f"the collector at {address} answered {code.name}: {details}"


@dataclass
class Query:
    """One channel to a collector; every call carries the API version and a deadline."""

    address: str
    timeout_s: float = CALL_TIMEOUT_S
    tls: TlsFiles | None = None  # mTLS (docs/SECURITY.md); None or no files: plaintext
    collector_uid: int | None = None  # --collector-uid: who besides root may serve it in plaintext

    def __post_init__(self) -> None:
        # Who we are is the collector's to find out (a certificate, SO_PEERCRED, the loopback
        # socket's owner): nothing here claims an identity. Who it is, in plaintext, is ours
        # (ghostgpu/common/transport/dial.py): a collector another local user serves is refused here.
        try:
            self.channel = open_channel(self.address, self.tls, channel_options(MAX_ANSWER_BYTES),
                                        collector_uid=self.collector_uid)
        except CollectorRefused as exc:
            raise ClientError(str(exc)) from None
        self.stub = query_pb2_grpc.QueryStub(self.channel)
        self.metadata = ((API_VERSION_METADATA, str(API_VERSION)),)

    @classmethod
    def from_flag(cls, value: str | None, tls: TlsFiles | None = None,
                  collector_uid: int | None = None) -> Query:
        return cls(collector_address(value), tls=tls, collector_uid=collector_uid)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Query:
        """--collector, the TLS flags and --collector-uid (GHOSTGPU_COLLECTOR, GHOSTGPU_TLS_*,
        GHOSTGPU_COLLECTOR_UID where not given). ClientError when the plaintext collector there is
        served by a uid this client does not trust."""
        return cls.from_flag(getattr(args, "collector", None), tls_from_args(args),
                             collector_uid_from_args(args))

    def close(self) -> None:
        self.channel.close()

    def _call(self, fn: Callable[..., T], request: object) -> T:
        try:
            return fn(request, metadata=self.metadata, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise ClientError(describe_rpc_error(exc, self.address, self.tls)) from exc

    def consumers(self, node: str = "", namespace: str = "", classes: list[ConsumerClass] | None = None,
                  ) -> list[ClusterConsumer]:
        req = query_pb2.ListConsumersRequest(node=node or "", namespace=namespace or "",
                                             classes=[class_to_proto(c) for c in classes or []])
        return [cluster_consumer_from_proto(m) for m in self._call(self.stub.ListConsumers, req).consumers]

    def nodes(self, node: str = "") -> list[query_pb2.TracerStatus]:
        resp = self._call(self.stub.NodeStatus, query_pb2.NodeStatusRequest(node=node or ""))
        return sorted(resp.nodes, key=lambda n: n.node)

    def findings(self, since_unix_ns: int, node: str = "", namespace: str = "",
                 classes: list[ConsumerClass] | None = None, limit: int = 0) -> list[query_pb2.Finding]:
        req = query_pb2.ListFindingsRequest(since_unix_ns=since_unix_ns, node=node or "",
                                            namespace=namespace or "", limit=max(0, limit),
                                            classes=[class_to_proto(c) for c in classes or []])
        return list(self._call(self.stub.ListFindings, req).findings)

    def faults(self, since_unix_ns: int, node: str = "", namespace: str = "",
               limit: int = 0) -> query_pb2.ListFaultsResponse:
        """ListFaults: GPU faults read at or after `since`, the newest `limit`, oldest first; with how
        many older ones the answer left out to stay within its size (`left_out`)."""
        req = query_pb2.ListFaultsRequest(since_unix_ns=since_unix_ns, node=node or "",
                                          namespace=namespace or "", limit=max(0, limit))
        answer: query_pb2.ListFaultsResponse = self._call(self.stub.ListFaults, req)
        return answer

    def remediate(self, finding: int, dry_run: bool, timeout_s: float = REMEDIATE_TIMEOUT_S,
                  ) -> query_pb2.RemediateResponse:
        """Remediate: one finding by hand (role remediator). A refusal (not orphaned, paused, no such
        finding) is a TraceRefused with the collector's one line."""
        req = query_pb2.RemediateRequest(finding=finding, dry_run=dry_run)
        try:
            answer: query_pb2.RemediateResponse = self.stub.Remediate(req, metadata=self.metadata,
                                                                      timeout=timeout_s)
        except grpc.RpcError as exc:
            raise trace_error(exc, self.address, self.tls) from exc
        return answer

    def remediation_control(self, verb: query_pb2.RemediationControlRequest.Verb, mode: str = "",
                            reason: str = "") -> query_pb2.RemediationStatus:
        req = query_pb2.RemediationControlRequest(verb=verb, mode=mode, reason=reason)
        try:
            answer: query_pb2.RemediationStatus = self.stub.RemediationControl(req, metadata=self.metadata,
                                                                               timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise trace_error(exc, self.address, self.tls) from exc
        return answer

    def events(self, node: str, instance_id: str, after_seq: int,
               limit: int = 0) -> list[query_pb2.StoredEvent]:
        req = query_pb2.ListEventsRequest(node=node, instance_id=instance_id, after_seq=after_seq,
                                          limit=limit)
        return list(self._call(self.stub.ListEvents, req).events)

    def watch(self, node: str = "", namespace: str = "", classes: list[ConsumerClass] | None = None,
              include_open: bool = False) -> Iterator[query_pb2.FindingEvent]:
        """The WatchFindings stream; cancel it with close(). Raises ClientError when it breaks."""
        req = query_pb2.WatchFindingsRequest(node=node or "", namespace=namespace or "",
                                             classes=[class_to_proto(c) for c in classes or []],
                                             include_open=include_open)
        stream = self.stub.WatchFindings(req, metadata=self.metadata)
        try:
            yield from stream
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise ClientError(describe_rpc_error(exc, self.address, self.tls)) from exc
        finally:
            stream.cancel()

    # Trace sessions (docs/TRACE.md). Errors: TraceRefused for a refusal, ClientError otherwise.
    def _trace_call(self, fn: Callable[..., T], request: object) -> T:
        try:
            return fn(request, metadata=self.metadata, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise trace_error(exc, self.address, self.tls) from exc

    def start_trace(self, scope: TraceScope, duration_ms: int = 0, max_records: int = 0) -> TraceSession:
        req = trace_pb2.StartTraceRequest(scope=scope_to_proto(scope), duration_ms=duration_ms,
                                          max_records=max_records)
        return session_from_proto(self._trace_call(self.stub.StartTrace, req).session)

    def stop_trace(self, session_id: str) -> TraceSession:
        resp = self._trace_call(self.stub.StopTrace, trace_pb2.StopTraceRequest(id=session_id))
        return session_from_proto(resp.session)

    def list_traces(self) -> list[TraceSession]:
        resp = self._trace_call(self.stub.ListTraces, trace_pb2.ListTracesRequest())
        return [session_from_proto(m) for m in resp.sessions]

    def watch_trace(self, session_id: str, follow: bool,
                    ) -> tuple[Iterator[tuple[list[TraceRecord], TraceSession]], Callable[[], None]]:
        """WatchTrace: (messages as (records, session), a cancel function another thread may call).
        The iterator ends after the message whose session has ended, or when cancelled."""
        call = self.stub.WatchTrace(trace_pb2.WatchTraceRequest(id=session_id, follow=follow),
                                    metadata=self.metadata)

        def messages() -> Iterator[tuple[list[TraceRecord], TraceSession]]:
            try:
                for m in call:
                    session = session_from_proto(m.session)
                    yield [record_from_proto(r, session.id or session_id) for r in m.records], session
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED:
                    raise trace_error(exc, self.address, self.tls) from exc
            finally:
                call.cancel()

        return messages(), call.cancel


class FindingWaker:
    """Follows WatchFindings in a thread and sets `changed` on each event, reconnecting with backoff
    when the collector goes away (a restarted collector is picked up without the user noticing)."""

    def __init__(self, query: Query, on_event: Callable[[query_pb2.FindingEvent], None] | None = None,
                 **filters: Unpack[WatchFilters]) -> None:
        self.query, self.filters, self.on_event = query, filters, on_event
        self.changed = threading.Event()
        self.error = ""  # the last stream failure, "" while connected
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ghostgpu-watch", daemon=True)

    def start(self) -> FindingWaker:
        self._thread.start()
        return self

    def _run(self) -> None:
        backoff_s = 0.1
        while not self._stop.is_set():
            try:
                for ev in self.query.watch(**self.filters):
                    self.error, backoff_s = "", 0.1
                    if self.on_event is not None:
                        self.on_event(ev)
                    self.changed.set()
                    if self._stop.is_set():
                        return
            except ClientError as exc:
                self.error = str(exc)
            self.changed.set()  # a broken (or ended) stream is news too: the view says so
            self._stop.wait(backoff_s)
            backoff_s = min(RECONNECT_MAX_S, backoff_s * 2)

    def stop(self) -> None:
        self._stop.set()


def _filters(args: argparse.Namespace) -> Filters:
    return {"node": args.node or "", "namespace": args.namespace or "",
            "classes": parse_classes(args.classes)}


def render_ps(query: Query, args: argparse.Namespace, filters: Filters) -> str:
    consumers = query.consumers(**filters)
    nodes = query.nodes(filters["node"])
    if args.output == "json":
        return json.dumps(view.consumers_json(consumers, nodes), indent=2, default=str)
    now_s = time.time()
    headers = [line for n in nodes for line in view.node_lines(n, now_s)]
    table = view.consumer_table(consumers, wide=args.output == "wide", now_s=now_s)
    return "\n".join([*headers, "", table] if headers else [table])


def _print_error(line: str) -> int:
    print(f"ghostgpu: {line}", file=sys.stderr)
    return 1


def cmd_ps(args: argparse.Namespace) -> int:
    filters = _filters(args)  # bad flags fail before any connection
    query = Query.from_args(args)
    try:
        if not args.watch:
            print(render_ps(query, args, filters))
            return 0
        return _watch(query, args, filters)
    except ClientError as exc:
        return _print_error(str(exc))
    except KeyboardInterrupt:
        return 0
    finally:
        query.close()


def _watch(query: Query, args: argparse.Namespace, filters: Filters) -> int:
    """Redraw on every finding event and at least every WATCH_REDRAW_S; survive collector restarts.

    The first answer must come (a wrong address is one line, not an endless wait); after that a
    lost collector is shown on the screen and retried."""
    first = render_ps(query, args, filters)
    waker = FindingWaker(query, **filters).start()
    tty = sys.stdout.isatty()
    last_printed, screen = "", first
    try:
        while True:
            last_printed = show(screen, last_printed, tty)
            waker.changed.wait(WATCH_REDRAW_S)
            waker.changed.clear()
            try:
                screen = render_ps(query, args, filters)
            except ClientError as exc:
                screen = f"ghostgpu: {exc}; retrying"
    finally:
        waker.stop()


_AGES = re.compile(r"\b\d+[smhd]\b")


def screen_signature(screen: str) -> str:
    """What a piped watch compares: the screen without its ages, so only real changes print."""
    return _AGES.sub("", screen)


def show(screen: str, last_printed: str, tty: bool) -> str:
    """Redraw a live view: a terminal gets the screen every time; a pipe gets it only when something
    other than an age changed (returns what was last printed)."""
    if tty:
        sys.stdout.write("\x1b[H\x1b[2J" + screen + "\n")
        sys.stdout.flush()
    elif screen_signature(screen) != screen_signature(last_printed):
        print(screen + "\n", flush=True)
        return screen
    return last_printed


def cmd_findings(args: argparse.Namespace) -> int:
    filters = _filters(args)
    since_s = parse_duration_s(args.since, "--since", LOOK_BACK)
    if args.limit is not None and args.limit < 0:
        raise ValueError(f"--limit {args.limit}: must be 0 (the collector's default) or more")
    query = Query.from_args(args)
    try:
        since_ns = int((time.time() - since_s) * 1e9)
        found = query.findings(since_ns, limit=args.limit or 0, **filters)
    except ClientError as exc:
        return _print_error(str(exc))
    finally:
        query.close()
    found.sort(key=lambda f: (f.opened_unix_ns, f.id))
    if args.output == "json":
        print(json.dumps([view.finding_json(f) for f in found], indent=2, default=str))
    else:
        print(view.findings_table(found, wide=args.output == "wide"))
    return 0
