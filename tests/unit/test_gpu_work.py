"""tracer/gpu_work.py: class categories, the kernel's allocation record, and the GpuWork judged from it.

Pure tables and functions, plus the C mirrors (bpf/alloc.bpf.c) they must agree with. The kernel
side for real is tests/integration/test_alloc_capture.py.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from ghostgpu.tracer import gpu_work
from ghostgpu.tracer.agent import Tracer
from ghostgpu.tracer.bpf_build import BPF_DIR, BPF_FILES, build_cflags, map_sizes
from ghostgpu.tracer.call_decode import HEAP_FUNCTIONS
from ghostgpu.tracer.config import TracerConfig
from ghostgpu.tracer.events import DeviceHold, GpuWork, Holder, ProcessInfo
from ghostgpu.tracer.gpu_work import (
    ALLOC,
    CLASS_CATEGORY,
    WORK,
    AllocRecord,
    Category,
    category_of,
    category_table,
    describe,
    judge,
    unpack_alloc,
)
from ghostgpu.tracer.ioctl_decode import NV_ESCAPES
from ghostgpu.tracer.nvabi_names import RM_CLASS_NAMES
from ghostgpu.tracer.sinks import CallbackSink

from ghostgpu.common.model.consumers import ConsumerClass, DeviceRef
from tests.helpers.fake_kmaps import AllocVal, fake_tables

C = Category
SOURCE = (BPF_DIR / "alloc.bpf.c").read_text()


def rec(first_nr: int = 0, value: int = 0, seen: tuple[Category, ...] = (), calls: int = 1,
        from_tgid: int = 0) -> AllocRecord:
    return AllocRecord(first_nr, value, calls, from_tgid, frozenset(seen))


# --- categories -------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("h_class", "category"),
    [
        (0x0041, C.QUERY),  # NV01_ROOT_CLIENT: every RM user's first allocation
        (0x0000, C.QUERY),  # NV01_ROOT: comes back as 0x41
        (0x0080, C.QUERY),  # NV01_DEVICE_0
        (0x2080, C.QUERY),  # NV20_SUBDEVICE_0
        (0x0079, C.QUERY),  # NV01_EVENT_OS_EVENT
        (0x00DE, C.QUERY),  # RM_USER_SHARED_DATA: a read-only page of state
        (0xB2CC, C.OTHER),  # MAXWELL_PROFILER_DEVICE: DCGM's profiling metrics
        (0xC637, C.OTHER),  # AMPERE_SMC_PARTITION_REF
        (0x0040, C.MEMORY),  # NV01_MEMORY_LOCAL_USER: video memory
        (0x003E, C.MEMORY),  # NV01_MEMORY_SYSTEM
        (0x90F1, C.MEMORY),  # FERMI_VASPACE_A
        (0x50A0, C.MEMORY),  # NV50_MEMORY_VIRTUAL
        (0xA06C, C.CHANNEL),  # KEPLER_CHANNEL_GROUP_A
        (0xC86F, C.CHANNEL),  # HOPPER_CHANNEL_GPFIFO_A
        (0xC661, C.CHANNEL),  # HOPPER_USERMODE_A
        (0xC6C0, C.ENGINE),  # AMPERE_COMPUTE_A
        (0xC8B5, C.ENGINE),  # HOPPER_DMA_COPY_A
        (0xCB97, C.ENGINE),  # HOPPER_A (3D)
        (0x900E, C.ENGINE),  # MPS_COMPUTE
        (0x906F, C.CHANNEL),  # GF100_CHANNEL_GPFIFO: not named, its family says channel
        (0xCFC0, C.ENGINE),  # a future compute class
        (0xCFB5, C.ENGINE),  # a future copy engine
        (0x00C0, C.UNKNOWN),  # below the families: a low byte means nothing there
        (0x402C, C.UNKNOWN),  # NV40_I2C: a query class the tables do not name is not work
        (0x0073, C.UNKNOWN),  # NV04_DISPLAY_COMMON
        (0x10000, C.UNKNOWN),  # no class id is that large
        (-1, C.UNKNOWN),
    ],
)
def test_category_of(h_class: int, category: Category) -> None:
    assert category_of(h_class) is category


def test_every_named_class_has_its_own_category() -> None:
    assert set(CLASS_CATEGORY) == set(RM_CLASS_NAMES)
    counts = [len(ids) for ids in gpu_work.CATEGORY_CLASSES.values()]
    assert sum(counts) == len(CLASS_CATEGORY)  # no class in two categories


def test_the_family_rule_agrees_with_every_named_class() -> None:
    for h_class, category in CLASS_CATEGORY.items():
        family = gpu_work.FAMILIES.get(h_class & 0xFF)
        if h_class >= gpu_work.FAMILY_FROM and family is not None:
            assert family is category, f"{h_class:#x} {RM_CLASS_NAMES[h_class]}"


def test_category_table_is_one_byte_per_class_id() -> None:
    table = category_table()
    assert len(table) == 1 << 16
    cats = bytes(b & gpu_work.CATEGORY_MASK for b in table)
    assert cats[0xC6C0] == C.ENGINE and cats[0x0041] == C.QUERY and cats[0x402C] == C.UNKNOWN
    assert C.UNSET not in set(cats)  # every id is judged: UNSET only means "table not written"


# --- the C mirrors ----------------------------------------------------------------------------

def c_defines(prefix: str) -> dict[str, int]:
    found = re.findall(rf"#define {prefix}(\w+) (0x[0-9A-Fa-f]+|\d+)u?", SOURCE)
    return {name: int(value, 0) for name, value in found}


def test_categories_mirror_the_kernel() -> None:
    defined = {name: value for name, value in c_defines("GG_AC_").items() if name != "SLOTS"}
    assert defined == {c.name: c.value for c in Category}
    assert c_defines("GG_AC_")["SLOTS"] == ALLOC.size - 16
    assert min(WORK) == c_defines("GG_AC_")["MEMORY"] and max(Category) < c_defines("GG_AC_")["SLOTS"]


def test_escapes_mirror_the_decoder_tables() -> None:
    escapes = c_defines("GG_ESC_")
    assert {f"NV_ESC_{name}" for name in escapes} <= set(NV_ESCAPES.values())
    assert {NV_ESCAPES[nr] for nr in escapes.values()} == {f"NV_ESC_{name}" for name in escapes}
    heap = c_defines("GG_HEAP_")
    assert {HEAP_FUNCTIONS[v] for v in heap.values()} == set(heap)
    assert tuple(sorted(heap.values())) == gpu_work.HEAP_ALLOC_FUNCTIONS


def test_record_struct_mirrors_the_kernel() -> None:
    body = re.search(r"struct gg_alloc_val \{(.*?)\};", SOURCE, re.S)
    assert body is not None
    fields = re.findall(r"^\s*(u64|u32|u8) (\w+)(\[\w+\])?;", body.group(1), re.M)
    assert [(t, n) for t, n, _ in fields] == [("u64", "first"), ("u32", "calls"), ("u32", "from_tgid"),
                                              ("u8", "seen")]
    assert ALLOC.size == ctypes.sizeof(AllocVal) == 24


def test_alloc_file_is_compiled_before_its_callers() -> None:
    order = list(BPF_FILES)
    assert order.index("alloc.bpf.c") < min(order.index("ioctl.bpf.c"), order.index("sched.bpf.c"))
    assert order.index("ghostgpu.h") < order.index("alloc.bpf.c")
    assert "-DGG_MAX_ALLOCS=16384" in build_cflags(("/dev/nvidia",))
    assert map_sizes(64)["GG_MAX_ALLOCS"] >= map_sizes(64)["GG_MAX_PROCS"]


# --- the record ---------------------------------------------------------------------------------

def test_unpack_alloc() -> None:
    raw = ALLOC.pack(0x2B << 32 | 0xC6C0, 5, 77, 0, 1, 0, 0, 0, 0, 1, 0)
    assert unpack_alloc(raw) == rec(0x2B, 0xC6C0, (C.QUERY, C.ENGINE), calls=5, from_tgid=77)
    assert unpack_alloc(ALLOC.pack(0, 2, 0, *[0] * 7, 1)) == rec(calls=2)  # slot 7: no category: dropped


@pytest.mark.parametrize(
    ("nr", "value", "text"),
    [
        (0x2B, 0xC6C0, "RM_ALLOC AMPERE_COMPUTE_A (0xc6c0)"),
        (0x27, 0x71, "RM_ALLOC_MEMORY NV01_MEMORY_SYSTEM_OS_DESCRIPTOR (0x71)"),
        (0x28, 0x40, "RM_ALLOC_OBJECT NV01_MEMORY_LOCAL_USER (0x40)"),
        (0x2B, 0xCFC0, "RM_ALLOC class 0xcfc0"),
        (0x4A, 2, "RM_VID_HEAP_CONTROL ALLOC_SIZE"),
        (0x4A, 99, "RM_VID_HEAP_CONTROL 99"),
    ],
)
def test_describe(nr: int, value: int, text: str) -> None:
    assert describe(nr, value) == text


COMPUTE = rec(0x2B, 0xCBC0, (C.QUERY, C.ENGINE))
QUERIES = rec(seen=(C.QUERY, C.UNKNOWN), calls=4)


@pytest.mark.parametrize(
    ("sources", "record", "lost", "expected"),
    [
        # Found by /proc alone: no call history, whatever the kernel holds since.
        ({"procfs"}, COMPUTE, False, None),
        (set(), None, False, None),
        # Seen from its first open: the record is the whole story.
        ({"bpf"}, QUERIES, False, GpuWork(False, "", True)),
        ({"bpf"}, None, False, GpuWork(False, "", True)),  # no allocation call at all
        ({"bpf"}, COMPUTE, False, GpuWork(True, "RM_ALLOC HOPPER_COMPUTE_A (0xcbc0)", True)),
        ({"bpf"}, rec(0x27, 0x3E, (C.MEMORY,)), False,
         GpuWork(True, "RM_ALLOC_MEMORY NV01_MEMORY_SYSTEM (0x3e)", True)),
        ({"bpf"}, rec(0x2B, 0xCBC0, (C.ENGINE,), from_tgid=40), False,
         GpuWork(True, "RM_ALLOC HOPPER_COMPUTE_A (0xcbc0), inherited from pid 40 at fork", True)),
        # A hold the kernel never saw opened: its fd's calls before the seed went unseen.
        ({"bpf", "procfs"}, QUERIES, False, GpuWork(False, "", False)),
        ({"bpf", "procfs"}, COMPUTE, False, GpuWork(True, "RM_ALLOC HOPPER_COMPUTE_A (0xcbc0)", False)),
        # The kernel lost some record: a missing one proves nothing, a kept one still does.
        ({"bpf"}, None, True, GpuWork(False, "", False)),
        ({"bpf"}, QUERIES, True, GpuWork(False, "", True)),
        # The class table was never written: nothing could be judged.
        ({"bpf"}, rec(seen=(C.UNSET,)), False, GpuWork(False, "", False)),
    ],
)
def test_judge(sources: set[str], record: AllocRecord | None, lost: bool, expected: GpuWork | None) -> None:
    assert judge(sources, record, lost) == expected


def holder(pid: int, *sources: str) -> Holder:
    holds = {f"/dev/nvidia{i}": DeviceHold(DeviceRef(f"/dev/nvidia{i}"), {3 + i}, source=src)
             for i, src in enumerate(sources)}
    return Holder(ProcessInfo(pid), holds, gpu_work=GpuWork(True, "stale"))


def test_fill_reads_only_holders_the_kernel_saw_and_the_lost_counter_at_most_once() -> None:
    holders = [holder(1, "procfs"), holder(2, "bpf"), holder(3, "bpf", "bpf"), holder(4, "bpf")]
    records = {3: COMPUTE}
    read: list[int] = []
    lost_reads: list[bool] = []

    def lost() -> bool:
        lost_reads.append(True)
        return False

    gpu_work.fill(holders, lambda pid: read.append(pid) or records.get(pid), lost)
    assert read == [2, 3, 4]
    assert lost_reads == [True]
    assert [h.gpu_work for h in holders] == [
        None, GpuWork(False, "", True), GpuWork(True, "RM_ALLOC HOPPER_COMPUTE_A (0xcbc0)", True),
        GpuWork(False, "", True)]


# --- the kernel tables and the agent -------------------------------------------------------------

def test_tables_read_and_forget_the_record() -> None:
    tables, kernel = fake_tables()
    seen = (ctypes.c_uint8 * 8)(0, 1, 0, 0, 0, 0, 1, 0)
    kernel.put("alloc_work", ctypes.c_uint32(42), AllocVal(0x2B << 32 | 0xC6C0, 3, 0, seen))
    assert tables.alloc_record(42) == rec(0x2B, 0xC6C0, (C.QUERY, C.ENGINE), calls=3)
    assert tables.alloc_record(43) is None
    tables.forget(42)
    assert tables.alloc_record(42) is None


class StubBpf:
    """What the agent asks of BpfSource around allocation records."""

    def __init__(self, allocated: set[int]) -> None:
        self.allocated, self.asked = allocated, []  # type: ignore[var-annotated]

    def any_allocated(self, pids: list[int]) -> bool:
        self.asked.append(sorted(pids))
        return bool(self.allocated & set(pids))

    def stats(self) -> dict[str, int]:
        return {}


@pytest.fixture
def tracer() -> Iterator[Tracer]:
    cfg = TracerConfig(node_name="n1", proc_root="/nonexistent", bpf="off")
    t = Tracer(cfg, CallbackSink(lambda _r: None))
    yield t
    t.nvml_source.close()


def consumer(pid: int, cls: ConsumerClass) -> Any:
    return SimpleNamespace(pid=pid, cls=cls)  # all the poll reads of a Consumer


@pytest.mark.parametrize(("allocated", "dirty"), [(set(), False), ({7}, True), ({8}, False)])
def test_a_monitor_that_starts_allocating_is_rejudged_at_the_next_poll(
        tracer: Tracer, allocated: set[int], dirty: bool) -> None:
    stub = StubBpf(allocated)
    tracer.bpf = stub
    tracer.consumers = {1: consumer(7, ConsumerClass.MONITOR), 2: consumer(8, ConsumerClass.HIDDEN)}
    tracer._dirty = False
    tracer._poll_counters()
    assert stub.asked == [[7]]  # only monitors are looked up
    assert tracer._dirty is dirty
