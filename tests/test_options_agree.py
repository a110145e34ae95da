"""Every place that lists the options agrees with their one definition, ``precise_bn.options.Options``:
names, defaults and meanings."""
from __future__ import annotations

import argparse
import inspect
from pathlib import Path

import pytest

from precise_bn import recompute
from precise_bn.cli.parser import build_parser
from precise_bn.options import OPTION_FIELDS, Options, option_help, options_table

ROOT = Path(__file__).resolve().parents[1]

# The command's flags that set an option, by option name; the others have no flag because a
# checkpoint run fixes them (sync, group: torchrun's group; forward_fn: --forward-fn and
# --input-key build it; progress and log_period: --quiet).
CLI_FLAGS = {"num_batches": "--num-batches", "num_samples": "--num-samples", "device": "--device",
             "exact": "--exact", "rtol": "--rtol", "min_batches": "--min-batches", "timeout": "--timeout"}


def test_recompute_takes_exactly_the_options_with_their_defaults():
    params = [p for p in inspect.signature(recompute).parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert [p.name for p in params] == list(OPTION_FIELDS)
    for p in params:
        assert p.default == OPTION_FIELDS[p.name].default, p.name
    doc = recompute.__doc__ or ""
    assert all("{}:".format(name) in doc for name in OPTION_FIELDS), "recompute's docstring misses an option"


def test_every_option_has_a_meaning_and_the_readme_table_is_generated_from_them():
    assert all(option_help(name).strip() for name in OPTION_FIELDS)
    assert options_table() in (ROOT / "README.md").read_text(encoding="utf-8"), \
        "README's option table differs from the options: paste the output of python -m precise_bn.options"


def _recompute_actions():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {flag: action for action in sub.choices["recompute"]._actions for flag in action.option_strings}


@pytest.mark.parametrize("name", sorted(CLI_FLAGS))
def test_the_commands_flags_say_what_the_option_says(name):
    action = _recompute_actions()[CLI_FLAGS[name]]
    assert action.dest == name and action.help.startswith(option_help(name))
    default = OPTION_FIELDS[name].default
    assert action.default in (None, False, default), (name, action.default)


def test_an_option_rejected_by_options_is_rejected_for_the_same_reason_everywhere():
    from precise_bn.errors import ConfigError

    with pytest.raises(ConfigError, match="rtol"):
        Options(rtol=2)
    with pytest.raises(ConfigError, match="rtol"):
        recompute(None, [], rtol=2)
