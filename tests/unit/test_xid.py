"""tracer/xid.py: every form of the driver's Xid line (krcReportXid in
src/nvidia/src/kernel/gpu/rc/kernel_rc.c of NVIDIA/open-gpu-kernel-modules), and PCI addresses
compared by number."""

from __future__ import annotations

import pytest
from ghostgpu.tracer.xid import PciAddress, XidReport, is_xid_line, parse_pci_bus_id, parse_xid

A3B = PciAddress(0, 0x3B, 0)

# (id, line, expected report): one row per form and per extended message the module docstring names.
PARSED: list[tuple[str, str, XidReport]] = [
    # 535.104.05 .. 550.x: pid and name always printed
    ("pid+name", "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python3, GPU has fallen off the bus.",
     XidReport(A3B, "0000:3b:00", 79, 4242, "python3", "GPU has fallen off the bus.", "pid+name")),
    # 535.104.05: no channel named the process
    ("pid+name unknown",
     "NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on "
     "(GPC 7, TPC 1, SM 0): Out Of Range Address",
     XidReport(PciAddress(0, 0xCB, 0), "0000:cb:00", 13, None, "",
               "Graphics SM Warp Exception on (GPC 7, TPC 1, SM 0): Out Of Range Address", "pid+name")),
    # the MMU fault text of Xid 31 holds commas and dots of its own
    ("xid 31 mmu fault",
     "NVRM: Xid (PCI:0000:00:06): 31, pid=79749, name=exe, Ch 0000000a, intr 00000000. MMU Fault: ENGINE "
     "GRAPHICS GPC2 GPCCLIENT_T1_7 faulted @ 0x2b57_b3000000. Fault is of type FAULT_PDE "
     "ACCESS_TYPE_VIRT_WRITE",
     XidReport(PciAddress(0, 0, 6), "0000:00:06", 31, 79749, "exe",
               "Ch 0000000a, intr 00000000. MMU Fault: ENGINE GRAPHICS GPC2 GPCCLIENT_T1_7 faulted @ "
               "0x2b57_b3000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_WRITE", "pid+name")),
    # 570.133.20 on: no process known -> neither field
    ("bare xid 154",
     "NVRM: Xid (PCI:0000:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 "
     "(GPU Reset Required)",
     XidReport(PciAddress(0, 1, 0), "0000:01:00", 154, None, "",
               "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)", "bare")),
    ("bare xid 79", "NVRM: Xid (PCI:0000:23:00): 79, GPU has fallen off the bus.",
     XidReport(PciAddress(0, 0x23, 0), "0000:23:00", 79, None, "", "GPU has fallen off the bus.", "bare")),
    # GSP RPC timeout: the driver names the current process; its name may hold spaces and brackets
    ("xid 119 gsp",
     "NVRM: Xid (PCI:0002:00:00): 119, pid=1582259, name=nvc:[driver], Timeout after 6s of waiting for RPC "
     "response from GPU1 GSP! Expected function 76 (GSP_RM_CONTROL) (0x20802a02 0x8).",
     XidReport(PciAddress(2, 0, 0), "0002:00:00", 119, 1582259, "nvc:[driver]",
               "Timeout after 6s of waiting for RPC response from GPU1 GSP! Expected function 76 "
               "(GSP_RM_CONTROL) (0x20802a02 0x8).", "pid+name")),
    ("xid 120 gsp, name with a space",
     "NVRM: Xid (PCI:000f:01:00): 120, pid=9111, name=KMS thread, GSP task exception: load access fault",
     XidReport(PciAddress(0xF, 1, 0), "000f:01:00", 120, 9111, "KMS thread",
               "GSP task exception: load access fault", "pid+name")),
    # closed drivers before name= (their logs): pid only
    ("pid only", "NVRM: Xid (PCI:0000:01:00): 79, pid=1122, GPU has fallen off the bus.",
     XidReport(PciAddress(0, 1, 0), "0000:01:00", 79, 1122, "", "GPU has fallen off the bus.", "pid")),
    ("pid only, no message", "NVRM: Xid (PCI:0000:01:00): 79, pid=1122",
     XidReport(PciAddress(0, 1, 0), "0000:01:00", 79, 1122, "", "", "pid")),
    # MIG attribution: GPU instance, and GPU and compute instance
    ("mig gi",
     "NVRM: Xid (PCI:0000:b5:00 GPU-I:03): 31, pid=17, name=train, Ch 00000008, intr 10000000. MMU Fault",
     XidReport(PciAddress(0, 0xB5, 0), "0000:b5:00", 31, 17, "train", "Ch 00000008, intr 10000000. MMU Fault",
               "pid+name", gpu_instance=3)),
    ("mig gi ci", "NVRM: Xid (PCI:0000:b5:00 GPU-I:01 GPU-CI:00): 43, pid=17, name=train, channel 0x00000002",
     XidReport(PciAddress(0, 0xB5, 0), "0000:b5:00", 43, 17, "train", "channel 0x00000002", "pid+name",
               gpu_instance=1, compute_instance=0)),
    # 570.133.20 on: Xid 45 names the Xid that caused the cleanup
    ("xid 45 root cause",
     "NVRM: Xid (PCI:0000:3b:00): 45, pid=8, name=a, Ch 00000001 caused by previous Xid 79",
     XidReport(A3B, "0000:3b:00", 45, 8, "a", "Ch 00000001 caused by previous Xid 79", "pid+name",
               previous_xid=79)),
    # pMsg NULL: the line ends after the name field
    ("empty message", "NVRM: Xid (PCI:0000:3b:00): 62, pid=8, name=a, ",
     XidReport(A3B, "0000:3b:00", 62, 8, "a", "", "pid+name")),
    ("no message at all", "NVRM: Xid (PCI:0000:3b:00): 48",
     XidReport(A3B, "0000:3b:00", 48, None, "", "", "bare")),
    # very old drivers: no PCI: prefix
    ("no PCI prefix", "NVRM: Xid (0000:03:00): 14, Channel 00000001",
     XidReport(PciAddress(0, 3, 0), "0000:03:00", 14, None, "", "Channel 00000001", "bare")),
    # as journald or dmesg show it, with a prefix before the marker, and a trailing newline
    ("prefixed",
     "kernel: [16450076.435595] NVRM: Xid (PCI:0000:3b:00): 94, pid=7, name=p, Contained ECC error.\n",
     XidReport(A3B, "0000:3b:00", 94, 7, "p", "Contained ECC error.", "pid+name")),
]


@pytest.mark.parametrize(("line", "expected"), [(line, exp) for _, line, exp in PARSED],
                         ids=[i for i, _, _ in PARSED])
def test_every_driver_form_parses(line: str, expected: XidReport) -> None:
    assert is_xid_line(line)
    assert parse_xid(line) == expected


@pytest.mark.parametrize("line", [
    "NVRM: Xid (PCI:0000:66:00): abc, pid=2280636",  # no number
    "NVRM: Xid : 32, pid=2280636",  # no address
    "NVRM: Xid (PCI:0000:66:00): 32, pid=12,x",  # a pid field the driver never writes
    "NVRM: Xid (PCI:zz:66:00): 32, Ch 1",
    "NVRM: Xid (PCI:0000:3b:00)",  # cut short
])
def test_xid_lines_that_do_not_parse(line: str) -> None:
    assert is_xid_line(line) and parse_xid(line) is None


def test_other_lines_are_not_xid_lines() -> None:
    for line in ("NVRM: GPU 0000:01:00.0: GPU has fallen off the bus.", "eth0: link up", ""):
        assert not is_xid_line(line) and parse_xid(line) is None


@pytest.mark.parametrize(("text", "expected"), [
    ("0000:3b:00", PciAddress(0, 0x3B, 0)),  # the driver's Xid line
    ("00000000:3B:00.0", PciAddress(0, 0x3B, 0, 0)),  # NVML busId
    ("0000:3B:00.0", PciAddress(0, 0x3B, 0, 0)),  # NVML busIdLegacy
    ("PCI:0001:17:02.1", PciAddress(1, 0x17, 2, 1)),
    ("", None),
    ("3b:00.0", None),
    ("0000:3b:00.9", None),
])
def test_parse_pci_bus_id(text: str, expected: PciAddress | None) -> None:
    assert parse_pci_bus_id(text) == expected


def test_addresses_match_by_number_and_function_only_when_both_say() -> None:
    nvml = parse_pci_bus_id("00000000:3B:00.0")
    driver = parse_pci_bus_id("0000:3b:00")
    assert nvml is not None and driver is not None
    assert driver.matches(nvml) and nvml.matches(driver)
    assert not PciAddress(0, 0x3B, 0, 1).matches(nvml)  # another function of the same device
    assert not PciAddress(1, 0x3B, 0).matches(nvml)  # another domain
    assert not PciAddress(0, 0x3C, 0).matches(nvml)
    assert driver.nvml_form == "00000000:3B:00.0"
