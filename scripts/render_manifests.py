#!/usr/bin/env python3
"""Write the plain Kubernetes manifests from the Helm chart, so the chart is their one source.

    .venv/bin/python scripts/render_manifests.py           # rewrite what differs, name each file
    .venv/bin/python scripts/render_manifests.py --check   # exit 1 naming each file out of step

deploy/kubernetes/ghostgpu.yaml is `helm template` of deploy/helm/ghostgpu with its default values,
replicated/ghostgpu.yaml with ci/postgresql-values.yaml, and isolation-rbac.yaml the node isolation
templates alone with remediation.config.actions.isolate_node on; all as release `ghostgpu` in namespace
`ghostgpu`, each after a header saying so and what to do before `kubectl apply`. The two full manifests
also carry the Namespace: a chart must not create its own (`helm install --create-namespace` does),
while `kubectl apply -f` needs it in the file. The chart cannot read outside its folder, so the alerting
rules and the Grafana dashboard it ships are copies under deploy/helm/ghostgpu/files, written here too.
tests/unit/test_helm_sync.py runs --check.

helm is the real binary scripts/install_helm.py puts beside the venv's python (or $HELM, or on PATH).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "ghostgpu"
RELEASE = "ghostgpu"
NAMESPACE = "ghostgpu"
HELM_TIMEOUT_S = 120

NAMESPACE_DOCUMENT = f"""apiVersion: v1
kind: Namespace
metadata:
  name: {NAMESPACE}
"""

# The chart's copies of files kept elsewhere in the repository: (original, copy).
COPIES = (
    (ROOT / "deploy" / "prometheus" / "ghostgpu-rules.yaml", CHART / "files" / "ghostgpu-rules.yaml"),
    (ROOT / "deploy" / "grafana" / "ghostgpu-dashboard.json", CHART / "files" / "ghostgpu-dashboard.json"),
)

SINGLE_HEADER = """\
# ghostgpu on a cluster: one collector, one tracer per GPU node, and how Prometheus scrapes both.
# Needs cert-manager (https://cert-manager.io) for the CA and the serving certificates.
# The collector here is one process on SQLite; replicated/ghostgpu.yaml runs 3 over one PostgreSQL, so
# that losing one loses no stream and no alert (docs/REPLICAS.md). With helm, install the chart
# instead: helm install ghostgpu deploy/helm/ghostgpu -n ghostgpu --create-namespace (docs/HELM.md).
#
# Before `kubectl apply -f deploy/kubernetes/ghostgpu.yaml` (docs/SECURITY.md):
#   1. Scrape credentials. Pick a password, put its bcrypt hash in the Secret ghostgpu-web-config
#      (htpasswd -nBC 10 "" | tr -d ':\\n') and the password itself in ghostgpu-scrape-auth. Until
#      then the collector and the tracers refuse to start with one line naming basic_auth_users.
#   2. Each GPU node's identity: /etc/ghostgpu/pki/{node.crt,node.key,ca.crt} on the node, issued
#      for that node's name from the cluster CA cert-manager makes here (see "Node identities" below).
#      A node without them keeps its tracer pod from starting (hostPath type: Directory).
#   kubectl apply -f deploy/prometheus/ghostgpu-prometheusrule.yaml   # alerts (Prometheus Operator)
# The ServiceMonitor and PodMonitor need the Prometheus Operator's CRDs; without it, scrape
# ghostgpu-collector:9400 (scheme https, honor_labels: true) and each tracer on :9401 (docs/ALERTING.md).
#
# tests/unit/test_deploy.py checks that every ghostgpu command line here parses with the real CLI and
# that probes, ports and monitors agree with the flags; tests/unit/test_deploy_security.py validates
# the core kinds with kubernetes-validate, checks the cert-manager ones field by field, and that the
# tracer's capabilities are exactly the measured set (tracer/capabilities.py, bench/caps_probe.py).
"""

REPLICATED_HEADER = """\
# ghostgpu on a cluster with a replicated collector: 3 collectors sharing one PostgreSQL (15+), one
# tracer per GPU node, and how Prometheus scrapes them all (docs/REPLICAS.md). The single collector of
# ../ghostgpu.yaml (SQLite on a volume) is a single point of failure for the alerting feed; here any
# one replica may go (drained, rolled, killed) while the others keep every node's stream.
# Needs cert-manager (https://cert-manager.io) for the CA and the serving certificates, and a
# PostgreSQL 15+ database that the collectors own. With helm: --set collector.store.scheme=postgresql
# --set collector.replicas=3 (docs/HELM.md).
#
# Before `kubectl apply -f deploy/kubernetes/replicated/ghostgpu.yaml` (docs/REPLICAS.md):
#   0. The database. Either a CloudNativePG Cluster (cloudnativepg-cluster.yaml beside this file: it
#      generates the Secrets ghostgpu-db-app and ghostgpu-db-ca that the collectors mount), or any
#      PostgreSQL 15+ with those two Secrets made by hand. Then the Secret ghostgpu-store with the
#      connection URI (its key `dsn`). store-secrets.example.yaml shows all three, placeholders only.
#      Until they exist the collector pods wait; their events name the missing Secret
#      (CreateContainerConfigError, FailedMount).
#   1. Scrape credentials and 2. each GPU node's identity, as for ../ghostgpu.yaml (its header and
#      docs/SECURITY.md): fill in the placeholders of the Secrets ghostgpu-web-config and
#      ghostgpu-scrape-auth below, and put /etc/ghostgpu/pki/{node.crt,node.key,ca.crt} on every GPU node.
#   kubectl apply -f deploy/prometheus/ghostgpu-prometheusrule.yaml   # alerts (Prometheus Operator)
# Coming from ../ghostgpu.yaml: its PersistentVolumeClaim ghostgpu-collector (the SQLite store) is
# not used here; the history in it stays there (delete it when you no longer want it).
#
# tests/unit/test_deploy.py and test_deploy_security.py check this file as they check ../ghostgpu.yaml
# (every command line parses with the real CLI, every core kind validates against the Kubernetes
# schemas); tests/unit/test_deploy_replicated.py checks what replication needs (3 replicas, the
# disruption budget, the spread, the store from Secrets, the headless Service the tracers dial) and
# that everything else here is the same as in ../ghostgpu.yaml.
"""

ISOLATION_HEADER = """\
# For remediation (the chart makes these itself with remediation.enabled; with actions.isolate_node
# off it grants nodes get only): the kill engine reads each node's opt-out label before an act and
# holds every act back while it cannot, and node isolation taints or cordons. Apply it, then run the
# collector as this ServiceAccount with its token mounted (the manifests keep the collector's pod off
# the API otherwise):
#   kubectl apply -f deploy/kubernetes/isolation-rbac.yaml
#   kubectl -n ghostgpu patch deployment ghostgpu-collector -p \\
#     '{"spec":{"template":{"spec":{"serviceAccountName":"ghostgpu-collector",
#       "automountServiceAccountToken":true}}}}'
# tests/unit/test_isolation.py checks the rules are exactly these; tests/integration/test_isolation_kube.py
# has the real kubectl parse this file.
"""


@dataclass(frozen=True)
class Rendered:
    """One generated manifest: where it goes and how the chart makes it."""

    path: Path
    header: str
    helm_args: tuple[str, ...]
    with_namespace: bool


MANIFESTS = (
    Rendered(ROOT / "deploy" / "kubernetes" / "ghostgpu.yaml", SINGLE_HEADER, (), True),
    Rendered(ROOT / "deploy" / "kubernetes" / "replicated" / "ghostgpu.yaml", REPLICATED_HEADER,
             ("-f", str(CHART / "ci" / "postgresql-values.yaml")), True),
    Rendered(ROOT / "deploy" / "kubernetes" / "isolation-rbac.yaml", ISOLATION_HEADER,
             ("--set", "remediation.enabled=true", "--set", "remediation.config.actions.isolate_node=true",
              "--show-only", "templates/isolation-rbac.yaml"), False),
)


class RenderError(Exception):
    """One line: what failed and what to do."""


def find_helm() -> str:
    """$HELM, else the helm beside this python (the venv's, from scripts/install_helm.py), else PATH's."""
    candidates = [os.environ.get("HELM", ""), str(Path(sys.executable).parent / "helm"),
                  shutil.which("helm") or ""]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise RenderError("helm not found: run `python3 scripts/install_helm.py .venv/bin/helm` "
                      "(scripts/bootstrap.sh does) or set HELM to the binary")


def command_line(rendered: Rendered) -> list[str]:
    """The helm command, as the generated file's header shows it (paths relative to the repo)."""
    args = [a.replace(f"{ROOT}/", "") for a in rendered.helm_args]
    return ["helm", "template", RELEASE, "deploy/helm/ghostgpu", "--namespace", NAMESPACE, *args]


def render(helm: str, rendered: Rendered) -> str:
    """The file's whole text: the GENERATED notice, its header, the Namespace, then helm's output."""
    argv = [helm, *command_line(rendered)[1:]]
    try:
        p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=HELM_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RenderError(f"{' '.join(argv)}: {exc}") from exc
    if p.returncode != 0:
        raise RenderError(f"{' '.join(command_line(rendered))}: {p.stderr.strip() or p.returncode}")
    notice = ("# GENERATED from deploy/helm/ghostgpu by scripts/render_manifests.py: do not edit; change\n"
              "# the chart and run `.venv/bin/python scripts/render_manifests.py`. It is the output of\n"
              f"#   {' '.join(command_line(rendered))}\n#\n")
    body = p.stdout.removeprefix("---\n")
    if rendered.with_namespace:
        body = f"{NAMESPACE_DOCUMENT}---\n{body}"
    return f"{notice}{rendered.header}{body}"


def expected(helm: str) -> dict[Path, str]:
    """Every generated file's path and the text it must have."""
    out = {dst: src.read_text() for src, dst in COPIES}
    for rendered in MANIFESTS:
        out[rendered.path] = render(helm, rendered)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 naming each file that differs from the chart's render")
    args = parser.parse_args(argv)
    try:
        files = expected(find_helm())
    except RenderError as exc:
        print(f"render_manifests: {exc}", file=sys.stderr)
        return 2
    stale = [path for path, text in files.items() if not path.exists() or path.read_text() != text]
    for path in stale:
        relative = path.relative_to(ROOT)
        if args.check:
            print(f"{relative}: out of step with deploy/helm/ghostgpu; run "
                  "`.venv/bin/python scripts/render_manifests.py`", file=sys.stderr)
        else:
            path.write_text(files[path])
            print(f"wrote {relative}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
