"""The BPF source: loads bpf/*.bpf.c with bcc, turns ring-buffer records into SourceEvents.

The only module that imports bcc (lazily, in start()). The pure parts (cflags, the event decoder,
format and capability checks) are module functions so unit tests need neither root nor bcc.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import struct
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from ghostgpu.tracer import gpu_work
from ghostgpu.tracer.bpf_build import (
    BPF_DIR,
    OPTIONAL_SYSCALLS,
    PID_MAX_LIMIT,
    build_cflags,
    find_tracefs,
    format_has_field,
    has_caps,
    kmsg_origin_supported,
    program_text,
)
from ghostgpu.tracer.config import TracerConfig
from ghostgpu.tracer.events import EventKind, Holder, ProcView, SourceEvent, boot_ns
from ghostgpu.tracer.identity import group_dead
from ghostgpu.tracer.kernel_maps import KernelMap, LibbccOps
from ghostgpu.tracer.kernel_tables import HolderTables
from ghostgpu.tracer.memcalls import MemCall, MemCallKind
from ghostgpu.tracer.rescan import take_marked

from ghostgpu.common.model.consumers import DeviceRef
from ghostgpu.common.system.settings import default_of

EVENT = struct.Struct("=QQIIIiIIII")  # struct gg_event, 48 bytes
# ghostgpu.h GG_EV_*, GG_FLAG_* and the GG_STAT_* slot order.
KINDS = {**dict(enumerate((EventKind.OPEN, EventKind.CLOSE, EventKind.MMAP, EventKind.FORK, EventKind.EXEC,
                           EventKind.EXIT), start=1)), 9: EventKind.RENAME}
EV_OPEN, EV_MMAP, EV_FD, EV_IOCTL_KEY, EV_MEMCALL = 1, 3, 7, 8, 10
BOOKKEEPING_KINDS = {EV_FD: "FD", EV_IOCTL_KEY: "IOCTL_KEY"}  # keys a tgid owns: never SourceEvents
FLAG_MAPPED, FLAG_LEADER_ONLY = 1, 2
TABLES = ("fds", "holds", "procs", "ioctls", "dev_ids", "alloc_work", "mem_clients")
STAT_NAMES = ("ringbuf_drops", "fds_full", "holds_full", "procs_full", "ioctls_full", "dev_ids_full",
              "pending_full", "forking_full", "allocs_full", "mem_refused", "mem_failed", "mem_lost",
              "mem_clients_full", "mem_drops")
# Slots that count what calls came to (refused by RM, failed ioctls), not something lost to a full
# map or ring buffer: the others should all read 0.
OUTCOME_STATS = ("mem_refused", "mem_failed")
# struct gg_memcall (bpf/alloc.bpf.c), 88 bytes: gg_event's first seven fields, then the call.
MEMCALL = struct.Struct("=QQIIIiIIIIIIQIIIIII")
MCF_INSTANCE = 1  # GG_MCF_INSTANCE
SLOW_PATHS = (b"gg_settle", b"gg_open_match")
KHEADERS = "/sys/kernel/kheaders.tar.xz"
# struct gg_log_line (bpf/printk.bpf.c): boot ns, text bytes (NUL included), user flag, text.
LOG_LINE = struct.Struct("=QII248s")
FACILITY_USER = 1  # LOG_USER: what devkmsg_write gives a line user space wrote (kernel/printk/printk.c)


class BpfUnavailable(RuntimeError):
    """BPF cannot be used here; the message is one line naming what is missing and what to do."""


class RawEvent(NamedTuple):  # struct gg_event without its padding
    ts_ns: int
    cgroup_id: int
    kind: int
    tgid: int
    tid: int
    fd: int
    dev_id: int
    child_pid: int  # gg_event.arg: the child's pid for FORK (see `request` for IOCTL_KEY)
    flags: int

    @property
    def request(self) -> int:
        """IOCTL_KEY: the ioctl request word, carried in gg_event.arg."""
        return self.child_pid


def unpack_event(data: bytes) -> RawEvent | None:
    return RawEvent(*EVENT.unpack_from(data)[:9]) if len(data) >= EVENT.size else None


def decode_event(
    data: bytes, dev_paths: Mapping[int, str], classify: Callable[[str], DeviceRef] = DeviceRef
) -> SourceEvent | None:
    """One ring-buffer record -> SourceEvent; None for a short record or an unknown kind.
    An id missing from dev_paths (or id 0: FORK/EXEC/EXIT) gives device=None."""
    raw = unpack_event(data)
    if raw is None or raw.kind not in KINDS:
        return None
    path = dev_paths.get(raw.dev_id) if raw.dev_id else None
    return SourceEvent(
        kind=KINDS[raw.kind], source="bpf", ts_ns=raw.ts_ns, pid=raw.tgid, tid=raw.tid, fd=raw.fd,
        device=classify(path) if path is not None else None, cgroup_id=raw.cgroup_id,
        child_pid=raw.child_pid, mapped=bool(raw.flags & FLAG_MAPPED),
    )


def decode_memcall(data: bytes) -> MemCall | None:
    """One GG_EV_MEMCALL record -> MemCall; None for a short record, another kind or an unknown
    call kind (a newer kernel side than this decoder)."""
    if len(data) < MEMCALL.size:
        return None
    (ts_ns, _cgroup_id, kind, tgid, _tid, fd, _dev_id, mkind, h_root, h_parent, h_object, h_class,
     size, attr, instance, src_client, src_object, flags, _pad) = MEMCALL.unpack_from(data)
    if kind != EV_MEMCALL or mkind not in MemCallKind._value2member_map_:
        return None
    return MemCall(kind=MemCallKind(mkind), ts_ns=ts_ns, pid=tgid, fd=fd, h_root=h_root, h_parent=h_parent,
                   h_object=h_object, h_class=h_class, size_bytes=size, attr=attr,
                   instance=instance if flags & MCF_INSTANCE else None, src_client=src_client,
                   src_object=src_object)


def decode_log_line(data: bytes) -> tuple[int, str, int] | None:
    """One bpf/printk.bpf.c record -> (boot ns, text, facility): facility 0 for the kernel's own
    line, FACILITY_USER for one written to /dev/kmsg (the kernel side saw its writer inside a
    write syscall). None for a short record. The text loses its NUL; bytes that are not UTF-8 are
    replaced, not fatal."""
    if len(data) < LOG_LINE.size:
        return None
    ts_ns, length, user, raw = LOG_LINE.unpack_from(data)
    text = raw[:max(0, min(length, len(raw)) - 1)].split(b"\0", 1)[0].decode(errors="replace")
    return ts_ns, text.rstrip("\n"), FACILITY_USER if user else 0


def read_module_version(sys_root: str = "/sys") -> str | None:
    """The loaded nvidia module's version (/sys/module/nvidia/version), None when not loaded."""
    text = _read(f"{sys_root}/module/nvidia/version").strip()
    return text or None


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:  # gone (a process exited mid-read) or not there on this kernel
        return ""


class BpfSource:
    """Kernel-side tracking of GPU device holders; see bpf/ghostgpu.h for the maps."""

    def __init__(
        self, prefixes: tuple[str, ...], max_fds: int = default_of(TracerConfig, "bpf_max_fds"),
        ringbuf_pages: int = default_of(TracerConfig, "bpf_ringbuf_pages"),
        bpf_dir: Path | None = None, classify: Callable[[str], DeviceRef] = DeviceRef,
        proc_root: str = "/proc", holder_filter: bool = True, driver_version: str | None = None,
    ) -> None:
        self.prefixes, self.max_fds, self.ringbuf_pages = tuple(prefixes), max_fds, ringbuf_pages
        self.bpf_dir, self.classify, self.proc_root = bpf_dir or BPF_DIR, classify, proc_root
        self.holder_filter = holder_filter  # False only to measure the filter (bench)
        # The NVIDIA driver's version (RM_ALLOC's status offsets depend on it): given (from NVML),
        # else read at start() from /sys/module/nvidia/version or /proc/driver/nvidia/version.
        self.driver_version = driver_version
        self.start_s: float | None = None  # how long start() took (compile + load + attach)
        self.programs_attached = 0  # tracepoint programs bcc attached (tail-call targets are not)
        self.have_group_dead = False  # from the exit tracepoint's format, at start()
        self.tables: HolderTables | None = None  # the kernel tables, once started
        self._bpf: Any = None
        self._records: list[bytes] = []
        self._memcalls: list[MemCall] = []  # decoded by poll(), handed out by take_memcalls()
        self._log_lines: list[tuple[int, str, int]] = []  # Xid lines from printk, by poll()
        self.log_origin_known = False  # a user-written Xid line is told apart (bpf/printk.bpf.c)
        self._leader_exits: dict[int, SourceEvent] = {}  # tgid -> EXIT waiting for the group to die
        self._holder_map: mmap.mmap | None = None
        self._touched_map: mmap.mmap | None = None
        self.trace: Any = None  # tracer.trace_kernel.TraceKernel once started (None: no trace sessions)
        self.trace_error = ""  # why trace sessions cannot run, when trace is None

    def _preflight(self) -> tuple[Any, str]:
        try:
            import bcc
        except ImportError:
            raise BpfUnavailable("bcc is not installed: apt-get install python3-bpfcc") from None
        caps = [ln.split()[1] for ln in _read("/proc/self/status").splitlines() if ln.startswith("CapEff:")]
        if os.geteuid() != 0 and not (caps and has_caps(caps[0])):
            raise BpfUnavailable("not root and no CAP_BPF+CAP_PERFMON: run the tracer as root (privileged)")
        if (tracefs := find_tracefs()) is None:
            raise BpfUnavailable("tracefs is not mounted: mount -t tracefs tracefs /sys/kernel/tracing")
        release = os.uname().release  # bcc takes /lib/modules/<release>/build or CONFIG_IKHEADERS
        if not any(Path(p).exists() for p in (f"/lib/modules/{release}/build/include", KHEADERS)):
            raise BpfUnavailable(f"kernel headers missing for {release}: run scripts/bootstrap.sh install")
        return bcc, tracefs

    def start(self) -> None:
        """Compile, load and attach every program. Raises BpfUnavailable with one clear line."""
        if self._bpf is not None:
            return
        t0 = time.monotonic()
        bcc, tracefs = self._preflight()
        exit_format = _read(f"{tracefs}/events/sched/sched_process_exit/format")
        self.have_group_dead = format_has_field(exit_format, "group_dead")
        present = [n for n in OPTIONAL_SYSCALLS if os.path.isdir(f"{tracefs}/events/syscalls/sys_enter_{n}")]
        pid_max = _read("/proc/sys/kernel/pid_max").strip()
        uname = os.uname()
        self.log_origin_known = kmsg_origin_supported(uname.release, uname.machine,
                                                      os.path.exists("/sys/kernel/btf/vmlinux"))
        if self.driver_version is None:
            from ghostgpu.tracer.call_decode import read_driver_version

            self.driver_version = read_module_version() or read_driver_version(self.proc_root)
        try:
            cflags = build_cflags(
                self.prefixes, max_fds=self.max_fds, ringbuf_pages=self.ringbuf_pages,
                pid_max=int(pid_max) if pid_max.isdigit() else PID_MAX_LIMIT,
                have_group_dead=self.have_group_dead, syscalls=present, bpf_dir=self.bpf_dir,
                holder_filter=self.holder_filter, driver_version=self.driver_version,
                kmsg_origin=self.log_origin_known,
            )
            self._bpf = bcc.BPF(text=program_text(self.bpf_dir).encode(), cflags=cflags)
        except ValueError as exc:  # a prefix the kernel matcher cannot take
            raise BpfUnavailable(str(exc)) from None
        except Exception as exc:  # bcc raises bare Exception; the compiler's detail went to stderr
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise BpfUnavailable(f"loading the ghostgpu BPF programs failed ({detail}); see stderr") from None
        try:
            for slot, name in enumerate(SLOW_PATHS):  # tail-call targets, ghostgpu.h GG_SLOW_*
                prog = self._bpf.load_func(name, bcc.BPF.TRACEPOINT)
                self._bpf[b"slow"][ctypes.c_int(slot)] = ctypes.c_int(prog.fd)
            self._bpf[b"events"].open_ring_buffer(self._on_record)
            self._bpf[b"log_lines"].open_ring_buffer(self._on_log_line)
            holder = self._bpf[b"holder_bytes"]  # one byte per tgid, see gg_maybe_holder()
            prot = mmap.PROT_READ | mmap.PROT_WRITE
            self._holder_map = mmap.mmap(holder.map_fd, len(holder) * 4096, mmap.MAP_SHARED, prot)
            touched = self._bpf[b"touched_bytes"]  # fd tables changed since the last rescan
            self._touched_map = mmap.mmap(touched.map_fd, len(touched) * 4096, mmap.MAP_SHARED, prot)
            ops = LibbccOps()
            self.tables = HolderTables({name: KernelMap.of(self._bpf, name, ops) for name in TABLES},
                                       self._holder_map)
            self._write_alloc_classes()
        except Exception as exc:
            self.close()
            raise BpfUnavailable(f"setting up the ghostgpu BPF maps failed: {exc}") from None
        try:
            from ghostgpu.tracer.trace_kernel import TraceKernel

            self.trace = TraceKernel(self._bpf)  # detaches the hooks only a session needs
        except Exception as exc:  # attribution runs on; sessions are refused with this line
            self.trace_error = f"trace sessions unavailable: {exc}"
        self.programs_attached = int(self._bpf.num_open_tracepoints())
        self.start_s = time.monotonic() - t0
        # LLVM's compile leaves ~25 MB of freed heap the allocator keeps (measured with bcc 0.26,
        # glibc 2.36): hand it back, this process never compiles again.
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)

    def close(self) -> None:
        """Detach and unload everything; safe to call twice."""
        if self.trace is not None:
            self.trace.close()
            self.trace = None
        if self.tables is not None:
            self.tables.holder_bytes = None
            self.tables = None
        if self._holder_map is not None:
            self._holder_map.close()
            self._holder_map = None
        if self._touched_map is not None:
            self._touched_map.close()
            self._touched_map = None
        if self._bpf is not None:
            self._bpf.cleanup()
            self._bpf = None
        self.programs_attached = 0

    def _on_log_line(self, _ctx: Any, data: Any, size: int) -> int:  # bcc's ring buffer callback
        line = decode_log_line(ctypes.string_at(data, size))
        if line is not None:
            self._log_lines.append(line)
        return 0

    def take_log_lines(self) -> list[tuple[int, str, int]]:
        """The Xid lines printk stored since the last take, as poll() read them: (boot ns, text,
        facility), facility 0 for the kernel's own and FACILITY_USER for a line user space wrote
        to /dev/kmsg (tracer/faults.py FaultWatch.offer takes the three)."""
        lines, self._log_lines = self._log_lines, []
        return lines

    def _write_alloc_classes(self) -> None:
        """The category of every RM class id, for bpf/alloc.bpf.c (written once, 256 pages)."""
        table, data = self._bpf[b"alloc_classes"], gpu_work.category_table()
        for page in range(len(data) // 256):
            leaf = table.Leaf()
            ctypes.memmove(ctypes.addressof(leaf), data[page * 256:(page + 1) * 256], 256)
            table[table.Key(page)] = leaf

    def _on_record(self, _ctx: Any, data: Any, size: int) -> int:  # bcc's ring buffer callback
        self._records.append(ctypes.string_at(data, size))
        return 0

    def fileno(self) -> int:
        """An epoll fd that turns readable when events wait (for the agent's selector); -1 if none."""
        manager = getattr(self._bpf, "_ringbuf_manager", None)  # libbpf's struct ring_buffer *
        try:
            libbpf = ctypes.CDLL("libbpf.so.1")  # the libbpf that bcc 0.26's libbcc links
        except OSError:
            return -1
        libbpf.ring_buffer__epoll_fd.argtypes = [ctypes.c_void_p]
        return int(libbpf.ring_buffer__epoll_fd(manager)) if manager else -1

    def poll(self, timeout_ms: int) -> list[SourceEvent]:
        """Wait up to timeout_ms for ring-buffer records and return them as events, in order.
        Bookkeeping records (which keys a tgid owns) go to the tables and are not returned."""
        if self._bpf is None or self.tables is None:
            return []
        self._bpf.ring_buffer_poll(timeout_ms)
        self._bpf.ring_buffer_consume()  # records committed whose wakeup (irq_work) is still due
        records, self._records = self._records, []
        tables = self.tables
        events: list[SourceEvent] = []
        for data in records:
            raw = unpack_event(data)
            if raw is None:
                continue
            if raw.kind == EV_MEMCALL:
                self._take_memcall(data)
                continue
            if raw.kind in (EV_OPEN, EV_FD):
                tables.note_fd(raw.tgid, raw.fd, raw.dev_id)
            elif raw.kind == EV_MMAP:
                tables.note_mapping(raw.tgid, raw.dev_id)
            elif raw.kind == EV_IOCTL_KEY:
                tables.note_ioctl_key(raw.tgid, raw.fd, raw.dev_id, raw.request)
                continue
            if raw.dev_id and raw.dev_id not in tables.dev_paths:
                tables.refresh_dev_paths()
            event = decode_event(data, tables.dev_paths, self.classify)
            if event is None:
                continue
            if raw.flags & FLAG_LEADER_ONLY:
                self._leader_exits[raw.tgid] = event  # reported once the whole group is gone
            else:
                events.append(event)
        events.extend(self._settle_leader_exits())
        return events

    def _take_memcall(self, data: bytes) -> None:
        call = decode_memcall(data)
        if call is None:
            return
        if call.kind is MemCallKind.ALLOC and self.tables is not None and \
                gpu_work.class_bits(call.h_class) & gpu_work.ClassBit.CLIENT:
            self.tables.note_mem_client(call.pid, call.fd)  # the kernel keeps (pid, fd) for the CLOSE
        elif call.kind is MemCallKind.CLOSE and self.tables is not None:
            self.tables.drop_mem_client(call.pid, call.fd)
        self._memcalls.append(call)

    def take_memcalls(self) -> list[MemCall]:
        """The memory calls the driver accepted that poll() decoded since the last take, in the
        order the kernel emitted them (tracer/memcalls.py)."""
        calls, self._memcalls = self._memcalls, []
        return calls

    def _settle_leader_exits(self) -> list[SourceEvent]:
        """Kernels without group_dead: the leader's EXIT becomes EXIT once no live task is left."""
        done: list[SourceEvent] = []
        for tgid, event in list(self._leader_exits.items()):
            if group_dead(_read(f"{self.proc_root}/{tgid}/stat")):
                del self._leader_exits[tgid]
                done.append(replace(event, ts_ns=boot_ns()))
        return done

    # --- the kernel tables (tracer/kernel_tables.py): no-ops before start() or after close() ---

    def seed(self, pid: int, fds: Mapping[int, str], mapped_paths: Iterable[str] = (),
             create: bool = True) -> bool:
        """Tell the kernel about holds found in /proc; True when it made pid a holder just now
        (see HolderTables.seed)."""
        return self.tables.seed(pid, fds, mapped_paths, create) if self.tables is not None else False

    def seed_view(self, view: ProcView, pids: set[int] | None) -> set[int]:
        """Write what a /proc scan found into the kernel tables; the pids made holders just now."""
        created: set[int] = set()
        for pid, holds in view.items():
            fds = {fd: path for path, hold in holds.items() for fd in hold.fds}
            mapped = [path for path, hold in holds.items() if hold.mapped]
            if self.seed(pid, fds, mapped):
                created.add(pid)
            if self.trace is not None:
                self.trace.forget_fork(pid)
        for pid in (pids or set()) - view.keys():
            # Rescanned and holding nothing now (an exec that dropped its close-on-exec fds): the
            # kernel's count goes to 0, its procs entry stays until EXIT (its counters wait for it).
            self.seed(pid, {}, (), create=False)
        return created

    def reset_fds(self, pid: int) -> None:
        """After an EXEC: drop the pid's stale fd and hold entries; see HolderTables.reset_fds."""
        if self.tables is not None:
            self.tables.reset_fds(pid)

    def ioctl_counts(self, pid: int | None = None) -> dict[int, dict[tuple[str, int], int]]:
        """pid -> (device path, ioctl request word) -> count, summed over the pid's fds."""
        return self.tables.ioctl_counts(pid) if self.tables is not None else {}

    def fill_gpu_work(self, holders: Iterable[Holder]) -> None:
        """Set each holder's gpu_work from the kernel's allocation record (tracer/gpu_work.py)."""
        tables = self.tables
        if tables is None or tables.alloc_work is None:
            return
        gpu_work.fill(holders, tables.alloc_record, lambda: self.stats().get("allocs_full", 0) > 0)

    def any_allocated(self, pids: Iterable[int]) -> bool:
        """Whether any of these tgids has made a work allocation call (one lookup each)."""
        tables = self.tables
        return tables is not None and any(
            (record := tables.alloc_record(pid)) is not None and record.allocated for pid in pids)

    def forget(self, pid: int) -> None:
        """Drop every kernel entry of tgid `pid` (after its EXIT and a last ioctl_counts())."""
        if self.tables is not None:
            self.tables.forget(pid)
        self._leader_exits.pop(pid, None)

    def sweep(self, alive: Callable[[int], bool]) -> int:
        """Remove the entries of tgids dead for two sweeps (periodic, O(the maps))."""
        return self.tables.sweep(alive) if self.tables is not None else 0

    def owned_tgids(self) -> int:
        """How many tgids the tables' index holds keys for (a gauge: bounded by live holders)."""
        return len(self.tables.owned) if self.tables is not None else 0

    def take_touched(self) -> set[int]:
        """The tgids that released an fd since the last call (ghostgpu.h touched_bytes), cleared."""
        return take_marked(self._touched_map) if self._touched_map is not None else set()

    def stats(self) -> dict[str, int]:
        """Kernel-side counters summed over CPUs: ring-buffer drops and full-map insert failures."""
        if self._bpf is None:
            return dict.fromkeys(STAT_NAMES, 0)
        table = self._bpf[b"stats"]
        return {name: int(table.sum(table.Key(i)).value) for i, name in enumerate(STAT_NAMES)}
