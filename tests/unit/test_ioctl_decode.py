"""Ioctl naming against the facts of docs/reference/nvidia-devices.md (§2, §3, §4)."""

from __future__ import annotations

import pytest
from ghostgpu.tracer.ioctl_decode import decode_ioctl, ioc_fields

# §2c "Common request words": every row, (cmd, name, nr, size).
NV_WORDS = [
    (0xC0104629, "NV_ESC_RM_FREE", 0x29, 0x10),
    (0xC020462A, "NV_ESC_RM_CONTROL", 0x2A, 0x20),
    (0xC020462B, "NV_ESC_RM_ALLOC", 0x2B, 0x20),
    (0xC030462B, "NV_ESC_RM_ALLOC", 0x2B, 0x30),
    (0xC0384627, "NV_ESC_RM_ALLOC_MEMORY", 0x27, 0x38),
    (0xC038464E, "NV_ESC_RM_MAP_MEMORY", 0x4E, 0x38),
    (0xC020464F, "NV_ESC_RM_UNMAP_MEMORY", 0x4F, 0x20),
    (0xC01C4634, "NV_ESC_RM_DUP_OBJECT", 0x34, 0x1C),
    (0xC00446C9, "NV_ESC_REGISTER_FD", 201, 0x04),
    (0xC01046CE, "NV_ESC_ALLOC_OS_EVENT", 206, 0x10),
    (0xC01046CF, "NV_ESC_FREE_OS_EVENT", 207, 0x10),
    (0xC00C46D1, "NV_ESC_STATUS_CODE", 209, 0x0C),
    (0xC04846D2, "NV_ESC_CHECK_VERSION_STR", 210, 0x48),
    (0xC01046D3, "NV_ESC_IOCTL_XFER_CMD", 211, 0x10),
    (0xC00846D5, "NV_ESC_QUERY_DEVICE_INTR", 213, 0x08),
    (0xC00846D6, "NV_ESC_SYS_PARAMS", 214, 0x08),
    (0xC00846DA, "NV_ESC_WAIT_OPEN_COMPLETE", 218, 0x08),
]


@pytest.mark.parametrize(("cmd", "name", "nr", "size"), NV_WORDS)
@pytest.mark.parametrize("kind", ["control", "gpu", "/dev/nvidiactl", "/dev/nvidia0"])
def test_nvidia_request_words(cmd: int, name: str, nr: int, size: int, kind: str) -> None:
    got = decode_ioctl(cmd, kind)
    assert (got.name, got.nr, got.size, got.dir, got.type_char) == (name, nr, size, 3, "F")
    assert got.label == f"{name}({nr:#x})"
    assert got.known and not got.removed


# Named by nr whatever the size part says (§2a: name by nr, never by the whole word).
@pytest.mark.parametrize(
    ("cmd", "name", "removed"),
    [
        (0xC0FF462A, "NV_ESC_RM_CONTROL", False),
        (0x0000462A, "NV_ESC_RM_CONTROL", False),  # _IO direction, size 0
        (0xC0104632, "NV_ESC_RM_CONFIG_GET", True),
        (0xC0104633, "NV_ESC_RM_CONFIG_SET", True),
        (0xC0104637, "NV_ESC_RM_CONFIG_GET_EX", True),
        (0xC0104638, "NV_ESC_RM_CONFIG_SET_EX", True),
        (0xC010465F, "NV_ESC_RM_LOCKLESS_DIAGNOSTIC", False),
        (0xC01046C8, "NV_ESC_CARD_INFO", False),
        (0xC01046D9, "NV_ESC_EXPORT_TO_DMABUF_FD", False),
    ],
)
def test_nvidia_by_nr(cmd: int, name: str, removed: bool) -> None:
    got = decode_ioctl(cmd, "control")
    assert (got.name, got.removed) == (name, removed)


# §3: UVM words are plain numbers, including the two large Linux-only ones and removed numbers.
UVM_NUMBERS = [
    (0x30000001, "UVM_INITIALIZE", False),
    (0x30000002, "UVM_DEINITIALIZE", False),
    (1, "UVM_RESERVE_VA", False),
    (9, "UVM_RUN_TEST", True),
    (11, "UVM_REMOVE_SESSION", True),
    (18, "UVM_REGISTER_MPS_SERVER", True),
    (19, "UVM_REGISTER_MPS_CLIENT", True),
    (36, "UVM_DEBUG_ACCESS_MEMORY", True),
    (37, "UVM_REGISTER_GPU", False),
    (38, "UVM_UNREGISTER_GPU", False),
    (51, "UVM_MIGRATE", False),
    (54, "UVM_ENABLE_SYSTEM_WIDE_ATOMICS", True),
    (55, "UVM_DISABLE_SYSTEM_WIDE_ATOMICS", True),
    (71, "UVM_POPULATE_PAGEABLE", False),
    (75, "UVM_MM_INITIALIZE", False),
    (80, "UVM_DISCARD", False),
    (2047, "UVM_IS_8_SUPPORTED", False),
]


@pytest.mark.parametrize(("cmd", "name", "removed"), UVM_NUMBERS)
@pytest.mark.parametrize("kind", ["uvm", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"])
def test_uvm_numbers(cmd: int, name: str, removed: bool, kind: str) -> None:
    got = decode_ioctl(cmd, kind)
    assert (got.name, got.nr, got.size, got.dir, got.type_char, got.removed) == (name, cmd, 0, 0, "", removed)
    assert got.label == f"{name}({cmd:#x})"


# §4: KFD by nr with type 'K'; on a render node or kfd path alike.
@pytest.mark.parametrize(
    ("cmd", "kind", "name", "nr"),
    [
        (0xC0084B01, "/dev/kfd", "AMDKFD_IOC_GET_VERSION", 0x01),
        (0xC0584B02, "control", "AMDKFD_IOC_CREATE_QUEUE", 0x02),
        (0xC0284B16, "/dev/kfd", "AMDKFD_IOC_ALLOC_MEMORY_OF_GPU", 0x16),
        (0xC0184B18, "/dev/kfd", "AMDKFD_IOC_MAP_MEMORY_TO_GPU", 0x18),
        (0xC0204B20, "/dev/kfd", "AMDKFD_IOC_SVM", 0x20),
        (0xC0384B22, "/dev/kfd", "AMDKFD_IOC_CRIU_OP", 0x22),
    ],
)
def test_kfd(cmd: int, kind: str, name: str, nr: int) -> None:
    got = decode_ioctl(cmd, kind)
    assert (got.name, got.nr, got.type_char, got.label) == (name, nr, "K", f"{name}({nr:#x})")


@pytest.mark.parametrize(
    ("cmd", "kind", "label"),
    [
        (0xC0104699, "control", "UNKNOWN(0xc0104699)"),  # 'F' but no escape 0x99
        (0xC00846D6, "uvm", "UNKNOWN(0xc00846d6)"),  # an RM word on a UVM fd is not UVM
        (0x30000003, "uvm", "UNKNOWN(0x30000003)"),
        (8, "uvm", "UNKNOWN(0x00000008)"),  # a gap in the UVM numbers
        (0xC020462A, "/dev/kfd", "UNKNOWN(0xc020462a)"),  # NVIDIA escape on kfd
        (0xC0084B01, "uvm", "UNKNOWN(0xc0084b01)"),
        (0x5401, "gpu", "UNKNOWN(0x00005401)"),  # TCGETS: type 'T'
        (0, "control", "UNKNOWN(0x00000000)"),
        (0xFFFFFFFF, "other", "UNKNOWN(0xffffffff)"),
        (0xC0FF4BFF, "/dev/kfd", "UNKNOWN(0xc0ff4bff)"),  # 'K' past the known numbers
    ],
)
def test_unknown(cmd: int, kind: str, label: str) -> None:
    got = decode_ioctl(cmd, kind)
    assert (got.name, got.label, got.known) == ("UNKNOWN", label, False)


@pytest.mark.parametrize(
    ("cmd", "expected"),
    [
        (0xC020462A, (3, 0x46, 0x2A, 0x20)),
        (0x40084B01, (1, 0x4B, 0x01, 0x08)),
        (0x80044B05, (2, 0x4B, 0x05, 0x04)),
        (0x00004600, (0, 0x46, 0x00, 0)),
        (0x1_C020462A, (3, 0x46, 0x2A, 0x20)),  # widened by the tracepoint: only 32 bits count
    ],
)
def test_ioc_fields(cmd: int, expected: tuple[int, int, int, int]) -> None:
    assert ioc_fields(cmd) == expected


def test_sign_extended_word_is_truncated() -> None:
    # A 64-bit tracepoint field may carry a sign-extended request word.
    assert decode_ioctl(0xFFFFFFFF_C020462A, "control").name == "NV_ESC_RM_CONTROL"
