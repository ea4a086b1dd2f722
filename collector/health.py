"""The collector's probes, served beside /metrics on --metrics-listen: `/healthz` and `/readyz`.

    health = CollectorHealth(store, loop=lambda: collector.loop, serving=is_serving, leases=leases)
    routes = {"/metrics": metrics.handle, **health.routes()}
    HttpServer(listen, routes, open_paths=PROBE_PATHS, ...)

- /healthz (liveness): 200 while the collector's event loop runs what it is handed. Each probe hands
  the loop a stamp to set (call_soon_threadsafe) and reads whether the previous probe's came back: a
  stamp asked for more than LIVE_WINDOW_S ago and never set is a wedged loop (503 naming how long),
  and kubelet restarts the pod. A database out of reach is no reason to restart: liveness ignores it.
- /readyz (readiness): 200 while the collector serves and its store takes writes; 503 with one line
  per reason otherwise: starting or stopping, the database out of reach ("store: database out of
  reach for 12 s (--store postgresql://...)": the store retries and acknowledges nothing meanwhile,
  so a Service sends no new tracer here), no lease renewal reaching it for a --lease-ttl (a quiet
  replica: no write to fail), or a write that failed for good.

Both are answered on the HTTP server's own loop thread (its inline paths: never behind a slow
scrape) and read a few attributes only; with a web config they need no credentials (kubelet's probes
cannot send any), as the tracer's (tracer/health.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from ghostgpu.common.web.httpserve import Request, Response, probe_routes

LIVE_WINDOW_S = 30.0  # the loop wakes every second (FINDINGS_FLUSH_S); 30 s without running is wedged
PROBE_PATHS = ("/healthz", "/readyz")  # kubelet probes: no credentials needed (TLS still applies)


class StoreReach(Protocol):
    """What the probes read of collector/store.py's Store."""

    db_down_since: float | None  # time.monotonic() the database went out of reach

    @property
    def failed(self) -> BaseException | None: ...

    @property
    def url(self) -> _Flagged: ...


class _Flagged(Protocol):
    @property
    def flag(self) -> str: ...


class LeaseClock(Protocol):
    """What the probes read of collector/leases.py's Leases."""

    ttl_s: float
    renewed_mono: float  # time.monotonic() of the last renewal that reached the database


class CollectorHealth:
    """The probes' state; every method runs on the HTTP server's loop thread except _answered."""

    def __init__(self, store: StoreReach, *, loop: Callable[[], asyncio.AbstractEventLoop | None],
                 serving: Callable[[], bool], leases: LeaseClock | None = None,
                 clock: Callable[[], float] = time.monotonic, live_window_s: float = LIVE_WINDOW_S) -> None:
        """loop: the collector's event loop once it runs (Collector.loop); serving: True while it serves
        gRPC (started, not stopping); leases: this replica's Leases, whose renewals reach the database
        every ttl/3 even when no event is written (the store's writes alone would not notice a
        database lost while nothing is ingested)."""
        self.store = store
        self.leases = leases
        self._loop, self._serving = loop, serving
        self._clock = clock
        self.live_window_s = live_window_s
        self._asked_s: float | None = None  # when the pending stamp was handed to the loop
        self._answered_s: float | None = None  # when the loop last set a stamp (on the loop)

    def _answered(self) -> None:
        self._answered_s = self._clock()  # one float store: the probe thread reads before or after

    def liveness(self) -> tuple[bool, str]:
        loop = self._loop()
        if loop is None or loop.is_closed() or not self._serving():
            return True, "ok: the collector is starting or stopping"
        now = self._clock()
        asked, answered = self._asked_s, self._answered_s
        pending = asked is not None and (answered is None or answered < asked)
        if pending and asked is not None and now - asked > self.live_window_s:
            return False, (f"collector loop has not run for {now - asked:.1f} s (limit "
                           f"{self.live_window_s:g} s): wedged, e.g. in a blocking call on the event loop")
        if not pending:
            self._asked_s = now
            try:
                loop.call_soon_threadsafe(self._answered)
            except RuntimeError:  # closed between the check and the call: stopping
                return True, "ok: the collector is stopping"
        if answered is None:
            return True, "ok: collector loop asked to answer (first probe)"
        return True, f"ok: collector loop answered {now - answered:.1f} s ago"

    def readiness(self) -> tuple[bool, list[str]]:
        lines = []
        if not self._serving():
            lines.append("collector: not serving (starting, or stopping)")
        store = self.store
        failed = store.failed
        down_since = store.db_down_since
        if failed is not None:
            lines.append(f"store: {failed}")
        elif down_since is not None:
            down_s = max(0.0, self._clock() - down_since)
            lines.append(f"store: database out of reach for {down_s:.0f} s ({store.url.flag})")
        elif (leases := self.leases) is not None and self._clock() - leases.renewed_mono > leases.ttl_s:
            # Renewals that fail never set db_down_since (that is the writes' retry loop): a quiet
            # replica learns of a lost database here.
            since_s = self._clock() - leases.renewed_mono
            lines.append(f"store: no lease renewal reached the database for {since_s:.0f} s "
                         f"({store.url.flag}; --lease-ttl {leases.ttl_s:g})")
        if lines:
            return False, lines
        return True, ["ok: serving; the store takes writes"]

    def routes(self) -> dict[str, Callable[[Request], Response]]:
        return probe_routes(self.liveness, self.readiness)
