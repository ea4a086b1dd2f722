"""`kubectl ghostgpu ps|findings|faults|trace|audit ...`: ghostgpu's collector commands as a kubectl plugin.

kubectl runs an executable named `kubectl-ghostgpu` found on PATH with every argument after the
plugin name, unchanged; its own global flags cannot go before the plugin name (kubectl 1.32 refuses:
"flags cannot be placed before plugin name"), and $KUBECONFIG is inherited. The arguments are parsed
by ghostgpu's own parser (cli/main.py, under the name `kubectl ghostgpu`) and run by the same handlers
as `ghostgpu ps|...`: nothing here re-implements a command. The plugin verbs are the commands that ask a
collector what it knows; the others (collector, tracer, up, certs, snapshot, remediate) are refused in
one line naming `ghostgpu VERB` (remediate too: it signals processes on a node, and stays behind
ghostgpu's own command rather than a kubectl verb a krew install adds to every kubectl user's shell).

Flags beside ghostgpu's, where kubectl has the same ones:
- `-n/--namespace` is ghostgpu's own: the namespace filter of ps, findings and faults (trace's pod
  namespace). Without it every namespace is shown, as `ghostgpu ps` does; not the kubeconfig
  context's namespace, which kubectl's own commands default to: ghostgpu is for finding GPU holders
  wherever they are, and a leak outside the namespace one happens to be in is the one to see.
- `-A/--all-namespaces`: no namespace filter (ps, findings, faults). With -n: one line, exit 2.
  (kubectl 1.32's `get` lets -A win silently; here the two disagree about what to show, so neither
  is guessed.)
- `-o`: ghostgpu's own.
- `--context`, `--kubeconfig`: passed to the `kubectl port-forward` below, only.

Finding the collector: `--collector`, else $GHOSTGPU_COLLECTOR; else, where kubectl would find a
kubeconfig (--kubeconfig, $KUBECONFIG, ~/.kube/config), a `kubectl port-forward` to the chart's
collector Service (cli/port_forward.py; --ghostgpu-namespace, --collector-service and
--collector-port name it), dialled on 127.0.0.1 with the certificate checked against
SERVICE.NAMESPACE.svc (--tls-server-name, unless given); else ghostgpu's default (the local collector).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Mapping
from typing import NoReturn

from ghostgpu.cli.port_forward import (
    ForwardTarget,
    PortForward,
    PortForwardError,
    exit_on_sigterm,
    kubeconfig_present,
)

PROG = "kubectl ghostgpu"
VERBS = ("ps", "findings", "faults", "trace", "audit")
FILTERED = ("ps", "findings", "faults")  # the verbs whose -n is a filter, and so take -A
OTHER_COMMANDS = ("snapshot", "tracer", "collector", "certs", "remediate", "up")
AUDIT_LOCAL_SOURCES = ("db", "store", "file")  # `audit` reading a file or a database: no collector

PLUGIN_FLAGS = """kubectl ghostgpu's own flags (any verb):
  -A, --all-namespaces   every namespace (ps, findings, faults); without -n that is the default: the
                         kubeconfig context's namespace is not used
  --context NAME         kubeconfig context of the port-forward
  --kubeconfig FILE      kubeconfig of the port-forward (default $KUBECONFIG, ~/.kube/config)
  --ghostgpu-namespace NS
                         namespace of the collector's Service (default ghostgpu)
  --collector-service NAME
                         the collector's Service (default ghostgpu-collector: the chart's, release
                         ghostgpu)
  --collector-port PORT  the Service's gRPC port (default 7450)
Without --collector or $GHOSTGPU_COLLECTOR, and with a kubeconfig, the plugin runs `kubectl
port-forward` to that Service on a free 127.0.0.1 port for as long as the command runs, and checks
the collector's certificate against SERVICE.NAMESPACE.svc (override: --tls-server-name).
"""

HELP = (f"usage: {PROG} {{{','.join(VERBS)}}} [flags]\n\n"
        "ghostgpu's collector commands through kubectl: the same commands and flags as `ghostgpu VERB`\n"
        f"(`{PROG} VERB --help` lists them).\n\n{PLUGIN_FLAGS}\n"
        f"Other ghostgpu commands ({', '.join(OTHER_COMMANDS)}) are not kubectl verbs: run "
        "`ghostgpu VERB`.\n")


class UsageError(Exception):
    """A bad plugin flag: one line, exit status 2."""


class _PluginParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _plugin_parser() -> argparse.ArgumentParser:
    """The plugin's own flags, taken out of the arguments before ghostgpu's parser sees the rest
    (none of them is a flag of a plugin verb)."""
    p = _PluginParser(prog=PROG, add_help=False, allow_abbrev=False)
    p.add_argument("-A", "--all-namespaces", dest="all_namespaces", action="store_true")
    p.add_argument("--context")
    p.add_argument("--kubeconfig")
    p.add_argument("--ghostgpu-namespace", dest="ghostgpu_namespace", default=ForwardTarget.namespace)
    p.add_argument("--collector-service", dest="collector_service", default=ForwardTarget.service)
    p.add_argument("--collector-port", dest="collector_port", type=int, default=ForwardTarget.remote_port)
    return p


def split_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(the plugin's flags, the rest in order for ghostgpu's parser). UsageError for a bad plugin flag."""
    plugin, rest = _plugin_parser().parse_known_args(argv)
    if not 0 < plugin.collector_port < 65536:
        raise UsageError(f"--collector-port {plugin.collector_port}: a port is 1 to 65535")
    return plugin, rest


def find_verb(rest: list[str]) -> str | None:
    """The command: the first argument that is not a flag (ghostgpu's top-level flags take no value)."""
    return next((a for a in rest if not a.startswith("-")), None)


def forward_target(plugin: argparse.Namespace) -> ForwardTarget:
    return ForwardTarget(namespace=plugin.ghostgpu_namespace, service=plugin.collector_service,
                         remote_port=plugin.collector_port, context=plugin.context,
                         kubeconfig=plugin.kubeconfig)


def check_namespaces(verb: str, plugin: argparse.Namespace, args: argparse.Namespace) -> None:
    """-A where it means something, and never with -n. UsageError otherwise."""
    if not plugin.all_namespaces:
        return
    if verb not in FILTERED:
        raise UsageError(f"-A/--all-namespaces: `{verb}` has no namespace filter (it goes with "
                         f"{', '.join(FILTERED)})")
    if getattr(args, "namespace", None):
        raise UsageError(f"-n/--namespace {args.namespace} and -A/--all-namespaces: give one (-A is every "
                         "namespace, and the default without -n)")
    args.namespace = None


def needs_port_forward(verb: str, plugin: argparse.Namespace, args: argparse.Namespace,
                       env: Mapping[str, str] | None = None, home: str | None = None) -> bool:
    """No --collector and no $GHOSTGPU_COLLECTOR, a collector to ask, and a kubeconfig to reach it with."""
    env = os.environ if env is None else env
    if getattr(args, "collector", None) or env.get("GHOSTGPU_COLLECTOR"):
        return False
    if verb == "audit" and any(getattr(args, name, None) for name in AUDIT_LOCAL_SOURCES):
        return False
    return kubeconfig_present(plugin.kubeconfig, env, home)


def _fail(line: str, status: int) -> int:
    print(f"{PROG}: {line}", file=sys.stderr)
    return status


def _refuse_verb(verb: str, rest: list[str]) -> int:
    at = rest.index(verb)
    later = next((a for a in rest[at + 1:] if a in VERBS), None)
    if at > 0 and rest[at - 1].startswith("-") and later is not None:  # `--collector X ps`
        flag = f"{rest[at - 1]} {verb}"
        return _fail(f"{flag}: a command's flags go after it: {PROG} {later} {flag} ...", 2)
    if verb in OTHER_COMMANDS:
        return _fail(f"`{verb}` is not a kubectl verb: run `ghostgpu {verb} ...` (the plugin runs "
                     f"{', '.join(VERBS)})", 2)
    return _fail(f"unknown command {verb!r}: use one of {', '.join(VERBS)} ({PROG} --help)", 2)


def main(argv: list[str] | None = None) -> int:
    from ghostgpu.cli.main import _build_parser, run

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        plugin, rest = split_args(argv)
    except UsageError as exc:
        return _fail(str(exc), 2)
    verb = find_verb(rest)
    if verb is None:
        if "--version" in rest:
            return _parse_or_exit(_build_parser(prog=PROG), rest)
        if "-h" in rest or "--help" in rest:
            print(HELP, end="")
            return 0
        return _fail(f"give a command: {', '.join(VERBS)} ({PROG} --help)", 2)
    if verb not in VERBS:
        return _refuse_verb(verb, rest)
    parser = _build_parser(prog=PROG)
    try:
        args = parser.parse_args(rest)
    except SystemExit as exc:  # argparse's --help (0, then ours) or usage error (2, said on stderr)
        if exc.code == 0 and ("-h" in rest or "--help" in rest):
            print("\n" + PLUGIN_FLAGS, end="")
        return exc.code if isinstance(exc.code, int) else 2
    try:
        check_namespaces(verb, plugin, args)
    except UsageError as exc:
        return _fail(str(exc), 2)
    if not needs_port_forward(verb, plugin, args):
        return run(args)
    return _run_forwarded(args, forward_target(plugin))


def _parse_or_exit(parser: argparse.ArgumentParser, rest: list[str]) -> int:
    try:
        parser.parse_args(rest)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    return 0


def _run_forwarded(args: argparse.Namespace, target: ForwardTarget) -> int:
    """The command, dialling a port-forward to the collector's Service that lives as long as it does."""
    from ghostgpu.cli.main import run

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return _fail("kubectl is not on PATH, and without --collector the plugin reaches the collector "
                     "through `kubectl port-forward`: install kubectl, or pass --collector", 1)
    exit_on_sigterm()  # SIGTERM leaves through the `with` below, which stops kubectl
    try:
        with PortForward(kubectl, target) as forward:
            args.collector = forward.address
            if getattr(args, "tls_server_name", None) is None:
                args.tls_server_name = target.server_name
            return run(args)
    except PortForwardError as exc:
        return _fail(str(exc), 1)
    except KeyboardInterrupt:  # while kubectl was starting (the commands take their own Ctrl-C)
        return 130


if __name__ == "__main__":
    sys.exit(main())
