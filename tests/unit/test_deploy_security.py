"""deploy/kubernetes, the security half, for the single collector (ghostgpu.yaml) and the replicas
(replicated/ghostgpu.yaml) alike: every core kind validates against Kubernetes' own schemas
(kubernetes-validate, strict), the cert-manager kinds are checked field by field (their CRDs are not in
those schemas), the tracer runs with exactly the measured capabilities, the collector as non-root, every
file a flag names is mounted, and the policy and web config parse with ghostgpu's own parsers."""

from __future__ import annotations

import os
import re
from pathlib import Path

import bcrypt
import pytest
from ghostgpu.collector.policy import Policy
from ghostgpu.tracer.capabilities import NEEDED_NAMES

from ghostgpu.common.model.durations import parse_duration_s
from ghostgpu.common.transport.principal import Principal
from ghostgpu.common.web.webconfig import WebConfigError, parse_web_config
from tests.helpers.kube_schemas import K8S_VERSIONS, is_core, validate_core
from tests.helpers.manifests import DEPLOY, MANIFESTS, Manifest, flag

# Kinds of the Kubernetes API itself are validated against its schemas (tests/helpers/kube_schemas.py).
# The others, each checked field by field where it is used: cert-manager's below, the Prometheus
# Operator's monitors in test_deploy.py and here, CloudNativePG's Cluster in test_deploy_replicated.py.
CUSTOM_KINDS = {("cert-manager.io/v1", "Issuer"), ("cert-manager.io/v1", "Certificate"),
                ("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PodMonitor"),
                ("postgresql.cnpg.io/v1", "Cluster")}
# cert-manager.io/v1 fields used here (https://cert-manager.io/docs/reference/api-docs/).
CERTIFICATE_FIELDS = {"secretName", "commonName", "dnsNames", "uris", "ipAddresses", "usages", "duration",
                      "renewBefore", "privateKey", "issuerRef", "isCA", "subject"}
PRIVATE_KEY_FIELDS = {"algorithm", "size", "rotationPolicy", "encoding"}
SERVING_SECRETS = {"ghostgpu-collector-tls", "ghostgpu-tracer-metrics-tls"}
KEY_USAGES = {"server auth", "client auth", "digital signature", "key encipherment", "cert sign"}
EVERY_FILE = sorted(DEPLOY.rglob("*.yaml"))


@pytest.fixture(params=MANIFESTS, ids=lambda p: str(p.relative_to(p.parents[1])))
def m(request: pytest.FixtureRequest) -> Manifest:
    path: Path = request.param
    return Manifest(path)


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
@pytest.mark.parametrize("path", EVERY_FILE, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_body_validates_against_the_kubernetes_schemas(path: Path, k8s_version: str) -> None:
    documents = Manifest(path).documents
    assert documents
    for doc in documents:
        if is_core(doc["apiVersion"]):
            validate_core(doc, k8s_version)  # one line naming the object and the field
        else:  # a custom resource: one of those checked field by field
            custom = (doc["apiVersion"], doc["kind"])
            assert custom in CUSTOM_KINDS, f"{path.name}: {doc['kind']} is checked nowhere"


def test_every_manifest_is_checked() -> None:
    """A new file under deploy/kubernetes is validated above; a new collector's belongs in MANIFESTS."""
    assert set(MANIFESTS) <= set(EVERY_FILE)
    collectors = {p for p in EVERY_FILE if Manifest(p).by_kind("Deployment")}
    assert collectors == set(MANIFESTS)


def test_cert_manager_resources_chain_self_signed_root_ca_issuer_collector(m: Manifest) -> None:
    issuers, certs = m.by_kind("Issuer"), m.by_kind("Certificate")
    assert all(d["apiVersion"] == "cert-manager.io/v1" for d in (*issuers.values(), *certs.values()))
    assert issuers["ghostgpu-selfsigned"]["spec"] == {"selfSigned": {}}
    ca_issuer = issuers["ghostgpu-ca"]["spec"]
    assert list(ca_issuer) == ["ca"]
    ca = certs["ghostgpu-ca"]["spec"]
    assert ca["isCA"] is True and ca["issuerRef"]["name"] == "ghostgpu-selfsigned"
    assert ca["secretName"] == ca_issuer["ca"]["secretName"]
    assert ca["uris"] == ["spiffe://ghostgpu"]  # the trust domain, as `ghostgpu certs init` records it
    for name, cert in certs.items():
        spec = cert["spec"]
        assert set(spec) <= CERTIFICATE_FIELDS, f"{name}: unknown fields {set(spec) - CERTIFICATE_FIELDS}"
        assert set(spec["privateKey"]) <= PRIVATE_KEY_FIELDS and spec["privateKey"]["algorithm"] == "ECDSA"
        ref = spec["issuerRef"]
        assert ref["kind"] == "Issuer" and ref["group"] == "cert-manager.io" and ref["name"] in issuers
        assert set(spec.get("usages", [])) <= KEY_USAGES
        for key in ("duration", "renewBefore"):
            if key in spec:  # Go durations; cert-manager takes h, m, s
                assert re.fullmatch(r"\d+h", spec[key]) and parse_duration_s(spec[key], key) > 0
        if "renewBefore" in spec:
            assert parse_duration_s(spec["renewBefore"], "") < parse_duration_s(spec["duration"], "")
        if name != "ghostgpu-ca":
            assert ref["name"] == "ghostgpu-ca" and "server auth" in spec["usages"]
            assert spec["commonName"] in spec["dnsNames"]
    collector = certs["ghostgpu-collector"]["spec"]
    assert collector["uris"] == ["spiffe://ghostgpu/collector"]
    tracer_args = m.container("DaemonSet", "ghostgpu-tracer")["args"]
    assert flag(tracer_args, "--collector").rsplit(":", 1)[0] in collector["dnsNames"]


def test_the_collector_serves_the_certificate_cert_manager_writes(m: Manifest) -> None:
    c = m.container("Deployment", "ghostgpu-collector")
    secret = m.by_kind("Certificate")["ghostgpu-collector"]["spec"]["secretName"]
    for name, key in (("--tls-cert", "tls.crt"), ("--tls-key", "tls.key"), ("--tls-ca", "ca.crt")):
        path = flag(c["args"], name)
        volume = m.mounted("Deployment", "ghostgpu-collector", path)
        assert os.path.basename(path) == key and volume["secret"]["secretName"] == secret


def test_the_tracer_has_exactly_the_measured_capabilities_each_with_its_reason(m: Manifest) -> None:
    c = m.container("DaemonSet", "ghostgpu-tracer")
    sc = c["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True and sc["runAsUser"] == 0
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sorted(f"CAP_{cap}" for cap in sc["capabilities"]["add"]) == sorted(NEEDED_NAMES)
    for cap in sc["capabilities"]["add"]:  # a comment says why, on the capability's own line
        assert re.search(rf"^\s+- {cap}\s+# \S.+$", m.text, re.M), f"{cap}: no comment why"
    # The runtime defaults would undo the capabilities: seccomp refuses bpf() without CAP_SYS_ADMIN,
    # AppArmor ptrace-reads only the container's own processes.
    assert sc["seccompProfile"] == {"type": "Unconfined"} and sc["appArmorProfile"] == {"type": "Unconfined"}
    assert "privileged: true" not in m.text
    spec = m.pod("DaemonSet", "ghostgpu-tracer")
    assert spec["automountServiceAccountToken"] is False
    tmp = m.mounted("DaemonSet", "ghostgpu-tracer", "/tmp/x")
    assert "emptyDir" in tmp  # the one writable path, with the root filesystem read-only


def test_each_tracer_brings_its_own_node_identity_from_the_host(m: Manifest) -> None:
    c = m.container("DaemonSet", "ghostgpu-tracer")
    assert flag(c["args"], "--node-name") == "$(NODE_NAME)"
    for name in ("--tls-cert", "--tls-key", "--tls-ca"):
        volume = m.mounted("DaemonSet", "ghostgpu-tracer", flag(c["args"], name))
        # type Directory: a node without its identity keeps the pod from starting, never a tracer
        # that runs without one.
        assert volume["hostPath"] == {"path": "/etc/ghostgpu/pki", "type": "Directory"}


def test_the_collector_runs_as_non_root_with_a_read_only_root(m: Manifest) -> None:
    spec = m.pod("Deployment", "ghostgpu-collector")
    c = m.container("Deployment", "ghostgpu-collector")
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 65532
    assert spec["securityContext"]["fsGroup"] == 65532  # the PVC and the Secrets' files are its group's
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    if any(a.startswith("--db=") for a in c["args"]):  # the single collector: SQLite on its volume
        db = flag(c["args"], "--db")
        assert "persistentVolumeClaim" in m.mounted("Deployment", "ghostgpu-collector", db)
    else:  # the replicas: their store is PostgreSQL, nothing of it on a volume (test_deploy_replicated.py)
        assert not any("persistentVolumeClaim" in v for v in spec["volumes"])
    assert "emptyDir" in m.mounted("Deployment", "ghostgpu-collector", "/tmp/x")  # SQLite's temp files
    secret_volumes = [v for v in spec["volumes"] if "secret" in v or "projected" in v]
    assert secret_volumes
    for volume in secret_volumes:  # readable by fsGroup 65532, by nobody else
        assert (volume.get("secret") or volume["projected"])["defaultMode"] == 0o440


def test_the_policy_config_map_parses_and_lets_each_node_stream(m: Manifest) -> None:
    c = m.container("Deployment", "ghostgpu-collector")
    path = flag(c["args"], "--policy")
    volume = m.mounted("Deployment", "ghostgpu-collector", path)
    text = m.by_kind("ConfigMap")[volume["configMap"]["name"]]["data"][os.path.basename(path)]
    policy = Policy.parse(text, path)  # PolicyError names the key
    assert policy.roles(Principal("node", "gpu-node-1", via="mtls")) == {"tracer"}
    assert policy.roles(Principal("user", "mallory", via="mtls")) == frozenset()
    assert "admin" in policy.roles(Principal("user", "ops", ("ghostgpu-admins",), via="mtls"))


def test_the_web_config_fails_closed_until_a_password_is_set_and_then_serves_tls(m: Manifest) -> None:
    secrets = m.by_kind("Secret")
    for kind, name in (("Deployment", "ghostgpu-collector"), ("DaemonSet", "ghostgpu-tracer")):
        c = m.container(kind, name)
        path = flag(c["args"], "--web-config-file")
        volume = m.mounted(kind, name, path)
        text = secrets[volume["secret"]["secretName"]]["stringData"][os.path.basename(path)]
        # As shipped: no known password anywhere; the pod says which key to fill and stops.
        with pytest.raises(WebConfigError, match=r"basic_auth_users\.prometheus: not a bcrypt hash"):
            parse_web_config(text, path)
        hashed = bcrypt.hashpw(b"x", bcrypt.gensalt(4)).decode()
        config = parse_web_config(text.replace("REPLACE_WITH_BCRYPT_HASH", f"'{hashed}'"), path)
        assert config.tls is not None and set(config.users) == {"prometheus"}
        for file in (config.tls.cert_file, config.tls.key_file):  # relative to the web config's directory
            serving = m.mounted(kind, name, os.path.normpath(file))
            assert serving["secret"]["secretName"] in SERVING_SECRETS
    assert secrets["ghostgpu-scrape-auth"]["stringData"]["username"] == "prometheus"


def test_probes_use_https_and_monitors_send_the_scrape_credentials(m: Manifest) -> None:
    c = m.container("DaemonSet", "ghostgpu-tracer")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["scheme"] == "HTTPS"  # kubelet does not verify; no credentials needed
    certs = m.by_kind("Certificate")
    service_monitor = m.by_kind("ServiceMonitor")["ghostgpu-collector"]["spec"]["endpoints"][0]
    pod_monitor = m.by_kind("PodMonitor")["ghostgpu-tracer"]["spec"]["podMetricsEndpoints"][0]
    monitors = [(service_monitor, "ghostgpu-collector"), (pod_monitor, "ghostgpu-tracer-metrics")]
    for endpoint, cert in monitors:
        assert endpoint["scheme"] == "https"
        tls = endpoint["tlsConfig"]
        assert tls["ca"]["secret"] == {"name": certs[cert]["spec"]["secretName"], "key": "ca.crt"}
        assert tls["serverName"] in certs[cert]["spec"]["dnsNames"]
        auth = endpoint["basicAuth"]
        assert auth["username"] == {"name": "ghostgpu-scrape-auth", "key": "username"}
        assert auth["password"] == {"name": "ghostgpu-scrape-auth", "key": "password"}
