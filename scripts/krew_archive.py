#!/usr/bin/env python3
"""Build the archive krew installs for `kubectl ghostgpu` (deploy/krew/ghostgpu.yaml), reproducibly.

The archive holds the launcher deploy/krew/kubectl-ghostgpu (a POSIX sh script that runs the plugin
from the installed ghostgpu package) and LICENSE when the repository has one. Its bytes depend only on
those files: entries sorted by name, mtime 0, owner and group 0 with no names, modes 0755 (the
launcher) and 0644, ustar headers (no pax records carrying times), and a gzip header with no name and
mtime 0. The deflate stream is zlib's at level 9 (1.2.13, Debian 12's): deflate's output is not
promised across zlib versions or forks, so a build elsewhere could differ, and --update-manifest then
refreshes the sha256. The sha256 in the manifest is checked by rebuilding (tests/unit/test_krew.py).

    python3 scripts/krew_archive.py [--out PATH] [--update-manifest]

prints the archive's path and sha256; --update-manifest writes the sha256 into the manifest.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import re
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "deploy" / "krew" / "ghostgpu.yaml"
ARCHIVE_NAME = "kubectl-ghostgpu.tar.gz"
DEFAULT_OUT = REPO / "build" / "krew" / ARCHIVE_NAME
_SHA256_LINE = re.compile(r"^(\s*sha256:\s*)\S+\s*$", re.M)


def members(repo: Path = REPO) -> list[tuple[str, bytes, int]]:
    """(name in the archive, content, mode) of each file; archive_bytes orders them."""
    out = [("kubectl-ghostgpu", (repo / "deploy" / "krew" / "kubectl-ghostgpu").read_bytes(), 0o755)]
    if (repo / "LICENSE").is_file():
        out.append(("LICENSE", (repo / "LICENSE").read_bytes(), 0o644))
    return out


def archive_bytes(entries: list[tuple[str, bytes, int]]) -> bytes:
    """The .tar.gz of `entries`, byte for byte the same for the same entries."""
    tar_buf = io.BytesIO()
    with tarfile.open(fileobj=tar_buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data, mode in sorted(entries):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.type = tarfile.REGTYPE
            tar.addfile(info, io.BytesIO(data))
    gz_buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=gz_buf, compresslevel=9, mtime=0) as gz:
        gz.write(tar_buf.getvalue())
    return gz_buf.getvalue()


def build(out: Path = DEFAULT_OUT, repo: Path = REPO) -> str:
    """Write the archive to `out`; its sha256 (hex)."""
    data = archive_bytes(members(repo))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(out)
    return hashlib.sha256(data).hexdigest()


def update_manifest(sha256: str, manifest: Path = MANIFEST) -> None:
    text = manifest.read_text()
    new, count = _SHA256_LINE.subn(lambda m: m.group(1) + sha256, text)
    if count == 0:
        raise SystemExit(f"{manifest}: no `sha256:` line to update")
    manifest.write_text(new)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"where to write it (default {DEFAULT_OUT})")
    parser.add_argument("--update-manifest", action="store_true",
                        help=f"write the sha256 into {MANIFEST.relative_to(REPO)}")
    args = parser.parse_args(argv)
    sha256 = build(args.out)
    if args.update_manifest:
        update_manifest(sha256)
    print(f"{args.out} sha256 {sha256}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
