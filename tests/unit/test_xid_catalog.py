"""tracer/xid_catalog.py: meanings and severities from NVIDIA's Xid catalogue."""

from __future__ import annotations

import pytest
from ghostgpu.tracer.xid_catalog import CATALOG, CRITICAL_XIDS, Severity, describe, severity_of

# The Xids an operator must act on (reset, reboot, service): the shipped alert rules name these.
MUST_BE_CRITICAL = (48, 62, 63, 64, 74, 79, 92, 93, 94, 95, 119, 120)


@pytest.mark.parametrize("xid", MUST_BE_CRITICAL)
def test_hardware_xids_are_critical_and_say_why(xid: int) -> None:
    info = describe(xid)
    assert info.severity is Severity.CRITICAL and xid in CRITICAL_XIDS
    assert info.meaning and len(info.why) > 20


@pytest.mark.parametrize(("xid", "severity", "meaning"), [
    (13, Severity.WARNING, "Graphics Engine Exception"),  # the job's own fault: restart it
    (31, Severity.WARNING, "GPU memory page fault"),
    (43, Severity.WARNING, "GPU stopped processing"),
    (45, Severity.INFO, "Preemptive cleanup, due to previous errors"),
    (79, Severity.CRITICAL, "GPU has fallen off the bus"),
])
def test_entries(xid: int, severity: Severity, meaning: str) -> None:
    assert describe(xid).severity is severity and describe(xid).meaning == meaning


def test_unknown_xid_and_unparsed_line() -> None:
    assert describe(99999).severity is Severity.UNKNOWN and describe(99999).meaning == ""
    assert describe(None).severity is Severity.UNKNOWN
    assert str(Severity.UNKNOWN) == "unknown"


def test_xid_154_severity_follows_the_action_it_states() -> None:
    assert severity_of(154, "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)") \
        is Severity.CRITICAL
    assert severity_of(154, "GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)") \
        is Severity.INFO
    assert severity_of(13, "anything") is Severity.WARNING


def test_only_critical_entries_carry_a_why() -> None:
    for xid, info in CATALOG.items():
        assert info.xid == xid and info.meaning
        assert bool(info.why) == (info.severity is Severity.CRITICAL), xid
