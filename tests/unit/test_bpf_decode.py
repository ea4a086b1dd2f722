"""The pure side of tracer/bpf_source.py: event decoding, cflags, format and /proc parsing.

No root, no bcc: these run everywhere. The kernel side is exercised by
tests/integration/test_bpf_source.py.
"""

from __future__ import annotations

import os
import re
import struct
import sys
from pathlib import Path

import pytest
from ghostgpu.tracer import bpf_build
from ghostgpu.tracer.bpf_build import (
    BPF_DIR,
    BPF_FILES,
    build_cflags,
    common_prefix,
    format_has_field,
    has_caps,
    map_sizes,
    prefix_word,
    program_text,
)
from ghostgpu.tracer.bpf_source import (
    BOOKKEEPING_KINDS,
    EV_MEMCALL,
    EVENT,
    KINDS,
    STAT_NAMES,
    decode_event,
    group_dead,
    unpack_event,
)
from ghostgpu.tracer.events import EventKind

from ghostgpu.common.model.consumers import DeviceKind, DeviceRef

DEV_PATHS = {7: "/dev/nvidia0", 0x80000001: "/dev/nvidiactl"}


def record(
    kind: int,
    *,
    ts: int = 1_000,
    cg: int = 42,
    tgid: int = 100,
    tid: int = 101,
    fd: int = 5,
    dev: int = 7,
    child: int = 0,
    flags: int = 0,
    pad: int = 0,
) -> bytes:
    return struct.pack("=QQIIIiIIII", ts, cg, kind, tgid, tid, fd, dev, child, flags, pad)


# (record, kind, pid, tid, fd, device path or None, child_pid, mapped)
DECODE_CASES = [
    (record(1), EventKind.OPEN, 100, 101, 5, "/dev/nvidia0", 0, False),
    (record(2), EventKind.CLOSE, 100, 101, 5, "/dev/nvidia0", 0, False),
    (record(2, flags=1), EventKind.CLOSE, 100, 101, 5, "/dev/nvidia0", 0, True),
    (record(3, fd=9, dev=0x80000001), EventKind.MMAP, 100, 101, 9, "/dev/nvidiactl", 0, False),
    (record(4, fd=-1, dev=0, child=555), EventKind.FORK, 100, 101, -1, None, 555, False),
    (record(5, fd=-1, dev=0), EventKind.EXEC, 100, 101, -1, None, 0, False),
    (record(6, tid=100, fd=-1, dev=0), EventKind.EXIT, 100, 100, -1, None, 0, False),
    (record(6, tid=100, fd=-1, dev=0, flags=2), EventKind.EXIT, 100, 100, -1, None, 0, False),
    (record(1, dev=99), EventKind.OPEN, 100, 101, 5, None, 0, False),  # id not (yet) known
    (
        record(1, tgid=4_194_303, tid=4_194_303, fd=2**31 - 1),
        EventKind.OPEN,
        4_194_303,
        4_194_303,
        2**31 - 1,
        "/dev/nvidia0",
        0,
        False,
    ),
    (record(1) + b"trailing", EventKind.OPEN, 100, 101, 5, "/dev/nvidia0", 0, False),
]


@pytest.mark.parametrize(("data", "kind", "pid", "tid", "fd", "path", "child", "mapped"), DECODE_CASES)
def test_decode_event(
    data: bytes, kind: EventKind, pid: int, tid: int, fd: int, path: str | None, child: int, mapped: bool
) -> None:
    event = decode_event(data, DEV_PATHS)
    assert event is not None
    assert (event.kind, event.pid, event.tid, event.fd, event.child_pid, event.mapped) == (
        kind,
        pid,
        tid,
        fd,
        child,
        mapped,
    )
    assert event.device == (DeviceRef(path=path) if path else None)
    assert (event.source, event.ts_ns, event.cgroup_id) == ("bpf", 1_000, 42)


@pytest.mark.parametrize(
    "data",
    [b"", record(1)[:47], record(0), record(7), record(10), record(0xFFFFFFFF)],
    ids=["empty", "short", "kind-0", "kind-7", "kind-memcall", "kind-max"],
)
def test_decode_rejects_bad_records(data: bytes) -> None:
    assert decode_event(data, DEV_PATHS) is None


def test_decode_uses_injected_classifier() -> None:
    def classify(path: str) -> DeviceRef:
        return DeviceRef(path=path, kind=DeviceKind.GPU, gpu_minor=int(path[-1]), major=195, minor=0)

    event = decode_event(record(1), DEV_PATHS, classify)
    assert event is not None and event.device is not None
    assert (event.device.kind, event.device.gpu_minor, event.device.is_gpu) == (DeviceKind.GPU, 0, True)


def test_unpack_keeps_flags_and_ids() -> None:
    raw = unpack_event(record(6, flags=2, dev=0, child=3))
    assert raw is not None
    assert (raw.kind, raw.flags, raw.dev_id, raw.child_pid) == (6, 2, 0, 3)
    assert unpack_event(b"\0" * 10) is None


@pytest.mark.parametrize(
    ("prefixes", "common"),
    [
        (("/dev/nvidia",), "/dev/nv"),  # capped at 7 bytes: the kernel probes 8 with the NUL
        (("/dev/kfd", "/dev/dri/renderD"), "/dev/"),
        (("/dev/nvidia", "/dev/kfd", "/dev/dri/renderD"), "/dev/"),
        (("/dev/davinci",), "/dev/da"),
        (("/dev/nvidia", "/host/dev/nvidia"), "/"),
        (("/dev/x",), "/dev/x"),
    ],
)
def test_common_prefix(prefixes: tuple[str, ...], common: str) -> None:
    assert common_prefix(prefixes) == common


@pytest.mark.parametrize(
    ("prefix", "low_bytes"),
    [("/dev/", b"/dev/\0\0\0"), ("/", b"/\0\0\0\0\0\0\0"), ("/dev/nv", b"/dev/nv\0")],
)
def test_prefix_word(prefix: str, low_bytes: bytes) -> None:
    value, mask = prefix_word(prefix)
    assert value.to_bytes(8, sys.byteorder) == low_bytes
    assert mask.to_bytes(8, sys.byteorder) == b"\xff" * len(prefix) + b"\0" * (8 - len(prefix))
    # What the kernel does with the first 8 bytes of a path: (head & mask) == value.
    for path, hit in ((prefix + "x", True), ("/etc/hostname", prefix == "/"), ("", False)):
        head = int.from_bytes(path.encode()[:7].ljust(8, b"\0"), sys.byteorder)
        assert ((head & mask) == value) is hit


@pytest.mark.parametrize("prefix", ["", "/dev/nvidia0"])
def test_prefix_word_rejects_lengths(prefix: str) -> None:
    with pytest.raises(ValueError):
        prefix_word(prefix)


def flag_value(flags: list[str], name: str) -> str | None:
    found = [f.split("=", 1)[1] for f in flags if f.startswith(f"-D{name}=")]
    return found[0] if found else None


@pytest.mark.parametrize(
    ("prefixes", "common", "npfx"),
    [
        (("/dev/nvidia",), "/dev/nv", 1),
        (("/dev/kfd", "/dev/dri/renderD"), "/dev/", 2),
        (tuple(f"/dev/p{i}" for i in range(8)), "/dev/p", 8),
    ],
)
def test_build_cflags_prefixes(prefixes: tuple[str, ...], common: str, npfx: int) -> None:
    flags = build_cflags(prefixes, bpf_dir=Path("/x/bpf"))
    assert flags[0] == "-I/x/bpf"
    assert flag_value(flags, "GG_NPREFIX") == str(npfx)
    for i, prefix in enumerate(prefixes):
        assert flag_value(flags, f"GG_PREFIX{i}") == f'"{prefix}"'  # a C string literal, one argv item
    assert flag_value(flags, f"GG_PREFIX{npfx}") is None
    assert flag_value(flags, "GG_COMMON_PREFIX") == f'"{common}"'
    assert flag_value(flags, "GG_COMMON_LEN") == str(len(common))
    value, mask = prefix_word(common)
    assert flag_value(flags, "GG_COMMON_U64") == f"{value:#x}ULL"
    assert flag_value(flags, "GG_COMMON_MASK") == f"{mask:#x}ULL"
    assert flag_value(flags, "GG_PATH_LEN") == "48"
    assert flag_value(flags, "GG_OPEN_SKIP_FLAGS") == f"{os.O_DIRECTORY | os.O_PATH:#x}"  # this ABI's


@pytest.mark.parametrize(
    ("kwargs", "expected", "absent"),
    [
        (
            {},
            {"GG_HAVE_GROUP_DEAD": "1", "GG_ID_SLOTS": "1024", "GG_MAX_FDS": "65536"},
            ["GG_NO_HOLDER_FILTER"],
        ),
        ({"have_group_dead": False}, {}, ["GG_HAVE_GROUP_DEAD"]),
        ({"pid_max": 32768}, {"GG_ID_SLOTS": "8"}, []),
        ({"pid_max": 32769}, {"GG_ID_SLOTS": "9"}, []),
        ({"pid_max": 1 << 30}, {"GG_ID_SLOTS": "1024"}, []),  # capped at PID_MAX_LIMIT
        (
            {"syscalls": ["openat2", "dup2", "openat2"]},
            {"GG_HAVE_SYS_OPENAT2": "1", "GG_HAVE_SYS_DUP2": "1"},
            ["GG_HAVE_SYS_OPEN"],
        ),
        ({"ringbuf_pages": 128}, {"GG_RINGBUF_PAGES": "128"}, []),
        ({"max_fds": 1024}, {"GG_MAX_FDS": "1024", "GG_MAX_HOLDS": "256", "GG_MAX_IOCTLS": "2048"}, []),
        ({"holder_filter": False}, {"GG_NO_HOLDER_FILTER": "1"}, []),
    ],
)
def test_build_cflags_options(kwargs: dict, expected: dict[str, str], absent: list[str]) -> None:
    flags = build_cflags(("/dev/nvidia",), **kwargs)
    for name, value in expected.items():
        assert flag_value(flags, name) == value
    for name in absent:
        assert flag_value(flags, name) is None
    assert len(flags) == len(set(flags))


@pytest.mark.parametrize(
    "prefixes",
    [
        (),
        tuple(f"/dev/p{i}" for i in range(9)),
        ("dev/nvidia",),
        ("/dev/" + "x" * 40,),
        ('/dev/"x',),
        ("/dev/a b",),
        ("/dev/\\n",),
    ],
    ids=["none", "nine", "relative", "too-long", "quote", "space", "backslash"],
)
def test_build_cflags_rejects(prefixes: tuple[str, ...]) -> None:
    with pytest.raises(ValueError):
        build_cflags(prefixes)


def test_map_sizes_are_bounded_by_the_fd_budget() -> None:
    for max_fds in (64, 65536, 1 << 22):
        sizes = map_sizes(max_fds)
        assert sizes["GG_MAX_FDS"] == max_fds
        assert all(v > 0 for v in sizes.values())
        assert sizes["GG_MAX_HOLDS"] <= max(256, max_fds)


EXIT_FORMAT_618 = """name: sched_process_exit
ID: 369
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:char comm[16];\toffset:8;\tsize:16;\tsigned:0;
\tfield:pid_t pid;\toffset:24;\tsize:4;\tsigned:1;
\tfield:int prio;\toffset:28;\tsize:4;\tsigned:1;
\tfield:bool group_dead;\toffset:32;\tsize:1;\tsigned:0;

print fmt: "comm=%s pid=%d prio=%d group_dead=%s", REC->comm, REC->pid, REC->prio, REC->group_dead
"""
EXIT_FORMAT_61 = EXIT_FORMAT_618.replace("\tfield:bool group_dead;\toffset:32;\tsize:1;\tsigned:0;\n", "")


@pytest.mark.parametrize(
    ("text", "field", "present"),
    [
        (EXIT_FORMAT_618, "group_dead", True),
        (EXIT_FORMAT_61, "group_dead", False),  # only the print fmt mentions it: not a field
        (EXIT_FORMAT_618, "comm", True),
        (EXIT_FORMAT_618, "pid", True),
        (EXIT_FORMAT_618, "dead", False),
        (EXIT_FORMAT_618, "common_pid", True),
        ("", "group_dead", False),
        ("garbage\n\x00field:", "group_dead", False),
    ],
)
def test_format_has_field(text: str, field: str, present: bool) -> None:
    assert format_has_field(text, field) is present


STAT_TAIL = " 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 {threads} 0 12345"


@pytest.mark.parametrize(
    ("stat", "dead"),
    [
        ("", True),  # reaped: /proc/<tgid> is gone
        ("42 (python3) Z" + STAT_TAIL.format(threads=1), True),
        ("42 (python3) Z" + STAT_TAIL.format(threads=3), False),  # zombie leader, threads alive
        ("42 (python3) S" + STAT_TAIL.format(threads=1), False),
        ("42 (python3) R" + STAT_TAIL.format(threads=1), False),  # leader still inside do_exit
        ("42 (a) b) Z c) Z" + STAT_TAIL.format(threads=1), True),  # comm with ") "
        ("42 (x) Z 1 2", True),  # truncated: treated as gone
        ("42 (x) X" + STAT_TAIL.format(threads=0), True),
    ],
)
def test_group_dead(stat: str, dead: bool) -> None:
    assert group_dead(stat) is dead


@pytest.mark.parametrize(
    ("cap_eff", "ok"),
    [
        ("000001ffffffffff", True),  # root
        ("0000000000200000", True),  # CAP_SYS_ADMIN only
        ("000000c000000000", True),  # CAP_BPF + CAP_PERFMON
        ("0000008000000000", False),  # CAP_BPF alone cannot attach tracepoints
        ("0000000000000000", False),
    ],
)
def test_has_caps(cap_eff: str, ok: bool) -> None:
    assert has_caps(cap_eff) is ok


def test_program_text_concatenates_with_line_markers() -> None:
    text = program_text()
    markers = re.findall(r'^#line 1 "(.+)"$', text, re.M)
    assert markers == [str(BPF_DIR / name) for name in BPF_FILES]
    assert "#include" not in re.sub(r"/\*.*?\*/", "", text, flags=re.S)  # see program_text's docstring


def test_python_mirrors_the_header() -> None:
    header = (BPF_DIR / "ghostgpu.h").read_text()
    kinds = {int(v): n for n, v in re.findall(r"#define GG_EV_(\w+) (\d+)", header)}
    named = {**{k: v.value.upper() for k, v in KINDS.items()}, **BOOKKEEPING_KINDS, EV_MEMCALL: "MEMCALL"}
    assert named == kinds
    stats = {int(v): n.lower() for n, v in re.findall(r"#define GG_STAT_(\w+) (\d+)", header) if n != "MAX"}
    assert [stats[i] for i in range(len(stats))] == list(STAT_NAMES)
    body = re.search(r"struct gg_event \{(.*?)\};", header, re.S)
    assert body is not None
    types = re.findall(r"^\s*(u64|u32|s32) \w+;", body.group(1), re.M)
    assert "=" + "".join({"u64": "Q", "u32": "I", "s32": "i"}[t] for t in types) == EVENT.format
    assert EVENT.size == 48


@pytest.mark.parametrize(
    ("prefix", "words"),
    [
        ("/dev/", 1),
        ("/dev/nvidia", 2),
        ("/dev/nvidia-caps/nvidia-cap", 4),
        ("/tmp/gg-bpf-abcdefgh/a-long-prefix-nothing-opens", 6),
    ],
)
def test_prefix_words_cover_the_prefix_and_nothing_more(prefix: str, words: int) -> None:
    pairs = bpf_build.prefix_words(prefix, 48)
    assert len(pairs) == 6
    assert [mask != 0 for _, mask in pairs] == [i < words for i in range(6)]
    path = (prefix + "0").encode().ljust(48, b"\0")
    other = (prefix[:-1] + chr(ord(prefix[-1]) ^ 1) + "0").encode().ljust(48, b"\0")
    for raw, expect in ((path, True), (other, False)):
        got = all(
            int.from_bytes(raw[8 * j:8 * j + 8], sys.byteorder) & mask == word
            for j, (word, mask) in enumerate(pairs)
        )
        assert got is expect


def test_build_cflags_passes_prefix_words() -> None:
    flags = bpf_build.build_cflags(("/dev/nvidia", "/dev/kfd"))
    for i, prefix in enumerate(("/dev/nvidia", "/dev/kfd")):
        for j, (word, mask) in enumerate(bpf_build.prefix_words(prefix, 48)):
            assert f"-DGG_P{i}_W{j}={word:#x}ULL" in flags
            assert f"-DGG_P{i}_M{j}={mask:#x}ULL" in flags
