"""The /proc source: pure parsers of /proc files, the device-holder scanner and process identity.

The scanner sees holders as the kernel does (fd tables, maps, every thread): fuser and lsof miss a
process whose leader is a zombie while its threads hold the device, and a GPU node made elsewhere
with mknod. ENOENT/ESRCH/EACCES mid-scan is a process or an fd going away: skipped silently.
"""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from stat import S_ISCHR

from ghostgpu.tracer.cgroup import parse_proc_cgroup, unified_path
from ghostgpu.tracer.devices import (
    DeviceCatalog,
    on_skipped_mount,
    outside_prefix,
    outside_prefix_hint,
    parse_mount_skips,
)
from ghostgpu.tracer.events import DeviceHold, ProcessInfo, ProcView, boot_ns

_DELETED = " (deleted)"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_READ_CHUNK_BYTES = 1 << 16
_NO_DEVICES = ("/proc/", "/sys/", "/memfd:")  # pseudo filesystems and memfds: never a device node
_FD_NAMES = [str(i) for i in range(4096)]  # fd names to probe without getdents
_PROBE_MISSES_BASE, _PROBE_MISSES_PER_FD = 4, 0.2  # a miss costs ~5 us, getdents ~1 us per fd (6.18)
MAX_WORKERS = 8
MIN_PIDS_PER_WORKER = 64  # ~40 ms of scanning: below that a fork costs more than it saves
MAX_PREFIX_HINTS = 16  # device prefixes suggested (one line each) in a scanner's lifetime


@dataclass(frozen=True, slots=True)
class StatFields:
    pid: int
    comm: str
    state: str
    ppid: int
    start_ticks: int  # field 22: clock ticks after boot
    num_threads: int  # field 20


@dataclass(frozen=True, slots=True)
class StatusFields:
    name: str
    state: str  # one letter
    tgid: int
    ppid: int
    uid: int  # real uid
    ns_pid: int | None  # in the innermost PID namespace (last number of NSpid:, Linux 4.1+)
    threads: int


@dataclass(frozen=True, slots=True)
class MapsEntry:
    start: int
    end: int
    perms: str
    offset: int
    dev: str  # "major:minor" (hex) of the filesystem holding the file, not the file's rdev
    inode: int
    path: str  # without the " (deleted)" suffix
    deleted: bool


def parse_stat(text: str) -> StatFields | None:
    """/proc/PID/stat; comm sits between the first '(' and the LAST ')' and may hold both and spaces."""
    left, right = text.find("("), text.rfind(")")
    if left <= 0 or right < left:
        return None
    rest = text[right + 1 :].split()  # rest[0] is field 3, so field N is rest[N - 3]
    try:
        return StatFields(int(text[:left]), text[left + 1 : right], rest[0], int(rest[1]), int(rest[19]),
                          int(rest[17]))
    except (IndexError, ValueError):
        return None


def parse_status(text: str) -> StatusFields | None:
    pairs = (line.partition(":") for line in text.splitlines())
    values = {key: value.strip() for key, sep, value in pairs if sep}
    try:
        ns_pids = values.get("NSpid", "").split()
        return StatusFields(values["Name"], values["State"][:1], int(values["Tgid"]), int(values["PPid"]),
                            int(values["Uid"].split()[0]), int(ns_pids[-1]) if ns_pids else None,
                            int(values["Threads"]))
    except (KeyError, IndexError, ValueError):
        return None


def parse_maps_line(line: str) -> MapsEntry | None:
    parts = line.split(None, 5)
    start, sep, end = parts[0].partition("-") if parts else ("", "", "")
    if len(parts) < 5 or not sep:
        return None
    path = parts[5] if len(parts) == 6 else ""
    deleted = path.endswith(_DELETED)
    try:
        return MapsEntry(int(start, 16), int(end, 16), parts[1], int(parts[2], 16), parts[3], int(parts[4]),
                         path[: -len(_DELETED)] if deleted else path, deleted)
    except ValueError:
        return None


def parse_maps(text: str) -> list[MapsEntry]:
    """/proc/PID/maps; a path may contain spaces, and ends in " (deleted)" once unlinked."""
    return [entry for entry in map(parse_maps_line, text.splitlines()) if entry is not None]


def parse_cmdline(data: bytes) -> str:
    """/proc/PID/cmdline: NUL-separated arguments -> one space-joined string."""
    return " ".join(arg.decode("utf-8", "replace") for arg in data.rstrip(b"\0").split(b"\0"))


def ticks_to_boot_ns(ticks: int) -> int:
    """/proc/PID/stat clock ticks -> ns since boot (the clock of boot_ns())."""
    return ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def read_bytes(path: str | int) -> bytes | None:
    """A whole /proc file (or what is left in an fd, then closed); None when gone or unreadable."""
    chunks: list[bytes] = []
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC) if isinstance(path, str) else path
    except OSError:
        return None
    try:
        while chunk := os.read(fd, _READ_CHUNK_BYTES):  # no buffered-IO objects: this is the hot path
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError:  # ESRCH: the process exited between open and read
        return None
    finally:
        os.close(fd)


def _read_text(path: str) -> str:
    data = read_bytes(path)
    return "" if data is None else data.decode("utf-8", "replace")


class ProcScanner:
    """One pass over /proc: host PID -> device path -> DeviceHold, for GPU device holders only.

    Kernel-bound (a readlink of another process's fd is ~3.5 us on Linux 6.18, Python adds ~25%):
    a large scan is split over forked `workers`. Files outside /dev are stat'ed (what catches a node
    made there with mknod; ~25% of a scan) for each process once every `stat_outside_dev_every`
    scans, staggered by PID: 1 = every scan, 0 = never.

    A file outside the prefixes named like a GPU device of theirs (`/srv/chroot/dev/nvidia0`: a
    chroot's or another mount namespace's /dev seen from here) is not a hold, but `on_hint` gets one
    line saying so (devices.outside_prefix_hint) after the scan that first saw it: one per prefix that
    would cover it, at most MAX_PREFIX_HINTS in all. The test costs one substring search per fd
    whose link is a path.
    """

    def __init__(self, catalog: DeviceCatalog, proc_root: str = "/proc", workers: int | None = None,
                 stat_outside_dev_every: int = 8, on_hint: Callable[[str], None] | None = None) -> None:
        self.catalog, self.proc_root = catalog, proc_root
        self.workers = workers if workers is not None else min(MAX_WORKERS, len(os.sched_getaffinity(0)))
        self.stat_outside_dev_every, self._scans, self._deep = stat_outside_dev_every, 0, False
        self._prefixes, self._dev_or_prefixes = catalog.prefixes, (*catalog.prefixes, "/dev/")
        # a maps file worth parsing names a device: under /dev/ or a prefix elsewhere (tests, host mounts)
        self._maps_needles = (b"/dev/", *(p.encode() for p in catalog.prefixes if not p.startswith("/dev/")))
        self._not_devices: set[tuple[str, str]] = set()  # (mount ns + root, path), for one scan
        self._mounts_by_ns: dict[str, tuple[dict[str, bool], dict[str, bool]]] = {}  # (mounts, dirs)
        # the process being scanned, and what it holds so far
        self._base, self._ns_key, self._now_ns, self._via_tasks = "", "", 0, False
        self._holds: dict[str, DeviceHold] = {}
        self.fds_seen = self.stats_done = 0  # counters of the last scan, for the benchmark and logs
        self._pid = 0
        # GPU-looking files outside the prefixes: a link holding "/" + a prefix's last part is checked
        stems = tuple(dict.fromkeys(p[p.rfind("/") + 1 :] for p in catalog.prefixes if not p.endswith("/")))
        self._hint_stems = stems
        self._hint_needle = f"/{stems[0]}" if stems else "\0"  # "\0": no path holds a NUL
        self._hint_more = tuple(f"/{stem}" for stem in stems[1:])
        self.on_hint = on_hint
        self._hinted: set[str] = set()  # the prefixes suggested so far
        self._new_hints: list[tuple[str, str, int]] = []  # this scan's (prefix, path, pid)

    def list_pids(self) -> list[int]:
        with contextlib.suppress(OSError):
            return [int(name) for name in os.listdir(self.proc_root) if name.isdigit()]
        return []

    def scan(self, pids: Iterable[int] | None = None) -> ProcView:
        now_ns = boot_ns()
        pid_list = self.list_pids() if pids is None else list(pids)
        self.fds_seen = self.stats_done = 0
        self._not_devices, self._mounts_by_ns, self._scans = set(), {}, self._scans + 1
        workers = min(self.workers, len(pid_list) // MIN_PIDS_PER_WORKER)
        view = (self._scan_forked(pid_list, workers, now_ns) if workers > 1
                else self._scan_inline(pid_list, now_ns))
        hints, self._new_hints = self._new_hints, []
        for _prefix, path, pid in hints:
            line = outside_prefix_hint(path, self._prefixes, pid)
            if line is not None and self.on_hint is not None:
                self.on_hint(line)
        return view

    def _scan_inline(self, pids: Iterable[int], now_ns: int) -> ProcView:
        return {pid: holds for pid in pids if (holds := self.scan_pid(pid, now_ns))}

    def _scan_forked(self, pids: list[int], workers: int, now_ns: int) -> ProcView:
        """This process and workers-1 forked children scan interleaved slices.

        Safe although the tracer has threads: a child only makes syscalls, pickles plain data and
        leaves by os._exit (no locks, imports or atexit). A failed child's slice is scanned here.
        """
        running: list[tuple[int, int, list[int]]] = []
        leftover = pids[0::workers]
        for i in range(1, workers):
            part = pids[i::workers]
            pipe_fds: tuple[int, ...] = ()
            try:
                read_fd, write_fd = pipe_fds = os.pipe()
                child = os.fork()
            except OSError:  # EMFILE/EAGAIN/ENOMEM
                for fd in pipe_fds:
                    os.close(fd)
                leftover += part
                continue
            if child == 0:  # pragma: no cover - runs in the forked child
                self._worker_main(read_fd, write_fd, part, now_ns)
            os.close(write_fd)
            running.append((child, read_fd, part))
        view = self._scan_inline(leftover, now_ns)
        for child, read_fd, part in running:
            data = read_bytes(read_fd)
            with contextlib.suppress(ChildProcessError):  # someone else may reap our children
                os.waitpid(child, 0)
            try:
                sub_view, fds_seen, stats_done, hints = pickle.loads(data or b"")
            except Exception:  # the child died before or while writing: scan its slice here
                sub_view, fds_seen, stats_done, hints = self._scan_inline(part, now_ns), 0, 0, []
            view.update(sub_view)
            for prefix, path, pid in hints:  # what the child found first; the parent's set decides
                self._hint(prefix, path, pid)
            self.fds_seen += fds_seen
            self.stats_done += stats_done
        return view

    def _worker_main(self, read_fd: int, write_fd: int, pids: list[int], now_ns: int) -> None:
        try:
            os.close(read_fd)
            with open(write_fd, "wb") as out:  # the counters after the scan: a tuple is built in order
                pickle.dump((self._scan_inline(pids, now_ns), self.fds_seen, self.stats_done,
                             self._new_hints), out)
        finally:  # whatever went wrong shows as a short pickle, and the parent scans the slice itself
            os._exit(0)

    def scan_pid(self, pid: int, now_ns: int | None = None) -> dict[str, DeviceHold]:
        """Device holds of one process: its fds, its maps, and its threads' fds if the leader is dead."""
        base = maps_base = self._base = f"{self.proc_root}/{pid}"
        self._pid = pid
        self._now_ns = boot_ns() if now_ns is None else now_ns
        self._ns_key, self._via_tasks, self._holds = "", False, {}
        every = self.stat_outside_dev_every
        self._deep = every > 0 and (pid + self._scans) % every == 0
        count = self._scan_fd_dir(f"{base}/fd")
        stat = parse_stat(_read_text(f"{base}/stat")) if count <= 0 else None
        if stat is not None and (count < 0 or stat.state == "Z"):
            # A zombie leader has released its own fd table and mm, but the other threads share
            # them (CLONE_FILES/CLONE_VM) and keep the device open: fuser and lsof miss this case.
            self._via_tasks = True
            with contextlib.suppress(OSError):
                for tid in os.listdir(f"{base}/task"):
                    if self._scan_fd_dir(f"{base}/task/{tid}/fd") > 0 and maps_base == base:
                        maps_base = f"{base}/task/{tid}"  # a live thread: its mm is still there
            self._via_tasks = False
        self._scan_maps(maps_base)
        return self._holds

    def _scan_fd_dir(self, fd_dir: str) -> int:
        """Readlink every fd: -1 if the directory is unreadable, else how many fds it holds. Since Linux
        6.2 its st_size is the fd count: fds 0..n-1 are probed, and getdents (1/8 of a scan's kernel
        time) is only paid for a table with holes, or on an older kernel (st_size 0)."""
        try:
            dir_fd = os.open(fd_dir, _DIR_FLAGS)
        except OSError:
            return -1
        try:
            count = os.fstat(dir_fd).st_size
            found = probed = 0
            if 0 < count <= len(_FD_NAMES):
                misses = _PROBE_MISSES_BASE + int(count * _PROBE_MISSES_PER_FD)
                found, probed = self._readlinks(dir_fd, _FD_NAMES, count, misses)
            if found < count or count == 0:
                names = [name for name in os.listdir(dir_fd) if name.isdigit() and int(name) >= probed]
                found += self._readlinks(dir_fd, names, len(names), len(names))[0]
            self.fds_seen += found
            return found
        except OSError:
            return -1
        finally:
            os.close(dir_fd)

    def _readlinks(self, dir_fd: int, names: list[str], want: int, max_misses: int) -> tuple[int, int]:
        """Readlink names in order until `want` exist or `max_misses` do not: (existed, tried).

        readlink, not stat, is the hot call: a stat follows the link into the file's filesystem.
        """
        readlink, deep, candidates, found, misses = os.readlink, self._deep, self._dev_or_prefixes, 0, 0
        needle, more = self._hint_needle, self._hint_more
        for name in names:
            if found == want:
                break
            try:
                target = readlink(name, dir_fd=dir_fd)
            except OSError:
                misses += 1
                if misses > max_misses:
                    break
                continue
            found += 1
            # not socket:[..], pipe:[..], anon_inode:..; _path_fd's first test, spared a method call
            if target[0] == "/":
                if deep or target.startswith(candidates):
                    self._path_fd(dir_fd, name, target)
                if needle in target or (more and any(n in target for n in more)):
                    self._outside(target)
        return found, found + misses

    def _outside(self, path: str) -> None:
        """A path named like a GPU device: noted for a hint if it lies outside the prefixes."""
        if path[path.rfind("/") + 1 :].startswith(self._hint_stems):
            prefix = outside_prefix(path, self._prefixes)
            if prefix is not None:
                self._hint(prefix, path, self._pid)

    def _hint(self, prefix: str, path: str, pid: int) -> None:
        if prefix not in self._hinted and len(self._hinted) < MAX_PREFIX_HINTS:
            self._hinted.add(prefix)
            self._new_hints.append((prefix, path, pid))

    def _path_fd(self, dir_fd: int, name: str, target: str) -> None:
        key = None
        if not target.startswith(self._prefixes):
            in_dev = target.startswith("/dev/")
            if not (in_dev or self._deep) or target.startswith(_NO_DEVICES):
                return
            # One path in one mount namespace and root is one file: stat it once per scan.
            key = (self._ns_key or self._load_ns_key(), target)
            if key in self._not_devices:
                return
            if not in_dev and self._skipped(target):
                self._not_devices.add(key)
                return
        try:
            st = os.stat(name, dir_fd=dir_fd)  # follows the magic link: the open file itself
        except OSError:
            return
        self.stats_done += 1
        node = S_ISCHR(st.st_mode)  # not a node and not under a prefix: no need to ask the catalog
        hold = self._add(target, st.st_rdev if node else None, int(name)) if node or key is None else None
        if hold is None and key is not None and not target.endswith(_DELETED):
            self._not_devices.add(key)  # (several deleted files can share one name: not cached)

    def _load_ns_key(self) -> str:
        try:
            self._ns_key = os.readlink(f"{self._base}/ns/mnt") + os.readlink(f"{self._base}/root")
        except OSError:
            self._ns_key = self._base  # unknown: share the cache with no other process
        return self._ns_key

    def _skipped(self, path: str) -> bool:
        """Is path on a remote or nodev mount? Memoised per mount namespace and directory."""
        if self._ns_key not in self._mounts_by_ns:
            self._mounts_by_ns[self._ns_key] = (parse_mount_skips(_read_text(f"{self._base}/mountinfo")), {})
        mounts, by_dir = self._mounts_by_ns[self._ns_key]
        if path in mounts:  # a file bind-mounted on its own
            return mounts[path]
        parent = path[: path.rfind("/")] or "/"
        if parent not in by_dir:
            by_dir[parent] = on_skipped_mount(parent, mounts)
        return by_dir[parent]

    def _add(self, target: str, rdev: int | None, fd: int) -> DeviceHold | None:
        path = target[: -len(_DELETED)] if target.endswith(_DELETED) else target
        hold = self._holds.get(path)
        if hold is None:
            ref = self.catalog.match(path, rdev)
            if ref is None:
                return None
            hold = self._holds[path] = DeviceHold(device=ref, first_seen_ns=self._now_ns, source="procfs")
        if fd >= 0:
            hold.fds.add(fd)
        hold.via_tasks = hold.via_tasks or self._via_tasks
        return hold

    def _scan_maps(self, base: str) -> None:
        """A process can mmap a device and close every fd: the mapping alone keeps it held."""
        data = read_bytes(f"{base}/maps")
        if not data or not any(needle in data for needle in self._maps_needles):
            return
        seen: set[str] = set()
        for line in data.decode("utf-8", "surrogateescape").splitlines():
            entry = parse_maps_line(line) if "/" in line else None
            if entry is None or entry.path in seen:
                continue
            if not entry.path.startswith(self._dev_or_prefixes):
                if self._hint_needle in entry.path or any(n in entry.path for n in self._hint_more):
                    self._outside(entry.path)
                continue
            path = entry.path
            seen.add(path)
            rdev = None
            try:  # map_files (CAP_SYS_ADMIN) names are unpadded, unlike maps' %08lx
                st = os.stat(f"{base}/map_files/{entry.start:x}-{entry.end:x}")
                rdev = st.st_rdev if S_ISCHR(st.st_mode) else 0
            except OSError:
                pass
            if not rdev and not path.startswith(self._prefixes):
                continue  # a regular file under /dev (e.g. /dev/shm/...): not a device
            hold = self._add(path, rdev, -1)
            if hold is not None:
                hold.mapped = True


def read_process(pid: int, proc_root: str = "/proc") -> ProcessInfo | None:
    """Who a host PID is; None when it is already gone."""
    base = f"{proc_root}/{pid}"
    fields = parse_stat(_read_text(f"{base}/stat"))
    if fields is None:
        return None
    info = ProcessInfo(pid=pid, start_ticks=fields.start_ticks, comm=fields.comm, ppid=fields.ppid,
                       state=fields.state)
    status = parse_status(_read_text(f"{base}/status"))
    if status is not None:
        info.ns_pid, info.uid = status.ns_pid, status.uid
    info.cmdline = parse_cmdline(read_bytes(f"{base}/cmdline") or b"")
    with contextlib.suppress(OSError):  # fails for kernel threads, zombie leaders, no ptrace access
        info.exe = os.readlink(f"{base}/exe")
    try:
        info.threads = len(os.listdir(f"{base}/task"))
    except OSError:
        info.threads = status.threads if status else fields.num_threads
    cgroup_text = _read_text(f"{base}/cgroup")
    ident = parse_proc_cgroup(cgroup_text)
    info.container_id, info.pod_uid, info.runtime = ident.container_id, ident.pod_uid, ident.runtime
    info.cgroup_path = ident.path or unified_path(cgroup_text)
    if fields.ppid > 0:  # best effort: the parent may be gone, or in another PID namespace
        parent = parse_stat(_read_text(f"{proc_root}/{fields.ppid}/stat"))
        info.parent_comm = parent.comm if parent else ""
        parent_cgroup = parse_proc_cgroup(_read_text(f"{proc_root}/{fields.ppid}/cgroup"))
        info.parent_container_id = parent_cgroup.container_id
    return info
