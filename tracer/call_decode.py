"""One traced NVIDIA ioctl, decoded: names and fields from what the kernel captured (docs/TRACE.md).

The kernel keeps the first CAPTURE_MAX bytes of a call's parameter block at entry (for
NV_ESC_IOCTL_XFER_CMD, of the block it carries) and the u32 status at exit, both at the offsets
`DriverLayout.kernel_layouts()` gives it for the running driver. `decode_call` turns such a
capture into names: the escape or UVM call, RM_ALLOC's class, RM_CONTROL's command, the NV_STATUS,
and the block's input fields. A number the tables (tracer/nvabi.py, tracer/nvabi_names.py) do not
know is shown raw, never dropped. Pure functions, except read_driver_version.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ghostgpu.tracer import nvabi
from ghostgpu.tracer.ioctl_decode import (
    NV_ESCAPES,
    NV_IOCTL_MAGIC,
    NV_REMOVED,
    UVM_IOCTLS,
    decode_ioctl,
    ioc_fields,
)
from ghostgpu.tracer.nvabi import BASELINE, NO_STATUS, XFER_NR, Field, Layout
from ghostgpu.tracer.nvabi_names import CONTROL_CLASS_NAMES, NV_STATUS_NAMES, RM_CLASS_NAMES, RM_CONTROLS

__all__ = ["ARRAY_MAX_N", "CAPTURE_MAX", "HEAP_FUNCTIONS", "NO_STATUS", "BlockAt", "DecodedCall",
           "DriverLayout", "IoctlCapture", "decode_call", "effective_request", "iowr", "layout_for",
           "parse_driver_version", "read_driver_version"]

CAPTURE_MAX = 56  # bytes of a parameter block the kernel reads at entry (bpf/trace.bpf.c GG_TRACE_CAPTURE)
# Array escapes (CARD_INFO, ATTACH_GPUS_TO_FD) take any multiple of their element; the kernel table
# lists 1..ARRAY_MAX_N elements. Our bound, not the driver's: a larger array is still named.
ARRAY_MAX_N = 32
EINVAL = 22
_CLASS_FROM = ("NV_ESC_RM_ALLOC", "NV_ESC_RM_ALLOC_OBJECT", "NV_ESC_RM_ALLOC_MEMORY",
               "NV_ESC_RM_ALLOC_CONTEXT_DMA2")  # escapes whose hClass@12 names an RM class
_VERSION_MODES = {0: "STRICT", 0x31: "RELAXED", 0x32: "QUERY"}  # CHECK_VERSION_STR cmd (osapi.c)
HEAP_FUNCTIONS = {2: "ALLOC_SIZE", 3: "FREE", 27: "ALLOC_OS_DESCRIPTOR"}  # NVOS32 function (nvos.h)


@dataclass(frozen=True)
class IoctlCapture:
    """What the kernel captured for one ioctl on a GPU fd."""

    request: int  # u32 request word as called (0xC020462A ...; UVM: a plain number like 0x30000001 or 37)
    device_kind: str  # DeviceKind value of the fd's device: "gpu", "control", "uvm", "mig", "other"
    block: bytes  # the first bytes of the parameter block at entry; for XFER (nr 211) the INNER block
    status: int | None  # the u32 at the layout's status offset at exit; None: no status field or no read
    ret: int  # syscall return value: >= 0, or -errno
    xfer_nr: int | None = None  # XFER: the inner escape nr (the xfer block's `cmd`)
    xfer_size: int | None = None  # XFER: the inner block's size


@dataclass(frozen=True)
class DecodedCall:
    call: str  # "RM_ALLOC", "CARD_INFO", "UVM_REGISTER_GPU", or raw "ioctl(0xc01046ff)"
    escape: str  # "NV_ESC_RM_ALLOC" ("" for UVM/unknown); for XFER the escape it carries
    cmd: int | None  # RM_CONTROL cmd
    cmd_name: str  # "NV2080_CTRL_CMD_GPU_GET_INFO_V2", "" if unknown
    h_class: int | None  # RM_ALLOC / RM_ALLOC_OBJECT / RM_ALLOC_MEMORY / RM_ALLOC_CONTEXT_DMA2 class
    class_name: str  # "NV01_ROOT_CLIENT", "" if unknown
    nv_status: int | None  # NV_STATUS (RM) or rmStatus (UVM)
    nv_status_name: str  # "NV_OK", ...; "" if unknown number
    args: dict[str, str]  # decoded input fields: handles and flags hex, sizes decimal, UUIDs GPU-...
    notes: tuple[str, ...]


class BlockAt(NamedTuple):
    """A block's layout in one driver."""

    name: str  # "NV_ESC_RM_ALLOC", "UVM_FREE"
    struct: str  # the C type; for UVM the call name
    size: int  # bytes (of one element, for an array escape)
    status: int  # offset of the u32 status, or NO_STATUS
    array: bool = False
    unsure: str = ""  # a note when the block changed between the compared tags around the driver

    def fits(self, size: int) -> bool:
        return size == self.size or (self.array and size > 0 and size % self.size == 0)


def iowr(nr: int, size: int) -> int:
    """_IOWR('F', nr, size), the request word of a frontend or RM escape (size masked to 14 bits)."""
    return (3 << 30) | ((size & nvabi.IOC_SIZE_MASK) << 16) | (NV_IOCTL_MAGIC << 8) | (nr & 0xFF)


def _is_xfer(request: int) -> bool:
    _, type_, nr, _ = ioc_fields(request)
    return type_ == NV_IOCTL_MAGIC and nr == XFER_NR


def effective_request(request: int, xfer_nr: int | None = None, xfer_size: int | None = None) -> int:
    """The request word a layout is keyed by: the word itself, or for XFER the _IOWR('F', inner_nr,
    inner_size) word synthesized from the inner nr/size (size masked to 14 bits)."""
    request &= 0xFFFFFFFF
    if xfer_nr is None or not _is_xfer(request):
        return request
    return iowr(xfer_nr, xfer_size or 0)


@dataclass(frozen=True)
class DriverLayout:
    version: str  # the driver version it was chosen for ("" = unknown)
    covered: bool  # False: the version is not in the tables (newest layout used, a note says so)
    rm_tag: str = BASELINE  # the compared tag whose frontend/RM layouts are used
    uvm_tag: str = BASELINE  # the same for UVM (§9.4 compared fewer tags)
    note: str = ""  # added to every decoded call: why the layouts may not be this driver's
    rm: dict[int, tuple[BlockAt, ...]] = field(default_factory=dict, repr=False, compare=False)
    uvm: dict[int, BlockAt] = field(default_factory=dict, repr=False, compare=False)

    def kernel_layouts(self) -> dict[int, tuple[int, int]]:
        """effective request word -> (capture_len, status_off) for every call the tables know for
        this driver: capture_len = min(block size, CAPTURE_MAX) bytes read at entry, status_off =
        byte offset of the u32 status read at exit, or NO_STATUS. Frontend/RM words are _IOWR('F',
        nr, size) (both RM_ALLOC sizes of this version; array escapes at 1..ARRAY_MAX_N elements),
        UVM words the plain numbers. XFER's own word is not listed: the kernel looks up the word of
        the escape it carries."""
        out: dict[int, tuple[int, int]] = {}
        for nr, blocks in self.rm.items():
            if nr == XFER_NR:
                continue
            for block in blocks:
                for n in range(1, (ARRAY_MAX_N if block.array else 1) + 1):
                    out[iowr(nr, block.size * n)] = (min(block.size * n, CAPTURE_MAX), block.status)
        for number, block in self.uvm.items():
            out[number] = (min(block.size, CAPTURE_MAX), block.status)
        return out

    def rm_block(self, nr: int, size: int) -> BlockAt | None:
        """The block escape `nr` carries at `size` bytes (RM_ALLOC: NVOS21 or NVOS64 by size)."""
        return next((b for b in self.rm.get(nr, ()) if b.fits(size)), None)


def _pick(name: str, history: tuple[Layout, ...], base: str, upper: str | None,
          version: str) -> list[tuple[Layout, str]]:
    """The layouts to use for a driver between compared tags `base` and `upper`, each with a note
    when the block changed across that gap (it may or may not have changed in this driver). A block
    that changed size there gets both layouts, the older first: each call's size picks one."""
    old = nvabi.layout_at(history, base)
    if not nvabi.changed_between(history, base, upper):
        return [(old, "")] if old is not None else []
    assert upper is not None
    new = nvabi.layout_at(history, upper)
    picked = [(old, base)] if old is not None else []
    if new is not None and (old is None or new.size != old.size):
        picked.append((new, upper))
    return [(lay, f"{name} changed between {base} and {upper}: driver {version} decoded with the {tag} "
                  "layout") for lay, tag in picked]


def layout_for(driver_version: str | None) -> DriverLayout:
    """The layouts of one driver release; one the tables do not cover gets the newest (595.45.04)."""
    version = (driver_version or "").strip()
    covered = nvabi.covers(version)
    note = ""
    if not covered:
        what = f"driver {version} not covered" if version else "driver version unknown"
        note = f"{what}: decoded with the {BASELINE} layout"
    rm_base, rm_upper = nvabi.bracket(nvabi.RM_TAGS, version) if covered else (BASELINE, None)
    uvm_base, uvm_upper = nvabi.bracket(nvabi.UVM_TAGS, version) if covered else (BASELINE, None)
    rm: dict[int, tuple[BlockAt, ...]] = {}
    for block in nvabi.RM_BLOCKS:
        name = NV_ESCAPES[block.nr]
        for lay, unsure in _pick(name, block.history, rm_base, rm_upper, version):
            at = BlockAt(name, block.struct, lay.size, lay.status, block.array, unsure)
            rm[block.nr] = (*rm.get(block.nr, ()), at)
    uvm: dict[int, BlockAt] = {}
    for number in nvabi.UVM_BLOCKS:  # the number alone is the key: one layout each
        name = UVM_IOCTLS[number]
        picked = _pick(name, nvabi.uvm_history(number), uvm_base, uvm_upper, version)
        if picked:
            (lay, unsure), *_ = picked
            uvm[number] = BlockAt(name, name, lay.size, lay.status, False, unsure)
    return DriverLayout(version, covered, rm_base, uvm_base, note, rm, uvm)


_VERSION_RE = re.compile(r"NVRM version:.*?Kernel Module(?:\s+for\s+\S+)?\s+(\d+(?:\.\d+)+)")


def parse_driver_version(text: str) -> str | None:
    """The version in /proc/driver/nvidia/version's text: proprietary ("NVIDIA UNIX x86_64 Kernel
    Module  550.54.15  Tue Mar  5 ...") or open ("NVIDIA UNIX Open Kernel Module for x86_64
    595.45.04  Release Build ...")."""
    match = _VERSION_RE.search(text)
    return match.group(1) if match else None


def read_driver_version(proc_root: str = "/proc") -> str | None:
    """The driver version from /proc/driver/nvidia/version, None when absent or unreadable."""
    try:
        text = (Path(proc_root) / "driver" / "nvidia" / "version").read_text(errors="replace")
    except OSError:
        return None
    return parse_driver_version(text)


def _read(block: bytes, off: int, size: int) -> int | None:
    """The little-endian unsigned integer at off, None when the block is too short for it."""
    if len(block) < off + size:
        return None
    return int.from_bytes(block[off:off + size], "little")


def _uuid(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _format(f: Field, block: bytes) -> str | None:
    if f.fmt == "str":  # a string is kept as far as it was captured
        return block[f.off:f.off + f.size].split(b"\0", 1)[0].decode("ascii", "replace") \
            if len(block) > f.off else None
    value = _read(block, f.off, f.size)
    if value is None:
        return None
    if f.fmt == "uuid":
        return _uuid(block[f.off:f.off + f.size])
    if f.fmt == "i":
        return str(value - (1 << (8 * f.size)) if value >> (8 * f.size - 1) else value)
    return str(value) if f.fmt == "d" else f"{value:#x}"


def _args(fields: tuple[Field, ...], block: bytes, at: BlockAt | None) -> dict[str, str]:
    """The fields present in the block: those of its layout, all unconditional ones when the layout
    is not known (a size the driver does not take)."""
    shape = (at.size, at.status) if at is not None else None
    out = {}
    for f in fields:
        if f.only and shape not in f.only:
            continue
        text = _format(f, block)
        if text is not None:
            out[f.name] = text
    return out


def _status_notes(name: str, at: BlockAt | None, cap: IoctlCapture) -> tuple[int | None, list[str]]:
    """The status to report, and what to say about it (595.45.04 nv.c, escape.c, uvm.c)."""
    if at is not None and at.status == NO_STATUS:
        return None, []
    if cap.status is None:
        return None, ["status not captured"] if at is not None and cap.ret >= 0 else []
    if cap.ret >= 0:
        return cap.status, []
    if cap.ret == -EINVAL and name == "NV_ESC_RM_LOCKLESS_DIAGNOSTIC":
        return cap.status, ["ret -22 with the status written (LOCKLESS_DIAGNOSTIC does so when not NV_OK)"]
    if cap.ret == -EINVAL and name == "NV_ESC_RM_ALLOC_MEMORY":
        return cap.status, ["ret -22: the status may be RM's (the mmap context could not be attached to fd) "
                            "or not written (the escape refused the call)"]
    return cap.status, [f"status not written by the driver (ret {cap.ret})"]


def _decoded(call: str, escape: str, cap: IoctlCapture, at: BlockAt | None, args: dict[str, str],
             notes: list[str]) -> DecodedCall:
    status, status_notes = _status_notes(escape or call, at, cap)
    notes = notes + status_notes + ([at.unsure] if at is not None and at.unsure else [])
    cmd = h_class = None
    cmd_name = class_name = ""
    if escape == "NV_ESC_RM_CONTROL" and (cmd := _read(cap.block, 8, 4)) is not None:
        cmd_name, want = RM_CONTROLS.get(cmd, ("", 0))
        if not cmd_name:
            cls = CONTROL_CLASS_NAMES.get(cmd >> 16, f"{cmd >> 16:#06x}")
            notes.append(f"control {cmd:#010x} not in the tables (class {cls})")
        elif "paramsSize" in args and int(args["paramsSize"]) != want:
            notes.append(f"paramsSize {args['paramsSize']} is not {want}: RM answers "
                         "NV_ERR_INVALID_PARAM_STRUCT")
    if escape in _CLASS_FROM and (h_class := _read(cap.block, 12, 4)) is not None:
        class_name = RM_CLASS_NAMES.get(h_class, "")
    name = NV_STATUS_NAMES.get(status, "") if status is not None else ""
    return DecodedCall(call, escape, cmd, cmd_name, h_class, class_name, status, name, args, tuple(notes))


def _extras(escape: str, at: BlockAt, size: int, block: bytes, args: dict[str, str]) -> None:
    """Fields that are not a plain read: counts, array contents, enum names."""
    if at.array:
        args["entries"] = str(size // at.size)
    if escape == "NV_ESC_ATTACH_GPUS_TO_FD":
        ids = [_read(block, i, 4) for i in range(0, min(size, len(block)) - 3, 4)]
        args["gpu_ids"] = ",".join(f"{i:#x}" for i in ids if i is not None)
    if escape == "NV_ESC_CHECK_VERSION_STR" and "cmd" in args:
        args["mode"] = _VERSION_MODES.get(int(args["cmd"], 16), "")
    if escape == "NV_ESC_RM_VID_HEAP_CONTROL" and "function" in args:
        args["functionName"] = HEAP_FUNCTIONS.get(int(args["function"]), "")


def _raw(request: int) -> str:
    return f"ioctl({request:#010x})" if request > 0xFFFF else f"ioctl({request:#x})"


def _decode_uvm(cap: IoctlCapture, layout: DriverLayout, notes: list[str]) -> DecodedCall:
    number = cap.request & 0xFFFFFFFF
    name = UVM_IOCTLS.get(number)
    if name is None:
        if number >= nvabi.UVM_TEST_BASE and number < nvabi.UVM_TEST_BASE + 0x100:
            notes.append(f"UVM test ioctl {number - nvabi.UVM_TEST_BASE} (UVM_TEST_IOCTL_BASE(i) = 200 + i)")
        else:
            notes.append(f"UVM number {number} not in the tables")
        return _decoded(_raw(number), "", cap, None, {}, notes)
    at = layout.uvm.get(number)
    if at is None:
        notes.append(f"{name} has no parameter layout for driver {layout.uvm_tag} in the tables")
        return _decoded(name, "", cap, None, {}, notes)
    return _decoded(name, "", cap, at, _args(nvabi.UVM_FIELDS.get(name, ()), cap.block, at), notes)


def decode_call(cap: IoctlCapture, layout: DriverLayout) -> DecodedCall:
    """Names and fields of one captured ioctl, with the layouts of the driver it ran against."""
    notes = [layout.note] if layout.note else []
    request = cap.request & 0xFFFFFFFF
    if "uvm" in cap.device_kind.lower():
        return _decode_uvm(cap, layout, notes)
    _, type_, nr, size = ioc_fields(request)
    if type_ != NV_IOCTL_MAGIC:  # not an NVIDIA escape: another family's name (KFD), else raw
        named = decode_ioctl(request, cap.device_kind)
        return _decoded(named.name if named.known else _raw(request), "", cap, None, {}, notes)
    args: dict[str, str] = {}
    if nr == XFER_NR:
        if cap.xfer_nr is None:
            notes.append("the escape carried by NV_ESC_IOCTL_XFER_CMD was not captured")
            at = layout.rm_block(XFER_NR, size)
            args = _args(nvabi.RM_FIELDS["nv_ioctl_xfer_t"], cap.block, at)
            return _decoded("IOCTL_XFER_CMD", NV_ESCAPES[XFER_NR], cap, at, args, notes)
        request = effective_request(request, cap.xfer_nr, cap.xfer_size)
        nr, size = cap.xfer_nr, cap.xfer_size or 0
        notes.append("via NV_ESC_IOCTL_XFER_CMD")
        args["xfer"] = "1"
    escape = NV_ESCAPES.get(nr)
    if escape is None:
        notes.append(f"escape nr {nr:#x} not in the tables")
        return _decoded(_raw(request), "", cap, None, args, notes)
    call = escape.removeprefix("NV_ESC_")
    blocks = layout.rm.get(nr, ())
    if not blocks:
        gone = " (removed in 595.44.02)" if nr in NV_REMOVED else ""
        notes.append(f"{escape}{gone} has no parameter layout for driver {layout.rm_tag} in the tables")
        return _decoded(call, escape, cap, None, args, notes)
    at = layout.rm_block(nr, size)
    if at is None:
        sizes = " or ".join(str(b.size) for b in blocks)
        notes.append(f"block size {size} is not one {escape} takes in driver {layout.rm_tag} ({sizes})")
    args.update(_args(nvabi.RM_FIELDS.get((at or blocks[0]).struct, ()), cap.block, at))
    if at is not None:
        _extras(escape, at, size, cap.block, args)
    return _decoded(call, escape, cap, at, args, notes)
