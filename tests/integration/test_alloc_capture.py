"""The always-on allocation capture for real (bpf/alloc.bpf.c): the kernel's record per process,
and the classes the real tracer gives an NVML-like client and a GPU job.

The "GPU" nodes are c 1 3 (/dev/null): every ioctl fails with ENOTTY, but each parameter block is
really in user memory (tests/helpers/gpuwork.c `rmalloc`), so the kernel reads it as on a driver.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.tracer.bpf_source import BpfSource, BpfUnavailable
from ghostgpu.tracer.gpu_work import AllocRecord, Category

from tests.conftest import require_root
from tests.helpers.container import FakeContainer
from tests.helpers.fakenvml import FakeNvml
from tests.helpers.tracer_proc import TracerProcess
from tests.helpers.workload import run_host

pytestmark = [pytest.mark.bpf, pytest.mark.root]

C = Category
RM_CONTROL = "0xc020462a"
CARD_INFO = "0xc04846c8"
def script(text: str) -> list[str]:
    """gpuwork steps written as one line."""
    return text.split()


# What an NVML client does to read a GPU's state (docs/reference/nvidia-ioctl-abi.md §3.1, §7,
# §8): a client, a device and a subdevice, an OS event, then controls on them.
NVML_LIKE = script(f"ioctl 0 {CARD_INFO} 1 rmalloc 0 alloc 0x41 rmalloc 0 alloc64 0x80 "
                   f"rmalloc 0 alloc 0x2080 rmalloc 1 alloc 0x79 ioctl 0 {RM_CONTROL} 6")
# What a CUDA context adds: a VA space, memory, a channel group and channel, a compute engine.
CUDA_LIKE = script("rmalloc 0 alloc64 0x90f1 rmalloc 0 alloc 0x40 rmalloc 0 xfer 0xa06c "
                   "rmalloc 0 alloc 0xc86f rmalloc 0 alloc64 0xcbc0")


@dataclass
class Rig:
    source: BpfSource
    root: Path

    def node(self, name: str) -> str:
        return str(self.root / name)

    def record_of(self, steps: list[str]) -> tuple[int, AllocRecord | None]:
        """Run gpuwork on the host with `steps` then `ready wait`; the kernel's record at ready."""
        with run_host([*steps, "ready", "wait"]) as w:
            ready = w.wait_ready(10.0)
            return ready.pid, self.source.tables.alloc_record(ready.pid)  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    require_root()
    root = Path(tempfile.mkdtemp(prefix="gg-alloc-", dir="/tmp"))
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


def test_an_nvml_like_client_allocates_only_query_classes(rig: Rig) -> None:
    _, record = rig.record_of(["open", rig.node("nvidiactl"), "open", rig.node("nvidia0"), *NVML_LIKE])
    assert record is not None
    assert record.calls == 4 and record.seen == {C.QUERY}
    assert not record.allocated and record.first_nr == 0


def test_a_cuda_like_process_is_recorded_by_its_first_work_call(rig: Rig) -> None:
    _, record = rig.record_of(["open", rig.node("nvidiactl"), *NVML_LIKE[4:12], *CUDA_LIKE])
    assert record is not None
    assert record.allocated and (record.first_nr, record.first_value) == (0x2B, 0x90F1)  # FERMI_VASPACE_A
    assert record.seen == {C.QUERY, C.MEMORY, C.CHANNEL, C.ENGINE}
    assert record.calls == 2 + len(CUDA_LIKE) // 4


@pytest.mark.parametrize(
    ("how", "value", "first", "seen"),
    [
        ("alloc", "0xc6c0", (0x2B, 0xC6C0), {C.ENGINE}),  # NVOS21
        ("alloc64", "0xc86f", (0x2B, 0xC86F), {C.CHANNEL}),  # NVOS64
        ("xfer", "0xcbc0", (0x2B, 0xCBC0), {C.ENGINE}),  # carried by NV_ESC_IOCTL_XFER_CMD
        ("object", "0x40", (0x28, 0x40), {C.MEMORY}),  # RM_ALLOC_OBJECT
        ("memory", "0x71", (0x27, 0x71), {C.MEMORY}),  # RM_ALLOC_MEMORY, whatever the class
        ("heap", "2", (0x4A, 2), {C.MEMORY}),  # VID_HEAP_CONTROL ALLOC_SIZE
        ("alloc", "0xcfc0", (0x2B, 0xCFC0), {C.ENGINE}),  # a future compute class, by its family
        ("alloc", "0x402c", (0, 0), {C.UNKNOWN}),  # an unnamed class is not work
    ],
)
def test_each_allocation_escape(rig: Rig, how: str, value: str, first: tuple[int, int], seen: set[Category],
                                ) -> None:
    _, record = rig.record_of(["open", rig.node("nvidiactl"), "rmalloc", "0", how, value])
    assert record is not None
    assert ((record.first_nr, record.first_value), record.seen, record.calls) == (first, seen, 1)


def test_calls_that_are_no_allocation_leave_no_record(rig: Rig) -> None:
    # VID_HEAP_CONTROL's other functions, controls, frees, and allocations on a file that is no GPU
    # device (the same request words: the kernel looks only after its GPU-fd check).
    steps = ["open", rig.node("nvidiactl"), "open", rig.node("other0"),
             *script(f"rmalloc 0 heap 3 ioctl 0 {RM_CONTROL} 5 ioctl 0 0xc0104629 2"),
             *script("rmalloc 1 alloc64 0xcbc0 rmalloc 1 memory 0x3e")]
    _, record = rig.record_of(steps)
    assert record is None


def test_a_fork_child_starts_with_its_parents_record_and_forget_drops_it(rig: Rig) -> None:
    steps = ["open", rig.node("nvidia0"), "rmalloc", "0", "alloc64", "0xcbc0", "fork", "ready", "wait",
             "rmalloc", "0", "alloc", "0x2080", "ready", "wait"]
    tables = rig.source.tables
    assert tables is not None
    with run_host(steps) as w:
        child = w.wait_ready(10.0).pid
        parent = w.pid
        assert child != parent
        record = tables.alloc_record(child)  # copied at fork, before the child ran
        assert record is not None and record.from_tgid == parent
        assert (record.first_nr, record.first_value, record.calls) == (0x2B, 0xCBC0, 1)
        # Its own calls on the inherited fd are seen once user space has seeded it (the agent's
        # FORK rescan does, here the test).
        rig.source.seed(child, {w.ready.fds[0]: rig.node("nvidia0")})  # type: ignore[union-attr]
        w.release()
        w.wait_ready(10.0)
        record = tables.alloc_record(child)
        assert record is not None and record.calls == 2 and record.seen == {C.QUERY, C.ENGINE}
        own = tables.alloc_record(parent)
        assert own is not None and own.calls == 1 and own.from_tgid == 0
    rig.source.forget(child)
    rig.source.forget(parent)
    assert tables.alloc_record(child) is None and tables.alloc_record(parent) is None


# --- the real tracer ----------------------------------------------------------------------------

FAST = ["--grace-s", "0.5"]


def finding(pid: int, cls: str):
    def pred(r: dict[str, Any]) -> bool:
        return r.get("event") == "finding" and r.get("pid") == pid and r.get("class") == cls

    return pred


@pytest.mark.netns
@pytest.mark.usefixtures("root_bpf")
def test_monitor_next_to_a_gpu_job(tmp_path: Path, fake_nvml: FakeNvml) -> None:
    devices = ["open", "/dev/nvidiactl", "open", "/dev/nvidia0"]
    with FakeContainer() as before:
        # Opened before the tracer watched: no call history, so nothing proves a monitor.
        early = before.run([*devices, *NVML_LIKE, "ready", "wait"])
        early.wait_ready()
        with TracerProcess(tmp_path, FAST, fake_nvml.env()) as tracer, FakeContainer() as c:
            tracer.wait_ready()
            monitor = c.run([*devices, *NVML_LIKE, "ready", "wait"])
            job = c.run([*devices, *NVML_LIKE, *CUDA_LIKE, "ready", "wait"])
            late = c.run([*devices, *NVML_LIKE, *script("ready wait rmalloc 0 memory 0x3e ready wait")])
            for p in (monitor, job, late):
                p.wait_ready()
            rec = tracer.wait_for(finding(monitor.host_pid, "monitor"), what="the NVML-like client's class")
            assert "allocated no memory, channel or compute class" in rec["reason"]
            assert rec["devices"] == ["/dev/nvidia0", "/dev/nvidiactl"]
            rec = tracer.wait_for(finding(job.host_pid, "hidden"), what="the GPU job's class")
            assert "RM_ALLOC FERMI_VASPACE_A (0x90f1)" in rec["reason"]
            rec = tracer.wait_for(finding(early.host_pid, "hidden"), what="the holder from before the tracer")
            assert "incomplete" in rec["reason"]
            tracer.wait_for(finding(late.host_pid, "monitor"), what="a client before it allocates")
            late.release()  # allocates now: no event says so, the counter poll re-judges it
            rec = tracer.wait_for(finding(late.host_pid, "hidden"), what="the same client once it allocated")
            assert "RM_ALLOC_MEMORY NV01_MEMORY_SYSTEM (0x3e)" in rec["reason"]
            assert tracer.matching(finding(job.host_pid, "monitor")) == []
