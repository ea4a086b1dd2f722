"""Sinks write what changed. A sink never reaches back into a source.

Sinks take typed records (ghostgpu.common.model.records); `event` says what each is (open, close, exit,
finding, resolved, notice, ...). The JSON-lines sink and the callback sink are JSON edges: they make
each record's JSON object (to_json()) there and only there. Records are flushed as they happen so a
reader (a test, `jq`, a log shipper) sees them at once.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable
from typing import IO, Any, Protocol

from ghostgpu.common.model.records import JsonRecord, Record


class Sink(Protocol):
    def emit(self, record: Record) -> None: ...

    def close(self) -> None: ...


def _default(obj: Any) -> Any:
    if isinstance(obj, set | frozenset | tuple):
        return sorted(obj) if isinstance(obj, set | frozenset) else list(obj)
    return str(obj)


def dumps(record: JsonRecord) -> str:
    return json.dumps(record, separators=(",", ":"), default=_default)


class JsonlSink:
    """JSON lines to a path ('-' is stdout). Appends, so a restart keeps what was written."""

    def __init__(self, path: str) -> None:
        self._lock = threading.Lock()
        self._own = path != "-"
        if self._own:
            parent = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(parent):
                raise ValueError(f"--jsonl: directory {parent} does not exist; create it or pick another")
            self._out: IO[str] = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        else:
            self._out = sys.stdout

    def emit(self, record: Record) -> None:
        line = dumps(record.to_json())
        with self._lock:
            try:
                self._out.write(line + "\n")
                self._out.flush()
            except BrokenPipeError:
                # The reader went away (e.g. `ghostgpu tracer | head`); nothing more to write to.
                self._out = open(os.devnull, "w")  # noqa: SIM115

    def close(self) -> None:
        with self._lock:
            if self._own:
                self._out.close()


class CallbackSink:
    """Hands each record's JSON object to a function (the live view, tests): a JSON edge too."""

    def __init__(self, fn: Callable[[JsonRecord], None]) -> None:
        self._fn = fn

    def emit(self, record: Record) -> None:
        self._fn(record.to_json())

    def close(self) -> None:
        pass


class FanOut:
    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def emit(self, record: Record) -> None:
        for sink in self.sinks:
            sink.emit(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
