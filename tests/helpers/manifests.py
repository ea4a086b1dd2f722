"""The Kubernetes manifests under deploy/kubernetes, read for the tests that check them
(tests/unit/test_deploy.py, test_deploy_security.py, test_deploy_replicated.py).

    m = Manifest(SINGLE)
    args = m.container("Deployment", "ghostgpu-collector")["args"]
    m.mounted("Deployment", "ghostgpu-collector", flag(args, "--tls-cert"))  # the volume behind a path

SINGLE is the one collector on SQLite (deploy/kubernetes/ghostgpu.yaml), REPLICATED the collector
replicas over PostgreSQL (deploy/kubernetes/replicated/ghostgpu.yaml); MANIFESTS both, for the checks
that hold for each.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

import yaml  # Debian's python3-yaml (scripts/bootstrap.sh installs it)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
SINGLE = DEPLOY / "ghostgpu.yaml"
REPLICATED = DEPLOY / "replicated" / "ghostgpu.yaml"
CLOUDNATIVEPG = DEPLOY / "replicated" / "cloudnativepg-cluster.yaml"
STORE_SECRETS_EXAMPLE = DEPLOY / "replicated" / "store-secrets.example.yaml"
MANIFESTS = (SINGLE, REPLICATED)


def flag(args: list[str], name: str) -> str:
    """The value of the one `--name=value` in a container's args."""
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    return value


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """Whether a matchLabels selector selects an object with these labels."""
    return all(labels.get(k) == v for k, v in selector.items())


class Documents:
    """Kubernetes objects of a YAML text (`text`, a subclass's), looked up by kind and name: a manifest
    file here, a chart's render in tests/helpers/helm.py."""

    text: str

    @cached_property
    def documents(self) -> list[dict[str, Any]]:
        return [d for d in yaml.safe_load_all(self.text) if d]

    def by_kind(self, kind: str) -> dict[str, dict[str, Any]]:
        return {d["metadata"]["name"]: d for d in self.documents if d["kind"] == kind}

    def get(self, kind: str, name: str) -> dict[str, Any]:
        return self.by_kind(kind)[name]

    def pod(self, kind: str, name: str) -> dict[str, Any]:
        """The pod template's spec of a Deployment or DaemonSet."""
        spec: dict[str, Any] = self.get(kind, name)["spec"]["template"]["spec"]
        return spec

    def container(self, kind: str, name: str) -> dict[str, Any]:
        (c,) = self.pod(kind, name)["containers"]
        return c

    def port_named(self, kind: str, name: str, port: str) -> int:
        (number,) = [p["containerPort"] for p in self.container(kind, name)["ports"] if p["name"] == port]
        return int(number)

    def mounted(self, kind: str, name: str, path: str) -> dict[str, Any]:
        """The volume whose mount holds `path` in the pod's container."""
        c = self.container(kind, name)
        mounts = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
        assert mounts, f"{self}: {name}: nothing mounted at {path}"
        mount = max(mounts, key=lambda m: len(m["mountPath"]))
        (volume,) = [v for v in self.pod(kind, name)["volumes"] if v["name"] == mount["name"]]
        return volume

    def secret_key_at(self, kind: str, name: str, path: str) -> tuple[str, str]:
        """(Secret name, key) of the file at `path`, from a secret or a projected volume."""
        c = self.container(kind, name)
        volume = self.mounted(kind, name, path)
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == volume["name"]
                    and path.startswith(m["mountPath"].rstrip("/") + "/")]
        relative = path[len(mount["mountPath"].rstrip("/")) + 1:]
        if "secret" in volume:
            secret = volume["secret"]
            sources = [{"secret": {"name": secret["secretName"], "items": secret.get("items")}}]
        else:
            sources = volume["projected"]["sources"]
        for source in sources:
            secret = source.get("secret")
            if secret is None:
                continue
            items = secret.get("items")
            if items is None:  # every key, each as a file of its name
                return secret["name"], relative
            for item in items:
                if item["path"] == relative:
                    return secret["name"], item["key"]
        raise AssertionError(f"{self}: {name}: no Secret projects {path}")


class Manifest(Documents):
    """One manifest file's documents."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __repr__(self) -> str:
        return str(self.path.relative_to(DEPLOY))

    @cached_property
    def text(self) -> str:  # type: ignore[override]  # a read-only property over the base attribute
        return self.path.read_text()
