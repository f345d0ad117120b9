"""The package's structure: no import cycle between its modules, and the floors that
keep its layers apart (the format knows nothing of distribution, the engine nothing of
torch, the tracer is a leaf).  Read from the source with :mod:`ast`, function-level
imports included (a lazy import is still a dependency); imports under
``if TYPE_CHECKING:`` are for annotations only and do not count."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import forebay

SRC = Path(forebay.__file__).parent


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for p in SRC.rglob("*.py"):
        parts = list(p.relative_to(SRC.parent).with_suffix("").parts)
        init = parts[-1] == "__init__"
        out[".".join(parts[:-1] if init else parts)] = (p, init)
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for b in node.body for n in ast.walk(b)}
    return skip


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports.  An import of a module's own package
    (``from . import x`` in a submodule) is its facade, not an edge."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, (path, init) in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_only(tree)
        here = mod.split(".") if init else mod.split(".")[:-1]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] +
                                    ([node.module] if node.module else []))
                elif (node.module or "").split(".")[0] == "forebay":
                    base = node.module or ""
                else:
                    continue
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in mods else base)
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.split(".")[0] == "forebay"]
            for t in targets:
                if t in mods and t != mod and not mod.startswith(t + "."):
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_cycle_and_a_facade_is_not_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    g = import_graph()
    assert "forebay.trace._writer" in g["forebay.trace._recorder"]   # a real edge is seen
    assert "forebay.trace" not in g["forebay.trace._recorder"]       # its facade is not


def test_no_import_cycle_between_the_packages_modules():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


#: package -> packages it must never import (the floors)
NEVER = {
    "forebay.dataset": ("forebay.store", "forebay.comm", "forebay.torch", "forebay.reduce",
                        "forebay.models", "forebay.sim", "forebay.plan"),
    "forebay.store": ("forebay.torch", "forebay.reduce", "forebay.models", "forebay.sim"),
    "forebay.trace": ("forebay.dataset", "forebay.store", "forebay.torch", "forebay.plan",
                      "forebay.reduce", "forebay.models", "forebay.sim", "forebay.comm"),
    "forebay.plan": ("forebay.store", "forebay.torch", "forebay.comm"),
}


@pytest.mark.parametrize("package", sorted(NEVER))
def test_a_floor_is_never_crossed(package):
    graph = import_graph()
    bad = sorted(f"{m} -> {t}" for m, ts in graph.items()
                 if m == package or m.startswith(package + ".")
                 for t in ts for never in NEVER[package]
                 if t == never or t.startswith(never + "."))
    assert not bad, f"{package} imports what it must not: " + ", ".join(bad)


def test_no_module_over_600_lines_without_its_reason():
    """Issue V: one responsibility per file; a module above ~600 lines says why in its
    docstring ("Over 600 lines on purpose: ...")."""
    long = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        doc = ast.get_docstring(ast.parse(text)) or ""
        if text.count("\n") > 600 and "Over 600 lines on purpose" not in doc:
            long.append(f"{path.relative_to(SRC)} ({text.count(chr(10))} lines)")
    assert not long, "modules over 600 lines with no stated reason: " + ", ".join(long)
