"""What `ghostgpu trace` prints for decoded calls (cli/trace_view.py): the STATUS column, the
notes a row keeps and the session facts said once, the live table and the summary alone.

The records are made from the real decoder's output (tracer/call_decode.py), the way the tracer
makes them (tracer/trace_records.py), so the notes these views recognise are the decoder's own.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator

import pytest
from ghostgpu.cli import trace_view
from ghostgpu.tracer.call_decode import IoctlCapture, decode_call, iowr, layout_for

from ghostgpu.common.model.trace import STATUS_NOT_WRITTEN, TraceRecord, is_driver_note

T0 = 1_700_000_000_123_456_789  # 2023-11-14 22:13:20.123456789 UTC
HC, HD, HO = 0xC1D00001, 0xCAF00002, 0xCAF00003
ENOTTY, EINVAL = -25, -22
FAKE = "999.99.99-fake"  # a driver release the layout tables do not cover
V595 = "595.45.04"
UNCOVERED = f"driver {FAKE} not covered: decoded with the 595.45.04 layout"

ALLOC = (0xC020462B, struct.pack("<IIIIQII", HC, HC, HO, 0x41, 0x7FFF0000, 0, 0))  # NVOS21, NV01_ROOT_CLIENT
CONTROL = (0xC020462A, struct.pack("<IIIIQII", HC, HD, 0x20800102, 0, 0, 564, 0))  # GPU_GET_INFO_V2
BAD_CONTROL = (0xC020462A, struct.pack("<IIIIQII", HC, HD, 0x20800102, 0, 0, 565, 0))  # paramsSize off
FREE = (0xC0104629, struct.pack("<IIII", HC, HC, HO, 0))  # NVOS00
CARD_INFO = (0xC04846C8, bytes(48))  # no status field
LOCKLESS = (iowr(0x5F, 15412), bytes(8))  # RM_LOCKLESS_DIAGNOSTIC
ALLOC_MEMORY = (0xC0384627, bytes(48))


def decoded(seq: int, call: tuple[int, bytes], status: int | None, ret: int = 0, version: str | None = FAKE,
            node: str = "gpu-1", dur_ns: int = 2500, kind: str = "control") -> TraceRecord:
    request, block = call
    c = decode_call(IoctlCapture(request, kind, block, status, ret), layout_for(version))
    return TraceRecord(session="t-42", node=node, seq=seq, ts_ns=T0 + seq * 1000, kind="ioctl", pid=4242,
                       tid=4242, namespace="ml", pod="trainer-0", container="main", device="/dev/nvidiactl",
                       fd=5, call=c.call, request=request, escape=c.escape, cmd=c.cmd, cmd_name=c.cmd_name,
                       h_class=c.h_class, class_name=c.class_name, nv_status=c.nv_status,
                       nv_status_name=c.nv_status_name, ret=ret, duration_ns=dur_ns, args=dict(c.args),
                       notes=tuple(c.notes))


@pytest.fixture
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The TIME column in UTC, so whole lines can be compared."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


# The STATUS column: "-" for a status the driver did not write; the errno of a failed call after it.
@pytest.mark.parametrize(("call", "status", "ret", "want", "unwritten"), [
    (FREE, 0, 0, "NV_OK", False),
    (FREE, 0x1F, 0, "NV_ERR_INVALID_ARGUMENT", False),
    (FREE, 0, ENOTTY, "- ENOTTY", True),  # the block's own zero, not NV_OK
    (FREE, 0x1F, ENOTTY, "- ENOTTY", True),  # whatever the block held
    (FREE, 0, -11, "- EAGAIN", True),
    (CARD_INFO, 7, ENOTTY, "ENOTTY", False),  # no status field: only the errno
    (LOCKLESS, 0x1F, EINVAL, "NV_ERR_INVALID_ARGUMENT EINVAL", False),  # written with ret -22
    (ALLOC_MEMORY, 0, EINVAL, "NV_OK EINVAL", False),  # may be RM's: shown, with its row note
    (FREE, None, 0, "-", False),  # not captured
])
def test_status_column(call: tuple[int, bytes], status: int | None, ret: int, want: str,
                       unwritten: bool) -> None:
    r = decoded(1, call, status, ret, version=V595)
    assert (trace_view.status(r), r.status_unwritten) == (want, unwritten)
    assert trace_view.live_row(r)[5] == want


def test_an_unwritten_status_keeps_its_number_and_note_in_json() -> None:
    r = decoded(1, FREE, 0, ENOTTY)
    obj = json.loads(trace_view.jsonl_line(r))
    assert (obj["nv_status"], obj["nv_status_name"], obj["ret"], obj["errno"]) == (0, "NV_OK", -25, 25)
    assert obj["notes"] == [UNCOVERED, "status not written by the driver (ret -25)"]


# Which of the decoder's notes are the node's driver's (said once) and which stay on the row.
@pytest.mark.parametrize(("version", "call", "status", "driver_note"), [
    (FAKE, FREE, 0, UNCOVERED),
    (None, FREE, 0, "driver version unknown: decoded with the 595.45.04 layout"),
    ("470.82.01", CONTROL, 0, "driver 470.82.01 not covered: decoded with the 595.45.04 layout"),
    ("532.1", (0xC030462B, struct.pack("<IIIIQQIII4x", HC, HC, HO, 0x80, 0x7FFF0000, 0, 56, 0, 0)), 0,
     "NV_ESC_RM_ALLOC changed between 530.30.02 and 535.43.02: driver 532.1 decoded with the 535.43.02 "
     "layout"),
    (V595, FREE, 0, None),
])
def test_driver_notes_are_the_decoders(version: str | None, call: tuple[int, bytes], status: int,
                                       driver_note: str | None) -> None:
    r = decoded(1, call, status, version=version)
    assert [n for n in r.notes if is_driver_note(n)] == ([driver_note] if driver_note else [])
    assert trace_view.driver_facts(r) == ([f"gpu-1: {driver_note}"] if driver_note else [])
    assert "decoded with the" not in trace_view.args_text(r)  # said once, not on the row


@pytest.mark.parametrize(("call", "status", "ret", "version", "row_notes", "facts"), [
    (FREE, 0, ENOTTY, FAKE, [], [f"gpu-1: {UNCOVERED}", trace_view.UNWRITTEN_FACT]),
    (FREE, 0, ENOTTY, V595, [], [trace_view.UNWRITTEN_FACT]),
    (BAD_CONTROL, 0x3A, 0, FAKE, ["paramsSize 565 is not 564: RM answers NV_ERR_INVALID_PARAM_STRUCT"],
     [f"gpu-1: {UNCOVERED}"]),
    (ALLOC_MEMORY, 0, EINVAL, V595, ["ret -22: the status may be RM's (the mmap context could not be "
                                     "attached to fd) or not written (the escape refused the call)"], []),
    (FREE, None, 0, V595, ["status not captured"], []),
    ((0xC020462A, struct.pack("<IIIIQII", HC, HD, 0x2080DEAD, 0, 0, 8, 0)), 0, 0, V595,
     ["control 0x2080dead not in the tables (class NV20_SUBDEVICE_0)"], []),
])
def test_row_notes_and_facts(call: tuple[int, bytes], status: int | None, ret: int, version: str,
                             row_notes: list[str], facts: list[str]) -> None:
    r = decoded(1, call, status, ret, version=version)
    assert trace_view.row_notes(r) == row_notes
    assert trace_view.facts(r) == facts
    assert trace_view.args_text(r).endswith("".join(f" ({n})" for n in row_notes))
    assert STATUS_NOT_WRITTEN not in trace_view.args_text(r)


def test_a_node_without_a_name_states_its_driver_note_bare() -> None:
    assert trace_view.driver_facts(decoded(1, FREE, 0, node="")) == [UNCOVERED]


HEADER = ("TIME             NODE      NAMESPACE/POD/CONTAINER   PID/TID      CALL              STATUS    "
          "DUR(µs)   ARGS")
FREE_ARGS = "hClient=0xc1d00001 hParent=0xc1d00001 hObject=0xcaf00003"


def row(usec: int, node: str, call: str, status: str, args: str) -> str:
    """One expected line, in the columns HEADER lays out."""
    return (f"22:13:20.{usec}  {node:<8}  ml/trainer-0/main         4242/4242    {call:<16}  {status:<8}  "
            f"2.5       {args}")


def test_live_table_says_each_fact_once(utc: None) -> None:
    table = trace_view.LiveTable()
    assert table.lines([]) == []
    first = table.lines([decoded(1, ALLOC, 0), decoded(2, CONTROL, 0)])
    second = table.lines([decoded(3, FREE, 0, ENOTTY), decoded(4, FREE, 0, ENOTTY),
                          decoded(5, CARD_INFO, 7, ENOTTY), decoded(6, FREE, 0, node="gpu-2")])
    assert first == [
        f"# gpu-1: {UNCOVERED}",
        HEADER,
        row(123457, "gpu-1", "RM_ALLOC", "NV_OK", "NV01_ROOT_CLIENT hClient=0xc1d00001 hParent=0xc1d00001 "
            "hObject=0xcaf00003 hClass=0x41 paramsSize=0"),
        row(123458, "gpu-1", "RM_CONTROL", "NV_OK", "NV2080_CTRL_CMD_GPU_GET_INFO_V2 hClient=0xc1d00001 "
            "hObject=0xcaf00002 cmd=0x20800102 flags=0x0 paramsSize=564"),
    ]
    assert second == [  # what the batch says first is new: the STATUS "-" and another node's driver
        "# STATUS -: status not written by the driver (the call failed before it; the errno follows)",
        f"# gpu-2: {UNCOVERED}",
        row(123459, "gpu-1", "RM_FREE", "- ENOTTY", FREE_ARGS),
        row(123460, "gpu-1", "RM_FREE", "- ENOTTY", FREE_ARGS),
        row(123461, "gpu-1", "CARD_INFO", "ENOTTY", "valid=0 domain=0x0 bus=0x0 slot=0x0 function=0x0 "
            "vendor_id=0x0 device_id=0x0 gpu_id=0x0 interrupt_line=0 reg_address=0x0 reg_size=0 "
            "fb_address=0x0 entries=1"),
        row(123462, "gpu-2", "RM_FREE", "NV_OK", FREE_ARGS),
    ]
    later = table.lines([decoded(7, FREE, 0, ENOTTY)])  # nothing said again
    assert later == [row(123463, "gpu-1", "RM_FREE", "- ENOTTY", FREE_ARGS)]


def test_the_summary_alone_says_the_driver_facts_once() -> None:
    recs = [decoded(1, ALLOC, 0), decoded(2, CONTROL, 0), decoded(3, FREE, 0, ENOTTY),
            decoded(4, FREE, 0, ENOTTY), decoded(5, CARD_INFO, 7, ENOTTY)]
    assert trace_view.summary_only(recs).splitlines() == [
        f"# gpu-1: {UNCOVERED}",
        "% TIME  TOTAL(µs)  AVG(µs)  P99(µs)  CALLS  ERRORS  CALL",
        "40.00   5.0        2.5      2.5      2      2       RM_FREE",
        "20.00   2.5        2.5      2.5      1      1       CARD_INFO",
        "20.00   2.5        2.5      2.5      1              RM_ALLOC NV01_ROOT_CLIENT",
        "20.00   2.5        2.5      2.5      1              RM_CONTROL NV2080_CTRL_CMD_GPU_GET_INFO_V2",
        "------  ---------  -------  -------  -----  ------  ------------------------------------------",
        "100.00  12.5       2.5      2.5      5      3       total",
    ]
    assert [json.loads(line) for line in trace_view.summary_jsonl(recs).splitlines()] == \
        trace_view.summary_json(recs)
    assert json.loads(trace_view.summary_jsonl(recs).splitlines()[-1]) == {
        "call": "total", "calls": 5, "errors": 3, "total_ns": 12500, "avg_ns": 2500.0, "p99_ns": 2500,
        "pct_time": 100.0}
    assert trace_view.summary_only([decoded(1, FREE, 0, version=V595)]).splitlines()[0].startswith("% TIME")
    assert trace_view.summary_only([]) == "(no calls traced)"
