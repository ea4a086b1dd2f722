"""The user-space half of the kernel side's tables: seed, resync on exec, read and forget holders.

The kernel keeps, per tgid, fd entries (fds), per-device hold counts (holds), a holder count
(procs, whose presence is what makes the kernel report the tgid's EXIT), ioctl counters (ioctls),
what its allocation calls named (alloc_work, bpf/alloc.bpf.c) and the fds through which it
allocated an RM client (mem_clients, for the CLOSE of that fd). User space must clean them up
after an EXIT and resync them after an EXEC. Walking a
whole map for that (a batch lookup visits every bucket of a 128k-entry map whatever its fill)
made each exec and exit of a holder cost O(the node); under churn that was most of the tracer.

So user space keeps an index of the keys each tgid owns: the kernel reports every fd entry it
makes (OPEN for a device's first fd, FD for each further one), every new ioctl counter
(IOCTL_KEY), every mapping (MMAP) and every accepted client allocation (a MEMCALL of a client
class), and seed() records what it writes itself. Resync and
forget then touch exactly the tgid's own entries. A record lost to a full ring buffer leaves
entries the index does not know; `sweep()`, run with the periodic full /proc scan, removes the
entries of tgids that have been dead for two sweeps.

Every map operation tolerates the kernel changing the same entry at the same moment (see
tracer/kernel_maps.py).
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from ghostgpu.tracer.gpu_work import AllocRecord, unpack_alloc
from ghostgpu.tracer.kernel_maps import BPF_EXIST, BPF_NOEXIST, KernelMap, Update

log = logging.getLogger(__name__)

FD_SEEDED = 1  # ghostgpu.h GG_FD_SEEDED
USER_ID_BASE = 0x80000000  # kernel ids stay below (ghostgpu.h GG_USER_ID_BASE)
PATH_LEN = 48  # ghostgpu.h GG_PATH_LEN


@dataclass
class Owned:
    """The keys one tgid owns in the kernel tables, as far as user space has been told."""

    fds: set[int] = field(default_factory=set)
    dev_ids: set[int] = field(default_factory=set)  # holds keys (tgid, dev_id)
    ioctl_keys: set[tuple[int, int, int]] = field(default_factory=set)  # (fd, dev_id, cmd)
    clients: set[int] = field(default_factory=set)  # mem_clients keys (tgid, fd)


class HolderTables:
    """fds, holds, procs, ioctls, dev_ids, alloc_work and mem_clients of a loaded kernel side, plus
    the holder bytes. alloc_work and mem_clients are optional (None: no allocation records, every
    gpu_work stays None; no memory calls)."""

    def __init__(self, maps: Mapping[str, KernelMap], holder_bytes: mmap.mmap | bytearray | None) -> None:
        self.fds, self.holds, self.procs = maps["fds"], maps["holds"], maps["procs"]
        self.ioctls, self.dev_ids = maps["ioctls"], maps["dev_ids"]
        self.alloc_work: KernelMap | None = maps.get("alloc_work")
        self.mem_clients: KernelMap | None = maps.get("mem_clients")
        self.holder_bytes = holder_bytes
        self.owned: dict[int, Owned] = {}
        self.dev_paths: dict[int, str] = {}  # device id -> path, refreshed from dev_ids on a miss
        self._next_user_id = USER_ID_BASE
        self._dead_last_sweep: set[int] = set()

    # --- what the ring buffer says the kernel made ----------------------------------------

    def note_fd(self, tgid: int, fd: int, dev_id: int) -> None:
        owned = self.owned.setdefault(tgid, Owned())
        owned.fds.add(fd)
        owned.dev_ids.add(dev_id)

    def note_mapping(self, tgid: int, dev_id: int) -> None:
        self.owned.setdefault(tgid, Owned()).dev_ids.add(dev_id)

    def note_ioctl_key(self, tgid: int, fd: int, dev_id: int, cmd: int) -> None:
        self.owned.setdefault(tgid, Owned()).ioctl_keys.add((fd, dev_id, cmd))

    def note_mem_client(self, tgid: int, fd: int) -> None:
        self.owned.setdefault(tgid, Owned()).clients.add(fd)

    def drop_mem_client(self, tgid: int, fd: int) -> None:
        """The kernel deleted (tgid, fd) from mem_clients itself (its CLOSE came)."""
        owned = self.owned.get(tgid)
        if owned is not None:
            owned.clients.discard(fd)

    # --- device ids -----------------------------------------------------------------------

    def dev_path(self, dev_id: int) -> str | None:
        if dev_id not in self.dev_paths:
            self.refresh_dev_paths()
        return self.dev_paths.get(dev_id)

    def refresh_dev_paths(self) -> None:
        # dev_ids is insert-only (nothing deletes from it), so a walk of it sees every id.
        for key, value in self.dev_ids.items():
            self.dev_paths[int(value.value)] = bytes(key.path).split(b"\0", 1)[0].decode(errors="replace")

    def intern(self, path: str) -> int | None:
        raw = path.encode()
        if not raw or len(raw) >= PATH_LEN:
            return None
        key = self.dev_ids.Key()
        key.path = raw
        found = self.dev_ids.lookup(key)
        if found is not None:
            return int(found.value)
        dev_id = self._next_user_id
        outcome = self.dev_ids.update(key, self.dev_ids.Leaf(dev_id), BPF_NOEXIST)  # never overwrite
        if outcome is not Update.WRITTEN:  # the kernel interned it meanwhile, or the map is full
            found = self.dev_ids.lookup(key)
            return int(found.value) if found is not None else None
        self._next_user_id += 1
        self.dev_paths[dev_id] = path
        return dev_id

    # --- holder bytes ---------------------------------------------------------------------

    def set_holder_byte(self, tgid: int, on: bool) -> None:  # a single byte store, see ghostgpu.h
        if self.holder_bytes is not None and 0 <= tgid < len(self.holder_bytes):
            self.holder_bytes[tgid] = int(on)

    # --- seed, resync, forget -------------------------------------------------------------

    def seed(self, tgid: int, fds: Mapping[int, str], mapped_paths: Iterable[str] = (),
             create: bool = True) -> bool:
        """Tell the kernel about holds found in /proc (opened before the tracer started, inherited
        over fork, kept over exec, received over a socket). Idempotent: a known (fd, device) is not
        counted twice. With create=False a tgid without a procs entry is not made a holder (its
        EXIT was already reported). A concurrent open/close by the process may race this; the next
        scan corrects it. True when this call made the tgid a holder (created its procs entry):
        the kernel reports its EXIT only from then on, so the caller checks it is still alive."""
        owned = self.owned.setdefault(tgid, Owned())
        for fd, path in fds.items():
            dev_id = self.intern(path)
            if dev_id is None:
                continue
            key = self.fds.Key(tgid, fd)
            old = self.fds.lookup(key)
            if old is not None and old.dev_id == dev_id:
                owned.fds.add(fd)
                owned.dev_ids.add(dev_id)
                continue
            if old is not None and self.fds.delete(key):  # the fd names another device now
                self._bump_hold(tgid, int(old.dev_id), nfds=-1, mapped=False)
            outcome = self.fds.update(key, self.fds.Leaf(dev_id, FD_SEEDED), BPF_NOEXIST)
            if outcome is Update.WRITTEN:
                self._bump_hold(tgid, dev_id, nfds=1, mapped=False)
            elif outcome is not Update.EXISTS:  # full: the /proc scan still knows the hold
                continue
            # EXISTS: the process opened it itself meanwhile and the kernel counted it.
            owned.fds.add(fd)
            owned.dev_ids.add(dev_id)
        for path in mapped_paths:
            dev_id = self.intern(path)
            if dev_id is not None:
                self._bump_hold(tgid, dev_id, nfds=0, mapped=True)
                owned.dev_ids.add(dev_id)
        held = sum(1 for d in owned.dev_ids if self.holds.lookup(self.holds.Key(tgid, d)) is not None)
        procs_key, leaf = self.procs.Key(tgid), self.procs.Leaf(held)
        if self.procs.update(procs_key, leaf, BPF_EXIST) is Update.WRITTEN:  # a fork child, an exec
            self.set_holder_byte(tgid, True)
            return False
        if not held or not create:
            return False
        # NOEXIST: if the kernel made the entry meanwhile (the process opened a device itself), its
        # count stands and it will report the EXIT.
        if self.procs.update(procs_key, leaf, BPF_NOEXIST) is not Update.WRITTEN:
            return False
        self.set_holder_byte(tgid, True)
        return True

    def _bump_hold(self, tgid: int, dev_id: int, nfds: int, mapped: bool) -> None:
        key = self.holds.Key(tgid, dev_id)
        old = self.holds.lookup(key)
        count, mapped = max(0, (old.nfds if old else 0) + nfds), mapped or bool(old and old.mapped)
        if count == 0 and not mapped:
            self.holds.delete(key)
            return
        self.holds.update(key, self.holds.Leaf(count, int(mapped)))  # FULL: the scan still knows it
        self.owned.setdefault(tgid, Owned()).dev_ids.add(dev_id)

    def reset_fds(self, tgid: int) -> None:
        """After an EXEC: drop the tgid's fd and hold entries (close-on-exec fds and the old
        mappings went without a close), keeping its procs entry, so that an exit from here on is
        still reported, and its ioctl counters, which belong to the process, not the image."""
        owned = self.owned.get(tgid)
        if owned is not None:
            self._drop_fds_and_holds(tgid, owned)

    def _drop_fds_and_holds(self, tgid: int, owned: Owned) -> None:
        for fd in owned.fds:
            self.fds.delete(self.fds.Key(tgid, fd))
        for dev_id in owned.dev_ids:
            self.holds.delete(self.holds.Key(tgid, dev_id))
        owned.fds.clear()
        owned.dev_ids.clear()

    def forget(self, tgid: int) -> None:
        """Drop every kernel entry of `tgid` (after its EXIT and a last ioctl_counts())."""
        self.set_holder_byte(tgid, False)
        self.procs.delete(self.procs.Key(tgid))
        if self.alloc_work is not None:  # keyed by tgid alone: no index needed
            self.alloc_work.delete(self.alloc_work.Key(tgid))
        owned = self.owned.pop(tgid, None)
        if owned is None:
            return
        self._drop_fds_and_holds(tgid, owned)
        for fd, dev_id, cmd in owned.ioctl_keys:
            self.ioctls.delete(self.ioctls.Key(tgid, fd, dev_id, cmd))
        if self.mem_clients is not None:  # its clients went with its files: no CLOSE will come
            for fd in owned.clients:
                self.mem_clients.delete(self.mem_clients.Key(tgid, fd))

    # --- ioctl counters -------------------------------------------------------------------

    def ioctl_counts(self, tgid: int | None = None) -> dict[int, dict[tuple[str, int], int]]:
        """pid -> (device path, ioctl request word) -> count, summed over the pid's fds. One pid:
        a lookup per counter it owns; all: one batch walk (the periodic read)."""
        if tgid is None:
            entries = [(int(k.tgid), int(k.dev_id), int(k.cmd), int(v.value)) for k, v in self.ioctls.items()]
        else:
            owned = self.owned.get(tgid)
            entries = []
            for fd, dev_id, cmd in sorted(owned.ioctl_keys) if owned else ():
                value = self.ioctls.lookup(self.ioctls.Key(tgid, fd, dev_id, cmd))
                if value is not None:
                    entries.append((tgid, dev_id, cmd, int(value.value)))
        out: dict[int, dict[tuple[str, int], int]] = {}
        for pid, dev_id, cmd, count in entries:
            per_pid = out.setdefault(pid, {})
            slot = (self.dev_path(dev_id) or "?", cmd)
            per_pid[slot] = per_pid.get(slot, 0) + count
        return out

    def alloc_record(self, tgid: int) -> AllocRecord | None:
        """What tgid's allocation calls named (bpf/alloc.bpf.c); None: it made none, or no map."""
        if self.alloc_work is None:
            return None
        leaf = self.alloc_work.lookup(self.alloc_work.Key(tgid))
        return unpack_alloc(bytes(leaf)) if leaf is not None else None

    # --- garbage collection ---------------------------------------------------------------

    def sweep(self, alive: Callable[[int], bool]) -> int:
        """Remove the entries of tgids dead at this sweep and the one before (their EXIT record
        was lost, or came before a seed re-created them). O(the maps): periodic only. Two sweeps,
        because an EXIT still in the ring buffer must find its counters to report them."""
        # Each map walked once: the keys seen here are the ones deleted below.
        tables = [self.fds, self.holds, self.ioctls, *([self.mem_clients] if self.mem_clients else [])]
        keyed = [(table, [key for key, _ in table.items()]) for table in tables]
        tgids = set(self.owned) | {int(key.value) for key, _ in self.procs.items()}
        if self.alloc_work is not None:  # forget() below drops these
            tgids |= {int(key.value) for key, _ in self.alloc_work.items()}
        tgids |= {int(key.tgid) for _, keys in keyed for key in keys}
        dead = {tgid for tgid in tgids if not alive(tgid)}
        doomed = dead & self._dead_last_sweep
        self._dead_last_sweep = dead - doomed
        if not doomed:
            return 0
        for tgid in doomed:
            self.forget(tgid)
        # What the index did not know (a lost record): forget() left it. Gone already is fine.
        removed = sum(1 for table, keys in keyed for key in keys
                      if int(key.tgid) in doomed and table.delete(key))
        return removed + len(doomed)
