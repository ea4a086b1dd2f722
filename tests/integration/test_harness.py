"""The fake container harness is what it claims: kubepods cgroups in every hierarchy, own PID and
mount namespaces, private device nodes, reparenting, zombie leaders, fd passing, clean teardown.

The pure parts (cgroup naming, mountinfo parsing, ready lines) run anywhere; the rest needs root.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import require_root
from tests.helpers.container import (
    CgroupMount,
    FakeContainer,
    HarnessError,
    ancestors,
    cgroup_registry,
    kube_cgroup_path,
    parse_cgroup_mounts,
)
from tests.helpers.polling import poll
from tests.helpers.workload import ReadyLine, build_gpuwork, run_host

CID = "08954b9e07782ae3f5feb9b36f9f82f4abeafaf11b6a012dcc30ed18759224cf"
UID = "1441bc39-919a-4962-bb72-ea854cbd68ff"
POD_SYSTEMD = "kubepods-burstable-pod1441bc39_919a_4962_bb72_ea854cbd68ff.slice"
ENODEV = 19




def status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return {k: v.strip() for k, _, v in (line.partition(":") for line in f)}


# --- pure parts -------------------------------------------------------------------------------


# Same shapes as vectors T01, T02, T07, T11 (systemd) and T03, T10 (cgroupfs) of
# tests/data/cgroup_vectors.json (docs/reference/cgroup-paths.md), with one container id and pod uid.
@pytest.mark.parametrize(
    ("runtime", "qos", "driver", "expected"),
    [
        (
            "containerd",
            "burstable",
            "systemd",
            f"/kubepods.slice/kubepods-burstable.slice/{POD_SYSTEMD}/cri-containerd-{CID}.scope",
        ),
        (
            "containerd",
            "guaranteed",
            "systemd",
            f"/kubepods.slice/kubepods-pod1441bc39_919a_4962_bb72_ea854cbd68ff.slice/cri-containerd-{CID}.scope",
        ),
        (
            "crio",
            "besteffort",
            "systemd",
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1441bc39_919a_4962_bb72_ea854cbd68ff"
            f".slice/crio-{CID}.scope",
        ),
        (
            "docker",
            "burstable",
            "systemd",
            f"/kubepods.slice/kubepods-burstable.slice/{POD_SYSTEMD}/docker-{CID}.scope",
        ),
        ("containerd", "burstable", "cgroupfs", f"/kubepods/burstable/pod{UID}/{CID}"),
        ("docker", "guaranteed", "cgroupfs", f"/kubepods/pod{UID}/{CID}"),
        ("crio", "besteffort", "cgroupfs", f"/kubepods/besteffort/pod{UID}/crio-{CID}"),
    ],
)
def test_kube_cgroup_path(runtime: str, qos: str, driver: str, expected: str) -> None:
    assert kube_cgroup_path(runtime, qos, driver, CID, UID) == expected


@pytest.mark.parametrize(
    "bad", [("rkt", "burstable", "systemd"), ("crio", "gold", "systemd"), ("crio", "burstable", "x")]
)
def test_kube_cgroup_path_rejects_unknown(bad: tuple[str, str, str]) -> None:
    with pytest.raises(ValueError):
        kube_cgroup_path(*bad, CID, UID)


HYBRID = """\
25 30 0:23 / /sys rw,nosuid - sysfs sysfs rw
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate
"""


@pytest.mark.parametrize(
    ("mountinfo", "expected"),
    [
        (
            HYBRID,
            [
                ("/sys/fs/cgroup/cpu", 1, ("cpu",)),
                ("/sys/fs/cgroup/cpuset", 1, ("cpuset",)),
                ("/sys/fs/cgroup/systemd", 1, ("name=systemd",)),
                ("/sys/fs/cgroup/unified", 2, ()),
            ],
        ),
        (
            "29 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n",
            [("/sys/fs/cgroup", 2, ())],
        ),
        # the same hierarchy bind-mounted twice is one hierarchy
        (
            "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
            "33 31 0:29 / /mnt/cpu rw - cgroup cgroup rw,cpu,cpuacct\n",
            [("/sys/fs/cgroup/cpu,cpuacct", 1, ("cpu", "cpuacct"))],
        ),
        # a sub-tree mount (cgroup namespace bind) cannot host kubepods paths
        ("50 31 0:38 /kubepods.slice /host/cg rw - cgroup2 cgroup2 rw\n", []),
        (r"60 31 0:40 / /mnt/cg\040two rw - cgroup2 cgroup2 rw" + "\n", [("/mnt/cg two", 2, ())]),
        ("garbage\n\n61 31 0:41 / /x rw - cgroup\n", []),
        ("", []),
    ],
)
def test_parse_cgroup_mounts(mountinfo: str, expected: list[tuple[str, int, tuple[str, ...]]]) -> None:
    assert [(m.mountpoint, m.version, m.options) for m in parse_cgroup_mounts(mountinfo)] == expected


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("ready 1 3 4 5", ReadyLine(1, (3, 4, 5))),
        ("ready 4242", ReadyLine(4242, ())),
        ("ready 7 -1 4", ReadyLine(7, (-1, 4))),
        ("step-error open 2", None),
        ("ready x", None),
        ("", None),
    ],
)
def test_ready_line_parse(line: str, expected: ReadyLine | None) -> None:
    assert ReadyLine.parse(line) == expected


# --- root parts --------------------------------------------------------------------------------


@pytest.fixture
def root() -> None:
    require_root()
    build_gpuwork()


@pytest.fixture
def container(root: None) -> Iterator[FakeContainer]:
    with FakeContainer() as c:
        yield c


@pytest.mark.root
@pytest.mark.netns
@pytest.mark.parametrize(
    ("runtime", "qos", "driver"),
    [
        ("containerd", "burstable", "systemd"),
        ("crio", "guaranteed", "systemd"),
        ("docker", "besteffort", "cgroupfs"),
        ("containerd", "guaranteed", "cgroupfs"),
    ],
)
def test_cgroup_path_on_every_line(root: None, runtime: str, qos: str, driver: str) -> None:
    with FakeContainer(runtime=runtime, qos=qos, cgroup_driver=driver) as c, c.run(["ready", "wait"]) as p:
        p.wait_ready()
        lines = Path(f"/proc/{p.host_pid}/cgroup").read_text().splitlines()
        assert len(lines) == len(c.cgroup_paths)
        assert all(line.split(":", 2)[2] == c.cgroup_path for line in lines), lines
        if any(m.version == 2 for m in c.mounts):
            assert any(line.startswith("0::/kubepods") for line in lines)
        assert c.container_id in c.cgroup_path
        assert (c.pod_uid if driver == "cgroupfs" else c.pod_uid.replace("-", "_")) in c.cgroup_path
        assert c.runtime == runtime


@pytest.mark.root
@pytest.mark.netns
def test_namespaces_comm_and_devices(container: FakeContainer) -> None:
    host_had_node = os.path.exists("/dev/nvidia0")
    with container.run(["open", "/dev/nvidia0", "open", "/dev/nvidiactl", "ready", "wait"]) as p:
        ready = p.wait_ready()
        assert ready.pid == p.ns_pid == 1
        assert status(p.host_pid)["NSpid"].split() == [str(p.host_pid), "1"]
        assert status(p.host_pid)["PPid"] == str(p.shim_pid)
        assert Path(f"/proc/{p.shim_pid}/comm").read_text().strip() == "containerd-shim"
        assert Path(f"/proc/{p.host_pid}/comm").read_text().strip() == "gpuwork"
        assert os.readlink(f"/proc/{p.host_pid}/ns/pid") != os.readlink("/proc/self/ns/pid")
        assert os.readlink(f"/proc/{p.host_pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
        for name in ("nvidia0", "nvidiactl", "nvidia-uvm"):
            st = os.stat(f"/proc/{p.host_pid}/root/dev/{name}")
            assert stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (1, 3)
        assert [os.readlink(f"/proc/{p.host_pid}/fd/{fd}") for fd in ready.fds] == [
            "/dev/nvidia0",
            "/dev/nvidiactl",
        ]
        assert os.path.exists("/dev/nvidia0") == host_had_node


@pytest.mark.root
@pytest.mark.netns
def test_custom_devices_mmap_and_shim_comm(root: None) -> None:
    devices = {"nvidia0": (1, 5), "nvidia-caps/nvidia-cap1": (1, 3)}
    zero_steps = ["open", "/dev/nvidia0", "mmap", "0", "close", "0"]  # keep only the mapping
    null_steps = ["open", "/dev/nvidia-caps/nvidia-cap1", "mmap", "1", "ready", "wait"]
    with (
        FakeContainer(devices=devices) as c,
        c.run(
            zero_steps + null_steps,
            shim_comm="conmon",
        ) as p,
    ):
        ready = p.wait_ready()
        assert ready.fds[0] == -1 and ready.fds[1] >= 0
        assert p.step_errors() == [f"step-error mmap {ENODEV}"]  # null has no mmap; zero does
        assert "/dev/nvidia0" in Path(f"/proc/{p.host_pid}/maps").read_text()  # closed fd, mapping holds it
        st = os.stat(f"/proc/{p.host_pid}/root/dev/nvidia-caps/nvidia-cap1")
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
        assert not os.path.exists(f"/proc/{p.host_pid}/root/dev/nvidiactl")
        assert Path(f"/proc/{p.shim_pid}/comm").read_text().strip() == "conmon"


@pytest.mark.root
@pytest.mark.netns
def test_kill_shim_reparents_init(container: FakeContainer) -> None:
    with container.run(["open", "/dev/nvidia0", "ready", "wait"]) as p:
        p.wait_ready()
        shim = p.shim_pid
        candidates = ancestors(shim)
        p.kill_shim()
        assert poll(lambda: status(p.host_pid)["PPid"] != str(shim))
        new_ppid = int(status(p.host_pid)["PPid"])
        reaper_comm = Path(f"/proc/{new_ppid}/comm").read_text().strip()
        print(f"\nreparented init {p.host_pid}: PPid {shim} -> {new_ppid} ({reaper_comm})")
        assert new_ppid in candidates  # the host's PID 1 or a subreaper above the shim
        assert p.host_pid in container.pids()  # still alive, still in the container
        assert os.readlink(f"/proc/{p.host_pid}/fd/{p.ready.fds[0]}") == "/dev/nvidia0"  # type: ignore[union-attr]


@pytest.mark.root
@pytest.mark.netns
def test_thread_hold_zombie_leader_in_container(container: FakeContainer) -> None:
    with container.run(["open", "/dev/nvidia0", "ready", "thread-hold"]) as p:
        p.wait_ready()
        pid = p.host_pid
        assert poll(lambda: status(pid)["State"].startswith("Z"))
        assert len(os.listdir(f"/proc/{pid}/task")) == 2
        p.release()
        assert poll(lambda: pid not in container.pids())
        assert p.wait_exit() == 0


def test_thread_hold_zombie_leader_on_host() -> None:
    with run_host(["open", "/dev/null", "ready", "thread-hold"]) as w:
        assert w.wait_ready().pid == w.pid
        assert poll(lambda: status(w.pid)["State"].startswith("Z"))
        assert len(os.listdir(f"/proc/{w.pid}/task")) == 2
        w.release()
        assert w.wait_exit() == 0


@pytest.mark.root
@pytest.mark.netns
def test_fork_in_container_resolves_child(container: FakeContainer) -> None:
    with container.run(["open", "/dev/nvidia0", "fork", "ready", "wait"]) as p:
        ready = p.wait_ready()
        assert ready.pid == p.ns_pid == 2
        assert status(p.host_pid)["NSpid"].split()[-1] == "2"
        assert status(p.host_pid)["PPid"] == str(p.init_pid)
        assert os.readlink(f"/proc/{p.host_pid}/fd/{ready.fds[0]}") == "/dev/nvidia0"


@pytest.mark.root
@pytest.mark.netns
@pytest.mark.parametrize("direction", ["container-to-host", "host-to-container"])
def test_fd_passing(container: FakeContainer, tmp_path: Path, direction: str) -> None:
    sock = str(tmp_path / "fd.sock")  # the container shares the host's filesystem outside /dev, /proc
    if direction == "container-to-host":
        receiver_cm, sender_cm = (
            run_host(["recvfd", sock, "ready", "wait"]),
            container.run(["open", "/dev/nvidia0", "sendfd", sock, "0", "ready", "wait"]),
        )
    else:
        receiver_cm, sender_cm = (
            container.run(["recvfd", sock, "ready", "wait"]),
            run_host(["open", "/dev/zero", "sendfd", sock, "0", "ready", "wait"]),
        )
    with receiver_cm as receiver, sender_cm as sender:
        assert sender.wait_ready().fds == (-1,)  # sent, then closed locally
        fd = receiver.wait_ready().fds[0]
        assert not receiver.step_errors() and not sender.step_errors()
        st = os.stat(f"/proc/{receiver.pid}/fd/{fd}")
        if direction == "container-to-host":
            assert os.readlink(f"/proc/{receiver.pid}/fd/{fd}") == "/dev/nvidia0"
            assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
            assert st.st_dev != os.stat("/dev/null").st_dev  # the node lives on the container's tmpfs
        else:
            assert st.st_rdev == os.makedev(1, 5) and st.st_dev == os.stat("/dev/zero").st_dev


@pytest.mark.root
@pytest.mark.netns
def test_several_containers_and_cleanup(root: None) -> None:
    pod_uid = str(uuid.uuid4())
    containers = [
        FakeContainer(pod_uid=pod_uid),
        FakeContainer(pod_uid=pod_uid),
        FakeContainer(qos="guaranteed"),
    ]
    pod_dirs = {os.path.dirname(d) for c in containers for d in c.cgroup_paths.values()}
    assert not any(os.path.exists(d) for d in pod_dirs), "pod cgroups left over from an earlier run"
    tops = [
        os.path.join(m.mountpoint, t) for m in containers[0].mounts for t in ("kubepods.slice", "kubepods")
    ]
    tops_absent_before = [t for t in tops if not os.path.exists(t)]
    procs = []
    for c in containers:
        c.create()
        procs += [c.run(["open", "/dev/nvidia0", "ready", "wait"]), c.run(["fork", "ready", "wait"])]
    for p in procs:
        p.wait_ready()
    assert len({p.host_pid for p in procs}) == len(procs)
    for p in procs:
        assert all(
            line.endswith(p.container.cgroup_path)
            for line in Path(f"/proc/{p.host_pid}/cgroup").read_text().split()
        )
    # Leave one process un-released and its shim killed: cleanup must still kill it and drain.
    procs[0].kill_shim()
    leftover = procs[0].host_pid
    for c in containers:  # first-created first: shared pod/QoS levels must survive until the last
        c.cleanup()
        assert not any(os.path.exists(d) for d in c.cgroup_paths.values())
    assert not any(os.path.exists(d) for d in pod_dirs)
    assert poll(lambda: not os.path.exists(f"/proc/{leftover}") or status(leftover)["State"].startswith("Z"))
    # Another test process may share the top levels; under the registry lock a shared level
    # exists only together with some container below it, so an empty one is a leak.
    with cgroup_registry():
        for top in tops_absent_before:
            assert not os.path.exists(top) or any(e.is_dir() for e in os.scandir(top)), f"{top} left behind"


@pytest.mark.root
def test_failed_create_removes_what_it_made(root: None) -> None:
    c = FakeContainer()
    real_dirs = list(c.cgroup_paths.values())
    c.mounts.append(CgroupMount("/nonexistent-cgroup-mount", 2, (), "0:0"))  # fails last
    c.cgroup_paths["/nonexistent-cgroup-mount"] = "/nonexistent-cgroup-mount" + c.cgroup_path
    with pytest.raises(HarnessError, match="nonexistent-cgroup-mount"):
        c.create()
    assert not [d for d in real_dirs if os.path.exists(os.path.dirname(d))]


@pytest.mark.parametrize(
    ("steps", "expected_lines", "expected_rc"),
    [
        (["frobnicate"], ["script-error unknown step 'frobnicate'"], 2),
        (["open", "/dev/null", "open"], ["script-error step 'open' needs 1 argument(s)"], 2),
        (["ioctl", "0", "x", "1"], ["script-error step 'ioctl': 'x' is not an integer"], 2),
        (["thread-hold", "ready"], ["script-error thread-hold must be the last step"], 2),
        (["open", "/nonexistent/nvidia9", "ready"], ["step-error open 2", "ready {pid}"], 0),  # ENOENT
        (["dup", "4", "exit", "3"], ["step-error dup 9"], 3),  # EBADF
        (
            ["open", "/dev/null", "mmap", "0", "close", "0", "ready"],
            ["step-error mmap 19", "ready {pid} -1"],
            0,
        ),
        (["sendfd", "/nonexistent/s", "0"], ["step-error sendfd 9"], 0),  # no fd 0 in the table
        (["recvfd", "/nonexistent/dir/s"], ["step-error recvfd 2"], 0),
        (["sleep", "0x14", "ready", "exit", "0"], ["ready {pid}"], 0),
        (["open", "/dev/null", "dup", "0", "ioctl", "1", "0x5401", "3", "ready"], ["ready {pid} 3 4"], 0),
    ],
)
def test_script_lines_and_exit_codes(steps: list[str], expected_lines: list[str], expected_rc: int) -> None:
    with run_host(steps) as w:
        assert w.wait_exit() == expected_rc
        lines = [w.read_line(1.0) for _ in expected_lines]
        assert lines == [line.format(pid=w.pid) for line in expected_lines]
        assert w.read_line(1.0) is None  # nothing more


@pytest.mark.root
@pytest.mark.netns
def test_shim_rejects_bad_script_before_namespaces(root: None) -> None:
    with FakeContainer() as c, c.run(["ready", "bogus"]) as p:
        assert p.wait_exit() == 2
        assert p.read_line(1.0) == "script-error unknown step 'bogus'"
        with pytest.raises(HarnessError):
            _ = p.init_pid  # no init was ever forked
        assert c.pids() == []


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace not installed: apt-get install strace")
def test_ioctl_step_issues_the_syscalls(tmp_path: Path) -> None:
    out = tmp_path / "trace"
    cmd = ["strace", "-f", "-qq", "-e", "trace=ioctl", "-o", str(out), str(build_gpuwork())]
    rc = subprocess.run([*cmd, "open", "/dev/null", "ioctl", "0", "0xc020462a", "7"], check=False, timeout=30)
    assert rc.returncode == 0
    calls = [line for line in out.read_text().splitlines() if "ioctl(3," in line]  # fd 3: the open
    assert len(calls) == 7 and all("ENOTTY" in line for line in calls), calls


@pytest.mark.root
@pytest.mark.netns
def test_container_start_latency(root: None) -> None:
    """Average start-to-ready over 50 fresh containers (cgroups in every hierarchy, namespaces,
    /dev): printed, not asserted, as it depends on the host."""
    starts_s, teardowns_s, readies = [], [], []
    for _ in range(50):
        t0 = time.monotonic()
        with FakeContainer() as c, c.run(["open", "/dev/nvidia0", "ready", "wait"]) as p:
            readies.append(p.wait_ready())
            t1 = time.monotonic()
        starts_s.append(t1 - t0)
        teardowns_s.append(time.monotonic() - t1)
    avg_ms, max_ms = 1000 * sum(starts_s) / len(starts_s), 1000 * max(starts_s)
    teardown_ms = 1000 * sum(teardowns_s) / len(teardowns_s)
    print(
        f"\ncontainer start-to-ready over {len(starts_s)}: avg {avg_ms:.2f} ms, max {max_ms:.2f} ms;"
        f" teardown avg {teardown_ms:.2f} ms"
    )
    assert readies == [ReadyLine(1, (3,))] * 50  # every start was a real PID 1 holding the node
