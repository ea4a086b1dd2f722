"""Decoding a recording of driver calls (tracer/memcall_decode.py) into MemCalls, with blocks built
at the offsets of docs/reference/nvidia-ioctl-abi.md (§2 to §5) by hand, not from tracer/nvabi.py."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.tracer.memcall_decode import (
    CardInfo,
    RecordedClose,
    RecordedIoctl,
    RecordError,
    RecordingDecoder,
    card_infos,
    decode_ioctl,
    gpu_id_instance,
    layout_tag,
    parse_record,
    status_offsets,
)
from ghostgpu.tracer.memcalls import MemCall, MemCallKind

V515, V525, V530, V550, V595 = "515.43.04", "525.47.04", "530.30.02", "550.54.15", "595.45.04"
HC, HD, HS, HM = 0xC1D00001, 0x5C000002, 0x5C000003, 0xBEEF0004
GIB = 1 << 30
NO_MEMORY = 0x51  # NV_ERR_NO_MEMORY (§6)
TS, PID, FD = 1_000, 4242, 7


def iowr(nr: int, size: int) -> int:  # _IOWR('F', nr, size), §1
    return 0xC0000000 | size << 16 | 0x46 << 8 | nr


def nvos21(h_class: int, h_new: int, parent: int = HC, status: int = 0, status_at: int = 28) -> bytes:
    block = bytearray(struct.pack("<IIIIQII", HC, parent, h_new, h_class, 0x7FFF0000, 128, 0))
    struct.pack_into("<I", block, status_at, status)
    return bytes(block)


def nvos64(h_class: int, h_new: int, size: int = 48, status_at: int = 40, status: int = 0) -> bytes:
    block = bytearray(size)
    struct.pack_into("<IIIIQ", block, 0, HC, HD, h_new, h_class, 0x7FFF0000)
    struct.pack_into("<I", block, status_at, status)
    return bytes(block)


def mem_params(size_bytes: int, attr: int = 0) -> bytes:  # NV_MEMORY_ALLOCATION_PARAMS, §4.1
    block = bytearray(128)
    struct.pack_into("<I", block, 24, attr)
    struct.pack_into("<Q", block, 64, size_bytes)
    return bytes(block)


def nvos32(function: int, h_memory: int, size_bytes: int = 0, attr: int = 0, status: int = 0,
           flags: int = 0) -> bytes:
    block = bytearray(184)  # §3.5; data@40: AllocSize hMemory@+4, flags@+12, attr@+16, size@+48
    struct.pack_into("<IIII", block, 0, HC, HD, function, 0)
    struct.pack_into("<I", block, 20, status)
    struct.pack_into("<I", block, 44, h_memory)
    struct.pack_into("<I", block, 52, flags)
    struct.pack_into("<I", block, 56, attr)
    struct.pack_into("<Q", block, 88, size_bytes)
    return bytes(block)


def rec(request: int, after: bytes, ret: int = 0, pid: int = PID, fd: int = FD, **kw: Any) -> RecordedIoctl:
    return RecordedIoctl(ts_ns=TS, pid=pid, fd=fd, request=request, ret=ret, before=after, after=after, **kw)


def xfer(nr: int, inner: bytes | None, ret: int = 0, size: int | None = None, **kw: Any) -> RecordedIoctl:
    outer = struct.pack("<IIQ", nr, len(inner or b"") if size is None else size, 0x7FFF1000)
    return rec(iowr(0xD3, 16), outer, ret=ret, inner_before=inner, inner_after=inner, **kw)


def call(kind: MemCallKind, **kw: Any) -> MemCall:
    base: dict[str, Any] = {"ts_ns": TS, "pid": PID, "fd": FD, "h_root": HC, "h_parent": HD}
    return MemCall(kind, **{**base, **kw})


ACCEPTED: list[tuple[str, str, RecordedIoctl, MemCall]] = [
    ("memory class: size and attr from pAllocParms after the call", V595,
     rec(iowr(0x2B, 32), nvos21(0x40, HM, parent=HD), params_after=mem_params(GIB + (2 << 20), 0x10)),
     call(MemCallKind.ALLOC, h_object=HM, h_class=0x40, size_bytes=GIB + (2 << 20), attr=0x10)),
    ("sysmem class 0x3E also reads its size (the accountant says whether it counts)", V595,
     rec(iowr(0x2B, 32), nvos21(0x3E, HM, parent=HD), params_after=mem_params(4096)),
     call(MemCallKind.ALLOC, h_object=HM, h_class=0x3E, size_bytes=4096)),
    ("client: hClass comes back as 0x41, hObjectNew as RM picked it", V595,
     rec(iowr(0x2B, 32), nvos21(0x41, HC)),
     call(MemCallKind.ALLOC, h_parent=HC, h_object=HC, h_class=0x41)),
    ("device: deviceId@0 of NV0080_ALLOC_PARAMETERS", V595,
     rec(iowr(0x2B, 32), nvos21(0x80, HD), params_after=struct.pack("<I52x", 1)),
     call(MemCallKind.ALLOC, h_parent=HC, h_object=HD, h_class=0x80, instance=1)),
    ("subdevice: subDeviceId@0 of NV2080_ALLOC_PARAMETERS", V595,
     rec(iowr(0x2B, 32), nvos21(0x2080, HS, parent=HD), params_after=struct.pack("<I", 0)),
     call(MemCallKind.ALLOC, h_object=HS, h_class=0x2080, instance=0)),
    ("another class: no parameters read", V595,
     rec(iowr(0x2B, 32), nvos21(0xC86F, 0x77, parent=HD)),
     call(MemCallKind.ALLOC, h_object=0x77, h_class=0xC86F)),
    ("NVOS64 (48 bytes): status @40", V595,
     rec(iowr(0x2B, 48), nvos64(0x40, HM), params_after=mem_params(GIB)),
     call(MemCallKind.ALLOC, h_object=HM, h_class=0x40, size_bytes=GIB)),
    ("NVOS21 on 530: status @24, whatever @28 holds", V530,
     rec(iowr(0x2B, 32), nvos21(0x40, HM, parent=HD)[:24] + struct.pack("<II", 0, NO_MEMORY),
         params_after=mem_params(GIB)),
     call(MemCallKind.ALLOC, h_object=HM, h_class=0x40, size_bytes=GIB)),
    ("NVOS64 on 525: 40 bytes, status @36", V525,
     rec(iowr(0x2B, 40), nvos64(0x40, HM, size=40, status_at=36), params_after=mem_params(GIB)),
     call(MemCallKind.ALLOC, h_object=HM, h_class=0x40, size_bytes=GIB)),
    ("NVOS64 on 515: 40 bytes, status @32", V515,
     rec(iowr(0x2B, 40), nvos64(0x40, HM, size=40, status_at=32), params_after=mem_params(GIB)),
     call(MemCallKind.ALLOC, h_object=HM, h_class=0x40, size_bytes=GIB)),
    ("RM_ALLOC inside XFER", V595,
     xfer(0x2B, nvos21(0x40, HM, parent=HD), params_after=mem_params(4 * GIB)),
     call(MemCallKind.ALLOC, h_object=HM, h_class=0x40, size_bytes=4 * GIB)),
    ("RM_ALLOC_OBJECT (NVOS05): status @16", V595,
     rec(iowr(0x28, 20), struct.pack("<IIIII", HC, HD, 0x99, 0xC6C0, 0)),
     call(MemCallKind.ALLOC, h_object=0x99, h_class=0xC6C0)),
    ("RM_ALLOC_MEMORY (NVOS02 + fd): size = limit + 1, its flags passed on as attr", V595,
     rec(iowr(0x27, 56), struct.pack("<IIIII4xQQI4xi4x", HC, HD, HM, 0x3E, 0x31, 0, (1 << 20) - 1, 0, 9)),
     call(MemCallKind.ALLOC_MEMORY, h_object=HM, h_class=0x3E, attr=0x31, size_bytes=1 << 20)),
    ("memory class whose pAllocParms the recording lacks: size 0, as a failed kernel read", V595,
     rec(iowr(0x2B, 32), nvos21(0x40, HM, parent=HD)),
     call(MemCallKind.ALLOC, h_object=HM, h_class=0x40)),
    ("device with an empty pAllocParms: instance unknown", V595,
     rec(iowr(0x2B, 32), nvos21(0x80, HD), params_after=b""),
     call(MemCallKind.ALLOC, h_parent=HC, h_object=HD, h_class=0x80)),
    ("RM_ALLOC_OBJECT reads no allocation parameters, whatever the class", V595,
     rec(iowr(0x28, 20), struct.pack("<IIIII", HC, HD, HM, 0x40, 0), params_after=mem_params(GIB)),
     call(MemCallKind.ALLOC, h_object=HM, h_class=0x40)),
    ("RM_FREE (NVOS00): hObjectOld", V595,
     rec(iowr(0x29, 16), struct.pack("<IIII", HC, HD, HM, 0)),
     call(MemCallKind.FREE, h_object=HM)),
    ("RM_FREE of the client: hObjectOld == hRoot", V595,
     rec(iowr(0x29, 16), struct.pack("<IIII", HC, HC, HC, 0)),
     call(MemCallKind.FREE, h_parent=HC, h_object=HC)),
    ("RM_FREE inside XFER", V595,
     xfer(0x29, struct.pack("<IIII", HC, HD, HM, 0)),
     call(MemCallKind.FREE, h_object=HM)),
    ("RM_DUP_OBJECT (NVOS55): the new handle and its source", V595,
     rec(iowr(0x34, 28), struct.pack("<IIIIIII", HC, HD, 0x55, 0xC1D00009, HM, 0, 0)),
     call(MemCallKind.DUP, h_object=0x55, src_client=0xC1D00009, src_object=HM)),
    ("VID_HEAP_CONTROL ALLOC_SIZE: hMemory@44, attr@56, size@88 after the call", V595,
     rec(iowr(0x4A, 184), nvos32(2, HM, 16 * GIB, attr=1 << 25)),
     call(MemCallKind.HEAP_ALLOC, h_object=HM, size_bytes=16 * GIB, attr=1 << 25)),
    ("ALLOC_SIZE with NVOS32_ALLOC_FLAGS_VIRTUAL (flags@52): an NV50_MEMORY_VIRTUAL reservation", V595,
     rec(iowr(0x4A, 184), nvos32(2, HM, 16 * GIB, flags=0x00080000)),
     call(MemCallKind.HEAP_ALLOC, h_object=HM, h_class=0x50A0, size_bytes=16 * GIB)),
    ("ALLOC_SIZE with other flags only: no class, the location decides", V595,
     rec(iowr(0x4A, 184), nvos32(2, HM, GIB, flags=0x00000400 | 0x00000100)),
     call(MemCallKind.HEAP_ALLOC, h_object=HM, size_bytes=GIB)),
    ("VID_HEAP_CONTROL FREE: hMemory@44", V595,
     rec(iowr(0x4A, 184), nvos32(3, HM)),
     call(MemCallKind.HEAP_FREE, h_object=HM)),
]


@pytest.mark.parametrize(("version", "record", "expected"), [c[1:] for c in ACCEPTED],
                         ids=[c[0] for c in ACCEPTED])
def test_accepted_calls(version: str, record: RecordedIoctl, expected: MemCall) -> None:
    assert decode_ioctl(record, status_offsets(version)) == expected


REFUSED: list[tuple[str, str, RecordedIoctl]] = [
    ("ioctl failed (-1, EINVAL): the status was never written", V595,
     rec(iowr(0x2B, 32), nvos21(0x40, HM), ret=-1, params_after=mem_params(GIB))),
    ("RM refused: NV_ERR_NO_MEMORY", V595,
     rec(iowr(0x2B, 32), nvos21(0x40, HM, status=NO_MEMORY), params_after=mem_params(GIB))),
    ("NVOS64 refused @40", V595, rec(iowr(0x2B, 48), nvos64(0x40, HM, status=NO_MEMORY))),
    ("NVOS21 on 595 reads @28, not @24", V595,
     rec(iowr(0x2B, 32), nvos21(0x40, HM, status=NO_MEMORY, status_at=28), params_after=mem_params(GIB))),
    ("NVOS21 on 550 refused @28", V550,
     rec(iowr(0x2B, 32), nvos21(0x40, HM, status=NO_MEMORY), params_after=mem_params(GIB))),
    ("a 40-byte RM_ALLOC on 595: a size the driver does not take", V595,
     rec(iowr(0x2B, 40), nvos64(0x40, HM, size=40, status_at=36))),
    ("XFER refused", V595, xfer(0x2B, nvos21(0x40, HM, status=NO_MEMORY), params_after=mem_params(GIB))),
    ("XFER that failed (-1)", V595, xfer(0x2B, nvos21(0x40, HM), ret=-1)),
    ("RM_FREE refused", V595, rec(iowr(0x29, 16), struct.pack("<IIII", HC, HD, HM, 0x57))),
    ("DUP refused", V595, rec(iowr(0x34, 28), struct.pack("<IIIIIII", HC, HD, 0x55, HC, HM, 0, 0x57))),
    ("heap alloc refused @20", V595, rec(iowr(0x4A, 184), nvos32(2, HM, GIB, status=NO_MEMORY))),
    ("heap function INFO: neither allocates by size nor frees", V595, rec(iowr(0x4A, 184), nvos32(1, 0))),
    ("heap ALLOC_OS_DESCRIPTOR: not a by-size allocation", V595, rec(iowr(0x4A, 184), nvos32(27, HM))),
    ("ALLOC_MEMORY with -EINVAL although RM succeeded: only ret 0 counts", V595,
     rec(iowr(0x27, 56), struct.pack("<IIIII4xQQI4xi4x", HC, HD, HM, 0x3E, 0, 0, 4095, 0, 9), ret=-1)),
    ("RM_CONTROL: no memory call", V595, rec(iowr(0x2A, 32), bytes(32))),
    ("CARD_INFO: no memory call", V595, rec(iowr(0xC8, 72), bytes(72))),
    ("a UVM number: another family", V595, rec(0x30000001, bytes(16))),
]


@pytest.mark.parametrize(("version", "record"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_refused_or_other_calls_count_nothing(version: str, record: RecordedIoctl) -> None:
    assert decode_ioctl(record, status_offsets(version)) is None


BAD: list[tuple[str, RecordedIoctl, str]] = [
    ("XFER without its inner block", xfer(0x2B, None, size=32), "of its 32 bytes"),
    ("a short XFER header", rec(iowr(0xD3, 16), bytes(8)), "nv_ioctl_xfer_t"),
    ("a short block", rec(iowr(0x29, 16), bytes(8)), "of its 16 bytes"),
]


@pytest.mark.parametrize(("record", "message"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_unreadable_records_are_one_line_errors(record: RecordedIoctl, message: str) -> None:
    with pytest.raises(RecordError, match=message) as err:
        decode_ioctl(record, status_offsets(V595))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("version", "tag"), [
    (None, "595.45.04"), ("", "595.45.04"), ("garbage", "595.45.04"), ("999.1", "595.45.04"),
    ("470.1.2", "595.45.04"), ("515.43.04", "515.43.04"), ("550.54.15", "550.40.07"),
    ("535.43.02", "535.43.02"), ("580.95.05", "580.65.06"),
])
def test_layout_tag(version: str | None, tag: str) -> None:
    assert layout_tag(version) == tag


@pytest.mark.parametrize(("version", "key", "status_at"), [
    (V595, (0x2B, 32), 28), (V595, (0x2B, 48), 40), (V530, (0x2B, 32), 24), (V525, (0x2B, 40), 36),
    (V515, (0x2B, 40), 32), (V595, (0x29, 16), 12), (V595, (0x4A, 184), 20), (V595, (0x27, 56), 40),
    (V595, (0x34, 28), 24), (V595, (0x28, 20), 16), (V595, (0x2A, 32), 28),
])
def test_status_offsets_from_nvabi(version: str, key: tuple[int, int], status_at: int) -> None:
    assert status_offsets(version)[key] == status_at


def test_no_status_blocks_are_left_out() -> None:
    offsets = status_offsets(V595)
    assert (0xC8, 72) not in offsets and (0xD3, 16) not in offsets and (0x2B, 40) not in offsets


def test_close_of_a_client_fd_once() -> None:
    dec = RecordingDecoder(V595)
    client = rec(iowr(0x2B, 32), nvos21(0x41, HC), fd=5)
    assert dec.feed(RecordedClose(TS, PID, 5)) is None  # no client on it yet
    assert dec.feed(client) is not None
    assert dec.feed(RecordedClose(TS, PID + 1, 5)) is None  # a fork child's close of the inherited fd
    assert dec.feed(RecordedClose(TS, PID, 6)) is None
    assert dec.feed(RecordedClose(TS + 1, PID, 5)) == MemCall(MemCallKind.CLOSE, ts_ns=TS + 1, pid=PID, fd=5,
                                                               h_root=0, h_parent=0, h_object=0)
    assert dec.feed(RecordedClose(TS + 2, PID, 5)) is None  # already closed


def test_params_unread_are_counted() -> None:
    dec = RecordingDecoder(V595)
    dec.feed(rec(iowr(0x2B, 32), nvos21(0x40, HM, parent=HD)))
    dec.feed(rec(iowr(0x2B, 32), nvos21(0x80, HD), params_after=struct.pack("<I", 0)))
    dec.feed(rec(iowr(0x2B, 32), nvos21(0xC86F, 0x77, parent=HD)))  # reads none
    dec.feed(rec(iowr(0x2B, 32), nvos21(0x40, HM, status=NO_MEMORY)))  # refused: nothing to read
    assert dec.params_unread == 1


def test_a_client_through_alloc_object_makes_no_close() -> None:
    dec = RecordingDecoder(V595)  # the kernel side marks client fds at RM_ALLOC only
    assert dec.feed(rec(iowr(0x28, 20), struct.pack("<IIIII", HC, HC, HC, 0x41, 0), fd=5)) is not None
    assert dec.feed(RecordedClose(TS, PID, 5)) is None


def test_a_refused_client_makes_no_close() -> None:
    dec = RecordingDecoder(V595)
    assert dec.feed(rec(iowr(0x2B, 32), nvos21(0x41, HC, status=0x23), fd=5)) is None
    assert dec.feed(RecordedClose(TS, PID, 5)) is None


def test_decoder_uses_the_driver_version() -> None:
    on_530 = rec(iowr(0x2B, 32), nvos21(0x40, HM, parent=HD, status=NO_MEMORY, status_at=24),
                 params_after=mem_params(GIB))
    assert RecordingDecoder(V530).feed(on_530) is None
    assert RecordingDecoder(V595).feed(on_530) is not None  # @28 is 0 there: the version matters


@pytest.mark.parametrize(("line", "expected"), [
    ({"ev": "start", "pid": 1}, None),
    ({"ev": "open", "pid": 1, "fd": 3, "path": "/dev/nvidiactl"}, None),
    ({"ev": "close", "ts_ns": 5, "pid": 1, "fd": 3}, RecordedClose(5, 1, 3)),
    ({"ev": "ioctl", "ts_ns": 5, "pid": 1, "fd": 3, "req": "0xc010464a", "ret": 0, "before": "00ff",
      "after": "01ff", "xfer_after": "", "ptr_after": "aa"},
     RecordedIoctl(5, 1, 3, 0xC010464A, 0, b"\x00\xff", b"\x01\xff", None, b"", None, b"\xaa")),
    ({"ev": "ioctl", "ts_ns": 5, "pid": 1, "fd": 3, "req": 3221767723, "ret": -1, "errno": 22},
     RecordedIoctl(5, 1, 3, 3221767723, -1)),
])
def test_parse_record(line: dict[str, Any], expected: object) -> None:
    assert parse_record(line) == expected


@pytest.mark.parametrize(("line", "message"), [
    ({"ev": "ioctl", "ts_ns": 5, "pid": 1, "fd": 3, "req": 1, "ret": 0, "after": "zz"}, "'after' is not hex"),
    ({"ev": "ioctl", "ts_ns": 5, "pid": 1, "fd": 3, "ret": 0}, "'req' must be an integer"),
    ({"ev": "close", "pid": 1, "fd": 3}, "'ts_ns' must be an integer"),
])
def test_parse_record_errors(line: dict[str, Any], message: str) -> None:
    with pytest.raises(RecordError, match=message):
        parse_record(line)


def card_entry(valid: int, domain: int, bus: int, slot: int, gpu_id: int, minor: int) -> bytes:
    block = bytearray(72)  # nv_ioctl_card_info_t, §4
    block[0] = valid
    struct.pack_into("<IBB", block, 4, domain, bus, slot)
    struct.pack_into("<I", block, 16, gpu_id)
    struct.pack_into("<I", block, 56, minor)
    return bytes(block)


def test_card_infos() -> None:
    answer = card_entry(1, 0, 0x3B, 0, 0x3B00, 0) + card_entry(1, 1, 0x86, 2, 0x186200, 1) + bytes(72)
    assert card_infos(rec(iowr(0xC8, 216), answer)) == [
        CardInfo(0x3B00, 0, "0000:3b:00.0"), CardInfo(0x186200, 1, "0001:86:02.0")]
    assert card_infos(rec(iowr(0xC8, 216), answer, ret=-1)) == []
    assert card_infos(rec(iowr(0x2A, 32), bytes(32))) == []


def control(cmd: int, status: int = 0) -> bytes:  # NVOS54, §3.2
    return struct.pack("<IIIIQII", HC, HC, cmd, 0, 0x7FFF2000, 32, status)


def test_gpu_id_instance() -> None:
    params = struct.pack("<IIII16x", 0x3B00, 0, 1, 0)
    offsets = status_offsets(V595)
    assert gpu_id_instance(rec(iowr(0x2A, 32), control(0x205), params_after=params), offsets) == (0x3B00, 1)
    assert gpu_id_instance(xfer(0x2A, control(0x205), params_after=params), offsets) == (0x3B00, 1)
    assert gpu_id_instance(rec(iowr(0x2A, 32), control(0x205, 0x1F), params_after=params), offsets) is None
    assert gpu_id_instance(rec(iowr(0x2A, 32), control(0x202), params_after=params + bytes(8)),
                           offsets) == (0x3B00, 1)  # GET_ID_INFO (v1): deviceInstance@8 too
    assert gpu_id_instance(rec(iowr(0x2A, 32), control(0x201), params_after=params), offsets) is None
    assert gpu_id_instance(rec(iowr(0x2A, 32), control(0x205)), offsets) is None


# --- the recording path: bench/nvrecord.c's lines, bench/gpu_real_decode.py on a recording ---

REPO = Path(__file__).resolve().parents[2]
ENOTTY = 25


def build_nvrecord(out_dir: Path) -> Path:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler (gcc or cc) to build bench/nvrecord.c")
    lib = out_dir / "nvrecord.so"
    subprocess.run([cc, "-O2", "-Wall", "-Werror", "-shared", "-fPIC", "-o", str(lib),
                    str(REPO / "bench" / "nvrecord.c"), "-ldl", "-lpthread"], check=True, capture_output=True)
    return lib


# Under nvrecord, with /dev/null standing in for a device file: every ioctl fails with ENOTTY, so
# the blocks before and after are the caller's, and nothing of it may count.
CALLER = """
import ctypes, os, struct
libc = ctypes.CDLL(None, use_errno=True)
fd = os.open("/dev/null", os.O_RDWR)
params = ctypes.create_string_buffer(bytes(range(128)), 128)
head = struct.pack("<IIIIQII", 1, 2, 3, 0x40, ctypes.addressof(params), 128, 0)
block = ctypes.create_string_buffer(head, 32)
libc.ioctl(fd, ctypes.c_ulong(0xC020462B), block)
xfer = ctypes.create_string_buffer(struct.pack("<IIQ", 0x2B, 32, ctypes.addressof(block)), 16)
libc.ioctl(fd, ctypes.c_ulong(0xC01046D3), xfer)
libc.ioctl(fd, ctypes.c_ulong(0x30000001), ctypes.create_string_buffer(16))  # a UVM number: no blocks
os.dup2(fd, 40)
os.close(40)
os.close(fd)
print(fd, ctypes.addressof(params))
"""


def test_nvrecord_lines_are_what_parse_record_reads(tmp_path: Path) -> None:
    lib = build_nvrecord(tmp_path)
    out = tmp_path / "rec.jsonl"
    env = {**os.environ, "LD_PRELOAD": str(lib), "NVRECORD_OUT": str(out), "NVRECORD_MATCH": "/dev/null"}
    proc = subprocess.run([sys.executable, "-c", CALLER], env=env, capture_output=True, text=True, check=True,
                          timeout=60)
    fd, params_at = (int(x) for x in proc.stdout.split())
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["ev"] == "start" and lines[0]["pid"] == lines[-1]["pid"]
    records = [r for r in (parse_record(line) for line in lines) if r is not None]
    ioctls = [r for r in records if isinstance(r, RecordedIoctl)]
    assert [(r.fd, r.request, r.ret) for r in ioctls] == [(fd, 0xC020462B, -1), (fd, 0xC01046D3, -1),
                                                          (fd, 0x30000001, -1)]
    assert all(line["errno"] == ENOTTY for line in lines if line["ev"] == "ioctl")
    alloc, xfer_call, uvm = ioctls
    assert alloc.before == alloc.after and len(alloc.before) == 32 and alloc.before[12] == 0x40
    assert alloc.params_before == alloc.params_after == bytes(range(128))  # paramsSize@24 bytes
    assert xfer_call.inner_before == alloc.before and xfer_call.params_before == bytes(range(128))
    assert uvm.before == b"" and uvm.inner_before is None and uvm.params_before is None
    assert next(line for line in lines if line.get("ptr_at"))["ptr_at"] == hex(params_at)
    closes = [(r.fd) for r in records if isinstance(r, RecordedClose)]
    assert closes == [40, fd]
    assert [line["dev"] for line in lines if line["ev"] == "open"] == ["/dev/null", "/dev/null"]
    dec = RecordingDecoder(V595)
    assert [dec.feed(r) for r in records] == [None] * len(records)  # refused: nothing counts


def recording_lines() -> list[dict[str, Any]]:
    """What nvrecord writes for cudaMalloc 1, 4 and 16 GiB and a free of the 4 GiB one (one refused
    32 GiB attempt between), as bench/gpu_real_check.sh --fake plants through the fake driver."""
    steps = [
        rec(iowr(0x2B, 32), nvos21(0x41, HC), fd=3),
        rec(iowr(0x2B, 32), nvos21(0x80, HD, parent=HC), fd=3, params_after=struct.pack("<I52x", 0)),
        rec(iowr(0x2B, 32), nvos21(0x2080, HS, parent=HD), fd=3, params_after=struct.pack("<I", 0)),
        rec(iowr(0x2B, 32), nvos21(0x40, HM, parent=HD), fd=3, params_after=mem_params(GIB)),
        xfer(0x2B, nvos21(0x40, HM + 1, parent=HD), fd=3, params_after=mem_params(4 * GIB)),
        rec(iowr(0x2B, 32), nvos21(0x40, HM + 2, parent=HD, status=NO_MEMORY), fd=3,
            params_after=mem_params(32 * GIB)),
        rec(iowr(0x2B, 48), nvos64(0x40, HM + 3), fd=3, params_after=mem_params(16 * GIB)),
        rec(iowr(0x29, 16), struct.pack("<IIII", HC, HD, HM + 1, 0), fd=3),
    ]
    lines: list[dict[str, Any]] = [{"ev": "start", "ts_ns": 1, "pid": PID, "ppid": 1, "exe": "x"}]
    for r in steps:
        line: dict[str, Any] = {"ev": "ioctl", "ts_ns": r.ts_ns, "pid": r.pid, "fd": r.fd,
                                "req": hex(r.request), "ret": r.ret, "errno": 0, "before": r.before.hex(),
                                "after": r.after.hex()}
        for key, value in (("xfer_before", r.inner_before), ("xfer_after", r.inner_after),
                           ("ptr_before", r.params_before), ("ptr_after", r.params_after)):
            if value is not None:
                line[key] = value.hex()
        lines.append(line)
    return lines


@pytest.mark.parametrize(("truth_bytes", "rc"), [(17 * GIB, 0), (18 * GIB, 1)])
def test_gpu_real_decode_on_a_recording(tmp_path: Path, truth_bytes: int, rc: int) -> None:
    recording, truth, out = tmp_path / "rec.jsonl", tmp_path / "truth.json", tmp_path / "out.json"
    recording.write_text("".join(json.dumps(line) + "\n" for line in recording_lines()) + '{"ev": "ioc')
    clients = [{"handle": HC, "pid": PID, "gpus": {"0": truth_bytes}},
               {"handle": 9, "pid": PID + 1, "gpus": {"0": GIB}}]  # another process's: not compared
    truth.write_text(json.dumps({"driver": V595, "clients": clients}))
    argv = [sys.executable, str(REPO / "bench" / "gpu_real_decode.py"), "decode", "--recording",
            str(recording), "--truth", str(truth), "--driver-label", "fake (FUSE)", "--out", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == rc, proc.stderr
    result = json.loads(out.read_text())
    assert result["driver"] == "fake (FUSE)" and result["pid"] == PID
    assert result["per_gpu"] == [{"gpu": 0, "decoded_bytes": 17 * GIB, "reference_bytes": truth_bytes,
                                  "diff_pct": round(100 * (17 * GIB - truth_bytes) / truth_bytes, 3),
                                  "within_goal": rc == 0}]
    assert result["recording"]["memcalls"] == {"ALLOC": 6, "FREE": 1}  # the refused one is not there
    assert result["recording"]["decode_errors_total"] == 0 and result["incomplete"] == ""
    assert result["instances_vs_minors"]["device_instances_allocated"] == [0]


def decode_argv(recording: Path, out: Path, *more: str) -> list[str]:
    return [sys.executable, str(REPO / "bench" / "gpu_real_decode.py"), "decode", "--recording",
            str(recording), "--out", str(out), *more]


@pytest.mark.parametrize(("text", "says"), [
    ("{not json", "not JSON"),
    ('["a list"]', "not the fake driver's state file"),
    ('{"clients": [{"pid": "x"}]}', "a client entry is not the fake driver's"),
    (None, "cannot read it"),
])
def test_gpu_real_decode_bad_truth_is_one_line(tmp_path: Path, text: str | None, says: str) -> None:
    recording, truth, out = tmp_path / "rec.jsonl", tmp_path / "truth.json", tmp_path / "out.json"
    recording.write_text("".join(json.dumps(line) + "\n" for line in recording_lines()))
    if text is not None:
        truth.write_text(text)
    proc = subprocess.run(decode_argv(recording, out, "--truth", str(truth)), capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and says in proc.stderr and "--truth" in proc.stderr, proc.stderr
    assert not out.exists()


def test_gpu_real_decode_fails_when_nvml_does_not_list_the_process(tmp_path: Path) -> None:
    """Another process NVML lists is not this one (another PID namespace, or another job): nothing is
    compared, the check fails naming what NVML listed."""
    recording, apps, out = tmp_path / "rec.jsonl", tmp_path / "apps.csv", tmp_path / "out.json"
    recording.write_text("".join(json.dumps(line) + "\n" for line in recording_lines()))
    apps.write_text(f"{PID + 7}, 00000000:17:00.0, 17408\n")
    proc = subprocess.run(decode_argv(recording, out, "--nvml-apps", str(apps)), capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert f"NVML lists no PID {PID} (it lists [{PID + 7}])" in proc.stderr and proc.stderr.count("\n") == 1
