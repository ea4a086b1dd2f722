"""The kernel tables from user space, against a fake kernel that moves at the worst moment.

No root: tests/helpers/fake_kmaps.py keeps the maps in dicts and answers like libbpf (-errno).
"""

from __future__ import annotations

import ctypes
import errno

import pytest
from ghostgpu.tracer.kernel_maps import BPF_EXIST, BPF_NOEXIST, MapError, Update

from tests.helpers.fake_kmaps import AllocVal, FdKey, FdVal, HoldKey, HoldVal, IoctlKey, PathKey, fake_tables

GPU, CTL = "/dev/nvidia0", "/dev/nvidiactl"
PID = 4242


def hold(kernel, tgid: int, dev_id: int) -> tuple[int, int] | None:  # type: ignore[no-untyped-def]
    raw = kernel.get("holds", HoldKey(tgid, dev_id))
    return None if raw is None else (HoldVal.from_buffer_copy(raw).nfds, HoldVal.from_buffer_copy(raw).mapped)


def procs(kernel, tgid: int) -> int | None:  # type: ignore[no-untyped-def]
    raw = kernel.get("procs", ctypes.c_uint32(tgid))
    return None if raw is None else int.from_bytes(raw, "little")


def test_the_kernel_deleting_between_our_lookup_and_delete_is_not_an_error() -> None:
    """A crash seen with bcc: its table.pop(key, None) looks up, then deletes, and raises
    KeyError when the kernel removed the entry in between. Here the fake kernel closes the fd
    right after seed() looked it up (the process closed it itself): nothing raises, and the
    hold is released once, by the kernel's close, not a second time by us."""
    tables, kernel = fake_tables()
    gpu_id, ctl_id = tables.intern(GPU), tables.intern(CTL)
    assert gpu_id is not None and ctl_id is not None
    kernel.put("fds", FdKey(PID, 3), FdVal(ctl_id, 0))  # fd 3 named nvidiactl when last seen
    kernel.put("holds", HoldKey(PID, ctl_id), HoldVal(1, 0))
    kernel.put("procs", ctypes.c_uint32(PID), ctypes.c_uint32(1))

    def the_process_closes_fd_3(name: str, raw_key: bytes, found: bool) -> None:
        if name == "fds" and raw_key == bytes(FdKey(PID, 3)) and found:
            kernel.map("fds").pop(raw_key)  # gg_close: delete the fd, drop the hold
            kernel.map("holds").pop(bytes(HoldKey(PID, ctl_id)))

    kernel.after_lookup = the_process_closes_fd_3
    tables.seed(PID, {3: GPU})  # /proc said fd 3 is nvidia0 now (closed and reopened)
    assert hold(kernel, PID, ctl_id) is None  # released once (by the kernel), never underflowed
    assert hold(kernel, PID, gpu_id) == (1, 0)
    assert FdVal.from_buffer_copy(kernel.get("fds", FdKey(PID, 3))).dev_id == gpu_id


def test_delete_and_update_outcomes_and_real_faults() -> None:
    tables, kernel = fake_tables(max_entries=1)
    fds = tables.fds
    assert fds.delete(FdKey(1, 3)) is False  # already gone: an outcome, not an error
    assert fds.update(FdKey(1, 3), FdVal(7, 0), BPF_EXIST) is Update.MISSING
    assert fds.update(FdKey(1, 3), FdVal(7, 0), BPF_NOEXIST) is Update.WRITTEN
    assert fds.update(FdKey(1, 3), FdVal(8, 0), BPF_NOEXIST) is Update.EXISTS
    assert fds.update(FdKey(1, 4), FdVal(7, 0)) is Update.FULL
    assert fds.lookup(FdKey(1, 4)) is None and fds.delete(FdKey(1, 3)) is True
    kernel.fail_with = errno.EBADF
    with pytest.raises(MapError, match=r"BPF map fds: lookup failed: Bad file descriptor \(EBADF\)"):
        fds.lookup(FdKey(1, 3))


def populate_node(kernel, tgids: range, dev_id: int) -> None:  # type: ignore[no-untyped-def]
    """Other holders' entries, as the kernel made them: what a walk would have to visit."""
    for tgid in tgids:
        kernel.put("fds", FdKey(tgid, 3), FdVal(dev_id, 0))
        kernel.put("holds", HoldKey(tgid, dev_id), HoldVal(1, 0))
        kernel.put("procs", ctypes.c_uint32(tgid), ctypes.c_uint32(1))
        kernel.put("ioctls", IoctlKey(tgid, 3, dev_id, 0xC020462A), ctypes.c_uint64(5))


def owned_process(tables, kernel, dev_ids: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    """PID's entries as the kernel made them, each announced by its ring-buffer record."""
    gpu_id, ctl_id = dev_ids
    for fd, dev_id in ((3, ctl_id), (4, gpu_id), (5, gpu_id)):
        kernel.put("fds", FdKey(PID, fd), FdVal(dev_id, 0))
        tables.note_fd(PID, fd, dev_id)  # OPEN, then FD for the second fd on nvidia0
    kernel.put("holds", HoldKey(PID, ctl_id), HoldVal(1, 0))
    kernel.put("holds", HoldKey(PID, gpu_id), HoldVal(2, 1))
    tables.note_mapping(PID, gpu_id)
    kernel.put("procs", ctypes.c_uint32(PID), ctypes.c_uint32(2))
    counters = ((3, ctl_id, 0xC020462A, 7), (4, gpu_id, 0xC020462B, 2), (5, gpu_id, 0xC020462B, 1))
    for fd, dev_id, cmd, n in counters:
        kernel.put("ioctls", IoctlKey(PID, fd, dev_id, cmd), ctypes.c_uint64(n))
        tables.note_ioctl_key(PID, fd, dev_id, cmd)  # IOCTL_KEY


def test_exit_reads_and_forgets_only_the_processes_own_entries() -> None:
    tables, kernel = fake_tables()
    ids = (tables.intern(GPU), tables.intern(CTL))
    populate_node(kernel, range(10_000, 15_000), ids[0])
    owned_process(tables, kernel, ids)  # type: ignore[arg-type]
    kernel.ops = dict.fromkeys(kernel.ops, 0)
    assert tables.ioctl_counts(PID) == {PID: {(CTL, 0xC020462A): 7, (GPU, 0xC020462B): 3}}
    tables.forget(PID)
    assert kernel.walks == dict.fromkeys(kernel.walks, 0)  # no whole-map walk on the exit path
    # 3 counter lookups, then 1 procs + 3 fds + 2 holds + 3 ioctls + 1 alloc_work deletes
    assert kernel.ops == {"fds": 3, "holds": 2, "procs": 1, "ioctls": 6, "dev_ids": 0, "alloc_work": 1}
    assert all(len(kernel.map(name)) == 5_000 for name in ("fds", "holds", "procs", "ioctls"))
    assert PID not in tables.owned and tables.holder_bytes[PID] == 0  # type: ignore[index]
    tables.forget(PID)  # twice (a kernel EXIT after a rescan settled it): nothing to do, no error


def test_exec_drops_fds_and_holds_but_keeps_procs_and_counters() -> None:
    tables, kernel = fake_tables()
    ids = (tables.intern(GPU), tables.intern(CTL))
    owned_process(tables, kernel, ids)  # type: ignore[arg-type]
    tables.reset_fds(PID)
    assert not kernel.map("fds") and not kernel.map("holds")
    assert procs(kernel, PID) == 2  # still a holder: the kernel reports its exit at any moment
    assert len(kernel.map("ioctls")) == 3  # the process's counters outlive its image
    assert tables.seed(PID, {3: CTL}) is False  # the fd kept over exec, reseeded; not a new holder
    assert procs(kernel, PID) == 1 and hold(kernel, PID, ids[1]) == (1, 0)
    assert tables.holder_bytes[PID] == 1  # type: ignore[index]


def test_seed_is_idempotent_and_says_when_it_made_a_holder() -> None:
    tables, kernel = fake_tables()
    assert tables.seed(PID, {3: GPU, 4: GPU}, [GPU]) is True
    assert tables.seed(PID, {3: GPU, 4: GPU}, [GPU]) is False
    gpu_id = tables.intern(GPU)
    assert hold(kernel, PID, gpu_id) == (2, 1) and procs(kernel, PID) == 1  # type: ignore[arg-type]
    # A process with no procs entry (its EXIT already reported) is not made a holder again.
    assert tables.seed(PID + 1, {3: GPU}, create=False) is False and procs(kernel, PID + 1) is None
    assert tables.ioctl_counts(PID + 2) == {}


def test_seed_leaves_an_fd_the_kernel_inserted_meanwhile_to_the_kernel() -> None:
    tables, kernel = fake_tables()
    gpu_id = tables.intern(GPU)
    assert gpu_id is not None

    def the_process_opens_it_now(name: str, raw_key: bytes, found: bool) -> None:
        if name == "fds" and not found and raw_key == bytes(FdKey(PID, 3)):
            kernel.put("fds", FdKey(PID, 3), FdVal(gpu_id, 0))  # gg_set_fd: fd, hold, OPEN
            kernel.put("holds", HoldKey(PID, gpu_id), HoldVal(1, 0))

    kernel.after_lookup = the_process_opens_it_now
    tables.seed(PID, {3: GPU})
    assert hold(kernel, PID, gpu_id) == (1, 0)  # counted once, by the kernel


def test_sweep_removes_leftovers_of_tgids_dead_for_two_sweeps() -> None:
    tables, kernel = fake_tables()
    ids = (tables.intern(GPU), tables.intern(CTL))
    populate_node(kernel, range(100, 110), ids[0])  # 100-104 live, 105-109 died unreported
    owned_process(tables, kernel, ids)  # type: ignore[arg-type]
    for tgid in (*range(100, 110), 300):  # 300: only an allocation record is left of it
        kernel.put("alloc_work", ctypes.c_uint32(tgid), AllocVal(calls=1))
    alive = set(range(100, 105)) | {PID}
    assert tables.sweep(alive.__contains__) == 0  # dead once: its EXIT may still be queued
    kernel.put("procs", ctypes.c_uint32(200), ctypes.c_uint32(1))  # dies before the next sweep
    kernel.walks = dict.fromkeys(kernel.walks, 0)
    assert tables.sweep(alive.__contains__) > 0
    assert kernel.walks == {"fds": 1, "holds": 1, "procs": 1, "ioctls": 1, "dev_ids": 0,
                            "alloc_work": 1}  # each map once
    assert sorted(int.from_bytes(k, "little") for k in kernel.map("alloc_work")) == [*range(100, 105)]
    assert sorted(int.from_bytes(k, "little") for k in kernel.map("procs")) == [*range(100, 105), 200, PID]
    assert {FdKey.from_buffer_copy(k).tgid for k in kernel.map("fds")} == {*range(100, 105), PID}
    assert {IoctlKey.from_buffer_copy(k).tgid for k in kernel.map("ioctls")} == {*range(100, 105), PID}
    assert tables.sweep(alive.__contains__) > 0 and procs(kernel, 200) is None


def test_interned_ids_never_overwrite_the_kernels() -> None:
    tables, kernel = fake_tables()
    key = PathKey(GPU.encode())

    def the_kernel_interns_it_first(name: str, raw_key: bytes, found: bool) -> None:
        if name == "dev_ids" and not found:
            kernel.put("dev_ids", key, ctypes.c_uint32(0x100001))

    kernel.after_lookup = the_kernel_interns_it_first
    assert tables.intern(GPU) == 0x100001
    assert tables.intern("/dev/" + "x" * 60) is None  # longer than the kernel's key: never interned
