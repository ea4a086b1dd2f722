"""What changed between two classifications of a node: the consumers to report as `finding` (new,
or changed in a way a reader cares about) and as `resolved` (gone).

Reasons carry numbers that move between refreshes (ages, MiB, fds); they are masked, so an age
ticking up is not a change, while the fields that matter (class, devices, memory, ...) are compared.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ghostgpu.common.model.consumers import Consumer, ConsumerKey, consumer_order

_NUMBERS = re.compile(r"\d+(?:[.,]\d+)*")  # "12.3", "5,6,7" (an fd list) each mask to one "#"


def _signature(c: Consumer) -> tuple[object, ...]:
    # The reason with its numbers masked: "pending for 0.4 s" and "for 1.2 s" are the same finding,
    # "zombie" and "reparented" are not. Numbers that matter are compared as fields. The comm is
    # one: a holder that renames itself (busybox applets, worker pools) is shown, and alerted on,
    # by its current name.
    reason_shape = _NUMBERS.sub("#", c.reason)
    return (c.cls, reason_shape, tuple(c.devices), c.gpu_memory_bytes, c.allocated_bytes, c.allocated_reason,
            c.container_id, c.mapped, c.alive, c.comm)


def diff_consumers(old: Mapping[ConsumerKey, Consumer], new: list[Consumer],
                   ) -> tuple[list[Consumer], list[Consumer]]:
    """(opened or changed, resolved) between the last consumers by key and a new classification."""
    new_keys = {c.key for c in new}
    changed = [c for c in new if c.key not in old or _signature(old[c.key]) != _signature(c)]
    resolved = [c for key, c in old.items() if key not in new_keys]
    resolved.sort(key=consumer_order)
    return changed, resolved
