"""collector/heap.py: the freeze/sweep schedule, on an injected clock and injected gc calls."""

from __future__ import annotations

import pytest
from ghostgpu.collector.heap import HeapPolicy


class FakeGc:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.now = 0.0

    def policy(self, freeze_s: float = 60.0, thaw_s: float = 3600.0) -> HeapPolicy:
        return HeapPolicy(freeze_s, thaw_s, clock=lambda: self.now,
                          freeze=lambda: self.calls.append("freeze"),
                          unfreeze=lambda: self.calls.append("unfreeze"),
                          collect=lambda: self.calls.append("collect") or 0,
                          collect_unfrozen=lambda: self.calls.append("collect new") or 0)


@pytest.mark.parametrize(("ticks_at_s", "expected"), [
    ([1.0, 30.0, 59.9], []),  # nothing before the first minute
    ([60.0], ["collect new", "freeze"]),  # the minute's garbage goes before the survivors are frozen
    ([60.0, 61.0, 119.0], ["collect new", "freeze"]),  # once a minute, however often the loop ticks
    ([60.0, 120.0, 180.0], ["collect new", "freeze"] * 3),
    ([3600.0], ["unfreeze", "collect"]),  # the hourly sweep, not a freeze, at the hour
    # freezing starts again a minute later
    ([3600.0, 3659.0, 3660.0], ["unfreeze", "collect", "collect new", "freeze"]),
    ([3600.0, 7200.0], ["unfreeze", "collect"] * 2),
])
def test_schedule(ticks_at_s: list[float], expected: list[str]) -> None:
    gc = FakeGc()
    policy = gc.policy()
    for t in ticks_at_s:
        gc.now = t
        policy.tick()
    assert gc.calls == expected
    assert policy.freezes_total == expected.count("freeze")
    assert policy.thaws_total == expected.count("collect")


def test_a_loop_that_stalled_past_both_deadlines_sweeps_once() -> None:
    gc = FakeGc()
    policy = gc.policy()
    gc.now = 10_000.0
    policy.tick()
    policy.tick()
    assert gc.calls == ["unfreeze", "collect"]


@pytest.mark.parametrize(("freeze_s", "thaw_s"), [(0.0, 10.0), (-1.0, 10.0), (60.0, 30.0)])
def test_bad_intervals_are_refused(freeze_s: float, thaw_s: float) -> None:
    with pytest.raises(ValueError, match="heap policy"):
        HeapPolicy(freeze_s, thaw_s)


def test_a_garbage_cycle_of_the_last_minute_is_freed_not_frozen() -> None:
    """The leak the soak found: a reference cycle that became garbage between two gen-0 passes (a
    gRPC call's, a failed CRI call's) was frozen with the live heap and kept for up to an hour."""
    import gc as real_gc
    import weakref

    class Node:
        pass

    now = [0.0]
    policy = HeapPolicy(1.0, 3600.0, clock=lambda: now[0])
    real_gc.disable()  # no automatic pass may free it first: only the policy's own collection
    try:
        a, b = Node(), Node()
        a.peer, b.peer = b, a  # type: ignore[attr-defined]
        alive = weakref.ref(a)
        del a, b
        now[0] = 1.0
        policy.tick()
        assert alive() is None and policy.freezes_total == 1
    finally:
        real_gc.enable()
        real_gc.unfreeze()


def test_real_gc_freeze_and_sweep_round_trip() -> None:
    """The defaults call the real gc functions: after a sweep nothing stays frozen."""
    import gc as real_gc

    now = [0.0]
    policy = HeapPolicy(1.0, 2.0, clock=lambda: now[0])
    try:
        now[0] = 1.0
        policy.tick()
        assert real_gc.get_freeze_count() > 0
        now[0] = 2.0
        policy.tick()
        assert real_gc.get_freeze_count() == 0 and policy.last_thaw_s > 0
    finally:
        real_gc.unfreeze()
