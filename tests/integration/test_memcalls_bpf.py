"""The kernel's memory calls for real (bpf/alloc.bpf.c, the ioctl exit in bpf/ioctl.bpf.c): only
calls the driver accepted reach BpfSource.take_memcalls().

On `c 1 3` nodes (/dev/null) every ioctl fails with ENOTTY: each memory call is stashed at entry
and counted at exit as failed (mem_failed), and none is reported. That the count matches the calls
made shows the exit ran for each of them: nothing is reported because nothing was accepted, not
because nothing was seen.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from ghostgpu.tracer.bpf_source import BpfSource, BpfUnavailable
from ghostgpu.tracer.memcalls import MemCall

from tests.conftest import require_root
from tests.helpers.workload import run_host

pytestmark = [pytest.mark.bpf, pytest.mark.root]

RM_CONTROL = "0xc020462a"  # _IOWR('F', 0x2A, 32): no memory call
RM_FREE = "0xc0104629"  # _IOWR('F', 0x29, 16), NVOS00
RM_DUP_OBJECT = "0xc01c4634"  # _IOWR('F', 0x34, 28), NVOS55
RM_FREE_WRONG_SIZE = "0xc0144629"  # 20 bytes: the driver refuses it before RM, so it is not stashed


@dataclass
class Rig:
    source: BpfSource
    root: Path
    seen: list[MemCall] = field(default_factory=list)

    def node(self, name: str) -> str:
        return str(self.root / name)

    def run(self, steps: list[str]) -> dict[str, int]:
        """Run gpuwork with `steps` then `ready wait`; the kernel's mem_* counters it added, once
        its ready line came (every call of the script has returned by then)."""
        before = self.source.stats()
        with run_host([*steps, "ready", "wait"]) as w:
            w.wait_ready(10.0)
            after = self.source.stats()
            self.drain()
        return {k: after[k] - before[k] for k in after if k.startswith("mem_")}

    def drain(self) -> None:
        self.source.poll(0)
        self.seen.extend(self.source.take_memcalls())


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    require_root()
    root = Path(tempfile.mkdtemp(prefix="gg-memcalls-", dir="/tmp"))
    for name in ("nvidiactl", "nvidia0", "other0"):
        os.mknod(root / name, 0o666 | 0o020000, os.makedev(1, 3))
    source = BpfSource((str(root / "nvidia"),), max_fds=4096, ringbuf_pages=16)
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


def steps(text: str) -> list[str]:
    return text.split()


def memory_calls(ctl: int, gpu: int) -> list[str]:
    """Every memory call the kernel stashes: RM_ALLOC (NVOS21, NVOS64, inside XFER),
    RM_ALLOC_OBJECT, RM_ALLOC_MEMORY, VID_HEAP_CONTROL ALLOC_SIZE (2) and FREE (3), RM_FREE, DUP;
    on the script's fds `ctl` and `gpu`."""
    return steps(f"rmalloc {ctl} alloc 0x41 rmalloc {ctl} alloc64 0x80 rmalloc {ctl} xfer 0x40 "
                 f"rmalloc {ctl} object 0x40 rmalloc {gpu} memory 0x3e rmalloc {gpu} heap 2 "
                 f"rmalloc {gpu} heap 3 ioctl {ctl} {RM_FREE} 1 ioctl {gpu} {RM_DUP_OBJECT} 1")


MEMORY_CALL_COUNT = 9
# Calls that are no memory call, or that the driver refuses by their size: never stashed.
OTHER_CALLS = steps(f"ioctl 0 {RM_CONTROL} 3 rmalloc 0 heap 27 rmalloc 0 heap 1 "
                    f"ioctl 0 {RM_FREE_WRONG_SIZE} 1")


def test_refused_calls_are_counted_and_never_reported(rig: Rig) -> None:
    added = rig.run(["open", rig.node("nvidiactl"), "open", rig.node("nvidia0"), *memory_calls(0, 1),
                     *OTHER_CALLS, "close", "0"])
    assert added == {"mem_refused": 0, "mem_failed": MEMORY_CALL_COUNT, "mem_lost": 0, "mem_clients_full": 0,
                     "mem_drops": 0}
    rig.drain()
    assert rig.seen == []


def test_memory_calls_on_a_file_that_is_no_gpu_device_are_not_even_stashed(rig: Rig) -> None:
    added = rig.run(["open", rig.node("other0"), *memory_calls(0, 0)])
    assert added["mem_failed"] == 0 and added["mem_lost"] == 0
    # the same script on a GPU fd: every call seen
    assert rig.run(["open", rig.node("nvidia0"), *memory_calls(0, 0)])["mem_failed"] == MEMORY_CALL_COUNT
    rig.drain()
    assert rig.seen == []


def test_a_thread_that_stashes_nothing_leaves_the_exit_at_once(rig: Rig) -> None:
    # Many ioctls on a GPU fd that are no memory call, then one that is: the one byte per thread
    # is set and taken exactly once (a leftover bit would show as mem_lost on the next exit).
    added = rig.run(["open", rig.node("nvidiactl"), "ioctl", "0", RM_CONTROL, "200", "rmalloc", "0", "alloc",
                     "0x40", "ioctl", "0", RM_CONTROL, "200"])
    assert (added["mem_failed"], added["mem_lost"], added["mem_refused"]) == (1, 0, 0)
