"""The package's prose share: docstring lines plus full-line comments are at most 15% of its
lines, so explanations stay where they are needed and derivations live in docs/."""
from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path
from typing import Set, Tuple

PACKAGE = Path(__file__).resolve().parents[1] / "precise_bn"
MAX_PROSE_SHARE = 0.15


def prose_lines(source: str) -> Tuple[Set[int], int]:
    """The line numbers of a module's docstrings and full-line comments, and its line count."""
    found: Set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                found.update(range(first.lineno, first.end_lineno + 1))
    lines = source.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and lines[token.start[0] - 1].lstrip().startswith("#"):
            found.add(token.start[0])
    return found, len(lines)


def test_prose_lines_counts_docstrings_and_full_line_comments_only():
    source = '"""Doc\nstring."""\n# a comment\nx = 1  # not a full-line comment\n\ndef f():\n    """One."""\n    return "not a docstring"\n'
    found, total = prose_lines(source)
    assert sorted(found) == [1, 2, 3, 7] and total == 8


def test_the_package_is_at_most_fifteen_percent_prose():
    prose = total = 0
    shares = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found, lines = prose_lines(path.read_text(encoding="utf-8"))
        prose, total = prose + len(found), total + lines
        shares.append((len(found) / max(lines, 1), str(path.relative_to(PACKAGE))))
    heaviest = ", ".join("{} {:.0%}".format(name, share) for share, name in sorted(shares, reverse=True)[:5])
    assert prose / total <= MAX_PROSE_SHARE, "prose is {:.1%} of the package's lines; heaviest: {}".format(prose / total, heaviest)
