"""The tests' container images, built here with no registry: a docker-save tarball for `ctr import`.

One layer (Debian's busybox-static as /bin/busybox, its applets as symlinks, a minimal /etc)
serves two images: BUSYBOX_IMAGE (entrypoint sh) and PAUSE_IMAGE (entrypoint `sleep inf`, the
sandbox image, so containerd never tries to pull registry.k8s.io/pause). Every tar member has a
fixed mtime and owner, so the digests are the same on every run.

An `ImageVariant` is one more image on that layer plus a second one holding its own files (such as
the static gpucalls at /bin/gpucalls): `write_image_tar(..., variants=[v], base=False)` writes a
tarball with just it; the two base images and their digests stay exactly what they were.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass

BUSYBOX_IMAGE = "docker.io/local/busybox:test"
PAUSE_IMAGE = "docker.io/local/pause:test"
BUSYBOX_PATH = "/bin/busybox"
APPLETS = ("sh", "sleep", "cat", "ls", "echo", "true", "false", "ps", "kill", "id", "env", "head", "grep",
           "readlink", "mkdir", "rm", "touch")
MTIME = 1_700_000_000  # fixed: stable layer digest


def _member(name: str, kind: bytes, mode: int, size: int = 0, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.linkname = kind, mode, size, link
    info.mtime, info.uid, info.gid, info.uname, info.gname = MTIME, 0, 0, "root", "root"
    return info


def build_layer(busybox_path: str = BUSYBOX_PATH) -> bytes:
    """layer.tar: bin/busybox (0755), applet symlinks, empty system dirs, /etc/passwd and group."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for d in ("bin", "dev", "etc", "proc", "root", "sys", "tmp"):
            tar.addfile(_member(d, tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755))
        with open(busybox_path, "rb") as f:
            data = f.read()
        tar.addfile(_member("bin/busybox", tarfile.REGTYPE, 0o755, len(data)), io.BytesIO(data))
        for applet in APPLETS:
            tar.addfile(_member(f"bin/{applet}", tarfile.SYMTYPE, 0o777, link="busybox"))
        for name, text in (("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n"), ("etc/group", "root:x:0:\n")):
            raw = text.encode()
            tar.addfile(_member(name, tarfile.REGTYPE, 0o644, len(raw)), io.BytesIO(raw))
    return buf.getvalue()


@dataclass(frozen=True)
class ImageVariant:
    """An image of the busybox layer plus one layer of `files`: (path in the image, host file), each
    copied with mode 0755 (its directories are made 0755), e.g. ("bin/gpucalls", "/.../gpucalls")."""

    tag: str
    files: tuple[tuple[str, str], ...]
    entrypoint: tuple[str, ...] = ("/bin/sh",)


def build_files_layer(files: Sequence[tuple[str, str]]) -> bytes:
    """layer.tar of these files (and the directories above them), fixed mtime and owner."""
    buf = io.BytesIO()
    dirs: set[str] = set()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for image_path, host_path in files:
            name = image_path.strip("/")
            parts = name.split("/")[:-1]
            for depth in range(1, len(parts) + 1):
                d = "/".join(parts[:depth])
                if d not in dirs:
                    dirs.add(d)
                    tar.addfile(_member(d, tarfile.DIRTYPE, 0o755))
            with open(host_path, "rb") as f:
                data = f.read()
            tar.addfile(_member(name, tarfile.REGTYPE, 0o755, len(data)), io.BytesIO(data))
    return buf.getvalue()


def _config(goarch: str, layer_sha: str, entrypoint: list[str], more_layers: Sequence[str] = ()) -> bytes:
    return json.dumps({
        "architecture": goarch, "os": "linux", "created": "2023-11-14T22:13:20Z",
        "config": {"Entrypoint": entrypoint, "Env": ["PATH=/bin"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{sha}" for sha in (layer_sha, *more_layers)]},
    }, sort_keys=True).encode()


def write_image_tar(path: str, goarch: str, busybox_path: str = BUSYBOX_PATH,
                    variants: Sequence[ImageVariant] = (), base: bool = True) -> None:
    """docker-save layout: manifest.json, one config JSON per image, <layer sha>/layer.tar. `base`:
    the busybox and pause images; `variants`: the images on their layer plus one of their own."""
    layer = build_layer(busybox_path)
    layer_sha = hashlib.sha256(layer).hexdigest()
    layers: dict[str, bytes] = {layer_sha: layer}
    files: dict[str, bytes] = {}
    manifest = []

    def add(tag: str, entrypoint: list[str], more_layers: Sequence[str] = ()) -> None:
        config = _config(goarch, layer_sha, entrypoint, more_layers)
        config_name = hashlib.sha256(config).hexdigest() + ".json"
        files[config_name] = config
        manifest.append({"Config": config_name, "RepoTags": [tag],
                         "Layers": [f"{sha}/layer.tar" for sha in (layer_sha, *more_layers)]})

    if base:
        for tag, entrypoint in ((BUSYBOX_IMAGE, ["/bin/sh"]), (PAUSE_IMAGE, ["/bin/sleep", "inf"])):
            add(tag, entrypoint)
    for variant in variants:
        extra = build_files_layer(variant.files)
        extra_sha = hashlib.sha256(extra).hexdigest()
        layers[extra_sha] = extra
        add(variant.tag, list(variant.entrypoint), [extra_sha])
    files["manifest.json"] = json.dumps(manifest).encode()
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for sha, data in layers.items():
            tar.addfile(_member(sha, tarfile.DIRTYPE, 0o755))
            tar.addfile(_member(f"{sha}/layer.tar", tarfile.REGTYPE, 0o644, len(data)), io.BytesIO(data))
        for name, data in files.items():
            tar.addfile(_member(name, tarfile.REGTYPE, 0o644, len(data)), io.BytesIO(data))
