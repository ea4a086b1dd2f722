"""ARCHITECTURE.md and DEVELOPERS.md name every module, and every path and module they name exists.

A module counts as named when either doc writes its repository path (`tracer/agent.py`) or its
dotted name (`ghostgpu.tracer.agent`); a package (`__init__.py`) also by its folder (`cli/`,
`ghostgpu/common/model/`). The generated code (ghostgpu/v1, ghostgpu/k8s) is named as a whole, not
module by module, so only the hand-written folders are walked. The other way round, a path the docs
write (a file, a folder or a glob) must match something in the repository, and a dotted
`ghostgpu.…` name must be a module, a package or a name defined at the top of one.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = ("ARCHITECTURE.md", "DEVELOPERS.md")
TEXT = "\n".join((REPO / doc).read_text() for doc in DOCS)
# Hand-written code, folder -> the package it installs as (pyproject.toml's package-dir).
WALKED = {"tracer": "ghostgpu.tracer", "collector": "ghostgpu.collector", "cli": "ghostgpu.cli",
          "ghostgpu/common": "ghostgpu.common"}
# Top-level folders whose paths the docs may write.
TOP = ("tracer", "collector", "cli", "ghostgpu", "bpf", "proto", "tests", "bench", "scripts", "deploy",
       "docs")
PATH = re.compile(rf"(?<![\w/.-])(?:{'|'.join(TOP)})/[\w./*-]*")
DOTTED = re.compile(r"(?<![\w/.-])ghostgpu(?:\.[a-z_]\w*)+")


def walked() -> dict[str, str]:
    """Repository path -> dotted name, for every hand-written module."""
    out: dict[str, str] = {}
    for folder, package in WALKED.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[path.relative_to(REPO).as_posix()] = ".".join([package, *parts])
    return out


MODULES = walked()


def is_named(path: str, dotted: str) -> bool:
    spellings = [rf"(?<![\w/.-]){re.escape(path)}(?![\w/])"]
    if path.endswith("/__init__.py"):
        folder = path.removesuffix("__init__.py")
        spellings.append(rf"(?<![\w/.-]){re.escape(folder)}(?![\w.*])")
        spellings.append(rf"(?<![\w/.-]){re.escape(dotted)}(?![\w]|\.\w)")  # the package, not a child
    else:
        spellings.append(rf"(?<![\w/.-]){re.escape(dotted)}(?!\w)")  # .attr after it still names it
    return any(re.search(s, TEXT) for s in spellings)


def test_the_walk_finds_the_modules() -> None:
    assert {"tracer/agent.py", "collector/main.py", "cli/main.py", "ghostgpu/common/model/consumers.py",
            "ghostgpu/common/__init__.py"} <= MODULES.keys()
    assert MODULES["cli/main.py"] == "ghostgpu.cli.main"
    assert MODULES["ghostgpu/common/model/__init__.py"] == "ghostgpu.common.model"


@pytest.mark.parametrize("path", sorted(MODULES))
def test_every_module_is_named_in_the_docs(path: str) -> None:
    assert is_named(path, MODULES[path]), (
        f"{path} ({MODULES[path]}) is named in neither ARCHITECTURE.md nor DEVELOPERS.md: "
        "add it to DEVELOPERS.md's layout table with one line on what it holds")


def named_paths() -> list[str]:
    return sorted({m.group().rstrip(".,:;") for m in PATH.finditer(TEXT)})


def test_every_path_the_docs_name_exists() -> None:
    paths = named_paths()
    assert "tracer/agent.py" in paths and "cli/" in paths
    missing = [p for p in paths if not (any(REPO.glob(p)) if "*" in p else (REPO / p).exists())]
    assert not missing, f"ARCHITECTURE.md / DEVELOPERS.md name paths that do not exist: {missing}"


def module_file(dotted: str) -> Path | None:
    """The file or folder of a ghostgpu module or package, None when there is none."""
    parts = dotted.split(".")
    if parts[1:2] and parts[1] in ("tracer", "collector", "cli"):
        base, rest = REPO / parts[1], parts[2:]
    else:
        base, rest = REPO / "ghostgpu", parts[1:]
    target = base.joinpath(*rest)
    if target.with_suffix(".py").is_file():
        return target.with_suffix(".py")
    if target.is_dir():
        return target
    return None


def top_level_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def resolves(dotted: str) -> bool:
    if module_file(dotted) is not None:
        return True
    parent, _, attr = dotted.rpartition(".")
    where = module_file(parent)
    return where is not None and where.is_file() and attr in top_level_names(where)


def test_every_dotted_name_the_docs_name_exists() -> None:
    names = sorted({m.group() for m in DOTTED.finditer(TEXT)})
    assert "ghostgpu.common" in names
    missing = [n for n in names if not resolves(n)]
    assert not missing, f"ARCHITECTURE.md / DEVELOPERS.md name modules that do not exist: {missing}"
