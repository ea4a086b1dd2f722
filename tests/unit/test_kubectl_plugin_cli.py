"""`kubectl ghostgpu` (cli/kubectl_plugin.py) and its port-forward (cli/port_forward.py), without kubectl.

The port-forward to the collector's Service cannot run here end to end (no API server): its command
line is tested as a pure function, table-driven; kubectl's ready line by its parser; and the child's
life cycle (ready, failed start, timeout, SIGKILL after an ignored SIGTERM, its process group, a flood
of output, the plugin killed or terminated) with a stand-in child, tests/helpers/port_forward_standin.py
passed as the kubectl path. The stand-in tests our code that runs a child; it does not pretend to be
kubectl (tests/integration/test_kubectl_plugin.py runs the real one, and its refused port-forward).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from ghostgpu.cli import kubectl_plugin as plugin
from ghostgpu.cli.port_forward import (
    ForwardTarget,
    PortForward,
    PortForwardError,
    kubeconfig_present,
    parse_forwarding,
    port_forward_command,
)

from tests.helpers.polling import wait_until

REPO = Path(__file__).resolve().parents[2]
STANDIN = REPO / "tests" / "helpers" / "port_forward_standin.py"
DEADLINE_S = 20.0


# ---- the command line ------------------------------------------------------------------------------

@pytest.mark.parametrize(("target", "port", "want"), [
    # No local port: kubectl picks a free one and binds it at once (no window for another process).
    (ForwardTarget(), None,
     ["kubectl", "port-forward", "--namespace", "ghostgpu", "--address", "127.0.0.1",
      "service/ghostgpu-collector", ":7450"]),
    (ForwardTarget(), 40001,
     ["kubectl", "port-forward", "--namespace", "ghostgpu", "--address", "127.0.0.1",
      "service/ghostgpu-collector", "40001:7450"]),
    (ForwardTarget(context="prod-eu"), 40002,
     ["kubectl", "port-forward", "--context", "prod-eu", "--namespace", "ghostgpu", "--address", "127.0.0.1",
      "service/ghostgpu-collector", "40002:7450"]),
    (ForwardTarget(kubeconfig="/home/u/.kube/prod"), 40003,
     ["kubectl", "port-forward", "--kubeconfig", "/home/u/.kube/prod", "--namespace", "ghostgpu", "--address",
      "127.0.0.1", "service/ghostgpu-collector", "40003:7450"]),
    (ForwardTarget(namespace="gpu-obs", service="gg-collector", remote_port=8450, context="c",
                   kubeconfig="/k"), 40004,
     ["kubectl", "port-forward", "--kubeconfig", "/k", "--context", "c", "--namespace", "gpu-obs",
      "--address", "127.0.0.1", "service/gg-collector", "40004:8450"]),
])
def test_port_forward_command(target: ForwardTarget, port: int | None, want: list[str]) -> None:
    assert port_forward_command("kubectl", target, port) == want


@pytest.mark.parametrize(("target", "name"), [
    (ForwardTarget(), "ghostgpu-collector.ghostgpu.svc"),
    (ForwardTarget(namespace="gpu-obs", service="gg-collector"), "gg-collector.gpu-obs.svc"),
])
def test_the_name_checked_is_the_charts_certificate_name(target: ForwardTarget, name: str) -> None:
    assert target.server_name == name


@pytest.mark.parametrize(("line", "want"), [
    ("Forwarding from 127.0.0.1:40001 -> 7450\n", ("127.0.0.1", 40001, 7450)),
    ("Forwarding from 127.0.0.1:40001 -> 7450\r\n", ("127.0.0.1", 40001, 7450)),
    ("Forwarding from [::1]:40001 -> 7450", ("::1", 40001, 7450)),
    ("Handling connection for 40001", None),
    ("Forwarding from 10.0.0.1:40001 -> 7450", None),  # not the address asked for
    ("Forwarding from 127.0.0.1:99999 -> 7450", None),
    ("Forwarding from 127.0.0.1:0 -> 7450", None),
    ("forwarding from 127.0.0.1:40001 -> 7450", None),
    ("", None),
])
def test_parse_forwarding(line: str, want: tuple[str, int, int] | None) -> None:
    assert parse_forwarding(line) == want


def test_kubeconfig_present(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".kube").mkdir(parents=True)
    other = tmp_path / "other.yaml"
    other.write_text("apiVersion: v1\n")
    gone = str(tmp_path / "gone.yaml")
    assert kubeconfig_present("/anything", {}, str(tmp_path / "nohome"))  # --kubeconfig: kubectl's to judge
    assert not kubeconfig_present(None, {}, str(home))
    assert kubeconfig_present(None, {"KUBECONFIG": f"{gone}{os.pathsep}{other}"}, str(home))
    assert not kubeconfig_present(None, {"KUBECONFIG": gone}, str(home))
    (home / ".kube" / "config").write_text("apiVersion: v1\n")
    assert kubeconfig_present(None, {}, str(home))
    assert not kubeconfig_present(None, {"KUBECONFIG": gone}, str(home))  # $KUBECONFIG wins, as in kubectl


# ---- the plugin's arguments ------------------------------------------------------------------------

def test_plugin_flags_are_taken_out_and_the_rest_kept_in_order() -> None:
    flags, rest = plugin.split_args(["ps", "-n", "ml", "--context", "prod", "-A", "-o", "json",
                                     "--kubeconfig=/k", "--ghostgpu-namespace", "obs", "--class", "hidden"])
    assert rest == ["ps", "-n", "ml", "-o", "json", "--class", "hidden"]
    assert (flags.context, flags.kubeconfig, flags.all_namespaces, flags.ghostgpu_namespace,
            flags.collector_service, flags.collector_port) == (
        "prod", "/k", True, "obs", "ghostgpu-collector", 7450)
    assert plugin.find_verb(["-v", "ps", "-n", "x"]) == "ps"
    assert plugin.find_verb(["--help"]) is None


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = plugin.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize(("argv", "want"), [
    (["collector", "--listen", "0.0.0.0:7450"],
     "`collector` is not a kubectl verb: run `ghostgpu collector ...`"),
    (["up"], "`up` is not a kubectl verb: run `ghostgpu up ...`"),
    (["remediate", "pause"], "`remediate` is not a kubectl verb: run `ghostgpu remediate ...`"),
    (["get", "pods"], "unknown command 'get': use one of ps, findings, faults, trace, audit"),
    ([], "give a command: ps, findings, faults, trace, audit"),
    (["--collector", "10.0.0.5:7450", "ps"],
     "--collector 10.0.0.5:7450: a command's flags go after it: "
     "kubectl ghostgpu ps --collector 10.0.0.5:7450"),
    (["ps", "-A", "-n", "ml"], "-n/--namespace ml and -A/--all-namespaces: give one"),
    (["findings", "--all-namespaces", "--namespace=ml"],
     "-n/--namespace ml and -A/--all-namespaces: give one"),
    (["trace", "-A", "--pod", "p"], "-A/--all-namespaces: `trace` has no namespace filter"),
    (["audit", "-A"], "-A/--all-namespaces: `audit` has no namespace filter"),
    (["ps", "--collector-port", "70000"], "--collector-port 70000: a port is 1 to 65535"),
    (["ps", "--context"], "argument --context: expected one argument"),
])
def test_refusals_are_one_line(argv: list[str], want: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_main(argv, capsys)
    assert rc == 2 and out == ""
    assert err.startswith(f"kubectl ghostgpu: {want}") and err.count("\n") == 1, err


def test_help_names_the_verbs_the_flags_and_the_namespace_default(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_main(["--help"], capsys)
    assert rc == 0
    assert out.startswith("usage: kubectl ghostgpu {ps,findings,faults,trace,audit}")
    for flag in ("-A, --all-namespaces", "--context", "--kubeconfig", "--ghostgpu-namespace",
                 "--collector-service", "--collector-port", "--tls-server-name"):
        assert flag in out
    assert "the\n                         kubeconfig context's namespace is not used" in out


def test_a_verbs_help_is_ghostgpus_under_kubectls_name_then_the_plugins_flags(
        capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_main(["ps", "--help"], capsys)
    assert rc == 0
    assert out.startswith("usage: kubectl ghostgpu ps ")
    assert "--tls-server-name NAME" in out and "-w, --watch" in out  # ghostgpu ps's own flags
    assert out.index("-w, --watch") < out.index("kubectl ghostgpu's own flags")


def captured_run(monkeypatch: pytest.MonkeyPatch) -> list[argparse.Namespace]:
    """ghostgpu's handlers replaced by a recorder: what the plugin hands them."""
    seen: list[argparse.Namespace] = []

    def run(args: argparse.Namespace) -> int:
        seen.append(args)
        return 0

    monkeypatch.setattr("ghostgpu.cli.main.run", run)
    return seen


@pytest.mark.parametrize(("argv", "namespace"), [
    (["ps", "--collector", "127.0.0.1:7450"], None),
    (["ps", "--collector", "127.0.0.1:7450", "-n", "ml"], "ml"),
    (["ps", "--collector", "127.0.0.1:7450", "-A"], None),
    (["faults", "-A", "--collector", "127.0.0.1:7450"], None),
    (["trace", "--collector", "127.0.0.1:7450", "-n", "ml", "--pod", "trainer-0"], "ml"),
])
def test_the_same_parser_and_handlers_with_kubectls_namespace_flags(
        argv: list[str], namespace: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = captured_run(monkeypatch)
    assert plugin.main(argv) == 0
    (args,) = seen
    assert (args.command, args.collector, args.namespace) == (argv[0], "127.0.0.1:7450", namespace)
    assert args.tls_server_name is None  # given --collector, nothing is forwarded or renamed


def flags(**given: Any) -> argparse.Namespace:
    values = {"kubeconfig": None, "context": None, "all_namespaces": False}
    return argparse.Namespace(**{**values, **given})


@pytest.mark.parametrize(("verb", "args", "env", "kubeconfig", "want"), [
    ("ps", {"collector": None}, {}, True, True),
    ("ps", {"collector": None}, {}, False, False),  # ghostgpu's own default then
    ("ps", {"collector": "10.0.0.5:7450"}, {}, True, False),
    ("ps", {"collector": None}, {"GHOSTGPU_COLLECTOR": "10.0.0.5:7450"}, True, False),
    ("audit", {"collector": None, "db": "/var/lib/ghostgpu/c.db"}, {}, True, False),
    ("audit", {"collector": None, "db": None, "store": None, "file": None}, {}, True, True),
])
def test_when_the_collector_is_port_forwarded(verb: str, args: dict[str, Any], env: dict[str, str],
                                              kubeconfig: bool, want: bool, tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".kube").mkdir(parents=True)
    if kubeconfig:
        (home / ".kube" / "config").write_text("apiVersion: v1\n")
    assert plugin.needs_port_forward(verb, flags(), argparse.Namespace(**args), env, str(home)) is want


# ---- the child's life cycle, with a stand-in child -------------------------------------------------

@pytest.fixture
def standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An executable that runs the stand-in: the path given where kubectl's would be."""
    exe = tmp_path / "bin" / "kubectl"
    exe.parent.mkdir()
    exe.write_text(f'#!/bin/sh\nexec {sys.executable} {STANDIN} "$@"\n')
    exe.chmod(0o755)
    monkeypatch.setenv("STANDIN_LOG", str(tmp_path / "standin.jsonl"))
    return exe


def standin_log(standin: Path) -> list[dict[str, Any]]:
    path = Path(os.environ["STANDIN_LOG"])
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def gone(pid: int) -> bool:
    """Ended: no such process, or a zombie nobody reaped yet (a grandchild re-parented to init)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_ready_then_stopped_on_leaving(standin: Path) -> None:
    target = ForwardTarget(namespace="obs", context="prod")
    with PortForward(str(standin), target) as forward:
        first = standin_log(standin)[0]
        assert forward.address == f"127.0.0.1:{first['local']}" and forward.local_port == first["local"]
        assert forward.proc is not None and forward.proc.poll() is None
        assert first["argv"] == port_forward_command(str(standin), target)[1:]  # the port kubectl's choice
    assert forward.proc.returncode == -signal.SIGTERM


def test_a_child_that_exits_first_is_one_line_with_its_last_error(standin: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STANDIN_MODE", "fail")
    with pytest.raises(PortForwardError) as failed:
        PortForward(str(standin), ForwardTarget(service="x")).start()
    line = str(failed.value)
    assert "\n" not in line
    assert line.startswith("kubectl port-forward to service/x in namespace ghostgpu exited with status 1 "
                           "before forwarding: error: services \"x\" not found;"), line


def test_a_child_that_never_says_ready_is_stopped(standin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STANDIN_MODE", "silent")
    forward = PortForward(str(standin), ForwardTarget(), ready_timeout_s=0.5)
    with pytest.raises(PortForwardError, match=r"did not say 'Forwarding from' within 0\.5 s"):
        forward.start()
    assert forward.proc is not None and forward.proc.returncode == -signal.SIGTERM


def test_sigkill_after_an_ignored_sigterm(standin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STANDIN_MODE", "stubborn")
    with PortForward(str(standin), ForwardTarget(), stop_timeout_s=0.5) as forward:
        pass
    assert forward.proc is not None and forward.proc.returncode == -signal.SIGKILL


def test_its_process_group_is_stopped_with_it(standin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An auth plugin kubectl starts (a process of its group) goes too."""
    monkeypatch.setenv("STANDIN_MODE", "grandchild")
    with PortForward(str(standin), ForwardTarget()):
        first = standin_log(standin)[0]
        assert not gone(first["grandchild"])
    wait_until(lambda: gone(first["grandchild"]), "the child's own child to end", DEADLINE_S)


def test_its_output_is_drained_after_ready(standin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kubectl writes a line per connection: an unread pipe would block it (and the forwarding)."""
    monkeypatch.setenv("STANDIN_FLOOD", "200000")  # ~5 MB, far past a pipe's 64 KiB
    with PortForward(str(standin), ForwardTarget()):
        wait_until(lambda: any(r.get("flooded") for r in standin_log(standin)),
                   "the stand-in to write all its lines", DEADLINE_S)


PLUGIN_PROCESS = """
import sys, time
from ghostgpu.cli.port_forward import ForwardTarget, PortForward, exit_on_sigterm
exit_on_sigterm()
with PortForward(sys.argv[1], ForwardTarget()) as forward:
    print(forward.proc.pid, flush=True)
    time.sleep(3600)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_the_child_ends_when_the_plugin_is_terminated_or_killed(sig: signal.Signals, standin: Path) -> None:
    """SIGTERM: the plugin stops it on its way out (exit 143). SIGKILL: nothing of ours runs; the kernel's
    parent-death signal (PR_SET_PDEATHSIG, Linux) ends it."""
    proc = subprocess.Popen([sys.executable, "-c", PLUGIN_PROCESS, str(standin)], stdout=subprocess.PIPE,
                            text=True, cwd=REPO)
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        assert not gone(child)
        proc.send_signal(sig)
        assert proc.wait(DEADLINE_S) == (143 if sig == signal.SIGTERM else -signal.SIGKILL)
        wait_until(lambda: gone(child), "the port-forward child to end", DEADLINE_S)
    finally:
        proc.kill()
        proc.wait()


def test_the_plugin_dials_the_forward_and_checks_the_charts_name(
        standin: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No --collector, a kubeconfig: the command runs against 127.0.0.1:PORT of a live child, with
    --tls-server-name SERVICE.NAMESPACE.svc (unless given), and the child is gone after."""
    monkeypatch.setenv("PATH", f"{standin.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("GHOSTGPU_COLLECTOR", raising=False)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\n")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    alive: list[bool] = []

    def run(args: argparse.Namespace) -> int:
        first = standin_log(standin)[0]
        alive.append(not gone(first["pid"]))
        assert first["argv"][-1] == ":7450" and args.collector == f"127.0.0.1:{first['local']}"
        assert args.tls_server_name == want_name
        return 7

    monkeypatch.setattr("ghostgpu.cli.main.run", run)
    want_name = "gg.obs.svc"
    assert plugin.main(["ps", "--ghostgpu-namespace", "obs", "--collector-service", "gg", "-n", "ml"]) == 7
    assert alive == [True]
    assert gone(standin_log(standin)[0]["pid"])
    Path(os.environ["STANDIN_LOG"]).unlink()
    want_name = "collector.example"
    assert plugin.main(["findings", "--tls-server-name", "collector.example"]) == 7
