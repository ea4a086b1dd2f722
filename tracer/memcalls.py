"""The driver's memory calls as the tracer sees them: one `MemCall` per RM call the driver accepted
(the ioctl returned 0 and the block's status is NV_OK) that creates, shares or frees an RM object.

Two producers, one shape: the kernel side (bpf/alloc.bpf.c, read at the ioctl's exit and decoded by
tracer/bpf_source.py), and the decoder of an LD_PRELOAD recording (tracer/memcall_decode.py, used
by bench/gpu_real_check.sh). One consumer: the accountant (tracer/gpu_memory.py), which keeps the
RM object tree and says how many bytes each process holds on each GPU.

Handles are RM's (docs/reference/nvidia-ioctl-abi.md §3): a client handle (`h_root`) is unique on
the node while the client lives, so (h_root, h_object) names one object node-wide.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class MemCallKind(IntEnum):
    """bpf/alloc.bpf.c GG_MC_*: the numbers are shared with the kernel side."""

    ALLOC = 1  # NV_ESC_RM_ALLOC (NVOS21/NVOS64), also inside NV_ESC_IOCTL_XFER_CMD; RM_ALLOC_OBJECT
    ALLOC_MEMORY = 2  # NV_ESC_RM_ALLOC_MEMORY (NVOS02): size = limit + 1
    HEAP_ALLOC = 3  # NV_ESC_RM_VID_HEAP_CONTROL, function ALLOC_SIZE: h_object = hMemory
    HEAP_FREE = 4  # NV_ESC_RM_VID_HEAP_CONTROL, function FREE: h_object = hMemory
    FREE = 5  # NV_ESC_RM_FREE (NVOS00): h_object = hObjectOld; == h_root frees the whole client
    DUP = 6  # NV_ESC_RM_DUP_OBJECT (NVOS55): h_object is the new handle, src_* the object shared
    CLOSE = 7  # the fd an RM client was allocated through was closed: RM frees that client (h_* 0)


@dataclass(frozen=True, slots=True)
class MemCall:
    kind: MemCallKind
    ts_ns: int  # since boot (CLOCK_BOOTTIME)
    pid: int  # host tgid of the caller
    fd: int  # the fd the call was made on (a client belongs to the fd it was allocated through)
    h_root: int  # the client (DUP: hClient, the destination client)
    h_parent: int
    h_object: int  # the object made (ALLOC, ALLOC_MEMORY, DUP), or freed (FREE), or hMemory (HEAP_*)
    h_class: int = 0  # ALLOC, ALLOC_MEMORY: the class as the driver wrote it back (a client: 0x41)
    size_bytes: int = 0  # memory the driver accepted: the allocation parameters' size after the call
    attr: int = 0  # memory attributes (NVOS32_ATTR_*: the location bits say video or system memory)
    instance: int | None = None  # NV01_DEVICE_0: deviceId; NV20_SUBDEVICE_0: subDeviceId
    src_client: int = 0  # DUP: hClientSrc
    src_object: int = 0  # DUP: hObjectSrc
