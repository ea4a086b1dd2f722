"""Decoding captured ioctls (tracer/call_decode.py) with blocks built at the offsets of
docs/reference/nvidia-ioctl-abi.md (§2 to §5, §9)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from ghostgpu.tracer.call_decode import (
    CAPTURE_MAX,
    NO_STATUS,
    DecodedCall,
    IoctlCapture,
    decode_call,
    effective_request,
    iowr,
    layout_for,
    parse_driver_version,
    read_driver_version,
)
from ghostgpu.tracer.ioctl_decode import NV_ESCAPES, UVM_IOCTLS

V525, V550, V595 = "525.47.04", "550.54.15", "595.45.04"
HC, HD, HO = 0xC1D00001, 0xCAF00002, 0xCAF00003
UUID = bytes.fromhex("5a3b1c0de0f1a2b3c4d5e6f708192a3b")
UUID_S = "GPU-5a3b1c0d-e0f1-a2b3-c4d5-e6f708192a3b"
ENOTTY = -25


def cap(request: int, block: bytes = b"", status: int | None = None, ret: int = 0, kind: str = "control",
        xfer: tuple[int, int] | None = None) -> IoctlCapture:
    """What the kernel hands over: at most CAPTURE_MAX bytes, as the kernel reads them."""
    return IoctlCapture(request, kind, block, status, ret, *(xfer or (None, None)))


def dec(c: IoctlCapture, version: str | None = V595) -> DecodedCall:
    return decode_call(c, layout_for(version))


def nvos21(h_class: int, params_size: int = 0) -> bytes:  # §3.1, 535.43.02 on
    return struct.pack("<IIIIQII", HC, HC, HO, h_class, 0x7FFF0000, params_size, 0)


def nvos64(h_class: int, params_size: int, flags: int) -> bytes:  # §3.1, 48 bytes
    return struct.pack("<IIIIQQIII4x", HC, HC, HO, h_class, 0x7FFF0000, 0, params_size, flags, 0)


# Every escape is named; the call is its name without NV_ESC_.
@pytest.mark.parametrize(("nr", "escape"), sorted(NV_ESCAPES.items()))
def test_every_escape_name(nr: int, escape: str) -> None:
    got = dec(cap(iowr(nr, 16)))
    assert (got.call, got.escape) == (escape.removeprefix("NV_ESC_"), escape)
    assert "via NV_ESC_IOCTL_XFER_CMD" not in got.notes


@pytest.mark.parametrize(("number", "name"), sorted(UVM_IOCTLS.items()))
def test_every_uvm_name(number: int, name: str) -> None:
    got = dec(cap(number, kind="uvm"))
    assert (got.call, got.escape, got.cmd, got.h_class) == (name, "", None, None)


@pytest.mark.parametrize(("nr", "why"), [(0x56, "no parameter layout"), (0x32, "removed in 595.44.02")])
def test_escape_without_block_is_named_and_says_so(nr: int, why: str) -> None:
    got = dec(cap(iowr(nr, 16), b"\1" * 16, status=0))
    assert got.args == {} and any(why in n for n in got.notes)


# RM_ALLOC: the struct by the size, its status offset by the driver version (§3.1, §5.2).
ALLOC_CASES = [
    # version, word, block, kernel layout, args beyond the four handles
    ("515.43.04", 0xC020462B, struct.pack("<IIIIQII", HC, HC, HO, 0x80, 0, 0, 0), (32, 24), {}),
    ("515.43.04", 0xC028462B, struct.pack("<IIIIQQII", HC, HC, HO, 0x80, 0, 0, 0, 0), (40, 32), {}),
    (V525, 0xC020462B, struct.pack("<IIIIQII", HC, HC, HO, 0x80, 0, 0, 0), (32, 24), {}),
    (V525, 0xC028462B, struct.pack("<IIIIQQII", HC, HC, HO, 0x80, 0, 0, 1, 0), (40, 36), {"flags": "0x1"}),
    (V550, 0xC020462B, nvos21(0x80, 56), (32, 28), {"paramsSize": "56"}),
    (V550, 0xC030462B, nvos64(0x80, 56, 1), (48, 40), {"paramsSize": "56", "flags": "0x1"}),
    (V595, 0xC020462B, nvos21(0x80, 56), (32, 28), {"paramsSize": "56"}),
    (V595, 0xC030462B, nvos64(0x80, 56, 0), (48, 40), {"paramsSize": "56", "flags": "0x0"}),
]


@pytest.mark.parametrize(("version", "word", "block", "kernel", "extra"), ALLOC_CASES)
def test_rm_alloc_by_size_and_version(version: str, word: int, block: bytes, kernel: tuple[int, int],
                                      extra: dict[str, str]) -> None:
    layout = layout_for(version)
    assert layout.covered and layout.kernel_layouts()[word] == kernel
    got = decode_call(cap(word, block, status=0), layout)
    assert (got.call, got.h_class, got.class_name, got.nv_status_name) == ("RM_ALLOC", 0x80, "NV01_DEVICE_0",
                                                                            "NV_OK")
    assert got.args == {"hClient": hex(HC), "hParent": hex(HC), "hObject": hex(HO), "hClass": "0x80", **extra}
    assert got.notes == ()


@pytest.mark.parametrize(("version", "present", "absent"), [
    ("515.43.04", {0xC020462B: (32, 24), 0xC028462B: (40, 32)}, [0xC030462B]),
    (V525, {0xC020462B: (32, 24), 0xC028462B: (40, 36)}, [0xC030462B]),
    (V550, {0xC020462B: (32, 28), 0xC030462B: (48, 40)}, [0xC028462B]),
    # NVOS46 56/@48 before 580, 64/@56 from 580.65.06; NVOS47 40/@32 before 550, 48/@40 after.
    ("575.51.02", {0xC0384657: (56, 48), 0xC0304658: (48, 40)}, [0xC0404657, 0xC0284658]),
    ("580.65.06", {0xC0404657: (56, 56), 0xC0304658: (48, 40)}, [0xC0384657]),
    ("545.23.06", {0xC0284658: (40, 32), iowr(0x5F, 4024): (56, 4)}, [0xC00846DA]),
    ("535.43.02", {0xC00846D5: (8, 4), iowr(0xD7, 560): (56, NO_STATUS)},
     [iowr(0x5F, 4024), iowr(0xD7, 552)]),
    (V525, {iowr(0xD9, 2600): (56, 2592), iowr(0xD7, 552): (56, NO_STATUS), 37: (40, 36)}, [75]),
    # UVM_FREE 24/@16 before 590.44.01, 16/@8 from it; UNREGISTER_CHANNEL 28/@24 then 12/@8.
    ("580.142", {34: (24, 16), 28: (28, 24), 75: (8, 4), 80: (32, 24)}, []),
    ("590.44.01", {34: (16, 8), 28: (12, 8), 0x30000001: (16, 8), 0x30000002: (0, NO_STATUS)}, []),
    (V595, {0xC04846C8: (56, NO_STATUS), iowr(0xC8, 72 * 32): (56, NO_STATUS), 0xC00446D4: (4, NO_STATUS),
            0xC00446C9: (4, NO_STATUS), iowr(0xD9, 2608): (56, 2600), 33: (56, 9260)}, [0xC01046D3]),
])
def test_kernel_layouts(version: str, present: dict[int, tuple[int, int]], absent: list[int]) -> None:
    table = layout_for(version).kernel_layouts()
    for word, want in present.items():
        assert table[word] == want, hex(word)
    for word in absent:
        assert word not in table, hex(word)
    assert all(0 <= n <= CAPTURE_MAX for n, _ in table.values())


def test_kernel_layouts_differ_only_where_the_sheet_says() -> None:
    old, new = layout_for("550.163.01").kernel_layouts(), layout_for(V595).kernel_layouts()
    changed = {w for w in old.keys() & new.keys() if old[w] != new[w]} | (old.keys() ^ new.keys())
    # TOOLS_INIT_EVENT_TRACKER (56) grew 56 -> 64 bytes with rmStatus still @48: the same to the kernel.
    assert changed == {0xC0384657, 0xC0404657, iowr(0xD9, 2600), iowr(0xD9, 2608), 34, 28, 64,
                       76, 77, 78, 79, 80}


# XFER (nr 211): decoded as the escape it carries, keyed by the synthesized word.
def test_effective_request() -> None:
    assert effective_request(0xC020462A) == 0xC020462A
    assert effective_request(37, 43, 48) == 37  # not an XFER word
    assert effective_request(0xC01046D3, 0x2B, 48) == 0xC030462B
    assert effective_request(0xC01046D3, 0x5F, 15412) == 0xFC34465F
    assert effective_request(0xC01046D3, 0x2A, 0x4000 + 32) == 0xC020462A  # 14 bits
    assert effective_request(0xC01046D3) == 0xC01046D3


@pytest.mark.parametrize("version", [V525, V550, V595])
def test_xfer_carries_rm_alloc(version: str) -> None:
    size = 40 if version == V525 else 48
    block = nvos64(0x2080, 4, 0)[:size]
    got = dec(cap(0xC01046D3, block, status=0x1F, kind="gpu", xfer=(0x2B, size)), version)
    assert (got.call, got.escape, got.h_class, got.class_name) == ("RM_ALLOC", "NV_ESC_RM_ALLOC", 0x2080,
                                                                   "NV20_SUBDEVICE_0")
    assert (got.nv_status, got.nv_status_name) == (0x1F, "NV_ERR_INVALID_ARGUMENT")
    assert got.args["xfer"] == "1" and got.args["hObject"] == hex(HO)
    assert "via NV_ESC_IOCTL_XFER_CMD" in got.notes
    assert layout_for(version).kernel_layouts()[effective_request(0xC01046D3, 0x2B, size)][0] == size


def test_xfer_unknown_inner_and_uncaptured_inner() -> None:
    got = dec(cap(0xC01046D3, b"", xfer=(0xF0, 8)))
    assert got.call == "ioctl(0xc00846f0)" and got.escape == "" and "via NV_ESC_IOCTL_XFER_CMD" in got.notes
    got = dec(cap(0xC01046D3, struct.pack("<IIQ", 0x4A, 184, 0x7000)))
    assert (got.call, got.escape) == ("IOCTL_XFER_CMD", "NV_ESC_IOCTL_XFER_CMD")
    assert got.args == {"cmd": "74", "size": "184", "ptr": "0x7000"}
    assert any("not captured" in n for n in got.notes)


# Numbers the tables do not know stay numbers.
@pytest.mark.parametrize(("c", "call", "note"), [
    (cap(0xC01046FF, b"\0" * 16), "ioctl(0xc01046ff)", "escape nr 0xff not in the tables"),
    (cap(1000, kind="uvm"), "ioctl(0x3e8)", "UVM number 1000 not in the tables"),
    (cap(205, kind="uvm"), "ioctl(0xcd)", "UVM test ioctl 5"),
    (cap(0xC0084B01, kind="control"), "AMDKFD_IOC_GET_VERSION", None),
    (cap(0xC0086D01, kind="control"), "ioctl(0xc0086d01)", None),
    (cap(0xC020462A, kind="uvm"), "ioctl(0xc020462a)", "UVM number"),
])
def test_unknown_numbers_raw(c: IoctlCapture, call: str, note: str | None) -> None:
    got = dec(c)
    assert got.call == call and got.escape == ""
    assert note is None or any(note in n for n in got.notes)


def test_unknown_control_class_and_status_kept_as_numbers() -> None:
    block = struct.pack("<IIIIQII", HC, HD, 0x2080DEAD, 0, 0, 8, 0)
    got = dec(cap(0xC020462A, block, status=0x8B))
    assert (got.cmd, got.cmd_name, got.nv_status, got.nv_status_name) == (0x2080DEAD, "", 0x8B, "")
    assert "control 0x2080dead not in the tables (class NV20_SUBDEVICE_0)" in got.notes
    got = dec(cap(0xC030462B, nvos64(0xBEEF, 0, 0), status=0))
    assert (got.h_class, got.class_name) == (0xBEEF, "")


def test_size_the_driver_does_not_take() -> None:
    got = dec(cap(0xC030462B, nvos64(0x41, 0, 0), status=0x1F), V525)
    assert got.call == "RM_ALLOC" and got.class_name == "NV01_ROOT_CLIENT"
    assert set(got.args) == {"hClient", "hParent", "hObject", "hClass"}  # the shared head only
    assert any("block size 48 is not one NV_ESC_RM_ALLOC takes in driver 525.47.04 (32 or 40)" in n
               for n in got.notes)


# A driver the tables do not cover: the newest layout, and a note on every call.
@pytest.mark.parametrize(("version", "note"), [
    ("999.1", "driver 999.1 not covered: decoded with the 595.45.04 layout"),
    ("470.82.01", "driver 470.82.01 not covered: decoded with the 595.45.04 layout"),
    ("595.58.03", "driver 595.58.03 not covered: decoded with the 595.45.04 layout"),
    (None, "driver version unknown: decoded with the 595.45.04 layout"),
    ("", "driver version unknown: decoded with the 595.45.04 layout"),
])
def test_uncovered_version(version: str | None, note: str) -> None:
    layout = layout_for(version)
    assert not layout.covered and layout.version == (version or "")
    assert layout.kernel_layouts() == layout_for(V595).kernel_layouts()
    for c in (cap(0xC020462B, nvos21(0x41), status=0), cap(34, b"\0" * 16, status=0, kind="uvm"),
              cap(0xC01046FF)):
        assert note in dec(c, version).notes
    assert dec(cap(0xC020462B, nvos21(0x41), status=0), version).nv_status_name == "NV_OK"


def test_version_between_tags_flags_blocks_that_changed_in_the_gap() -> None:
    layout = layout_for(V550)
    assert (layout.covered, layout.rm_tag, layout.uvm_tag) == (True, "550.40.07", "550.40.07")
    got = dec(cap(33, struct.pack("<QQQ", 0x7F0000000000, 1 << 21, 0), status=0, kind="uvm"), V550)
    assert got.args == {"base": "0x7f0000000000", "length": "2097152", "offset": "0x0"}
    assert ("UVM_MAP_EXTERNAL_ALLOCATION changed between 550.40.07 and 550.163.01: driver 550.54.15 "
            "decoded with the 550.40.07 layout") in got.notes
    assert layout.kernel_layouts()[33] == (56, 1196)
    assert dec(cap(37, UUID + bytes(24), status=0, kind="uvm"), V550).notes == ()
    # Appearing in the gap: captured with the layout it has where it first shows; a size change in
    # the gap: both sizes (each call's size picks one).
    assert layout_for("540.1").kernel_layouts()[iowr(0x5F, 4024)] == (56, 4)
    table = layout_for("532.1").kernel_layouts()
    assert (table[0xC020462B], table[0xC028462B], table[0xC030462B]) == ((32, 24), (40, 36), (48, 40))
    got = dec(cap(0xC030462B, nvos64(0x80, 56, 0), status=0), "532.1")
    assert got.args["paramsSize"] == "56" and "decoded with the 535.43.02 layout" in got.notes[0]


# Short blocks: a field the block does not reach is absent.
@pytest.mark.parametrize(("n", "keys"), [
    (0, set()), (3, set()), (4, {"hClient"}), (11, {"hClient", "hObject"}),
    (12, {"hClient", "hObject", "cmd"}), (28, {"hClient", "hObject", "cmd", "flags", "paramsSize"}),
])
def test_short_blocks(n: int, keys: set[str]) -> None:
    block = struct.pack("<IIIIQII", HC, HD, 0x20800102, 0, 0, 564, 0)[:n]
    got = dec(cap(0xC020462A, block, status=0))
    assert set(got.args) == keys
    assert got.cmd == (0x20800102 if n >= 12 else None)
    assert got.cmd_name == ("NV2080_CTRL_CMD_GPU_GET_INFO_V2" if n >= 12 else "")


@pytest.mark.parametrize(("cmd", "name", "size"), [
    (0x00000201, "NV0000_CTRL_CMD_GPU_GET_ATTACHED_IDS", 128),
    (0x00003D05, "NV0000_CTRL_CMD_OS_UNIX_EXPORT_OBJECT_TO_FD", 24),
    (0x00800201, "NV0080_CTRL_CMD_GPU_GET_CLASSLIST", 16), (0x00FD0104, "NV00FD_CTRL_CMD_ATTACH_GPU", 16),
    (0x2080014A, "NV2080_CTRL_CMD_GPU_GET_GID_INFO", 268),
    (0x20803801, "NV2080_CTRL_CMD_GRMGR_GET_GR_FS_INFO", 1928),
    (0xA06C0101, "NVA06C_CTRL_CMD_GPFIFO_SCHEDULE", 3), (0xC6380101, "NVC638_CTRL_CMD_GET_UUID", 57),
])
def test_control_names(cmd: int, name: str, size: int) -> None:
    got = dec(cap(0xC020462A, struct.pack("<IIIIQII", HC, HD, cmd, 0, 0, size, 0), status=0))
    assert (got.cmd, got.cmd_name, got.notes) == (cmd, name, ())
    bad = dec(cap(0xC020462A, struct.pack("<IIIIQII", HC, HD, cmd, 0, 0, size + 1, 0), status=0x3A))
    assert bad.nv_status_name == "NV_ERR_INVALID_PARAM_STRUCT"
    assert f"paramsSize {size + 1} is not {size}: RM answers NV_ERR_INVALID_PARAM_STRUCT" in bad.notes


@pytest.mark.parametrize(("h_class", "name"), [
    (0x0, "NV01_ROOT"), (0x1, "NV01_ROOT_NON_PRIV"), (0x41, "NV01_ROOT_CLIENT"), (0x3E, "NV01_MEMORY_SYSTEM"),
    (0x80, "NV01_DEVICE_0"), (0x2080, "NV20_SUBDEVICE_0"), (0x90F1, "FERMI_VASPACE_A"),
    (0xC86F, "HOPPER_CHANNEL_GPFIFO_A"), (0xCBC0, "HOPPER_COMPUTE_A"), (0xCEC0, "BLACKWELL_COMPUTE_B"),
])
def test_class_names(h_class: int, name: str) -> None:
    assert dec(cap(0xC020462B, nvos21(h_class), status=0)).class_name == name
    assert dec(cap(0xC0144628, struct.pack("<IIIII", HC, HD, HO, h_class, 0), status=0)).class_name == name


@pytest.mark.parametrize(("status", "name"), [
    (0x0, "NV_OK"), (0x1F, "NV_ERR_INVALID_ARGUMENT"), (0x16, "NV_ERR_ILLEGAL_ACTION"),
    (0x51, "NV_ERR_NO_MEMORY"),
    (0x56, "NV_ERR_NOT_SUPPORTED"), (0x57, "NV_ERR_OBJECT_NOT_FOUND"), (0xFFFF, "NV_ERR_GENERIC"),
    (0x10006, "NV_WARN_NOTHING_TO_DO"), (0x8C, ""),
])
def test_status_names(status: int, name: str) -> None:
    rm = dec(cap(0xC0104629, struct.pack("<IIII", HC, HC, HO, 0), status=status))
    uvm = dec(cap(0x30000001, struct.pack("<QI4x", 0, 0), status=status, kind="uvm"))
    assert (rm.nv_status, rm.nv_status_name) == (uvm.nv_status, uvm.nv_status_name) == (status, name)


@pytest.mark.parametrize(("c", "status", "note"), [
    (cap(0xC0104629, bytes(16), status=0x1F, ret=ENOTTY), 0x1F, "status not written by the driver (ret -25)"),
    (cap(0x22, bytes(16), status=0, ret=-11, kind="uvm"), 0, "status not written by the driver (ret -11)"),
    (cap(iowr(0x5F, 15412), bytes(8), status=0x1F, ret=-22), 0x1F, "ret -22 with the status written"),
    (cap(0xC0384627, bytes(48), status=0, ret=-22), 0, "mmap context could not be attached"),
    (cap(0xC0104629, bytes(16), status=None), None, "status not captured"),
    (cap(0xC04846C8, bytes(48), status=7, ret=ENOTTY), None, None),  # CARD_INFO has no status
    (cap(0xC00446D8, bytes(4), status=3), None, None),  # a NUMA state, not an NV_STATUS
])
def test_status_and_return_value(c: IoctlCapture, status: int | None, note: str | None) -> None:
    got = dec(c)
    assert got.nv_status == status
    if note is None:
        assert got.notes == ()
    else:
        assert any(note in n for n in got.notes), got.notes


MAP = struct.pack("<IIIIQQQII", HC, HD, HO, 0, 0x1000, 1 << 20, 0, 0, 0x10)  # NVOS33, §3.4
# (request, kind, block, call, args): every call the decoder must spell out, at the sheet's offsets.
ARGS_CASES = [
    (0xC0144628, "control", struct.pack("<IIIII", HC, HD, HO, 0xC6C0, 0), "RM_ALLOC_OBJECT",
     {"hClient": hex(HC), "hParent": hex(HD), "hObject": hex(HO), "hClass": "0xc6c0"}),
    (0xC0104629, "control", struct.pack("<IIII", HC, HD, HO, 0), "RM_FREE",
     {"hClient": hex(HC), "hParent": hex(HD), "hObject": hex(HO)}),
    (0xC01C4634, "control", struct.pack("<IIIIIII", HC, HD, HO, 0xC1D00009, 0x5C000001, 0, 0),
     "RM_DUP_OBJECT",
     {"hClient": hex(HC), "hParent": hex(HD), "hObject": hex(HO), "hClientSrc": "0xc1d00009",
      "hObjectSrc": "0x5c000001", "flags": "0x0"}),
    (0xC038464E, "control", MAP[:48], "RM_MAP_MEMORY",
     {"hClient": hex(HC), "hDevice": hex(HD), "hMemory": hex(HO), "offset": "0x1000", "length": "1048576",
      "flags": "0x10"}),
    (0xC038464E, "control", MAP + struct.pack("<i4x", 7), "RM_MAP_MEMORY",  # longer than the kernel keeps
     {"hClient": hex(HC), "hDevice": hex(HD), "hMemory": hex(HO), "offset": "0x1000", "length": "1048576",
      "flags": "0x10", "fd": "7"}),
    (0xC020464F, "control", struct.pack("<IIIIQII", HC, HD, HO, 0, 0x7F00, 0, 0), "RM_UNMAP_MEMORY",
     {"hClient": hex(HC), "hDevice": hex(HD), "hMemory": hex(HO), "pLinearAddress": "0x7f00",
      "flags": "0x0"}),
    (0xC0384627, "gpu", struct.pack("<IIIIIIQQII", HC, HD, HO, 0x3E, 0x4, 0, 0, 0xFFFFF, 0, 0),
     "RM_ALLOC_MEMORY",
     {"hClient": hex(HC), "hParent": hex(HD), "hObject": hex(HO), "hClass": "0x3e", "flags": "0x4",
      "limit": "0xfffff"}),
    (0xC04846C8, "control", struct.pack("<B3xIBBBxHHIH2xQQQ", 1, 0, 0x41, 0, 0, 0x10DE, 0x2330, 0x4100,
                                        0, 0xFB000000, 1 << 24, 0x2000000000)[:48], "CARD_INFO",
     {"valid": "1", "domain": "0x0", "bus": "0x41", "slot": "0x0", "function": "0x0", "vendor_id": "0x10de",
      "device_id": "0x2330", "gpu_id": "0x4100", "interrupt_line": "0", "reg_address": "0xfb000000",
      "reg_size": "16777216", "fb_address": "0x2000000000", "entries": "1"}),
    (iowr(0xC8, 72 * 32), "control", bytes(8), "CARD_INFO", {"valid": "0", "domain": "0x0", "entries": "32"}),
    (0xC04846D2, "control", struct.pack("<II", 0, 0) + b"550.54.15\0", "CHECK_VERSION_STR",
     {"cmd": "0x0", "reply": "0", "versionString": "550.54.15", "mode": "STRICT"}),
    (0xC00446C9, "gpu", struct.pack("<i", 5), "REGISTER_FD", {"ctl_fd": "5"}),
    (0xC01046CE, "gpu", struct.pack("<IIi4x", HC, HD, 9), "ALLOC_OS_EVENT",
     {"hClient": hex(HC), "hDevice": hex(HD), "fd": "9"}),
    (iowr(0xD4, 8), "control", struct.pack("<II", 0x100, 0x4100), "ATTACH_GPUS_TO_FD",
     {"entries": "2", "gpu_ids": "0x100,0x4100"}),
    (0xC0B8464A, "control", struct.pack("<IIIIh", HC, HD, 2, 0, -1), "RM_VID_HEAP_CONTROL",
     {"hClient": hex(HC), "hParent": hex(HD), "function": "2", "hVASpace": "0x0", "ivcHeapNumber": "-1",
      "functionName": "ALLOC_SIZE"}),
    (0x30000001, "uvm", struct.pack("<QI4x", 0x2, 0), "UVM_INITIALIZE", {"flags": "0x2"}),
    (75, "uvm", struct.pack("<iI", 12, 0), "UVM_MM_INITIALIZE", {"uvmFd": "12"}),
    (37, "uvm", UUID + struct.pack("<B3xiiIII", 0, -1, 5, HC, 0, 0), "UVM_REGISTER_GPU",
     {"gpu_uuid": UUID_S, "rmCtrlFd": "5", "hClient": hex(HC), "hSmcPartRef": "0x0"}),
    (25, "uvm", UUID + struct.pack("<iIII", 5, HC, 0xCAF00010, 0), "UVM_REGISTER_GPU_VASPACE",
     {"gpuUuid": UUID_S, "rmCtrlFd": "5", "hClient": hex(HC), "hVaSpace": "0xcaf00010"}),
    (27, "uvm", UUID + struct.pack("<iII4xQQI4x", 5, HC, 0xCAF00020, 0x200000, 4096, 0),
     "UVM_REGISTER_CHANNEL",
     {"gpuUuid": UUID_S, "rmCtrlFd": "5", "hClient": hex(HC), "hChannel": "0xcaf00020", "base": "0x200000",
      "length": "4096"}),
    (23, "uvm", struct.pack("<QI4x", 3, 0), "UVM_CREATE_RANGE_GROUP", {"rangeGroupId": "3"}),
    (33, "uvm", struct.pack("<QQQ", 0x7F0000000000, 1 << 21, 0) + bytes(24), "UVM_MAP_EXTERNAL_ALLOCATION",
     {"base": "0x7f0000000000", "length": "2097152", "offset": "0x0"}),
    (34, "uvm", struct.pack("<QI4x", 0x7F0000000000, 0), "UVM_FREE", {"base": "0x7f0000000000"}),
    (28, "uvm", struct.pack("<III", HC, 0xCAF00020, 0), "UVM_UNREGISTER_CHANNEL",
     {"hClient": hex(HC), "hChannel": "0xcaf00020"}),
]


@pytest.mark.parametrize(("request_", "kind", "block", "call", "args"), ARGS_CASES)
def test_args(request_: int, kind: str, block: bytes, call: str, args: dict[str, str]) -> None:
    got = dec(cap(request_, block, status=0, kind=kind))
    assert got.call == call and got.args == args


@pytest.mark.parametrize(("version", "number", "block", "args"), [
    # UVM_FREE and UNREGISTER_CHANNEL before 590.44.01: the sheet gives no fields of the old layout.
    ("580.142", 34, bytes(24), {}),
    ("580.142", 28, bytes(28), {}),
    ("590.44.01", 34, struct.pack("<QI4x", 0x1000, 0), {"base": "0x1000"}),
])
def test_uvm_fields_follow_the_layout(version: str, number: int, block: bytes, args: dict[str, str]) -> None:
    assert dec(cap(number, block, status=0, kind="uvm"), version).args == args


PROPRIETARY = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
               "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
OPEN = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  595.45.04  Release Build  "
        "(dvs-builder@U22-I3-AE18-09-1)  Thu Mar  5 01:02:03 UTC 2026\nGCC version:  gcc version 12.2.0\n")


@pytest.mark.parametrize(("text", "version"), [
    (PROPRIETARY, "550.54.15"), (OPEN, "595.45.04"),
    ("NVRM version: NVIDIA UNIX aarch64 Kernel Module  580.142  Fri ...\n", "580.142"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  570.86.15  Release Build\n", "570.86.15"),
    ("GCC version:  gcc version 12.2.0\n", None), ("", None),
])
def test_read_driver_version(tmp_path: Path, text: str, version: str | None) -> None:
    path = tmp_path / "driver" / "nvidia" / "version"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    assert read_driver_version(str(tmp_path)) == version == parse_driver_version(text)


def test_read_driver_version_absent(tmp_path: Path) -> None:
    assert read_driver_version(str(tmp_path)) is None
    (tmp_path / "driver" / "nvidia" / "version").mkdir(parents=True)  # unreadable as a file
    assert read_driver_version(str(tmp_path)) is None
