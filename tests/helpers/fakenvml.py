"""Build the fake libnvidia-ml.so.1 (tests/fakenvml/fake_nvml.c) and write the state it serves.

The fake reads its config file on every NVML call, so a test changes what "the driver" says by
rewriting the file; the rewrite is atomic (temp file + rename) so the library never sees half a file.
A process must be started with env() in its environment: the dynamic loader reads LD_LIBRARY_PATH
only at process start, and pynvml loads the library by its soname.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass, field, fields
from pathlib import Path

FAKENVML_DIR = Path(__file__).resolve().parent.parent / "fakenvml"
SOURCE_PATH = FAKENVML_DIR / "fake_nvml.c"
DEFAULT_BUILD_DIR = FAKENVML_DIR / "build"
LIB_NAME = "libnvidia-ml.so.1"
CFLAGS = ("-shared", "-fPIC", "-O2", "-Wall", "-Werror")
KINDS = ("compute", "graphics")


class FakeNvmlBuildError(RuntimeError):
    """gcc is missing or the fake library does not compile; the message says which."""


def build_fake_nvml(dest_dir: Path | None = None) -> Path:
    """Compile the fake library once per source hash; return the directory holding libnvidia-ml.so.1.

    Each hash gets its own directory so LD_LIBRARY_PATH can name it alone; concurrent builders
    (xdist workers, threads) each compile to a private temp name and rename, the last rename wins
    with identical bytes.
    """
    source = SOURCE_PATH.read_bytes()
    digest = hashlib.sha256(source + " ".join(CFLAGS).encode()).hexdigest()[:16]
    out_dir = (dest_dir or DEFAULT_BUILD_DIR) / digest
    lib_path = out_dir / LIB_NAME
    if lib_path.is_file():
        return out_dir
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise FakeNvmlBuildError("gcc not found: install it (apt-get install gcc) to build the fake NVML")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp_path = out_dir / f".{LIB_NAME}.{os.getpid()}.{threading.get_ident()}.tmp"
    result = subprocess.run(
        [compiler, *CFLAGS, "-o", str(tmp_path), str(SOURCE_PATH)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        tmp_path.unlink(missing_ok=True)
        first = (result.stderr.strip().splitlines() or ["no output"])[0]
        raise FakeNvmlBuildError(f"building {SOURCE_PATH.name} failed: {first}")
    os.replace(tmp_path, lib_path)
    return out_dir


def _token(value: str, what: str) -> str:
    """Config values are whitespace-separated tokens: refuse ones that would split."""
    if not value or any(ch.isspace() for ch in value):
        raise ValueError(f"{what}: {value!r} must be a non-empty token without whitespace")
    return value


@dataclass
class FakeGpu:
    index: int
    uuid: str
    minor: int | None = None  # None: the same as the index
    name: str = "NVIDIA H100 80GB HBM3"  # spaces are fine; underscores would come back as spaces
    mem_total_bytes: int = 80 * 1024**3
    mem_used_bytes: int = 0
    mem_reserved_bytes: int = 0  # v1 memory info counts it as used, v2 reports it apart
    mig: bool | None = None  # None: NVML says MIG is not supported on this GPU
    pci_bus_id: str = ""  # what nvmlDeviceGetPciInfo answers as busId, e.g. "00000000:3B:00.0"; "": empty
    fail: tuple[str, ...] = ()  # queries that fail: handle uuid name minor index memory mig compute ...
    fail_code: str = "GPU_IS_LOST"

    def line(self) -> str:
        parts = [
            f"gpu {self.index}",
            f"uuid={_token(self.uuid, 'uuid')}",
            f"minor={self.index if self.minor is None else self.minor}",
            f"name={_token(self.name.replace(' ', '_'), 'name')}",
            f"mem_total={self.mem_total_bytes}",
            f"mem_used={self.mem_used_bytes}",
            f"mem_reserved={self.mem_reserved_bytes}",
            f"mig={'-' if self.mig is None else int(self.mig)}",
        ]
        if self.pci_bus_id:
            parts.append(f"pci={_token(self.pci_bus_id, 'pci_bus_id')}")
        if self.fail:
            parts.append(f"fail={_token(','.join(self.fail), 'fail')}")
            parts.append(f"fail_code={_token(self.fail_code, 'fail_code')}")
        return " ".join(parts)


@dataclass
class FakeProc:
    gpu: int  # NVML index of the GPU that lists it
    pid: int
    used_bytes: int | None  # None: NVML_VALUE_NOT_AVAILABLE
    kind: str = "compute"  # compute | graphics
    gpu_instance_id: int | None = None  # MIG ids; None: not in MIG mode
    compute_instance_id: int | None = None

    def line(self) -> str:
        if self.kind not in KINDS:
            raise ValueError(f"kind: {self.kind!r} must be one of {KINDS}")
        used = "-" if self.used_bytes is None else str(self.used_bytes)
        out = f"proc {self.gpu} {self.pid} {used} {self.kind}"
        if self.gpu_instance_id is not None:
            out += f" gi={self.gpu_instance_id}"
        if self.compute_instance_id is not None:
            out += f" ci={self.compute_instance_id}"
        return out


@dataclass
class FakeNvml:
    """The whole state the fake driver serves, written to config_path."""

    config_path: Path
    gpus: list[FakeGpu] = field(default_factory=list)
    procs: list[FakeProc] = field(default_factory=list)
    driver_version: str = "550.54.15"
    fail_init: str | None = None  # e.g. "NVML_ERROR_DRIVER_NOT_LOADED" or "9"
    no_v3: bool = False  # the *_v3 process queries are missing, as with drivers before R510
    lib_dir: Path | None = None  # None: build_fake_nvml() on first env()

    def render(self) -> str:
        lines = [f"driver {_token(self.driver_version, 'driver_version')}"]
        if self.fail_init is not None:
            lines.append(f"fail_init {_token(self.fail_init, 'fail_init')}")
        if self.no_v3:
            lines.append("no_v3")
        lines.extend(gpu.line() for gpu in self.gpus)
        lines.extend(proc.line() for proc in self.procs)
        return "\n".join(lines) + "\n"

    def write(self, path: Path | None = None) -> Path:
        """Write the config atomically so a concurrent NVML call sees the old or the new state."""
        target = path or self.config_path
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp_path = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp_path.write_text(self.render())
        os.replace(tmp_path, target)
        return target

    def update(self, **changes: object) -> None:
        """Change some fields (gpus=, procs=, fail_init=, ...) and rewrite the config."""
        known = {f.name for f in fields(self)}
        for name, value in changes.items():
            if name not in known:
                raise TypeError(f"FakeNvml has no field {name!r}; known: {sorted(known)}")
            setattr(self, name, value)
        self.write()

    def env(self) -> dict[str, str]:
        """What a child process needs in its environment to load this fake as libnvidia-ml.so.1."""
        if self.lib_dir is None:
            self.lib_dir = build_fake_nvml()
        if not self.config_path.exists():
            self.write()
        return {"LD_LIBRARY_PATH": str(self.lib_dir), "FAKE_NVML_CONFIG": str(self.config_path)}
