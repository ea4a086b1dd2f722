"""GPU faults end to end on the node: the real tracer (BPF on, fake NVML answering a PCI bus id per
GPU) reads real kernel log lines written to /dev/kmsg and joins each Xid to the processes in fake
containers that held that GPU.

Only root can write /dev/kmsg. With BPF on the lines come through the printk:console tracepoint
(bpf/printk.bpf.c), which tells a line written from a write syscall as origin "user"; through
/dev/kmsg (BPF off) the LOG_USER facility says the same. Each test marks its lines with a token of
its own, so lines other tests (or the kernel) write meanwhile are told apart.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.container import FakeContainer
from tests.helpers.fakenvml import FakeGpu, FakeNvml
from tests.helpers.polling import wait_until
from tests.helpers.tracer_proc import TracerProcess
from tests.integration.conftest import GPU0_UUID, GPU1_UUID

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.usefixtures("root_bpf")]

FAST = ["--grace-s", "0.5"]
DEVICES = {"nvidia0": (1, 3), "nvidia1": (1, 3), "nvidiactl": (1, 3)}
GPU1_BUS = "0000:3b:00"  # as the driver writes it; NVML says 00000000:3B:00.0


@pytest.fixture
def two_gpus(tmp_path: Path) -> Iterator[FakeNvml]:
    nvml = FakeNvml(tmp_path / "nvml.conf", gpus=[
        FakeGpu(index=0, uuid=GPU0_UUID, minor=0, pci_bus_id="00000000:17:00.0"),
        FakeGpu(index=1, uuid=GPU1_UUID, minor=1, pci_bus_id="00000000:3B:00.0"),
    ])
    nvml.write()
    yield nvml


def kmsg(line: str) -> None:
    """One record into the kernel log, level 3 (err) as the driver logs an Xid."""
    try:
        with open("/dev/kmsg", "w") as f:
            f.write(f"<3>{line}\n")
    except OSError as exc:
        pytest.skip(f"/dev/kmsg cannot be written ({exc.strerror}): run the suite as root")


def fault_with(token: str) -> Any:
    def pred(r: dict[str, Any]) -> bool:
        return r.get("event") == "fault" and token in (r.get("message", "") + r.get("raw", ""))

    return pred


def test_xid_names_the_holders_of_that_gpu_the_named_process_first(tmp_path: Path,
                                                                  two_gpus: FakeNvml) -> None:
    token = secrets.token_hex(6)
    kmsg(f"NVRM: Xid (PCI:{GPU1_BUS}): 79, pid=1, name=before, logged before the tracer started {token}-old")
    with TracerProcess(tmp_path, FAST, two_gpus.env()) as tracer, \
            FakeContainer(devices=DEVICES) as c1, FakeContainer(devices=DEVICES) as c0, \
            FakeContainer(devices=DEVICES) as other:
        tracer.wait_ready()
        assert not tracer.matching(lambda r: r.get("event") == "notice" and r.get("what") == "kmsg")
        named = c1.run(["open", "/dev/nvidiactl", "open", "/dev/nvidia1", "ready", "wait"])
        named.wait_ready()
        also = other.run(["open", "/dev/nvidia1", "ready", "wait"])
        also.wait_ready()
        gpu0 = c0.run(["open", "/dev/nvidia0", "ready", "wait"])
        gpu0.wait_ready()
        for p in (named, also, gpu0):
            tracer.wait_for(lambda r, pid=p.host_pid: r.get("event") == "open" and r.get("pid") == pid,
                            what=f"open of {p.host_pid}")

        kmsg(f"NVRM: Xid (PCI:{GPU1_BUS}): 79, pid={named.host_pid}, name=gpuwork, GPU has fallen off the "
             f"bus. {token}")
        rec = tracer.wait_for(fault_with(token), what="fault record")
        assert (rec["xid"], rec["gpu"], rec["gpu_uuid"], rec["pci_bus_id"]) == (79, 1, GPU1_UUID, GPU1_BUS)
        assert (rec["severity"], rec["meaning"]) == ("critical", "GPU has fallen off the bus")
        assert rec["pid"] == named.host_pid and rec["process_name"] == "gpuwork"
        assert rec["origin"] == "user" and rec["message"] == f"GPU has fallen off the bus. {token}"
        hit = rec["affected"]
        assert [a["pid"] for a in hit] == [named.host_pid, also.host_pid]  # not the GPU 0 holder
        assert hit[0]["named"] is True and hit[1]["named"] is False
        assert hit[0]["container_id"] == c1.container_id and hit[0]["pod_uid"] == c1.pod_uid
        assert hit[0]["ns_pid"] == 1 and hit[0]["gpu"] == 1
        assert hit[1]["container_id"] == other.container_id

        # A line that names an Xid but does not parse is kept raw, never dropped.
        kmsg(f"NVRM: Xid (PCI:{GPU1_BUS}): garbled {token}-raw")
        raw = tracer.wait_for(fault_with(f"{token}-raw"), what="raw fault record")
        assert raw["xid"] is None and raw["raw"].endswith(f"garbled {token}-raw")
        assert raw["severity"] == "unknown" and raw["affected"] == []

        # Nothing from before the tracer's start: both later lines were read, the earlier one never.
        assert not tracer.matching(fault_with(f"{token}-old"))


def test_a_holder_that_exited_just_before_is_still_hit(tmp_path: Path, two_gpus: FakeNvml) -> None:
    token = secrets.token_hex(6)
    with TracerProcess(tmp_path, FAST, two_gpus.env()) as tracer, FakeContainer(devices=DEVICES) as c:
        tracer.wait_ready()
        job = c.run(["open", "/dev/nvidia1", "ready", "wait"])
        job.wait_ready()
        tracer.wait_for(lambda r: r.get("event") == "open" and r.get("pid") == job.host_pid, what="open")
        job.release()
        # The Xid is logged as soon as the job is gone (exited tasks leave cgroup.procs at once), not
        # once the tracer has reported the exit: the look-back is one second, end to end.
        wait_until(lambda: job.host_pid not in c.pids(), "the job gone from its cgroup")
        # The driver's form when no process is known (570 on): no pid, no name.
        kmsg(f"NVRM: Xid (PCI:{GPU1_BUS}): 48, An uncorrectable double bit error {token}")
        tracer.wait_for(lambda r: r.get("event") == "exit" and r.get("pid") == job.host_pid, what="exit")
        rec = tracer.wait_for(fault_with(token), what="fault record")
        assert rec["xid"] == 48 and rec["pid"] is None and rec["severity"] == "critical"
        assert [(a["pid"], a["exited"], a["named"], a["container_id"]) for a in rec["affected"]] == [
            (job.host_pid, True, False, c.container_id)]
