"""The import rule of the layered package (ARCHITECTURE.md, "The rule"), over every import statement.

The same table as pyproject's ``[tool.importlinter]`` contracts, checked by walking the AST of every module
under src/hyperdcp, function-level imports included (a lazy import is still an arrow):

* imports go down the layers only; siblings of one layer (``a | b``) do not import each other;
* only hyperdcp.adapters.*, hyperdcp.coordination.torch_dist, hyperdcp.coordination.jax_dist,
  hyperdcp.coordination.mindspore_dist, hyperdcp.tools.convert_torch_dcp (writing
  torch DCP checkpoints) and hyperdcp.cli.demo import torch, jax or mindspore (imports under ``if TYPE_CHECKING:``
  are exempt);
* hyperdcp.planning and hyperdcp.format import neither hyperdcp.storage nor hyperdcp.coordination.

``KNOWN`` lists the arrows of modules that are still being moved into the tree; the test fails on any new
violation and on any listed arrow that no longer exists, so the list only shrinks.
"""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "hyperdcp"

#: top to bottom; a tuple is one layer of independent siblings
LAYERS: list[tuple[str, ...]] = [
    ("cli",),
    ("manager", "torch"),
    ("retention",),
    ("api",),
    ("async_saving", "tools"),
    ("saving", "loading"),
    ("results",),
    ("sources", "adapters"),
    ("planning",),
    ("storage", "coordination"),
    ("format",),
    ("core",),
    ("options",),
    ("errors", "_runtime"),
]
FRAMEWORKS = ("torch", "jax", "mindspore")
FRAMEWORK_HOMES = ("hyperdcp.adapters", "hyperdcp.coordination.torch_dist", "hyperdcp.coordination.jax_dist",
                   "hyperdcp.coordination.mindspore_dist", "hyperdcp.cli.demo",
                   "hyperdcp.tools.convert_torch_dcp")
PURE = ("hyperdcp.planning", "hyperdcp.format")
IMPURE = ("hyperdcp.storage", "hyperdcp.coordination")
#: the package's front door and its entry points sit above every layer
ROOT = {"hyperdcp", "hyperdcp.__main__", "hyperdcp._version"}

#: modules of the old flat layout that other parts of issue 12 are moving into the tree (or turning into
#: deprecated shims); their arrows are not checked against the layers until they have a place
UNPLACED = {
    "hyperdcp.async_save", "hyperdcp.async_save.file_coordination", "hyperdcp.async_save.rank_files",
    "hyperdcp.demo", "hyperdcp.exchange", "hyperdcp.hf", "hyperdcp.logs", "hyperdcp.path_identity",
    "hyperdcp.shm", "hyperdcp.verify",
}

#: arrows that break the rule today, each to be removed by the step of ARCHITECTURE.md named with it
KNOWN: set[tuple[str, str]] = set()


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(path: pathlib.Path) -> bool:
    return path.name == "__init__.py"


def _exists(dotted: str) -> bool:
    p = SRC.joinpath(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file() or p.is_dir()


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Line numbers of statements inside ``if TYPE_CHECKING:`` blocks."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            t = node.test
            name = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                for stmt in node.body:
                    for sub in ast.walk(stmt):
                        if hasattr(sub, "lineno"):
                            out.add(sub.lineno)
    return out


def imports_of(path: pathlib.Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement of one file, function-level ones included."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_lines(tree)
    me = _module_name(path)
    base = me.split(".") if _is_package(path) else me.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                stem = base[: len(base) - node.level + 1]
                mod = ".".join(stem + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((mod, node.lineno))
            for a in node.names:  # ``from . import numpy``: the submodule itself is the target
                if mod.startswith("hyperdcp") and _exists(f"{mod}.{a.name}"):
                    out.append((f"{mod}.{a.name}", node.lineno))
    return out


def _layer(mod: str) -> tuple[int, str] | None:
    parts = mod.split(".")
    if len(parts) < 2 or parts[0] != "hyperdcp":
        return None
    for i, names in enumerate(LAYERS):
        if parts[1] in names:
            return i, parts[1]
    return None


def _placed(mod: str) -> bool:
    return mod not in ROOT and not any(mod == u or mod.startswith(u + ".") for u in UNPLACED)


def violations() -> list[tuple[str, str, str]]:
    """(importer, imported, why) for every import that breaks the rule (one per pair of modules)."""
    seen: dict[tuple[str, str], str] = {}
    for path in sorted(PKG.rglob("*.py")):
        me = _module_name(path)
        for target, line in imports_of(path):
            top = target.split(".")[0]
            if top in FRAMEWORKS:
                if not any(me == h or me.startswith(h + ".") for h in FRAMEWORK_HOMES):
                    seen.setdefault((me, top), f"{me}:{line} imports {target} (frameworks only in adapters)")
                continue
            if top != "hyperdcp" or not _placed(me) or not _placed(target):
                continue
            a, b = _layer(me), _layer(target)
            if a is None or b is None or a[1] == b[1]:
                continue  # inside one package
            if any(me.startswith(p) for p in PURE) and any(target.startswith(p) for p in IMPURE):
                seen.setdefault((me, target), f"{me}:{line} imports {target} (planning/format do no I/O)")
            elif a[0] >= b[0]:
                how = "a sibling" if a[0] == b[0] else "a higher layer"
                seen.setdefault((me, target), f"{me}:{line} imports {target} ({how})")
    return [(k[0], k[1], why) for k, why in seen.items()]


def _known(importer: str, imported: str) -> bool:
    return any(importer.startswith(a) and (imported == b or imported.startswith(b + ".")) for a, b in KNOWN)


def test_imports_go_down_the_layers_only():
    new = [why for a, b, why in violations() if not _known(a, b)]
    assert not new, "imports against the layers of ARCHITECTURE.md:\n" + "\n".join(sorted(new))


def test_every_known_violation_still_exists():
    """A fixed arrow must leave KNOWN, so that it cannot come back unnoticed."""
    found = violations()
    stale = [k for k in KNOWN if not any(a.startswith(k[0]) and (b == k[1] or b.startswith(k[1] + "."))
                                         for a, b, _ in found)]
    assert not stale, f"fixed: remove from KNOWN: {sorted(stale)}"


def test_every_module_has_a_layer():
    homeless = sorted(m for m in map(_module_name, PKG.rglob("*.py")) if _placed(m) and _layer(m) is None)
    assert not homeless, f"modules outside the layers of ARCHITECTURE.md: {homeless}"
    assert all(_exists(u) for u in UNPLACED), f"moved: remove from UNPLACED: {[u for u in UNPLACED if not _exists(u)]}"


def test_the_checker_sees_function_level_and_relative_imports(tmp_path):
    """The walk itself: a lazy upward import inside a function is an arrow, ``if TYPE_CHECKING`` is not."""
    src = PKG / "core" / "_probe_for_test.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
                   "def f():\n    from ..saving import stage\n    from . import boxes\n    return stage, boxes\n")
    try:
        got = {m for m, _ in imports_of(src)}
        assert {"hyperdcp.saving", "hyperdcp.core.boxes"} <= got and "torch" not in got
        assert any(a == "hyperdcp.core._probe_for_test" and b == "hyperdcp.saving" for a, b, _ in violations())
    finally:
        src.unlink()
