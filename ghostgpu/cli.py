"""The `ghostgpu` command line. Command names, flags and JSON keys are a contract: extend, never rename."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from typing import Any

from ghostgpu import __version__


def _add_tracer_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config file (keys as in tracer/config.py; env GHOSTGPU_CONFIG)")
    p.add_argument("--node-name", dest="node_name", help="node name reported with every record")
    p.add_argument("--proc-root", dest="proc_root", help="host /proc (in a pod: the host mount)")
    p.add_argument("--sys-root", dest="sys_root", help="host /sys")
    p.add_argument("--cgroup-root", dest="cgroup_root", help="host cgroup mount")
    p.add_argument("--vendor", dest="vendors", action="append", choices=("nvidia", "amd", "ascend"),
                   help="device families to watch (repeatable; default nvidia)")
    p.add_argument("--device-prefix", dest="device_prefixes", action="append",
                   help="device path prefix to watch (repeatable; overrides --vendor)")
    p.add_argument("--grace-s", dest="grace_s", type=float,
                   help="seconds a holder may go unlisted by NVML before it is hidden (default 2)")
    p.add_argument("--scan-interval-s", dest="scan_interval_s", type=float,
                   help="seconds between /proc scans (default 30)")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ghostgpu", description="Find every GPU consumer on this node, "
                                     "including the ones nvidia-smi and NVML miss.")
    parser.add_argument("--version", action="version", version=f"ghostgpu {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    snap = sub.add_parser("snapshot", help="one-shot view of this node from /proc and NVML (no BPF)")
    snap.add_argument("-o", "--output", choices=("table", "wide", "json"), default="table")
    _add_tracer_flags(snap)

    tracer = sub.add_parser("tracer",
                            help="the node agent: BPF + /proc + NVML, events and findings as JSON lines")
    tracer.add_argument("--jsonl", default="-", help="where to write JSON lines ('-' = stdout, the default)")
    tracer.add_argument("--bpf", choices=("auto", "on", "off"), help="kernel tracing (default auto)")
    _add_tracer_flags(tracer)

    up = sub.add_parser("up", help="run the tracer on this node with a live view of its GPU consumers")
    up.add_argument("--jsonl", help="also write JSON lines to this path")
    up.add_argument("--bpf", choices=("auto", "on", "off"))
    up.add_argument("--once", action="store_true", help="print one view after start-up and exit")
    _add_tracer_flags(up)
    return parser


def _config(args: argparse.Namespace) -> Any:
    from tracer.config import load_config

    keys = ("node_name", "proc_root", "sys_root", "cgroup_root", "vendors", "device_prefixes", "grace_s",
            "scan_interval_s", "bpf")
    overrides = {k: getattr(args, k, None) for k in keys}
    return load_config(args.config, overrides=overrides)


def _install_signals(stop: Any) -> None:
    def handler(signum: int, frame: Any) -> None:
        stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def cmd_snapshot(args: argparse.Namespace) -> int:
    from tracer.snapshot import render_table, take_snapshot

    consumers = take_snapshot(_config(args))  # notices go to stderr through logging
    if args.output == "json":
        json.dump([c.to_json() for c in consumers], sys.stdout, indent=2, default=str)
        print()
    else:
        print(render_table(consumers, wide=args.output == "wide"))
    return 0


def cmd_tracer(args: argparse.Namespace) -> int:
    from tracer.agent import Tracer
    from tracer.sinks import JsonlSink

    cfg = _config(args)
    tracer = Tracer(cfg, JsonlSink(args.jsonl))
    _install_signals(tracer.stop)
    tracer.run()
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from ghostgpu.view import run_up

    return run_up(_config(args), jsonl=args.jsonl, once=args.once, install_signals=_install_signals)


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="ghostgpu: %(name)s: %(message)s")
    from tracer.config import ConfigError

    try:
        return {"snapshot": cmd_snapshot, "tracer": cmd_tracer, "up": cmd_up}[args.command](args)
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
        raise


if __name__ == "__main__":
    sys.exit(main())
