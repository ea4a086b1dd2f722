"""The wheel, installed into a venv of its own, runs `ghostgpu tracer` with BPF.

No checkout is on its path (it runs from an empty directory, python -I semantics for the wheel's
own code): the `ghostgpu` it imports, the tracer and the BPF sources it compiles are the wheel's.
The dependencies come from this venv's site-packages through a .pth line (no index is reachable).
"""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
READY_DEADLINE_S = 90.0  # bcc compiles the programs at start: ~1-2 s here, more on a loaded CI VM

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.usefixtures("root_bpf")]


def run(*cmd: str, cwd: Path | None = None) -> str:
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=300, check=False, cwd=cwd)
    assert done.returncode == 0, f"{cmd}: {done.stderr[-2000:]}"
    return done.stdout


@dataclass(frozen=True)
class Installed:
    venv: Path
    site: Path  # its purelib
    workdir: Path  # an empty directory


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    tmp_path = tmp_path_factory.mktemp("wheel")
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
        str(tmp_path / "wheel"), str(REPO))
    (wheel,) = (tmp_path / "wheel").glob("ghostgpu-*.whl")
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv))  # bcc: system
    python = venv / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
        str(wheel))
    site = Path(run(str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip())
    # grpcio, protobuf, psutil, pynvml, prometheus_client from here; the editable ghostgpu of this
    # venv is not on that path (its finder hooks in only through a .pth processed in a site dir).
    (site / "ghostgpu-test-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    workdir = tmp_path / "empty"
    workdir.mkdir()
    return Installed(venv, site, workdir)


def test_the_installed_wheel_traces_with_bpf(installed: Installed) -> None:
    venv, site, workdir = installed.venv, installed.site, installed.workdir
    python = venv / "bin" / "python"
    where = run(str(python), "-c", "import ghostgpu.tracer.agent as a, ghostgpu.tracer.bpf_build as b; "
                "print(a.__file__); print(b.BPF_DIR)", cwd=workdir).split()
    assert where[0].startswith(str(site)) and where[1] == str(venv / "share" / "ghostgpu" / "bpf")

    proc = subprocess.Popen([str(venv / "bin" / "ghostgpu"), "tracer", "--bpf", "on", "--jsonl", "-",
                             "--node-name", "wheel-node"], cwd=workdir, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready: dict[str, object] = {}
        deadline = time.monotonic() + READY_DEADLINE_S
        while not ready and time.monotonic() < deadline and proc.poll() is None:
            if select.select([proc.stdout], [], [], 0.5)[0]:
                line = proc.stdout.readline()
                record = json.loads(line) if line.startswith("{") else {}
                if record.get("event") == "ready":
                    ready = record
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
    assert ready.get("bpf") is True and ready["node"] == "wheel-node", f"no ready record: {stderr[-2000:]}"
    assert proc.returncode == 0, stderr[-2000:]


def test_the_installed_up_runs_from_inside_a_checkout(installed: Installed, tmp_path: Path) -> None:
    """`bootstrap.sh run` from a clone under /root runs the copy in /opt/ghostgpu with the clone as its
    working directory: the tracer `up` starts must import the installed ghostgpu, not the clone's own
    ghostgpu/ folder (which lacks the tracer and collector the install maps in)."""
    done = subprocess.run(
        [str(installed.venv / "bin" / "ghostgpu"), "up", "--once", "--bpf", "off", "--node-name", "wheel-up",
         "--db", str(tmp_path / "up.db"), "--listen", f"unix://{tmp_path}/up.sock"],
        cwd=REPO, capture_output=True, text=True, timeout=READY_DEADLINE_S, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "wheel-up" in done.stdout, done.stdout[-2000:]
