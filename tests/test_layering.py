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
    ["errors", "_version", "signals", "atomic", "digits", "rng", "se_spread", "order", "package_cache", "aoti", "compiled"],
    ["options", "estimator", "slices", "moments", "buffers"],
    ["data", "reader", "distributed", "report", "snapshot", "precision", "staleness"],
    ["driver"],
    ["pytorch", "caffe2.net", "caffe2.stats", "caffe2.original", "caffe2.checkpoint", "caffe2.names"],
    ["api", "caffe2.backend"],
    ["step_cache", "torch_job"],
    ["hooks", "bn_helper", "helper"],
    ["lightning", "classy", "mmengine"],
    ["checkpoint"],
    ["cli"],
]
# Lines of code, not counting docstrings, comments or blank lines: the explanations are the
# code's best part and must never be what gets trimmed to fit.
MAX_MODULE_CODE = 280
MAX_FUNCTION_CODE = 50

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


def _code_lines(tree: ast.AST, lines: list) -> Set[int]:
    """Line numbers (1-based) that hold code: not blank, not only a comment, not a docstring."""
    docstrings: Set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    return {i for i, line in enumerate(lines, 1)
            if line.strip() and not line.strip().startswith("#") and i not in docstrings}


def test_modules_and_functions_stay_small():
    too_long = []
    for name, path in _modules().items():
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
        code = _code_lines(tree, text.splitlines())
        if len(code) > MAX_MODULE_CODE:
            too_long.append("module {}: {} lines of code".format(name, len(code)))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = len([i for i in code if node.lineno <= i <= node.end_lineno])
                if length > MAX_FUNCTION_CODE:
                    too_long.append("{}.{}: {} lines of code".format(name, node.name, length))
    assert not too_long, "\n".join(too_long)


def _defined_names(tree: ast.Module) -> Iterator[str]:
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name


def _referenced_names(tree: ast.AST) -> Set[str]:
    names: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            names.add(node.value)  # __all__ entries, entry points named in strings
    return names


# Used outside the package on purpose: name -> why.
OBSERVERS = {
    "signals.in_critical_section": "the interrupt trials ask whether a line runs inside a critical section",
}


def test_every_module_level_function_and_class_is_used_in_the_package():
    """No dead code: each module-level function and class of ``precise_bn`` is referenced by the
    package itself (another module, or its own module beyond its definition), or named in
    ``pyproject.toml`` (entry points); a definition that only tests use is dead."""
    trees = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in _modules().items()}
    pyproject = (PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8")
    unused = []
    for name, tree in trees.items():
        elsewhere: Set[str] = set()
        for other, other_tree in trees.items():
            if other != name:
                elsewhere |= _referenced_names(other_tree)
        own = set()
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own |= _referenced_names(node)
            else:
                own |= _referenced_names(ast.Module(body=node.body, type_ignores=[]))
                for deco in node.decorator_list:
                    own |= _referenced_names(deco)
        for defined in _defined_names(tree):
            if defined.startswith("__"):
                continue  # module protocols (__getattr__, __dir__) are called by Python itself
            if defined not in elsewhere and defined not in own and ":" + defined not in pyproject \
                    and "{}.{}".format(name, defined) not in OBSERVERS:
                unused.append("precise_bn.{}.{}".format(name, defined))
    assert not unused, "defined but never used in the package: " + ", ".join(sorted(unused))


def test_no_module_shadows_the_standard_library():
    """A sibling's ``import inspect`` must get the standard library's, not ours."""
    import sys

    stdlib = getattr(sys, "stdlib_module_names", {"inspect", "json", "logging", "os", "signal", "types", "typing"})
    shadowing = [name for name in _modules() if name and name.split(".")[-1] in stdlib]
    assert not shadowing, shadowing


def test_only_ranks_changes_the_state_of_ranks():
    """A ``Ranks`` object's fields (which round it is in, whether it finished) are set by its own
    methods alone: no other module assigns to an attribute of a ``ranks`` variable."""
    offenders = []
    for name, path in _modules().items():
        if name == "distributed":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                owner = target.value if isinstance(target, ast.Attribute) else None
                if isinstance(owner, ast.Name) and owner.id == "ranks" or \
                        isinstance(owner, ast.Attribute) and owner.attr == "ranks":
                    offenders.append("{}:{}".format(name, node.lineno))
    assert not offenders, "set through a Ranks method instead: {}".format(offenders)


def test_only_the_signals_module_touches_signal_handlers():
    """One mechanism for every signal: no other module imports ``signal`` (docs/ARCHITECTURE.md)."""
    importers = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if name != "signals" and any(n.split(".")[0] in ("signal", "_signal") for n in names):
                importers.append(name)
    assert not importers, importers
