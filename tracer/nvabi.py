"""Parameter-block layouts of NVIDIA ioctls by driver release, from docs/reference/nvidia-ioctl-abi.md.

Each block has a history: the layouts (bytes, offset of the u32 NV_STATUS / rmStatus) it had, each
from the first compared driver tag that has it. The sheet compiled every block against the headers
of a fixed set of tags (RM_TAGS, UVM_TAGS); a driver between two tags gets the layout of the older
one, and `changed_between` says which blocks differ across that gap (the change happened somewhere
in it). Upstream headers, all in NVIDIA/open-gpu-kernel-modules: frontend blocks in
kernel-open/common/inc/nv-ioctl.h and nv-ioctl-numa.h; NVOS* in src/common/sdk/nvidia/inc/nvos.h;
the *_with_fd wrappers in src/nvidia/arch/nvalloc/unix/include/nv-unix-nvos-params-wrappers.h;
NV_LOCKLESS_DIAGNOSTIC_PARAMS in .../unix/include/nv-ioctl-lockless-diag.h; UVM in
kernel-open/nvidia-uvm/uvm_ioctl.h and uvm_linux_ioctl.h. Escape and UVM names are
tracer/ioctl_decode.py's NV_ESCAPES and UVM_IOCTLS. Data and pure helpers; no I/O.
"""

from __future__ import annotations

from typing import NamedTuple

NO_STATUS = 0xFFFF  # the block has no NV_STATUS field
XFER_NR = 211  # NV_ESC_IOCTL_XFER_CMD: its nv_ioctl_xfer_t carries another escape's nr, size, ptr
IOC_SIZE_MASK = 0x3FFF  # _IOC_SIZE is 14 bits

OLDEST = "515.43.04"
BASELINE = "595.45.04"  # the sheet's tag: every block at its newest layout
# §5.2: the tags whose RM and frontend blocks were compiled and compared, plus the baseline.
RM_TAGS = (OLDEST, "520.56.06", "525.47.04", "530.30.02", "535.43.02", "535.288.01", "545.23.06",
           "550.40.07", "550.163.01", "555.42.02", "560.28.03", "565.57.01", "570.86.15", "570.211.01",
           "575.51.02", "580.65.06", "580.142", "590.44.01", BASELINE)
# §9.4: the tags whose UVM blocks were compared (520 and 530 were not).
UVM_TAGS = tuple(t for t in RM_TAGS if t not in ("520.56.06", "530.30.02"))


class Layout(NamedTuple):
    since: str  # the first compared tag with this layout
    size: int  # bytes of the block (of one element, for an array escape)
    status: int  # byte offset of the u32 status, or NO_STATUS


class Block(NamedTuple):
    nr: int  # _IOC_NR of the escape
    struct: str  # the C type it carries
    history: tuple[Layout, ...]
    array: bool = False  # element[n]: the kernel takes any non-zero multiple of `size`


def _same(size: int, status: int, since: str = OLDEST) -> tuple[Layout, ...]:
    """A block that compiled identical in every compared tag it exists in (§5.2, §9.4)."""
    return (Layout(since, size, status),)


# §2 (595.45.04) with §5.2's history. No block: 0x56, 0x5C, 0x5D (no handler in any tag checked)
# and the NV_ESC_RM_CONFIG_* escapes removed in 595.44.02.
RM_BLOCKS: tuple[Block, ...] = (
    Block(0x27, "nv_ioctl_nvos02_parameters_with_fd", _same(56, 40)),
    Block(0x28, "NVOS05_PARAMETERS", _same(20, 16)),
    Block(0x29, "NVOS00_PARAMETERS", _same(16, 12)),
    Block(0x2A, "NVOS54_PARAMETERS", _same(32, 28)),
    # RM_ALLOC takes either struct and picks it by the block size (escape.c). 515-530: NVOS21 has
    # no paramsSize and its status is @24; the same 32 bytes put it @28 from 535.43.02 on, so the
    # version, not the size, says where NVOS21's status is.
    Block(0x2B, "NVOS21_PARAMETERS", (Layout(OLDEST, 32, 24), Layout("535.43.02", 32, 28))),
    Block(0x2B, "NVOS64_PARAMETERS", (Layout(OLDEST, 40, 32), Layout("525.47.04", 40, 36),
                                      Layout("535.43.02", 48, 40))),
    Block(0x34, "NVOS55_PARAMETERS", _same(28, 24)),
    Block(0x35, "NVOS57_PARAMETERS", _same(24, 20)),
    Block(0x39, "NVOS_I2C_ACCESS_PARAMS", _same(32, 24)),
    Block(0x41, "NVOS30_PARAMETERS", _same(56, 48)),
    Block(0x4A, "NVOS32_PARAMETERS", _same(184, 20)),
    Block(0x4D, "NVOS38_PARAMETERS", _same(72, 64)),
    Block(0x4E, "nv_ioctl_nvos33_parameters_with_fd", _same(56, 40)),
    Block(0x4F, "NVOS34_PARAMETERS", _same(32, 24)),
    Block(0x52, "NVOS41_PARAMETERS", _same(16, 12)),
    Block(0x54, "NVOS39_PARAMETERS", _same(56, 48)),
    # 580.65.06 added flags2@36 and kindOverride@40 and moved dmaOffset to @48.
    Block(0x57, "NVOS46_PARAMETERS", (Layout(OLDEST, 56, 48), Layout("580.65.06", 64, 56))),
    # 550.40.07 added `size`@32.
    Block(0x58, "NVOS47_PARAMETERS", (Layout(OLDEST, 40, 32), Layout("550.40.07", 48, 40))),
    Block(0x59, "NVOS49_PARAMETERS", _same(16, 12)),
    Block(0x5E, "NVOS56_PARAMETERS", _same(40, 32)),
    # Not in 535.x; the params union grew in 550.163.01 and 570 but not in 555-565.
    Block(0x5F, "NV_LOCKLESS_DIAGNOSTIC_PARAMS", (
        Layout("545.23.06", 4024, 4), Layout("550.163.01", 15412, 4), Layout("555.42.02", 4024, 4),
        Layout("570.86.15", 15412, 4))),
    Block(0xC8, "nv_ioctl_card_info_t", _same(72, NO_STATUS), array=True),
    Block(0xC9, "nv_ioctl_register_fd_t", _same(4, NO_STATUS)),
    Block(0xCE, "nv_ioctl_alloc_os_event_t", _same(16, 12)),
    Block(0xCF, "nv_ioctl_free_os_event_t", _same(16, 12)),
    Block(0xD1, "nv_ioctl_status_code_t", _same(12, 8)),
    Block(0xD2, "nv_ioctl_rm_api_version_t", _same(72, NO_STATUS)),  # reply@4 is not a status
    Block(0xD3, "nv_ioctl_xfer_t", _same(16, NO_STATUS)),  # the carried block has the status
    Block(0xD4, "NvU32", _same(4, NO_STATUS), array=True),  # gpu_ids[n]
    Block(0xD5, "nv_ioctl_query_device_intr_t", _same(8, 4)),
    Block(0xD6, "nv_ioctl_sys_params_t", _same(8, NO_STATUS)),
    # Its status@4 is a NUMA state (0-6), not an NV_STATUS. 535.43.02 added use_auto_online@32.
    Block(0xD7, "nv_ioctl_numa_info_t", (Layout(OLDEST, 552, NO_STATUS),
                                         Layout("535.43.02", 560, NO_STATUS))),
    Block(0xD8, "nv_ioctl_set_numa_status_t", _same(4, NO_STATUS)),
    # 570.86.15 added mappingType@32; 580.65.06 added bAllowMmap@33 with the same size and status.
    Block(0xD9, "nv_ioctl_export_to_dma_buf_fd_t", (Layout(OLDEST, 2600, 2592),
                                                    Layout("570.86.15", 2608, 2600))),
    Block(0xDA, "nv_ioctl_wait_open_complete_t", _same(8, 4, "550.40.07")),  # adapterStatus@4
)

# §9.1, §9.2: UVM number -> (bytes, rmStatus offset) at 595.45.04. 21 and 22 are Windows-only.
UVM_BLOCKS: dict[int, tuple[int, int]] = {
    0x30000001: (16, 8),  # UVM_INITIALIZE (uvm_linux_ioctl.h)
    0x30000002: (0, NO_STATUS),  # UVM_DEINITIALIZE: no params
    1: (24, 16), 2: (24, 16), 3: (48, 40), 4: (24, 16), 5: (48, 40), 6: (16, 8), 7: (272, 264),
    10: (8, 4), 12: (904, 900), 13: (40, 32), 14: (40, 36), 15: (8, 4), 16: (56, 48), 17: (16, 12),
    20: (520, 516), 23: (16, 8), 24: (16, 8), 25: (32, 28), 26: (20, 16), 27: (56, 48), 28: (12, 8),
    29: (36, 32), 30: (36, 32), 31: (32, 24), 33: (9264, 9260), 34: (16, 8), 35: (24, 16),
    37: (40, 36), 38: (20, 16), 39: (8, 4), 40: (272, 264), 41: (272, 264), 42: (40, 36),
    43: (24, 16), 44: (24, 16), 45: (24, 16), 46: (40, 32), 47: (40, 32), 51: (80, 72), 53: (32, 24),
    56: (56, 48), 57: (8, 4), 58: (16, 8), 59: (16, 8), 60: (16, 8), 61: (16, 8), 62: (40, 32),
    63: (40, 32), 64: (16, 8), 65: (40, 32), 66: (40, 32), 67: (4, 0), 68: (9248, 9240),
    69: (4, 0), 70: (24, 20), 71: (24, 20), 72: (24, 16), 73: (24, 16), 74: (40, 32), 75: (8, 4),
    76: (56, 48), 77: (16, 8), 78: (56, 52), 79: (4, 0), 80: (32, 24), 2047: (8, 4),
}
# §9.4: the blocks whose layout changed, their whole history (the last entry is the one above).
UVM_CHANGED: dict[int, tuple[Layout, ...]] = {
    # The per-GPU attribute arrays grew between 550.40.07 and 550.163.01 (the branch alone does not
    # pick the layout); base, length and offset before them did not move.
    33: (Layout(OLDEST, 1200, 1196), Layout("550.163.01", 9264, 9260)),  # MAP_EXTERNAL_ALLOCATION
    68: (Layout(OLDEST, 1184, 1176), Layout("550.163.01", 9248, 9240)),  # ALLOC_SEMAPHORE_POOL
    42: (Layout(OLDEST, 40, 32), Layout("550.40.07", 40, 36)),  # SET_PREFERRED_LOCATION
    56: (Layout(OLDEST, 56, 48), Layout("550.163.01", 64, 48), Layout("560.28.03", 56, 52),
         Layout("565.57.01", 56, 48)),  # TOOLS_INIT_EVENT_TRACKER
    64: (Layout(OLDEST, 16, 12), Layout("550.163.01", 24, 12), Layout("560.28.03", 16, 12),
         Layout("565.57.01", 16, 8)),  # TOOLS_GET_PROCESSOR_UUID_TABLE
    34: (Layout(OLDEST, 24, 16), Layout("590.44.01", 16, 8)),  # FREE
    28: (Layout(OLDEST, 28, 24), Layout("590.44.01", 12, 8)),  # UNREGISTER_CHANNEL
}
# §9.4: numbers newer than the oldest tag, with the first compared tag that has them.
UVM_SINCE: dict[int, str] = {75: "535.43.02", 76: "565.57.01", 77: "565.57.01", 78: "565.57.01",
                             79: "565.57.01", 80: "580.65.06"}
UVM_TEST_BASE = 200  # UVM_TEST_IOCTL_BASE(i) = 200 + i (uvm_test_ioctl.h): test builds only


def uvm_history(number: int) -> tuple[Layout, ...]:
    """Every layout UVM ioctl `number` had in the compared tags; () for a number with no block."""
    if number in UVM_CHANGED:
        return UVM_CHANGED[number]
    if number not in UVM_BLOCKS:
        return ()
    return _same(*UVM_BLOCKS[number], since=UVM_SINCE.get(number, OLDEST))


def version_key(version: str) -> tuple[int, ...] | None:
    """(550, 54, 15) for "550.54.15": compared numerically, component by component; None if not a
    dotted number."""
    parts = version.strip().split(".")
    if len(parts) < 2 or not all(p.isdigit() for p in parts):
        return None
    return tuple(int(p) for p in parts)


def _key(version: str) -> tuple[int, ...]:
    key = version_key(version)
    if key is None:
        raise ValueError(f"not a driver version: {version!r}")
    return key


def covers(version: str) -> bool:
    """Whether `version` lies within the compared tags (OLDEST to BASELINE)."""
    key = version_key(version)
    return key is not None and _key(OLDEST) <= key <= _key(BASELINE)


def bracket(tags: tuple[str, ...], version: str) -> tuple[str, str | None]:
    """For a covered `version`: the newest tag at or below it, and the next tag above it when it
    falls strictly between two tags (None when it is a tag itself)."""
    key = _key(version)
    below = [t for t in tags if _key(t) <= key]
    base = below[-1]
    return base, (None if _key(base) == key else tags[len(below)])


def layout_at(history: tuple[Layout, ...], tag: str) -> Layout | None:
    """The layout a block has at a compared tag; None when it does not exist there yet."""
    found = None
    for layout in history:
        if _key(layout.since) <= _key(tag):
            found = layout
    return found


def changed_between(history: tuple[Layout, ...], base: str, upper: str | None) -> bool:
    """Whether a block's layout differs between two consecutive compared tags."""
    return upper is not None and layout_at(history, base) != layout_at(history, upper)


class Field(NamedTuple):
    name: str  # the key in DecodedCall.args
    off: int
    size: int  # bytes
    fmt: str  # "x" hex (handles, flags, addresses), "d" decimal (sizes, counts), "i" signed (fds),
    # "uuid" (16 raw bytes, shown GPU-xxxxxxxx-...), "str" (NUL-terminated, as far as captured)
    only: tuple[tuple[int, int], ...] = ()  # the layouts (bytes, status@) it exists in; () = all


def fields(spec: str, only: tuple[tuple[int, int], ...] = ()) -> tuple[Field, ...]:
    """Fields in the sheet's notation, "hClient@0 offset@16/8 length@24/8:d": 4 bytes and hex
    unless a /size or :fmt says otherwise."""
    out = []
    for item in spec.split():
        name, _, rest = item.partition("@")
        rest, _, fmt = rest.partition(":")
        off, _, size = rest.partition("/")
        out.append(Field(name, int(off), int(size or 4), fmt or "x", only))
    return tuple(out)


# RM_ALLOC's two structs share their first five fields (asserted in escape.c) in every tag; the
# handles keep the names the rest of the RM API gives them (hRoot is the client, ...).
_ALLOC_HEAD = fields("hClient@0 hParent@4 hObject@8 hClass@12")
_BASE_LEN = "base@0/8 length@8/8:d"

# Input fields by struct (§3, §4). Only the entry block is captured, so outputs are left out, and
# fields past CAPTURE_MAX bytes (the *_with_fd wrappers' fd@48, ...) appear only in longer blocks.
RM_FIELDS: dict[str, tuple[Field, ...]] = {
    "nv_ioctl_nvos02_parameters_with_fd": _ALLOC_HEAD + fields("flags@16 limit@32/8 fd@48:i"),
    "NVOS05_PARAMETERS": _ALLOC_HEAD,
    "NVOS00_PARAMETERS": fields("hClient@0 hParent@4 hObject@8"),  # hObject = hClient frees the client
    "NVOS54_PARAMETERS": fields("hClient@0 hObject@4 cmd@8 flags@12 paramsSize@24:d"),
    "NVOS21_PARAMETERS": _ALLOC_HEAD + fields("paramsSize@24:d", only=((32, 28),)),
    "NVOS64_PARAMETERS": _ALLOC_HEAD + fields("flags@32", only=((40, 36),))
    + fields("paramsSize@32:d flags@36", only=((48, 40),)),
    "NVOS55_PARAMETERS": fields("hClient@0 hParent@4 hObject@8 hClientSrc@12 hObjectSrc@16 flags@20"),
    "NVOS57_PARAMETERS": fields("hClient@0 hObject@4"),
    "NVOS_I2C_ACCESS_PARAMS": fields("hClient@0 hDevice@4 paramSize@8:d"),
    "NVOS30_PARAMETERS": fields("hClient@0 hDevice@4 hChannel@8 numChannels@12:d flags@40 timeout@44:d"),
    "NVOS32_PARAMETERS": fields("hClient@0 hParent@4 function@8:d hVASpace@12 ivcHeapNumber@16/2:i"),
    "NVOS38_PARAMETERS": fields("hClient@0 hObject@4 AccessType@8:d DevNodeLength@12:d ParmStrLength@24:d "
                                "BinaryDataLength@40:d"),
    "nv_ioctl_nvos33_parameters_with_fd": fields("hClient@0 hDevice@4 hMemory@8 offset@16/8 length@24/8:d "
                                                 "flags@44 fd@48:i"),
    "NVOS34_PARAMETERS": fields("hClient@0 hDevice@4 hMemory@8 pLinearAddress@16/8 flags@28"),
    "NVOS39_PARAMETERS": fields("hParent@0 hSubDevice@4 hObject@8 hClass@12 flags@16 selector@20 hMemory@24 "
                                "offset@32/8 limit@40/8"),
    # The fields before flags2 did not move in 580.65.06 (§5.2 names only what it added).
    "NVOS46_PARAMETERS": fields("hClient@0 hDevice@4 hDma@8 hMemory@12 offset@16/8 length@24/8:d flags@32")
    + fields("flags2@36 kindOverride@40 dmaOffset@48/8", only=((64, 56),)),
    "NVOS47_PARAMETERS": fields("hClient@0 hDevice@4 hDma@8 hMemory@12 flags@16 dmaOffset@24/8")
    + fields("size@32/8:d", only=((48, 40),)),
    "NVOS49_PARAMETERS": fields("hClient@0 hChannel@4 hCtxDma@8"),
    "NVOS56_PARAMETERS": fields("hClient@0 hDevice@4 hMemory@8 pOldCpuAddress@16/8 pNewCpuAddress@24/8"),
    "NV_LOCKLESS_DIAGNOSTIC_PARAMS": fields("cmd@0"),
    # The first entry; nv_pci_info_t sits @4 (domain@4, bus@8, slot@9, function@10, ids @12, @14).
    "nv_ioctl_card_info_t": fields("valid@0/1:d domain@4 bus@8/1 slot@9/1 function@10/1 vendor_id@12/2 "
                                   "device_id@14/2 gpu_id@16 interrupt_line@20/2:d reg_address@24/8 "
                                   "reg_size@32/8:d fb_address@40/8 fb_size@48/8:d minor_number@56:d "
                                   "dev_name@60/10:str"),
    "nv_ioctl_register_fd_t": fields("ctl_fd@0:i"),
    "nv_ioctl_alloc_os_event_t": fields("hClient@0 hDevice@4 fd@8:i"),
    "nv_ioctl_free_os_event_t": fields("hClient@0 hDevice@4 fd@8:i"),
    "nv_ioctl_status_code_t": fields("domain@0 bus@4/1 slot@5/1"),
    "nv_ioctl_rm_api_version_t": fields("cmd@0 reply@4:d versionString@8/64:str"),
    "nv_ioctl_xfer_t": fields("cmd@0:d size@4:d ptr@8/8"),
    "nv_ioctl_sys_params_t": fields("memblock_size@0/8:d"),
    "nv_ioctl_numa_info_t": fields("nid@0:i"),
    "nv_ioctl_set_numa_status_t": fields("numaStatus@0:d"),  # a NUMA state 0-6, not an NV_STATUS
    "nv_ioctl_export_to_dma_buf_fd_t": fields("fd@0:i hClient@4 totalObjects@8:d numObjects@12:d index@16:d "
                                              "totalSize@24/8:d")
    + fields("mappingType@32/1:d", only=((2608, 2600),)),
}

# §9.3, by UVM name. Fields of a block whose layout changed are given for the layout the sheet
# lays out (595.45.04) only, except MAP_EXTERNAL_ALLOCATION and ALLOC_SEMAPHORE_POOL, where only
# the per-GPU array after base and length grew.
_TRACKER = fields("queueBuffer@0/8 queueBufferSize@8/8:d controlBuffer@16/8 processor@24/16:uuid "
                  "allProcessors@40:d uvmFd@44:i", only=((56, 48),))
UVM_FIELDS: dict[str, tuple[Field, ...]] = {
    "UVM_INITIALIZE": fields("flags@0/8"),
    "UVM_MM_INITIALIZE": fields("uvmFd@0:i"),
    "UVM_REGISTER_GPU": fields("gpu_uuid@0/16:uuid rmCtrlFd@24:i hClient@28 hSmcPartRef@32"),
    "UVM_UNREGISTER_GPU": fields("gpu_uuid@0/16:uuid"),
    "UVM_REGISTER_GPU_VASPACE": fields("gpuUuid@0/16:uuid rmCtrlFd@16:i hClient@20 hVaSpace@24"),
    "UVM_UNREGISTER_GPU_VASPACE": fields("gpuUuid@0/16:uuid"),
    "UVM_REGISTER_CHANNEL": fields("gpuUuid@0/16:uuid rmCtrlFd@16:i hClient@20 hChannel@24 base@32/8 "
                                   "length@40/8:d"),
    "UVM_UNREGISTER_CHANNEL": fields("hClient@0 hChannel@4", only=((12, 8),)),
    "UVM_CREATE_RANGE_GROUP": fields("rangeGroupId@0/8:d"),
    "UVM_ENABLE_PEER_ACCESS": fields("gpuUuidA@0/16:uuid gpuUuidB@16/16:uuid"),
    "UVM_CREATE_EXTERNAL_RANGE": fields(_BASE_LEN),
    "UVM_MAP_EXTERNAL_ALLOCATION": fields(_BASE_LEN + " offset@16/8"),
    "UVM_FREE": fields("base@0/8", only=((16, 8),)),
    "UVM_SET_PREFERRED_LOCATION": fields("requestedBase@0/8 length@8/8:d preferredLocation@16/16:uuid "
                                         "preferredCpuNumaNode@32:i", only=((40, 36),)),
    "UVM_SET_ACCESSED_BY": fields("requestedBase@0/8 length@8/8:d accessedByUuid@16/16:uuid"),
    "UVM_MIGRATE": fields(_BASE_LEN + " destinationUuid@16/16:uuid flags@32 semaphoreAddress@40/8 "
                          "semaphorePayload@48:d cpuNumaNode@52:i"),
    "UVM_MAP_DYNAMIC_PARALLELISM_REGION": fields(_BASE_LEN + " gpuUuid@16/16:uuid"),
    "UVM_UNMAP_EXTERNAL": fields(_BASE_LEN + " gpuUuid@16/16:uuid"),
    "UVM_ALLOC_SEMAPHORE_POOL": fields(_BASE_LEN),
    "UVM_VALIDATE_VA_RANGE": fields(_BASE_LEN),
    "UVM_POPULATE_PAGEABLE": fields(_BASE_LEN + " flags@16"),
    "UVM_TOOLS_INIT_EVENT_TRACKER": _TRACKER,
    "UVM_TOOLS_INIT_EVENT_TRACKER_V2": _TRACKER,  # the V1 struct (§9.2)
}
