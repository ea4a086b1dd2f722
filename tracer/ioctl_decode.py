"""Names for GPU ioctl request words, from the facts in docs/reference/nvidia-devices.md.

NVIDIA frontend/RM escapes on /dev/nvidiactl and /dev/nvidiaN are _IOWR('F', nr, size): they are
named by nr only, because the size part differs between parameter structs (RM_ALLOC takes NVOS21
or NVOS64) and may change between driver branches. UVM ioctls on /dev/nvidia-uvm are plain
numbers (UVM_IOCTL_BASE(i) is i), not _IOC words. AMD KFD ioctls are _IOC words of type 'K'.
Pure functions; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

NV_IOCTL_MAGIC = 0x46  # 'F'
KFD_IOCTL_MAGIC = 0x4B  # 'K'
IOC_DIR_NAMES = {0: "none", 1: "write", 2: "read", 3: "readwrite"}  # asm-generic _IOC_NONE/WRITE/READ

# docs/reference/nvidia-devices.md §2b (frontend escapes, NV_IOCTL_BASE 200 + i, and RM escapes).
NV_ESCAPES: dict[int, str] = {
    0xC8: "NV_ESC_CARD_INFO",
    0xC9: "NV_ESC_REGISTER_FD",
    0xCE: "NV_ESC_ALLOC_OS_EVENT",
    0xCF: "NV_ESC_FREE_OS_EVENT",
    0xD1: "NV_ESC_STATUS_CODE",
    0xD2: "NV_ESC_CHECK_VERSION_STR",
    0xD3: "NV_ESC_IOCTL_XFER_CMD",  # the real escape is the first u32 of the argument
    0xD4: "NV_ESC_ATTACH_GPUS_TO_FD",
    0xD5: "NV_ESC_QUERY_DEVICE_INTR",
    0xD6: "NV_ESC_SYS_PARAMS",
    0xD7: "NV_ESC_NUMA_INFO",
    0xD8: "NV_ESC_SET_NUMA_STATUS",
    0xD9: "NV_ESC_EXPORT_TO_DMABUF_FD",
    0xDA: "NV_ESC_WAIT_OPEN_COMPLETE",  # since 550.40.07
    0x27: "NV_ESC_RM_ALLOC_MEMORY",
    0x28: "NV_ESC_RM_ALLOC_OBJECT",
    0x29: "NV_ESC_RM_FREE",
    0x2A: "NV_ESC_RM_CONTROL",
    0x2B: "NV_ESC_RM_ALLOC",
    0x32: "NV_ESC_RM_CONFIG_GET",  # removed in 595.44.02
    0x33: "NV_ESC_RM_CONFIG_SET",  # removed in 595.44.02
    0x34: "NV_ESC_RM_DUP_OBJECT",
    0x35: "NV_ESC_RM_SHARE",
    0x37: "NV_ESC_RM_CONFIG_GET_EX",  # removed in 595.44.02
    0x38: "NV_ESC_RM_CONFIG_SET_EX",  # removed in 595.44.02
    0x39: "NV_ESC_RM_I2C_ACCESS",
    0x41: "NV_ESC_RM_IDLE_CHANNELS",
    0x4A: "NV_ESC_RM_VID_HEAP_CONTROL",
    0x4D: "NV_ESC_RM_ACCESS_REGISTRY",
    0x4E: "NV_ESC_RM_MAP_MEMORY",
    0x4F: "NV_ESC_RM_UNMAP_MEMORY",
    0x52: "NV_ESC_RM_GET_EVENT_DATA",
    0x54: "NV_ESC_RM_ALLOC_CONTEXT_DMA2",
    0x56: "NV_ESC_RM_ADD_VBLANK_CALLBACK",
    0x57: "NV_ESC_RM_MAP_MEMORY_DMA",
    0x58: "NV_ESC_RM_UNMAP_MEMORY_DMA",
    0x59: "NV_ESC_RM_BIND_CONTEXT_DMA",
    0x5C: "NV_ESC_RM_EXPORT_OBJECT_TO_FD",
    0x5D: "NV_ESC_RM_IMPORT_OBJECT_FROM_FD",
    0x5E: "NV_ESC_RM_UPDATE_DEVICE_MAPPING_INFO",
    0x5F: "NV_ESC_RM_LOCKLESS_DIAGNOSTIC",  # since 545.23.06
}
NV_REMOVED = frozenset({0x32, 0x33, 0x37, 0x38})

# docs/reference/nvidia-devices.md §3: the request word is the number itself. Older numbers stay:
# none was ever reassigned, and nodes run old drivers.
UVM_IOCTLS: dict[int, str] = {
    0x30000001: "UVM_INITIALIZE",
    0x30000002: "UVM_DEINITIALIZE",
    1: "UVM_RESERVE_VA",
    2: "UVM_RELEASE_VA",
    3: "UVM_REGION_COMMIT",
    4: "UVM_REGION_DECOMMIT",
    5: "UVM_REGION_SET_STREAM",
    6: "UVM_SET_STREAM_RUNNING",
    7: "UVM_SET_STREAM_STOPPED",
    9: "UVM_RUN_TEST",
    10: "UVM_ADD_SESSION",
    11: "UVM_REMOVE_SESSION",
    12: "UVM_ENABLE_COUNTERS",
    13: "UVM_MAP_COUNTER",
    14: "UVM_CREATE_EVENT_QUEUE",
    15: "UVM_REMOVE_EVENT_QUEUE",
    16: "UVM_MAP_EVENT_QUEUE",
    17: "UVM_EVENT_CTRL",
    18: "UVM_REGISTER_MPS_SERVER",
    19: "UVM_REGISTER_MPS_CLIENT",
    20: "UVM_GET_GPU_UUID_TABLE",
    21: "UVM_REGION_SET_BACKING",
    22: "UVM_REGION_UNSET_BACKING",
    23: "UVM_CREATE_RANGE_GROUP",
    24: "UVM_DESTROY_RANGE_GROUP",
    25: "UVM_REGISTER_GPU_VASPACE",
    26: "UVM_UNREGISTER_GPU_VASPACE",
    27: "UVM_REGISTER_CHANNEL",
    28: "UVM_UNREGISTER_CHANNEL",
    29: "UVM_ENABLE_PEER_ACCESS",
    30: "UVM_DISABLE_PEER_ACCESS",
    31: "UVM_SET_RANGE_GROUP",
    33: "UVM_MAP_EXTERNAL_ALLOCATION",
    34: "UVM_FREE",
    35: "UVM_MEM_MAP",
    36: "UVM_DEBUG_ACCESS_MEMORY",
    37: "UVM_REGISTER_GPU",
    38: "UVM_UNREGISTER_GPU",
    39: "UVM_PAGEABLE_MEM_ACCESS",
    40: "UVM_PREVENT_MIGRATION_RANGE_GROUPS",
    41: "UVM_ALLOW_MIGRATION_RANGE_GROUPS",
    42: "UVM_SET_PREFERRED_LOCATION",
    43: "UVM_UNSET_PREFERRED_LOCATION",
    44: "UVM_ENABLE_READ_DUPLICATION",
    45: "UVM_DISABLE_READ_DUPLICATION",
    46: "UVM_SET_ACCESSED_BY",
    47: "UVM_UNSET_ACCESSED_BY",
    51: "UVM_MIGRATE",
    53: "UVM_MIGRATE_RANGE_GROUP",
    54: "UVM_ENABLE_SYSTEM_WIDE_ATOMICS",
    55: "UVM_DISABLE_SYSTEM_WIDE_ATOMICS",
    56: "UVM_TOOLS_INIT_EVENT_TRACKER",
    57: "UVM_TOOLS_SET_NOTIFICATION_THRESHOLD",
    58: "UVM_TOOLS_EVENT_QUEUE_ENABLE_EVENTS",
    59: "UVM_TOOLS_EVENT_QUEUE_DISABLE_EVENTS",
    60: "UVM_TOOLS_ENABLE_COUNTERS",
    61: "UVM_TOOLS_DISABLE_COUNTERS",
    62: "UVM_TOOLS_READ_PROCESS_MEMORY",
    63: "UVM_TOOLS_WRITE_PROCESS_MEMORY",
    64: "UVM_TOOLS_GET_PROCESSOR_UUID_TABLE",
    65: "UVM_MAP_DYNAMIC_PARALLELISM_REGION",
    66: "UVM_UNMAP_EXTERNAL",
    67: "UVM_TOOLS_FLUSH_EVENTS",
    68: "UVM_ALLOC_SEMAPHORE_POOL",
    69: "UVM_CLEAN_UP_ZOMBIE_RESOURCES",
    70: "UVM_PAGEABLE_MEM_ACCESS_ON_GPU",
    71: "UVM_POPULATE_PAGEABLE",
    72: "UVM_VALIDATE_VA_RANGE",
    73: "UVM_CREATE_EXTERNAL_RANGE",
    74: "UVM_MAP_EXTERNAL_SPARSE",
    75: "UVM_MM_INITIALIZE",  # since 535.43.02
    76: "UVM_TOOLS_INIT_EVENT_TRACKER_V2",  # since 565.57.01
    77: "UVM_TOOLS_GET_PROCESSOR_UUID_TABLE_V2",  # since 565.57.01
    78: "UVM_ALLOC_DEVICE_P2P",  # since 565.57.01
    79: "UVM_CLEAR_ALL_ACCESS_COUNTERS",  # since 565.57.01
    80: "UVM_DISCARD",  # since 580.65.06
    2047: "UVM_IS_8_SUPPORTED",
}
UVM_REMOVED = frozenset({9, 11, 18, 19, 36, 54, 55})

# docs/reference/nvidia-devices.md §4 (Linux include/uapi/linux/kfd_ioctl.h), by nr.
KFD_IOCTLS: dict[int, str] = {
    0x01: "AMDKFD_IOC_GET_VERSION",
    0x02: "AMDKFD_IOC_CREATE_QUEUE",
    0x03: "AMDKFD_IOC_DESTROY_QUEUE",
    0x04: "AMDKFD_IOC_SET_MEMORY_POLICY",
    0x05: "AMDKFD_IOC_GET_CLOCK_COUNTERS",
    0x06: "AMDKFD_IOC_GET_PROCESS_APERTURES",
    0x07: "AMDKFD_IOC_UPDATE_QUEUE",
    0x08: "AMDKFD_IOC_CREATE_EVENT",
    0x09: "AMDKFD_IOC_DESTROY_EVENT",
    0x0A: "AMDKFD_IOC_SET_EVENT",
    0x0B: "AMDKFD_IOC_RESET_EVENT",
    0x0C: "AMDKFD_IOC_WAIT_EVENTS",
    0x11: "AMDKFD_IOC_SET_SCRATCH_BACKING_VA",
    0x12: "AMDKFD_IOC_GET_TILE_CONFIG",
    0x13: "AMDKFD_IOC_SET_TRAP_HANDLER",
    0x14: "AMDKFD_IOC_GET_PROCESS_APERTURES_NEW",
    0x15: "AMDKFD_IOC_ACQUIRE_VM",
    0x16: "AMDKFD_IOC_ALLOC_MEMORY_OF_GPU",
    0x17: "AMDKFD_IOC_FREE_MEMORY_OF_GPU",
    0x18: "AMDKFD_IOC_MAP_MEMORY_TO_GPU",
    0x19: "AMDKFD_IOC_UNMAP_MEMORY_FROM_GPU",
    0x1A: "AMDKFD_IOC_SET_CU_MASK",
    0x1B: "AMDKFD_IOC_GET_QUEUE_WAVE_STATE",
    0x1C: "AMDKFD_IOC_GET_DMABUF_INFO",
    0x1D: "AMDKFD_IOC_IMPORT_DMABUF",
    0x1E: "AMDKFD_IOC_ALLOC_QUEUE_GWS",
    0x1F: "AMDKFD_IOC_SMI_EVENTS",
    0x20: "AMDKFD_IOC_SVM",
    0x21: "AMDKFD_IOC_SET_XNACK_MODE",
    0x22: "AMDKFD_IOC_CRIU_OP",
}


@dataclass(frozen=True)
class IoctlName:
    cmd: int  # the request word as traced (32 bits)
    name: str  # "NV_ESC_RM_CONTROL", "UVM_REGISTER_GPU", "UNKNOWN"
    nr: int  # _IOC_NR for _IOC words; the whole number for UVM
    size: int  # _IOC_SIZE (bytes of the parameter block); 0 for UVM
    dir: int  # _IOC_DIR: 0 none, 1 write, 2 read, 3 read+write; 0 for UVM
    type_char: str  # _IOC_TYPE as a character ("F", "K"); "" for UVM
    label: str  # "NV_ESC_RM_CONTROL(0x2a)" or "UNKNOWN(0xc0104699)"
    removed: bool = False  # known from older drivers only

    @property
    def known(self) -> bool:
        return self.name != "UNKNOWN"


def ioc_fields(cmd: int) -> tuple[int, int, int, int]:
    """(dir, type, nr, size) of an asm-generic _IOC word (x86_64, arm64)."""
    cmd &= 0xFFFFFFFF
    return cmd >> 30, (cmd >> 8) & 0xFF, cmd & 0xFF, (cmd >> 16) & 0x3FFF


def _family(device_kind: str) -> str:
    """'uvm', 'kfd' or '' (decide by the _IOC type) from a DeviceKind value or a device path."""
    kind = device_kind.lower()
    if "uvm" in kind:
        return "uvm"
    if "kfd" in kind:
        return "kfd"
    return ""


def _unknown(cmd: int, dir_: int, type_: int, nr: int, size: int) -> IoctlName:
    type_char = chr(type_) if 0x20 < type_ < 0x7F else ""
    return IoctlName(cmd, "UNKNOWN", nr, size, dir_, type_char, f"UNKNOWN({cmd:#010x})")


def decode_ioctl(cmd: int, device_kind: str) -> IoctlName:
    """Name an ioctl request word seen on a device of `device_kind` (a DeviceKind value such as
    "gpu", "control", "uvm", or a device path such as "/dev/nvidia-uvm", "/dev/kfd")."""
    cmd &= 0xFFFFFFFF
    dir_, type_, nr, size = ioc_fields(cmd)
    family = _family(device_kind)
    if family == "uvm":
        name = UVM_IOCTLS.get(cmd)
        if name is None:
            return _unknown(cmd, 0, 0, cmd, 0)
        return IoctlName(cmd, name, cmd, 0, 0, "", f"{name}({cmd:#x})", cmd in UVM_REMOVED)
    if type_ == KFD_IOCTL_MAGIC and family in ("kfd", ""):
        name = KFD_IOCTLS.get(nr)
    elif type_ == NV_IOCTL_MAGIC and family == "":
        name = NV_ESCAPES.get(nr)
    else:
        name = None
    if name is None:
        return _unknown(cmd, dir_, type_, nr, size)
    removed = type_ == NV_IOCTL_MAGIC and nr in NV_REMOVED
    return IoctlName(cmd, name, nr, size, dir_, chr(type_), f"{name}({nr:#x})", removed)
