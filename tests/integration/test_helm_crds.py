"""The chart's cert-manager and Prometheus Operator objects validate against the schemas of the Go API
types their CRDs are generated from, for every values file under deploy/helm/ghostgpu/ci.

How: the npm packages @kubernetes-models/cert-manager and @kubernetes-models/prometheus-operator
(pinned) ship ajv validators generated from github.com/cert-manager/cert-manager/pkg/apis/certmanager/v1
and github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1 (their package.json's
"go-generate" inputs; https://github.com/tommy351/kubernetes-models-ts, third-party/). They are
installed once into tests/helpers/build (git-ignored, kept between runs), and
tests/helpers/crd_validate.mjs runs each object through its kind's validator: a wrong type, a missing
required field or a value outside an enum is one line each, and so is a field the Go type does not
have (the generated schemas would let it pass; the script records what the validator reads).
Integration because it installs from the npm registry on first use; tests/unit/test_helm_chart.py
checks the same objects' field names without it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers.helm import Render, ci_values_files, render_values_file, values_id
from tests.helpers.kube_schemas import CRD_KINDS, is_core
from tests.helpers.npm_cache import npm_install_once

REPO = Path(__file__).resolve().parents[2]
MODELS_VERSION = "6.0.0"  # pinned: both packages' validators are what this test trusts
PACKAGES = [f"@kubernetes-models/cert-manager@{MODELS_VERSION}",
            f"@kubernetes-models/prometheus-operator@{MODELS_VERSION}"]
CACHE = REPO / "tests" / "helpers" / "build" / f"kubernetes-models-{MODELS_VERSION}"
VALIDATOR = REPO / "tests" / "helpers" / "crd_validate.mjs"
NODE_TIMEOUT_S = 60


def _node() -> str:
    node = shutil.which("node")
    if not node:
        pytest.skip("node is not installed (apt-get install nodejs npm; scripts/bootstrap.sh install)")
    return node


@pytest.fixture(scope="module")
def models() -> Path:
    """The folder whose node_modules holds both packages, installed from the npm registry on first use."""
    installed = [CACHE / "node_modules" / "@kubernetes-models" / name / "package.json"
                 for name in ("cert-manager", "prometheus-operator")]
    return npm_install_once(CACHE, PACKAGES, installed)


def crd_check(models: Path, docs: list[dict[str, Any]]) -> tuple[int, list[str]]:
    """(exit status, the lines) of tests/helpers/crd_validate.mjs on these objects."""
    try:
        done = subprocess.run([_node(), str(VALIDATOR), str(models)], input=json.dumps(docs),
                              capture_output=True, text=True, timeout=NODE_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{VALIDATOR.name}: no answer within {NODE_TIMEOUT_S} s") from e
    assert done.returncode in (0, 1), f"{VALIDATOR.name} failed (exit {done.returncode}):\n{done.stderr}"
    return done.returncode, done.stdout.splitlines()


@pytest.fixture(params=ci_values_files(), ids=values_id)
def rendered(request: pytest.FixtureRequest) -> Render:
    path: Path = request.param
    return render_values_file(path)


def test_custom_resources_validate_against_their_go_types(models: Path, rendered: Render) -> None:
    custom = [d for d in rendered.documents if not is_core(d["apiVersion"])]
    assert {(d["apiVersion"], d["kind"]) for d in custom} <= CRD_KINDS
    if not custom:
        return  # cert-manager off and no monitors: nothing of theirs rendered
    status, lines = crd_check(models, custom)
    assert (status, lines) == (0, []), "\n".join(lines)


def test_the_plain_prometheus_rule_validates(models: Path) -> None:
    """The PrometheusRule the chart renders is deploy/prometheus/ghostgpu-prometheusrule.yaml's rules;
    the shipped file itself validates too."""
    path = REPO / "deploy" / "prometheus" / "ghostgpu-prometheusrule.yaml"
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert [d["kind"] for d in docs] == ["PrometheusRule"]
    assert crd_check(models, docs) == (0, [])


# Deliberately wrong objects and the line each must give: the validator bites on a wrong type, a
# value outside an enum, a missing required field and a misspelt field, at any depth.
BAD = [
    ({"apiVersion": "cert-manager.io/v1", "kind": "Certificate", "metadata": {"name": "bad"},
      "spec": {"secretName": "s", "issuerRef": {"name": "ca"}, "duration": 2160}},
     "Certificate/bad: /spec/duration: must be string"),
    ({"apiVersion": "cert-manager.io/v1", "kind": "Certificate", "metadata": {"name": "bad"},
      "spec": {"secretName": "s", "issuerRef": {"name": "ca"}, "privateKey": {"algorithm": "DSA"}}},
     'Certificate/bad: /spec/privateKey/algorithm: must be equal to one of the allowed values '
     '("RSA", "ECDSA", "Ed25519")'),
    ({"apiVersion": "cert-manager.io/v1", "kind": "Certificate", "metadata": {"name": "bad"},
      "spec": {"issuerRef": {"name": "ca"}}},
     "Certificate/bad: /spec: must have required property secretName"),
    ({"apiVersion": "cert-manager.io/v1", "kind": "Certificate", "metadata": {"name": "bad"},
      "spec": {"secretName": "s", "issuerRef": {"name": "ca"}, "dnsName": ["x"]}},
     "Certificate/bad: /spec/dnsName: unknown field (cert-manager.io/v1 Certificate has no such field)"),
    ({"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": {"name": "bad"},
      "spec": {"selector": {}, "endpoints": [{"port": "metrics", "tlsConfig": {"serverNmae": "x"}}]}},
     "ServiceMonitor/bad: /spec/endpoints/0/tlsConfig/serverNmae: unknown field "
     "(monitoring.coreos.com/v1 ServiceMonitor has no such field)"),
    ({"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": {"name": "bad"},
      "spec": {"selector": {}, "podMetricsEndpoints": [{"port": "health", "scheme": "ftp"}]}},
     'PodMonitor/bad: /spec/podMetricsEndpoints/0/scheme: must be equal to one of the allowed values '
     '("http", "https", "HTTP", "HTTPS")'),
    ({"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": {"name": "bad"},
      "spec": {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "up", "for": 300}]}]}},
     "PrometheusRule/bad: /spec/groups/0/rules/0/for: must be string"),
    ({"apiVersion": "cert-manager.io/v9", "kind": "Certificate", "metadata": {"name": "bad"}, "spec": {}},
     "Certificate/bad: no schema for cert-manager.io/v9 Certificate in @kubernetes-models/cert-manager, "
     "@kubernetes-models/prometheus-operator"),
]


@pytest.mark.parametrize(("doc", "line"), BAD, ids=[line.split(": ", 1)[1][:40] for _, line in BAD])
def test_the_validator_bites(models: Path, doc: dict[str, Any], line: str) -> None:
    status, lines = crd_check(models, [doc])
    assert status == 1 and line in lines, lines
