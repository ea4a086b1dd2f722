"""A real CRI endpoint for tests: Debian's containerd with its CRI plugin, all state in a temp dir.

Follows docs/reference/containerd-test-recipe.md: a version-2 config with root, state, sockets
and runc root under one short /tmp dir (a unix socket path must stay under 108 bytes), the
busybox image built here as a docker-save tarball (no registry) and imported into namespace
k8s.io, host-network pods with a cgroupfs parent /kubepods/besteffort/pod<uid>, kubelet's labels
set by hand (containerd only returns the labels it was given). `stop()` kills containerd and
leaves the pods running (their shims live on); `start()` on the same root recovers them.
Teardown: sandboxes stopped and removed through CRI, containerd killed, the pod cgroups removed
depth-first (containerd never removes them: that is the kubelet's job), the temp dir removed.
More images on the busybox layer (tests/helpers/containerd_image.py ImageVariant) are imported on
demand (`import_variant`); a container's stdout is read back from its CRI log (`log_lines`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from ghostgpu.k8s import cri_runtime_v1_pb2 as cri
from ghostgpu.k8s import cri_runtime_v1_pb2_grpc as cri_grpc
from tests.helpers.container import cgroup_registry, parse_cgroup_mounts
from tests.helpers.containerd_image import BUSYBOX_IMAGE, PAUSE_IMAGE, ImageVariant, write_image_tar

BINARIES = ("containerd", "containerd-shim-runc-v2", "ctr", "runc")
QOS_PARENT = "/kubepods/besteffort"
START_TIMEOUT_S = 20.0
CALL_TIMEOUT_S = 30.0  # RunPodSandbox on a loaded 2-core VM can take seconds
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def missing() -> str | None:
    """One line naming what this host lacks to run containerd for tests, None when all is there."""
    if os.geteuid() != 0:
        return "needs root to run containerd (CRI tests); run as root or via scripts/bootstrap.sh test"
    absent = [b for b in BINARIES if not shutil.which(b, path=_PATH)]
    if absent or not os.path.exists("/bin/busybox"):
        names = ", ".join(absent + ([] if os.path.exists("/bin/busybox") else ["/bin/busybox"]))
        return (f"{names} not installed: apt-get install -y --no-install-recommends containerd runc "
                "busybox-static (scripts/bootstrap.sh install)")
    return None


def _config(w: str) -> str:
    return f"""version = 2
root = "{w}/root"
state = "{w}/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs"]

[grpc]
  address = "{w}/containerd.sock"

[ttrpc]
  address = "{w}/containerd.sock.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "{w}/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  disable_tcp_service = true
  # This VM lacks CAP_SYS_RESOURCE: without it every RunPodSandbox fails in runc create.
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true

  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{w}/cni/bin"
    conf_dir = "{w}/cni/conf"

  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"

    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        # The systemd driver fails here ("systemd not running on this host").
        SystemdCgroup = false
        Root = "{w}/runc"
"""


@dataclass(frozen=True)
class Pod:
    id: str  # sandbox ID
    name: str
    namespace: str
    uid: str
    config: cri.PodSandboxConfig

    @property
    def cgroup_parent(self) -> str:
        return f"{QOS_PARENT}/pod{self.uid}"


def kubelet_labels(name: str, namespace: str, uid: str, container: str | None = None) -> dict[str, str]:
    labels = {"io.kubernetes.pod.name": name, "io.kubernetes.pod.namespace": namespace,
              "io.kubernetes.pod.uid": uid}
    if container is not None:
        labels["io.kubernetes.container.name"] = container
    return labels


class Containerd:
    """One containerd serving CRI on `endpoint` (unix:///tmp/gg-ctd-XXXX/containerd.sock)."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="gg-ctd-", dir="/tmp")
        self.socket = os.path.join(self.dir, "containerd.sock")
        self.endpoint = "unix://" + self.socket
        self.config_path = os.path.join(self.dir, "config.toml")
        self.log_path = os.path.join(self.dir, "containerd.log")
        self.proc: subprocess.Popen[bytes] | None = None
        self.pod_uids: set[str] = set()
        self._channel: grpc.Channel | None = None
        self._stub: cri_grpc.RuntimeServiceStub | None = None
        self._imported = False
        self._variants: set[ImageVariant] = set()
        for sub in ("cni/bin", "cni/conf", "logs"):
            os.makedirs(os.path.join(self.dir, sub), exist_ok=True)
        Path(self.config_path).write_text(_config(self.dir))

    # ---- lifecycle ------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.running and self.proc is not None else None

    def start(self, timeout_s: float = START_TIMEOUT_S) -> Containerd:
        """Start containerd (again, on the same root) and wait until CRI answers Version."""
        if self.running:
            return self
        with open(self.log_path, "ab") as log:
            # Its own session (setsid), as the recipe says: a test's terminal signals never reach it.
            self.proc = subprocess.Popen(
                ["containerd", "--config", self.config_path], stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "PATH": _PATH})
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.runtime.Version(cri.VersionRequest(version="v1"), timeout=1.0)
                break
            except grpc.RpcError as e:
                if not self.running:
                    raise RuntimeError(f"containerd exited at start: {self.log_tail()}") from e
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"containerd did not answer CRI in {timeout_s} s: {self.log_tail()}") from e
                time.sleep(0.02)  # polling interval while containerd loads its plugins
        if not self._imported:
            self.import_images()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Kill containerd; its pods' shims and containers keep running (a runtime restart)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def import_images(self) -> None:
        tar = os.path.join(self.dir, "images.tar")
        write_image_tar(tar, _goarch())
        out = subprocess.run(
            ["ctr", "--address", self.socket, "-n", "k8s.io", "images", "import", tar],
            capture_output=True, text=True, timeout=60, env={**os.environ, "PATH": _PATH})
        if out.returncode != 0:
            raise RuntimeError(f"ctr images import {tar} failed: {out.stderr.strip() or out.stdout.strip()}")
        self._imported = True

    def import_variant(self, variant: ImageVariant) -> str:
        """Import an image on the busybox layer (once per containerd root); its tag, for create_container."""
        if variant in self._variants:
            return variant.tag
        tar = os.path.join(self.dir, f"image-{len(self._variants)}.tar")
        write_image_tar(tar, _goarch(), variants=[variant], base=False)
        out = subprocess.run(
            ["ctr", "--address", self.socket, "-n", "k8s.io", "images", "import", tar],
            capture_output=True, text=True, timeout=60, env={**os.environ, "PATH": _PATH})
        os.unlink(tar)
        if out.returncode != 0:
            raise RuntimeError(f"ctr images import {variant.tag} failed: "
                               f"{out.stderr.strip() or out.stdout.strip()}")
        self._variants.add(variant)
        return variant.tag

    def log_tail(self, lines: int = 20) -> str:
        try:
            return " | ".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"(no log: {e})"

    @property
    def runtime(self) -> cri_grpc.RuntimeServiceStub:
        if self._stub is None:
            self._channel = grpc.insecure_channel(self.endpoint, options=[
                ("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                ("grpc.max_reconnect_backoff_ms", 500)])
            self._stub = cri_grpc.RuntimeServiceStub(self._channel)
        return self._stub

    # ---- pods and containers ----------------------------------------------------------------

    def run_pod(self, name: str, namespace: str = "default", uid: str | None = None) -> Pod:
        """RunPodSandbox: host network, own PID namespace, cgroup /kubepods/besteffort/pod<uid>."""
        uid = uid or str(uuid.uuid4())
        log_dir = os.path.join(self.dir, "logs", uid)
        os.makedirs(log_dir, exist_ok=True)
        config = cri.PodSandboxConfig(
            metadata=cri.PodSandboxMetadata(name=name, uid=uid, namespace=namespace, attempt=0),
            log_directory=log_dir,  # no hostname: a host-network pod has no UTS namespace of its own
            labels=kubelet_labels(name, namespace, uid),
            linux=cri.LinuxPodSandboxConfig(
                # Not a ".slice" parent: with the cgroupfs driver containerd would then emit
                # systemd-style "x.slice:cri-containerd:<id>" names runc makes into odd directories.
                cgroup_parent=f"{QOS_PARENT}/pod{uid}",
                security_context=cri.LinuxSandboxSecurityContext(namespace_options=cri.NamespaceOption(
                    network=cri.NODE, pid=cri.CONTAINER, ipc=cri.POD))))
        self.pod_uids.add(uid)
        resp = self.runtime.RunPodSandbox(cri.RunPodSandboxRequest(config=config), timeout=CALL_TIMEOUT_S)
        return Pod(resp.pod_sandbox_id, name, namespace, uid, config)

    def create_container(self, pod: Pod, name: str, command: list[str],
                         devices: Sequence[tuple[str, str]] = (),
                         labels: dict[str, str] | None = None, start: bool = True,
                         image: str = BUSYBOX_IMAGE) -> str:
        """CreateContainer (+ StartContainer) in `pod`; devices are (host path, container path)."""
        config = cri.ContainerConfig(
            metadata=cri.ContainerMetadata(name=name, attempt=0), image=cri.ImageSpec(image=image),
            command=command, log_path=f"{name}.log",
            devices=[cri.Device(host_path=h, container_path=c, permissions="rwm") for h, c in devices],
            labels={**kubelet_labels(pod.name, pod.namespace, pod.uid, name), **(labels or {})})
        resp = self.runtime.CreateContainer(
            cri.CreateContainerRequest(pod_sandbox_id=pod.id, config=config, sandbox_config=pod.config),
            timeout=CALL_TIMEOUT_S)
        if start:
            self.runtime.StartContainer(cri.StartContainerRequest(container_id=resp.container_id),
                                        timeout=CALL_TIMEOUT_S)
        return resp.container_id

    def container_info(self, container_id: str) -> dict[str, Any]:
        """containerd's verbose ContainerStatus info JSON (pid, sandboxID, runtimeSpec, ...)."""
        resp = self.runtime.ContainerStatus(
            cri.ContainerStatusRequest(container_id=container_id, verbose=True), timeout=CALL_TIMEOUT_S)
        return json.loads(resp.info["info"])

    def container_host_pid(self, container_id: str) -> int:
        return int(self.container_info(container_id)["pid"])

    def container_status(self, container_id: str) -> cri.ContainerStatus:
        req = cri.ContainerStatusRequest(container_id=container_id)
        return self.runtime.ContainerStatus(req, timeout=CALL_TIMEOUT_S).status

    def log_lines(self, container_id: str, stream: str = "stdout") -> list[str]:
        """What the container wrote on `stream` so far, line by line, from its CRI log file
        (`TIMESTAMP STREAM P|F TEXT` lines; P: a partial line continued on the next one)."""
        path = self.container_status(container_id).log_path
        try:
            raw = Path(path).read_text(errors="replace")
        except FileNotFoundError:
            return []
        out: list[str] = []
        partial = ""
        for entry in raw.splitlines():
            parts = entry.split(" ", 3)
            if len(parts) < 3 or parts[1] != stream:
                continue
            text = parts[3] if len(parts) == 4 else ""
            if parts[2] == "P":
                partial += text
            else:
                out.append(partial + text)
                partial = ""
        return out

    def stop_pod(self, pod_id: str) -> None:
        self.runtime.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod_id), timeout=CALL_TIMEOUT_S)

    def remove_pod(self, pod_id: str) -> None:
        self.stop_pod(pod_id)
        self.runtime.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=pod_id),
                                      timeout=CALL_TIMEOUT_S)

    # ---- teardown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Teardown in the recipe's order; every step runs even if an earlier one failed."""
        errors: list[str] = []
        try:
            self.start()  # a test may have left it stopped: the pods can only be removed through CRI
            for sb in self.runtime.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=CALL_TIMEOUT_S).items:
                self.pod_uids.add(sb.metadata.uid)
                try:
                    self.remove_pod(sb.id)
                except grpc.RpcError as e:
                    errors.append(f"removing sandbox {sb.id[:12]}: {e.code().name} {e.details()}")
        except (grpc.RpcError, RuntimeError) as e:
            errors.append(f"listing sandboxes: {e}")
        if self._channel is not None:
            self._channel.close()
            self._channel = self._stub = None
        self.stop()
        errors += remove_pod_cgroups(self.pod_uids)
        shutil.rmtree(self.dir, ignore_errors=True)
        if errors:
            raise RuntimeError("containerd teardown: " + "; ".join(errors))

    def __enter__(self) -> Containerd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _goarch() -> str:
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def rmdir_cgroup(path: str, deadline: float) -> str | None:
    """rmdir a cgroup, waiting out EBUSY while the last tasks leave; an error line, or None."""
    while True:
        try:
            os.rmdir(path)
            return None
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                return f"cannot remove cgroup {path}: {e}"
            time.sleep(0.005)  # polling interval while the kernel finishes the exits


def remove_pod_cgroups(pod_uids: set[str], timeout_s: float = 10.0) -> list[str]:
    """Remove kubepods/besteffort/pod<uid> depth-first in every hierarchy, then the shared levels
    if empty and no fake container (tests/helpers/container.py) registered them: those are its."""
    with open("/proc/self/mountinfo") as f:
        mounts = parse_cgroup_mounts(f.read())
    deadline = time.monotonic() + timeout_s
    errors: list[str] = []
    with cgroup_registry() as registered:  # the fake containers' lock: no mkdir races our rmdir
        for mount in mounts:
            qos = mount.mountpoint + QOS_PARENT
            for uid in sorted(pod_uids):
                top = os.path.join(qos, f"pod{uid}")
                if not os.path.isdir(top):
                    continue
                for directory, _subdirs, _files in os.walk(top, topdown=False):
                    if (err := rmdir_cgroup(directory, deadline)) is not None:
                        errors.append(err)
            for shared in (qos, os.path.dirname(qos)):
                if shared in registered or not os.path.isdir(shared):
                    continue
                with contextlib.suppress(OSError):  # ENOTEMPTY/EBUSY: someone else's pods are in it
                    os.rmdir(shared)
    return errors

