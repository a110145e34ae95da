"""Generated attacks on the exact bound and on the default path's untrusted-channel bound.

    python benchmarks/exact_attack.py [--quick] [--out DIR] [--cases N]

Each seed of ``tests/attack_cases.py`` builds a small model and batches meant to defeat float32
statistics (layouts, reused layers, ragged batches, means that start, stop, grow or jump, dead
channels coming alive, sorted loaders, a late outlier batch). Per case, against the float64
two-pass reference of the same batches: the worst relative variance error of ``exact=True``
(bound 1e-7), and of the default path, split into channels it named untrusted and those it did
not (which must stay within 1e-3). Writes the "attack" section of ``DIR/RESULTS.md``.
"""
from __future__ import annotations

import argparse
import copy
import sys
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

import common

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from attack_cases import LAYOUTS, make_case  # noqa: E402
from reference import float64_reference  # noqa: E402

import precise_bn  # noqa: E402
from precise_bn.errors import PreciseBNWarning  # noqa: E402

EXACT_RTOL = 1e-7
UNTRUSTED_RTOL = 1e-3


def _relative_var_errors(model: torch.nn.Module, batches: List[torch.Tensor], exact: bool, ref_var: torch.Tensor):
    model = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PreciseBNWarning)
        layer = precise_bn.recompute(model, batches, exact=exact, progress=False)["bn"]
    live = ref_var > 0
    rel = torch.zeros_like(ref_var)
    rel[live] = (layer.new_var[live] - ref_var[live]).abs() / ref_var[live]
    rel[~live] = layer.new_var[~live].abs()  # a dead channel must come out exactly 0
    named = torch.zeros_like(live)
    named[layer.untrusted] = True
    return rel, named


def _largest(values: torch.Tensor) -> float:
    return float(values.max()) if values.numel() else 0.0


def run(seeds: Sequence[int]) -> Dict[str, Dict[str, float]]:
    rows: Dict[str, Dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for seed in seeds:
        case = make_case(seed)
        _, ref_var, _ = float64_reference(case.model, case.batches)["bn"]
        exact, _ = _relative_var_errors(case.model, case.batches, True, ref_var)
        default, named = _relative_var_errors(case.model, case.batches, False, ref_var)
        row = rows[case.layout]
        row["cases"] += 1
        row["channels"] += ref_var.numel()
        row["exact worst"] = max(row["exact worst"], float(exact.max()))
        row["exact outside"] += int((exact > EXACT_RTOL).sum())
        row["named"] += int(named.sum())
        row["default worst unnamed"] = max(row["default worst unnamed"], _largest(default[~named]))
        row["default worst named"] = max(row["default worst named"], _largest(default[named]))
        row["unnamed outside"] += int((default[~named] > UNTRUSTED_RTOL).sum())
    return rows


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser)
    parser.add_argument("--cases", type=int, default=None, help="seeds to run (default 3000, quick 12)")
    args = common.parse_common(parser, argv)
    count = args.cases or (12 if args.quick else 3000)
    common.log.info("exact attack: %d generated cases", count)
    rows = run(range(count))
    table = common.markdown_table(
        ["layout", "cases", "channels", "exact: worst var error", "exact: outside 1e-7",
         "default: channels named untrusted", "default: worst error, unnamed", "default: unnamed outside 1e-3",
         "default: worst error, named"],
        [[layout, int(r["cases"]), int(r["channels"]), common.fmt_err(r["exact worst"]), int(r["exact outside"]),
          int(r["named"]), common.fmt_err(r["default worst unnamed"]), int(r["unnamed outside"]),
          common.fmt_err(r["default worst named"])] for layout, r in sorted(rows.items(), key=lambda kv: LAYOUTS.index(kv[0]))])
    outside = sum(int(r["exact outside"] + r["unnamed outside"]) for r in rows.values())
    text = "\n\n".join([
        "## Generated attacks on the bounds (`benchmarks/exact_attack.py`)",
        "Command: `{}`".format(common.command_line(argv)),
        common.environment_text(args.threads),
        "Relative variance errors against the float64 two-pass reference of the same batches, over "
        "{} generated cases (`tests/attack_cases.py`, seeds 0 to {}); a dead channel counts its "
        "written variance itself.".format(count, count - 1),
        table,
        common.target_line("0 channels outside their bound ({} found)".format(outside), outside == 0),
    ])
    common.write_section(args.out / "RESULTS.md", "attack", text)
    print(text)


if __name__ == "__main__":
    main()
