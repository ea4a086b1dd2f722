"""The layout and name tables against docs/reference/nvidia-ioctl-abi.md, row by row.

Each table below is copied from the sheet (§2, §5.2, §9.2, §9.4, §6 to §8) independently of
tracer/nvabi.py, so a typo on either side fails here.
"""

from __future__ import annotations

import pytest
from ghostgpu.tracer import nvabi
from ghostgpu.tracer.call_decode import CAPTURE_MAX, iowr, layout_for
from ghostgpu.tracer.ioctl_decode import NV_ESCAPES, NV_REMOVED, UVM_IOCTLS
from ghostgpu.tracer.nvabi import NO_STATUS, RM_BLOCKS, UVM_BLOCKS, Layout
from ghostgpu.tracer.nvabi_names import CONTROL_CLASS_NAMES, NV_STATUS_NAMES, RM_CLASS_NAMES, RM_CONTROLS

N = NO_STATUS
# §2 at 595.45.04: (escape, struct, bytes, _IOWR word, NV_STATUS offset).
SHEET_595 = [
    ("NV_ESC_RM_ALLOC_MEMORY", "nv_ioctl_nvos02_parameters_with_fd", 56, 0xC0384627, 40),
    ("NV_ESC_RM_ALLOC_OBJECT", "NVOS05_PARAMETERS", 20, 0xC0144628, 16),
    ("NV_ESC_RM_FREE", "NVOS00_PARAMETERS", 16, 0xC0104629, 12),
    ("NV_ESC_RM_CONTROL", "NVOS54_PARAMETERS", 32, 0xC020462A, 28),
    ("NV_ESC_RM_ALLOC", "NVOS21_PARAMETERS", 32, 0xC020462B, 28),
    ("NV_ESC_RM_ALLOC", "NVOS64_PARAMETERS", 48, 0xC030462B, 40),
    ("NV_ESC_RM_DUP_OBJECT", "NVOS55_PARAMETERS", 28, 0xC01C4634, 24),
    ("NV_ESC_RM_SHARE", "NVOS57_PARAMETERS", 24, 0xC0184635, 20),
    ("NV_ESC_RM_I2C_ACCESS", "NVOS_I2C_ACCESS_PARAMS", 32, 0xC0204639, 24),
    ("NV_ESC_RM_IDLE_CHANNELS", "NVOS30_PARAMETERS", 56, 0xC0384641, 48),
    ("NV_ESC_RM_VID_HEAP_CONTROL", "NVOS32_PARAMETERS", 184, 0xC0B8464A, 20),
    ("NV_ESC_RM_ACCESS_REGISTRY", "NVOS38_PARAMETERS", 72, 0xC048464D, 64),
    ("NV_ESC_RM_MAP_MEMORY", "nv_ioctl_nvos33_parameters_with_fd", 56, 0xC038464E, 40),
    ("NV_ESC_RM_UNMAP_MEMORY", "NVOS34_PARAMETERS", 32, 0xC020464F, 24),
    ("NV_ESC_RM_GET_EVENT_DATA", "NVOS41_PARAMETERS", 16, 0xC0104652, 12),
    ("NV_ESC_RM_ALLOC_CONTEXT_DMA2", "NVOS39_PARAMETERS", 56, 0xC0384654, 48),
    ("NV_ESC_RM_MAP_MEMORY_DMA", "NVOS46_PARAMETERS", 64, 0xC0404657, 56),
    ("NV_ESC_RM_UNMAP_MEMORY_DMA", "NVOS47_PARAMETERS", 48, 0xC0304658, 40),
    ("NV_ESC_RM_BIND_CONTEXT_DMA", "NVOS49_PARAMETERS", 16, 0xC0104659, 12),
    ("NV_ESC_RM_UPDATE_DEVICE_MAPPING_INFO", "NVOS56_PARAMETERS", 40, 0xC028465E, 32),
    ("NV_ESC_RM_LOCKLESS_DIAGNOSTIC", "NV_LOCKLESS_DIAGNOSTIC_PARAMS", 15412, 0xFC34465F, 4),
    ("NV_ESC_CARD_INFO", "nv_ioctl_card_info_t", 72, 0xC04846C8, N),
    ("NV_ESC_REGISTER_FD", "nv_ioctl_register_fd_t", 4, 0xC00446C9, N),
    ("NV_ESC_ALLOC_OS_EVENT", "nv_ioctl_alloc_os_event_t", 16, 0xC01046CE, 12),
    ("NV_ESC_FREE_OS_EVENT", "nv_ioctl_free_os_event_t", 16, 0xC01046CF, 12),
    ("NV_ESC_STATUS_CODE", "nv_ioctl_status_code_t", 12, 0xC00C46D1, 8),
    ("NV_ESC_CHECK_VERSION_STR", "nv_ioctl_rm_api_version_t", 72, 0xC04846D2, N),
    ("NV_ESC_IOCTL_XFER_CMD", "nv_ioctl_xfer_t", 16, 0xC01046D3, N),
    ("NV_ESC_ATTACH_GPUS_TO_FD", "NvU32", 4, 0xC00446D4, N),
    ("NV_ESC_QUERY_DEVICE_INTR", "nv_ioctl_query_device_intr_t", 8, 0xC00846D5, 4),
    ("NV_ESC_SYS_PARAMS", "nv_ioctl_sys_params_t", 8, 0xC00846D6, N),
    ("NV_ESC_NUMA_INFO", "nv_ioctl_numa_info_t", 560, 0xC23046D7, N),
    ("NV_ESC_SET_NUMA_STATUS", "nv_ioctl_set_numa_status_t", 4, 0xC00446D8, N),
    ("NV_ESC_EXPORT_TO_DMABUF_FD", "nv_ioctl_export_to_dma_buf_fd_t", 2608, 0xCA3046D9, 2600),
    ("NV_ESC_WAIT_OPEN_COMPLETE", "nv_ioctl_wait_open_complete_t", 8, 0xC00846DA, 4),
]
NO_HANDLER = {0x56, 0x5C, 0x5D}  # §2: defined, no handler in any tag checked


def test_every_escape_has_a_block_or_is_known_to_have_none() -> None:
    with_block = {b.nr for b in RM_BLOCKS}
    assert with_block | NO_HANDLER | NV_REMOVED == set(NV_ESCAPES)
    assert not with_block & (NO_HANDLER | NV_REMOVED)
    assert len(RM_BLOCKS) == len(SHEET_595)


@pytest.mark.parametrize(("escape", "struct_name", "size", "word", "status"), SHEET_595)
def test_595_blocks_as_the_sheet_lists_them(escape: str, struct_name: str, size: int, word: int,
                                            status: int) -> None:
    [block] = [b for b in RM_BLOCKS if b.struct == struct_name]
    assert NV_ESCAPES[block.nr] == escape
    assert block.history[-1][1:] == (size, status)
    assert iowr(block.nr, size) == word
    if escape != "NV_ESC_IOCTL_XFER_CMD":
        assert layout_for("595.45.04").kernel_layouts()[word] == (min(size, CAPTURE_MAX), status)


# §5.2 "bytes/status@" per column, every changed block, checked at every compared tag of a column.
COLUMNS = {
    "515": ("515.43.04", "520.56.06"), "525": ("525.47.04", "530.30.02"),
    "535": ("535.43.02", "535.288.01", "545.23.06"),
    "550": ("550.40.07", "550.163.01", "555.42.02", "560.28.03", "565.57.01", "570.86.15", "570.211.01",
            "575.51.02"),
    "580": ("580.65.06", "580.142", "590.44.01", "595.45.04"),
}
HISTORY_52 = [  # columns 515, 525, 535, 550, 580
    ("NVOS21_PARAMETERS", [(32, 24), (32, 24), (32, 28), (32, 28), (32, 28)]),
    ("NVOS64_PARAMETERS", [(40, 32), (40, 36), (48, 40), (48, 40), (48, 40)]),
    ("NVOS46_PARAMETERS", [(56, 48), (56, 48), (56, 48), (56, 48), (64, 56)]),
    ("NVOS47_PARAMETERS", [(40, 32), (40, 32), (40, 32), (48, 40), (48, 40)]),
    ("nv_ioctl_numa_info_t", [(552, N), (552, N), (560, N), (560, N), (560, N)]),
]


@pytest.mark.parametrize(("struct_name", "row"), HISTORY_52)
def test_rm_history_52(struct_name: str, row: list[tuple[int, int]]) -> None:
    [block] = [b for b in RM_BLOCKS if b.struct == struct_name]
    for tags, want in zip(COLUMNS.values(), row, strict=True):
        for tag in tags:
            assert nvabi.layout_at(block.history, tag)[1:] == want, tag  # type: ignore[index]


@pytest.mark.parametrize(("struct_name", "tag", "want"), [
    ("nv_ioctl_export_to_dma_buf_fd_t", "565.57.01", (2600, 2592)),
    ("nv_ioctl_export_to_dma_buf_fd_t", "570.86.15", (2608, 2600)),
    ("nv_ioctl_export_to_dma_buf_fd_t", "515.43.04", (2600, 2592)),
    ("NV_LOCKLESS_DIAGNOSTIC_PARAMS", "535.288.01", None),
    ("NV_LOCKLESS_DIAGNOSTIC_PARAMS", "545.23.06", (4024, 4)),
    ("NV_LOCKLESS_DIAGNOSTIC_PARAMS", "550.40.07", (4024, 4)),
    ("NV_LOCKLESS_DIAGNOSTIC_PARAMS", "550.163.01", (15412, 4)),
    ("NV_LOCKLESS_DIAGNOSTIC_PARAMS", "560.28.03", (4024, 4)),
    ("NV_LOCKLESS_DIAGNOSTIC_PARAMS", "570.211.01", (15412, 4)),
    ("nv_ioctl_wait_open_complete_t", "545.23.06", None),
    ("nv_ioctl_wait_open_complete_t", "550.40.07", (8, 4)),
])
def test_rm_history_odd_rows(struct_name: str, tag: str, want: tuple[int, int] | None) -> None:
    [block] = [b for b in RM_BLOCKS if b.struct == struct_name]
    got = nvabi.layout_at(block.history, tag)
    assert (got[1:] if got else None) == want


# §9.4 columns and rows (number -> per column); None = not there.
UVM_COLUMNS = {
    "515-545": ("515.43.04", "525.47.04", "535.43.02", "535.288.01", "545.23.06"), "550.40": ("550.40.07",),
    "550.163": ("550.163.01", "555.42.02"), "560": ("560.28.03",), "565": ("565.57.01",),
    "570-580": ("570.86.15", "570.211.01", "575.51.02", "580.65.06", "580.142"),
    "590": ("590.44.01", "595.45.04"),
}
_COLS = tuple(UVM_COLUMNS)
HISTORY_94 = [
    (33, [(1200, 1196)] * 2 + [(9264, 9260)] * 5),
    (68, [(1184, 1176)] * 2 + [(9248, 9240)] * 5),
    (42, [(40, 32)] + [(40, 36)] * 6),
    (56, [(56, 48), (56, 48), (64, 48), (56, 52), (56, 48), (56, 48), (56, 48)]),
    (64, [(16, 12), (16, 12), (24, 12), (16, 12), (16, 8), (16, 8), (16, 8)]),
    (34, [(24, 16)] * 6 + [(16, 8)]),
    (28, [(28, 24)] * 6 + [(12, 8)]),
]


@pytest.mark.parametrize(("number", "row"), HISTORY_94)
def test_uvm_history_94(number: int, row: list[tuple[int, int]]) -> None:
    history = nvabi.uvm_history(number)
    for column, want in zip(_COLS, row, strict=True):
        for tag in UVM_COLUMNS[column]:
            assert nvabi.layout_at(history, tag)[1:] == want, (UVM_IOCTLS[number], tag)  # type: ignore[index]
    assert history[-1][1:] == UVM_BLOCKS[number]


@pytest.mark.parametrize(("number", "absent", "present"), [
    (75, "525.47.04", "535.43.02"), (76, "560.28.03", "565.57.01"), (77, "560.28.03", "565.57.01"),
    (78, "560.28.03", "565.57.01"), (79, "560.28.03", "565.57.01"), (80, "575.51.02", "580.65.06"),
])
def test_uvm_newest_numbers(number: int, absent: str, present: str) -> None:
    history = nvabi.uvm_history(number)
    assert nvabi.layout_at(history, absent) is None
    assert nvabi.layout_at(history, present)[1:] == UVM_BLOCKS[number]  # type: ignore[index]


def test_uvm_tables_consistent() -> None:
    assert set(UVM_BLOCKS) <= set(UVM_IOCTLS)
    # §9.2 lists every number UVM_IOCTLS has except the Windows-only and removed ones.
    assert set(UVM_IOCTLS) - set(UVM_BLOCKS) == {9, 11, 18, 19, 21, 22, 36, 54, 55}
    assert set(nvabi.UVM_FIELDS) <= set(UVM_IOCTLS.values())
    assert UVM_BLOCKS[0x30000001] == (16, 8) and UVM_BLOCKS[37] == (40, 36) and UVM_BLOCKS[2047] == (8, 4)


def test_histories_are_ordered_compared_tags() -> None:
    histories = [(b.history, nvabi.RM_TAGS) for b in RM_BLOCKS]
    histories += [(nvabi.uvm_history(n), nvabi.UVM_TAGS) for n in UVM_BLOCKS]
    for history, tags in histories:
        keys = [nvabi.version_key(entry.since) for entry in history]
        assert keys == sorted(keys) and len(set(keys)) == len(keys)
        assert all(entry.since in tags for entry in history)
        assert all(0 < entry.size <= nvabi.IOC_SIZE_MASK or entry.size == 0 for entry in history)
        assert all(entry.status == N or entry.status + 4 <= entry.size for entry in history)


def test_fields_fit_their_blocks() -> None:
    layouts: dict[str, list[Layout]] = {b.struct: list(b.history) for b in RM_BLOCKS}
    for number in UVM_BLOCKS:
        layouts[UVM_IOCTLS[number]] = list(nvabi.uvm_history(number))
    for key, fields in (nvabi.RM_FIELDS | nvabi.UVM_FIELDS).items():
        assert key in layouts, key
        for f in fields:
            shapes = [(lay.size, lay.status) for lay in layouts[key]]
            assert set(f.only) <= set(shapes), (key, f)
            for size, status in (f.only or shapes):
                assert f.off + f.size <= size, (key, f)
                assert status == N or f.off + f.size <= status or f.off >= status + 4, (key, f)


def test_fields_notation() -> None:
    got = nvabi.fields("hClient@0 offset@16/8 length@24/8:d gpu@0/16:uuid")
    assert [(f.name, f.off, f.size, f.fmt) for f in got] == [
        ("hClient", 0, 4, "x"), ("offset", 16, 8, "x"), ("length", 24, 8, "d"), ("gpu", 0, 16, "uuid")]


@pytest.mark.parametrize(("version", "key"), [
    ("550.54.15", (550, 54, 15)), ("580.142", (580, 142)), (" 595.45.04\n", (595, 45, 4)),
    ("", None), ("550", None), ("550.54.x", None), ("v550.54", None),
])
def test_version_key(version: str, key: tuple[int, ...] | None) -> None:
    assert nvabi.version_key(version) == key


@pytest.mark.parametrize(("version", "covered", "base", "upper"), [
    ("515.43.04", True, "515.43.04", None),
    ("550.54.15", True, "550.40.07", "550.163.01"),
    ("550.163.01", True, "550.163.01", None),
    ("550.100", True, "550.40.07", "550.163.01"),  # numeric: 100 > 40, < 163
    ("580.95.05", True, "580.65.06", "580.142"),
    ("595.45.04", True, "595.45.04", None),
    ("595.45.05", False, None, None),
    ("999.1", False, None, None),
    ("470.82.01", False, None, None),
])
def test_covers_and_bracket(version: str, covered: bool, base: str | None, upper: str | None) -> None:
    assert nvabi.covers(version) is covered
    if covered:
        assert nvabi.bracket(nvabi.RM_TAGS, version) == (base, upper)


# §6: every row of the two-column table.
STATUS_ROWS = [
    (0x0, "NV_OK"), (0x2, "NV_ERR_BUFFER_TOO_SMALL"), (0x16, "NV_ERR_ILLEGAL_ACTION"),
    (0x1F, "NV_ERR_INVALID_ARGUMENT"), (0x3A, "NV_ERR_INVALID_PARAM_STRUCT"), (0x51, "NV_ERR_NO_MEMORY"),
    (0x56, "NV_ERR_NOT_SUPPORTED"), (0x81, "NV_ERR_NVLINK_FABRIC_NOT_READY"), (0xFFFF, "NV_ERR_GENERIC"),
    (0x10005, "NV_WARN_MORE_PROCESSING_REQUIRED"), (0x10008, "NV_WARN_OUT_OF_RANGE"),
]


@pytest.mark.parametrize(("value", "name"), STATUS_ROWS)
def test_status_names(value: int, name: str) -> None:
    assert NV_STATUS_NAMES[value] == name


def test_name_table_sizes_and_shapes() -> None:
    assert len(NV_STATUS_NAMES) == 60
    assert len(RM_CONTROLS) == 108  # "All 108 values" (§7)
    assert len(RM_CLASS_NAMES) == 95  # 96 rows, 0x41 named twice
    assert CONTROL_CLASS_NAMES[0x41] == "NV04_MEMORY" and RM_CLASS_NAMES[0x41] == "NV01_ROOT_CLIENT"
    assert all(n.startswith(("NV_OK", "NV_ERR_", "NV_WARN_")) for n in NV_STATUS_NAMES.values())
    for cmd, (name, size) in RM_CONTROLS.items():
        assert "_CTRL_CMD_" in name and size > 0 and cmd <= 0xFFFFFFFF
        prefix = name.split("_CTRL_")[0]  # NV2080 ... is class 0x2080
        assert int(prefix[2:], 16) == cmd >> 16, name
