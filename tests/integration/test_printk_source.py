"""The printk:console tracepoint for real (bpf/printk.bpf.c): Xid lines written to /dev/kmsg reach
BpfSource.take_log_lines() marked as user-written; a line that is not an Xid report is never
delivered. Lines carry a token of this test's own, so what the kernel or other tests log meanwhile
is told apart. Polled with a deadline; nothing sleeps.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import pytest
from ghostgpu.tracer.bpf_source import FACILITY_USER, BpfSource, BpfUnavailable

from tests.conftest import require_root
from tests.helpers.polling import wait_until

pytestmark = [pytest.mark.bpf, pytest.mark.root]


@pytest.fixture
def source() -> Iterator[BpfSource]:
    require_root()
    src = BpfSource(("/tmp/gg-printk-test/nvidia",), max_fds=1024, ringbuf_pages=8)
    try:
        src.start()
    except BpfUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield src
    finally:
        src.close()


def kmsg(line: str) -> None:
    try:
        with open("/dev/kmsg", "w") as f:
            f.write(f"<3>{line}\n")
    except OSError as exc:
        pytest.skip(f"/dev/kmsg cannot be written ({exc.strerror}): run as root")


def test_xid_lines_arrive_marked_user_written_and_others_do_not(source: BpfSource) -> None:
    token = secrets.token_hex(6)
    before_ns = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
    kmsg(f"not an Xid report {token}-plain")
    kmsg(f"NVRM: GPU at PCI:0000:3b:00: not an Xid either {token}-nvrm")
    kmsg(f"NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus. {token}")
    got: list[tuple[int, str, int]] = []

    def arrived() -> bool:
        source.poll(20)
        got.extend(line for line in source.take_log_lines() if token in line[1])
        return bool(got)

    wait_until(arrived, "the Xid line from the printk tracepoint")
    assert source.log_origin_known, "devkmsg_write could not be probed on this kernel"
    ((ts_ns, text, facility),) = got  # the two lines written before it never came
    assert text == f"NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus. {token}"
    assert facility == FACILITY_USER
    assert before_ns <= ts_ns <= time.clock_gettime_ns(time.CLOCK_BOOTTIME)
