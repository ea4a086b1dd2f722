"""The long-running node agent: sources -> the holder table -> classify -> sinks.

One thread, one loop: wait on the BPF ring buffer (or the stop event when BPF is off), apply
what arrived, and on their own clocks read NVML, rescan /proc, read ioctl counters and
re-classify. Everything that changes goes to the sink as it happens.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ghostgpu.tracer import records
from ghostgpu.tracer.agent_scan import EXIT_WAIT_S, AgentScans, IoctlCounts
from ghostgpu.tracer.cgroup import CgroupIdResolver
from ghostgpu.tracer.classify import ClassifyConfig, classify, diff_consumers
from ghostgpu.tracer.config import TracerConfig
from ghostgpu.tracer.containment import Containment, HealthReport
from ghostgpu.tracer.devices import DeviceCatalog
from ghostgpu.tracer.events import EventKind, HeldMemory, Holder, NvmlView, SourceEvent, boot_ns
from ghostgpu.tracer.faults import FaultWatch
from ghostgpu.tracer.gpu_memory import MemoryAccountant
from ghostgpu.tracer.holders import HolderTable
from ghostgpu.tracer.identity import Identities
from ghostgpu.tracer.memcalls import MemCallKind
from ghostgpu.tracer.nvml import NvmlSource
from ghostgpu.tracer.procfs import ProcScanner, ticks_to_boot_ns
from ghostgpu.tracer.rescan import RescanPlanner
from ghostgpu.tracer.sinks import Sink

from ghostgpu.common.model.consumers import Consumer, ConsumerClass, ConsumerKey
from ghostgpu.common.model.records import GpuInfo, ProcessIdentity

if TYPE_CHECKING:
    from ghostgpu.tracer.bpf_source import BpfSource  # imports bcc: only where BPF runs
    from ghostgpu.tracer.memcalls import MemCall

log = logging.getLogger("ghostgpu.tracer")

CLASSIFY_INTERVAL_S = 0.25  # how soon a consumer leaves `pending` once its grace period ends
# Kernel counters (tracer/bpf_source.py STAT_NAMES) that say an accepted memory call never reached the
# accountant (its stash was evicted, the ring buffer was full) or a client's close went unreported
# (the client-fd set was full): every figure of a process alive then may be wrong.
MEMCALL_LOSS_STATS = ("mem_lost", "mem_drops", "mem_clients_full")
MEMCALLS_LOST = "the kernel side lost some of the driver's memory calls (a table or the ring buffer was full)"
# How many recent exits a memory call queued behind them is checked against (see _apply_memcall).
GONE_MAX = 4096
# A process forked from one whose clients the accountant tracks shares its open files, and with them
# the memory of their clients, which the parent's figure counts while it lives (_fill_memory).
SHARES_PARENT = ("it shares the GPU memory of device files it inherited from PID {parent}, whose figure "
                 "counts it")


class Tracer:
    def __init__(self, cfg: TracerConfig, sink: Sink, health: HealthReport | None = None) -> None:
        self.cfg = cfg
        # The classifier's fixed settings, once; classify_config() adds what changes per step.
        self._classify_settings = replace(ClassifyConfig.of(cfg), boot_ns_of_ticks=ticks_to_boot_ns)
        self.sink = sink
        self.health = health  # reported into at start, per loop step and per full scan; read by HTTP
        if health is not None:
            health.tracer = self
        self.catalog = DeviceCatalog(cfg.prefixes, cfg.proc_root)
        self.scanner = ProcScanner(self.catalog, cfg.proc_root,
                                   on_hint=lambda line: self._notice("device_prefix", line))
        self.rescans = RescanPlanner(cfg.full_scan_interval_s, cfg.proc_root, take_touched=self._take_touched)
        self.cgroups = CgroupIdResolver(cfg.cgroup_root)
        self.identities = Identities(cfg.proc_root, self.cgroups)
        self.nvml_source = NvmlSource()
        self.nvml = NvmlView(available=False, error="NVML not read yet")
        self.state = HolderTable(self.identities.identify, exists=self.identities.alive)
        # GPU faults (Xid) from the kernel log, joined to the holders on this loop (tracer/faults.py).
        self.faults = FaultWatch(cfg.node_name)
        self.bpf: BpfSource | None = None  # when the kernel side runs
        self.consumers: dict[ConsumerKey, Consumer] = {}
        self.nvml_first_listed: dict[tuple[str, int], int] = {}
        self.stop_event = threading.Event()
        self.errors = Containment()  # one bad event or scan is counted, never fatal
        self.own_pids = {os.getpid()}
        self._due: dict[str, float] = {}
        self._exit_due: dict[int, float] = {}  # pid -> when /proc settles it if its EXIT never came
        # Holder pid -> boot ns it was last seen alive (an event of it, a scan that read its fds): an
        # exit found through /proc happened after that, and the fault join's look-back starts there.
        self._alive_ns: dict[int, int] = {}
        self._dirty = True
        self._bpf_stats: dict[str, int] = {}
        self._info_signature: tuple[Any, ...] | None = None  # None until `ready` was emitted
        self._info_gpus: tuple[GpuInfo, ...] = ()  # the GPUs (and memory split) the last `info` sent
        self._split_stale = False  # consumers or NVML changed since the split was last compared
        # GPU memory from the driver's calls (tracer/gpu_memory.py), fed by the kernel side.
        self.memory = MemoryAccountant(cfg.max_memory_objects)
        self._memory_fds: dict[int, set[int]] = {}  # pid -> fds it made accepted memory calls on
        self._memory_gone: dict[int, int] = {}  # pid -> boot ns of its exit (newest last)
        self._memory_dead_last_sweep: set[int] = set()  # pids with memory found dead by the last sweep
        # The FORKs of holders, both ways: a child shares its parent's open files, and RM frees a file's
        # clients only when the last process holding it lets it go (_release_fd).
        self._forked_from: dict[int, int] = {}  # child pid -> parent pid
        self._forks: dict[int, set[int]] = {}  # parent pid -> child pids
        self._memory_changed = False  # calls applied since the consumers were last classified
        self._memcalls_lost_ns: int | None = None  # when the kernel side last lost memory calls
        # The /proc scans and ioctl counter reads (tracer/agent_scan.py): they call back into this
        # loop for the kernel's queued events and for the records and exits they find.
        self.scans = AgentScans(self, self.scanner, self.rescans, self.state, self.identities, self.errors,
                                health, exit_due=self._exit_due, alive_ns=self._alive_ns)

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._started_s = time.monotonic()
        off_reason = self._start_bpf()
        if self.health is not None:
            self.health.bpf_started(self.bpf.programs_attached if self.bpf is not None else 0, off_reason)
        self._read_nvml()
        if not self.nvml.available:
            self._notice("nvml", f"{self.nvml.error}; classes that need NVML are reported as unknown")
        # Read from now on (no replay): an Xid logged during the first scan is joined once it is done.
        # The one choice of where Xid lines come from: with BPF, the printk tracepoint
        # (bpf/printk.bpf.c: no /dev/kmsg, which a pod's container lacks, and no CAP_SYSLOG); without
        # it, /dev/kmsg (tracer/kmsg.py).
        if self.bpf is None:
            kmsg_off = self.faults.start()
            if kmsg_off:
                self._notice("kmsg", kmsg_off)
        elif not self.bpf.log_origin_known:
            self._notice("kmsg", "Xid lines are read from printk, but this kernel does not let the "
                                 "tracer tell one that user space wrote to /dev/kmsg (needs x86_64, Linux "
                                 "5.15+ and kernel BTF): every line reads as the kernel's")
        # BPF is attached before the first scan, so nothing opened in between slips through;
        # what both see is merged by the holder table.
        self.errors.run("scan", self._scan, True)
        self.errors.run("classify", self._classify)
        self.sink.emit(records.ready_record(self.cfg.node_name, self.bpf is not None, self.nvml.available,
                                            time.monotonic() - self._started_s, len(self.state.holders)))
        self._emit_info()
        if self.health is not None:
            self.health.started()

    def _start_bpf(self) -> str:
        """Attach the kernel side; '' when attached, else why it is off."""
        if self.cfg.bpf == "off":
            return "--bpf off"
        from ghostgpu.tracer.bpf_source import BpfSource, BpfUnavailable

        source = BpfSource(self.cfg.prefixes, max_fds=self.cfg.bpf_max_fds,
                           ringbuf_pages=self.cfg.bpf_ringbuf_pages, classify=self.catalog.ref_for)
        try:
            source.start()
        except BpfUnavailable as exc:
            if self.cfg.bpf == "on":
                raise
            self._notice("bpf", f"{exc}; running on /proc scans every {self.cfg.scan_interval_s:g} s only")
            return str(exc)
        self.bpf = source
        return ""

    def stop(self) -> None:
        self.stop_event.set()

    def close(self) -> None:
        if self.bpf is not None:
            self.bpf.close()
            self.bpf = None
        self.faults.close()
        self.nvml_source.close()

    def run(self) -> None:
        try:
            self.start()
            while not self.stop_event.is_set():
                self.step()
        finally:
            self.close()

    def _is_due(self, what: str, interval_s: float) -> bool:
        now = time.monotonic()
        if now >= self._due.get(what, 0.0):
            self._due[what] = now + interval_s
            return True
        return False

    def _scan(self, initial: bool = False, pids: set[int] | None = None, periodic: bool = False) -> None:
        """A /proc scan (AgentScans.scan); it also refreshes identities (a parent that died, a leader
        turned zombie) without any hold changing: re-classify after every one."""
        self.scans.scan(initial, pids, periodic)
        if initial:  # the start scan puts off the first periodic one
            self._due["scan"] = time.monotonic() + self.cfg.scan_interval_s
        self._dirty = True

    def _sweep_memory(self) -> None:
        """With every full scan (AgentScans.scan, beside the kernel tables' sweep): a process whose
        exit no event reported (it made memory calls on an fd it received rather than opened, so the
        kernel never counted it a holder) holds nothing. Only its memory goes: a holder still waiting
        for its kernel EXIT keeps its kernel entries for that EXIT to report. Dead at two sweeps in a
        row, as the kernel tables' sweep (tracer/kernel_tables.py): an EXIT still in the ring buffer
        settles it first, with its exact time."""
        dead = {pid for pid in self._memory_fds
                if pid not in self.state.holders and pid not in self._exit_due
                and not self.identities.alive(pid)}
        doomed = dead & self._memory_dead_last_sweep
        self._memory_dead_last_sweep = dead - doomed
        for pid in sorted(doomed):
            self._memory_exit(pid, boot_ns())
        # And what is kept per process outside the holder table, for one no event reported gone:
        # last-seen times (only a holder's exit is dated by them) and fork links of the dead.
        for pid in [pid for pid in self._alive_ns if pid not in self.state.holders]:
            del self._alive_ns[pid]
        for pid in [pid for pid in self._forked_from if pid not in self.state.holders
                    and not self.identities.alive(pid)]:
            self._unlink_fork(pid)

    def _rescan(self) -> None:
        if self.scans.rescan():
            self._dirty = True

    def _take_touched(self) -> set[int]:
        """The processes the kernel saw release an fd since the last rescan (none without BPF)."""
        return self.bpf.take_touched() if self.bpf is not None else set()

    def step(self, timeout_ms: int = 250) -> None:
        """One loop turn. Each unit of work runs contained (tracer/containment.py): an unexpected
        exception is logged once per place and counted, and the loop goes on."""
        run = self.errors.run
        if self.bpf is not None:
            self._drain(timeout_ms)
        else:
            self.stop_event.wait(timeout_ms / 1000)
        if self._exit_due:
            run("scan", self._settle_overdue)
        if self.faults.pending:  # Xid lines from the kernel log: joined to the holders as they are now
            run("fault", self._emit_faults)
        if self._is_due("nvml", self.cfg.nvml_interval_s):
            run("nvml", self._read_nvml)
        if self._is_due("scan", self.cfg.scan_interval_s):
            run("scan", self._rescan)
        if self.bpf is not None and self._is_due("ioctl", self.cfg.ioctl_poll_interval_s):
            run("ioctl", self._poll_counters)
        # Memory calls re-classify at most once per NVML refresh: a job allocating all the time makes
        # a finding a second (as NVML's own figure would), not one per call.
        if self._memory_changed and self._is_due("memory", self.cfg.nvml_interval_s):
            self._memory_changed = False
            self._dirty = True
        # Re-classify on change, and on a clock only while a consumer waits out its grace period:
        # an idle node then costs one ring-buffer wait per step.
        waiting = any(c.cls is ConsumerClass.PENDING for c in self.consumers.values())
        if self._dirty or (waiting and self._is_due("classify", CLASSIFY_INTERVAL_S)):
            run("classify", self._classify)
        if self._split_stale and self._info_signature is not None and self._is_due("split",
                                                                                   self.cfg.nvml_interval_s):
            run("info", self._check_split)
        if self.health is not None:
            self.health.stepped()  # after the work: a step stuck in NVML or /proc never gets here

    def _kernel(self) -> BpfSource:
        """The kernel side, for the steps that run only while it is attached."""
        assert self.bpf is not None, "a BPF step ran with BPF off"
        return self.bpf

    def _drain(self, timeout_ms: int) -> None:
        """Apply what the ring buffer holds, each event on its own: one that fails is counted. The
        driver's memory calls go to the accountant in their order, each before the events that came
        after it (a process's calls before its EXIT, an exec's closed fds after the calls before it)."""
        kernel = self._kernel()
        events = self.errors.run("event", kernel.poll, timeout_ms) or ()
        calls = self.errors.run("memory", kernel.take_memcalls) or ()
        for ts_ns, text, facility in kernel.take_log_lines():  # Xid lines only: joined in step()
            self.faults.offer(text, ts_ns, facility=facility)
        i = 0
        for ev in events:
            while i < len(calls) and calls[i].ts_ns <= ev.ts_ns:
                self.errors.run("memory", self._apply_memcall, calls[i])
                i += 1
            self.errors.run("event", self._handle, ev)
        for call in calls[i:]:
            self.errors.run("memory", self._apply_memcall, call)

    def _apply_memcall(self, call: MemCall) -> None:
        gone_ns = self._memory_gone.get(call.pid)
        if gone_ns is not None and call.ts_ns <= gone_ns:
            return  # queued behind an exit settled from /proc: the process and its clients are gone
        if call.kind == MemCallKind.CLOSE:
            self._release_fd(call.pid, call.fd, self.state.holders.get(call.pid))
        else:
            self.memory.apply(call)
        self._memory_fds.setdefault(call.pid, set()).add(call.fd)
        self._memory_changed = True

    def _release_fd(self, pid: int, fd: int, holder: Holder | None) -> None:
        """The process let fd go (a close, an exec's close-on-exec, its exit). RM frees the clients
        allocated through it only when the open file itself is released (nvidia_close, kernel-open/
        nvidia/nv.c, then rm_cleanup_file_private, src/nvidia/arch/nvalloc/unix/src/osapi.c): while a
        process forked from it still holds that file (the same fd number on the same device: a
        DataLoader worker forked after CUDA started), the clients and their memory are its now."""
        heir = self._heir(pid, fd, holder)
        if heir is None:
            self.memory.close_fd(pid, fd)
        elif self.memory.transfer_fd(pid, fd, heir, fd):
            self._memory_fds.setdefault(heir, set()).add(fd)

    def _heir(self, pid: int, fd: int, holder: Holder | None) -> int | None:
        """A live holder forked from pid (or from one of its forks, recursively) that holds the file
        pid had at fd; None when none does."""
        path = next((p for p, hold in holder.holds.items() if fd in hold.fds), None) if holder else None
        for child in sorted(self._forks.get(pid, ())):
            held = self.state.holders.get(child)
            if held is None or child in self._exit_due:
                continue
            holds = [held.holds[path]] if path is not None and path in held.holds else \
                [] if path is not None else list(held.holds.values())
            if any(fd in hold.fds for hold in holds):
                return child
        return None

    def _unlink_fork(self, pid: int) -> None:
        """The process is gone (or its pid reused): the fork links to and from it go."""
        parent = self._forked_from.pop(pid, None)
        if parent is not None and (siblings := self._forks.get(parent)) is not None:
            siblings.discard(pid)
            if not siblings:
                del self._forks[parent]
        for child in self._forks.pop(pid, set()):
            self._forked_from.pop(child, None)

    def _poll_counters(self) -> None:
        if self.state.holders:  # an idle node has no counters to read
            self.scans.read_ioctls()
        self._report_bpf_stats()
        # An allocation makes no event: a monitor that starts allocating is re-judged within one
        # poll, not at the next change (one map lookup per monitor).
        monitors = [c.pid for c in self.consumers.values() if c.cls is ConsumerClass.MONITOR]
        if monitors and self._kernel().any_allocated(monitors):
            self._dirty = True

    # --- sources --------------------------------------------------------------------------

    def _read_nvml(self) -> None:
        view = self.nvml_source.read()
        if view.available:
            listed = {(gpu.uuid, p.pid) for gpu in view.gpus for p in gpu.processes}
            for key in listed:
                self.nvml_first_listed.setdefault(key, view.ts_ns)
            for key in list(self.nvml_first_listed):
                if key not in listed:
                    del self.nvml_first_listed[key]
        if replace(view, ts_ns=0) != replace(self.nvml, ts_ns=0):  # what the driver says changed
            self._dirty = True
        self.nvml = view
        self._split_stale = True
        if self._info_signature is not None and records.info_signature(view) != self._info_signature:
            self._emit_info()

    def _emit_info(self, gpus: tuple[GpuInfo, ...] | None = None) -> None:
        """The node's `info` record (GPUs, NVML, BPF, each GPU's memory split): after `ready`, then when
        NVML or its GPUs change, or the split moved (_check_split)."""
        self._info_signature = records.info_signature(self.nvml)
        self._info_gpus = records.gpu_infos(self.nvml, self.consumers.values()) if gpus is None else gpus
        self._split_stale = False
        self.sink.emit(records.info_record(self.cfg.node_name, self.bpf is not None, self.nvml,
                                           self._info_gpus))

    def _check_split(self) -> None:
        """Re-send `info` when a GPU's memory split moved by a MiB or more (records.split_moved): at
        most once per NVML refresh, never for NVML's used memory drifting by a few KiB."""
        self._split_stale = False
        gpus = records.gpu_infos(self.nvml, self.consumers.values())
        if records.split_moved(self._info_gpus, gpus):
            self._emit_info(gpus)

    def stream_counters(self) -> dict[str, int]:
        """The agent's counters TracerStats carries, by field name (read from the stream's thread:
        plain int reads)."""
        return {"memory_objects_dropped_total": self.memory.dropped_objects_total,
                "kmsg_unparsed_total": self.faults.kmsg_unparsed_total(),
                "faults_dropped_total": self.faults.dropped_total,
                "kmsg_records_lost_total": self.faults.reader.records_lost_total}

    def bpf_stats(self) -> dict[str, int]:
        """The kernel counters as last read (a dict replaced whole, so any thread may read it)."""
        return self._bpf_stats

    def _report_bpf_stats(self) -> None:
        stats = self._kernel().stats()
        for name, value in stats.items():
            before = self._bpf_stats.get(name, 0)
            if value > before and name in MEMCALL_LOSS_STATS:
                self._memcalls_lost_ns = boot_ns()
                self._memory_changed = True
            if value > before:
                self._notice(f"bpf.{name}", f"{value - before} new ({value} in all): the kernel side lost "
                             f"state; the next /proc scan reconciles")
        self._bpf_stats = stats

    # --- events ---------------------------------------------------------------------------

    def _handle(self, ev: SourceEvent) -> None:
        if ev.kind is EventKind.RENAME:
            # Not a record: the new name reaches the collector with the next classification.
            if self.state.refresh(ev.pid):
                self._dirty = True
            return
        before = self.state.holders.get(ev.pid)
        if ev.kind is EventKind.EXIT:
            self._exit(ev, before)
            return
        if before is not None:
            self._note_for_faults(ev, before)
        gpus_before = _held_gpus(before) if ev.kind is EventKind.EXEC and before is not None else None
        changes = self.state.apply(ev)
        after = self.state.holders.get(ev.pid)
        if (after or before) is not None:  # it made this event: alive then
            self._alive_ns[ev.pid] = max(self._alive_ns.get(ev.pid, 0), ev.ts_ns)
        if ev.kind is EventKind.FORK and before is not None and ev.child_pid > 0 and ev.child_pid != ev.pid:
            self._unlink_fork(ev.child_pid)  # a pid reused: its old links go
            self._forked_from[ev.child_pid] = ev.pid
            self._forks.setdefault(ev.pid, set()).add(ev.child_pid)
        if ev.kind in (EventKind.FORK, EventKind.EXEC):
            # Reported before the rescan, which may settle the process's exit: records stay in order.
            # An EXEC of a process whose exit was already settled (a rescan found it gone while its
            # EXEC and EXIT were still queued) is not reported: it would read as a resurrection.
            if ev.kind is EventKind.FORK or (after or before) is not None:
                self._emit_event(ev, after or before)
            pid = ev.child_pid if ev.kind is EventKind.FORK else ev.pid
            if ev.kind is EventKind.EXEC and self.bpf is not None:
                # The kernel muted the exec'd process: its fd entries name the old image's fds
                # (close-on-exec ones are gone). Drop them (its procs entry stays, so its exit is
                # still reported at any moment) and seed what /proc shows now.
                self.bpf.reset_fds(pid)
            # The kernel cannot walk a process's fd table without reading kernel structs: read
            # the child's (or the exec'd image's) fds from /proc and seed the kernel with them.
            self._scan(pids={pid})
            if ev.kind is EventKind.EXEC:
                self._exec_closed(pid)
                if gpus_before:
                    self._note_exec_closes(ev, gpus_before)
            self._dirty = True
            return
        if changes:
            counts = None
            if ev.kind is EventKind.CLOSE and self.bpf is not None:
                counts = self.scans.read_ioctls_of(ev.pid)  # at the moment of the close, not a second ago
            self._emit_event(ev, after or before, counts=counts)
            self._dirty = True
            if after is not None and after is not before:
                # A new holder's identity is read when its OPEN is handled: a 10 ms job may be a
                # zombie by then. It holds nothing any more; classified, it would read as orphaned.
                self._settle_if_gone(ev.pid)

    def _exit(self, ev: SourceEvent, before: Holder | None) -> None:
        if before is None:  # not a holder (or already settled by a rescan): only kernel leftovers
            self._forget(ev.pid, ev.ts_ns)
            return
        counts: IoctlCounts | None = None
        if self.bpf is not None:
            counts = self.scans.read_ioctls_of(ev.pid)
        self._note_for_faults(ev, before)
        self.state.apply(ev)
        self._emit_event(ev, before, counts=counts)
        self._forget(ev.pid, ev.ts_ns, before)
        self._dirty = True

    def _note_for_faults(self, ev: SourceEvent, holder: Holder) -> None:
        """An exit, or a close of a device, kept for the fault join's look-back (tracer/faults.py,
        before the holder table forgets the hold): an Xid read after it still names the process. An
        exit /proc found is dated when the process was last seen alive: it died after that, and the
        moment /proc noticed may be seconds late."""
        if ev.kind is EventKind.EXIT:
            exit_ns = ev.ts_ns if ev.source == "bpf" else min(ev.ts_ns, self._alive_ns.get(ev.pid, ev.ts_ns))
            self.faults.note_exit(holder, exit_ns)
        elif ev.kind is EventKind.CLOSE and ev.device is not None:
            self.faults.note_close(holder, ev.device.path, ev.ts_ns)  # a job that closed its GPU after an Xid

    def _note_exec_closes(self, ev: SourceEvent, gpus_before: Holder) -> None:
        """The GPU devices an exec let go (close-on-exec fds: no close call to trace), for the fault
        join as closes: the exec's rescan says which remain held."""
        now = self.state.holders.get(ev.pid)
        still = _held_gpus(now).holds.keys() if now is not None else set()
        for path in sorted(gpus_before.holds.keys() - still):
            self.faults.note_close(gpus_before, path, ev.ts_ns)

    def _settle_if_gone(self, pid: int) -> None:
        """Settle a holder whose last identity read says zombie, once /proc confirms it is gone."""
        holder = self.state.holders.get(pid)
        if holder is not None and holder.process.state in ("Z", "X") and not self.identities.alive(pid):
            self._settle_exit(pid)

    def _settle_overdue(self) -> None:
        now_s = time.monotonic()
        for pid in [pid for pid, due_s in self._exit_due.items() if due_s <= now_s]:
            self._settle_exit(pid)

    def _settle_exit(self, pid: int) -> None:
        """The process is gone and the kernel may never say so: report its EXIT now."""
        self._exit(SourceEvent(EventKind.EXIT, "procfs", boot_ns(), pid), self.state.holders.get(pid))

    def _exec_closed(self, pid: int) -> None:
        """An exec closed the process's close-on-exec fds in the kernel, with no close call to trace
        (CUDA opens nvidiactl and nvidiaN with O_CLOEXEC): RM freed the clients allocated through
        them. The exec's rescan says which of its device fds remain."""
        fds = self._memory_fds.get(pid)
        if not fds:
            return
        holder = self.state.holders.get(pid)
        still_open = {fd for hold in (holder.holds.values() if holder is not None else ()) for fd in hold.fds}
        for fd in sorted(fds - still_open):
            self._release_fd(pid, fd, holder)
            fds.discard(fd)
        self._memory_changed = True

    def _forget(self, pid: int, exit_ns: int | None = None, holder: Holder | None = None) -> None:
        """The process is gone: its kernel entries, counters and memory. exit_ns: when it exited (its
        EXIT's time; None: now); holder: what it held (for a fork that still holds one of its files)."""
        self._memory_exit(pid, boot_ns() if exit_ns is None else exit_ns, holder)
        self._unlink_fork(pid)
        self._exit_due.pop(pid, None)
        self._alive_ns.pop(pid, None)
        if self.bpf is not None:
            self.bpf.forget(pid)
        self.scans.ioctls.pop(pid, None)

    def _memory_exit(self, pid: int, exit_ns: int, holder: Holder | None = None) -> None:
        """Its fds are closed: RM freed every client it allocated, but those of a file a fork of it
        still holds (_release_fd). A call of it still queued (its exit settled from /proc first) is
        dropped by _apply_memcall: one made before exit_ns."""
        fds = self._memory_fds.pop(pid, None)
        if fds is not None:
            if pid in self._forks:
                for fd in sorted(fds):
                    self._release_fd(pid, fd, holder)
            self.memory.process_exit(pid)
            self._memory_gone.pop(pid, None)  # re-added last: the oldest go first
            self._memory_gone[pid] = exit_ns
            while len(self._memory_gone) > GONE_MAX:
                del self._memory_gone[next(iter(self._memory_gone))]
            self._memory_changed = True

    def _emit_event(self, ev: SourceEvent, holder: Holder | None, counts: IoctlCounts | None = None) -> None:
        info = holder.process if holder is not None else None
        devices = sorted(holder.holds) if holder is not None else []
        if ev.device is not None and ev.device.path not in devices:
            devices.append(ev.device.path)
        ioctls = held_s = None
        if counts is not None:
            kinds = {path: str(h.device.kind) for path, h in (holder.holds.items() if holder else ())}
            ioctls = records.ioctl_list(counts, kinds)
        if ev.kind is EventKind.EXIT and holder is not None and holder.holds:
            first = min(h.first_seen_ns for h in holder.holds.values())
            held_s = round(max(0, ev.ts_ns - first) / 1e9, 6)
        self.sink.emit(records.event_record(self.cfg.node_name, ev, info, devices, self.nvml, ioctls=ioctls,
                                            held_s=held_s))

    # --- classification -------------------------------------------------------------------

    def classify_config(self) -> ClassifyConfig:
        return replace(
            self._classify_settings,
            own_pids=frozenset(self.own_pids),
            nvml_first_listed=dict(self.nvml_first_listed),
            # The kernel reports every open; without it, a holder is known once a full scan found it.
            holders_complete_ns=None if self.bpf is not None else self.scans.full_scan_ns,
        )

    def current_consumers(self) -> list[Consumer]:
        # A holder dead and waiting for its kernel EXIT is not classified: it holds nothing now.
        holders = [h for h in self.state.holders_snapshot() if h.process.pid not in self._exit_due]
        if self.bpf is not None:  # what each asked the driver for: None (no history) without BPF
            self.bpf.fill_gpu_work(holders)
            self._fill_memory(holders)
        return classify(holders, self.nvml, boot_ns(), self.classify_config(),
                        self.cfg.node_name, self.identities.start_ticks)

    def _fill_memory(self, holders: list[Holder]) -> None:
        """Set each holder's memory: what its driver calls hold, per device instance (tracer/classify.py
        maps it onto its consumers), with why the figure is not exact where it is not."""
        lost_ns = self._memcalls_lost_ns
        for holder in holders:
            pid = holder.pid
            why = self.memory.incomplete(pid)
            if not why and lost_ns is not None and holder.holds and \
                    min(h.first_seen_ns for h in holder.holds.values()) <= lost_ns:
                why = MEMCALLS_LOST
            if not why and (parent := self._forked_from.get(pid)) is not None and \
                    parent in self.state.holders and self._memory_fds.get(parent, set()) & _fds(holder):
                why = SHARES_PARENT.format(parent=parent)
            holder.memory = HeldMemory(self.memory.held(pid), why)

    def _classify(self) -> None:
        self._dirty = False
        self._await_dead_holders()
        new = self.current_consumers()
        changed, resolved = diff_consumers(self.consumers, new)
        for consumer in changed:
            self.sink.emit(records.consumer_record("finding", consumer))
        for consumer in resolved:
            self.sink.emit(records.consumer_record("resolved", consumer))
        self.consumers = {c.key: c for c in new}
        self._split_stale = True

    def _await_dead_holders(self) -> None:
        """A holder whose identity, re-read on one of its events (the RENAME of its exec, another
        OPEN, a FORK), says zombie has exited after that event: its EXEC and EXIT are queued behind
        it, not applied yet. Classified now it would read as orphaned, a finding for an exit in
        progress. It waits for that EXIT like any dying holder the kernel knows (1 s, then /proc
        settles it), unclassified. A zombie leader whose threads live on is not dead: it stays."""
        now_s = time.monotonic()
        for pid, holder in self.state.holders.items():
            if (holder.process.state in ("Z", "X") and pid not in self._exit_due
                    and not self.identities.alive(pid)):
                self._exit_due[pid] = now_s + EXIT_WAIT_S

    def _emit_faults(self) -> None:
        """The queued Xid lines, each joined to the holders (tracer/faults.py) and emitted; the driver's
        named process read from /proc when it holds nothing the tracer saw."""
        def lookup(pid: int) -> ProcessIdentity | None:
            info = self.identities.identify(pid, 0)
            return records.identity(info) if info is not None and info.alive else None

        if self.bpf is not None:
            # What the kernel queued before these lines were read (the exit of the job the fault
            # killed, often just before its Xid) is applied first: the join then sees it as gone.
            self._drain(0)

        for fault in self.faults.take(self.nvml, self.state.holders, lookup):
            self.sink.emit(fault)

    def _notice(self, what: str, message: str) -> None:
        if what != "nvml":  # the NVML source logs its own one line
            log.warning("%s: %s", what, message)
        self.sink.emit(records.notice_record(self.cfg.node_name, what, message))


def _fds(holder: Holder) -> set[int]:
    return {fd for hold in holder.holds.values() for fd in hold.fds}


def _held_gpus(holder: Holder) -> Holder:
    """A copy of the holder with only the GPU devices it holds now (the holds copied: the table
    changes its own in place)."""
    held = {path: hold for path, hold in holder.holds.items() if hold.held and hold.device.is_gpu}
    return Holder(holder.process, {path: replace(hold, fds=set(hold.fds)) for path, hold in held.items()})
