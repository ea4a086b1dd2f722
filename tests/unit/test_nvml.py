"""NVML source without a library: the pure mapping, the failure lines, and the init/retry/fallback
logic against an in-memory stand-in for pynvml that raises pynvml's own exception classes."""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest
from ghostgpu.tracer.events import NvmlGpu, NvmlProcess
from ghostgpu.tracer.nvml import (
    NOT_AVAILABLE_U64,
    NvmlSource,
    describe_failure,
    merge_processes,
    pci_bus_id,
    used_memory_bytes,
)

NA = None  # what nvidia-ml-py 11+ puts in usedGpuMemory for NVML_VALUE_NOT_AVAILABLE
NO_MIG = pynvml.NVML_VALUE_NOT_AVAILABLE_uint.value  # gpuInstanceId/computeInstanceId outside MIG


def proc(pid: Any, used: Any, gi: int = NO_MIG, ci: int = NO_MIG) -> SimpleNamespace:
    """The shape of pynvml's nvmlFriendlyObject for c_nvmlProcessInfo_v3_t."""
    return SimpleNamespace(pid=pid, usedGpuMemory=used, gpuInstanceId=gi, computeInstanceId=ci)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, None),
        (NOT_AVAILABLE_U64, None),  # an older binding passing the raw sentinel through
        (pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value, None),
        (0, 0),
        (536870912, 536870912),
        (NOT_AVAILABLE_U64 - 1, NOT_AVAILABLE_U64 - 1),
        (-1, None),
        ("junk", None),
        (True, None),
    ],
)
def test_used_memory_bytes(raw: Any, expected: int | None) -> None:
    assert used_memory_bytes(raw) == expected


MERGE_CASES = [
    ("nothing", [], [], ()),
    ("one compute", [proc(7, 100)], [], (NvmlProcess(7, 100, "compute"),)),
    ("one graphics", [], [proc(7, 100)], (NvmlProcess(7, 100, "graphics"),)),
    ("not available", [proc(7, NA)], [], (NvmlProcess(7, None, "compute"),)),
    ("raw sentinel", [proc(7, NOT_AVAILABLE_U64)], [], (NvmlProcess(7, None, "compute"),)),
    (
        "both lists: same memory reported twice is not added",
        [proc(7, 300)],
        [proc(7, 200)],
        (NvmlProcess(7, 300, "compute+graphics"),),
    ),
    ("both lists, one unknown", [proc(7, NA)], [proc(7, 200)], (NvmlProcess(7, 200, "compute+graphics"),)),
    ("both lists, both unknown", [proc(7, NA)], [proc(7, NA)], (NvmlProcess(7, None, "compute+graphics"),)),
    (
        "MIG: two instances hold separate memory",
        [proc(7, 100, gi=1, ci=0), proc(7, 50, gi=2, ci=0)],
        [],
        (NvmlProcess(7, 150, "compute"),),
    ),
    (
        "MIG: one instance unknown",
        [proc(7, NA, gi=1, ci=0), proc(7, 50, gi=2, ci=0)],
        [],
        (NvmlProcess(7, 50, "compute"),),
    ),
    (
        "sorted by pid",
        [proc(30, 1), proc(10, 2)],
        [proc(20, 3)],
        (NvmlProcess(10, 2, "compute"), NvmlProcess(20, 3, "graphics"), NvmlProcess(30, 1, "compute")),
    ),
    (
        "v1 objects without MIG ids",
        [SimpleNamespace(pid=5, usedGpuMemory=9)],
        [],
        (NvmlProcess(5, 9, "compute"),),
    ),
    ("bad pids are skipped", [proc(None, 1), proc(-3, 1), proc(True, 1), proc(4, 1)], [],
     (NvmlProcess(4, 1, "compute"),)),
]


@pytest.mark.parametrize(("compute", "graphics", "expected"), [c[1:] for c in MERGE_CASES],
                         ids=[c[0] for c in MERGE_CASES])
def test_merge_processes(compute: list[Any], graphics: list[Any], expected: tuple[NvmlProcess, ...]) -> None:
    assert merge_processes(compute, graphics) == expected


@pytest.mark.parametrize(
    ("exc", "must_contain"),
    [
        (pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND), ["libnvidia-ml.so.1 not found", "install"]),
        (pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED), ["driver not loaded", "modprobe nvidia"]),
        (pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION), ["no permission", "/dev/nvidiactl"]),
        (pynvml.NVMLError(pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH), ["does not match", "reboot"]),
        (pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND), ["too old", "upgrade"]),
        (pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN), ["nvmlInit failed", "Unknown Error", "nvidia-smi"]),
        (ImportError("No module named 'pynvml'"), ["nvidia-ml-py", "pip install"]),
        (OSError("weird"), ["OSError: weird"]),
    ],
)
def test_describe_failure(exc: BaseException, must_contain: list[str]) -> None:
    line = describe_failure("nvmlInit", exc, 30.0)
    assert line.startswith("NVML: ")
    assert "\n" not in line
    for part in must_contain:
        assert part in line


class FakeBindings:
    """Just enough of pynvml's API for NvmlSource, failing where `errors` says (query -> code)."""

    NVML_INIT_FLAG_NO_GPUS = pynvml.NVML_INIT_FLAG_NO_GPUS
    nvmlMemory_v2 = pynvml.nvmlMemory_v2

    def __init__(self, gpus: int = 1) -> None:
        self.gpus = gpus
        self.errors: dict[tuple[str, int | None], int] = {}  # (query, gpu index or None) -> NVML code
        self.calls: dict[str, int] = {}
        self.mig: dict[int, Any] = {}  # handle -> what nvmlDeviceGetMigMode returns; default [0, 0]

    def _call(self, query: str, index: int | None = None) -> None:
        self.calls[query] = self.calls.get(query, 0) + 1
        code = self.errors.get((query, index), self.errors.get((query, None)))
        if code is not None:
            raise pynvml.NVMLError(code)

    def nvmlInitWithFlags(self, flags: int) -> None:
        assert flags == pynvml.NVML_INIT_FLAG_NO_GPUS
        self._call("init")

    def nvmlShutdown(self) -> None:
        self._call("shutdown")

    def nvmlSystemGetDriverVersion(self) -> str:
        self._call("driver")
        return "570.86.15"

    def nvmlDeviceGetCount(self) -> int:
        self._call("count")
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._call("handle", index)
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        self._call("uuid", handle)
        return f"GPU-{handle}"

    def nvmlDeviceGetMinorNumber(self, handle: int) -> int:
        self._call("minor", handle)
        return handle + 10

    def nvmlDeviceGetName(self, handle: int) -> str:
        self._call("name", handle)
        return "NVIDIA H200"

    def nvmlDeviceGetMemoryInfo(self, handle: int, version: int | None = None) -> SimpleNamespace:
        self._call("memory_v2" if version else "memory_v1", handle)
        return SimpleNamespace(total=1000, used=100 if version else 150)

    def nvmlDeviceGetMigMode(self, handle: int) -> Any:
        self._call("mig", handle)
        return self.mig.get(handle, [0, 0])

    def nvmlDeviceGetPciInfo(self, handle: int) -> SimpleNamespace:
        self._call("pci", handle)
        # pynvml decodes the char arrays to str; busIdLegacy keeps the 4-digit domain
        return SimpleNamespace(busId=f"00000000:{0x3B + handle:02X}:00.0", busIdLegacy="0000:3B:00.0")

    def _procs(self, query: str, handle: int) -> list[Any]:
        self._call(query, handle)
        return [proc(100 + handle, 64)]

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: int) -> list[Any]:
        return self._procs("compute_v3", handle)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: int) -> list[Any]:
        return self._procs("compute_v2", handle)

    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, handle: int) -> list[Any]:
        return self._procs("graphics_v3", handle)

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle: int) -> list[Any]:
        return self._procs("graphics_v2", handle)


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def healthy_gpu(index: int, used: int = 100) -> NvmlGpu:
    return NvmlGpu(
        index=index, uuid=f"GPU-{index}", minor=index + 10, name="NVIDIA H200", memory_total_bytes=1000,
        memory_used_bytes=used, mig_mode=False, pci_bus_id=f"00000000:{0x3B + index:02X}:00.0",
        processes=(NvmlProcess(100 + index, 64, "compute+graphics"),),
    )


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "ghostgpu.nvml" and r.levelno == logging.WARNING]


def test_healthy_read_maps_every_field() -> None:
    source = NvmlSource(bindings=FakeBindings(gpus=2), clock=Clock())
    view = source.read()
    assert view.available and view.error == "" and view.ts_ns > 0
    assert view.driver_version == "570.86.15"
    assert view.gpus == (healthy_gpu(0), healthy_gpu(1))


def test_init_failure_is_logged_once_and_retried_after_the_interval(caplog: pytest.LogCaptureFixture) -> None:
    fake, clock = FakeBindings(), Clock()
    fake.errors[("init", None)] = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    source = NvmlSource(retry_interval_s=30.0, clock=clock, bindings=fake)
    views = [source.read()]
    clock.now_s += 10
    views.append(source.read())  # inside the interval: no new init
    assert fake.calls["init"] == 1
    clock.now_s += 25
    views.append(source.read())  # past it: one retry, same cause, no new log line
    assert fake.calls["init"] == 2
    assert all(not v.available and "driver not loaded" in v.error for v in views)
    assert warnings_of(caplog) == [views[0].error]
    del fake.errors[("init", None)]  # the driver loads
    clock.now_s += 31
    assert source.read().available
    assert fake.calls["init"] == 3


def test_pynvml_missing_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    view = NvmlSource(clock=Clock()).read()
    assert not view.available
    assert "nvidia-ml-py" in view.error


def test_driver_lost_after_init_shuts_down_and_retries(caplog: pytest.LogCaptureFixture) -> None:
    fake, clock = FakeBindings(), Clock()
    source = NvmlSource(retry_interval_s=30.0, clock=clock, bindings=fake)
    assert source.read().available
    fake.errors[("count", None)] = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    view = source.read()
    assert not view.available and "nvmlDeviceGetCount" in view.error
    assert fake.calls["shutdown"] == 1 and not source.initialized
    del fake.errors[("count", None)]
    assert not source.read().available  # still inside the retry interval
    clock.now_s += 31
    assert source.read().available and fake.calls["init"] == 2
    assert len(warnings_of(caplog)) == 1


def test_lost_gpu_keeps_the_others_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeBindings(gpus=3)
    fake.errors[("handle", 1)] = pynvml.NVML_ERROR_GPU_IS_LOST
    fake.errors[("compute_v3", 2)] = pynvml.NVML_ERROR_GPU_IS_LOST
    fake.errors[("memory_v2", 2)] = pynvml.NVML_ERROR_GPU_IS_LOST
    source = NvmlSource(bindings=fake, clock=Clock())
    first, second = source.read(), source.read()
    assert first.gpus == second.gpus
    assert first.gpus[0] == healthy_gpu(0)
    assert first.gpus[1] == NvmlGpu(index=1, uuid="", minor=None, processes_known=False)
    assert first.gpus[2] == NvmlGpu(
        index=2, uuid="GPU-2", minor=12, name="NVIDIA H200", mig_mode=False, pci_bus_id="00000000:3D:00.0",
        processes=(NvmlProcess(102, 64, "graphics"),), processes_known=False,
    )
    logged = warnings_of(caplog)
    assert len(logged) == 3  # handle of GPU 1, memory and compute of GPU 2: each once over two reads
    assert all("GPU is lost" in line and "reset the GPU" in line for line in logged)


def test_not_supported_mig_and_graphics_are_quiet(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeBindings()
    fake.errors[("mig", None)] = pynvml.NVML_ERROR_NOT_SUPPORTED
    fake.errors[("graphics_v3", None)] = pynvml.NVML_ERROR_NOT_SUPPORTED
    gpu = NvmlSource(bindings=fake, clock=Clock()).read().gpus[0]
    assert gpu.mig_mode is None
    assert gpu.processes == (NvmlProcess(100, 64, "compute"),)
    assert gpu.processes_known
    assert warnings_of(caplog) == []


def test_compute_not_supported_means_unknown_processes() -> None:
    fake = FakeBindings()
    fake.errors[("compute_v3", None)] = pynvml.NVML_ERROR_NOT_SUPPORTED
    gpu = NvmlSource(bindings=fake, clock=Clock()).read().gpus[0]
    assert not gpu.processes_known


@pytest.mark.parametrize(
    ("missing", "used_then"),
    [
        ({("compute_v3", None): pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
          ("graphics_v3", None): pynvml.NVML_ERROR_FUNCTION_NOT_FOUND}, {"compute_v2", "graphics_v2"}),
        ({("memory_v2", None): pynvml.NVML_ERROR_FUNCTION_NOT_FOUND}, {"memory_v1"}),
        ({("memory_v2", None): pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH}, {"memory_v1"}),
    ],
)
def test_old_driver_falls_back_once(missing: dict[tuple[str, int | None], int], used_then: set[str]) -> None:
    fake = FakeBindings()
    fake.errors.update(missing)
    source = NvmlSource(bindings=fake, clock=Clock())
    views = [source.read(), source.read()]
    for query in used_then:
        assert fake.calls[query] == 2
    # Tried once, then never again: a driver without one _v3 query has none of them.
    assert sum(fake.calls.get(query, 0) for query, _ in missing) == 1
    gpu = views[1].gpus[0]
    assert gpu.processes == (NvmlProcess(100, 64, "compute+graphics"),)
    expected_used = 150 if "memory_v1" in used_then else 100
    assert gpu.memory_used_bytes == expected_used


def test_unexpected_binding_result_costs_only_that_gpu(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeBindings(gpus=2)
    fake.mig[1] = 5  # not the [current, pending] list pynvml returns
    view = NvmlSource(bindings=fake, clock=Clock()).read()
    assert view.available
    assert view.gpus == (healthy_gpu(0), NvmlGpu(index=1, uuid="", minor=None, processes_known=False))
    assert [line.split(":")[:2] for line in warnings_of(caplog)] == [["NVML", " GPU 1"]]
    assert "unexpected TypeError" in warnings_of(caplog)[0]


def test_unexpected_count_result_never_raises() -> None:
    fake = FakeBindings()
    fake.gpus = "two"  # type: ignore[assignment]  # int("two") fails inside the source
    view = NvmlSource(bindings=fake, clock=Clock()).read()
    assert not view.available
    assert "nvmlDeviceGetCount" in view.error


def test_close_shuts_down_once_and_read_reinitializes() -> None:
    fake = FakeBindings()
    source = NvmlSource(bindings=fake, clock=Clock())
    source.close()
    assert "shutdown" not in fake.calls  # never initialized: nothing to shut down
    assert source.read().available
    source.close()
    source.close()
    assert fake.calls["shutdown"] == 1
    assert source.read().available and fake.calls["init"] == 2


@pytest.mark.parametrize(("info", "expected"), [
    (SimpleNamespace(busId="00000000:3B:00.0", busIdLegacy="0000:3B:00.0"), "00000000:3B:00.0"),
    (SimpleNamespace(busId=b"00000000:17:00.0\x00", busIdLegacy=b""), "00000000:17:00.0"),  # an older binding
    (SimpleNamespace(busId="", busIdLegacy="0000:3B:00.0"), "0000:3B:00.0"),  # before NVML 9.0
    (SimpleNamespace(), ""),
    (None, ""),  # the query failed
])
def test_pci_bus_id(info: Any, expected: str) -> None:
    assert pci_bus_id(info) == expected


def test_pci_info_not_supported_is_quiet_and_empty(caplog: pytest.LogCaptureFixture) -> None:
    bindings = FakeBindings()
    bindings.errors[("pci", None)] = pynvml.NVML_ERROR_NOT_SUPPORTED
    view = NvmlSource(bindings=bindings, clock=Clock()).read()
    assert view.gpus[0].pci_bus_id == "" and view.gpus[0].uuid == "GPU-0"
    assert warnings_of(caplog) == []
