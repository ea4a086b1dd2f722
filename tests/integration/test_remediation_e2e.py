"""Remediation end to end, real parts only: a real `ghostgpu collector` process (its config's
`remediation:` section), a real `ghostgpu tracer` (BPF, a fake NVML, its CRI relay to an in-process
runtime, tests/helpers/cri_fake.py) and real processes in fake containers (tests/helpers/container.py).

- An orphan: a holder of /dev/nvidia0 in a fake container CRI does not know (orphaned). In dry-run it
  is only reported: `findings -o json` shows `remediation.state` proposed, and it lives on. After
  `ghostgpu remediate mode on` the collector kills it through the tracer (SIGTERM, then SIGKILL: a
  container's init ignores SIGTERM), and `findings -o json` shows `done`.
- A holder in a live container (CRI says CONTAINER_RUNNING) is never touched.
- Every step is in the audit chain, and `ghostgpu audit --verify` passes.
- Against Debian's real Alertmanager (no root needed): the orphan's alert carries the dry run's
  `remediation` annotation, and GhostGPURemediationPaused fires while mode on is paused, and
  leaves the active alerts on resume.

Every wait polls with a deadline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.cli.main import main

from ghostgpu.common.model.consumers import ConsumerClass
from tests.helpers.collector_env import running_collector
from tests.helpers.collector_proc import CollectorProcess, ghostgpu_cli, remediation_of, remediation_state
from tests.helpers.container import FakeContainer
from tests.helpers.cri_fake import FakeCri
from tests.helpers.fakenvml import FakeGpu, FakeNvml
from tests.helpers.polling import wait_until
from tests.helpers.promstack import Alertmanager, alertmanager  # noqa: F401  (fixture)
from tests.helpers.sim_tracer import SimTracer, make_consumer
from tests.helpers.tracer_proc import TracerProcess
from tests.integration.conftest import GPU0_UUID

NODE = "node-remedy"
NS, POD = "ml-remedy", "live-0"
DEADLINE_S = 45.0  # a tracer start (bcc compiles), CRI lookups, and a kill's grace, on a shared VM
CONFIG = """\
remediation:
  mode: dry-run
  min_age: 0s
  grace: 1s
  namespaces: {include: ["*"], exclude: ["kube-system"]}
"""


# Only a Kubernetes pod's orphan is a candidate: a container and its pod's UID
IN_POD = {"container_id": "c0ffee" * 8, "pod_uid": "6d1f2a3b-0000-4000-8000-000000000001"}


def alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.root
@pytest.mark.bpf
@pytest.mark.usefixtures("root_bpf")
def test_dry_run_reports_mode_on_kills_the_orphan_and_leaves_the_live_holder(tmp_path: Path) -> None:
    nvml = FakeNvml(tmp_path / "nvml.conf", gpus=[FakeGpu(index=0, uuid=GPU0_UUID, minor=0)])
    nvml.write()
    config = tmp_path / "collector.yaml"
    config.write_text(CONFIG)
    (tmp_path / "tracer").mkdir()
    cri = FakeCri(runtime_name="containerd").start()  # the runtime the tracer's cgroups name
    try:
        with FakeContainer() as orphan_box, FakeContainer() as live_box, \
                CollectorProcess(tmp_path / "collector", args=["--config", str(config)]) as col:
            cri.add_sandbox("sb-live", POD, NS, live_box.pod_uid)
            cri.add_container(live_box.container_id, "sb-live", "main")  # running: never touched
            args = ["--grace-s", "0.5", "--cri-endpoint", cri.endpoint]
            with TracerProcess(tmp_path / "tracer", args, nvml.env(), NODE, col.address) as tracer:
                tracer.wait_ready(DEADLINE_S)
                orphan = orphan_box.run(["open", "/dev/nvidia0", "ready", "wait"])
                orphan.wait_ready()
                live = live_box.run(["open", "/dev/nvidia0", "ready", "wait"])
                live.wait_ready()

                # dry-run: proposed, and the orphan lives on
                wait_until(lambda: remediation_state(col.address, NODE, orphan.host_pid) == "proposed",
                           "the orphan's dry run", DEADLINE_S)
                proposed = remediation_of(col.address, NODE, orphan.host_pid)
                assert proposed is not None and proposed["mode"] == "dry-run"
                assert proposed["reason"].startswith(f"dry-run: would SIGTERM pid {orphan.host_pid}")
                assert alive(orphan.host_pid)

                out = ghostgpu_cli("remediate", "mode", "on", "--reason", "e2e", "--collector", col.address)
                assert out.returncode == 0, out.stderr
                wait_until(lambda: remediation_state(col.address, NODE, orphan.host_pid) == "done",
                           "the orphan killed", DEADLINE_S)
                wait_until(lambda: not alive(orphan.host_pid), "the orphan gone", DEADLINE_S)
                done = remediation_of(col.address, NODE, orphan.host_pid)
                assert done is not None and done["audit_seq"] > 0

                # the holder in a live container: alive, and no remediation ever considered it
                assert alive(live.host_pid)
                assert remediation_of(col.address, NODE, live.host_pid) is None

                audit = ghostgpu_cli("audit", "--collector", col.address, "-o", "json", "--since", "1h")
                assert audit.returncode == 0, audit.stderr
                actions = [r["action"] for r in json.loads(audit.stdout)]
                for step in ("decided", "re-checked", "acted", "outcome", "mode"):
                    assert f"remediation.{step}" in actions, step
                verify = ghostgpu_cli("audit", "--collector", col.address, "--verify")
                assert verify.returncode == 0, verify.stdout + verify.stderr
    finally:
        cri.close()


@pytest.mark.prometheus
def test_the_alert_carries_the_dry_run_and_the_paused_alert_fires(alertmanager: Alertmanager,  # noqa: F811
                                                                   tmp_path: Path) -> None:
    config = tmp_path / "collector.yaml"
    config.write_text(CONFIG)
    with running_collector(tmp_path, config_path=str(config), alertmanager=[alertmanager.url]) as c, \
            SimTracer(c.address, "gpu-node-8", capabilities=("cri-relay", "remediation")) as t:
        t.connect()
        t.send_snapshot([make_consumer("gpu-node-8", 4242, cls=ConsumerClass.ORPHANED, **IN_POD)])

        def annotated() -> dict[str, Any] | None:
            for a in alertmanager.alerts(alertname="GhostGPUOrphanedConsumer", pid="4242"):
                if a["annotations"].get("remediation", "").startswith("dry-run: would SIGTERM pid 4242"):
                    return a
            return None

        wait_until(lambda: annotated() is not None, "the dry run in the orphan's alert", 15)
        assert main(["remediate", "pause", "--reason", "drill", "--collector", c.address]) == 0
        assert main(["remediate", "mode", "on", "--collector", c.address]) == 0
        alert = alertmanager.wait_alert("GhostGPURemediationPaused", timeout_s=15)
        assert alert["labels"] == {"alertname": "GhostGPURemediationPaused", "severity": "warning",
                                   "source": "ghostgpu-collector"}
        assert "paused (by uid:" in alert["annotations"]["summary"]
        assert not any(not cmd.dry_run for cmd in t.remediate_commands)  # paused: nothing killed
        assert main(["remediate", "resume", "--collector", c.address]) == 0
        alertmanager.wait_gone("GhostGPURemediationPaused", timeout_s=15)


@pytest.mark.postgres
def test_a_replica_hands_remediate_to_the_one_serving_the_node(tmp_path: Path, postgres_dsn: str) -> None:
    """Two replicas on one PostgreSQL: the sim tracer streams to a; `ghostgpu remediate --finding` on b
    goes to a through replica_commands (the store's SQL on PostgreSQL: the incident stored once, acted
    once), and `findings -o json` on b shows it done."""
    from tests.helpers.replicas import replica

    config = tmp_path / "collector.yaml"
    # dry-run asked for (a kill by hand is refused while the mode is off), min_age keeping the engine's
    # own dry run away: the commands the tracer sees are the manual path's only
    config.write_text(CONFIG.replace("min_age: 0s", "min_age: 1h"))
    settings = {"config_path": str(config)}
    with replica(tmp_path, postgres_dsn, "a", settings=settings, listening_s=DEADLINE_S) as a, \
            replica(tmp_path, postgres_dsn, "b", settings=settings, listening_s=DEADLINE_S) as b, \
            SimTracer(a.address, "gpu-node-9", capabilities=("cri-relay", "remediation")) as t:
        t.connect()
        t.send_snapshot([make_consumer("gpu-node-9", 4242, cls=ConsumerClass.ORPHANED, **IN_POD)])

        def rows() -> list[dict[str, Any]]:
            out = ghostgpu_cli("findings", "--collector", b.address, "-o", "json")
            assert out.returncode == 0, out.stderr
            found: list[dict[str, Any]] = json.loads(out.stdout)
            return [r for r in found if r["node"] == "gpu-node-9"]

        wait_until(lambda: bool(rows()), "the finding, read on b", DEADLINE_S)
        fid = rows()[0]["id"]
        out = ghostgpu_cli("remediate", "--finding", str(fid), "-o", "json", "--collector", b.address)
        assert out.returncode == 0, out.stderr
        answer = json.loads(out.stdout)
        assert (answer["state"], answer["mode"]) == ("done", "manual")
        assert [c.dry_run for c in t.remediate_commands] == [True, False]
        assert rows()[0]["remediation"]["state"] == "done"
        again = ghostgpu_cli("remediate", "--finding", str(fid), "-o", "json", "--collector", b.address)
        assert again.returncode == 0 and json.loads(again.stdout)["state"] == "done"
        assert [c.dry_run for c in t.remediate_commands] == [True, False]  # never acted twice
