"""How values are written for people (ghostgpu.common.model.display) and the one table layout that
`ghostgpu snapshot` shares with `ps` (ghostgpu.cli.view): the snapshot table byte for byte as the
tracer used to render it."""

from __future__ import annotations

from dataclasses import replace

from ghostgpu.cli import view

from ghostgpu.common.model.consumers import Consumer, ConsumerClass
from ghostgpu.common.model.display import LISTING_ID_LEN, SHORT_ID_LEN, mib, mib_phrase, short_id

C = ConsumerClass
BASE = Consumer(
    node="n1", pid=4242, ns_pid=7, comm="python3", gpu=0, gpu_uuid="GPU-aaaa", gpu_minor=0,
    devices=["/dev/nvidia0", "/dev/nvidiactl"], container_id="c0ffee" * 10 + "abcd", pod_uid="uid-1",
    runtime="containerd", cls=C.HIDDEN, reason="holds /dev/nvidia0; NVML lists no such process",
    gpu_memory_bytes=None)
HOST = replace(BASE, pid=5, ns_pid=None, gpu=None, container_id="", comm="", gpu_memory_bytes=3 << 20,
               cls=C.VISIBLE, pod_uid="", devices=[])
BIG = replace(BASE, pid=77777, gpu=3, gpu_memory_bytes=(512 << 20) + 12345, cls=C.ORPHANED, reason="x" * 50)


def test_mib() -> None:
    assert [mib(n) for n in (None, 0, 3 << 20, (512 << 20) + 12345, (1 << 20) // 2 + 1)] == \
        ["-", "0MiB", "3MiB", "512MiB", "1MiB"]
    assert [mib_phrase(n) for n in (None, 2 << 30)] == ["an unknown amount of memory", "2048 MiB"]


def test_short_ids() -> None:
    cid = "0123456789abcdef" * 4
    assert short_id(cid) == "0123456789ab" and SHORT_ID_LEN == 12
    assert short_id(cid, LISTING_ID_LEN) == "0123456789abc"  # what every listing has always shown
    assert short_id("") == ""


def test_snapshot_table_is_byte_identical() -> None:
    assert view.snapshot_table([BASE, HOST, BIG]) == (
        "GPU  PID    CPID  COMM     CLASS     GPU-MEM  CONTAINER      POD-UID  DEVICES            REASON\n"
        "0    4242   7     python3  hidden    -        c0ffeec0ffeec  uid-1    nvidia0,nvidiactl  "
        "holds /dev/nvidia0; NVML lists no such process\n"
        "-    5      -     ?        visible   3MiB     -              -                           "
        "holds /dev/nvidia0; NVML lists no such process\n"
        "3    77777  7     python3  orphaned  512MiB   c0ffeec0ffeec  uid-1    nvidia0,nvidiactl  "
        + "x" * 50)
    assert view.snapshot_table([BASE, HOST, BIG], wide=False) == (
        "GPU  PID    CPID  COMM     CLASS     GPU-MEM  CONTAINER      POD-UID  DEVICES\n"
        "0    4242   7     python3  hidden    -        c0ffeec0ffeec  uid-1    nvidia0,nvidiactl\n"
        "-    5      -     ?        visible   3MiB     -              -\n"
        "3    77777  7     python3  orphaned  512MiB   c0ffeec0ffeec  uid-1    nvidia0,nvidiactl")
    assert view.snapshot_table([]) == (
        "GPU  PID  CPID  COMM  CLASS  GPU-MEM  CONTAINER  POD-UID  DEVICES  REASON\n"
        "(no process holds a GPU device file)")


def test_one_layout_for_every_table() -> None:
    cols: list[view.Column[int]] = [("N", str), ("SQUARE", lambda n: str(n * n))]
    assert view.table(cols, [3, 12], "(none)") == "N   SQUARE\n3   9\n12  144"
    assert view.table(cols, [], "(none)") == "N  SQUARE\n(none)"
