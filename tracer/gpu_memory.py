"""How many bytes of GPU memory each process holds, on each GPU, from the driver's own calls.

Pure: no I/O, no clock. Fed the `MemCall`s the driver accepted (tracer/memcalls.py; a refused call
never becomes a MemCall: the kernel side reads the ioctl's return value and the block's status
first, docs/reference/nvidia-ioctl-abi.md §1 step 5), it keeps the RM object tree RM keeps, as far
as the GPU memory figure needs it, and answers per process and device instance. docs/MEMORY.md has
the rules with their driver sources; each rule is written once below, where it is applied.

Paths to the driver source are in NVIDIA/open-gpu-kernel-modules (the tag of docs/reference/
nvidia-ioctl-abi.md §0).

What it tracks, and only that (so that the table's bound goes to what the figure needs): clients,
devices, subdevices, the memory objects that count (`MEMORY_CLASSES`) and their RM_DUP_OBJECT
copies, and a placeholder for a parent it never saw allocated. Every other RM object (channels,
engines, VA spaces, events, ...) can parent no counted memory: resserv's class table
(src/nvidia/src/kernel/rmapi/resource_list.h) lists Device and Subdevice as the only parents of
NV01_MEMORY_LOCAL_USER (VideoMemory).

Cost: `apply` is O(1) but for a free, which is O(the freed subtree) (a client: all its objects),
and a change of a memory's references, O(the processes sharing that memory).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

from ghostgpu.tracer.memcalls import MemCall, MemCallKind

# The node-wide bound on tracked objects when the config does not say. A CUDA process holds tens
# to hundreds of the objects tracked here (a client, a device and a subdevice per GPU it opens, one
# object per allocation RM made for it: allocators ask RM for large blocks and carve them up), so
# this covers hundreds of GPU processes on a node. A tracked object costs at most OBJECT_COST_BYTES
# of the tracer's memory (tests/unit/test_gpu_memory.py measures it): at most 40 MiB at the bound.
DEFAULT_MAX_OBJECTS = 131_072
OBJECT_COST_BYTES = 320

# Why a figure cannot be exact (`MemoryAccountant.incomplete`). Each makes it a lower bound. The
# classifier (tracer/classify.py) gives BEFORE_START, the same words, to a holder whose whole history
# the kernel did not see.
TABLE_FULL = "the RM object table was full"
BEFORE_START = "allocated before the tracer started"
SIZE_UNREAD = "the size of one of its allocations could not be read"
INSTANCE_UNREAD = "the GPU of one of its devices could not be read"

# RM classes the tree needs (src/common/sdk/nvidia/inc/class/clXXXX.h, nvos.h; docs/reference/
# nvidia-ioctl-abi.md §8). A client allocation names 0x0 or 0x1 and the driver writes 0x41 back
# (§3.1); the accountant accepts all three.
NV01_ROOT = 0x0000
NV01_ROOT_NON_PRIV = 0x0001
NV01_ROOT_CLIENT = 0x0041
CLIENT_CLASSES = frozenset({NV01_ROOT, NV01_ROOT_NON_PRIV, NV01_ROOT_CLIENT})
NV01_DEVICE_0 = 0x0080
NV20_SUBDEVICE_0 = 0x2080
NV01_MEMORY_LOCAL_USER = 0x0040

# NVOS32_ATTR_LOCATION is bits 26:25 of `attr` (src/common/sdk/nvidia/inc/nvos.h).
ATTR_LOCATION_SHIFT = 25
ATTR_LOCATION_MASK = 0x3
LOCATION_VIDMEM = 0
LOCATION_PCI = 1
LOCATION_AGP = 2
LOCATION_ANY = 3


def attr_location(attr: int) -> int:
    """NVOS32_ATTR_LOCATION of an `attr` word: 0 VIDMEM, 1 PCI, 2 AGP, 3 ANY (nvos.h)."""
    return (attr >> ATTR_LOCATION_SHIFT) & ATTR_LOCATION_MASK


@dataclass(frozen=True, slots=True)
class MemoryClass:
    """One row of the table of memory classes: does an allocation of it count, and why."""

    h_class: int
    name: str
    counts: bool
    why: str
    header: str  # under src/common/sdk/nvidia/inc/


# Which memory classes count. Only one does: the other memory classes allocate no video memory, or
# describe video memory some other object holds (counting them would count it twice), or are host
# memory, which NVML's used memory does not include either. docs/MEMORY.md shows this table; a
# test checks that they agree.
MEMORY_CLASSES: tuple[MemoryClass, ...] = (
    MemoryClass(0x0040, "NV01_MEMORY_LOCAL_USER", True,
                "video memory from the GPU's heap; RM refuses it unless attr's location is VIDMEM and "
                "the VIRTUAL flag is clear (vidmemConstruct, src/nvidia/src/kernel/mem_mgr/video_mem.c)",
                "class/cl0040.h"),
    MemoryClass(0x003F, "NV01_MEMORY_LOCAL_PRIVILEGED", False,
                "the GPU's register space (BAR0) as a memory object, nothing allocated "
                "(regmemConstruct, src/nvidia/src/kernel/mem_mgr/reg_mem.c)",
                "class/cl003f.h"),
    MemoryClass(0x00C2, "NV01_MEMORY_LOCAL_PHYSICAL", False,
                "a view of the whole framebuffer for privileged clients, nothing allocated "
                "(src/nvidia/src/kernel/mem_mgr/phys_mem.c)",
                "class/cl00c2.h"),
    MemoryClass(0x0070, "NV01_MEMORY_VIRTUAL", False,
                "a GPU virtual-address range, no physical memory (also NV01_MEMORY_SYSTEM_DYNAMIC)",
                "class/cl0070.h"),
    MemoryClass(0x50A0, "NV50_MEMORY_VIRTUAL", False,
                "a GPU virtual-address range, no physical memory "
                "(src/nvidia/src/kernel/mem_mgr/virtual_mem.c)",
                "class/cl50a0.h"),
    MemoryClass(0x90F1, "FERMI_VASPACE_A", False,
                "a GPU virtual address space (page tables are RM's own allocation), no memory of the "
                "process's",
                "class/cl90f1.h"),
    MemoryClass(0x003E, "NV01_MEMORY_SYSTEM", False,
                "host RAM (attr's location PCI), not GPU memory; NVML's used memory excludes it",
                "class/cl003e.h"),
    MemoryClass(0x0071, "NV01_MEMORY_SYSTEM_OS_DESCRIPTOR", False,
                "host RAM the process already had, pinned for the GPU; not GPU memory",
                "class/cl0071.h"),
    MemoryClass(0x90CE, "NV01_MEMORY_DEVICELESS", False,
                "host RAM under a client, no device at all (src/nvidia/src/kernel/mem_mgr/no_device_mem.c)",
                "class/cl90ce.h"),
    MemoryClass(0x00F8, "NV_MEMORY_FABRIC", False,
                "maps video memory that an NV01_MEMORY_LOCAL_USER object holds (map.hVidMem) into the "
                "NVLink fabric; that object is counted (src/nvidia/src/kernel/mem_mgr/mem_fabric.c)",
                "class/cl00f8.h"),
    MemoryClass(0x00F9, "NV_MEMORY_FABRIC_IMPORT_V2", False,
                "imports memory another process or node exported; the exporter holds it",
                "class/cl00f9.h"),
    MemoryClass(0x00FB, "NV_MEMORY_FABRIC_IMPORTED_REF", False,
                "a reference to imported fabric memory; the exporter holds it",
                "class/cl00fb.h"),
    MemoryClass(0x00FD, "NV_MEMORY_MULTICAST_FABRIC", False,
                "a multicast object; the video memory attached to it is allocated, and counted, as "
                "NV01_MEMORY_LOCAL_USER",
                "class/cl00fd.h"),
    MemoryClass(0x00E0, "NV_MEMORY_EXPORT", False,
                "a container of exported handles; the memory is held by the objects it names",
                "class/cl00e0.h"),
    MemoryClass(0x00FE, "NV_MEMORY_MAPPER", False,
                "maps memory other objects hold",
                "class/cl00fe.h"),
)
CLASS_BY_ID: dict[int, MemoryClass] = {c.h_class: c for c in MEMORY_CLASSES}
COUNTED_CLASSES = frozenset(c.h_class for c in MEMORY_CLASSES if c.counts)


def counts(call: MemCall) -> bool:
    """Whether an accepted allocation call made video memory that a process's figure counts.

    - RM_ALLOC: by class (`MEMORY_CLASSES`), and for a counted class the location bits must say
      VIDMEM; RM refuses anything else for that class, so this only guards against a misread attr.
    - RM_VID_HEAP_CONTROL ALLOC_SIZE: RM turns it into an allocation of NV50_MEMORY_VIRTUAL when
      the VIRTUAL flag is set, NV01_MEMORY_LOCAL_USER when attr's location is VIDMEM, else
      NV01_MEMORY_SYSTEM (_rmVidHeapControlAllocCommon,
      src/nvidia/interface/deprecated/rmapi_deprecated_vidheapctrl.c): the location bits decide,
      and a producer that read the flags names the class it chose in `h_class` (0: VIDMEM decides).
    - RM_ALLOC_MEMORY (NVOS02) never does: for NV01_MEMORY_LOCAL_USER it allocates
      NV01_MEMORY_LOCAL_PHYSICAL or NV01_MEMORY_SYSTEM_DYNAMIC, a handle on the whole framebuffer
      whose `limit` is the framebuffer's size, with nothing allocated; every other class it takes
      is host memory, registers, or memory that exists already (RmDeprecatedAllocMemory,
      src/nvidia/interface/deprecated/rmapi_deprecated_allocmemory.c).
    """
    if call.kind == MemCallKind.ALLOC:
        return call.h_class in COUNTED_CLASSES and attr_location(call.attr) == LOCATION_VIDMEM
    if call.kind == MemCallKind.HEAP_ALLOC:
        if call.h_class:
            return call.h_class in COUNTED_CLASSES
        return attr_location(call.attr) == LOCATION_VIDMEM
    return False


class _Kind(IntEnum):
    CLIENT = 1
    DEVICE = 2
    SUBDEVICE = 3
    MEMORY = 4
    PLACEHOLDER = 5  # a parent never seen allocated (before the tracer started, or dropped)


def _key(h_root: int, h_object: int) -> int:
    # (hClient, hObject) is unique on the node while the client lives (RM handles, docs/reference/
    # nvidia-ioctl-abi.md §3); both are 32-bit, one int is a cheaper dict key than a tuple.
    return (h_root << 32) | h_object


class _Obj:
    """One tracked RM object. A memory object carries its allocation's size; `group` is None until
    an RM_DUP_OBJECT copy of it exists, then the list of every object referring to that allocation
    (its own handle first, then the copies, oldest first), shared by all of them. Lean on purpose:
    the table holds up to `max_objects` of these."""

    __slots__ = ("children", "fd", "group", "instance", "key", "kind", "parent", "pid", "size_bytes")

    def __init__(self, kind: _Kind, key: int, parent: _Obj | None, instance: int | None,
                 pid: int, fd: int) -> None:
        self.kind = kind
        self.key = key
        self.parent = parent
        self.instance = instance
        self.pid = pid  # a client's: the process it was allocated by; others: their client's
        self.fd = fd  # a client's: the fd it was allocated through
        self.size_bytes = 0
        self.group: list[_Obj] | None = None
        self.children: set[_Obj] | None = None

    def refs(self) -> list[_Obj]:
        return self.group if self.group is not None else [self]


class MemoryAccountant:
    """The RM object tree of the node's GPU processes, as far as GPU memory needs it.

    A process's figure is what it holds now (allocated - freed), per device instance:
    `held(pid)`. Memory it only reaches through RM_DUP_OBJECT is `shared(pid)`, never in `held`,
    so summing `held` over processes counts each allocation once.
    """

    def __init__(self, max_objects: int = DEFAULT_MAX_OBJECTS) -> None:
        if max_objects < 1:
            raise ValueError(f"gpu memory accountant: max_objects {max_objects} is not positive; "
                             f"give at least 1 (default {DEFAULT_MAX_OBJECTS})")
        self.max_objects = max_objects
        # RM objects the table had no room for: one per accepted call that made an object and did not
        # fit (the client or parent it would have needed as a placeholder is not counted apart).
        self.dropped_objects_total = 0
        self._objects: dict[int, _Obj] = {}
        self._clients_by_fd: dict[tuple[int, int], set[int]] = {}  # (pid, fd) -> client keys
        self._clients_by_pid: dict[int, set[int]] = {}
        self._held: dict[int, dict[int | None, int]] = {}
        self._shared: dict[int, dict[int | None, int]] = {}
        self._incomplete: dict[int, str] = {}

    @property
    def objects(self) -> int:
        """Tracked RM objects, node-wide (at most `max_objects`)."""
        return len(self._objects)

    # --- the answers ---------------------------------------------------------------------------

    def held(self, pid: int) -> dict[int | None, int]:
        """Device instance -> bytes the process holds there; None: memory under no device object
        the accountant saw (its device was allocated before the tracer started). Empty: none."""
        return dict(self._held.get(pid, {}))

    def shared(self, pid: int) -> dict[int | None, int]:
        """Device instance -> bytes the process reaches only through RM_DUP_OBJECT copies of
        memory another process holds (counted in that one's `held`)."""
        return dict(self._shared.get(pid, {}))

    def incomplete(self, pid: int) -> str:
        """"" when the process's figure is exact, else why it is only a lower bound."""
        return self._incomplete.get(pid, "")

    # --- the calls -----------------------------------------------------------------------------

    def apply(self, call: MemCall) -> None:
        """One call the driver accepted."""
        kind = call.kind
        if kind == MemCallKind.ALLOC:
            self._alloc(call)
        elif kind == MemCallKind.HEAP_ALLOC:
            self._forget_stale(call.h_root, call.h_object)
            if counts(call):
                self._alloc_memory(call)
        elif kind == MemCallKind.ALLOC_MEMORY:
            # Nothing it makes counts or parents counted memory (see `counts`); a handle it reuses
            # means the old object's free was missed.
            self._forget_stale(call.h_root, call.h_object)
        elif kind in (MemCallKind.FREE, MemCallKind.HEAP_FREE):
            self._free(call.h_root, call.h_object)
        elif kind == MemCallKind.DUP:
            self._dup(call)
        elif kind == MemCallKind.CLOSE:
            self.close_fd(call.pid, call.fd)

    def close_fd(self, pid: int, fd: int) -> None:
        """The fd was closed (or exec closed it, CLOEXEC): RM frees every client allocated through
        it (rm_cleanup_file_private → RmFreeUnusedClients, src/nvidia/arch/nvalloc/unix/src/
        osapi.c)."""
        for key in list(self._clients_by_fd.get((pid, fd), ())):
            self._free_subtree(self._objects[key])

    def transfer_fd(self, pid: int, fd: int, to_pid: int, to_fd: int) -> bool:
        """The clients allocated through (pid, fd) now belong to (to_pid, to_fd): the process closed
        the fd (or exited) while another, forked from it, still holds the same open file. RM frees a
        file's clients only when the file itself is released, at its last reference (nvidia_close,
        kernel-open/nvidia/nv.c, then rm_cleanup_file_private → RmFreeUnusedClients, src/nvidia/arch/
        nvalloc/unix/src/osapi.c), so the memory lives on and is that process's now. A reason the
        figure was a lower bound goes with it. False when no client was allocated through it."""
        keys = self._clients_by_fd.pop((pid, fd), None)
        if not keys:
            return False
        for key in sorted(keys):
            client = self._objects[key]
            subtree = _subtree(client)
            memory = [obj for obj in subtree if obj.kind == _Kind.MEMORY]
            for obj in memory:
                self._count(obj.refs(), -1)
            for obj in subtree:
                obj.pid, obj.fd = to_pid, to_fd
            for obj in memory:
                self._count(obj.refs(), +1)
            by_pid = self._clients_by_pid.get(pid)
            if by_pid is not None:
                by_pid.discard(key)
                if not by_pid:
                    del self._clients_by_pid[pid]
            self._clients_by_pid.setdefault(to_pid, set()).add(key)
            self._clients_by_fd.setdefault((to_pid, to_fd), set()).add(key)
        if why := self._incomplete.get(pid):
            self._mark(to_pid, why)
        return True

    def process_exit(self, pid: int) -> None:
        """The process is gone: its fds closed, so every client it allocated is freed. Its state
        goes too (the pid may be reused)."""
        for key in list(self._clients_by_pid.get(pid, ())):
            self._free_subtree(self._objects[key])
        self._held.pop(pid, None)
        self._shared.pop(pid, None)
        self._incomplete.pop(pid, None)

    # --- allocation ----------------------------------------------------------------------------

    def _alloc(self, call: MemCall) -> None:
        h_class = call.h_class
        if h_class in CLIENT_CLASSES:
            # A client allocation's new handle is hObjectNew; it is the hRoot of later calls.
            self._forget_stale(call.h_object, call.h_object)
            if self._room(call.pid, 1):
                self._add_client(call.h_object, call.pid, call.fd)
            return
        self._forget_stale(call.h_root, call.h_object)
        if h_class == NV01_DEVICE_0:
            # NV0080_ALLOC_PARAMETERS.deviceId: the device instance, which names the GPU
            # (class/cl0080.h; docs/reference/nvidia-ioctl-abi.md §4.1). None: the kernel side could
            # not read pAllocParms, and the memory under it is on no GPU the figure can name.
            if call.instance is None:
                self._mark(call.pid, INSTANCE_UNREAD)
            self._add_node(call, _Kind.DEVICE, lambda parent: call.instance)
        elif h_class == NV20_SUBDEVICE_0:
            # NV2080_ALLOC_PARAMETERS.subDeviceId numbers the subdevices of one device (SLI), 0 on
            # every GPU otherwise (class/cl2080.h): the GPU is its parent device's instance.
            self._add_node(call, _Kind.SUBDEVICE, lambda parent: parent.instance)
        elif counts(call):
            self._alloc_memory(call)

    def _alloc_memory(self, call: MemCall) -> None:
        if call.size_bytes <= 0:
            self._mark(call.pid, SIZE_UNREAD)
            return
        # The memory belongs to the GPU of the nearest device above it: VideoMemory's parents are
        # Device or Subdevice (resource_list.h), and a subdevice carries its device's instance.
        obj = self._add_node(call, _Kind.MEMORY, lambda parent: parent.instance)
        if obj is not None:
            obj.size_bytes = call.size_bytes
            self._count(obj.refs(), +1)

    def _add_node(self, call: MemCall, kind: _Kind, instance_of: Callable[[_Obj], int | None]) -> _Obj | None:
        """Adds an object under its parent (made a placeholder when never seen), and under its
        client (an implicit one when never seen). None when the table has no room."""
        client = self._objects.get(_key(call.h_root, call.h_root))
        parent = client if call.h_parent == call.h_root else self._objects.get(
            _key(call.h_root, call.h_parent))
        need = 1 + (client is None) + (parent is None and call.h_parent != call.h_root)
        owner_pid = client.pid if client is not None else call.pid
        if not self._room(owner_pid, need):
            return None
        if client is None:
            # A client allocated before the tracer started (or dropped): it belongs to the fd the
            # call came through, since RM serves a client only on the fd that allocated it.
            client = self._add_client(call.h_root, call.pid, call.fd)
            self._mark(call.pid, BEFORE_START)
        if parent is None:
            if call.h_parent == call.h_root:
                parent = client
            else:
                parent = self._attach(_Obj(_Kind.PLACEHOLDER, _key(call.h_root, call.h_parent),
                                           client, None, client.pid, client.fd))
                self._mark(client.pid, BEFORE_START)
        return self._attach(_Obj(kind, _key(call.h_root, call.h_object), parent, instance_of(parent),
                                 client.pid, client.fd))

    def _add_client(self, h_root: int, pid: int, fd: int) -> _Obj:
        key = _key(h_root, h_root)
        obj = _Obj(_Kind.CLIENT, key, None, None, pid, fd)
        self._objects[key] = obj
        self._clients_by_fd.setdefault((pid, fd), set()).add(key)
        self._clients_by_pid.setdefault(pid, set()).add(key)
        return obj

    def _attach(self, obj: _Obj) -> _Obj:
        self._objects[obj.key] = obj
        parent = obj.parent
        assert parent is not None
        if parent.children is None:
            parent.children = set()
        parent.children.add(obj)
        return obj

    def _room(self, pid: int, need: int) -> bool:
        # Bounded: an object that does not fit is counted and makes its process's figure a lower
        # bound, never silently low.
        if len(self._objects) + need <= self.max_objects:
            return True
        self.dropped_objects_total += 1
        self._mark(pid, TABLE_FULL)
        return False

    def _mark(self, pid: int, reason: str) -> None:
        self._incomplete.setdefault(pid, reason)

    # --- RM_DUP_OBJECT -------------------------------------------------------------------------

    def _dup(self, call: MemCall) -> None:
        self._forget_stale(call.h_root, call.h_object)
        src = self._objects.get(_key(call.src_client, call.src_object))
        if src is None or src.kind == _Kind.CLIENT:
            return  # not memory, or allocated before the tracer started: nothing to share
        if src.kind == _Kind.MEMORY:
            # The copy refers to the same allocation (vidmemCopyConstruct takes a reference on the
            # same heap block, video_mem.c): shared for its process, never counted twice.
            obj = self._add_node(call, _Kind.MEMORY, lambda parent: src.instance)
            if obj is None:
                return
            obj.size_bytes = src.size_bytes
            refs = src.refs()
            self._count(refs, -1)
            if src.group is None:
                src.group = refs
            refs.append(obj)
            obj.group = refs
            self._count(refs, +1)
        else:
            # A device or subdevice copied into another client: memory allocated under the copy is
            # on the same GPU.
            self._add_node(call, src.kind, lambda parent: src.instance)

    def _count(self, refs: list[_Obj], sign: int) -> None:
        """Adds (or takes away) what one allocation contributes: held by the process of its oldest
        reference (the allocation's own handle while it lives: when that is freed while copies
        remain, RM keeps the memory alive and it moves to the oldest copy, so sums per GPU stay
        right), shared by every other process that refers to it."""
        if not refs:
            return
        first = refs[0]
        delta = sign * first.size_bytes
        inst = first.instance
        owner = first.pid
        _add(self._held, owner, inst, delta)
        if len(refs) > 1:
            for pid in {r.pid for r in refs[1:]} - {owner}:
                _add(self._shared, pid, inst, delta)

    # --- frees ---------------------------------------------------------------------------------

    def _free(self, h_root: int, h_object: int) -> None:
        # RM_FREE frees the object and everything under it; hObjectOld == hRoot frees the client
        # (NVOS00_PARAMETERS, nvos.h; docs/reference/nvidia-ioctl-abi.md §3.3). RM_VID_HEAP_CONTROL
        # FREE is RmFree(hRoot, hMemory) (_nvos32FunctionFree, rmapi_deprecated_vidheapctrl.c).
        # A handle not tracked is ignored: allocated before the tracer started, or not memory.
        obj = self._objects.get(_key(h_root, h_object))
        if obj is not None:
            self._free_subtree(obj)

    def _forget_stale(self, h_root: int, h_object: int) -> None:
        # RM hands out a handle again only after it was freed: a live entry under it means its
        # free was missed; drop it rather than count it forever.
        stale = self._objects.get(_key(h_root, h_object))
        if stale is not None:
            self._free_subtree(stale)

    def _free_subtree(self, top: _Obj) -> None:
        parent = top.parent
        if parent is not None and parent.children is not None:
            parent.children.discard(top)
        stack = [top]
        while stack:
            obj = stack.pop()
            if obj.children:
                stack.extend(obj.children)
            del self._objects[obj.key]
            if obj.kind == _Kind.MEMORY:
                self._forget_ref(obj)
            if obj.kind == _Kind.CLIENT:
                self._forget_client(obj)

    def _forget_ref(self, obj: _Obj) -> None:
        refs = obj.refs()
        self._count(refs, -1)
        if obj.group is not None:
            refs.remove(obj)
            obj.group = None
            self._count(refs, +1)

    def _forget_client(self, client: _Obj) -> None:
        by_fd = self._clients_by_fd.get((client.pid, client.fd))
        if by_fd is not None:
            by_fd.discard(client.key)
            if not by_fd:
                del self._clients_by_fd[(client.pid, client.fd)]
        by_pid = self._clients_by_pid.get(client.pid)
        if by_pid is not None:
            by_pid.discard(client.key)
            if not by_pid:
                del self._clients_by_pid[client.pid]


def _subtree(top: _Obj) -> list[_Obj]:
    out: list[_Obj] = []
    stack = [top]
    while stack:
        obj = stack.pop()
        out.append(obj)
        if obj.children:
            stack.extend(obj.children)
    return out


def _add(table: dict[int, dict[int | None, int]], pid: int, inst: int | None, delta: int) -> None:
    per_gpu = table.setdefault(pid, {})
    total = per_gpu.get(inst, 0) + delta
    if total:
        per_gpu[inst] = total
    else:
        per_gpu.pop(inst, None)
        if not per_gpu:
            del table[pid]


def memory_split(used_bytes: int | None, listed_bytes: int | None, unlisted_bytes: int,
                 ) -> tuple[int | None, int, int | None]:
    """One GPU's used memory split three ways: (listed, unlisted, unaccounted).

    listed: what NVML attributes to the processes it lists on the GPU; unlisted: the known driver-call
    figures (`held`) of the consumers NVML does not list there; unaccounted: the rest of NVML's
    used memory, max(0, used - listed - unlisted). Unlisted is always known: an unlisted consumer
    whose figure is unknown adds nothing to it, so what it holds is in unaccounted. An unknown used
    or listed figure makes unaccounted unknown (None): unknown is not zero.

    Floored at 0 because the parts can add up to more than used: NVML's used memory (v2) leaves
    out the memory the driver reserves for itself, while a process's figures can include some of
    it (NVML's per-process figure counts the context's RM-internal buffers; docs/MEMORY.md).
    """
    if used_bytes is None or listed_bytes is None:
        return listed_bytes, unlisted_bytes, None
    return listed_bytes, unlisted_bytes, max(0, used_bytes - listed_bytes - unlisted_bytes)
