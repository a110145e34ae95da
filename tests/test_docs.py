"""The README stays one read long and starts with what a newcomer needs; every relative link in it
and in ``docs/`` leads to a file (and heading) that exists; install hints work from a checkout."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator, Set, Tuple

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAX_README_LINES = 250
FIRST_SCREEN_LINES = 30

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def _pages() -> list:
    return [README] + sorted((REPO / "docs").glob("*.md"))


def _prose(text: str) -> str:
    """The text with code blocks and code spans blanked, so that code is never read as a link."""
    return _CODE_SPAN.sub("``", _FENCE.sub("", text))


def _links(page: Path) -> Iterator[Tuple[str, str]]:
    """``(target, fragment)`` of every relative link on ``page``."""
    for target in _LINK.findall(_prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        yield path, fragment


def _anchors(page: Path) -> Set[str]:
    """GitHub's anchors for the headings of ``page``: lower case, punctuation dropped, spaces to dashes."""
    headings = re.findall(r"^#+ (.+)$", _FENCE.sub("", page.read_text(encoding="utf-8")), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_readme_fits_in_one_read():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, "README.md has {} lines; move detail to a page under docs/".format(len(lines))


def test_readme_first_screen_installs_and_runs_the_demo():
    first = "\n".join(README.read_text(encoding="utf-8").splitlines()[:FIRST_SCREEN_LINES])
    for command in ("pip install .", "precise-bn demo", "bash scripts/dev.sh demo", "bash scripts/dev.sh test"):
        assert command in first, "the README's first {} lines lack `{}`".format(FIRST_SCREEN_LINES, command)


def test_every_relative_link_leads_somewhere():
    broken = []
    for page in _pages():
        for path, fragment in _links(page):
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append("{}: {} does not exist".format(page.relative_to(REPO), path))
            elif fragment and target.suffix == ".md" and fragment not in _anchors(target):
                broken.append("{}: {} has no heading #{}".format(page.relative_to(REPO), path or page.name, fragment))
    assert not broken, "\n".join(broken)


def test_the_link_check_sees_links_and_skips_code(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("see [a](docs/a.md#x-y) and [web](https://example.org)\n`[not](code.md)`\n"
                    "```\n[nor](block.md)\n```\n## X y!\n", encoding="utf-8")
    assert list(_links(page)) == [("docs/a.md", "x-y")]
    assert _anchors(page) == {"x-y"}


def test_install_hints_work_from_a_checkout():
    """The package is installed from a checkout, not from an index: extras are ``'.[name]'``,
    quoted for zsh, and name an extra that exists."""
    section = re.search(r"\[project.optional-dependencies\]\n(.*?)\n\n", (REPO / "pyproject.toml").read_text(), re.S)
    extras = {line.split(" =")[0] for line in section.group(1).splitlines()}
    for page in _pages():
        text = page.read_text(encoding="utf-8")
        assert "precise-bn[" not in text, "{}: install extras from a checkout, pip install '.[NAME]'".format(page.name)
        for hint in re.findall(r"pip install (\S*\[\S*)", text):
            match = re.fullmatch(r"'\.\[([a-z0-9_,-]+)\]'", hint.rstrip("`):,."))
            assert match, "{}: unquoted or unknown install hint {}".format(page.name, hint)
            assert set(match.group(1).split(",")) <= extras, "{}: no such extra in {}".format(page.name, hint)
