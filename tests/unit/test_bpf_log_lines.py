"""Xid lines from the printk:console tracepoint (bpf/printk.bpf.c): the record decode, the hand-out,
and the agent feeding them to the fault watch with the origin the kernel side saw.

No root, no bcc: records are built as the kernel side lays them out. The real tracepoint is
exercised by tests/integration/test_xid_kmsg.py (a line written to /dev/kmsg, BPF on), including a
non-Xid line that is never delivered.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ghostgpu.tracer.agent import Tracer
from ghostgpu.tracer.bpf_build import BPF_DIR, build_cflags, kmsg_origin_supported
from ghostgpu.tracer.bpf_source import FACILITY_USER, LOG_LINE, BpfSource, decode_log_line
from ghostgpu.tracer.config import TracerConfig
from ghostgpu.tracer.events import SourceEvent
from ghostgpu.tracer.faults import ORIGIN_KERNEL, ORIGIN_USER
from ghostgpu.tracer.memcalls import MemCall
from ghostgpu.tracer.sinks import CallbackSink

XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus."


def record(text: bytes, ts_ns: int = 5_000, user: int = 0, length: int | None = None) -> bytes:
    """A struct gg_log_line: len counts the NUL, as bpf_probe_read_kernel_str returns it."""
    body = text[:247] + b"\0"
    return LOG_LINE.pack(ts_ns, len(body) if length is None else length, user, body)


def test_the_record_layout_matches_the_c_struct() -> None:
    c = (BPF_DIR / "printk.bpf.c").read_text()
    assert "#define GG_LOG_TEXT 248" in c
    assert LOG_LINE.size == 8 + 4 + 4 + 248


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        pytest.param(record(XID.encode()), (5_000, XID, 0), id="kernel"),
        pytest.param(record(XID.encode(), user=1), (5_000, XID, FACILITY_USER), id="user-written"),
        pytest.param(record(XID.encode() + b"\n"), (5_000, XID, 0), id="newline-dropped"),
        pytest.param(record(b"NVRM: Xid " + b"a" * 300), (5_000, "NVRM: Xid " + "a" * 237, 0),
                     id="truncated"),
        pytest.param(record(b"NVRM: Xid \xff"), (5_000, "NVRM: Xid \ufffd", 0), id="not-utf8"),
        pytest.param(record(XID.encode(), length=0), (5_000, "", 0), id="read-failed"),
        pytest.param(record(XID.encode(), length=9999), (5_000, XID, 0), id="length-past-the-buffer"),
        pytest.param(record(XID.encode())[:-1], None, id="short"),
        pytest.param(b"", None, id="empty"),
    ],
)
def test_decode_log_line(data: bytes, expected: tuple[int, str, int] | None) -> None:
    assert decode_log_line(data) == expected


def test_take_log_lines_hands_each_line_out_once() -> None:
    src = BpfSource(("/dev/nvidia",))
    for i, user in enumerate((0, 1)):
        buf = record(XID.encode(), ts_ns=i, user=user)
        src._on_log_line(None, buf, len(buf))  # ctypes.string_at reads a bytes object as memory
    assert src.take_log_lines() == [(0, XID, 0), (1, XID, FACILITY_USER)]
    assert src.take_log_lines() == []


class LinesOnly(BpfSource):
    """A started kernel side whose ring buffer holds only log lines."""

    def __init__(self, lines: list[tuple[int, str, int]]) -> None:
        super().__init__(("/dev/nvidia",))
        self._log_lines = lines

    def poll(self, timeout_ms: int) -> list[SourceEvent]:
        return []

    def take_memcalls(self) -> list[MemCall]:
        return []


def test_the_agent_offers_each_line_with_its_origin(tmp_path: Path) -> None:
    records: list[dict[str, Any]] = []
    cfg = TracerConfig(node_name="n1", proc_root=str(tmp_path), bpf="off")
    tracer = Tracer(cfg, CallbackSink(records.append))
    tracer.bpf = LinesOnly([(10, XID, 0), (11, XID, FACILITY_USER), (12, "NVRM: not one", 0)])
    tracer._drain(0)
    queued = []
    while tracer.faults.pending:
        queued.append(tracer.faults._queue.get_nowait())
    assert [(p.ts_ns, p.line, p.origin) for p in queued] == [(10, XID, ORIGIN_KERNEL), (11, XID, ORIGIN_USER)]


@pytest.mark.parametrize(
    ("release", "machine", "btf", "ok"),
    [
        ("6.18.0-1-amd64", "x86_64", True, True),
        ("5.15.0", "x86_64", True, True),
        ("5.14.21", "x86_64", True, False),  # no bpf_task_pt_regs
        ("6.1.0", "aarch64", True, False),  # the syscall number is not at orig_ax
        ("6.1.0", "x86_64", False, False),  # no kernel BTF: no bpf_get_current_task_btf
        ("weird", "x86_64", True, False),
    ],
)
def test_kmsg_origin_supported(release: str, machine: str, btf: bool, ok: bool) -> None:
    assert kmsg_origin_supported(release, machine, btf) is ok
    assert ("-DGG_KMSG_ORIGIN=1" in build_cflags(("/dev/nvidia",), kmsg_origin=ok)) is ok
