"""The tracer's system allowlist settings: names or executable paths, and the places (Kubernetes
namespaces, NAMESPACE/CONTAINER) where else allowlisted daemons count as system."""

from __future__ import annotations

from pathlib import Path

import pytest
from ghostgpu.tracer.agent import Tracer
from ghostgpu.tracer.config import DEFAULT_SYSTEM_ALLOWLIST, ConfigError, TracerConfig, load_config
from ghostgpu.tracer.sinks import CallbackSink

# (key, value, the error's words; None: accepted)
CASES = [
    ("system_allowlist", ["nv-hostengine", "/usr/bin/dcgm-exporter"], None),
    ("system_allowlist", ["bin/nv-hostengine"], "must be a process name or an absolute executable path"),
    ("system_allowlist", ["  "], "must be a process name"),
    ("system_namespaces", ["gpu-operator", "kube-system"], None),
    ("system_namespaces", ["GPU_Operator"], "is not a Kubernetes namespace name"),
    ("system_namespaces", ["gpu-operator/dcgm"], "is not a Kubernetes namespace name"),
    ("system_containers", ["gpu-operator/nvidia-dcgm-exporter"], None),
    ("system_containers", ["nvidia-dcgm-exporter"], "must be NAMESPACE/CONTAINER"),
    ("system_containers", ["gpu-operator/"], "must be NAMESPACE/CONTAINER"),
    ("system_containers", ["a/b/c"], "must be NAMESPACE/CONTAINER"),
]


@pytest.mark.parametrize(("key", "value", "error"), CASES)
def test_system_settings_are_checked(key: str, value: list[str], error: str | None) -> None:
    if error is None:
        assert getattr(TracerConfig(node_name="n", **{key: value}), key) == value
        return
    with pytest.raises(ConfigError, match=f"^{key}: .*{error}"):
        TracerConfig(node_name="n", **{key: value})


def test_defaults_are_the_host_only() -> None:
    cfg = TracerConfig(node_name="n")
    assert (cfg.system_namespaces, cfg.system_containers) == ([], [])
    assert tuple(cfg.system_allowlist) == DEFAULT_SYSTEM_ALLOWLIST


def test_from_file_and_environment(tmp_path: Path) -> None:
    path = tmp_path / "tracer.toml"
    path.write_text('[tracer]\nsystem_namespaces = ["gpu-operator"]\n'
                    'system_allowlist = ["nvidia-persistenced", "/usr/bin/nv-hostengine"]\n')
    env = {"GHOSTGPU_SYSTEM_CONTAINERS": "kube-system/nvidia-device-plugin-ctr, kube-system/gfd",
           "GHOSTGPU_NODE_NAME": "n"}
    cfg = load_config(path, env=env)
    assert cfg.system_namespaces == ["gpu-operator"]
    assert cfg.system_containers == ["kube-system/nvidia-device-plugin-ctr", "kube-system/gfd"]
    assert cfg.system_allowlist == ["nvidia-persistenced", "/usr/bin/nv-hostengine"]


def test_the_agent_hands_the_places_and_its_holders_view_to_classify() -> None:
    cfg = TracerConfig(node_name="n", bpf="off", proc_root="/nonexistent-proc",
                       system_namespaces=["gpu-operator"], system_containers=["kube-system/gfd"])
    tracer = Tracer(cfg, CallbackSink(lambda record: None))
    ccfg = tracer.classify_config()
    assert ccfg.system_places == ("gpu-operator", "kube-system/gfd")
    # Without BPF only a full /proc scan finds holders: none yet, so no listed PID is judged reused.
    assert ccfg.holders_complete_ns == 0
    tracer.scans.full_scan_ns = 123
    assert tracer.classify_config().holders_complete_ns == 123
    tracer.bpf = object()  # the kernel reports every open: the holders are complete now
    assert tracer.classify_config().holders_complete_ns is None
