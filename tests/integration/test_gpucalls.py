"""The trace-session workload (tests/helpers/gpucalls.c) checked without the tracer.

strace sees every open, ioctl, mmap, munmap and close gpucalls makes on its private /dev (nodes
`c 1 3`, nvidia0 also `c 1 5` so its mmap succeeds): thread by thread and globally, they must be
exactly what its JSON lines say (request word, argument address, fd, device, return value). Each
parameter block it dumps must follow the layout the sheet (docs/reference/nvidia-ioctl-abi.md)
gives for the chosen driver release: the pre-set status at the right offset, handles, class,
command and sizes where the sheet puts them. The names it writes (class, control, status, escape,
UVM call) are looked up in the sheet's own tables, read here from the Markdown.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import struct
import subprocess
import uuid
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require_root
from tests.helpers.container import FakeContainer
from tests.helpers.gpucalls import (
    DRIVERS,
    NODES_MMAP,
    NODES_NULL,
    GpuCalls,
    GpuCallsOptions,
    Record,
    build_gpucalls,
    expected_calls,
    read_records,
    run_gpucalls,
)

SHEET = Path(__file__).resolve().parents[2] / "docs" / "reference" / "nvidia-ioctl-abi.md"
STRACE = ("strace", "-f", "-qq", "-X", "raw", "-y", "-e", "trace=ioctl,openat,mmap,munmap,close",
          "-e", "signal=none")
TRACED = ("open", "ioctl", "mmap", "munmap", "close")
LINE = re.compile(r"^(\d+) +(\w+)\((.*)\) += (.*)$")
UNFINISHED, RESUMED = " <unfinished ...>", re.compile(r"^(\d+) +<\.\.\. \w+ resumed>(.*)$")
XFER_WORD = 0xC01046D3


@pytest.fixture(scope="module")
def gcc() -> None:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build tests/helpers/gpucalls.c (apt-get install gcc)")


@pytest.fixture
def root_gcc(gcc: None) -> None:
    require_root()


@pytest.fixture
def root_strace(root_gcc: None) -> None:
    if shutil.which("strace") is None:
        pytest.skip("strace not installed: apt-get install strace")


@pytest.fixture
def file_dev(tmp_path: Path) -> str:
    """A dev dir of regular files: ioctl is ENOTTY and mmap works, as on the nodes; no root."""
    directory = tmp_path / "dev"
    directory.mkdir()
    for name in NODES_NULL:
        (directory / name).write_bytes(b"")
    return str(directory)


# ---- strace ----------------------------------------------------------------------------------

def _ret(text: str) -> int:
    """strace's return column as the kernel's value: `4</dev/x>` 4, `-1 ENOTTY (...)` -25."""
    token = text.split()[0]
    if token == "-1":
        return -getattr(errno, text.split()[1])
    return int(token.split("<")[0], 0)


def _fd(arg: str, dev_dir: str) -> tuple[int, str] | None:
    """`4</dev/nvidiactl>` -> (4, path) when the path is under dev_dir."""
    m = re.fullmatch(r"(\d+)<(.*)>", arg)
    return (int(m[1]), m[2]) if m and m[2].startswith(dev_dir + "/") else None


def strace_events(trace: Path, dev_dir: str = "/dev") -> list[tuple[Any, ...]]:
    """The device calls strace saw, in its order: (tid, kind, device, fd, detail, ret)."""
    events: list[tuple[Any, ...]] = []
    mapped: dict[int, str] = {}
    pending: dict[str, str] = {}  # tid -> the first half of a call another thread's line split
    for line in trace.read_text().splitlines():
        if line.endswith(UNFINISHED):
            tid, _, head = line.removesuffix(UNFINISHED).partition(" ")
            pending[tid] = head.lstrip()
            continue
        if resumed := RESUMED.match(line):  # placed where it returned: the turns order the exits
            line = f"{resumed[1]} {pending.pop(resumed[1])}{resumed[2]}"
        m = LINE.match(line)
        assert m or "exited with" in line or "+++" in line, f"unparsed strace line {line!r}"
        if not m:
            continue
        tid, name, args, ret = int(m[1]), m[2], m[3].split(", "), _ret(m[4])
        if name == "openat" and args[1].strip('"').startswith(dev_dir + "/"):
            path = args[1].strip('"')
            events.append((tid, "open", path, ret, int(args[2], 0), ret))
        elif name in ("ioctl", "close", "mmap") and (fd := _fd(args[4 if name == "mmap" else 0], dev_dir)):
            detail: Any = None
            if name == "ioctl":
                detail = (int(args[1], 0), int(args[2], 0))
            elif name == "mmap":
                detail = tuple(int(a, 0) for a in (args[1], args[2], args[3], args[5]))
                if ret >= 0:
                    mapped[ret] = fd[1]
            events.append((tid, name, fd[1], fd[0], detail, ret))
        elif name == "munmap" and int(args[0], 0) in mapped:
            events.append((tid, "munmap", mapped.pop(int(args[0], 0)), None, int(args[1], 0), ret))
    return events


def record_events(records: list[Record]) -> list[tuple[Any, ...]]:
    """The same tuples, from gpucalls' own records."""
    out: list[tuple[Any, ...]] = []
    for r in records:
        detail = {"open": r.get("flags"), "ioctl": (r.get("request"), r.get("arg")),
                  "mmap": (r.get("length"), r.get("prot"), r.get("flags"), r.get("offset")),
                  "munmap": r.get("length"), "close": None}.get(r["kind"])
        fd = r["ret"] if r["kind"] == "open" else r.get("fd")
        if r["kind"] in TRACED:
            out.append((r["tid"], r["kind"], r["device"], fd, detail, r["ret"]))
    return out


def run_under_strace(tmp_path: Path, options: GpuCallsOptions) -> tuple[list[Record], list[tuple[Any, ...]]]:
    trace = tmp_path / "strace.txt"
    records = run_gpucalls(options, prefix=(*STRACE, "-o", str(trace), "--"))
    return records, strace_events(trace)


# ---- the sheet -------------------------------------------------------------------------------

@cache
def sheet_names(section: str) -> dict[str, list[tuple[int, list[str]]]]:
    """In the tables of sheet section `section` ("2", "6", "7", "8", "9"): every cell pair
    (number, `NAME`) as NAME -> [(number, the cells after the name)]."""
    text = SHEET.read_text()
    body = re.split(r"^## ", text, flags=re.M)
    part = next(b for b in body if b.startswith(section + ". "))
    names: dict[str, list[tuple[int, list[str]]]] = {}
    for line in part.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        for k in range(len(cells) - 1):
            number = re.fullmatch(r"0x[0-9A-Fa-f]+|\d+", cells[k])
            name = re.fullmatch(r"`(\w+)`", cells[k + 1])
            if number and name:
                names.setdefault(name[1], []).append((int(number[0], 0), cells[k + 2:]))
    return names


def assert_named(section: str, value: int | None, name: str) -> None:
    """`name` is the sheet's name of `value`, or "" and the sheet has no name for it."""
    if value is None:
        assert name == ""
        return
    names = sheet_names(section)
    if name:
        assert value in [v for v, _ in names.get(name, [])], f"§{section}: {name} is not {value:#x}"
    else:
        assert all(value != v for rows in names.values() for v, _ in rows), f"§{section} names {value:#x}"


def sheet_block(record: Record) -> tuple[int, int | None]:
    """(bytes, status offset or None) of the call's block at 595.45.04, from §2 / §9."""
    if record["call"] == "UVM_INITIALIZE":
        m = re.search(r"`UVM_INITIALIZE` \| (0x[0-9A-F]+) .*`rmStatus`@(\d+); (\d+) bytes", SHEET.read_text())
        assert m and int(m[1], 16) == record["nr"]
        return int(m[3]), int(m[2])
    if record["escape"]:  # §2: nr, hex, `NV_ESC_…`, block, bytes, word, status, issue on
        rows = [cells for v, cells in sheet_names("2")[record["escape"]] if v == record["nr"]]
    else:  # §9.2: nr, hex, `NAME`, served on, bytes, rmStatus at
        uvm = sheet_names("9")[record["call"].removeprefix("UVM_")]
        rows = [cells for v, cells in uvm if v == record["nr"]]
    row = next((c for c in rows if int(re.match(r"\d+", c[1])[0]) == record["size"]), None)  # type: ignore[index]
    assert row is not None, f"no sheet row for {record['call']} of {record['size']} bytes: {rows}"
    status = row[3] if record["escape"] else row[2]
    if record["escape"] and not record["xfer"]:
        word = re.search(r"0x[0-9A-F]+", row[2])
        assert word and int(word[0], 16) == record["request"]  # the `_IOWR` word column
    return record["size"], int(m[1]) if (m := re.match(r"@(\d+)", status)) else None


def layout(record: Record, driver: str) -> tuple[int, int | None, int | None]:
    """(bytes, status offset, paramsSize offset) of the call's block at `driver`: §5.2 and §9.4
    for the blocks that changed, the 595.45.04 tables for the rest (unchanged since 515)."""
    major = int(driver.split(".")[0])
    if record["call"] == "RM_ALLOC":  # §5.2: NVOS21 / NVOS64, by release
        forms = ({32: (24, None), 40: (32, None)} if major < 525 else
                 {32: (24, None), 40: (36, None)} if major < 535 else {32: (28, 24), 48: (40, 32)})
        assert record["size"] in forms, f"RM_ALLOC of {record['size']} bytes at {driver}"
        if major >= 535:  # as §2 has it for 595.45.04
            assert sheet_block(record) == (record["size"], forms[record["size"]][0])
        return record["size"], *forms[record["size"]]
    if record["call"] == "UVM_FREE":  # §9.4: 24/@16 up to 580, 16/@8 from 590.44.01
        return (16, 8, None) if major >= 590 else (24, 16, None)
    size, status = sheet_block(record)
    return size, status, 24 if record["call"] == "RM_CONTROL" else None


def u32(block: bytes, at: int) -> int:
    return struct.unpack_from("<I", block, at)[0]


def check_block(record: Record, driver: str) -> None:
    block = bytes.fromhex(record["block_hex"])
    size, status_at, params_at = layout(record, driver)
    assert (len(block), record["size"], record["status_offset"]) == (size, size, status_at), record
    if status_at is not None:
        assert u32(block, status_at) == record["nv_status"]
    if record["xfer"]:  # nv_ioctl_xfer_t: cmd@0 (bare nr), size@4, ptr@8
        cmd, inner, _ = struct.unpack("<IIQ", bytes.fromhex(record["xfer_hex"]))
        assert (record["request"], cmd, inner) == (XFER_WORD, record["nr"], size)
    elif record["escape"]:
        assert record["request"] == 0xC0004600 | size << 16 | record["nr"]  # _IOWR('F', nr, size)
    else:
        assert record["request"] == record["nr"]  # UVM: a plain number
    handles = [int(h, 16) for h in record["handles"].values()]
    if record["call"] in ("RM_ALLOC", "RM_CONTROL", "RM_FREE", "RM_MAP_MEMORY"):
        assert [u32(block, 4 * k) for k in range(len(handles))] == handles
    if record["call"] in ("RM_ALLOC", "RM_CONTROL"):
        assert u32(block, 8 if record["cmd"] is not None else 12) == (record["cmd"] or record["h_class"])
        assert (struct.unpack_from("<Q", block, 16)[0] != 0) == (record["params_size"] > 0)
        if params_at is not None:
            assert u32(block, params_at) == record["params_size"]
    if record["call"] == "RM_MAP_MEMORY":
        assert (u32(block, 24), u32(block, 48)) == (record["args"]["length"], record["args"]["fd"])
    if record["call"].startswith("UVM_REGISTER_GPU"):
        assert block[:16] == uuid.UUID(record["args"]["gpu_uuid"].removeprefix("GPU-")).bytes
        ctl_at = 24 if record["call"] == "UVM_REGISTER_GPU" else 16
        fields = [u32(block, ctl_at + 4 * k) for k in range(1 + len(handles))]
        assert fields == [record["args"]["rmCtrlFd"], *handles]
    if record["call"] == "CHECK_VERSION_STR":
        assert block[8:72].rstrip(b"\0").decode() == driver


# ---- tests -----------------------------------------------------------------------------------

@pytest.mark.root
@pytest.mark.parametrize(("driver", "nodes", "loop"), [
    ("525.47.04", NODES_NULL, 1), ("595.45.04", NODES_MMAP, 2), ("550.54.15", NODES_MMAP, 1)])
def test_strace_sees_exactly_the_expected_calls(root_strace: None, tmp_path: Path, driver: str,
                                                nodes: dict[str, tuple[int, int]], loop: int) -> None:
    options = GpuCallsOptions(driver=driver, out=tmp_path / "calls.jsonl", private_dev=nodes, loop=loop,
                              fork=True)
    records, seen = run_under_strace(tmp_path, options)
    expected = record_events(records)
    assert seen == expected  # every call, globally in issue order: the turns are deterministic
    per_tid: dict[int, list[tuple[Any, ...]]] = {}
    for event in seen:
        per_tid.setdefault(event[0], []).append(event)
    assert per_tid == {tid: record_events(rs) for tid, rs in expected_calls(records).items()}
    threads = {r["thread"]: r["tid"] for r in records}
    pids = {r["thread"]: r["pid"] for r in records}
    assert sorted(threads) == ["A", "B", "child"] and len(set(threads.values())) == 3
    assert pids["A"] == pids["B"] != pids["child"] == threads["child"]
    calls = [r for r in records if r["kind"] == "ioctl"]
    assert len(calls) == 27 * loop + 3 and all(r["ret"] == -errno.ENOTTY for r in calls)
    assert {r["device"] for r in calls} == {"/dev/nvidiactl", "/dev/nvidia-uvm"}
    assert len({(r["fd"], r["device"]) for r in calls}) == 3  # A's nvidiactl, B's nvidiactl, B's uvm
    mmap = next(r for r in records if r["kind"] == "mmap")
    assert (mmap["ret"] >= 0) == (nodes["nvidia0"] == (1, 5)), mmap
    assert [r["kind"] for r in records].count("munmap") == (mmap["ret"] >= 0)
    assert [r["i"] for r in records] == list(range(len(records)))


@pytest.mark.parametrize("driver", ["515.43.04", *DRIVERS, "535.43.02", "580.65.06"])
def test_blocks_follow_the_driver_layout(gcc: None, file_dev: str, tmp_path: Path, driver: str) -> None:
    options = GpuCallsOptions(driver=driver, out=tmp_path / "c.jsonl", dev_dir=file_dev, dump_blocks=True,
                              fork=True, ready=False)
    calls = [r for r in run_gpucalls(options) if r["kind"] == "ioctl"]
    for record in calls:
        check_block(record, driver)
    forms = {(r["xfer"], r["size"]) for r in calls if r["call"] == "RM_ALLOC"}
    nvos64 = 48 if driver >= "535" else 40
    assert forms == {(False, 32), (False, nvos64), (True, nvos64)}
    assert any(r["xfer"] and r["call"] == "RM_CONTROL" for r in calls)
    statuses = {r["nv_status"] for r in calls} - {None}
    assert 0 in statuses and len(statuses) >= 6


def test_names_are_the_sheets(gcc: None, file_dev: str, tmp_path: Path) -> None:
    options = GpuCallsOptions(out=tmp_path / "c.jsonl", dev_dir=file_dev, fork=True, ready=False)
    records = run_gpucalls(options)
    calls = [r for r in records if r["kind"] == "ioctl"]
    for r in calls:
        assert_named("8", r["h_class"], r["class_name"])
        assert_named("7", r["cmd"], r["cmd_name"])
        assert_named("6", r["nv_status"], r["nv_status_name"])
        if r["cmd_name"]:  # the sheet's paramsSize for the command
            assert [int(c[0]) for v, c in sheet_names("7")[r["cmd_name"]]] == [r["params_size"]]
        if r["escape"]:
            assert r["call"] == r["escape"].removeprefix("NV_ESC_")
            assert r["nr"] in [v for v, _ in sheet_names("2")[r["escape"]]]
        else:
            assert r["call"].startswith("UVM_")
    assert {r["class_name"] for r in calls} >= {"NV01_ROOT_CLIENT", "NV01_DEVICE_0", "NV20_SUBDEVICE_0",
                                               "KEPLER_CHANNEL_GROUP_A", "HOPPER_COMPUTE_A"}
    unknown = [r for r in calls if (r["cmd"] is not None and not r["cmd_name"])
               or (r["nv_status"] is not None and not r["nv_status_name"])]
    assert len(unknown) == 1  # one control whose command and status no table knows: shown raw


@pytest.mark.root
def test_ready_done_hold_gate_the_calls(root_gcc: None) -> None:
    options = GpuCallsOptions(private_dev=NODES_NULL, hold=True)  # records on stdout
    with GpuCalls(options) as run:
        pid = run.wait_ready().pid
        assert pid == run.pid and sorted(os.listdir(f"/proc/{pid}/fd")) == ["0", "1", "2"]  # nothing opened
        assert run.records() == []
        run.release()
        run.wait_done()
        assert run.popen.poll() is None and sorted(os.listdir(f"/proc/{pid}/fd")) == ["0", "1", "2"]
        records = run.records()
        run.release()
        assert run.wait_exit(10) == 0
    assert [r["kind"] for r in records][:4] == ["open"] * 4 and records[-1]["kind"] == "close"
    assert len(records) == 4 + 27 + 1 + 4  # opens, the ioctl part, mmap (ENODEV: no munmap), closes


@pytest.mark.root
def test_spin_issues_m_controls(root_strace: None, tmp_path: Path) -> None:
    options = GpuCallsOptions(out=tmp_path / "s.jsonl", private_dev=NODES_NULL, spin=2000)
    trace = tmp_path / "strace.txt"
    with GpuCalls(options, prefix=(*STRACE, "-o", str(trace), "--")) as run:
        run.start()
        records = run.finish()
        result = run.spin_result()
    assert result is not None and result["calls"] == 2000 and result["ns_per_call"] > 0
    ioctls = [e for e in strace_events(trace) if e[1] == "ioctl"]
    assert len(ioctls) == 2000 and {e[4][0] for e in ioctls} == {0xC020462A}
    assert [r["kind"] for r in records] == ["open", "spin", "close"] and records[1]["calls"] == 2000


@pytest.mark.root
@pytest.mark.netns
def test_static_build_in_a_fake_container_cgroup(root_strace: None, tmp_path: Path) -> None:
    binary = build_gpucalls(static=True)
    elf = binary.read_bytes()
    phoff, phentsize, phnum = struct.unpack_from("<Q", elf, 0x20)[0], *struct.unpack_from("<HH", elf, 0x36)
    types = [struct.unpack_from("<I", elf, phoff + k * phentsize)[0] for k in range(phnum)]
    assert 3 not in types, "a static build has no PT_INTERP"
    with FakeContainer() as container:
        procs = [os.path.join(d, "cgroup.procs") for d in container.cgroup_paths.values()]
        options = GpuCallsOptions(out=tmp_path / "c.jsonl", private_dev=NODES_MMAP, cgroups=procs, hold=True)
        with GpuCalls(options, binary=binary) as run:
            pid = run.start()
            assert pid in container.pids()
            run.finish()
    dynamic = run_gpucalls(GpuCallsOptions(out=tmp_path / "d.jsonl", private_dev=NODES_MMAP, ready=False))
    keys = ("kind", "thread", "device", "request", "call", "handles", "nv_status", "ret")
    static_records = read_records(tmp_path / "c.jsonl")
    assert [[r.get(k) for k in keys if k != "ret" or r["kind"] != "mmap"] for r in static_records] == \
           [[r.get(k) for k in keys if k != "ret" or r["kind"] != "mmap"] for r in dynamic]


def test_bad_driver_is_a_usage_error(gcc: None) -> None:
    proc = subprocess.run([str(build_gpucalls()), "--driver", "470.82.01"], capture_output=True, text=True,
                          timeout=30, check=False)
    assert proc.returncode == 2 and "--driver" in proc.stderr
