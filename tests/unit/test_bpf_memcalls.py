"""The kernel's memory-call records (bpf/alloc.bpf.c) as user space takes them: the decoder into
MemCall, the C mirrors (kinds, class bits, record layout), RM_ALLOC's status offsets per driver
release, the class bits in the table the kernel reads, and the client fds the tables index.

No root, no bcc. The kernel side itself runs in tests/integration/test_memcalls_bpf.py.
"""

from __future__ import annotations

import ctypes
import re
import struct
from typing import Any

import pytest
from ghostgpu.tracer import gpu_work
from ghostgpu.tracer.bpf_build import BPF_DIR, build_cflags, rm_alloc_layout
from ghostgpu.tracer.bpf_source import (
    EV_MEMCALL,
    MCF_INSTANCE,
    MEMCALL,
    STAT_NAMES,
    BpfSource,
    decode_memcall,
)
from ghostgpu.tracer.gpu_work import CATEGORY_MASK, Category, ClassBit, category_table, class_bits
from ghostgpu.tracer.memcalls import MemCall, MemCallKind

from tests.helpers import fake_kmaps

K = MemCallKind
ALLOC_C = (BPF_DIR / "alloc.bpf.c").read_text()
HEADER = (BPF_DIR / "ghostgpu.h").read_text()


def memcall(mkind: int, *, ts: int = 5_000, tgid: int = 300, tid: int = 301, fd: int = 7, dev: int = 9,
            h_root: int = 0xC1D00001, h_parent: int = 0, h_object: int = 0, h_class: int = 0, size: int = 0,
            attr: int = 0, instance: int = 0, src_client: int = 0, src_object: int = 0, flags: int = 0,
            kind: int = EV_MEMCALL) -> bytes:
    """struct gg_memcall as the kernel writes it."""
    return MEMCALL.pack(ts, 42, kind, tgid, tid, fd, dev, mkind, h_root, h_parent, h_object, h_class, size,
                        attr, instance, src_client, src_object, flags, 0)


def call(kind: MemCallKind, **kw: Any) -> MemCall:
    base: dict[str, Any] = {"ts_ns": 5_000, "pid": 300, "fd": 7, "h_root": 0xC1D00001, "h_parent": 0,
                            "h_object": 0}
    return MemCall(kind=kind, **{**base, **kw})


GIB = 1 << 30
# (record, the MemCall it decodes to)
DECODE_CASES = [
    pytest.param(memcall(1, h_parent=0xC1D00002, h_object=0xC1D00005, h_class=0x40, size=4 * GIB, attr=0x1),
                 call(K.ALLOC, h_parent=0xC1D00002, h_object=0xC1D00005, h_class=0x40, size_bytes=4 * GIB,
                      attr=0x1), id="alloc-memory-class"),
    pytest.param(memcall(1, h_root=0, h_object=0xC1D00001, h_class=0x41),
                 call(K.ALLOC, h_root=0, h_object=0xC1D00001, h_class=0x41), id="alloc-client"),
    pytest.param(memcall(1, h_parent=0xC1D00001, h_object=0xC1D00002, h_class=0x80, instance=1,
                         flags=MCF_INSTANCE),
                 call(K.ALLOC, h_parent=0xC1D00001, h_object=0xC1D00002, h_class=0x80, instance=1),
                 id="alloc-device-1"),
    pytest.param(memcall(1, h_object=0xC1D00003, h_class=0x2080, instance=0, flags=MCF_INSTANCE),
                 call(K.ALLOC, h_object=0xC1D00003, h_class=0x2080, instance=0), id="alloc-subdevice-0"),
    pytest.param(memcall(1, h_object=0xC1D00003, h_class=0x2080, instance=3, flags=0),
                 call(K.ALLOC, h_object=0xC1D00003, h_class=0x2080, instance=None),
                 id="instance-not-read"),
    pytest.param(memcall(2, h_object=0xC1D00006, h_class=0x3E, size=(1 << 20), attr=0x30),
                 call(K.ALLOC_MEMORY, h_object=0xC1D00006, h_class=0x3E, size_bytes=1 << 20, attr=0x30),
                 id="alloc-memory"),
    pytest.param(memcall(3, h_parent=0xC1D00002, h_object=0xCAFE0001, size=(1 << 64) - 1, attr=0xFFFFFFFF),
                 call(K.HEAP_ALLOC, h_parent=0xC1D00002, h_object=0xCAFE0001, size_bytes=(1 << 64) - 1,
                      attr=0xFFFFFFFF), id="heap-alloc-extremes"),
    pytest.param(memcall(4, h_object=0xCAFE0001), call(K.HEAP_FREE, h_object=0xCAFE0001), id="heap-free"),
    pytest.param(memcall(5, h_object=0xC1D00001), call(K.FREE, h_object=0xC1D00001), id="free-client"),
    pytest.param(memcall(6, h_root=0xC2000001, h_parent=0xC2000002, h_object=0xC2000009,
                         src_client=0xC1D00001, src_object=0xC1D00005),
                 call(K.DUP, h_root=0xC2000001, h_parent=0xC2000002, h_object=0xC2000009,
                      src_client=0xC1D00001, src_object=0xC1D00005), id="dup"),
    pytest.param(memcall(7, h_root=0, fd=-1), call(K.CLOSE, h_root=0, fd=-1), id="close"),
    pytest.param(memcall(5, h_object=1) + b"trailing", call(K.FREE, h_object=1), id="longer-record"),
]


@pytest.mark.parametrize(("data", "expected"), DECODE_CASES)
def test_decode_memcall(data: bytes, expected: MemCall) -> None:
    assert decode_memcall(data) == expected


@pytest.mark.parametrize(
    "data",
    [b"", memcall(1)[:87], memcall(0), memcall(8), memcall(0xFFFFFFFF), memcall(1, kind=1)],
    ids=["empty", "short", "mkind-0", "mkind-8", "mkind-max", "an-open-event"],
)
def test_decode_memcall_rejects(data: bytes) -> None:
    assert decode_memcall(data) is None


# --- the C mirrors ------------------------------------------------------------------------------

def c_defines(text: str, prefix: str) -> dict[str, int]:
    return {n: int(v, 0) for n, v in re.findall(rf"#define {prefix}(\w+) (0x[0-9A-Fa-f]+|\d+)u?\b", text)}


def test_kinds_and_bits_mirror_the_kernel() -> None:
    assert c_defines(ALLOC_C, "GG_MC_") == {k.name: k.value for k in MemCallKind}
    assert c_defines(ALLOC_C, "GG_CB_") == {b.name: b.value for b in ClassBit}
    assert c_defines(ALLOC_C, "GG_CATEGORY_")["MASK"] == CATEGORY_MASK
    assert c_defines(ALLOC_C, "GG_MCF_")["INSTANCE"] == MCF_INSTANCE
    assert c_defines(HEADER, "GG_EV_")["MEMCALL"] == EV_MEMCALL
    assert max(Category) <= CATEGORY_MASK and min(ClassBit) > CATEGORY_MASK  # bits never hide a category


def test_the_record_layout_mirrors_the_kernel() -> None:
    body = re.search(r"struct gg_memcall \{(.*?)\};", ALLOC_C, re.S)
    assert body is not None
    types = re.findall(r"^\s*(u64|u32|s32) \w+;", body.group(1), re.M)
    assert "=" + "".join({"u64": "Q", "u32": "I", "s32": "i"}[t] for t in types) == MEMCALL.format
    assert MEMCALL.size == 88
    # gg_event's head: the poll loop reads the kind of every record the same way
    assert MEMCALL.format.startswith("=QQIIIiI")


def test_stat_names_cover_the_memory_slots() -> None:
    for name in ("mem_refused", "mem_failed", "mem_lost", "mem_clients_full", "mem_drops"):
        assert name in STAT_NAMES


# --- RM_ALLOC's status per driver release (docs/reference/nvidia-ioctl-abi.md §3.1, §5.2) --------

@pytest.mark.parametrize(
    ("version", "nvos21_status", "nvos64_size", "nvos64_status"),
    [
        ("515.43.04", 24, 40, 32),
        ("520.56.06", 24, 40, 32),
        ("525.47.04", 24, 40, 36),
        ("530.30.02", 24, 40, 36),
        ("531.99", 24, 40, 36),  # between 530 and 535: the older tag's layout
        ("535.43.02", 28, 48, 40),
        ("550.54.15", 28, 48, 40),
        ("595.45.04", 28, 48, 40),
        ("610.1", 28, 48, 40),  # newer than the tables: the baseline
        ("470.82.01", 28, 48, 40),  # older than the tables: the baseline too
        (None, 28, 48, 40),
        ("", 28, 48, 40),
        ("not-a-version", 28, 48, 40),
    ],
)
def test_rm_alloc_layout(version: str | None, nvos21_status: int, nvos64_size: int,
                         nvos64_status: int) -> None:
    assert rm_alloc_layout(version) == {"GG_NVOS21_STATUS": nvos21_status, "GG_NVOS64_SIZE": nvos64_size,
                                        "GG_NVOS64_STATUS": nvos64_status}
    flags = build_cflags(("/dev/nvidia",), driver_version=version)
    assert f"-DGG_NVOS21_STATUS={nvos21_status}" in flags and f"-DGG_NVOS64_SIZE={nvos64_size}" in flags
    assert f"-DGG_NVOS64_STATUS={nvos64_status}" in flags


def test_memory_maps_are_bounded() -> None:
    flags = build_cflags(("/dev/nvidia",), max_fds=1024)
    assert "-DGG_MAX_MEM_INFLIGHT=4096" in flags and "-DGG_MAX_MEM_CLIENTS=256" in flags


# --- the class bits the kernel reads ------------------------------------------------------------

@pytest.mark.parametrize(
    ("h_class", "bits", "category"),
    [
        (0x0040, ClassBit.MEM_PARAMS, Category.MEMORY),  # NV01_MEMORY_LOCAL_USER
        (0x003E, ClassBit.MEM_PARAMS, Category.MEMORY),  # NV01_MEMORY_SYSTEM
        (0x003F, 0, Category.MEMORY),  # NV01_MEMORY_LOCAL_PRIVILEGED: RS_NONE, no parameters
        (0x0080, ClassBit.INSTANCE, Category.QUERY),  # NV01_DEVICE_0
        (0x2080, ClassBit.INSTANCE, Category.QUERY),  # NV20_SUBDEVICE_0
        (0x0041, ClassBit.CLIENT, Category.QUERY),  # NV01_ROOT_CLIENT
        (0x0000, ClassBit.CLIENT, Category.QUERY),  # NV01_ROOT
        (0x0001, ClassBit.CLIENT, Category.QUERY),  # NV01_ROOT_NON_PRIV
        (0x90F1, 0, Category.MEMORY),  # FERMI_VASPACE_A: a VA reservation, no size to read
        (0x0070, 0, Category.MEMORY),  # NV01_MEMORY_VIRTUAL
        (0xCBC0, 0, Category.ENGINE),
        (0x402C, 0, Category.UNKNOWN),
    ],
)
def test_class_bits_ride_above_the_category(h_class: int, bits: int, category: Category) -> None:
    table = category_table()
    assert class_bits(h_class) == bits
    assert table[h_class] == bits | category
    assert table[h_class] & CATEGORY_MASK == gpu_work.category_of(h_class)


# --- client fds: noted from the records, dropped at CLOSE or forget -------------------------------

@pytest.fixture
def source(monkeypatch: pytest.MonkeyPatch) -> tuple[BpfSource, fake_kmaps.FakeKernel]:
    monkeypatch.setitem(fake_kmaps.TYPES, "mem_clients", (fake_kmaps.FdKey, ctypes.c_uint32))
    tables, kernel = fake_kmaps.fake_tables()
    src = BpfSource(("/dev/nvidia",))
    src.tables = tables
    return src, kernel


def test_take_memcalls_hands_out_each_call_once_in_order(source: tuple[BpfSource, Any]) -> None:
    src, _ = source
    records = [memcall(1, h_root=0, h_object=0xC1D00001, h_class=0x41), memcall(5, h_object=0xC1D00005),
               memcall(8), memcall(7, fd=7)]
    for data in records:
        src._take_memcall(data)
    assert [c.kind for c in src.take_memcalls()] == [K.ALLOC, K.FREE, K.CLOSE]
    assert src.take_memcalls() == []


def test_a_client_fd_is_indexed_until_its_close(source: tuple[BpfSource, Any]) -> None:
    src, kernel = source
    tables = src.tables
    src._take_memcall(memcall(1, tgid=300, fd=7, h_class=0x41))
    src._take_memcall(memcall(1, tgid=300, fd=8, h_class=0x40))  # memory: not a client
    assert tables.owned[300].clients == {7}
    src._take_memcall(memcall(7, tgid=300, fd=7))
    assert tables.owned[300].clients == set()
    # forget() deletes what the kernel still keeps for a process whose CLOSE never came (its exit)
    src._take_memcall(memcall(1, tgid=300, fd=9, h_class=0x41))
    key = fake_kmaps.FdKey(300, 9)
    kernel.put("mem_clients", key, ctypes.c_uint32(1))
    src.forget(300)
    assert kernel.get("mem_clients", key) is None


def test_sweep_removes_client_fds_of_the_dead(source: tuple[BpfSource, Any]) -> None:
    src, kernel = source
    key = fake_kmaps.FdKey(777, 4)  # never indexed: its record was lost
    kernel.put("mem_clients", key, ctypes.c_uint32(1))
    assert src.sweep(lambda pid: False) == 0  # dead once: kept for the EXIT still in flight
    assert src.sweep(lambda pid: False) >= 1
    assert kernel.get("mem_clients", key) is None


def test_memcall_struct_packs_like_the_c_struct() -> None:
    # u64 size at byte 56: 8-aligned after fourteen 4-byte fields (no implicit padding in C)
    offsets = struct.calcsize("=QQIIIiIIIIII")
    assert offsets == 56
