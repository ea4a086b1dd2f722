"""A real orphaned GPU holder: a process a real containerd container started, still holding
`/dev/nvidia0` after CRI stopped that container (CRI says CONTAINER_EXITED, or NOT_FOUND once the
container is removed).

    with planted_orphan(containerd, "orphan-0") as orphan:
        orphan.pid, orphan.container_id, orphan.alive(), orphan.holds()

How it is made, and why each step:
1. The pod shares one PID namespace among its containers (CRI `NamespaceMode.POD`, the pod spec's
   `shareProcessNamespace: true`), so the container's init is not PID 1 of a namespace of its own:
   its exit does not make the kernel kill the rest of the container.
2. The container's command is gpuwork (tests/helpers/gpuwork.c): it opens `/dev/nvidia0` (host
   `/dev/null`, as in every containerd test here), allocates on it (a GPU job, not a `monitor`),
   forks, and the child, which inherits the fd, says `ready` and sleeps. The parent, the
   container's init, waits for it.
3. The child is moved out of the container's cgroup, in every hierarchy, into an escape cgroup
   outside kubepods whose path still names the container and its pod the way
   tracer/cgroup.py reads them: `/ghostgpu-orphans/pod<uid>/cri-containerd-<id>.scope`. This is
   the step a real orphan gets by other means (a process stuck in the driver that the runtime's
   kill does not end, or a holder a crashed shim left behind); containerd 1.6's runc shim, on the
   exit of an init that shares its PID namespace, runs `runc kill --all`, and runc 1.1 signals
   every process of the container's cgroup (its devices hierarchy on cgroup v1,
   `cgroup.procs` on v2): the escaped child is not among them.
4. StopContainer: SIGTERM ends the init, containerd records the container EXITED, and the child
   lives on, reparented to the pod's pause process, still holding the device.

Everything it made goes in `close()` (the `planted_orphan` context's exit): the holder killed
through a pidfd, the escape cgroups removed, the pod stopped and removed through CRI.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from ghostgpu.k8s import cri_runtime_v1_pb2 as cri
from tests.helpers.container import CgroupMount, parse_cgroup_mounts
from tests.helpers.containerd import CALL_TIMEOUT_S, QOS_PARENT, Containerd, Pod, kubelet_labels, rmdir_cgroup
from tests.helpers.polling import poll, wait_until
from tests.helpers.workload import GPUWORK_IN_IMAGE, ReadyLine, allocates, gpuwork_image

ESCAPE_ROOT = "ghostgpu-orphans"  # the top cgroup, in every hierarchy, planted holders escape into
DEVICE = "/dev/nvidia0"
HOLD_MS = 3_600_000  # the holder sleeps this long at most: a leak is bounded even past a crash
DEADLINE_S = 30.0  # generous: CRI calls on a loaded 2-core VM take seconds


class PlantError(RuntimeError):
    """The orphan could not be planted; says which step and what was seen."""


def escape_cgroup_path(pod_uid: str, container_id: str) -> str:
    """The escaped holder's cgroup path, as /proc/PID/cgroup shows it in every hierarchy."""
    return f"/{ESCAPE_ROOT}/pod{pod_uid}/cri-containerd-{container_id}.scope"


def holds(pid: int, device: str = DEVICE) -> bool:
    """`pid` has an fd open on `device` (the path as the process's own mount namespace names it)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") == device:
                return True
    return False


def start_time_ticks(pid: int) -> int:
    """Field 22 of /proc/PID/stat (clock ticks since boot): with the pid, who the process is."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rindex(")") + 2:].split()[19])


def _status_field(pid: int, name: str) -> str:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(name + ":"):
                return line.split(":", 1)[1].strip()
    return ""


def run_shared_pid_pod(ctd: Containerd, name: str, namespace: str) -> Pod:
    """RunPodSandbox as Containerd.run_pod does (host network, cgroup /kubepods/besteffort/pod<uid>),
    but with one PID namespace for the whole pod (shareProcessNamespace)."""
    uid = str(uuid.uuid4())
    log_dir = os.path.join(ctd.dir, "logs", uid)
    os.makedirs(log_dir, exist_ok=True)
    config = cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name=name, uid=uid, namespace=namespace, attempt=0),
        log_directory=log_dir, labels=kubelet_labels(name, namespace, uid),
        linux=cri.LinuxPodSandboxConfig(
            cgroup_parent=f"{QOS_PARENT}/pod{uid}",
            security_context=cri.LinuxSandboxSecurityContext(namespace_options=cri.NamespaceOption(
                network=cri.NODE, pid=cri.POD, ipc=cri.POD))))
    ctd.pod_uids.add(uid)  # its cgroups are removed at the containerd's teardown, whatever happens here
    resp = ctd.runtime.RunPodSandbox(cri.RunPodSandboxRequest(config=config), timeout=CALL_TIMEOUT_S)
    return Pod(resp.pod_sandbox_id, name, namespace, uid, config)


@dataclass
class PlantedOrphan:
    containerd: Containerd
    pod: Pod
    container_id: str = ""
    pid: int = 0  # the holder's host PID
    start_ticks: int = 0
    ns_pid: int = 0  # its PID in the pod's namespace
    init_pid: int = 0  # the container's init (gone once the container is stopped)
    removed: bool = False  # RemoveContainer was called: CRI answers NOT_FOUND
    cgroup_leaves: list[str] = field(default_factory=list)  # the escape cgroup in each hierarchy
    _pidfd: int = -1  # pins the holder: signals through it can never reach a reused PID

    @property
    def cgroup_path(self) -> str:
        return escape_cgroup_path(self.pod.uid, self.container_id)

    def alive(self) -> bool:
        """The holder still runs (not a zombie), and it is the same process (pid and start time)."""
        if self._pidfd < 0:
            return False
        try:
            signal.pidfd_send_signal(self._pidfd, 0)
            state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            return state not in ("Z", "X") and start_time_ticks(self.pid) == self.start_ticks
        except (ProcessLookupError, FileNotFoundError):
            return False

    def holds(self, device: str = DEVICE) -> bool:
        return self.alive() and holds(self.pid, device)

    def cri_state(self) -> str:
        """What CRI says of the container: CONTAINER_RUNNING, CONTAINER_EXITED, ..., or NOT_FOUND."""
        try:
            status = self.containerd.container_status(self.container_id)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return "NOT_FOUND"
            raise
        return str(cri.ContainerState.Name(status.state))

    def proc_cgroup(self) -> str:
        return Path(f"/proc/{self.pid}/cgroup").read_text()

    def kill(self, timeout_s: float = 10.0) -> None:
        """SIGKILL through the pidfd, then wait until it is gone (its parent, the pod's pause, reaps it)."""
        if self._pidfd < 0:
            return
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        wait_until(lambda: not os.path.exists(f"/proc/{self.pid}") or not self.alive(),
                   f"planted holder {self.pid} to die", timeout_s)

    def close(self) -> None:
        """Undo everything, each step even if one before failed; raises the failures together."""
        errors: list[str] = []
        try:
            self.kill()
        except AssertionError as e:
            errors.append(str(e))
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        deadline = time.monotonic() + DEADLINE_S
        for leaf in self.cgroup_leaves:
            if (err := rmdir_cgroup(leaf, deadline)) is not None:
                errors.append(err)
                continue
            # The levels above, once empty (another planted orphan may still be in them).
            parent = os.path.dirname(leaf)
            for _ in range(self.cgroup_path.strip("/").count("/")):
                try:
                    os.rmdir(parent)
                except OSError:
                    break
                parent = os.path.dirname(parent)
        self.cgroup_leaves.clear()
        try:
            self.containerd.start()  # a test may have stopped it: the pod can only go through CRI
            self.containerd.remove_pod(self.pod.id)
        except (grpc.RpcError, RuntimeError) as e:
            errors.append(f"removing pod {self.pod.name}: {e}")
        if errors:
            raise PlantError("orphan cleanup: " + "; ".join(errors))


def _mkdirs(mount: CgroupMount, path: str) -> str:
    """mkdir -p `path` under the hierarchy; cpuset v1 groups get their parent's cpus and mems (a new
    one starts empty and refuses tasks with ENOSPC). Returns the leaf directory."""
    directory = mount.mountpoint
    for part in path.strip("/").split("/"):
        parent, directory = directory, os.path.join(directory, part)
        if os.path.isdir(directory):
            continue
        os.mkdir(directory)
        if mount.is_cpuset_v1:
            for name in ("cpus", "mems"):
                key = f"cpuset.{name}" if os.path.exists(os.path.join(parent, f"cpuset.{name}")) else name
                Path(directory, key).write_text(Path(parent, key).read_text())
    return directory


def _holder_pid(init_pid: int, ready: ReadyLine) -> int:
    """The host PID of the forked holder: the init's child whose innermost NSpid is the one it printed."""
    for task in os.listdir(f"/proc/{init_pid}/task"):
        with contextlib.suppress(OSError):
            for child in Path(f"/proc/{init_pid}/task/{task}/children").read_text().split():
                if _status_field(int(child), "NSpid").split()[-1:] == [str(ready.pid)]:
                    return int(child)
    raise PlantError(f"no child of the container's init {init_pid} has namespace pid {ready.pid}")


def _ready_line(ctd: Containerd, container_id: str) -> ReadyLine:
    found: list[ReadyLine] = []

    def ready() -> bool:
        found[:] = [r for line in ctd.log_lines(container_id) if (r := ReadyLine.parse(line)) is not None]
        return bool(found)

    if not poll(ready, DEADLINE_S):
        raise PlantError(f"container {container_id[:12]} printed no ready line in {DEADLINE_S} s: "
                         f"{ctd.log_lines(container_id)} {ctd.log_lines(container_id, 'stderr')}")
    return found[0]


def plant_orphan(ctd: Containerd, name: str = "orphan-0", namespace: str = "ghost-orphans", *,
                 remove: bool = False) -> PlantedOrphan:
    """Plant one (see the module's docstring); `remove`: RemoveContainer too, so CRI says NOT_FOUND.
    The caller owns the result and must close() it; on failure everything made is undone here."""
    pod = run_shared_pid_pod(ctd, name, namespace)
    orphan = PlantedOrphan(ctd, pod)
    try:
        image = ctd.import_variant(gpuwork_image())
        command = [GPUWORK_IN_IMAGE, "open", DEVICE, *allocates(), "fork", "ready", "sleep", str(HOLD_MS)]
        orphan.container_id = ctd.create_container(pod, "cuda", command, devices=[("/dev/null", DEVICE)],
                                                   image=image)
        ready = _ready_line(ctd, orphan.container_id)
        orphan.init_pid = ctd.container_host_pid(orphan.container_id)
        orphan.pid = _holder_pid(orphan.init_pid, ready)
        orphan._pidfd = os.pidfd_open(orphan.pid)  # from here on it is pinned, whatever its PID becomes
        orphan.start_ticks = start_time_ticks(orphan.pid)
        orphan.ns_pid = ready.pid
        if not holds(orphan.pid):
            raise PlantError(f"holder {orphan.pid} holds no {DEVICE}")
        _escape(orphan)
        ctd.runtime.StopContainer(cri.StopContainerRequest(container_id=orphan.container_id, timeout=10),
                                  timeout=CALL_TIMEOUT_S)
        if remove:
            ctd.runtime.RemoveContainer(cri.RemoveContainerRequest(container_id=orphan.container_id),
                                        timeout=CALL_TIMEOUT_S)
            orphan.removed = True
        expected = "NOT_FOUND" if remove else "CONTAINER_EXITED"
        wait_until(lambda: orphan.cri_state() == expected, f"CRI to say {expected}", DEADLINE_S)
        if not orphan.holds():
            raise PlantError(f"the holder {orphan.pid} did not survive StopContainer "
                             f"(alive: {orphan.alive()}); its cgroup: {_safe_cgroup(orphan.pid)}")
        return orphan
    except BaseException:
        with contextlib.suppress(PlantError):
            orphan.close()
        raise


def _escape(orphan: PlantedOrphan) -> None:
    """Move the holder (its whole thread group) into the escape cgroup in every hierarchy."""
    with open("/proc/self/mountinfo") as f:
        mounts = parse_cgroup_mounts(f.read())
    if not mounts:
        raise PlantError("no cgroup hierarchy mounted at its root in /proc/self/mountinfo")
    for mount in mounts:
        try:
            leaf = _mkdirs(mount, orphan.cgroup_path)
            orphan.cgroup_leaves.append(leaf)
            Path(leaf, "cgroup.procs").write_text(str(orphan.pid))
        except OSError as e:
            raise PlantError(f"cannot move holder {orphan.pid} into {mount.mountpoint}{orphan.cgroup_path}: "
                             f"{e}; needs root and a writable cgroupfs") from e


def _safe_cgroup(pid: int) -> str:
    try:
        return " | ".join(Path(f"/proc/{pid}/cgroup").read_text().splitlines())
    except OSError as e:
        return f"(gone: {e.strerror})"


@contextlib.contextmanager
def planted_orphan(ctd: Containerd, name: str = "orphan-0", namespace: str = "ghost-orphans", *,
                   remove: bool = False) -> Iterator[PlantedOrphan]:
    orphan = plant_orphan(ctd, name, namespace, remove=remove)
    try:
        yield orphan
    finally:
        orphan.close()
