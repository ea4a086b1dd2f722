"""What an Xid means and how bad it is, from NVIDIA's public Xid catalogue.

Meanings are the catalogue's short descriptions ("Analyzing Xid Errors with the Xid Catalog",
docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, the table for Ampere and newer; the
older per-cause table at docs.nvidia.com/deploy/xid-errors/ for the rest). The catalogue gives each
Xid a "Resolution Bucket (Immediate Action)": RESTART_APP, RESET_GPU, RESTART_BM (reboot the node),
CONTACT_SUPPORT, IGNORE, ... ghostgpu's severity follows from that, for the pods that held the GPU:

- critical: the GPU itself is suspect until it is reset, the node rebooted or the board serviced
  (an uncorrectable memory error, a lost bus, a hung firmware, a failed link): every job on that
  GPU is hit or will be, and the next one scheduled there may be too;
- warning: the job whose channel faulted was stopped (an illegal address, an engine exception, a
  timeout): restart that job; the GPU stays usable;
- info: a consequence of an earlier Xid or of the job stopping (cleanup), nothing to act on alone;
- unknown: an Xid this table does not hold (a newer driver's): reported by number, never guessed.

Each critical entry says why (`why`). Xid 154 states the recovery action in its message: "to 0x0
(None)" is info, any other action critical (severity_of()).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Severity(StrEnum):
    CRITICAL = "critical"
    WARNING = "warning"
    INFO = "info"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class XidInfo:
    xid: int | None
    meaning: str
    severity: Severity
    why: str = ""  # for a critical Xid: what makes the GPU suspect


def _c(meaning: str, why: str) -> tuple[str, Severity, str]:
    return meaning, Severity.CRITICAL, why


_W, _I = Severity.WARNING, Severity.INFO
_TABLE: dict[int, tuple[str, Severity, str]] = {
    8: ("GPU stopped processing", _W, ""),
    13: ("Graphics Engine Exception", _W, ""),
    31: ("GPU memory page fault", _W, ""),
    32: ("Invalid or corrupted push buffer stream", _W, ""),
    43: ("GPU stopped processing", _W, ""),
    45: ("Preemptive cleanup, due to previous errors", _I, ""),
    48: _c("Double Bit ECC Error",
           "an uncorrectable memory error: the data of every job using that memory is lost; the GPU "
           "needs a reset (or the node a reboot) before the bad memory is retired"),
    61: ("Internal micro-controller breakpoint/warning", _W, ""),
    62: _c("Internal micro-controller halt",
           "the GPU's power-management micro-controller stopped: the GPU needs a reset"),
    63: _c("ECC page retirement or row remapping recording event",
           "a memory row went bad and is marked for remapping, which takes effect only after a GPU "
           "reset: until then the GPU runs with the bad row offlined"),
    64: _c("ECC page retirement or row remapper recording failure",
           "a bad memory row could not be retired or remapped: the GPU keeps faulting memory and needs "
           "a reset, then service if it repeats"),
    68: ("Video processor exception", _W, ""),
    69: ("Graphics Engine class error", _W, ""),
    74: _c("NVLink Error",
           "an NVLink connection to another GPU or NVSwitch failed: jobs spanning the link fail and the "
           "GPU needs a reset (the fault may sit at the link's other end)"),
    79: _c("GPU has fallen off the bus",
           "the driver can no longer reach the GPU over PCIe: every job on it is lost; the node needs a "
           "reboot and its power and PCIe seating a check"),
    92: _c("High single-bit ECC error rate",
           "corrected memory errors arrive faster than expected: the memory is failing, the usual "
           "precursor of uncorrectable errors (48, 94, 95)"),
    93: _c("Non-fatal violation of provisioned InfoROM wear limit",
           "the board's InfoROM has been written past its wear limit: its error and retirement records "
           "may stop being kept, so the board needs service"),
    94: _c("Contained ECC error",
           "an uncorrectable memory error that the GPU contained: the job that touched it was stopped, "
           "and the bad row stays offlined until a GPU reset remaps it"),
    95: _c("Uncontained ECC error",
           "an uncorrectable memory error that could not be contained: every job on the GPU is "
           "affected and the GPU needs a reset"),
    109: ("Context Switch Timeout Error", _W, ""),
    119: _c("GSP RPC Timeout",
            "the GPU System Processor firmware stopped answering the driver: the GPU needs a reset "
            "(often a reboot)"),
    120: _c("GSP Error",
            "the GPU System Processor firmware faulted: the GPU needs a reset"),
    140: _c("Unrecovered ECC Error",
            "an uncorrectable memory error that was not recovered: the GPU needs a reset"),
    143: _c("GPU Initialization Failure",
            "the GPU failed to initialize: it serves no job until it is reset or serviced"),
    154: _c("GPU Recovery Action Changed",
            "the driver states the recovery the GPU now needs (a reset, a node reboot, a drain)"),
}
CATALOG: dict[int, XidInfo] = {xid: XidInfo(xid, *row) for xid, row in _TABLE.items()}
CRITICAL_XIDS: frozenset[int] = frozenset(x for x, i in CATALOG.items() if i.severity is Severity.CRITICAL)


def describe(xid: int | None) -> XidInfo:
    """The catalogue's entry; an Xid it does not hold (or None: a line that did not parse) is
    severity unknown with no meaning."""
    if xid is None:
        return XidInfo(None, "", Severity.UNKNOWN)
    return CATALOG.get(xid) or XidInfo(xid, "", Severity.UNKNOWN)


def severity_of(xid: int | None, message: str = "") -> Severity:
    """The severity of one report: the catalogue's, except that Xid 154 whose recovery action went
    back to "0x0 (None)" (the GPU needs nothing any more) is info."""
    if xid == 154 and " to 0x0 (None)" in message:
        return Severity.INFO
    return describe(xid).severity
