#!/usr/bin/env python3
"""Type-check the installed package `ghostgpu` with mypy, every module under the name it is imported by.

    python scripts/typecheck.py [MYPY ARGS...]   # settings: pyproject.toml's [tool.mypy]

mypy cannot follow setuptools' editable finder, which maps tracer/, collector/ and cli/ in as
ghostgpu.tracer, ghostgpu.collector and ghostgpu.cli (pyproject's package-dir). So the installed
layout is laid out as symlinks under build/typecheck/ghostgpu (remade on every run: a new module needs
no step), mypy checks the package there, and each line it prints names the file's path in the checkout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "ghostgpu"
TREE = Path("build") / "typecheck"  # relative to ROOT, as pyproject's mypy_path names it


def package_map(pyproject: dict, root: Path) -> dict[str, Path]:
    """Each subpackage's name under ghostgpu -> its folder in the checkout (the installed layout)."""
    mapped = pyproject["tool"]["setuptools"]["package-dir"]
    out = {p.name: p for p in sorted((root / PACKAGE).iterdir()) if p.name != "__pycache__"}
    for name, folder in mapped.items():
        head, _, sub = name.partition(".")
        if head != PACKAGE or not sub or "." in sub:
            raise SystemExit(f"typecheck: package-dir {name!r}: only ghostgpu.NAME is mapped here")
        out[sub] = root / folder
    return out


def lay_tree(tree: Path, links: dict[str, Path]) -> None:
    """Make tree/ghostgpu hold exactly one symlink per entry of `links`."""
    pkg = tree / PACKAGE
    pkg.mkdir(parents=True, exist_ok=True)
    for old in pkg.iterdir():
        if old.name not in links or not old.is_symlink() or old.readlink() != links[old.name]:
            old.unlink()
    for name, target in links.items():
        if not (pkg / name).is_symlink():
            (pkg / name).symlink_to(target)


def checkout_paths(line: str, links: dict[str, Path], root: Path) -> str:
    """mypy's line with a path under the link tree rewritten to the file's path in the checkout."""
    for name, target in links.items():
        prefix = f"{TREE / PACKAGE / name}"
        if line.startswith(prefix):
            return f"{target.relative_to(root)}{line[len(prefix):]}"
    return line


def main(argv: list[str]) -> int:
    with open(ROOT / "pyproject.toml", "rb") as f:
        links = package_map(tomllib.load(f), ROOT)
    lay_tree(ROOT / TREE, links)
    proc = subprocess.run([sys.executable, "-m", "mypy", "-p", PACKAGE, *argv], cwd=ROOT,
                          stdout=subprocess.PIPE, text=True, env={**os.environ, "MYPY_FORCE_COLOR": "0"})
    for line in proc.stdout.splitlines():
        print(checkout_paths(line, links, ROOT))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
