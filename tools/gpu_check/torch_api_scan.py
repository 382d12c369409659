"""Which torch APIs the code names, and whether the torch running this finds each of them.

Run under the oldest torch the project supports (2.11, the GPU boxes'), an API added after it is
an unresolved name here. What it covers: every `torch.a.b` attribute chain (through import aliases
such as `nn`, `F`, `from torch.x import y`) and every `import torch.x` / `from torch.x import y`
in the scanned files, resolved against the running torch by getattr and import. A use inside a
`try:` body, or under an `if` whose test reads `hasattr`, `getattr` or a version, counts as
guarded (it may be missing; the code has a fallback). What it does not cover: methods called on
tensors or modules (`x.new_api()`), names built from strings, and changed signatures or
behaviour of APIs that exist in both versions (the kit's other parts run those on the box).
"""

from __future__ import annotations

import ast
import importlib
from dataclasses import dataclass, field
from pathlib import Path

GUARD_WORDS = ("hasattr", "getattr", "version")


@dataclass
class ScanResult:
    uses: int = 0
    missing: list[str] = field(default_factory=list)  # unguarded uses the running torch lacks
    guarded_missing: list[str] = field(default_factory=list)  # guarded, and lacking here (fine)
    guarded: int = 0  # uses under a guard
    names: set[str] = field(default_factory=set)  # every dotted torch name used, unguarded


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    try:
        value = importlib.import_module(parts[0])
    except ImportError:
        return False
    for index, name in enumerate(parts[1:], start=1):
        try:
            value = getattr(value, name)
            continue
        except AttributeError:
            pass
        try:
            value = importlib.import_module(".".join(parts[:index + 1]))
        except ImportError:
            return False
    return True


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> the torch path it stands for, from the file's imports (any depth)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch" or alias.name.startswith("torch."):
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == "torch" or node.module.startswith("torch.")):
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def _chain(node: ast.Attribute) -> tuple[str, list[str]] | None:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return node.id, names[::-1]
    return None


def _guarded(parents: list[ast.AST], source: str) -> bool:
    for parent in parents:
        if isinstance(parent, ast.Try) and parent.handlers:
            return True
        if isinstance(parent, (ast.If, ast.IfExp, ast.BoolOp)):
            test = ast.get_source_segment(source, parent.test if not isinstance(parent, ast.BoolOp) else parent) or ""
            if any(word in test for word in GUARD_WORDS):
                return True
    return False


def scan_file(path: Path, result: ScanResult, root: Path) -> None:
    source = path.read_text()
    tree = ast.parse(source)
    aliases = _aliases(tree)
    where = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)

    def record(dotted: str, node: ast.AST, parents: list[ast.AST]) -> None:
        result.uses += 1
        guarded = _guarded(parents, source)
        result.guarded += guarded
        if not guarded:
            result.names.add(dotted)
        if not _resolves(dotted):
            (result.guarded_missing if guarded else result.missing).append(f"{where}:{node.lineno}: {dotted}")

    def visit(node: ast.AST, parents: list[ast.AST]) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torch."):
                    record(alias.name, node, parents)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == "torch" or node.module.startswith("torch.")):
            for alias in node.names:
                record(f"{node.module}.{alias.name}", node, parents)
        elif isinstance(node, ast.Attribute):
            chain = _chain(node)
            if chain and chain[0] in aliases:
                record(".".join([aliases[chain[0]], *chain[1]]), node, parents)
                return  # the longest chain only (its prefixes resolve when it does)
        for child in ast.iter_child_nodes(node):
            visit(child, [node, *parents])

    visit(tree, [])


def scan(paths: list[Path], root: Path) -> ScanResult:
    result = ScanResult()
    for path in paths:
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for file in files:
            scan_file(file, result, root)
    return result
