"""``precise-bn check``: do a checkpoint's BN statistics fit the data? Exit 0 if so, 1 if not,
2 if the data could not tell (channels untested), as a usage error does: no verdict either way.

Measured exactly as ``recompute`` measures (:func:`~precise_bn.cli.job.open_job`), writing
nothing but the optional JSON report; a stale layer is named with its worst channel and the
``recompute`` command that fixes it, untested channels with the data that would test them.
"""
from __future__ import annotations

import argparse
import json
import logging
import shlex
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

from torch import nn

from .. import distributed
from ..checkpoint.serializers import write_file
from ..precision import FLAGS
from ..report import counted
from ..staleness import MIN_CALLS, CheckReport, Rule, judge
from .job import measure, open_job
from .parser import shared_actions

logger = logging.getLogger("precise_bn")

#: The command's exit status for each verdict of :attr:`~precise_bn.CheckReport.verdict`.
EXIT_STATUS = {"fits": 0, "stale": 1, "untested": 2}


def check_checkpoint(
    checkpoint: str,
    model: Union[str, nn.Module],
    data: Union[str, Iterable[Any]],
    *,
    tolerance: Tuple[float, float],
    alpha: float,
    report_path: Optional[str] = None,
    break_hardlinks: bool = False,
    overwrite: bool = False,
    **kwargs: Any,
) -> CheckReport:
    """The verdict on a checkpoint file's BN statistics (see :func:`precise_bn.check`); rank 0
    writes ``report_path`` (JSON), checked before any work as every output of the command is.
    ``**kwargs``: what :func:`~precise_bn.cli.job.recompute_checkpoint` takes to read the
    checkpoint, the model and the data, and the options of :func:`precise_bn.check`."""
    rule = Rule(tolerance, alpha)
    outputs = [("--report", report_path)] if report_path else []
    job = open_job(checkpoint, model, data, outputs, where="check_checkpoint", break_hardlinks=break_hardlinks,
                   overwrite=overwrite, **kwargs)
    report = judge(measure(job, write=False), rule)
    try:
        if report_path and distributed.is_main_process():
            body = {"checkpoint": job.ckpt.path, "format": job.ckpt.format, "prefix": job.prefix}
            body.update(report.to_dict())
            text = json.dumps(body, indent=2).encode("utf-8")
            write_file(job.targets[0], lambda handle: handle.write(text))
            logger.info("wrote %s (the verdict per layer)", report_path)
    finally:
        distributed.barrier()
    return report


def fix_command(args: argparse.Namespace) -> str:
    """The ``precise-bn recompute`` command that reads what ``check`` read: the same checkpoint,
    model, data and budget, every flag the two commands share that was given."""
    words = ["precise-bn", "recompute"]
    for action in shared_actions():
        value = getattr(args, action.dest, None)
        if not action.option_strings:
            words.append(value)
        elif value is True and action.const is True:
            words.append(action.option_strings[0])
        elif value != action.default and value is not False:
            words += [action.option_strings[0], json.dumps(value) if isinstance(value, dict) else str(value)]
    return " ".join(shlex.quote(str(word)) for word in words)


def untested_line(report: CheckReport) -> str:
    """The untested channels per layer, and what data would test them."""
    reasons: Dict[str, int] = {}
    for fit in report.layers:
        for reason, count in fit.untested_by_reason().items():
            reasons[reason] = reasons.get(reason, 0) + count
    read, needs = report.measured.batches, []
    if "calls" in reasons:
        needs.append("too few calls ({}): a verdict needs at least {} ({} calls of each layer); this run read "
                     "{}".format(reasons.pop("calls"), counted(report.batches_needed(), "batch", "batches"),
                                 MIN_CALLS, read))
    if reasons:
        why = ", ".join("{} {}".format(FLAGS[r][0] if r in FLAGS else "standard error 0", n)
                        for r, n in reasons.items())
        needs.append("standard errors that cannot be used ({}): a verdict needs more batches than this run's {}, "
                     "independent and shuffled".format(why, read))
    untested = report.untested
    return "untested: {} could not be tested ({} {}): {}".format(
        counted(sum(untested.values()), "channel"), "layer" if len(untested) == 1 else "layers",
        ", ".join("{!r} {}".format(name, count) for name, count in untested.items()), "; ".join(needs))


def verdict_lines(report: CheckReport, args: argparse.Namespace) -> List[str]:
    """Each stale layer with its worst channel's figures, then the command that fixes them; or,
    with no stale layer, the line on the untested channels, if any."""
    lines = []
    for fit in report.layers:
        off, worst = len(set(fit.off("mean")) | set(fit.off("var"))), fit.worst
        if off and worst is not None:
            lines.append("stale: layer {!r} ({} channel{} off): {}".format(
                fit.name, off, "" if off == 1 else "s", worst.describe()))
    if lines:
        lines.append("to fix: " + fix_command(args))
    elif report.untested:
        lines.append(untested_line(report))
    return lines
