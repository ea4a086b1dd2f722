"""GPU memory from the driver's own calls, end to end: the real `ghostgpu tracer` (BPF on, a fake NVML
with two GPUs) streaming to a real `ghostgpu collector`, read with the real `ghostgpu ps -o json`.

The GPUs are the fake driver's (tests/helpers/fakedriver.py: a FUSE file system whose ioctls answer as
the real driver's, with a real RM object table), bound on /dev/nvidiactl, /dev/nvidia0 and
/dev/nvidia1 in fake containers whose init is rmplan (tests/helpers/rmplan.py), which plants exact
RM call sequences. The driver's own record of what each process holds on each GPU (its state file)
is the truth the tracer's figures are compared with:

- a planted sequence (allocations on GPU 0 and 1, one freed, one the driver refuses, a dup of one,
  one wrapped in NV_ESC_IOCTL_XFER_CMD, one of the NVOS64 block, a heap allocation, and a second
  client whose fd is closed) is exact per consumer and per GPU;
- a holder that allocated before the tracer started has no figure (null), with the reason;
- each GPU's NVML used memory is split: listed (NVML's per-process figures), unlisted (the allocated
  bytes of the consumers NVML does not list), unaccounted (the rest).

The tracer sees every holder on this host (other tests' too): rows are picked by node and PID.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.helpers.collector_proc import CollectorProcess, ghostgpu_cli, ps_json
from tests.helpers.container import ContainerProcess, FakeContainer, HarnessError
from tests.helpers.fakedriver import NV_ERR_NO_MEMORY, FakeDriver, fuse_unavailable
from tests.helpers.fakenvml import FakeNvml, FakeProc
from tests.helpers.polling import POLL_INTERVAL_S
from tests.helpers.rmplan import build_rmplan, failed, parse_records
from tests.helpers.tracer_proc import TracerProcess

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.usefixtures("root_bpf")]

NODE = "node-memory"
FAST = ["--grace-s", "0.5", "--bpf", "on"]
DEADLINE_S = 30.0
MIB, GIB = 1 << 20, 1 << 30
BEFORE_START = "allocated before the tracer started"
NVML_FIGURE = 512 * MIB  # what the fake NVML says the listed process uses (not the driver's figure)
USED = (GIB, 512 * MIB)  # NVML's used memory of GPU 0 and GPU 1

OPEN = ["open ctl", "open gpu 0", "open gpu 1", "client as c1", "device 0", "device 1"]
# Every kind of call the accountant must get right, in one process (the driver rounds each
# allocation up to 2 MiB and writes the size back; the tracer reads it after the call).
PLANTED = [
    *OPEN,
    "alloc-mem 0 3145728",  # 3 MiB asked, 4 MiB allocated on GPU 0
    "alloc-mem 1 1048576 xfer",  # inside NV_ESC_IOCTL_XFER_CMD: 2 MiB on GPU 1
    "alloc-mem 0 2097152 as gone",
    "free $gone",  # freed: nothing left of it
    "heap-alloc 0 2097152 as heap",  # RM_VID_HEAP_CONTROL ALLOC_SIZE: 2 MiB on GPU 0
    "dup $heap gpu 0",  # shares the heap allocation: counted once
    "alloc-mem 1 4194304 nvos64",  # the NVOS64 block: 4 MiB on GPU 1
    "alloc-mem 0 134217728",  # refused (fail-size-over): NV_ERR_NO_MEMORY, must not count
    "open ctl",  # a second client on a second fd, freed by closing that fd
    "client as c2",
    "device 0",
    "alloc-mem 0 6291456",
    "close ctl",
    "ready",
    "hold",
]
EXPECTED = {0: 4 * MIB + 2 * MIB, 1: 2 * MIB + 4 * MIB}  # what the driver holds for it at the end


T = TypeVar("T")


def until(fn: Callable[[], T | None], what: str, timeout_s: float = DEADLINE_S) -> T:
    """fn()'s first answer that is not None; fails naming `what` (and the last answer) past the deadline."""
    deadline = time.monotonic() + timeout_s
    while (got := fn()) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(POLL_INTERVAL_S)  # the polling interval of a deadline loop
    return got


@pytest.fixture
def driver() -> Iterator[FakeDriver]:
    if (reason := fuse_unavailable()) is not None:
        pytest.skip(f"the fake driver cannot run: {reason}")
    with FakeDriver() as d:
        d.fail_size_over(64 * MIB)
        yield d


def start(container: FakeContainer, steps: list[str]) -> ContainerProcess:
    proc = container.run(steps, program=build_rmplan())
    proc.wait_ready(10.0)
    return proc


def everyone_info(rows: list[dict[str, Any]], gpu: int) -> dict[str, Any]:
    """The `gpu_info` the rows of GPU `gpu` carry (each row of one GPU carries the same)."""
    return next(r["gpu_info"] for r in rows if r["gpu"] == gpu and r["gpu_info"])


def rows_of(collector: CollectorProcess, *pids: int) -> dict[tuple[int, int | None], dict[str, Any]]:
    """This node's `ps -o json` rows of these PIDs, by (pid, gpu)."""
    rows = ps_json(collector.address, "--node", NODE)
    return {(r["pid"], r["gpu"]): r for r in rows if r["pid"] in pids}


def test_allocated_bytes_per_consumer_and_per_gpu(tmp_path: Path, driver: FakeDriver,
                                                  fake_nvml: FakeNvml) -> None:
    gpus = driver.nvml_gpus()
    for gpu, used in zip(gpus, USED, strict=True):
        gpu.mem_used_bytes = used
    fake_nvml.update(gpus=gpus)
    containers = [FakeContainer(bind_devices=driver.devices()) for _ in range(3)]
    try:
        for c in containers:
            c.create()
    except HarnessError as e:
        pytest.skip(str(e))
    early_c, planted_c, listed_c = containers
    try:
        # Before the tracer: its allocation is history the kernel never saw.
        early = start(early_c, [*OPEN[:5], "alloc-mem 0 2097152", "ready", "hold"])
        with CollectorProcess(tmp_path / "collector") as col, \
                TracerProcess(tmp_path, FAST, fake_nvml.env(), NODE, col.address) as tracer:
            tracer.wait_ready(DEADLINE_S)
            planted = start(planted_c, PLANTED)
            listed = start(listed_c, [*OPEN[:5], "alloc-mem 0 8388608", "ready", "hold"])
            fake_nvml.update(procs=[FakeProc(gpu=0, pid=listed.host_pid, used_bytes=NVML_FIGURE)])

            results = parse_records(planted.lines)
            refused = failed(results)
            assert [(r["op"], r["status"]) for r in refused] == [("alloc-mem", NV_ERR_NO_MEMORY)], results
            truth = driver.wait_state(lambda s: s.pid_bytes(planted.host_pid) == EXPECTED,
                                      "the planted process's memory in the driver")
            pids = (planted.host_pid, early.host_pid, listed.host_pid)

            want = {(planted.host_pid, 0), (planted.host_pid, 1), (early.host_pid, 0), (listed.host_pid, 0)}

            def settled() -> dict[tuple[int, int | None], dict[str, Any]] | None:
                """The rows once the planted figures, NVML's listing and the GPU's split are in."""
                rows = rows_of(col, *pids)
                if not want <= rows.keys():
                    return None
                figures = {gpu: rows[(planted.host_pid, gpu)]["allocated_bytes"] for gpu in EXPECTED}
                split = rows[(planted.host_pid, 0)]["gpu_info"] or {}
                done = (figures == EXPECTED and rows[(listed.host_pid, 0)]["gpu_memory_bytes"] == NVML_FIGURE
                        and split.get("memory_listed_bytes") == NVML_FIGURE
                        and rows[(planted.host_pid, 1)]["class"] != "pending")  # past the grace period
                return rows if done else None

            rows = until(settled, "ps rows with the planted memory and NVML's listing")

            # (a) Exact, per consumer and GPU, as the driver's truth says.
            for gpu in (0, 1):
                row = rows[(planted.host_pid, gpu)]
                assert row["allocated_bytes"] == truth.pid_bytes(planted.host_pid)[gpu], row
                assert "allocated_reason" not in row
                assert row["class"] == "hidden" and row["gpu_memory_bytes"] is None
            assert "(from the driver calls ghostgpu saw)" in rows[(planted.host_pid, 0)]["reason"]
            listed_row = rows[(listed.host_pid, 0)]
            assert listed_row["allocated_bytes"] == truth.pid_bytes(listed.host_pid)[0] == 8 * MIB
            assert listed_row["class"] == "visible"

            # (b) Allocated before the tracer started: unknown, never 0.
            early_row = rows[(early.host_pid, 0)]
            assert early_row["allocated_bytes"] is None and early_row["allocated_reason"] == BEFORE_START
            assert truth.pid_bytes(early.host_pid)[0] == 2 * MIB  # what it does hold, unseen

            # (c) Per GPU: used = listed + unlisted + unaccounted, where unlisted is the allocated
            # bytes of the consumers NVML does not list on that GPU (every one the tracer sees). The
            # node's split is its own record, re-sent once a figure moves (Tracer._check_split): it may
            # trail the consumers' rows by a moment, so wait for one `ps` that shows both agreeing.
            def split_of(rows: list[dict[str, Any]], gpu: int) -> tuple[int, int]:
                info = everyone_info(rows, gpu)
                unlisted = sum(r["allocated_bytes"] or 0 for r in rows
                               if r["gpu"] == gpu and r["gpu_memory_bytes"] is None)
                return info["memory_unlisted_bytes"], unlisted

            def agreeing() -> list[dict[str, Any]] | None:
                rows = ps_json(col.address, "--node", NODE)
                return rows if all(a == b for a, b in (split_of(rows, g) for g in range(len(USED)))) else None

            everyone = until(agreeing, "each GPU's split to count its unlisted holders' allocated bytes")
            for gpu, used in enumerate(USED):
                info = everyone_info(everyone, gpu)
                unlisted = sum(r["allocated_bytes"] or 0 for r in everyone
                               if r["gpu"] == gpu and r["gpu_memory_bytes"] is None)
                listed_bytes = NVML_FIGURE if gpu == 0 else 0
                assert unlisted >= EXPECTED[gpu]
                assert info["pci_bus_id"] == driver.pci_bus_ids[gpu]
                assert (info["memory_used_bytes"], info["memory_listed_bytes"], info["memory_unlisted_bytes"],
                        info["unaccounted_bytes"]) == (used, listed_bytes, unlisted,
                                                      max(0, used - listed_bytes - unlisted))

            # The table: the driver calls' figure marked, and each GPU's split under the node's line.
            table = ghostgpu_cli("ps", "--collector", col.address, "--node", NODE)
            assert table.returncode == 0, table.stderr
            lines = table.stdout.splitlines()
            gpu0 = everyone_info(everyone, 0)
            unlisted0, unaccounted0 = gpu0["memory_unlisted_bytes"] / MIB, gpu0["unaccounted_bytes"] / MIB
            assert lines[1] == (f"  GPU 0 ({driver.pci_bus_ids[0]}): 1024MiB used = 512MiB by processes NVML "
                                f"lists + {unlisted0:.0f}MiB by holders it does not list + "
                                f"{unaccounted0:.0f}MiB unaccounted")
            planted_line = next(line for line in lines
                                if f" {planted.host_pid} " in line and line.split()[1] == "0")
            assert " 6MiB* " in planted_line and lines[-1] == "* from the driver calls ghostgpu saw"

            # The close of the second client's fd, and the exit, free what they held.
            planted.release()  # past `ready`
            planted.release()  # past `hold`: it exits
            until(lambda: True if not rows_of(col, planted.host_pid) else None, "the planted process gone")
            driver.wait_state(lambda s: not s.pid_bytes(planted.host_pid), "its clients freed by the driver")
            # And GPU 0's split no longer counts it among the holders NVML does not list.
            planted0 = rows[(planted.host_pid, 0)]["allocated_bytes"]
            unlisted_after = gpu0["memory_unlisted_bytes"] - planted0
            assert planted0 > 0

            def unlisted_dropped() -> bool | None:
                info = everyone_info(ps_json(col.address, "--node", NODE), 0)
                return True if info["memory_unlisted_bytes"] == unlisted_after else None

            until(unlisted_dropped, "GPU 0's unlisted memory without the planted process's")
    finally:
        for c in containers:
            c.cleanup()
