"""The package's shape, as docs/ARCHITECTURE.md draws it: every module imports only from its own
layer or the ones below, so there is no cycle, and modules and functions stay small."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, Set

PACKAGE = Path(__file__).resolve().parents[1] / "precise_bn"

# Lowest first. A module belongs to the first layer with an entry that is its name or a package
# holding it; the package root (re-exports) and ``__main__`` sit above everything.
LAYERS = [
    ["errors", "_version", "atomic", "tails"],
    ["options", "estimator"],
    ["data", "distributed", "report", "signals", "precision"],
    ["driver"],
    ["pytorch", "caffe2.net", "caffe2.stats", "caffe2.original", "caffe2.checkpoint", "caffe2.names"],
    ["api", "caffe2.backend"],
    ["step_cache"],
    ["hooks", "helper"],
    ["lightning", "classy"],
    ["checkpoint"],
    ["cli"],
]
MAX_MODULE_LINES = 360
MAX_FUNCTION_LINES = 65


def _modules() -> Dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _layer(name: str) -> int:
    if name in ("", "__main__"):
        return len(LAYERS)
    for index, entries in enumerate(LAYERS):
        if any(name == entry or name.startswith(entry + ".") for entry in entries):
            return index
    raise AssertionError("module precise_bn.{} is in no layer of tests/test_layering.py".format(name))


def _imports(name: str, path: Path, modules: Set[str]) -> Iterator[str]:
    """The package's modules ``name`` imports (``from . import x`` counts as ``x``)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            target = ".".join(p for p in base if p)
            submodules = [target + "." + a.name if target else a.name for a in node.names]
            hits = [s for s in submodules if s in modules]
            yield from hits if hits else [target]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("precise_bn"):
            yield node.module[len("precise_bn."):] if node.module != "precise_bn" else ""
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("precise_bn."):
                    yield alias.name[len("precise_bn."):]


def test_every_import_points_down_or_sideways():
    modules = _modules()
    upward = []
    for name, path in modules.items():
        for target in _imports(name, path, set(modules)):
            if target != name and _layer(target) > _layer(name) and not name.startswith(target + "."):
                upward.append("{} (layer {}) imports {} (layer {})".format(name, _layer(name), target, _layer(target)))
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    modules = _modules()
    graph = {name: {t for t in _imports(name, path, set(modules)) if t in modules and t != name}
             for name, path in modules.items()}
    state: Dict[str, int] = {}

    def visit(node: str, trail: list) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if nxt == "" or node.startswith(nxt + ".") or nxt.startswith(node + "."):
                continue  # a package and its own modules
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join(trail + [node, nxt])
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [])


def test_modules_and_functions_stay_small():
    too_long = []
    for name, path in _modules().items():
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > MAX_MODULE_LINES:
            too_long.append("module {}: {} lines".format(name, text.count("\n")))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append("{}.{}: {} lines".format(name, node.name, length))
    assert not too_long, "\n".join(too_long)
