"""NvmlSource through the real pynvml code path against the fake libnvidia-ml.so.1.

Each case runs the source in a child process, because the loader reads LD_LIBRARY_PATH only at
process start and pynvml keeps the library loaded for the life of the process. The child reads a
view each time the test writes "read" on its stdin, so the test can rewrite the fake's state between
two reads of the same NvmlSource. Needs gcc, not root.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.tracer.events import NvmlGpu, NvmlProcess, NvmlView

from tests.helpers.fakenvml import FakeGpu, FakeNvml, FakeNvmlBuildError, FakeProc, build_fake_nvml

REPO_ROOT = Path(__file__).resolve().parents[2]
UUID0 = "GPU-11111111-2222-3333-4444-555555555555"
UUID1 = "GPU-66666666-7777-8888-9999-000000000000"
GIB = 1024**3

CHILD = r"""
import dataclasses, json, logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
from ghostgpu.tracer.nvml import NvmlSource
source = NvmlSource(retry_interval_s=float(sys.argv[1]))
for line in sys.stdin:
    if line.strip() == "close":
        source.close()
        print("{}", flush=True)
    else:
        print(json.dumps(dataclasses.asdict(source.read())), flush=True)
"""


class Child:
    """One NvmlSource in its own process, driven line by line with a deadline per answer."""

    def __init__(self, env: dict[str, str], retry_interval_s: float = 30.0) -> None:
        full_env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "FAKE_NVML_CONFIG")}
        full_env.update(env)
        full_env["PYTHONPATH"] = str(REPO_ROOT)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(retry_interval_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=full_env, cwd=REPO_ROOT,
        )

    def ask(self, command: str = "read", timeout_s: float = 20.0) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    break
                return json.loads(line)
        _, err = self.finish()
        raise AssertionError(f"child gave no answer to {command!r} within {timeout_s} s; stderr: {err}")

    def finish(self) -> tuple[int, str]:
        """Close stdin, wait for the exit, return (exit code, stderr)."""
        try:
            _, err = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return self.proc.returncode, err


def normal(value: Any) -> Any:
    """A dataclass view as the child prints it (JSON: tuples are lists), without the timestamp."""
    data = json.loads(json.dumps(asdict(value) if not isinstance(value, dict) else value))
    assert data.pop("ts_ns") > 0
    return data


@pytest.fixture(scope="session")
def lib_dir() -> Path:
    try:
        return build_fake_nvml()
    except FakeNvmlBuildError as exc:
        if "not found" in str(exc):
            pytest.skip(str(exc))
        raise


@pytest.fixture
def fake(tmp_path: Path, lib_dir: Path) -> FakeNvml:
    return FakeNvml(config_path=tmp_path / "nvml.conf", lib_dir=lib_dir)


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for child in started:
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.communicate()


def two_gpus() -> list[FakeGpu]:
    return [
        FakeGpu(0, UUID0, minor=0, name="NVIDIA H100 80GB HBM3", mem_total_bytes=80 * GIB,
                mem_used_bytes=3 * GIB, mem_reserved_bytes=GIB // 2, mig=False,
                pci_bus_id="00000000:17:00.0"),
        FakeGpu(1, UUID1, minor=3, name="NVIDIA H100 80GB HBM3", mem_total_bytes=80 * GIB,
                mem_used_bytes=GIB, mig=None),
    ]


def expected_gpu(index: int, **changes: Any) -> NvmlGpu:
    base = {
        0: NvmlGpu(index=0, uuid=UUID0, minor=0, name="NVIDIA H100 80GB HBM3", memory_total_bytes=80 * GIB,
                   memory_used_bytes=3 * GIB, mig_mode=False, pci_bus_id="00000000:17:00.0"),
        1: NvmlGpu(index=1, uuid=UUID1, minor=3, name="NVIDIA H100 80GB HBM3", memory_total_bytes=80 * GIB,
                   memory_used_bytes=GIB, mig_mode=None),
    }[index]
    return replace(base, **changes)


def test_two_gpus_with_processes(fake: FakeNvml, children: list[Child]) -> None:
    fake.gpus = two_gpus()
    fake.procs = [
        FakeProc(0, 12345, 512 * 1024**2),
        FakeProc(0, 12346, None),  # NVML_VALUE_NOT_AVAILABLE
        FakeProc(0, 12345, 512 * 1024**2, kind="graphics"),
        FakeProc(1, 4242, 256 * 1024**2, kind="graphics"),
        FakeProc(1, 777, GIB),
    ]
    fake.write()
    children.append(child := Child(fake.env()))
    expected = NvmlView(available=True, ts_ns=1, driver_version="550.54.15", gpus=(
        expected_gpu(0, processes=(NvmlProcess(12345, 512 * 1024**2, "compute+graphics"),
                                   NvmlProcess(12346, None, "compute"))),
        expected_gpu(1, processes=(NvmlProcess(777, GIB, "compute"),
                                   NvmlProcess(4242, 256 * 1024**2, "graphics"))),
    ))
    assert normal(child.ask()) == normal(expected)
    code, err = child.finish()
    assert code == 0 and "WARNING" not in err


def test_config_change_between_reads_of_one_source(fake: FakeNvml, children: list[Child]) -> None:
    fake.gpus = two_gpus()
    fake.procs = [FakeProc(0, 100, GIB)]
    fake.write()
    children.append(child := Child(fake.env()))
    first = child.ask()
    assert first["gpus"][0]["processes"] == [{"pid": 100, "used_gpu_memory_bytes": GIB, "kind": "compute"}]
    gpus = two_gpus()
    gpus[0].mig = True
    gpus[1].mem_used_bytes = 5 * GIB
    fake.update(gpus=gpus, procs=[FakeProc(0, 200, None), FakeProc(1, 300, 7)], driver_version="550.54.15")
    second = child.ask()
    assert second["ts_ns"] > first["ts_ns"]
    assert normal(second) == normal(NvmlView(available=True, ts_ns=1, driver_version="550.54.15", gpus=(
        expected_gpu(0, mig_mode=True, processes=(NvmlProcess(200, None, "compute"),)),
        expected_gpu(1, memory_used_bytes=5 * GIB, processes=(NvmlProcess(300, 7, "compute"),)),
    )))
    assert child.ask("close") == {}
    assert normal(child.ask()) == normal(second)  # a closed source initializes again on read
    assert child.finish()[0] == 0


def test_fail_init_driver_not_loaded(fake: FakeNvml, children: list[Child]) -> None:
    fake.gpus = two_gpus()
    fake.fail_init = "NVML_ERROR_DRIVER_NOT_LOADED"
    fake.write()
    children.append(child := Child(fake.env()))
    views = [child.ask(), child.ask()]
    for view in views:
        assert view["available"] is False and view["gpus"] == []
        assert "driver not loaded" in view["error"] and "\n" not in view["error"]
    code, err = child.finish()
    assert code == 0
    assert err.count("WARNING ghostgpu.nvml") == 1  # one line, not one per read


def test_driver_that_loads_later_is_picked_up(fake: FakeNvml, children: list[Child]) -> None:
    fake.gpus = two_gpus()[:1]
    fake.fail_init = "9"  # numeric NVML_ERROR_DRIVER_NOT_LOADED
    fake.write()
    children.append(child := Child(fake.env(), retry_interval_s=0.0))
    assert child.ask()["available"] is False
    fake.update(fail_init=None)
    assert normal(child.ask()) == normal(NvmlView(True, 1, "550.54.15", gpus=(expected_gpu(0),)))


def test_no_config_means_no_driver(lib_dir: Path, children: list[Child]) -> None:
    children.append(child := Child({"LD_LIBRARY_PATH": str(lib_dir)}))
    view = child.ask()
    assert view["available"] is False and "driver not loaded" in view["error"]


def test_library_absent(tmp_path: Path, children: list[Child]) -> None:
    system_lib = ctypes.util.find_library("nvidia-ml")
    if system_lib:
        pytest.skip(f"a real NVML ({system_lib}) is installed here, so its absence cannot be simulated")
    empty = tmp_path / "empty"
    empty.mkdir()
    children.append(child := Child({"LD_LIBRARY_PATH": str(empty)}))
    view = child.ask()
    assert view["available"] is False and view["gpus"] == []
    assert "libnvidia-ml.so.1" in view["error"] and "\n" not in view["error"]
    assert child.ask()["error"] == view["error"]
    code, err = child.finish()
    assert code == 0 and err.count("WARNING ghostgpu.nvml") == 1


def test_lost_gpu_keeps_the_other(fake: FakeNvml, children: list[Child]) -> None:
    gpus = two_gpus()
    gpus[0].fail = ("memory", "compute")
    fake.gpus = gpus
    fake.procs = [FakeProc(0, 100, GIB), FakeProc(0, 101, 5, kind="graphics"), FakeProc(1, 200, GIB)]
    fake.write()
    children.append(child := Child(fake.env()))
    views = [child.ask(), child.ask()]
    expected = NvmlView(True, 1, "550.54.15", gpus=(
        expected_gpu(0, memory_total_bytes=None, memory_used_bytes=None,
                     processes=(NvmlProcess(101, 5, "graphics"),), processes_known=False),
        expected_gpu(1, processes=(NvmlProcess(200, GIB, "compute"),)),
    ))
    assert [normal(v) for v in views] == [normal(expected)] * 2
    code, err = child.finish()
    assert code == 0
    warnings = [line for line in err.splitlines() if line.startswith("WARNING ghostgpu.nvml")]
    assert len(warnings) == 2 and all(f"GPU 0 ({UUID0})" in w and "GPU is lost" in w for w in warnings)


def test_driver_without_v3_queries_uses_v2(fake: FakeNvml, children: list[Child]) -> None:
    fake.gpus = two_gpus()[:1]
    fake.no_v3 = True
    fake.procs = [FakeProc(0, 100, GIB), FakeProc(0, 100, GIB, kind="graphics"), FakeProc(0, 9, None)]
    fake.write()
    children.append(child := Child(fake.env()))
    expected = NvmlView(True, 1, "550.54.15", gpus=(
        expected_gpu(0, processes=(NvmlProcess(9, None, "compute"),
                                   NvmlProcess(100, GIB, "compute+graphics"))),
    ))
    assert normal(child.ask()) == normal(expected)
    code, err = child.finish()
    assert code == 0 and "WARNING" not in err


def test_no_gpus_is_an_available_empty_view(fake: FakeNvml, children: list[Child]) -> None:
    fake.write()
    children.append(child := Child(fake.env()))
    assert normal(child.ask()) == normal(NvmlView(True, 1, "550.54.15", gpus=()))


def test_many_processes_through_the_two_call_protocol(fake: FakeNvml, children: list[Child]) -> None:
    fake.gpus = two_gpus()[:1]
    fake.procs = [FakeProc(0, 1000 + i, i * 4096) for i in range(200)]
    fake.write()
    children.append(child := Child(fake.env()))
    processes = child.ask()["gpus"][0]["processes"]
    assert processes == [{"pid": 1000 + i, "used_gpu_memory_bytes": i * 4096, "kind": "compute"}
                         for i in range(200)]


@pytest.mark.parametrize(
    ("item", "line"),
    [
        (FakeProc(0, 5, None), "proc 0 5 - compute"),
        (FakeProc(1, 6, 7, kind="graphics", gpu_instance_id=1, compute_instance_id=0),
         "proc 1 6 7 graphics gi=1 ci=0"),
        (FakeGpu(2, "GPU-x", name="A B", mem_total_bytes=8, mem_used_bytes=1, mig=True, fail=("all",)),
         "gpu 2 uuid=GPU-x minor=2 name=A_B mem_total=8 mem_used=1 mem_reserved=0 mig=1 fail=all "
         "fail_code=GPU_IS_LOST"),
    ],
)
def test_fake_config_lines(item: FakeGpu | FakeProc, line: str) -> None:
    assert item.line() == line


LAYOUT_CHILD = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
class V1(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]
class V2(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]
assert lib.nvmlInit_v2() == 0
handle = ctypes.c_void_p()
assert lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)) == 0
for name, struct in (("nvmlDeviceGetComputeRunningProcesses", V1),
                     ("nvmlDeviceGetComputeRunningProcesses_v2", V2),
                     ("nvmlDeviceGetGraphicsRunningProcesses_v3", V2)):
    count = ctypes.c_uint(1)
    rc = getattr(lib, name)(handle, ctypes.byref(count), (struct * 1)())
    rows = (struct * count.value)()
    rc2 = getattr(lib, name)(handle, ctypes.byref(count), rows)
    got = [(r.pid, r.usedGpuMemory, getattr(r, "gpuInstanceId", None)) for r in rows]
    print(name, rc, count.value, rc2, got)
"""


def test_fake_struct_layouts_per_version(fake: FakeNvml) -> None:
    """The plain (v1) queries fill 16-byte rows, _v2/_v3 24-byte rows with the MIG ids."""
    fake.gpus = two_gpus()[:1]
    fake.procs = [
        FakeProc(0, 11, 1),
        FakeProc(0, 12, None),
        FakeProc(0, 13, 3, kind="graphics", gpu_instance_id=2, compute_instance_id=0),
        FakeProc(0, 14, 4, kind="graphics"),
    ]
    fake.write()
    lib = str((fake.lib_dir or Path()) / "libnvidia-ml.so.1")
    env = {**os.environ, "FAKE_NVML_CONFIG": str(fake.config_path)}
    result = subprocess.run([sys.executable, "-c", LAYOUT_CHILD, lib], capture_output=True, text=True,
                            env=env, timeout=30, check=False)
    assert result.returncode == 0, result.stderr
    # First call with room for one row: 7 (INSUFFICIENT_SIZE) and the count needed; then 0 and the rows.
    na, no_mig = (1 << 64) - 1, (1 << 32) - 1
    assert result.stdout.splitlines() == [
        f"nvmlDeviceGetComputeRunningProcesses 7 2 0 [(11, 1, None), (12, {na}, None)]",
        f"nvmlDeviceGetComputeRunningProcesses_v2 7 2 0 [(11, 1, {no_mig}), (12, {na}, {no_mig})]",
        f"nvmlDeviceGetGraphicsRunningProcesses_v3 7 2 0 [(13, 3, 2), (14, 4, {no_mig})]",
    ]


PCI_CHILD = r"""
import ctypes, sys
import pynvml
lib = ctypes.CDLL(sys.argv[1])
assert lib.nvmlInit_v2() == 0
for index in (0, 1):
    handle = ctypes.c_void_p()
    assert lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) == 0
    for name in ("nvmlDeviceGetPciInfo", "nvmlDeviceGetPciInfo_v2", "nvmlDeviceGetPciInfo_v3"):
        info = pynvml.nvmlPciInfo_t()
        rc = getattr(lib, name)(handle, ctypes.byref(info))
        print(index, name, rc, info.busId, info.busIdLegacy, info.domain, hex(info.bus), info.device)
"""


def test_fake_answers_pci_info_per_gpu_in_every_version(fake: FakeNvml) -> None:
    """nvmlPciInfo_t as pynvml lays it out, from each entry point, per GPU (a GPU without a bus id
    configured answers empty ones: test_two_gpus_with_processes)."""
    fake.gpus = two_gpus()
    fake.gpus[1].pci_bus_id = "00000001:3B:02.0"
    fake.write()
    lib = str((fake.lib_dir or Path()) / "libnvidia-ml.so.1")
    env = {**os.environ, "FAKE_NVML_CONFIG": str(fake.config_path)}
    result = subprocess.run([sys.executable, "-c", PCI_CHILD, lib], capture_output=True, text=True,
                            env=env, timeout=30, check=False)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # The plain and _v2 names fill the struct before NVML 9.0: the legacy id where its busId[16] was,
    # the numbers, and nothing where busId[32] now is (their callers' struct has reserved fields there).
    assert lines[:3] == [f"0 {name} 0 {bus_id} 0000:17:00.0 0 0x17 0" for name, bus_id in
                         (("nvmlDeviceGetPciInfo", ""), ("nvmlDeviceGetPciInfo_v2", ""),
                          ("nvmlDeviceGetPciInfo_v3", "00000000:17:00.0"))]
    assert lines[3] == "1 nvmlDeviceGetPciInfo 0  0001:3B:02.0 1 0x3b 2"
    assert lines[5] == "1 nvmlDeviceGetPciInfo_v3 0 00000001:3B:02.0 0001:3B:02.0 1 0x3b 2"
