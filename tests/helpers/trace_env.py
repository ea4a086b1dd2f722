"""Trace sessions end to end without root: a real Collector, simulated tracers (tests/helpers/sim_tracer.py)
whose CRI relay answers from an in-process runtime per node (tests/helpers/cri_fake.py), and a
client for the four trace RPCs, all over real loopback gRPC."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from ghostgpu.collector.cri_fetch import CriCallError, direct_transport
from ghostgpu.collector.main import Collector
from ghostgpu.collector.trace_commands import TraceTiming

from ghostgpu.v1 import trace_pb2
from tests.helpers.collector_env import QueryClient, running_collector
from tests.helpers.cri_fake import FakeCri
from tests.helpers.sim_tracer import CriAnswer, SimTracer

# Deadlines, re-resolution and waits short enough for tests; the defaults are seconds.
FAST = TraceTiming(tick_s=0.02, end_grace_s=0.5, reresolve_s=0.05, command_timeout_s=1.0)
TRACE_CAPS = ("cri-relay", "trace")


def cri_via(fake: FakeCri) -> CriAnswer:
    """A sim tracer's CRI relay answered by a fake runtime over its real socket."""
    transport = direct_transport(fake.endpoint)

    def answer(method: str, request: bytes) -> tuple[int, str, bytes]:
        try:
            return 0, "", transport(method, request, 5.0)
        except CriCallError as e:
            return e.code.value[0], e.message, b""

    return answer


class TraceClient(QueryClient):
    """QueryClient plus the trace RPCs."""

    def start(self, duration_ms: int = 60_000, max_records: int = 0, **scope: Any) -> trace_pb2.TraceSession:
        req = trace_pb2.StartTraceRequest(scope=trace_pb2.TraceScope(**scope), duration_ms=duration_ms,
                                          max_records=max_records)
        return self.stub.StartTrace(req, metadata=self.metadata, timeout=15).session

    def start_error(self, duration_ms: int = 60_000, max_records: int = 0, **scope: Any) -> tuple[Any, str]:
        """(code, details) of a StartTrace that must fail."""
        try:
            s = self.start(duration_ms, max_records, **scope)
        except grpc.RpcError as e:
            return e.code(), e.details()  # type: ignore[attr-defined]
        raise AssertionError(f"StartTrace {scope} succeeded: {s}")

    def stop(self, sid: str) -> trace_pb2.TraceSession:
        req = trace_pb2.StopTraceRequest(id=sid)
        return self.stub.StopTrace(req, metadata=self.metadata, timeout=15).session

    def sessions(self) -> list[trace_pb2.TraceSession]:
        req = trace_pb2.ListTracesRequest()
        return list(self.stub.ListTraces(req, metadata=self.metadata, timeout=10).sessions)

    def session(self, sid: str) -> trace_pb2.TraceSession:
        return next(s for s in self.sessions() if s.id == sid)

    def watch(self, sid: str, follow: bool = True, timeout_s: float = 20.0) -> Any:
        req = trace_pb2.WatchTraceRequest(id=sid, follow=follow)
        return self.stub.WatchTrace(req, metadata=self.metadata, timeout=timeout_s)

    def show(self, sid: str) -> tuple[list[trace_pb2.TraceRecord], trace_pb2.TraceSession]:
        """What `ghostgpu trace show` gets: every stored record and the session."""
        records: list[trace_pb2.TraceRecord] = []
        last = None
        for msg in self.watch(sid, follow=False):
            records.extend(msg.records)
            last = msg.session
        assert last is not None
        return records, last


@dataclass
class TraceCluster:
    collector: Collector
    client: TraceClient
    cri: dict[str, FakeCri] = field(default_factory=dict)  # node -> its runtime
    tracers: dict[str, SimTracer] = field(default_factory=dict)

    def connect(self, node: str, capabilities: Sequence[str] = TRACE_CAPS, **kw: Any) -> SimTracer:
        """A sim tracer for `node` (its runtime made on first use), connected."""
        if node not in self.cri:
            self.cri[node] = FakeCri().start()
        t = self.tracers[node] = SimTracer(self.collector.address, node, cri=cri_via(self.cri[node]),
                                           capabilities=capabilities, **kw)
        t.connect()
        return t

    def pod(self, node: str, namespace: str, pod: str, containers: dict[str, str], **kw: Any) -> None:
        """A pod on the node's runtime: container name -> id."""
        fake = self.cri[node] if node in self.cri else self.cri.setdefault(node, FakeCri().start())
        sandbox = f"sb-{namespace}-{pod}"
        fake.add_sandbox(sandbox, pod, namespace, f"uid-{pod}")
        for name, cid in containers.items():
            fake.add_container(cid, sandbox, name, **kw)


@contextlib.contextmanager
def trace_cluster(tmp_path: Path, limits: TraceTiming = FAST, **collector_kw: Any) -> Iterator[TraceCluster]:
    with running_collector(tmp_path, trace_timing=limits, **collector_kw) as c, TraceClient(c.address) as q:
        cluster = TraceCluster(c, q)
        try:
            yield cluster
        finally:
            for t in cluster.tracers.values():
                t.stop()
            for fake in cluster.cri.values():
                fake.close()
