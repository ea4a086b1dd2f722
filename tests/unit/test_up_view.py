"""`ghostgpu up`'s first frame and its store, without root: the live view's node line before and after
the tracer connects (fake query and supervisor), which store a run writes, and the demo's store going
with the demo."""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest
from ghostgpu.cli import up
from ghostgpu.cli.demo import Demo

from ghostgpu.v1 import query_pb2, stream_pb2

NO_DRIVER = stream_pb2.NodeInfo(nvml=False, nvml_error="NVML: nvmlInit: NVIDIA kernel driver not loaded; "
                                "load it (modprobe nvidia), retrying every 30 s")
NO_GPU_TEXT = ("no NVIDIA GPU visible here (NVML: nvmlInit: NVIDIA kernel driver not loaded; load it "
               "(modprobe nvidia), retrying every 30 s); still watching device files")
ONE_GPU = stream_pb2.NodeInfo(bpf=True, nvml=True, driver_version="550.54",
                              gpus=[stream_pb2.Gpu(index=0, uuid="GPU-1", name="H100")])


class FakeQuery:
    address = "unix:///tmp/x.sock"

    def __init__(self) -> None:
        self.status: query_pb2.TracerStatus | None = None

    def nodes(self, node: str = "") -> list[query_pb2.TracerStatus]:
        return [] if self.status is None else [self.status]

    def consumers(self, node: str = "") -> list[Any]:
        return []

    def events(self, node: str, instance_id: str, after_seq: int, limit: int = 0) -> list[Any]:
        return []


class FakeTracer:
    stderr: list[tuple[int, str]] = []
    on_notice: Any = None

    def describe(self) -> str:
        return "tracer pid 42"


def live_view(query: FakeQuery, nvml_text: str = NO_GPU_TEXT) -> up.LiveView:
    return up.LiveView(cast(Any, query), "n1", cast(Any, FakeTracer()), threading.Event(), None,
                       argparse.Namespace(once=False), db="/tmp/s.db", nvml_text=nvml_text)


def node_line(live: up.LiveView) -> str:
    return live._screen()[0].splitlines()[1]


def status(connected: bool, info: stream_pb2.NodeInfo | None = None, heard_s_ago: float = 0) -> Any:
    st = query_pb2.TracerStatus(node="n1", connected=connected, instance_id="i-1")
    if heard_s_ago:
        st.last_heartbeat_unix_ns = int((time.time() - heard_s_ago) * 1e9)
    if info is not None:
        st.info.CopyFrom(info)
    return st


def test_first_frame_says_tracer_starting_and_no_gpu_then_what_the_tracer_says() -> None:
    query = FakeQuery()
    live = live_view(query)
    # A fresh store: the collector does not know the node yet.
    assert node_line(live) == f"node n1 | tracer starting | {NO_GPU_TEXT}"
    # The store knows the node from a run that ended 5 minutes ago: still starting, not DISCONNECTED.
    query.status = status(False, heard_s_ago=300)
    assert node_line(live) == f"node n1 | tracer starting | {NO_GPU_TEXT}"
    # Connected, its snapshot not in yet: up's own probe stands in for the tracer's NVML.
    query.status = status(True)
    assert node_line(live) == f"node n1 | tracer connected | {NO_GPU_TEXT}"
    query.status = status(True, ONE_GPU, heard_s_ago=1)
    line = node_line(live)
    assert line.startswith("node n1 | tracer connected (heard ") and NO_GPU_TEXT not in line
    assert line.endswith(" | BPF tracepoints attached | NVML driver 550.54: 0:H100")
    # Once this run's tracer has connected, losing it is a disconnection, said as such.
    query.status = status(False, heard_s_ago=20)
    assert node_line(live).startswith("node n1 | tracer DISCONNECTED, last heard 20s ago | ")


def test_top_line_names_the_store() -> None:
    screen = live_view(FakeQuery())._screen()[0]
    assert screen.splitlines()[0].startswith("ghostgpu up: collector unix:///tmp/x.sock (db /tmp/s.db), ")


@pytest.mark.parametrize(("info", "demo_gpu", "text"), [
    (NO_DRIVER, False, NO_GPU_TEXT),
    (NO_DRIVER, True, f"{NO_GPU_TEXT}; --demo plants a demo GPU for its tracer"),
    (ONE_GPU, False, "NVML driver 550.54: 0:H100"),
    (stream_pb2.NodeInfo(nvml=True, driver_version="550.54"), False, "NVML driver 550.54: no GPUs"),
], ids=["no-driver", "no-driver-demo", "one-gpu", "driver-no-gpus"])
def test_first_nvml_text(info: stream_pb2.NodeInfo, demo_gpu: bool, text: str) -> None:
    assert up.first_nvml_text(info, demo_gpu) == text


@pytest.mark.parametrize(("info", "visible"), [(NO_DRIVER, False), (ONE_GPU, True),
                                               (stream_pb2.NodeInfo(nvml=True), False)])
def test_gpu_visible_decides_the_demo_gpu(info: stream_pb2.NodeInfo, visible: bool) -> None:
    assert up.gpu_visible(info) is visible


def test_probe_nvml_is_a_view_either_way() -> None:
    """The host's own NVML: on a machine without one, a view saying why (never an exception)."""
    info = up.probe_nvml("n1")
    assert info.nvml or (info.nvml_error.startswith("NVML: ") and not info.gpus)


class FakeDemo:
    db_path = "/tmp/ghostgpu-demo-x/collector.db"


@pytest.mark.parametrize(("db_flag", "demo", "want"), [
    (None, None, up.DEFAULT_DB),
    (None, FakeDemo(), FakeDemo.db_path),  # the demo's own store, never the node's
    ("/srv/x.db", FakeDemo(), "/srv/x.db"),  # named: used and kept
    (":memory:", FakeDemo(), ":memory:"),
    ("/srv/x.db", None, "/srv/x.db"),
], ids=["plain", "demo", "demo-db", "demo-memory", "plain-db"])
def test_store_path(db_flag: str | None, demo: Any, want: str) -> None:
    assert up.store_path(db_flag, demo) == want


def test_store_label_says_the_demo_store_goes() -> None:
    demo: Any = FakeDemo()
    assert up.store_label(demo.db_path, demo) == f"{demo.db_path}, the demo's own, removed on exit"
    assert up.store_label("/srv/x.db", demo) == "/srv/x.db"
    assert up.store_label(up.DEFAULT_DB, None) == up.DEFAULT_DB


def test_demo_store_is_removed_by_close() -> None:
    """Nothing planted (no root needed): close() still deletes the store and what SQLite put beside it."""
    demo = Demo(fake_nvml=True)
    db = Path(demo.db_path)
    assert db.parent == demo.workdir
    for name in (db.name, f"{db.name}-wal", f"{db.stem}.audit.jsonl"):
        (db.parent / name).write_text("x")
    demo.close()
    assert not db.parent.exists()


HEAD = "the tracer has not seen the demo's {} 5 s after its first /proc scan: "
CHROOT_HINT = ("/srv/chroot/dev/nvidia0 (held by pid 41) looks like a GPU device outside the device prefixes "
               "(/dev/nvidia): run the tracer on the host, not in a chroot or another mount namespace, or "
               "watch it there too with --device-prefix /dev/nvidia --device-prefix /srv/chroot/dev/nvidia")


@pytest.mark.parametrize(("unseen", "held", "want"), [
    (["hidden", "orphaned"], {"hidden": (41, "/srv/chroot/dev/nvidia0"),
                              "orphaned": (42, "/srv/chroot/dev/nvidia0")},
     HEAD.format("hidden and orphaned consumers") + CHROOT_HINT),
    # the path wins over another consumer's trouble: it says what to do
    (["hidden", "orphaned"], {"hidden": (None, "its container has no process left (it exited or was killed)"),
                              "orphaned": (41, "/srv/chroot/dev/nvidia0")},
     HEAD.format("hidden and orphaned consumers") + CHROOT_HINT),
    (["orphaned"], {"hidden": (40, "/dev/nvidia0"),
                    "orphaned": (None, "its container has no process left (it exited or was killed)")},
     HEAD.format("orphaned consumer") + "the orphaned consumer: its container has no process left (it exited "
     "or was killed)"),
    (["hidden"], {"hidden": (40, "cannot read /proc/40/fd/3: Permission denied")},
     HEAD.format("hidden consumer") + "the hidden consumer (pid 40): cannot read /proc/40/fd/3: Permission "
     "denied"),
    # watched by path, still unseen: not a prefix matter
    (["hidden"], {"hidden": (40, "/dev/nvidia0")},
     HEAD.format("hidden consumer") + "pid 40 (hidden) holds /dev/nvidia0, which the device prefixes "
     "(/dev/nvidia) cover; the tracer must read this host's /proc (--proc-root) from its PID namespace: see "
     "the tracer's lines above"),
], ids=["chroot", "chroot-and-gone", "gone", "unreadable", "inside-prefixes"])
def test_demo_unseen_line(unseen: list[str], held: dict[str, tuple[int | None, str]], want: str) -> None:
    assert up.demo_unseen_line(unseen, held, ("/dev/nvidia",), 5.2) == want


class BlindDemo:
    """A demo whose consumers the tracer does not list: held as from inside a chroot."""

    fake_nvml = False
    short_lived_every_s = 3.0
    started_short_lived = False

    def container_ids(self) -> dict[str, str]:
        return {"hidden": "c" * 64, "orphaned": "d" * 64, "short-lived": "e" * 64}

    def legend(self) -> str:
        return "demo: planted"

    def start_short_lived(self) -> None:
        self.started_short_lived = True

    def held(self) -> dict[str, tuple[int | None, str]]:
        return {"hidden": (41, "/srv/chroot/dev/nvidia0"), "orphaned": (42, "/srv/chroot/dev/nvidia0")}


def test_a_blind_tracer_is_reported_once_up_not_at_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing is said while the tracer starts (the long cap covers that); DEMO_UNSEEN_S after its first
    snapshot, the view names the path and the fix."""
    clock = [1000.0]
    monkeypatch.setattr(up.time, "monotonic", lambda: clock[0])
    query = FakeQuery()
    live = up.LiveView(cast(Any, query), "n1", cast(Any, FakeTracer()), threading.Event(),
                       cast(Any, BlindDemo()), argparse.Namespace(once=True), prefixes=("/dev/nvidia",))
    clock[0] += 100  # starting for a long time: not this line's business
    assert "NOT SEEN" not in live._screen()[0] and live.demo_problem == ""
    query.status = status(True, ONE_GPU)
    assert live._screen()[1] is False and live.demo_problem == ""  # up: the clock starts
    clock[0] += up.DEMO_UNSEEN_S - 0.1
    assert live._screen()[1] is False and live.demo_problem == ""
    clock[0] += 0.1
    screen, ready = live._screen()
    assert not ready and live.demo_problem == HEAD.format("hidden and orphaned consumers") + CHROOT_HINT
    assert f"demo: NOT SEEN: {live.demo_problem}" in screen.splitlines()
    # A restarted tracer (another instance) gets its own DEMO_UNSEEN_S; while it is down nothing is said.
    query.status = status(False)
    assert "NOT SEEN" not in live._screen()[0]
    query.status = status(True, ONE_GPU)
    query.status.instance_id = "i-2"
    clock[0] += 1
    assert "NOT SEEN" not in live._screen()[0]
    clock[0] += up.DEMO_UNSEEN_S
    assert "NOT SEEN" in live._screen()[0]
