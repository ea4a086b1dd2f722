"""An installed (non-editable) ghostgpu finds its BPF sources: the wheel carries bpf/ as data files
and tracer/bpf_build.py looks there when no checkout sits beside the code (the container image)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from ghostgpu.tracer.bpf_build import BPF_FILES, find_bpf_dir

REPO = Path(__file__).resolve().parents[2]


def test_a_checkout_uses_its_own_bpf_dir(tmp_path: Path) -> None:
    assert find_bpf_dir(REPO, tmp_path) == REPO / "bpf"


def test_without_a_checkout_the_installed_data_dir_is_used(tmp_path: Path) -> None:
    assert find_bpf_dir(tmp_path / "site-packages", tmp_path) == tmp_path / "share" / "ghostgpu" / "bpf"


def test_the_wheel_installs_the_bpf_sources_where_the_tracer_looks(tmp_path: Path) -> None:
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path / "wheel"), str(REPO)], capture_output=True, text=True,
                           timeout=300, check=False)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "wheel").glob("ghostgpu-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    data = {n.split("/data/", 1)[1] for n in names if ".data/data/" in n}
    assert {f"share/ghostgpu/bpf/{f}" for f in BPF_FILES} <= data
    # Nothing outside `ghostgpu`: no generic top-level `tracer` or `collector` in site-packages.
    tops = {n.split("/", 1)[0] for n in names}
    assert {t for t in tops if not t.startswith("ghostgpu-")} == {"ghostgpu"}, sorted(tops)
    assert not [n for n in names if ".data/" in n and "/data/share/ghostgpu/" not in n]
    assert {"ghostgpu/tracer/agent.py", "ghostgpu/collector/main.py", "ghostgpu/common/model/consumers.py",
            "ghostgpu/cli/__init__.py", "ghostgpu/cli/demo_nvml.c", "ghostgpu/v1/stream_pb2.py"} <= names
    # Installed into a venv of its own (never this one: pip would uninstall the editable ghostgpu
    # here first) and imported from there, the tracer's default lookup finds the installed copies.
    venv = tmp_path / "venv"
    made = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert made.returncode == 0, made.stderr[-2000:]
    python = venv / "bin" / "python"
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                                "--no-deps", "--no-index", str(wheel)], capture_output=True, text=True,
                               timeout=300, check=False)
    assert installed.returncode == 0, installed.stderr[-2000:]
    probe = ("import ghostgpu.tracer.bpf_build as b; print(b.__file__); print(b.BPF_DIR); "
             "print(len(b.program_text(b.BPF_DIR)))")
    out = subprocess.run([str(python), "-I", "-c", probe], capture_output=True, text=True, timeout=60,
                         check=False, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    module_file, bpf_dir, text_len = out.stdout.split()
    assert module_file.startswith(str(venv))
    assert bpf_dir == str(venv / "share" / "ghostgpu" / "bpf")
    from ghostgpu.tracer.bpf_build import program_text

    assert int(text_len) == len(program_text(REPO / "bpf").replace(str(REPO / "bpf"), bpf_dir))
