"""The Linux capabilities the node tracer needs, and one line at start for each one it lacks.

The set is measured, not guessed: bench/caps_probe.py starts the real `ghostgpu tracer` as root
with its bounding set cut (setpriv), first dropping each capability of the full set one at a time,
then running with exactly NEEDED and with NEEDED less one, and records what broke
(bench/results/caps.json; docs/SECURITY.md, "Least privilege"). On Linux 6.18:

- CAP_BPF: without it creating the BPF maps is refused (bcc: "could not open bpf map: trace_events,
  error: Operation not permitted"); the tracer falls back to /proc scans.
- CAP_PERFMON: without it loading the tracepoint programs is refused (bcc: "Failed to load program:
  Operation not permitted": tracing programs need it, and it is what perf_event_open's tracepoint
  attach checks with perf_event_paranoid > -1); same fallback.
- CAP_SYS_PTRACE: without it readlink(/proc/PID/fd/N) and /proc/PID/exe fail for processes of other
  uids and for root processes holding capabilities the tracer lacks (the kernel's ptrace access
  check): GPU holders that predate the tracer go unseen by the /proc scan.
- CAP_DAC_READ_SEARCH: /proc/PID/fd is mode 0500, owned by the process's uid: without it the tracer
  (uid 0) cannot list the fds of a process running as another user.
- CAP_CHECKPOINT_RESTORE: /proc/PID/map_files/* (the device number of a GPU mapping whose fd was
  closed) needs it; without it a mapping-only hold is matched by its path alone.
- CAP_SYSLOG, only with --bpf off: opening /dev/kmsg for reading with kernel.dmesg_restrict=1
  (Debian's default; kernel/printk/printk.c check_syslog_permissions, which also accepts
  CAP_SYS_ADMIN) needs it; without it the driver's Xid reports are not read (tracer/kmsg.py). With
  dmesg_restrict=0 nothing is needed. While BPF runs the Xid lines come from the printk:console
  tracepoint (bpf/printk.bpf.c), which CAP_BPF and CAP_PERFMON cover: the DaemonSet (no /dev/kmsg
  in its container anyway) grants the five others only.

Optional: CAP_KILL, for remediation only (tracer/remediate.py, docs/REMEDIATION.md). Without it the
kernel's kill permission check (kernel/signal.c kill_ok_by_cred) lets the tracer (uid 0) signal only
processes of uid 0: a holder of another uid is answered `failed` ("the tracer lacks CAP_KILL"), and
orphans are reported but not signalled. It is not in NEEDED: nothing of the tracer's watching needs
it, and a node that never remediates (`--remediation off`) should not hold it. The DaemonSet adds it
to the tracer container's securityContext.capabilities.add where remediation is wanted.

Not needed on Linux >= 5.11: CAP_SYS_ADMIN (tracefs is mounted by the host and readable by uid 0;
CAP_BPF+CAP_PERFMON cover BPF), CAP_SYS_RESOURCE and CAP_IPC_LOCK (BPF memory is charged to the
memory cgroup, not RLIMIT_MEMLOCK: the tracer starts with a 64 KiB memlock limit), CAP_DAC_OVERRIDE
(the CRI and PodResources sockets and tracefs are owned by root, which the tracer runs as).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# Bit n of CapEff is CAP_NAMES[n] (include/uapi/linux/capability.h; 40 is the last one in Linux 6.18).
CAP_NAMES: tuple[str, ...] = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE", "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO", "CAP_SYS_CHROOT", "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT",
    "CAP_SYS_NICE", "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
    "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE", "CAP_MAC_ADMIN", "CAP_SYSLOG",
    "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ", "CAP_PERFMON", "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
)
CAP_BITS: dict[str, int] = {name: bit for bit, name in enumerate(CAP_NAMES)}


@dataclass(frozen=True)
class Need:
    """One capability the tracer needs: what for (the manifest's comment) and what fails without it."""

    name: str
    why: str
    without: str
    covered_by: tuple[str, ...] = ()  # broader capabilities that grant the same (the kernel's own checks)
    bpf_only: bool = False  # irrelevant with --bpf off
    no_bpf_only: bool = False  # needed only with --bpf off: the kernel side does the same without it
    dmesg_restricted_only: bool = False  # irrelevant when kernel.dmesg_restrict is 0

    @property
    def line(self) -> str:
        return f"{self.name} missing: {self.without}"


_FALLBACK = "the tracer runs on /proc scans only (short-lived holders and ioctl counts go unseen)"
NEEDED: tuple[Need, ...] = (
    Need("CAP_BPF", "create the BPF maps and load the programs (bpf())",
         f"the kernel refuses to create the BPF maps; {_FALLBACK}",
         covered_by=("CAP_SYS_ADMIN",), bpf_only=True),
    Need("CAP_PERFMON", "load tracing programs and attach them to tracepoints (perf_event_open)",
         f"the kernel refuses to load the tracepoint programs; {_FALLBACK}",
         covered_by=("CAP_SYS_ADMIN",), bpf_only=True),
    Need("CAP_SYS_PTRACE", "readlink /proc/PID/fd/N and /proc/PID/exe of every process (ptrace access check)",
         "/proc/PID/fd of processes of other users, or holding capabilities the tracer lacks (containers "
         "running as root), cannot be read; their GPU holds from before the tracer started go unseen"),
    Need("CAP_DAC_READ_SEARCH", "list /proc/PID/fd (mode 0500) of processes of other uids",
         "/proc/PID/fd of processes running as another user cannot be listed; their GPU holds from before "
         "the tracer started go unseen", covered_by=("CAP_DAC_OVERRIDE",)),
    Need("CAP_CHECKPOINT_RESTORE", "stat /proc/PID/map_files/* for the device number of a mapped GPU",
         "/proc/PID/map_files cannot be read: a GPU mapping whose fd was closed is matched by its path "
         "only, not by its device number (a renamed device node is missed or misattributed)",
         covered_by=("CAP_SYS_ADMIN",)),
    Need("CAP_SYSLOG", "read the kernel log (/dev/kmsg) for the driver's Xid reports (dmesg_restrict=1, "
         "--bpf off)",
         "Xid faults are not read from the kernel log (/dev/kmsg is refused with kernel.dmesg_restrict=1)",
         covered_by=("CAP_SYS_ADMIN",), dmesg_restricted_only=True, no_bpf_only=True),
)
# What the tracer needs with BPF on, as the DaemonSet runs it: its capabilities, exactly.
NEEDED_NAMES: tuple[str, ...] = tuple(n.name for n in NEEDED if not n.no_bpf_only)


def mask_of(names: Iterable[str]) -> int:
    """A capability bit mask; ValueError naming an unknown capability."""
    mask = 0
    for name in names:
        key = name.upper() if name.upper().startswith("CAP_") else f"CAP_{name.upper()}"
        if key not in CAP_BITS:
            raise ValueError(f"unknown capability {name!r}; use a name such as CAP_BPF (capabilities(7))")
        mask |= 1 << CAP_BITS[key]
    return mask


def names_of(mask: int) -> list[str]:
    """The capability names set in mask, by bit order (bits past CAP_NAMES as CAP_<bit>)."""
    return [CAP_NAMES[bit] if bit < len(CAP_NAMES) else f"CAP_{bit}"
            for bit in range(mask.bit_length()) if mask >> bit & 1]


def effective_mask(status_text: str) -> int | None:
    """CapEff of a /proc/PID/status text; None when the line is absent."""
    for line in status_text.splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return None


def missing(mask: int, bpf: bool = True, dmesg_restricted: bool = True) -> list[Need]:
    """The needs not met by mask: neither the capability nor a broader one that covers it."""
    out = []
    for need in NEEDED:
        if (need.bpf_only and not bpf) or (need.no_bpf_only and bpf) or \
                (need.dmesg_restricted_only and not dmesg_restricted):
            continue
        if mask & mask_of((need.name, *need.covered_by)):
            continue
        out.append(need)
    return out


def dmesg_restricted(path: str = "/proc/sys/kernel/dmesg_restrict") -> bool:
    """kernel.dmesg_restrict is set (or cannot be read: then assume it is, as Debian ships it)."""
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip() != "0"
    except (OSError, ValueError):
        return True


def check_capabilities(bpf: bool = True, status_path: str = "/proc/self/status",
                       dmesg_restrict_path: str = "/proc/sys/kernel/dmesg_restrict") -> list[str]:
    """One line per capability this process lacks, naming it and what fails without it; [] when the
    status file or its CapEff line cannot be read (not Linux: nothing to say)."""
    try:
        with open(status_path, encoding="ascii", errors="replace") as f:
            mask = effective_mask(f.read())
    except OSError:
        return []
    if mask is None:
        return []
    return [need.line for need in missing(mask, bpf, dmesg_restricted(dmesg_restrict_path))]


def has_effective(name: str, status_path: str = "/proc/self/status") -> bool | None:
    """Whether this process's effective set holds capability `name` (e.g. CAP_KILL); None when the
    status file or its CapEff line cannot be read (not Linux)."""
    try:
        with open(status_path, encoding="ascii", errors="replace") as f:
            mask = effective_mask(f.read())
    except OSError:
        return None
    return None if mask is None else bool(mask & mask_of((name,)))
