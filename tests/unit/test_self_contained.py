"""The repository stands alone: no tracked file points outside the clone, and every reference page
a file names exists.

The facts the code relies on live in docs/reference/ (each page citing its upstream sources) and the
vectors built from them in tests/data/; a path into a folder beside the clone or into one machine's
layout works on that machine only.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "docs" / "reference"
# Built from pieces so that this file does not match its own patterns.
FORBIDDEN = ("../" + "shared", "shared" + "/reference", "/" + "work/")
# Where the tree walk (no git) does not look: environments, build outputs, caches.
_UNTRACKED_DIRS = {".git", ".venv", "venv", "build", "__pycache__", ".pytest_cache", ".ruff_cache",
                   "node_modules"}
_REFERENCE_LINK = re.compile(r"docs/reference/([\w.-]+\.md)")
_MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")


def tracked_files() -> list[Path]:
    """`git ls-files` (tracked files that exist); without git, every file outside build and env dirs."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=30)
        names = [n for n in out.stdout.decode("utf-8", "surrogateescape").split("\0") if n]
    except (OSError, subprocess.SubprocessError):
        names = []
        for root, dirs, files in os.walk(REPO):
            dirs[:] = [d for d in dirs if d not in _UNTRACKED_DIRS and not d.endswith(".egg-info")]
            names += [os.path.relpath(os.path.join(root, f), REPO) for f in files]
    return [REPO / n for n in sorted(names) if (REPO / n).is_file()]


def text_of(path: Path) -> str | None:
    """The file as text, or None for a binary file (a NUL byte, or not UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


# The tracked files, and the reference pages and test data even before they are committed.
FILES = sorted(set(tracked_files()) | set(REFERENCE.glob("*.md")) | set((REPO / "tests" / "data").glob("*")))
TEXTS = {p: t for p in FILES if (t := text_of(p)) is not None}


def test_the_file_list_is_real() -> None:
    rel = {p.relative_to(REPO).as_posix() for p in FILES}
    assert {"README.md", "DEVELOPERS.md", "tracer/cgroup.py", "tests/data/cgroup_vectors.json"} <= rel
    assert len(TEXTS) > 50


def test_no_file_points_outside_the_repository() -> None:
    hits = [
        f"{path.relative_to(REPO)}:{lineno}: {line.strip()[:120]}"
        for path, text in TEXTS.items()
        for lineno, line in enumerate(text.splitlines(), 1)
        if any(bad in line for bad in FORBIDDEN)
    ]
    assert not hits, (f"{len(hits)} line(s) point outside the clone ({', '.join(FORBIDDEN)}); cite "
                      "docs/reference/ or tests/data/ instead:\n" + "\n".join(hits))


def test_every_reference_link_resolves() -> None:
    named = {
        (path.relative_to(REPO).as_posix(), page)
        for path, text in TEXTS.items()
        for page in _REFERENCE_LINK.findall(text)
    }
    assert named, "no file names a docs/reference page"
    missing = sorted(f"{where} -> docs/reference/{page}" for where, page in named
                     if not (REFERENCE / page).is_file())
    assert not missing, "links to reference pages that do not exist:\n" + "\n".join(missing)


PAGES = sorted(REFERENCE.glob("*.md"))


def test_the_reference_pages_exist() -> None:
    names = {p.name for p in PAGES}
    assert names >= {"README.md", "cgroup-paths.md", "nvidia-devices.md", "nvidia-ioctl-abi.md",
                     "cri-and-podresources.md", "containerd-test-recipe.md", "alertmanager-api.md"}


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_reference_page_links_resolve(page: Path) -> None:
    """Relative links inside a reference page (to other pages, protos, test data) point at files."""
    broken = []
    for target in _MARKDOWN_LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+://", target) or target.startswith("#"):
            continue
        if not (page.parent / target.split("#", 1)[0]).exists():
            broken.append(target)
    assert not broken, f"{page.name}: broken links {broken}"


@pytest.mark.parametrize("page", [p for p in PAGES if p.name != "README.md"],
                         ids=[p.name for p in PAGES if p.name != "README.md"])
def test_reference_page_cites_upstream_and_is_indexed(page: Path) -> None:
    text = page.read_text()
    assert re.search(r"^## Sources$", text, re.M), f"{page.name} has no '## Sources' section"
    assert f"]({page.name})" in (REFERENCE / "README.md").read_text(), f"{page.name} is not in the index"
