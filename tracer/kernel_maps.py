"""Race-tolerant user-space access to the kernel side's BPF hash maps.

The kernel programs insert, update and delete entries of the same maps at every moment: a process
exits between our lookup and our delete, a fork child's entry appears while we seed it. bcc's table
objects treat that as an error (`table.pop(key, None)` is MutableMapping's lookup-then-delete and
raises KeyError when the kernel deleted the entry in between; `table[key] = leaf` raises a bare
Exception on a full map). Every read, update and delete the tracer makes goes through `KernelMap`,
which turns each of those outcomes into a value:

- `lookup` returns None for a missing entry;
- `delete` returns False when the entry was already gone (the kernel removed it first);
- `update` returns an `Update` outcome: written, `EXISTS` (NOEXIST and someone inserted first),
  `MISSING` (EXIST and someone deleted it), `FULL` (the map is at max_entries).

Any other errno is a real fault (a closed map fd, a bad key size) and raises `MapError` naming
the map and the errno. The syscalls go through `MapOps`, the libbcc binding in production and a
dict in tests/helpers/fake_kmaps.py, so the races are reproduced deterministically without root.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from collections.abc import Iterator
from enum import Enum
from typing import Any, Protocol

log = logging.getLogger(__name__)

BPF_ANY, BPF_NOEXIST, BPF_EXIST = 0, 1, 2  # include/uapi/linux/bpf.h, stable ABI


class MapError(RuntimeError):
    """A map operation failed for a reason other than the entry's own coming or going."""


class Update(Enum):
    WRITTEN = "written"
    EXISTS = "exists"  # BPF_NOEXIST: an entry was there already (the kernel inserted it first)
    MISSING = "missing"  # BPF_EXIST: no entry (the kernel deleted it first)
    FULL = "full"  # max_entries reached: the /proc scan still knows what we could not write


class MapOps(Protocol):
    """The three map syscalls: 0 on success, else a negative errno (libbpf's convention)."""

    def lookup(self, map_fd: int, key: Any, leaf: Any) -> int: ...
    def update(self, map_fd: int, key: Any, leaf: Any, flags: int) -> int: ...
    def delete(self, map_fd: int, key: Any) -> int: ...


class LibbccOps:
    """MapOps through bcc's libbcc (which wraps libbpf): only imported once bcc is loaded."""

    def __init__(self) -> None:
        from bcc.libbcc import lib  # CDLL(..., use_errno=True)

        self._lib = lib

    @staticmethod
    def _result(res: int) -> int:
        # libbpf returns -errno and sets errno; older libbcc builds return -1: take errno then.
        return 0 if res >= 0 else (res if res < -1 else -ctypes.get_errno())

    def lookup(self, map_fd: int, key: Any, leaf: Any) -> int:
        return self._result(self._lib.bpf_lookup_elem(map_fd, ctypes.byref(key), ctypes.byref(leaf)))

    def update(self, map_fd: int, key: Any, leaf: Any, flags: int) -> int:
        return self._result(self._lib.bpf_update_elem(map_fd, ctypes.byref(key), ctypes.byref(leaf), flags))

    def delete(self, map_fd: int, key: Any) -> int:
        return self._result(self._lib.bpf_delete_elem(map_fd, ctypes.byref(key)))


class KernelMap:
    """One BPF hash map: Key/Leaf ctypes types, its fd, and race-tolerant operations."""

    def __init__(self, name: str, map_fd: int, key_type: Any, leaf_type: Any, ops: MapOps,
                 table: Any = None) -> None:
        self.name, self.map_fd, self.Key, self.Leaf, self._ops = name, map_fd, key_type, leaf_type, ops
        self._table = table  # the bcc table, for batch reads only

    @classmethod
    def of(cls, bpf: Any, name: str, ops: MapOps) -> KernelMap:
        table = bpf[name.encode()]
        return cls(name, table.map_fd, table.Key, table.Leaf, ops, table)

    def _fail(self, what: str, res: int) -> MapError:
        code = -res
        return MapError(f"BPF map {self.name}: {what} failed: {os.strerror(code)} "
                        f"({errno.errorcode.get(code, code)})")

    def lookup(self, key: Any) -> Any | None:
        leaf = self.Leaf()
        res = self._ops.lookup(self.map_fd, key, leaf)
        if res == 0:
            return leaf
        if res == -errno.ENOENT:
            return None
        raise self._fail("lookup", res)

    def delete(self, key: Any) -> bool:
        """True when this call removed the entry; False when it was already gone."""
        res = self._ops.delete(self.map_fd, key)
        if res == 0:
            return True
        if res == -errno.ENOENT:
            return False
        raise self._fail("delete", res)

    def update(self, key: Any, leaf: Any, flags: int = BPF_ANY) -> Update:
        res = self._ops.update(self.map_fd, key, leaf, flags)
        if res == 0:
            return Update.WRITTEN
        if res == -errno.EEXIST and flags == BPF_NOEXIST:
            return Update.EXISTS
        if res == -errno.ENOENT and flags == BPF_EXIST:
            return Update.MISSING
        if res in (-errno.E2BIG, -errno.ENOMEM, -errno.ENOSPC):  # htab full: E2BIG (kernel/bpf/hashtab.c)
            return Update.FULL
        raise self._fail("update", res)

    def items(self) -> Iterator[tuple[Any, Any]]:
        """Every entry, in as few syscalls as the kernel allows (BPF_MAP_LOOKUP_BATCH). The kernel
        walks every bucket whatever the fill, so this is for periodic reads, never per event.
        Entries may come and go during the walk: each one returned existed at some instant."""
        if self._table is None:
            return iter(())
        try:
            batch = list(self._table.items_lookup_batch())
        except Exception as exc:  # bcc raises bare Exception (ENOSPC when a bucket outgrew the buffer)
            log.debug("batch read of %s failed (%s); falling back to key iteration", self.name, exc)
            return self._iterate()
        # A batch comes back as ctypes arrays, whose scalar elements read as plain ints: give every
        # caller the map's own Key/Leaf types, as lookup() does.
        return ((self._typed(self.Key, k), self._typed(self.Leaf, v)) for k, v in batch)

    @staticmethod
    def _typed(kind: Any, value: Any) -> Any:
        return kind(value) if isinstance(value, int) else value

    def _iterate(self) -> Iterator[tuple[Any, Any]]:
        # get_next_key restarts from the first key when ours was deleted meanwhile: bound the walk.
        seen: set[bytes] = set()
        key = None
        for _ in range(4 * max(1, getattr(self._table, "max_entries", 1 << 16))):
            try:
                key = self._table.next(key)
            except StopIteration:
                return
            raw = bytes(key)
            if raw in seen:
                continue
            seen.add(raw)
            leaf = self.lookup(key)
            if leaf is not None:
                yield key, leaf
