"""`ghostgpu trace --chrome-trace`: the Chrome Trace Event document against the format's rules.

The format (the "Trace Event Format" document Perfetto, chrome://tracing and speedscope read):
every event has name, ph, ts, pid and tid; complete events (X) have dur; metadata events (M)
name a process or thread in args.name; instant events (i) have a scope s. The object form carries
traceEvents, and displayTimeUnit is "ms" or "ns". tests/integration/test_speedscope.py loads the
same document in a real viewer.
"""

from __future__ import annotations

import json
from dataclasses import replace

from ghostgpu.cli.chrome_trace import PID_SPACE, chrome_trace, process_name

from ghostgpu.common.model.trace import TraceRecord, TraceScope, TraceSession

T0 = 1_700_000_000_123_456_789
SESSION = TraceSession(id="t-42", scope=TraceScope(namespace="ml", pod="trainer-0"), requested_by="uid 0",
                       started_unix_ns=T0 - 1_000, deadline_unix_ns=T0 + 30 * 10**9,
                       nodes=("gpu-1", "gpu-2"))
POD = {"namespace": "ml", "pod": "trainer-0", "container": "main", "container_id": "c0ffee" * 10}


def _ioctl(seq: int, ts_ns: int, tid: int, call: str, dur_ns: int, **kw: object) -> TraceRecord:
    fields: dict = {"session": "t-42", "node": "gpu-1", "seq": seq, "ts_ns": ts_ns, "kind": "ioctl",
                    "pid": 4242, "tid": tid, "comm": "python3", "device": "/dev/nvidiactl", "fd": 5,
                    "call": call, "request": 0xC020462A, "ret": 0, "duration_ns": dur_ns, **POD}
    fields.update(kw)
    return TraceRecord(**fields)  # type: ignore[arg-type]


def sample_records() -> list[TraceRecord]:
    """A small session: an open, RM calls on two threads (one failing), an mmap, a fork and an exit."""
    return [
        TraceRecord(session="t-42", node="gpu-1", seq=1, ts_ns=T0, kind="open", pid=4242, tid=4242,
                    comm="python3", device="/dev/nvidiactl", fd=5, call="open", ret=5,
                    args={"path": "/dev/nvidiactl", "flags": "O_RDWR"}, **POD),
        _ioctl(2, T0 + 10_000, 4242, "RM_ALLOC", 25_500, escape="NV_ESC_RM_ALLOC", h_class=0x0,
               class_name="NV01_ROOT", nv_status=0, nv_status_name="NV_OK",
               args={"hObjectNew": "0xc1d00001"}),
        _ioctl(3, T0 + 50_000, 4243, "RM_CONTROL", 12_250, escape="NV_ESC_RM_CONTROL", cmd=0x20800102,
               cmd_name="NV2080_CTRL_CMD_GPU_GET_INFO", nv_status=0, nv_status_name="NV_OK"),
        _ioctl(4, T0 + 70_000, 4242, "RM_CONTROL", 3_000, escape="NV_ESC_RM_CONTROL", cmd=0x20800102,
               cmd_name="NV2080_CTRL_CMD_GPU_GET_INFO", nv_status=0x1F,
               nv_status_name="NV_ERR_INVALID_ARGUMENT"),
        _ioctl(5, T0 + 90_000, 4242, "UNKNOWN_ESCAPE", 800, request=0xC0084699, ret=-25),
        TraceRecord(session="t-42", node="gpu-1", seq=6, ts_ns=T0 + 95_000, kind="mmap", pid=4242, tid=4242,
                    call="mmap", device="/dev/nvidia0", gpu="0", fd=6, ret=0x7F0000000000,
                    args={"length": "2097152"}, **POD),
        TraceRecord(session="t-42", node="gpu-1", seq=7, ts_ns=T0 + 99_000, kind="fork", pid=4242, tid=4242,
                    call="fork", child_pid=4300, **POD),
        TraceRecord(session="t-42", node="gpu-2", seq=1, ts_ns=T0 + 20_000, kind="exit", pid=4242, tid=4242,
                    call="exit", comm="worker"),
    ]


def test_every_event_has_the_required_fields_and_the_document_is_json() -> None:
    doc = chrome_trace(sample_records(), SESSION)
    assert set(doc) == {"traceEvents", "displayTimeUnit", "otherData"}
    assert doc["displayTimeUnit"] in ("ms", "ns")
    assert json.loads(json.dumps(doc)) == doc  # serializable, nothing lost
    for ev in doc["traceEvents"]:
        assert {"name", "ph", "ts", "pid", "tid"} <= ev.keys(), ev
        assert isinstance(ev["ts"], float) and isinstance(ev["pid"], int) and isinstance(ev["tid"], int)
        if ev["ph"] == "X":
            assert isinstance(ev["dur"], float) and ev["dur"] >= 0 and ev["cat"] == "ioctl"
        elif ev["ph"] == "M":
            assert ev["name"] in ("process_name", "thread_name") and isinstance(ev["args"]["name"], str)
        elif ev["ph"] == "i":
            assert ev["s"] == "t"
        else:
            raise AssertionError(f"unexpected phase {ev['ph']}")
    assert {k: type(v) for k, v in doc["otherData"].items()} == dict.fromkeys(doc["otherData"], str)


def test_one_slice_per_ioctl_with_decoded_args_and_instants_for_the_rest() -> None:
    doc = chrome_trace(sample_records(), SESSION)
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in slices] == ["RM_ALLOC NV01_ROOT", "RM_CONTROL NV2080_CTRL_CMD_GPU_GET_INFO",
                                           "RM_CONTROL NV2080_CTRL_CMD_GPU_GET_INFO", "UNKNOWN_ESCAPE"]
    base = int(doc["otherData"]["ts_base_unix_ns"])
    assert base == T0 - 1_000  # the session's start, before the first record
    first = slices[0]
    assert first["ts"] == (T0 + 10_000 - base) / 1e3 and first["dur"] == 25.5
    assert first["args"]["nv_status_name"] == "NV_OK" and first["args"]["request"] == "0xc020462a"
    assert first["args"]["ret"] == 0 and first["args"]["hObjectNew"] == "0xc1d00001"
    failed = slices[2]["args"]
    assert failed["nv_status"] == "0x1f" and failed["nv_status_name"] == "NV_ERR_INVALID_ARGUMENT"
    assert slices[3]["args"]["errno"] == "ENOTTY" and slices[3]["args"]["ret"] == -25
    instants = [e for e in doc["traceEvents"] if e["ph"] == "i"]
    assert sorted(e["name"] for e in instants) == ["exit", "fork", "mmap", "open"]
    assert next(e for e in instants if e["name"] == "fork")["args"]["child_pid"] == 4300
    assert next(e for e in instants if e["name"] == "open")["args"]["path"] == "/dev/nvidiactl"


def test_processes_and_threads_are_named_and_events_sorted_by_ts() -> None:
    doc = chrome_trace(sample_records(), SESSION)
    events = doc["traceEvents"]
    assert [e["ts"] for e in events] == sorted(e["ts"] for e in events)
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    # the same host pid on a second node is a second process, moved above Linux's pid space
    assert procs == {4242: "ml/trainer-0/main (pid 4242)", 4242 + PID_SPACE: "gpu-2/worker (pid 4242)"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert threads == {(4242, 4242): "tid 4242", (4242, 4243): "tid 4243",
                       (4242 + PID_SPACE, 4242 + PID_SPACE): "tid 4242"}
    used = {(e["pid"], e["tid"]) for e in events if e["ph"] != "M"}
    assert used == set(threads)


def test_names_outside_a_pod_and_an_empty_trace() -> None:
    r = replace(sample_records()[0], namespace="", pod="", container="", container_id="")
    assert process_name(r) == "gpu-1/python3 (pid 4242)"
    assert process_name(replace(r, container_id="deadbeef" * 8)) == "gpu-1/deadbeefdead/python3 (pid 4242)"
    doc = chrome_trace([], SESSION)
    assert doc["traceEvents"] == [] and doc["otherData"]["session"] == "t-42"
    assert chrome_trace([])["otherData"]["ts_base_unix_ns"] == "0"


def test_unknown_numbers_stay_numbers() -> None:
    r = _ioctl(9, T0, 4242, "RM_ALLOC", 1_000, h_class=0xC96F, class_name="", nv_status=0x56,
               nv_status_name="")
    (ev,) = [e for e in chrome_trace([r])["traceEvents"] if e["ph"] == "X"]
    assert ev["name"] == "RM_ALLOC 0xc96f" and ev["args"]["nv_status_name"] == "0x56"
    assert ev["ts"] == 0.0
