"""The work threshold as behaviour: which allocations make a holder a GPU job rather than a `monitor`.

tests/unit/test_gpu_work.py checks that the Python categories mirror the BPF constants; this file
checks what they do. A holder whose only work-category allocation was memory (a VA space, video or
system memory), a channel or an engine class is a GPU job; one that only allocated clients, devices,
events, profilers and unknown classes only reads state. Each category is judged alone, with
`first` 0 (the kernel stores seen[category] before `first`, bpf/alloc.bpf.c gg_alloc_record, so a
reader between the two stores sees exactly that), through the path the tracer takes: the kernel's
record bytes (unpack_alloc) -> judge/fill -> Holder.gpu_work -> classify().
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from ghostgpu.tracer import gpu_work
from ghostgpu.tracer.classify import ClassifyConfig, classify
from ghostgpu.tracer.config import TracerConfig
from ghostgpu.tracer.events import DeviceHold, GpuWork, Holder, NvmlGpu, NvmlView, ProcessInfo
from ghostgpu.tracer.gpu_work import ALLOC, AllocRecord, Category, category_of, judge, unpack_alloc
from ghostgpu.tracer.nvabi_names import RM_CLASS_NAMES

from ghostgpu.common.model.consumers import ConsumerClass, DeviceKind, DeviceRef

C = Category
# Written out, not derived from gpu_work.WORK: the threshold is what this table says.
COUNTS_AS_WORK = {C.UNSET: False, C.QUERY: False, C.OTHER: False, C.UNKNOWN: False,
                  C.MEMORY: True, C.CHANNEL: True, C.ENGINE: True}

S = 1_000_000_000
NOW = 100 * S
NV0 = DeviceRef("/dev/nvidia0", DeviceKind.GPU, 0, 195, 0)
CTL = DeviceRef("/dev/nvidiactl", DeviceKind.CONTROL, None, 195, 255)
VIEW = NvmlView(True, NOW, "595.45.04", (NvmlGpu(0, "GPU-00000000-aaaa", 0, processes=()),))
CFG = replace(ClassifyConfig.of(TracerConfig(node_name="node-a", grace_s=2.0)),
              boot_ns_of_ticks=lambda ticks: ticks * 10_000_000)


def raw_record(*cats: Category, first: int = 0, calls: int = 1) -> bytes:
    """struct gg_alloc_val as the kernel leaves it: seen[c] = 1 for each category in `cats`."""
    seen = [0] * (ALLOC.size - 16)
    for cat in cats:
        seen[cat] = 1
    return ALLOC.pack(first, calls, 0, *seen)


def container_holder(pid: int, work: GpuWork | None) -> Holder:
    """A process in a container holding /dev/nvidia0 and nvidiactl since 10 s, both opens seen by BPF,
    mapping nothing, and not listed by NVML: `monitor` or `hidden` rests on its allocations alone."""
    info = ProcessInfo(pid=pid, comm="python3", start_ticks=1000, ppid=50, parent_comm="containerd-shim",
                       state="S", threads=1, container_id="a" * 64, pod_uid="pod-1", runtime="containerd")
    holds = {d.path: DeviceHold(d, {3 + i}, False, 10 * S, "bpf") for i, d in enumerate((NV0, CTL))}
    return Holder(info, holds, gpu_work=work)


@pytest.mark.parametrize("cat", list(Category), ids=[c.name for c in Category])
def test_each_category_alone_decides_allocated(cat: Category) -> None:
    record = unpack_alloc(raw_record(cat))
    assert record == AllocRecord(0, 0, 1, 0, frozenset({cat}))
    assert record.allocated is COUNTS_AS_WORK[cat]
    # With the reads every client makes first (root client, device, subdevice, events).
    with_queries = unpack_alloc(raw_record(C.QUERY, C.UNKNOWN, cat, calls=5))
    assert with_queries.allocated is COUNTS_AS_WORK[cat]


@pytest.mark.parametrize("cat", list(Category), ids=[c.name for c in Category])
def test_judge_turns_each_category_into_gpu_work(cat: Category) -> None:
    work = judge({"bpf"}, unpack_alloc(raw_record(cat)), records_lost=False)
    assert work is not None
    assert work.allocated is COUNTS_AS_WORK[cat]
    assert work.what == ("an allocation call" if COUNTS_AS_WORK[cat] else "")
    assert work.complete is (cat is not C.UNSET)  # UNSET: the class table was never written


def test_no_work_category_at_all_is_not_allocated() -> None:
    reads = [c for c, counts in COUNTS_AS_WORK.items() if not counts and c is not C.UNSET]
    record = unpack_alloc(raw_record(*reads, calls=9))
    assert not record.allocated
    assert judge({"bpf"}, record, False) == GpuWork(False, "", True)
    # The first work call alone (a record read after both stores) also counts.
    assert unpack_alloc(raw_record(first=0x27 << 32 | 0x40)).allocated


NAMED = sorted(RM_CLASS_NAMES)


@pytest.mark.parametrize("h_class", NAMED, ids=[RM_CLASS_NAMES[c] for c in NAMED])
def test_every_named_class_alone(h_class: int) -> None:
    """A holder whose one allocation was this class: allocated exactly when its category is work."""
    cat = category_of(h_class)
    work = judge({"bpf"}, unpack_alloc(raw_record(cat)), False)
    assert work is not None and work.allocated is COUNTS_AS_WORK[cat], (RM_CLASS_NAMES[h_class], cat)


@pytest.mark.parametrize(("name", "expected"), [
    ("NV01_MEMORY_LOCAL_USER", True),  # video memory
    ("NV01_MEMORY_SYSTEM", True),
    ("NV01_MEMORY_SYSTEM_OS_DESCRIPTOR", True),
    ("NV01_MEMORY_VIRTUAL", True),
    ("NV50_MEMORY_VIRTUAL", True),
    ("FERMI_VASPACE_A", True),
    ("NV_MEMORY_FABRIC", True),
    ("KEPLER_CHANNEL_GROUP_A", True),
    ("FERMI_CONTEXT_SHARE_A", True),
    ("HOPPER_CHANNEL_GPFIFO_A", True),
    ("HOPPER_USERMODE_A", True),
    ("AMPERE_COMPUTE_A", True),
    ("VOLTA_COMPUTE_A", True),
    ("HOPPER_DMA_COPY_A", True),
    ("MPS_COMPUTE", True),
    ("NV01_ROOT_CLIENT", False),
    ("NV01_DEVICE_0", False),
    ("NV20_SUBDEVICE_0", False),
    ("NV01_EVENT_OS_EVENT", False),
    ("RM_USER_SHARED_DATA", False),
    ("MAXWELL_PROFILER_DEVICE", False),  # DCGM's profiling metrics
    ("AMPERE_SMC_PARTITION_REF", False),
    ("NV01_CONTEXT_DMA", False),
])
def test_named_classes_that_make_a_gpu_job(name: str, expected: bool) -> None:
    h_class = {n: c for c, n in RM_CLASS_NAMES.items()}[name]
    work = judge({"bpf"}, unpack_alloc(raw_record(category_of(h_class))), False)
    assert work is not None and work.allocated is expected


@pytest.mark.parametrize("cat", list(Category), ids=[c.name for c in Category])
def test_fill_sets_the_holder_from_the_kernel_record(cat: Category) -> None:
    holder = container_holder(100, GpuWork(True, "stale"))
    gpu_work.fill([holder], lambda pid: unpack_alloc(raw_record(cat)), lambda: False)
    assert holder.gpu_work is not None and holder.gpu_work.allocated is COUNTS_AS_WORK[cat]


@pytest.mark.parametrize("cat", list(Category), ids=[c.name for c in Category])
def test_classify_a_holder_whose_only_allocation_was_one_category(cat: Category) -> None:
    holder = container_holder(100, None)
    gpu_work.fill([holder], lambda pid: unpack_alloc(raw_record(C.QUERY, cat)), lambda: False)
    [consumer] = classify([holder], VIEW, NOW, CFG, "node-a", {100: 1000}.get)
    if COUNTS_AS_WORK[cat]:
        assert consumer.cls is ConsumerClass.HIDDEN, consumer.reason
        assert "it allocated GPU resources (an allocation call)" in consumer.reason
    elif cat is C.UNSET:  # nothing could be judged: no proof it only reads
        assert consumer.cls is ConsumerClass.HIDDEN and "evidence is incomplete" in consumer.reason
    else:
        assert consumer.cls is ConsumerClass.MONITOR, consumer.reason


def test_classify_a_memory_only_job_named_by_its_first_call() -> None:
    """The usual record: seen[MEMORY] and `first` naming the call; hidden, with the call in the reason."""
    holder = container_holder(100, None)
    record = unpack_alloc(raw_record(C.QUERY, C.MEMORY, first=0x2B << 32 | 0x40))
    gpu_work.fill([holder], lambda pid: record, lambda: False)
    [consumer] = classify([holder], VIEW, NOW, CFG, "node-a", {100: 1000}.get)
    assert consumer.cls is ConsumerClass.HIDDEN
    assert "it allocated GPU resources (RM_ALLOC NV01_MEMORY_LOCAL_USER (0x40))" in consumer.reason
