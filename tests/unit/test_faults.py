"""tracer/faults.py: an Xid joined to the processes that held its GPU (by PCI bus id), the named
process first, recent exits within the look-back, unparsed lines kept raw and counted."""

from __future__ import annotations

from collections.abc import Callable

from ghostgpu.tracer.events import DeviceHold, Holder, NvmlGpu, NvmlView, ProcessInfo
from ghostgpu.tracer.faults import EXIT_LOOKBACK_NS, FaultWatch, RecentExits, fault_record, gpu_by_bus_id
from ghostgpu.tracer.kmsg import KmsgRecord
from ghostgpu.tracer.xid import PciAddress

from ghostgpu.common.model.consumers import DeviceKind, DeviceRef
from ghostgpu.common.model.records import FaultRecord, ProcessIdentity

S = 1_000_000_000
XID_TS = 100 * S
NVML = NvmlView(available=True, gpus=(
    NvmlGpu(index=0, uuid="GPU-a", minor=0, pci_bus_id="00000000:17:00.0"),
    NvmlGpu(index=1, uuid="GPU-b", minor=1, pci_bus_id="00000000:3B:00.0"),
    NvmlGpu(index=2, uuid="GPU-c", minor=2, pci_bus_id=""),  # NVML did not say
))
LINE_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid={pid}, name=train, GPU has fallen off the bus."


def dev(minor: int | None, kind: DeviceKind = DeviceKind.GPU) -> DeviceRef:
    path = f"/dev/nvidia{minor}" if minor is not None else "/dev/nvidiactl"
    return DeviceRef(path, kind if minor is not None else DeviceKind.CONTROL, minor)


def holder(pid: int, *minors: int | None, since_ns: int = 50 * S, container: str = "") -> Holder:
    holds = {dev(m).path: DeviceHold(dev(m), fds={3}, first_seen_ns=since_ns) for m in minors}
    return Holder(ProcessInfo(pid=pid, comm=f"p{pid}", container_id=container), holds)


def no_proc(_pid: int) -> ProcessIdentity | None:
    return None


def join(line: str, holders: list[Holder], exits: RecentExits | None = None,
         lookup: Callable[[int], ProcessIdentity | None] = no_proc, nvml: NvmlView = NVML,
         origin: str = "kernel") -> FaultRecord:
    return fault_record("node-a", line, XID_TS, nvml, {h.pid: h for h in holders}, exits or RecentExits(),
                        lookup, seq=7, origin=origin, wall_ts=1.5)


def test_gpu_by_bus_id_compares_numbers_not_spellings() -> None:
    assert gpu_by_bus_id(PciAddress(0, 0x3B, 0), NVML) is NVML.gpus[1]
    assert gpu_by_bus_id(PciAddress(0, 0x17, 0), NVML) is NVML.gpus[0]
    assert gpu_by_bus_id(PciAddress(0, 0x99, 0), NVML) is None
    assert gpu_by_bus_id(PciAddress(0, 0x3B, 0), NvmlView(available=False)) is None


def test_holders_of_that_gpu_are_hit_the_named_one_first() -> None:
    holders = [holder(300, 1, container="c300"), holder(200, 1), holder(400, 0), holder(500, None),
               holder(100, 1, 0, container="c100")]
    rec = join(LINE_79.format(pid=300), holders)
    assert (rec.xid, rec.gpu, rec.gpu_uuid, rec.pci_bus_id) == (79, 1, "GPU-b", "0000:3b:00")
    assert (rec.severity, rec.meaning) == ("critical", "GPU has fallen off the bus")
    assert (rec.pid, rec.process_name, rec.message) == (300, "train", "GPU has fallen off the bus.")
    assert [(c.pid, c.named, c.exited, c.gpu) for c in rec.affected] == [
        (300, True, False, 1), (100, False, False, 1), (200, False, False, 1)]
    assert rec.affected[0].process is not None and rec.affected[0].process.container_id == "c300"
    assert (rec.ts, rec.ts_ns, rec.kmsg_seq, rec.node, rec.raw) == (1.5, XID_TS, 7, "node-a", "")


def test_a_hold_that_began_after_the_xid_was_not_hit() -> None:
    rec = join(LINE_79.format(pid=1), [holder(200, 1, since_ns=XID_TS + 1), holder(201, 1, since_ns=XID_TS)])
    assert [c.pid for c in rec.affected if not c.named] == [201]


def test_exits_within_the_look_back_are_hit_older_ones_not() -> None:
    exits = RecentExits()
    exits.note(holder(600, 1), XID_TS - EXIT_LOOKBACK_NS)  # exactly one second before: hit
    exits.note(holder(601, 1), XID_TS - EXIT_LOOKBACK_NS - 1)  # longer ago: not
    exits.note(holder(602, 1), XID_TS + S // 2)  # exited after the Xid, before it was read: hit
    exits.note(holder(603, 0), XID_TS)  # another GPU
    rec = join("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.", [holder(200, 1)], exits)
    assert rec.pid is None
    assert [(c.pid, c.named, c.exited) for c in rec.affected] == [
        (200, False, False), (600, False, True), (602, False, True)]


def test_named_process_that_already_exited_comes_first() -> None:
    exits = RecentExits()
    exits.note(holder(700, 1, container="c700"), XID_TS - S // 10)
    rec = join(LINE_79.format(pid=700), [holder(200, 1)], exits)
    first = rec.affected[0]
    assert (first.pid, first.named, first.exited, first.gpu) == (700, True, True, 1)
    assert first.process is not None and first.process.container_id == "c700"


def test_named_process_the_tracer_never_saw_is_read_from_proc_and_still_first() -> None:
    seen: list[int] = []

    def lookup(pid: int) -> ProcessIdentity | None:
        seen.append(pid)
        return ProcessIdentity(comm="ghost", container_id="c9")

    rec = join(LINE_79.format(pid=9), [holder(200, 1)], lookup=lookup)
    assert seen == [9]
    assert [(c.pid, c.named, c.gpu) for c in rec.affected] == [(9, True, None), (200, False, 1)]
    assert rec.affected[0].process == ProcessIdentity(comm="ghost", container_id="c9")
    gone = join(LINE_79.format(pid=9), [])
    assert [(c.pid, c.named, c.process) for c in gone.affected] == [(9, True, None)]


def test_unknown_pid_names_nobody() -> None:
    line = ("NVRM: Xid (PCI:0000:3b:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on "
            "(GPC 0, TPC 1, SM 2): Out Of Range Address")
    rec = join(line, [holder(200, 1)])
    assert rec.pid is None and rec.process_name == "" and rec.severity == "warning"
    assert [(c.pid, c.named) for c in rec.affected] == [(200, False)]


def test_gpu_nvml_does_not_know_lists_only_the_named_process() -> None:
    rec = join("NVRM: Xid (PCI:0000:99:00): 48, pid=200, name=x, DBE", [holder(200, 1), holder(201, 1)])
    assert rec.gpu is None and rec.gpu_uuid == ""
    assert [(c.pid, c.named, c.gpu) for c in rec.affected] == [(200, True, None)]
    off = join(LINE_79.format(pid=1), [holder(200, 1)], nvml=NvmlView(available=False))
    assert off.gpu is None and [c.pid for c in off.affected] == [1]


def test_unparsed_line_is_kept_raw() -> None:
    line = "NVRM: Xid (PCI:0000:3b:00): abc, pid=1"
    rec = join(line, [holder(200, 1)])
    assert (rec.xid, rec.raw, rec.severity, rec.affected, rec.gpu) == (None, line, "unknown", (), None)


def test_unknown_xid_number_is_reported_by_number() -> None:
    rec = join("NVRM: Xid (PCI:0000:3b:00): 999, pid=200, name=x, new thing", [holder(200, 1)])
    assert (rec.xid, rec.severity, rec.meaning) == (999, "unknown", "")


def test_a_line_written_by_user_space_says_so() -> None:
    """The record's facility says who wrote it (0: the kernel): origin, never a mark in the message."""
    watch = FaultWatch("node-a", path="/nonexistent/kmsg")
    watch.offer(LINE_79.format(pid=200), XID_TS, seq=1, facility=1)
    watch.offer(LINE_79.format(pid=200), XID_TS, seq=2)
    user, kernel = watch.take(NVML, {200: holder(200, 1)}, no_proc)
    assert (user.origin, kernel.origin) == ("user", "kernel")
    assert user.message == kernel.message == "GPU has fallen off the bus."
    assert user.affected[0].pid == 200
    assert join(LINE_79.format(pid=200), []).origin == "kernel"
    assert join("NVRM: Xid (PCI:0000:3b:00): x", [], origin="user").origin == "user"


def test_a_close_and_then_the_exit_reads_as_the_exit() -> None:
    exits = RecentExits()
    job = holder(810, 1)
    exits.note(job, XID_TS - S // 2, only_path="/dev/nvidia1")
    exits.note(job, XID_TS - S // 4)
    rec = join(LINE_79.format(pid=810), [], exits)
    assert [(c.pid, c.named, c.exited) for c in rec.affected] == [(810, True, True)]


def test_the_named_process_is_taken_from_the_exits_only_within_the_look_back() -> None:
    """A PID the driver names that exited long before the Xid is not that process: its PID may be
    reused, so /proc says who it is now."""
    exits = RecentExits()
    exits.note(holder(820, 0, container="old"), XID_TS - 10 * S)
    rec = join(LINE_79.format(pid=820), [], exits, lookup=lambda pid: ProcessIdentity(comm="new"))
    first = rec.affected[0]
    assert (first.pid, first.named, first.exited) == (820, True, False)
    assert first.process == ProcessIdentity(comm="new")


def test_recent_exits_expire_by_age() -> None:
    exits = RecentExits(max_entries=100, max_age_ns=10 * S)
    exits.note(holder(1, 0), 100 * S)
    exits.note(holder(2, 0), 105 * S)
    exits.note(holder(3, 0), 111 * S)  # 1 is past the age now
    assert [e.pid for e in exits] == [2, 3]
    exits.expire(116 * S)
    assert [e.pid for e in exits] == [3]


def test_recent_exits_are_bounded() -> None:
    exits = RecentExits(max_entries=3)
    for pid in range(10):
        exits.note(holder(pid, 0), pid)
    assert [e.pid for e in exits] == [7, 8, 9] and len(exits) == 3


def test_watch_queues_only_xid_lines_and_counts_the_unparsed() -> None:
    watch = FaultWatch("node-a", path="/nonexistent/kmsg")
    assert "no such device" in watch.start() and "Xid faults are not read" in watch.start()
    for seq, text in enumerate(["eth0: link up", LINE_79.format(pid=200), "NVRM: Xid (PCI:0000:3b:00): x"]):
        watch._on_record(KmsgRecord(facility=0, level=3, seq=seq, ts_us=10**12, text=text), XID_TS)
    assert watch.pending
    out = watch.take(NVML, {200: holder(200, 1)}, no_proc)
    assert [(r.xid, r.kmsg_seq) for r in out] == [(79, 1), (None, 2)]
    assert out[0].ts_ns <= XID_TS  # never later than it was read
    assert watch.kmsg_unparsed_total() == 1 and watch.faults_total == 2 and not watch.pending
    watch.close()


def test_a_job_that_closed_the_gpu_just_before_is_hit_and_still_alive() -> None:
    watch = FaultWatch("node-a", path="/nonexistent/kmsg")
    job = holder(800, 1, 0)
    watch.note_close(job, "/dev/nvidia1", XID_TS - S // 2)  # closed GPU 1, still holds GPU 0
    watch.note_close(job, "/dev/nvidiactl", XID_TS)  # not a GPU: nothing to note
    assert len(watch.exits) == 1
    rec = join("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.", [], watch.exits)
    assert [(c.pid, c.exited, c.gpu) for c in rec.affected] == [(800, False, 1)]


def test_lines_from_another_source_are_offered_and_joined_alike() -> None:
    watch = FaultWatch("node-a", path="/nonexistent/kmsg")
    watch.offer("not an xid", XID_TS)
    watch.offer(LINE_79.format(pid=200), XID_TS - 5, seq=0)
    out = watch.take(NVML, {200: holder(200, 1)}, no_proc)
    assert [(r.xid, r.ts_ns, r.affected[0].pid) for r in out] == [(79, XID_TS - 5, 200)]
