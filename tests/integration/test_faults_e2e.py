"""GPU faults end to end, real parts only.

- A real `ghostgpu collector` process and a real `ghostgpu tracer` (BPF, a fake NVML whose GPU 0
  answers its PCI bus id, its CRI relay to an in-process runtime, tests/helpers/cri_fake.py, that
  names the fake container's pod). A process in a fake container (tests/helpers/container.py) holds
  /dev/nvidia0; an Xid line for that GPU's bus id, naming the process, is written to /dev/kmsg while
  the tracer runs. `ghostgpu faults -o json` names the pod, and `ghostgpu_xid_errors_total` counts it.
- Debian's Prometheus 2.42 scrapes an in-process collector fed by a simulated tracer and evaluates
  the shipped rules: a repeated critical Xid fires GhostGPUXidCritical with its node, GPU and Xid.

Every wait polls with a deadline.
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.collector_env import running_collector
from tests.helpers.collector_proc import CollectorProcess, ghostgpu_cli
from tests.helpers.container import FakeContainer
from tests.helpers.cri_fake import FakeCri
from tests.helpers.fakenvml import FakeGpu, FakeNvml
from tests.helpers.fault_events import fault_event, fault_record, hit
from tests.helpers.polling import wait_until
from tests.helpers.promstack import (
    PROMETHEUS_BIN,
    SHIPPED_RULES,
    Prometheus,
    free_port,
    require_binary,
)
from tests.helpers.sim_tracer import SimTracer
from tests.helpers.tracer_proc import TracerProcess
from tests.integration.conftest import GPU0_UUID
from tests.unit.test_metrics import samples

NODE = "node-faults"
NS, POD = "ml-faults", "trainer-0"
BUS_ID = "00000000:3B:00.0"  # NVML's form; the driver writes the same address as PCI:0000:3b:00
TRACER_DROPS = ("ghostgpu_tracer_memory_objects_dropped_total", "ghostgpu_tracer_kmsg_unparsed_total",
                "ghostgpu_tracer_faults_dropped_total", "ghostgpu_tracer_kmsg_records_lost_total")
DEADLINE_S = 30.0  # a tracer start (bcc compiles) and a CRI lookup, on a VM shared with other tests


def faults_json(collector: str, *args: str) -> list[dict[str, Any]]:
    out = ghostgpu_cli("faults", "--collector", collector, "-o", "json", *args)
    if out.returncode != 0:
        raise AssertionError(f"ghostgpu faults exited {out.returncode}: {out.stderr.strip()}")
    rows = json.loads(out.stdout)
    assert isinstance(rows, list)
    return rows


def scrape(address: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        return samples(resp.read().decode())


def write_kmsg(line: str) -> None:
    """One record into the kernel log, as root may (priority 3, the level NVRM logs Xids at)."""
    fd = os.open("/dev/kmsg", os.O_WRONLY)
    try:
        os.write(fd, f"<3>{line}\n".encode())
    finally:
        os.close(fd)


@pytest.mark.root
@pytest.mark.bpf
@pytest.mark.usefixtures("root_bpf")
def test_a_kernel_log_xid_names_the_pod_that_held_the_gpu(tmp_path: Path) -> None:
    gpu = FakeGpu(index=0, uuid=GPU0_UUID, minor=0, pci_bus_id=BUS_ID)
    nvml = FakeNvml(tmp_path / "nvml.conf", gpus=[gpu])
    nvml.write()
    cri = FakeCri().start()
    metrics = f"127.0.0.1:{free_port()}"
    (tmp_path / "tracer").mkdir()
    try:
        with FakeContainer() as box, CollectorProcess(tmp_path / "collector",
                                                      args=["--metrics-listen", metrics]) as col:
            cri.add_sandbox("sb-1", POD, NS, box.pod_uid)
            cri.add_container(box.container_id, "sb-1", "main")
            args = ["--grace-s", "0.5", "--cri-endpoint", cri.endpoint]
            with TracerProcess(tmp_path / "tracer", args, nvml.env(), NODE, col.address) as tracer:
                tracer.wait_ready(DEADLINE_S)
                job = box.run(["open", "/dev/nvidia0", "ready", "wait"])
                job.wait_ready()
                wait_until(lambda: POD in ghostgpu_cli("ps", "--collector", col.address, "-o", "json",
                                                       "-n", NS).stdout,
                           f"the job's consumer in pod {NS}/{POD}", DEADLINE_S)
                write_kmsg(f"NVRM: Xid (PCI:0000:3b:00): 79, pid={job.host_pid}, name=gpuwork, "
                           "GPU has fallen off the bus.")
                wait_until(lambda: faults_json(col.address), "the fault at the collector", DEADLINE_S)
                (row,) = faults_json(col.address, "-n", NS)
                assert (row["node"], row["gpu"], row["xid"], row["severity"]) == (NODE, 0, 79, "critical")
                assert row["gpu_uuid"] == GPU0_UUID and row["pid"] == job.host_pid
                assert row["origin"] == "user"  # this test, not the driver, wrote the line to /dev/kmsg
                assert row["pods"] == [f"{NS}/{POD}"]
                first = row["hits"][0]
                assert (first["pid"], first["named"], first["namespace"], first["pod"]) == (
                    job.host_pid, True, NS, POD)
                assert first["container"] == "main"
                table = ghostgpu_cli("faults", "--collector", col.address).stdout
                assert f"{NS}/{POD}" in table and "fallen off the bus (written by user space)" in table
                page = scrape(metrics)
                assert ({"node": NODE, "gpu": "0", "xid": "79"}, 1) in page["ghostgpu_xid_errors_total"]
                # The tracer's own drop counters, from its snapshot's and heartbeats' TracerStats: one
                # series each for the node (other tests' kernel log lines may count: values not pinned).
                for name in TRACER_DROPS:
                    assert len([v for labels, v in page[name] if labels == {"node": NODE}]) == 1, name
                assert page[TRACER_DROPS[0]] == [({"node": NODE}, 0)]  # a few objects: the table held them
    finally:
        cri.close()


@pytest.mark.prometheus
def test_a_repeated_critical_xid_fires_the_shipped_rule_in_prometheus(tmp_path: Path) -> None:
    require_binary(PROMETHEUS_BIN)
    port = free_port()
    with running_collector(tmp_path, metrics_listen=f"127.0.0.1:{port}") as c, \
            SimTracer(c.address, "gpu-node-9") as t:
        t.connect()
        prom = Prometheus(tmp_path / "prometheus", scrape_targets={"ghostgpu": f"127.0.0.1:{port}"},
                          rule_files=[SHIPPED_RULES], interval_s=1.0)
        try:
            xid = fault_record(node="gpu-node-9", gpu=0, affected=(hit(4242),))
            t.wait_acked(t.send_events([fault_event(1, xid)]))
            wait_until(lambda: prom.query('ghostgpu_xid_errors_total{node="gpu-node-9"} == 1'),
                       "the first fault scraped", DEADLINE_S)
            again = fault_record(node="gpu-node-9", gpu=0, affected=(hit(4242),))  # its own kernel log record
            t.wait_acked(t.send_events([fault_event(2, again)]))  # the same Xid again on that GPU

            def firing() -> list[dict[str, Any]]:
                return [a for a in prom.alerts()
                        if a["labels"]["alertname"] == "GhostGPUXidCritical" and a["state"] == "firing"]

            wait_until(firing, "GhostGPUXidCritical firing in Prometheus", DEADLINE_S)
            (alert,) = firing()
            labels = alert["labels"]
            assert (labels["node"], labels["gpu"], labels["xid"], labels["severity"]) == (
                "gpu-node-9", "0", "79", "critical")
            assert alert["annotations"]["summary"] == "Critical GPU fault: Xid 79 on node gpu-node-9 GPU 0"
        finally:
            prom.stop()
