"""The modules of ccoll import each other without a cycle.

The graph is read from the source with ``ast``: every ``import`` and ``from ... import``
statement counts, at module level or inside a function (a lazy import still ties the two
modules together), relative or absolute. ``from ccoll.x import y`` is an edge to
``ccoll.x.y`` when ``y`` is a submodule, else to ``ccoll.x``. Importing a submodule runs
its parent packages' ``__init__`` too, but that is not counted: otherwise every package
whose ``__init__`` re-exports its submodules would be a cycle.
"""

from __future__ import annotations

import ast
import os
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def modules_of(pkg_dir: Path) -> dict[str, Path]:
    """Map every module name of the package at ``pkg_dir`` to its file."""
    base = pkg_dir.parent
    mods: dict[str, Path] = {}
    for path in sorted(pkg_dir.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def import_graph(pkg_dir: Path) -> dict[str, set[str]]:
    """Edges ``module -> imported module`` between the modules of one package."""
    mods = modules_of(pkg_dir)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        here = mod if is_pkg else mod.rpartition(".")[0]  # the package relative imports use
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in mods:
                        graph[mod].add(alias.name)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    pkg = here.split(".")
                    if node.level > 1:
                        pkg = pkg[: len(pkg) - (node.level - 1)]
                    target = ".".join(pkg + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in mods:
                        graph[mod].add(sub)
                    elif target in mods:
                        graph[mod].add(target)
    for mod in graph:
        graph[mod].discard(mod)  # `from . import x` inside x's own package __init__ is no cycle
    return graph


def tangles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected groups of two or more modules (each module reaches each)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return groups


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) through each strongly connected group of modules."""
    found = []
    for group in tangles(graph):
        start = min(group)
        # Shortest way back to start inside the group (breadth-first), printed as a path.
        prev: dict[str, str] = {}
        frontier = [start]
        while start not in prev:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & group):
                    if w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        path = [start]
        v = prev[start]
        while v != start:
            path.append(v)
            v = prev[v]
        path.append(start)
        found.append(path[::-1])
    return found


def test_ccoll_modules_import_each_other_without_a_cycle():
    graph = import_graph(ROOT / "ccoll")
    found = cycles(graph)
    assert not found, "import cycles between ccoll's modules:\n" + "\n".join(
        f"  {' -> '.join(c)}\n    (all modules of this tangle: {', '.join(sorted(t))})"
        for c, t in zip(found, tangles(graph), strict=True)
    )


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text), encoding="utf-8")
    return root / "pkg"


def test_reader_sees_every_kind_of_import(tmp_path):
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "from pkg.api import run\n",
        "pkg/api.py": "from pkg import sub\nimport pkg.util\nimport os\n",
        "pkg/util.py": "def f():\n    from .sub import deep\n",
        "pkg/sub/__init__.py": "from . import deep\n",
        "pkg/sub/deep.py": "from ..util import f\nfrom .. import api\n",
    })
    g = import_graph(pkg)
    assert g == {
        "pkg": {"pkg.api"},
        "pkg.api": {"pkg.sub", "pkg.util"},
        "pkg.util": {"pkg.sub.deep"},  # inside a function, relative, a submodule
        "pkg.sub": {"pkg.sub.deep"},
        "pkg.sub.deep": {"pkg.util", "pkg.api"},
    }
    assert cycles(g) == [["pkg.api", "pkg.sub", "pkg.sub.deep", "pkg.api"]]


def test_no_cycle_is_reported_for_a_tree(tmp_path):
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "from pkg import a, b\n",
        "pkg/a.py": "from pkg.b import x\n",
        "pkg/b.py": "x = 1\n",
    })
    assert cycles(import_graph(pkg)) == []


def test_every_ccoll_module_is_read():
    mods = modules_of(ROOT / "ccoll")
    on_disk = {
        os.path.relpath(p, ROOT) for p in (ROOT / "ccoll").rglob("*.py")
    }
    assert {os.path.relpath(p, ROOT) for p in mods.values()} == on_disk
    assert "ccoll.compressor.api" in mods and "ccoll" in mods
