"""How model values are written for people, one definition each: GPU memory in MiB (NVML's figures in
tables), sizes in binary units (a consumer's memory in a reason), short container IDs.

The tracer writes them into reasons (sentences that travel to the collector and into findings);
the commands write them into table cells and event lines.
"""

from __future__ import annotations

from collections.abc import Iterable

_MIB = 1 << 20

# Container IDs in sentences, as docker ps, crictl and kubectl print them.
SHORT_ID_LEN = 12
# Listings (`ps`, `findings`, `snapshot` tables and the live view's event lines) have always printed
# one character more, and tests/unit/test_client.py pins it for the ps table and the event lines:
# kept so every output stays byte-identical. Make it SHORT_ID_LEN when those outputs may change.
LISTING_ID_LEN = SHORT_ID_LEN + 1


def short_id(container_id: str, length: int = SHORT_ID_LEN) -> str:
    """The ID's first `length` characters ("" stays "")."""
    return container_id[:length]


def mib(nbytes: int | None) -> str:
    """A table cell: "512MiB", "-" when NVML does not say."""
    return "-" if nbytes is None else f"{nbytes / _MIB:.0f}MiB"


def mib_phrase(nbytes: int | None) -> str:
    """Within a sentence: "512 MiB", or "an unknown amount of memory" when NVML does not say."""
    return "an unknown amount of memory" if nbytes is None else f"{nbytes / _MIB:.0f} MiB"


# Binary units, largest first: a size is written in the largest unit it reaches.
_UNITS = ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))
# Marks a memory cell that comes from the driver calls ghostgpu saw, not from NVML; the footnote
# says so under any table that shows one.
DRIVER_CALLS_MARK = "*"
DRIVER_CALLS_FOOTNOTE = f"{DRIVER_CALLS_MARK} from the driver calls ghostgpu saw"


def size_phrase(nbytes: int) -> str:
    """Within a sentence: "3.2 GiB", "512.0 MiB", "4.0 KiB", "100 bytes" (one decimal in any unit,
    so 3.2 GiB is not read as 3 GiB)."""
    for size, unit in _UNITS:
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} bytes"


def memory_cell(nvml_bytes: int | None, allocated_bytes: int | None) -> str:
    """A consumer's memory in a table: NVML's figure where NVML gives one ("512MiB"), else the figure
    from its driver calls, marked ("512MiB*"), else "-" (unknown)."""
    if nvml_bytes is not None:
        return mib(nvml_bytes)
    if allocated_bytes is not None:
        return mib(allocated_bytes) + DRIVER_CALLS_MARK
    return "-"


# ---- the processes a GPU fault hit (collector/alertbook.py's alert texts, cli/faults.py's table) ----


def hit_where(namespace: str, pod: str, container_id: str) -> str:
    """Where a hit process ran: namespace/pod when CRI named it, else "container" and the ID's
    prefix, else "host"."""
    if pod:
        return f"{namespace}/{pod}"
    if container_id:
        return f"container {short_id(container_id, LISTING_ID_LEN)}"
    return "host"


def hit_notes(exited: bool, resolution: str, container_state: str, container_id: str) -> list[str]:
    """What became of a hit process or its container by then ([] when it ran on), as findings say:
    resolution and container_state are its K8sIdentity's (CRI's answer)."""
    notes = ["exited"] if exited else []
    if resolution == "not_found":
        notes.append("container gone")
    elif container_state in ("CONTAINER_EXITED", "CONTAINER_UNKNOWN"):
        notes.append(f"container {container_state.removeprefix('CONTAINER_').lower()}")
    elif resolution == "unresolved" and container_id:
        notes.append("CRI did not answer")
    return notes


def fault_id(boot_id: str, kmsg_seq: int, log_ts_ns: int) -> str:
    """A GPU fault's identity within its node, from the kernel log record it came from: the boot's
    first 8 characters and the record's /dev/kmsg sequence number (unique within a boot), or its kernel
    log time for a line that came without one. The pushed alert's fault_id label."""
    boot = boot_id[:8] or "-"
    return f"{boot}-{kmsg_seq}" if kmsg_seq else f"{boot}-t{log_ts_ns}"


def hit_pods(hits: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (namespace, pod) pairs of the hits CRI named, each once, in hit order."""
    return list(dict.fromkeys((ns, pod) for ns, pod in hits if pod))
