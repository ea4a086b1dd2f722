"""Process churn for the churn test and bench: thousands of short-lived, exec'ing GPU holders.

`ChurnRun` drives tests/helpers/churn.c: one launcher for the host half (its own mount namespace
with a private /dev holding `nvidia0` as `c 1 3`) and one per fake container (tests/helpers/
container.py) for the other half. Each launcher keeps its share of the concurrency busy: fork,
open /dev/nvidia0 as fd 3 (no O_CLOEXEC), exec `churn hold MS` (the fd survives), sleep MS, exit.
That is every `sh -c` wrapper on a busy node, at a rate Python's process start cannot reach.

Each launcher writes one line per reaped child as it happens (host PID, fork and reap times in
CLOCK_BOOTTIME ns), so a caller reads the `Lifetime`s so far mid-run. A container's children are
forked into the PID namespace of its init (a `ready wait` gpuwork), so the launcher still learns
their host PIDs. `CpuHogs` keeps every core busy for a bounded time.

Everything started here is killed on exit, also when the caller fails half-way.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from tests.helpers.container import FakeContainer
from tests.helpers.workload import HELPERS_DIR, build_program

SOURCE = HELPERS_DIR / "churn.c"
DEVICE = "/dev/nvidia0"
COMM = "churn"  # /proc/PID/comm of the launcher, its forked children and the exec'd image alike


def build_churn() -> Path:
    return build_program(SOURCE, COMM)


@dataclass(frozen=True)
class Lifetime:
    """One short-lived holder as its launcher saw it; times are CLOCK_BOOTTIME ns."""

    pid: int  # host PID
    fork_ns: int  # just before fork(): nothing of this child can be traced earlier
    reap_ns: int  # when waitpid() returned it: its exit happened before
    status: int  # exit code (128 + signal when killed); 0 = it held the device across exec
    container_id: str  # "" on the host

    @property
    def key(self) -> tuple[int, int]:
        """PIDs are reused within a run: a lifetime is (pid, fork time)."""
        return (self.pid, self.fork_ns)


class Launcher:
    """One `churn run` process for one target (the host, or one fake container)."""

    def __init__(self, binary: Path, out_path: Path, count: int, concurrency: int, hold_ms: int,
                 target_args: list[str], container_id: str = "", rate_per_s: float = 0.0) -> None:
        self.out_path, self.container_id, self.count = out_path, container_id, count
        self.err_path = out_path.with_suffix(".err")
        argv = [str(binary), "run", "--count", str(count), "--concurrency", str(concurrency),
                "--hold-ms", str(hold_ms), "--device", DEVICE, "--rate-per-s", str(rate_per_s), *target_args]
        with open(out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        self.lifetimes: list[Lifetime] = []
        self.done_ns: int | None = None
        self._offset = 0

    def read(self) -> list[Lifetime]:
        """New lifetimes since the last call (the launcher writes whole lines with one write each)."""
        with open(self.out_path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1
        self._offset += end
        fresh: list[Lifetime] = []
        for line in chunk[:end].decode().splitlines():
            parts = line.split()
            if parts and parts[0] == "child":
                pid, fork_ns, reap_ns, status = (int(p) for p in parts[1:5])
                fresh.append(Lifetime(pid, fork_ns, reap_ns, status, self.container_id))
            elif parts and parts[0] == "done":
                self.done_ns = int(parts[2])
        self.lifetimes.extend(fresh)
        return fresh

    @property
    def finished(self) -> bool:
        return self.proc.poll() is not None

    def failure(self) -> str | None:
        """Why this launcher failed (exit status and stderr), None while it runs or when it did not."""
        rc = self.proc.poll()
        if rc in (None, 0):
            return None
        return f"churn launcher exited {rc}: {self.err_path.read_text(errors='replace')[-500:]}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class ChurnRun:
    """`count` holders, half on the host and half spread over `containers` fake containers.

    The concurrency is split the same way (at least one in flight per launcher); `rate_per_s`
    (0 = as fast as forks go) paces the whole run. Use as a context manager.
    """

    def __init__(self, workdir: Path, count: int, concurrency: int = 16, containers: int = 4,
                 hold_ms: int = 10, rate_per_s: float = 0.0) -> None:
        if count < 2 or containers < 1:
            raise ValueError("a churn run needs count >= 2 and at least one container")
        self.workdir, self.count, self.hold_ms = workdir, count, hold_ms
        self.concurrency, self.rate_per_s = concurrency, rate_per_s
        self.binary = build_churn()
        self.containers = [FakeContainer(devices={"nvidia0": (1, 3)}) for _ in range(containers)]
        self.launchers: list[Launcher] = []
        self._stack = contextlib.ExitStack()

    def start(self) -> ChurnRun:
        host_count = self.count // 2
        host_conc = max(1, self.concurrency // 2)
        shares = _split(self.count - host_count, len(self.containers))
        conc = _split(max(len(self.containers), self.concurrency - host_conc), len(self.containers))
        with contextlib.ExitStack() as stack:  # on a failure half-way, undo what was started
            inits = []
            for container in self.containers:
                stack.enter_context(container)
                init = container.run(["ready", "wait"])  # PID 1: the namespace lives while it does
                stack.callback(init.close)
                init.wait_ready(10.0)
                inits.append(init)
            stack.callback(self._kill_launchers)  # before the containers go: a launcher is in their cgroups
            self._launch(host_count, host_conc, "host", ["--private-dev", "nvidia0:1:3"], "")
            for n, (container, init) in enumerate(zip(self.containers, inits, strict=True)):
                cgroups = [arg for d in container.cgroup_paths.values()
                           for arg in ("--cgroup", os.path.join(d, "cgroup.procs"))]
                self._launch(shares[n], conc[n], f"c{n}", ["--join", str(init.init_pid), *cgroups],
                             container.container_id)
            self._stack = stack.pop_all()
        return self

    def _launch(self, count: int, concurrency: int, name: str, target: list[str], cid: str) -> None:
        # Each launcher paces its own share so that together they hold the run's rate.
        rate = self.rate_per_s * count / self.count if self.rate_per_s else 0.0
        self.launchers.append(Launcher(self.binary, self.workdir / f"churn-{name}.out", count, concurrency,
                                       self.hold_ms, target, cid, rate))

    def read(self) -> list[Lifetime]:
        """Lifetimes reaped since the last call, over all launchers."""
        return [life for launcher in self.launchers for life in launcher.read()]

    def lifetimes(self) -> list[Lifetime]:
        self.read()
        return [life for launcher in self.launchers for life in launcher.lifetimes]

    @property
    def finished(self) -> bool:
        return all(launcher.finished for launcher in self.launchers)

    def failures(self) -> list[str]:
        return [f for launcher in self.launchers if (f := launcher.failure())]

    def _kill_launchers(self) -> None:
        for launcher in self.launchers:
            launcher.kill()

    def close(self) -> None:
        self._kill_launchers()
        self._stack.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _split(total: int, parts: int) -> list[int]:
    """`total` in `parts` shares that differ by at most one."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


class CpuHogs:
    """One `churn spin` busy loop per core for at most `limit_s`, killed on close."""

    def __init__(self, limit_s: float, cores: int | None = None) -> None:
        binary = build_churn()
        self.procs = [subprocess.Popen([str(binary), "spin", str(int(limit_s * 1000))],
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
                      for _ in range(cores or os.cpu_count() or 1)]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGKILL)
            proc.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
