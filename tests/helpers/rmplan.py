"""Build and drive rmplan (tests/helpers/rmplan.c): an exact sequence of NVIDIA RM calls, one
step per line, each answered by one JSON line (the step language is in rmplan.c's header).

Two ways to run it:
* steps on the command line, run in order; a `ready` step prints `ready <pid>` and waits for a
  line on stdin (`release()`), `hold` waits for another:

      with RmPlan(["open ctl", "client", "device 0", "alloc-mem 0 1048576", "ready", "hold"],
                  private_dev=driver.devices()) as plan:
          plan.wait_ready()
          records = plan.records()   # the JSON lines so far

* interactive (steps=None): each `step(line)` is sent on stdin and returns its JSON line.

      with RmPlan(None, private_dev=driver.devices()) as plan:
          client = plan.step("client")["handle"]

In a fake container, the container's init execs rmplan: `container.run(steps, program=build_rmplan())`
with `bind_devices=driver.devices()` on the FakeContainer; the steps open /dev/... as usual.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.helpers.workload import CFLAGS, HELPERS_DIR, GpuworkError, Workload, build_program

SOURCE = HELPERS_DIR / "rmplan.c"
NAME = "rmplan"  # /proc/PID/comm
Record = dict[str, Any]


def build_rmplan(static: bool = False) -> Path:
    """Compile rmplan.c once per content and flags: build/<hash>/rmplan. `static`: -static."""
    return build_program(SOURCE, NAME, (*CFLAGS, "-static") if static else CFLAGS)


def rmplan_argv(steps: Sequence[str] | None, *, dev_dir: str | None = None, driver: str | None = None,
                private_dev: Mapping[str, str | Path] | None = None) -> list[str]:
    """rmplan's arguments (without the program): options, then one argument per step."""
    argv: list[str] = []
    if dev_dir is not None:
        argv += ["--dev-dir", dev_dir]
    if driver is not None:
        argv += ["--driver", driver]
    for name, path in (private_dev or {}).items():
        argv += ["--private-dev", f"{name}={path}"]
    for step in steps or ():
        if not step.strip():
            raise ValueError(f"rmplan step {step!r} is empty")
    return [*argv, *(steps or ())]


def parse_records(lines: Iterable[str]) -> list[Record]:
    """The JSON step results among rmplan's stdout lines (ready/holding lines are skipped)."""
    return [json.loads(line) for line in lines if line.startswith("{")]


class RmPlan(Workload):
    """A running rmplan; killed and reaped on exit from the `with` block."""

    def __init__(self, steps: Sequence[str] | None, *, dev_dir: str | None = None, driver: str | None = None,
                 private_dev: Mapping[str, str | Path] | None = None, binary: Path | None = None,
                 prefix: Sequence[str] = (), **popen_kw: Any) -> None:
        self.interactive = steps is None
        argv = rmplan_argv(steps, dev_dir=dev_dir, driver=driver, private_dev=private_dev)
        popen_kw.setdefault("stdin", subprocess.PIPE)
        popen_kw.setdefault("stdout", subprocess.PIPE)
        popen_kw.setdefault("stderr", subprocess.PIPE)
        super().__init__(subprocess.Popen([*prefix, str(binary or build_rmplan()), *argv], **popen_kw))

    def step(self, line: str, timeout_s: float = 10.0) -> Record:
        """Interactive mode: runs one step, returns its JSON result (for ready/hold: {"line": ...})."""
        if not self.interactive:
            raise GpuworkError("rmplan was given its steps on the command line: step() needs steps=None")
        if self.popen.stdin is None:
            raise GpuworkError("rmplan has no stdin pipe")
        self.popen.stdin.write(line.encode() + b"\n")
        self.popen.stdin.flush()
        op = line.split()[0] if line.split() else ""
        if op in ("sleep",):
            return {}
        if op == "exit":
            self.wait_exit(timeout_s)
            return {}
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.read_line(max(0.0, deadline - time.monotonic()))
            if got is None:
                raise GpuworkError(f"rmplan gave no answer to {line!r} within {timeout_s}s "
                                   f"(rc={self.popen.poll()}, stderr={self._stderr_tail()!r})")
            if got.startswith("{"):
                record: Record = json.loads(got)
                if "error" in record:
                    raise GpuworkError(f"rmplan step {line!r}: {record['error']}")
                return record
            if op in ("ready", "hold"):
                return {"line": got}

    def records(self) -> list[Record]:
        """The step results read so far."""
        return parse_records(self.lines)

    def read_until_exit(self, timeout_s: float = 10.0) -> list[Record]:
        """Reads stdout to EOF (the plan ran to its end), checks exit 0, returns every result."""
        deadline = time.monotonic() + timeout_s
        while self.read_line(max(0.0, deadline - time.monotonic())) is not None:
            pass
        rc = self.wait_exit(max(0.1, deadline - time.monotonic()))
        if rc != 0:
            raise GpuworkError(
                f"rmplan exited {rc}: last lines {self.lines[-3:]!r}, stderr={self._stderr_tail()!r}")
        return self.records()

    def finish(self, timeout_s: float = 10.0) -> list[Record]:
        """Closes stdin (ending an interactive plan, releasing a ready/hold), then read_until_exit."""
        if self.popen.stdin is not None and not self.popen.stdin.closed:
            self.popen.stdin.close()
        return self.read_until_exit(timeout_s)


def run_rmplan(steps: Sequence[str], timeout_s: float = 10.0, **kw: Any) -> list[Record]:
    """Runs a plan to its end (stdin closed: ready/hold do not wait) and returns its results."""
    with RmPlan(steps, **kw) as plan:
        return plan.finish(timeout_s)


def failed(records: Iterable[Record]) -> list[Record]:
    """Results whose ioctl failed or whose status is not NV_OK (open: ret < 0)."""
    return [r for r in records if r.get("ret", 0) != 0 or r.get("status") not in (None, 0)]
