"""The Helm chart (deploy/helm/ghostgpu) checked with the real helm (v3.17.3, tests/helpers/helm.py),
for every values file under its ci/ folder (one per way of installing: the defaults, cert-manager,
existing Secrets, `ghostgpu certs` files, the PostgreSQL store, everything optional on):

- `helm lint --strict` is clean;
- `helm template` renders, and every object of a Kubernetes API kind validates against Kubernetes'
  own schemas with kubernetes-validate, strict, at the chart's oldest Kubernetes and a current one;
- every cert-manager and Prometheus Operator object uses only fields its kind has (the schemas of
  their Go types are checked in tests/integration/test_helm_crds.py, which needs npm);
- every ghostgpu command line the chart renders parses with the real CLI, and builds the
  collector's or the tracer's configuration (the checks each makes at start);
- a bad value fails `helm template` with values.schema.json's message, and so does a value whose
  render the process or the API server would refuse later;
- the longest release name and namespace render names Kubernetes and cert-manager accept.

No root, no network, no API server: helm lint and template are offline.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import yaml
from ghostgpu.cli import kubectl_plugin
from ghostgpu.cli import main as cli
from ghostgpu.collector.config import collector_config
from ghostgpu.tracer.config import TracerConfig, load_config

from ghostgpu.common.system.settings import flag_values
from ghostgpu.common.web.webconfig import WebConfigError, parse_web_config
from tests.helpers.helm import (
    CI,
    Render,
    ci_values_files,
    lint,
    notes,
    render,
    render_values_file,
    template,
    values_id,
)
from tests.helpers.kube_schemas import CRD_KINDS, K8S_VERSIONS, is_core, unknown_crd_fields, validate_core

VALUES_FILES = ci_values_files()


@pytest.fixture(params=VALUES_FILES, ids=values_id)
def values_file(request: pytest.FixtureRequest) -> Path:
    path: Path = request.param
    return path


@pytest.fixture
def rendered(values_file: Path) -> Render:
    return render_values_file(values_file)


def ci_values(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


def test_the_ci_values_cover_each_way_of_installing() -> None:
    """The cases CI must lint and render: the defaults, cert-manager on, existing Secrets, PostgreSQL."""
    values = [ci_values(p) for p in VALUES_FILES]
    assert {} in values, f"no ci/*-values.yaml of the defaults ({{}}) in {CI}"
    assert any(v.get("certManager", {}).get("enabled") is True for v in values), "none with cert-manager on"
    assert any(any(v.get("tls", {}).get("existingSecrets", {}).values()) for v in values), \
        "none with tls.existingSecrets"
    assert any(v.get("collector", {}).get("store", {}).get("scheme") == "postgresql" for v in values), \
        "none with collector.store.scheme postgresql"


def test_helm_lint_strict_is_clean(values_file: Path) -> None:
    done = lint(values_file)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"helm lint --strict -f {values_file.name}:\n{output}"
    assert "[WARNING]" not in output and "[ERROR]" not in output, output


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
def test_every_core_kind_validates_against_the_kubernetes_schemas(rendered: Render, k8s_version: str) -> None:
    assert rendered.documents
    for doc in rendered.documents:
        if is_core(doc["apiVersion"]):
            validate_core(doc, k8s_version)
        else:  # a custom resource: checked field by field below, against its Go types in test_helm_crds.py
            custom = (doc["apiVersion"], doc["kind"])
            assert custom in CRD_KINDS, f"{doc['kind']}/{doc['metadata']['name']}: {custom} checked nowhere"


def test_custom_resources_use_only_their_kinds_fields(rendered: Render) -> None:
    problems = [line for doc in rendered.documents if not is_core(doc["apiVersion"])
                for line in unknown_crd_fields(doc)]
    assert not problems, "\n".join(problems)


def test_the_field_check_catches_a_misspelt_field() -> None:
    doc = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": {"name": "m"},
           "spec": {"selector": {}, "endpoints": [{"port": "metrics", "honorLabel": True,
                                                   "tlsConfig": {"serverNmae": "x"}}]}}
    assert unknown_crd_fields(doc) == [
        "ServiceMonitor/m: spec.endpoints[].honorLabel: not a field of "
        "monitoring.coreos.com/v1 ServiceMonitor",
        "ServiceMonitor/m: spec.endpoints[].tlsConfig.serverNmae: not a field of "
        "monitoring.coreos.com/v1 ServiceMonitor"]


def ghostgpu_containers(rendered: Render) -> list[tuple[str, dict[str, Any]]]:
    """(owner, container) of every container that runs the image's entry point, `ghostgpu`."""
    out = []
    for doc in rendered.documents:
        if doc["kind"] not in ("Deployment", "DaemonSet", "StatefulSet", "Job"):
            continue
        pod = doc["spec"]["template"]["spec"]
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            if "command" not in c:  # the Dockerfile's ENTRYPOINT ["ghostgpu"]
                out.append((f"{doc['kind']}/{doc['metadata']['name']}", c))
    return out


def test_command_lines_parse_with_the_real_cli(rendered: Render) -> None:
    containers = ghostgpu_containers(rendered)
    assert {c["args"][0] for _, c in containers} >= {"collector", "tracer"}
    for owner, c in containers:
        try:
            parsed = cli._build_parser().parse_args(c["args"])
        except SystemExit:  # argparse printed why on stderr, which pytest shows
            pytest.fail(f"{owner}: container {c['name']}: ghostgpu does not parse {c['args']}")
        assert parsed.command == c["args"][0]


def pod_env(c: dict[str, Any]) -> dict[str, str]:
    """The container's environment as kubelet would set it, a field or Secret reference as a sample."""
    samples = {"spec.nodeName": "gpu-node-1", "metadata.name": "ghostgpu-collector-0"}
    env = {}
    for e in c.get("env", []):
        field = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")
        env[e["name"]] = e.get("value", samples.get(field, "from-a-secret"))
    return env


def expanded(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubelet's $(VAR) expansion of a container's args."""
    out = []
    for arg in args:
        for name, value in env.items():
            arg = arg.replace(f"$({name})", value)
        out.append(arg)
    return out


def mounted_config_file(rendered: Render, pod: dict[str, Any], c: dict[str, Any], path: str,
                        into: Path) -> Path:
    """The file at `path` in the container, from the ConfigMap mounted there, written under `into`."""
    (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    key = path[len(mount["mountPath"].rstrip("/")) + 1:]
    text = rendered.by_kind("ConfigMap")[volume["configMap"]["name"]]["data"][key]
    out = into / key
    out.write_text(text)
    return out


def refusals(rendered: Render, tmp_path: Path) -> list[str]:
    """What the collector and the tracer refuse at start, past the parser (a duration above 0, a URL
    with a host, --config's file), in each command line the chart renders; one line each."""
    out = []
    for doc in rendered.documents:
        if doc["kind"] not in ("Deployment", "DaemonSet"):
            continue
        pod = doc["spec"]["template"]["spec"]
        for c in pod["containers"]:
            env = pod_env(c)
            args = expanded(c["args"], env)
            for i, arg in enumerate(args):
                if arg.startswith("--config="):
                    config = mounted_config_file(rendered, pod, c, arg.split("=", 1)[1], tmp_path)
                    args[i] = f"--config={config}"
            parsed = cli._build_parser().parse_args(args)
            try:
                if args[0] == "collector":
                    collector_config(parsed)
                else:
                    load_config(None, env={k: v for k, v in env.items() if k.startswith("GHOSTGPU_")},
                                overrides=flag_values(TracerConfig, parsed))
            except ValueError as e:  # ConfigError is one
                out.append(f"{doc['kind']}/{doc['metadata']['name']}: ghostgpu {args[0]}: {e}")
    return out


def test_command_lines_build_each_process_configuration(rendered: Render, tmp_path: Path) -> None:
    assert refusals(rendered, tmp_path) == []


def test_the_configuration_check_catches_a_value_the_tracer_refuses(tmp_path: Path) -> None:
    bad = render(set_values={"tracer.extraArgs": "{--trace-max-sessions=0}"})  # the last flag wins
    assert refusals(bad, tmp_path) == [
        "DaemonSet/ghostgpu-tracer: ghostgpu tracer: trace_max_sessions: must be 1 to 8, got 0"]


# (--set values, what helm prints): each bad value is refused by values.schema.json, with its words
# as helm v3.17.3 prints them under "values don't meet the specifications of the schema(s)".
BAD_VALUES = [
    ({"collector.retentionDays": "-1"}, "collector.retentionDays: Must be greater than 0"),
    ({"collector.store.scheme": "mysql"},
     'collector.store.scheme: collector.store.scheme must be one of the following: "sqlite", "postgresql"'),
    ({"colector.replicas": "2"}, "(root): Additional property colector is not allowed"),
    ({"tracer.capabilities": "{BPF,SYS_ADMIN}"},
     'tracer.capabilities.1: tracer.capabilities.1 must be one of the following: "BPF", "PERFMON", '
     '"SYS_PTRACE", "DAC_READ_SEARCH", "CHECKPOINT_RESTORE", "KILL"'),
]


@pytest.mark.parametrize(("set_values", "message"), BAD_VALUES, ids=[next(iter(s)) for s, _ in BAD_VALUES])
def test_a_bad_value_fails_helm_template_with_the_schema_message(set_values: dict[str, str],
                                                                  message: str) -> None:
    done = template(set_values=set_values)
    assert done.returncode != 0, f"helm template --set {set_values} rendered:\n{done.stdout[:2000]}"
    assert "values don't meet the specifications of the schema(s)" in done.stderr, done.stderr
    assert f"- {message}\n" in done.stderr, done.stderr


def test_the_cli_check_catches_an_unknown_flag() -> None:
    bad = render(set_values={"collector.extraArgs": "{--no-such-flag}"})
    (collector,) = [c for owner, c in ghostgpu_containers(bad) if owner == "Deployment/ghostgpu-collector"]
    with pytest.raises(SystemExit):
        cli._build_parser().parse_args(collector["args"])


# Values the schema must refuse because what they render is refused later, at a worse time: by the
# process at start (a crash loop) or by the API server at install. (--set values, the key, why.)
REFUSED_LATER = [
    ({"tracer.trace.maxDuration": "0s"}, "tracer.trace.maxDuration",
     "the tracer refuses --trace-max-duration 0s at start: must be above 0"),
    ({"collector.alertmanager.urls": "{https://}"}, "collector.alertmanager.urls",
     "the collector refuses an --alertmanager URL without a host at start"),
    ({"serviceMonitor.interval": "1.5m"}, "serviceMonitor.interval",
     "the Prometheus Operator's Duration (^(0|(([0-9]+)y)?...(([0-9]+)ms)?)$) has no fractions"),
    ({"podMonitor.interval": "30s1m"}, "podMonitor.interval",
     "the Prometheus Operator's Duration takes its units largest first"),
    ({"tracer.updateStrategy.maxUnavailable": "0%"}, "tracer.updateStrategy.maxUnavailable",
     "the API server refuses a DaemonSet rolling update with maxUnavailable 0 and maxSurge 0"),
    ({"tracer.updateStrategy.maxUnavailable": "150%"}, "tracer.updateStrategy.maxUnavailable",
     "the API server refuses a maxUnavailable over 100%"),
]


@pytest.mark.parametrize(("set_values", "key", "why"), REFUSED_LATER,
                         ids=[f"{next(iter(s))}={next(iter(s.values()))}" for s, _, _ in REFUSED_LATER])
def test_a_value_refused_later_is_refused_by_the_schema(set_values: dict[str, str], key: str,
                                                        why: str) -> None:
    done = template(set_values=set_values)
    assert done.returncode != 0, f"helm template --set {set_values} rendered it, but {why}"
    assert "values don't meet the specifications of the schema(s)" in done.stderr, done.stderr
    assert f"- {key}" in done.stderr, done.stderr


# The longest names Helm and Kubernetes allow: a release name of 53 characters (Helm's limit), a
# namespace of 63 (a DNS label).
LONG_RELEASE = "r" * 53
LONG_NAMESPACE = "n" * 63
X509_COMMON_NAME_MAX = 64  # RFC 5280 ub-common-name; cert-manager's webhook refuses a longer commonName


def test_the_longest_names_render_objects_kubernetes_and_cert_manager_accept(values_file: Path) -> None:
    rendered = render([values_file], release=LONG_RELEASE, namespace=LONG_NAMESPACE)
    problems = []
    for doc in rendered.documents:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in ("Service", "ConfigMap", "Secret", "Deployment", "DaemonSet", "Certificate",
                           "Issuer", "ServiceMonitor", "PodMonitor", "PodDisruptionBudget",
                           "PersistentVolumeClaim", "ServiceAccount") and len(doc["metadata"]["name"]) > 63:
            problems.append(f"{name}: name longer than 63")
        if doc["kind"] == "Certificate":
            spec = doc["spec"]
            if len(spec.get("commonName", "")) > X509_COMMON_NAME_MAX:
                problems.append(f"{name}: commonName {spec['commonName']!r} is {len(spec['commonName'])} "
                                f"bytes, more than {X509_COMMON_NAME_MAX}")
            for dns in spec.get("dnsNames", []):
                if len(dns) > 253 or any(len(label) > 63 for label in dns.split(".")):
                    problems.append(f"{name}: dnsName {dns!r} is not a DNS name")
    assert not problems, "\n".join(problems)


# extraArgs items YAML would read as something else if written unquoted: a mapping ("key: value")
# and a comment (" #").
EXTRA_ARGS = ["--alert-label=summary=memory: unaccounted", "--event-log-max=200000 # a comment"]


def test_extra_args_reach_the_command_line_verbatim(tmp_path: Path) -> None:
    values = tmp_path / "extra-values.yaml"
    values.write_text(yaml.safe_dump({"collector": {"extraArgs": EXTRA_ARGS},
                                      "tracer": {"extraArgs": EXTRA_ARGS}}))
    rendered = render([values])
    for owner, c in ghostgpu_containers(rendered):
        assert c["args"][-len(EXTRA_ARGS):] == EXTRA_ARGS, f"{owner}: {c['args'][-len(EXTRA_ARGS):]}"


# ---- defaults a user's value replaces whole --------------------------------------------------------
# Helm merges a map default of values.yaml with the user's map, so the chart keeps these two empty and
# applies its default in the template: a selector or a user given is the whole of it.

def test_a_given_node_selector_replaces_the_nvidia_default(tmp_path: Path) -> None:
    def selector(rendered: Render) -> dict[str, str]:
        spec = rendered.by_kind("DaemonSet")["ghostgpu-tracer"]["spec"]["template"]["spec"]
        return dict(spec["nodeSelector"])

    assert selector(render()) == {"nvidia.com/gpu.present": "true"}
    amd = tmp_path / "amd-values.yaml"
    amd.write_text(yaml.safe_dump({"tracer": {"nodeSelector": {"amd.com/gpu.present": "true"}}}))
    assert selector(render([amd])) == {"amd.com/gpu.present": "true"}


def test_a_named_scrape_user_replaces_the_placeholder() -> None:
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()
    for users, want in (({}, None), ({"webConfig.basicAuthUsers.scraper": hashed}, {"scraper"})):
        web = render(set_values=users).by_kind("Secret")["ghostgpu-web-config"]["stringData"]["web.yml"]
        if want is None:  # the placeholder: the pods refuse to start, naming the key to fill
            with pytest.raises(WebConfigError, match=r"basic_auth_users\.prometheus: not a bcrypt hash"):
                parse_web_config(web, "/etc/ghostgpu/web/web.yml")
        else:
            assert set(parse_web_config(web, "/etc/ghostgpu/web/web.yml").users) == want


# ---- NOTES.txt --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("release", "namespace", "grpc_port"), [
    ("ghostgpu", "ghostgpu", 7450), ("prod", "obs", 7451)])
def test_the_notes_kubectl_line_reaches_this_releases_collector(tmp_path: Path, release: str, namespace: str,
                                                               grpc_port: int) -> None:
    values = {"collector.ports.grpc": str(grpc_port)}
    text = notes(tmp_path, values, release=release, namespace=namespace)
    (line,) = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("kubectl ghostgpu ")]
    argv = shlex.split(line.partition("#")[0])[2:]
    plugin, rest = kubectl_plugin.split_args(argv)
    assert rest == ["ps"], line
    target = kubectl_plugin.forward_target(plugin)
    rendered = render(set_values=values, release=release, namespace=namespace)
    service = rendered.by_kind("Service")[target.service]
    assert service["metadata"]["namespace"] == target.namespace == namespace
    assert target.remote_port in [p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"]
    if (release, namespace, grpc_port) == ("ghostgpu", "ghostgpu", 7450):
        # The plugin's defaults are the chart's defaults: no flag to add.
        assert line.split("#")[0].split() == ["kubectl", "ghostgpu", "ps"]
