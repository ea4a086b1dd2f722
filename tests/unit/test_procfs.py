"""The /proc parsers, read_process and the device-holder scanner (on real processes)."""

from __future__ import annotations

import ctypes
import mmap
import os
import select
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from ghostgpu.tracer import procfs
from ghostgpu.tracer.devices import DeviceCatalog
from ghostgpu.tracer.events import boot_ns
from ghostgpu.tracer.procfs import (
    MapsEntry,
    ProcScanner,
    StatFields,
    StatusFields,
    parse_cmdline,
    parse_maps,
    parse_stat,
    parse_status,
    read_process,
    ticks_to_boot_ns,
)

from ghostgpu.common.model.consumers import DeviceKind
from tests.conftest import require_root
from tests.helpers.polling import wait_until

DEADLINE_S = 10.0
LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mmap.restype = ctypes.c_void_p
LIBC.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long)

STAT_TAIL = "S 1 100 100 0 -1 4194304 500 0 0 0 7 3 0 0 20 0 3 0 123456 1000000 200 18446744073709551615"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"42 (python3) {STAT_TAIL}", StatFields(42, "python3", "S", 1, 123456, 3)),
        (f"42 (a b) (c)) {STAT_TAIL}", StatFields(42, "a b) (c)", "S", 1, 123456, 3)),  # the LAST ')'
        (f"42 () {STAT_TAIL}", StatFields(42, "", "S", 1, 123456, 3)),
        (f"7 (x) Z{STAT_TAIL[1:]}\n", StatFields(7, "x", "Z", 1, 123456, 3)),
        ("42 (python3) S 1 100", None),  # truncated
        ("42 python3 S 1", None),  # no parens
        ("x (y) S 1 " + STAT_TAIL[4:], None),  # bad pid
        ("", None),
    ],
    ids=["plain", "parens-and-spaces", "empty-comm", "zombie", "truncated", "no-parens", "bad-pid", "empty"],
)
def test_parse_stat(text: str, expected: StatFields | None) -> None:
    assert parse_stat(text) == expected


STATUS = """Name:\tpython3
Umask:\t0022
State:\tS (sleeping)
Tgid:\t4242
Ngid:\t0
Pid:\t4242
PPid:\t17
Uid:\t1000\t0\t0\t0
Gid:\t1000\t1000\t1000\t1000
NSpid:\t4242\t77\t1
Threads:\t5
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (STATUS, StatusFields("python3", "S", 4242, 17, 1000, 1, 5)),
        (STATUS.replace("NSpid:\t4242\t77\t1\n", "NSpid:\t4242\n"),
         StatusFields("python3", "S", 4242, 17, 1000, 4242, 5)),
        (STATUS.replace("NSpid:\t4242\t77\t1\n", ""), StatusFields("python3", "S", 4242, 17, 1000, None, 5)),
        (STATUS.replace("State:\tS (sleeping)", "State:\tZ (zombie)"),
         StatusFields("python3", "Z", 4242, 17, 1000, 1, 5)),
        (STATUS.replace("Threads:\t5\n", ""), None),
        (STATUS.replace("Uid:\t1000", "Uid:\tx"), None),
        ("", None),
    ],
    ids=["nested-pidns", "host-pidns", "pre-4.1-kernel", "zombie", "missing-key", "bad-uid", "empty"],
)
def test_parse_status(text: str, expected: StatusFields | None) -> None:
    assert parse_status(text) == expected


MAPS = """55d0c0a00000-55d0c0a21000 r--p 00000000 fd:01 1311 /usr/bin/python3.11
7f1000000000-7f1000200000 rw-s 00000000 00:05 301 /dev/nvidia0
7f2000000000-7f2000001000 rw-s 00003000 00:05 302 /dev/nvidiactl (deleted)
7f3000000000-7f3000001000 r--p 00000000 fd:01 99 /home/a user/my file.bin
7f4000000000-7f4000021000 rw-p 00000000 00:00 0 \n7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]
garbage
zz-yy r--p 0 0 0 /x
"""


def test_parse_maps() -> None:
    assert parse_maps(MAPS) == [
        MapsEntry(0x55D0C0A00000, 0x55D0C0A21000, "r--p", 0, "fd:01", 1311, "/usr/bin/python3.11", False),
        MapsEntry(0x7F1000000000, 0x7F1000200000, "rw-s", 0, "00:05", 301, "/dev/nvidia0", False),
        MapsEntry(0x7F2000000000, 0x7F2000001000, "rw-s", 0x3000, "00:05", 302, "/dev/nvidiactl", True),
        MapsEntry(0x7F3000000000, 0x7F3000001000, "r--p", 0, "fd:01", 99, "/home/a user/my file.bin", False),
        MapsEntry(0x7F4000000000, 0x7F4000021000, "rw-p", 0, "00:00", 0, "", False),
        MapsEntry(0x7FFD00000000, 0x7FFD00021000, "rw-p", 0, "00:00", 0, "[stack]", False),
    ]


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"python3\0-m\0pytest\0", "python3 -m pytest"),
        (b"python3\0-c\0print('a b')", "python3 -c print('a b')"),  # no trailing NUL (setproctitle)
        (b"", ""),
        (b"\0", ""),
        (b"bad\xff\0arg\0", "bad\ufffd arg"),
    ],
)
def test_parse_cmdline(data: bytes, expected: str) -> None:
    assert parse_cmdline(data) == expected


def test_ticks_to_boot_ns() -> None:
    hz = os.sysconf("SC_CLK_TCK")
    assert ticks_to_boot_ns(0) == 0
    assert ticks_to_boot_ns(hz) == 1_000_000_000
    assert ticks_to_boot_ns(3 * hz + 1) == 3_000_000_000 + 1_000_000_000 // hz
    me = parse_stat(Path("/proc/self/stat").read_text())
    assert me is not None and 0 < ticks_to_boot_ns(me.start_ticks) <= boot_ns()


# --- real processes ---------------------------------------------------------------------------

HOLD = r"""
import os, sys
fds = []
for arg in sys.argv[1:]:
    path, _, at = arg.partition("@")
    fd = os.open(path, os.O_RDONLY)
    if at:
        os.dup2(fd, int(at)); os.close(fd); fd = int(at)
    fds.append(fd)
print("ready", *fds, flush=True)
sys.stdin.read()
"""

ZOMBIE_LEADER = r"""
import ctypes, os, sys, threading
fd = os.open(sys.argv[1], os.O_RDONLY)
threading.Thread(target=sys.stdin.read).start()
print("ready", fd, flush=True)
ctypes.CDLL(None).pthread_exit(None)  # the leader exits; the thread keeps the fd table alive
"""


class Child:
    """A Python child running `script`; `fds` are what it printed on its ready line."""

    def __init__(self, script: str, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", script, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], DEADLINE_S)
        line = self.proc.stdout.readline().decode() if ready else ""
        if not line.startswith("ready"):
            self.close()
            raise AssertionError(f"child not ready within {DEADLINE_S} s: {line!r}")
        self.fds = [int(x) for x in line.split()[1:]]
        self.pid = self.proc.pid

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=DEADLINE_S)


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for child in started:
        child.close()


def poll(predicate, what: str) -> None:  # type: ignore[no-untyped-def]
    wait_until(predicate, what, DEADLINE_S)


def state_of(pid: int) -> str:
    fields = parse_stat(Path(f"/proc/{pid}/stat").read_text())
    return fields.state if fields else ""


def gpu_file(tmp_path: Path, name: str = "nvidia0", major_minor: tuple[int, int] | None = None) -> str:
    """A file under the test prefix: a char node when root (mknod), else a regular file.

    Prefix matches are by name, so a regular file exercises the same path without root.
    """
    path = str(tmp_path / name)
    if major_minor is not None:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(*major_minor))
    else:
        Path(path).write_bytes(b"\0" * mmap.PAGESIZE)
    return path


def scanner_for(tmp_path: Path, **kw: object) -> ProcScanner:
    return ProcScanner(DeviceCatalog((f"{tmp_path}/nvidia",), str(tmp_path / "noproc")), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("as_node", [False, pytest.param(True, marks=pytest.mark.root)],
                         ids=["regular-file", "char-node"])
def test_scan_finds_holders_in_this_process_and_a_child(tmp_path: Path, children: list[Child],
                                                        as_node: bool) -> None:
    if as_node:
        require_root()
    path = gpu_file(tmp_path, major_minor=(1, 3) if as_node else None)
    own_fd = os.open(path, os.O_RDONLY)
    try:
        children.append(Child(HOLD, path, f"{path}@200"))  # a sparse fd table: fd 200 past the holes
        view = scanner_for(tmp_path, workers=1).scan([os.getpid(), children[0].pid, 2**22 + 7])
    finally:
        os.close(own_fd)
    assert set(view) == {os.getpid(), children[0].pid}  # the gone PID is simply absent
    mine, theirs = view[os.getpid()][path], view[children[0].pid][path]
    assert own_fd in mine.fds and theirs.fds == set(children[0].fds) and 200 in theirs.fds
    ref = theirs.device
    assert (ref.path, ref.kind, ref.gpu_minor) == (path, DeviceKind.GPU, 0)
    assert (ref.major, ref.minor) == ((1, 3) if as_node else (None, None))
    assert not theirs.mapped and not theirs.via_tasks
    assert theirs.source == "procfs" and theirs.first_seen_ns > 0


@pytest.mark.parametrize(
    ("placement", "listings"),
    [(["@"], 0), (["@5", "@7", "@9"], 0), (["@300", "@900", "@1000"], 1)],
    ids=["dense", "a-few-holes", "sparse"],
)
def test_every_fd_is_read_whatever_the_holes(tmp_path: Path, children: list[Child], placement: list[str],
                                             listings: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """fds 0..n-1 are probed, a few holes are probed past, only a sparse table is listed."""
    path = gpu_file(tmp_path)
    child = Child(HOLD, *(path + at if at != "@" else path for at in placement))
    children.append(child)
    expected_count = len(os.listdir(f"/proc/{child.pid}/fd"))
    calls: list[int] = []
    real_listdir = os.listdir
    monkeypatch.setattr(procfs.os, "listdir", lambda p: calls.append(1) or real_listdir(p))
    scanner = scanner_for(tmp_path, workers=1)
    assert scanner.scan([child.pid])[child.pid][path].fds == set(child.fds)
    assert scanner.fds_seen == expected_count and len(calls) == listings


@pytest.mark.parametrize("as_node", [False, pytest.param(True, marks=pytest.mark.root)],
                         ids=["regular-file", "char-node-c1-5"])
def test_mapped_then_closed_is_still_held(tmp_path: Path, as_node: bool) -> None:
    if as_node:
        require_root()  # c 1 5 = /dev/zero: a MAP_PRIVATE mapping keeps the node's path in maps (6.18)
    path = gpu_file(tmp_path, major_minor=(1, 5) if as_node else None)
    fd = os.open(path, os.O_RDONLY)
    # libc mmap, not the mmap module: that one keeps a dup of the fd for as long as the mapping
    addr = LIBC.mmap(None, mmap.PAGESIZE, mmap.PROT_READ, mmap.MAP_PRIVATE, fd, 0)
    os.close(fd)
    assert addr not in (None, ctypes.c_void_p(-1).value)
    try:
        holds = scanner_for(tmp_path, workers=1).scan([os.getpid()])[os.getpid()]
    finally:
        LIBC.munmap(ctypes.c_void_p(addr), mmap.PAGESIZE)
    assert holds[path].mapped and holds[path].fds == set()
    assert (holds[path].device.major, holds[path].device.minor) == ((1, 5) if as_node else (None, None))
    assert os.getpid() not in scanner_for(tmp_path, workers=1).scan([os.getpid()])  # unmapped: gone


def test_device_found_by_major_under_dev(tmp_path: Path) -> None:
    """A GPU major injected through a fake /proc/devices: /dev/null (c 1 3) counts as nvidia-uvm."""
    (tmp_path / "devices").write_text("Character devices:\n  1 nvidia-uvm\n")
    catalog = DeviceCatalog(("/dev/nvidia",), str(tmp_path))
    fd = os.open("/dev/null", os.O_RDONLY)
    try:
        holds = ProcScanner(catalog, workers=1).scan([os.getpid()])[os.getpid()]
    finally:
        os.close(fd)
    hold = holds["/dev/null"]
    assert fd in hold.fds
    assert (hold.device.kind, hold.device.major, hold.device.minor) == (DeviceKind.UVM, 1, 3)


@pytest.mark.root
def test_node_made_elsewhere_is_found_by_major(tmp_path: Path) -> None:
    require_root()
    (tmp_path / "devices").write_text("Character devices:\n  1 nvidia-uvm\n")
    catalog = DeviceCatalog(("/dev/nvidia",), str(tmp_path))
    node = str(tmp_path / "innocent-name")
    os.mknod(node, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    fd = os.open(node, os.O_RDONLY)
    try:
        found = ProcScanner(catalog, workers=1, stat_outside_dev_every=1).scan([os.getpid()])
        skipped = ProcScanner(catalog, workers=1, stat_outside_dev_every=0).scan([os.getpid()])
    finally:
        os.close(fd)
    assert found[os.getpid()][node].fds == {fd} and found[os.getpid()][node].device.kind == DeviceKind.UVM
    assert node not in skipped.get(os.getpid(), {})


def test_deleted_holder_keeps_its_path(tmp_path: Path) -> None:
    path = gpu_file(tmp_path, "nvidia3")
    fd = os.open(path, os.O_RDONLY)
    os.unlink(path)
    try:
        holds = scanner_for(tmp_path, workers=1).scan([os.getpid()])[os.getpid()]
    finally:
        os.close(fd)
    assert holds[path].fds == {fd} and holds[path].device.gpu_minor == 3


def test_zombie_leader_found_through_tasks(tmp_path: Path, children: list[Child]) -> None:
    path = gpu_file(tmp_path)
    child = Child(ZOMBIE_LEADER, path)
    children.append(child)
    poll(lambda: state_of(child.pid) == "Z", "the leader to become a zombie")
    try:
        leader_fds = os.listdir(f"/proc/{child.pid}/fd")  # what fuser and lsof look at
    except OSError:
        leader_fds = []  # unreadable is the other form of the same blind spot
    assert leader_fds == []
    hold = scanner_for(tmp_path, workers=1).scan([child.pid])[child.pid][path]
    assert hold.via_tasks and hold.fds == set(child.fds)
    info = read_process(child.pid)
    assert info is not None and info.state == "Z" and info.threads == 2 and info.leader_zombie


def test_forked_workers_agree_with_one_process(tmp_path: Path, children: list[Child],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = gpu_file(tmp_path)
    children.extend(Child(HOLD, path) for _ in range(3))
    ours = {c.pid for c in children}  # other processes on the host come and go: compare only ours
    # enough PIDs for several workers: every real one plus PIDs that do not exist
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()] + list(range(2**22 + 1, 2**22 + 400))
    inline = summary(scanner_for(tmp_path, workers=1).scan(pids), ours)
    forked_scanner = scanner_for(tmp_path, workers=3)
    assert summary(forked_scanner.scan(pids), ours) == inline
    assert set(inline) == ours and forked_scanner.fds_seen > 0

    def dying_worker(self: ProcScanner, read_fd: int, write_fd: int, part: list[int], now_ns: int) -> None:
        os._exit(3)  # a worker that dies before writing: its slice is scanned by the parent

    monkeypatch.setattr(ProcScanner, "_worker_main", dying_worker)
    assert summary(scanner_for(tmp_path, workers=3).scan(pids), ours) == inline

    def no_fork() -> int:
        raise BlockingIOError(11, "fork: resource temporarily unavailable")

    monkeypatch.setattr(procfs.os, "fork", no_fork)
    assert summary(scanner_for(tmp_path, workers=3).scan(pids), ours) == inline


def summary(view: procfs.ProcView, pids: set[int]) -> dict[int, dict[str, tuple[frozenset[int], bool]]]:
    return {pid: {path: (frozenset(h.fds), h.mapped) for path, h in view[pid].items()}
            for pid in pids if pid in view}


def test_fake_proc_tree_with_broken_links(tmp_path: Path) -> None:
    """A /proc look-alike: symlinks stand for fd links, some dangling or not paths at all."""
    prefix_file = gpu_file(tmp_path, "nvidia1")
    fd_dir = tmp_path / "proc" / "77" / "fd"
    fd_dir.mkdir(parents=True)
    for name, target in {"0": "socket:[123]", "1": "pipe:[9]", "2": str(tmp_path / "gone"),
                         "9": prefix_file, "x": prefix_file}.items():
        os.symlink(target, fd_dir / name)
    (tmp_path / "proc" / "77" / "maps").write_text(f"7f0-7f1 rw-s 0 00:05 1 {prefix_file}\n")
    proc = str(tmp_path / "proc")
    scanner = ProcScanner(DeviceCatalog((f"{tmp_path}/nvidia",), proc), proc)
    view = scanner.scan()
    assert scanner.list_pids() == [77]
    assert set(view) == {77} and view[77][prefix_file].fds == {9} and view[77][prefix_file].mapped


def fake_process(proc: Path, pid: int, fds: dict[str, str], mountinfo: str = "") -> None:
    (proc / str(pid) / "fd").mkdir(parents=True)
    for name, target in fds.items():
        os.symlink(target, proc / str(pid) / "fd" / name)
    (proc / str(pid) / "ns").mkdir()
    os.symlink("mnt:[4026531841]", proc / str(pid) / "ns" / "mnt")  # one mount namespace for all
    os.symlink("/", proc / str(pid) / "root")
    (proc / str(pid) / "mountinfo").write_text(mountinfo)


def test_stat_once_per_path_and_never_on_remote_mounts(tmp_path: Path) -> None:
    """Files outside /dev are stat'ed once per path and mount namespace, and not at all on NFS."""
    (tmp_path / "remote").mkdir()
    shared, own = gpu_file(tmp_path, "shared.log"), gpu_file(tmp_path, "own.log")
    remote = gpu_file(tmp_path / "remote", "data.bin")
    mountinfo = (f"22 1 254:1 / / rw,relatime - ext4 /dev/vda rw\n"
                 f"25 22 0:40 / {tmp_path}/remote rw,relatime - nfs4 srv:/export rw,vers=4.2\n")
    proc = tmp_path / "proc"
    fake_process(proc, 50, {"0": shared, "1": remote, "2": "anon_inode:[eventfd]"}, mountinfo)
    fake_process(proc, 51, {"0": shared, "3": shared, "4": remote, "5": own}, mountinfo)
    catalog = DeviceCatalog((f"{tmp_path}/nvidia",), str(proc))
    scanner = ProcScanner(catalog, str(proc), workers=1, stat_outside_dev_every=1)
    assert scanner.scan() == {}
    assert (scanner.fds_seen, scanner.stats_done) == (7, 2)  # shared once, own once, the NFS file never
    scanner.stat_outside_dev_every = 0
    assert scanner.scan() == {} and scanner.stats_done == 0
    # every other scan, staggered by PID: 50 (1 stat: shared) and 51 (2: shared, own) take turns
    scanner.stat_outside_dev_every = 2
    stats = []
    for _ in range(4):
        scanner.scan()
        stats.append(scanner.stats_done)
    assert stats in ([1, 2, 1, 2], [2, 1, 2, 1])


HINT = "looks like a GPU device outside the device prefixes (/dev/nvidia)"


def hint_scanner(proc: Path, workers: int = 1) -> tuple[ProcScanner, list[str]]:
    lines: list[str] = []
    scanner = ProcScanner(DeviceCatalog(("/dev/nvidia",), str(proc)), str(proc), workers=workers,
                          stat_outside_dev_every=0, on_hint=lines.append)
    return scanner, lines


def test_a_gpu_device_outside_the_prefixes_is_named_once_per_prefix(tmp_path: Path) -> None:
    """A chroot's /dev seen from outside: one line per prefix that would cover it, not per scan,
    process or device; by fd or by mapping; never a hold."""
    proc = tmp_path / "proc"
    fake_process(proc, 60, {"0": "socket:[1]", "3": "/srv/chroot/dev/nvidia0",
                            "4": "/srv/chroot/dev/nvidiactl", "5": "/var/log/nvidia-installer.log",
                            "6": "/dev/null"})
    fake_process(proc, 61, {"3": "/srv/chroot/dev/nvidia0"})
    fake_process(proc, 62, {})  # mapped only, in another chroot
    (proc / "62" / "maps").write_text("7f0000-7f1000 rw-s 00000000 00:05 12 /jail/dev/nvidia2\n")
    scanner, lines = hint_scanner(proc)
    assert scanner.scan([60, 61, 62]) == {}
    assert lines == [
        f"/srv/chroot/dev/nvidia0 (held by pid 60) {HINT}: run the tracer on the host, not in a chroot or "
        "another mount namespace, or watch it there too with --device-prefix /dev/nvidia --device-prefix "
        "/srv/chroot/dev/nvidia",
        f"/jail/dev/nvidia2 (held by pid 62) {HINT}: run the tracer on the host, not in a chroot or another "
        "mount namespace, or watch it there too with --device-prefix /dev/nvidia --device-prefix "
        "/jail/dev/nvidia"]
    assert scanner.scan([60, 61, 62]) == {} and len(lines) == 2  # said once, not per scan
    fake_process(proc, 63, {"3": "/srv/other/dev/nvidia-uvm"})
    scanner.scan([60, 61, 62, 63])
    assert len(lines) == 3 and lines[2].startswith(f"/srv/other/dev/nvidia-uvm (held by pid 63) {HINT}")
    # bounded: one line per prefix up to MAX_PREFIX_HINTS in a scanner's lifetime
    many = range(100, 100 + procfs.MAX_PREFIX_HINTS + 5)
    for pid in many:
        fake_process(proc, pid, {"3": f"/srv/c{pid}/dev/nvidia0"})
    scanner.scan(many)
    assert len(lines) == procfs.MAX_PREFIX_HINTS


def test_a_forked_scan_names_an_outside_device_once(tmp_path: Path) -> None:
    """Workers find it in their slices; the parent says it once."""
    proc = tmp_path / "proc"
    pids = list(range(1000, 1000 + 2 * procfs.MIN_PIDS_PER_WORKER))
    for pid in pids:
        fds = {"3": "/srv/chroot/dev/nvidia0"} if pid < 1004 else {"1": "/var/log/x.log"}
        if pid == 1101:  # only in the worker's slice (pids[1::2])
            fds = {"3": "/jail/dev/nvidiactl"}
        fake_process(proc, pid, fds)
    scanner, lines = hint_scanner(proc, workers=2)
    assert scanner.scan(pids) == {}
    named = sorted(line.split(" (held")[0] for line in lines)
    assert named == ["/jail/dev/nvidiactl", "/srv/chroot/dev/nvidia0"]
    assert "(held by pid 1101)" in next(x for x in lines if x.startswith("/jail"))
    scanner.scan(pids)
    assert len(lines) == 2


@pytest.mark.root
def test_mapping_under_dev_found_by_major_through_map_files(tmp_path: Path) -> None:
    """/dev/zero (c 1 5) mapped then closed, with major 1 injected as nvidia-uvm: only map_files
    (CAP_SYS_ADMIN) gives the mapping's device number."""
    require_root()
    (tmp_path / "devices").write_text("Character devices:\n  1 nvidia-uvm\n")
    scanner = ProcScanner(DeviceCatalog(("/dev/nvidia",), str(tmp_path)), workers=1)
    fd = os.open("/dev/zero", os.O_RDONLY)
    addr = LIBC.mmap(None, mmap.PAGESIZE, mmap.PROT_READ, mmap.MAP_PRIVATE, fd, 0)
    os.close(fd)
    try:
        hold = scanner.scan([os.getpid()])[os.getpid()]["/dev/zero"]
    finally:
        LIBC.munmap(ctypes.c_void_p(addr), mmap.PAGESIZE)
    assert hold.mapped and hold.fds == set()
    assert (hold.device.kind, hold.device.major, hold.device.minor) == (DeviceKind.UVM, 1, 5)


def test_read_process_of_this_process() -> None:
    info = read_process(os.getpid())
    assert info is not None
    assert (info.pid, info.ppid, info.state) == (os.getpid(), os.getppid(), "R")
    assert info.comm and info.threads >= 1 and info.uid == os.getuid()
    assert os.path.realpath(info.exe) == os.path.realpath(sys.executable)
    assert "pytest" in info.cmdline
    assert info.start_ticks is not None and ticks_to_boot_ns(info.start_ticks) <= boot_ns()
    assert read_process(2**22 + 9) is None  # above pid_max: never exists


def test_read_process_identity_from_a_fake_proc(tmp_path: Path) -> None:
    cid = "08954b9e07782ae3f5feb9b36f9f82f4abeafaf11b6a012dcc30ed18759224cf"
    pcid = "3d273284cb94e68f4b085ae789394cad01a492373c7eec8be1d7f6bdaaa7d51a"
    root = tmp_path / "proc"
    for pid, comm, ppid, cgroup in ((10, "train (gpu)", 5, f"0::/docker/{cid}\n"),
                                    (5, "containerd-shim", 1, f"0::/docker/{pcid}\n")):
        (root / str(pid) / "task" / str(pid)).mkdir(parents=True)
        (root / str(pid) / "stat").write_text(f"{pid} ({comm}) {STAT_TAIL.replace('S 1 ', f'S {ppid} ', 1)}")
        (root / str(pid) / "cgroup").write_text(cgroup)
    (root / "10" / "status").write_text(STATUS)
    (root / "10" / "cmdline").write_bytes(b"python\0train.py\0")
    info = read_process(10, str(root))
    assert info is not None
    assert (info.comm, info.ppid, info.ns_pid, info.uid) == ("train (gpu)", 5, 1, 1000)
    assert info.cmdline == "python train.py"
    assert (info.container_id, info.runtime, info.cgroup_path) == (cid, "docker", f"/docker/{cid}")
    assert (info.parent_comm, info.parent_container_id) == ("containerd-shim", pcid)
    assert info.exe == "" and info.threads == 1 and info.start_ticks == 123456
    host = read_process(5, str(root))
    assert host is not None and host.parent_comm == "" and host.parent_container_id == ""  # pid 1 is absent
