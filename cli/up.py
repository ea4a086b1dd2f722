"""`ghostgpu up`: the collector and a tracer on this node, with the live `ps` view.

The collector runs in this process (collector.main.Collector); the tracer is `ghostgpu tracer
--collector ADDR` as a child in this process group, so it is the same tracer a cluster runs and
talks to the collector over the same gRPC stream. The view is drawn from the query service,
exactly as `ghostgpu ps` draws it, with the node's BPF/NVML status above the table and the
latest events and findings under it, so a short-lived consumer gone before the next redraw is
still seen. See cli/demo.py for `--demo`; a demo keeps its records in a store of its own
(store_path), so none of its planted findings reaches the node's real history.

Until this run's tracer first connects, the node line says "tracer starting" (the collector may know
the node only from the store, from a run that ended: not a disconnection) and what `up`'s own NVML
probe found, so the first frame on a machine without a GPU already says so.

A demo whose planted consumers the tracer does not list DEMO_UNSEEN_S after its first scan says why
at once (demo_unseen_line: the path a consumer holds, as /proc shows it from here, and what to do),
and `--once` exits 1 with that line; the long wait (CONNECT_TIMEOUT_S + DEMO_TIMEOUT_S) is only for a
tracer that is not up yet.

A tracer that dies is restarted by cli/supervise.py (jittered backoff; `up` exits 1 with the
reason after --tracer-max-restarts failed restarts in a row); the view's loop drives it, and
says when and why the tracer restarted.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from ghostgpu.cli import view
from ghostgpu.cli.client import ClientError, FindingWaker, Query, show
from ghostgpu.cli.demo import Demo, DemoError
from ghostgpu.cli.supervise import DEFAULT_MAX_RESTARTS, TracerSupervisor
from ghostgpu.collector.config import CollectorConfig

from ghostgpu.common.model.consumers import ClusterConsumer, ConsumerClass
from ghostgpu.common.system.fdlimit import raise_fd_limit
from ghostgpu.common.system.settings import default_of
from ghostgpu.common.transport.addresses import (
    DEFAULT_COLLECTOR,
    dial_address,
    is_unix,
    port_free,
    unix_address,
)
from ghostgpu.v1 import query_pb2, stream_pb2

if TYPE_CHECKING:
    from ghostgpu.collector.main import Collector
    from ghostgpu.tracer.config import TracerConfig

DEFAULT_DB = default_of(CollectorConfig, "db_path")  # the collector's (collector/config.py)
CONNECT_TIMEOUT_S = 60.0  # tracer start to its snapshot: BPF compile takes ~2 s, more on a busy node
DEMO_TIMEOUT_S = 60.0
# Counted from the tracer's first snapshot (its `info`), not from its start, so a slow BPF compile does
# not eat into it: the tracer sends `info` after its first full /proc scan and the classification of
# what it found, on the same ordered stream, so a consumer it can see is in the collector's table by
# then. What is left is the collector's CRI lookup of the demo pods and the view's 0.2 s poll; 5 s
# covers a loaded node many times over and says why within seconds, not at the cap.
DEMO_UNSEEN_S = 5.0
REDRAW_S = 1.0
RECENT_LINES = 10


class UpError(Exception):
    """One line to print before exiting 1."""


class FlagError(UpError):
    """A bad flag value, named in the line: exit 2."""


def probe_nvml(node: str) -> stream_pb2.NodeInfo:
    """What this host's NVML says, as the tracer will report it (same library, same environment), read
    once before the tracer starts; quiet (the tracer logs its own). Closed at once: `up` holds no GPU."""
    from ghostgpu.tracer.nvml import NvmlSource
    from ghostgpu.tracer.records import info_record

    from ghostgpu.common.wire.convert import info_to_proto

    nvml_log = logging.getLogger("ghostgpu.nvml")
    level = nvml_log.level
    nvml_log.setLevel(logging.CRITICAL)
    source = NvmlSource()
    try:
        return info_to_proto(info_record(node, False, source.read()))
    finally:
        source.close()
        nvml_log.setLevel(level)


def gpu_visible(info: stream_pb2.NodeInfo) -> bool:
    return info.nvml and bool(info.gpus)


def first_nvml_text(info: stream_pb2.NodeInfo, demo_gpu: bool) -> str:
    """The NVML part of the node line until the tracer's own snapshot arrives."""
    text = view.nvml_text(info)
    return f"{text}; --demo plants a demo GPU for its tracer" if demo_gpu else text


def demo_unseen_line(unseen: list[str], held: dict[str, tuple[int | None, str]], prefixes: tuple[str, ...],
                     waited_s: float) -> str:
    """Why the tracer lists no consumer for the demo roles `unseen` (hidden, orphaned), `waited_s` after its
    first scan. `held`: Demo.held(), role -> (host PID, the path its GPU fd links to, or why none)."""
    from ghostgpu.tracer.devices import outside_prefix_hint

    s = "s" if len(unseen) > 1 else ""
    head = (f"the tracer has not seen the demo's {' and '.join(unseen)} consumer{s} {waited_s:.0f} s after "
            f"its first /proc scan")
    known = {role: held.get(role, (None, "not planted")) for role in unseen}
    for pid, what in known.values():
        hint = outside_prefix_hint(what, prefixes, pid) if pid is not None else None
        if hint is not None:  # a chroot or another mount namespace: the usual case, and its fix
            return f"{head}: {hint}"
    for role, (pid, what) in known.items():
        if pid is None or not what.startswith("/"):
            return f"{head}: the {role} consumer{f' (pid {pid})' if pid else ''}: {what}"
    role, (pid, what) = next(iter(known.items()))
    return (f"{head}: pid {pid} ({role}) holds {what}, which the device prefixes ({', '.join(prefixes)}) "
            f"cover; the tracer must read this host's /proc (--proc-root) from its PID namespace: see the "
            f"tracer's lines above")


def store_path(db_flag: str | None, demo: Demo | None) -> str:
    """--db when given (kept, whatever runs); else a demo's own store, in the demo's temporary directory
    so Demo.close() removes it with the demo's processes; else the node's store, DEFAULT_DB."""
    if db_flag:
        return db_flag
    return demo.db_path if demo is not None else DEFAULT_DB


def store_label(db: str, demo: Demo | None) -> str:
    return f"{db}, the demo's own, removed on exit" if demo is not None and db == demo.db_path else db


def _local_cri_endpoint() -> str | None:
    from ghostgpu.tracer.cri_relay import detect_socket

    path = detect_socket()
    return unix_address(path) if path else None


def tracer_command(args: argparse.Namespace, address: str, node: str, cri_endpoint: str | None) -> list[str]:
    """`ghostgpu tracer --collector ADDR` with every tracer flag `up` was given."""
    # -P (Python 3.11+): the working directory stays off sys.path. Run from a checkout by a copy
    # installed elsewhere (/opt/ghostgpu, scripts/bootstrap.sh), the checkout's own ghostgpu/ folder,
    # which lacks the tracer and collector that the install maps in, would shadow the installed one.
    cmd = [sys.executable, "-P", "-m", "ghostgpu.cli"] + (["-v"] if getattr(args, "verbose", False) else [])
    cmd += ["tracer", "--collector", address, "--node-name", node]
    for flag, dest in (("--config", "config"), ("--bpf", "bpf"), ("--jsonl", "jsonl"),
                       ("--proc-root", "proc_root"), ("--sys-root", "sys_root"),
                       ("--cgroup-root", "cgroup_root"), ("--grace-s", "grace_s"),
                       ("--scan-interval-s", "scan_interval_s"),
                       ("--podresources-endpoint", "podresources_endpoint"),
                       ("--health-listen", "health_listen"), ("--trace-max-sessions", "trace_max_sessions"),
                       ("--trace-max-duration", "trace_max_duration"),
                       ("--trace-max-records", "trace_max_records"),
                       ("--web-config-file", "web_config_file"),
                       ("--http-max-connections", "http_max_connections"),
                       ("--http-max-connections-per-source", "http_max_connections_per_source")):
        value = getattr(args, dest, None)
        if value is not None:
            cmd += [flag, str(value)]
    if getattr(args, "insecure", False):  # one --insecure for up's listeners and its tracer's health port
        cmd.append("--insecure")
    for flag, dest in (("--vendor", "vendors"), ("--device-prefix", "device_prefixes")):
        for value in getattr(args, dest, None) or []:
            cmd += [flag, value]
    if cri_endpoint:
        cmd += ["--cri-endpoint", cri_endpoint]
    return cmd


def _open_db(db: str) -> str:
    if db != ":memory:":
        try:
            from ghostgpu.common.system.filemodes import make_private_dirs

            make_private_dirs(os.path.dirname(os.path.abspath(db)))  # new levels 0700: the store is private
        except OSError as e:
            raise UpError(f"cannot create the directory of the collector database {db}: {e.strerror}; "
                          f"run as root or pass --db PATH (or --db :memory:)") from e
    return db


def _start_collector(args: argparse.Namespace, listen: str, node: str, cri_endpoint: str | None,
                     db: str) -> Collector:
    from ghostgpu.collector.heap import HeapPolicy
    from ghostgpu.collector.main import Collector
    from ghostgpu.collector.server import ListenError

    from ghostgpu.common.system.settings import flag_values
    from ghostgpu.common.web.httpserve import HttpListenError

    busy = port_free(listen)
    if busy is not None:
        raise UpError(f"cannot listen on {listen} ({busy}): another collector or `ghostgpu up` may be "
                      f"running; pass --listen HOST:PORT (e.g. --listen 127.0.0.1:7451)")
    try:  # a bad --metrics-listen, --alertmanager, --alert-label, ... is a ValueError naming the flag
        given = {"listen": (listen,), "db_path": _open_db(db), "cri_endpoint": cri_endpoint,
                 "node_name": node}
        config = CollectorConfig(**{**flag_values(CollectorConfig, args), **given})
        if config.security_options().tls.enabled and not is_unix(listen):
            # The TLS files are the collector's; up's own tracer and live view come in through a
            # private unix socket instead, as the local root (SO_PEERCRED), which needs no certificate.
            private = unix_address(os.path.join(tempfile.mkdtemp(prefix="ghostgpu-up-"), "up.sock"))
            config = replace(config, listen=(listen, private))
        collector = Collector(config, heap=HeapPolicy())  # gc state is process-wide: the commands only
    except ValueError as e:
        raise FlagError(str(e)) from None
    try:
        collector.start()
    except Exception as e:
        with contextlib.suppress(Exception):
            collector.stop()
        # --metrics-listen cannot be bound, a bad --alertmanager URL or --alert-label: the line names it
        if isinstance(e, ValueError) and (isinstance(e, HttpListenError) or not isinstance(e, ListenError)):
            raise FlagError(str(e)) from None
        raise UpError(f"cannot start the collector on {listen} ({e}); pass --listen HOST:PORT or --db PATH"
                      ) from e
    return collector


def run_up(cfg: TracerConfig, args: argparse.Namespace,
           install_signals: Callable[[Callable[[], None]], None]) -> int:
    stop = threading.Event()
    install_signals(stop.set)
    node = cfg.node_name
    demo: Demo | None = None
    collector: Collector | None = None
    tracer: TracerSupervisor | None = None
    try:
        raise_fd_limit()  # before the collector listens: a flood of connections takes descriptors
        max_restarts = getattr(args, "tracer_max_restarts", DEFAULT_MAX_RESTARTS)
        if max_restarts < 0:
            raise FlagError(f"--tracer-max-restarts {max_restarts}: must be 0 (never restart) or more")
        local_cri = args.collector_cri_endpoint or args.cri_endpoint or _local_cri_endpoint()
        nvml_info = probe_nvml(node)
        if args.demo:
            demo = Demo(fake_nvml=not gpu_visible(nvml_info), real_cri_endpoint=local_cri).start()
        cri = demo.cri_endpoint if demo else local_cri
        db = store_path(args.db, demo)
        collector = _start_collector(args, args.listen or DEFAULT_COLLECTOR, node, cri, db)
        from ghostgpu.collector.run import reload_on_hangup

        reload_on_hangup(collector)  # SIGHUP re-reads --policy, as for `ghostgpu collector`
        address = dial_address(collector.addresses[-1])  # the private unix socket when there is one
        env = {**os.environ, **(demo.tracer_env() if demo else {})}
        tracer_cri = demo.cri_endpoint if demo else args.cri_endpoint
        tracer = TracerSupervisor(tracer_command(args, address, node, tracer_cri), env, max_restarts).start()
        live = LiveView(Query(address), node, tracer, stop, demo, args, db=store_label(db, demo),
                        nvml_text=first_nvml_text(nvml_info, bool(demo and demo.fake_nvml)),
                        prefixes=tuple(cfg.prefixes))
        live.metrics_address = collector.metrics_address
        return live.run()
    except FlagError as e:
        print(f"ghostgpu: {e}", file=sys.stderr)
        return 2
    except (UpError, DemoError) as e:
        print(f"ghostgpu: {e}", file=sys.stderr)
        return 1
    finally:
        if tracer is not None:
            tracer.stop()
        if collector is not None:
            collector.stop()
        if demo is not None:
            demo.close()  # after the collector has closed the demo's store: close() deletes it


class LiveView:
    """Redraws the view on findings and every REDRAW_S until stopped (or once, for --once)."""

    def __init__(self, query: Query, node: str, tracer: TracerSupervisor, stop: threading.Event,
                 demo: Demo | None, args: argparse.Namespace, db: str = DEFAULT_DB,
                 nvml_text: str = "", prefixes: tuple[str, ...] = ()) -> None:
        """`db`: the store as the top line names it; `nvml_text`: up's own NVML probe (first_nvml_text);
        `prefixes`: the tracer's device prefixes, for the line saying why it does not see the demo."""
        self.query, self.node, self.tracer, self.stop, self.demo = query, node, tracer, stop, demo
        self.once = bool(args.once)
        self.db = db
        self.nvml_text = nvml_text
        self.tracer_connected = False  # this run's tracer has connected at least once
        self.prefixes = prefixes
        self.tracer_up_s: float | None = None  # monotonic, when this tracer's first snapshot (`info`) was in
        self._up_instance = ""
        self.demo_problem = ""  # why the tracer does not list the planted consumers (demo_unseen_line)
        self.address = query.address
        self.metrics_address: str | None = None  # run_up sets it when --metrics-listen serves
        self.recent: collections.deque[tuple[int, str]] = collections.deque(maxlen=200)
        self.instance_id, self.after_seq = "", 0
        # demo: runs of the short-lived container seen opening. A count, not the set of their pids,
        # which grew by one every few seconds for as long as the demo ran.
        self.short_lived_runs = 0
        self._short_lived_pid = 0
        self.short_lived_last = ""
        self.tracer_lines_shown = 0
        self._lock = threading.Lock()
        tracer.on_notice = self._on_tracer_notice

    def _on_tracer_notice(self, text: str) -> None:
        """A restart line from the supervisor, after the dead tracer's last stderr lines."""
        self._tracer_lines()
        with self._lock:
            self.recent.append((time.time_ns(), f"{time.strftime('%H:%M:%S')} tracer   {text}"))

    def _on_finding(self, ev: query_pb2.FindingEvent) -> None:
        with self._lock:
            self.recent.append((time.time_ns(), view.finding_event_line(ev)))

    def _poll_events(self, status: query_pb2.TracerStatus | None) -> None:
        if status is None or not status.instance_id:
            return
        if status.instance_id != self.instance_id:
            self.instance_id, self.after_seq = status.instance_id, 0
        batch = self.query.events(self.node, self.instance_id, self.after_seq)
        short_id = self.demo.container_ids()["short-lived"] if self.demo else None
        for stored in batch:
            ev = stored.event
            self.after_seq = max(self.after_seq, ev.seq)
            if ev.WhichOneof("body") not in ("holder", "notice"):
                continue  # findings come from the collector, with CRI's verdict in them
            line = view.event_line(ev)
            if short_id and ev.WhichOneof("body") == "holder" and ev.holder.process.container_id == short_id:
                self._short_lived(ev, line)
            if line:
                with self._lock:
                    self.recent.append((ev.ts_unix_ns, line))

    def _short_lived(self, ev: stream_pb2.NodeEvent, line: str | None) -> None:
        h = ev.holder
        new_run = h.process.pid != self._short_lived_pid  # one run opens once; the stream may resend
        if h.kind == h.KIND_OPEN and h.device_kind in ("gpu", "mig") and new_run:
            self._short_lived_pid = h.process.pid
            self.short_lived_runs += 1
        elif h.kind == h.KIND_EXIT and h.HasField("held_ns"):
            when = line.split()[0] if line else "?"
            held_ms = h.held_ns / 1e6
            self.short_lived_last = f"latest: pid {h.process.pid} held it {held_ms:.0f} ms, exited {when}"

    def _tracer_lines(self) -> None:
        """The tracer's stderr under the view, but not the warnings it also sent as notices."""
        lines = list(self.tracer.stderr)
        fresh = [line for n, line in lines if n >= self.tracer_lines_shown]
        if lines:
            self.tracer_lines_shown = lines[-1][0] + 1
        with self._lock:
            shown = [line for _, line in self.recent]
            for line in fresh:
                text = line.split(": ", 2)[-1] if line.startswith("ghostgpu: ") else line
                if not any(text in s for s in shown):
                    self.recent.append((time.time_ns(), f"{time.strftime('%H:%M:%S')} tracer   {line}"))

    def _status(self) -> query_pb2.TracerStatus | None:
        # Unfiltered: asked for one node, the collector answers NOT_FOUND until its tracer first
        # connects, and a tracer failing at start never does; the view must still draw (and say why).
        return next((n for n in self.query.nodes() if n.node == self.node), None)

    def _screen(self) -> tuple[str, bool]:
        """(the view, whether --once may print it)."""
        status = self._status()
        self._poll_events(status)
        consumers = self.query.consumers(node=self.node)
        self._tracer_lines()
        ready = status is not None and status.connected and status.HasField("info")
        if status is None or not ready:
            self.tracer_up_s = None
        elif self.tracer_up_s is None or status.instance_id != self._up_instance:  # up, or up again
            self.tracer_up_s, self._up_instance = time.monotonic(), status.instance_id
        if self.demo is not None:
            self._check_demo_seen(consumers)
        metrics = f", metrics http://{self.metrics_address}/metrics" if self.metrics_address else ""
        top = (f"ghostgpu up: collector {self.address} (db {self.db}){metrics}, "
               f"{self.tracer.describe()}"
               f"{'' if self.once else '; Ctrl-C stops both'}")
        lines = [top, self._node_line(status)]
        if self.demo:
            lines.append(self.demo.legend())
            latest = f"; {self.short_lived_last}" if self.short_lived_last else ""
            n = self.short_lived_runs
            lines.append(f"demo: short-lived: ghostgpu saw {n} run{'' if n == 1 else 's'} open the GPU "
                         f"(one every {self.demo.short_lived_every_s:g} s){latest}")
            if self.demo_problem:
                lines.append(f"demo: NOT SEEN: {self.demo_problem}")
        with self._lock:
            recent = [line for _, line in sorted(self.recent, key=lambda x: x[0])][-RECENT_LINES:]
        lines += ["", view.consumer_table(consumers, empty="(no process holds a GPU device file)"), "",
                  "recent events and findings:", *(recent or ["(none yet)"])]
        if ready and self.demo is not None:
            # Runs start once the tracer is attached: one before would be missed by design, not by ghostgpu.
            self.demo.start_short_lived()
            ready = self._demo_seen(consumers)
        return "\n".join(lines), ready

    def _node_line(self, status: query_pb2.TracerStatus | None) -> str:
        self.tracer_connected = self.tracer_connected or bool(status is not None and status.connected)
        if status is not None and self.tracer_connected:
            # The header and its GPU memory lines, as `ps` shows them.
            line = "\n".join(view.node_lines(status, demo_gpu=bool(self.demo and self.demo.fake_nvml)))
        else:
            # Before this run's tracer first connects, a status can only come from the store (a run
            # that ended, which node_header would call DISCONNECTED): say what is known instead.
            line = f"node {self.node} | tracer starting"
        if (status is None or not status.HasField("info") or not self.tracer_connected) and self.nvml_text:
            line += f" | {self.nvml_text}"
        return line

    def _check_demo_seen(self, consumers: list[ClusterConsumer]) -> None:
        """Set (or clear) demo_problem: hidden or orphaned still unlisted DEMO_UNSEEN_S after the tracer's
        first snapshot."""
        assert self.demo is not None
        if self.tracer_up_s is None:
            self.demo_problem = ""  # the tracer is not up (yet, or again): the long cap covers a slow start
            return
        ids = self.demo.container_ids()
        listed = {c.consumer.container_id for c in consumers}
        unseen = [role for role in ("hidden", "orphaned") if ids[role] not in listed]
        waited_s = time.monotonic() - self.tracer_up_s
        if unseen and waited_s >= DEMO_UNSEEN_S:
            self.demo_problem = demo_unseen_line(unseen, self.demo.held(), self.prefixes, waited_s)
        elif not unseen:
            self.demo_problem = ""

    def _demo_seen(self, consumers: list[ClusterConsumer]) -> bool:
        assert self.demo is not None
        ids = self.demo.container_ids()
        classes = {(c.consumer.container_id, c.consumer.cls) for c in consumers}
        return ((ids["hidden"], ConsumerClass.HIDDEN) in classes and (ids["orphaned"], ConsumerClass.ORPHANED)
                in classes and self.short_lived_runs > 0)

    def run(self) -> int:
        # include_open: findings opened before the stream was (re)established are shown too.
        waker = FindingWaker(self.query, on_event=self._on_finding, node=self.node, include_open=True).start()
        tty = sys.stdout.isatty() and not self.once
        started = time.monotonic()
        deadline = started + CONNECT_TIMEOUT_S + (DEMO_TIMEOUT_S if self.demo else 0)
        last, screen = "", ""
        self.tracer.on_change = waker.changed.set
        try:
            while not self.stop.is_set():
                failed = self.tracer.poll()
                if self.stop.is_set():
                    break  # Ctrl-C reached the tracer too (same process group): not a failure
                if failed is not None:
                    if self.once:  # the screen as it is now: every restart, and the tracer stopped
                        with contextlib.suppress(ClientError):
                            screen = self._screen()[0]
                        print(screen, flush=True)
                    print(f"ghostgpu: {failed}", file=sys.stderr, flush=True)
                    return 1
                try:
                    screen, ready = self._screen()
                except ClientError as e:
                    screen, ready = f"ghostgpu up: {e}", False
                if self.once:
                    if ready:
                        print(screen, flush=True)
                        return 0
                    if self.demo_problem:  # the tracer is up and blind to the demo: no use waiting
                        print(screen, flush=True)
                        print(f"ghostgpu: {self.demo_problem}", file=sys.stderr, flush=True)
                        return 1
                    if time.monotonic() > deadline:
                        print(screen, flush=True)
                        what = "the demo consumers" if self.demo else "the tracer's first snapshot"
                        print(f"ghostgpu: gave up waiting {time.monotonic() - started:.0f} s for {what}; "
                              f"tracer said: {self.tracer.last_line()}", file=sys.stderr)
                        return 1
                else:
                    last = show(screen, last, tty)
                wait_s = 0.2 if self.once else REDRAW_S
                due_s = self.tracer.due_in_s()  # wake for a pending restart, not at the next redraw
                waker.changed.wait(wait_s if due_s is None else min(wait_s, due_s))
                waker.changed.clear()
            return 0
        finally:
            waker.stop()
            self.query.close()
