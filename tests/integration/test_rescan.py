"""The periodic /proc rescan is incremental (tracer/rescan.py), yet a holder the kernel side could
not have seen open its device is still found within one rescan period, by the real tracer.

Each holder here is a process that existed before the tracer started (so not a new process) and
gets its device fd in a way the kernel's open hook cannot match: passed over a unix socket, the
receiver closing its sockets and opening a file (its fd count ends where it began: only the
kernel's mark of its closes tells the rescan), or opened by a path relative to its working
directory (its count grows).
The full reconcile is an hour away, so only the incremental rescan can find them.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.container import FakeContainer
from tests.helpers.fakenvml import FakeNvml
from tests.helpers.polling import wait_until
from tests.helpers.tracer_proc import TracerProcess
from tests.helpers.workload import run_host

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.usefixtures("root_bpf")]

SCAN_INTERVAL_S = 1.0
ARGS = ["--grace-s", "0.5", "--scan-interval-s", str(SCAN_INTERVAL_S)]
SLACK_S = 3.0  # the agent's own step and the JSON lines' poll, on a shared 2-CPU machine


def env_of(fake_nvml: FakeNvml) -> dict[str, str]:
    return {**fake_nvml.env(), "GHOSTGPU_FULL_SCAN_INTERVAL_S": "3600"}


def found_by_rescan(pid: int):
    def pred(r: dict[str, Any]) -> bool:
        return r.get("event") == "open" and r.get("pid") == pid and r.get("source") == "procfs"

    return pred


def assert_no_kernel_loss(tracer: TracerProcess) -> None:
    """A kernel-side loss would have made that rescan a full one: then this test proved nothing."""
    notices = tracer.matching(lambda r: r.get("event") == "notice" and str(r.get("what")).startswith("bpf."))
    assert notices == [], notices


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gg-rs-", dir="/tmp"))  # device prefixes are at most 40 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


def fd_count(pid: int) -> int:
    return os.stat(f"/proc/{pid}/fd").st_size  # Linux 6.2+: the number of open (or reserved) fds


def test_an_fd_received_over_a_socket_at_the_same_count(tmp_path: Path, fake_nvml: FakeNvml) -> None:
    sock, spare = str(tmp_path / "pass.sock"), tmp_path / "spare"
    spare.write_bytes(b"")
    with FakeContainer() as a, FakeContainer() as b:
        # Before the tracer, so not a new process. Blocked in accept it holds the listening socket
        # and the fd number accept reserved; once it has the device fd it closes both sockets and
        # opens one file: the same count, the same /proc inode.
        receiver = b.run(["recvfd", sock, "open", str(spare), "ready", "wait"])
        wait_until(lambda: os.path.exists(sock), "the receiver's socket")
        with TracerProcess(tmp_path, ARGS, env_of(fake_nvml)) as tracer:
            tracer.wait_ready()
            count_before = fd_count(receiver.host_pid)
            sender = a.run(["open", "/dev/nvidia0", "sendfd", sock, "0", "ready", "wait"])
            sender.wait_ready()
            receiver.wait_ready()
            received_s = time.monotonic()
            assert fd_count(receiver.host_pid) == count_before  # only the kernel's close marks tell
            rec = tracer.wait_for(found_by_rescan(receiver.host_pid), timeout_s=SCAN_INTERVAL_S + SLACK_S,
                                  what="the receiver, found by the incremental rescan")
            assert time.monotonic() - received_s <= SCAN_INTERVAL_S + SLACK_S
            assert rec["container_id"] == b.container_id and rec["device"] == "/dev/nvidia0"
            tracer.wait_for(lambda r: r.get("event") == "finding" and r.get("pid") == receiver.host_pid
                            and r.get("class") == "hidden", what="the receiver classified")
            assert_no_kernel_loss(tracer)


def test_a_device_opened_by_a_relative_path(tmp_path: Path, fake_nvml: FakeNvml, short_dir: Path) -> None:
    os.mknod(short_dir / "nvidia0", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    args = [*ARGS, "--device-prefix", f"{short_dir}/nvidia"]
    with run_host(["ready", "wait", "open", "nvidia0", "ready", "wait"], cwd=short_dir) as holder:
        holder.wait_ready()  # before the tracer: not a new process
        with TracerProcess(tmp_path, args, env_of(fake_nvml)) as tracer:
            tracer.wait_ready()
            holder.release()
            holder.wait_ready()
            opened_s = time.monotonic()
            rec = tracer.wait_for(found_by_rescan(holder.pid), timeout_s=SCAN_INTERVAL_S + SLACK_S,
                                  what="the relative open, found by the incremental rescan")
            assert time.monotonic() - opened_s <= SCAN_INTERVAL_S + SLACK_S
            assert rec["device"] == f"{short_dir}/nvidia0"
            # The kernel was told (seeded): the close is its own record now, not a rescan's.
            holder.release()
            holder.wait_exit()
            tracer.wait_for(lambda r: r.get("event") == "exit" and r.get("pid") == holder.pid
                            and r.get("source") == "bpf", what="the exit, from the kernel")
            assert_no_kernel_loss(tracer)
