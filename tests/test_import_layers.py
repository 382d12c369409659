"""The packages under modules/ and ui/ form layers: a package imports only from the layers below
it, counting imports made inside functions (a lazy import still ties the two packages together).
So no two packages import each other, and each can be read, tested and changed knowing only
what lies below it. The layers are listed here, lowest first; a new package takes its place in
the list.

Imports under `if TYPE_CHECKING:` are left out: they never run, and they are how a lower layer
names the type of a caller that hands itself down (a training method is given its trainer).
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# lowest first; "modules" is the files directly in modules/ (errors.py)
LAYERS = ["modules", "quantization", "util", "loading", "config", "sampling", "model", "saving", "adapters",
          "data", "optim", "offload", "methods", "plan", "trainer", "cli", "remote", "ui"]

# Upward imports being removed by the declared-union work of issue 31 (the adapter config union's
# metaclass, the family registry read by the config, the optimizer trait tables): each entry is
# (importing module, imported module). An entry that no longer exists fails the test below, so the
# list only shrinks.
PENDING: set[tuple[str, str]] = set()


def package_of(module: str) -> str:
    """modules.trainer.preflight -> trainer, modules.errors -> modules, ui.tabs.run -> ui."""
    parts = module.split(".")
    if parts[0] == "modules":
        return parts[1] if len(parts) > 1 and (ROOT / "modules" / parts[1]).is_dir() else "modules"
    return parts[0]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level == 0:
        return [node.module]
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return [".".join(base + ([node.module] if node.module else []))]


def _imports_in(tree: ast.AST, module: str, is_package: bool):
    """(line, imported module) of every import in the file that can run, at any depth."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        for name in _imported(node, module, is_package):
            yield node.lineno, name
        stack.extend(ast.iter_child_nodes(node))


def project_imports() -> list[tuple[str, int, str, str]]:
    """(file, line, importing module, imported module) for each import of a project module by another package."""
    found = []
    for top in ("modules", "ui"):
        for path in sorted((ROOT / top).rglob("*.py")):
            relative = path.relative_to(ROOT)
            is_package = path.name == "__init__.py"
            module = ".".join(relative.parent.parts if is_package else relative.with_suffix("").parts)
            for line, name in _imports_in(ast.parse(path.read_text(), str(relative)), module, is_package):
                if name.split(".")[0] in ("modules", "ui") and package_of(name) != package_of(module):
                    found.append((str(relative), line, module, name))
    return found


def test_every_package_has_a_layer():
    packages = {package_of(m) for _, _, m, _ in project_imports()} | {
        path.parent.name for path in (ROOT / "modules").glob("*/__init__.py")}
    assert sorted(packages - set(LAYERS)) == [], "a new package: give it its place in LAYERS"


def test_no_package_imports_a_higher_layer():
    upward = [f"{file}:{line} ({package_of(importer)}) imports {name} ({package_of(name)})"
              for file, line, importer, name in project_imports()
              if LAYERS.index(package_of(name)) > LAYERS.index(package_of(importer)) and (importer, name) not in PENDING]
    assert upward == [], "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_import_cycle_between_packages():
    graph: dict[str, set[str]] = {}
    for _, _, importer, name in project_imports():
        if (importer, name) not in PENDING:
            graph.setdefault(package_of(importer), set()).add(package_of(name))
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as cycle:
        raise AssertionError(f"packages import each other: {' -> '.join(cycle.args[1])}") from None


def test_pending_upward_imports_still_exist():
    """The allow-list shrinks: an upward import that was removed leaves it."""
    present = {(importer, name) for _, _, importer, name in project_imports()}
    assert sorted(PENDING - present) == [], "removed upward imports: drop them from PENDING"
