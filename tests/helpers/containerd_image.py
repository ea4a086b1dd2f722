"""The tests' container images, built here with no registry: a docker-save tarball for `ctr import`.

One layer (Debian's busybox-static as /bin/busybox, its applets as symlinks, a minimal /etc)
serves two images: BUSYBOX_IMAGE (entrypoint sh) and PAUSE_IMAGE (entrypoint `sleep inf`, the
sandbox image, so containerd never tries to pull registry.k8s.io/pause). Every tar member has a
fixed mtime and owner, so the digests are the same on every run.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

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


def _config(goarch: str, layer_sha: str, entrypoint: list[str]) -> bytes:
    return json.dumps({
        "architecture": goarch, "os": "linux", "created": "2023-11-14T22:13:20Z",
        "config": {"Entrypoint": entrypoint, "Env": ["PATH=/bin"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_sha}"]},
    }, sort_keys=True).encode()


def write_image_tar(path: str, goarch: str, busybox_path: str = BUSYBOX_PATH) -> None:
    """docker-save layout: manifest.json, one config JSON per image, <layer sha>/layer.tar."""
    layer = build_layer(busybox_path)
    layer_sha = hashlib.sha256(layer).hexdigest()
    files: dict[str, bytes] = {f"{layer_sha}/layer.tar": layer}
    manifest = []
    for tag, entrypoint in ((BUSYBOX_IMAGE, ["/bin/sh"]), (PAUSE_IMAGE, ["/bin/sleep", "inf"])):
        config = _config(goarch, layer_sha, entrypoint)
        config_name = hashlib.sha256(config).hexdigest() + ".json"
        files[config_name] = config
        manifest.append({"Config": config_name, "RepoTags": [tag], "Layers": [f"{layer_sha}/layer.tar"]})
    files["manifest.json"] = json.dumps(manifest).encode()
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        tar.addfile(_member(layer_sha, tarfile.DIRTYPE, 0o755))
        for name, data in files.items():
            tar.addfile(_member(name, tarfile.REGTYPE, 0o644, len(data)), io.BytesIO(data))
