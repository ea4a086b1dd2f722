"""Run the real `ghostgpu tracer` as a subprocess and read what it writes, polling with deadlines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ghostgpu.common.model.records import STREAMED_KINDS

Record = dict[str, Any]


class TracerProcess:
    """`ghostgpu tracer --jsonl FILE`, started as a user would, stopped with SIGTERM."""

    def __init__(
        self,
        workdir: Path,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        node_name: str = "test-node",
        collector: str | None = None,
        wrapper: list[str] | None = None,
    ) -> None:
        """wrapper: argv run in front of the tracer's, e.g. setpriv with a reduced capability set."""
        self.node_name = node_name
        self.path = workdir / "tracer.jsonl"
        self.stderr_path = workdir / "tracer.stderr"
        cmd = [
            *(wrapper or []),
            sys.executable,
            "-m",
            "ghostgpu.cli",
            "tracer",
            "--jsonl",
            str(self.path),
            "--node-name",
            node_name,
            *(["--collector", collector] if collector else []),
            *(args or []),
        ]
        full_env = {**os.environ, **(env or {})}
        self._stderr = open(self.stderr_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd,
            env=full_env,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
            cwd=Path(__file__).resolve().parents[2],
        )
        self._offset = 0
        self._buf = b""
        self.records: list[Record] = []

    def _read_new(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        self._offset += len(chunk)
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        self.records.extend(json.loads(line) for line in lines if line.strip())

    def wait_for(self, pred: Callable[[Record], bool], timeout_s: float = 10.0, what: str = "") -> Record:
        """The first record (old or new) matching pred; fails with what was seen on timeout."""
        deadline = time.monotonic() + timeout_s
        seen = 0
        while True:
            self._read_new()
            for rec in self.records[seen:]:
                if pred(rec):
                    return rec
            seen = len(self.records)
            if self.proc.poll() is not None:
                raise AssertionError(f"tracer exited with {self.proc.returncode}: {self.stderr()}")
            if time.monotonic() > deadline:
                tail = "\n".join(json.dumps(r) for r in self.records[-15:])
                raise AssertionError(
                    f"timed out after {timeout_s}s waiting for {what or pred}; "
                    f"last records:\n{tail}\nstderr: {self.stderr()}"
                )
            time.sleep(0.02)  # polling interval of a deadline loop, not a wait for a result

    def wait_ready(self, timeout_s: float = 15.0) -> None:
        """Ready once the first classification pass ran (a `ready` notice)."""
        self.wait_for(lambda r: r.get("event") == "ready", timeout_s, "tracer ready")

    def matching(self, pred: Callable[[Record], bool]) -> list[Record]:
        self._read_new()
        return [r for r in self.records if pred(r)]

    def stderr(self) -> str:
        if not self._stderr.closed:
            self._stderr.flush()
        return self.stderr_path.read_text()[-3000:]

    def stop(self, timeout_s: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()
        self._read_new()
        return self.proc.returncode

    def kill(self) -> int:
        """SIGKILL, as a crash or an OOM kill: no flush, nothing said to the collector."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._stderr.close()
        self._read_new()
        return self.proc.returncode

    def streamed(self) -> list[Record]:
        """The records so far of the kinds the tracer streams to a collector (not `ready`)."""
        return self.matching(lambda r: r.get("event") in STREAMED_KINDS)

    def __enter__(self) -> TracerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
