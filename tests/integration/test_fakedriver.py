"""The fake NVIDIA driver (tests/helpers/fakedriver/) answers as the real driver would.

Each test plants an exact RM call sequence with rmplan through a private /dev whose nvidiactl,
nvidiaN and nvidia-uvm are the driver's FUSE files, and checks both what the caller got back
(return, NV_STATUS, handles, sizes written back) and the driver's own truth (its state file),
which the tracer's figures are compared with elsewhere.
"""

from __future__ import annotations

import array
import ctypes
import fcntl
import mmap
import os
import struct
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.container import FakeContainer, HarnessError
from tests.helpers.fakedriver import (
    DEFAULT_PCI_BUS_IDS,
    NV_ERR_NO_MEMORY,
    NV_OK,
    NVOS02_GRANULE_BYTES,
    DriverState,
    FakeDriver,
    fuse_unavailable,
)
from tests.helpers.polling import wait_until
from tests.helpers.rmplan import RmPlan, build_rmplan, parse_records, run_rmplan

MIB = 1 << 20
SETUP = ["open ctl", "open gpu 0", "open gpu 1", "client as c", "device 0", "subdevice", "device 1"]


def nv_iowr(nr: int, size: int) -> int:
    """_IOWR('F', nr, size) (docs/reference/nvidia-ioctl-abi.md §1)."""
    return (3 << 30) | (size << 16) | (0x46 << 8) | nr


@pytest.fixture
def driver() -> Iterator[FakeDriver]:
    reason = fuse_unavailable()
    if reason:
        pytest.skip(reason)
    with FakeDriver() as fake:
        yield fake


def plan(fake: FakeDriver, steps: list[str], **kw: Any) -> list[dict[str, Any]]:
    """Runs the steps to the end in a private /dev holding the driver's files; all results."""
    return run_rmplan(steps, private_dev=fake.devices(), **kw)


def by_op(records: list[dict[str, Any]], op: str) -> list[dict[str, Any]]:
    return [r for r in records if r["op"] == op]


def test_rm_alloc_returns_nv_ok_a_handle_and_the_rounded_size(driver: FakeDriver) -> None:
    records = plan(driver, [*SETUP, "alloc-mem 0 1000", "alloc-mem 1 3000000 nvos64"])
    client = by_op(records, "client")[0]
    assert (client["ret"], client["status"], client["class"]) == (0, NV_OK, 0x41)
    assert client["handle"] != 0
    mems = by_op(records, "alloc-mem")
    assert [(m["ret"], m["status"]) for m in mems] == [(0, NV_OK), (0, NV_OK)]
    assert all(m["handle"] != 0 for m in mems)
    # the driver writes back the size it allocated: whole 2 MiB pages
    assert [m["size_bytes"] for m in mems] == [2 * MIB, 4 * MIB]


@pytest.mark.parametrize("steps, size_bytes", [
    (["alloc-mem 0 1048576 xfer"], 2 * MIB),
    (["alloc-mem 0 1048576 xfer nvos64"], 2 * MIB),
    (["heap-alloc 0 5242880 xfer"], 6 * MIB),
    (["heap-alloc 0 5242880"], 6 * MIB),
    (["alloc-memory 0 100"], NVOS02_GRANULE_BYTES),
])
def test_each_allocating_call_plain_and_inside_xfer(driver: FakeDriver, steps: list[str],
                                                    size_bytes: int) -> None:
    records = plan(driver, [*SETUP, *steps, "ready", "hold"])
    last = records[-1]
    assert (last["ret"], last["status"], last["size_bytes"]) == (0, NV_OK, size_bytes)
    # the plan exited: closing its nvidiactl freed the client and its memory
    state = driver.wait_state(lambda s: not s.clients, "the plan's client freed at exit")
    assert state.gpu_bytes(0) == 0
    assert state.counters["allocs_ok"] == 1


def test_state_shows_memory_while_held(driver: FakeDriver) -> None:
    with RmPlan([*SETUP, "alloc-mem 0 4194304 xfer", "heap-alloc 1 1", "ready", "hold"],
                private_dev=driver.devices()) as held:
        ready = held.wait_ready()
        state = driver.state()
        assert state.pid_bytes(ready.pid) == {0: 4 * MIB, 1: 2 * MIB}
        assert [state.gpu_bytes(0), state.gpu_bytes(1)] == [4 * MIB, 2 * MIB]
        client = state.clients[0]
        assert (client["pid"], client["node"]) == (ready.pid, "nvidiactl")
        calls = sorted(m["call"] for m in state.memory)
        assert calls == ["rm_alloc", "rm_vid_heap_alloc"]


@pytest.mark.parametrize("control, steps, statuses", [
    ("fail-alloc 1", ["alloc-mem 0 1", "alloc-mem 0 1"], [NV_ERR_NO_MEMORY, NV_OK]),
    ("fail-alloc 2", ["heap-alloc 0 1 xfer", "alloc-memory 0 1", "alloc-mem 0 1"],
     [NV_ERR_NO_MEMORY, NV_ERR_NO_MEMORY, NV_OK]),
    (f"fail-size-over {4 * MIB}", ["alloc-mem 0 4194304", "alloc-mem 0 4194305", "heap-alloc 1 8388608"],
     [NV_OK, NV_ERR_NO_MEMORY, NV_ERR_NO_MEMORY]),
])
def test_failures_on_demand_allocate_nothing(driver: FakeDriver, control: str, steps: list[str],
                                             statuses: list[int]) -> None:
    driver.control(control)
    with RmPlan(None, private_dev=driver.devices()) as live:
        for step in SETUP:
            live.step(step)
        results = [live.step(step) for step in steps]
        assert [(r["ret"], r["status"]) for r in results] == [(0, s) for s in statuses]
        failed = [r for r in results if r["status"] == NV_ERR_NO_MEMORY]
        assert all(r["size_bytes"] == r["requested_bytes"] for r in failed)  # nothing written back
        state = driver.state()
        assert len(state.memory) == statuses.count(NV_OK)
        assert state.counters["allocs_failed"] == len(failed)
    driver.reset()
    assert (driver.state().raw["fail_alloc"], driver.state().raw["fail_size_over"]) == (0, 0)


def test_free_takes_the_object_its_subtree_or_the_whole_client(driver: FakeDriver) -> None:
    with RmPlan(None, private_dev=driver.devices()) as live:
        for step in SETUP:
            live.step(step)
        a = live.step("alloc-mem 0 2097152 as a")["handle"]
        live.step("alloc-mem 1 2097152 as b")
        live.step("heap-alloc 1 2097152 as h")
        assert [driver.state().gpu_bytes(0), driver.state().gpu_bytes(1)] == [2 * MIB, 4 * MIB]

        assert live.step(f"free {a}")["status"] == NV_OK
        assert [driver.state().gpu_bytes(0), driver.state().gpu_bytes(1)] == [0, 4 * MIB]
        assert live.step(f"free {a}")["status"] == 0x33  # NV_ERR_INVALID_OBJECT_HANDLE: gone

        assert live.step("heap-free $h")["status"] == NV_OK
        assert driver.state().gpu_bytes(1) == 2 * MIB

        live.step("alloc-mem 1 2097152")
        device1 = next(m for m in driver.state().memory if m["gpu"] == 1)["parent"]
        assert live.step(f"free {device1}")["status"] == NV_OK  # a parent: its memory goes with it
        assert driver.state().gpu_bytes(1) == 0

        live.step("alloc-mem 0 2097152")
        client = live.step("free client")
        assert client["status"] == NV_OK
        state = driver.state()
        assert (state.clients, state.memory, state.raw["objects"]) == ([], [], 0)


def test_dup_shares_memory_without_allocating_it_again(driver: FakeDriver) -> None:
    with RmPlan(None, private_dev=driver.devices()) as live:
        for step in SETUP:
            live.step(step)
        c1 = live.step("use c")["client"]
        live.step("alloc-mem 0 6291456 as m")
        c2 = live.step("client")["handle"]
        live.step("device 0")
        dup = live.step(f"dup $m from {c1}")
        assert (dup["ret"], dup["status"], dup["src_client"]) == (0, NV_OK, c1)
        state = driver.state()
        assert state.gpu_bytes(0) == 6 * MIB  # once, however many handles share it
        assert state.client_bytes(c1, 0) == 6 * MIB
        assert (state.client_bytes(c2, 0), state.client_bytes(c2, 0, shared=True)) == (0, 6 * MIB)
        ids = {m["alloc_id"] for m in state.memory}
        assert len(state.memory) == 2 and len(ids) == 1

        live.step(f"use {c1}")
        live.step("free client")  # the owner goes: the dup still holds the memory
        state = driver.state()
        assert state.gpu_bytes(0) == 6 * MIB and state.client(c1) is None


def test_closing_the_file_frees_its_clients(driver: FakeDriver) -> None:
    with RmPlan(None, private_dev=driver.devices()) as live:
        for step in [*SETUP, "alloc-mem 0 2097152", "alloc-mem 1 2097152"]:
            live.step(step)
        assert driver.state().gpu_bytes(1) == 2 * MIB
        live.step("close ctl")
        state = driver.wait_state(lambda s: not s.clients, "the client freed by the close of nvidiactl")
        assert (state.gpu_bytes(0), state.gpu_bytes(1)) == (0, 0)
        assert state.counters["clients_closed"] == 1


def test_process_exit_frees_its_clients(driver: FakeDriver) -> None:
    records = plan(driver, [*SETUP, "alloc-mem 0 2097152", "exit 0"])
    assert by_op(records, "alloc-mem")[0]["status"] == NV_OK
    state = driver.wait_state(lambda s: not s.clients, "the client freed at process exit")
    assert state.memory == []


def test_two_gpus_by_card_info_and_device_id(driver: FakeDriver) -> None:
    records = plan(driver, ["open ctl", "card-info", "version", "attach"])
    gpus = by_op(records, "card-info")[0]["gpus"]
    assert [(g["minor"], g["pci_bus_id"]) for g in gpus] == list(enumerate(DEFAULT_PCI_BUS_IDS))
    assert by_op(records, "version")[0]["version"] == "595.45.04"
    assert by_op(records, "attach")[0]["ret"] == 0
    # deviceId must name a GPU the driver has
    bad = plan(driver, ["open ctl", "client", "device 2"])[-1]
    assert (bad["ret"], bad["status"]) == (0, 0x1F)  # NV_ERR_INVALID_ARGUMENT


def test_older_release_layout() -> None:
    """525.x: NVOS21 has its status @24 and NVOS64 is 40 bytes (sheet §5.2)."""
    reason = fuse_unavailable()
    if reason:
        pytest.skip(reason)
    with FakeDriver(driver="525.47.04") as old:
        records = plan(old, [*SETUP, "alloc-mem 0 1", "alloc-mem 1 1 nvos64 xfer"], driver="525.47.04")
        assert [(r["ret"], r["status"]) for r in records[3:]] == [(0, NV_OK)] * 6
        assert old.state().gpu_bytes(1) == 0  # the plan has exited: its client is gone
        # a 48-byte RM_ALLOC is not an RM_ALLOC on 525: -EINVAL
        fd = os.open(old.ctl_path, os.O_RDWR)
        try:
            with pytest.raises(OSError) as err:
                fcntl.ioctl(fd, nv_iowr(0x2B, 48), bytearray(48), True)
            assert err.value.errno == 22
        finally:
            os.close(fd)


def test_unknown_escape_or_wrong_size_is_einval_and_writes_nothing(driver: FakeDriver) -> None:
    fd = os.open(driver.ctl_path, os.O_RDWR)
    try:
        for request, size in [(nv_iowr(0x2B, 40), 40), (nv_iowr(0x29, 20), 20), (nv_iowr(0x60, 16), 16)]:
            block = bytearray(b"\xa5" * size)
            with pytest.raises(OSError) as err:
                fcntl.ioctl(fd, request, block, True)
            assert err.value.errno == 22
            assert block == bytearray(b"\xa5" * size)
        # an RM_ALLOC of a client on a GPU node (nvidiactl only, escape.c): -EINVAL too
        gpu_fd = os.open(driver.gpu_path(0), os.O_RDWR)
        try:
            with pytest.raises(OSError):
                fcntl.ioctl(gpu_fd, nv_iowr(0x2B, 32), bytearray(32), True)
        finally:
            os.close(gpu_fd)
        # and the right size goes through, with the handle and hClass written back
        block = bytearray(32)
        assert fcntl.ioctl(fd, nv_iowr(0x2B, 32), block, True) == 0
        _, _, h_new, h_class = struct.unpack_from("<IIII", block)
        assert (h_new != 0, h_class, struct.unpack_from("<I", block, 28)[0]) == (True, 0x41, NV_OK)
    finally:
        os.close(fd)
    assert driver.state().counters["einval"] == 4


def test_device_files_can_be_mapped(driver: FakeDriver) -> None:
    """CUDA maps nvidiactl and nvidiaN: a shared mapping of the FUSE files succeeds."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    for path in (driver.ctl_path, driver.gpu_path(0), driver.gpu_path(1)):
        fd = os.open(path, os.O_RDWR)
        try:
            addr = libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
            assert addr not in (None, ctypes.c_void_p(-1).value), f"mmap {path}: errno {ctypes.get_errno()}"
            libc.munmap(addr, mmap.PAGESIZE)
        finally:
            os.close(fd)


def test_uvm_answers_rm_status(driver: FakeDriver) -> None:
    fd = os.open(driver.uvm_path, os.O_RDWR)
    try:
        register = array.array("B", bytes(16))  # UVM_CREATE_RANGE_GROUP_PARAMS: rmStatus@8
        struct.pack_into("<I", register, 8, 0xFFFF)
        assert fcntl.ioctl(fd, 23, register, True) == 0
        assert struct.unpack_from("<I", register, 8)[0] == 0x16  # NV_ERR_ILLEGAL_ACTION before INITIALIZE
        records = plan(driver, ["open uvm", "uvm-init"])
        assert (records[-1]["ret"], records[-1]["status"]) == (0, NV_OK)
    finally:
        os.close(fd)


def test_a_container_process_allocates_through_its_private_dev(driver: FakeDriver) -> None:
    container = FakeContainer(bind_devices=driver.devices())
    try:
        container.create()
    except HarnessError as e:
        pytest.skip(str(e))
    try:
        proc = container.run([*SETUP, "alloc-mem 1 2097152 xfer", "ready", "hold"], program=build_rmplan())
        ready = proc.wait_ready(10.0)
        assert ready.pid == 1  # rmplan is the container's init
        results = parse_records(proc.lines)
        assert results[0]["path"] == "/dev/nvidiactl" and results[-1]["status"] == NV_OK
        state: DriverState = driver.state()
        # the driver sees the host PID (its own PID namespace), as the real driver's current->tgid
        assert state.pid_bytes(proc.host_pid) == {0: 0, 1: 2 * MIB}
        proc.release()
        proc.release()
        wait_until(lambda: proc.popen.poll() is not None, "the container init to exit", 10.0)
        driver.wait_state(lambda s: not s.clients, "the container's client freed at exit")
    finally:
        container.cleanup()
