"""Kubernetes objects checked against Kubernetes' own OpenAPI schemas with kubernetes-validate, strict
(an unknown field fails), for the plain manifests (tests/unit/test_deploy_security.py) and the
chart's renders (tests/unit/test_helm_chart.py) alike.

    if is_core(doc["apiVersion"]):
        validate_core(doc)   # AssertionError: "Deployment/ghostgpu-collector: spec.template...: why"

A core kind is one of the Kubernetes API itself, the kinds kubernetes-validate has schemas for: a
group without a dot (`v1`, `apps/v1`, `policy/v1`, `batch/v1`) or one under `k8s.io`
(`rbac.authorization.k8s.io/v1`). Any other is a custom resource, for a CRD's own schema
(tests/helpers/crd_validate.mjs).
"""

from __future__ import annotations

from typing import Any

import pytest

# The oldest Kubernetes with securityContext.appArmorProfile, which the tracer sets (the chart's
# kubeVersion floor), and a current one.
K8S_VERSIONS = ("1.30.0", "1.32.0")


def is_core(api_version: str) -> bool:
    group = api_version.rpartition("/")[0]
    return "." not in group or group == "k8s.io" or group.endswith(".k8s.io")


def validate_core(doc: dict[str, Any], k8s_version: str) -> None:
    """One line naming the object, the field and what is wrong, else nothing."""
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate (the dev extra; .ci/run installs it)")
    try:
        kubernetes_validate.validate(doc, k8s_version, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = ".".join(str(p) for p in e.absolute_path) or "(the object)"
        raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']}: {where}: {e.message} "
                             f"(Kubernetes {k8s_version})") from None


# The custom resources' fields, for a check that needs no npm: for each (kind, path) the chart may
# render, every field the Go API type has there (a list's items as `[]`). Taken from
# https://cert-manager.io/docs/reference/api-docs/ (cert-manager.io/v1) and
# https://prometheus-operator.dev/docs/api-reference/api/ (monitoring.coreos.com/v1); the schemas
# behind tests/helpers/crd_validate.mjs, which also reads every other level, agree. A field that is
# neither here nor the Go type's is a misspelling that the CRD would prune without a word.
_SCRAPE_ENDPOINT = {
    "port", "targetPort", "path", "scheme", "params", "interval", "scrapeTimeout", "honorLabels",
    "honorTimestamps", "trackTimestampsStaleness", "metricRelabelings", "relabelings", "filterRunning",
    "authorization", "basicAuth", "bearerTokenSecret", "oauth2", "followRedirects", "enableHttp2",
    "tlsConfig", "proxyUrl", "noProxy", "proxyFromEnvironment", "proxyConnectHeader"}
_MONITOR_SPEC = {
    "jobLabel", "podTargetLabels", "selector", "selectorMechanism", "namespaceSelector", "sampleLimit",
    "targetLimit", "scrapeProtocols", "fallbackScrapeProtocol", "labelLimit", "labelNameLengthLimit",
    "labelValueLengthLimit", "scrapeClassicHistograms", "scrapeNativeHistograms",
    "nativeHistogramBucketLimit", "nativeHistogramMinBucketFactor", "convertClassicHistogramsToNHCB",
    "keepDroppedTargets", "attachMetadata", "scrapeClass", "bodySizeLimit"}
_TLS_CONFIG = {"ca", "cert", "keySecret", "serverName", "insecureSkipVerify", "minVersion", "maxVersion"}
_SECRET_KEY = {"name", "key", "optional"}
_RELABEL = {"sourceLabels", "separator", "targetLabel", "regex", "modulus", "replacement", "action"}
CRD_FIELDS: dict[tuple[str, str], set[str]] = {
    ("Certificate", "spec"): {
        "subject", "literalSubject", "commonName", "duration", "renewBefore", "renewBeforePercentage",
        "dnsNames", "ipAddresses", "uris", "otherNames", "emailAddresses", "secretName", "secretTemplate",
        "keystores", "issuerRef", "isCA", "usages", "privateKey", "signatureAlgorithm",
        "encodeUsagesInRequest", "revisionHistoryLimit", "additionalOutputFormats", "nameConstraints"},
    ("Certificate", "spec.privateKey"): {"rotationPolicy", "encoding", "algorithm", "size"},
    ("Certificate", "spec.issuerRef"): {"name", "kind", "group"},
    ("Issuer", "spec"): {"acme", "ca", "vault", "selfSigned", "venafi"},
    ("Issuer", "spec.ca"): {"secretName", "crlDistributionPoints", "ocspServers", "issuingCertificateURLs"},
    ("Issuer", "spec.selfSigned"): {"crlDistributionPoints"},
    ("ServiceMonitor", "spec"): _MONITOR_SPEC | {"endpoints", "targetLabels", "serviceDiscoveryRole"},
    ("ServiceMonitor", "spec.endpoints[]"): _SCRAPE_ENDPOINT | {"bearerTokenFile"},
    ("ServiceMonitor", "spec.endpoints[].tlsConfig"): _TLS_CONFIG | {"caFile", "certFile", "keyFile"},
    ("ServiceMonitor", "spec.endpoints[].tlsConfig.ca"): {"configMap", "secret"},
    ("ServiceMonitor", "spec.endpoints[].tlsConfig.ca.secret"): _SECRET_KEY,
    ("ServiceMonitor", "spec.endpoints[].basicAuth"): {"username", "password"},
    ("ServiceMonitor", "spec.endpoints[].basicAuth.username"): _SECRET_KEY,
    ("ServiceMonitor", "spec.endpoints[].basicAuth.password"): _SECRET_KEY,
    ("ServiceMonitor", "spec.endpoints[].relabelings[]"): _RELABEL,
    ("ServiceMonitor", "spec.endpoints[].metricRelabelings[]"): _RELABEL,
    ("PodMonitor", "spec"): _MONITOR_SPEC | {"podMetricsEndpoints"},
    ("PodMonitor", "spec.podMetricsEndpoints[]"): _SCRAPE_ENDPOINT | {"portNumber"},
    ("PodMonitor", "spec.podMetricsEndpoints[].tlsConfig"): _TLS_CONFIG,
    ("PodMonitor", "spec.podMetricsEndpoints[].tlsConfig.ca"): {"configMap", "secret"},
    ("PodMonitor", "spec.podMetricsEndpoints[].tlsConfig.ca.secret"): _SECRET_KEY,
    ("PodMonitor", "spec.podMetricsEndpoints[].basicAuth"): {"username", "password"},
    ("PodMonitor", "spec.podMetricsEndpoints[].basicAuth.username"): _SECRET_KEY,
    ("PodMonitor", "spec.podMetricsEndpoints[].basicAuth.password"): _SECRET_KEY,
    ("PodMonitor", "spec.podMetricsEndpoints[].relabelings[]"): _RELABEL,
    ("PodMonitor", "spec.podMetricsEndpoints[].metricRelabelings[]"): _RELABEL,
    ("PrometheusRule", "spec"): {"groups"},
    ("PrometheusRule", "spec.groups[]"): {"name", "labels", "interval", "query_offset", "limit",
                                          "partial_response_strategy", "rules"},
    ("PrometheusRule", "spec.groups[].rules[]"): {"record", "alert", "expr", "for", "keep_firing_for",
                                                  "labels", "annotations"},
}
# The cert-manager and Prometheus Operator kinds the chart may render (apiVersion, kind).
CRD_KINDS = {("cert-manager.io/v1", "Certificate"), ("cert-manager.io/v1", "Issuer"),
             ("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PodMonitor"),
             ("monitoring.coreos.com/v1", "PrometheusRule")}


def unknown_crd_fields(doc: dict[str, Any]) -> list[str]:
    """Every field of a custom resource, at a path CRD_FIELDS lists, that the kind has not there."""
    out: list[str] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, list):
            for item in value:
                walk(item, f"{path}[]")
            return
        if not isinstance(value, dict):
            return
        allowed = CRD_FIELDS.get((doc["kind"], path))
        if allowed is None:
            return  # a level the chart's checks do not list (a map, a selector): the npm check reads it
        for key, child in value.items():
            if key not in allowed:
                out.append(f"{doc['kind']}/{doc['metadata']['name']}: {path}.{key}: not a field of "
                           f"{doc['apiVersion']} {doc['kind']}")
            else:
                walk(child, f"{path}.{key}")

    walk(doc.get("spec"), "spec")
    return out
