"""Table tests for classify(): every class, the precedence conflicts, and diff_consumers()."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from ghostgpu.tracer.classify import ClassifyConfig, classify, diff_consumers
from ghostgpu.tracer.events import DeviceHold, Holder, NvmlGpu, NvmlProcess, NvmlView, ProcessInfo

from ghostgpu.common.model import Consumer, ConsumerClass, DeviceKind, DeviceRef

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
CFG = ClassifyConfig(
    grace_ns=2 * S,
    own_pids=frozenset({999}),
    nvml_first_listed={(UUID0, 300): 50 * S, (UUID0, 301): 50 * S, (UUID0, 4242): 50 * S},
    boot_ns_of_ticks=lambda ticks: ticks * 10_000_000,
)


def hold(dev: DeviceRef, *fds: int, mapped: bool = False, seen_s: float = 10) -> DeviceHold:
    return DeviceHold(dev, set(fds), mapped, int(seen_s * S), "bpf")


def h(pid: int, *holds: DeviceHold, **info: Any) -> Holder:
    """A holder; keyword arguments are ProcessInfo fields (default: a live host process)."""
    fields: dict[str, Any] = {"comm": "python3", "start_ticks": EXISTING.get(pid), "ppid": 50,
                              "parent_comm": "bash", "state": "S", "threads": 1}
    fields.update(info)
    return Holder(ProcessInfo(pid=pid, **fields), {x.device.path: x for x in holds})


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
    ("listed-started-before-first-listed", [], nv(proc(301)), [(301, 0, C.VISIBLE)], "no fd of it"),
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
    ("only-control-devices", [h(100, hold(CTL, 3), hold(UVM, 4), hold(CAP2, 6))], nv(), [], ""),
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
]


@pytest.mark.parametrize(("holders", "view", "expected", "reason_part"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_classify_table(holders: list[Holder], view: NvmlView, expected: list[tuple[int, int, C]],
                        reason_part: str) -> None:
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


def test_reused_pid_without_first_listed_time_is_visible() -> None:
    cfg = replace(CFG, nvml_first_listed={})
    [c] = classify([], nv(proc(300)), NOW, cfg, "n", EXISTING.get)
    assert c.cls is C.VISIBLE


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
