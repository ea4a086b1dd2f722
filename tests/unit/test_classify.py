"""Table tests for classify(): every class, the precedence conflicts, and diff_consumers()."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from ghostgpu.tracer.classify import ClassifyConfig, classify, diff_consumers
from ghostgpu.tracer.config import TracerConfig
from ghostgpu.tracer.events import DeviceHold, GpuWork, Holder, NvmlGpu, NvmlProcess, NvmlView, ProcessInfo

from ghostgpu.common.model.consumers import Consumer, ConsumerClass, DeviceKind, DeviceRef

S = 1_000_000_000
NOW = 100 * S
GIB = 1 << 30
C = ConsumerClass

NV0 = DeviceRef("/dev/nvidia0", DeviceKind.GPU, 0, 195, 0)
NV1 = DeviceRef("/dev/nvidia1", DeviceKind.GPU, 1, 195, 1)
CTL = DeviceRef("/dev/nvidiactl", DeviceKind.CONTROL, None, 195, 255)
UVM = DeviceRef("/dev/nvidia-uvm", DeviceKind.UVM, None, 508, 0)
CAP13 = DeviceRef("/dev/nvidia-caps/nvidia-cap13", DeviceKind.MIG, 0, 511, 13)  # gpu0/gi1/ci0/access
CAP138 = DeviceRef("/dev/nvidia-caps/nvidia-cap138", DeviceKind.MIG, 1, 511, 138)  # gpu1/gi0/access
CAP2 = DeviceRef("/dev/nvidia-caps/nvidia-cap2", DeviceKind.CONTROL, None, 511, 2)  # mig/monitor

CID = "a" * 64
UUID0, UUID1 = "GPU-00000000-aaaa", "GPU-11111111-bbbb"

# Processes that exist on the host: pid -> start_ticks (100 Hz ticks, so 6000 = 60 s after boot).
EXISTING = {100: 1000, 101: 1000, 200: 1000, 300: 6000, 301: 4000, 999: 10}
CFG = replace(
    ClassifyConfig.of(TracerConfig(node_name="node-a", grace_s=2.0)),
    own_pids=frozenset({999}),
    nvml_first_listed={(UUID0, 300): 50 * S, (UUID0, 301): 50 * S, (UUID0, 4242): 50 * S},
    boot_ns_of_ticks=lambda ticks: ticks * 10_000_000,
)


def hold(dev: DeviceRef, *fds: int, mapped: bool = False, seen_s: float = 10) -> DeviceHold:
    return DeviceHold(dev, set(fds), mapped, int(seen_s * S), "bpf")


def h(pid: int, *holds: DeviceHold, work: GpuWork | None = None, **info: Any) -> Holder:
    """A holder; keyword arguments are ProcessInfo fields (default: a live host process), `work` what
    it asked the driver for (default: no call history)."""
    fields: dict[str, Any] = {"comm": "python3", "start_ticks": EXISTING.get(pid), "ppid": 50,
                              "parent_comm": "bash", "state": "S", "threads": 1}
    fields.update(info)
    return Holder(ProcessInfo(pid=pid, **fields), {x.device.path: x for x in holds}, gpu_work=work)


def ctr(pid: int, *holds: DeviceHold, **info: Any) -> Holder:
    """A holder in container CID under its shim."""
    fields: dict[str, Any] = {"container_id": CID, "pod_uid": "pod-1", "runtime": "containerd",
                              "parent_comm": "containerd-shim", "parent_container_id": ""}
    fields.update(info)
    return h(pid, *holds, **fields)


def proc(pid: int, mem: int | None = GIB, kind: str = "compute") -> NvmlProcess:
    return NvmlProcess(pid, mem, kind)


def nv(*listed0: NvmlProcess, gpu1: tuple[NvmlProcess, ...] = (), index0: int = 0) -> NvmlView:
    return NvmlView(True, NOW, "595.45.04", (
        NvmlGpu(index0, UUID0, 0, processes=listed0),
        NvmlGpu(1 - index0, UUID1, 1, processes=gpu1),
    ))


UNLISTED = NvmlView(True, NOW, "595.45.04", (NvmlGpu(0, UUID0, 0, processes_known=False),))
NO_NVML = NvmlView(False, error="libnvidia-ml.so.1: cannot open shared object file")
ONLY_GPU1 = NvmlView(True, NOW, "595.45.04", (NvmlGpu(0, UUID1, 1),))
ZOMBIE = {"state": "Z", "threads": 3}

# (id, holders, nvml, expected [(pid, gpu, class)], reason must contain)
CASES = [
    ("visible", [ctr(100, hold(NV0, 5), hold(CTL, 3))], nv(proc(100)), [(100, 0, C.VISIBLE)], "NVML lists"),
    ("hidden-after-grace", [ctr(100, hold(NV0, 5))], nv(), [(100, 0, C.HIDDEN)], "for 90.0 s"),
    ("pending-in-container", [ctr(100, hold(NV0, 5, seen_s=99.5))], nv(), [(100, 0, C.PENDING)], "grace"),
    ("pending-host-process", [h(100, hold(NV0, 5, seen_s=99))], nv(), [(100, 0, C.PENDING)], "grace"),
    ("grace-boundary-is-hidden", [ctr(100, hold(NV0, 5, seen_s=98))], nv(), [(100, 0, C.HIDDEN)],
     "for 2.0 s"),
    ("unattributed-host", [h(100, hold(NV0, 5))], nv(), [(100, 0, C.UNATTRIBUTED)], "outside any container"),
    ("system-comm-truncated", [h(100, hold(NV0, 5), comm="nvidia-persiste")], nv(proc(100)),
     [(100, 0, C.SYSTEM)], "nvidia-persistenced"),
    ("system-exe-basename", [h(100, hold(NV0, 5), comm="x", exe="/usr/bin/dcgm-exporter (deleted)")], nv(),
     [(100, 0, C.SYSTEM)], "dcgm-exporter"),
    ("system-own-pid", [h(999, hold(NV0, 5))], nv(), [(999, 0, C.SYSTEM)], "tracer itself"),
    ("system-beats-ghost", [h(4242, hold(NV0, 5), comm="nv-hostengine")], nv(proc(4242)),
     [(4242, 0, C.SYSTEM)], "nv-hostengine"),
    ("ghost-no-such-pid", [], nv(proc(4242, 3 * GIB)), [(4242, 0, C.GHOST)], "no such process exists"),
    ("ghost-reused-pid", [], nv(proc(300)), [(300, 0, C.GHOST)], "was reused"),
    ("ghost-reused-pid-holder", [ctr(300, hold(NV0, 5), **ZOMBIE)], nv(proc(300)), [(300, 0, C.GHOST)],
     "started at 60.0 s"),
    ("listed-alive-holding-nothing-was-reused", [], nv(proc(301)), [(301, 0, C.GHOST)],
     "holds no GPU device file"),
    ("orphaned-zombie-leader-listed", [ctr(100, hold(NV0, 5), **ZOMBIE)], nv(proc(100)),
     [(100, 0, C.ORPHANED)], "2 thread(s) live on"),
    ("orphaned-zombie-host", [h(100, hold(NV0, 5), state="Z", threads=1)], nv(), [(100, 0, C.ORPHANED)],
     "state Z"),
    ("orphaned-reparented-init", [ctr(100, hold(NV0, 5), ppid=1, parent_comm="systemd")], nv(proc(100)),
     [(100, 0, C.ORPHANED)], "host PID 1"),
    ("orphaned-subreaper", [ctr(100, hold(NV0, 5), ppid=7, parent_comm="init")], nv(), [(100, 0, C.ORPHANED)],
     "subreaper init"),
    ("parent-in-same-container", [ctr(100, hold(NV0, 5), ppid=1, parent_container_id=CID)], nv(),
     [(100, 0, C.HIDDEN)], "container aaaaaaaaaaaa"),
    ("host-child-of-init", [h(100, hold(NV0, 5), ppid=1, parent_comm="systemd")], nv(),
     [(100, 0, C.UNATTRIBUTED)], "NVML lists no such"),
    ("gone-is-not-orphaned", [ctr(100, hold(NV0, 5), alive=False, ppid=None, parent_comm="")], nv(),
     [(100, 0, C.HIDDEN)], "NVML lists no such"),
    ("only-control-devices", [h(100, hold(CTL, 3), hold(UVM, 4), hold(CAP2, 6))], nv(),
     [(100, None, C.UNATTRIBUTED)], "only node-wide devices /dev/nvidia-caps/nvidia-cap2 (fd 6), "
     "/dev/nvidia-uvm (fd 4), /dev/nvidiactl (fd 3)"),
    ("unheld-hold-ignored", [h(100, hold(NV0))], nv(), [], ""),
    ("mig-cap-joins-its-gpu", [ctr(100, hold(NV0, 5), hold(CAP13, 7))], nv(proc(100)), [(100, 0, C.VISIBLE)],
     "nvidia-cap13"),
    ("mig-cap-alone", [ctr(100, hold(CAP138, 7))], nv(gpu1=(proc(100),)), [(100, 1, C.VISIBLE)], "cap138"),
    ("two-gpus", [ctr(100, hold(NV0, 5), hold(NV1, 6))], nv(proc(100)),
     [(100, 0, C.VISIBLE), (100, 1, C.HIDDEN)], "NVML lists PID 100"),
    ("nvml-index-differs-from-minor", [ctr(100, hold(NV0, 5))], nv(proc(100), index0=1),
     [(100, 1, C.VISIBLE)], "GPU 1 (GPU-00000000-aaaa)"),
    ("nvml-knows-not-this-minor", [ctr(100, hold(NV0, 5))], ONLY_GPU1, [(100, 0, C.UNKNOWN)],
     "no GPU with device minor 0"),
    ("nvml-cannot-list-gpu", [ctr(100, hold(NV0, 5))], UNLISTED, [(100, 0, C.UNKNOWN)], "could not list"),
    ("no-nvml-unknown", [ctr(100, hold(NV0, 5))], NO_NVML, [(100, 0, C.UNKNOWN)], "cannot open shared"),
    ("no-nvml-orphaned", [ctr(100, hold(NV0, 5), **ZOMBIE)], NO_NVML, [(100, 0, C.ORPHANED)], "zombie"),
    ("no-nvml-system", [h(100, hold(NV0, 5), comm="nvidia-smi")], NO_NVML, [(100, 0, C.SYSTEM)],
     "nvidia-smi"),
    ("mapped-then-closed-holds", [ctr(100, hold(NV0, mapped=True))], nv(), [(100, 0, C.HIDDEN)],
     "mapped, fd closed"),
    ("listed-on-other-gpu", [ctr(100, hold(NV0, 5))], nv(gpu1=(proc(100),)),
     [(100, 0, C.HIDDEN), (100, 1, C.VISIBLE)], "NVML lists no such"),
    ("listed-twice-one-consumer", [ctr(100, hold(NV0, 5))], nv(proc(100, GIB), proc(100, GIB, "graphics")),
     [(100, 0, C.VISIBLE)], "2048 MiB"),
    ("sorted-by-gpu-then-pid", [ctr(200, hold(NV1, 5)), ctr(101, hold(NV1, 5)), ctr(100, hold(NV0, 5))], nv(),
     [(100, 0, C.HIDDEN), (101, 1, C.HIDDEN), (200, 1, C.HIDDEN)], "in container"),
    # --- unknown waits out the grace period like every other class
    ("no-nvml-pending-first", [ctr(100, hold(NV0, 5, seen_s=99.98))], NO_NVML, [(100, 0, C.PENDING)],
     "grace"),
    ("nvml-cannot-list-pending-first", [ctr(100, hold(NV0, 5, seen_s=99.5))], UNLISTED, [(100, 0, C.PENDING)],
     "grace"),
]

# Node-wide holders: only nvidiactl, nvidia-uvm(-tools), nvidia-modeset, nvidia-caps/*. One
# consumer with no GPU, the same classes and grace, its reason naming the devices.
NODE_WIDE = [
    ("node-wide-hidden", [ctr(100, hold(CTL, 3), hold(UVM, 4))], nv(), [(100, None, C.HIDDEN)],
     "holds only node-wide devices /dev/nvidia-uvm (fd 4), /dev/nvidiactl (fd 3) for 90.0 s in container"),
    ("node-wide-says-nvml-cannot-list-it", [ctr(100, hold(UVM, 4))], nv(), [(100, None, C.HIDDEN)],
     "no GPU device file, so NVML lists it nowhere; it keeps the driver in use"),
    ("node-wide-pending", [ctr(100, hold(CTL, 3, seen_s=99.5))], nv(), [(100, None, C.PENDING)], "grace"),
    ("node-wide-no-nvml-unknown", [ctr(100, hold(UVM, 4))], NO_NVML, [(100, None, C.UNKNOWN)],
     "NVML is unavailable"),
    ("node-wide-no-nvml-pending-first", [ctr(100, hold(UVM, 4, seen_s=99.5))], NO_NVML,
     [(100, None, C.PENDING)], "grace"),
    ("node-wide-unlisted-gpu-is-no-excuse", [ctr(100, hold(UVM, 4))], UNLISTED, [(100, None, C.HIDDEN)],
     "/dev/nvidia-uvm"),
    ("node-wide-system-daemon", [h(100, hold(CTL, 3), comm="nvidia-persiste")], nv(), [(100, None, C.SYSTEM)],
     "allowlisted node daemon nvidia-persistenced"),
    ("node-wide-zombie-orphaned", [ctr(100, hold(UVM, 4), **ZOMBIE)], nv(), [(100, None, C.ORPHANED)],
     "zombie"),
    ("node-wide-monitor", [ctr(100, hold(CTL, 3), work=GpuWork(False))], NO_NVML, [(100, None, C.MONITOR)],
     "only reads the GPU's state"),
    ("node-wide-allocated", [h(100, hold(CTL, 3), work=GpuWork(True, "RM_ALLOC FERMI_VASPACE_A (0x90f1)"))],
     nv(), [(100, None, C.UNATTRIBUTED)], "RM_ALLOC FERMI_VASPACE_A"),
    ("node-wide-after-gpu-holders", [ctr(100, hold(NV0, 5)), ctr(101, hold(CTL, 3))], nv(proc(100)),
     [(101, None, C.HIDDEN), (100, 0, C.VISIBLE)], "/dev/nvidiactl"),
    ("gpu-holder-is-not-also-node-wide", [ctr(100, hold(NV0, 5), hold(CTL, 3), hold(UVM, 4))], nv(),
     [(100, 0, C.HIDDEN)], "/dev/nvidia0"),
]

MPS = h(200, hold(NV0, 9), comm="nvidia-cuda-mps")  # the server: comm is cut to 15 bytes
MPS_BY_EXE = ctr(200, hold(NV0, 9), comm="x", exe="/usr/bin/nvidia-cuda-mps-server")

# NVML lists a PID that is alive but holds no GPU device file: reused, unless an MPS server
# holds that GPU (its clients are listed while it holds the device).
LISTED = [
    ("alive-unheld-pid-was-reused", [], nv(proc(301, 2 * GIB)), [(301, 0, C.GHOST)],
     "NVML lists PID 301 on GPU 0 (GPU-00000000-aaaa) using 2048 MiB, but PID 301 holds no GPU device file"),
    ("reused-pid-holding-control-is-also-a-node-wide-holder", [ctr(301, hold(CTL, 3))], nv(proc(301)),
     [(301, None, C.HIDDEN), (301, 0, C.GHOST)], "/dev/nvidiactl"),
    ("mps-client", [MPS], nv(proc(301), proc(200)), [(200, 0, C.VISIBLE), (301, 0, C.VISIBLE)],
     "NVML lists PID 200"),
    ("mps-server-by-exe", [MPS_BY_EXE], nv(proc(301)), [(200, 0, C.HIDDEN), (301, 0, C.VISIBLE)],
     "NVML lists no such process"),
    ("mps-client-holding-control", [MPS, ctr(301, hold(CTL, 3), hold(UVM, 4))], nv(proc(301), proc(200)),
     [(200, 0, C.VISIBLE), (301, 0, C.VISIBLE)], "NVML lists PID 200"),
    ("mps-server-of-another-gpu", [h(200, hold(NV1, 9), comm="nvidia-cuda-mps")], nv(proc(301)),
     [(301, 0, C.GHOST), (200, 1, C.UNATTRIBUTED)], "holds no GPU device file"),
    ("mps-server-named-by-a-client-holding-nothing", [], nv(proc(301)), [(301, 0, C.GHOST)], "reused"),
    ("holder-of-another-gpu-is-not-reused", [ctr(100, hold(NV1, 5))], nv(proc(100)),
     [(100, 0, C.VISIBLE), (100, 1, C.HIDDEN)], "no fd of it on the GPU's device file"),
    ("dead-pid-stays-a-plain-ghost", [], nv(proc(4242)), [(4242, 0, C.GHOST)], "no such process exists"),
]

DONE = GpuWork(False)  # watched since its first open, allocated nothing
COMPUTE = GpuWork(True, "RM_ALLOC AMPERE_COMPUTE_A (0xc6c0)")

# A holder NVML does not list: a monitoring client (no allocation, no device memory mapped, whole
# history) or a GPU job. Precedence: visible and pending win over monitor.
MONITOR = [
    ("monitor-in-container", [ctr(100, hold(NV0, 5), hold(CTL, 3), work=DONE)], nv(), [(100, 0, C.MONITOR)],
     "allocated no memory, channel or compute class and mapped no device memory"),
    ("monitor-on-host", [h(100, hold(NV0, 5), work=DONE)], nv(), [(100, 0, C.MONITOR)], "on the host"),
    ("monitor-without-nvml", [ctr(100, hold(NV0, 5), work=DONE)], NO_NVML, [(100, 0, C.MONITOR)],
     "only reads"),
    ("allocated-is-hidden", [ctr(100, hold(NV0, 5), work=COMPUTE)], nv(), [(100, 0, C.HIDDEN)],
     "it allocated GPU resources (RM_ALLOC AMPERE_COMPUTE_A (0xc6c0))"),
    ("allocated-without-a-name", [ctr(100, hold(NV0, 5), work=GpuWork(True))], nv(), [(100, 0, C.HIDDEN)],
     "an RM_ALLOC or ALLOC_MEMORY call"),
    ("complete-but-mapped-is-hidden", [ctr(100, hold(NV0, 5, mapped=True), work=DONE)], nv(),
     [(100, 0, C.HIDDEN)], "it maps GPU device memory"),
    ("mapped-mig-cap-is-hidden", [ctr(100, hold(CAP13, 7, mapped=True), work=DONE)], nv(),
     [(100, 0, C.HIDDEN)], "maps GPU device memory"),
    ("mapped-control-device-is-no-gpu-memory", [ctr(100, hold(NV0, 5), hold(CTL, 3, mapped=True), work=DONE)],
     nv(), [(100, 0, C.MONITOR)], "only reads"),
    ("no-history-mapped-is-hidden", [ctr(100, hold(NV0, 5, mapped=True))], nv(), [(100, 0, C.HIDDEN)],
     "it maps GPU device memory"),
    ("no-history-unmapped-is-hidden-incomplete", [ctr(100, hold(NV0, 5))], nv(), [(100, 0, C.HIDDEN)],
     "the evidence is incomplete (it opened the device before the tracer watched it, or BPF is off)"),
    ("partial-history-is-incomplete", [ctr(100, hold(NV0, 5), work=GpuWork(False, complete=False))], nv(),
     [(100, 0, C.HIDDEN)], "the evidence is incomplete"),
    ("no-history-host-is-unattributed", [h(100, hold(NV0, 5))], nv(), [(100, 0, C.UNATTRIBUTED)],
     "evidence is incomplete"),
    ("listed-beats-monitor", [ctr(100, hold(NV0, 5), work=DONE)], nv(proc(100)), [(100, 0, C.VISIBLE)],
     "NVML lists PID 100"),
    ("pending-beats-monitor", [ctr(100, hold(NV0, 5, seen_s=99.5), work=DONE)], nv(), [(100, 0, C.PENDING)],
     "grace"),
    ("orphaned-beats-monitor", [ctr(100, hold(NV0, 5), work=DONE, **ZOMBIE)], nv(), [(100, 0, C.ORPHANED)],
     "zombie"),
    ("allowlisted-host-daemon-stays-system", [h(100, hold(NV0, 5), comm="dcgm-exporter", work=DONE)], nv(),
     [(100, 0, C.SYSTEM)], "dcgm-exporter"),
]

# `system` by executable path and by where it runs: the host, else its real class with a
# note on the name it impersonates.
SYSTEM = [
    ("container-named-like-a-daemon-is-hidden", [ctr(100, hold(NV0, 5), comm="nv-hostengine")], nv(),
     [(100, 0, C.HIDDEN)], "it impersonates allowlisted node daemon nv-hostengine: it runs in container "
     "aaaaaaaaaaaa, and such daemons are system only on the host"),
    ("container-exe-like-a-daemon-is-hidden", [ctr(100, hold(NV0, 5), exe="/usr/bin/dcgm-exporter")], nv(),
     [(100, 0, C.HIDDEN)], "impersonates allowlisted node daemon dcgm-exporter"),
    ("impersonator-keeps-its-real-class", [ctr(100, hold(NV0, 5), comm="nvidia-smi", work=DONE)], nv(),
     [(100, 0, C.MONITOR)], "impersonates allowlisted node daemon nvidia-smi"),
    ("impersonator-listed-is-visible", [ctr(100, hold(NV0, 5), comm="nvidia-smi")], nv(proc(100)),
     [(100, 0, C.VISIBLE)], "impersonates"),
    ("own-pid-namespace-is-not-the-host", [h(100, hold(NV0, 5), comm="nv-hostengine", ns_pid=7)], nv(),
     [(100, 0, C.UNATTRIBUTED)], "it runs in a PID namespace of its own (PID 7 there)"),
    ("host-pid-namespace-is-the-host", [h(100, hold(NV0, 5), comm="nv-hostengine", ns_pid=100)], nv(),
     [(100, 0, C.SYSTEM)], "allowlisted node daemon nv-hostengine (nv-hostengine) on the host"),
]

ALL_CASES = CASES + NODE_WIDE + LISTED + MONITOR + SYSTEM


@pytest.mark.parametrize(("holders", "view", "expected", "reason_part"),
                         [c[1:] for c in ALL_CASES], ids=[c[0] for c in ALL_CASES])
def test_classify_table(holders: list[Holder], view: NvmlView, expected: list[tuple[int, int | None, C]],
                        reason_part: str) -> None:
    """reason_part is in the reason of the first consumer whose (pid, gpu) the case lists first."""
    out = classify(holders, view, NOW, CFG, "node-a", EXISTING.get)
    assert [(c.pid, c.gpu, c.cls) for c in out] == expected
    assert all(c.node == "node-a" and c.reason and "\n" not in c.reason for c in out)
    assert reason_part in out[0].reason if out else reason_part == ""


def test_fields_filled_from_holder_and_nvml() -> None:
    holder = ctr(100, hold(NV0, 9, 5, seen_s=40), hold(CAP13, 7, seen_s=30, mapped=True), hold(CTL, 3),
                 ns_pid=7, exe="/usr/bin/python3", cmdline="python3 train.py", uid=1000, ppid=80)
    [c] = classify([holder], nv(proc(100, 5 * GIB)), NOW, CFG, "node-a", EXISTING.get)
    assert (c.pid, c.ns_pid, c.comm, c.exe, c.cmdline, c.uid, c.ppid, c.state) == (
        100, 7, "python3", "/usr/bin/python3", "python3 train.py", 1000, 80, "S")
    assert (c.gpu, c.gpu_uuid, c.gpu_minor, c.gpu_memory_bytes) == (0, UUID0, 0, 5 * GIB)
    assert c.devices == ["/dev/nvidia-caps/nvidia-cap13", "/dev/nvidia0", "/dev/nvidiactl"]
    assert c.fds == [5, 7, 9] and c.mapped and c.alive
    assert c.first_seen_ns == 30 * S and c.start_time_ns == 10 * S
    assert (c.container_id, c.pod_uid, c.runtime) == (CID, "pod-1", "containerd")


def test_ghost_fields() -> None:
    [c] = classify([], nv(proc(4242, 3 * GIB)), NOW, CFG, "node-a", EXISTING.get)
    assert (c.gpu_memory_bytes, c.alive, c.devices, c.first_seen_ns) == (3 * GIB, False, [], 50 * S)
    assert c.reason.startswith("NVML lists PID 4242 on GPU 0 (GPU-00000000-aaaa) using 3072 MiB")


def test_listed_on_other_gpu_borrows_identity() -> None:
    out = classify([ctr(100, hold(NV0, 5), comm="trainer")], nv(gpu1=(proc(100),)), NOW, CFG, "n",
                   EXISTING.get)
    assert [(c.gpu, c.comm, c.container_id, c.devices) for c in out] == [
        (0, "trainer", CID, ["/dev/nvidia0"]), (1, "trainer", CID, [])]


def test_unknown_fields_without_nvml() -> None:
    [c] = classify([ctr(100, hold(NV0, 5))], NO_NVML, NOW, CFG, "n", EXISTING.get)
    assert (c.gpu, c.gpu_uuid, c.gpu_minor, c.gpu_memory_bytes) == (0, "", 0, None)


def test_reused_pid_without_first_listed_time_holds_nothing_so_is_a_ghost() -> None:
    cfg = replace(CFG, nvml_first_listed={})
    [c] = classify([], nv(proc(300)), NOW, cfg, "n", EXISTING.get)
    assert c.cls is C.GHOST and "holds no GPU device file" in c.reason
    assert (c.alive, c.comm, c.devices) == (False, "", [])


# (id, boot ns the holders are complete at (None: BPF sees every open), NVML first listed 301 at, class)
SCANS = [
    ("bpf-judges-at-once", None, 99 * S, C.GHOST),
    ("listed-before-the-last-full-scan", 60 * S, 50 * S, C.GHOST),
    ("listed-at-the-scan", 50 * S, 50 * S, C.GHOST),
    ("listed-after-the-last-full-scan", 40 * S, 50 * S, C.VISIBLE),
    ("no-listing-time-is-now", 99 * S, None, C.VISIBLE),
]


@pytest.mark.parametrize(("complete_ns", "listed_ns", "cls"), [s[1:] for s in SCANS],
                         ids=[s[0] for s in SCANS])
def test_reuse_is_judged_once_a_scan_could_have_seen_the_holder(complete_ns: int | None,
                                                                 listed_ns: int | None, cls: C) -> None:
    """Without BPF, a CUDA process that opened its GPU after the last full /proc scan is not a holder
    yet although NVML lists it: the PID counts as reused only when listed before a scan began."""
    first = {(UUID0, 301): listed_ns} if listed_ns is not None else {}
    cfg = replace(CFG, nvml_first_listed=first, holders_complete_ns=complete_ns)
    [c] = classify([], nv(proc(301)), NOW, cfg, "n", EXISTING.get)
    assert c.cls is cls
    if cls is C.VISIBLE:
        assert c.reason.endswith("was seen yet (a /proc scan has not looked since NVML listed it)")


def test_mps_client_is_visible_through_the_server() -> None:
    client = ctr(301, hold(CTL, 3), hold(UVM, 4), comm="infer")
    out = classify([MPS, client], nv(proc(301, GIB)), NOW, CFG, "n", EXISTING.get)
    by_pid = {c.pid: c for c in out}
    assert sorted(by_pid) == [200, 301]  # no node-wide consumer beside the client's listing
    c = by_pid[301]
    assert (c.cls, c.gpu, c.comm, c.container_id, c.alive) == (C.VISIBLE, 0, "infer", CID, True)
    assert c.devices == ["/dev/nvidia-uvm", "/dev/nvidiactl"]
    assert c.reason == ("NVML lists PID 301 on GPU 0 (GPU-00000000-aaaa) using 1024 MiB through MPS: the MPS "
                        "server nvidia-cuda-mps (PID 200) holds the GPU's device file for its clients")


def test_reused_pid_does_not_lend_its_identity() -> None:
    """The ghost is the dead process's memory; the live holder of control devices is reported apart."""
    out = classify([ctr(301, hold(CTL, 3), comm="sleeper")], nv(proc(301)), NOW, CFG, "n", EXISTING.get)
    wide, ghost = out
    assert (wide.gpu, wide.gpu_uuid, wide.gpu_minor, wide.comm, wide.devices) == (
        None, "", None, "sleeper", ["/dev/nvidiactl"])
    assert (ghost.cls, ghost.comm, ghost.container_id, ghost.alive, ghost.devices) == (
        C.GHOST, "", "", False, [])
    assert wide.key != ghost.key


def test_node_wide_fields() -> None:
    holder = ctr(100, hold(UVM, 4, seen_s=30), hold(CTL, 3, seen_s=40), ns_pid=7)
    [c] = classify([holder], nv(), NOW, CFG, "n", EXISTING.get)
    assert (c.gpu, c.gpu_uuid, c.gpu_minor, c.gpu_memory_bytes, c.mapped) == (None, "", None, None, False)
    assert (c.devices, c.fds, c.first_seen_ns, c.ns_pid) == (["/dev/nvidia-uvm", "/dev/nvidiactl"], [3, 4],
                                                            30 * S, 7)
    assert c.key == (100, None, "")
    assert c.to_json()["gpu"] is None


def test_allowlist_entry_with_a_slash_is_an_exact_executable_path() -> None:
    cfg = replace(CFG, system_allowlist=("/usr/bin/nv-hostengine",))
    cases = [(h(100, hold(NV0, 5), comm="nv-hostengine", exe="/usr/bin/nv-hostengine"), C.SYSTEM),
             (h(100, hold(NV0, 5), comm="x", exe="/usr/bin/nv-hostengine (deleted)"), C.SYSTEM),
             (h(100, hold(NV0, 5), comm="nv-hostengine", exe="/tmp/nv-hostengine"), C.UNATTRIBUTED),
             (h(100, hold(NV0, 5), comm="nv-hostengine", exe=""), C.UNATTRIBUTED)]
    for holder, cls in cases:
        [c] = classify([holder], nv(), NOW, cfg, "n", EXISTING.get)
        assert c.cls is cls, holder.process
        assert c.allowlisted == ("/usr/bin/nv-hostengine" if cls is C.SYSTEM else "")


def test_impersonator_carries_the_places_for_the_collector() -> None:
    cfg = replace(CFG, system_places=("gpu-operator", "kube-system/dcgm"))
    [c] = classify([ctr(100, hold(NV0, 5), comm="dcgm-exporter")], nv(), NOW, cfg, "n", EXISTING.get)
    assert (c.cls, c.allowlisted, c.system_places) == (
        C.HIDDEN, "dcgm-exporter", ["gpu-operator", "kube-system/dcgm"])
    assert ("named like allowlisted node daemon dcgm-exporter but runs in container aaaaaaaaaaaa: such a "
            "daemon is system on the host, or where CRI places it in gpu-operator, kube-system/dcgm "
            "(collector)") in c.reason
    # On the host it is system at once, and nothing is left for the collector to check.
    [c] = classify([h(100, hold(NV0, 5), comm="dcgm-exporter")], nv(), NOW, cfg, "n", EXISTING.get)
    assert (c.cls, c.allowlisted, c.system_places) == (C.SYSTEM, "dcgm-exporter", [])
    # Not allowlisted: no places either.
    [c] = classify([ctr(100, hold(NV0, 5))], nv(), NOW, cfg, "n", EXISTING.get)
    assert (c.allowlisted, c.system_places) == ("", [])


def test_classify_does_not_mutate_input() -> None:
    holders = [ctr(100, hold(NV0, 5)), h(4242, hold(NV1, 3))]
    before = repr(holders)
    classify(holders, nv(proc(4242)), NOW, CFG, "n", EXISTING.get)
    assert repr(holders) == before


# --- diff_consumers ---------------------------------------------------------------------------


def one(holder: Holder, view: NvmlView, now_ns: int = NOW) -> Consumer:
    [c] = classify([holder], view, now_ns, CFG, "n", EXISTING.get)
    return c


BASE = ctr(100, hold(NV0, 5))
ZOMBIE_BASE = ctr(100, hold(NV0, 5), **ZOMBIE)

# (id, old consumer, new consumer, is it a change)
DIFFS = [
    ("age-only", one(BASE, nv()), one(BASE, nv(), NOW + 7 * S), False),
    ("same", one(BASE, nv(proc(100))), one(BASE, nv(proc(100))), False),
    ("fd-only", one(BASE, nv()), one(ctr(100, hold(NV0, 5, 6)), nv()), False),
    ("pending-to-hidden", one(BASE, nv(), 11 * S), one(BASE, nv()), True),
    ("hidden-to-visible", one(BASE, nv()), one(BASE, nv(proc(100))), True),
    ("memory", one(BASE, nv(proc(100, GIB))), one(BASE, nv(proc(100, 2 * GIB))), True),
    ("devices", one(BASE, nv()), one(ctr(100, hold(NV0, 5), hold(CTL, 3)), nv()), True),
    ("mapped", one(BASE, nv()), one(ctr(100, hold(NV0, 5, mapped=True)), nv()), True),
    ("alive", one(BASE, nv()), one(ctr(100, hold(NV0, 5), alive=False), nv()), True),
    ("container", one(BASE, nv()), one(ctr(100, hold(NV0, 5), container_id="b" * 64), nv()), True),
    ("orphan-cause", one(ZOMBIE_BASE, nv()), one(ctr(100, hold(NV0, 5), ppid=1), nv()), True),
]


@pytest.mark.parametrize(("old", "new", "changed"), [d[1:] for d in DIFFS], ids=[d[0] for d in DIFFS])
def test_diff_consumers_table(old: Consumer, new: Consumer, changed: bool) -> None:
    assert old.key == new.key
    opened, resolved = diff_consumers({old.key: old}, [new])
    assert (opened == [new]) is changed
    assert resolved == []


def test_diff_opened_and_resolved() -> None:
    a, b = one(BASE, nv()), one(ctr(200, hold(NV1, 5)), nv())
    opened, resolved = diff_consumers({a.key: a}, [b])
    assert (opened, resolved) == ([b], [a])
    assert diff_consumers({}, []) == ([], [])
