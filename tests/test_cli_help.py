"""Every ``--help`` of the command prints, run as a user runs it, and every flag of every
sub-command is named in docs/cli.md, in that sub-command's section. Sub-commands and flags are
read from the parser itself, so a new one whose help crashes or that has no docs fails here."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from typing import Dict, List, Set

import pytest

from cli_helpers import REPO
from precise_bn.cli.parser import _Parser, build_parser
from precise_bn.options import OPTION_FIELDS, option_help

CLI_DOC = REPO / "docs" / "cli.md"
#: The heading of the section that names the flags every sub-command takes.
COMMON_HEADING = "Flags every sub-command takes"


def _subparsers() -> Dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


SUBCOMMANDS = sorted(_subparsers())


def _flags(parser: argparse.ArgumentParser) -> Set[str]:
    """The flags a sub-command offers: all but ``--help`` and the retired ones it hides."""
    return {flag for action in parser._actions for flag in action.option_strings
            if flag not in ("-h", "--help") and action.help != argparse.SUPPRESS}


def _common_flags() -> Set[str]:
    return set.intersection(*(_flags(p) for p in _subparsers().values()))


def _section(text: str, heading: str) -> str:
    """The text under the level-2 heading ``heading`` up to the next level-2 heading ("" if none)."""
    match = re.search(r"^## {}\n(.*?)(?=^## |\Z)".format(re.escape(heading)), text, re.M | re.S)
    return match.group(1) if match else ""


def _unnamed(flags: Set[str], text: str) -> List[str]:
    return sorted(f for f in flags if not re.search(r"(?<![\w-]){}(?![\w-])".format(re.escape(f)), text))


def _run(*args: str) -> subprocess.CompletedProcess:
    """``python -m precise_bn ARGS`` in a new process, importing this checkout's package."""
    path = os.pathsep.join([str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    return subprocess.run([sys.executable, "-m", "precise_bn", *args], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=path, COLUMNS="100"))


def test_the_console_script_is_what_python_m_runs():
    scripts = re.search(r"^\[project\.scripts\]\n(.*?)(?:\n\n|\Z)", (REPO / "pyproject.toml").read_text(), re.M | re.S)
    assert scripts and 'precise-bn = "precise_bn.__main__:main"' in scripts.group(1).splitlines()


def test_python_m_precise_bn_help_lists_every_sub_command():
    done = _run("--help")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.startswith("usage: precise-bn ")
    assert all(re.search(r"^ +{}\b".format(name), done.stdout, re.M) for name in SUBCOMMANDS), done.stdout


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_sub_commands_help_prints_every_flag(name):
    done = _run(name, "--help")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.startswith("usage: precise-bn {} ".format(name))
    assert not _unnamed(_flags(_subparsers()[name]), done.stdout)


def test_a_percent_sign_in_a_help_text_is_a_percent_sign():
    """argparse expands help texts with ``%``: the command's formatter keeps a bare ``%`` as it
    is, for every option's text (those without a flag today too), and still expands ``%(default)``."""
    parser = _Parser(prog="p")
    parser.add_argument("--share", default=3, help="about 95% of channels, 100%% sure (default %(default)s)")
    for i, name in enumerate(OPTION_FIELDS):
        parser.add_argument("--option{}".format(i), help=option_help(name))
    text = re.sub(r"\s+", " ", parser.format_help())
    assert "about 95% of channels, 100%% sure (default 3)" in text
    assert all(re.sub(r"\s+", " ", option_help(name)) in text for name in OPTION_FIELDS)


def test_every_flag_of_every_sub_command_is_named_in_its_section_of_docs_cli_md():
    text = CLI_DOC.read_text(encoding="utf-8")
    common = _common_flags()
    assert common and not _unnamed(common, _section(text, COMMON_HEADING)), \
        "docs/cli.md: name {} under '## {}'".format(_unnamed(common, _section(text, COMMON_HEADING)), COMMON_HEADING)
    missing = {}
    for name, parser in _subparsers().items():
        section = _section(text, "`precise-bn {}`".format(name))
        assert section, "docs/cli.md has no section '## `precise-bn {}`'".format(name)
        missing.update({"precise-bn " + name: _unnamed(_flags(parser) - common, section)})
    assert not any(missing.values()), "flags docs/cli.md does not name in their sub-command's section: {}".format(
        {k: v for k, v in missing.items() if v})


def test_the_doc_check_sees_a_flag_missing_from_its_section():
    text = "## `precise-bn a`\n`--x`, --y-z\n## `precise-bn b`\n--w\n"
    assert _unnamed({"--x", "--y-z", "--y", "--w"}, _section(text, "`precise-bn a`")) == ["--w", "--y"]
    assert _section(text, "`precise-bn c`") == ""
