"""The package layering: no import cycle between kvrelay's modules, counting every import (top level,
inside functions, and under ``TYPE_CHECKING``), and no module loaded by name through importlib."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("benchmarks", "decode", "deploy", "engine", "kernels", "kvrelay", "kvstore", "model", "node", "prefill",
            "router", "transfer")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _graph(mods: dict[str, Path]) -> tuple[dict[str, set[str]], set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    dynamic = set()
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
                dynamic.add(name)
            # `kvrelay.engine.x` is the module of engine/x.py (the folders install under kvrelay: pyproject.toml)
            targets = [t.removeprefix("kvrelay.") if t.removeprefix("kvrelay.") in mods else t for t in targets]
            edges[name].update(t for t in targets if t in mods and t != name)
    return edges, dynamic


def _cycles(edges: dict[str, set[str]], nodes: list[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_cycles_and_no_importlib() -> None:
    mods = _modules()
    assert len(mods) > 100 and "engine.kv_policy" in mods and "kvstore.lmdb_writer" in mods
    edges, dynamic = _graph(mods)
    assert "engine.h2o" in edges["engine.kv_policy"]  # the graph sees real edges
    assert _cycles(edges, sorted(mods)) == []
    assert dynamic == set()


def test_the_cycle_finder_finds_a_cycle() -> None:
    edges: dict[str, set[str]] = defaultdict(set, {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert _cycles(edges, ["a", "b", "c", "d"]) == [["a", "b", "c"]]


def test_every_import_of_a_package_goes_through_kvrelay() -> None:
    """``from engine.engine import ...`` would load a second copy of the module beside ``kvrelay.engine.engine`` (in a
    source tree both resolve): its classes, patches and loggers would not be the ones the rest of the code uses."""
    bare = []
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")] + list((ROOT / "tests").rglob("*.py"))
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                     else [])
            bare += [f"{path.relative_to(ROOT)}: {n}" for n in names
                     if n.split(".")[0] in PACKAGES and n.split(".")[0] != "kvrelay"]
    assert bare == []
