"""Every place that lists or takes the options agrees with their one definition, ``precise_bn.options.Options``:
names, defaults, meanings, and the same TypeError with a hint for a misspelt name at every entry point."""
from __future__ import annotations

import argparse
import re
import inspect
from pathlib import Path

import pytest

from precise_bn import recompute
from precise_bn.cli.parser import build_parser
from precise_bn.options import OPTION_FIELDS, RETIRED, Options, option_help, options_table

ROOT = Path(__file__).resolve().parents[1]

# The command's flags that set an option, by option name; the others have no flag because a
# checkpoint run fixes them (sync, group: torchrun's group; forward_fn: --forward-fn and
# --input-key build it; progress and log_period: --quiet).
CLI_FLAGS = {"num_batches": "--num-batches", "num_samples": "--num-samples", "device": "--device",
             "rtol": "--rtol", "min_batches": "--min-batches", "timeout": "--timeout"}


def test_recompute_takes_exactly_the_options_with_their_defaults():
    params = [p for p in inspect.signature(recompute).parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert [p.name for p in params] == list(OPTION_FIELDS) + list(RETIRED)
    for p in params:
        assert p.default == (OPTION_FIELDS[p.name].default if p.name in OPTION_FIELDS else None), p.name
    doc = recompute.__doc__ or ""  # its options' lines are generated from their meanings: help() shows them
    assert all("{}: {}".format(name, option_help(name)) in doc for name in OPTION_FIELDS)


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


def _entry_points():
    """Every entry point that takes the options, called with ``**kw`` on a model and data that
    a pass would fail on: a misspelt name must fail first."""
    from torch import nn

    from precise_bn import BatchNormHelper, check, recalibrated, update_bn_stats
    from precise_bn.cli.check import check_checkpoint
    from precise_bn.cli.job import recompute_checkpoint
    from precise_bn.hooks import PreciseBNHook

    def lightning(**kw):
        from precise_bn.lightning import PreciseBNCallback
        return PreciseBNCallback(**kw)

    def mmengine(**kw):
        from precise_bn.mmengine import ExactPreciseBNHook
        return ExactPreciseBNHook(**kw)

    def classy(**kw):
        from precise_bn.classy import PreciseBatchNormHook
        return PreciseBatchNormHook(10, **kw)

    def classy_config(**kw):
        from precise_bn.classy import PreciseBatchNormHook
        return PreciseBatchNormHook.from_config(dict(num_samples=10, **kw))

    model, never = nn.BatchNorm2d(3), iter(())
    return {
        "recompute": lambda **kw: recompute(model, never, **kw),
        "update_bn_stats": lambda **kw: update_bn_stats(model, never, **kw),
        "recalibrated": lambda **kw: recalibrated(model, never, **kw),
        "check": lambda **kw: check(model, never, **kw),
        "recompute_checkpoint": lambda **kw: recompute_checkpoint("absent.pt", model, never, **kw),
        "check_checkpoint": lambda **kw: check_checkpoint("absent.pt", model, never, tolerance=(0.1, 0.1),
                                                          alpha=0.01, **kw),
        "Options.replace": lambda **kw: Options().replace(**kw),
        "PreciseBNHook": lambda **kw: PreciseBNHook(model, never, **kw),
        "BatchNormHelper": lambda **kw: BatchNormHelper(**kw),
        "PreciseBNCallback": lightning,
        "ExactPreciseBNHook": mmengine,
        "PreciseBatchNormHook": classy,
        "PreciseBatchNormHook.from_config": classy_config,
    }


MAIN_ENV = ("PreciseBNCallback", "ExactPreciseBNHook", "PreciseBatchNormHook", "PreciseBatchNormHook.from_config")
# An entry point's own arguments, misspelt: the hint is among them too.
OWN_MISSPELT = [("check", "alhpa", "alpha"), ("BatchNormHelper", "iter", "iters"),
                ("PreciseBNHook", "eval_perod", "eval_period"), ("PreciseBNHook", "checkpoint_perod", "checkpoint_period"),
                ("PreciseBNHook", "log_perod", "log_period"), ("PreciseBNHook", "extra_model", "extra_models"),
                ("PreciseBNCallback", "atribute", "attribute"), ("PreciseBNCallback", "dta", "data"),
                ("PreciseBNCallback", "num_batchs", "num_batches"),
                ("PreciseBatchNormHook", "cache_sample", "cache_samples"),
                ("PreciseBatchNormHook.from_config", "cache_sample", "cache_samples")]
MISSPELT = ([(where, "unbaised", "unbiased") for where in _entry_points()]
            + [(where, "num_batchs", "num_batches") for where in ("recalibrated", "check")])


@pytest.mark.parametrize("where, name, hint", [
    pytest.param(*case, marks=[pytest.mark.main_env] if case[0] in MAIN_ENV else [], id="-".join(case[:2]))
    for case in MISSPELT + OWN_MISSPELT])
def test_a_misspelt_name_fails_at_once_naming_the_entry_point_and_the_closest_name(where, name, hint):
    # recompute's keywords are Python's own: Python 3.13 adds the hint, older ones name the argument alone
    hinted = "" if where == "recompute" else ".*did you mean {!r}".format(hint)
    said = "{}.*{!r}".format(re.escape(where), name) + hinted
    with pytest.raises(TypeError, match=said):
        _entry_points()[where](**{name: 1})


ENTRY_POINTS = [pytest.param(where, marks=[pytest.mark.main_env] if where in MAIN_ENV else []) for where in _entry_points()]


@pytest.mark.parametrize("where", ENTRY_POINTS)
def test_exact_is_accepted_everywhere_with_a_deprecation_warning_and_offered_nowhere(where):
    """Old calls still run: ``exact=True`` warns why it is ignored and goes no further than the
    warning (the call then fails, or not, as it does without it); a value that was never valid
    still fails. The README, the command's help and ``Options`` no longer list it."""
    def outcome(**kw):
        try:
            _entry_points()[where](**kw)
        except Exception as exc:  # noqa: BLE001 - the model and data are built to fail a pass
            return type(exc)
        return None

    with pytest.warns(DeprecationWarning, match="exact is deprecated and ignored: every call of every layer is "
                      "measured in float64"):
        with_exact = outcome(exact=True)
    assert with_exact == outcome()
    with pytest.raises(Exception, match="exact must be True or False"):
        _entry_points()[where](exact="yes")
    assert "exact" not in OPTION_FIELDS and "`exact`" not in options_table()
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert "--exact" in _recompute_actions() and not any("--exact" in p.format_help() for p in sub.choices.values())
