"""The NVML source: what the driver says about each GPU and the processes it lists.

This is the only module that imports pynvml (package nvidia-ml-py). It never raises: no library,
no driver or no permission is a view with available=False and one line saying what to do, logged
once; init is retried every `retry_interval_s` because a driver can load after the tracer starts.
A query that fails on one GPU (a GPU fallen off the bus) does not hide the others.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from ghostgpu.tracer.events import NvmlGpu, NvmlProcess, NvmlView, boot_ns

log = logging.getLogger("ghostgpu.nvml")

LIBRARY_NAME = "libnvidia-ml.so.1"
INIT_RETRY_S = 30.0
NOT_AVAILABLE_U64 = (1 << 64) - 1  # NVML_VALUE_NOT_AVAILABLE as the unsigned long long NVML writes

# nvmlReturn_t values from nvml.h; stable across driver releases.
NOT_SUPPORTED = 3
NO_PERMISSION = 4
DRIVER_NOT_LOADED = 9
LIBRARY_NOT_FOUND = 12
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15
LIB_RM_VERSION_MISMATCH = 18
ARGUMENT_VERSION_MISMATCH = 25


def used_memory_bytes(raw: Any) -> int | None:
    """NVML's per-process memory, None when NVML cannot say.

    nvidia-ml-py 11+ turns NVML_VALUE_NOT_AVAILABLE into None; older bindings hand over the raw
    sentinel (2**64 - 1), so both mean "not available" (no permission, MIG parent handle, WDDM).
    """
    if raw is None or isinstance(raw, bool):
        return None
    try:
        value = int(raw)
    except (TypeError, ValueError):
        return None
    return None if value < 0 or value >= NOT_AVAILABLE_U64 else value


def merge_processes(compute: Iterable[Any], graphics: Iterable[Any]) -> tuple[NvmlProcess, ...]:
    """pynvml process objects (pid, usedGpuMemory, gpuInstanceId, computeInstanceId) -> NvmlProcess.

    One entry per PID, sorted. A PID in both lists is "compute+graphics"; NVML reports the process's
    memory on that GPU in each list, so the two are not added (the larger known value wins). Entries
    of one PID in different MIG instances hold separate memory and are added. Memory is None only
    when no entry of the PID gives a value.
    """
    kinds: dict[int, set[str]] = {}
    per_instance: dict[int, dict[tuple[Any, Any], int | None]] = {}
    for kind, entries in (("compute", compute), ("graphics", graphics)):
        for entry in entries:
            pid = getattr(entry, "pid", None)
            if not isinstance(pid, int) or isinstance(pid, bool) or pid < 0:
                continue
            instance = (getattr(entry, "gpuInstanceId", None), getattr(entry, "computeInstanceId", None))
            used = used_memory_bytes(getattr(entry, "usedGpuMemory", None))
            slots = per_instance.setdefault(pid, {})
            known = [v for v in (slots.get(instance), used) if v is not None]
            slots[instance] = max(known) if known else None
            kinds.setdefault(pid, set()).add(kind)
    out: list[NvmlProcess] = []
    for pid in sorted(per_instance):
        values = [v for v in per_instance[pid].values() if v is not None]
        kind = "+".join(k for k in ("compute", "graphics") if k in kinds[pid])
        out.append(NvmlProcess(pid=pid, used_gpu_memory_bytes=sum(values) if values else None, kind=kind))
    return tuple(out)


def pci_bus_id(info: Any) -> str:
    """NVML's bus id from an nvmlPciInfo_t: `busId` ("00000000:3B:00.0", NVML 9.0 on), else the
    older `busIdLegacy` ("0000:3B:00.0"); "" when neither says. The Xid join (tracer/faults.py)
    compares addresses by number, so either spelling matches the driver's "PCI:0000:3b:00"."""
    for field in ("busId", "busIdLegacy"):
        value = getattr(info, field, None)
        if isinstance(value, bytes):
            value = value.decode("ascii", errors="replace")
        if isinstance(value, str) and value.strip("\x00 "):
            return value.strip("\x00 ")
    return ""


def describe_failure(call: str, exc: BaseException, retry_interval_s: float = INIT_RETRY_S) -> str:
    """One line naming what failed and what to do about it."""
    code = getattr(exc, "value", None)
    retry = f"retrying every {retry_interval_s:g} s"
    if isinstance(exc, ImportError):
        return "NVML: Python package nvidia-ml-py (module pynvml) is not installed; pip install nvidia-ml-py"
    if code == LIBRARY_NOT_FOUND:
        return (
            f"NVML: {LIBRARY_NAME} not found; install the NVIDIA driver on the node or mount its "
            f"libraries into the tracer (NVIDIA container toolkit), {retry}"
        )
    if code == DRIVER_NOT_LOADED:
        return f"NVML: {call}: NVIDIA kernel driver not loaded; load it (modprobe nvidia), {retry}"
    if code == NO_PERMISSION:
        return (
            f"NVML: {call}: no permission to talk to the NVIDIA driver; run the tracer privileged "
            f"or give it access to /dev/nvidiactl and /dev/nvidia*, {retry}"
        )
    if code == LIB_RM_VERSION_MISMATCH:
        return (
            f"NVML: {call}: {LIBRARY_NAME} does not match the loaded kernel driver; reboot or reload "
            f"the driver after an upgrade, {retry}"
        )
    if code == FUNCTION_NOT_FOUND:
        return f"NVML: {call}: missing from {LIBRARY_NAME}; the driver is too old for nvidia-ml-py, upgrade"
    return f"NVML: {call} failed ({type(exc).__name__}: {exc}); check the driver with nvidia-smi, {retry}"


class NvmlSource:
    """Reads an NvmlView on demand; lazy init, retried, never raises."""

    def __init__(
        self,
        retry_interval_s: float = INIT_RETRY_S,
        clock: Callable[[], float] = time.monotonic,
        bindings: Any = None,
    ) -> None:
        """`bindings` stands in for the pynvml module (tests); None imports pynvml on first read."""
        self._retry_interval_s = retry_interval_s
        self._clock = clock
        self._bindings = bindings
        self._nvml: Any = None  # the pynvml module once nvmlInit succeeded
        self._driver_version = ""
        self._next_init_s: float | None = None  # monotonic time before which init is not retried
        self._init_error = ""
        self._logged: set[str] = set()
        self._memory_v2 = True  # nvmlDeviceGetMemoryInfo_v2 exists from R510 on; fall back once
        self._procs_v3 = True  # the *_v3 process queries exist from R510 on; fall back once
        self._lock = threading.Lock()

    @property
    def initialized(self) -> bool:
        return self._nvml is not None

    def read(self) -> NvmlView:
        with self._lock:
            ts_ns = boot_ns()
            try:
                return self._read(ts_ns)
            except Exception as exc:  # a binding surprise must not stop the tracer loop
                line = f"NVML: unexpected {type(exc).__name__}: {exc}; please report it"
                self._warn_once(line)
                return NvmlView(available=False, ts_ns=ts_ns, error=line)

    def close(self) -> None:
        with self._lock:
            self._shutdown()

    def _read(self, ts_ns: int) -> NvmlView:
        if self._nvml is None and not self._try_init():
            return NvmlView(available=False, ts_ns=ts_ns, error=self._init_error)
        nvml = self._nvml
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as exc:  # driver unloaded or reset under us: start over after the interval
            self._shutdown()
            self._next_init_s = self._clock() + self._retry_interval_s
            self._init_error = describe_failure("nvmlDeviceGetCount", exc, self._retry_interval_s)
            self._warn_once(self._init_error)
            return NvmlView(available=False, ts_ns=ts_ns, error=self._init_error)
        gpus = tuple(self._read_gpu_safely(nvml, index) for index in range(count))
        return NvmlView(available=True, ts_ns=ts_ns, driver_version=self._driver_version, gpus=gpus)

    def _try_init(self) -> bool:
        now = self._clock()
        if self._next_init_s is not None and now < self._next_init_s:
            return False
        self._next_init_s = now + self._retry_interval_s
        try:
            nvml = self._bindings or importlib.import_module("pynvml")
            # NO_GPUS: a node whose GPUs are all gone or fenced is a view with no GPUs, not a failure.
            nvml.nvmlInitWithFlags(nvml.NVML_INIT_FLAG_NO_GPUS)
        except Exception as exc:
            line = describe_failure("nvmlInit", exc, self._retry_interval_s)
            if line != self._init_error:  # once per distinct cause, not once per retry
                log.warning("%s", line)
            self._init_error = line
            return False
        self._nvml = nvml
        self._next_init_s = None
        self._init_error = ""
        self._driver_version = str(self._query(nvml.nvmlSystemGetDriverVersion, "driver", "version") or "")
        log.info("NVML ready: driver %s", self._driver_version or "unknown")
        return True

    def _shutdown(self) -> None:
        if self._nvml is None:
            return
        nvml, self._nvml = self._nvml, None
        try:
            nvml.nvmlShutdown()
        except Exception as exc:  # shutting down a lost driver may fail; there is nothing to undo
            log.debug("nvmlShutdown: %s", exc)

    def _warn_once(self, line: str) -> None:
        if line not in self._logged:
            self._logged.add(line)
            log.warning("%s", line)

    def _query(self, fn: Callable[..., Any], gpu: str, what: str, *args: Any, quiet: bool = False) -> Any:
        """Call one NVML query; None on failure (logged once per GPU, query and error)."""
        try:
            return fn(*args)
        except Exception as exc:
            self._report(gpu, what, exc, quiet)
            return None

    def _report(self, gpu: str, what: str, exc: BaseException, quiet: bool = False) -> None:
        code = getattr(exc, "value", None)
        if quiet and code == NOT_SUPPORTED:
            return
        hint = "drain the node and reset the GPU" if code == GPU_IS_LOST else "other GPUs are still read"
        self._warn_once(f"NVML: {gpu}: reading {what} failed ({type(exc).__name__}: {exc}); {hint}")

    def _read_gpu_safely(self, nvml: Any, index: int) -> NvmlGpu:
        try:
            return self._read_gpu(nvml, index)
        except Exception as exc:  # a surprise on one GPU must not cost the others
            self._warn_once(f"NVML: GPU {index}: unexpected {type(exc).__name__}: {exc}; please report it")
            return NvmlGpu(index=index, uuid="", minor=None, processes_known=False)

    def _read_gpu(self, nvml: Any, index: int) -> NvmlGpu:
        gpu = f"GPU {index}"
        handle = self._query(nvml.nvmlDeviceGetHandleByIndex, gpu, "handle", index)
        if handle is None:
            return NvmlGpu(index=index, uuid="", minor=None, processes_known=False)
        uuid = str(self._query(nvml.nvmlDeviceGetUUID, gpu, "uuid", handle) or "")
        gpu = f"GPU {index} ({uuid})" if uuid else gpu
        minor = self._query(nvml.nvmlDeviceGetMinorNumber, gpu, "minor number", handle)
        name = str(self._query(nvml.nvmlDeviceGetName, gpu, "name", handle) or "")
        total_bytes, used_bytes = self._memory(nvml, gpu, handle)
        # MIG mode is [current, pending]; GPUs before Ampere answer NOT_SUPPORTED, which is None.
        mig = self._query(nvml.nvmlDeviceGetMigMode, gpu, "MIG mode", handle, quiet=True)
        pci = self._query(nvml.nvmlDeviceGetPciInfo, gpu, "PCI info", handle, quiet=True)
        compute = self._processes(nvml, gpu, handle, "Compute")
        graphics = self._processes(nvml, gpu, handle, "Graphics")
        return NvmlGpu(
            index=index,
            uuid=uuid,
            minor=None if minor is None else int(minor),
            name=name,
            memory_total_bytes=total_bytes,
            memory_used_bytes=used_bytes,
            mig_mode=None if mig is None else int(mig[0]) == 1,
            pci_bus_id=pci_bus_id(pci),
            processes=merge_processes(compute or [], graphics or []),
            processes_known=compute is not None and graphics is not None,
        )

    def _memory(self, nvml: Any, gpu: str, handle: Any) -> tuple[int | None, int | None]:
        """Total and used bytes. v2 "used" leaves out the driver's reserved memory (R510+), so it
        compares with the sum of per-process memory; v1 "used" includes it."""
        version = getattr(nvml, "nvmlMemory_v2", None)
        if self._memory_v2 and version is not None:
            try:
                mem = nvml.nvmlDeviceGetMemoryInfo(handle, version)
                return int(mem.total), int(mem.used)
            except Exception as exc:
                if getattr(exc, "value", None) not in (FUNCTION_NOT_FOUND, ARGUMENT_VERSION_MISMATCH):
                    self._report(gpu, "memory", exc)
                    return None, None
                self._memory_v2 = False
        mem = self._query(nvml.nvmlDeviceGetMemoryInfo, gpu, "memory", handle)
        return (None, None) if mem is None else (int(mem.total), int(mem.used))

    def _processes(self, nvml: Any, gpu: str, handle: Any, kind: str) -> list[Any] | None:
        """One kind's process list; None when it cannot be read. Graphics lists are NOT_SUPPORTED on
        some compute-only boards: that is an empty list, not an unknown one."""
        what = f"{kind.lower()} processes"
        quiet = kind == "Graphics"
        for version in ("_v3", "_v2") if self._procs_v3 else ("_v2",):
            try:
                return list(getattr(nvml, f"nvmlDeviceGet{kind}RunningProcesses{version}")(handle))
            except Exception as exc:
                code = getattr(exc, "value", None)
                # Drivers before R510 lack _v3 (same struct as _v2): fall back once, for good.
                if version == "_v3" and code == FUNCTION_NOT_FOUND:
                    self._procs_v3 = False
                    continue
                self._report(gpu, what, exc, quiet)
                return [] if quiet and code == NOT_SUPPORTED else None
        return None
