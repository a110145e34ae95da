"""The ``precise-bn`` command: recalibrate, inspect and convert saved checkpoints.

    precise-bn recompute ckpt.pt --model torchvision:resnet50 --data imagefolder:/data/train
    precise-bn check ckpt.pt --model torchvision:resnet50 --data imagefolder:/data/val
    precise-bn inspect ckpt.pt --against ckpt.precise_bn.pt
    precise-bn convert model_final.pkl model_final.pt
    precise-bn demo

Exit status: 0 on success, 2 on a usage error, 1 on a failure, shown as one line that names the
file, key, layer or argument at fault (``--debug`` adds the traceback), or when ``check`` finds a
stale layer (2 when its data could not test every channel); 130 after Ctrl-C, 143 after SIGTERM.
Under ``torchrun`` every rank measures its shard, the stats are merged exactly, and rank 0 alone
writes.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import traceback
import warnings
from typing import Any, Callable, Dict, Iterator, Optional, Sequence

import torch

from .. import distributed
from ..data import input_key_forward
from ..options import RETIRED, ForwardFn, Options
from ..signals import Terminated, relayed
from . import convert, inspect_cmd
from .check import EXIT_STATUS, check_checkpoint, verdict_lines
from .demo import run_demo
from .failures import one_line
from .job import recompute_checkpoint
from .parser import parse
from .specs import load_callable

logger = logging.getLogger("precise_bn")


def _forward_fn(args: argparse.Namespace) -> Optional[ForwardFn]:
    if args.forward_fn:
        return load_callable(args.forward_fn, "--forward-fn")
    return input_key_forward(args.input_key) if args.input_key else None


@contextlib.contextmanager
def _ranks(args: argparse.Namespace) -> Iterator[None]:
    """Under torchrun, this rank joined to the others for the command; left at the end."""
    Options(device=args.device, timeout=args.timeout)  # checked before joining a process group
    joined = _init_distributed(args.device, args.timeout)
    try:
        yield
    finally:
        if joined:
            torch.distributed.destroy_process_group()


def _job_arguments(args: argparse.Namespace) -> Dict[str, Any]:
    """What ``recompute`` and ``check`` both pass to their job: how to read the checkpoint, the
    model and the data, the options of the pass, and the rules for output files."""
    options: Dict[str, Any] = {"num_batches": args.num_batches, "num_samples": args.num_samples,
                               "device": _rank_device(args.device), "rtol": args.rtol,
                               "forward_fn": _forward_fn(args), "timeout": args.timeout,
                               "progress": False if args.quiet else None, "model_kwargs": args.model_kwargs,
                               "data_kwargs": args.data_kwargs, "batch_size": args.batch_size, "seed": args.seed,
                               "augment": args.augment, "key": args.key, "prefix": args.prefix,
                               "trust": args.trust_checkpoint, "caffe2_rules": inspect_cmd.rules_of(args),
                               "break_hardlinks": args.break_hardlinks, "overwrite": args.overwrite}
    if args.min_batches is not None:
        options["min_batches"] = args.min_batches
    if args.exact:
        logger.warning("precise-bn: --exact is deprecated and ignored: %s; drop it", RETIRED["exact"])
    return options


def _recompute(args: argparse.Namespace) -> None:
    with _ranks(args):
        options = _job_arguments(args)
        if args.prior:
            options["prior"] = args.prior
        report, _ = recompute_checkpoint(args.checkpoint, args.model, args.data, output=args.output,
                                         in_place=args.in_place, report_path=args.report, **options)
        if distributed.is_main_process() and not args.quiet:
            print(report)


def _check(args: argparse.Namespace) -> int:
    with _ranks(args):
        report = check_checkpoint(args.checkpoint, args.model, args.data, tolerance=tuple(args.tolerance),
                                  alpha=args.alpha, report_path=args.report, **_job_arguments(args))
        if distributed.is_main_process():
            print(report.summary() if args.quiet else report)  # -q: the verdict without the table
            for line in verdict_lines(report, args):
                print(line)
    return EXIT_STATUS[report.verdict]


def _demo(args: argparse.Namespace) -> None:
    run_demo(steps=args.steps, seed=args.seed, workdir=args.workdir, quiet=args.quiet)


def _rank_device(device: Optional[str]) -> Optional[str]:
    """Under torchrun, a bare ``cuda`` means this rank's GPU (``LOCAL_RANK``)."""
    if device == "cuda" and distributed.get_world_size() > 1:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return "cuda:{}".format(local)
    return device


def _init_distributed(device: Optional[str], timeout: float) -> bool:
    """Join the process group torchrun describes in the environment; False when not launched so.
    Its collectives give up after ``timeout`` seconds, as precise-bn's own rounds do."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or distributed.is_distributed():
        return False
    import torch.distributed as dist

    dist.init_process_group("nccl" if device and device.startswith("cuda") else "gloo",
                            timeout=distributed.group_timeout(timeout))
    return True


@contextlib.contextmanager
def _logging_to_stderr(quiet: bool) -> Iterator[None]:
    """Show the package's log records on stderr for one command; restore the logger after."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.WARNING if quiet or not distributed.is_main_process() else logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def _show_warning(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
    logger.warning("%s: %s", category.__name__, message)


COMMANDS: Dict[str, Callable[[argparse.Namespace], Optional[int]]] = {
    "recompute": _recompute, "check": _check, "inspect": inspect_cmd.run, "convert": convert.run, "demo": _demo}


def _stdout_closed() -> None:
    """The reader of our output has gone (``inspect X | head``): whatever is still buffered
    goes nowhere, so that the interpreter's own flush at exit does not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    try:
        args = parse(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        with relayed(terminate=True), _logging_to_stderr(args.quiet), warnings.catch_warnings():
            warnings.showwarning = _show_warning
            status = COMMANDS[args.command](args) or 0
            sys.stdout.flush()
    except BrokenPipeError:
        _stdout_closed()
        return 0
    except (Exception, KeyboardInterrupt, Terminated) as exc:
        if args.debug:
            traceback.print_exc()
        if isinstance(exc, KeyboardInterrupt):
            print("precise-bn: interrupted", file=sys.stderr)
            return 130
        if isinstance(exc, Terminated):
            print("precise-bn: stopped by a termination signal", file=sys.stderr)
            return int(exc.code)
        print("precise-bn: error: " + one_line(exc), file=sys.stderr)
        return 1
    return status
