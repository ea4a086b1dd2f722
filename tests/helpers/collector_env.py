"""A real collector in the test process, and a query client for it (real gRPC on loopback/unix)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ghostgpu.collector.config import CollectorConfig
from ghostgpu.collector.main import Collector

from ghostgpu.common.transport.dial import open_channel
from ghostgpu.common.transport.tls import TlsFiles
from ghostgpu.common.wire.protocol import API_VERSION, API_VERSION_METADATA, channel_options
from ghostgpu.v1 import query_pb2, query_pb2_grpc

# Collector's keywords that are collaborators, not settings (CollectorConfig holds those).
COLLABORATORS = ("resolver_factory", "pusher_factory", "heap", "trace_timing", "security")


@contextlib.contextmanager
def running_collector(tmp_path: Path, db_name: str = "collector.db", unix: bool = False,
                      **kwargs: Any) -> Iterator[Collector]:
    """A started Collector on 127.0.0.1:0 (and a unix socket in tmp_path when unix=True); kwargs are
    CollectorConfig's settings and Collector's collaborators."""
    listen = ("127.0.0.1:0",) + ((f"unix://{tmp_path}/collector.sock",) if unix else ())
    parts = {k: kwargs.pop(k) for k in COLLABORATORS if k in kwargs}
    c = Collector(CollectorConfig(listen=listen, db_path=str(tmp_path / db_name), **kwargs), **parts).start()
    try:
        yield c
    finally:
        c.stop(grace_s=0.5)


class QueryClient:
    """The Query service's stub with the API-version metadata on every call."""

    def __init__(self, target: str, api_version: int | None = API_VERSION,
                 tls: TlsFiles | None = None) -> None:
        self.channel = open_channel(target, tls, channel_options())  # mTLS with `tls`
        self.stub = query_pb2_grpc.QueryStub(self.channel)
        self.metadata = [] if api_version is None else [(API_VERSION_METADATA, str(api_version))]

    def consumers(self, **filters: Any) -> list[query_pb2.ClusterConsumer]:
        req = query_pb2.ListConsumersRequest(**filters)
        return list(self.stub.ListConsumers(req, metadata=self.metadata, timeout=10).consumers)

    def findings(self, **filters: Any) -> list[query_pb2.Finding]:
        req = query_pb2.ListFindingsRequest(**filters)
        return list(self.stub.ListFindings(req, metadata=self.metadata, timeout=10).findings)

    def status(self, node: str = "") -> list[query_pb2.TracerStatus]:
        req = query_pb2.NodeStatusRequest(node=node)
        return list(self.stub.NodeStatus(req, metadata=self.metadata, timeout=10).nodes)

    def node(self, node: str) -> query_pb2.TracerStatus:
        return self.status(node)[0]

    def events(self, **filters: Any) -> list[query_pb2.StoredEvent]:
        req = query_pb2.ListEventsRequest(**filters)
        return list(self.stub.ListEvents(req, metadata=self.metadata, timeout=10).events)

    def watch(self, **filters: Any) -> Any:
        return self.stub.WatchFindings(query_pb2.WatchFindingsRequest(**filters), metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> QueryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
