"""A fake kernel for tracer/kernel_maps.py and tracer/kernel_tables.py: the maps as dicts, the
syscalls as MapOps returning -errno as libbpf does, and hooks that let a test play the kernel at
the worst moment (delete an entry right after user space looked it up, fill a map).

The Key/Leaf types have the layout bcc generates from bpf/ghostgpu.h.
"""

from __future__ import annotations

import ctypes
import errno
from collections.abc import Callable, Iterator
from typing import Any

from ghostgpu.tracer.kernel_maps import BPF_EXIST, BPF_NOEXIST, KernelMap
from ghostgpu.tracer.kernel_tables import HolderTables


class FdKey(ctypes.Structure):
    _fields_ = (("tgid", ctypes.c_uint32), ("fd", ctypes.c_int32))


class FdVal(ctypes.Structure):
    _fields_ = (("dev_id", ctypes.c_uint32), ("flags", ctypes.c_uint32))


class HoldKey(ctypes.Structure):
    _fields_ = (("tgid", ctypes.c_uint32), ("dev_id", ctypes.c_uint32))


class HoldVal(ctypes.Structure):
    _fields_ = (("nfds", ctypes.c_uint32), ("mapped", ctypes.c_uint32))


class IoctlKey(ctypes.Structure):
    _fields_ = (("tgid", ctypes.c_uint32), ("fd", ctypes.c_int32), ("dev_id", ctypes.c_uint32),
                ("cmd", ctypes.c_uint32))


class PathKey(ctypes.Structure):
    _fields_ = (("path", ctypes.c_char * 48),)


class AllocVal(ctypes.Structure):  # bpf/alloc.bpf.c struct gg_alloc_val
    _fields_ = (("first", ctypes.c_uint64), ("calls", ctypes.c_uint32), ("from_tgid", ctypes.c_uint32),
                ("seen", ctypes.c_uint8 * 8))


TYPES: dict[str, tuple[Any, Any]] = {
    "fds": (FdKey, FdVal), "holds": (HoldKey, HoldVal), "procs": (ctypes.c_uint32, ctypes.c_uint32),
    "ioctls": (IoctlKey, ctypes.c_uint64), "dev_ids": (PathKey, ctypes.c_uint32),
    "alloc_work": (ctypes.c_uint32, AllocVal),
}


class FakeKernel:
    """MapOps over dicts keyed by the raw key bytes. `ops` counts every syscall by map name."""

    def __init__(self, max_entries: int = 1 << 16) -> None:
        self.names = list(TYPES)
        self.data: dict[int, dict[bytes, bytes]] = {fd: {} for fd in range(len(self.names))}
        self.max_entries = dict.fromkeys(range(len(self.names)), max_entries)
        self.ops: dict[str, int] = dict.fromkeys(self.names, 0)
        self.walks: dict[str, int] = dict.fromkeys(self.names, 0)
        # Called with (map name, raw key, found) after every lookup: the kernel's move.
        self.after_lookup: Callable[[str, bytes, bool], None] | None = None
        self.fail_with: int | None = None  # an errno every call returns, for the fault path

    def fd(self, name: str) -> int:
        return self.names.index(name)

    def map(self, name: str) -> dict[bytes, bytes]:
        return self.data[self.fd(name)]

    def lookup(self, map_fd: int, key: Any, leaf: Any) -> int:
        self.ops[self.names[map_fd]] += 1
        if self.fail_with:
            return -self.fail_with
        raw = self.data[map_fd].get(bytes(key))
        if raw is not None:
            ctypes.memmove(ctypes.addressof(leaf), raw, len(raw))
        if self.after_lookup is not None:
            self.after_lookup(self.names[map_fd], bytes(key), raw is not None)
        return 0 if raw is not None else -errno.ENOENT

    def update(self, map_fd: int, key: Any, leaf: Any, flags: int) -> int:
        self.ops[self.names[map_fd]] += 1
        if self.fail_with:
            return -self.fail_with
        table, raw = self.data[map_fd], bytes(key)
        if flags == BPF_NOEXIST and raw in table:
            return -errno.EEXIST
        if flags == BPF_EXIST and raw not in table:
            return -errno.ENOENT
        if raw not in table and len(table) >= self.max_entries[map_fd]:
            return -errno.E2BIG
        table[raw] = bytes(leaf)
        return 0

    def delete(self, map_fd: int, key: Any) -> int:
        self.ops[self.names[map_fd]] += 1
        if self.fail_with:
            return -self.fail_with
        return 0 if self.data[map_fd].pop(bytes(key), None) is not None else -errno.ENOENT

    # --- the kernel programs' own writes ------------------------------------------------------

    def put(self, name: str, key: Any, leaf: Any) -> None:
        self.map(name)[bytes(key)] = bytes(leaf)

    def get(self, name: str, key: Any) -> bytes | None:
        return self.map(name).get(bytes(key))


class FakeTable:
    """What KernelMap needs of a bcc table for whole-map reads: a batch walk (counted)."""

    def __init__(self, kernel: FakeKernel, name: str) -> None:
        self.kernel, self.name = kernel, name
        self.Key, self.Leaf = TYPES[name]
        self.max_entries = kernel.max_entries[kernel.fd(name)]

    def items_lookup_batch(self) -> Iterator[tuple[Any, Any]]:
        self.kernel.walks[self.name] += 1
        for raw_key, raw_leaf in list(self.kernel.map(self.name).items()):
            key, leaf = self.Key.from_buffer_copy(raw_key), self.Leaf.from_buffer_copy(raw_leaf)
            # ctypes arrays of scalars read back as ints, as bcc's batch arrays do
            yield (key.value if isinstance(key, ctypes.c_uint32) else key,
                   leaf.value if not isinstance(leaf, ctypes.Structure) else leaf)


def fake_tables(max_entries: int = 1 << 16, pid_max: int = 1 << 16) -> tuple[HolderTables, FakeKernel]:
    kernel = FakeKernel(max_entries)
    maps = {name: KernelMap(name, kernel.fd(name), *TYPES[name], kernel, FakeTable(kernel, name))
            for name in TYPES}
    return HolderTables(maps, bytearray(pid_max)), kernel
