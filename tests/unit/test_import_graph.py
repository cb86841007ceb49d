"""The import graph of rlstack/ and megatron_bridge/: no circles, and the training path imports no
command-line module.

Every module is parsed with `ast`; an edge is any import statement in it, at the top or inside a
function (a lazy import still ties the two modules together), except those under
`if TYPE_CHECKING:`, which never run. `from a import b` is an edge to `a.b` when that is a module.
"""

from __future__ import annotations

import ast
import os
import re
from collections import deque

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("rlstack", "megatron_bridge")
# The command-line modules (`python -m ...`) the training path must not import.
CLI = re.compile(r"(^|\.)(verify\w*|plan)$")
TRAINING_ENTRY = "rlstack.loop"
# Circles allowed for now, each with the reason; empty since the rollout interface moved out of
# rollout/base.py and verify_engine out of the verify command line.
KNOWN_CIRCLES: list[set[str]] = []


def product_modules(root: str = ROOT) -> dict[str, str]:
    """Dotted module name -> file path, for every .py file of the packages."""
    found = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(root, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    dotted = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                    found[dotted.removesuffix(".__init__")] = path
    return found


def _runtime_imports(tree: ast.AST):
    """Import nodes anywhere in the tree, skipping `if TYPE_CHECKING:` bodies."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imports_of(name: str, path: str, modules: dict[str, str]) -> set[str]:
    """The product modules that module `name` (at `path`) imports."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    targets = set()
    for node in _runtime_imports(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        if node.level:  # relative: from .x import y
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module
        for alias in node.names:
            sub = f"{source}.{alias.name}"
            targets.add(sub if sub in modules else source)
    return {t for t in targets if t in modules and t != name}


def import_graph(root: str = ROOT) -> dict[str, set[str]]:
    modules = product_modules(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> b -> ... -> a) for every strongly connected group of two or more modules."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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
            visit(v)
    return [_cycle_in(graph, group) for group in groups]


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    start = min(group)
    path = _path(graph, start, lambda v: start in graph[v], within=group)
    return path + [start]


def _path(graph, start: str, is_goal, within=None) -> list[str]:
    """Shortest import path from `start` to a module where `is_goal` holds (breadth first)."""
    previous = {start: None}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        if is_goal(v) and (v != start or start in graph[v]):
            path = [v]
            while previous[path[-1]] is not None:
                path.append(previous[path[-1]])
            return path[::-1]
        for w in sorted(graph[v]):
            if w not in previous and (within is None or w in within):
                previous[w] = v
                queue.append(w)
    return []


def test_the_graph_sees_lazy_relative_and_submodule_imports(tmp_path):
    pkg = tmp_path / "rlstack"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from rlstack.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from .c import x\n")
    (pkg / "sub" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import rlstack.a\nimport rlstack.a as a\n"
    )
    graph = import_graph(str(tmp_path))
    assert graph["rlstack.a"] == {"rlstack.sub.b"}
    assert graph["rlstack.sub.b"] == {"rlstack.sub.c"}
    assert graph["rlstack.sub.c"] == {"rlstack.a"}
    assert circles(graph) == [["rlstack.a", "rlstack.sub.b", "rlstack.sub.c", "rlstack.a"]]


def test_no_import_circles():
    found = [c for c in circles(import_graph()) if set(c) not in KNOWN_CIRCLES]
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_training_path_imports_no_command_line_module():
    graph = import_graph()
    reached = set()
    queue = deque([TRAINING_ENTRY])
    while queue:
        v = queue.popleft()
        if v not in reached:
            reached.add(v)
            queue.extend(graph[v])
    assert len(reached) > 20  # the trainer, its workers, the bridge
    bad = sorted(m for m in reached if CLI.search(m))
    paths = [" -> ".join(_path(graph, TRAINING_ENTRY, lambda v, m=m: v == m)) for m in bad]
    assert not bad, "the training path imports command-line modules:\n" + "\n".join(paths)
