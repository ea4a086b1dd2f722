"""GPU faults (Xid) from the kernel log, joined to the processes that held that GPU.

The kernel log reader (tracer/kmsg.py) runs on its own thread and only queues the records that
mention an Xid (tracer/xid.py XID_MARKER). The agent's loop thread, which owns the holder table,
takes them (FaultWatch.take) and turns each into one FaultRecord
(ghostgpu.common.model.records), so the join reads the holders without a lock:

- the GPU: NVML's GPU whose PCI bus id (nvmlDeviceGetPciInfo) is the Xid's, compared as
  (domain, bus, device) numbers (tracer/xid.py PciAddress); no match (NVML off, a GPU NVML does
  not list) leaves `gpu` None and only the named process is listed;
- affected: the processes holding that GPU's device (its minor) since before the Xid's timestamp,
  and those that held it and exited, or closed it, from one second before the Xid on (a job the
  fault killed is often gone before its Xid is read): a ring of recent exits bounded by count and
  by age (RecentExits), read newest first, so a process that closed its GPU and then exited reads
  exited;
- the process the driver named (`pid=`) comes first, named=True, also when it holds nothing the
  tracer saw: from the exits ring when it left within the look-back, else from /proc while it
  lives, else by its PID alone.

A line that mentions an Xid but does not parse is a FaultRecord too, with xid None and the line in
`raw`: counted (unparsed_total, the stream's kmsg_unparsed_total), never dropped.

A line user space wrote to /dev/kmsg (only root can) is joined like the driver's, with origin
"user" (FaultRecord.origin; the driver's are "kernel"): a drill or a test is told apart from the
driver in every place the fault shows.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from ghostgpu.tracer.events import Holder, NvmlGpu, NvmlView
from ghostgpu.tracer.kmsg import KMSG_PATH, KmsgReader, KmsgRecord, PrintkClock, boot_offset_ns
from ghostgpu.tracer.records import identity
from ghostgpu.tracer.xid import PciAddress, XidReport, is_xid_line, parse_pci_bus_id, parse_xid
from ghostgpu.tracer.xid_catalog import describe, severity_of

from ghostgpu.common.model.records import FaultConsumer, FaultRecord, ProcessIdentity

log = logging.getLogger("ghostgpu.faults")

EXIT_LOOKBACK_NS = 1_000_000_000  # a holder that exited this long before the Xid is still hit by it
RECENT_EXITS_MAX = 1024  # exits kept for the look-back: a second of heavy churn on one node
# And none older than this: an Xid is queued as it is read, so one whose look-back reaches an exit
# this old was read a minute late (the loop stalled), and an older exit joined to it would be a guess.
RECENT_EXITS_MAX_AGE_NS = 60_000_000_000
QUEUE_MAX = 4096  # Xid lines waiting for the loop thread; past it they are counted as dropped
DROP_LOG_INTERVAL_S = 60.0  # dropped Xid lines: one warning a minute at most
ORIGIN_KERNEL, ORIGIN_USER = "kernel", "user"  # FaultRecord.origin


@dataclass(frozen=True, slots=True)
class ExitedHolder:
    """A process that stopped holding GPUs: it exited, or closed its last fd of one (a CUDA job that
    tears its context down after a fault closes its devices before it exits)."""

    pid: int
    held_since_ns: dict[int, int]  # GPU minor -> when its hold began (boot ns)
    exit_ns: int  # when it exited or closed
    process: ProcessIdentity | None
    exited: bool = True  # False: it closed the device and lives on


class RecentExits:
    """The holders that exited or let a GPU go lately, newest last; bounded by count and by age (the
    oldest go first)."""

    def __init__(self, max_entries: int = RECENT_EXITS_MAX,
                 max_age_ns: int = RECENT_EXITS_MAX_AGE_NS) -> None:
        self._ring: deque[ExitedHolder] = deque(maxlen=max_entries)
        self.max_age_ns = max_age_ns

    def expire(self, now_ns: int) -> None:
        """Drop the entries older than max_age_ns at now_ns (boot ns)."""
        while self._ring and self._ring[0].exit_ns < now_ns - self.max_age_ns:
            self._ring.popleft()

    def note(self, holder: Holder, exit_ns: int, only_path: str | None = None) -> None:
        """Its GPU holds (or only the one at `only_path`: a close) ended at exit_ns."""
        since: dict[int, int] = {}
        for path, hold in holder.holds.items():
            minor = hold.device.gpu_minor
            if hold.device.is_gpu and minor is not None and only_path in (None, path):
                since[minor] = min(since.get(minor, hold.first_seen_ns), hold.first_seen_ns)
        if since:
            self.expire(exit_ns)
            self._ring.append(ExitedHolder(holder.pid, since, exit_ns, identity(holder.process),
                                           exited=only_path is None))

    def __iter__(self) -> Iterator[ExitedHolder]:
        return iter(tuple(self._ring))

    def __len__(self) -> int:
        return len(self._ring)


def gpu_by_bus_id(pci: PciAddress, nvml: NvmlView) -> NvmlGpu | None:
    """NVML's GPU at that PCI address; None when NVML is off or lists no GPU there."""
    if not nvml.available:
        return None
    for gpu in nvml.gpus:
        address = parse_pci_bus_id(getattr(gpu, "pci_bus_id", "") or "")
        if address is not None and address.matches(pci):
            return gpu
    return None


def _held_since(holder: Holder, minor: int) -> int | None:
    """When the holder's hold of GPU `minor` began; None when it holds no device of that GPU."""
    starts = [h.first_seen_ns for h in holder.holds.values()
              if h.device.is_gpu and h.device.gpu_minor == minor and h.held]
    return min(starts) if starts else None


def affected_consumers(
    report: XidReport,
    ts_ns: int,
    gpu: NvmlGpu | None,
    holders: Mapping[int, Holder],
    exits: Iterable[ExitedHolder],
    lookup: Callable[[int], ProcessIdentity | None],
) -> tuple[FaultConsumer, ...]:
    """Who the fault hit, the named process first, then holders and recent exits by PID. `exits`
    oldest first (RecentExits); read newest first, so a close and then an exit of one process
    reads as its exit."""
    since_ns = ts_ns - EXIT_LOOKBACK_NS
    exits = tuple(g for g in reversed(tuple(exits)) if g.exit_ns >= since_ns)
    index = gpu.index if gpu is not None else None
    minor = gpu.minor if gpu is not None else None
    hit: dict[int, FaultConsumer] = {}
    if minor is not None:
        for pid, holder in holders.items():
            since = _held_since(holder, minor)
            if since is not None and since <= ts_ns:
                hit[pid] = FaultConsumer(pid, gpu=index, process=identity(holder.process))
        for gone in exits:
            held_ns = gone.held_since_ns.get(minor)
            if gone.pid not in hit and held_ns is not None and held_ns <= ts_ns:
                hit[gone.pid] = FaultConsumer(gone.pid, exited=gone.exited, gpu=index, process=gone.process)
    named: FaultConsumer | None = None
    named_pid = report.pid
    if named_pid is not None:
        if named_pid in hit:
            c = hit.pop(named_pid)
            named = FaultConsumer(c.pid, named=True, exited=c.exited, gpu=c.gpu, process=c.process)
        elif named_pid in holders:  # holds other devices only (a node-wide one): the driver still names it
            named = FaultConsumer(named_pid, named=True, process=identity(holders[named_pid].process))
        else:
            gone_named = next((g for g in exits if g.pid == named_pid), None)
            if gone_named is not None:
                named = FaultConsumer(named_pid, named=True, exited=gone_named.exited,
                                      process=gone_named.process)
            else:
                named = FaultConsumer(named_pid, named=True, process=lookup(named_pid))
    rest = tuple(hit[p] for p in sorted(hit))
    return (named, *rest) if named is not None else rest


def fault_record(
    node: str,
    line: str,
    ts_ns: int,
    nvml: NvmlView,
    holders: Mapping[int, Holder],
    exits: Iterable[ExitedHolder],
    lookup: Callable[[int], ProcessIdentity | None],
    *,
    seq: int = 0,
    origin: str = ORIGIN_KERNEL,
    wall_ts: float | None = None,
) -> FaultRecord:
    """One kernel log line that mentions an Xid -> its FaultRecord (the join above)."""
    ts = round(time.time() if wall_ts is None else wall_ts, 6)
    report = parse_xid(line)
    if report is None:
        return FaultRecord(ts=ts, node=node, ts_ns=ts_ns, xid=None, raw=line, kmsg_seq=seq, origin=origin)
    gpu = gpu_by_bus_id(report.pci, nvml)
    return FaultRecord(
        ts=ts, node=node, ts_ns=ts_ns, xid=report.xid,
        gpu=gpu.index if gpu is not None else None, gpu_uuid=gpu.uuid if gpu is not None else "",
        pci_bus_id=report.pci_bus_id, severity=str(severity_of(report.xid, report.message)),
        meaning=describe(report.xid).meaning, message=report.message, pid=report.pid,
        process_name=report.name, affected=affected_consumers(report, ts_ns, gpu, holders, exits, lookup),
        kmsg_seq=seq, origin=origin,
    )


@dataclass(frozen=True, slots=True)
class _Pending:
    line: str
    ts_ns: int
    seq: int
    origin: str


class FaultWatch:
    """The kernel log reader, the queue to the agent's loop, the recent exits and the counters."""

    def __init__(self, node: str, path: str = KMSG_PATH) -> None:
        self.node = node
        self.exits = RecentExits()
        self._queue: queue.Queue[_Pending] = queue.Queue(maxsize=QUEUE_MAX)
        self.reader = KmsgReader(self._on_record, path)
        self.unparsed_total = 0  # Xid lines that did not parse (each still became a fault record)
        self.faults_total = 0
        self.dropped_total = 0  # Xid lines lost because the loop thread fell QUEUE_MAX behind
        self.clock = PrintkClock()  # the printk clock's offset, measured from every record read
        self._next_drop_log_s = 0.0

    def start(self) -> str:
        """Start reading: "" when reading, else one line saying why not (the tracer goes on)."""
        return self.reader.start()

    def close(self) -> None:
        self.reader.close()

    @property
    def pending(self) -> bool:
        return not self._queue.empty()

    def kmsg_unparsed_total(self) -> int:
        return self.unparsed_total

    def note_exit(self, holder: Holder, exit_ns: int) -> None:
        """A holder exited (the agent's EXIT, before the holder table forgets it): kept for the look-back."""
        self.exits.note(holder, exit_ns)

    def note_close(self, holder: Holder, path: str, ts_ns: int) -> None:
        """A holder closed its last fd of device `path` (the agent's CLOSE, before it is applied)."""
        self.exits.note(holder, ts_ns, only_path=path)

    def _on_record(self, record: KmsgRecord, read_ns: int) -> None:
        """On the reader's thread: every record calibrates the printk clock (tracer/kmsg.py
        PrintkClock); what mentions an Xid is kept, with its time on the boot clock."""
        ts_ns = self.clock.to_boot_ns(record.ts_us, read_ns, boot_offset_ns())
        self.offer(record.text, ts_ns, record.seq, record.facility)

    def offer(self, line: str, ts_ns: int, seq: int = 0, facility: int = 0) -> None:
        """A kernel log line from any source and thread (the /dev/kmsg reader, or a kernel-side capture
        of the printk:console tracepoint where /dev/kmsg is out of reach): queued for the loop when it
        mentions an Xid. ts_ns: when it was logged, on CLOCK_BOOTTIME. facility: the record's (0: the
        kernel's; any other was written to /dev/kmsg by user space: the kernel forces LOG_USER on a
        write without one, devkmsg_write in kernel/printk/printk.c)."""
        if not is_xid_line(line):
            return
        origin = ORIGIN_KERNEL if facility == 0 else ORIGIN_USER
        try:
            self._queue.put_nowait(_Pending(line, ts_ns, seq, origin))
        except queue.Full:
            self.dropped_total += 1
            now_s = time.monotonic()
            if now_s >= self._next_drop_log_s:  # a storm is one warning a minute, not one per line
                self._next_drop_log_s = now_s + DROP_LOG_INTERVAL_S
                log.warning("%d Xid lines dropped in all: the tracer's loop fell %d lines behind the kernel "
                            "log", self.dropped_total, QUEUE_MAX)

    def take(self, nvml: NvmlView, holders: Mapping[int, Holder],
             lookup: Callable[[int], ProcessIdentity | None]) -> list[FaultRecord]:
        """On the loop thread: every queued line as its FaultRecord, in the order read."""
        out: list[FaultRecord] = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return out
            self.exits.expire(item.ts_ns)  # what is this old is past every look-back from now on
            rec = fault_record(self.node, item.line, item.ts_ns, nvml, holders, self.exits, lookup,
                               seq=item.seq, origin=item.origin)
            if rec.xid is None:
                self.unparsed_total += 1
            self.faults_total += 1
            out.append(rec)
