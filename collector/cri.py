"""CRI resolution for the collector: (node, container ID) -> K8sInfo, cached, never blocking.

`CriResolver.get()` answers from the cache at once. A container it has not seen yet answers
`unresolved` ("CRI lookup pending") while one background fetch runs for it, however many events
ask meanwhile (single flight per (node, container ID)); `on_change(node, container_id)` fires
when a fetch changes the answer, so the collector re-enriches that node's consumers. Answers live
`ttl_s` (30 s), unknown containers `negative_ttl_s` (5 s); an expired answer is still served while
its refresh runs, so names do not flicker. CRI unreachable: the answer is `unresolved` with the
error (keeping the names last seen), retried with backoff (0.5 s doubling to 10 s) until CRI
answers. `keep(node, container_id)` keeps a container's answer fresh by itself: the cluster table
calls it when the container's first consumer comes, and the answer is fetched again every ttl_s
from then on (a container stopped under a holder that outlives it turns it orphaned within ttl_s,
though nothing on its node changes); `forget(node, container_id)` drops the answer, and the keeping
with it: the cluster table calls it a while after the container's last consumer is gone
(collector/cluster.py), as a node that runs short-lived jobs brings a new container ID with every
one. The fetch procedure itself is collector/cri_fetch.py.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import random
import threading
import time
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import grpc
from ghostgpu.collector.cri_fetch import (
    READ_ONLY_METHODS,
    CriCallError,
    CriClient,
    CriTransport,
    direct_transport,
    fetch_k8s_info,
    normalize_container_id,
)
from ghostgpu.collector.enrich import NO_CONTAINER

from ghostgpu.common.model.consumers import K8sInfo

__all__ = ["READ_ONLY_METHODS", "CriCallError", "CriResolver", "CriStats", "CriTransport", "direct_transport"]

log = logging.getLogger(__name__)

PENDING_ERROR = "CRI lookup pending"
_PENDING = K8sInfo(resolution="unresolved", error=PENDING_ERROR)  # frozen: one shared by every new entry
# Upper bounds (le) of the call latency histogram: a relayed call on a quiet node answers in 1-5 ms, a
# busy runtime in tens of ms; call_timeout_s (5 s) is the last finite bound.
CALL_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass(frozen=True)
class CriStats:
    """Counters for NodeStatus and metrics (totals since the resolver started)."""

    calls_total: int = 0  # CRI calls made (every method)
    failures_total: int = 0  # calls that did not answer (NOT_FOUND is an answer)
    cache_hits_total: int = 0  # get() answered by a fresh cache entry
    cache_misses_total: int = 0  # get() for a container not in the cache
    fetches_total: int = 0  # lookups run (each is one or more calls)
    last_call_latency_s: float = 0.0
    last_fetch_latency_s: float = 0.0
    call_seconds_total: float = 0.0  # summed latency of every call (mean = this / calls_total)
    fetch_seconds_total: float = 0.0  # summed latency of every lookup (mean = this / fetches_total)
    cached: int = 0  # entries in the cache now
    pending: int = 0  # lookups due (queued or running) now
    failures_by_node: dict[str, int] = field(default_factory=dict)
    # Cumulative counts of calls that took at most CALL_LATENCY_BUCKETS_S[i] seconds (a Prometheus
    # histogram's buckets; +Inf is calls_total and the sum is call_seconds_total).
    call_latency_bucket_counts: tuple[int, ...] = (0,) * len(CALL_LATENCY_BUCKETS_S)


@dataclass
class _Entry:
    info: K8sInfo
    expires_at: float = 0.0  # monotonic; the answer is fresh before it (0: never fresh)
    queued: bool = False  # a fetch is scheduled or running: nobody schedules another
    ticket: int = 0  # which heap item is this entry's live one
    failures: int = 0  # consecutive transport failures, for the retry backoff
    last_read: float = 0.0
    kept: bool = False  # keep(): fetched again every ttl by itself, never dropped as idle


class CriResolver:
    """Resolves container IDs through each node's CRI transport; see the module docstring."""

    def __init__(
        self,
        transport_for: Callable[[str], CriTransport | None],
        on_change: Callable[[str, str], None],
        ttl_s: float,  # --cri-ttl-s (collector/config.py)
        negative_ttl_s: float = 5.0,
        *,
        workers: int = 4,
        max_entries: int = 100_000,
        call_timeout_s: float = 5.0,
        retry_initial_s: float = 0.5,
        retry_max_s: float = 10.0,
        idle_drop_s: float = 600.0,
    ) -> None:
        if ttl_s <= 0 or negative_ttl_s <= 0 or workers < 1 or max_entries < 1:
            raise ValueError("CriResolver: ttl_s, negative_ttl_s must be > 0; workers, max_entries >= 1")
        self.transport_for = transport_for
        self.on_change = on_change
        self.ttl_s, self.negative_ttl_s = ttl_s, negative_ttl_s
        self.max_entries = max_entries
        self.call_timeout_s = call_timeout_s
        self.retry_initial_s, self.retry_max_s = retry_initial_s, retry_max_s
        self.idle_drop_s = idle_drop_s
        self._cond = threading.Condition()
        self._cache: OrderedDict[tuple[str, str], _Entry] = OrderedDict()  # LRU order
        self._heap: list[tuple[float, int, tuple[str, str]]] = []  # (due, ticket, key)
        self._tickets = itertools.count(1)
        self._runtime: dict[str, str] = {}  # node -> "containerd 1.6.20" (Version, once per node)
        self._version_locks: dict[str, threading.Lock] = {}
        self._closed = False
        self._hits = self._misses = self._fetches = self._calls = self._failures = 0
        self._node_failures: dict[str, int] = {}
        self._call_buckets = [0] * (len(CALL_LATENCY_BUCKETS_S) + 1)  # per bucket, the last is past 5 s
        self._last_call_s = self._last_fetch_s = self._call_total_s = self._fetch_total_s = 0.0
        self._threads = [threading.Thread(target=self._work, name=f"cri-resolver-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    # ---- the collector's side -------------------------------------------------------------

    def get(self, node: str, container_id: str) -> K8sInfo:
        """The cached answer for a container, or `unresolved` while its one lookup runs."""
        cid = normalize_container_id(container_id)
        if not cid:
            return NO_CONTAINER
        key = (node, cid)
        now = time.monotonic()
        with self._cond:
            entry = self._cache.get(key)
            if entry is None:
                self._misses += 1
                entry = self._cache[key] = _Entry(_PENDING)
                self._schedule(key, entry, now)
                while len(self._cache) > self.max_entries:
                    self._cache.popitem(last=False)  # a queued fetch of an evicted entry is skipped
            else:
                self._cache.move_to_end(key)
                if now < entry.expires_at:
                    self._hits += 1
                elif not entry.queued:
                    self._schedule(key, entry, now)  # expired: refresh, serve the old answer meanwhile
            entry.last_read = now
            return entry.info

    def keep(self, node: str, container_id: str) -> None:
        """Keep the container's answer fresh without anyone asking (a GPU holder is in it): fetched
        now if it has none, then again as each answer expires, until forget()."""
        cid = normalize_container_id(container_id)
        if not cid:
            return
        key = (node, cid)
        now = time.monotonic()
        with self._cond:
            entry = self._cache.get(key)
            if entry is None:
                entry = self._cache[key] = _Entry(_PENDING)
                while len(self._cache) > self.max_entries:
                    self._cache.popitem(last=False)
            entry.kept = True
            entry.last_read = now
            if not entry.queued:
                self._schedule(key, entry, max(now, entry.expires_at))

    def forget(self, node: str, container_id: str) -> None:
        """Drop the answer for a container nobody holds a GPU in any more (a lookup in flight for it
        is discarded when it ends, a queued one skipped); the next get() looks it up afresh."""
        with self._cond:
            self._cache.pop((node, normalize_container_id(container_id)), None)

    def runtime(self, node: str) -> str:
        """The node's runtime as Version() named it, "" before the first answer."""
        with self._cond:
            return self._runtime.get(node, "")

    def stats(self) -> CriStats:
        now = time.monotonic()
        with self._cond:
            return CriStats(
                calls_total=self._calls, failures_total=self._failures, cache_hits_total=self._hits,
                cache_misses_total=self._misses, fetches_total=self._fetches,
                last_call_latency_s=self._last_call_s, last_fetch_latency_s=self._last_fetch_s,
                call_seconds_total=self._call_total_s, fetch_seconds_total=self._fetch_total_s,
                cached=len(self._cache),
                # a kept answer's next refresh, queued while the answer is fresh, is not due yet
                pending=sum(1 for e in self._cache.values() if e.queued and e.expires_at <= now),
                failures_by_node=dict(self._node_failures),
                call_latency_bucket_counts=tuple(itertools.accumulate(self._call_buckets[:-1])),
            )

    def node_failures(self, node: str) -> int:
        """CRI calls for `node` that did not answer (TracerStatus.cri_failures_total)."""
        with self._cond:
            return self._node_failures.get(node, 0)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the workers; a lookup in flight finishes (bounded by call_timeout_s) and is dropped."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout_s)

    def __enter__(self) -> CriResolver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the workers ----------------------------------------------------------------------

    def _schedule(self, key: tuple[str, str], entry: _Entry, due: float) -> None:
        """Under the lock: queue one fetch of `key` at monotonic time `due`."""
        entry.queued = True
        entry.ticket = next(self._tickets)
        heapq.heappush(self._heap, (due, entry.ticket, key))
        self._cond.notify()

    def _next(self) -> tuple[tuple[str, str], _Entry] | None:
        """Wait for the next due fetch; None once closed."""
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                if self._heap and self._heap[0][0] <= now:
                    _, ticket, key = heapq.heappop(self._heap)
                    entry = self._cache.get(key)
                    if entry is None or entry.ticket != ticket:
                        continue  # evicted or forgotten since it was queued
                    if not entry.kept and now - entry.last_read > self.idle_drop_s:
                        del self._cache[key]  # nobody asked for it in a long while: stop retrying
                        continue
                    return key, entry
                self._cond.wait(self._heap[0][0] - now if self._heap else None)
            return None

    def _work(self) -> None:
        while (job := self._next()) is not None:
            key, entry = job
            try:
                self._resolve(key, entry)
            except Exception:  # a bug must not kill a worker: log it, retry the entry later
                log.exception("CRI lookup of container %s on node %s failed", key[1], key[0])
                with self._cond:
                    if self._cache.get(key) is entry:
                        self._schedule(key, entry, time.monotonic() + self.retry_max_s)

    def _client(self, node: str, transport: CriTransport) -> CriClient:
        def on_call(method: str, latency_s: float, ok: bool) -> None:
            with self._cond:
                self._calls += 1
                self._last_call_s = latency_s
                self._call_total_s += latency_s
                self._call_buckets[bisect_left(CALL_LATENCY_BUCKETS_S, latency_s)] += 1
                if not ok:
                    self._failures += 1
                    self._node_failures[node] = self._node_failures.get(node, 0) + 1

        return CriClient(transport, self.call_timeout_s, on_call)

    def _node_runtime(self, node: str, client: CriClient) -> str:
        """Version() once per node (single flight per node too); "" if the runtime will not say."""
        with self._cond:
            if node in self._runtime:
                return self._runtime[node]
            lock = self._version_locks.setdefault(node, threading.Lock())
        with lock:
            with self._cond:
                if node in self._runtime:
                    return self._runtime[node]
            try:
                runtime = client.version()
            except CriCallError as e:
                if e.code != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                runtime = ""
            with self._cond:
                self._runtime[node] = runtime
            return runtime

    def _fetch(self, node: str, cid: str, early: Callable[[K8sInfo], None] | None = None,
               ) -> K8sInfo | CriCallError:
        transport = self.transport_for(node)
        if transport is None:
            return CriCallError(grpc.StatusCode.UNAVAILABLE,
                                f"no CRI path to node {node}: its tracer offers no cri-relay and the "
                                "collector has no --collector-cri-endpoint")
        client = self._client(node, transport)
        try:
            return fetch_k8s_info(client, cid, self._node_runtime(node, client), early)
        except CriCallError as e:
            with self._cond:
                self._runtime.pop(node, None)  # the runtime may come back upgraded: ask again
            return e

    def _publish_early(self, key: tuple[str, str], entry: _Entry, info: K8sInfo) -> None:
        """Names known before the sandbox check: show them now; the lookup goes on and may add more."""
        with self._cond:
            # Only a first answer: a refresh of a resolved entry keeps its complete answer until the
            # new one is complete too, so names never flicker.
            if self._cache.get(key) is not entry or entry.info.resolution == "resolved" or entry.info == info:
                return
            entry.info = info
        try:
            self.on_change(*key)
        except Exception:
            log.exception("CRI on_change callback failed for container %s on node %s", key[1], key[0])

    def _resolve(self, key: tuple[str, str], entry: _Entry) -> None:
        node, cid = key
        start = time.monotonic()
        result = self._fetch(node, cid, lambda info: self._publish_early(key, entry, info))
        now = time.monotonic()
        with self._cond:
            self._fetches += 1
            self._last_fetch_s = now - start
            self._fetch_total_s += now - start
            if self._cache.get(key) is not entry:
                return  # evicted or forgotten meanwhile: nobody wants this answer
            old = entry.info
            if isinstance(result, CriCallError):
                error = f"CRI unreachable for node {node}: {result}"
                entry.info = replace(old, resolution="unresolved", error=error)
                entry.expires_at = 0.0
                delay_s = min(self.retry_initial_s * (2 ** entry.failures), self.retry_max_s)
                entry.failures += 1
                self._schedule(key, entry, now + delay_s * random.uniform(0.9, 1.1))
            else:
                entry.info = result
                entry.failures = 0
                entry.queued = False
                ttl_s = self.negative_ttl_s if result.resolution == "not_found" else self.ttl_s
                entry.expires_at = now + ttl_s
                if entry.kept:  # its next fetch is due as this answer expires
                    self._schedule(key, entry, entry.expires_at)
            changed = entry.info != old
        if changed:
            try:
                self.on_change(node, cid)
            except Exception:
                log.exception("CRI on_change callback failed for container %s on node %s", cid, node)
