"""The package's import layers (docs/architecture.md): every import goes down, none closes a cycle.

Every module of `gift_compile` (its layer subpackages), `gift_compile.passes` and
`gift_compile.torchtitan_ext` is parsed with `ast`; every `import` / `from ... import` counts,
wherever it stands: at module level, inside a function (a function-level import that dodges a
cycle still is one) and inside `if TYPE_CHECKING:` (a type a lower layer needs from a higher
one belongs lower, or comes in as a small Protocol; annotations go down like code does).

An import edge `a -> b` is fine when `b`'s layer is `a`'s or below it; within one layer the
modules must still form no cycle (strongly connected components of the whole graph). Only the
import statements written in a module count: the parent packages Python imports on the way
(`gift_compile/__init__.py` for any `gift_compile.x.y`) do not.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Import name -> source folder (pyproject.toml's package-dir: passes/ and torchtitan_ext/ are
# subpackages of gift_compile by their import names).
PACKAGES = {"gift_compile": ROOT / "gift_compile", "gift_compile.passes": ROOT / "passes",
            "gift_compile.torchtitan_ext": ROOT / "torchtitan_ext"}

# The layers, lowest first; a module belongs to the layer of its longest listed prefix.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("codec", ("gift_compile.codec",)),
    ("kernels", ("gift_compile.kernels",)),
    ("base", ("gift_compile.config", "gift_compile.sync", "gift_compile.torch_release")),
    ("geometry", ("gift_compile.geometry",)),
    ("exchange", ("gift_compile.exchange",)),
    ("runtime", ("gift_compile.runtime",)),
    ("frameworks", ("gift_compile.frameworks",)),
    ("passes", ("gift_compile.passes",)),
    ("api", ("gift_compile.api", "gift_compile")),
    ("torchtitan", ("gift_compile.torchtitan_ext",)),
)


def layer_index(module: str) -> int:
    """Position of `module`'s layer in `LAYERS` (raises for a module no layer lists)."""
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), i)
    if best is None:
        raise KeyError(f"{module} is in no layer of tests/test_layers.py's LAYERS")
    return best[1]


def modules_under(folder: Path, package: str) -> dict[str, Path]:
    """Dotted name -> file of every module under `folder` (imported as `package`)."""
    modules = {}
    for path in sorted(folder.rglob("*.py")):
        parts = list(path.relative_to(folder).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join([package, *parts])] = path
    return modules


def package_modules() -> dict[str, Path]:
    """Every module of the three packages: dotted name -> file."""
    return {m: p for package, folder in PACKAGES.items() for m, p in modules_under(folder, package).items()}


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """Candidate dotted names an import statement in `module` reaches."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join([*base, node.module] if node.module else base)
    else:
        source = node.module or ""
    # `from pkg import name` reaches the submodule `pkg.name` when there is one, else `pkg`.
    return [f"{source}.{alias.name}" for alias in node.names] + [source]


def import_graph(modules: Mapping[str, Path]) -> dict[str, dict[str, int]]:
    """`module -> {imported module: line}` for imports between `modules` (all of them: module
    level, function level and `if TYPE_CHECKING`)."""
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = _imported(node, module, path.name == "__init__.py")
            if isinstance(node, ast.ImportFrom) and any(n in modules for n in names[:-1]):
                names = names[:-1]  # `from pkg import submodule`: the submodule, not pkg's __init__
            for name in names:
                while name and name not in modules:  # `import a.b.c` of a name inside a.b
                    name = name.rpartition(".")[0]
                if name and name != module:
                    edges.setdefault(name, node.lineno)
    return graph


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph.get(root, ())))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph.get(nxt, ()))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def layer_violations(graph: Mapping[str, Mapping[str, int]], layer_of: Callable[[str], int]) -> list[str]:
    """Every upward import (`a -> b` with `b` in a higher layer than `a`) and every cycle,
    each named by its modules."""
    problems = [f"upward import {a} -> {b} (line {line})"
                for a, edges in sorted(graph.items()) for b, line in sorted(edges.items())
                if layer_of(b) > layer_of(a)]
    for component in cycles(graph):
        members = set(component)
        edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a]) if b in members]
        problems.append(f"import cycle among {', '.join(component)}: {'; '.join(edges)}")
    return problems


def test_every_module_has_a_layer():
    unlisted = []
    for module in package_modules():
        try:
            layer_index(module)
        except KeyError:
            unlisted.append(module)
    assert not unlisted


def test_imports_only_go_down_and_close_no_cycle():
    problems = layer_violations(import_graph(package_modules()), layer_index)
    assert not problems, "\n".join(problems)


def test_the_checker_reports_an_upward_import_and_a_cycle(tmp_path):
    """A synthetic package: `low.a` imports `high.b` inside a function (upward), `high.b` and
    `high.c` import each other (one under TYPE_CHECKING): a cycle inside one layer."""
    files = {
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from pkg.high import b\n    return b\n",
        "high/__init__.py": "",
        "high/b.py": "from pkg.high.c import C\nimport pkg.low\n",
        "high/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import f\nclass C: ...\n",
    }
    modules = {}
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        name = ".".join(["pkg", *Path(rel).with_suffix("").parts])
        modules[name.removesuffix(".__init__")] = path
    graph = import_graph(modules)
    assert graph["pkg.low.a"] == {"pkg.high.b": 2}
    assert graph["pkg.high.b"] == {"pkg.high.c": 1, "pkg.low": 2}
    assert graph["pkg.high.c"] == {"pkg.high.b": 3}
    problems = layer_violations(graph, lambda m: 1 if m.startswith("pkg.high") else 0)
    assert problems[0] == "upward import pkg.low.a -> pkg.high.b (line 2)"
    assert len(problems) == 2 and problems[1].startswith("import cycle among pkg.high.b, pkg.high.c:")
    assert "pkg.high.b -> pkg.high.c" in problems[1] and "pkg.high.c -> pkg.high.b" in problems[1]
    # ...and a three-module cycle across a longer path is one component.
    assert cycles({"x": ["y"], "y": ["z"], "z": ["x"], "w": ["x"]}) == [["x", "y", "z"]]
