"""`ghostgpu up`: the tracer on this node with a live view of its GPU consumers.

The tracer loop runs in a worker thread; this thread redraws the table once a second (on a
terminal) or prints it when it changes (when piped), with the latest events under it so that
short-lived consumers, gone before the next redraw, are seen too.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from tracer.agent import Tracer
from tracer.config import TracerConfig
from tracer.sinks import CallbackSink, FanOut, JsonlSink, Sink
from tracer.snapshot import render_table

RECENT_EVENTS = 8


def _event_line(rec: dict[str, Any]) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(rec.get("ts", time.time())))
    who = f"pid {rec.get('pid')} ({rec.get('comm') or '?'})"
    where = f" container {rec['container_id'][:13]}" if rec.get("container_id") else " on the host"
    if rec["event"] in ("finding", "resolved"):
        return f"{when} {rec['event']:8} {rec.get('class')}: {who}{where}: {rec.get('reason', '')}"
    if rec["event"] == "notice":
        return f"{when} notice   {rec.get('what')}: {rec.get('message')}"
    return f"{when} {rec['event']:8} {who}{where} {rec.get('device') or ''}"


def _header(tracer: Tracer) -> str:
    nvml = tracer.nvml
    kernel = "BPF tracepoints attached" if tracer.bpf is not None else "BPF off: /proc scans only"
    if nvml.available:
        gpus = ", ".join(f"{g.index}:{g.name or g.uuid}" for g in nvml.gpus) or "no GPUs"
        driver = f"NVML driver {nvml.driver_version}: {gpus}"
    else:
        driver = (f"no NVIDIA GPU visible here ({nvml.error}); still watching device files, "
                  "NVML-dependent classes show as unknown")
    return f"ghostgpu on {tracer.cfg.node_name} | {kernel} | {driver}"


def run_up(cfg: TracerConfig, jsonl: str | None, once: bool,
           install_signals: Callable[[Callable[[], None]], None]) -> int:
    recent: collections.deque[str] = collections.deque(maxlen=RECENT_EVENTS)

    def remember(rec: dict[str, Any]) -> None:
        if rec.get("event") in ("open", "exit", "finding", "resolved", "notice"):
            recent.append(_event_line(rec))

    sinks: list[Sink] = [CallbackSink(remember)]
    if jsonl:
        sinks.append(JsonlSink(jsonl))
    tracer = Tracer(cfg, FanOut(sinks))
    install_signals(tracer.stop)
    started = threading.Event()
    failure: list[BaseException] = []

    def work() -> None:
        try:
            tracer.start()
            started.set()
            while not tracer.stop_event.is_set():
                tracer.step()
        except BaseException as exc:  # surfaced on the main thread
            failure.append(exc)
            tracer.stop()
        finally:
            started.set()
            tracer.close()

    worker = threading.Thread(target=work, name="ghostgpu-tracer", daemon=True)
    worker.start()
    started.wait()
    tty = sys.stdout.isatty()
    last = ""
    while not tracer.stop_event.is_set():
        screen = "\n".join([_header(tracer), "", render_table(list(tracer.consumers.values())), "",
                            "recent:", *recent])
        if tty:
            sys.stdout.write("\x1b[H\x1b[2J" + screen + "\n")
            sys.stdout.flush()
        elif screen != last:
            print(screen + "\n", flush=True)
        last = screen
        if once:
            tracer.stop()
            break
        tracer.stop_event.wait(1.0)
    worker.join(timeout=10)
    if failure:
        raise failure[0]
    return 0
