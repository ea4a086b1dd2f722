"""The krew manifest (deploy/krew/ghostgpu.yaml) and the archive it names (scripts/krew_archive.py).

- The archive is reproducible, and the manifest's sha256 is the archive's as built from this tree.
- The manifest uses krew's field names only and passes krew's own structural checks, both written
  down here from krew's source: the Plugin type, sigs.k8s.io/krew pkg/index/types.go, and
  ValidatePlugin, pkg/index/validation/validate.go (kubernetes-sigs/krew, master, 2024; apiVersion
  krew.googlecontainertools.github.com/v1alpha2 is pkg/constants CurrentAPIVersion).
- The launcher in the archive runs the plugin with the python found on PATH, and without the
  ghostgpu package says so in one line.
"""

from __future__ import annotations

import hashlib
import io
import re
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from tests.helpers.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "deploy" / "krew" / "ghostgpu.yaml"
VENV_BIN = Path(sys.executable).parent

# krew's pkg/index/types.go, field by field (their json tags).
PLUGIN_FIELDS = {"apiVersion", "kind", "metadata", "spec"}  # metav1.TypeMeta inline, ObjectMeta, Spec
METADATA_FIELDS = {"name"}  # of metav1.ObjectMeta, the one krew reads (ValidatePlugin: p.Name)
SPEC_FIELDS = {"version", "shortDescription", "description", "caveats", "homepage", "platforms"}
PLATFORM_FIELDS = {"uri", "sha256", "selector", "files", "license", "bin"}
FILE_OPERATION_FIELDS = {"from", "to"}
SELECTOR_FIELDS = {"matchLabels", "matchExpressions"}  # metav1.LabelSelector
EXPRESSION_FIELDS = {"key", "operator", "values"}  # metav1.LabelSelectorRequirement
# validate.go
API_VERSION = "krew.googlecontainertools.github.com/v1alpha2"
SAFE_NAME = re.compile(r"^[\w-]+$")
SHA256 = re.compile(r"^[a-f0-9]{64}$")
SELECTOR_KEYS = {"os", "arch"}
# krew's pkg/installation/semver: a version is "v" and semver
SEMVER = re.compile(r"^v\d+\.\d+\.\d+(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?$")


@pytest.fixture(scope="module")
def ka() -> ModuleType:
    return load_script("krew_archive")


@pytest.fixture(scope="module")
def manifest() -> dict[str, Any]:
    loaded = yaml.safe_load(MANIFEST.read_text())
    assert isinstance(loaded, dict)
    return loaded


def test_the_archive_is_reproducible_and_its_sha256_is_the_manifests(
        ka: ModuleType, manifest: dict[str, Any], tmp_path: Path) -> None:
    first, second = tmp_path / "a" / ka.ARCHIVE_NAME, tmp_path / "b" / ka.ARCHIVE_NAME
    sha = ka.build(first)
    assert ka.build(second) == sha and first.read_bytes() == second.read_bytes()
    assert hashlib.sha256(first.read_bytes()).hexdigest() == sha
    (platform,) = manifest["spec"]["platforms"]
    assert platform["sha256"] == sha, (
        "deploy/krew/ghostgpu.yaml's sha256 is not the archive's: run `python3 scripts/krew_archive.py "
        "--update-manifest` after changing deploy/krew/kubectl-ghostgpu")


def test_the_archive_holds_the_launcher_with_fixed_owners_times_and_modes(ka: ModuleType,
                                                                          tmp_path: Path) -> None:
    path = tmp_path / ka.ARCHIVE_NAME
    ka.build(path)
    with tarfile.open(path) as tar:
        infos = tar.getmembers()
        names = [i.name for i in infos]
        assert names == sorted(names) and "kubectl-ghostgpu" in names
        assert set(names) <= {"kubectl-ghostgpu", "LICENSE"}
        for info in infos:
            assert (info.uid, info.gid, info.uname, info.gname, info.mtime) == (0, 0, "", "", 0)
            assert info.isreg() and info.mode == (0o755 if info.name == "kubectl-ghostgpu" else 0o644)
        launcher = tar.extractfile("kubectl-ghostgpu")
        assert launcher is not None
        assert launcher.read() == (REPO / "deploy" / "krew" / "kubectl-ghostgpu").read_bytes()
    with open(path, "rb") as f:
        header = f.read(10)
    assert header[:3] == b"\x1f\x8b\x08" and header[3] == 0 and header[4:8] == b"\0\0\0\0"  # no name, mtime 0


def keys_within(obj: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = set(obj) - allowed
    assert not unknown, f"{where}: {sorted(unknown)} are not krew's fields (allowed: {sorted(allowed)})"


def test_the_manifest_has_krews_fields_only(manifest: dict[str, Any]) -> None:
    keys_within(manifest, PLUGIN_FIELDS, "Plugin")
    keys_within(manifest["metadata"], METADATA_FIELDS, "metadata")
    keys_within(manifest["spec"], SPEC_FIELDS, "spec")
    for platform in manifest["spec"]["platforms"]:
        keys_within(platform, PLATFORM_FIELDS, "platform")
        keys_within(platform["selector"], SELECTOR_FIELDS, "selector")
        for expression in platform["selector"].get("matchExpressions", []):
            keys_within(expression, EXPRESSION_FIELDS, "matchExpressions")
        for op in platform["files"]:
            keys_within(op, FILE_OPERATION_FIELDS, "files")


def test_the_manifest_passes_krews_validate_plugin(manifest: dict[str, Any], ka: ModuleType,
                                                   tmp_path: Path) -> None:
    spec = manifest["spec"]
    assert manifest["apiVersion"] == API_VERSION and manifest["kind"] == "Plugin"
    name = manifest["metadata"]["name"]
    assert SAFE_NAME.match(name) and name == "ghostgpu"  # `kubectl ghostgpu`; krew index file ghostgpu.yaml
    assert spec["shortDescription"].strip() and spec["platforms"]
    assert SEMVER.match(spec["version"]), spec["version"]
    with open(REPO / "pyproject.toml", "rb") as f:
        assert spec["version"] == "v" + tomllib.load(f)["project"]["version"]
    path = tmp_path / ka.ARCHIVE_NAME
    ka.build(path)
    with tarfile.open(path) as tar:
        archived = set(tar.getnames())
    for platform in spec["platforms"]:
        assert platform["uri"] and SHA256.match(platform["sha256"]) and platform["bin"] and platform["files"]
        assert platform["uri"].endswith(f"/{spec['version']}/{ka.ARCHIVE_NAME}"), platform["uri"]
        selector = platform["selector"]
        assert selector.get("matchLabels") or selector.get("matchExpressions")
        keys = set(selector.get("matchLabels", {})) | {e["key"] for e in selector.get("matchExpressions", [])}
        assert keys <= SELECTOR_KEYS
        assert {op["from"] for op in platform["files"]} <= archived
        assert platform["bin"] in archived
    assert "pip install ghostgpu" in spec["caveats"] and "3.11" in spec["caveats"]


@pytest.fixture
def launcher(ka: ModuleType, tmp_path: Path) -> Path:
    """The launcher as krew unpacks it, away from the checkout."""
    path = tmp_path / ka.ARCHIVE_NAME
    ka.build(path)
    out = tmp_path / "installed" / "kubectl-ghostgpu"
    out.parent.mkdir()
    with tarfile.open(fileobj=io.BytesIO(path.read_bytes())) as tar:  # krew's extractTARGZ: name and mode
        info = tar.getmember("kubectl-ghostgpu")
        member = tar.extractfile(info)
        assert member is not None
        out.write_bytes(member.read())
        out.chmod(info.mode)
    return out


def test_the_launcher_runs_the_plugin_with_the_python_on_path(launcher: Path) -> None:
    env = {"PATH": f"{VENV_BIN}:/usr/bin:/bin", "HOME": str(launcher.parent)}
    out = subprocess.run([str(launcher), "--help"], capture_output=True, text=True, env=env,
                         cwd=launcher.parent, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: kubectl ghostgpu {ps,findings,faults,trace,audit}")
    refused = subprocess.run([str(launcher), "up"], capture_output=True, text=True, env=env,
                             cwd=launcher.parent, timeout=60, check=False)
    assert refused.returncode == 2 and "run `ghostgpu up ...`" in refused.stderr


def test_the_launcher_without_ghostgpu_says_pip_install(launcher: Path, tmp_path: Path) -> None:
    """A python without the package: this one, isolated (-I) and without site-packages (-S)."""
    bare = tmp_path / "bare-python"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')
    bare.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "GHOSTGPU_PYTHON": str(bare)}
    out = subprocess.run([str(launcher), "ps"], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=60, check=False)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == (f"kubectl ghostgpu: the ghostgpu package is not installed for {sys.executable}: "
                          "run `pip install ghostgpu`, or set GHOSTGPU_PYTHON to the python that has it\n")
    missing = subprocess.run([str(launcher), "ps"], capture_output=True, text=True, cwd=tmp_path, timeout=60,
                             env={"PATH": "/usr/bin:/bin", "GHOSTGPU_PYTHON": "no-such-python"}, check=False)
    assert missing.returncode == 127 and "no-such-python not found: install Python 3.11" in missing.stderr
