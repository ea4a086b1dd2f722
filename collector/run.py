"""`ghostgpu collector`: its settings (collector/config.py: defaults, --config FILE, flags) turned into a
Collector (collector/main.py), its life until SIGTERM, and SIGHUP re-reading the policy and the
config file's remediation section. `ghostgpu up` builds its collector from the same settings
(cli/up.py)."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from ghostgpu.collector.config import collector_config
from ghostgpu.collector.heap import HeapPolicy
from ghostgpu.collector.main import Collector
from ghostgpu.collector.server import ListenError
from ghostgpu.collector.store import StoreError

from ghostgpu import __version__
from ghostgpu.common.system.fdlimit import raise_fd_limit
from ghostgpu.common.web.httpserve import HttpListenError


def run_collector(args: argparse.Namespace, install_signals: Callable[[Callable[[], None]], None]) -> int:
    """The body of `ghostgpu collector`: exit 0 on SIGTERM/SIGINT, 2 on a bad flag, 1 if storage fails."""
    raise_fd_limit()  # before anything listens: descriptors are what a flood of connections takes
    try:
        config = collector_config(args)  # defaults < --config FILE < flags; ValueError naming one
        if config.web_config_file and not config.metrics_listen:
            print("ghostgpu: collector: --web-config-file: it secures /metrics; add --metrics-listen "
                  "HOST:PORT", file=sys.stderr)
            return 2
        collector = Collector(config, heap=HeapPolicy())  # gc state is process-wide: the commands only
        collector.start()
    except (ListenError, StoreError, HttpListenError, ValueError) as e:
        print(f"ghostgpu: collector: {e}", file=sys.stderr)
        return 2
    _say_started(collector)
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


def _say_started(collector: Collector) -> None:
    extra = ""
    if collector.metrics_address:
        extra += f"; metrics {collector.metrics_url}"
    if collector.pusher is not None:  # its URLs without a user:password@ the flag may carry
        extra += f"; alerts to {', '.join(collector.pusher.urls)}"
    print(f"ghostgpu collector {__version__}: listening on {', '.join(collector.addresses)}; database "
          f"{collector.db_path}{extra}", file=sys.stderr, flush=True)


def reload_on_hangup(collector: Collector) -> None:
    """SIGHUP re-reads the policy and the remediation section (on the collector's loop, where both are
    read)."""
    def on_hup(_sig: int, _frame: Any) -> None:
        loop, security = collector.loop, collector.security
        if loop is not None and security is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(security.reload)
                loop.call_soon_threadsafe(collector.remediation_config.reload)

    signal.signal(signal.SIGHUP, on_hup)
