"""`ghostgpu remediate` and `findings -o json`'s remediation, against a real collector (loopback gRPC)
and a simulated tracer that answers RemediateCommands: the config's dry-run only proposes, `remediate
mode on` acts, pause refuses a kill by hand naming who paused, a finding not orphaned is refused in one
line, and every step is in the audit chain, which verifies."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.cli.main import main
from ghostgpu.collector.audit import record_from_row, select_audit
from ghostgpu.collector.main import Collector

from ghostgpu.common.audit.chain import verify
from ghostgpu.common.model.consumers import ConsumerClass
from tests.helpers.collector_env import running_collector
from tests.helpers.polling import wait_until
from tests.helpers.sim_tracer import SimTracer, make_consumer

# Only a Kubernetes pod's orphan is a candidate: a container and its pod's UID
IN_POD = {"container_id": "c0ffee" * 8, "pod_uid": "6d1f2a3b-0000-4000-8000-000000000001"}

CONFIG = """\
remediation:
  mode: dry-run
  min_age: 0s
  grace: 1s
"""


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[Collector]:
    config = tmp_path / "collector.yaml"
    config.write_text(CONFIG)
    with running_collector(tmp_path, config_path=str(config)) as c:
        yield c


@pytest.fixture
def tracer(collector: Collector) -> Iterator[SimTracer]:
    with SimTracer(collector.address, "gpu-1", capabilities=("cri-relay", "remediation")) as t:
        t.connect()
        yield t


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def finding_rows(collector: Collector, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    code, out, _ = cli(capsys, "findings", "--collector", collector.address, "-o", "json")
    assert code == 0
    rows: list[dict[str, Any]] = json.loads(out)
    return rows


def test_dry_run_proposes_mode_on_acts_and_findings_show_it(collector: Collector, tracer: SimTracer,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    tracer.send_snapshot([make_consumer("gpu-1", 4242, cls=ConsumerClass.ORPHANED, **IN_POD),
                          make_consumer("gpu-1", 5151, cls=ConsumerClass.HIDDEN)])
    wait_until(lambda: len(tracer.remediate_commands) == 1, "the dry run's re-check", 10)
    assert tracer.remediate_commands[0].dry_run and tracer.remediate_commands[0].process.pid == 4242

    def state(pid: int) -> dict[str, Any] | None:
        row = next(r for r in finding_rows(collector, capsys) if r["pid"] == pid)
        out: dict[str, Any] | None = row["remediation"]
        return out

    wait_until(lambda: (state(4242) or {}).get("state") == "proposed", "a proposed incident", 10)
    proposed = state(4242)
    assert proposed is not None and proposed["reason"].startswith("dry-run: would SIGTERM pid 4242 (python3)")
    assert proposed["action"] == "kill_orphan" and proposed["mode"] == "dry-run"
    assert isinstance(proposed["at"], float) and proposed["incident"].endswith("/kill_orphan")
    assert state(5151) is None

    code, out, _ = cli(capsys, "remediate", "status", "--collector", collector.address, "-o", "json")
    assert code == 0 and json.loads(out)["mode"] == "dry-run"
    code, out, _ = cli(capsys, "remediate", "mode", "on", "--collector", collector.address, "--reason", "go")
    assert code == 0 and out.startswith("mode      on (config file: dry-run, override on)")
    wait_until(lambda: any(not c.dry_run for c in tracer.remediate_commands), "the kill", 10)
    wait_until(lambda: (state(4242) or {}).get("state") == "done", "the incident done", 10)
    done = state(4242)
    assert done is not None and done["audit_seq"] > 0

    hidden = next(r for r in finding_rows(collector, capsys) if r["pid"] == 5151)["id"]
    code, _, err = cli(capsys, "remediate", "--finding", str(hidden), "--collector", collector.address)
    assert code == 2
    assert err.strip() == (f"ghostgpu: remediate: finding {hidden} is hidden, not orphaned: only orphaned "
                           "holders are killed")
    code, _, err = cli(capsys, "remediate", "--finding", "999", "--collector", collector.address)
    assert code == 2 and "no finding 999" in err

    records = [record_from_row(r) for r in collector.store.read(select_audit()).result(10)]
    actions = [r.action for r in records if hasattr(r, "action")]
    for step in ("decided", "re-checked", "acted", "outcome", "mode"):
        assert f"remediation.{step}" in actions
    assert verify(records, from_start=True).ok


def test_pause_refuses_a_kill_by_hand_and_resume_lets_it(collector: Collector, tracer: SimTracer,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "remediate", "pause", "--reason", "maintenance", "--collector",
                       collector.address)
    assert code == 0 and "paused    yes, by uid:" in out
    tracer.send_snapshot([make_consumer("gpu-1", 4242, cls=ConsumerClass.ORPHANED, **IN_POD)])
    wait_until(lambda: bool(finding_rows(collector, capsys)), "the finding", 10)
    fid = finding_rows(collector, capsys)[0]["id"]
    code, _, err = cli(capsys, "remediate", "--finding", str(fid), "--collector", collector.address)
    assert code == 2 and "remediation is paused by uid:" in err and "ghostgpu remediate resume" in err
    assert not any(not c.dry_run for c in tracer.remediate_commands)
    code, out, _ = cli(capsys, "remediate", "--finding", str(fid), "--dry-run", "--collector",
                       collector.address)
    assert code == 0 and out.startswith(f"finding {fid}: proposed: dry-run: would SIGTERM pid 4242")
    assert cli(capsys, "remediate", "resume", "--collector", collector.address)[0] == 0
    code, out, _ = cli(capsys, "remediate", "--finding", str(fid), "--collector", collector.address, "-o",
                       "json")
    assert code == 0
    answer = json.loads(out)
    assert (answer["state"], answer["mode"]) == ("done", "manual")
    assert [c.dry_run for c in tracer.remediate_commands][-2:] == [True, False]


@pytest.mark.parametrize(("argv", "line"), [
    (["remediate"], "ghostgpu: remediate: give --finding ID, or one of pause, resume, mode MODE, status"),
    (["remediate", "mode", "yes"], "ghostgpu: remediate mode 'yes': use one of off, dry-run, on, or config "
                                   "to go back to the config file's"),
    (["remediate", "pause", "--dry-run"], "ghostgpu: --dry-run goes with --finding"),
    (["remediate", "stop"], "ghostgpu: remediate 'stop': use --finding ID, or one of pause, resume, mode, "
                            "status"),
    (["remediate", "--finding", "0"],
     "ghostgpu: --finding 0: a finding id is 1 or more (`ghostgpu findings`)"),
    (["remediate", "status", "-o", "yaml"], "ghostgpu: -o 'yaml': use one of text, json"),
])
def test_bad_flags_are_one_line(argv: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, *argv)
    assert code == 2 and err.strip() == line
