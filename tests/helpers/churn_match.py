"""Match the tracer's records (and the collector's findings) to churn lifetimes (tests/helpers/churn.py).

PIDs come back within a run (pid_max is 32,768 on many nodes and a bench forks 20,000 holders),
so a record names a lifetime by (pid, time): the latest lifetime of that PID forked before the
record's own boot-clock time. Event records carry `ts_ns` (the kernel's CLOCK_BOOTTIME stamp, or
the /proc scan's; an exit's `held_s` back from it); finding records carry `first_seen_ns`, when the
hold was first seen, which lies inside the lifetime. A record of another process that got the PID
later is told apart by its container id or comm where the tracer could read them.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tests.helpers.churn import COMM, Lifetime

Record = dict[str, Any]

# The classes that open a finding ("non-visible" in docs/METRICS.md); `pending` and `unknown` never do.
NON_VISIBLE = frozenset({"hidden", "ghost", "orphaned", "unallocated", "unattributed"})
ERRORS_METRIC = "ghostgpu_agent_errors_total"


def wall_to_boot_offset_ns() -> int:
    """CLOCK_REALTIME - CLOCK_BOOTTIME now: turns a record's wall `ts` into boot ns (± a few µs)."""
    return time.time_ns() - time.clock_gettime_ns(time.CLOCK_BOOTTIME)


@dataclass
class Seen:
    """What was reported about one lifetime."""

    life: Lifetime
    opens: list[Record] = field(default_factory=list)
    exits: list[Record] = field(default_factory=list)
    findings: list[Record] = field(default_factory=list)  # non-visible ones only


class Matcher:
    """Lifetimes by PID, sorted by fork time; `add` files a record under its lifetime."""

    def __init__(self, lifetimes: Iterable[Lifetime], offset_ns: int | None = None) -> None:
        self.seen: dict[tuple[int, int], Seen] = {}
        self._by_pid: dict[int, list[Lifetime]] = {}
        for life in sorted(lifetimes, key=lambda lf: lf.fork_ns):
            self.seen[life.key] = Seen(life)
            self._by_pid.setdefault(life.pid, []).append(life)
        self._forks = {pid: [lf.fork_ns for lf in lives] for pid, lives in self._by_pid.items()}
        self.offset_ns = wall_to_boot_offset_ns() if offset_ns is None else offset_ns
        self.foreign = 0  # records of a PID of ours that belong to some other process

    def lifetime(self, rec: Record) -> Lifetime | None:
        lives = self._by_pid.get(rec.get("pid"))  # type: ignore[arg-type]
        if not lives:
            return None
        when = record_boot_ns(rec, self.offset_ns)
        if when is None:
            return None
        i = bisect.bisect_right(self._forks[lives[0].pid], when) - 1
        if i < 0:
            return None
        life = lives[i]
        cid, comm = rec.get("container_id") or "", rec.get("comm") or ""
        if (cid and cid != life.container_id) or (comm and comm != COMM):
            self.foreign += 1
            return None
        return life

    def add(self, rec: Record) -> Lifetime | None:
        kind = rec.get("event")
        if kind not in ("open", "exit", "finding"):
            return None
        if kind == "open" and rec.get("device_kind") not in ("gpu", None):
            return None  # only /dev/nvidia0 is opened; anything else is not ours
        if kind == "finding" and rec.get("class") not in NON_VISIBLE:
            return None
        life = self.lifetime(rec)
        if life is None:
            return None
        seen = self.seen[life.key]
        {"open": seen.opens, "exit": seen.exits, "finding": seen.findings}[kind].append(rec)
        return life

    def add_all(self, records: Iterable[Record]) -> Matcher:
        for rec in records:
            self.add(rec)
        return self

    def missing(self, kind: str) -> list[Seen]:
        """Lifetimes with no record of `kind` ("open" or "exit")."""
        return [s for s in self.seen.values() if not (s.opens if kind == "open" else s.exits)]

    def with_findings(self) -> list[Seen]:
        return [s for s in self.seen.values() if s.findings]

    def wrong_identity(self) -> list[Seen]:
        """Container lifetimes whose open record does not name their container."""
        return [s for s in self.seen.values() if s.life.container_id and s.opens
                and all(r.get("container_id") != s.life.container_id for r in s.opens)]


def exit_lag_ms(seen: Seen, offset_ns: int) -> float | None:
    """ms from the reap to the first exit record about it: when a reader received it (`_arrival_ns`,
    boot ns, where the reader stamped one), else when the tracer wrote it (its wall `ts`). Negative
    when the tracer reported the exit before the launcher's waitpid() returned."""
    if not seen.exits:
        return None
    rec = seen.exits[0]
    if isinstance(rec.get("_arrival_ns"), int):
        return (rec["_arrival_ns"] - seen.life.reap_ns) / 1e6
    ts = rec.get("ts")
    return (float(ts) * 1e9 - offset_ns - seen.life.reap_ns) / 1e6 if isinstance(ts, int | float) else None


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of values; None for none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def record_boot_ns(rec: Record, offset_ns: int) -> int | None:
    """When a record happened on the boot clock: see the module doc."""
    if rec.get("event") in ("finding", "resolved"):
        if isinstance(rec.get("first_seen_ns"), int):
            return int(rec["first_seen_ns"])
    elif isinstance(rec.get("ts_ns"), int):
        # An exit says how long the holder held: its first sight is inside the lifetime even when
        # the exit itself was found by a /proc scan long after the PID went to another process.
        held_ns = int(float(rec["held_s"]) * 1e9) if isinstance(rec.get("held_s"), int | float) else 0
        return int(rec["ts_ns"]) - held_ns
    ts = rec.get("ts")
    return int(float(ts) * 1e9) - offset_ns if isinstance(ts, int | float) else None


def describe(seen: list[Seen], limit: int = 5) -> str:
    """A few examples for an assertion message: the lifetime and what was reported about it."""
    out = []
    for s in seen[:limit]:
        where = f"container {s.life.container_id[:12]}" if s.life.container_id else "host"
        recs = [f"{r.get('event')}/{r.get('source')}" for r in s.opens + s.exits]
        recs += [f"finding/{r.get('class')} ({str(r.get('reason'))[:70]})" for r in s.findings]
        out.append(f"pid {s.life.pid} ({where}, lived {(s.life.reap_ns - s.life.fork_ns) / 1e6:.1f} ms, "
                   f"status {s.life.status}): {recs or 'no record'}")
    return "; ".join(out) + (f"; ... {len(seen) - limit} more" if len(seen) > limit else "")


def metric_sum(text: str, name: str) -> float | None:
    """The sum over every label set of the samples called `name` in a /metrics page; None if absent."""
    from prometheus_client.parser import text_string_to_metric_families

    values = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]
    return sum(values) if values else None


def health_address(stderr_text: str) -> str | None:
    """HOST:PORT from the tracer's "ghostgpu: health: serving on HOST:PORT (...)" line."""
    for line in stderr_text.splitlines():
        if line.startswith("ghostgpu: health: serving on "):
            return line.removeprefix("ghostgpu: health: serving on ").split()[0]
    return None
