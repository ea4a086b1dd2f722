"""The GPU device catalog: which device files are GPU devices, and what each one stands for.

Two ways to recognise a device file:
* by name, for a path under a configured prefix (`/dev/nvidia`, `/dev/kfd`, ...);
* by its rdev major, for a node made elsewhere with mknod (`/tmp/x` c 195 0): the kernel
  does not care where a node lives, only its (major, minor), so a path check alone is easy to hide from.

The numbers come from docs/reference/nvidia-devices.md (open-gpu-kernel-modules 595.45.04): major
195 is fixed, every other NVIDIA major is dynamic and must be read from /proc/devices at runtime.
"""

from __future__ import annotations

import os

from ghostgpu.tracer.bpf_build import MAX_PREFIXES, prefix_ok

from ghostgpu.common.model.consumers import DeviceKind, DeviceRef

NVIDIA_MAJOR = 195
NVIDIA_MAX_GPU_MINOR = 247  # 248..253 unused, 254 nvidia-modeset, 255 nvidiactl
NVIDIA_MODESET_MINOR = 254
NVIDIACTL_MINOR = 255
DRM_MAJOR = 226
DRM_RENDER_MINOR_BASE = 128  # renderD128 is the first render node (64 * DRM_MINOR_RENDER)

# MIG capability minors are handed out in a fixed order at module load (nv-caps.c), so they can be
# computed when /proc/driver/nvidia-caps/mig-minors is not readable (e.g. not mounted in the pod).
MIG_CAP_BASE = 3
MIG_CAPS_PER_GPU = 135  # 15 GIs x (1 GI access + 8 CI access)
MIG_MAX_GPUS = 32
MIG_CONTROL_MINORS = frozenset({0, 1, 2, MIG_CAP_BASE + MIG_CAPS_PER_GPU * MIG_MAX_GPUS})

# Dynamic majors by their exact /proc/devices name -> the role of every minor under them.
_NVIDIA_DYNAMIC = {
    "nvidia-uvm": DeviceKind.UVM,
    "nvidia-caps": DeviceKind.MIG,
    "nvidia-caps-imex-channels": DeviceKind.OTHER,
    "nvidia-nvlink": DeviceKind.OTHER,
    "nvidia-nvswitch": DeviceKind.OTHER,
}

MigMinors = dict[int, tuple[int, int | None, int | None]]

# Directories under /dev that hold a vendor's devices: part of the device's name as a prefix sees it.
_DEVICE_SUBDIRS = frozenset(("nvidia-caps", "dri"))

# Where a node made elsewhere is worth looking for. A stat of an open file is a getattr on its
# filesystem: a server round trip on these, and a hang when the server is dead (what fuser is
# known for), so files there are never stat'ed; nor on nodev mounts, where a node cannot be opened.
_REMOTE_FS = frozenset(("nfs", "nfs4", "cifs", "smb3", "ceph", "lustre", "gpfs", "glusterfs", "9p", "afs",
                        "beegfs", "fuse", "fuseblk", "davfs"))


def parse_proc_devices(text: str) -> dict[int, list[str]]:
    """Character-device section of /proc/devices: major -> names (195 carries several)."""
    out: dict[int, list[str]] = {}
    in_char = False
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.endswith(":"):
            in_char = line == "Character devices:"
            continue
        if not in_char:
            continue
        num, _, name = line.partition(" ")
        name = name.strip()
        if not num.isdigit() or not name:
            continue
        out.setdefault(int(num), []).append(name)
    return out


def parse_mig_minors(text: str) -> MigMinors:
    """/proc/driver/nvidia-caps/mig-minors: minor -> (gpu, gi, ci) for the per-GPU capabilities.

    `config` and `monitor` (and the nvlink/imex fabric lines) stand for no GPU and are left out;
    classify_mig_minor() knows them as node-wide control capabilities.
    """
    out: MigMinors = {}
    for raw in text.splitlines():
        parts = raw.split()
        if len(parts) != 2 or not parts[1].isdigit():
            continue
        name, minor = parts[0], int(parts[1])
        comps = name.split("/")
        if len(comps) < 2 or comps[-1] != "access" or not comps[0].startswith("gpu"):
            continue
        gpu = _int_after(comps[0], "gpu")
        gi = _int_after(comps[1], "gi") if len(comps) >= 3 else None
        ci = _int_after(comps[2], "ci") if len(comps) >= 4 else None
        if gpu is None or (len(comps) >= 3 and gi is None) or (len(comps) >= 4 and ci is None):
            continue
        out[minor] = (gpu, gi, ci)
    return out


def _int_after(text: str, prefix: str) -> int | None:
    rest = text[len(prefix) :] if text.startswith(prefix) else ""
    return int(rest) if rest.isdigit() else None


def classify_mig_minor(minor: int, mig_minors: MigMinors | None = None) -> tuple[DeviceKind, int | None]:
    """(kind, gpu_minor) of /dev/nvidia-caps/nvidia-cap<minor>; the table wins over the formula."""
    if mig_minors and minor in mig_minors:
        return DeviceKind.MIG, mig_minors[minor][0]
    if minor in MIG_CONTROL_MINORS:
        return DeviceKind.CONTROL, None
    if MIG_CAP_BASE <= minor < MIG_CAP_BASE + MIG_CAPS_PER_GPU * MIG_MAX_GPUS:
        return DeviceKind.MIG, (minor - MIG_CAP_BASE) // MIG_CAPS_PER_GPU
    return DeviceKind.OTHER, None


def _nvidia_minor_kind(minor: int) -> tuple[DeviceKind, int | None]:
    if 0 <= minor <= NVIDIA_MAX_GPU_MINOR:
        return DeviceKind.GPU, minor
    if minor in (NVIDIA_MODESET_MINOR, NVIDIACTL_MINOR):
        return DeviceKind.CONTROL, None
    return DeviceKind.OTHER, None


def classify_device_path(path: str, mig_minors: MigMinors | None = None) -> DeviceRef:
    """Role of a path already known to be a GPU device, from its name alone (no I/O, no symlinks).

    Only the file name (and, for channels, its directory) is looked at, so a prefix that is not
    under /dev (a test directory, a host mount) classifies the same way.
    """
    clean = path[: -len(" (deleted)")] if path.endswith(" (deleted)") else path
    parent, _, name = clean.rpartition("/")
    kind, gpu = _classify_name(name, parent.rpartition("/")[2], mig_minors)
    return DeviceRef(path=path, kind=kind, gpu_minor=gpu)


def _classify_name(name: str, parent: str, mig_minors: MigMinors | None) -> tuple[DeviceKind, int | None]:
    if name in ("nvidiactl", "nvidia-modeset", "kfd", "davinci_manager"):
        return DeviceKind.CONTROL, None
    if name in ("nvidia-uvm", "nvidia-uvm-tools"):
        return DeviceKind.UVM, None
    if name.startswith("nvidia-cap"):
        num = name[len("nvidia-cap") :]
        return classify_mig_minor(int(num), mig_minors) if num.isdigit() else (DeviceKind.OTHER, None)
    if name.startswith("nvidia"):
        num = name[len("nvidia") :]
        return _nvidia_minor_kind(int(num)) if num.isdigit() else (DeviceKind.OTHER, None)
    if name.startswith("renderD"):
        num = name[len("renderD") :]
        if num.isdigit() and int(num) >= DRM_RENDER_MINOR_BASE:
            return DeviceKind.GPU, int(num) - DRM_RENDER_MINOR_BASE
        return DeviceKind.OTHER, None
    if name.startswith("davinci"):
        num = name[len("davinci") :]
        return (DeviceKind.GPU, int(num)) if num.isdigit() else (DeviceKind.OTHER, None)
    # nvidia-caps-imex-channels/channelN, nvidia-nvlink, nvidia-nvswitch*: known, but no GPU role.
    return DeviceKind.OTHER, None


def outside_prefix(path: str, prefixes: tuple[str, ...]) -> str | None:
    """The device prefix that would cover `path`, a GPU device file by its name (the rules above) lying
    outside `prefixes`; None for any other path. Pure.

    What a chroot or another mount namespace looks like from outside: a device the holder opened as
    /dev/nvidia0 reads `/srv/chroot/dev/nvidia0` in /proc/PID/fd where that /dev is not reachable from
    the reader's root. The name's own directory (nvidia-caps/, dri/) is kept, and each prefix's tail
    (`nvidia` of /dev/nvidia, `dri/renderD` of /dev/dri/renderD) is tried against the rest, so only a
    device of a vendor the prefixes watch counts: a desktop's renderD128 does not, under NVIDIA's.
    """
    clean = path[: -len(" (deleted)")] if path.endswith(" (deleted)") else path
    if not clean.startswith("/") or clean.startswith(prefixes):
        return None
    parent_path, _, name = clean.rpartition("/")
    parent = parent_path.rpartition("/")[2]
    if _classify_name(name, parent, None)[0] is DeviceKind.OTHER:
        return None
    rel = f"{parent}/{name}" if parent in _DEVICE_SUBDIRS else name
    dev_dir = clean[: len(clean) - len(rel)]  # ends with "/"
    for prefix in prefixes:
        cut = prefix.find("/")
        while cut >= 0:
            tail = prefix[cut + 1 :]
            if tail and rel.startswith(tail):
                return dev_dir + tail
            cut = prefix.find("/", cut + 1)
    return None


def outside_prefix_hint(path: str, prefixes: tuple[str, ...], pid: int | None = None) -> str | None:
    """One line for a GPU device outside the prefixes (outside_prefix): which path, and what to do."""
    suggested = outside_prefix(path, prefixes)
    if suggested is None:
        return None
    held = f" (held by pid {pid})" if pid is not None else ""
    if len(prefixes) >= MAX_PREFIXES or not prefix_ok(suggested):
        also = (f" ({suggested} cannot be added as a device prefix: at most {MAX_PREFIXES} prefixes of at "
                "most 40 plain characters)")
    else:
        # --device-prefix replaces the vendor's prefixes: the flags name them all, this one added.
        flags = " ".join(f"--device-prefix {p}" for p in (*prefixes, suggested))
        also = f", or watch it there too with {flags}"
    return (f"{path}{held} looks like a GPU device outside the device prefixes ({', '.join(prefixes)}): "
            f"run the tracer on the host, not in a chroot or another mount namespace{also}")


def parse_mount_skips(text: str) -> dict[str, bool]:
    """/proc/PID/mountinfo -> mount point: True where open files are not stat'ed.

    That is remote/FUSE filesystems, and nodev mounts (a device node there cannot be opened).
    A later line over the same mount point wins: the later mount hides the earlier one.
    """
    mounts: dict[str, bool] = {}
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split(" ")
        if not sep or len(fields) < 6:
            continue
        fstype = right.split(" ", 1)[0]
        point = fields[4]
        for escaped, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
            point = point.replace(escaped, char)
        mounts[point] = fstype in _REMOTE_FS or fstype.startswith("fuse.") or "nodev" in fields[5].split(",")
    return mounts


def on_skipped_mount(path: str, mounts: dict[str, bool]) -> bool:
    """Whether the deepest mount point above `path` is one whose files are not stat'ed."""
    probe = path
    while probe:
        skip = mounts.get(probe)
        if skip is not None:
            return skip
        probe = probe[: probe.rfind("/")]
    return mounts.get("/", False)


class DeviceCatalog:
    """Decides whether a device file is a GPU device, by prefix or by rdev major, and classifies it."""

    def __init__(self, prefixes: tuple[str, ...], proc_root: str = "/proc") -> None:
        self.prefixes = tuple(prefixes)
        self.proc_root = proc_root
        # DRM major 226 is shared with every display GPU (Intel iGPUs, virtio): only count it when
        # the AMD render prefix was asked for.
        self.drm_render = any(p.startswith("/dev/dri/renderD") for p in self.prefixes)
        self.majors: dict[int, DeviceKind | str] = {}
        self.mig_minors: MigMinors = {}
        self.reload()

    def reload(self) -> None:
        """Re-read /proc/devices (dynamic majors change when a module is reloaded) and mig-minors."""
        majors: dict[int, DeviceKind | str] = {NVIDIA_MAJOR: "nvidia"}
        for major, names in parse_proc_devices(_read_text(f"{self.proc_root}/devices")).items():
            for name in names:
                if name in _NVIDIA_DYNAMIC:
                    majors[major] = _NVIDIA_DYNAMIC[name]
                elif major == NVIDIA_MAJOR and name.startswith("nvidia"):
                    majors[major] = "nvidia"
                elif name == "kfd":
                    majors[major] = DeviceKind.CONTROL
                elif "davinci" in name:
                    # Ascend majors/minors are not documented (docs/reference/nvidia-devices.md
                    # section 5): count the holder, but do not guess which NPU a minor stands for.
                    majors[major] = DeviceKind.OTHER
        if self.drm_render:
            majors[DRM_MAJOR] = "drm"
        self.majors = majors
        self.mig_minors = parse_mig_minors(_read_text(f"{self.proc_root}/driver/nvidia-caps/mig-minors"))

    def is_gpu_major(self, major: int) -> bool:
        return major in self.majors

    def classify_rdev(self, rdev: int) -> tuple[DeviceKind, int | None] | None:
        """(kind, gpu_minor) of a device number, or None when it is not a GPU device."""
        major, minor = os.major(rdev), os.minor(rdev)
        role = self.majors.get(major)
        if role is None:
            return None
        if role == "nvidia":
            return _nvidia_minor_kind(minor)
        if role == "drm":
            if minor < DRM_RENDER_MINOR_BASE:
                return None  # primary/control nodes: display, not compute
            return DeviceKind.GPU, minor - DRM_RENDER_MINOR_BASE
        if role == DeviceKind.MIG:
            return classify_mig_minor(minor, self.mig_minors)
        return DeviceKind(role), None

    def match(self, path: str, rdev: int | None = None) -> DeviceRef | None:
        """The DeviceRef of a device file, or None when it is not a GPU device."""
        major, minor = (os.major(rdev), os.minor(rdev)) if rdev else (None, None)
        by_rdev = self.classify_rdev(rdev) if rdev else None
        if by_rdev is not None:
            # The number wins over the name: a runtime may create /dev/nvidia0 in a container for
            # the host's GPU 3 (docs/reference/nvidia-devices.md: identify devices by i_rdev, not by path).
            return DeviceRef(path, by_rdev[0], by_rdev[1], major, minor)
        if path.startswith(self.prefixes):
            ref = classify_device_path(path, self.mig_minors)
            return DeviceRef(path, ref.kind, ref.gpu_minor, major, minor)
        return None

    def ref_for(self, path: str) -> DeviceRef:
        """A path the kernel side matched by prefix: a GPU device file even where match() (with this
        catalog's prefixes) would not say so."""
        return self.match(path) or classify_device_path(path, self.mig_minors)


def _read_text(path: str) -> str:
    """A whole /proc file, or "" when it is missing or unreadable (a driver not loaded is normal)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""
