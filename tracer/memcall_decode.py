"""A recording of driver calls (bench/nvrecord.c) -> the MemCalls the kernel side would have emitted.

One recorded ioctl on an NVIDIA device holds the request word, the return value, the parameter
block before and after the call, for NV_ESC_IOCTL_XFER_CMD the block it carries (before and
after), and the block a pointer in it names (RM_ALLOC's pAllocParms, RM_CONTROL's params). From
that, `decode_ioctl` applies exactly the rules of the kernel side (bpf/alloc.bpf.c, decoded by
tracer/bpf_source.py), so that a recording made on a real driver checks them and the accountant
(tracer/gpu_memory.py) against NVML without BPF:

- only a call the driver accepted counts: the ioctl returned 0 and the block's NV_STATUS is NV_OK
  (docs/reference/nvidia-ioctl-abi.md §1 step 5: on -EINVAL the status was never written). That
  also drops NV_ESC_RM_ALLOC_MEMORY's -EINVAL after an RM success (the mmap context could not be
  attached): the kernel side counts only ret == 0 too;
- the status offset of each block comes from tracer/nvabi.py for the driver version (§5: NVOS21's
  moved without its size changing), the block size from the request word or the XFER `size`;
- handles, classes and sizes are read from the blocks AFTER the call: RM picks hObjectNew when 0
  was passed, a client's hClass comes back as 0x41 (§3.1), and RM writes back the size it really
  allocated (NV_MEMORY_ALLOCATION_PARAMS.size, NVOS32 AllocSize.size);
- which classes have their pAllocParms read, and which are clients, is tracer/gpu_work.py
  CLASS_BITS: the same table the kernel side is given.

`RecordingDecoder` adds the one rule that needs memory across calls: a close of an fd through
which a client was accepted is a CLOSE (RM frees the clients of the file when it is released).
Pure: no I/O; bench/gpu_real_decode.py reads the file.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ghostgpu.tracer.gpu_work import ClassBit, class_bits
from ghostgpu.tracer.memcalls import MemCall, MemCallKind
from ghostgpu.tracer.nvabi import (
    BASELINE,
    IOC_SIZE_MASK,
    NO_STATUS,
    RM_BLOCKS,
    RM_TAGS,
    XFER_NR,
    bracket,
    covers,
    layout_at,
)

NV_IOCTL_TYPE = 0x46  # 'F', NV_IOCTL_MAGIC (kernel-open/common/inc/nv-ioctl-numbers.h)
NV_OK = 0

# Escape numbers (src/nvidia/arch/nvalloc/unix/include/nv_escape.h, docs/reference §2).
ESC_RM_ALLOC_MEMORY = 0x27
ESC_RM_ALLOC_OBJECT = 0x28
ESC_RM_FREE = 0x29
ESC_RM_CONTROL = 0x2A
ESC_RM_ALLOC = 0x2B
ESC_RM_DUP_OBJECT = 0x34
ESC_RM_VID_HEAP_CONTROL = 0x4A
ESC_CARD_INFO = 0xC8
MEMORY_ESCAPES = frozenset({ESC_RM_ALLOC_MEMORY, ESC_RM_ALLOC_OBJECT, ESC_RM_FREE, ESC_RM_ALLOC,
                            ESC_RM_DUP_OBJECT, ESC_RM_VID_HEAP_CONTROL})

# NVOS32_FUNCTION_* (src/common/sdk/nvidia/inc/nvos.h): the two the kernel side stashes.
HEAP_ALLOC_SIZE = 2
HEAP_FREE = 3
# NVOS32_PARAMETERS.data sits @40 (§3.5); AllocSize: hMemory@4, attr@16, size@48 (u64); Free:
# hMemory@4 (nvos.h, compiled offsets) -> absolute offsets in the 184-byte block.
HEAP_HMEMORY_AT = 44
HEAP_FLAGS_AT = 52
HEAP_ATTR_AT = 56
HEAP_SIZE_AT = 88
# NVOS32_ALLOC_FLAGS_VIRTUAL (nvos.h) in AllocSize.flags: RM makes an NV50_MEMORY_VIRTUAL object
# (cl50a0.h), a VA reservation with no memory behind it. The HEAP_ALLOC then names that class;
# h_class 0 leaves it to the attr's location (tracer/gpu_memory.py counts()).
NVOS32_ALLOC_FLAGS_VIRTUAL = 0x00080000
NV50_MEMORY_VIRTUAL = 0x50A0

# Which RM_ALLOC classes have what read from pAllocParms after the call, and which are clients:
# tracer/gpu_work.py CLASS_BITS, the one list the kernel side is given too. ClassBit.MEM_PARAMS:
# NV_MEMORY_ALLOCATION_PARAMS (nvos.h, §4.1) attr@24, size@64 (u64); ClassBit.INSTANCE: u32 @0,
# NV0080_ALLOC_PARAMETERS.deviceId (class/cl0080.h) or NV2080_ALLOC_PARAMETERS.subDeviceId
# (class/cl2080.h); ClassBit.CLIENT: NV01_ROOT, NV01_ROOT_NON_PRIV, NV01_ROOT_CLIENT (§3.1).
MEMORY_PARAMS_ATTR_AT = 24
MEMORY_PARAMS_SIZE_AT = 64

# NV0000_CTRL_CMD_GPU_GET_ID_INFO (0x202, 40 bytes) and _V2 (0x205, 32 bytes), both in
# ctrl/ctrl0000/ctrl0000gpu.h (§7): gpuId@0 in, gpuFlags@4, deviceInstance@8 out in both structs:
# the device instance of an RM GPU id.
CTRL_GPU_GET_ID_INFO = frozenset({0x202, 0x205})
CARD_INFO_BYTES = 72  # nv_ioctl_card_info_t (kernel-open/common/inc/nv-ioctl.h, §4)

StatusOffsets = Mapping[tuple[int, int], int]  # (escape nr, block bytes) -> NV_STATUS offset


class RecordError(ValueError):
    """A recorded call that cannot be read: too short a block, a hex field that is not hex, ..."""


def layout_tag(version: str | None) -> str:
    """The compared driver tag whose layouts apply to `version`: the newest tag at or below it; the
    baseline for a version the tables do not cover or do not know (as tracer/call_decode.py
    layout_for and the kernel side's -D flags do)."""
    version = (version or "").strip()
    return bracket(RM_TAGS, version)[0] if covers(version) else BASELINE


def status_offsets(version: str | None) -> dict[tuple[int, int], int]:
    """(escape nr, block bytes) -> where the NV_STATUS is, for every RM and frontend block that has
    one at the driver `version` (tracer/nvabi.py RM_BLOCKS). A size missing here is a block the
    driver refuses with -EINVAL (nv.c, escape.c), so nothing of it counts."""
    tag = layout_tag(version)
    out: dict[tuple[int, int], int] = {}
    for block in RM_BLOCKS:
        layout = layout_at(block.history, tag)
        if layout is not None and layout.status != NO_STATUS:
            out[(block.nr, layout.size)] = layout.status
    return out


@dataclass(frozen=True, slots=True)
class RecordedIoctl:
    """One ioctl on an NVIDIA device file, as bench/nvrecord.c writes it."""

    ts_ns: int  # CLOCK_BOOTTIME at the call's entry, as the kernel side stamps it
    pid: int
    fd: int
    request: int
    ret: int  # the libc return: 0, or -1 with errno
    before: bytes = b""
    after: bytes = b""
    inner_before: bytes | None = None  # XFER: the block at nv_ioctl_xfer_t.ptr
    inner_after: bytes | None = None
    params_before: bytes | None = None  # RM_ALLOC: pAllocParms; RM_CONTROL: params
    params_after: bytes | None = None


@dataclass(frozen=True, slots=True)
class RecordedClose:
    """A close (or a dup2/dup3 over) of an fd on an NVIDIA device file."""

    ts_ns: int
    pid: int
    fd: int


def _u32(block: bytes, off: int) -> int:
    return int(struct.unpack_from("<I", block, off)[0])


def _u64(block: bytes, off: int) -> int:
    return int(struct.unpack_from("<Q", block, off)[0])


def carried(rec: RecordedIoctl) -> tuple[int, int, bytes | None] | None:
    """(escape nr, block bytes, block after the call) of an 'F' request, through XFER when it is
    one (§1 step 3: the inner `cmd` is a bare nr, `size` the real block size); None for another
    ioctl family (UVM numbers, ...)."""
    request = rec.request
    if (request >> 8) & 0xFF != NV_IOCTL_TYPE:
        return None
    nr, size = request & 0xFF, (request >> 16) & IOC_SIZE_MASK
    if nr != XFER_NR:
        return nr, size, rec.after
    if len(rec.after) < 16:
        raise RecordError(f"XFER call at {rec.ts_ns}: its nv_ioctl_xfer_t has {len(rec.after)} of 16 bytes")
    cmd, inner_size = struct.unpack_from("<II", rec.after, 0)
    return cmd & 0xFF, inner_size, rec.inner_after


def decode_ioctl(rec: RecordedIoctl, offsets: StatusOffsets) -> MemCall | None:
    """The MemCall the kernel side emits for this call, or None: not a memory escape, refused by
    the kernel (ret != 0, or a block size the driver does not take) or by RM (status != NV_OK), or
    a VID_HEAP_CONTROL function that neither allocates by size nor frees."""
    if rec.ret != 0:
        return None
    found = carried(rec)
    if found is None:
        return None
    nr, size, block = found
    if nr not in MEMORY_ESCAPES:
        return None
    status_at = offsets.get((nr, size))
    if status_at is None:
        return None
    if block is None or len(block) < size:
        raise RecordError(f"escape 0x{nr:02X} at {rec.ts_ns}: the recording holds "
                          f"{0 if block is None else len(block)} of its {size} bytes after the call")
    if _u32(block, status_at) != NV_OK:
        return None
    h_root, h_parent, h_object = struct.unpack_from("<III", block, 0)
    base = {"ts_ns": rec.ts_ns, "pid": rec.pid, "fd": rec.fd, "h_root": h_root, "h_parent": h_parent}
    if nr in (ESC_RM_ALLOC, ESC_RM_ALLOC_OBJECT):
        return _alloc(rec, nr, block, base)
    if nr == ESC_RM_ALLOC_MEMORY:  # NVOS02: flags@16 (as the kernel side passes them), limit@32
        return MemCall(MemCallKind.ALLOC_MEMORY, h_object=h_object, h_class=_u32(block, 12),
                       attr=_u32(block, 16), size_bytes=_u64(block, 32) + 1, **base)
    if nr == ESC_RM_FREE:  # NVOS00: hObjectOld@8
        return MemCall(MemCallKind.FREE, h_object=h_object, **base)
    if nr == ESC_RM_DUP_OBJECT:  # NVOS55: hObject@8 (new), hClientSrc@12, hObjectSrc@16
        return MemCall(MemCallKind.DUP, h_object=h_object, src_client=_u32(block, 12),
                       src_object=_u32(block, 16), **base)
    function = _u32(block, 8)  # VID_HEAP_CONTROL: NVOS32 function@8
    if function == HEAP_ALLOC_SIZE:
        virtual = _u32(block, HEAP_FLAGS_AT) & NVOS32_ALLOC_FLAGS_VIRTUAL
        return MemCall(MemCallKind.HEAP_ALLOC, h_object=_u32(block, HEAP_HMEMORY_AT),
                       h_class=NV50_MEMORY_VIRTUAL if virtual else 0,
                       attr=_u32(block, HEAP_ATTR_AT), size_bytes=_u64(block, HEAP_SIZE_AT), **base)
    if function == HEAP_FREE:
        return MemCall(MemCallKind.HEAP_FREE, h_object=_u32(block, HEAP_HMEMORY_AT), **base)
    return None


def _alloc(rec: RecordedIoctl, nr: int, block: bytes, base: dict[str, int]) -> MemCall:
    """RM_ALLOC (NVOS21/NVOS64) or RM_ALLOC_OBJECT (NVOS05): hObjectNew@8 and hClass@12 as the
    driver wrote them back; for RM_ALLOC, what the class's allocation parameters say after it. A
    pAllocParms the recording could not read leaves the size 0 and the instance unknown, as a
    failed user read does in the kernel side (the accountant says the figure is incomplete)."""
    h_class = _u32(block, 12)
    size_bytes = attr = 0
    instance: int | None = None
    bits = class_bits(h_class) if nr == ESC_RM_ALLOC else 0
    params = rec.params_after or b""
    if bits & ClassBit.MEM_PARAMS and len(params) >= MEMORY_PARAMS_SIZE_AT + 8:
        size_bytes = _u64(params, MEMORY_PARAMS_SIZE_AT)
        attr = _u32(params, MEMORY_PARAMS_ATTR_AT)
    if bits & ClassBit.INSTANCE and len(params) >= 4:
        instance = _u32(params, 0)
    return MemCall(MemCallKind.ALLOC, h_object=_u32(block, 8), h_class=h_class, size_bytes=size_bytes,
                   attr=attr, instance=instance, **base)


def params_unread(rec: RecordedIoctl, call: MemCall) -> bool:
    """Whether an accepted RM_ALLOC needed pAllocParms that the recording does not hold."""
    found = carried(rec)
    if found is None or found[0] != ESC_RM_ALLOC:
        return False
    bits = class_bits(call.h_class)
    need = MEMORY_PARAMS_SIZE_AT + 8 if bits & ClassBit.MEM_PARAMS else 4 if bits & ClassBit.INSTANCE else 0
    return len(rec.params_after or b"") < need


class RecordingDecoder:
    """Feeds a recording's calls in order and hands back the MemCalls, CLOSE included.

    A CLOSE comes for a (pid, fd) through which a client was accepted, once, like the kernel
    side's bounded set of such fds: a fork child's close of an inherited fd is none (the client
    belongs to the open file, which the parent still holds)."""

    def __init__(self, driver_version: str | None) -> None:
        self.offsets = status_offsets(driver_version)
        self._client_fds: set[tuple[int, int]] = set()
        self.params_unread = 0  # accepted RM_ALLOCs whose pAllocParms the recording lacks

    def feed(self, rec: RecordedIoctl | RecordedClose) -> MemCall | None:
        if isinstance(rec, RecordedClose):
            if (rec.pid, rec.fd) not in self._client_fds:
                return None
            self._client_fds.discard((rec.pid, rec.fd))
            return MemCall(MemCallKind.CLOSE, ts_ns=rec.ts_ns, pid=rec.pid, fd=rec.fd, h_root=0, h_parent=0,
                           h_object=0)
        call = decode_ioctl(rec, self.offsets)
        if call is None:
            return None
        if params_unread(rec, call):
            self.params_unread += 1
        found = carried(rec)
        if found is not None and found[0] == ESC_RM_ALLOC and class_bits(call.h_class) & ClassBit.CLIENT:
            self._client_fds.add((call.pid, call.fd))
        return call


def _hex(obj: Mapping[str, Any], key: str) -> bytes | None:
    value = obj.get(key)
    if value is None:
        return None
    try:
        return bytes.fromhex(str(value))
    except ValueError:
        raise RecordError(f"recording field {key!r} is not hex: {str(value)[:40]!r}") from None


def _int(obj: Mapping[str, Any], key: str) -> int:
    value = obj.get(key)
    try:
        return int(value, 0) if isinstance(value, str) else int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise RecordError(f"recording field {key!r} must be an integer, got {value!r}") from None


def parse_record(obj: Mapping[str, Any]) -> RecordedIoctl | RecordedClose | None:
    """One JSON line of bench/nvrecord.c -> a recorded call; None for the lines that are none
    (`start`, `open`). Keys: ev ("ioctl" | "close"), ts_ns, pid, fd; ioctl: req, ret, and hex
    blocks before/after, xfer_before/xfer_after, ptr_before/ptr_after."""
    event = obj.get("ev")
    if event == "close":
        return RecordedClose(_int(obj, "ts_ns"), _int(obj, "pid"), _int(obj, "fd"))
    if event != "ioctl":
        return None
    return RecordedIoctl(
        ts_ns=_int(obj, "ts_ns"), pid=_int(obj, "pid"), fd=_int(obj, "fd"), request=_int(obj, "req"),
        ret=_int(obj, "ret"), before=_hex(obj, "before") or b"", after=_hex(obj, "after") or b"",
        inner_before=_hex(obj, "xfer_before"), inner_after=_hex(obj, "xfer_after"),
        params_before=_hex(obj, "ptr_before"), params_after=_hex(obj, "ptr_after"))


@dataclass(frozen=True, slots=True)
class CardInfo:
    """One valid entry of NV_ESC_CARD_INFO's answer (nv_ioctl_card_info_t, §4)."""

    gpu_id: int  # RM's GPU id (@16)
    minor: int  # the N of /dev/nvidiaN (@56)
    pci_bus_id: str  # domain@4, bus@8, slot@9 as NVML writes it: 0000:3b:00.0 (function is left 0)


def card_infos(rec: RecordedIoctl) -> list[CardInfo]:
    """The GPUs a CARD_INFO call that returned 0 listed (entries with valid@0 = 1); [] for any
    other call."""
    found = carried(rec)
    if rec.ret != 0 or found is None or found[0] != ESC_CARD_INFO or found[2] is None:
        return []
    block = found[2]
    out = []
    for off in range(0, len(block) - CARD_INFO_BYTES + 1, CARD_INFO_BYTES):
        if block[off] != 1:
            continue
        domain, bus, slot = _u32(block, off + 4), block[off + 8], block[off + 9]
        out.append(CardInfo(gpu_id=_u32(block, off + 16), minor=_u32(block, off + 56),
                            pci_bus_id=f"{domain:04x}:{bus:02x}:{slot:02x}.0"))
    return out


def gpu_id_instance(rec: RecordedIoctl, offsets: StatusOffsets) -> tuple[int, int] | None:
    """(RM GPU id, device instance) from an accepted NV0000_CTRL_CMD_GPU_GET_ID_INFO(_V2) control
    (NVOS54: cmd@8, status@28; the params gpuId@0, deviceInstance@8); None for any other call."""
    found = carried(rec)
    if rec.ret != 0 or found is None or found[0] != ESC_RM_CONTROL or found[2] is None:
        return None
    nr, size, block = found
    status_at = offsets.get((nr, size))
    if status_at is None or block is None or len(block) < size or _u32(block, 8) not in CTRL_GPU_GET_ID_INFO:
        return None
    params = rec.params_after
    if _u32(block, status_at) != NV_OK or params is None or len(params) < 12:
        return None
    return _u32(params, 0), _u32(params, 8)
