"""deploy/kubernetes/replicated: what the collector replicas need from their manifests (docs/REPLICAS.md).

Three replicas rolled one at a time, a disruption budget that keeps two, one replica per node; the store
from Secrets and never a literal (the URI in env GHOSTGPU_STORE from a secretKeyRef, the password a file
of a mounted Secret), each replica named by its pod; readiness on the collector's /readyz; the tracers
dialing a headless Service that resolves to every ready replica, a name the collector's certificate
carries; the CloudNativePG Cluster and the example Secrets with the names and keys the collectors read.
Everything else in replicated/ghostgpu.yaml must be what ghostgpu.yaml has, so the two cannot drift.
test_deploy.py and test_deploy_security.py check both files for what holds for each (the CLI parses
every command line, every body validates against the Kubernetes schemas, the security settings)."""

from __future__ import annotations

import copy
import re
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from ghostgpu.cli import main as cli
from ghostgpu.collector.config import collector_config
from ghostgpu.collector.db import parse_store_url
from ghostgpu.collector.health import PROBE_PATHS

from ghostgpu.common.transport.addresses import parse_listen
from ghostgpu.common.transport.collector_target import parse_collector
from tests.helpers.manifests import (
    CLOUDNATIVEPG,
    REPLICATED,
    SINGLE,
    STORE_SECRETS_EXAMPLE,
    Manifest,
    flag,
    selects,
)

COLLECTOR = ("Deployment", "ghostgpu-collector")
TRACER = ("DaemonSet", "ghostgpu-tracer")
# What replication changes: anything else differs from ghostgpu.yaml only by a test's leave.
CHANGED = {COLLECTOR, TRACER, ("Certificate", "ghostgpu-collector")}
ADDED = {("PodDisruptionBudget", "ghostgpu-collector"), ("Service", "ghostgpu-collector-headless")}
REMOVED = {("PersistentVolumeClaim", "ghostgpu-collector")}  # the SQLite volume
# CloudNativePG's Cluster fields used (postgresql.cnpg.io/v1, https://cloudnative-pg.io/documentation/).
CLUSTER_FIELDS = {"instances", "imageName", "minSyncReplicas", "maxSyncReplicas", "enableSuperuserAccess",
                  "bootstrap", "storage", "postgresql", "affinity", "resources", "certificates"}


def replicated() -> Manifest:
    return Manifest(REPLICATED)


def pod_labels(m: Manifest) -> dict[str, str]:
    labels: dict[str, str] = m.get(*COLLECTOR)["spec"]["template"]["metadata"]["labels"]
    return labels


def env(c: dict[str, Any], name: str) -> dict[str, Any]:
    (var,) = [e for e in c.get("env", []) if e["name"] == name]
    return var


def strings(node: Any) -> list[str]:
    """Every string value in a parsed document (comments are not in it)."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for v in node.values() for s in strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in strings(v)]
    return []


def test_three_replicas_roll_one_at_a_time() -> None:
    spec = replicated().get(*COLLECTOR)["spec"]
    assert spec["replicas"] == 3
    # Recreate (the single collector's) would stop all three at once.
    assert spec["strategy"] == {"type": "RollingUpdate",
                                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


def test_a_disruption_budget_selects_the_collectors_and_keeps_two() -> None:
    m = replicated()
    budgets = [b["spec"] for b in m.by_kind("PodDisruptionBudget").values()
               if selects(b["spec"]["selector"]["matchLabels"], pod_labels(m))]
    (budget,) = budgets
    tracer_labels = m.get(*TRACER)["spec"]["template"]["metadata"]["labels"]
    assert not selects(budget["selector"]["matchLabels"], tracer_labels)
    replicas = m.get(*COLLECTOR)["spec"]["replicas"]
    kept = budget["minAvailable"] if "minAvailable" in budget else replicas - budget["maxUnavailable"]
    assert kept >= 2
    # A replica that cannot reach the database is not ready and serves no one: a drain may take it.
    assert budget["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_the_replicas_spread_over_nodes() -> None:
    m = replicated()
    spec = m.pod(*COLLECTOR)
    by_key = {t["topologyKey"]: t for t in spec["topologySpreadConstraints"]}
    on_nodes = by_key["kubernetes.io/hostname"]
    assert on_nodes["maxSkew"] == 1 and on_nodes["whenUnsatisfiable"] == "DoNotSchedule"
    # Nodes it may not run on (tainted GPU nodes, the control plane) must not count as empty domains.
    assert on_nodes["nodeTaintsPolicy"] == "Honor"
    for constraint in by_key.values():
        assert constraint["labelSelector"]["matchLabels"] == pod_labels(m)
        assert constraint["whenUnsatisfiable"] in {"DoNotSchedule", "ScheduleAnyway"}


def test_the_store_comes_from_secrets_never_a_literal(monkeypatch: pytest.MonkeyPatch) -> None:
    m = replicated()
    c = m.container(*COLLECTOR)
    args = c["args"]
    # No URI on the command line (it would show in every process listing) nor a SQLite path.
    assert not [a for a in args if a.startswith(("--store=", "--store ", "--db"))]
    store = env(c, "GHOSTGPU_STORE")
    assert set(store) == {"name", "valueFrom"}
    assert store["valueFrom"] == {"secretKeyRef": {"name": "ghostgpu-store", "key": "dsn"}}
    for doc in m.documents:  # nowhere in the file a URI or a password as a value
        assert not [s for s in strings(doc) if "postgres://" in s or "postgresql://" in s], doc["kind"]
    password = flag(args, "--store-password-file")
    assert m.secret_key_at(*COLLECTOR, password) == ("ghostgpu-db-app", "password")
    assert m.mounted(*COLLECTOR, password)["projected"]["defaultMode"] == 0o440
    # Each replica is its pod: the name its leases carry.
    assert flag(args, "--replica-id") == "$(POD_NAME)"
    assert env(c, "POD_NAME")["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # The real collector reads them so: the URI from GHOSTGPU_STORE, the id from the expanded flag.
    dsn = Manifest(CLOUDNATIVEPG).get("Secret", "ghostgpu-store")["stringData"]["dsn"]
    monkeypatch.setenv("GHOSTGPU_STORE", dsn)
    expanded = [a.replace("$(POD_NAME)", "ghostgpu-collector-7d9f-x2x8z") for a in args]
    config = collector_config(cli._build_parser().parse_args(expanded))
    assert config.store_location() == dsn and parse_store_url(dsn).engine == "postgresql"
    assert config.store_password_file == password
    assert config.replica_name() == "ghostgpu-collector-7d9f-x2x8z"


def test_readiness_is_the_collectors_readyz_and_liveness_its_healthz() -> None:
    m = replicated()
    c = m.container(*COLLECTOR)
    ready = c["readinessProbe"]["httpGet"]
    assert (ready["path"], ready["port"], ready["scheme"]) == ("/readyz", "metrics", "HTTPS")
    metrics_port = parse_listen(flag(c["args"], "--metrics-listen"), "--metrics-listen")[1]
    assert metrics_port == m.port_named(*COLLECTOR, "metrics")
    assert flag(c["args"], "--web-config-file")  # the HTTPS the probe speaks
    # A database outage makes every replica unready; it must not restart them (they resume without
    # loss), so liveness and startup ask /healthz (the event loop answers), never /readyz.
    for probe in ("livenessProbe", "startupProbe"):
        check = c[probe]["httpGet"]
        assert (check["path"], check["port"], check["scheme"]) == ("/healthz", "metrics", "HTTPS"), probe
    # Both paths are the collector's probes, open to kubelet (which sends no credentials).
    assert {ready["path"], "/healthz"} == set(PROBE_PATHS)


def test_the_tracers_dial_the_headless_service_of_every_replica() -> None:
    m = replicated()
    tracer_args = m.container(*TRACER)["args"]
    target = flag(tracer_args, "--collector")
    host, port = target.rsplit(":", 1)
    assert "," not in target and re.fullmatch(r"[a-z0-9-]+\.[a-z0-9-]+\.svc", host)  # one name, every record
    # The tracer's own parser: a name gRPC's dns:/// resolver turns into every replica's address, and
    # the name TLS checks on each of them.
    parsed = parse_collector(target)
    assert parsed.kind == "dns" and parsed.grpc_target() == f"dns:///{target}" and parsed.server_name == host
    name, namespace = host.split(".")[:2]
    headless = m.get("Service", name)
    assert headless["metadata"]["namespace"] == namespace
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"].get("publishNotReadyAddresses", False) is False  # ready replicas only
    assert headless["spec"]["selector"] == pod_labels(m)
    (grpc,) = headless["spec"]["ports"]
    assert grpc["port"] == int(port) and grpc["targetPort"] == "grpc"
    # The clients' Service stays a virtual IP over the same pods.
    client = m.get("Service", "ghostgpu-collector")
    assert client["spec"].get("clusterIP") != "None" and client["spec"]["selector"] == pod_labels(m)
    # Prometheus scrapes each replica once: the ServiceMonitor selects the clients' Service only.
    monitor = m.get("ServiceMonitor", "ghostgpu-collector")["spec"]["selector"]["matchLabels"]
    scraped = [n for n, s in m.by_kind("Service").items() if selects(monitor, s["metadata"]["labels"])]
    assert scraped == ["ghostgpu-collector"]
    # TLS checks the dialed name on whichever replica answers: the certificate they share names it.
    certificate = m.get("Certificate", "ghostgpu-collector")["spec"]
    assert host in certificate["dnsNames"] and f"{host}.cluster.local" in certificate["dnsNames"]


def test_everything_else_is_the_single_collectors() -> None:
    single, m = Manifest(SINGLE), replicated()
    keys = {(d["kind"], d["metadata"]["name"]) for d in single.documents}
    replicated_keys = {(d["kind"], d["metadata"]["name"]) for d in m.documents}
    assert replicated_keys - keys == ADDED and keys - replicated_keys == REMOVED
    for key in sorted(keys & replicated_keys - CHANGED):
        assert m.get(*key) == single.get(*key), f"{key}: differs from ghostgpu.yaml"
    # The tracers: only the address they dial.
    tracer = copy.deepcopy(m.get(*TRACER))
    (args,) = [c["args"] for c in tracer["spec"]["template"]["spec"]["containers"]]
    args[:] = [f"--collector={flag(single.container(*TRACER)['args'], '--collector')}"
               if a.startswith("--collector=") else a for a in args]
    assert tracer == single.get(*TRACER)
    # The certificate: the same, with the headless Service's names added.
    cert, single_cert = copy.deepcopy(m.get("Certificate", "ghostgpu-collector")), single.get(
        "Certificate", "ghostgpu-collector")
    names = cert["spec"].pop("dnsNames")
    assert set(single_cert["spec"]["dnsNames"]) < set(names)
    assert cert == {**single_cert, "spec": {k: v for k, v in single_cert["spec"].items() if k != "dnsNames"}}
    # The collector: the same image, security context, ports, resources, and TLS, policy and web
    # config mounts; only the store, the replica id, the probes and the scheduling differ.
    c, single_c = m.container(*COLLECTOR), single.container(*COLLECTOR)
    for field in ("image", "securityContext", "ports", "resources"):
        assert c[field] == single_c[field], field
    for name in ("--listen", "--metrics-listen"):
        assert flag(c["args"], name) == flag(single_c["args"], name), name
    for name in ("--tls-cert", "--tls-key", "--tls-ca", "--policy", "--web-config-file"):
        path = flag(c["args"], name)
        assert path == flag(single_c["args"], name), name
        assert m.mounted(*COLLECTOR, path) == single.mounted(*COLLECTOR, path), name
    pod, single_pod = m.pod(*COLLECTOR), single.pod(*COLLECTOR)
    assert pod["securityContext"] == single_pod["securityContext"]
    assert pod["automountServiceAccountToken"] is False


def test_the_cloudnativepg_cluster_and_the_collectors_agree() -> None:
    m, cnpg = replicated(), Manifest(CLOUDNATIVEPG)
    (cluster,) = cnpg.by_kind("Cluster").values()
    assert cluster["apiVersion"] == "postgresql.cnpg.io/v1"
    spec, name, namespace = cluster["spec"], cluster["metadata"]["name"], cluster["metadata"]["namespace"]
    assert set(spec) <= CLUSTER_FIELDS, f"fields not checked here: {set(spec) - CLUSTER_FIELDS}"
    assert spec["instances"] >= 2 and spec["minSyncReplicas"] >= 1  # an ack survives a failover
    assert spec["enableSuperuserAccess"] is False
    owner, database = spec["bootstrap"]["initdb"]["owner"], spec["bootstrap"]["initdb"]["database"]
    assert set(spec["bootstrap"]["initdb"]) <= {"database", "owner", "secret", "encoding", "localeCollate",
                                                "localeCType", "dataChecksums", "postInitApplicationSQL"}
    # CloudNativePG names its Secrets <cluster>-app (the owner's credentials) and <cluster>-ca
    # (ca.crt: the server CA); the collectors mount exactly those keys.
    c = m.container(*COLLECTOR)
    password = flag(c["args"], "--store-password-file")
    assert m.secret_key_at(*COLLECTOR, password) == (f"{name}-app", "password")
    dsn = cnpg.get("Secret", "ghostgpu-store")["stringData"]["dsn"]
    check_dsn(m, dsn, host=f"{name}-rw.{namespace}.svc", user=owner, database=database, ca=f"{name}-ca")
    assert env(c, "GHOSTGPU_STORE")["valueFrom"]["secretKeyRef"] == {"name": "ghostgpu-store", "key": "dsn"}
    assert namespace == m.get(*COLLECTOR)["metadata"]["namespace"]


def test_the_store_secrets_example_is_placeholders_with_the_names_the_collectors_read() -> None:
    m, example = replicated(), Manifest(STORE_SECRETS_EXAMPLE)
    secrets = example.by_kind("Secret")
    assert set(secrets) == {"ghostgpu-store", "ghostgpu-db-app", "ghostgpu-db-ca"}
    c = m.container(*COLLECTOR)
    for path in (flag(c["args"], "--store-password-file"), "/etc/ghostgpu/store/ca.crt"):
        secret, key = m.secret_key_at(*COLLECTOR, path)
        assert key in secrets[secret]["stringData"]
    # Clearly placeholders: nothing that could be a real password, host or certificate.
    assert secrets["ghostgpu-db-app"]["stringData"]["password"].startswith("REPLACE_WITH_")
    assert secrets["ghostgpu-db-ca"]["stringData"]["ca.crt"].strip().startswith("REPLACE_WITH_")
    assert "BEGIN CERTIFICATE" not in example.text
    dsn = secrets["ghostgpu-store"]["stringData"]["dsn"]
    host = urlsplit(dsn).hostname or ""
    assert host.startswith("replace_with_")  # urlsplit lowercases the host
    check_dsn(m, dsn, host=host, user=secrets["ghostgpu-db-app"]["stringData"]["username"],
              database="ghostgpu", ca="ghostgpu-db-ca")


def check_dsn(m: Manifest, dsn: str, *, host: str, user: str, database: str, ca: str) -> None:
    """A libpq URI without a password, verifying the server against the CA the collectors mount."""
    url = urlsplit(dsn)
    assert parse_store_url(dsn).engine == "postgresql"
    assert (url.hostname, url.port, url.username, url.path) == (host, 5432, user, f"/{database}")
    assert url.password is None  # the password is --store-password-file's
    query = parse_qs(url.query)
    assert query["sslmode"] == ["verify-full"]
    (root,) = query["sslrootcert"]
    assert m.secret_key_at(*COLLECTOR, root) == (ca, "ca.crt")
