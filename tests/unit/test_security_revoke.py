"""Revocation against the real collector over real mTLS (docs/SECURITY.md, "Revocation"):
streams that were allowed when they opened end when a policy reload takes the role away
(PERMISSION_DENIED, within 1 s) or when the client certificate they came with expires
(UNAUTHENTICATED, at its notAfter); each end is audited; the tracer whose stream was revoked comes
back, is refused, and backs off instead of spinning.

Every stream is opened for real (sim tracers, the query API's own streams, the tracer's real
StreamSink), every certificate comes from a real CA (tests/helpers/certs.py), and every wait polls
with a deadline."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from ghostgpu.collector.config import CollectorConfig
from ghostgpu.collector.main import Collector
from ghostgpu.collector.revoke import OpenStreams
from ghostgpu.tracer.stream import StreamSink
from ghostgpu.tracer.stream_sender import StreamOptions

from ghostgpu.common.transport.principal import Principal
from ghostgpu.common.transport.tls import TlsFiles
from ghostgpu.v1 import query_pb2
from tests.helpers.audit_log import audit_records, secure_options
from tests.helpers.certs import Pki, write_file
from tests.helpers.cri_fake import FakeCri
from tests.helpers.polling import poll, wait_until
from tests.helpers.sim_tracer import SimTracer, finding, make_consumer
from tests.helpers.trace_env import FAST, TraceClient, cri_via

A = "a1" * 32
POLICY = """
rules:
  - role: trace-operator
    subjects: ["user:alice"]
    namespaces: ["ml-*"]
  - role: viewer
    subjects: ["group:ops", "user:carol"]
  - role: tracer
    subjects: ["node:*"]
"""
# alice loses trace-operator, group:ops (bob) loses viewer, node n1 loses tracer; carol and n2 keep theirs.
REVOKED = """
rules:
  - role: viewer
    subjects: ["user:carol"]
  - role: tracer
    subjects: ["node:n2"]
"""
CONNECT = "/ghostgpu.v1.NodeStream/Connect"
WATCH_FINDINGS = "/ghostgpu.v1.Query/WatchFindings"
WATCH_TRACE = "/ghostgpu.v1.Query/WatchTrace"
WITHIN_S = 1.0  # a revoked stream ends within 1 s of the reload (docs/SECURITY.md, "Revocation")


@dataclass
class Secure:
    collector: Collector
    pki: Pki
    policy: Path
    audit: Path
    cri: FakeCri

    def tls(self, stem: str, pair: Any) -> TlsFiles:
        return self.pki.write(stem, pair)

    def tracer(self, node: str, tls: TlsFiles,
               capabilities: tuple[str, ...] = ("cri-relay", "trace")) -> SimTracer:
        return SimTracer(self.collector.address, node, tls=tls, cri=cri_via(self.cri),
                         capabilities=capabilities)

    def client(self, tls: TlsFiles) -> TraceClient:
        return TraceClient(self.collector.address, tls=tls)

    def reload(self, text: str) -> float:
        """Write the policy and send what SIGHUP sends (collector/run.py); the monotonic time before."""
        t0 = time.monotonic()
        write_file(self.policy, text.encode())
        loop = self.collector.loop
        assert loop is not None
        loop.call_soon_threadsafe(self.collector.security.reload)
        return t0

    def audit_records(self, action: str | None = None) -> list[dict[str, Any]]:
        return audit_records(self.audit, action)


@pytest.fixture
def secure(tmp_path: Path) -> Iterator[Secure]:
    pki, opts, audit = secure_options(tmp_path, POLICY)
    policy = Path(opts.policy_path or "")
    fake = FakeCri().start()
    fake.add_sandbox("sb-ml", "trainer-0", "ml-train", "uid-trainer-0")
    fake.add_container(A, "sb-ml", "main")
    c = Collector(CollectorConfig(listen=("127.0.0.1:0",), db_path=str(tmp_path / "c.db")), trace_timing=FAST,
                  security=opts).start()
    try:
        yield Secure(c, pki, policy, audit, fake)
    finally:
        c.stop(grace_s=0.5)
        fake.close()


class Drain:
    """A server stream whose first answer has arrived (so it is open on the collector), read on a
    thread until it ends: the status and when (monotonic)."""

    def __init__(self, call: Any, what: str) -> None:
        self.call, self.what = call, what
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.ended_at = 0.0
        self.done = threading.Event()
        next(call)  # the first answer: the collector admitted the stream and is serving it
        threading.Thread(target=self._read, daemon=True, name=f"drain-{what}").start()

    def _read(self) -> None:
        try:
            for _ in self.call:
                pass
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            self.code, self.details = e.code(), e.details() or ""
        self.ended_at = time.monotonic()
        self.done.set()

    def wait(self, timeout_s: float) -> tuple[grpc.StatusCode, str, float]:
        if not self.done.wait(timeout_s):
            raise AssertionError(f"{self.what}: still open after {timeout_s} s")
        assert self.code is not None
        return self.code, self.details, self.ended_at


def watch_findings(client: TraceClient) -> Any:
    """WatchFindings with the open findings first (so the first answer comes at once)."""
    request = query_pb2.WatchFindingsRequest(include_open=True)
    return client.stub.WatchFindings(request, metadata=client.metadata)


def _tracer_end(t: SimTracer, timeout_s: float) -> tuple[grpc.StatusCode, str, float]:
    """A sim tracer's stream end: status and when (monotonic, polled)."""
    if not poll(lambda: t.status is not None, timeout_s):
        raise AssertionError(f"node {t.node}: stream still open after {timeout_s} s")
    at = time.monotonic()
    assert t.status is not None
    return t.status[0], t.status[1], at


def test_a_policy_reload_ends_the_open_streams_of_whoever_lost_the_role(secure: Secure) -> None:
    n1 = secure.tracer("n1", secure.tls("node-n1", secure.pki.node("n1")), capabilities=())
    n2 = secure.tracer("n2", secure.tls("node-n2", secure.pki.node("n2")))
    n1.connect()
    n2.connect()
    n1.send_events([finding(1, make_consumer("n1", 42, container_id=A))])
    n1.wait_acked(1)
    alice = secure.client(secure.tls("user-alice", secure.pki.user("alice")))
    bob = secure.client(secure.tls("user-bob", secure.pki.user("bob", groups=["ops"])))
    carol = secure.client(secure.tls("user-carol", secure.pki.user("carol")))
    try:
        session = alice.start(namespace="ml-train", duration_ms=60_000)
        trace = Drain(alice.watch(session.id, follow=True, timeout_s=60.0), "alice's WatchTrace")
        # bob watches findings three times: one audit record names all three.
        bobs = [Drain(watch_findings(bob), f"bob's WatchFindings #{i}") for i in range(3)]
        kept = Drain(watch_findings(carol), "carol's WatchFindings")

        t0 = secure.reload(REVOKED)
        for what, (code, details, at) in [("n1's Connect", _tracer_end(n1, 5.0)),
                                          *[(d.what, d.wait(5.0)) for d in (trace, *bobs)]]:
            assert code == grpc.StatusCode.PERMISSION_DENIED, (what, code, details)
            assert "permission denied" in details and "policy was reloaded" in details, (what, details)
            assert at - t0 <= WITHIN_S, f"{what} ended {at - t0:.2f} s after the reload"
        assert "user:bob" in bobs[0].details and "viewer" in bobs[0].details
        assert "node:n1" in n1.status[1] and "tracer" in n1.status[1]  # type: ignore[index]
        # Who kept the role keeps the stream: carol still watches, n2 still streams and is acked.
        assert not kept.done.is_set(), (kept.code, kept.details)
        n2.send_events([finding(1, make_consumer("n2", 7))])
        n2.wait_acked(1)
        assert n2.status is None
        # bob opening a new watch is refused at once, as before.
        with pytest.raises(grpc.RpcError) as e:
            next(watch_findings(bob))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        for c in (alice, bob, carol):
            c.close()
        n1.stop()
        n2.stop()

    revoked = {(r["subject"], r["detail"]["method"]): r for r in secure.audit_records("stream.revoked")}
    assert set(revoked) == {("node:n1", CONNECT), ("user:bob", WATCH_FINDINGS), ("user:alice", WATCH_TRACE)}
    assert revoked[("user:bob", WATCH_FINDINGS)]["detail"]["streams"] == 3
    for r in revoked.values():
        detail = r["detail"]
        assert (r["result"], detail["status"], detail["via"]) == ("denied", "PERMISSION_DENIED", "mtls")
        assert "policy reload" in r["detail"]["reason"]


def _not_after_s(pem: bytes) -> float:
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(pem)
    return cert.not_valid_after.replace(tzinfo=dt.UTC).timestamp()


def test_a_certificate_that_expires_mid_stream_ends_its_streams(secure: Secure) -> None:
    soon = {"not_before": dt.datetime.now(dt.UTC) - dt.timedelta(minutes=1),
            "not_after": dt.datetime.now(dt.UTC) + dt.timedelta(seconds=6)}
    n1_pair = secure.pki.node("n1", **soon)
    bob_pair = secure.pki.user("bob", groups=["ops"], **soon)
    expires_s = min(_not_after_s(n1_pair.cert_pem), _not_after_s(bob_pair.cert_pem))
    n1 = secure.tracer("n1", secure.tls("node-n1", n1_pair))
    n2 = secure.tracer("n2", secure.tls("node-n2", secure.pki.node("n2")))  # a year ahead
    bob = secure.client(secure.tls("user-bob", bob_pair))
    carol = secure.client(secure.tls("user-carol", secure.pki.user("carol")))
    try:
        n1.connect()
        n2.connect()
        n1.send_events([finding(1, make_consumer("n1", 42))])
        n1.wait_acked(1)
        watch = Drain(watch_findings(bob), "bob's WatchFindings")
        kept = Drain(watch_findings(carol), "carol's WatchFindings")
        assert time.time() < expires_s, "the machine was too slow to open the streams before the expiry"

        left_s = expires_s - time.time()
        for what, (code, details, at) in [("bob's WatchFindings", watch.wait(left_s + 5.0)),
                                          ("n1's Connect", _tracer_end(n1, left_s + 5.0))]:
            wall = time.time() - (time.monotonic() - at)  # when it ended, on the certificate's clock
            assert code == grpc.StatusCode.UNAUTHENTICATED, (what, code, details)
            assert "expired" in details and "notAfter" in details, (what, details)
            assert expires_s - 0.5 <= wall <= expires_s + WITHIN_S, (
                f"{what} ended {wall - expires_s:+.2f} s from the certificate's notAfter")
        assert not kept.done.is_set(), (kept.code, kept.details)
        n2.send_events([finding(1, make_consumer("n2", 7))])
        n2.wait_acked(1)
    finally:
        for c in (bob, carol):
            c.close()
        n1.stop()
        n2.stop()
    revoked = {(r["subject"], r["detail"]["method"]): r for r in secure.audit_records("stream.revoked")}
    assert set(revoked) == {("node:n1", CONNECT), ("user:bob", WATCH_FINDINGS)}
    for r in revoked.values():
        assert (r["result"], r["detail"]["status"]) == ("denied", "UNAUTHENTICATED")
        assert r["detail"]["reason"] == "certificate expired"


def test_a_revoked_tracer_comes_back_is_refused_and_backs_off(secure: Secure) -> None:
    """The tracer's real stream code (StreamSink, default backoff): after its stream is revoked it
    reconnects, is refused at the door, and then retries rarely instead of spinning."""
    tls = secure.tls("node-n1", secure.pki.node("n1"))
    sink = StreamSink(secure.collector.address, "n1", options=StreamOptions(info_wait_s=0.0, tls=tls),
                      boot_id="boot-n1")
    try:
        wait_until(lambda: sink.stats()["connected"], "the tracer connected", 10.0)
        authorizer = secure.collector.security.authorizer
        before = authorizer.denied_total
        t0 = secure.reload(REVOKED.replace('"node:n2"', '"node:nobody"'))
        wait_until(lambda: not sink.stats()["connected"], "the tracer's stream revoked", 5.0)
        assert time.monotonic() - t0 <= WITHIN_S + 0.5  # the sink notices a little after the collector
        wait_until(lambda: authorizer.denied_total > before, "the tracer's reconnect refused", 5.0)
        first = authorizer.denied_total
        # Refused once: the sender now waits backoff_max_s (5 s, jittered to at least 2.5 s) per try.
        window_s = 2.0
        end = time.monotonic() + window_s
        while time.monotonic() < end:  # an observation window, not a wait for a result
            assert authorizer.denied_total - first <= 1, "the refused tracer is spinning"
            time.sleep(0.05)
        assert sink.stats()["connect_failures"] <= 2
    finally:
        sink.close()
    revoked = secure.audit_records("stream.revoked")
    assert [(r["subject"], r["detail"]["method"]) for r in revoked] == [("node:n1", CONNECT)]


class _CoreLikeContext:
    """A ServicerContext as gRPC core treats one: a status cannot start while a message send is in
    flight (grpcio 1.85 raises ExecuteBatchError, GRPC_CALL_ERROR_TOO_MANY_OPERATIONS, and the call
    then never gets a status). The send in flight completes when the test lets the client read."""

    def __init__(self) -> None:
        self.client_reads = asyncio.Event()
        self.sending = False
        self.status: tuple[grpc.StatusCode, str] | None = None

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    async def write(self, message: object) -> None:
        self.sending = True
        try:
            await self.client_reads.wait()
        finally:
            self.sending = False

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        if self.sending:
            raise RuntimeError("GRPC_CALL_ERROR_TOO_MANY_OPERATIONS")
        self.status = (code, details)
        raise grpc.aio.AbortError()


def test_a_stream_revoked_while_a_message_is_in_flight_still_gets_its_status() -> None:
    class Deny:
        def denial(self, principal: Principal, method: str) -> str | None:
            return "role tracer"

    async def run() -> tuple[grpc.StatusCode, str] | None:
        streams, context = OpenStreams(), _CoreLikeContext()

        async def handler(ctx: Any) -> None:
            await ctx.write(b"ack")  # held: the client does not read yet

        task = asyncio.ensure_future(streams.run(Principal("node", "n1", (), "mtls", "peer"), "/m",
                                                 context, handler))
        while not context.sending:
            await asyncio.sleep(0)
        streams.recheck(Deny())
        for _ in range(100):  # the handler is cancelled; its send is still in flight
            await asyncio.sleep(0)
        assert not task.done() and context.status is None
        context.client_reads.set()
        with pytest.raises(grpc.aio.AbortError):
            await asyncio.wait_for(task, 5)
        return context.status

    status = asyncio.run(run())
    assert status is not None and status[0] == grpc.StatusCode.PERMISSION_DENIED
