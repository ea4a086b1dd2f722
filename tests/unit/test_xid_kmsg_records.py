"""tracer/kmsg.py without a kernel: the record format of /dev/kmsg, the clock move, the one line when
it cannot be opened, and the reader thread fed through a record-preserving socket (the real device
is tests/integration/test_xid_kmsg.py)."""

from __future__ import annotations

import errno
import os
import socket
import threading

import pytest
from ghostgpu.tracer.kmsg import (
    KmsgReader,
    KmsgRecord,
    PrintkClock,
    open_failure,
    parse_record,
    printk_to_boot_ns,
)

from tests.helpers.polling import wait_until


@pytest.mark.parametrize(("data", "expected"), [
    (b"3,1234,5678901,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.\n",
     KmsgRecord(0, 3, 1234, 5678901, "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.")),
    # written by user space: facility LOG_USER (1 << 3 | level 3)
    (b"11,5,6,-;hello\n", KmsgRecord(1, 3, 5, 6, "hello")),
    # continuation lines (the dictionary) are not part of the text
    (b"6,7,8,-;text\n SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0\n", KmsgRecord(0, 6, 7, 8, "text")),
    # escaped bytes come back; a backslash is escaped too, so this is unambiguous
    (b"6,7,8,-;tab\\x09here \\x5c end\n", KmsgRecord(0, 6, 7, 8, "tab\there \\ end")),
    (b"6,7,8,c;part\n", KmsgRecord(0, 6, 7, 8, "part")),  # a fragment: FLAGS are not used
    (b"6,7,8,-,caller=T1;with extra field\n", KmsgRecord(0, 6, 7, 8, "with extra field")),
    (b"no prefix\n", None),
    (b"x,7,8,-;bad\n", None),
    (b"6,7;short\n", None),
])
def test_parse_record(data: bytes, expected: KmsgRecord | None) -> None:
    assert parse_record(data) == expected


def test_record_from_kernel_or_user_space() -> None:
    assert KmsgRecord(0, 3, 1, 1, "x").from_kernel and not KmsgRecord(1, 3, 1, 1, "x").from_kernel


def test_printk_time_moves_to_the_boot_clock() -> None:
    assert printk_to_boot_ns(5_000_000, 0) == 5_000_000_000
    assert printk_to_boot_ns(5_000_000, 7) == 5_000_000_007


S = 1_000_000_000


def test_the_printk_offset_is_the_least_over_the_records_read() -> None:
    """Each record is read after it was logged: (read - logged) bounds the offset from above, and the
    quickest read bounds it best. A record read late is dated by the tightest offset seen, not by its
    read; the error is bounded by the quickest read's latency, not by the clocks' drift."""
    clock = PrintkClock()
    true_offset = 7 * S  # monotonic - printk: what a long uptime's drift made it
    # Logged at printk 100 s, read 300 ms later: the first estimate is 300 ms high (dated late, never
    # after its read).
    assert clock.to_boot_ns(100_000_000, 100 * S + true_offset + 300_000_000, 0) == \
        100 * S + true_offset + 300_000_000
    # Logged at 200 s, read 50 us later: the estimate tightens.
    assert clock.to_boot_ns(200_000_000, 200 * S + true_offset + 50_000, 0) == 200 * S + true_offset + 50_000
    # Logged at 250 s and read 5 s late (the reader was behind): dated by the tight offset.
    assert clock.to_boot_ns(250_000_000, 255 * S + true_offset, 0) == 250 * S + true_offset + 50_000
    assert clock.offset_ns == true_offset + 50_000


def test_suspended_time_is_added_at_conversion() -> None:
    """The printk clock stops in suspend, as CLOCK_MONOTONIC does; CLOCK_BOOTTIME does not: the
    offset is measured against monotonic, and the time spent suspended is added to each record."""
    clock = PrintkClock()
    clock.to_boot_ns(100_000_000, 100 * S + 1000, 0)
    asleep = 3600 * S
    assert clock.to_boot_ns(101_000_000, 101 * S + asleep + 1000, asleep) == 101 * S + asleep + 1000


def test_open_failure_says_what_is_lost_and_what_to_do() -> None:
    line = open_failure("/dev/kmsg", PermissionError(errno.EPERM, "Operation not permitted"))
    assert "CAP_SYSLOG" in line and "Xid faults are not read from the kernel log" in line and "\n" not in line
    assert "/dev has no kmsg unless it is privileged" in open_failure(
        "/x", FileNotFoundError(errno.ENOENT, "No such file or directory"))
    assert "(Input/output error;" in open_failure("/x", OSError(errno.EIO, "Input/output error"))
    assert "device cgroup" in open_failure("/x", PermissionError(errno.EPERM, "Operation not permitted"))


def test_reader_thread_delivers_records_counts_gaps_and_stops(caplog: pytest.LogCaptureFixture) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    got: list[tuple[KmsgRecord, int]] = []
    lock = threading.Lock()

    def on_record(record: KmsgRecord, read_ns: int) -> None:
        with lock:
            got.append((record, read_ns))
        if record.text == "boom":
            raise RuntimeError("a bad record")  # logged, the reader goes on

    reader = KmsgReader(on_record, path="test", opener=lambda _path: os.dup(ours.fileno()))
    assert reader.start() == ""
    try:
        for seq, text in ((10, "a"), (11, "boom"), (15, "after a gap")):
            theirs.send(f"6,{seq},100,-;{text}\n".encode())
        theirs.send(b"garbage")
        theirs.send(b"6,16,100,-;last\n")
        wait_until(lambda: len(got) == 4, "four records delivered")
        assert [r.text for r, _ in got] == ["a", "boom", "after a gap", "last"]
        assert all(read_ns > 0 for _, read_ns in got)
        assert (reader.records_read_total, reader.records_lost_total, reader.unreadable_total) == (4, 3, 1)
        lost = [r.getMessage() for r in caplog.records if "overwritten" in r.getMessage()]
        assert lost == ["test: 3 records were overwritten before they were read (3 in all); Xid reports "
                        "among them are lost"]
        assert reader.running
    finally:
        reader.close()
        ours.close()
        theirs.close()
    assert not reader.running
