"""Build and drive gpucalls, the CUDA start-up ioctl sequence (tests/helpers/gpucalls.c).

gpucalls issues, from two threads taking fixed turns, the calls a CUDA process makes when it
starts (RM allocs, controls, map, free; UVM init and registrations; mmap of nvidia0; closes),
each parameter block holding a pre-set NV_STATUS at the offset of the chosen driver release. It
writes one JSON line per call, in issue order: the expectation a trace session is checked
against. `GpuCalls` starts it (optionally behind a prefix such as strace), lets it go after its
`ready <pid>` line, reads its lines until `done`, and hands back the records;
`expected_calls()` groups them per thread.

    opts = GpuCallsOptions(driver="550.54.15", out=tmp / "calls.jsonl", private_dev=NODES_MMAP)
    with GpuCalls(opts) as run:
        pid = run.start()            # ready <pid>, then released
        records = run.finish()       # done, (hold released), exit 0, the JSON lines

Record keys (every line): i, pid, tid, thread ("A", "B", "child", "main"), kind, ret (the
syscall's return, -errno on failure). Per kind: open: device, path, flags, fd. ioctl: device,
fd, request, arg, call, escape, nr, xfer, size, h_class, class_name, cmd, cmd_name,
params_size, handles, args, status_offset, nv_status, nv_status_name (+ block_hex, xfer_hex
with dump_blocks). mmap: device, fd, length, prot, flags, offset. munmap: device, addr,
length. close: device, fd. fork: child_pid. spin: device, fd, request, call, cmd, calls.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.helpers.workload import CFLAGS, HELPERS_DIR, GpuworkError, Workload, build_program

SOURCE = HELPERS_DIR / "gpucalls.c"
NAME = "gpucalls"  # /proc/PID/comm of the workload (and of its --fork child)
DRIVERS = ("525.47.04", "550.54.15", "595.45.04")  # one per RM_ALLOC layout family past 520
NODES_NULL: dict[str, tuple[int, int]] = {"nvidiactl": (1, 3), "nvidia0": (1, 3), "nvidia-uvm": (1, 3)}
# nvidia0 as /dev/zero: its mmap succeeds, so the sequence also has a munmap
NODES_MMAP: dict[str, tuple[int, int]] = {**NODES_NULL, "nvidia0": (1, 5)}
Record = dict[str, Any]


def build_gpucalls(static: bool = False) -> Path:
    """Compile gpucalls.c once per content and flags: build/<hash>/gpucalls. `static` links
    with -static (libc and pthreads only), for a minimal container image."""
    return build_program(SOURCE, NAME, (*CFLAGS, "-static") if static else CFLAGS)


@dataclass
class GpuCallsOptions:
    """gpucalls' command line (see the header of gpucalls.c)."""

    driver: str = "595.45.04"
    out: Path | None = None  # None: the JSON lines come on stdout, between ready and done
    ready: bool = True
    hold: bool = False
    loop: int = 1
    fork: bool = False
    dump_blocks: bool = False
    spin: int | None = None
    dev_dir: str | None = None  # default /dev
    private_dev: dict[str, tuple[int, int]] | None = None  # own mount ns + tmpfs dev dir (root)
    cgroups: Sequence[str] = field(default_factory=tuple)  # cgroup.procs files to join first

    def argv(self) -> list[str]:
        argv = ["--driver", self.driver, "--loop", str(self.loop)]
        flags = {"--ready": self.ready, "--hold": self.hold, "--fork": self.fork,
                 "--dump-blocks": self.dump_blocks}
        argv += [flag for flag, on in flags.items() if on]
        if self.out is not None:
            argv += ["--out", str(self.out)]
        if self.spin is not None:
            argv += ["--spin", str(self.spin)]
        if self.dev_dir is not None:
            argv += ["--dev-dir", self.dev_dir]
        for name, (major, minor) in (self.private_dev or {}).items():
            argv += ["--private-dev", f"{name}:{major}:{minor}"]
        for procs in self.cgroups:
            argv += ["--cgroup", procs]
        return argv


class GpuCalls(Workload):
    """A running gpucalls (behind `prefix`, e.g. an strace command line ending in its `--`).

    Always killed and reaped on exit from the `with` block.
    """

    def __init__(self, options: GpuCallsOptions, *, static: bool = False, prefix: Sequence[str] = (),
                 binary: Path | None = None, **popen_kw: Any) -> None:
        self.options = options
        self.binary = binary or build_gpucalls(static)
        popen_kw.setdefault("stdin", subprocess.PIPE)
        popen_kw.setdefault("stdout", subprocess.PIPE)
        popen_kw.setdefault("stderr", subprocess.PIPE)
        super().__init__(subprocess.Popen([*prefix, str(self.binary), *options.argv()], **popen_kw))
        self.done = False

    @property
    def workload_pid(self) -> int:
        """PID gpucalls printed on its ready line (not the prefix's, when there is one)."""
        if self.ready is None:
            raise GpuworkError("gpucalls has not printed its ready line yet")
        return self.ready.pid

    def start(self, timeout_s: float = 10.0) -> int:
        """Waits for `ready <pid>` (only with options.ready), lets the calls start; returns the pid."""
        if not self.options.ready:
            raise GpuworkError("gpucalls was started without --ready: there is nothing to release")
        ready = self.wait_ready(timeout_s)
        self.release()
        return ready.pid

    def wait_done(self, timeout_s: float = 30.0) -> None:
        """Reads stdout until the `done` line; raises GpuworkError at EOF or the deadline."""
        deadline = time.monotonic() + timeout_s
        while not self.done:
            line = self.read_line(max(0.0, deadline - time.monotonic()))
            if line is None:
                raise GpuworkError(
                    f"gpucalls gave no done line within {timeout_s}s (rc={self.popen.poll()}, "
                    f"stdout so far={self.lines[-5:]!r}, stderr={self._stderr_tail()!r})"
                )
            self.done = line == "done"

    def finish(self, timeout_s: float = 30.0) -> list[Record]:
        """Waits for done, releases a --hold, waits for exit 0; returns the records."""
        self.wait_done(timeout_s)
        if self.options.hold:
            self.release()
        rc = self.wait_exit(timeout_s)
        if rc != 0:
            raise GpuworkError(f"gpucalls exited {rc}: stderr={self._stderr_tail()!r}")
        return self.records()

    def records(self) -> list[Record]:
        """The call records written so far (the --out file, else stdout's JSON lines)."""
        if self.options.out is not None:
            return read_records(self.options.out)
        return [r for r in parse_lines(self.lines) if "i" in r]

    def spin_result(self) -> Record | None:
        """--spin's `{"calls": M, "ns_per_call": X}` from stdout, once printed."""
        return next((r for r in parse_lines(self.lines) if "ns_per_call" in r), None)


def parse_lines(lines: Iterable[str]) -> list[Record]:
    """The JSON objects among `lines` (others, such as ready/done, are skipped)."""
    return [json.loads(line) for line in lines if line.startswith("{")]


def read_records(path: Path) -> list[Record]:
    return parse_lines(path.read_text().splitlines())


def expected_calls(lines: Iterable[str | Record]) -> dict[int, list[Record]]:
    """Records (JSON lines or parsed) grouped by tid, each list in issue order ("i")."""
    records = [r if isinstance(r, dict) else json.loads(r) for r in lines
               if isinstance(r, dict) or r.startswith("{")]
    grouped: dict[int, list[Record]] = {}
    for record in sorted(records, key=lambda r: r["i"]):
        grouped.setdefault(record["tid"], []).append(record)
    return grouped


def run_gpucalls(options: GpuCallsOptions, *, static: bool = False, prefix: Sequence[str] = (),
                 timeout_s: float = 30.0) -> list[Record]:
    """Starts gpucalls, releases it, returns its records after a clean exit."""
    with GpuCalls(options, static=static, prefix=prefix) as run:
        if options.ready:
            run.start(timeout_s)
        return run.finish(timeout_s)

