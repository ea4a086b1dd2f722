"""What StreamSink.emit() costs the tracer's loop, next to the sinks it sits beside, and what the
spool holds per event. No root needed: python bench/bench_stream_emit.py [--events N] [--reps R].

emit() is on the tracer's hot path (every open, close, finding), so it must stay far below the
JSON-lines sink the tracer always had. Modes, best of R rounds of N emits of real typed records
(a holder `open` and a `finding`, alternating), taking turns within each round:

- callback: a sink that hands each record's JSON object to a function that does nothing (the
  live view's cost: to_json() and a Python call)
- jsonl: JsonlSink to /dev/null (what `ghostgpu tracer --jsonl` pays: to_json() and json.dumps)
- stream_connected: StreamSink streaming to an acknowledging collector on loopback
- stream_spooling: StreamSink with the collector away (records go to the spool only)

Each mode reports wall ns per emit and the emitting thread's CPU ns (`_cpu`): wall time also
counts waiting for the GIL while the stream's sender thread encodes. Also: events/s through to the
collector (every one acknowledged), spool bytes per event once encoded (the (seq, bytes) entry
and its deque slot), and CPU ns per record (best of R) of what surrounds emit(): building the
record in the agent (`build_cpu_ns`) and encoding it to NodeEvent bytes on the sender thread
(`encode_cpu_ns`). Writes bench/results/stream_emit.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ghostgpu.tracer import records  # noqa: E402
from ghostgpu.tracer.events import EventKind, NvmlView, ProcessInfo, SourceEvent  # noqa: E402
from ghostgpu.tracer.sinks import CallbackSink, JsonlSink  # noqa: E402
from ghostgpu.tracer.spool import encode_event  # noqa: E402
from ghostgpu.tracer.stream import StreamOptions, StreamSink  # noqa: E402

from bench.common import RESULTS_DIR, machine  # noqa: E402
from ghostgpu.common.model.consumers import Consumer, ConsumerClass, DeviceKind, DeviceRef  # noqa: E402
from ghostgpu.common.model.records import Record  # noqa: E402
from ghostgpu.v1 import stream_pb2, stream_pb2_grpc  # noqa: E402


class AckingCollector(stream_pb2_grpc.NodeStreamServicer):
    """Welcome, then an Ack for every batch: the least a collector does."""

    def Connect(self, requests: Iterator[stream_pb2.TracerMessage], context: Any,
                ) -> Iterator[stream_pb2.CollectorMessage]:
        next(requests)
        yield stream_pb2.CollectorMessage(welcome=stream_pb2.Welcome(api_version=1, max_batch_events=2000))
        for msg in requests:
            if msg.WhichOneof("msg") == "events":
                yield stream_pb2.CollectorMessage(ack=stream_pb2.Ack(seq=msg.events.events[-1].seq))


def record_builders() -> list[Callable[[], Record]]:
    """How the agent makes each sample record (tracer/records.py), from its own events and state."""
    info = ProcessInfo(pid=4242, ns_pid=7, comm="python3", exe="/usr/bin/python3", cmdline="python3 train.py",
                       uid=0, ppid=4200, state="S", cgroup_path="/kubepods.slice/x/cri-containerd-a.scope",
                       container_id="a" * 64, pod_uid="1441bc39-919a-4962-bb72-ea854cbd68ff",
                       runtime="containerd")
    dev = DeviceRef("/dev/nvidia0", DeviceKind.GPU, 0, 195, 0)
    ev = SourceEvent(EventKind.OPEN, "bpf", 123_456_789, 4242, tid=4242, fd=5, device=dev, cgroup_id=812)
    nvml = NvmlView(available=False)
    consumer = Consumer(node="node-1", pid=4242, ns_pid=7, comm="python3", gpu=0, gpu_uuid="", gpu_minor=0,
                        devices=["/dev/nvidia0"], container_id="a" * 64, pod_uid="p", runtime="containerd",
                        cls=ConsumerClass.HIDDEN, reason="holds /dev/nvidia0; NVML does not list it",
                        gpu_memory_bytes=None)
    return [lambda: records.event_record("node-1", ev, info, ["/dev/nvidia0"], nvml),
            lambda: records.consumer_record("finding", consumer)]


def sample_records() -> list[Record]:
    return [build() for build in record_builders()]


def cpu_ns_per_call(fn: Callable[[int], object], n: int, reps: int) -> float:
    """Best of `reps` rounds of n calls: the calling thread's CPU ns per call."""
    best = float("inf")
    for _ in range(reps):
        gc.collect()
        start = time.thread_time_ns()
        for i in range(n):
            fn(i)
        best = min(best, (time.thread_time_ns() - start) / n)
    return round(best, 1)


def ns_per_emit(sink: Any, recs: list[Record], n: int) -> tuple[float, float]:
    """(wall ns, CPU ns of the emitting thread) per emit. Wall time includes waiting for the GIL
    while the sender thread encodes; CPU time is what emit() itself costs the tracer's thread."""
    emit = sink.emit
    gc.collect()
    start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
    for i in range(n):
        emit(recs[i & 1])
    return (time.perf_counter_ns() - start) / n, (time.thread_time_ns() - start_cpu) / n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    recs = sample_records()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    stream_pb2_grpc.add_NodeStreamServicer_to_server(AckingCollector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    options = StreamOptions(info_wait_s=0, spool_events=args.events * 2)
    modes = {
        "callback": lambda: CallbackSink(lambda rec: None),
        "jsonl": lambda: JsonlSink("/dev/null"),
        "stream_connected": lambda: StreamSink(f"127.0.0.1:{port}", "node-1", options=options),
        "stream_spooling": lambda: StreamSink("127.0.0.1:1", "node-1", options=options),
    }
    rounds: list[dict[str, float]] = []
    throughput = []
    for _ in range(args.reps):
        row = {}
        for name, make in modes.items():
            sink = make()
            if name == "stream_connected":
                deadline = time.monotonic() + 10
                while not sink.stats()["connected"] and time.monotonic() < deadline:
                    time.sleep(0.01)  # bench warm-up: the handshake, not a measured result
            start = time.monotonic()
            wall, cpu = ns_per_emit(sink, recs, args.events)
            row[name], row[f"{name}_cpu"] = round(wall, 1), round(cpu, 1)
            if name == "stream_connected":
                while sink.stats()["acked_seq"] < args.events and time.monotonic() < start + 60:
                    time.sleep(0.005)
                throughput.append(args.events / (time.monotonic() - start))
            sink.close()
        rounds.append(row)
        print(row, flush=True)
    server.stop(None)
    # A spool entry is a (seq, bytes) tuple in a deque: count the objects, not a noisy heap delta.
    seq = 1 << 20
    entries = [(seq + i, encode_event(seq + i, recs[i & 1])) for i in range(1000)]
    per_event = sum(sys.getsizeof(e) + sys.getsizeof(e[0]) + sys.getsizeof(e[1]) + 8 for e in entries) / 1000
    best = {name: min(r[name] for r in rounds) for name in rounds[0]}
    n_calls = max(1, args.events // 2)
    kinds = ("open", "finding")
    build_cpu = {k: cpu_ns_per_call(lambda _i, b=b: b(), n_calls, args.reps)
                 for k, b in zip(kinds, record_builders(), strict=True)}
    encode_cpu = {k: cpu_ns_per_call(lambda i, r=r: encode_event(i + 1, r), n_calls, args.reps)
                  for k, r in zip(kinds, recs, strict=True)}
    result = {
        "ns_per_emit": best,
        "build_cpu_ns": build_cpu,
        "encode_cpu_ns": encode_cpu,
        "ratio_to_jsonl": {name: round(v / best["jsonl"], 3) for name, v in best.items()
                           if not name.endswith("_cpu")},
        "events_per_s_acknowledged": round(max(throughput)),
        "spool_bytes_per_encoded_event": round(per_event),
        "events": args.events, "rounds": rounds, "machine": machine(),
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "stream_emit.json").write_text(json.dumps(result, indent=2) + "\n")
    shown = ("ns_per_emit", "ratio_to_jsonl", "events_per_s_acknowledged", "spool_bytes_per_encoded_event",
             "build_cpu_ns", "encode_cpu_ns")
    print(json.dumps({k: result[k] for k in shown}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
