"""Remediation against a real containerd: the issue's "done when" with real parts end to end.

A real `ghostgpu collector` (its YAML config's `remediation:` section), a real `ghostgpu tracer` (BPF,
a fake NVML, CRI through its relay to the real containerd) and two real pods:

- an orphan planted in a real pod whose container was then stopped (tests/helpers/orphan_plant.py:
  CRI says CONTAINER_EXITED, the holder lives on with /dev/nvidia0): in dry-run it is only reported
  (`findings -o json`: `remediation.state` proposed, the process alive); after `ghostgpu remediate
  mode on` the tracer signals it through a pidfd and `findings -o json` says done;
- a GPU job in a running container: never touched, no remediation ever considered for it.

Every step is in the audit chain, and `ghostgpu audit --verify` passes. Every wait polls with a
deadline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.collector_proc import (
    CollectorProcess,
    ghostgpu_cli,
    ps_json,
    remediation_of,
    remediation_state,
)
from tests.helpers.containerd import Containerd
from tests.helpers.fakenvml import FakeGpu, FakeNvml
from tests.helpers.orphan_plant import planted_orphan
from tests.helpers.polling import poll, wait_until
from tests.helpers.tracer_proc import TracerProcess
from tests.helpers.workload import gpuwork_image, job_command
from tests.integration.conftest import GPU0_UUID, require_bpf

pytestmark = [pytest.mark.root, pytest.mark.containerd]

NODE = "node-remedy-ctd"
NS = "ml-remedy"
DEADLINE_S = 60.0  # a tracer start (bcc compiles), CRI calls and a kill's grace on a shared 2-core VM
CONFIG = """\
remediation:
  mode: dry-run
  min_age: 0s
  grace: 1s
  namespaces: {include: ["*"], exclude: ["kube-system"]}
  actions:
    kill_orphans: true
    isolate_node: false
    ticket: {url: "", headers_file: ""}
  breaker: {max_actions: 10, window: 1h, max_per_node: 3, max_isolated_nodes_pct: 10}
"""


def test_a_planted_containerd_orphan_is_reported_in_dry_run_and_killed_in_mode_on(
        containerd: Containerd, tmp_path: Path) -> None:
    require_bpf()
    nvml = FakeNvml(tmp_path / "nvml.conf", gpus=[FakeGpu(index=0, uuid=GPU0_UUID, minor=0)])
    nvml.write()
    config = tmp_path / "collector.yaml"
    config.write_text(CONFIG)
    (tmp_path / "tracer").mkdir()
    # --cri-ttl-s 1: the stopped container is seen EXITED a second after, not at the default 30 s
    collector_args = ["--config", str(config), "--cri-ttl-s", "1"]
    with CollectorProcess(tmp_path / "collector", args=collector_args) as col, \
            TracerProcess(tmp_path / "tracer", ["--grace-s", "0.5", "--cri-endpoint", containerd.endpoint],
                          nvml.env(), NODE, col.address) as tracer:
        tracer.wait_ready(DEADLINE_S)
        live_pod = containerd.run_pod("live-0", NS)
        try:
            image = containerd.import_variant(gpuwork_image())
            live_cid = containerd.create_container(live_pod, "cuda", job_command(),
                                                   devices=[("/dev/null", "/dev/nvidia0")], image=image)
            live_pid = containerd.container_host_pid(live_cid)
            with planted_orphan(containerd, "orphan-0") as orphan:
                assert orphan.cri_state() == "CONTAINER_EXITED" and orphan.holds()

                # dry-run: the orphan is found and proposed, nothing is signalled
                seen: list[dict[str, Any]] = []

                def orphaned() -> bool:
                    seen[:] = [r for r in ps_json(col.address, "--node", NODE) if r["pid"] == orphan.pid]
                    return any(r["class"] == "orphaned" for r in seen)

                if not poll(orphaned, DEADLINE_S):
                    raise AssertionError(f"the planted holder was not found orphaned: {seen}")
                wait_until(lambda: remediation_state(col.address, NODE, orphan.pid) == "proposed",
                           "the orphan's dry run", DEADLINE_S)
                proposed = remediation_of(col.address, NODE, orphan.pid)
                assert proposed is not None and proposed["mode"] == "dry-run"
                assert proposed["action"] == "kill_orphan"
                assert f"pid {orphan.pid}" in proposed["reason"]
                assert orphan.alive() and orphan.holds()

                # mode on: the same incident is acted on; the tracer re-checks and kills it
                out = ghostgpu_cli("remediate", "mode", "on", "--reason", "containerd e2e",
                                   "--collector", col.address)
                assert out.returncode == 0, out.stderr
                wait_until(lambda: remediation_state(col.address, NODE, orphan.pid) == "done",
                           "the orphan killed", DEADLINE_S)
                wait_until(lambda: not orphan.alive(), "the orphan gone", DEADLINE_S)
                done = remediation_of(col.address, NODE, orphan.pid)
                assert done is not None and done["incident"] == proposed["incident"]

            # the live container's holder: untouched, never considered
            assert containerd.container_host_pid(live_cid) == live_pid
            assert remediation_of(col.address, NODE, live_pid) is None
        finally:
            containerd.remove_pod(live_pod.id)

        audit = ghostgpu_cli("audit", "--collector", col.address, "-o", "json", "--since", "1h")
        assert audit.returncode == 0, audit.stderr
        steps = [r["action"] for r in json.loads(audit.stdout) if r["action"].startswith("remediation.")]
        for step in ("decided", "re-checked", "acted", "outcome"):
            assert f"remediation.{step}" in steps, (step, steps)
        verify = ghostgpu_cli("audit", "--collector", col.address, "--verify")
        assert verify.returncode == 0, verify.stdout + verify.stderr
