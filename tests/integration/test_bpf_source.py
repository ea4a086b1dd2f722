"""The kernel side for real: BpfSource against processes holding planted device nodes.

The "GPU" is a character node under a fresh directory in /tmp (c 1 3 = /dev/null, c 1 5 =
/dev/zero where a test maps it) and the configured prefix is <dir>/nvidia, so only the processes
started here match. ioctl on /dev/null fails with ENOTTY, but the syscall and its tracepoint run.
Events are polled with a deadline; nothing sleeps.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from ghostgpu.tracer import bpf_source
from ghostgpu.tracer.bpf_source import OUTCOME_STATS, SLOW_PATHS, BpfSource, BpfUnavailable
from ghostgpu.tracer.events import EventKind, SourceEvent
from ghostgpu.tracer.trace_kernel import LAZY_HOOKS

from tests.conftest import require_root

pytestmark = [pytest.mark.bpf, pytest.mark.root]

RM_CONTROL = 0xC020462A
SYS_PARAMS = 0xC00846D6

PRELUDE = """
import ctypes, fcntl, mmap, os, sys, threading
def ioctls(fd, cmd, n):
    for _ in range(n):
        try:
            fcntl.ioctl(fd, cmd, bytearray(64))
        except OSError:
            pass  # ENOTTY from /dev/null: the syscall was still made
def step():  # wait for the test to say go (one line on stdin)
    sys.stdin.readline()
"""


@dataclass
class Rig:
    source: BpfSource
    root: Path
    seen: list[SourceEvent] = field(default_factory=list)

    @property
    def gpu(self) -> str:
        return str(self.root / "nvidia0")

    def spawn(self, body: str, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", PRELUDE + body, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def run(self, body: str, *args: str) -> tuple[int, list[str]]:
        proc = self.spawn(body, *args)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        return proc.pid, out.split()

    def wait_for(self, done: Callable[[list[SourceEvent]], bool], timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done(self.seen):
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for events; seen: {self.seen}")
            self.seen.extend(self.source.poll(100))

    def of(self, pid: int) -> list[SourceEvent]:
        return [e for e in self.seen if e.pid == pid]

    def kinds(self, pid: int) -> list[EventKind]:
        return [e.kind for e in self.of(pid)]

    def wait_exit(self, pid: int) -> list[SourceEvent]:
        self.wait_for(lambda _: EventKind.EXIT in self.kinds(pid))
        return self.of(pid)


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    require_root()
    root = Path(tempfile.mkdtemp(prefix="gg-bpf-", dir="/tmp"))
    for name, minor in (("nvidia0", 3), ("nvidiazero", 5), ("other0", 3)):
        os.mknod(root / name, 0o666 | 0o020000, os.makedev(1, minor))
    (root / "nvidia-caps").mkdir()  # matches the prefix, but a directory is not a device
    # Several long prefixes, the matching one last: every open is checked against all of them.
    prefixes = (str(root / "no-such-gpu/"), "/dev/kfd", str(root / "nvidia"))
    source = BpfSource(prefixes, max_fds=4096, ringbuf_pages=16)
    try:
        source.start()
    except BpfUnavailable as exc:
        shutil.rmtree(root)
        pytest.skip(str(exc))
    try:
        yield Rig(source, root)
    finally:
        source.close()
        shutil.rmtree(root)


def test_open_ioctl_dup_close_exit(rig: Rig) -> None:
    epoll_fd = rig.source.fileno()
    assert epoll_fd >= 0
    pid, (fd, fd2) = rig.run(
        f"""
fd = os.open(sys.argv[1], os.O_RDWR)
ioctls(fd, {RM_CONTROL}, 7)
ioctls(fd, {SYS_PARAMS}, 3)
fd2 = os.dup(fd)
print(fd, fd2)
os.close(fd)
os.close(fd2)
""",
        rig.gpu,
    )
    # The ring buffer's epoll fd turns readable once records wait.
    readable, _, _ = select.select([epoll_fd], [], [], 10)
    assert readable == [epoll_fd]
    events = rig.wait_exit(pid)
    assert [e.kind for e in events] == [EventKind.OPEN, EventKind.CLOSE, EventKind.EXIT]
    opened, closed, _ = events
    assert (opened.fd, closed.fd) == (int(fd), int(fd2))  # the last fd standing is the dup
    assert opened.device is not None and opened.device.path == rig.gpu
    assert closed.device == opened.device and not closed.mapped
    assert opened.tid == pid and opened.ts_ns <= closed.ts_ns <= events[2].ts_ns
    assert rig.source.ioctl_counts(pid) == {pid: {(rig.gpu, RM_CONTROL): 7, (rig.gpu, SYS_PARAMS): 3}}
    rig.source.forget(pid)
    assert rig.source.ioctl_counts(pid) == {}


def test_fork_of_a_holder(rig: Rig) -> None:
    pid, (child,) = rig.run(
        """
fd = os.open(sys.argv[1], os.O_RDWR)
child = os.fork()
if child == 0:
    os._exit(0)
os.waitpid(child, 0)
print(child)
""",
        rig.gpu,
    )
    events = rig.wait_exit(pid)
    forks = [e for e in events if e.kind is EventKind.FORK]
    assert [e.child_pid for e in forks] == [int(child)]
    # The child is marked a holder at fork, so its exit is reported before anyone seeds it.
    rig.wait_exit(int(child))
    for p in (pid, int(child)):
        rig.source.forget(p)


def test_thread_of_a_holder_is_not_a_fork(rig: Rig) -> None:
    pid, _ = rig.run(
        """
fd = os.open(sys.argv[1], os.O_RDWR)
t = threading.Thread(target=ioctls, args=(fd, 0xC01046CE, 2))
t.start()
t.join()
os.close(fd)
""",
        rig.gpu,
    )
    events = rig.wait_exit(pid)
    assert [e.kind for e in events] == [EventKind.OPEN, EventKind.CLOSE, EventKind.EXIT]
    # The thread's ioctls count for the process: fds belong to the thread group.
    assert rig.source.ioctl_counts(pid)[pid] == {(rig.gpu, 0xC01046CE): 2}
    rig.source.forget(pid)


def test_exec_of_a_holder(rig: Rig) -> None:
    proc = rig.spawn(
        """
fd = os.open(sys.argv[1], os.O_RDWR)  # close-on-exec (PEP 446): gone after exec, no close()
os.execv("/bin/true", ["true"])
""",
        rig.gpu,
    )
    proc.communicate(timeout=30)
    events = rig.wait_exit(proc.pid)
    # Not the loader's mmap/close of libc on the reused fd 3: the stale entry is muted at exec.
    # The exec names the process after its new image (begin_new_exec fires task_rename before
    # sched_process_exec): a RENAME, then the EXEC.
    assert [e.kind for e in events] == [EventKind.OPEN, EventKind.RENAME, EventKind.EXEC, EventKind.EXIT]
    rig.source.forget(proc.pid)


def test_mmap_then_close_keeps_the_hold(rig: Rig) -> None:
    pid, (fd,) = rig.run(
        """
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
c = ctypes
libc.mmap.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_int, c.c_int, c.c_long]
fd = os.open(sys.argv[1], os.O_RDWR)
addr = libc.mmap(None, 4096, mmap.PROT_READ, mmap.MAP_PRIVATE, fd, 0)
assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
os.close(fd)
print(fd)
""",
        str(rig.root / "nvidiazero"),
    )
    events = rig.wait_exit(pid)
    assert [e.kind for e in events] == [EventKind.OPEN, EventKind.MMAP, EventKind.CLOSE, EventKind.EXIT]
    assert events[1].fd == int(fd) and events[2].mapped
    assert events[2].device is not None and events[2].device.path == str(rig.root / "nvidiazero")
    rig.source.forget(pid)


def test_non_matching_open_is_ignored(rig: Rig) -> None:
    quiet, _ = rig.run(
        """
for path in (sys.argv[1], "/dev/null"):
    fd = os.open(path, os.O_RDWR)
    ioctls(fd, 0xC020462A, 3)
    os.close(fd)
os.close(os.open(sys.argv[2], os.O_RDONLY | os.O_DIRECTORY))  # opendir() of a matching directory
os.close(os.open(sys.argv[3], os.O_PATH))  # an O_PATH fd never opens the device
""",
        str(rig.root / "other0"),
        str(rig.root / "nvidia-caps"),
        rig.gpu,
    )
    # The ring buffer is one ordered stream: once a later holder's EXIT is in, anything the quiet
    # process had caused would be in too.
    sentinel, _ = rig.run("os.open(sys.argv[1], os.O_RDWR)", rig.gpu)
    rig.wait_exit(sentinel)
    assert rig.of(quiet) == []
    assert rig.source.ioctl_counts(quiet) == {}
    rig.source.forget(sentinel)


def test_seeded_holder_is_counted_and_closed(rig: Rig) -> None:
    # A relative openat is not matched in the kernel (by design: the /proc scan finds it), so this
    # hold is unknown to BPF until seed().
    proc = rig.spawn(
        """
dirfd = os.open(os.path.dirname(sys.argv[1]), os.O_RDONLY | os.O_DIRECTORY)
fd = os.open(os.path.basename(sys.argv[1]), os.O_RDWR, dir_fd=dirfd)
print(fd, flush=True)
step()
ioctls(fd, 0xC0104629, 4)
os.close(fd)
step()
""",
        rig.gpu,
    )
    assert proc.stdin is not None and proc.stdout is not None
    fd = int(proc.stdout.readline())
    rig.source.seed(proc.pid, {fd: rig.gpu}, ())
    rig.source.seed(proc.pid, {fd: rig.gpu}, ())  # twice: must not count the fd twice
    proc.stdin.write("go\n")
    proc.stdin.flush()
    rig.wait_for(lambda _: EventKind.CLOSE in rig.kinds(proc.pid))
    assert rig.source.ioctl_counts(proc.pid) == {proc.pid: {(rig.gpu, 0xC0104629): 4}}
    proc.stdin.write("go\n")
    proc.stdin.flush()
    proc.communicate(timeout=30)
    events = rig.wait_exit(proc.pid)
    assert [e.kind for e in events] == [EventKind.CLOSE, EventKind.EXIT]
    assert events[0].fd == fd and events[0].device is not None and events[0].device.path == rig.gpu
    rig.source.forget(proc.pid)


def test_no_map_overflowed(rig: Rig) -> None:
    # The memory-call outcomes count the earlier tests' allocation ioctls, which fail on c 1 3.
    lost = {name: n for name, n in rig.source.stats().items() if name not in OUTCOME_STATS}
    assert set(lost.values()) == {0}


def _bpf_fds() -> tuple[int, int]:
    """(BPF program fds, perf event fds) this process holds."""
    progs = perf = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            info = Path(f"/proc/self/fdinfo/{fd}").read_text()
        except OSError:
            continue  # the listing's own fd, closed meanwhile
        progs += "prog_id:" in info
        perf += target == "anon_inode:[perf_event]"
    return progs, perf


def test_close_detaches_everything() -> None:
    require_root()
    before = _bpf_fds()
    source = BpfSource(("/tmp/gg-detach-test/nvidia",), max_fds=1024, ringbuf_pages=8)
    try:
        source.start()
    except BpfUnavailable as exc:
        pytest.skip(str(exc))
    try:
        progs, perf = _bpf_fds()
        hooked = len(source._bpf.tracepoint_fds)
        assert hooked >= 15  # 15 on every ABI, plus open, dup2 and openat2 where they exist
        # One program per tracepoint plus the two slow paths reached by tail call, plus the trace
        # sessions' exit hooks: loaded, attached only while a session runs (none now).
        lazy = len(LAZY_HOOKS)
        assert (progs, perf) == (before[0] + hooked + len(SLOW_PATHS) + lazy, before[1] + hooked)
        source.trace.open_slot(0, 10)
        assert _bpf_fds()[1] == before[1] + hooked + lazy
        source.trace.close_slot(0)
        assert _bpf_fds()[1] == before[1] + hooked
        assert source.start_s is not None and source.start_s < 30
        print(f"BpfSource.start() took {source.start_s:.2f} s")
    finally:
        source.close()
    source.close()  # idempotent
    assert _bpf_fds() == before
    assert source.poll(0) == [] and source.stats()["ringbuf_drops"] == 0


def test_leader_exit_on_a_kernel_without_group_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Older kernels: only the leader's exit is seen; EXIT must wait for the last thread."""
    require_root()
    monkeypatch.setattr(bpf_source, "format_has_field", lambda text, field: False)
    root = Path(tempfile.mkdtemp(prefix="gg-old-", dir="/tmp"))
    os.mknod(root / "nvidia0", 0o666 | 0o020000, os.makedev(1, 3))
    source = BpfSource((str(root / "nvidia"),), max_fds=1024, ringbuf_pages=8)
    try:
        source.start()
    except BpfUnavailable as exc:
        shutil.rmtree(root)
        pytest.skip(str(exc))
    rig = Rig(source, root)
    try:
        assert not source.have_group_dead
        proc = rig.spawn(
            """
fd = os.open(sys.argv[1], os.O_RDWR)
threading.Thread(target=step).start()  # outlives the leader until the test says go
print(os.getpid(), flush=True)
ctypes.CDLL(None).pthread_exit(None)  # ctypes drops the GIL, so the thread runs on
""",
            rig.gpu,
        )
        assert proc.stdin is not None and proc.stdout is not None
        pid = int(proc.stdout.readline())
        deadline = time.monotonic() + 15
        while Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
            assert time.monotonic() < deadline, "the leader never became a zombie"
        # The leader's exit record was submitted before it turned zombie: drain it now.
        rig.seen.extend(source.poll(0))
        assert rig.kinds(pid) == [EventKind.OPEN]
        assert pid in source._leader_exits  # received, and held back while a thread lives
        proc.stdin.write("go\n")
        proc.stdin.flush()
        proc.communicate(timeout=30)
        assert [e.kind for e in rig.wait_exit(pid)] == [EventKind.OPEN, EventKind.EXIT]
    finally:
        source.close()
        shutil.rmtree(root)
