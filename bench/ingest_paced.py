#!/usr/bin/env python3
"""bench_ingest.py --paced: simulated tracers offering events at a steady rate, batched by the real
tracer's policy (tracer/stream.py), against the collector and the bare echo reference.

Each tracer's event i (0-based) is created at t0 + i / rate (t0 staggered across tracers). Its
sender (a coroutine: each client process runs its tracers on one grpc.aio event loop) follows
StreamSink._pump: pending events leave at once when nothing is in flight (every seq sent is
acknowledged), otherwise when `max_batch_events` are pending or 10 ms after the first pending event
was created, as long as fewer than WINDOW_BATCHES batches await their Ack; with the window full they
gather until an Ack frees it (the one time the sender wakes on an Ack, as the real one); a window
of 0 (bench_ingest.py --paced-window 0) is none: every due batch leaves, as before the tracer had
one. Events are encoded once per tracer as a pool of NodeEvent bodies without their seq; a send
prefixes each with its seq field and frames them as tracer.spool.encode_events_message does (same
bytes, checked at connect; varints from tables), so no protobuf work is done per event. Ack latency
runs from an event's creation to the arrival (client side) of the first Ack covering it. The
clients did not offer the rate, and no offered rate is reported, when the last event left more
than 0.1 s after the window or the senders woke more than 10 ms late (p99, `client_wake_late_ms`).

Client processes run this file: `ingest_paced.py client ADDR FIRST COUNT TRACERS RATE DURATION WINDOW`.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import CLK_TCK, ROOT, cpu_ticks, status_kib

PY = sys.executable
FLUSH_S = 0.010  # tracer/stream.py FLUSH_S (WINDOW_BATCHES is imported from there)
POOL = 1000  # distinct event bodies per tracer (a multiple of the finding period, 20)
LAT_RES = 1e5  # latency histogram buckets: 10 us
LATE_RES = 1e4  # wake-lateness buckets: 0.1 ms
LATE_SLACK_S = 0.1  # the last send may leave this long after the last event's creation


# ---- client side ---------------------------------------------------------------------------------


def _bodies(node: str) -> list[bytes]:
    """POOL NodeEvent bodies (holder events, a finding every 20th) with no seq field."""
    from ghostgpu.v1 import stream_pb2
    from tests.helpers.sim_tracer import synthetic_batches

    batch = stream_pb2.TracerMessage.FromString(synthetic_batches(node, 1, POOL)[0]).events
    out = []
    for ev in batch.events:  # seqs 1..POOL: body k serves seqs with seq % POOL == k % POOL
        ev.seq = 0
        out.append(ev.SerializeToString())
    return out[-1:] + out[:-1]  # index by seq % POOL


_VARINT: list[bytes] = []


def frame(pfx: list[bytes], bodies: list[bytes], lo: int, hi: int) -> bytes:
    """tracer.spool.encode_events_message([pfx[s] + bodies[s % POOL] for s in range(lo, hi)]), with
    the varints from a table: the tracers' encoding cost is theirs, not what the clients measure."""
    vi = _VARINT
    if not vi:
        from ghostgpu.tracer.spool import varint

        vi.extend(varint(n) for n in range(1 << 14))
    parts = []
    for s in range(lo, hi):
        p, b = pfx[s], bodies[s % POOL]
        parts.append(b"\x0a" + vi[len(p) + len(b)] + p + b)
    inner = b"".join(parts)
    n = len(inner)
    return b"\x12" + (vi[n] if n < len(vi) else _varint(n)) + inner


def _varint(n: int) -> bytes:
    from ghostgpu.tracer.spool import varint

    return varint(n)


class PacedTracer:
    """One simulated tracer on a grpc.aio stream (all of a client process's on one event loop, so
    that 25 tracers cost what 25 tracers' senders cost, not 75 threads fighting over one GIL)."""

    def __init__(self, addr: str, node: str) -> None:
        self.addr, self.node = addr, node
        self.acked_seq, self.max_batch = 0, 2000
        self.acks: list[tuple[float, int]] = []  # (arrival, seq), timestamped as each Ack is read
        self.batches: Counter[int] = Counter()
        self.late: Counter[int] = Counter()
        self.last_send = 0.0
        self.acked = asyncio.Event()
        self.ack_wake = asyncio.Event()  # every Ack: the sender waits on it while its window is full

    async def connect(self) -> None:
        import grpc

        from ghostgpu.common.wire.convert import consumer_to_proto
        from ghostgpu.common.wire.protocol import API_VERSION, API_VERSION_METADATA, channel_options
        from ghostgpu.v1 import stream_pb2
        from tests.helpers.sim_tracer import METHOD, make_consumer

        self.channel = grpc.aio.insecure_channel(self.addr, options=channel_options())
        stub = self.channel.stream_stream(METHOD, request_serializer=None,
                                          response_deserializer=stream_pb2.CollectorMessage.FromString)
        self.call = stub(metadata=[(API_VERSION_METADATA, str(API_VERSION))])
        hello = stream_pb2.Hello(api_version=API_VERSION, node=self.node, boot_id="sim-boot",
                                 instance_id=os.urandom(16).hex(), tracer_version="sim-paced")
        await self.call.write(stream_pb2.TracerMessage(hello=hello).SerializeToString())
        welcome = await asyncio.wait_for(self.call.read(), 60)
        if welcome is grpc.aio.EOF or welcome.WhichOneof("msg") != "welcome":
            raise SystemExit(f"bench: {self.node}: no Welcome from {self.addr}")
        self.max_batch = welcome.welcome.max_batch_events or self.max_batch
        consumers = [consumer_to_proto(make_consumer(self.node, 10_000 + j, gpu=j % 8,
                                                     container_id=f"{j:02x}" * 32)) for j in range(20)]
        snap = stream_pb2.Snapshot(seq=0, ts_unix_ns=time.time_ns(), consumers=consumers)
        await self.call.write(stream_pb2.TracerMessage(snapshot=snap).SerializeToString())
        self.bodies = _bodies(self.node)
        from ghostgpu.tracer.spool import encode_events_message, varint

        pfx = [b"\x08" + varint(s) for s in range(POOL + 2)]
        assert frame(pfx, self.bodies, 1, POOL + 2) == encode_events_message(
            [pfx[s] + self.bodies[s % POOL] for s in range(1, POOL + 2)])

    async def read(self, total: int) -> None:
        import grpc

        while (msg := await self.call.read()) is not grpc.aio.EOF:  # read(), as connect() did: no mixing
            if msg.WhichOneof("msg") == "ack":
                self.acks.append((time.monotonic(), msg.ack.seq))
                self.acked_seq = max(self.acked_seq, msg.ack.seq)
                self.ack_wake.set()
                if self.acked_seq >= total:
                    self.acked.set()

    async def pace(self, pfx: list[bytes], rate: float, total: int, t0: float, window_batches: int) -> None:
        """The tracer's sender (StreamSink._pump), window included (window_batches 0: no window)."""
        limit = window_batches if window_batches > 0 else float("inf")
        period, sent, bodies, max_batch, mono = 1.0 / rate, 0, self.bodies, self.max_batch, time.monotonic
        ends: deque[int] = deque()  # last seq of each batch awaiting its Ack
        while sent < total:
            now = mono()
            pending = (min(total, int((now - t0) * rate) + 1) if now >= t0 else 0) - sent
            first = t0 + sent * period  # creation of the oldest pending (or the next) event
            while ends and ends[0] <= self.acked_seq:
                ends.popleft()
            window = len(ends) < limit
            if pending > 0:
                if not ends or (window and (pending >= max_batch or now >= first + FLUSH_S)):
                    n = min(pending, max_batch)
                    await self.call.write(frame(pfx, bodies, sent + 1, sent + n + 1))
                    sent += n
                    ends.append(sent)
                    self.batches[n] += 1
                    self.last_send = now
                    continue
                if not window:
                    self.ack_wake.clear()
                    if ends[0] > self.acked_seq:  # no Ack slipped in since the check above
                        await self.ack_wake.wait()
                    continue
                wake = min(first + FLUSH_S, t0 + (sent + max_batch - 1) * period)
            else:
                wake = first  # the next event's emit() wakes the sender
            delay = wake - mono()
            await asyncio.sleep(delay if delay > 0 else 0)
            self.late[int((mono() - wake) * LATE_RES)] += 1


async def _client(addr: str, first: int, count: int, tracers: int, rate: float, duration_s: float,
                  window_batches: int) -> None:
    from ghostgpu.tracer.spool import varint

    total = max(1, round(rate * duration_s))
    pfx = [b"\x08" + varint(s) for s in range(total + 1)]  # NodeEvent.seq = 1, varint
    sims = [PacedTracer(addr, f"bench-node-{i:03d}") for i in range(first, first + count)]
    for t in sims:
        await t.connect()
    readers = [asyncio.create_task(t.read(total)) for t in sims]
    print("ready", flush=True)
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    t0 = float(line.split()[1])
    starts = [t0 + ((first + k) / tracers) / rate for k in range(count)]  # staggered phases
    errors: list[str] = []
    await asyncio.gather(*(t.pace(pfx, rate, total, starts[k], window_batches) for k, t in enumerate(sims)))
    for t in sims:
        try:
            await asyncio.wait_for(t.acked.wait(), 120)
        except TimeoutError:
            errors.append(f"node {t.node}: seq {total} not acked within 120 s (acked {t.acked_seq})")
    lat: Counter[int] = Counter()
    batches: Counter[int] = Counter()
    late: Counter[int] = Counter()
    period, last_ack = 1.0 / rate, 0.0
    for k, t in enumerate(sims):
        batches.update(t.batches)
        late.update(t.late)
        prev, start = 0, starts[k]
        for when, seq in t.acks:  # every event in (prev, seq] is acknowledged at `when`
            for s in range(prev + 1, min(seq, total) + 1):
                lat[int((when - start - (s - 1) * period) * LAT_RES)] += 1
            prev = max(prev, seq)
            last_ack = max(last_ack, when)
    print(json.dumps({"events": total * count, "t0": t0, "last_send": max(t.last_send for t in sims),
                      "last_ack": last_ack, "batches": batches, "lat": lat, "late": late,
                      "errors": errors}), flush=True)
    for t in sims:
        t.call.cancel()
    for r in readers:
        r.cancel()
    for t in sims:
        await t.channel.close()


def run_client(addr: str, first: int, count: int, tracers: int, rate: float, duration_s: float,
               window_batches: int) -> None:
    """`count` paced tracers; 'ready' once connected, then 'go T0' on stdin; one JSON line out."""
    asyncio.run(_client(addr, first, count, tracers, rate, duration_s, window_batches))


# ---- orchestration -------------------------------------------------------------------------------


def _hist(parts: list[dict[str, int]]) -> Counter[int]:
    out: Counter[int] = Counter()
    for p in parts:
        out.update({int(k): v for k, v in p.items()})
    return out


def _quantile(h: Counter[int], q: float) -> int | None:
    n = sum(h.values())
    if not n:
        return None
    rank, seen = q * (n - 1), 0
    for k in sorted(h):
        seen += h[k]
        if seen > rank:
            return k
    return max(h)


def _cpu_busy() -> tuple[int, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4], sum(v)  # busy (all but idle and iowait), total


def measure_paced(target: str, tracers: int, client_procs: int, events_per_s: float, duration_s: float,
                  spawn_server: Callable[[str, str], Any], node_totals: Callable[[str], dict[str, int]],
                  tmp: str, window_batches: int | None = None) -> dict[str, Any]:
    """window_batches: unacknowledged batches per tracer (None: the tracer's WINDOW_BATCHES; 0: no window)."""
    from ghostgpu.tracer.stream import WINDOW_BATCHES

    window = WINDOW_BATCHES if window_batches is None else window_batches
    rate = events_per_s / tracers
    server, addr = spawn_server(target, tmp)
    clients: list[subprocess.Popen[str]] = []
    try:
        per = [tracers // client_procs + (i < tracers % client_procs) for i in range(client_procs)]
        first = 0
        for count in per:
            cmd = [PY, str(Path(__file__).resolve()), "client", addr, str(first), str(count), str(tracers),
                   repr(rate), repr(duration_s), str(window)]
            clients.append(subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}))
            first += count
        for c in clients:
            if c.stdout is None or c.stdout.readline().strip() != "ready":
                raise SystemExit(f"bench: a client process failed to connect to {target}")
        t0 = time.monotonic() + 0.5
        cpu0 = [cpu_ticks(p.pid) or 0 for p in (server, *clients)]
        busy0 = _cpu_busy()
        for c in clients:
            assert c.stdin is not None
            c.stdin.write(f"go {t0!r}\n")
            c.stdin.flush()
        results = [json.loads(c.stdout.readline()) for c in clients]  # type: ignore[union-attr]
        cpu1 = [cpu_ticks(p.pid) or 0 for p in (server, *clients)]
        busy1 = _cpu_busy()
        rss_kib = status_kib(server.pid, "VmHWM")
        totals = node_totals(addr) if target == "collector" else None
    finally:
        for c in clients:
            c.kill()
        server.terminate()
        server.wait(30)
    errors = [e for r in results for e in r["errors"]]
    events = sum(r["events"] for r in results)
    last_send = max(r["last_send"] for r in results) - t0
    last_ack = max(r["last_ack"] for r in results) - t0
    batches, lat, late = (_hist([r[k] for r in results]) for k in ("batches", "lat", "late"))
    n_batches = sum(batches.values())
    late_p99 = (_quantile(late, 0.99) or 0) / LATE_RES
    why = []
    if last_send > duration_s + LATE_SLACK_S:
        why.append(f"the last event left {last_send - duration_s:.3f} s after the {duration_s:g} s window")
    if late_p99 > FLUSH_S:
        why.append(f"sender threads woke {late_p99 * 1000:.1f} ms late (p99), more than the 10 ms flush")
    kept_up = not errors and not why

    def ms(k: int | None) -> float | None:
        return None if k is None else round(k / LAT_RES * 1000, 2)

    out: dict[str, Any] = {
        "target": target, "offered_events_per_s_target": events_per_s, "duration_s": duration_s,
        "window_batches": window, "events": events, "clients_kept_up": kept_up,  # window 0: none
        "offered_events_per_s": round(events / max(duration_s, last_send)) if kept_up else None,
        "acked_events_per_s": round(events / last_ack) if last_ack > 0 and not errors else None,
        "last_send_after_t0_s": round(last_send, 3), "last_ack_after_t0_s": round(last_ack, 3),
        "batches": n_batches,
        "batch_events": {"mean": round(events / n_batches, 1) if n_batches else None,
                         "p50": _quantile(batches, 0.5), "p99": _quantile(batches, 0.99),
                         "max": max(batches, default=None)},
        "ack_latency_ms": {"p50": ms(_quantile(lat, 0.5)), "p99": ms(_quantile(lat, 0.99)),
                           "max": ms(max(lat, default=None))},
        "client_wake_late_ms": {"p50": (_quantile(late, 0.5) or 0) / LATE_RES * 1000,
                                "p99": round(late_p99 * 1000, 1),
                                "max": max(late, default=0) / LATE_RES * 1000},
        "server_cpu_s": round((cpu1[0] - cpu0[0]) / CLK_TCK, 2),
        "clients_cpu_s": round(sum(b - a for a, b in zip(cpu0[1:], cpu1[1:], strict=True)) / CLK_TCK, 2),
        "machine_cpu_busy": round((busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]), 3),
        "server_peak_rss_mb": round((rss_kib or 0) / 1024, 1), "errors": errors[:5],
    }
    if why:
        out["note"] = f"the clients did not offer {events_per_s:g} events/s on schedule: " + "; ".join(why)
    if totals is not None:
        out["node_status"] = totals
        out["exactly_once"] = (totals["ingested"] == events and totals["lost"] == 0
                               and totals["duplicates"] == 0)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 9 or sys.argv[1] != "client":
        raise SystemExit(__doc__)
    a = sys.argv[2:]
    run_client(a[0], int(a[1]), int(a[2]), int(a[3]), float(a[4]), float(a[5]), int(a[6]))
