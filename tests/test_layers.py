"""The package is a DAG of layers, read from its imports (``ast``).

Each module may import only from a lower layer or from its own unit (the
first name under ``lmcache_mp``), and never another unit's private module
(a name that starts with ``_`` below the unit). Imports under ``if
TYPE_CHECKING:`` are for annotations only and are not counted: nothing
runs them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lmcache_mp

ROOT = Path(lmcache_mp.__file__).parent

#: The layers, lowest first. Units on one line may not import each other.
LAYERS: list[set[str]] = [
    {"_util"},
    {"errors"},
    {"cache_kind"},
    {"metrics"},
    {"kv"},
    {"_core"},
    {"stream", "request", "hints"},
    {"engine", "edits"},
    {"executors"},
    {"batch"},
    {"_harness"},
    {"bench", "eval"},
    {"__main__", "__init__"},
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str:
    """The unit of ``lmcache_mp.X.Y``: ``X`` (``__init__`` for the package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path, root: Path) -> str:
    """The dotted name of the module at ``path`` in the package at ``root``."""
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
        if len(parts) == 1:
            return "lmcache_mp"
    return ".".join(parts)


def imports(path: Path, package: str, root: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of each lmcache_mp import in a file, relative ones
    resolved; ``from X import name`` counts as ``X.name`` when that is a
    module."""
    found = []
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for inner in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            base = node.module
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], base])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                is_module = (root.parent / sub.replace(".", "/")).with_suffix(
                    ".py"
                ).exists() or (
                    root.parent / sub.replace(".", "/") / "__init__.py"
                ).exists()
                found.append((node.lineno, sub if is_module else base))
    return [
        (line, m)
        for line, m in found
        if m == "lmcache_mp" or m.startswith("lmcache_mp.")
    ]


def violations(root: Path = ROOT) -> list[str]:
    """Every import against the layers or into another unit's private module."""
    bad: list[str] = []
    for path in sorted(root.rglob("*.py")):
        me = module_name(path, root)
        package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
        mine = unit_of(me) if me != "lmcache_mp" else "__init__"
        for line, target in imports(path, package, root):
            theirs = unit_of(target)
            where = f"{path.relative_to(root.parent)}:{line}: {me} imports {target}"
            if theirs == mine:
                continue
            found = []
            if RANK[theirs] >= RANK[mine]:
                found.append(f"{where} (layer {theirs} is not below {mine})")
            below = target.split(".")[2:]
            if any(part.startswith("_") for part in below):
                found.append(f"{where} (a private module of {theirs})")
            bad += [f for f in found if f not in bad]
    return bad


def test_every_unit_has_a_layer() -> None:
    """Each top-level module and subpackage of lmcache_mp is placed."""
    units = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()}
    units = {u for u in units if u != "__pycache__" and u != "py"}
    units.discard("py.typed")
    assert units <= set(RANK), units - set(RANK)


def test_no_import_goes_up_or_into_another_units_private_module() -> None:
    """The package's imports follow the layers, and no unit reaches into
    another's private modules."""
    bad = violations()
    assert not bad, "\n".join(bad)


def test_an_upward_import_is_caught(tmp_path: Path) -> None:
    """The check is live: a kv module importing the batch is reported."""
    fake = tmp_path / "lmcache_mp"
    (fake / "kv").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "kv" / "__init__.py").write_text("")
    (fake / "kv" / "store.py").write_text("from lmcache_mp.batch import X\n")
    (fake / "batch.py").write_text("")
    bad = violations(fake)
    assert len(bad) == 1 and "layer batch is not below kv" in bad[0]
