"""`kubectl ghostgpu` through the real kubectl's plugin mechanism, against a real collector.

kubectl (the binary the image ships; bootstrap installs it) finds `kubectl-ghostgpu` on PATH (the
venv's console script) and runs it; it needs no cluster for that. A real `ghostgpu collector` process
is fed by a simulated tracer over real gRPC (tests/helpers/sim_tracer.py): two GPU holders in two pods
of two namespaces, their containers resolved through the tracer's CRI relay by an in-process runtime
(tests/helpers/cri_fake.py). What kubectl prints is then compared with what was sent.

The port-forward to the collector's Service needs an API server, which this machine has none of: here
the real kubectl is given a kubeconfig whose server refuses connections, so `kubectl port-forward`
accepts the command line the plugin built (a flag it did not know would be "unknown flag") and then
fails, and the plugin says so in one line. The forward's success path is tested with a stand-in child
in tests/unit/test_kubectl_plugin_cli.py.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.cli.client import screen_signature

from ghostgpu.common.model.consumers import ConsumerClass
from tests.helpers.collector_env import QueryClient
from tests.helpers.collector_proc import REPO, CollectorProcess, cluster_rows
from tests.helpers.cri_fake import FakeCri
from tests.helpers.polling import wait_until
from tests.helpers.sim_tracer import SimTracer, finding, make_consumer
from tests.helpers.trace_env import cri_via

KUBECTL = shutil.which("kubectl")
VENV_BIN = Path(sys.executable).parent
NODE = "node-kubectl"
TRAINER_CID, ETL_CID = "c1" * 32, "e7" * 32
TRAINER_PID, ETL_PID = 41001, 41002
DEADLINE_S = 30.0

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (scripts/bootstrap.sh "
                                "install puts it in; Debian: kubernetes-client)")


def require_plugin() -> None:
    if not (VENV_BIN / "kubectl-ghostgpu").exists():
        pytest.fail(f"{VENV_BIN}/kubectl-ghostgpu is missing: run `{VENV_BIN}/pip install -e . --no-deps "
                    "--no-build-isolation` (the console script of pyproject.toml)")


@dataclass
class Cluster:
    collector: str  # HOST:PORT


def kubectl(home: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real kubectl with the venv's bin on PATH; HOME without a kubeconfig unless `env` names one."""
    assert KUBECTL is not None
    base = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "GHOSTGPU_COLLECTOR")}
    base.update({"PATH": f"{VENV_BIN}{os.pathsep}{base.get('PATH', '/usr/bin:/bin')}", "HOME": str(home)})
    return subprocess.run([KUBECTL, *args], capture_output=True, text=True, env={**base, **(env or {})},
                          cwd=REPO, timeout=60, stdin=subprocess.DEVNULL, check=False)


def rows_of(out: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr.strip()}"
    rows = json.loads(out.stdout)
    assert isinstance(rows, list)
    return [r for r in rows if r.get("node") == NODE]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A collector holding two GPU holders of node-kubectl: ml/trainer-0 (hidden) and etl/loader-0
    (orphaned), each with an open finding."""
    require_plugin()
    tmp = tmp_path_factory.mktemp("kubectl-plugin")
    with FakeCri() as runtime, CollectorProcess(tmp / "collector", unix=False) as col:
        runtime.add_sandbox("sb-trainer", "trainer-0", "ml", "uid-trainer")
        runtime.add_container(TRAINER_CID, "sb-trainer", "train")
        runtime.add_sandbox("sb-loader", "loader-0", "etl", "uid-loader")
        runtime.add_container(ETL_CID, "sb-loader", "load")
        trainer = make_consumer(NODE, TRAINER_PID, container_id=TRAINER_CID, cls=ConsumerClass.HIDDEN)
        loader = make_consumer(NODE, ETL_PID, gpu=1, container_id=ETL_CID, cls=ConsumerClass.ORPHANED)
        with SimTracer(col.address, NODE, cri=cri_via(runtime)) as tracer, QueryClient(col.address) as q:
            welcome = tracer.connect()
            tracer.send_snapshot([trainer, loader], seq=welcome.acked_seq)
            last = tracer.send_events([finding(welcome.acked_seq + 1, trainer),
                                       finding(welcome.acked_seq + 2, loader)])
            tracer.wait_acked(last)
            want = {(TRAINER_PID, "ml"), (ETL_PID, "etl")}
            wait_until(lambda: {(r["pid"], r["namespace"]) for r in cluster_rows(q) if r["node"] == NODE}
                       == want, "both holders resolved to their pods", DEADLINE_S)
            yield Cluster(col.address)


def test_kubectl_plugin_list_shows_it_without_a_cluster(tmp_path: Path) -> None:
    require_plugin()
    out = kubectl(tmp_path, "plugin", "list")
    assert out.returncode == 0, out.stderr
    assert f"{VENV_BIN}/kubectl-ghostgpu" in out.stdout.splitlines()


def test_ps_through_kubectl_shows_what_the_tracer_sent(cluster: Cluster, tmp_path: Path) -> None:
    rows = {r["pid"]: r for r in rows_of(kubectl(tmp_path, "ghostgpu", "ps", "--collector", cluster.collector,
                                                 "-o", "json"))}
    assert set(rows) == {TRAINER_PID, ETL_PID}
    trainer, loader = rows[TRAINER_PID], rows[ETL_PID]
    assert (trainer["namespace"], trainer["pod"], trainer["container"], trainer["class"], trainer["gpu"]) == (
        "ml", "trainer-0", "train", "hidden", 0)
    assert (loader["namespace"], loader["pod"], loader["container"], loader["class"], loader["gpu"]) == (
        "etl", "loader-0", "load", "orphaned", 1)
    assert trainer["cmdline"] == "python3 train.py --epochs 90" and trainer["container_id"] == TRAINER_CID


def test_ps_is_the_same_as_ghostgpu_ps(cluster: Cluster, tmp_path: Path) -> None:
    """Same parser, same handler: the table and the JSON are ghostgpu's own."""
    via_kubectl = kubectl(tmp_path, "ghostgpu", "ps", "--collector", cluster.collector, "--node", NODE)
    direct = subprocess.run([sys.executable, "-m", "ghostgpu.cli", "ps", "--collector", cluster.collector,
                             "--node", NODE], capture_output=True, text=True, cwd=REPO, timeout=60,
                            check=False)
    assert via_kubectl.returncode == direct.returncode == 0, via_kubectl.stderr + direct.stderr
    assert screen_signature(via_kubectl.stdout) == screen_signature(direct.stdout)  # ages may tick between
    assert "trainer-0" in via_kubectl.stdout and "loader-0" in via_kubectl.stdout


def test_namespace_flags(cluster: Cluster, tmp_path: Path) -> None:
    ml = rows_of(kubectl(tmp_path, "ghostgpu", "ps", "-n", "ml", "--collector", cluster.collector,
                         "-o", "json"))
    assert [(r["pid"], r["namespace"]) for r in ml] == [(TRAINER_PID, "ml")]
    every = rows_of(kubectl(tmp_path, "ghostgpu", "ps", "-A", "--collector", cluster.collector, "-o", "json"))
    assert {r["pid"] for r in every} == {TRAINER_PID, ETL_PID}
    both = kubectl(tmp_path, "ghostgpu", "ps", "-A", "-n", "ml", "--collector", cluster.collector)
    assert both.returncode == 2 and both.stdout == ""
    assert both.stderr == ("kubectl ghostgpu: -n/--namespace ml and -A/--all-namespaces: give one (-A is "
                           "every namespace, and the default without -n)\n")


def test_findings_through_kubectl(cluster: Cluster, tmp_path: Path) -> None:
    def found() -> list[dict[str, Any]]:
        return rows_of(kubectl(tmp_path, "ghostgpu", "findings", "--collector", cluster.collector,
                               "-o", "json"))

    rows: list[dict[str, Any]] = []

    def both_open() -> bool:
        nonlocal rows
        rows = found()
        return {r["pid"] for r in rows} >= {TRAINER_PID, ETL_PID}

    wait_until(both_open, "both findings in `kubectl ghostgpu findings`", DEADLINE_S)
    by_pid = {r["pid"]: r for r in rows}
    assert (by_pid[ETL_PID]["class"], by_pid[ETL_PID]["resolved"]) == ("orphaned", None)
    etl = rows_of(kubectl(tmp_path, "ghostgpu", "findings", "--namespace", "etl", "--collector",
                          cluster.collector, "-o", "json"))
    assert {r["pid"] for r in etl} == {ETL_PID}


def test_other_commands_are_refused_in_one_line(tmp_path: Path) -> None:
    require_plugin()
    out = kubectl(tmp_path, "ghostgpu", "collector", "--listen", "127.0.0.1:0")
    assert out.returncode == 2
    assert out.stderr == ("kubectl ghostgpu: `collector` is not a kubectl verb: run `ghostgpu collector ...` "
                          "(the plugin runs ps, findings, faults, trace, audit)\n")


def refused_port() -> int:
    """A loopback port nobody listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_port_forward_command_line_is_kubectls_and_its_failure_one_line(tmp_path: Path) -> None:
    """No --collector, a kubeconfig: the real `kubectl port-forward` runs with the plugin's flags, reaches
    for the API server (which refuses: there is none), and the plugin prints kubectl's reason."""
    require_plugin()
    port = refused_port()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: none, cluster: {{server: "https://127.0.0.1:{port}"}}}}]
users: [{{name: u, user: {{token: not-a-token}}}}]
contexts: [{{name: nowhere, context: {{cluster: none, user: u}}}}]
current-context: nowhere
""")
    out = kubectl(tmp_path, "ghostgpu", "ps", "--context", "nowhere", "--ghostgpu-namespace", "obs",
                  "--collector-service", "gg-collector", env={"KUBECONFIG": str(kubeconfig)})
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("kubectl ghostgpu: kubectl port-forward to service/gg-collector in "
                                 "namespace obs exited with status 1 before forwarding: "), out.stderr
    assert f"127.0.0.1:{port}" in out.stderr and "refused" in out.stderr
    assert "unknown flag" not in out.stderr
