"""Build, mount, steer and read the fake NVIDIA driver (tests/helpers/fakedriver/fakedriver.c).

The driver is a FUSE file system serving `nvidiactl`, `nvidia0`, `nvidia1` and `nvidia-uvm` as
regular files whose ioctls answer like the real driver's (NV_OK and handles written back, a
real RM object table, sizes rounded up and written back, -EINVAL for an unknown escape or a
wrong size). A test binds these files into a private /dev (rmplan's `--private-dev`,
`FakeContainer(bind_devices=driver.devices())`), so the tracer sees `/dev/nvidia0` as on a GPU
node, and compares what the tracer reports with the driver's own truth, `state()`.

    with FakeDriver() as driver:
        driver.fail_alloc(1)                       # the next memory allocation: NV_ERR_NO_MEMORY
        ...
        state = driver.wait_state(lambda s: not s.clients, "every client freed")
        assert state.gpu_bytes(0) == 0

Closing a file frees its clients in the driver's release handler, which the kernel sends after
close() has returned: read a state that follows a close with `wait_state`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from tests.helpers.fakenvml import FakeGpu
from tests.helpers.workload import BUILD_DIR, HELPERS_DIR

SOURCE = HELPERS_DIR / "fakedriver" / "fakedriver.c"
NAME = "fakedriver"
CFLAGS = ("-O2", "-Wall", "-Wextra", "-Werror")
DEFAULT_DRIVER = "595.45.04"
DEFAULT_PCI_BUS_IDS = ("00000000:17:00.0", "00000000:65:00.0")
DEVICE_NAMES = ("nvidiactl", "nvidia-uvm")  # plus nvidiaN, one per GPU
CTL_FILE = "ghostgpu-fake-ctl"
STATE_FILE = "ghostgpu-fake-state"
NV_OK = 0x0
NV_ERR_NO_MEMORY = 0x51  # nvstatuscodes.h (docs/reference/nvidia-ioctl-abi.md §6)
RM_MEMORY_GRANULE_BYTES = 2 << 20  # RM_ALLOC memory and heap allocations round up to this
NVOS02_GRANULE_BYTES = 4096  # RM_ALLOC_MEMORY rounds up to a CPU page
INSTALL_HINT = "install fuse3 and libfuse3-dev (apt-get install fuse3 libfuse3-dev pkg-config)"


class FakeDriverError(RuntimeError):
    """The fake driver cannot be built, mounted or read; the message says what to do."""


def fuse_unavailable() -> str | None:
    """Why the fake driver cannot run here (a skip reason), or None when it can."""
    if os.geteuid() != 0:
        return "needs root (a FUSE mount with allow_other, process_vm_readv of other processes)"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing: load the fuse module (modprobe fuse)"
    if shutil.which("fusermount3") is None:
        return f"fusermount3 is missing: {INSTALL_HINT}"
    if shutil.which("pkg-config") is None or _pkg_config("--exists") is None:
        return f"libfuse3 (pkg-config fuse3) is missing: {INSTALL_HINT}"
    if shutil.which("gcc") is None:
        return "gcc is missing: install it (apt-get install gcc) to build the fake driver"
    return None


def _pkg_config(*args: str) -> list[str] | None:
    try:
        proc = subprocess.run(["pkg-config", *args, "fuse3"], capture_output=True, text=True, check=False)
    except OSError:
        return None
    return proc.stdout.split() if proc.returncode == 0 else None


def build_fakedriver() -> Path:
    """Compile fakedriver.c once per content and flags: build/<hash>/fakedriver (ignored by git)."""
    cflags, libs = _pkg_config("--cflags"), _pkg_config("--libs")
    if cflags is None or libs is None:
        raise FakeDriverError(f"fakedriver: libfuse3 not found by pkg-config: {INSTALL_HINT}")
    flags = (*CFLAGS, *cflags)
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join((*flags, *libs)).encode()).hexdigest()[:16]
    binary = BUILD_DIR / digest / NAME
    if binary.exists():
        return binary
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise FakeDriverError("fakedriver: no C compiler (gcc) on PATH; install gcc (apt-get install gcc)")
    binary.parent.mkdir(parents=True, exist_ok=True)
    tmp = binary.parent / f".{NAME}.{os.getpid()}.{threading.get_ident()}.tmp"
    proc = subprocess.run([cc, *flags, "-o", str(tmp), str(SOURCE), *libs], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise FakeDriverError(f"fakedriver: {cc} failed (rc={proc.returncode}): {proc.stderr.strip()[:2000]}")
    os.replace(tmp, binary)  # concurrent builders: the last rename wins with identical bytes
    return binary


@dataclass(frozen=True)
class DriverState:
    """One read of ghostgpu-fake-state (its JSON in `raw`; the layout is in fakedriver.c's header)."""

    raw: dict[str, Any]

    @property
    def clients(self) -> list[dict[str, Any]]:
        return list(self.raw["clients"])

    @property
    def memory(self) -> list[dict[str, Any]]:
        return list(self.raw["memory"])

    @property
    def counters(self) -> dict[str, int]:
        return dict(self.raw["counters"])

    def client(self, handle: int) -> dict[str, Any] | None:
        return next((c for c in self.raw["clients"] if c["handle"] == handle), None)

    def gpu_bytes(self, gpu: int) -> int:
        """Bytes allocated on GPU `gpu`, each allocation once however many handles share it."""
        return int(self.raw["gpus"][gpu]["allocated_bytes"])

    def client_bytes(self, handle: int, gpu: int, *, shared: bool = False) -> int:
        """What client `handle` allocated itself on `gpu` (shared=True: what it holds by dup)."""
        client = self.client(handle)
        if client is None:
            return 0
        return int(client["shared" if shared else "gpus"][str(gpu)])

    def pid_bytes(self, pid: int) -> dict[int, int]:
        """Per GPU index: bytes the clients created by host PID `pid` allocated themselves."""
        out: dict[int, int] = {}
        for client in self.raw["clients"]:
            if client["pid"] == pid:
                for gpu, size in client["gpus"].items():
                    out[int(gpu)] = out.get(int(gpu), 0) + int(size)
        return out


class FakeDriver:
    """A mounted fake driver; `with FakeDriver() as d:` mounts it and always unmounts it.

    mount_dir: an empty directory (default: a new one under /tmp, removed at stop).
    driver: the release whose RM_ALLOC layouts it answers and CHECK_VERSION_STR reports.
    pci_bus_ids: one GPU per id (NVML's busId form); GPU i is `nvidia{i}`, minor i.
    """

    def __init__(self, mount_dir: Path | None = None, *, driver: str = DEFAULT_DRIVER,
                 pci_bus_ids: Sequence[str] = DEFAULT_PCI_BUS_IDS, max_objects: int | None = None) -> None:
        self.driver = driver
        self.pci_bus_ids = tuple(pci_bus_ids)
        self.max_objects = max_objects
        self._own_dir = mount_dir is None
        self.mount_dir = mount_dir or Path(tempfile.mkdtemp(prefix="ghostgpu-fakedriver-"))
        self.popen: subprocess.Popen[bytes] | None = None

    # ---- paths ---------------------------------------------------------------------------------

    def path(self, name: str) -> Path:
        return self.mount_dir / name

    @property
    def ctl_path(self) -> Path:
        return self.path("nvidiactl")

    @property
    def uvm_path(self) -> Path:
        return self.path("nvidia-uvm")

    def gpu_path(self, index: int) -> Path:
        return self.path(f"nvidia{index}")

    def devices(self) -> dict[str, str]:
        """/dev name -> file in the mount: what to bind into a private /dev (rmplan --private-dev,
        FakeContainer(bind_devices=...))."""
        names = ["nvidiactl", *(f"nvidia{i}" for i in range(len(self.pci_bus_ids))), "nvidia-uvm"]
        return {name: str(self.path(name)) for name in names}

    def nvml_gpus(self, uuid_prefix: str = "GPU-0a1b2c3d-0000-4000-8000-00000000000") -> list[FakeGpu]:
        """Fake NVML GPUs that match this driver: same index, minor and PCI bus id."""
        return [FakeGpu(index=i, uuid=f"{uuid_prefix}{i}", minor=i, pci_bus_id=pci)
                for i, pci in enumerate(self.pci_bus_ids)]

    # ---- life cycle ----------------------------------------------------------------------------

    def argv(self, binary: Path) -> list[str]:
        argv = [str(binary), str(self.mount_dir), "--driver", self.driver]
        for pci in self.pci_bus_ids:
            argv += ["--gpu", pci]
        if self.max_objects is not None:
            argv += ["--max-objects", str(self.max_objects)]
        return argv

    def start(self, timeout_s: float = 10.0) -> None:
        """Builds the driver, mounts it and waits until its state file answers."""
        reason = fuse_unavailable()
        if reason is not None:
            raise FakeDriverError(f"fakedriver: {reason}")
        binary = build_fakedriver()
        self.mount_dir.mkdir(parents=True, exist_ok=True)
        self.popen = subprocess.Popen(self.argv(binary), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while not self.path(STATE_FILE).exists():
            if self.popen.poll() is not None:
                err = self.popen.stderr.read().decode(errors="replace").strip() if self.popen.stderr else ""
                raise FakeDriverError(f"fakedriver exited {self.popen.returncode} before mounting: {err}")
            if time.monotonic() > deadline:
                self.stop()
                raise FakeDriverError(f"fakedriver did not mount {self.mount_dir} within {timeout_s}s")
            time.sleep(0.005)  # polling interval for the mount to appear

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM (the daemon unmounts itself); past the deadline SIGKILL and a lazy unmount."""
        popen, self.popen = self.popen, None
        if popen is not None:
            if popen.poll() is None:
                popen.send_signal(signal.SIGTERM)
                try:
                    popen.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    popen.kill()
                    popen.wait(timeout=timeout_s)
            for pipe in (popen.stdout, popen.stderr):
                if pipe is not None:
                    pipe.close()
        if _is_mounted(self.mount_dir):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mount_dir)], capture_output=True, check=False)
        if self._own_dir:
            with contextlib.suppress(OSError):
                self.mount_dir.rmdir()

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # ---- control and truth ---------------------------------------------------------------------

    def control(self, command: str) -> None:
        """One line to ghostgpu-fake-ctl: fail-alloc N | fail-size-over BYTES | reset."""
        try:
            with open(self.path(CTL_FILE), "w") as ctl:
                ctl.write(command.rstrip("\n") + "\n")
        except OSError as e:
            raise FakeDriverError(f"fakedriver control {command!r}: {e}") from e

    def fail_alloc(self, count: int) -> None:
        """The next `count` memory allocations fail with NV_ERR_NO_MEMORY."""
        self.control(f"fail-alloc {count}")

    def fail_size_over(self, size_bytes: int) -> None:
        """Memory allocations over `size_bytes` (after rounding) fail; 0 turns it off."""
        self.control(f"fail-size-over {size_bytes}")

    def reset(self) -> None:
        self.control("reset")

    def state(self) -> DriverState:
        try:
            return DriverState(json.loads(self.path(STATE_FILE).read_text()))
        except (OSError, ValueError) as e:
            raise FakeDriverError(f"fakedriver state {self.path(STATE_FILE)}: {e}") from e

    def wait_state(self, predicate: Callable[[DriverState], bool], what: str,
                   timeout_s: float = 5.0) -> DriverState:
        """The first state for which predicate holds; AssertionError naming `what` past the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.state()
            if predicate(state):
                return state
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout_s} s waiting for {what}; driver state: {state.raw}")
            time.sleep(0.005)  # polling interval: release arrives after close() has returned


def _is_mounted(path: Path) -> bool:
    target = str(path)
    try:
        with open("/proc/self/mountinfo") as f:
            return any(line.split(" ")[4] == target for line in f if line.count(" ") > 4)
    except OSError:
        return False
