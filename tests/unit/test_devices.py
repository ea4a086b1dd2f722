"""The GPU device catalog: /proc/devices, mig-minors, names, device numbers, mount skips."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from ghostgpu.tracer.devices import (
    DeviceCatalog,
    classify_device_path,
    classify_mig_minor,
    on_skipped_mount,
    outside_prefix,
    outside_prefix_hint,
    parse_mig_minors,
    parse_mount_skips,
    parse_proc_devices,
)

from ghostgpu.common.model.consumers import DeviceKind, DeviceRef

G, M, C, U, X = DeviceKind.GPU, DeviceKind.MIG, DeviceKind.CONTROL, DeviceKind.UVM, DeviceKind.OTHER

PROC_DEVICES = """Character devices:
  1 mem
  4 /dev/vc/0
  4 tty
195 nvidia
195 nvidiactl
195 nvidia-modeset
226 drm
236 davinci-npu
505 nvidia-caps-imex-channels
506 nvidia-nvswitch
507 nvidia-nvlink
508 kfd
509 nvidia-caps
510 nvidia-uvm

Block devices:
  7 loop
510 notachar
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (PROC_DEVICES, {1: ["mem"], 4: ["/dev/vc/0", "tty"], 195: ["nvidia", "nvidiactl", "nvidia-modeset"],
                        226: ["drm"], 236: ["davinci-npu"], 505: ["nvidia-caps-imex-channels"],
                        506: ["nvidia-nvswitch"], 507: ["nvidia-nvlink"], 508: ["kfd"], 509: ["nvidia-caps"],
                        510: ["nvidia-uvm"]}),
        ("", {}),
        ("Block devices:\n  7 loop\n", {}),
        ("Character devices:\n  x bad\n 12\n 13 ok\n", {13: ["ok"]}),
        ("Character devices:\r\n195 nvidia\r\n", {195: ["nvidia"]}),
    ],
    ids=["full", "empty", "block-only", "garbage", "crlf"],
)
def test_parse_proc_devices(text: str, expected: dict[int, list[str]]) -> None:
    assert parse_proc_devices(text) == expected


MIG_MINORS = """config 1
monitor 2
gpu0/gi0/access 3
gpu0/gi1/access 12
gpu0/gi1/ci0/access 13
gpu1/gi0/access 138
gpu1/gi0/ci7/access 146
fabric-imex-mgmt 4323
gpuX/gi0/access 99
gpu2/giY/ci0/access 98
gpu2/gi0/ci0/access notanumber
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (MIG_MINORS, {3: (0, 0, None), 12: (0, 1, None), 13: (0, 1, 0), 138: (1, 0, None), 146: (1, 0, 7)}),
        ("", {}),
        ("gpu3/access 7\n", {7: (3, None, None)}),
    ],
    ids=["full", "empty", "gpu-level"],
)
def test_parse_mig_minors(text: str, expected: dict[int, tuple[int, int | None, int | None]]) -> None:
    assert parse_mig_minors(text) == expected


@pytest.mark.parametrize(
    ("minor", "table", "expected"),
    [
        (0, None, (C, None)),  # nvlink fabric-mgmt
        (1, None, (C, None)),  # mig/config
        (2, None, (C, None)),  # mig/monitor
        (3, None, (M, 0)),  # gpu0/gi0/access
        (12, None, (M, 0)),  # gpu0/gi1/access = 3 + 9
        (13, None, (M, 0)),  # gpu0/gi1/ci0/access
        (137, None, (M, 0)),  # the last minor of GPU 0
        (138, None, (M, 1)),  # gpu1/gi0/access = 3 + 135
        (3 + 135 * 31 + 134, None, (M, 31)),
        (4323, None, (C, None)),  # fabric-imex-mgmt
        (9000, None, (X, None)),
        (12, {12: (5, 1, None)}, (M, 5)),  # the driver's table wins over the formula
    ],
)
def test_classify_mig_minor(minor: int, table: dict | None, expected: tuple) -> None:  # type: ignore[type-arg]
    assert classify_mig_minor(minor, table) == expected


@pytest.mark.parametrize(
    ("path", "kind", "gpu_minor"),
    [
        ("/dev/nvidia0", G, 0),
        ("/dev/nvidia7", G, 7),
        ("/dev/nvidia247", G, 247),
        ("/dev/nvidia248", X, None),
        ("/dev/nvidia254", C, None),
        ("/dev/nvidia255", C, None),
        ("/dev/nvidiactl", C, None),
        ("/dev/nvidia-modeset", C, None),
        ("/dev/nvidia-uvm", U, None),
        ("/dev/nvidia-uvm-tools", U, None),
        ("/dev/nvidia-caps/nvidia-cap1", C, None),
        ("/dev/nvidia-caps/nvidia-cap2", C, None),
        ("/dev/nvidia-caps/nvidia-cap12", M, 0),
        ("/dev/nvidia-caps/nvidia-cap138", M, 1),
        ("/dev/nvidia-caps/nvidia-capX", X, None),
        ("/dev/nvidia-caps-imex-channels/channel0", X, None),
        ("/dev/nvidia-nvlink", X, None),
        ("/dev/nvidia-nvswitch0", X, None),
        ("/dev/nvidia-nvswitchctl", X, None),
        ("/dev/nvidiaX", X, None),
        ("/dev/dri/renderD128", G, 0),
        ("/dev/dri/renderD131", G, 3),
        ("/dev/dri/renderD12", X, None),
        ("/dev/kfd", C, None),
        ("/dev/davinci0", G, 0),
        ("/dev/davinci15", G, 15),
        ("/dev/davinci_manager", C, None),
        ("/dev/nvidia3 (deleted)", G, 3),  # an unlinked node still stands for its GPU
        ("/tmp/test-prefix/nvidia1", G, 1),  # by name, wherever the configured prefix is
    ],
)
def test_classify_device_path(path: str, kind: DeviceKind, gpu_minor: int | None) -> None:
    assert classify_device_path(path) == DeviceRef(path, kind, gpu_minor)


NV, AMD, ASCEND = ("/dev/nvidia",), ("/dev/kfd", "/dev/dri/renderD"), ("/dev/davinci",)


@pytest.mark.parametrize(
    ("path", "prefixes", "expected"),
    [
        # a chroot's (or another mount namespace's) /dev as /proc/PID/fd shows it from outside
        ("/srv/chroot/dev/nvidia0", NV, "/srv/chroot/dev/nvidia"),
        ("/srv/chroot/dev/nvidiactl", NV, "/srv/chroot/dev/nvidia"),
        ("/srv/chroot/dev/nvidia-uvm-tools", NV, "/srv/chroot/dev/nvidia"),
        ("/srv/chroot/dev/nvidia-modeset", NV, "/srv/chroot/dev/nvidia"),
        ("/srv/chroot/dev/nvidia-caps/nvidia-cap12", NV, "/srv/chroot/dev/nvidia"),  # its own directory kept
        ("/srv/chroot/dev/nvidia3 (deleted)", NV, "/srv/chroot/dev/nvidia"),
        ("/nvidia0", NV, "/nvidia"),
        ("/srv/c/dev/dri/renderD128", AMD, "/srv/c/dev/dri/renderD"),
        ("/srv/c/dev/kfd", AMD, "/srv/c/dev/kfd"),
        ("/srv/c/dev/davinci3", ASCEND, "/srv/c/dev/davinci"),
        ("/srv/c/dev/davinci_manager", ASCEND, "/srv/c/dev/davinci"),
        ("/dev/nvidia0", ("/tmp/gg-x/nvidia",), "/dev/nvidia"),  # outside a test's own prefix
        ("/dev/nvidia0", ("/dev/nvidia", "/srv/c/dev/nvidia"), None),  # inside: watched
        ("/srv/c/dev/nvidia0", ("/dev/nvidia", "/srv/c/dev/nvidia"), None),
        ("/dev/nvidia-caps/nvidia-cap1", NV, None),
        # not a GPU device name: no hint
        ("/var/log/nvidia-installer.log", NV, None),
        ("/srv/chroot/dev/nvidia248", NV, None),
        ("/srv/chroot/dev/nvidia-nvswitch0", NV, None),
        ("/srv/chroot/dev/nvidiaX", NV, None),
        ("/srv/chroot/dev/dri/renderD12", AMD, None),
        # a device of a vendor the prefixes do not watch: a desktop's render node under NVIDIA's
        ("/dev/dri/renderD128", NV, None),
        ("/srv/c/dev/kfd", NV, None),
        ("/srv/c/dev/nvidia0", AMD, None),
        # not a path at all, or a directory-only prefix (no name part to match)
        ("socket:[123]", NV, None),
        ("nvidia0", NV, None),
        ("/srv/c/dev/nvidia0", ("/tmp/gg-dir/",), None),
    ],
)
def test_outside_prefix(path: str, prefixes: tuple[str, ...], expected: str | None) -> None:
    assert outside_prefix(path, prefixes) == expected


@pytest.mark.parametrize(
    ("path", "prefixes", "pid", "expected"),
    [
        ("/srv/chroot/dev/nvidia0", NV, 123,
         "/srv/chroot/dev/nvidia0 (held by pid 123) looks like a GPU device outside the device prefixes "
         "(/dev/nvidia): run the tracer on the host, not in a chroot or another mount namespace, or watch "
         "it there too with --device-prefix /dev/nvidia --device-prefix /srv/chroot/dev/nvidia"),
        ("/srv/c/dev/kfd", AMD, None,
         "/srv/c/dev/kfd looks like a GPU device outside the device prefixes (/dev/kfd, /dev/dri/renderD): "
         "run the tracer on the host, not in a chroot or another mount namespace, or watch it there too "
         "with --device-prefix /dev/kfd --device-prefix /dev/dri/renderD --device-prefix /srv/c/dev/kfd"),
        # a prefix the kernel matcher cannot take (over 40 bytes, a space; a 9th prefix): no flag offered
        ("/var/lib/machines/a-long-machine-name/dev/nvidia0", NV, 7,
         "/var/lib/machines/a-long-machine-name/dev/nvidia0 (held by pid 7) looks like a GPU device outside "
         "the device prefixes (/dev/nvidia): run the tracer on the host, not in a chroot or another mount "
         "namespace (/var/lib/machines/a-long-machine-name/dev/nvidia cannot be added as a device prefix: "
         "at most 8 prefixes of at most 40 plain characters)"),
        ("/srv/my root/dev/nvidia0", NV, 7, None),  # checked below: the flag is left out
        ("/srv/c/dev/nvidia0", tuple(f"/p{i}/nvidia" for i in range(8)), 7, None),
        ("/var/log/nvidia-installer.log", NV, 7, None),
        ("/dev/nvidia0", NV, 7, None),
    ],
)
def test_outside_prefix_hint(path: str, prefixes: tuple[str, ...], pid: int | None,
                             expected: str | None) -> None:
    line = outside_prefix_hint(path, prefixes, pid)
    if expected is not None or outside_prefix(path, prefixes) is None:
        assert line == expected
    else:
        assert line is not None and line.startswith(f"{path} (held by pid {pid}) looks like a GPU device")
        assert "--device-prefix" not in line and "cannot be added as a device prefix" in line


def test_classify_device_path_uses_mig_table() -> None:
    ref = classify_device_path("/dev/nvidia-caps/nvidia-cap12", {12: (4, 1, None)})
    assert (ref.kind, ref.gpu_minor) == (M, 4)


def fake_proc(tmp_path: Path, devices: str = PROC_DEVICES, mig: str | None = MIG_MINORS) -> str:
    (tmp_path / "devices").write_text(devices)
    if mig is not None:
        (tmp_path / "driver" / "nvidia-caps").mkdir(parents=True)
        (tmp_path / "driver" / "nvidia-caps" / "mig-minors").write_text(mig)
    return str(tmp_path)


NV = ("/dev/nvidia",)
NV_AMD = ("/dev/nvidia", "/dev/kfd", "/dev/dri/renderD")
dev = os.makedev


@pytest.mark.parametrize(
    ("prefixes", "path", "rdev", "expected"),
    [
        # by prefix, classified by name; rdev fills major/minor
        (NV, "/dev/nvidia0", None, DeviceRef("/dev/nvidia0", G, 0)),
        (NV, "/dev/nvidia0", dev(195, 0), DeviceRef("/dev/nvidia0", G, 0, 195, 0)),
        (NV, "/dev/nvidiactl", dev(195, 255), DeviceRef("/dev/nvidiactl", C, None, 195, 255)),
        (NV, "/dev/nvidia-caps/nvidia-cap13", dev(509, 13),
         DeviceRef("/dev/nvidia-caps/nvidia-cap13", M, 0, 509, 13)),
        # the number wins over the name: a container's /dev/nvidia0 may be the host's GPU 3
        (NV, "/dev/nvidia0", dev(195, 3), DeviceRef("/dev/nvidia0", G, 3, 195, 3)),
        (NV, "/dev/nvidia-gpu-a", dev(195, 2), DeviceRef("/dev/nvidia-gpu-a", G, 2, 195, 2)),
        # a non-GPU number under the prefix (a test node c 1 3): the name is all there is
        (NV, "/dev/nvidia1", dev(1, 3), DeviceRef("/dev/nvidia1", G, 1, 1, 3)),
        # by rdev major, outside the prefixes: a node made elsewhere with mknod
        (NV, "/tmp/x", dev(195, 0), DeviceRef("/tmp/x", G, 0, 195, 0)),
        (NV, "/tmp/x", dev(195, 247), DeviceRef("/tmp/x", G, 247, 195, 247)),
        (NV, "/tmp/x", dev(195, 250), DeviceRef("/tmp/x", X, None, 195, 250)),
        (NV, "/tmp/ctl", dev(195, 255), DeviceRef("/tmp/ctl", C, None, 195, 255)),
        (NV, "/tmp/modeset", dev(195, 254), DeviceRef("/tmp/modeset", C, None, 195, 254)),
        (NV, "/tmp/uvm", dev(510, 0), DeviceRef("/tmp/uvm", U, None, 510, 0)),
        (NV, "/tmp/uvm-tools", dev(510, 1), DeviceRef("/tmp/uvm-tools", U, None, 510, 1)),
        (NV, "/tmp/cap", dev(509, 146), DeviceRef("/tmp/cap", M, 1, 509, 146)),  # from mig-minors
        (NV, "/tmp/cap", dev(509, 1), DeviceRef("/tmp/cap", C, None, 509, 1)),
        (NV, "/tmp/imex", dev(505, 0), DeviceRef("/tmp/imex", X, None, 505, 0)),
        (NV, "/tmp/nvlink", dev(507, 0), DeviceRef("/tmp/nvlink", X, None, 507, 0)),
        (NV, "/tmp/nvswitch", dev(506, 3), DeviceRef("/tmp/nvswitch", X, None, 506, 3)),
        (NV, "/tmp/kfd", dev(508, 0), DeviceRef("/tmp/kfd", C, None, 508, 0)),
        (NV, "/tmp/npu", dev(236, 1), DeviceRef("/tmp/npu", X, None, 236, 1)),
        # not GPU devices
        (NV, "/dev/null", dev(1, 3), None),
        (NV, "/tmp/file", 0, None),
        (NV, "/tmp/file", None, None),
        (NV, "/dev/dri/renderD128", dev(226, 128), None),  # DRM only with the AMD prefixes
        # AMD: render nodes by prefix or by 226 with minor >= 128
        (NV_AMD, "/dev/dri/renderD129", dev(226, 129), DeviceRef("/dev/dri/renderD129", G, 1, 226, 129)),
        (NV_AMD, "/tmp/render", dev(226, 130), DeviceRef("/tmp/render", G, 2, 226, 130)),
        (NV_AMD, "/dev/dri/card0", dev(226, 0), None),  # display node, not compute
        (NV_AMD, "/dev/kfd", dev(508, 0), DeviceRef("/dev/kfd", C, None, 508, 0)),
    ],
)
def test_catalog_match(tmp_path: Path, prefixes: tuple[str, ...], path: str, rdev: int | None,
                       expected: DeviceRef | None) -> None:
    catalog = DeviceCatalog(prefixes, fake_proc(tmp_path))
    assert catalog.match(path, rdev) == expected


def test_catalog_without_driver_files(tmp_path: Path) -> None:
    """No /proc/devices entry and no mig-minors (no driver loaded): 195 is still known."""
    catalog = DeviceCatalog(NV, str(tmp_path))
    assert catalog.majors.keys() == {195}
    assert catalog.mig_minors == {}
    assert catalog.match("/tmp/x", dev(195, 3)) == DeviceRef("/tmp/x", G, 3, 195, 3)
    assert catalog.match("/tmp/x", dev(510, 0)) is None


def test_catalog_reload_picks_up_a_new_major(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, devices="Character devices:\n  1 mem\n", mig=None)
    catalog = DeviceCatalog(NV, proc)
    assert catalog.match("/dev/x", dev(511, 0)) is None
    Path(proc, "devices").write_text("Character devices:\n  1 mem\n511 nvidia-uvm\n")
    catalog.reload()
    assert catalog.match("/dev/x", dev(511, 0)) == DeviceRef("/dev/x", U, None, 511, 0)


def test_catalog_on_this_host() -> None:
    """The real /proc: never raises, and the fixed NVIDIA major is always there."""
    catalog = DeviceCatalog(NV)
    assert catalog.is_gpu_major(195)
    assert catalog.match("/dev/null", os.stat("/dev/null").st_rdev) is None


MOUNTINFO = r"""22 1 254:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
23 22 0:5 / /dev rw,nosuid shared:2 - devtmpfs udev rw
24 23 0:21 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw
25 22 0:40 / /mnt/nfs rw,relatime shared:4 - nfs4 srv:/export rw,vers=4.2
26 25 0:41 / /mnt/nfs/local rw,relatime shared:5 - ext4 /dev/vdb rw
27 22 0:42 / /home/a\040b rw,relatime - fuse.sshfs host: rw
28 22 0:43 / /run rw,nosuid,nodev - tmpfs tmpfs rw
29 22 0:44 / /run rw,nosuid - tmpfs tmpfs rw
garbage line
"""


@pytest.mark.parametrize(
    ("path", "skipped"),
    [
        ("/tmp/x", False),
        ("/dev/shm/x", True),  # nodev: a node there cannot be opened
        ("/dev/x", False),
        ("/mnt/nfs/data/file", True),  # remote: no stat round trip
        ("/mnt/nfs", True),
        ("/mnt/nfsx/file", False),  # a sibling, not under the mount
        ("/mnt/nfs/local/file", False),  # a local mount under the remote one
        ("/home/a b/file", True),  # escaped space, FUSE
        ("/run/x", False),  # the later mount over /run hides the nodev one
        ("/", False),
    ],
)
def test_mount_skips(path: str, skipped: bool) -> None:
    assert on_skipped_mount(path, parse_mount_skips(MOUNTINFO)) is skipped


def test_mount_skips_empty_table() -> None:
    assert parse_mount_skips("") == {}
    assert on_skipped_mount("/any/path", {}) is False
