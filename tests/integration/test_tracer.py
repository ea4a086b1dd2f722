"""The real tracer (`ghostgpu tracer`, BPF + /proc + fake NVML) against planted consumers.

Each test plants a consumer in a fake container (own PID and mount namespaces, private /dev with
real character device nodes, kubepods cgroup path in every hierarchy) or on the host, and asserts
the exact class and identity the tracer reports.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.tracer.procfs import parse_stat

from tests.helpers.container import FakeContainer
from tests.helpers.fakenvml import FakeGpu, FakeNvml, FakeProc
from tests.helpers.polling import wait_until
from tests.helpers.tracer_proc import TracerProcess
from tests.helpers.workload import build_gpuwork, run_host
from tests.integration.conftest import GPU0_UUID, GPU1_UUID

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.usefixtures("root_bpf")]

FAST = ["--grace-s", "0.5"]
# An allocation of a compute class on the first fd: what makes a holder a GPU job rather than a
# `monitor`, which only reads the GPU's state (tracer/gpu_work.py).
ALLOC = ["rmalloc", "0", "alloc64", "0xcbc0"]


def finding(pid: int, cls: str | None = None):
    def pred(r: dict[str, Any]) -> bool:
        return r.get("event") == "finding" and r.get("pid") == pid and (cls is None or r.get("class") == cls)

    return pred


def event(kind: str, **match: Any):
    def pred(r: dict[str, Any]) -> bool:
        return r.get("event") == kind and all(r.get(k) == v for k, v in match.items())

    return pred


def assert_identity(rec: dict[str, Any], c: FakeContainer, host_pid: int, ns_pid: int) -> None:
    assert rec["pid"] == host_pid
    assert rec["ns_pid"] == ns_pid
    assert rec["container_id"] == c.container_id
    assert rec["pod_uid"] == c.pod_uid
    assert rec["runtime"] == "containerd"
    assert rec["comm"] == "gpuwork"
    assert rec["node"] == "test-node"


def test_hidden_consumer_in_a_container(tmp_path: Path, fake_nvml: FakeNvml) -> None:
    with TracerProcess(tmp_path, FAST, fake_nvml.env()) as tracer, FakeContainer() as c:
        tracer.wait_ready()
        p = c.run(["open", "/dev/nvidiactl", "open", "/dev/nvidia0", *ALLOC, "ready", "wait"])
        p.wait_ready()
        opened = tracer.wait_for(event("open", pid=p.host_pid, device="/dev/nvidia0"), what="open event")
        assert opened["source"] == "bpf"
        assert_identity(opened, c, p.host_pid, 1)
        rec = tracer.wait_for(finding(p.host_pid, "hidden"), what="hidden finding")
        assert_identity(rec, c, p.host_pid, 1)
        assert rec["gpu"] == 0 and rec["gpu_uuid"] == GPU0_UUID
        assert set(rec["devices"]) == {"/dev/nvidia0", "/dev/nvidiactl"}
        assert "NVML" in rec["reason"]
        p.release()
        tracer.wait_for(event("exit", pid=p.host_pid), what="exit event")
        tracer.wait_for(event("resolved", pid=p.host_pid), what="resolved finding")


def test_container_pid_is_translated_to_the_host_pid(tmp_path: Path, fake_nvml: FakeNvml) -> None:
    with TracerProcess(tmp_path, FAST, fake_nvml.env()) as tracer, FakeContainer() as c:
        tracer.wait_ready()
        # The init forks; the child (PID 2 in the container) opens the GPU.
        p = c.run(["fork", "open", "/dev/nvidia0", *ALLOC, "ready", "wait"])
        ready = p.wait_ready()
        assert ready.pid == 2
        assert p.host_pid != 2
        rec = tracer.wait_for(finding(p.host_pid, "hidden"), what="hidden finding of the forked child")
        assert_identity(rec, c, p.host_pid, 2)


def test_ghost_pid_listed_by_nvml(tmp_path: Path, fake_nvml: FakeNvml) -> None:
    ghost_pid = next(pid for pid in range(4_000_000, 4_100_000) if not os.path.exists(f"/proc/{pid}"))
    fake_nvml.update(procs=[FakeProc(gpu=0, pid=ghost_pid, used_bytes=3 << 30)])
    with TracerProcess(tmp_path, FAST, fake_nvml.env()) as tracer:
        rec = tracer.wait_for(finding(ghost_pid, "ghost"), what="ghost finding")
        assert rec["gpu"] == 0 and rec["gpu_uuid"] == GPU0_UUID
        assert rec["gpu_memory_bytes"] == 3 << 30
        assert "does not exist" in rec["reason"] or "no such process" in rec["reason"]


def test_zombie_leader_holding_through_threads(tmp_path: Path, fake_nvml: FakeNvml) -> None:
    with FakeContainer() as c:
        p = c.run(["open", "/dev/nvidia0", "ready", "thread-hold"])
        p.wait_ready()
        host_pid = p.host_pid
        wait_until(lambda: proc_state(host_pid) == "Z", "leader to become a zombie")
        with TracerProcess(tmp_path, FAST, fake_nvml.env()) as tracer:
            rec = tracer.wait_for(finding(host_pid, "orphaned"), what="orphaned zombie leader")
            assert_identity(rec, c, host_pid, 1)
            assert "zombie" in rec["reason"]
            assert rec["devices"] == ["/dev/nvidia0"]


def test_process_reparented_after_its_shim_died(tmp_path: Path, fake_nvml: FakeNvml) -> None:
    with TracerProcess(tmp_path, [*FAST, "--scan-interval-s", "0.5"], fake_nvml.env()) as tracer, \
            FakeContainer() as c:
        tracer.wait_ready()
        p = c.run(["open", "/dev/nvidia0", *ALLOC, "ready", "wait"])
        p.wait_ready()
        host_pid = p.host_pid
        tracer.wait_for(finding(host_pid, "hidden"), what="hidden before the shim dies")
        p.kill_shim()
        rec = tracer.wait_for(finding(host_pid, "orphaned"), what="orphaned after the shim died")
        assert_identity(rec, c, host_pid, 1)
        assert "reparent" in rec["reason"]


def test_mapped_then_closed_still_holds(tmp_path: Path, fake_nvml: FakeNvml) -> None:
    devices = {"nvidia0": (1, 5), "nvidiactl": (1, 3)}
    with TracerProcess(tmp_path, FAST, fake_nvml.env()) as tracer, FakeContainer(devices=devices) as c:
        tracer.wait_ready()
        p = c.run(["open", "/dev/nvidia0", "mmap", "0", "close", "0", "ready", "wait"])
        p.wait_ready()
        tracer.wait_for(event("mmap", pid=p.host_pid, device="/dev/nvidia0"), what="mmap event")
        closed = tracer.wait_for(event("close", pid=p.host_pid, device="/dev/nvidia0"), what="close event")
        assert closed.get("mapped") is True
        rec = tracer.wait_for(finding(p.host_pid, "hidden"), what="hidden through the mapping")
        assert rec["mapped"] is True and rec["fds"] == []
    # The same hold found by a /proc scan alone (no open was seen).
    with FakeContainer(devices=devices) as c:
        p = c.run(["open", "/dev/nvidia0", "mmap", "0", "close", "0", "ready", "wait"])
        p.wait_ready()
        (tmp_path / "scan").mkdir()
        with TracerProcess(tmp_path / "scan", FAST, fake_nvml.env()) as tracer:
            rec = tracer.wait_for(finding(p.host_pid, "hidden"), what="hidden mapping found by the scan")
            assert rec["mapped"] is True and rec["devices"] == ["/dev/nvidia0"]


def test_holder_from_before_the_tracer_started(tmp_path: Path, fake_nvml: FakeNvml) -> None:
    with FakeContainer() as c:
        p = c.run(["open", "/dev/nvidia0", "ready", "wait", "ioctl", "0", "0xc020462a", "4", "close", "0",
                   "wait"])
        p.wait_ready()
        with TracerProcess(tmp_path, FAST, fake_nvml.env()) as tracer:
            opened = tracer.wait_for(event("open", pid=p.host_pid), what="open found by the first scan")
            assert opened["source"] == "procfs"
            rec = tracer.wait_for(finding(p.host_pid, "hidden"), what="hidden")
            assert_identity(rec, c, p.host_pid, 1)
            # The scan seeded the kernel table: later ioctls are counted and the close is traced.
            p.release()
            closed = tracer.wait_for(event("close", pid=p.host_pid, source="bpf"), what="traced close")
            assert counts(closed) == {"0xc020462a": 4}


def test_fork_child_inherits_the_fd(tmp_path: Path, fake_nvml: FakeNvml) -> None:
    with TracerProcess(tmp_path, FAST, fake_nvml.env()) as tracer, FakeContainer() as c:
        tracer.wait_ready()
        p = c.run(["open", "/dev/nvidia0", *ALLOC, "fork", "ready", "wait"])
        p.wait_ready()
        child = p.host_pid
        parent = p.init_pid
        forked = tracer.wait_for(event("fork", pid=parent), what="fork event")
        assert forked["child_pid"] == child
        rec = tracer.wait_for(finding(child, "hidden"), what="hidden child")
        assert_identity(rec, c, child, 2)
        assert rec["devices"] == ["/dev/nvidia0"]


def test_exec_keeps_an_inherited_hold(tmp_path: Path, fake_nvml: FakeNvml) -> None:
    with TracerProcess(tmp_path, FAST, fake_nvml.env()) as tracer, FakeContainer() as c:
        tracer.wait_ready()
        p = c.run(["open", "/dev/nvidia0", *ALLOC, "ready", "wait", "exec", "ready", "wait"])
        p.wait_ready()
        host_pid = p.host_pid
        tracer.wait_for(finding(host_pid, "hidden"), what="hidden before exec")
        p.release()
        p.wait_ready()  # the new image
        tracer.wait_for(event("exec", pid=host_pid), what="exec event")
        p.release()
        exited = tracer.wait_for(event("exit", pid=host_pid), what="exit after exec")
        # The fd survived exec (no O_CLOEXEC): no close in between, the kernel was re-seeded and
        # still saw the exit, with the identity of the holder.
        assert exited["source"] == "bpf"
        assert tracer.matching(event("close", pid=host_pid)) == []
        assert_identity(exited, c, host_pid, 1)
        assert exited["devices"] == ["/dev/nvidia0"]


def test_a_holder_that_renames_itself_is_shown_by_its_new_name(tmp_path: Path, fake_nvml: FakeNvml) -> None:
    # busybox runs an applet by exec'ing /proc/self/exe (comm "exe") and then names itself; the
    # periodic scan is far away here, so only the kernel's task_rename can carry the new name.
    args = [*FAST, "--scan-interval-s", "3600"]
    with TracerProcess(tmp_path, args, fake_nvml.env()) as tracer, FakeContainer() as c:
        tracer.wait_ready()
        p = c.run(["open", "/dev/nvidia0", *ALLOC, "ready", "wait", "rename", "trainer", "ready", "wait"])
        p.wait_ready()
        host_pid = p.host_pid
        tracer.wait_for(finding(host_pid, "hidden"), what="hidden under its first name")
        p.release()
        p.wait_ready()
        renamed = tracer.wait_for(lambda r: finding(host_pid, "hidden")(r) and r.get("comm") == "trainer",
                                  what="the finding under its new name")
        assert renamed["ns_pid"] == 1
        p.release()


def test_fd_passed_over_a_unix_socket(tmp_path: Path, fake_nvml: FakeNvml) -> None:
    sock = str(tmp_path / "pass.sock")
    args = [*FAST, "--scan-interval-s", "0.5"]
    with TracerProcess(tmp_path, args, fake_nvml.env()) as tracer, FakeContainer() as a, \
            FakeContainer() as b:
        tracer.wait_ready()
        receiver = b.run(["recvfd", sock, "ready", "wait"])
        wait_until(lambda: os.path.exists(sock), "the receiver's socket")
        sender = a.run(["open", "/dev/nvidia0", "sendfd", sock, "0", "ready", "wait"])
        sender.wait_ready()
        receiver.wait_ready()
        # The receiver never opened anything: only the /proc scan can find it.
        rec = tracer.wait_for(finding(receiver.host_pid, "hidden"), what="receiver found by the scan")
        assert rec["container_id"] == b.container_id
        assert rec["devices"] == ["/dev/nvidia0"]
        tracer.wait_for(event("close", pid=sender.host_pid), what="sender's close")


def test_short_lived_consumer_is_caught_with_its_container(tmp_path: Path, fake_nvml: FakeNvml) -> None:
    with TracerProcess(tmp_path, FAST, fake_nvml.env()) as tracer, FakeContainer() as c:
        tracer.wait_ready()
        p = c.run(["open", "/dev/nvidia0", "sleep", "20", "exit", "0"])
        host_pid = p.init_pid
        assert p.wait_exit(5.0) == 0
        opened = tracer.wait_for(event("open", pid=host_pid), what="open of the short-lived consumer")
        exited = tracer.wait_for(event("exit", pid=host_pid), what="exit of the short-lived consumer")
        for rec in (opened, exited):
            assert rec["container_id"] == c.container_id
            assert rec["pod_uid"] == c.pod_uid
            assert rec["device" if rec is opened else "devices"] in ("/dev/nvidia0", ["/dev/nvidia0"])
        assert exited["comm"] == "gpuwork"
        assert 0.015 <= exited["held_s"] < 5


def test_ioctl_counts_per_request(tmp_path: Path, fake_nvml: FakeNvml) -> None:
    with TracerProcess(tmp_path, FAST, fake_nvml.env()) as tracer, FakeContainer() as c:
        tracer.wait_ready()
        p = c.run(["open", "/dev/nvidia0", "ioctl", "0", "0xc020462a", "7", "ioctl", "0", "0xc00846d6", "3",
                   "ioctl", "0", "0xc01046d3", "1", "close", "0", "ready", "wait"])
        p.wait_ready()
        closed = tracer.wait_for(event("close", pid=p.host_pid), what="close with ioctl counts")
        assert counts(closed) == {"0xc020462a": 7, "0xc00846d6": 3, "0xc01046d3": 1}
        names = {r["cmd"]: r["name"] for r in closed["ioctls"]}
        assert names["0xc020462a"].startswith("NV_ESC_RM_CONTROL")
        assert names["0xc00846d6"].startswith("NV_ESC_SYS_PARAMS")


def test_visible_consumer_is_not_flagged(tmp_path: Path, fake_nvml: FakeNvml) -> None:
    with FakeContainer() as c:
        p = c.run(["open", "/dev/nvidia0", "ready", "wait"])
        p.wait_ready()
        fake_nvml.update(procs=[FakeProc(gpu=0, pid=p.host_pid, used_bytes=1 << 30)])
        with TracerProcess(tmp_path, FAST, fake_nvml.env()) as tracer:
            rec = tracer.wait_for(finding(p.host_pid, "visible"), what="visible finding")
            assert rec["gpu_memory_bytes"] == 1 << 30
            assert_identity(rec, c, p.host_pid, 1)
            p.release()
            tracer.wait_for(event("exit", pid=p.host_pid), what="exit")
            flagged = tracer.matching(lambda r: r.get("pid") == p.host_pid and r.get("class") == "hidden")
            assert flagged == []


def test_allowlisted_daemon_is_system_and_host_holder_unattributed(tmp_path: Path, fake_nvml: FakeNvml,
                                                                   request: pytest.FixtureRequest) -> None:
    # Host processes need a device node in the host's /dev: minor 200 is far above any GPU a test
    # machine has, and the fake driver is told it is GPU 1.
    node = "/dev/nvidia200"
    if os.path.exists(node):
        pytest.skip(f"{node} exists on this host; refusing to touch it")
    os.mknod(node, 0o20666, os.makedev(1, 3))
    request.addfinalizer(lambda: os.unlink(node))
    fake_nvml.update(gpus=[*fake_nvml.gpus, FakeGpu(index=1, uuid=GPU1_UUID, minor=200)])
    daemon = tmp_path / "nvidia-persistenced"
    shutil.copy(build_gpuwork(), daemon)
    with TracerProcess(tmp_path, FAST, fake_nvml.env()) as tracer:
        tracer.wait_ready()
        with run_host(["open", node, "ready", "wait"], executable=str(daemon)) as d, \
                run_host(["open", node, *ALLOC, "ready", "wait"]) as h:
            d.wait_ready()
            h.wait_ready()
            sysrec = tracer.wait_for(finding(d.pid, "system"), what="system daemon")
            assert sysrec["comm"] == "nvidia-persiste"  # the kernel keeps 15 characters
            hostrec = tracer.wait_for(finding(h.pid, "unattributed"), what="unattributed host holder")
            assert hostrec["container_id"] == "" and hostrec["gpu"] == 1
            assert hostrec["gpu_uuid"] == GPU1_UUID


def chroot_dev(request: pytest.FixtureRequest) -> Path:
    """<dir>/dev with nvidia0 and nvidiactl (c 1 3): what /proc/PID/fd shows from the host for a holder
    in a chroot at <dir> whose /dev the host cannot reach. A short <dir> under /tmp, so that the
    --device-prefix the hint suggests fits the kernel matcher's 40 bytes."""
    root = Path(tempfile.mkdtemp(prefix="gg-ch-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
    (root / "dev").mkdir()
    for name in ("nvidia0", "nvidiactl"):
        os.mknod(root / "dev" / name, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    return root / "dev"


def test_a_gpu_device_outside_the_prefixes_is_named_with_what_to_do(tmp_path: Path, fake_nvml: FakeNvml,
                                                                    request: pytest.FixtureRequest) -> None:
    """Not a hold (the prefixes say what is watched), but one notice and one stderr line naming the path,
    its holder and the fix; once per prefix it suggests, whatever the scans and devices."""
    dev, other = chroot_dev(request), chroot_dev(request)
    notices = event("notice", what="device_prefix")
    # Every rescan is a full one: each reads the first holder again.
    fast_scans = {**fake_nvml.env(), "GHOSTGPU_FULL_SCAN_INTERVAL_S": "0.2"}
    with run_host(["open", f"{dev}/nvidia0", "open", f"{dev}/nvidiactl", "ready", "wait"]) as h:
        h.wait_ready()
        with TracerProcess(tmp_path, [*FAST, "--scan-interval-s", "0.2"], fast_scans) as tracer:
            rec = tracer.wait_for(notices, what="the hint from the first scan")
            assert rec["message"] == (
                f"{dev}/nvidia0 (held by pid {h.pid}) looks like a GPU device outside the device prefixes "
                f"(/dev/nvidia): run the tracer on the host, not in a chroot or another mount namespace, or "
                f"watch it there too with --device-prefix /dev/nvidia --device-prefix {dev}/nvidia")
            wait_until(lambda: f"device_prefix: {rec['message']}" in tracer.stderr(), "the stderr line")
            with run_host(["open", f"{other}/nvidia0", "ready", "wait"]) as h2:
                h2.wait_ready()
                tracer.wait_for(lambda r: notices(r) and r["message"].startswith(f"{other}/nvidia0 (held by "
                                                                                  f"pid {h2.pid})"),
                                what="the hint for a second chroot, from a later scan")
            assert [r["message"].split(" ")[0] for r in tracer.matching(notices)] == [f"{dev}/nvidia0",
                                                                                      f"{other}/nvidia0"]
            assert tracer.matching(lambda r: r.get("pid") == h.pid) == []  # never a holder


def counts(rec: dict[str, Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for row in rec.get("ioctls", []):
        out[row["cmd"]] = out.get(row["cmd"], 0) + row["count"]
    return out


def proc_state(pid: int) -> str:
    try:
        stat = parse_stat(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return ""
    return stat.state if stat else ""


SNAPSHOT_KEYS = {"node", "pid", "ns_pid", "comm", "gpu", "devices", "container_id", "pod_uid", "runtime",
                 "class", "reason", "gpu_memory_bytes"}


def test_snapshot_json_lists_hidden_and_ghost(tmp_path: Path, fake_nvml: FakeNvml) -> None:
    ghost_pid = next(pid for pid in range(4_000_000, 4_100_000) if not os.path.exists(f"/proc/{pid}"))
    fake_nvml.update(procs=[FakeProc(gpu=0, pid=ghost_pid, used_bytes=2 << 30)])
    with FakeContainer() as c:
        p = c.run(["open", "/dev/nvidiactl", "open", "/dev/nvidia0", "ready", "wait"])
        p.wait_ready()
        out = subprocess.run(
            [sys.executable, "-m", "ghostgpu.cli", "snapshot", "-o", "json", "--node-name", "snap-node",
             "--grace-s", "0"],
            env={**os.environ, **fake_nvml.env()}, capture_output=True, text=True, timeout=60, check=True)
        rows = {r["pid"]: r for r in json.loads(out.stdout)}
        hidden, ghost = rows[p.host_pid], rows[ghost_pid]
        for row in (hidden, ghost):
            assert set(row) >= SNAPSHOT_KEYS
            assert row["node"] == "snap-node" and row["gpu"] == 0
        assert hidden["class"] == "hidden" and hidden["ns_pid"] == 1
        assert (hidden["container_id"], hidden["pod_uid"], hidden["runtime"]) == (
            c.container_id, c.pod_uid, "containerd")
        assert sorted(hidden["devices"]) == ["/dev/nvidia0", "/dev/nvidiactl"]
        assert ghost["class"] == "ghost" and ghost["gpu_memory_bytes"] == 2 << 30
