"""Read the kernel log (/dev/kmsg) from the tracer's start, one record at a time, on one thread.

/dev/kmsg hands out one record per read(): `PRI,SEQ,TS_US,FLAGS[,...];TEXT\n`, then continuation
lines ` KEY=VALUE\n` (Documentation/ABI/testing/dev-kmsg; kernel/printk/printk.c devkmsg_read).
PRI is facility << 3 | level. TEXT escapes bytes below 0x20, from 0x7f, and the backslash as
`\\xNN`. The reader opens the device, seeks to its end (devkmsg_llseek SEEK_END: the next record to
be written; nothing older is replayed) and waits in poll(). A reader that falls behind the ring
buffer gets EPIPE once and then the oldest record still there: the records it missed are counted
(from the sequence numbers), and reading goes on.

Opening needs CAP_SYSLOG when kernel.dmesg_restrict is 1, the default on Debian and many others
(kernel/printk/printk.c check_syslog_permissions; CAP_SYS_ADMIN is accepted too, with a warning).
Without it open() fails with EPERM: start() says so in one line and the tracer goes on without
faults. A container's /dev has no kmsg node unless the container is privileged, and a node mounted
in is refused by the container's device cgroup all the same: there, the lines have to come from
another source (FaultWatch.offer takes a line from anywhere).

TS_US is the printk clock (local_clock(), kernel/printk/printk.c: it stops in suspend, as
CLOCK_MONOTONIC does, but NTP does not slew it as it slews CLOCK_MONOTONIC): over a long uptime the
two drift apart by tens of ppm, seconds after weeks. So the offset is not read, it is measured
(PrintkClock): every record is read after it was logged, so (monotonic when read - its TS_US) is
at least the true offset, and the least such value over the records read is the best estimate,
early by at most the quickest read's latency. CLOCK_BOOTTIME, the holder timeline's clock, is
monotonic plus the time spent suspended (boot_offset_ns), added at conversion.

Lines that user space wrote to /dev/kmsg (facility != 0: the kernel forces LOG_USER on a write
without one, devkmsg_write) are passed on like the kernel's; KmsgRecord.from_kernel tells them apart.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("ghostgpu.kmsg")

KMSG_PATH = "/dev/kmsg"
LOST_LOG_INTERVAL_S = 60.0  # a burst that overruns the ring buffer is one warning, not one per gap
READ_BUFFER_BYTES = 16384  # a record is at most ~1 KiB of text plus its dictionary; a short buffer is EINVAL
_ESCAPE = re.compile(rb"\\x([0-9a-fA-F]{2})")


@dataclass(frozen=True, slots=True)
class KmsgRecord:
    facility: int  # 0: the kernel itself; anything else was written by user space
    level: int  # 0 (emerg) .. 7 (debug)
    seq: int
    ts_us: int  # printk clock, microseconds
    text: str

    @property
    def from_kernel(self) -> bool:
        return self.facility == 0


def parse_record(data: bytes) -> KmsgRecord | None:
    """One read() of /dev/kmsg -> KmsgRecord; None when the prefix is not `PRI,SEQ,TS,FLAGS;`.
    Continuation lines (` KEY=VALUE`) are dropped: the text is the first line. FLAGS ('-', or 'c'
    for a fragment the kernel could not merge) is not used: the driver logs an Xid as one line."""
    head, sep, body = data.partition(b";")
    if not sep:
        return None
    fields = head.split(b",")
    if len(fields) < 3:
        return None
    try:
        pri, seq, ts_us = int(fields[0]), int(fields[1]), int(fields[2])
    except ValueError:
        return None
    text = body.split(b"\n", 1)[0]
    text = _ESCAPE.sub(lambda m: bytes([int(m[1], 16)]), text)
    return KmsgRecord(facility=pri >> 3, level=pri & 7, seq=seq, ts_us=ts_us,
                      text=text.decode("utf-8", errors="replace"))


def boot_offset_ns() -> int:
    """CLOCK_BOOTTIME - CLOCK_MONOTONIC now: the time the machine spent suspended."""
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME) - time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def printk_to_boot_ns(ts_us: int, offset_ns: int) -> int:
    """A kmsg timestamp on the holder timeline's clock (CLOCK_BOOTTIME), given the offset."""
    return ts_us * 1000 + offset_ns


class PrintkClock:
    """The printk clock's offset to CLOCK_MONOTONIC, measured from the records read (see the module
    doc): pure, one per reader, fed every record (not only the Xid lines) so that the estimate is
    as tight as the quickest read."""

    def __init__(self) -> None:
        self.offset_ns: int | None = None  # min over the records of (monotonic when read - TS_US)

    def to_boot_ns(self, ts_us: int, read_boot_ns: int, suspended_ns: int) -> int:
        """A record's time on CLOCK_BOOTTIME. read_boot_ns: when it was read (CLOCK_BOOTTIME);
        suspended_ns: boottime - monotonic then (boot_offset_ns). Never later than read_boot_ns."""
        printk_ns = ts_us * 1000
        sample = read_boot_ns - suspended_ns - printk_ns
        if self.offset_ns is None or sample < self.offset_ns:
            self.offset_ns = sample
        return printk_ns + self.offset_ns + suspended_ns


def open_failure(path: str, exc: OSError) -> str:
    """One line: why the kernel log cannot be read, what is lost, what to do."""
    lost = "Xid faults are not read from the kernel log"
    if exc.errno in (errno.EPERM, errno.EACCES):
        return (f"{path}: permission denied ({lost}); kernel.dmesg_restrict=1 needs CAP_SYSLOG: add it "
                f"to the tracer's capabilities (in a container, its device cgroup must also allow the "
                f"device: only a privileged container's does)")
    if exc.errno == errno.ENOENT:
        return (f"{path}: no such device ({lost}); a container's /dev has no kmsg unless it is privileged")
    return f"{path}: cannot open ({exc.strerror or exc}; {lost})"


def open_at_end(path: str) -> int:
    """/dev/kmsg opened for reading, positioned after the last record written: nothing is replayed."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        os.lseek(fd, 0, os.SEEK_END)
    except OSError:
        os.close(fd)
        raise
    return fd


class KmsgReader:
    """Calls on_record(record, read_boot_ns) for each record, on its own thread, from start() on.
    `opener` stands in for open_at_end (tests hand over a record-preserving socket)."""

    def __init__(self, on_record: Callable[[KmsgRecord, int], None], path: str = KMSG_PATH,
                 opener: Callable[[str], int] = open_at_end) -> None:
        self.path = path
        self._on_record = on_record
        self._opener = opener
        self._fd: int | None = None
        self._wake_r = self._wake_w = -1
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._next_seq: int | None = None
        self.records_read_total = 0
        self.records_lost_total = 0  # overwritten in the ring buffer before this reader got them
        self.unreadable_total = 0  # a read that did not hold a record (never seen from the kernel)
        self._next_lost_log_s = 0.0

    def start(self) -> str:
        """Open, seek to the end, start the thread: "" when reading, else the one line saying why not."""
        try:
            self._fd = self._opener(self.path)
        except OSError as exc:
            return open_failure(self.path, exc)
        os.set_blocking(self._fd, False)  # the thread reads until EAGAIN, then waits in poll()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="ghostgpu-kmsg", daemon=True)
        self._thread.start()
        return ""

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        self._stop.set()
        if self._wake_w >= 0:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        for fd in (self._fd, self._wake_r, self._wake_w):
            if fd is not None and fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd, self._wake_r, self._wake_w = None, -1, -1

    def _lost(self, count: int) -> None:
        """Records overwritten before this reader got them: counted, and said at most once a minute."""
        self.records_lost_total += count
        now_s = time.monotonic()
        if now_s >= self._next_lost_log_s:
            self._next_lost_log_s = now_s + LOST_LOG_INTERVAL_S
            log.warning("%s: %d records were overwritten before they were read (%d in all); Xid reports "
                        "among them are lost", self.path, count, self.records_lost_total)

    def _run(self) -> None:
        assert self._fd is not None
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while not self._stop.is_set():
            try:
                ready = poller.poll()
            except InterruptedError:
                continue
            if any(fd == self._wake_r for fd, _ in ready):
                return
            self._read_available()

    def _read_available(self) -> None:
        assert self._fd is not None
        while not self._stop.is_set():
            try:
                data = os.read(self._fd, READ_BUFFER_BYTES)
            except BlockingIOError:
                return
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # overwritten under us: the next read is the oldest left
                    continue
                log.warning("%s: read failed (%s); Xid faults are no longer read", self.path, exc)
                self._stop.set()
                return
            if not data:
                return
            record = parse_record(data)
            if record is None:
                self.unreadable_total += 1
                continue
            if self._next_seq is not None and record.seq > self._next_seq:
                self._lost(record.seq - self._next_seq)
            self._next_seq = record.seq + 1
            self.records_read_total += 1
            try:
                self._on_record(record, time.clock_gettime_ns(time.CLOCK_BOOTTIME))
            except Exception:  # one bad record must not stop the reader
                log.exception("%s: handling record %d failed", self.path, record.seq)
