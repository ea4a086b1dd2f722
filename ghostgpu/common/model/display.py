"""How model values are written for people, one definition each: GPU memory in MiB, short container IDs.

The tracer writes them into reasons (sentences that travel to the collector and into findings);
the commands write them into table cells and event lines.
"""

from __future__ import annotations

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
