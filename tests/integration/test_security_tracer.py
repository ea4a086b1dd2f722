"""The collector's security with the real processes (docs/SECURITY.md): the real `ghostgpu tracer`
streaming over mTLS with its node certificate, the real `ghostgpu ps` and `ghostgpu audit` CLIs, and
the kernel's word on who is calling over a unix socket or loopback (the CLI run as another uid).

tests/unit/test_security_e2e.py covers the same rules with simulated tracers and in-process clients;
here each part is the program a user runs, started as a subprocess. Nothing sleeps to wait: every
wait polls with a deadline.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require_root
from tests.helpers.audit_log import audit_records
from tests.helpers.certs import Pki
from tests.helpers.collector_proc import CollectorProcess, ghostgpu_cli, tls_flags
from tests.helpers.container import FakeContainer
from tests.helpers.fakenvml import FakeNvml
from tests.helpers.polling import poll, wait_until
from tests.helpers.tracer_proc import TracerProcess
from tests.helpers.workload import allocates

NODE = "node-sec"
OTHER = "node-other"
NOBODY = 65534
DEADLINE_S = 30.0  # Python start-up of three programs on a 2-core VM shared with other tests
POLICY = """
rules:
  - role: viewer
    subjects: ["user:alice"]
  - role: tracer
    subjects: ["node:*"]
"""
# The CLI runs as uid 65534, which is what the kernel reports for its socket (SO_PEERCRED, the loopback
# socket's owner). It keeps one capability, CAP_DAC_READ_SEARCH (ambient, so it survives the exec), to
# read the checkout and its venv wherever they are: a clone under /root (0700 on Debian) is closed to
# that uid. The collector decides by uid alone, so the capability changes nothing under test.
# tests/integration/test_install.py runs the installed tool as a plain uid 65534, with no capability.
AS_NOBODY = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups",
             "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]


def audit_file(col: CollectorProcess, action: str) -> list[dict[str, Any]]:
    """The collector's audit JSON lines (beside its database), records of `action`."""
    return audit_records(col.db_path.with_suffix(".audit.jsonl"), action)


def audit_db(col: CollectorProcess, action: str) -> list[dict[str, Any]]:
    """`ghostgpu audit --db DB -o json`, as an operator reads the store file: records of `action`."""
    out = ghostgpu_cli("audit", "--db", str(col.db_path), "-o", "json")
    assert out.returncode == 0, f"ghostgpu audit --db exited {out.returncode}: {out.stderr.strip()}"
    return [r for r in json.loads(out.stdout) if r["action"] == action]


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.endswith("\n"), f"expected one line on stderr, got: {err!r}"
    return err.strip()


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "pki")


@pytest.fixture
def tls_collector(tmp_path: Path, pki: Pki) -> Iterator[CollectorProcess]:
    """`ghostgpu collector` serving mTLS on loopback with the collector certificate and POLICY."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    server = pki.write("collector", pki.collector())
    with CollectorProcess(tmp_path / "collector", unix=False,
                          args=[*tls_flags(server), "--policy", str(policy)]) as col:
        yield col


@pytest.mark.root
@pytest.mark.bpf
@pytest.mark.netns
def test_a_tracer_with_its_node_certificate_reaches_ps_with_a_user_certificate(
        tmp_path: Path, root_bpf: None, pki: Pki, tls_collector: CollectorProcess,
        fake_nvml: FakeNvml) -> None:
    node = tls_flags(pki.write(f"node-{NODE}", pki.node(NODE)))
    alice = tls_flags(pki.write("user-alice", pki.user("alice")))
    bob = tls_flags(pki.write("user-bob", pki.user("bob")))  # a valid certificate the policy gives nothing
    (tmp_path / "tracer").mkdir()
    with FakeContainer() as c, TracerProcess(tmp_path / "tracer", ["--grace-s", "0.5", *node],
                                             fake_nvml.env(), NODE, tls_collector.address) as tracer:
        p = c.run(["open", "/dev/nvidia0", *allocates(), "ready", "wait"])  # a GPU job: `hidden`
        p.wait_ready()
        tracer.wait_for(lambda r: r.get("event") == "finding" and r.get("pid") == p.host_pid, DEADLINE_S,
                        "the tracer's finding")
        rows: list[dict[str, Any]] = []

        def shown() -> bool:
            nonlocal rows
            out = ghostgpu_cli("ps", "--collector", tls_collector.address, "-o", "json", *alice)
            assert out.returncode == 0, f"ghostgpu ps as user:alice exited {out.returncode}: {out.stderr}"
            rows = [r for r in json.loads(out.stdout) if r["node"] == NODE and r["pid"] == p.host_pid]
            return bool(rows)

        if not poll(shown, DEADLINE_S):
            raise AssertionError(f"ghostgpu ps never showed {NODE} PID {p.host_pid}: "
                                 f"{tls_collector.stderr()}")
        assert rows[0]["class"] == "hidden"
        denied = ghostgpu_cli("ps", "--collector", tls_collector.address, *bob)
        assert denied.returncode == 1
        line = one_line(denied.stderr)
        assert "permission denied" in line and "user:bob" in line and "viewer" in line, line
    connect = audit_file(tls_collector, "tracer.connect")[0]
    assert (connect["subject"], connect["result"], connect["detail"]["via"]) == (f"node:{NODE}", "ok", "mtls")


def test_a_tracer_with_another_nodes_certificate_is_refused_once_and_audited(
        tmp_path: Path, pki: Pki, tls_collector: CollectorProcess) -> None:
    other = tls_flags(pki.write(f"node-{OTHER}", pki.node(OTHER)))
    (tmp_path / "tracer").mkdir()
    # No BPF needed: the refusal happens at the stream's Hello, before any event.
    args = ["--bpf", "off", *other]
    with TracerProcess(tmp_path / "tracer", args, {}, NODE, tls_collector.address) as tracer:
        # Two refusals on the collector's side: the tracer came back once and did not say it again.
        wait_until(lambda: len(audit_file(tls_collector, "tracer.refused")) >= 2, "a second refused Hello",
                   DEADLINE_S)
        assert tracer.proc.poll() is None, f"the refused tracer exited: {tracer.stderr()}"
    lines = tracer.stderr().splitlines()  # after its stop, which tries once more to hand over its spool
    refusals = [line for line in lines if "refused" in line]
    assert len(refusals) == 1, lines
    assert not [line for line in lines if "not reachable" in line], lines  # no TLS or transport noise
    assert f"the certificate of node {OTHER} cannot speak for node {NODE}" in refusals[0], refusals[0]
    assert tls_collector.address in refusals[0]
    wait_until(lambda: audit_db(tls_collector, "tracer.refused"), "tracer.refused in the store", DEADLINE_S)
    refused = audit_db(tls_collector, "tracer.refused")[0]
    assert (refused["subject"], refused["result"], refused["detail"]["node"]) == (
        f"node:{OTHER}", "denied", NODE)
    assert audit_file(tls_collector, "tracer.connect") == []


def ps_as(col: CollectorProcess, address: str, wrapper: list[str] | None) -> tuple[int, str]:
    out = ghostgpu_cli("ps", "--collector", address, "-o", "json", wrapper=wrapper)
    if out.returncode == 0:
        assert isinstance(json.loads(out.stdout), list), out.stdout
    return out.returncode, out.stderr


@pytest.mark.root
def test_the_kernel_says_who_calls_over_the_unix_socket_and_loopback(shared_dir: Path) -> None:
    require_root()
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) is needed to run the CLI as another uid")
    with CollectorProcess(shared_dir / "collector") as col:
        for address in (col.unix_address, col.address):
            assert ps_as(col, address, None) == (0, ""), f"root via {address}"
            rc, err = ps_as(col, address, AS_NOBODY)
            assert rc == 1, err
            line = one_line(err)
            assert "permission denied" in line and f"uid:{NOBODY}" in line and address in line, line
        denied = audit_file(col, "denied")
        assert {(r["subject"], r["detail"]["via"]) for r in denied} == {
            (f"uid:{NOBODY}", "unix"), (f"uid:{NOBODY}", "loopback")}, denied

        policy = shared_dir / "policy.yaml"
        policy.write_text(f'rules:\n  - role: viewer\n    subjects: ["uid:{NOBODY}"]\n')
        col.stop()
        col.args += ["--policy", str(policy)]
        col.start()  # the same socket path and TCP port
        for address in (col.unix_address, col.address):
            assert ps_as(col, address, AS_NOBODY) == (0, ""), f"uid {NOBODY} via {address}"


def test_a_plaintext_collector_on_all_interfaces_needs_insecure(tmp_path: Path) -> None:
    refused = ghostgpu_cli("collector", "--listen", "0.0.0.0:0", "--db", str(tmp_path / "refused.db"))
    assert refused.returncode == 2
    line = one_line(refused.stderr)
    assert "0.0.0.0:0" in line and "--insecure" in line and "--tls-cert" in line, line
    with CollectorProcess(tmp_path / "insecure", unix=False, tcp=["0.0.0.0:0"], args=["--insecure"]) as col:
        loud = [line for line in col.stderr().splitlines() if "INSECURE" in line]
        assert len(loud) == 1 and "0.0.0.0" in loud[0], col.stderr()
        rc, err = ps_as(col, f"127.0.0.1:{col.port}", None)  # still served: root on loopback is admin
        assert rc == 0, err
