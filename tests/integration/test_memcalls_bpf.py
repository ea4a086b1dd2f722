"""The kernel's memory calls for real (bpf/alloc.bpf.c, the ioctl exit in bpf/ioctl.bpf.c): only
calls the driver accepted reach BpfSource.take_memcalls().

On `c 1 3` nodes (/dev/null) every ioctl fails with ENOTTY: each memory call is stashed at entry
and counted at exit as failed (mem_failed), and none is reported. That the count matches the calls
made shows the exit ran for each of them: nothing is reported because nothing was accepted, not
because nothing was seen.

Through the fake driver (tests/helpers/fakedriver.py, a FUSE file system whose ioctls answer as
the real driver's), rmplan plants exact call sequences; the MemCalls must be exactly what the
driver accepted, with the handles and sizes it wrote back, and nothing for what it refused.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.tracer.bpf_source import BpfSource, BpfUnavailable
from ghostgpu.tracer.memcalls import MemCall, MemCallKind

from tests.conftest import require_root
from tests.helpers.fakedriver import FakeDriver, fuse_unavailable
from tests.helpers.polling import wait_until
from tests.helpers.rmplan import RmPlan
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


def inflight(source: BpfSource) -> int:
    """Threads with a memory call between entry and exit, node-wide (alloc.bpf.c mem_inflight):
    back to 0 once every call returned, or every ioctl exit of the node would take the slow road."""
    table = source._bpf[b"mem_inflight"]
    return int(table[table.Key(0)].value)


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
    assert inflight(rig.source) == 0


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


# --- through the fake driver: what it accepted, exactly ------------------------------------------

K = MemCallKind
MIB = 1 << 20


@dataclass
class FuseRig:
    source: BpfSource
    driver: FakeDriver
    seen: list[MemCall] = field(default_factory=list)

    def plan(self, steps: list[str]) -> tuple[int, list[dict[str, Any]], dict[str, int]]:
        """Run rmplan with `steps`, then `ready hold`: its pid, its records and the mem_* counters
        it added."""
        before = self.source.stats()
        with RmPlan([*steps, "ready", "hold"], dev_dir=str(self.driver.mount_dir)) as plan:
            plan.wait_ready(10.0)
            records = plan.records()
            pid = plan.pid
            plan.release()
        after = self.source.stats()
        return pid, records, {k: after[k] - before[k] for k in after if k.startswith("mem_")}

    def calls_of(self, pid: int, count: int) -> list[MemCall]:
        """The first `count` MemCalls of `pid`, their times zeroed (polled for: a record of the
        last call may still be on its way through the ring buffer)."""
        def enough() -> bool:
            self.source.poll(0)
            self.seen.extend(self.source.take_memcalls())
            return len([c for c in self.seen if c.pid == pid]) >= count

        wait_until(enough, f"{count} memory calls of pid {pid}")
        return [replace(c, ts_ns=0) for c in self.seen if c.pid == pid]


@pytest.fixture(scope="module")
def fuse_rig() -> Iterator[FuseRig]:
    require_root()
    if (why := fuse_unavailable()) is not None:
        pytest.skip(why)
    mount = Path(tempfile.mkdtemp(prefix="gg-mc-", dir="/tmp"))  # short: the prefix has 40 bytes at most
    with FakeDriver(mount) as driver:
        source = BpfSource((str(mount / "nvidia"),), max_fds=4096, ringbuf_pages=16)
        try:
            source.start()
        except BpfUnavailable as exc:
            pytest.skip(str(exc))
        try:
            yield FuseRig(source, driver)
        finally:
            source.close()


MEMORY_OPS = frozenset({"client", "device", "subdevice", "alloc-mem", "alloc-object", "alloc-memory",
                        "heap-alloc", "heap-free", "free", "dup"})


def expected_calls(pid: int, records: list[dict[str, Any]]) -> list[MemCall]:
    """What the kernel must report for rmplan's records: one MemCall per accepted memory call, with
    the handles and sizes the driver wrote back (rmplan prints them), in issue order."""
    fds: dict[str, int] = {}
    out: list[MemCall] = []
    for r in records:
        op = r["op"]
        if op == "open":
            fds["ctl" if r["path"].endswith("nvidiactl") else "gpu"] = r["fd"]
            continue
        if op not in MEMORY_OPS or r.get("status") != 0 or r["ret"] != 0:
            continue  # no memory call (close, use, control), or refused: nothing
        base = {"ts_ns": 0, "pid": pid, "fd": fds["ctl"], "h_root": r.get("client", 0),
                "h_parent": r.get("parent", 0), "h_object": r["handle"]}
        if op == "client":
            out.append(MemCall(K.ALLOC, **{**base, "h_root": 0, "h_parent": 0}, h_class=0x41))
        elif op in ("device", "subdevice"):
            instance = r["gpu"] if op == "device" else 0  # rmplan's subDeviceId is 0
            out.append(MemCall(K.ALLOC, **base, h_class=r["class"], instance=instance))
        elif op == "alloc-mem":
            out.append(MemCall(K.ALLOC, **base, h_class=r["class"], size_bytes=r["size_bytes"], attr=ATTR))
        elif op == "alloc-object":
            out.append(MemCall(K.ALLOC, **base, h_class=r["class"]))
        elif op == "alloc-memory":
            out.append(MemCall(K.ALLOC_MEMORY, **{**base, "fd": r["fd"]}, h_class=r["class"],
                               size_bytes=r["size_bytes"]))
        elif op == "heap-alloc":  # NVOS32_ALLOC_FLAGS_VIRTUAL: an NV50_MEMORY_VIRTUAL reservation
            h_class = 0x50A0 if r["flags"] & 0x00080000 else 0
            out.append(MemCall(K.HEAP_ALLOC, **base, h_class=h_class, size_bytes=r["size_bytes"]))
        elif op == "heap-free":
            out.append(MemCall(K.HEAP_FREE, **base))
        elif op == "free":
            out.append(MemCall(K.FREE, **base))
        elif op == "dup":
            out.append(MemCall(K.DUP, **base, src_client=r["src_client"], src_object=r["src_object"]))
    return out


ATTR = 0x11  # NV_MEMORY_ALLOCATION_PARAMS.attr the plan passes: read back after the call


def test_each_accepted_call_is_reported_exactly(fuse_rig: FuseRig) -> None:
    pid, records, added = fuse_rig.plan([
        "open ctl", "open gpu 0", "client as c1", "device 0", "subdevice",
        f"alloc-mem 0 {MIB} attr={ATTR:#x} as m1",  # rounded up by the driver to its 2 MiB granule
        f"alloc-mem 0 {4 * MIB} nvos64 attr={ATTR:#x}", f"alloc-mem 0 {MIB} xfer attr={ATTR:#x}",
        f"heap-alloc 0 {3 * MIB} as h1", f"heap-alloc 0 {MIB} xfer flags=0x80000", "alloc-memory 0 10000",
        "alloc-object 0x3e",
        "client as c2", "device 1", "dup $m1 from $c1 gpu 1", "use $c1", "free $m1", "heap-free $h1",
        "control", "use $c2", "free $c2",
    ])
    expected = expected_calls(pid, records)
    assert [r["op"] for r in records if r.get("status") not in (None, 0)] == []  # the driver took every call
    assert len(expected) == 16
    assert fuse_rig.calls_of(pid, len(expected)) == expected
    assert (added["mem_refused"], added["mem_failed"], added["mem_lost"], added["mem_drops"]) == (0, 0, 0, 0)
    assert inflight(fuse_rig.source) == 0


def test_refused_allocations_are_not_reported(fuse_rig: FuseRig) -> None:
    fuse_rig.driver.fail_alloc(2)  # the next two memory allocations: NV_ERR_NO_MEMORY
    pid, records, added = fuse_rig.plan(["open ctl", "client", "device 0",
                                         f"alloc-mem 0 {MIB} attr={ATTR:#x}", f"heap-alloc 0 {MIB}",
                                         f"alloc-mem 0 {2 * MIB} attr={ATTR:#x}"])
    refused = [r["op"] for r in records if r.get("status") not in (None, 0)]
    assert refused == ["alloc-mem", "heap-alloc"]
    expected = expected_calls(pid, records)
    assert [(c.kind, c.size_bytes) for c in expected] == [(K.ALLOC, 0), (K.ALLOC, 0), (K.ALLOC, 2 * MIB)]
    assert fuse_rig.calls_of(pid, len(expected)) == expected
    assert added["mem_refused"] == 2 and added["mem_failed"] == 0


def test_closing_the_fd_of_a_client_reports_close(fuse_rig: FuseRig) -> None:
    pid, records, _ = fuse_rig.plan(["open ctl", "client", "device 0", "close ctl", "open ctl", "close ctl"])
    ctl_fd = records[0]["fd"]
    calls = fuse_rig.calls_of(pid, 3)
    assert [c.kind for c in calls] == [K.ALLOC, K.ALLOC, K.CLOSE]  # the second fd held no client
    assert calls[2] == MemCall(K.CLOSE, ts_ns=0, pid=pid, fd=ctl_fd, h_root=0, h_parent=0, h_object=0)


def test_a_traced_memory_call_reaches_both_the_session_and_the_accountant(fuse_rig: FuseRig) -> None:
    # One ioctl exit serves both: the thread's byte carries both bits, and each half takes its own.
    from ghostgpu.tracer.trace_kernel import TRACE_KINDS, unpack_trace

    trace = fuse_rig.source.trace
    assert trace is not None
    slot = 0
    trace.open_slot(slot, 1000)
    try:
        steps = ["open ctl", "ready", "client", "device 0", f"alloc-mem 0 {MIB}", "control", "ready", "hold"]
        with RmPlan(steps, dev_dir=str(fuse_rig.driver.mount_dir)) as plan:
            plan.wait_ready(10.0)
            pid = plan.pid
            trace.add_tgid(slot, pid)
            plan.release()
            plan.wait_ready(10.0)
            ioctls: list[Any] = []

            def traced() -> bool:
                ioctls.extend(r for r in map(unpack_trace, trace.poll(0))
                              if r is not None and r.tgid == pid and TRACE_KINDS.get(r.kind) == "ioctl")
                return len(ioctls) >= 4

            wait_until(traced, "4 traced ioctls")
            plan.release()
        assert [r.ret for r in ioctls] == [0, 0, 0, 0]
        assert [c.kind for c in fuse_rig.calls_of(pid, 3)] == [K.ALLOC, K.ALLOC, K.ALLOC]
        assert inflight(fuse_rig.source) == 0
    finally:
        trace.close_slot(slot)
