"""The import structure of the five packages, read from the source with ``ast`` (nothing imported).

Rules, and why:

* **Leaves never import omni_grpo**, not even for type hints. omni-extract, omni-rope,
  omni-audio-inject and omni-rollout-client are separate distributions that pip-install, test and
  type-check alone; omni-grpo finds them, never the other way round.
* **rollout, sync and backends do not import each other.** ``omni_grpo.rollout``,
  ``omni_grpo.sync`` and ``omni_grpo.backends`` meet only in the loop (``trainer.py`` and
  ``loop/``) and in the shared rooms below them (``types``, ``aio``, ``sglang``, ``data``,
  ``models``, ``algo``).
* **No import cycle inside a package.** Imports inside functions count (a lazy import that closes
  a loop is still a loop: it only moves the failure to run time), and so do imports under
  ``if TYPE_CHECKING:``: they never run, but a module typed by another is read through it, so a
  loop of them leaves no floor to start reading from (``omni_grpo.config`` once reached the data
  loader, which reached the rewards, which are typed by the config). An edge goes to the module
  named, not to the packages above it.
* **No import circle between the floors of omni_grpo.** A floor is a first-level subpackage
  (``omni_grpo.config``, ``omni_grpo.models``, ``omni_grpo.exact``, ...) or a top-level module
  (``omni_grpo.types``, ``omni_grpo.dataset_spec``); an import between two modules is an edge
  between their floors, counted as in the module cycle rule (inside functions and under
  ``if TYPE_CHECKING:`` too). With no circle the floors stack: each can be read, tested and
  changed knowing only the floors below it (the config is the ground floor and imports nothing
  of ``data``; ``exact`` is installed onto ``models`` from above and ``models`` imports nothing
  of it).
* **No cross-module import of a private name.** ``from m import _name`` is refused unless it is the
  module itself; a private *module* (``_mcore.py``) is private to its package: it may be imported
  from inside the package that holds it (its siblings and their subpackages), never from outside.
  Dunder names are not private. Applies to the packages' sources and to ``benchmarks/``; tests may
  reach into what they test.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LEAVES = ("omni_extract", "omni_rope", "omni_audio_inject", "omni_rollout_client")
APART = ("omni_grpo.rollout", "omni_grpo.sync", "omni_grpo.backends")


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, tuple[Path, bool]]:
    """Every first-party module: name -> (file, is a package ``__init__``)."""
    out: dict[str, tuple[Path, bool]] = {}
    for src in sorted(ROOT.glob("packages/*/src")):
        for path in sorted(src.rglob("*.py")):
            out[_module_name(path, src)] = (path, path.name == "__init__.py")
    return out


MODULES = _sources()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.AST, typing: bool = False):  # type: ignore[no-untyped-def]
    """Import nodes that can run (everything but the body of ``if TYPE_CHECKING:``); with
    ``typing``, that body's as well."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if not typing and isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


@functools.cache
def imports_of(module: str, typing: bool = False) -> list[tuple[str, str | None, int]]:
    """``(imported module, imported name or None, line)`` for each runtime import of ``module``
    (with ``typing``, each import under ``if TYPE_CHECKING:`` too)."""
    path, is_package = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[tuple[str, str | None, int]] = []
    for node in _runtime_imports(tree, typing):
        if isinstance(node, ast.Import):
            out += [(alias.name, None, node.lineno) for alias in node.names]
            continue
        base = _base(module, is_package, node)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            # ``from pkg import mod`` imports the module ``pkg.mod``; otherwise a name of ``pkg``.
            if sub in MODULES:
                out.append((sub, None, node.lineno))
            else:
                out.append((base, alias.name, node.lineno))
    return out


def _first_party(name: str) -> bool:
    return name.split(".")[0] in {m.split(".")[0] for m in MODULES}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _where(module: str, line: int) -> str:
    return f"{MODULES[module][0].relative_to(ROOT)}:{line}"


def test_the_sources_were_found() -> None:
    tops = {m.split(".")[0] for m in MODULES}
    assert tops == {*LEAVES, "omni_grpo"}, tops
    assert "omni_grpo.trainer" in MODULES and "omni_rope.positions" in MODULES


def test_no_leaf_imports_omni_grpo() -> None:
    bad = [
        f"{_where(m, line)}: {m} imports {target}"
        for m in MODULES
        if m.split(".")[0] in LEAVES
        for target, _, line in imports_of(m, typing=True)
        if _within(target, "omni_grpo")
    ]
    assert not bad, "\n".join(bad)


def test_rollout_sync_and_backends_do_not_import_each_other() -> None:
    bad = []
    for m in MODULES:
        own = [room for room in APART if _within(m, room)]
        if not own:
            continue
        for target, _, line in imports_of(m):
            for other in APART:
                if other != own[0] and _within(target, other):
                    bad.append(f"{_where(m, line)}: {m} imports {target}")
    assert not bad, "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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


def _graph_within_packages() -> tuple[dict[str, set[str]], dict[tuple[str, str], int]]:
    """Module -> the modules of its own package it imports (type-only imports too), and the
    line of each edge's first import."""
    graph: dict[str, set[str]] = defaultdict(set)
    lines: dict[tuple[str, str], int] = {}
    for m in MODULES:
        graph[m]
        for target, _, line in imports_of(m, typing=True):
            if target in MODULES and target != m and target.split(".")[0] == m.split(".")[0]:
                graph[m].add(target)
                lines.setdefault((m, target), line)
    return graph, lines


def test_no_import_cycle_inside_any_package() -> None:
    graph, lines = _graph_within_packages()
    report = []
    for cycle in _cycles(graph):
        members = set(cycle)
        ties = [
            f"  {_where(a, lines[(a, b)])}: {a} -> {b}"
            for a in cycle
            for b in sorted(graph[a] & members)
        ]
        report.append("cycle " + " / ".join(cycle) + "\n" + "\n".join(ties))
    assert not report, "\n".join(report)


def _floor(module: str) -> str:
    """``omni_grpo.models.thinker`` -> ``omni_grpo.models``; a top-level module is its own floor."""
    return ".".join(module.split(".")[:2])


def _floor_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], list[str]]]:
    """Floor of omni_grpo -> the floors it imports (type-only and function-local imports too),
    and every import behind each edge."""
    graph: dict[str, set[str]] = defaultdict(set)
    ties: dict[tuple[str, str], list[str]] = defaultdict(list)
    for m in MODULES:
        if not _within(m, "omni_grpo"):
            continue
        here = _floor(m)
        graph[here]
        for target, _, line in imports_of(m, typing=True):
            if target in MODULES and _within(target, "omni_grpo") and _floor(target) != here:
                graph[here].add(_floor(target))
                tie = f"{_where(m, line)}: {m} -> {target}"
                if tie not in ties[(here, _floor(target))]:  # ``from m import a, b``: once
                    ties[(here, _floor(target))].append(tie)
    return graph, ties


def test_no_import_circle_between_the_floors_of_omni_grpo() -> None:
    graph, ties = _floor_graph()
    assert {"omni_grpo.config", "omni_grpo.data", "omni_grpo.models", "omni_grpo.exact"} <= set(
        graph
    )
    report = []
    for cycle in _cycles(graph):
        members = set(cycle)
        edges = [
            f"  {tie}" for a in cycle for b in sorted(graph[a] & members) for tie in ties[(a, b)]
        ]
        report.append("circle " + " / ".join(cycle) + "\n" + "\n".join(edges))
    assert not report, "\n".join(report)


def _private_module_owner(target: str) -> str | None:
    """The package a private module belongs to (``a.b._c`` -> ``a.b``), if ``target`` is one."""
    parts = target.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def _benchmark_imports() -> list[tuple[str, str, str | None, int]]:
    out = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _runtime_imports(tree):
            if isinstance(node, ast.Import):
                out += [
                    (str(path.relative_to(ROOT)), a.name, None, node.lineno) for a in node.names
                ]
            elif node.module and not node.level:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    name = None if sub in MODULES else a.name
                    target = sub if sub in MODULES else node.module
                    out.append((str(path.relative_to(ROOT)), target, name, node.lineno))
    return out


def test_no_private_name_is_imported_across_modules() -> None:
    uses = [
        (_where(m, line), m, target, name) for m in MODULES for target, name, line in imports_of(m)
    ]
    uses += [
        (f"{where}:{line}", "", target, name) for where, target, name, line in _benchmark_imports()
    ]
    bad = []
    for where, importer, target, name in uses:
        if not _first_party(target):
            continue
        private = name and name.startswith("_") and not name.startswith("__")
        if private and target != importer:
            bad.append(f"{where}: imports private name {name} from {target}")
        owner = _private_module_owner(target)
        if owner is not None and not (importer and _within(importer, owner)):
            bad.append(f"{where}: imports {target}, private to {owner}")
    assert not bad, "\n".join(bad)
