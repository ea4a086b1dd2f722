"""The tracer's one typed configuration: defaults < config file (TOML) < GHOSTGPU_* env < flags.

Every default and unit of the tracer is written once, on TracerConfig's field, and its checks in
TracerConfig.validate (the spool's bound in tracer/spool.py); the field's metadata says its flag, and
cli/main.py declares the tracer's flags from it (help with the default filled in; the TLS and web
config flags, which the commands share, come from cli/tls_flags.py and cli/main.py).
Host paths are settings because in a pod they are host mounts (/host/proc, /host/sys, ...).
The file and the environment are read by the reader the collector's file is
(ghostgpu/common/system/configfile.py). A bad value raises ConfigError with one line naming the key
(and, for the file or the environment, where it was set) and what to do.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ghostgpu.tracer.gpu_memory import DEFAULT_MAX_OBJECTS

from ghostgpu.common.model.durations import duration_flag, format_s
from ghostgpu.common.model.names import node_name_problem
from ghostgpu.common.model.trace_limits import TRACE_MAX_DURATION_S, TRACE_MAX_RECORDS
from ghostgpu.common.system.configfile import ConfigError, environment_values, read_config_file
from ghostgpu.common.system.settings import flag_values, meta, setting
from ghostgpu.common.transport.addresses import parse_listen

VENDOR_PREFIXES: dict[str, tuple[str, ...]] = {
    # /dev/nvidia covers nvidia0..N, nvidiactl, nvidia-uvm(-tools), nvidia-modeset, nvidia-caps/...
    "nvidia": ("/dev/nvidia",),
    "amd": ("/dev/kfd", "/dev/dri/renderD"),
    "ascend": ("/dev/davinci",),
}

# Node daemons that hold GPU devices by design: `system` where they run on the host itself (or in a
# place system_namespaces / system_containers name). An entry with a "/" is an executable path, matched
# exactly; any other a name, matched against the comm (cut to 15 bytes) or the executable's file name.
DEFAULT_SYSTEM_ALLOWLIST = (
    "nvidia-persistenced",
    "nv-hostengine",
    "dcgm-exporter",
    "nvidia-device-plugin",
    "gpu-feature-discovery",
    "nvidia-smi",
    "ghostgpu",
)


BPF_MODES = ("auto", "on", "off")
# on: the node takes part in remediation (docs/REMEDIATION.md; the collector decides whether anything is
# done at all); off: the node opts out, every remediation command is answered "skipped".
REMEDIATION_MODES = ("on", "off")
# Trace sessions the kernel side holds at once: bpf/trace.bpf.c GG_TRACE_SLOTS (tracer/trace_kernel.py
# reads its slot masks with it).
TRACE_SLOTS = 8
# The accountant's bound may go this high: at most 320 bytes an object (tracer/gpu_memory.py
# OBJECT_COST_BYTES), 5 GiB here.
MAX_MEMORY_OBJECTS = 1 << 24
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # RFC 1123: namespace and container names


def _node_name() -> str:
    return os.environ.get("NODE_NAME") or socket.gethostname().lower()


def _vendors_text(vendors: list[str]) -> str:
    return ",".join(vendors)


@dataclass
class TracerConfig:
    """Every tracer setting: its default, unit and check (validate), and its flag in the metadata
    (ghostgpu/common/system/settings.py: cli/main.py declares the flags from here). A component takes
    its slice (ClassifyConfig, NodeTraceLimits, StreamOptions) and has no defaults of its own."""

    # kubelet's default node name is the hostname lowercased; the collector refuses a Hello whose node
    # is no DNS-1123 subdomain (collector/ingest.py)
    node_name: str = field(default_factory=_node_name,
                           metadata=meta(flag="--node-name", help="node name reported with every record"))
    proc_root: str = setting("/proc", flag="--proc-root", help="host /proc (in a pod: the host mount)")
    sys_root: str = setting("/sys", flag="--sys-root", help="host /sys")
    cgroup_root: str = setting("/sys/fs/cgroup", flag="--cgroup-root", help="host cgroup mount")
    vendors: list[str] = field(default_factory=lambda: ["nvidia"], metadata=meta(
        flag="--vendor", dest="vendors", action="append", choices=tuple(VENDOR_PREFIXES), show=_vendors_text,
        help="device families to watch (repeatable; default {default})"))
    device_prefixes: list[str] = field(default_factory=list, metadata=meta(  # empty: derived from vendors
        flag="--device-prefix", dest="device_prefixes", action="append",
        help="device path prefix to watch (repeatable; overrides --vendor)"))
    # The periodic /proc rescan reads only processes whose fd table changed (tracer/rescan.py); every
    # full_scan_interval_s it reads them all (the reconcile: what no rescan can notice).
    scan_interval_s: float = setting(30.0, flag="--scan-interval-s", type=float,
                                     help="seconds between /proc scans (default {default})")
    full_scan_interval_s: float = 600.0
    nvml_interval_s: float = 1.0
    grace_s: float = setting(
        2.0, flag="--grace-s", type=float,
        help="seconds a holder may go unlisted by NVML before it is hidden (default {default})")
    system_allowlist: list[str] = field(default_factory=lambda: list(DEFAULT_SYSTEM_ALLOWLIST))
    # Where else allowlisted daemons are system: Kubernetes namespaces (e.g. gpu-operator), and
    # NAMESPACE/CONTAINER pairs. A pod chooses its process and container names but not its namespace,
    # so only CRI's names count: the collector checks them (collector/enrich.py). Default: the host only.
    system_namespaces: list[str] = field(default_factory=list)
    system_containers: list[str] = field(default_factory=list)
    # The parent of a reparented container process when it is orphaned (tracer/classify.py)
    reaper_comms: list[str] = field(default_factory=lambda: ["systemd", "init"])
    bpf: str = setting("auto", flag="--bpf", choices=BPF_MODES,
                       help="kernel tracing (default {default})")  # auto | on | off
    remediation: str = setting(
        "on", flag="--remediation", choices=REMEDIATION_MODES,
        help="on: this node takes part in remediation when the collector enables it (it signals an "
        "orphaned GPU holder after re-checking it; needs CAP_KILL); off: it opts out (default {default}; "
        "env GHOSTGPU_REMEDIATION)")
    bpf_max_fds: int = 65536
    bpf_ringbuf_pages: int = 64
    # RM objects the GPU memory accountant tracks node-wide (tracer/gpu_memory.py, docs/MEMORY.md): one
    # past it is counted (TracerStats.memory_objects_dropped_total) and its process's figure is unknown.
    max_memory_objects: int = DEFAULT_MAX_OBJECTS
    ioctl_poll_interval_s: float = 1.0
    # HOST:PORT for /healthz, /readyz, /metrics (tracer/health.py); "" = off
    health_listen: str = setting(
        "", flag="--health-listen", metavar="HOST:PORT", show=lambda listen: listen or "off",
        help="the tracer serves /healthz, /readyz and /metrics here (default {default}; "
        "env GHOSTGPU_HEALTH_LISTEN)")
    # TLS and basic auth of the health port: a Prometheus exporter-toolkit web config file
    # (ghostgpu/common/web/webconfig.py); /healthz and /readyz stay open to kubelet's probes.
    # Its flag is shared with the collector's /metrics (cli/main.py's _add_web_config_flag).
    web_config_file: str = setting("", flag="--web-config-file")
    # Unacknowledged events kept while the collector is out: ~40 MB at ~370 B each (tracer/spool.py
    # checks the bound, naming the flag).
    spool_events: int = setting(
        100_000, flag="--spool-events", type=int,
        help="events kept unacknowledged while the collector is out (default {default}, ~40MB)")
    trace_max_sessions: int = setting(
        4, flag="--trace-max-sessions", type=int, metavar="N",
        help=f"trace sessions at once on this node (default {{default}}, at most {TRACE_SLOTS})")
    trace_max_duration_s: float = setting(
        TRACE_MAX_DURATION_S, flag="--trace-max-duration", dest="trace_max_duration", metavar="D",
        parse=duration_flag("--trace-max-duration"), show=format_s,
        help="longest trace session (default {default}; 30s, 10m, 1h)")
    trace_max_records: int = setting(  # per session; calls past it are counted, not recorded
        TRACE_MAX_RECORDS, flag="--trace-max-records", type=int, metavar="N",
        help="records kept per trace session; calls past it are counted (default {default})")
    # mTLS to the collector (docs/SECURITY.md): this node's certificate (URI SAN
    # spiffe://TRUST_DOMAIN/node/NODE_NAME) and key, and the CA the collector's certificate chains to.
    # Their flags are every command's (cli/tls_flags.py).
    tls_cert: str = setting("", flag="--tls-cert")
    tls_key: str = setting("", flag="--tls-key")
    tls_ca: str = setting("", flag="--tls-ca")
    tls_trust_domain: str = setting("ghostgpu", flag="--tls-trust-domain")
    # Who besides root may serve a plaintext collector (unix socket, loopback): the tracer checks the
    # uid serving the address before it sends anything (ghostgpu/common/transport/dial.py). -1: nobody else.
    collector_uid: int = setting(-1, flag="--collector-uid")

    def __post_init__(self) -> None:
        self.validate()

    @property
    def prefixes(self) -> tuple[str, ...]:
        if self.device_prefixes:
            return tuple(self.device_prefixes)
        out: list[str] = []
        for vendor in self.vendors:
            out.extend(VENDOR_PREFIXES[vendor])
        return tuple(out)

    def validate(self) -> None:
        for vendor in self.vendors:
            if vendor not in VENDOR_PREFIXES:
                raise ConfigError(f"vendors: unknown vendor {vendor!r}; use one of {sorted(VENDOR_PREFIXES)}")
        for prefix in self.device_prefixes:
            if not prefix.startswith("/") or len(prefix) > 40:
                raise ConfigError(f"device_prefixes: {prefix!r} must be an absolute path of at most 40 bytes")
        if len(self.prefixes) > 8:
            raise ConfigError("device_prefixes: at most 8 prefixes are supported by the BPF matcher")
        for name in ("scan_interval_s", "full_scan_interval_s", "nvml_interval_s", "ioctl_poll_interval_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be a positive number of seconds, got {getattr(self, name)}")
        for entry in self.system_allowlist:
            if not entry.strip() or ("/" in entry and not entry.startswith("/")):
                raise ConfigError(f"system_allowlist: {entry!r} must be a process name or an absolute "
                                  "executable path")
        for ns in self.system_namespaces:
            if not _DNS_LABEL.fullmatch(ns):
                raise ConfigError(f"system_namespaces: {ns!r} is not a Kubernetes namespace name")
        for place in self.system_containers:
            ns, _, container = place.partition("/")
            if not (_DNS_LABEL.fullmatch(ns) and _DNS_LABEL.fullmatch(container)):
                raise ConfigError(f"system_containers: {place!r} must be NAMESPACE/CONTAINER, e.g. "
                                  "gpu-operator/nvidia-dcgm-exporter")
        if self.grace_s < 0:
            raise ConfigError(f"grace_s: must be >= 0 seconds, got {self.grace_s}")
        if self.bpf not in BPF_MODES:
            raise ConfigError(f"bpf: must be auto, on or off, got {self.bpf!r}")
        if self.remediation not in REMEDIATION_MODES:
            raise ConfigError(f"remediation (--remediation, GHOSTGPU_REMEDIATION): must be on or off, got "
                              f"{self.remediation!r}")
        if not 64 <= self.bpf_max_fds <= 1 << 22:
            raise ConfigError(f"bpf_max_fds: must be between 64 and 4194304, got {self.bpf_max_fds}")
        if not 1 <= self.max_memory_objects <= MAX_MEMORY_OBJECTS:
            raise ConfigError(f"max_memory_objects: must be between 1 and {MAX_MEMORY_OBJECTS}, got "
                              f"{self.max_memory_objects}")
        pages = self.bpf_ringbuf_pages
        if pages <= 0 or pages & (pages - 1):
            raise ConfigError(f"bpf_ringbuf_pages: must be a power of two, got {pages}")
        if self.collector_uid < -1:
            raise ConfigError(f"collector_uid: a uid is 0 or more, got {self.collector_uid}")
        if not 1 <= self.trace_max_sessions <= TRACE_SLOTS:
            raise ConfigError(f"trace_max_sessions: must be 1 to {TRACE_SLOTS}, got "
                              f"{self.trace_max_sessions}")
        if self.trace_max_duration_s <= 0 or self.trace_max_records <= 0:
            raise ConfigError("trace_max_duration_s and trace_max_records: must be positive")
        if not self.node_name:
            raise ConfigError("node_name: empty; set --node-name or GHOSTGPU_NODE_NAME")
        if problem := node_name_problem(self.node_name):
            raise ConfigError(f"node_name: {problem}; set --node-name or GHOSTGPU_NODE_NAME to the "
                              "Kubernetes node's name")
        if self.health_listen:
            try:
                parse_listen(self.health_listen, "--health-listen")
            except ValueError:
                raise ConfigError(f"health_listen (--health-listen, GHOSTGPU_HEALTH_LISTEN): "
                                  f"{self.health_listen!r} is not HOST:PORT; use e.g. 0.0.0.0:9401 (port 0 "
                                  "picks a free one), or leave it empty for no health server") from None


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> TracerConfig:
    """The defaults, then the config file (`path`, else GHOSTGPU_CONFIG), then the GHOSTGPU_*
    environment, then `overrides` (the flags given, in the fields' units; None values are unset).
    ConfigError naming the file or the variable and the key."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    if path:
        values |= read_config_file(os.fspath(path), TracerConfig, "tracer", where=f"--config {path}")
    elif path := env.get("GHOSTGPU_CONFIG"):
        values |= read_config_file(path, TracerConfig, "tracer", where=f"GHOSTGPU_CONFIG {path}")
    values |= environment_values(TracerConfig, env, "GHOSTGPU_")
    values |= {key: value for key, value in (overrides or {}).items() if value is not None}
    return TracerConfig(**values)


def tracer_config(args: argparse.Namespace) -> TracerConfig:
    """The command line's settings: the defaults, then --config FILE (or GHOSTGPU_CONFIG), then the
    GHOSTGPU_* environment, then the flags given (ValueError naming a flag, ConfigError a key)."""
    return load_config(getattr(args, "config", None), overrides=flag_values(TracerConfig, args))
