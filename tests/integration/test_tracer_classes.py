"""The real tracer's verdicts for the hard cases: node-wide holders, PIDs NVML lists that hold no GPU
device file (reused, or MPS clients), a container process named like an allowlisted daemon, and the
grace period that `unknown` waits out too.

Holders that must come out `hidden` whatever the kernel's allocation capture says start before the
tracer: found by its first /proc scan, they have no call history, so they are judged by their
mappings (none here): `hidden`, with the evidence called incomplete.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.container import FakeContainer
from tests.helpers.fakenvml import FakeNvml, FakeProc
from tests.helpers.tracer_proc import TracerProcess
from tests.integration.conftest import GPU0_UUID

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.usefixtures("root_bpf")]

FAST = ["--grace-s", "0.5"]
NODE_WIDE = {"nvidiactl": (1, 3), "nvidia-uvm": (1, 3)}  # no /dev/nvidiaN in this container


def finding(pid: int, cls: str | None = None, gpu: object = "any"):
    def pred(r: dict[str, Any]) -> bool:
        return (r.get("event") == "finding" and r.get("pid") == pid and (cls is None or r.get("class") == cls)
                and (gpu == "any" or r.get("gpu") == gpu))

    return pred


def snapshot(fake_nvml: FakeNvml, *args: str) -> str:
    argv = [sys.executable, "-m", "ghostgpu.cli", "snapshot", "--node-name", "snap", "--grace-s", "0", *args]
    return subprocess.run(argv, env={**os.environ, **fake_nvml.env()}, capture_output=True, text=True,
                          timeout=60, check=True).stdout


def test_a_holder_of_node_wide_devices_only_is_a_consumer_with_no_gpu(tmp_path: Path,
                                                                     fake_nvml: FakeNvml) -> None:
    with FakeContainer(devices=NODE_WIDE) as c:
        before = c.run(["open", "/dev/nvidiactl", "open", "/dev/nvidia-uvm", "ready", "wait"])
        before.wait_ready()
        with TracerProcess(tmp_path, FAST, fake_nvml.env()) as tracer:
            rec = tracer.wait_for(finding(before.host_pid, "hidden"), what="node-wide holder, hidden")
            assert (rec["gpu"], rec["gpu_uuid"], rec["gpu_minor"]) == (None, "", None)
            assert rec["devices"] == ["/dev/nvidia-uvm", "/dev/nvidiactl"]
            assert rec["container_id"] == c.container_id and rec["ns_pid"] == 1
            assert "holds only node-wide devices /dev/nvidia-uvm (fd " in rec["reason"]
            assert "/dev/nvidiactl (fd " in rec["reason"]
            assert "evidence is incomplete" in rec["reason"]
            # One opened while the tracer watches is reported too, past its grace period (hidden, or
            # monitor where the kernel saw it allocate nothing).
            fresh = c.run(["open", "/dev/nvidia-uvm", "ready", "wait"])
            fresh.wait_ready()
            rec = tracer.wait_for(lambda r: finding(fresh.host_pid, gpu=None)(r) and r["class"] != "pending",
                                  what="fresh node-wide holder past its grace")
            assert rec["class"] in ("hidden", "monitor") and rec["devices"] == ["/dev/nvidia-uvm"]
            fresh.release()
            tracer.wait_for(lambda r: r.get("event") == "resolved" and r.get("pid") == fresh.host_pid,
                            what="resolved when it exits")
        rows = [r for r in json.loads(snapshot(fake_nvml, "-o", "json")) if r["pid"] == before.host_pid]
        assert [(r["gpu"], r["class"], r["devices"]) for r in rows] == [
            (None, "hidden", ["/dev/nvidia-uvm", "/dev/nvidiactl"])]
        header, *rows = snapshot(fake_nvml).splitlines()
        [row] = [line.split() for line in rows if f" {before.host_pid} " in f" {line} "]
        assert (header.split()[0], row[0]) == ("GPU", "-")


def test_a_listed_pid_holding_no_gpu_file_was_reused_unless_mps_serves_it(tmp_path: Path,
                                                                          fake_nvml: FakeNvml) -> None:
    with TracerProcess(tmp_path, FAST, fake_nvml.env()) as tracer, FakeContainer() as client_c, \
            FakeContainer() as server_c:
        tracer.wait_ready()
        client = client_c.run(["ready", "wait"])  # alive, and holds no device file at all
        client.wait_ready()
        fake_nvml.update(procs=[FakeProc(gpu=0, pid=client.host_pid, used_bytes=1 << 30)])
        ghost = tracer.wait_for(finding(client.host_pid, "ghost"), what="ghost: the PID was reused")
        assert (ghost["gpu"], ghost["gpu_uuid"], ghost["gpu_memory_bytes"]) == (0, GPU0_UUID, 1 << 30)
        assert "holds no GPU device file" in ghost["reason"] and "reused" in ghost["reason"]
        assert ghost["alive"] is False and ghost["container_id"] == ""  # not the live process's identity
        # An MPS server (comm cut to 15 bytes: nvidia-cuda-mps) holds GPU 0 for its clients.
        server = server_c.run(["rename", "nvidia-cuda-mps-server", "open", "/dev/nvidia0", "ready", "wait"])
        server.wait_ready()
        visible = tracer.wait_for(finding(client.host_pid, "visible"), what="visible through MPS")
        assert visible["gpu"] == 0 and visible["alive"] is True
        assert (f"through MPS: the MPS server nvidia-cuda-mps (PID {server.host_pid}) holds the GPU's device "
                "file") in visible["reason"]
        server.release()
        tracer.wait_for(lambda r: finding(client.host_pid, "ghost")(r) and r["ts"] > visible["ts"],
                        what="a ghost again once the server is gone")


def test_a_container_process_named_like_an_allowlisted_daemon_is_not_system(tmp_path: Path,
                                                                           fake_nvml: FakeNvml) -> None:
    with FakeContainer() as c:
        p = c.run(["rename", "nv-hostengine", "open", "/dev/nvidia0", "ready", "wait"])
        p.wait_ready()
        with TracerProcess(tmp_path, FAST, fake_nvml.env()) as tracer:
            rec = tracer.wait_for(finding(p.host_pid, "hidden"), what="hidden impersonator")
            assert rec["comm"] == "nv-hostengine" and rec["allowlisted"] == "nv-hostengine"
            assert (f"it impersonates allowlisted node daemon nv-hostengine: it runs in container "
                    f"{c.container_id[:12]}") in rec["reason"]
            assert tracer.matching(finding(p.host_pid, "system")) == []


def test_unknown_waits_out_the_grace_period(tmp_path: Path, fake_nvml: FakeNvml) -> None:
    """With NVML unavailable, a holder that lives 20 ms opens no finding; one that stays is unknown."""
    fake_nvml.update(fail_init="NVML_ERROR_DRIVER_NOT_LOADED")
    with FakeContainer() as c:
        stays = c.run(["open", "/dev/nvidia0", "ready", "wait"])
        stays.wait_ready()
        with TracerProcess(tmp_path, ["--grace-s", "2"], fake_nvml.env()) as tracer:
            tracer.wait_ready()
            brief = c.run(["open", "/dev/nvidia0", "sleep", "20", "exit", "0"])
            assert brief.wait_exit(5.0) == 0
            exited = tracer.wait_for(lambda r: r.get("event") == "exit" and r.get("pid") == brief.init_pid,
                                     what="the brief holder's exit")
            assert 0.015 <= exited["held_s"] < 2
            rec = tracer.wait_for(finding(stays.host_pid, "unknown"), what="the lasting holder, unknown")
            assert "NVML is unavailable" in rec["reason"]
        classes = {r["class"] for r in tracer.matching(finding(brief.init_pid))}
        assert classes <= {"pending"}, classes
