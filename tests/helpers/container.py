"""Fake Kubernetes containers for integration tests: no runtime, no kubelet, same kernel traces.

A FakeContainer is a kubepods-shaped cgroup, created in every mounted cgroup hierarchy (v1 and
v2, found in /proc/self/mountinfo), named exactly as kubelet + the runtime would name it.
`run(steps)` starts gpuwork in its `--shim` mode: a host process with the comm of a runtime
shim forks the container init into a new PID and mount namespace; the init joins the
container's cgroups, mounts a private tmpfs on /dev with the requested character nodes (mknod)
or bound files (`bind_devices`: a fake driver's FUSE files) and a /proc of its own, and execs
gpuwork (or `run(program=...)`, e.g. rmplan) with the script, so the script runs as PID 1.

Orphans: when the shim dies (`kill_shim`) the kernel hands the init to the nearest
PR_SET_CHILD_SUBREAPER ancestor of the shim, else to the PID 1 of the shim's PID namespace
(the host's). On the project's test VM (Linux 6.18) nothing in the chain is a subreaper, so the
new PPid is 1, `process_api`, the VM's init; it reaps an exited orphan, but lazily (about 1 s
measured), so wait for "gone from cgroup.procs", not for "gone from /proc". Exited tasks leave
cgroup.procs at once, zombie or not, so cleanup never waits for that reaping.

Cgroups are made at the root of each hierarchy, as kubelet does, not below the test's own
cgroup: /proc/PID/cgroup then reads exactly like a node's. On the VM this moves the container
process out of the memory cgroup the VM runs tests in; they are a few hundred KiB.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from tests.helpers.workload import ReadyLine, Workload, popen_gpuwork

RUNTIMES = ("containerd", "crio", "docker")
QOS_CLASSES = ("guaranteed", "burstable", "besteffort")
CGROUP_DRIVERS = ("systemd", "cgroupfs")
DEFAULT_DEVICES: dict[str, tuple[int, int]] = {"nvidia0": (1, 3), "nvidiactl": (1, 3), "nvidia-uvm": (1, 3)}
CLEANUP_DEADLINE_S = 10.0


class HarnessError(RuntimeError):
    """The host cannot host a fake container (no cgroup mounts, read-only cgroupfs, ...)."""


@dataclass(frozen=True)
class CgroupMount:
    """One cgroup hierarchy as /proc/self/mountinfo shows it."""

    mountpoint: str
    version: int  # 1 or 2
    options: tuple[str, ...]  # v1 super options: controllers and name=...; empty for v2
    dev: str  # major:minor; two mounts with the same dev are the same hierarchy

    @property
    def is_cpuset_v1(self) -> bool:
        return self.version == 1 and "cpuset" in self.options


def _unescape_mountinfo(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit() and len(field[i + 1 : i + 4]) == 3:
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_cgroup_mounts(mountinfo: str) -> list[CgroupMount]:
    """Cgroup hierarchies mounted at their root, one per hierarchy, in mountinfo order.

    Mounts of a sub-tree (root field other than "/", e.g. inside a cgroup namespace bind) are
    skipped: a path made under them would not read as the kubepods path in /proc/PID/cgroup.
    """
    mounts: dict[str, CgroupMount] = {}
    for line in mountinfo.splitlines():
        pre, sep, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        if fields[3] != "/" or fields[2] in mounts:
            continue
        version = 2 if tail[0] == "cgroup2" else 1
        options = () if version == 2 else tuple(o for o in tail[2].split(",") if o not in ("rw", "ro"))
        mounts[fields[2]] = CgroupMount(_unescape_mountinfo(fields[4]), version, options, fields[2])
    return list(mounts.values())


def kube_cgroup_path(runtime: str, qos: str, cgroup_driver: str, container_id: str, pod_uid: str) -> str:
    """The container's cgroup path as /proc/PID/cgroup shows it (docs/reference/cgroup-paths.md §2)."""
    if runtime not in RUNTIMES or qos not in QOS_CLASSES or cgroup_driver not in CGROUP_DRIVERS:
        raise ValueError(f"unsupported runtime/qos/driver {runtime!r}/{qos!r}/{cgroup_driver!r}")
    levels = ["kubepods"] if qos == "guaranteed" else ["kubepods", qos]
    if cgroup_driver == "cgroupfs":
        leaf = {"containerd": container_id, "docker": container_id, "crio": f"crio-{container_id}"}
        return "/" + "/".join([*levels, f"pod{pod_uid}", leaf[runtime]])
    # kubelet's systemd driver: '-' in a name part becomes '_', each slice repeats its parents.
    parts = [*levels, "pod" + pod_uid.replace("-", "_")]
    slices = ["-".join(parts[: i + 1]) + ".slice" for i in range(len(parts))]
    prefix = {"containerd": "cri-containerd", "crio": "crio", "docker": "docker"}[runtime]
    return "/" + "/".join([*slices, f"{prefix}-{container_id}.scope"])


def _read_ints(path: str) -> list[int]:
    try:
        with open(path) as f:
            return [int(x) for x in f.read().split()]
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return []


def _status_field(pid: int, name: str) -> str | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return line.split(":", 1)[1].strip()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def ancestors(pid: int) -> list[int]:
    """PPid chain of `pid` up to (and including) 1: the candidates to reap an orphan of `pid`."""
    chain: list[int] = []
    while pid > 1 and (ppid := _status_field(pid, "PPid")) is not None and int(ppid) not in chain:
        pid = int(ppid)
        chain.append(pid)
    return chain


def _registry_path() -> str:
    return os.environ.get("GHOSTGPU_HARNESS_REGISTRY") or (
        "/run/ghostgpu-fake-cgroups.json" if os.path.isdir("/run") else "/tmp/ghostgpu-fake-cgroups.json"
    )


@contextlib.contextmanager
def cgroup_registry() -> Iterator[set[str]]:
    """The cgroup directories fake containers made and have not removed yet, shared by every
    test process on the host under an flock: shared levels (kubepods, QoS, pod) are removed
    by whichever container leaves last, whatever process made them, and a concurrent mkdir
    never loses its parent. It lives in /run, which is cleared at boot like the cgroups."""
    fd = os.open(_registry_path(), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        raw = b""
        while chunk := os.read(fd, 65536):
            raw += chunk
        try:
            created = set(json.loads(raw or b"[]"))
        except (ValueError, TypeError):
            created = set()  # a torn or foreign file: start afresh rather than fail every test
        try:
            yield created
        finally:  # also on failure: what was made before it must stay known
            os.lseek(fd, 0, os.SEEK_SET)
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(sorted(created)).encode())
    finally:
        os.close(fd)  # releases the flock


class ContainerProcess(Workload):
    """gpuwork as the init of a fake container; `.pid` is its host PID like `.host_pid`."""

    def __init__(self, container: FakeContainer, steps: list[str], shim_comm: str,
                 program: Path | None = None) -> None:
        argv = ["--shim", "--comm", shim_comm]
        for directory in container.cgroup_paths.values():
            argv += ["--cgroup", os.path.join(directory, "cgroup.procs")]
        for name, (major, minor) in container.devices.items():
            argv += ["--dev", f"{name}:{major}:{minor}"]
        for name, host_path in container.bind_devices.items():
            argv += ["--bind", f"{name}:{host_path}"]
        if program is not None:
            argv += ["--exec", str(program)]
        super().__init__(popen_gpuwork([*argv, "--", *steps]))
        self.container = container
        self._init_pid: int | None = None
        self._host_pid: int | None = None

    def _on_line(self, line: str) -> None:
        if line.startswith("shim-init "):
            self._init_pid = int(line.split()[1])

    @property
    def shim_pid(self) -> int:
        return self.popen.pid

    @property
    def init_pid(self) -> int:
        """Host PID of the container init (PID 1 of its namespace), from the shim's first line."""
        if self._init_pid is None:
            line = self.read_line(5.0)  # the shim prints it before the init may print anything
            if self._init_pid is None:
                raise HarnessError(
                    f"shim {self.shim_pid} did not announce its init (first line {line!r}, "
                    f"rc={self.popen.poll()}, stderr={self._stderr_tail()!r})"
                )
        return self._init_pid

    @property
    def host_pid(self) -> int:
        """Host PID of the gpuwork that printed the last ready line (the init before any)."""
        if self.ready is None or self.ready.pid == 1:
            return self.init_pid
        if self._host_pid is None:
            raise HarnessError(f"namespace PID {self.ready.pid} had exited before it could be resolved")
        return self._host_pid

    @property
    def pid(self) -> int:
        return self.host_pid

    @property
    def ns_pid(self) -> int:
        return self.ready.pid if self.ready is not None else 1

    def wait_ready(self, timeout_s: float = 5.0) -> ReadyLine:
        ready = super().wait_ready(timeout_s)
        self._host_pid = self.init_pid if ready.pid == 1 else self._resolve(ready.pid)
        return ready

    def _resolve(self, ns_pid: int) -> int | None:
        """Host PID of `ns_pid` in this run's PID namespace (each run() has its own PID 1)."""
        try:
            pidns = os.stat(f"/proc/{self.init_pid}/ns/pid").st_ino
        except FileNotFoundError:
            return None  # the init is gone, and with it every process of its namespace
        for pid in self.container.pids():
            nspid = (_status_field(pid, "NSpid") or "").split()
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                if nspid and nspid[-1] == str(ns_pid) and os.stat(f"/proc/{pid}/ns/pid").st_ino == pidns:
                    return pid
        return None

    def kill_shim(self) -> None:
        """SIGKILL the shim only and reap it: the init lives on, reparented (see module doc)."""
        super().kill()

    def kill(self) -> None:
        """SIGKILL the init (the kernel then kills its whole PID namespace) and the shim."""
        with contextlib.suppress(HarnessError):
            self.container.kill_member(self.init_pid)
        super().kill()


class FakeContainer:
    """A kubepods cgroup in every hierarchy plus `run()` to start inits in it; cleans all up on exit."""

    def __init__(
        self,
        runtime: str = "containerd",
        qos: str = "burstable",
        cgroup_driver: str = "systemd",
        devices: dict[str, tuple[int, int]] | None = None,
        container_id: str | None = None,
        pod_uid: str | None = None,
        bind_devices: dict[str, str] | None = None,
    ) -> None:
        self.runtime, self.qos, self.cgroup_driver = runtime, qos, cgroup_driver
        # Files bound on /dev/NAME (a fake driver's FUSE files, FakeDriver.devices()) take the
        # place of the default character nodes of the same name.
        self.bind_devices = dict(bind_devices or {})
        default = {n: d for n, d in DEFAULT_DEVICES.items() if n not in self.bind_devices}
        self.devices = dict(default if devices is None else devices)
        self.container_id = container_id or secrets.token_hex(32)
        self.pod_uid = pod_uid or str(uuid.uuid4())
        self.cgroup_path = kube_cgroup_path(runtime, qos, cgroup_driver, self.container_id, self.pod_uid)
        with open("/proc/self/mountinfo") as f:
            self.mounts = parse_cgroup_mounts(f.read())
        if not self.mounts:
            raise HarnessError("no cgroup hierarchy in /proc/self/mountinfo; mount cgroup2 on /sys/fs/cgroup")
        self.cgroup_paths: dict[str, str] = {
            m.mountpoint: m.mountpoint + self.cgroup_path for m in self.mounts
        }
        self.processes: list[ContainerProcess] = []
        self._created = False

    def create(self) -> None:
        """mkdir -p the container's cgroup in every hierarchy; undoes itself if one fails."""
        self._created = True  # from the first mkdir on, cleanup has something to remove
        try:
            with cgroup_registry() as created:
                for mount in self.mounts:
                    self._mkdirs(mount, created)
        except BaseException:
            with contextlib.suppress(HarnessError):
                self.cleanup()
            raise

    def _mkdirs(self, mount: CgroupMount, created: set[str]) -> None:
        # Runs under the registry's flock, as every rmdir of a fake container does, so no other
        # test process can remove a shared level between two of these mkdirs.
        directory = mount.mountpoint
        try:
            for part in self.cgroup_path.strip("/").split("/"):
                parent, directory = directory, os.path.join(directory, part)
                if os.path.isdir(directory):
                    continue
                os.mkdir(directory)
                created.add(directory)
                if mount.is_cpuset_v1:
                    # cpuset v1 starts a new group with empty cpus/mems and refuses tasks (ENOSPC).
                    for name in ("cpus", "mems"):
                        key = (
                            f"cpuset.{name}"
                            if os.path.exists(os.path.join(parent, f"cpuset.{name}"))
                            else name
                        )
                        Path(directory, key).write_text(Path(parent, key).read_text())
        except OSError as e:
            raise HarnessError(
                f"cannot create cgroup {directory}: {e}; needs root and a writable cgroupfs"
            ) from e

    def run(self, steps: list[str], shim_comm: str = "containerd-shim",
            program: Path | None = None) -> ContainerProcess:
        """Starts a new init (own PID + mount namespace) running `steps` in this container.

        Each run gets its own namespaces (so its own PID 1) but shares the container's cgroups.
        `shim_comm` is cut to 15 bytes by the kernel (TASK_COMM_LEN). `program`: the init execs
        it (e.g. rmplan, tests/helpers/rmplan.py) with `steps` as its arguments instead of gpuwork.
        """
        if not self._created:
            self.create()
        proc = ContainerProcess(self, steps, shim_comm, program)
        self.processes.append(proc)
        return proc

    def pids(self) -> list[int]:
        """Host PIDs in the container's cgroup (first hierarchy; v2 preferred)."""
        mount = next((m for m in self.mounts if m.version == 2), self.mounts[0])
        return _read_ints(os.path.join(self.cgroup_paths[mount.mountpoint], "cgroup.procs"))

    def kill_member(self, pid: int) -> bool:
        """SIGKILL `pid` only if it is (still) in this container's cgroup.

        The pidfd pins the process, so a PID that exited and was reused between reading
        cgroup.procs and the kill can never hit an unrelated process.
        """
        try:
            pidfd = os.pidfd_open(pid)
        except (ProcessLookupError, OSError):
            return False
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                if not any(line.endswith(":" + self.cgroup_path) for line in f.read().splitlines()):
                    return False
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            return True
        except (FileNotFoundError, ProcessLookupError):
            return False
        finally:
            os.close(pidfd)

    def _all_pids(self) -> set[int]:
        return {p for d in self.cgroup_paths.values() for p in _read_ints(os.path.join(d, "cgroup.procs"))}

    def cleanup(self) -> None:
        """Kills everything in the container, then removes its cgroups deepest first.

        Every step runs even when an earlier one failed, so that a broken test leaves no
        cgroups behind; the failures are raised together at the end.
        """
        errors: list[str] = []
        for proc in self.processes:
            try:
                proc.close()
            except Exception as e:  # keep going: the cgroups must still be removed
                errors.append(f"closing shim {proc.shim_pid}: {e!r}")
        deadline = time.monotonic() + CLEANUP_DEADLINE_S
        while pids := self._all_pids():  # a forking script may add PIDs while we kill
            for pid in pids:
                self.kill_member(pid)
            if time.monotonic() > deadline:
                errors.append(f"{self.cgroup_path}: tasks {sorted(pids)} survive SIGKILL")
                break
            time.sleep(0.001)  # polling interval while the kernel finishes the exits
        if self._created:
            with cgroup_registry() as created:
                for directory in self.cgroup_paths.values():
                    try:
                        self._rmdirs(directory, created, deadline)
                    except HarnessError as e:
                        errors.append(str(e))
            self._created = False
        if errors:
            raise HarnessError("; ".join(errors))

    def _rmdirs(self, leaf: str, created: set[str], deadline: float) -> None:
        directory = leaf
        for _ in self.cgroup_path.strip("/").split("/"):
            if directory in created:
                while True:
                    try:
                        os.rmdir(directory)
                        created.discard(directory)
                        break
                    except FileNotFoundError:
                        created.discard(directory)
                        break
                    except OSError as e:
                        # EBUSY: tasks still draining out (leaf) or a sibling container still in it.
                        if directory != leaf and e.errno in (errno.EBUSY, errno.ENOTEMPTY):
                            return
                        if time.monotonic() > deadline:
                            raise HarnessError(f"cannot remove cgroup {directory}: {e}") from e
                        time.sleep(0.001)
            elif directory != leaf:
                return  # no fake container made it (a real kubelet's?): leave it
            directory = os.path.dirname(directory)

    def __enter__(self) -> Self:
        self.create()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cleanup()
