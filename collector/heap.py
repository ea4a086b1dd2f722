"""The collector's garbage-collection policy: freeze the long-lived heap, sweep it once an hour.

A collector for 1,000 nodes keeps about half a million tracked objects (consumers, CRI answers,
rendered /metrics lines) alive for as long as their nodes run. CPython 3.11's full (generation 2)
collection walks all of them: 62-96 ms with the event loop stopped on this project's 2-core VM
(bench/bench_metrics_scrape.py --no-heap-policy, bench/results/metrics_scrape_no_heap_policy.json),
so the ack of every stream and the scrape that happen to meet it wait
that long. Every `freeze_s` the loop moves what survived into the permanent generation
(gc.freeze(), a list splice), so later collections walk only what was allocated since: the same
bench then saw full collections of 3-13 ms (bench/results/metrics_scrape.json). A frozen object is
never collected, so garbage cycles frozen with it would leak: each freeze therefore first runs a
full collection, which walks only what was allocated since the last freeze (frozen objects are
not traversed), so the garbage cycles of the last minute (a gRPC call's, a CRI failure's) are
freed instead of pinned. Before that, `ghostgpu up --demo` with 20 short-lived consumers a second
grew 5.7 MB/h in bench_churn.py's soak. Once every `thaw_s` everything is unfrozen and swept in
one full collection, for cycles that formed among frozen objects; that costs one long pause an
hour.

Only the long-running commands (`ghostgpu collector`, `ghostgpu up`) install it: gc state is
process-wide and an embedded collector (tests, benchmarks) must not change its host's.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

FREEZE_S = 60.0
THAW_S = 3600.0


class HeapPolicy:
    """tick() from the collector's loop (about once a second); the gc calls are injectable for tests."""

    def __init__(self, freeze_s: float = FREEZE_S, thaw_s: float = THAW_S, *,
                 clock: Callable[[], float] = time.monotonic,
                 freeze: Callable[[], None] = gc.freeze, unfreeze: Callable[[], None] = gc.unfreeze,
                 collect: Callable[[], int] = gc.collect,
                 collect_unfrozen: Callable[[], int] = gc.collect) -> None:
        if freeze_s <= 0 or thaw_s < freeze_s:
            raise ValueError(f"heap policy: freeze_s {freeze_s} must be > 0 and thaw_s {thaw_s} >= it")
        self.freeze_s, self.thaw_s = freeze_s, thaw_s
        self._clock, self._freeze, self._unfreeze, self._collect = clock, freeze, unfreeze, collect
        # The same gc.collect: once the heap is frozen it walks only the objects allocated since.
        self._collect_unfrozen = collect_unfrozen
        now = clock()
        self._next_freeze = now + freeze_s
        self._next_thaw = now + thaw_s
        self.freezes_total = 0
        self.thaws_total = 0
        self.last_thaw_s = 0.0  # how long the last hourly sweep stopped the loop

    def tick(self) -> None:
        now = self._clock()
        if now >= self._next_thaw:
            started = time.perf_counter()
            self._unfreeze()
            self._collect()
            self.last_thaw_s = time.perf_counter() - started
            self.thaws_total += 1
            self._next_thaw = now + self.thaw_s
            self._next_freeze = now + self.freeze_s
            log.debug("heap: hourly sweep took %.0f ms", self.last_thaw_s * 1000)
        elif now >= self._next_freeze:
            self._collect_unfrozen()  # never freeze the last minute's garbage cycles with the heap
            self._freeze()
            self.freezes_total += 1
            self._next_freeze = now + self.freeze_s
