"""Parse the NVIDIA driver's Xid reports (`NVRM: Xid (PCI:...): N, ...`) from kernel log text.

Pure: text in, a typed XidReport out (or None). The driver prints one line per Xid through
`portDbgPrintf` in `krcReportXid` (src/nvidia/src/kernel/gpu/rc/kernel_rc.c in
NVIDIA/open-gpu-kernel-modules; the RM's error paths reach it through `nvErrorLog`). The forms,
and where each was read:

- `pid+name`, `pid=%s, name=%s, <message>`: kernel_rc.c at 535.104.05 (read in a copy of that
  tag) prints both fields always: pid `'<unknown>'` and name `<unknown>` when no channel named the
  process (Xid 119, the GSP RPC timeout, names the current process). At 570.133.20 (commit
  e8113f66, the XID_PRINT_WITH_ATTR macro) only when a process is known: the channel's, or the
  one whose RM call is being served.
- `bare`, `<message>`: kernel_rc.c at 570.133.20 when no process is known: neither field.
- `pid`, `pid=%s, <message>`: closed drivers from before `name=`, seen in their logs and in no open
  tag read here; accepted so that old nodes' lines parse.

The parenthesis is `PCI:%04x:%02x:%02x` (domain, bus, device), followed on a MIG GPU by
` GPU-I:%02u` and ` GPU-CI:%02u` (the GPU and compute instance the Xid is attributed to,
`krcGetMigAttributionForError`; both tags). Very old drivers wrote the address without `PCI:`
(NVIDIA's Xid document shows `NVRM: Xid (0000:03:00): 14, ...`); a function (`.0`) is accepted
though the driver never prints one. The second `%s` at 570.133.20 is Xid 45's (
ROBUST_CHANNEL_PREEMPTIVE_REMOVAL) ` caused by previous Xid %d`, parsed into previous_xid.

The message is free text set by the reporting path, e.g. Xid 13 `Graphics SM Warp Exception on
(GPC 1, TPC 0, SM 0): Out Of Range Address`, Xid 31 `Ch 0000000a, intr 00000000. MMU Fault: ENGINE
GRAPHICS ... faulted @ 0x...`, Xid 79 `GPU has fallen off the bus.`, Xid 119 `Timeout after 6s of
waiting for RPC response from GPU0 GSP! Expected function 76 (GSP_RM_CONTROL) ...` (the driver's
GSP_RPC_TIMEOUT_XID_MESSAGE_FMT), Xid 120 `GSP task exception: ...`, Xid 154 `GPU recovery action
changed from 0x0 (None) to 0x1 (GPU Reset Required)`. It is kept as the driver wrote it; only the
fields above are taken apart.

A name is the process's name as the driver copied it: it may hold spaces (`KMS thread`) and ends
at the first ", ". A name that itself holds ", " is split there (the rest reads as message).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

XID_MARKER = "NVRM: Xid"  # a line holding this is an Xid report: parsed, or kept raw

_HEAD = re.compile(
    r"NVRM: Xid \((?:PCI:)?"
    r"(?P<pci>(?P<domain>[0-9a-fA-F]{4,8}):(?P<bus>[0-9a-fA-F]{2}):(?P<device>[0-9a-fA-F]{2})"
    r"(?:\.(?P<function>[0-7]))?)"
    r"(?: GPU-I:(?P<gi>\d+))?(?: GPU-CI:(?P<ci>\d+))?"
    r"\): (?P<xid>\d+)(?:,(?P<rest>.*))?$",
    re.DOTALL,
)
_PID = re.compile(r" pid=(?P<pid>'<unknown>'|<unknown>|\d+)(?:,|$)")
_NAME = re.compile(r" name=(?P<name>.*?)(?:, |,$|$)", re.DOTALL)
_CAUSE = re.compile(r" caused by previous Xid (?P<xid>\d+)$")
_UNKNOWN = ("'<unknown>'", "<unknown>")


@dataclass(frozen=True, slots=True)
class PciAddress:
    """A PCI address as (domain, bus, device[, function]); compared by value, never by spelling."""

    domain: int
    bus: int
    device: int
    function: int | None = None  # None: the text did not say (the driver's Xid line never does)

    def matches(self, other: PciAddress) -> bool:
        """Same device; functions are compared only when both say one."""
        if (self.domain, self.bus, self.device) != (other.domain, other.bus, other.device):
            return False
        return self.function is None or other.function is None or self.function == other.function

    @property
    def nvml_form(self) -> str:
        """NVML's busId spelling: 8 hex digits of domain, upper case, function 0 when unknown."""
        return f"{self.domain:08X}:{self.bus:02X}:{self.device:02X}.{self.function or 0:X}"


_BUS_ID = re.compile(r"^(?:PCI:)?([0-9a-fA-F]{1,8}):([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})(?:\.([0-7]))?$")


def parse_pci_bus_id(text: str) -> PciAddress | None:
    """"0000:3b:00", "00000000:3B:00.0" (NVML busId), "0000:3B:00.0" (busIdLegacy) -> PciAddress;
    None for anything else (an empty string: NVML did not say)."""
    m = _BUS_ID.match(text.strip())
    if m is None:
        return None
    return PciAddress(int(m[1], 16), int(m[2], 16), int(m[3], 16), None if m[4] is None else int(m[4]))


@dataclass(frozen=True, slots=True)
class XidReport:
    """One parsed Xid line."""

    pci: PciAddress
    pci_bus_id: str  # as the driver wrote it, e.g. "0000:3b:00"
    xid: int
    pid: int | None  # the process the driver named (host PID); None: unknown or not said
    name: str  # its name as the driver wrote it; "" when unknown or not said
    message: str  # the text after the pid/name fields, as written (may be "")
    form: str  # "pid+name" | "pid" | "bare" (the module docstring's table)
    gpu_instance: int | None = None  # MIG attribution (GPU-I), when the driver printed one
    compute_instance: int | None = None  # MIG attribution (GPU-CI)
    previous_xid: int | None = None  # Xid 45's " caused by previous Xid N"


def is_xid_line(text: str) -> bool:
    return XID_MARKER in text


def parse_xid(text: str) -> XidReport | None:
    """The Xid report in one kernel log line, or None when the line is not one the table above
    describes (the caller keeps such a line raw when is_xid_line() says it was meant as one)."""
    start = text.find(XID_MARKER)
    if start < 0:
        return None
    m = _HEAD.match(text[start:].rstrip("\r\n"))
    if m is None:
        return None
    rest = m["rest"] if m["rest"] is not None else ""
    pid: int | None = None
    name = ""
    form = "bare"
    pm = _PID.match(rest)
    if pm is not None:
        form = "pid"
        pid = None if pm["pid"] in _UNKNOWN else int(pm["pid"])
        rest = rest[pm.end():]
        nm = _NAME.match(rest)
        if nm is not None:
            form = "pid+name"
            name = "" if nm["name"] in _UNKNOWN else nm["name"]
            rest = rest[nm.end():]
            if rest and not rest.startswith(" "):
                rest = " " + rest
        elif not rest.startswith(" ") and rest:
            return None  # "pid=12,x" (no space after the comma): not a form the driver writes
    message = rest[1:] if rest.startswith(" ") else rest
    message = message.rstrip()
    cause = _CAUSE.search(message)
    return XidReport(
        pci=PciAddress(int(m["domain"], 16), int(m["bus"], 16), int(m["device"], 16),
                       None if m["function"] is None else int(m["function"])),
        pci_bus_id=m["pci"],
        xid=int(m["xid"]),
        pid=pid,
        name=name,
        message=message,
        form=form,
        gpu_instance=None if m["gi"] is None else int(m["gi"]),
        compute_instance=None if m["ci"] is None else int(m["ci"]),
        previous_xid=int(cause["xid"]) if cause is not None else None,
    )
