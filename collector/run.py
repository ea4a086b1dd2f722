"""`ghostgpu collector`: its flags turned into a Collector (collector/main.py), its life until
SIGTERM, and SIGHUP re-reading the policy. `ghostgpu up` builds its collector with the same
`collector_options`."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from ghostgpu.collector.heap import HeapPolicy
from ghostgpu.collector.main import DEFAULT_DB, DEFAULT_LISTEN, Collector
from ghostgpu.collector.security import SecurityOptions
from ghostgpu.collector.server import ListenError
from ghostgpu.collector.store import StoreError
from ghostgpu.collector.trace_commands import trace_options

from ghostgpu import __version__
from ghostgpu.common.system.fdlimit import raise_fd_limit
from ghostgpu.common.web.httpserve import HttpListenError


def collector_options(args: argparse.Namespace) -> dict[str, Any]:
    """The metrics, Alertmanager and heap keyword arguments of Collector from `collector`/`up` flags."""
    urls: list[str] = list(getattr(args, "alertmanager", None) or ())
    labels: Any = list(getattr(args, "alert_labels", None) or ())
    if labels and not urls:
        raise ValueError("--alert-label: labels go on alerts pushed to Alertmanager; add --alertmanager URL "
                         "(alerts from Prometheus rules take labels from its external_labels)")
    if urls:
        from ghostgpu.collector.alertpush import parse_alert_labels, parse_alertmanager_urls

        urls, labels = parse_alertmanager_urls(urls), parse_alert_labels(labels)
    return {
        "metrics_listen": getattr(args, "metrics_listen", None),
        "metrics_max_process_series": getattr(args, "metrics_max_process_series", 1000),
        "alertmanager": urls,
        "alert_resend_s": getattr(args, "alertmanager_resend_s", 60.0),
        "alert_labels": dict(labels),
        "heap": HeapPolicy(),  # the long-running commands only: gc state is process-wide
        "web_config_file": getattr(args, "web_config_file", None),
        "http_max_connections": getattr(args, "http_max_connections", None),
        "http_max_connections_per_source": getattr(args, "http_max_connections_per_source", None),
    }


def run_collector(args: argparse.Namespace, install_signals: Callable[[Callable[[], None]], None]) -> int:
    """The body of `ghostgpu collector`: exit 0 on SIGTERM/SIGINT, 2 on a bad flag, 1 if storage fails."""
    raise_fd_limit()  # before anything listens: descriptors are what a flood of connections takes
    listen = [a.strip() for a in (args.listen or DEFAULT_LISTEN).split(",") if a.strip()]
    db = args.db or DEFAULT_DB
    if getattr(args, "web_config_file", None) and not getattr(args, "metrics_listen", None):
        print("ghostgpu: collector: --web-config-file: it secures /metrics; add --metrics-listen HOST:PORT",
              file=sys.stderr)
        return 2
    try:
        collector = Collector(listen, db, args.retention_days, args.event_log_max,
                              getattr(args, "collector_cri_endpoint", None), args.cri_ttl_s,
                              **collector_options(args), **trace_options(args),
                              security=SecurityOptions.from_args(args))
        collector.start()
    except (ListenError, StoreError, HttpListenError, ValueError) as e:
        print(f"ghostgpu: collector: {e}", file=sys.stderr)
        return 2
    extra = ""
    if collector.metrics_address:
        extra += f"; metrics {collector.metrics_url}"
    if collector.pusher is not None:  # its URLs without a user:password@ the flag may carry
        extra += f"; alerts to {', '.join(collector.pusher.urls)}"
    print(f"ghostgpu collector {__version__}: listening on {', '.join(collector.addresses)}; database {db}"
          f"{extra}", file=sys.stderr, flush=True)
    stop = threading.Event()
    install_signals(stop.set)
    reload_on_hangup(collector)
    rc = 0
    while not stop.wait(0.5):
        if collector.failed is not None:
            print(f"ghostgpu: collector: {collector.failed}", file=sys.stderr)
            rc = 1
            break
        if collector.wait(0):
            rc = 1
            break
    collector.stop()
    return rc


def reload_on_hangup(collector: Collector) -> None:
    """SIGHUP re-reads the policy (on the collector's loop, where the policy is read)."""
    def on_hup(_sig: int, _frame: Any) -> None:
        loop, security = collector.loop, collector.security
        if loop is not None and security is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(security.reload)

    signal.signal(signal.SIGHUP, on_hup)
