"""Fixtures for integration tests that run the real tracer against planted consumers."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from ghostgpu.collector.store import Store

from tests.conftest import require_root
from tests.helpers.cri_fake import FakeCri
from tests.helpers.fakenvml import FakeGpu, FakeNvml
from tests.helpers.replicas import TRAINER_CID
from tests.integration.containerd_fixtures import containerd, containerd_session  # noqa: F401

GPU0_UUID = "GPU-0a1b2c3d-0000-4000-8000-000000000000"
GPU1_UUID = "GPU-0a1b2c3d-0000-4000-8000-000000000001"


def _bpf_ready() -> str | None:
    try:
        import bcc  # noqa: F401
    except ImportError:
        return "bcc is not installed (apt-get install python3-bpfcc; scripts/bootstrap.sh install)"
    if not os.path.exists("/sys/kernel/tracing/events/syscalls"):
        return "tracefs is not mounted (mount -t tracefs tracefs /sys/kernel/tracing)"
    return None


def require_bpf() -> None:
    """Skip (or, under CI, fail) a test, or a module-scoped fixture that starts a tracer, without
    root, BPF or gcc."""
    require_root()
    reason = _bpf_ready()
    if reason:
        pytest.skip(reason)
    if not shutil.which("gcc"):
        pytest.skip("gcc is needed to build the test workload and the fake NVML")


@pytest.fixture
def root_bpf() -> None:
    require_bpf()


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory another uid (65534) can traverse: pytest's tmp_path is under a 0700 directory."""
    path = Path(tempfile.mkdtemp(prefix="ghostgpu-shared-"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def fake_nvml(tmp_path: Path) -> Iterator[FakeNvml]:
    """One GPU (index 0, minor 0) whose driver lists no process until a test says so."""
    nvml = FakeNvml(tmp_path / "nvml.conf", gpus=[FakeGpu(index=0, uuid=GPU0_UUID, minor=0)])
    nvml.write()
    yield nvml


@pytest.fixture
def stores(postgres_dsn: str) -> Iterator[tuple[Store, Store]]:
    """Two stores, as two replicas hold them, over one PostgreSQL database (the postgres tests')."""
    a = Store(postgres_dsn, event_log_max=1000, retention_days=7, replica_id="collector-a")
    b = Store(postgres_dsn, event_log_max=1000, retention_days=7, replica_id="collector-b")
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def trainer_runtime() -> Iterator[FakeCri]:
    """A fake CRI runtime with pod ml/trainer-0 (sandbox sb-ml-trainer-0) and its container `train`
    (TRAINER_CID): what the trace tests across replicas resolve their scope against."""
    fake = FakeCri().start()
    fake.add_sandbox("sb-ml-trainer-0", "trainer-0", "ml", "uid-trainer-0")
    fake.add_container(TRAINER_CID, "sb-ml-trainer-0", "train")
    try:
        yield fake
    finally:
        fake.close()
