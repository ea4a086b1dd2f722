"""The `ghostgpu` command line. Command names, flags and JSON keys are a contract: extend, never rename."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from ghostgpu.cli.tls_flags import (
    INSECURE_HELP,
    add_collector_uid_flag,
    add_server_security_flags,
    add_tls_flags,
    add_tls_server_name_flag,
)

from ghostgpu import __version__
from ghostgpu.common.transport.addresses import DEFAULT_COLLECTOR
from ghostgpu.common.transport.collector_target import FORMS as COLLECTOR_FORMS

if TYPE_CHECKING:
    from ghostgpu.tracer.config import TracerConfig


def _add_tracer_flags(p: argparse.ArgumentParser) -> None:
    """The tracer's settings (snapshot, tracer, up): each flag's help and default come from its
    TracerConfig field (tracer/config.py); a flag left out is None, so the config file's value, the
    environment's or the field's default stands."""
    p.add_argument("--config", help="TOML config file (keys as in tracer/config.py; env GHOSTGPU_CONFIG)")
    for name in ("node_name", "proc_root", "sys_root", "cgroup_root", "vendors", "device_prefixes", "grace_s",
                 "scan_interval_s", "trace_max_sessions", "trace_max_duration_s", "trace_max_records"):
        _add_tracer_flag(p, name)
    add_tls_flags(p)


def _add_tracer_flag(p: argparse.ArgumentParser, name: str) -> None:
    from ghostgpu.tracer.config import TracerConfig

    from ghostgpu.common.system.settings import add_flag

    add_flag(p, TracerConfig, name)


def _add_node_flags(p: argparse.ArgumentParser) -> None:
    """What a tracer needs to reach its node's runtime and kubelet (tracer and up)."""
    p.add_argument("--cri-endpoint", dest="cri_endpoint",
                   help="CRI runtime socket, unix:///path (default: detect containerd, CRI-O, cri-dockerd)")
    p.add_argument("--podresources-endpoint", dest="podresources_endpoint",
                   help="kubelet PodResources socket "
                   "(default unix:///var/lib/kubelet/pod-resources/kubelet.sock)")


def _add_collector_flags(p: argparse.ArgumentParser) -> None:
    """The collector's settings (`collector` and `up`): each flag's help and default come from its
    CollectorConfig field (collector/config.py); a flag left out is None, so a config file's value or the
    field's default stands."""
    import contextlib

    from ghostgpu.collector.config import CollectorConfig

    from ghostgpu.common.system.settings import add_flag

    def add(name: str) -> None:
        add_flag(p, CollectorConfig, name)

    for name in ("listen", "db_path", "retention_days", "event_log_max", "faults_max", "cri_endpoint",
                 "cri_ttl_s", "metrics_listen", "metrics_max_process_series", "alertmanager",
                 "alert_resend_s", "alert_fault_hold_s", "alert_labels"):
        add(name)
    # Trace sessions (docs/TRACE.md). --trace-max-duration and --trace-max-records are also tracer
    # limits: where the parser has them already (`up`, from its tracer's flags), one value serves both.
    for name in ("trace_max_duration_s", "trace_max_records"):
        with contextlib.suppress(argparse.ArgumentError):
            add(name)
    for name in ("trace_default_duration_s", "trace_store_max_records", "trace_retention_h"):
        add(name)
    with contextlib.suppress(argparse.ArgumentError):  # `up` has them already, from its tracer's flags
        add_tls_flags(p)
    add_server_security_flags(p)
    add("max_connections")
    add("max_connections_per_source")
    _add_web_config_flag(p)


def _add_health_flag(p: argparse.ArgumentParser) -> None:
    _add_tracer_flag(p, "health_listen")
    _add_web_config_flag(p)
    import contextlib

    with contextlib.suppress(argparse.ArgumentError):  # `up`: one --insecure for both
        p.add_argument("--insecure", action="store_true", help=INSECURE_HELP)


def _add_web_config_flag(p: argparse.ArgumentParser) -> None:
    """--web-config-file: TLS and basic auth of /metrics and the health port (exporter-toolkit format);
    the HTTP port's connection caps."""
    import contextlib

    with contextlib.suppress(argparse.ArgumentError):  # `up`: one file for the tracer's and the collector's
        p.add_argument("--web-config-file", dest="web_config_file", metavar="FILE",
                       help="Prometheus web config (tls_server_config, basic_auth_users) for /metrics and "
                       "the health port (docs/SECURITY.md; env GHOSTGPU_WEB_CONFIG_FILE for the tracer)")
    with contextlib.suppress(argparse.ArgumentError):
        p.add_argument("--http-max-connections", dest="http_max_connections", type=int, metavar="N",
                       help="connections at once on the /metrics or health port; past it the oldest idle "
                       "one is closed for the new one (default 256)")
    with contextlib.suppress(argparse.ArgumentError):
        p.add_argument("--http-max-connections-per-source", dest="http_max_connections_per_source", type=int,
                       metavar="N", help="connections at once from one address on that port; past it that "
                       "address's oldest idle one is closed (default 32)")



def _add_query_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--collector", help=f"collector address: {COLLECTOR_FORMS} "
                   f"(default $GHOSTGPU_COLLECTOR or {DEFAULT_COLLECTOR})")
    p.add_argument("-o", "--output", choices=("table", "wide", "json"), default="table")
    p.add_argument("-n", "--namespace", help="only this Kubernetes namespace")
    p.add_argument("--class", dest="classes", action="append", metavar="CLASS",
                   help="only this class (repeatable): hidden, ghost, orphaned, unallocated, ...")
    p.add_argument("--node", help="only this node")
    add_tls_flags(p)
    add_collector_uid_flag(p)
    add_tls_server_name_flag(p)


def _add_trace_outputs(p: argparse.ArgumentParser, outputs: tuple[str, ...], verb: bool = False) -> None:
    """--collector and the outputs. On list/show the defaults are SUPPRESSed, so a flag given before
    the verb (`trace --collector X list`) is not overwritten by the verb's default."""
    def default(value: object) -> object:
        return argparse.SUPPRESS if verb else value

    p.add_argument("--collector", default=default(None), help=f"collector address: {COLLECTOR_FORMS} "
                   f"(default $GHOSTGPU_COLLECTOR or {DEFAULT_COLLECTOR})")
    add_tls_flags(p, verb=verb)
    add_collector_uid_flag(p, verb=verb)
    add_tls_server_name_flag(p, verb=verb)
    p.add_argument("-o", "--output", choices=outputs, default=default("table"),
                   help="table (default), json (one document at the end) or jsonl (one record a line)")
    if "jsonl" in outputs:
        p.add_argument("--summary", action="store_true", default=default(False),
                       help="only a summary at the end, as strace -c: per call the count, errors, total, "
                       "average and p99 time, %% of time")
        p.add_argument("--summary-with-calls", dest="summary_with_calls", action="store_true",
                       default=default(False), help="the calls as they come, then the summary (strace -C)")
        p.add_argument("--chrome-trace", dest="chrome_trace", metavar="FILE", default=default(None),
                       help="also write Chrome Trace Event JSON (Perfetto, chrome://tracing, speedscope)")


def _add_trace_parser(sub: Any) -> None:
    """`ghostgpu trace [flags]` starts a session; `trace list|show ID|stop ID` (docs/TRACE.md)."""
    trace = sub.add_parser("trace", help="record every GPU call of a pod, container or process tree "
                           "for a while, decoded (docs/TRACE.md)",
                           description="Start a trace session and print its GPU calls as they happen; "
                           "or list, show and stop sessions.")
    _add_trace_outputs(trace, ("table", "json", "jsonl"))
    trace.add_argument("-n", "--namespace", help="trace this namespace (with --pod: the pod's; "
                       "default 'default' when --pod is given)")
    trace.add_argument("--pod", help="trace this pod")
    trace.add_argument("--container", help="only this container of the pod (a name, or a container id "
                       "prefix)")
    trace.add_argument("--pid", type=int, help="trace this host PID and every process it forks "
                       "(needs --node)")
    trace.add_argument("--node", help="the node of --pid; otherwise only this node")
    trace.add_argument("--gpu", metavar="INDEX|UUID", help="only this GPU's device files (and the "
                       "control devices)")
    trace.add_argument("--for", dest="duration", metavar="DURATION",
                       help="how long: 30s, 2m, 1h30m, 500ms or plain seconds (default: the collector's)")
    trace.add_argument("--max-records", dest="max_records", type=int, metavar="N",
                       help="keep at most N records (default: the tracer's --trace-max-records)")
    trace.add_argument("--detach", action="store_true", help="print the session id first; Ctrl-C then "
                       "leaves the session running without asking")
    verbs = trace.add_subparsers(dest="trace_command", metavar="{list,show,stop}")
    lst = verbs.add_parser("list", help="trace sessions, running and ended")
    _add_trace_outputs(lst, ("table", "json"), verb=True)
    show = verbs.add_parser("show", help="a session's records, as `trace` printed them live")
    show.add_argument("id", help="session id (t-...)")
    _add_trace_outputs(show, ("table", "json", "jsonl"), verb=True)
    stop = verbs.add_parser("stop", help="stop a running session")
    stop.add_argument("id", help="session id (t-...)")
    stop.add_argument("--collector", default=argparse.SUPPRESS,
                      help=f"collector address: {COLLECTOR_FORMS}")
    add_tls_flags(stop, verb=True)
    add_collector_uid_flag(stop, verb=True)
    add_tls_server_name_flag(stop, verb=True)


def _build_parser(prog: str = "ghostgpu") -> argparse.ArgumentParser:
    """prog: the name usage lines show (`kubectl ghostgpu` for cli/kubectl_plugin.py)."""
    parser = argparse.ArgumentParser(prog=prog, description="Find every GPU consumer on this node, "
                                     "including the ones nvidia-smi and NVML miss.")
    parser.add_argument("--version", action="version", version=f"ghostgpu {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    # In the order `ghostgpu --help` lists them.
    _add_snapshot_parser(sub)
    _add_tracer_parser(sub)
    _add_collector_parser(sub)
    _add_ps_and_findings_parsers(sub)
    _add_trace_parser(sub)
    from ghostgpu.cli import audit as audit_cli  # flags only; it imports grpc when it runs

    audit_cli.add_parser(sub)
    from ghostgpu.cli import certs as certs_cli  # flags only; cryptography is imported when it runs

    certs_cli.add_parser(sub)
    from ghostgpu.cli import remediate as remediate_cli  # flags only; grpc is imported when it runs

    remediate_cli.add_parser(sub)
    _add_up_parser(sub)
    return parser


def _add_snapshot_parser(sub: Any) -> None:
    snap = sub.add_parser("snapshot", help="one-shot view of this node from /proc and NVML (no BPF)")
    snap.add_argument("-o", "--output", choices=("table", "wide", "json"), default="table")
    _add_tracer_flags(snap)


def _add_tracer_parser(sub: Any) -> None:
    tracer = sub.add_parser("tracer",
                            help="the node agent: BPF + /proc + NVML, events and findings as JSON lines")
    tracer.add_argument("--jsonl", help="where to write JSON lines ('-' = stdout, the default without "
                        "--collector)")
    _add_tracer_flag(tracer, "bpf")
    tracer.add_argument("--collector", help=f"stream to this collector: {COLLECTOR_FORMS}; one stream, to "
                        "one replica, moving to another when it is lost")
    _add_tracer_flag(tracer, "spool_events")
    _add_tracer_flag(tracer, "remediation")  # config key remediation, env GHOSTGPU_REMEDIATION
    _add_tracer_flags(tracer)
    _add_node_flags(tracer)
    _add_health_flag(tracer)
    add_collector_uid_flag(tracer)  # config key collector_uid, env GHOSTGPU_COLLECTOR_UID


def _add_collector_parser(sub: Any) -> None:
    coll = sub.add_parser("collector", help="the cluster collector: ingests tracers, resolves containers "
                          "through CRI, answers queries")
    coll.add_argument("--config", metavar="FILE", help="TOML config file, or YAML when it ends in .yaml/.yml "
                      "(keys as in collector/config.py, in a [collector] table or at the top level; its "
                      "remediation section: docs/REMEDIATION.md); a flag given wins over it")
    _add_collector_flags(coll)
    # Replicas over a shared store (docs/REPLICAS.md): the collector's own flags; `up` stays on SQLite.
    from ghostgpu.collector.config import CollectorConfig

    from ghostgpu.common.system.settings import add_flag

    for name in ("store_url", "store_password_file", "replica_id", "lease_ttl_s"):
        add_flag(coll, CollectorConfig, name)


def _add_ps_and_findings_parsers(sub: Any) -> None:
    ps = sub.add_parser("ps", help="the cluster's nvidia-smi: every GPU consumer the collector knows")
    _add_query_flags(ps)
    ps.add_argument("-w", "--watch", action="store_true", help="redraw as findings open and resolve")

    findings = sub.add_parser("findings", help="history of findings (hidden, ghost, orphaned, ...)")
    _add_query_flags(findings)
    findings.add_argument("--since", default="1h", help="how far back: 30s, 15m, 1h, 7d (default 1h)")
    findings.add_argument("--limit", type=int, default=1000)

    faults = sub.add_parser("faults", help="GPU faults (Xid) the drivers logged, with the pods each one hit")
    faults.add_argument("--collector", help=f"collector address: {COLLECTOR_FORMS} "
                        f"(default $GHOSTGPU_COLLECTOR or {DEFAULT_COLLECTOR})")
    faults.add_argument("--since", default="1h", help="how far back: 30s, 15m, 1h, 7d (default 1h)")
    faults.add_argument("-n", "--namespace", help="only faults that hit a pod of this namespace")
    faults.add_argument("--node", help="only this node")
    # Checked by cli/faults.py (one line naming -o and the choices), not argparse's choices (the usage).
    faults.add_argument("-o", "--output", default="table", help="table (default), wide or json")
    faults.add_argument("--limit", type=int, default=1000, help="the newest N at most (default 1000)")
    add_tls_flags(faults)
    add_collector_uid_flag(faults)
    add_tls_server_name_flag(faults)


def _add_up_parser(sub: Any) -> None:
    up = sub.add_parser("up", help="collector and tracer on this node with a live view of the GPU consumers")
    up.add_argument("--jsonl", help="also write the tracer's JSON lines to this path")
    _add_tracer_flag(up, "bpf")
    up.add_argument("--once", action="store_true", help="print one view after start-up and exit")
    up.add_argument("--demo", action="store_true",
                    help="plant demonstration consumers (hidden, orphaned, short-lived), removed on exit "
                    "with the store they were recorded in (unless --db names one)")
    up.add_argument("--tracer-max-restarts", dest="tracer_max_restarts", type=int, default=5, metavar="N",
                    help="restart a tracer that dies (backoff 0.5 s doubling to 30 s); exit 1 after N failed "
                    "restarts in a row (default 5; a run of 60 s resets the count; 0 never restarts)")
    _add_tracer_flags(up)
    _add_node_flags(up)
    _add_health_flag(up)
    _add_collector_flags(up)  # --listen: up's own default, DEFAULT_COLLECTOR (cli/up.py)


def _config(args: argparse.Namespace) -> TracerConfig:
    from ghostgpu.tracer.config import tracer_config

    return tracer_config(args)


def _install_signals(stop: Callable[[], None]) -> None:
    def handler(signum: int, frame: FrameType | None) -> None:
        stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def cmd_snapshot(args: argparse.Namespace) -> int:
    from ghostgpu.cli.view import snapshot_table
    from ghostgpu.tracer.snapshot import take_snapshot

    consumers = take_snapshot(_config(args))  # notices go to stderr through logging
    if args.output == "json":
        json.dump([c.to_json() for c in consumers], sys.stdout, indent=2, default=str)
        print()
    else:
        print(snapshot_table(consumers, wide=args.output == "wide"))
    return 0


def cmd_tracer(args: argparse.Namespace) -> int:
    from ghostgpu.tracer.node import run_tracer

    return run_tracer(_config(args), args, install_signals=_install_signals)


def cmd_collector(args: argparse.Namespace) -> int:
    from ghostgpu.collector.run import run_collector

    return run_collector(args, install_signals=_install_signals)


def cmd_query(args: argparse.Namespace) -> int:
    """`ps` and `findings`, defined in cli/client.py: imported only when one runs (grpc)."""
    from ghostgpu.cli import client

    return {"ps": client.cmd_ps, "findings": client.cmd_findings}[args.command](args)


def cmd_faults(args: argparse.Namespace) -> int:
    """`faults`, defined in cli/faults.py: imported only when it runs (grpc)."""
    from ghostgpu.cli.faults import cmd_faults as run

    return run(args)


def cmd_trace(args: argparse.Namespace) -> int:
    """`trace` and `trace list|show|stop`, defined in cli/trace.py: imported only when one runs."""
    from ghostgpu.cli.trace import cmd_trace as run

    return run(args)


def cmd_audit(args: argparse.Namespace) -> int:
    from ghostgpu.cli import audit as audit_cli

    return audit_cli.run(args)


def cmd_certs(args: argparse.Namespace) -> int:
    from ghostgpu.cli import certs as certs_cli

    return certs_cli.run(args)


def cmd_remediate(args: argparse.Namespace) -> int:
    from ghostgpu.cli.remediate import cmd_remediate as run

    return run(args)


def cmd_up(args: argparse.Namespace) -> int:
    from ghostgpu.cli.up import run_up

    return run_up(_config(args), args, install_signals=_install_signals)


def main(argv: list[str] | None = None) -> int:
    return run(_build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the command `args` names (parsed by _build_parser): one line and a status for known failures."""
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="ghostgpu: %(name)s: %(message)s")
    from ghostgpu.common.system.configfile import ConfigError

    try:
        if args.command in ("tracer", "collector", "up"):
            # Several threads share one GIL (agent, stream sender, gRPC, CRI workers): with
            # CPython's default 5 ms switch interval a woken thread can wait that long for a busy
            # one, once per hop of the open -> collector -> CRI relay path. 0.5 ms cut the
            # detection latency p50 from 44 to 30 ms on a 2-core VM (bench/bench_detect_latency.py).
            sys.setswitchinterval(0.0005)
        commands = {"snapshot": cmd_snapshot, "tracer": cmd_tracer, "collector": cmd_collector,
                    "ps": cmd_query, "findings": cmd_query, "faults": cmd_faults, "up": cmd_up,
                    "trace": cmd_trace, "audit": cmd_audit, "certs": cmd_certs, "remediate": cmd_remediate}
        return commands[args.command](args)
    except ConfigError as exc:
        print(f"ghostgpu: config: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"ghostgpu: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # one line, never a traceback wall, for known environment failures
        if type(exc).__name__ == "BpfUnavailable":
            print(f"ghostgpu: bpf: {exc}", file=sys.stderr)
            return 3
        if type(exc).__name__ == "ClientError":  # e.g. a plaintext collector of an untrusted uid
            print(f"ghostgpu: {exc}", file=sys.stderr)
            return 1
        raise

