"""A consumer's memory, rule by rule: allocated_bytes from the driver calls (device instance N is the
GPU of device minor N; unknown is not zero), the memory a finding's reason names, each GPU's split of
NVML's used memory and when it is re-sent, and how sizes are written."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from ghostgpu.tracer import records
from ghostgpu.tracer.classify import BEFORE_START, NO_HOLDER, NO_KERNEL_SIDE, ClassifyConfig, classify
from ghostgpu.tracer.config import TracerConfig
from ghostgpu.tracer.events import DeviceHold, HeldMemory, Holder, NvmlGpu, NvmlProcess, NvmlView, ProcessInfo

from ghostgpu.common.model.consumers import Consumer, ConsumerClass, DeviceKind, DeviceRef
from ghostgpu.common.model.display import memory_cell, size_phrase
from ghostgpu.common.model.records import GpuInfo

S = 1_000_000_000
NOW = 100 * S
MIB, GIB = 1 << 20, 1 << 30
C = ConsumerClass
NV0 = DeviceRef("/dev/nvidia0", DeviceKind.GPU, 0, 195, 0)
NV1 = DeviceRef("/dev/nvidia1", DeviceKind.GPU, 1, 195, 1)
CTL = DeviceRef("/dev/nvidiactl", DeviceKind.CONTROL, None, 195, 255)
UUID0, UUID1 = "GPU-00000000-aaaa", "GPU-11111111-bbbb"
EXISTING = {100: 1000, 200: 1000}
CFG = replace(ClassifyConfig.of(TracerConfig(node_name="node-a", grace_s=2.0)),
              boot_ns_of_ticks=lambda ticks: ticks * 10_000_000)
GONE = "it is a zombie (state Z)"


def hold(dev: DeviceRef, fd: int, source: str = "bpf") -> DeviceHold:
    return DeviceHold(dev, {fd}, False, 10 * S, source)


def holder(pid: int, *holds: DeviceHold, memory: HeldMemory | None, **info: Any) -> Holder:
    fields: dict[str, Any] = {"comm": "python3", "start_ticks": EXISTING.get(pid), "ppid": 50,
                              "parent_comm": "bash", "state": "S", "threads": 1}
    fields.update(info)
    return Holder(ProcessInfo(pid=pid, **fields), {x.device.path: x for x in holds}, memory=memory)


def nvml(*listed0: NvmlProcess, used0: int | None = None) -> NvmlView:
    return NvmlView(True, NOW, "595.45.04", (NvmlGpu(0, UUID0, 0, memory_used_bytes=used0, processes=listed0),
                                             NvmlGpu(1, UUID1, 1)))


def run(holders: list[Holder], view: NvmlView | None = None) -> dict[tuple[int, int | None], Consumer]:
    out = classify(holders, view or nvml(), NOW, CFG, "node-a", EXISTING.get)
    return {(c.pid, c.gpu_minor): c for c in out}


# (id, holders, NVML, {(pid, gpu minor): (allocated_bytes, allocated_reason)}, what a reason ends with)
CASES: list[tuple[str, list[Holder], NvmlView | None, dict[tuple[int, int | None], tuple[int | None, str]],
                  dict[tuple[int, int | None], str]]] = [
    ("instance N is the GPU of minor N",
     [holder(100, hold(NV0, 4), hold(NV1, 5), hold(CTL, 3),
             memory=HeldMemory({0: 3 * GIB + 200 * MIB, 1: MIB}))],
     None, {(100, 0): (3 * GIB + 200 * MIB, ""), (100, 1): (MIB, "")},
     {(100, 0): "; it holds 3.2 GiB on GPU 0 (from the driver calls ghostgpu saw)",
      (100, 1): "; it holds 1.0 MiB on GPU 1 (from the driver calls ghostgpu saw)"}),
    ("seen from its first open, nothing allocated: 0, and the reason names no memory",
     [holder(100, hold(NV0, 4), memory=HeldMemory({}))], None, {(100, 0): (0, "")},
     {(100, 0): "NVML lists no such process on GPU 0 (GPU-00000000-aaaa); whether it allocated GPU resources "
                "is unknown: the evidence is incomplete (it opened the device before the tracer watched it, "
                "or BPF is off)"}),
    ("a hold found by the /proc scan: allocated before the tracer started",
     [holder(100, hold(NV0, 4, "procfs"), hold(CTL, 3), memory=HeldMemory({0: GIB}))], None,
     {(100, 0): (None, BEFORE_START)}, {}),
    ("BPF off: no driver call is seen",
     [holder(100, hold(NV0, 4), memory=None)], None, {(100, 0): (None, NO_KERNEL_SIDE)}, {}),
    ("the accountant's figure is not exact: unknown, with its reason",
     [holder(100, hold(NV0, 4), memory=HeldMemory({0: GIB}, "the RM object table was full"))], None,
     {(100, 0): (None, "the RM object table was full")}, {}),
    ("memory under no device object, and on a GPU it holds no file of, goes to its first consumer",
     [holder(100, hold(NV1, 5), memory=HeldMemory({None: 2 * MIB, 0: 4 * MIB, 1: 8 * MIB}))], None,
     {(100, 1): (14 * MIB, "")}, {}),
    ("a holder of node-wide devices only: everything on its one consumer",
     [holder(100, hold(CTL, 3), memory=HeldMemory({0: 5 * MIB}))], None, {(100, None): (5 * MIB, "")},
     {(100, None): "; it holds 5.0 MiB of GPU memory (from the driver calls ghostgpu saw)"}),
    ("NVML lists it: the visible reason already names NVML's figure; allocated_bytes is still set",
     [holder(100, hold(NV0, 4), memory=HeldMemory({0: 6 * MIB}))], nvml(NvmlProcess(100, 7 * MIB)),
     {(100, 0): (6 * MIB, "")}, {(100, 0): "holds /dev/nvidia0 (fd 4) for 90.0 s"}),
    ("orphaned and listed: NVML's figure, said to be NVML's",
     [holder(100, hold(NV0, 4), memory=HeldMemory({0: 6 * MIB}), state="Z")],
     nvml(NvmlProcess(100, 3 * GIB + 300 * MIB)), {(100, 0): (6 * MIB, "")},
     {(100, 0): f"{GONE} and still holds /dev/nvidia0 (fd 4) for 90.0 s; it holds 3.3 GiB on GPU 0 "
                "(NVML's figure)"}),
    ("a ghost NVML lists and no holder covers: none of its calls were seen",
     [], nvml(NvmlProcess(4242, GIB)), {(4242, 0): (None, NO_HOLDER)}, {}),
]


@pytest.mark.parametrize(("holders", "view", "allocated", "reason_ends"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_allocated_bytes_and_the_reason(holders: list[Holder], view: NvmlView | None,
                                        allocated: dict[tuple[int, int | None], tuple[int | None, str]],
                                        reason_ends: dict[tuple[int, int | None], str]) -> None:
    consumers = run(holders, view)
    assert {key: (c.allocated_bytes, c.allocated_reason) for key, c in consumers.items()} == allocated
    for key, end in reason_ends.items():
        assert consumers[key].reason.endswith(end), consumers[key].reason
    for key, c in consumers.items():
        if c.allocated_bytes is None and c.gpu_memory_bytes is None:
            assert "it holds" not in c.reason, f"{key}: an unknown figure is named as held"


def test_the_json_says_why_unknown_and_omits_an_empty_reason() -> None:
    known = run([holder(100, hold(NV0, 4), memory=HeldMemory({0: MIB}))])[(100, 0)].to_json()
    unknown = run([holder(100, hold(NV0, 4, "procfs"), memory=HeldMemory({}))])[(100, 0)].to_json()
    assert known["allocated_bytes"] == MIB and "allocated_reason" not in known
    assert (unknown["allocated_bytes"], unknown["allocated_reason"]) == (None, BEFORE_START)
    assert list(known).index("allocated_bytes") == list(known).index("gpu_memory_bytes") + 1


# ---- each GPU's memory split -------------------------------------------------------------------

def test_the_split_of_nvmls_used_memory() -> None:
    """listed: NVML's per-process figures; unlisted: the allocated_bytes of the consumers NVML does not
    list on that GPU; unaccounted: the rest. A consumer with an unknown figure adds nothing: what it
    holds stays unaccounted."""
    holders = [holder(100, hold(NV0, 4), memory=HeldMemory({0: 3 * GIB})),  # unlisted, known
               holder(200, hold(NV0, 4, "procfs"), memory=HeldMemory({}))]  # unlisted, unknown
    view = nvml(NvmlProcess(4242, 2 * GIB), used0=10 * GIB)
    gpus = records.gpu_infos(view, run(holders, view).values())
    split = [(g.memory_used_bytes, g.memory_listed_bytes, g.memory_unlisted_bytes, g.unaccounted_bytes)
             for g in gpus]
    assert split == [(10 * GIB, 2 * GIB, 3 * GIB, 5 * GIB), (None, 0, 0, None)]


def test_the_mps_server_is_not_unlisted() -> None:
    """The MPS server's driver calls allocate for its clients, which NVML lists with that memory: it
    adds nothing to unlisted (the memory is in listed already)."""
    holders = [holder(100, hold(NV0, 4), memory=HeldMemory({0: 3 * GIB}), comm="nvidia-cuda-mps",
                      exe="/usr/bin/nvidia-cuda-mps-server"),
               holder(200, hold(NV0, 4), memory=HeldMemory({0: GIB}))]
    view = nvml(NvmlProcess(4242, 3 * GIB), used0=10 * GIB)
    (gpu0, _) = records.gpu_infos(view, run(holders, view).values())
    assert (gpu0.memory_listed_bytes, gpu0.memory_unlisted_bytes, gpu0.unaccounted_bytes) == \
        (3 * GIB, GIB, 6 * GIB)


@pytest.mark.parametrize(("gpu", "listed"), [
    (NvmlGpu(0, UUID0, 0, memory_used_bytes=GIB, processes=(NvmlProcess(1, None),)), None),  # no figure for 1
    (NvmlGpu(0, UUID0, 0, memory_used_bytes=GIB, processes_known=False), None),  # could not list
    (NvmlGpu(0, UUID0, 0, memory_used_bytes=GIB, processes=(NvmlProcess(1, MIB), NvmlProcess(2, MIB))),
     2 * MIB),
], ids=["a listed process without a figure", "processes not listed", "two listed"])
def test_listed_is_unknown_when_nvml_leaves_a_part_out(gpu: NvmlGpu, listed: int | None) -> None:
    (info,) = records.gpu_infos(NvmlView(True, NOW, "595.45.04", (gpu,)), ())
    assert info.memory_listed_bytes == listed
    assert info.unaccounted_bytes == (None if listed is None else GIB - listed)


def _gpu(used: int | None, unaccounted: int | None, uuid: str = UUID0) -> GpuInfo:
    return GpuInfo(0, uuid, "", 0, None, memory_used_bytes=used, memory_listed_bytes=0,
                           memory_unlisted_bytes=0, unaccounted_bytes=unaccounted)


@pytest.mark.parametrize(("old", "new", "moved"), [
    ((_gpu(GIB, GIB),), (_gpu(GIB + MIB - 1, GIB + MIB - 1),), False),  # less than a MiB
    ((_gpu(GIB, GIB),), (_gpu(GIB + MIB, GIB + MIB),), True),
    ((_gpu(GIB, GIB),), (_gpu(GIB - MIB, GIB - MIB),), True),
    ((_gpu(GIB, GIB),), (_gpu(None, None),), True),  # became unknown
    ((_gpu(None, None),), (_gpu(0, 0),), True),  # became known
    ((_gpu(GIB, GIB),), (_gpu(GIB, GIB, UUID1),), True),  # another GPU
    ((), (_gpu(GIB, GIB),), True),
])
def test_the_split_is_resent_when_it_moves_a_mib(old: tuple[GpuInfo, ...], new: tuple[GpuInfo, ...],
                                                 moved: bool) -> None:
    assert records.split_moved(old, new) is moved


# ---- how sizes are written ------------------------------------------------------------------------

@pytest.mark.parametrize(("nbytes", "text"), [
    (0, "0 bytes"), (1023, "1023 bytes"), (1024, "1.0 KiB"), (2 * MIB, "2.0 MiB"),
    (3 * GIB + 200 * MIB, "3.2 GiB"), (5 << 40, "5.0 TiB"),
])
def test_size_phrase(nbytes: int, text: str) -> None:
    assert size_phrase(nbytes) == text


@pytest.mark.parametrize(("nvml_bytes", "allocated", "cell"), [
    (512 * MIB, 3 * GIB, "512MiB"),  # NVML's figure where NVML gives one
    (None, 3 * GIB, "3072MiB*"),  # else the driver calls', marked
    (None, 0, "0MiB*"),
    (None, None, "-"),  # unknown
])
def test_memory_cell(nvml_bytes: int | None, allocated: int | None, cell: str) -> None:
    assert memory_cell(nvml_bytes, allocated) == cell
