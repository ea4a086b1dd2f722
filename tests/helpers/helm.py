"""The real helm binary, run on the chart (deploy/helm/ghostgpu) for the tests that check it.

    docs = render([CI / "cert-manager-values.yaml"]).documents   # helm template, parsed
    failed = template(set_values={"collector.retentionDays": "-1"})   # the raw run: rc, stderr
    linted = lint(CI / "postgresql-values.yaml")                       # helm lint --strict
    text = notes(tmp_path, release="prod", namespace="obs")            # NOTES.txt as rendered

The binary is the pinned v3.17.3 that scripts/install_helm.py puts beside the venv's python
(.venv/bin/helm; `bash scripts/bootstrap.sh install` runs it), else a `helm` on PATH; any other
version skips the test with the reason, since the chart's checks are only as good as the helm they
ran. The reference render is release `ghostgpu` in namespace `ghostgpu`: with that name every object
keeps the plain manifests' names (ghostgpu-collector, ghostgpu-tracer, ghostgpu-ca, ...).
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml  # Debian's python3-yaml (scripts/bootstrap.sh installs it)

from tests.helpers.manifests import Documents

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "ghostgpu"
CI = CHART / "ci"  # the values files CI lints and renders, one per way of installing
RELEASE = "ghostgpu"
NAMESPACE = "ghostgpu"
HELM_TIMEOUT_S = 60


def pinned_version() -> str:
    """scripts/install_helm.py's HELM_VERSION, read from its source (scripts/ is not a package)."""
    text = (REPO / "scripts" / "install_helm.py").read_text()
    match = re.search(r'^HELM_VERSION = "(v[\d.]+)"$', text, re.M)
    assert match, "scripts/install_helm.py: no HELM_VERSION line"
    return match.group(1)


class HelmError(AssertionError):
    """helm exited non-zero: the command line and helm's own stderr."""


@functools.cache
def _find_helm() -> tuple[str | None, str]:
    """(path, "") for the pinned helm, else (None, why not)."""
    beside_python = Path(sys.executable).parent / "helm"
    path = str(beside_python) if beside_python.is_file() else shutil.which("helm")
    install = "bash scripts/bootstrap.sh install (or python3 scripts/install_helm.py .venv/bin/helm)"
    if not path:
        return None, f"helm is not installed: {install}"
    want = pinned_version()
    try:
        done = subprocess.run([path, "version", "--template", "{{.Version}}"], capture_output=True,
                              text=True, timeout=HELM_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{path} does not run ({e}): {install}"
    if done.returncode != 0 or done.stdout.strip() != want:
        return None, f"{path} is helm {done.stdout.strip() or '?'}, not the pinned {want}: {install}"
    return path, ""


def helm() -> str:
    """The pinned helm's path; skips the test (a failure under GHOSTGPU_REQUIRE_INTEGRATION=1) without it."""
    path, why = _find_helm()
    if path is None:
        pytest.skip(why)
    return path


def run_helm(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    argv = [helm(), *args]
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=HELM_TIMEOUT_S, cwd=REPO)
    except subprocess.TimeoutExpired as e:
        raise HelmError(f"{' '.join(argv)}: no answer within {HELM_TIMEOUT_S} s") from e


def _values_args(values_files: Sequence[Path], set_values: Mapping[str, str]) -> list[str]:
    args: list[str] = []
    for path in values_files:
        args += ["--values", str(path)]
    for key, value in set_values.items():  # --set-string would hide a wrong type from the schema
        args += ["--set", f"{key}={value}"]
    return args


NOTES_PROBE = """\
apiVersion: v1
kind: ConfigMap
metadata: {name: notes-probe}
data:
  notes: |
{{- tpl (.Files.Get "notes-probe/NOTES.txt") . | nindent 4 }}
"""


def notes(workdir: Path, set_values: Mapping[str, str] | None = None, release: str = RELEASE,
          namespace: str = NAMESPACE) -> str:
    """templates/NOTES.txt as `helm install` prints it. `helm template` never renders NOTES.txt, and
    `helm install --dry-run` asks a cluster (helm 3.17), so a copy of the chart renders it through
    `tpl` into a ConfigMap of its own."""
    chart = workdir / "chart"
    shutil.copytree(CHART, chart)
    (chart / "notes-probe").mkdir()
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "notes-probe" / "NOTES.txt")
    (chart / "templates" / "notes-probe.yaml").write_text(NOTES_PROBE)
    done = run_helm(["template", release, str(chart), "--namespace", namespace,
                     *_values_args((), set_values or {}), "--show-only", "templates/notes-probe.yaml"])
    if done.returncode != 0:
        raise HelmError(f"helm template (NOTES.txt) failed (exit {done.returncode}):\n{done.stderr}")
    return str(yaml.safe_load(done.stdout)["data"]["notes"])


def template(values_files: Sequence[Path] = (), set_values: Mapping[str, str] | None = None,
             show_only: Sequence[str] = (), release: str = RELEASE,
             namespace: str = NAMESPACE) -> subprocess.CompletedProcess[str]:
    """`helm template ghostgpu CHART --namespace ghostgpu ...`, whatever its exit status."""
    args = ["template", release, str(CHART), "--namespace", namespace,
            *_values_args(values_files, set_values or {})]
    for template_path in show_only:
        args += ["--show-only", template_path]
    return run_helm(args)


@dataclass(frozen=True, repr=False)
class Render(Documents):
    """What `helm template` printed, and its documents (empty ones dropped)."""

    text: str

    def __repr__(self) -> str:  # failure messages name it; the whole text would drown them
        return "the chart's render"


def render(values_files: Sequence[Path] = (), set_values: Mapping[str, str] | None = None,
           show_only: Sequence[str] = (), release: str = RELEASE, namespace: str = NAMESPACE) -> Render:
    """The chart rendered; HelmError with helm's stderr when it refuses."""
    done = template(values_files, set_values, show_only, release, namespace)
    if done.returncode != 0:
        raise HelmError(f"helm template {' '.join(str(p) for p in values_files)} failed "
                        f"(exit {done.returncode}):\n{done.stderr}")
    return Render(done.stdout)


@functools.cache
def render_values_file(path: Path) -> Render:
    """One render per values file per session: several tests read each."""
    return render([path])


def lint(values_file: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`helm lint --strict` of the chart (warnings fail too), with one values file or the defaults."""
    args = ["lint", "--strict", str(CHART), "--namespace", NAMESPACE]
    if values_file is not None:
        args += ["--values", str(values_file)]
    return run_helm(args)


def ci_values_files() -> list[Path]:
    """deploy/helm/ghostgpu/ci/*-values.yaml (helm's chart-testing convention), sorted."""
    return sorted(CI.glob("*-values.yaml"))


def values_id(path: Path) -> str:
    """A values file's test id: ci/postgresql-values.yaml is `postgresql`."""
    return path.name.removesuffix("-values.yaml")
