"""Build and drive gpuwork, the scriptable GPU-client stand-in (tests/helpers/gpuwork.c).

`run_host(["open", "/dev/nvidia0", "ready", "wait"])` starts it as a plain host process;
`FakeContainer.run` (container.py) starts it as PID 1 of a fake container. Both hand back an
object whose `wait_ready` polls stdout with a deadline for the `ready <pid> <fd>...` line.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from tests.helpers.containerd_image import ImageVariant

HELPERS_DIR = Path(__file__).resolve().parent
SOURCE = HELPERS_DIR / "gpuwork.c"
BUILD_DIR = HELPERS_DIR / "build"  # ignored by git (.gitignore has `build/`)
CFLAGS = ("-O2", "-Wall", "-Wextra", "-pthread")


# One RM_ALLOC of HOPPER_COMPUTE_A (0xcbc0) through a 48-byte NVOS64 block on the script's fd 0:
# what makes a holder a GPU job (class `hidden` when NVML does not list it) rather than a
# `monitor`, which only reads the GPU's state (tracer/gpu_work.py; gpuwork.c `rmalloc`).
ALLOC = ("rmalloc", "0", "alloc64", "0xcbc0")


def allocates(idx: int = 0) -> list[str]:
    """gpuwork steps: the ALLOC call on the script's fd `idx` (an open GPU or control node)."""
    return [ALLOC[0], str(idx), *ALLOC[2:]]


# A pod's GPU job for the real containerd: the busybox image plus a static gpuwork (GPUWORK_IMAGE,
# `import_variant(gpuwork_image())`) whose command is `job_command()`. A pod whose shell only ran
# `exec 3</dev/nvidia0` would be a `monitor`: it allocates nothing.
GPUWORK_IMAGE = "docker.io/local/gpuwork:test"
GPUWORK_IN_IMAGE = "/bin/gpuwork"


def gpuwork_image() -> ImageVariant:
    """The image variant with the static gpuwork at /bin/gpuwork (comm `gpuwork`)."""
    return ImageVariant(GPUWORK_IMAGE, ((GPUWORK_IN_IMAGE.lstrip("/"), str(build_gpuwork(static=True))),))


def job_command(device: str = "/dev/nvidia0", hold_s: int = 300) -> list[str]:
    """A container's command: open `device`, allocate (ALLOC) on it, hold it `hold_s` s, exit 0."""
    return [GPUWORK_IN_IMAGE, "open", device, *allocates(), "sleep", str(hold_s * 1000)]


class GpuworkError(RuntimeError):
    """gpuwork could not be built, or did not reach its `ready` step."""


@dataclass(frozen=True)
class ReadyLine:
    """`ready <pid> <fd>...`: pid as gpuwork saw it (the namespace PID inside a container);
    fds[i] is the fd of table entry i, -1 once closed or sent away."""

    pid: int
    fds: tuple[int, ...]

    @classmethod
    def parse(cls, line: str) -> ReadyLine | None:
        parts = line.split()
        if len(parts) < 2 or parts[0] != "ready":
            return None
        try:
            return cls(int(parts[1]), tuple(int(p) for p in parts[2:]))
        except ValueError:
            return None


def build_gpuwork(static: bool = False) -> Path:
    """Compile gpuwork.c once per content (and flags): build/<hash>/gpuwork. `static` links with
    -static (libc and pthreads only), for a container image with no libc (containerd_image.py).

    The binary keeps the plain name `gpuwork` so that /proc/PID/comm reads `gpuwork`.
    """
    return build_program(SOURCE, "gpuwork", (*CFLAGS, "-static") if static else CFLAGS)


def build_program(source: Path, name: str, cflags: tuple[str, ...] = CFLAGS) -> Path:
    """Compile one C file of the helpers once per content (and flags): build/<hash>/NAME."""
    digest = hashlib.sha256(source.read_bytes() + " ".join(cflags).encode()).hexdigest()[:16]
    binary = BUILD_DIR / digest / name
    if binary.exists():
        return binary
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise GpuworkError(f"{name}: no C compiler (gcc) on PATH; install gcc (apt-get install gcc)")
    binary.parent.mkdir(parents=True, exist_ok=True)
    # Compile to a temporary name and rename: parallel test runs never see half a binary.
    fd, tmp = tempfile.mkstemp(dir=binary.parent, prefix=f".{name}-")
    os.close(fd)
    proc = subprocess.run([cc, *cflags, "-o", tmp, str(source)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise GpuworkError(f"{name}: {cc} failed (rc={proc.returncode}):\n{proc.stderr}")
    os.replace(tmp, binary)
    return binary


class Workload:
    """A running gpuwork (wraps its Popen). Use as a context manager: it is always killed and reaped."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.lines: list[str] = []  # every stdout line read so far
        self.ready: ReadyLine | None = None
        self._buf = b""

    @property
    def pid(self) -> int:
        """Host PID of the process Popen started."""
        return self.popen.pid

    def read_line(self, timeout_s: float = 5.0) -> str | None:
        """Next stdout line, or None at EOF or when the deadline passes."""
        if self.popen.stdout is None or self.popen.stdout.closed:
            return None
        fd = self.popen.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                return None
            # poll, not select: a benchmark holding many pipes may pass fd 1024
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            if not poller.poll(left_s * 1000):
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\n", 1)
        line = raw.decode(errors="replace")
        self.lines.append(line)
        self._on_line(line)
        return line

    def _on_line(self, line: str) -> None:
        """Hook for subclasses that learn something from a line (see ContainerProcess)."""

    def wait_ready(self, timeout_s: float = 5.0) -> ReadyLine:
        """Reads stdout until the next `ready` line; raises GpuworkError on EOF or deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            line = self.read_line(max(0.0, deadline - time.monotonic()))
            if line is None:
                raise GpuworkError(
                    f"gpuwork pid {self.pid} gave no ready line within {timeout_s}s "
                    f"(rc={self.popen.poll()}, stdout so far={self.lines!r}, stderr={self._stderr_tail()!r})"
                )
            ready = ReadyLine.parse(line)
            if ready is not None:
                self.ready = ready
                return ready

    def step_errors(self) -> list[str]:
        """The `step-error <step> <errno>` lines read so far."""
        return [line for line in self.lines if line.startswith("step-error ")]

    def release(self) -> None:
        """Writes one line to stdin: lets one `wait` (or a `thread-hold` thread) continue."""
        if self.popen.stdin is None:
            return
        with contextlib.suppress(BrokenPipeError, ValueError, OSError):
            self.popen.stdin.write(b"\n")
            self.popen.stdin.flush()

    def wait_exit(self, timeout_s: float = 5.0) -> int:
        """Exit status of the Popen'd process (raises subprocess.TimeoutExpired past the deadline)."""
        return self.popen.wait(timeout=timeout_s)

    def kill(self) -> None:
        """SIGKILL and reap. Safe to call twice."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=10)

    def close(self) -> None:
        self.kill()
        for pipe in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    def _stderr_tail(self) -> str:
        """Whatever stderr holds now, without blocking (a container init may keep the pipe open)."""
        if self.popen.stderr is None:
            return ""
        with contextlib.suppress(OSError, ValueError):
            fd = self.popen.stderr.fileno()
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            if poller.poll(50):
                return os.read(fd, 4000).decode(errors="replace")
        return ""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def popen_gpuwork(argv: list[str], **popen_kw: Any) -> subprocess.Popen[bytes]:
    """Starts the gpuwork binary with argv; stdin/stdout are pipes unless the caller overrides."""
    popen_kw.setdefault("stdin", subprocess.PIPE)
    popen_kw.setdefault("stdout", subprocess.PIPE)
    popen_kw.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen([str(build_gpuwork()), *argv], **popen_kw)


def run_host(steps: list[str], **popen_kw: Any) -> Workload:
    """Runs gpuwork with `steps` as a plain host process (no namespaces, the caller's cgroups)."""
    return Workload(popen_gpuwork(steps, **popen_kw))
