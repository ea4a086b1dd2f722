"""The kernel side of trace sessions (bpf/trace.bpf.c) as user space drives it: slots, scope maps,
the layout table, the hooks attached only while a session runs, and the trace ring buffer.

The trace ring buffer has its own libbpf consumer (not bcc's, which polls every ring buffer of a
program together): the session thread drains it while the agent's loop drains the attribution
events, and neither waits for the other. Every map operation tolerates an entry the kernel
removed or added meanwhile (a traced process forking or exiting).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import struct
import threading
from collections.abc import Iterable
from typing import Any, NamedTuple

from ghostgpu.tracer.config import TRACE_SLOTS

log = logging.getLogger("ghostgpu.trace")

TREC = struct.Struct("=QQQQQQqIIIIiIIIIIII56s")  # struct gg_trec, 160 bytes
TRACE_KINDS = {1: "ioctl", 2: "open", 3: "close", 4: "mmap", 5: "munmap", 6: "fork", 7: "exec", 8: "exit"}
TF_XFER, TF_STATUS = 1, 2  # gg_trec.flags
SLOTS = TRACE_SLOTS  # GG_TRACE_SLOTS
NO_STATUS = 0xFFFF  # GG_TRACE_NO_STATUS
# Attached only while a session runs (bpf/trace.bpf.c): with none, no process pays for them. The
# ioctl exit is always attached: it also finishes the memory calls (bpf/ioctl.bpf.c).
LAZY_HOOKS = (
    (b"syscalls:sys_exit_mmap", b"tracepoint__syscalls__sys_exit_mmap"),
    (b"syscalls:sys_enter_munmap", b"tracepoint__syscalls__sys_enter_munmap"),
)
_SAMPLE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


class RawTrace(NamedTuple):  # struct gg_trec
    ts_ns: int
    dur_ns: int
    cgroup_id: int
    a0: int
    a1: int
    a2: int
    ret: int
    kind: int
    slots: int
    tgid: int
    tid: int
    fd: int
    dev_id: int
    request: int
    status: int
    xfer_nr: int
    xfer_size: int
    flags: int
    block_len: int
    block: bytes

    @property
    def block_bytes(self) -> bytes:
        return self.block[:min(self.block_len, len(self.block))]


def unpack_trace(data: bytes) -> RawTrace | None:
    return RawTrace(*TREC.unpack_from(data)) if len(data) >= TREC.size else None


def slot_bits(mask: int) -> list[int]:
    return [i for i in range(SLOTS) if mask >> i & 1]


class _Libbpf:
    """The four libbpf ring-buffer calls, from the libbpf that bcc's libbcc links (0.26: libbpf.so.1)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libbpf.so.1")
        lib.ring_buffer__new.restype = ctypes.c_void_p
        lib.ring_buffer__new.argtypes = [ctypes.c_int, _SAMPLE_FN, ctypes.c_void_p, ctypes.c_void_p]
        lib.ring_buffer__poll.restype = ctypes.c_int
        lib.ring_buffer__poll.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.ring_buffer__consume.restype = ctypes.c_int
        lib.ring_buffer__consume.argtypes = [ctypes.c_void_p]
        lib.ring_buffer__free.restype = None
        lib.ring_buffer__free.argtypes = [ctypes.c_void_p]
        self.lib = lib


class TraceKernel:
    """Slots, scope, layouts and the ring buffer of bpf/trace.bpf.c, over a loaded bcc program."""

    def __init__(self, bpf: Any) -> None:
        self._bpf = bpf
        # Attach state, trace_on and the scope masks: commands, the session thread and the agent
        # (forget_fork) all change them.
        self._lock = threading.Lock()
        self._attached = True  # bcc attached every TRACEPOINT_PROBE at load
        self._active: set[int] = set()
        self._records: list[bytes] = []
        self._lib = _Libbpf().lib
        self._cb = _SAMPLE_FN(self._on_record)  # kept referenced: libbpf calls it
        self._rb = self._lib.ring_buffer__new(bpf[b"trace_events"].map_fd, self._cb, None, None)
        if not self._rb:
            raise OSError("libbpf ring_buffer__new failed for trace_events")
        self._set_attached(False)

    # --- hooks and slots ----------------------------------------------------------------------

    def _set_attached(self, on: bool) -> None:
        if on == self._attached:
            return
        for tp, fn in LAZY_HOOKS:
            if on:
                self._bpf.attach_tracepoint(tp=tp, fn_name=fn)
            else:
                with contextlib.suppress(Exception):  # not attached (a failed earlier attach)
                    self._bpf.detach_tracepoint(tp)
        self._attached = on

    @property
    def attached(self) -> bool:
        return self._attached

    def set_layouts(self, layouts: dict[int, tuple[int, int]]) -> None:
        """effective request word -> (capture_len, status_off) for the running driver."""
        table = self._bpf[b"trace_layout"]
        for word, (capture_len, status_off) in layouts.items():
            leaf = table.Leaf()
            leaf.capture_len, leaf.status_off = capture_len, status_off
            table[table.Key(word & 0xFFFFFFFF)] = leaf

    def open_slot(self, slot: int, max_records: int) -> None:
        table = self._bpf[b"trace_slots"]
        leaf = table.Leaf()
        leaf.records = leaf.over_limit = leaf.drops = 0
        leaf.max_records, leaf.active = max_records, 1
        table[table.Key(slot)] = leaf
        with self._lock:
            self._set_attached(True)  # before trace_on: an entry never waits for an unattached exit
            self._active.add(slot)
            self._write_on()

    def close_slot(self, slot: int) -> None:
        """Stop recording for `slot` (its counters stay readable) and take its bit off every scope."""
        table = self._bpf[b"trace_slots"]
        with contextlib.suppress(KeyError):
            leaf = table[table.Key(slot)]
            leaf.active = 0
            table[table.Key(slot)] = leaf
        with self._lock:
            for name in (b"trace_cgroups", b"trace_tgids", b"trace_pincg"):
                self._clear_bit(name, slot)
            self._write_pinned(slot, False)
            self._active.discard(slot)
            self._write_on()
            if not self._active:
                self._set_attached(False)
                # Calls left in flight by the detach, forks and mappings of the ended sessions: none
                # may surface in the next session (a stale entry would be taken by the next exit).
                for name in (b"trace_inflight", b"trace_forked", b"trace_maps"):
                    self._bpf[name].clear()

    def _write_on(self) -> None:
        table = self._bpf[b"trace_on"]
        table[table.Key(0)] = table.Leaf(len(self._active))

    def _clear_bit(self, name: bytes, slot: int, keep: Iterable[int] = ()) -> None:
        """Take `slot`'s bit off every key of map `name` but those in `keep` (a key left with no bit
        goes); keys without the bit are not written."""
        table, kept = self._bpf[name], set(keep)
        for key, value in list(table.items()):
            if key.value in kept or not value.value >> slot & 1:
                continue
            mask = value.value & ~(1 << slot)
            with contextlib.suppress(KeyError):  # a traced tgid exited meanwhile
                if mask:
                    table[key] = table.Leaf(mask)
                else:
                    del table[key]

    def set_cgroups(self, slot: int, cgroup_ids: Iterable[int]) -> None:
        """Make `slot`'s cgroup scope exactly `cgroup_ids`."""
        wanted = set(cgroup_ids)
        with self._lock:  # masks are read-modify-written: one writer at a time
            self._clear_bit(b"trace_cgroups", slot, keep=wanted)
            table = self._bpf[b"trace_cgroups"]
            for cgroup_id in wanted:
                self._add_bit(table, table.Key(cgroup_id), slot)

    def pin(self, slot: int, cgroup_ids: Iterable[int]) -> None:
        """Keep `slot`'s pid scope to these cgroups: a process of it in any other cgroup is out of
        the scope, and leaves it at its exec (bpf/trace.bpf.c trace_pinned, trace_pincg)."""
        with self._lock:
            table = self._bpf[b"trace_pincg"]
            for cgroup_id in set(cgroup_ids):
                self._add_bit(table, table.Key(cgroup_id), slot)
            self._write_pinned(slot, True)

    def _write_pinned(self, slot: int, on: bool) -> None:
        table = self._bpf[b"trace_pinned"]
        key = table.Key(0)
        mask = int(table[key].value)
        table[key] = table.Leaf(mask | 1 << slot if on else mask & ~(1 << slot))

    def add_tgid(self, slot: int, tgid: int) -> None:
        """Put `tgid` in `slot`'s scope; its forks from now on join it in the kernel."""
        table = self._bpf[b"trace_tgids"]
        with self._lock:
            self._add_bit(table, table.Key(tgid), slot)

    def forget_fork(self, tgid: int) -> None:
        """User space seeded tgid's own fds: stop resolving its fds through its parent's."""
        if self._active:
            with contextlib.suppress(KeyError):
                del self._bpf[b"trace_forked"][ctypes.c_uint32(tgid)]

    @staticmethod
    def _add_bit(table: Any, key: Any, slot: int) -> None:
        try:
            mask = table[key].value
        except KeyError:
            mask = 0
        table[key] = table.Leaf(mask | 1 << slot)

    def slot_counts(self, slot: int) -> tuple[int, int, int]:
        """(records, calls past the limit, ring-buffer drops) of `slot`."""
        table = self._bpf[b"trace_slots"]
        try:
            leaf = table[table.Key(slot)]
        except KeyError:
            return 0, 0, 0
        return int(leaf.records), int(leaf.over_limit), int(leaf.drops)

    def dev_paths(self) -> dict[int, str]:
        """The kernel's device-path ids (dev_ids), read now."""
        out: dict[int, str] = {}
        for key, value in list(self._bpf[b"dev_ids"].items()):
            out[int(value.value)] = bytes(key.path).split(b"\0", 1)[0].decode(errors="replace")
        return out

    # --- the ring buffer --------------------------------------------------------------------------

    def _on_record(self, _ctx: Any, data: Any, size: int) -> int:
        self._records.append(ctypes.string_at(data, size))
        return 0

    def poll(self, timeout_ms: int) -> list[bytes]:
        """Wait up to timeout_ms for records; every record waiting is returned, in order."""
        if self._rb:
            self._lib.ring_buffer__poll(self._rb, timeout_ms)
            self._lib.ring_buffer__consume(self._rb)
        records, self._records = self._records, []
        return records

    def close(self) -> None:
        with self._lock:
            self._active.clear()
            with contextlib.suppress(Exception):
                self._write_on()
        if self._rb:
            self._lib.ring_buffer__free(self._rb)
            self._rb = None
