"""The house (ARCHITECTURE.md): floors, imports only downward, no cycles, one installed name.

    ghostgpu.cli (cli/)               the commands: entry point, client, views, up, demo
    ghostgpu.tracer | ghostgpu.collector   the node tracer and the collector, never each other
    ghostgpu.common (and ghostgpu)    the shared floor, in rooms: wire, web
                                      over model, transport, audit
                                      over system
    ghostgpu.v1, ghostgpu.k8s         generated code

Every import counts: at module level, inside a function (lazy), or under TYPE_CHECKING. The walk
reads the source with ast, so it needs no import of anything it checks.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Package -> folder, as pyproject.toml's package-dir maps them.
ROOTS = {"ghostgpu": REPO / "ghostgpu", "ghostgpu.tracer": REPO / "tracer",
         "ghostgpu.collector": REPO / "collector",
         "ghostgpu.cli": REPO / "cli"}
FLOORS = {"generated": 0, "common": 1, "tracer": 2, "collector": 2, "cli": 3}
# The shared floor's rooms (ghostgpu/common/*/): a room imports only rooms on a lower level, never one
# beside it, so model, transport and audit each read on their own. system (the process and its files:
# fd limit, file modes, the YAML loader, the file watcher) is under them all.
ROOMS = {"system": 0, "model": 1, "transport": 1, "audit": 1, "wire": 2, "web": 2}


def modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for package, folder in ROOTS.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if package == "ghostgpu" and parts[:1] in (["tracer"], ["collector"], ["cli"]):
                continue
            out[name] = path
    return out


MODULES = modules()


def side(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "common"  # the package itself: __version__ only
    return {"v1": "generated", "k8s": "generated", "common": "common", "tracer": "tracer",
            "collector": "collector", "cli": "cli"}[parts[1]]


def imports(module: str, path: Path) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import of a ghostgpu module, resolved to a known module."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x / from .. import y
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name.startswith("ghostgpu") and name != module:
                yield node.lineno, name


GRAPH = {m: sorted({target for _, target in imports(m, p)}) for m, p in MODULES.items()}


def test_every_module_is_found() -> None:
    assert {"ghostgpu.cli.main", "ghostgpu.common.model.consumers", "ghostgpu.tracer.agent",
            "ghostgpu.collector.main", "ghostgpu.v1.stream_pb2"} <= MODULES.keys()
    mapped = ("tracer", "collector", "cli")
    assert not [m for m in MODULES if m.split(".")[1:2] and m.split(".")[1] in mapped
                and not MODULES[m].is_relative_to(REPO / m.split(".")[1])]


def test_the_shared_floor_is_only_rooms() -> None:
    """ghostgpu/common holds rooms (packages), no loose modules: a newcomer sees six rooms."""
    loose = sorted(p.name for p in (REPO / "ghostgpu/common").glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules outside a room in ghostgpu/common: {loose}"
    assert {p.parent.name for p in (REPO / "ghostgpu/common").glob("*/__init__.py")} == set(ROOMS)


def room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["ghostgpu", "common"] and len(parts) > 3 else None


@pytest.mark.parametrize("module", sorted(m for m in MODULES if room(m)))
def test_rooms_import_only_lower_rooms(module: str) -> None:
    here = room(module)
    assert here is not None
    bad = []
    for line, target in imports(module, MODULES[module]):
        there = room(target)
        if there is not None and there != here and ROOMS[there] >= ROOMS[here]:
            where = MODULES[module].relative_to(REPO)
            bad.append(f"{where}:{line}: {module} ({here}) imports {target} ({there})")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_only_run_down(module: str) -> None:
    here = side(module)
    bad = []
    for line, target in imports(module, MODULES[module]):
        there = side(target)
        sideways = {here, there} == {"tracer", "collector"}
        if FLOORS[there] > FLOORS[here] or sideways:
            where = MODULES[module].relative_to(REPO)
            bad.append(f"{where}:{line}: {module} ({here}) imports {target} ({there})")
    assert not bad, "\n".join(bad)


def test_no_import_cycles() -> None:
    """Tarjan's strongly connected components over every import edge."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)
