"""What a holder asked the driver for: the categories of RM classes, and `GpuWork` from the kernel's
always-on allocation record (bpf/alloc.bpf.c).

A monitoring client (nvidia-smi, nvitop, gpustat, dcgm-exporter) opens /dev/nvidiaN and nvidiactl
to read the GPU's state: it allocates an RM client, a device, a subdevice, events, and runs
controls. A GPU job also allocates memory, a VA space, channels and compute/copy engines. The
kernel records, per tgid, which categories of class its allocation calls named (NV_ESC_RM_ALLOC,
also inside NV_ESC_IOCTL_XFER_CMD, RM_ALLOC_OBJECT, RM_ALLOC_MEMORY, RM_VID_HEAP_CONTROL's
ALLOC_SIZE and ALLOC_OS_DESCRIPTOR) and the first work call; this module says what each class is,
pushes that to the kernel as a 64 KiB table (`category_table()`), and turns a record into the
`GpuWork` tracer/classify.py judges.

Completeness (`GpuWork.complete`): the record covers a holder's whole life only if the kernel saw
every device it holds being opened (each DeviceHold's source is "bpf"). A holder the /proc scan
found alone (opened before the tracer started, or with BPF off) has no history: `gpu_work` None.
One with a hold the kernel never saw opened (an fd received over a unix socket, a relative-path
open) is incomplete: the calls on that fd before the scan seeded it went unseen. A fork child
starts with its parent's record (the kernel copies it at fork, before the child runs): it shares
the parent's fds and the RM objects allocated through them. Its own calls on the inherited fds are
seen once user space has seeded them (the FORK rescan, milliseconds after the fork); calls in that
window are the one gap, the same one the ioctl counters have, and a job would also have to map no
device memory to pass for a monitor. An exec keeps the record: RM objects on fds kept across exec
stay. A record outlives its process until the EXIT is handled (or the sweep), so a reused pid may
read as having allocated: the error is on the side that alerts.

Classes (docs/reference/nvidia-ioctl-abi.md §8, from the open driver's
src/common/sdk/nvidia/inc/class/clXXXX.h and nvos.h). An id the tables do not name takes its
family's category by its low byte (§8: ...6F GPFIFO channels, ...61 usermode doorbells, ...C0
compute, ...B5 copy, ...97 3D); any other unnamed id is UNKNOWN and not work: an NVML client
allocates query classes this table does not list (display, I2C, GSYNC, timers), while GPU work
cannot happen without the memory, VA space, channel and engine classes the table and the families
cover.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import IntEnum

from ghostgpu.tracer.call_decode import HEAP_FUNCTIONS
from ghostgpu.tracer.events import GpuWork, Holder
from ghostgpu.tracer.ioctl_decode import NV_ESCAPES
from ghostgpu.tracer.nvabi_names import RM_CLASS_NAMES


class Category(IntEnum):
    """bpf/alloc.bpf.c GG_AC_*: from MEMORY up a call is work."""

    UNSET = 0  # the kernel's class table was not written: nothing can be judged
    QUERY = 1
    OTHER = 2
    UNKNOWN = 3
    MEMORY = 4
    CHANNEL = 5
    ENGINE = 6


WORK = frozenset({Category.MEMORY, Category.CHANNEL, Category.ENGINE})
CLASS_IDS = 1 << 16  # every RM class id fits 16 bits; the kernel calls a larger hClass UNKNOWN

# Every class of RM_CLASS_NAMES, by category (tests/unit/test_gpu_work.py checks none is missing).
CATEGORY_CLASSES: dict[Category, tuple[int, ...]] = {
    # What an NVML client allocates to read state: clients (NV01_ROOT* turns into 0x41, §3.1),
    # device, subdevice, events, GPU management, the shared read-only data page, the master
    # subdevice, the MIG monitor session.
    Category.QUERY: (0x0000, 0x0001, 0x0041, 0x0005, 0x0078, 0x0079, 0x007E, 0x0020, 0x0080, 0x2080,
                     0x00DE, 0x90E6, 0xC640),
    # Known, but neither reading nor work: context DMAs over existing memory, P2P objects,
    # debugger and profilers (DCGM's profiling metrics use them), fault and counter buffers, the
    # MIG references a process subscribes to, confidential computing, IMEX sessions, encoder and
    # frame-capture session bookkeeping (their engines need channels), ZBC table entries.
    Category.OTHER: (0x0002, 0x00F1, 0x208F, 0x503B, 0x503C, 0x83DE, 0x844C, 0x9096, 0x90CC, 0x90CD,
                     0xA0BC, 0xA0BD, 0xB1CC, 0xB2CC, 0xC365, 0xC369, 0xC637, 0xC638, 0xC639, 0xC763,
                     0xCB33, 0xCBCA),
    # NV01_MEMORY_*, semaphore surfaces, export, fabric and mapper objects, virtual memory and
    # VA spaces (NV50_MEMORY_VIRTUAL, FERMI_VASPACE_A).
    Category.MEMORY: (0x003E, 0x003F, 0x0040, 0x0070, 0x0071, 0x00C2, 0x00DA, 0x00E0, 0x00F8, 0x00F9,
                      0x00FB, 0x00FD, 0x00FE, 0x50A0, 0x90CE, 0x90F1),
    # Channel groups, context shares, GPFIFO channels, usermode doorbell pages.
    Category.CHANNEL: (0x9067, 0xA06C, 0xA06F, 0xB06F, 0xC06F, 0xC36F, 0xC46F, 0xC56F, 0xC86F, 0xC96F,
                       0xCA6F, 0xC361, 0xC461, 0xC561, 0xC661, 0xC761),
    # Compute, copy, 3D, inline-to-memory and software engine classes bound to a channel, MPS.
    Category.ENGINE: (0xC3C0, 0xC5C0, 0xC6C0, 0xC7C0, 0xC9C0, 0xCBC0, 0xCDC0, 0xCEC0, 0xC0B5, 0xC3B5,
                      0xC5B5, 0xC6B5, 0xC7B5, 0xC8B5, 0xC9B5, 0xCAB5, 0xC597, 0xC697, 0xC997, 0xCB97,
                      0xCD97, 0xCE97, 0xA140, 0xCD40, 0xC076, 0xCBA2, 0x5080, 0x900E),
}
CLASS_CATEGORY: dict[int, Category] = {cls: cat for cat, ids in CATEGORY_CLASSES.items() for cls in ids}
# §8 families by the low byte, for ids the tables do not name (Fermi's 0x906F, a future 0xCFC0).
FAMILY_FROM = 0x5000  # below, the low byte names no family (0x00C2 is memory, not compute)
FAMILIES: dict[int, Category] = {0x6F: Category.CHANNEL, 0x61: Category.CHANNEL, 0xC0: Category.ENGINE,
                                 0xB5: Category.ENGINE, 0x97: Category.ENGINE}

# Escapes the kernel takes (bpf/alloc.bpf.c GG_ESC_*; tests check both against ioctl_decode).
ESC_RM_ALLOC_MEMORY, ESC_RM_ALLOC_OBJECT, ESC_RM_ALLOC, ESC_RM_VID_HEAP_CONTROL = 0x27, 0x28, 0x2B, 0x4A
HEAP_ALLOC_FUNCTIONS = (2, 27)  # NVOS32_FUNCTION_ALLOC_SIZE, _ALLOC_OS_DESCRIPTOR (nvos.h)

ALLOC = struct.Struct("=QII8B")  # struct gg_alloc_val, 24 bytes


def category_of(h_class: int) -> Category:
    """The category of RM class id `h_class`: named, else by family, else UNKNOWN."""
    if not 0 <= h_class < CLASS_IDS:
        return Category.UNKNOWN
    named = CLASS_CATEGORY.get(h_class)
    if named is not None:
        return named
    if h_class >= FAMILY_FROM:
        return FAMILIES.get(h_class & 0xFF, Category.UNKNOWN)
    return Category.UNKNOWN


class ClassBit(IntEnum):
    """bpf/alloc.bpf.c GG_CB_*: bits above the category in a class's byte, saying what the kernel
    reads from RM_ALLOC's pAllocParms after an accepted call (docs/reference/nvidia-ioctl-abi.md
    §4.1). The kernel holds no class list: these sets are the only one."""

    MEM_PARAMS = 0x08  # NV_MEMORY_ALLOCATION_PARAMS (nvos.h): attr@24, size@64 (u64), written back
    INSTANCE = 0x10  # u32 @0: NV0080_ALLOC_PARAMETERS.deviceId, NV2080_ALLOC_PARAMETERS.subDeviceId
    CLIENT = 0x20  # an RM client: the file it was allocated through owns it (CLOSE frees it)


CATEGORY_MASK = 0x07  # GG_CATEGORY_MASK
CLASS_BITS: dict[ClassBit, tuple[int, ...]] = {
    # NV01_MEMORY_SYSTEM (cl003e.h) and NV01_MEMORY_LOCAL_USER (cl0040.h): their allocation
    # parameters are NV_MEMORY_ALLOCATION_PARAMS. NV01_MEMORY_LOCAL_PRIVILEGED (0x3F) takes none
    # (RS_NONE in src/nvidia/src/kernel/rmapi/resource_list.h), so there is nothing to read.
    ClassBit.MEM_PARAMS: (0x003E, 0x0040),
    ClassBit.INSTANCE: (0x0080, 0x2080),  # NV01_DEVICE_0 (cl0080.h), NV20_SUBDEVICE_0 (cl2080.h)
    # NV01_ROOT, NV01_ROOT_NON_PRIV and NV01_ROOT_CLIENT; RM writes every one back as 0x41 (§3.1).
    ClassBit.CLIENT: (0x0000, 0x0001, 0x0041),
}


def class_bits(h_class: int) -> int:
    """The GG_CB_* bits of RM class id `h_class` (0 for most)."""
    return sum(int(bit) for bit, ids in CLASS_BITS.items() if h_class in ids)


def category_table() -> bytes:
    """The kernel's alloc_classes map: one byte per class id, 256 pages of 256: the category in the
    low bits (CATEGORY_MASK), the ClassBit bits above."""
    table = bytearray(category_of(cls) for cls in range(CLASS_IDS))
    for bit, ids in CLASS_BITS.items():
        for cls in ids:
            table[cls] |= bit
    return bytes(table)


@dataclass(frozen=True)
class AllocRecord:
    """One tgid's entry of the kernel's alloc_work map."""

    first_nr: int  # escape nr of the first work call; 0: none yet
    first_value: int  # its hClass (RM_VID_HEAP_CONTROL: the NVOS32 function)
    calls: int  # allocation calls seen, of every category
    from_tgid: int  # != 0: copied from this parent at fork
    seen: frozenset[Category]

    @property
    def allocated(self) -> bool:
        return self.first_nr != 0 or bool(self.seen & WORK)


def unpack_alloc(raw: bytes) -> AllocRecord:
    first, calls, from_tgid, *seen = ALLOC.unpack_from(raw)
    cats = frozenset(Category(i) for i, flag in enumerate(seen) if flag and i in Category._value2member_map_)
    return AllocRecord(first >> 32, first & 0xFFFFFFFF, calls, from_tgid, cats)


def describe(nr: int, value: int) -> str:
    """A work call as the trace decoder names it: "RM_ALLOC AMPERE_COMPUTE_A (0xc6c0)"."""
    call = NV_ESCAPES.get(nr, f"escape {nr:#x}").removeprefix("NV_ESC_")
    if nr == ESC_RM_VID_HEAP_CONTROL:
        return f"{call} {HEAP_FUNCTIONS.get(value, str(value))}"
    name = RM_CLASS_NAMES.get(value)
    return f"{call} {name} ({value:#x})" if name else f"{call} class {value:#x}"


def judge(sources: Iterable[str], record: AllocRecord | None, records_lost: bool) -> GpuWork | None:
    """A holder's GpuWork from who saw its holds first ("bpf" | "procfs") and its kernel record.

    None when no hold was seen opened by the kernel (no call history at all). records_lost: the
    kernel failed to keep some tgid's record (alloc_work full), so a missing one proves nothing."""
    seen_by = set(sources)
    if "bpf" not in seen_by:
        return None
    complete = (seen_by == {"bpf"} and (record is not None or not records_lost)
                and (record is None or Category.UNSET not in record.seen))
    if record is None or not record.allocated:
        return GpuWork(allocated=False, what="", complete=complete)
    what = describe(record.first_nr, record.first_value) if record.first_nr else "an allocation call"
    if record.from_tgid:
        what += f", inherited from pid {record.from_tgid} at fork"
    return GpuWork(allocated=True, what=what, complete=complete)


def fill(holders: Iterable[Holder], read: Callable[[int], AllocRecord | None],
         records_lost: Callable[[], bool]) -> None:
    """Set each holder's gpu_work (one map lookup per holder the kernel saw open a device; the
    lost-records counter is read at most once, and only for a holder without a record)."""
    lost: bool | None = None
    for holder in holders:
        sources = {hold.source for hold in holder.holds.values()}
        if "bpf" not in sources:
            holder.gpu_work = None
            continue
        record = read(holder.pid)
        if record is None and lost is None:
            lost = records_lost()
        holder.gpu_work = judge(sources, record, bool(lost))
