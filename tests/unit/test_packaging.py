"""An installed (non-editable) ghostgpu finds its BPF sources: the wheel carries bpf/ as data files
and tracer/bpf_build.py looks there when no checkout sits beside the code (the container image)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from tracer.bpf_build import BPF_FILES, find_bpf_dir

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
    # Installed into a bare prefix and imported from there (not from this checkout), the tracer's
    # program text reads the installed copies: byte for byte the checkout's.
    prefix = tmp_path / "prefix"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                                "--prefix", str(prefix), str(wheel)], capture_output=True, text=True,
                               timeout=300, check=False)
    assert installed.returncode == 0, installed.stderr[-2000:]
    (site,) = prefix.glob("lib/python3*/site-packages")
    probe = ("import sys, sysconfig; from pathlib import Path; import tracer.bpf_build as b; "
             f"d = b.find_bpf_dir(data_root=Path({str(prefix)!r})); print(b.__file__); print(d); "
             "print(len(b.program_text(d)))")
    code = f"import sys; sys.path.insert(0, {str(site)!r}); {probe}"
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60,
                         check=False, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    module_file, bpf_dir, text_len = out.stdout.split()
    assert module_file.startswith(str(site))
    assert bpf_dir == str(prefix / "share" / "ghostgpu" / "bpf")
    from tracer.bpf_build import program_text

    assert int(text_len) == len(program_text(REPO / "bpf").replace(str(REPO / "bpf"), bpf_dir))
