"""`ghostgpu up --demo`: plant the consumers ghostgpu exists to find, then remove every trace of them.

Each demo container is what the kernel sees of a Kubernetes container, made by hand: a process in
its own PID and mount namespaces (`unshare`), in a kubepods-shaped cgroup
(/kubepods/besteffort/pod<uid>/<64-hex id>, kubelet's cgroupfs driver) in every cgroup hierarchy,
with a private tmpfs /dev holding `nvidia0` and `nvidiactl` as `mknod c 1 3` (the null device:
nothing reaches a real GPU). Three are planted:

- hidden: holds /dev/nvidia0 open, running; NVML lists no such process.
- orphaned: the same, then its parent (the "shim", here `unshare`) is killed, so the container's
  init is reparented to the host's init while its cgroup stays: what a crashed containerd-shim
  leaves behind.
- short-lived: a container re-run every few seconds that opens the GPU for 50 ms and exits, the
  kind of job a 1 s poller (or dcgm-exporter's 15 s scrape) never sees.

Without a real NVIDIA driver, NVML cannot say whether it lists a process, so "hidden" would read
"unknown". The demo then builds a demo NVML (cli/demo_nvml.c) reporting one demo GPU with no
processes, and the view labels it as such. A demo CRI runtime (cli/demo_cri.py) names the
pods. Everything lives in one temporary directory and is removed by close(), which runs on exit,
on SIGINT/SIGTERM (through `up`) and when planting fails half-way. That includes the collector's store
(db_path, unless `up --db` names one): the planted consumers' findings and events are the demo's, and
must not reach the node's real history, where the next `ghostgpu up` would list them as findings.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from types import TracebackType

import grpc
from ghostgpu.cli.demo_cri import DemoPod
from ghostgpu.cli.demo_cri import serve as serve_cri

from ghostgpu.common.model.display import short_id
from ghostgpu.common.transport.addresses import unix_address

log = logging.getLogger("ghostgpu.demo")

SHORT_LIVED_EVERY_S = 3.0
READY_TIMEOUT_S = 10.0
CLEANUP_TIMEOUT_S = 10.0
DEMO_GPU_UUID = "GPU-00000000-dead-beef-0000-000000000000"
NVML_SOURCE = Path(__file__).with_name("demo_nvml.c")
GPU_FD = 3  # _INIT's `exec 3<>/dev/nvidia0`

# Runs as the container's init. $@ are the cgroup.procs files of the container in every hierarchy;
# writing 0 moves the writer itself (cgroup v1 and v2 both read 0 as "current").
_INIT = r"""
set -e
for procs in "$@"; do echo 0 > "$procs"; done
mount -t tmpfs -o mode=755,size=64k ghostgpu-demo-dev /dev
mknod -m 666 /dev/nvidia0 c 1 3
mknod -m 666 /dev/nvidiactl c 1 3
exec 3<>/dev/nvidia0 4<>/dev/nvidiactl
if [ "$DEMO_HOLD_S" = forever ]; then echo ready; exec "$DEMO_EXEC" infinity; fi
exec "$DEMO_EXEC" "$DEMO_HOLD_S"
"""


class DemoError(RuntimeError):
    """Planting failed; the message is one line saying what and why."""


def _cgroup_hierarchies() -> list[tuple[str, bool]]:
    """(mountpoint, is cpuset v1) for each cgroup hierarchy mounted at its root, once each."""
    seen: dict[str, tuple[str, bool]] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fields, tail = pre.split(), post.split()
            if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2") or fields[3] != "/":
                continue
            cpuset = tail[0] == "cgroup" and "cpuset" in tail[2].split(",")
            seen.setdefault(fields[2], (fields[4].replace("\\040", " "), cpuset))
    return list(seen.values())


class Demo:
    """The planted containers, their cgroups, the demo NVML and CRI; close() undoes all of it."""

    def __init__(self, fake_nvml: bool, short_lived_every_s: float = SHORT_LIVED_EVERY_S,
                 real_cri_endpoint: str | None = None) -> None:
        """`real_cri_endpoint`: the node's runtime, which answers for every container not the demo's."""
        self.fake_nvml = fake_nvml
        self.real_cri_endpoint = real_cri_endpoint
        self.short_lived_every_s = short_lived_every_s
        self.workdir = Path(tempfile.mkdtemp(prefix="ghostgpu-demo-"))
        self.cgroup_dirs: list[str] = []  # made by the demo, parents first
        self.shims: list[subprocess.Popen[bytes]] = []
        self.pods: dict[str, DemoPod] = {}
        self.container_dirs: dict[str, list[str]] = {}
        self._cri: grpc.Server | None = None
        self._stop = threading.Event()
        self._loop: threading.Thread | None = None
        self._lock = threading.Lock()

    # ---- set-up -------------------------------------------------------------------------------

    def start(self) -> Demo:
        """Plant hidden and orphaned and start the demo runtime; on any failure undo what was done."""
        try:
            if os.geteuid() != 0:
                raise DemoError("--demo needs root (mknod, namespaces, cgroups); run it with sudo")
            for tool in ("unshare", "mount", "mknod", "sleep"):
                if shutil.which(tool) is None:
                    raise DemoError(f"--demo needs `{tool}` (util-linux/coreutils) on the PATH")
            if self.fake_nvml:
                self._build_nvml()
            pods = [self._pod("hidden-trainer", "trainer", "demo-trainer"),
                    self._pod("orphaned-worker", "worker", "demo-worker", exited=True),
                    self._pod("short-lived-batch", "batch", "demo-batch")]
            self._cri = serve_cri(pods, str(self.workdir / "cri.sock"), self.real_cri_endpoint)
            self._hold(self.pods["demo-trainer"])
            orphan = self._hold(self.pods["demo-worker"])
            # The shim dies and the init lives on, reparented: SIGKILL so it cannot take its child along.
            orphan.kill()
            orphan.wait()
        except BaseException:
            self.close()
            raise
        return self

    def _build_nvml(self) -> None:
        lib_dir = self.workdir / "nvml"
        lib_dir.mkdir()
        compiler = shutil.which("gcc") or shutil.which("cc")
        if compiler is None:
            raise DemoError("--demo without an NVIDIA driver builds a demo NVML library and needs gcc; "
                            "apt-get install gcc")
        done = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-Wall", "-o",
                               str(lib_dir / "libnvidia-ml.so.1"), str(NVML_SOURCE)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no output"])[0]
            raise DemoError(f"building the demo NVML ({NVML_SOURCE.name}) failed: {first}")
        (self.workdir / "nvml.conf").write_text(
            f"driver=demo\nuuid={DEMO_GPU_UUID}\nname=ghostgpu_demo_GPU\nminor=0\nmemory={16 << 30}\n")

    def _pod(self, pod: str, container: str, comm: str, exited: bool = False) -> DemoPod:
        cid, pod_uid = secrets.token_hex(32), str(uuid.uuid4())
        p = DemoPod(container_id=cid, sandbox_id=secrets.token_hex(32), pod=pod, pod_uid=pod_uid,
                    container=container, image=f"ghostgpu/demo-{container}:1", exited=exited)
        self.pods[comm] = p
        # A process's comm is the basename of the path it was exec'd by, so links named after the
        # role make every event read well: the init is sh (it opens the devices), then it execs
        # coreutils sleep to hold them.
        (self.workdir / "sh").mkdir(exist_ok=True)
        os.symlink(shutil.which("sh") or "/bin/sh", self.workdir / "sh" / comm)
        os.symlink(shutil.which("sleep") or "/bin/sleep", self.workdir / comm)
        dirs = [self._mkdirs(mountpoint, cpuset, ("kubepods", "besteffort", f"pod{pod_uid}", cid))
                for mountpoint, cpuset in _cgroup_hierarchies()]
        if not dirs:
            raise DemoError("no cgroup hierarchy is mounted (see /proc/self/mountinfo); mount cgroup2 "
                            "on /sys/fs/cgroup")
        self.container_dirs[cid] = dirs
        return p

    def _mkdirs(self, mountpoint: str, cpuset: bool, parts: tuple[str, ...]) -> str:
        """mkdir -p of the container's cgroup; a shared level (kubepods, besteffort) that another
        demo or runtime removes under our feet is made again, a few times."""
        for attempt in range(3):
            directory = mountpoint
            try:
                for part in parts:
                    parent, directory = directory, os.path.join(directory, part)
                    if not os.path.isdir(directory):
                        self._mkdir(parent, directory, cpuset)
                return directory
            except FileNotFoundError:
                if attempt == 2:
                    raise DemoError(f"cannot create cgroup {directory}: its parent keeps vanishing") from None
        return directory

    def _mkdir(self, parent: str, directory: str, cpuset: bool) -> None:
        try:
            os.mkdir(directory)
        except FileExistsError:
            return  # made meanwhile by someone else: theirs to remove
        except FileNotFoundError:
            raise  # the parent was removed meanwhile: _mkdirs starts over
        except OSError as e:
            raise DemoError(f"cannot create cgroup {directory}: {e}; --demo needs a writable cgroupfs") from e
        self.cgroup_dirs.append(directory)
        if cpuset:
            # cpuset v1 starts a group with no cpus and mems and refuses tasks (ENOSPC) until set.
            for name in ("cpus", "mems"):
                key = f"cpuset.{name}" if os.path.exists(os.path.join(parent, f"cpuset.{name}")) else name
                Path(directory, key).write_text(Path(parent, key).read_text())

    def _launch(self, pod: DemoPod, comm: str, hold: str) -> subprocess.Popen[bytes]:
        procs = [os.path.join(d, "cgroup.procs") for d in self.container_dirs[pod.container_id]]
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
               "DEMO_EXEC": str(self.workdir / comm), "DEMO_HOLD_S": hold}
        proc = subprocess.Popen(
            ["unshare", "--pid", "--mount", "--fork", "--mount-proc", "--", str(self.workdir / "sh" / comm),
             "-c", _INIT, comm, *procs],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE if hold == "forever" else subprocess.DEVNULL,
            stderr=subprocess.PIPE, env=env)
        with self._lock:
            self.shims.append(proc)
        return proc

    def _hold(self, pod: DemoPod) -> subprocess.Popen[bytes]:
        comm = next(c for c, p in self.pods.items() if p is pod)
        proc = self._launch(pod, comm, "forever")
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT_S)
        line = proc.stdout.readline() if ready else b""
        proc.stdout.close()
        if line.strip() != b"ready":
            self._kill_container(pod.container_id)
            proc.kill()
            err = ""
            if proc.stderr is not None and select.select([proc.stderr], [], [], 1.0)[0]:
                err = os.read(proc.stderr.fileno(), 4096).decode(errors="replace").strip()
            why = err.splitlines()[-1] if err else f"no ready line (got {line!r})"
            raise DemoError(f"demo container {pod.pod} did not start: {why}")
        return proc

    # ---- the short-lived consumer -----------------------------------------------------------

    def start_short_lived(self) -> None:
        """Start re-running the short-lived container (once; later calls do nothing)."""
        if self._loop is not None or self._stop.is_set():
            return
        self._loop = threading.Thread(target=self._short_lived_loop, name="ghostgpu-demo-batch", daemon=True)
        self._loop.start()

    def _short_lived_loop(self) -> None:
        pod = self.pods["demo-batch"]
        while not self._stop.is_set():
            proc = self._launch(pod, "demo-batch", "0.05")
            try:
                proc.wait(timeout=READY_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("demo: a short-lived run is stuck; killing it")
                self._kill_container(pod.container_id)
                proc.kill()
                proc.wait()
            if proc.stderr:
                proc.stderr.close()
            with self._lock:
                self.shims.remove(proc)
            self._stop.wait(self.short_lived_every_s)

    # ---- what up needs ----------------------------------------------------------------------

    @property
    def db_path(self) -> str:
        """The demo's own collector store (SQLite, with its WAL and audit log beside it)."""
        return str(self.workdir / "collector.db")

    @property
    def cri_endpoint(self) -> str:
        return unix_address(str(self.workdir / "cri.sock"))

    def tracer_env(self) -> dict[str, str]:
        if not self.fake_nvml:
            return {}
        return {"LD_LIBRARY_PATH": str(self.workdir / "nvml"),
                "GHOSTGPU_DEMO_NVML": str(self.workdir / "nvml.conf")}

    def container_ids(self) -> dict[str, str]:
        """Role -> container ID."""
        return {"hidden": self.pods["demo-trainer"].container_id,
                "orphaned": self.pods["demo-worker"].container_id,
                "short-lived": self.pods["demo-batch"].container_id}

    def held(self) -> dict[str, tuple[int | None, str]]:
        """Role (hidden, orphaned) -> (host PID, the GPU device it holds as /proc/PID/fd shows it from
        here): /dev/nvidia0 on the host, `<dir>/dev/nvidia0` from inside a chroot at <dir>. (None, why)
        when the container has no process left; (PID, why) when its fd cannot be read."""
        out: dict[str, tuple[int | None, str]] = {}
        for role in ("hidden", "orphaned"):
            pids = sorted(self._members(self.container_ids()[role]))
            if not pids:
                out[role] = (None, "its container has no process left (it exited or was killed)")
                continue
            try:
                out[role] = (pids[0], os.readlink(f"/proc/{pids[0]}/fd/{GPU_FD}"))
            except OSError as e:
                out[role] = (pids[0], f"cannot read /proc/{pids[0]}/fd/{GPU_FD}: {e.strerror}")
        return out

    def legend(self) -> str:
        ids = {role: short_id(cid) for role, cid in self.container_ids().items()}
        return (f"demo: planted in namespace ghostgpu-demo: hidden = hidden-trainer ({ids['hidden']}), "
                f"orphaned = orphaned-worker ({ids['orphaned']}), short-lived = short-lived-batch "
                f"({ids['short-lived']}, re-run every {self.short_lived_every_s:g} s); all removed on exit")

    # ---- tear-down --------------------------------------------------------------------------

    def _members(self, cid: str) -> set[int]:
        pids: set[int] = set()
        for d in self.container_dirs.get(cid, []):
            with contextlib.suppress(OSError, ValueError):
                pids.update(int(x) for x in Path(d, "cgroup.procs").read_text().split())
        return pids

    def _kill_container(self, cid: str) -> None:
        """SIGKILL every process in the container's cgroups (PID 1 of a namespace ignores the rest).
        A pidfd pins each PID, so one reused between the read and the kill is never hit."""
        for pid in self._members(cid):
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                if pid in self._members(cid):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(fd)

    def close(self) -> None:
        """Kill, remove, delete; every step runs even if one before it failed. Idempotent."""
        self._stop.set()
        if self._loop is not None and self._loop is not threading.current_thread():
            self._loop.join(timeout=READY_TIMEOUT_S + 1)
        deadline = time.monotonic() + CLEANUP_TIMEOUT_S
        for cid in self.container_dirs:
            while self._members(cid) and time.monotonic() < deadline:
                self._kill_container(cid)
                time.sleep(0.01)  # exited tasks leave cgroup.procs at once; this only spaces retries
        with self._lock:
            shims, self.shims = list(self.shims), []
        for proc in shims:
            with contextlib.suppress(OSError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        for directory in reversed(self.cgroup_dirs):
            self._rmdir(directory, deadline)
        self.cgroup_dirs.clear()
        if self._cri is not None:
            self._cri.stop(grace=None)
            self._cri = None
        shutil.rmtree(self.workdir, ignore_errors=True)

    @staticmethod
    def _rmdir(directory: str, deadline: float) -> None:
        while True:
            try:
                if any(entry.is_dir() for entry in os.scandir(directory)):
                    return  # a shared level (kubepods, besteffort) that other pods use: theirs now
                os.rmdir(directory)
                return
            except FileNotFoundError:
                return
            except OSError as e:
                # EBUSY: a killed task has not left the group yet.
                if e.errno != errno.EBUSY or time.monotonic() >= deadline:
                    log.warning("demo: cannot remove cgroup %s: %s", directory, e)
                    return
                time.sleep(0.01)

    def __enter__(self) -> Demo:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
