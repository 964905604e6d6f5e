"""The import graph of a package read from its source with ``ast`` (every ``import`` statement, also inside
functions, except under ``if TYPE_CHECKING:``) and its cycles: shared by tests/test_import_cycles.py (dinopipe)
and tests/curation/test_import_graph.py (curation)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _modules(root: Path, pkg: str) -> dict[str, Path]:
    mods = {}
    for path in sorted((root / pkg).rglob("*.py")):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(tree: ast.AST):
    """Every import statement, also inside functions, except under ``if TYPE_CHECKING:``."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _targets(mod: str, is_pkg: bool, node, mods: dict) -> set[str]:
    """Modules of the package an import statement loads (``from .x import y``: x, and x.y when it is a module)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in mods}
    if node.level:
        base = mod if is_pkg else mod.rpartition(".")[0]
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        target = f"{base}.{node.module}" if node.module else base
    else:
        target = node.module or ""
    out = {target} if target in mods else set()
    return out | {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods}


def import_graph(root: Path = REPO, pkg: str | tuple[str, ...] = "dinopipe") -> dict[str, set[str]]:
    """Module -> the modules it imports. ``pkg``: one package, or several read as one graph (edges between them
    included: a cycle through dinopipe and curation is found too)."""
    mods = {m: p for one in ((pkg,) if isinstance(pkg, str) else pkg) for m, p in _modules(root, one).items()}
    graph = {}
    for mod, path in mods.items():
        deps = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            deps |= _targets(mod, path.name == "__init__.py", node, mods)
        # a package's own __init__ is loaded before any of its submodules: not an edge back
        graph[mod] = {d for d in deps if d != mod and not mod.startswith(d + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            u, children = work[-1]
            v = next(children, None)
            if v is not None:
                if v not in index:
                    index[v] = low[v] = len(index)
                    stack.append(v)
                    on_stack.add(v)
                    work.append((v, iter(sorted(graph.get(v, ())))))
                elif v in on_stack:
                    low[u] = min(low[u], index[v])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[u])
            if low[u] == index[u]:
                group = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.add(w)
                    if w == u:
                        break
                if len(group) > 1:
                    out.append(frozenset(group))
    return out
