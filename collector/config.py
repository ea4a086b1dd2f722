"""The collector's one typed configuration: defaults < config file (TOML, `--config`) < flags.

Every setting is a field of CollectorConfig, and the field is the one place its default, its check
and its unit are written (but the mTLS connection caps' "1 or more", checked where the TCP gate is
built: only TLS on a TCP port uses them). Its metadata (ghostgpu/common/system/settings.py) says
what the command line needs (the flag, its argparse type, the help line with `{default}` filled in
from the field), so cli/main.py declares the flags from here and a flag's help can never say another
default than the one the collector uses. What a component takes (SecurityOptions, TraceLimits, the
trace store's caps, /metrics' HttpCaps, the CRI cache's ttl, the Alertmanager resend) comes from
here; none of them has a default of its own for it.

The file is read by the reader the tracer's is (ghostgpu/common/system/configfile.py): TOML (YAML
when its name ends in .yaml or .yml), its keys the field names, in a `[collector]` table or at the
top level; a flag that is given wins over the file. Its `remediation` section is not a field: it is
the remediation policy's (collector/remediation_policy.py), re-read when the file changes
(collector/remediation_config.py), so the file's path travels in `config_path`. Durations are
seconds in the file (`trace_max_duration_s = 600`; the remediation section's are written 5m, 1h) and
"10m" on the command line. A bad value is a ValueError with one line: a flag's names the flag, a
file's (ConfigError) names the file and the key.

This module is imported when the parser is built, by every command: nothing heavy at module level.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from ghostgpu.common.model.durations import duration_flag, format_s
from ghostgpu.common.model.trace_limits import TRACE_MAX_DURATION_S, TRACE_MAX_RECORDS
from ghostgpu.common.system.configfile import comma_list, read_config_file
from ghostgpu.common.system.settings import flag_values, meta, setting

# The config file's section the remediation policy reads (collector/remediation_policy.py's SECTION),
# skipped by the settings' reader; written here too, as that module is not imported to build a parser.
REMEDIATION_SECTION = "remediation"

if TYPE_CHECKING:
    from ghostgpu.collector.security import SecurityOptions
    from ghostgpu.collector.trace_commands import TraceLimits, TraceTiming

    from ghostgpu.common.web.httpserve import HttpCaps


# ---- the checks: one line naming the flag, as the collector always said it ---------------------------


def _above_0(flag: str) -> Callable[[Any], None]:
    def check(value: float) -> None:
        if value <= 0:
            raise ValueError(f"{flag} {value}: must be more than 0")
    return check


def _at_least_0(flag: str, what: str) -> Callable[[Any], None]:
    def check(value: int) -> None:
        if value < 0:
            raise ValueError(f"{flag} {value}: must be {what}")
    return check


def _at_least_1(flag: str) -> Callable[[Any], None]:
    def check(value: int) -> None:
        if value < 1:
            raise ValueError(f"{flag} {value}: must be 1 or more")
    return check


def _check_listen(addresses: Sequence[str]) -> None:
    from ghostgpu.collector.server import check_listen  # grpc: only when a collector is configured

    for addr in addresses:
        check_listen(addr)


def _check_metrics_listen(addr: str | None) -> None:
    if addr is not None:
        from ghostgpu.common.transport.addresses import parse_listen
        from ghostgpu.common.web.httpserve import HttpListenError

        parse_listen(addr, "--metrics-listen", HttpListenError)  # one line naming the flag


def _check_trace_max_records(value: int) -> None:
    if value < 1:
        raise ValueError(f"--trace-max-records {value}: must be 1 or more")


def _check_alert_labels(labels: Mapping[str, str]) -> None:
    if labels:
        from ghostgpu.collector.alertpush import check_extra_labels

        check_extra_labels(labels)  # ValueError naming --alert-label


# ---- what a flag's text becomes -------------------------------------------------------------------------


def _comma_list(value: str) -> tuple[str, ...]:
    return tuple(comma_list(value))


def _alertmanager_urls(values: Sequence[str]) -> tuple[str, ...]:
    """ValueError naming --alertmanager and a bad URL."""
    from ghostgpu.collector.alertpush import parse_alertmanager_urls  # only with --alertmanager

    return tuple(parse_alertmanager_urls(values))


def _alert_labels(values: Sequence[str]) -> dict[str, str]:
    from ghostgpu.collector.alertpush import parse_alert_labels  # only with --alert-label

    return parse_alert_labels(values)


@dataclass(frozen=True)
class CollectorConfig:
    """Every collector setting: its default, unit and check, and its flag in the metadata. Checked when
    made (a bad value: ValueError, one line naming the flag); the components take their slices."""

    # ---- where it serves and stores ----
    listen: tuple[str, ...] = setting(
        ("0.0.0.0:7450",), flag="--listen", check=_check_listen, parse=_comma_list,
        help="gRPC address for tracers and clients: HOST:PORT or unix:///path")
    db_path: str = setting(
        "/var/lib/ghostgpu/collector.db", flag="--db", dest="db",
        help="SQLite file for findings and the event log (default {default}; ':memory:' keeps nothing)")
    store_url: str = setting(
        "", flag="--store", dest="store", metavar="URL",
        help="the store several replicas share: postgresql://USER@HOST[:PORT]/DB (libpq URI: "
        "?sslmode=verify-full&sslrootcert=...), or sqlite:///PATH; env GHOSTGPU_STORE; default: --db "
        "(docs/REPLICAS.md)")
    store_password_file: str | None = setting(
        flag="--store-password-file", metavar="PATH",
        help="the PostgreSQL password, on the file's first line (a mounted Secret)")
    replica_id: str = setting(
        "", flag="--replica-id", metavar="ID",
        help="this collector among the replicas sharing --store (default: HOSTNAME-PID; the pod name "
        "in Kubernetes)")
    lease_ttl_s: float = setting(
        10.0, flag="--lease-ttl", check=_above_0("--lease-ttl"), type=float, metavar="SECONDS",
        help="a replica that cannot renew its node leases this long ends their streams, so the tracers "
        "move to a replica that reaches the database (default {default})")
    retention_days: float = setting(
        7.0, flag="--retention-days", check=_above_0("--retention-days"), type=float,
        help="keep findings resolved within this many days (default {default})")
    faults_max: int = setting(
        10_000, flag="--faults-max", check=_at_least_1("--faults-max"), type=int, metavar="N",
        help="GPU faults (Xid) kept, with the pods each hit; past it the oldest go, counted in "
        "ghostgpu_faults_dropped_total (default {default})")
    event_log_max: int = setting(
        1_000_000, flag="--event-log-max", check=_at_least_0("--event-log-max", "0 (keep none) or more"),
        type=int, help="events kept in the event log, newest first (default {default}; 0 keeps none)")
    # ---- CRI: the local runtime socket for tracers without a relay, and the answers' cache ----
    cri_endpoint: str | None = setting(
        flag="--collector-cri-endpoint", dest="collector_cri_endpoint",
        help="resolve containers of tracers without a CRI relay through this local socket")
    cri_ttl_s: float = setting(
        30.0, flag="--cri-ttl-s", check=_above_0("--cri-ttl-s"), type=float,
        help="seconds a CRI answer is cached (default {default}; unknown containers 5); the answer "
             "for a container with a GPU holder is fetched again this often, so a container that stops "
             "under a holder that outlives it is seen orphaned within it")
    # The node the collector itself runs on (`up`): its containers are resolved through cri_endpoint.
    node_name: str | None = setting(in_file=False)
    # --config FILE, as given: its remediation section is read (and re-read) by the remediation policy's
    # watcher (collector/remediation_config.py); None: no file, remediation off.
    config_path: str | None = setting(in_file=False)
    # ---- /metrics and the Alertmanager push ----
    metrics_listen: str | None = setting(
        flag="--metrics-listen", check=_check_metrics_listen, metavar="HOST:PORT",
        help="serve Prometheus /metrics on this address (default off; e.g. 0.0.0.0:9400)")
    metrics_max_process_series: int = setting(
        1000, flag="--metrics-max-process-series",
        check=_at_least_0("--metrics-max-process-series", "0 or more"), type=int, metavar="N",
        help="at most N non-visible consumers get per-process series, oldest findings first (default "
        "{default}; ghostgpu_metrics_process_series_capped counts the rest)")
    alertmanager: tuple[str, ...] = setting(
        (), flag="--alertmanager", action="append", metavar="URL",
        help="push findings to this Alertmanager as they open and resolve, "
        "e.g. http://127.0.0.1:9093 (repeatable, or comma-separated)")
    alert_resend_s: float = setting(
        60.0, flag="--alertmanager-resend-s", dest="alertmanager_resend_s",
        check=_above_0("--alertmanager-resend-s"), type=float, metavar="S",
        help="re-send open alerts every S seconds (default {default})")
    alert_fault_hold_s: float = setting(
        3600.0, flag="--alert-fault-hold", dest="alert_fault_hold", check=_above_0("--alert-fault-hold"),
        parse=duration_flag("--alert-fault-hold"), show=format_s, metavar="D",
        help="a GPU fault is an instant: its pushed alert ends this long after the fault (default "
        "{default})")
    alert_labels: dict[str, str] = field(default_factory=dict, metadata=meta(
        flag="--alert-label", dest="alert_labels", check=_check_alert_labels, parse=_alert_labels,
        action="append", metavar="KEY=VALUE", help="extra label on every pushed alert (repeatable), "
        "e.g. cluster=prod"))
    # TLS and basic auth of /metrics (ghostgpu/common/web/webconfig.py), and its port's connection caps
    # (ghostgpu/common/web/httpserve.py; None: its defaults). The flags are shared with the tracer's.
    web_config_file: str | None = setting(flag="--web-config-file")
    http_max_connections: int | None = setting(flag="--http-max-connections")
    http_max_connections_per_source: int | None = setting(flag="--http-max-connections-per-source")
    # ---- trace sessions (docs/TRACE.md) ----
    trace_max_duration_s: float = setting(
        TRACE_MAX_DURATION_S, flag="--trace-max-duration", dest="trace_max_duration",
        check=_above_0("--trace-max-duration"), parse=duration_flag("--trace-max-duration"), show=format_s,
        metavar="D",
        help="longest trace session a client may start (default {default}; 30s, 10m, 1h)")
    trace_default_duration_s: float = setting(
        30.0, flag="--trace-default-duration", dest="trace_default_duration",
        check=_above_0("--trace-default-duration"), parse=duration_flag("--trace-default-duration"),
        show=format_s, metavar="D",
        help="length of a trace session whose client names none (default {default})")
    trace_max_records: int = setting(
        TRACE_MAX_RECORDS, flag="--trace-max-records", check=_check_trace_max_records, type=int, metavar="N",
        help="records kept per trace session at most, and its default (default {default})")
    trace_store_max_records: int = setting(
        1_000_000, flag="--trace-store-max-records",
        check=_at_least_0("--trace-store-max-records", "0 or more"), type=int, metavar="N",
        help="trace records kept in all sessions together; the oldest ended sessions make room, else "
        "records past it are counted as dropped (default {default})")
    trace_retention_h: float = setting(
        24.0, flag="--trace-retention-h", check=_above_0("--trace-retention-h"), type=float, metavar="H",
        help="hours an ended trace session and its records are kept (default {default})")
    # ---- who may connect (collector/security.py), and the record of what they did ----
    # The TLS files: each one not given is taken from its GHOSTGPU_TLS_* variable (TlsFiles.resolve).
    tls_cert: str | None = setting(flag="--tls-cert")
    tls_key: str | None = setting(flag="--tls-key")
    tls_ca: str | None = setting(flag="--tls-ca")
    tls_trust_domain: str | None = setting(flag="--tls-trust-domain")
    insecure: bool = setting(False, flag="--insecure")
    policy_path: str | None = setting(flag="--policy", dest="policy")
    audit_log: str | None = setting(flag="--audit-log")
    # The mTLS listeners' caps (collector/tcpgate.py); max_connections None: 10000, or what the fd
    # limit holds.
    max_connections: int | None = setting(
        flag="--max-connections", type=int, metavar="N",
        help="connections at once on each mTLS --listen port; past it the oldest one not yet "
        "authenticated is closed for the new one (default 10000, fewer where the fd limit "
        "holds fewer: docs/SECURITY.md)")
    max_connections_per_source: int = setting(
        32, flag="--max-connections-per-source", type=int, metavar="N",
        help="connections not yet authenticated at once from one address on each mTLS port; "
        "past it that address's oldest is closed (default {default})")

    def __post_init__(self) -> None:
        if self.alertmanager:  # comma-separated, duplicates once (flag and file alike): checked here
            object.__setattr__(self, "alertmanager", _alertmanager_urls(self.alertmanager))
        for f in fields(self):
            check = f.metadata.get("check")
            if check is not None:
                check(getattr(self, f.name))
        if self.trace_default_duration_s > self.trace_max_duration_s:
            raise ValueError(f"--trace-default-duration {self.trace_default_duration_s:g}s is more than "
                             f"--trace-max-duration {self.trace_max_duration_s:g}s")
        if self.alert_labels and not self.alertmanager:
            raise ValueError("--alert-label: labels go on alerts pushed to Alertmanager; add --alertmanager "
                             "URL (alerts from Prometheus rules take labels from its external_labels)")

    # ---- the slices the components take ----

    def store_location(self) -> str:
        """Where the store is: --store, else GHOSTGPU_STORE, else --db (a SQLite path)."""
        return self.store_url or os.environ.get("GHOSTGPU_STORE", "") or self.db_path

    def replica_name(self) -> str:
        return self.replica_id or f"{socket.gethostname()}-{os.getpid()}"

    def security_options(self) -> SecurityOptions:
        """collector/security.py's SecurityOptions (TLS files from the settings, else GHOSTGPU_TLS_*)."""
        from ghostgpu.collector.security import SecurityOptions  # grpc: only when a collector starts

        from ghostgpu.common.transport.tls import TlsFiles

        tls = TlsFiles.resolve(self.tls_cert, self.tls_key, self.tls_ca, self.tls_trust_domain)
        return SecurityOptions(tls=tls, insecure=self.insecure, policy_path=self.policy_path,
                               audit_log=self.audit_log, max_connections=self.max_connections,
                               max_connections_per_source=self.max_connections_per_source)

    def trace_limits(self, timing: TraceTiming | None = None) -> TraceLimits:
        """collector/trace_commands.py's TraceLimits: these limits, with `timing`'s waits and ticks (tests
        shorten them) or the defaults."""
        from ghostgpu.collector.trace_commands import TraceLimits, TraceTiming  # grpc: not for --help

        return TraceLimits(self.trace_max_duration_s, self.trace_default_duration_s, self.trace_max_records,
                           timing or TraceTiming())

    def http_caps(self) -> HttpCaps:
        """/metrics' connection caps for HttpServer, those set (ghostgpu/common/web/httpserve.py)."""
        from ghostgpu.common.web.httpserve import given_caps

        return given_caps(self.http_max_connections, self.http_max_connections_per_source)


# ---- the command line -----------------------------------------------------------------------------------


def collector_config(args: argparse.Namespace) -> CollectorConfig:
    """`ghostgpu collector`'s settings: the defaults, then --config FILE, then the flags."""
    path = getattr(args, "config", None)
    from_file = read_config_file(path, CollectorConfig, "collector", where=f"--config {path}",
                                 sections=(REMEDIATION_SECTION,)) if path else {}
    return CollectorConfig(**{**from_file, **flag_values(CollectorConfig, args)}, config_path=path)
