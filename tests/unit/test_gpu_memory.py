"""tracer/gpu_memory.py: the RM object tree, who holds how much GPU memory on which GPU, the split of
a GPU's used memory.

Call sequences are written as the driver accepted them: a refused call (the ioctl failed, or the
block's status was not NV_OK) never becomes a MemCall, which the kernel side sees to
(tests/integration/test_alloc_capture.py), so nothing here has a status to check.
"""

from __future__ import annotations

import json
import random
import re
import tracemalloc
from pathlib import Path

import pytest
from ghostgpu.tracer.gpu_memory import (
    BEFORE_START,
    DEFAULT_MAX_OBJECTS,
    INSTANCE_UNREAD,
    MEMORY_CLASSES,
    OBJECT_COST_BYTES,
    SIZE_UNREAD,
    TABLE_FULL,
    MemoryAccountant,
    attr_location,
    counts,
    memory_split,
)
from ghostgpu.tracer.memcalls import MemCall, MemCallKind

REPO = Path(__file__).resolve().parents[2]
K = MemCallKind
MiB = 1 << 20
GiB = 1 << 30

A, B, C = 100, 200, 300  # pids
FD = 5  # the nvidiactl fd each process allocates its client through
CA, CB, CC = 0xC1D00001, 0xC1D00002, 0xC1D00003  # client handles of A, B, C
DEV0, DEV1 = 0x5C000001, 0x5C000002
SUB0, SUB1 = 0x5C000011, 0x5C000012
M1, M2, M3 = 0xCAF00001, 0xCAF00002, 0xCAF00003
PCI = 1 << 25  # NVOS32_ATTR_LOCATION_PCI
ANY = 3 << 25  # NVOS32_ATTR_LOCATION_ANY
CLIENT_OF = {A: CA, B: CB, C: CC}


# --- call builders, as the producers fill a MemCall -------------------------------------------------

def client(pid: int = A, fd: int = FD, h: int | None = None, cls: int = 0x41) -> MemCall:
    h = CLIENT_OF[pid] if h is None else h
    return MemCall(K.ALLOC, 0, pid, fd, h, h, h, cls)


def device(pid: int = A, h: int = DEV0, instance: int = 0, root: int | None = None) -> MemCall:
    root = CLIENT_OF[pid] if root is None else root
    return MemCall(K.ALLOC, 0, pid, FD, root, root, h, 0x80, instance=instance)


def subdevice(pid: int = A, h: int = SUB0, parent: int = DEV0) -> MemCall:
    # subDeviceId is 0 on every non-SLI GPU: the accountant must not take it for the GPU.
    root = CLIENT_OF[pid]
    return MemCall(K.ALLOC, 0, pid, FD, root, parent, h, 0x2080, instance=0)


def alloc(pid: int = A, h: int = M1, size: int = GiB, parent: int = DEV0, cls: int = 0x40,
          attr: int = 0, root: int | None = None, fd: int = FD) -> MemCall:
    root = CLIENT_OF[pid] if root is None else root
    return MemCall(K.ALLOC, 0, pid, fd, root, parent, h, cls, size_bytes=size, attr=attr)


def heap_alloc(pid: int = A, h: int = M1, size: int = GiB, attr: int = 0, cls: int = 0) -> MemCall:
    root = CLIENT_OF[pid]
    return MemCall(K.HEAP_ALLOC, 0, pid, FD, root, DEV0, h, cls, size_bytes=size, attr=attr)


def alloc_memory(pid: int = A, h: int = M1, cls: int = 0x40, size: int = 80 * GiB) -> MemCall:
    root = CLIENT_OF[pid]
    return MemCall(K.ALLOC_MEMORY, 0, pid, 7, root, DEV0, h, cls, size_bytes=size)


def free(pid: int = A, h: int = M1, parent: int = DEV0, root: int | None = None) -> MemCall:
    root = CLIENT_OF[pid] if root is None else root
    return MemCall(K.FREE, 0, pid, FD, root, parent, h)


def heap_free(pid: int = A, h: int = M1) -> MemCall:
    return MemCall(K.HEAP_FREE, 0, pid, FD, CLIENT_OF[pid], DEV0, h)


def dup(pid: int = B, h: int = M2, src_pid: int = A, src: int = M1, parent: int = DEV0) -> MemCall:
    root = CLIENT_OF[pid]
    return MemCall(K.DUP, 0, pid, FD, root, parent, h, src_client=CLIENT_OF[src_pid], src_object=src)


def close(pid: int = A, fd: int = FD) -> MemCall:
    return MemCall(K.CLOSE, 0, pid, fd, 0, 0, 0)


def setup(*pids: int) -> list[MemCall]:
    """Each process: a client, device 0 (instance 0) and device 1 (instance 1)."""
    out: list[MemCall] = []
    for pid in pids:
        out += [client(pid), device(pid, DEV0, 0), device(pid, DEV1, 1)]
    return out


def run(calls: list[MemCall], max_objects: int = DEFAULT_MAX_OBJECTS) -> MemoryAccountant:
    acc = MemoryAccountant(max_objects)
    for call in calls:
        acc.apply(call)
    return acc


# --- the rules, one sequence each --------------------------------------------------------------------
# (name, calls, {pid: held}, {pid: shared})

Held = dict[int, dict[int | None, int]]
CASES: list[tuple[str, list[MemCall], Held, Held]] = [
    ("an allocation counts on its device's GPU",
     [*setup(A), alloc(A, M1, GiB)], {A: {0: GiB}}, {}),
    ("two GPUs: each allocation on the instance of the device it was made under",
     [*setup(A), alloc(A, M1, GiB, DEV0), alloc(A, M2, 4 * GiB, DEV1)], {A: {0: GiB, 1: 4 * GiB}}, {}),
    ("under a subdevice: its device's instance, not subDeviceId",
     [*setup(A), subdevice(A, SUB1, DEV1), alloc(A, M1, GiB, SUB1)], {A: {1: GiB}}, {}),
    ("the figure is what is held now: allocated minus freed",
     [*setup(A), alloc(A, M1, GiB), alloc(A, M2, 4 * GiB), alloc(A, M3, 16 * GiB), free(A, M2)],
     {A: {0: 17 * GiB}}, {}),
    ("RM_FREE of a parent frees its subtree",
     [*setup(A), subdevice(A, SUB0, DEV0), alloc(A, M1, GiB, DEV0), alloc(A, M2, GiB, SUB0),
      alloc(A, M3, 2 * GiB, DEV1), free(A, DEV0, parent=CA)],
     {A: {1: 2 * GiB}}, {}),
    ("RM_FREE with hObjectOld == hRoot frees the whole client",
     [*setup(A), alloc(A, M1, GiB, DEV0), alloc(A, M2, GiB, DEV1), free(A, CA, parent=0)], {}, {}),
    ("closing the client's fd frees it",
     [*setup(A), alloc(A, M1, GiB), close(A, FD)], {}, {}),
    ("closing another fd frees nothing",
     [*setup(A), alloc(A, M1, GiB), close(A, FD + 1), close(B, FD)], {A: {0: GiB}}, {}),
    ("a second client on another fd lives on when the first fd closes",
     [*setup(A), alloc(A, M1, GiB), client(A, FD + 1, h=0xC1D000A0), device(A, DEV0, 0, root=0xC1D000A0),
      alloc(A, M2, 2 * GiB, root=0xC1D000A0, fd=FD + 1), close(A, FD)],
     {A: {0: 2 * GiB}}, {}),
    ("a client allocated as NV01_ROOT (0x0) or NV01_ROOT_NON_PRIV (0x1) is a client too",
     [client(A, cls=0x0), device(A), alloc(A, M1, GiB), client(B, cls=0x1), device(B),
      alloc(B, M1, 2 * GiB), free(A, CA, parent=0)],
     {B: {0: 2 * GiB}}, {}),
    ("VID_HEAP_CONTROL: ALLOC_SIZE in video memory counts, FREE frees it",
     [*setup(A), heap_alloc(A, M1, GiB), heap_alloc(A, M2, 2 * GiB), heap_free(A, M1)],
     {A: {0: 2 * GiB}}, {}),
    ("VID_HEAP_CONTROL in host memory (PCI), or ANY (RM makes it NV01_MEMORY_SYSTEM), is not counted",
     [*setup(A), heap_alloc(A, M1, GiB, attr=PCI), heap_alloc(A, M2, GiB, attr=ANY)], {}, {}),
    ("VID_HEAP_CONTROL that RM made virtual (a producer names NV50_MEMORY_VIRTUAL) is not counted",
     [*setup(A), heap_alloc(A, M1, GiB, cls=0x50A0), heap_alloc(A, M2, GiB, cls=0x40)], {A: {0: GiB}}, {}),
    ("host memory and virtual-address classes are not counted",
     [*setup(A), alloc(A, 0x10, GiB, cls=0x3E, attr=PCI), alloc(A, 0x11, GiB, cls=0x71, attr=PCI),
      alloc(A, 0x12, GiB, cls=0x70), alloc(A, 0x13, GiB, cls=0x50A0), alloc(A, 0x14, GiB, cls=0x90F1),
      alloc(A, 0x15, GiB, cls=0x90CE, parent=CA)],
     {}, {}),
    ("classes that describe memory held elsewhere are not counted",
     [*setup(A), alloc(A, 0x10, GiB, cls=0x3F), alloc(A, 0x11, 80 * GiB, cls=0xC2),
      alloc(A, 0x12, GiB, cls=0xF8, parent=SUB0), alloc(A, 0x13, GiB, cls=0xFD)],
     {}, {}),
    ("NV01_MEMORY_LOCAL_USER with a location other than VIDMEM is not counted",
     [*setup(A), alloc(A, M1, GiB, attr=PCI)], {}, {}),
    ("RM_ALLOC_MEMORY never counts: for 0x40 it is a handle on the whole framebuffer",
     [*setup(A), alloc_memory(A, M1, 0x40), alloc_memory(A, M2, 0x3E, GiB)], {}, {}),
    ("freeing a handle it never saw is ignored",
     [*setup(A), alloc(A, M1, GiB), free(A, 0xDEAD), heap_free(A, 0xBEEF), free(B, M1),
      free(A, 0x1234, root=0x7777)],
     {A: {0: GiB}}, {}),
    ("RM_DUP_OBJECT: shared for the copy's process, held once by the allocator",
     [*setup(A, B), alloc(A, M1, GiB), dup(B, M2, A, M1)], {A: {0: GiB}}, {B: {0: GiB}}),
    ("RM_DUP_OBJECT: the original freed, the memory moves to the copy's process",
     [*setup(A, B), alloc(A, M1, GiB), dup(B, M2, A, M1), free(A, M1)], {B: {0: GiB}}, {}),
    ("RM_DUP_OBJECT: the last reference freed, the memory is gone",
     [*setup(A, B), alloc(A, M1, GiB), dup(B, M2, A, M1), free(A, M1), free(B, M2)], {}, {}),
    ("RM_DUP_OBJECT: the copy freed first, the allocator keeps it",
     [*setup(A, B), alloc(A, M1, GiB), dup(B, M2, A, M1), free(B, M2)], {A: {0: GiB}}, {}),
    ("RM_DUP_OBJECT: three references, the oldest remaining one holds it",
     [*setup(A, B, C), alloc(A, M1, GiB, DEV1), dup(B, M2, A, M1, DEV1), dup(C, M3, A, M1, DEV1),
      free(A, CA, parent=0)],
     {B: {1: GiB}}, {C: {1: GiB}}),
    ("RM_DUP_OBJECT: a copy of a copy is the same memory",
     [*setup(A, B, C), alloc(A, M1, GiB), dup(B, M2, A, M1), dup(C, M3, B, M2)],
     {A: {0: GiB}}, {B: {0: GiB}, C: {0: GiB}}),
    ("RM_DUP_OBJECT inside one process: held once, not shared",
     [*setup(A), alloc(A, M1, GiB), dup(A, M2, A, M1)], {A: {0: GiB}}, {}),
    ("RM_DUP_OBJECT: the copy's client closed, the allocator keeps it alone",
     [*setup(A, B), alloc(A, M1, GiB), dup(B, M2, A, M1), close(B)], {A: {0: GiB}}, {}),
    ("RM_DUP_OBJECT of a handle it never saw shares nothing",
     [*setup(A, B), dup(B, M2, A, 0xDEAD)], {}, {}),
    ("RM_DUP_OBJECT of a device: memory under the copy is on that device's GPU",
     [*setup(A), client(B), MemCall(K.DUP, 0, B, FD, CB, CB, 0x5C0000B1, src_client=CA, src_object=DEV1),
      alloc(B, M1, GiB, 0x5C0000B1)],
     {B: {1: GiB}}, {}),
    ("a handle allocated again means its free was missed: counted once, at its new size",
     [*setup(A), alloc(A, M1, GiB), alloc(A, M1, 2 * GiB)], {A: {0: 2 * GiB}}, {}),
    ("a device handle allocated again drops the memory under the stale one",
     [*setup(A), alloc(A, M1, GiB, DEV1), device(A, DEV1, 1), alloc(A, M2, 2 * GiB, DEV1)],
     {A: {1: 2 * GiB}}, {}),
]


@pytest.mark.parametrize(("calls", "held", "shared"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rules(calls: list[MemCall], held: Held, shared: Held) -> None:
    acc = run(calls)
    for pid in (A, B, C):
        assert acc.held(pid) == held.get(pid, {}), f"held({pid})"
        assert acc.shared(pid) == shared.get(pid, {}), f"shared({pid})"
        assert acc.incomplete(pid) == ""


def test_per_gpu_sums_stay_right_through_copies_and_frees() -> None:
    # Whatever the order of frees, summing `held` over processes counts every live allocation
    # once on its GPU.
    acc = MemoryAccountant()
    for call in [*setup(A, B, C), alloc(A, M1, GiB, DEV0), alloc(B, M1, 4 * GiB, DEV1),
                 dup(B, M2, A, M1), dup(C, M2, B, M1, DEV1), dup(C, M3, A, M1)]:
        acc.apply(call)

    def per_gpu() -> dict[int | None, int]:
        out: dict[int | None, int] = {}
        for pid in (A, B, C):
            for inst, n in acc.held(pid).items():
                out[inst] = out.get(inst, 0) + n
        return out

    assert per_gpu() == {0: GiB, 1: 4 * GiB}
    acc.apply(free(A, M1))
    assert per_gpu() == {0: GiB, 1: 4 * GiB}
    assert acc.held(B) == {0: GiB, 1: 4 * GiB}
    acc.process_exit(B)
    assert per_gpu() == {0: GiB, 1: 4 * GiB}
    assert acc.held(C) == {0: GiB, 1: 4 * GiB}
    acc.process_exit(C)
    assert per_gpu() == {}
    assert acc.objects == 3  # A's client and two devices


def test_close_fd_is_a_close_call() -> None:
    acc = run([*setup(A), alloc(A, M1, GiB)])
    acc.close_fd(A, FD)
    assert acc.held(A) == {}
    assert acc.objects == 0


def test_process_exit_frees_every_client_and_forgets_the_pid() -> None:
    acc = run([*setup(A, B), alloc(A, M1, GiB), client(A, FD + 1, h=0xC1D000A0),
               alloc(A, M2, GiB, parent=0xC1D000A0, root=0xC1D000A0, fd=FD + 1),
               alloc(B, M1, 2 * GiB), alloc(0xAAA, M1, GiB, root=0x7777)])
    assert acc.held(A) == {0: GiB, None: GiB}
    assert acc.incomplete(0xAAA) == BEFORE_START
    acc.process_exit(A)
    acc.process_exit(0xAAA)
    assert acc.held(A) == {}
    assert acc.held(B) == {0: 2 * GiB}
    assert acc.incomplete(0xAAA) == ""  # a reused pid starts clean
    assert acc.objects == 4  # B's client, two devices, one allocation


def test_objects_count_and_all_freed() -> None:
    acc = run([*setup(A), subdevice(A), alloc(A, M1), alloc(A, M2, parent=SUB0), dup(A, M3, A, M1)])
    assert acc.objects == 7
    acc.apply(free(A, CA, parent=0))
    assert acc.objects == 0
    assert acc.held(A) == {} and acc.shared(A) == {}


# --- what it cannot know, said -----------------------------------------------------------------------

def test_a_client_from_before_the_start_counts_under_no_device_and_says_so() -> None:
    # The process's client and device were allocated before the tracer started: its memory is
    # counted, under no GPU (None), and its figure is marked a lower bound.
    acc = run([alloc(A, M1, GiB), alloc(A, M2, GiB)])
    assert acc.held(A) == {None: 2 * GiB}
    assert acc.incomplete(A) == BEFORE_START
    acc.apply(free(A, DEV0, parent=CA))  # freeing the device it never saw frees what it saw under it
    assert acc.held(A) == {}
    acc.apply(alloc(A, M3, GiB))
    acc.apply(close(A, FD))  # the implicit client belongs to the fd the calls came through
    assert acc.held(A) == {}
    assert acc.objects == 0


def test_a_device_from_before_the_start_under_a_known_client() -> None:
    acc = run([client(A), alloc(A, M1, GiB, DEV1), device(A, DEV0, 0), alloc(A, M2, 2 * GiB, DEV0)])
    assert acc.held(A) == {None: GiB, 0: 2 * GiB}
    assert acc.incomplete(A) == BEFORE_START
    acc.apply(free(A, DEV1, parent=CA))
    assert acc.held(A) == {0: 2 * GiB}


def test_overflow_is_counted_and_marks_the_figure() -> None:
    # Room for a client, a device and one allocation.
    acc = run([client(A), device(A), alloc(A, M1, GiB), alloc(A, M2, 4 * GiB), client(B)], max_objects=3)
    assert acc.objects == 3
    assert acc.dropped_objects_total == 2  # M2 and B's client
    assert acc.held(A) == {0: GiB}
    assert acc.incomplete(A) == TABLE_FULL
    assert acc.incomplete(B) == TABLE_FULL
    acc.apply(free(A, M1))
    acc.apply(alloc(A, M3, 2 * GiB))  # room again
    assert acc.held(A) == {0: 2 * GiB}
    assert acc.dropped_objects_total == 2


def test_overflow_when_a_placeholder_parent_does_not_fit() -> None:
    # An allocation under a client never seen needs the client and the parent too: all or nothing.
    acc = run([client(A), device(A), alloc(B, M1, GiB)], max_objects=4)
    assert acc.held(B) == {}
    assert acc.dropped_objects_total == 1
    assert acc.incomplete(B) == TABLE_FULL
    assert acc.objects == 2


def test_a_size_it_could_not_read_is_said() -> None:
    acc = run([*setup(A), alloc(A, M1, 0), alloc(A, M2, GiB)])
    assert acc.held(A) == {0: GiB}
    assert acc.incomplete(A) == SIZE_UNREAD


def test_a_bad_bound_is_one_line_naming_it() -> None:
    with pytest.raises(ValueError, match=r"max_objects 0 is not positive"):
        MemoryAccountant(0)


def test_a_device_whose_instance_was_not_read_marks_the_figure() -> None:
    # The kernel side could not read pAllocParms: the memory under that device is on no GPU it can name.
    acc = run([client(A), MemCall(K.ALLOC, 0, A, FD, CA, CA, DEV0, 0x80, instance=None), alloc(A, M1, GiB)])
    assert acc.held(A) == {None: GiB}
    assert acc.incomplete(A) == INSTANCE_UNREAD


# --- a file shared by a fork ---------------------------------------------------------------------------

def test_transfer_fd_moves_the_clients_and_their_memory() -> None:
    """A parent closes (or exits) while a child forked from it holds the same file: RM keeps the
    file's clients, and the child holds them now, at its fd."""
    acc = run([client(A), device(A), alloc(A, M1, GiB), client(A, fd=9, h=0xC1D000FF)])
    assert acc.transfer_fd(A, FD, C, FD) is True
    assert acc.held(A) == {} and acc.held(C) == {0: GiB}
    acc.apply(free(A, M1, root=CA))  # the child frees it through the same handles
    assert acc.held(C) == {}
    acc.apply(alloc(C, M2, 2 * GiB, root=CA))
    assert acc.held(C) == {0: 2 * GiB}
    acc.process_exit(A)  # the parent's other fd's client goes, the moved one stays
    assert acc.objects == 3 and acc.held(C) == {0: 2 * GiB}
    acc.apply(close(C, FD))
    assert acc.held(C) == {} and acc.objects == 0
    assert acc.transfer_fd(A, FD, C, FD) is False, "nothing allocated through it any more"


def test_transfer_fd_keeps_a_shared_allocation_counted_once() -> None:
    # B reaches A's memory through a copy: after the move, C holds it and B still only shares it.
    acc = run([*setup(A, B), alloc(A, M1, GiB), dup(B, M2, A, M1)])
    acc.transfer_fd(A, FD, C, FD)
    assert (acc.held(C), acc.shared(B), acc.held(B), acc.held(A)) == ({0: GiB}, {0: GiB}, {}, {})


def test_transfer_fd_carries_a_lower_bound() -> None:
    acc = run([client(A), device(A), alloc(A, M1, 0)])
    acc.transfer_fd(A, FD, C, FD)
    assert acc.incomplete(C) == SIZE_UNREAD


# --- cost ---------------------------------------------------------------------------------------------

def cuda_like(pids: int, allocations: int) -> list[MemCall]:
    calls: list[MemCall] = []
    for p in range(pids):
        root = 0xC1D10000 + p
        calls += [client(1000 + p, h=root), device(1000 + p, DEV0, p % 2, root=root)]
        calls += [alloc(1000 + p, 0xCAF00000 + i, 2 * MiB, root=root) for i in range(allocations)]
    return calls


def test_many_objects_then_exits_leave_nothing() -> None:
    acc = run(cuda_like(20, 2000))
    assert acc.objects == 20 * 2002
    assert acc.held(1000) == {0: 2000 * 2 * MiB}
    assert acc.held(1001) == {1: 2000 * 2 * MiB}
    for p in range(20):
        acc.process_exit(1000 + p)
    assert acc.objects == 0
    assert acc._held == {} and acc._shared == {}  # nothing left behind per pid


def test_bytes_per_tracked_object_as_the_module_says() -> None:
    # DEFAULT_MAX_OBJECTS's comment and docs/MEMORY.md price a tracked object at OBJECT_COST_BYTES.
    calls = cuda_like(10, 5000)
    acc = MemoryAccountant()
    tracemalloc.start()
    try:
        for call in calls:
            acc.apply(call)
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert used / acc.objects < OBJECT_COST_BYTES


# --- pure rules ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("attr", "location"), [
    (0, 0), (1 << 25, 1), (2 << 25, 2), (3 << 25, 3), (0xFFFF_FFFF & ~(3 << 25), 0), (0xFFFF_FFFF, 3),
])
def test_attr_location(attr: int, location: int) -> None:
    assert attr_location(attr) == location


@pytest.mark.parametrize(("call", "counted"), [
    (alloc(cls=0x40), True),
    (alloc(cls=0x40, attr=PCI), False),
    (alloc(cls=0x40, attr=ANY), False),
    (alloc(cls=0x3E, attr=PCI), False),
    (alloc(cls=0x3F), False),
    (alloc(cls=0x70), False),
    (alloc(cls=0x50A0), False),
    (alloc(cls=0x90F1), False),
    (alloc(cls=0xC2), False),
    (alloc(cls=0xF8), False),
    (alloc(cls=0xC6C0), False),  # an engine object
    (heap_alloc(), True),
    (heap_alloc(attr=PCI), False),
    (heap_alloc(attr=ANY), False),
    (heap_alloc(cls=0x40), True),
    (heap_alloc(cls=0x50A0), False),
    (heap_alloc(cls=0x3E), False),
    (alloc_memory(cls=0x40), False),
    (alloc_memory(cls=0x3E), False),
    (free(), False),
    (dup(), False),
])
def test_counts(call: MemCall, counted: bool) -> None:
    assert counts(call) is counted


@pytest.mark.parametrize(("used", "listed", "unlisted", "split"), [
    (10 * GiB, 4 * GiB, 3 * GiB, (4 * GiB, 3 * GiB, 3 * GiB)),  # seed 003: 3 GiB nobody holds
    (10 * GiB, 10 * GiB, 0, (10 * GiB, 0, 0)),
    (10 * GiB, 0, 10 * GiB, (0, 10 * GiB, 0)),
    (10 * GiB, 8 * GiB, 4 * GiB, (8 * GiB, 4 * GiB, 0)),  # parts past used: floored at 0
    (None, 4 * GiB, 3 * GiB, (4 * GiB, 3 * GiB, None)),  # NVML's used unknown
    (10 * GiB, None, 3 * GiB, (None, 3 * GiB, None)),  # the listed part unknown
    (0, 0, 0, (0, 0, 0)),
])
def test_memory_split(used: int | None, listed: int | None, unlisted: int,
                      split: tuple[int | None, int | None, int | None]) -> None:
    assert memory_split(used, listed, unlisted) == split


# --- the table, in code and in docs/MEMORY.md -----------------------------------------------------------

def test_the_class_table_names_the_classes_the_abi_page_names() -> None:
    classes = json.loads((REPO / "tests/data/nvidia_classes.json").read_text())["classes"]
    names = {c["id"]: c["name"] for c in classes}
    for row in MEMORY_CLASSES:
        assert names.get(f"0x{row.h_class:04X}") == row.name, row
    assert [c.name for c in MEMORY_CLASSES if c.counts] == ["NV01_MEMORY_LOCAL_USER"]


def test_docs_memory_has_every_row() -> None:
    text = (REPO / "docs/MEMORY.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \|.*$", text, re.M)}
    for row in MEMORY_CLASSES:
        line = rows.get(row.name)
        assert line is not None, f"docs/MEMORY.md has no row for {row.name}"
        assert f"0x{row.h_class:04X}" in line, line
        assert ("| yes |" in line) is row.counts, line
        assert row.header in line, line
    assert f"{DEFAULT_MAX_OBJECTS:,}" in text or str(DEFAULT_MAX_OBJECTS) in text


# --- against a naive model, on random call sequences ---------------------------------------------------

class Naive:
    """The same rules, recomputed from scratch after every call: every live object with its parent,
    every allocation with the age of each reference to it."""

    def __init__(self) -> None:
        self.objs: dict[tuple[int, int], dict[str, int | None]] = {}  # (root, handle) -> fields
        self.seq = 0

    def add(self, root: int, h: int, parent: int, pid: int, fd: int, kind: str, instance: int | None,
            alloc: int | None = None, size: int = 0) -> None:
        self.seq += 1
        self.objs[(root, h)] = {"parent": parent, "pid": pid, "fd": fd, "instance": instance, "alloc": alloc,
                                "size": size, "seq": self.seq, "client": int(kind == "client")}

    def free(self, root: int, h: int) -> None:
        doomed = {(root, h)} & self.objs.keys()
        grew = True
        while grew:
            more = {k for k, o in self.objs.items() if k[0] == root and (root, o["parent"]) in doomed
                    and k not in doomed and not o["client"]}
            grew = bool(more)
            doomed |= more
        for k in doomed:
            del self.objs[k]

    def held_shared(self) -> tuple[Held, Held]:
        by_alloc: dict[int, list[dict[str, int | None]]] = {}
        for o in self.objs.values():
            if o["alloc"] is not None:
                by_alloc.setdefault(o["alloc"], []).append(o)
        held: Held = {}
        shared: Held = {}
        for refs in by_alloc.values():
            refs.sort(key=lambda o: o["seq"] or 0)
            owner = refs[0]["pid"]
            size = refs[0]["size"] or 0
            assert owner is not None
            inst = refs[0]["instance"]
            held.setdefault(owner, {})[inst] = held.get(owner, {}).get(inst, 0) + size
            for pid in {r["pid"] for r in refs[1:]} - {owner}:
                assert pid is not None
                shared.setdefault(pid, {})[inst] = shared.get(pid, {}).get(inst, 0) + size
        return held, shared


@pytest.mark.parametrize("seed", range(8))
def test_random_sequences_agree_with_the_naive_model(seed: int) -> None:
    rnd = random.Random(seed)
    acc = MemoryAccountant()
    naive = Naive()
    pids = (A, B, C)
    fds = (FD, FD + 1)
    next_alloc = 0
    for _ in range(400):
        pid = rnd.choice(pids)
        fd = rnd.choice(fds)
        root = CLIENT_OF[pid] + (fd - FD) * 0x100  # one client per (pid, fd)
        live = [k for k in naive.objs if k[0] == root]
        op = rnd.random()
        if not live or op < 0.05:
            if (root, root) in naive.objs:
                continue
            acc.apply(MemCall(K.ALLOC, 0, pid, fd, root, root, root, 0x41))
            naive.add(root, root, root, pid, fd, "client", None)
            for h, inst in ((DEV0, 0), (DEV1, 1)):
                acc.apply(MemCall(K.ALLOC, 0, pid, fd, root, root, h, 0x80, instance=inst))
                naive.add(root, h, root, pid, fd, "device", inst)
        elif op < 0.45:
            parent = rnd.choice((DEV0, DEV1))
            if (root, parent) not in naive.objs:
                continue
            h = rnd.randrange(0x1000, 0x1040)
            naive.free(root, h)  # a reused handle: the stale object goes first
            size = rnd.choice((MiB, 2 * MiB, GiB))
            acc.apply(MemCall(K.ALLOC, 0, pid, fd, root, parent, h, 0x40, size_bytes=size))
            naive.add(root, h, parent, pid, fd, "memory", naive.objs[(root, parent)]["instance"],
                      alloc=next_alloc, size=size)
            next_alloc += 1
        elif op < 0.65:
            sources = [k for k, o in naive.objs.items() if o["alloc"] is not None]
            parent = rnd.choice((DEV0, DEV1))
            if not sources or (root, parent) not in naive.objs:
                continue
            src = rnd.choice(sources)
            h = rnd.randrange(0x2000, 0x2040)
            if src == (root, h):
                continue  # RM refuses a copy into the handle it copies
            naive.free(root, h)
            acc.apply(MemCall(K.DUP, 0, pid, fd, root, parent, h, src_client=src[0], src_object=src[1]))
            o = naive.objs[src]
            naive.add(root, h, parent, pid, fd, "memory", o["instance"], alloc=o["alloc"],
                      size=o["size"] or 0)
        elif op < 0.9:
            h = rnd.choice([k[1] for k in live] + [0xDEAD])
            acc.apply(MemCall(K.FREE, 0, pid, fd, root, 0, h))
            naive.free(root, h)
        elif op < 0.95:
            acc.apply(MemCall(K.CLOSE, 0, pid, fd, 0, 0, 0))
            naive.free(root, root)
        else:
            acc.process_exit(pid)
            for f in fds:
                naive.free(CLIENT_OF[pid] + (f - FD) * 0x100, CLIENT_OF[pid] + (f - FD) * 0x100)
        held, shared = naive.held_shared()
        for p in pids:
            assert acc.held(p) == held.get(p, {}), (seed, p)
            assert acc.shared(p) == shared.get(p, {}), (seed, p)
        assert acc.objects == len(naive.objs)
