"""tracer/capabilities.py: which needs a capability set meets, and the one line per missing one
(the real tracer's behaviour with each dropped is tests/integration/test_capabilities.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from ghostgpu.tracer.capabilities import (
    CAP_BITS,
    CAP_NAMES,
    NEEDED,
    NEEDED_NAMES,
    check_capabilities,
    dmesg_restricted,
    effective_mask,
    mask_of,
    missing,
    names_of,
)

ALL = (1 << len(CAP_NAMES)) - 1


def status(mask: int) -> str:
    return f"Name:\tghostgpu\nCapInh:\t0000000000000000\nCapEff:\t{mask:016x}\nCapBnd:\t{ALL:016x}\n"


def test_bits_follow_linux_capability_h() -> None:
    bits = [CAP_BITS[n] for n in ("CAP_DAC_READ_SEARCH", "CAP_SYS_PTRACE", "CAP_SYS_ADMIN", "CAP_PERFMON",
                                  "CAP_BPF", "CAP_CHECKPOINT_RESTORE")]
    assert bits == [2, 19, 21, 38, 39, 40]
    assert names_of(mask_of(["bpf", "CAP_PERFMON"])) == ["CAP_PERFMON", "CAP_BPF"]
    assert names_of(1 << 45) == ["CAP_45"]  # a newer kernel's capability
    with pytest.raises(ValueError, match="unknown capability 'CAP_FLY'"):
        mask_of(["CAP_FLY"])


@pytest.mark.parametrize(("caps", "bpf", "missing_names"), [
    (NEEDED_NAMES, True, []),
    ((), True, list(NEEDED_NAMES)),
    # --bpf off
    ((), False, ["CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH", "CAP_CHECKPOINT_RESTORE", "CAP_SYSLOG"]),
    # CAP_SYS_ADMIN is what the kernel also accepts for BPF, PERFMON and map_files, DAC_OVERRIDE
    # for DAC_READ_SEARCH: a privileged container hears nothing.
    (("CAP_SYS_ADMIN", "CAP_SYS_PTRACE", "CAP_DAC_OVERRIDE"), True, []),
    ([n for n in NEEDED_NAMES if n != "CAP_SYS_PTRACE"], True, ["CAP_SYS_PTRACE"]),
    (("CAP_BPF", "CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH", "CAP_CHECKPOINT_RESTORE", "CAP_SYSLOG"), True,
     ["CAP_PERFMON"]),
])
def test_missing_needs(caps: tuple[str, ...], bpf: bool, missing_names: list[str]) -> None:
    assert [n.name for n in missing(mask_of(caps), bpf)] == missing_names


def test_check_capabilities_reads_cap_eff_and_says_one_line_each(tmp_path: Path) -> None:
    path = tmp_path / "status"
    path.write_text(status(mask_of(n for n in NEEDED_NAMES if n not in ("CAP_BPF", "CAP_SYS_PTRACE"))))
    lines = check_capabilities(status_path=str(path))
    assert lines == [n.line for n in NEEDED if n.name in ("CAP_BPF", "CAP_SYS_PTRACE")]
    assert lines[0].startswith("CAP_BPF missing: ") and all("\n" not in line for line in lines)
    assert "other users" in lines[1]
    path.write_text(status(ALL))
    assert check_capabilities(status_path=str(path)) == []
    assert check_capabilities(status_path=str(tmp_path / "absent")) == []  # not Linux: nothing to say
    assert effective_mask("Name:\tx\n") is None


def test_every_need_says_what_for_and_what_fails() -> None:
    for need in NEEDED:
        assert need.name in CAP_BITS and need.why and need.without
        assert all(c in CAP_BITS for c in need.covered_by)


def test_syslog_is_needed_only_while_dmesg_is_restricted(tmp_path: Path) -> None:
    """kernel/printk/printk.c check_syslog_permissions asks for CAP_SYSLOG only with dmesg_restrict=1."""
    assert [n.name for n in missing(0, False, dmesg_restricted=False)] == \
        ["CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH", "CAP_CHECKPOINT_RESTORE"]
    # CAP_SYS_ADMIN counts for CAP_SYSLOG (with a warning in the kernel log)
    admin_only = missing(mask_of(["CAP_SYS_ADMIN"]), False)
    assert [n.name for n in admin_only] == ["CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH"]
    status_path, restrict = tmp_path / "status", tmp_path / "dmesg_restrict"
    status_path.write_text(status(mask_of(n for n in NEEDED_NAMES if n != "CAP_SYSLOG")))
    restrict.write_text("0\n")
    assert check_capabilities(False, status_path=str(status_path), dmesg_restrict_path=str(restrict)) == []
    restrict.write_text("1\n")
    lines = check_capabilities(False, status_path=str(status_path), dmesg_restrict_path=str(restrict))
    assert len(lines) == 1 and lines[0].startswith("CAP_SYSLOG missing: Xid faults are not read")
    # With BPF the Xid lines come from the printk tracepoint (bpf/printk.bpf.c): no CAP_SYSLOG asked.
    assert check_capabilities(True, status_path=str(status_path), dmesg_restrict_path=str(restrict)) == []
    assert "CAP_SYSLOG" not in NEEDED_NAMES  # the DaemonSet's set: BPF on
    assert dmesg_restricted(str(tmp_path / "absent"))  # unreadable: assume Debian's default
