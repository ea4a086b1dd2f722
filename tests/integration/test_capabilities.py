"""The real tracer with exactly the DaemonSet's capabilities (tracer/capabilities.NEEDED) works, and
with one of them dropped it says so in one line and loses what the measurement said it would.

Runs as root under setpriv (tests/helpers/capsprobe.py), as a container with `capabilities: {drop:
[ALL], add: NEEDED}` and allowPrivilegeEscalation false would: uid 0, bounding = permitted =
effective = NEEDED, no_new_privs. bench/caps_probe.py is the full measurement.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from ghostgpu.tracer.capabilities import NEEDED, NEEDED_NAMES, Need, dmesg_restricted

from tests.helpers.capsprobe import PlantedHolders, readonly_check, run_case, socket_check
from tests.integration.conftest import require_bpf

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns]

# What each capability's absence must break (bench/results/caps.json, Linux 6.18).
EXPECTED_BREAK: dict[str, str] = {
    "CAP_BPF": "BPF not loaded",
    "CAP_PERFMON": "BPF not loaded",
    "CAP_SYS_PTRACE": "container_root holder not found by the /proc scan",
    "CAP_DAC_READ_SEARCH": "other_uid holder not found by the /proc scan",
    "CAP_CHECKPOINT_RESTORE": "/proc/PID/map_files: failed",
}


@pytest.fixture(scope="module")
def holders(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlantedHolders]:
    require_bpf()
    for tool in ("setpriv", "prlimit", "unshare"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} is needed to run the tracer with fewer capabilities (apt-get install "
                        "util-linux)")
    with PlantedHolders(tmp_path_factory.mktemp("caps")) as planted:
        yield planted


def test_the_needed_set_alone_runs_everything(tmp_path: Path, holders: PlantedHolders) -> None:
    result = run_case(tmp_path, set(NEEDED_NAMES), holders)
    assert result.broken == [], result.to_json()
    assert result.bpf and result.readyz == 200 and result.new_holder_by_bpf
    assert result.found == dict.fromkeys(holders.planted, True)
    assert result.capability_lines == []  # nothing to warn about
    assert socket_check(NEEDED_NAMES, tmp_path) == "ok"  # the CRI and PodResources sockets: root-owned


def test_bpf_maps_need_no_memlock_limit(tmp_path: Path, holders: PlantedHolders) -> None:
    """Linux >= 5.11 charges BPF memory to the memory cgroup: no CAP_SYS_RESOURCE to raise the limit."""
    result = run_case(tmp_path, set(NEEDED_NAMES), holders, memlock_bytes=64 * 1024)
    assert result.broken == [], result.to_json()


def test_read_only_root_filesystem_and_tracefs(holders: PlantedHolders) -> None:
    """The DaemonSet's readOnlyRootFilesystem, its read-only tracefs mount and /tmp emptyDir."""
    ready = json.loads(readonly_check(NEEDED_NAMES))
    assert ready["event"] == "ready" and ready["bpf"] is True


@pytest.mark.parametrize("need", [n for n in NEEDED if n.name in NEEDED_NAMES], ids=lambda n: n.name)
def test_one_dropped_is_named_and_breaks_what_it_covers(tmp_path: Path, holders: PlantedHolders,
                                                         need: Need) -> None:
    if need.dmesg_restricted_only and not dmesg_restricted():
        pytest.skip("kernel.dmesg_restrict is 0: /dev/kmsg needs no capability here (sysctl -w "
                    "kernel.dmesg_restrict=1 to test it)")
    result = run_case(tmp_path, set(NEEDED_NAMES) - {need.name}, holders)
    assert result.started and result.readyz == 200  # never fatal: the tracer runs with what it has
    assert result.capability_lines == [need.line]
    assert any(line.startswith(EXPECTED_BREAK[need.name]) for line in result.broken), result.to_json()
