"""The planted orphan (tests/helpers/orphan_plant.py) against a real containerd: after StopContainer
the holder lives on, holds /dev/nvidia0, CRI says the container EXITED (NOT_FOUND once removed), and
the tracer's cgroup parser still reads that container's id from the holder's cgroup."""

from __future__ import annotations

import os

import pytest
from ghostgpu.tracer.cgroup import parse_proc_cgroup

from ghostgpu.k8s import cri_runtime_v1_pb2 as cri
from tests.helpers.containerd import Containerd
from tests.helpers.orphan_plant import planted_orphan

pytestmark = [pytest.mark.root, pytest.mark.containerd]


def test_the_holder_outlives_its_stopped_container(containerd: Containerd) -> None:
    with planted_orphan(containerd, "orphan-exited") as orphan:
        assert orphan.cri_state() == "CONTAINER_EXITED"
        assert orphan.alive() and orphan.holds("/dev/nvidia0")
        assert not os.path.exists(f"/proc/{orphan.init_pid}")  # the container's own init is gone
        ident = parse_proc_cgroup(orphan.proc_cgroup())
        assert (ident.runtime, ident.container_id, ident.pod_uid) == (
            "containerd", orphan.container_id, orphan.pod.uid)
        # Its parent now is the pod's pause process: outside the stopped container, still in the pod.
        with open(f"/proc/{orphan.pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        assert ppid != orphan.init_pid
        leaves = list(orphan.cgroup_leaves)
        assert leaves and all(d.endswith(orphan.cgroup_path) for d in leaves)
    # Cleaned up: the holder, its escape cgroups with the levels above them, and the pod.
    assert not orphan.alive()
    assert not any(os.path.exists(d) for d in leaves)
    assert not any(os.path.exists(d.removesuffix(orphan.cgroup_path) + "/ghostgpu-orphans") for d in leaves)
    pods = containerd.runtime.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=30).items
    assert orphan.pod.id not in {p.id for p in pods}


def test_the_holder_outlives_its_removed_container(containerd: Containerd) -> None:
    with planted_orphan(containerd, "orphan-removed", remove=True) as orphan:
        assert orphan.cri_state() == "NOT_FOUND"
        assert orphan.holds()
        assert parse_proc_cgroup(orphan.proc_cgroup()).container_id == orphan.container_id
