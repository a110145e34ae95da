"""Interrupts at every instant of a call: larger runs of the trials of ``tests/test_interrupts.py``.

    python benchmarks/interrupts.py [--quick] [--out DIR] [--trials N] [--label TEXT]

For each call of ``tests/interrupt_cases.CASE_NAMES`` (``recompute``, ``update_bn_stats``, a
hook's recomputation and its re-apply of cached stats, a ``recalibrated`` block, ``undo``):

* ``N`` random-timed SIGALRM trials (default 500) over a model with 101 BN layers, the handler
  raising ``KeyboardInterrupt``, and ``N / 5`` with a handler that only counts;
* an exception raised at every line event of the package over a whole call (critical sections
  skipped), and SIGALRM sent at every line event (critical sections included), handled once by
  a raising and once by a counting handler, on a model with 4 BN layers.

A trial fails when the call raised and the model (or the hook's cache) is not bit-identical to
before, when it returned without exactly the stats of an undisturbed call, when a signal relay
or a critical section is left behind, or when a sent signal did not reach its handler exactly
once. Failures are counted, not raised: the case is rebuilt and the signal module's state put
back, so a run against an older version of the package (``PYTHONPATH``) counts its unsafe
points. Writes the section of ``DIR/INTERRUPTS.md`` for this Python version (or ``--label``)
and, where matplotlib is installed, ``DIR/interrupts.png``: where the signals landed.
"""
from __future__ import annotations

import argparse
import collections
import os
import platform
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

import common

import precise_bn.signals

sys.path.insert(0, str(common.REPO / "tests"))
import interrupt_cases as cases  # noqa: E402  (the trials live with the tests)
import interrupt_trials as trials  # noqa: E402

HEADER = """# Interrupt trials

Written by `benchmarks/interrupts.py` (one section per Python version; the tests in
`tests/test_interrupts.py` run the same trials in smaller numbers). Each trial runs one call
with a `KeyboardInterrupt` or a signal placed inside it (the three ways are described in
`tests/interrupt_trials.py`) and fails when the call raised and left the model (or the hook's
step cache) not bit-identical to before, when it returned without exactly the stats of an
undisturbed call, when a signal relay, an open critical section or autograd switched off was
left behind, or when a sent signal did not reach its handler exactly once.

How to read the tables: *timed* trials send SIGALRM at a uniform random instant over the call
(a handler that raises `KeyboardInterrupt`, or one that only counts); *every line* trials act at
each line event of the package over a whole call: an exception raised there (lines inside
critical sections skipped), or a real SIGALRM sent there (critical sections included).
*Deferred signals* counts the trials whose signal arrived inside a critical section and was
handed to its handler when the section ended. The timed trials use a model with 101 BN layers
(88 recomputed), the line trials one with 4 (3 recomputed).
"""

PHASES = ("setup", "pass", "merge", "report", "write", "restore", "driver", "outside")
#: The phase of a package function, by file and function name (a method's own name); a file's
#: "" entry is the default for its other functions; files absent here (the estimator, the
#: report, data conventions, rank rounds) take the phase of their caller.
_PHASE_OF = {
    "signals.py": {"install": "setup", "begin": "setup", "release": "restore", "_put_back": "restore",
                   "abort": "restore", "write": "write", "commit": "write", "stop_deferring": "write",
                   "_deliver": "write", "": "driver"},
    "bn_pass.py": {"__init__": "setup", "choose": "setup", "old_stats": "setup", "attach": "setup",
                   "step": "pass", "running": "pass", "_functional_bn": "pass", "collect": "merge",
                   "write": "write", "change": "write", "restore": "restore", "_detach": "restore"},
    "model_state.py": {"__init__": "setup", "freeze_observers": "setup", "module_names": "setup",
                       "check_parameters": "pass", "written_parameters": "pass", "changed_buffers": "pass",
                       "": "restore"},
    "capture.py": {"attach": "setup", "__init__": "setup", "_capturing_class": "setup", "detach": "restore",
                   "flush": "merge", "_merge": "merge", "_uniform_pending": "merge", "merge_due": "merge",
                   "due": "merge", "take": "merge", "": "pass"},
    "moments.py": {"": "pass"},
    "buffers.py": {"check_fits": "report", "round_to": "write"},
    "driver.py": {"run_pass": "pass", "update": "pass", "play": "pass", "finalize": "merge",
                  "build_report": "report", "warn_if_short": "report", "recalibrate": "driver"},
    "step_cache.py": {"_store": "write", "change": "write", "undo": "restore", "": "driver"},
    "torch_job.py": {"apply": "write", "copy": "write", "_prepare": "setup", "": "driver"},
    "rng.py": {"__init__": "setup", "loader_generators": "setup", "": "driver"},
    "layers.py": {"": "setup"},
    "options.py": {"": "setup"},
    "api.py": {"": "driver"},
    "hooks.py": {"": "driver"},
}


def phase(arrived: str) -> str:
    """The phase of the innermost function of ``arrived`` (``file:function < ...``, innermost
    first, 3.11 qualified names or 3.9 plain ones) that says one, else "driver"."""
    if not arrived:
        return "outside"
    for where in arrived.split(" < "):
        file, _, function = where.partition(":")
        table = _PHASE_OF.get(file)
        if table is not None:
            found = table.get(function.split(".")[-1], table.get(""))
            if found is not None:
                return found
    return "driver"


def reset_signal_state(handlers: Dict[int, Any]) -> None:
    """After a failed trial: the test's handlers back, and the relay module's bookkeeping
    emptied (whatever its version names it), so that the next trial starts clean."""
    for signum, handler in handlers.items():
        if signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)
    module = vars(precise_bn.signals)
    for name, value in list(module.items()):
        if name.startswith("_") and not name.startswith("__"):
            if isinstance(value, (dict, list, set)):
                value.clear()
            elif isinstance(value, int) and not isinstance(value, bool):
                module[name] = 0


def run_case(name: str, count: int, quick: bool, baseline: Dict[int, Any]) -> List[Tuple[str, List[trials.Trial]]]:
    """Every kind of trial on one case; returns (mode, trials) pairs. Each kind starts from the
    signal state of ``baseline``, so what a failed trial of one kind left hidden (a deferred
    signal never handed over) cannot make another kind fail."""
    deep, small = (12, 3) if quick else (cases.DEEP_BLOCKS, cases.SMALL_BLOCKS)
    stride = 25 if quick else 1
    seed = cases.CASE_NAMES.index(name)
    failures: List[str] = []

    def rebuild(case: cases.Case, handlers: Dict[int, Any]) -> cases.Case:
        failures.append(case.name)
        reset_signal_state(handlers)
        torch.set_grad_enabled(True)
        return cases.make_case(name, len(case.model.blocks), 2)

    kinds = [
        ("timed, raising", lambda: trials.timed_trials(cases.make_case(name, deep, 2), count, seed,
                                                       on_failure=rebuild)),
        ("timed, counting", lambda: trials.timed_trials(cases.make_case(name, deep, 2), max(count // 5, 1), seed,
                                                        raising=False, on_failure=rebuild)),
        ("every line, exception", lambda: trials.line_trials(cases.make_case(name, small, 2), stride=stride,
                                                             on_failure=rebuild)),
        ("every line, signal raising", lambda: trials.line_trials(cases.make_case(name, small, 2), send=True,
                                                                  stride=stride, on_failure=rebuild)),
        ("every line, signal counting", lambda: trials.line_trials(cases.make_case(name, small, 2), send=True,
                                                                   raising=False, stride=stride,
                                                                   on_failure=rebuild)),
    ]
    started = time.perf_counter()
    out = []
    for kind, run in kinds:
        reset_signal_state(baseline)
        torch.set_grad_enabled(True)
        out.append((kind, run()))
    common.log.info("%s: %d trials in %.0f s, %d failed", name, sum(len(t) for _, t in out),
                    time.perf_counter() - started, len(failures))
    return out


def table(results: Dict[str, List[Tuple[str, List[trials.Trial]]]]) -> str:
    rows = []
    for name, modes in results.items():
        for mode, done in modes:
            raised = sum(t.raised for t in done)
            rows.append((name, mode, len(done), raised, len(done) - raised, sum(t.deferred for t in done),
                         sum(bool(t.failure) for t in done)))
    return common.markdown_table(
        ("call", "trials", "count", "raised", "returned", "deferred signals", "**failed**"), rows)


def landing(results: Dict[str, List[Tuple[str, List[trials.Trial]]]], mode: str) -> Dict[str, Dict[str, int]]:
    """Per case, how many ``mode`` trials' signals first arrived in each phase."""
    counts = {}
    for name, modes in results.items():
        done = dict(modes)[mode]
        tally = collections.Counter(phase(t.arrived) for t in done if t.landed)
        counts[name] = {p: tally.get(p, 0) for p in PHASES}
    return counts


def plot(path: Path, counts: Dict[str, Dict[str, int]], title: str) -> bool:
    try:
        plt = common.pyplot()
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(9, 3.6))
    names = list(counts)
    left = [0] * len(names)
    colours = plt.get_cmap("tab10")
    for index, p in enumerate(PHASES):
        widths = [counts[n][p] for n in names]
        ax.barh(names, widths, left=left, color=colours(index), label=p)
        for row, (start, width) in enumerate(zip(left, widths)):
            if width >= 12:
                ax.text(start + width / 2, row, str(width), ha="center", va="center", fontsize=8, color="white")
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("random-timed trials whose SIGALRM was first handled in ...")
    ax.set_title(title, fontsize=10)
    ax.legend(ncol=len(PHASES), fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def command(argv: Optional[Sequence[str]]) -> str:
    """The command that ran, quoted for a shell, with the ``PYTHONPATH`` it ran under if any."""
    args = sys.argv[1:] if argv is None else list(argv)
    words = [os.path.relpath(sys.argv[0], common.REPO)] + args
    prefix = "PYTHONPATH={} ".format(shlex.quote(os.environ["PYTHONPATH"])) if os.environ.get("PYTHONPATH") else ""
    return prefix + "python " + " ".join(shlex.quote(w) for w in words)


def load_average() -> str:
    try:
        return "load average {} (1, 5, 15 min) on {} logical cores".format(
            ", ".join("{:.1f}".format(v) for v in os.getloadavg()), os.cpu_count())
    except OSError:
        return "load average unknown"


MAX_POINTS = 60


def failure_points(results: Dict[str, List[Tuple[str, List[trials.Trial]]]]) -> List[str]:
    """Each distinct place and kind of failure, with the calls where it happened."""
    points: Dict[Tuple[str, str], set] = collections.defaultdict(set)
    for name, modes in results.items():
        for _, done in modes:
            for t in done:
                if t.failure:
                    head, _, rest = t.failure.partition(": ")
                    points[(head.partition(", ")[2], rest.split(": ")[0])].add(name)
    return ["- {}: {} ({})".format(where, what, ", ".join(sorted(names)))
            for (where, what), names in sorted(points.items())]


def render(results: Dict[str, List[Tuple[str, List[trials.Trial]]]], args: argparse.Namespace,
           argv: Optional[Sequence[str]], seconds: float, load: Tuple[str, str], figure: bool) -> str:
    counts = landing(results, "timed, raising")
    failed = sum(bool(t.failure) for modes in results.values() for _, done in modes for t in done)
    points = failure_points(results)
    lines = [
        "## {}".format(args.label),
        "",
        "Command: `{}` ({:.0f} s; {} at the start, {} at the end).".format(
            command(argv), seconds, load[0], load[1]),
        "",
        common.run_text(args.threads),
        "",
        table(results),
        "",
        "**{} failed trial(s)** out of {}.".format(
            failed, sum(len(done) for modes in results.values() for _, done in modes)),
    ]
    if points:
        lines += ["", "Where they failed ({} distinct points; the calls where each failed):".format(len(points)), ""]
        lines += points[:MAX_POINTS] + (["- ... and {} more".format(len(points) - MAX_POINTS)]
                                        if len(points) > MAX_POINTS else [])
    lines += ["", "Where the random-timed signals first arrived (raising handler), by phase of the call "
              "(\"outside\": after the call had returned; trials whose alarm was cancelled when the call "
              "returned are not counted):", "",
              common.markdown_table(("call",) + PHASES, [(n,) + tuple(c[p] for p in PHASES)
                                                          for n, c in counts.items()])]
    if figure:
        lines += ["", "![where the signals landed](interrupts.png)"]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser)
    parser.add_argument("--trials", type=int, default=None, help="random-timed trials per call (default 500, quick 10)")
    parser.add_argument("--label", default=None, help="the section's title (default: the Python version)")
    parser.add_argument("--no-plot", action="store_true", help="leave interrupts.png as it is")
    args = common.parse_common(parser, argv)
    args.threads = 1  # tiny operators: a second intra-op thread only waits for a core
    torch.set_num_threads(args.threads)
    args.label = args.label or "Python {}, torch {}".format(platform.python_version(), torch.__version__)
    count = args.trials or (10 if args.quick else 500)
    load_start = load_average()
    started = time.perf_counter()
    baseline = cases.all_handlers()
    results = {name: run_case(name, count, args.quick, baseline) for name in cases.CASE_NAMES}
    seconds = time.perf_counter() - started
    figure = not args.no_plot and plot(args.out / "interrupts.png", landing(results, "timed, raising"),
                                       "{}: {} random-timed trials per call".format(args.label, count))
    text = render(results, args, argv, seconds, (load_start, load_average()), figure)
    path = args.out / "INTERRUPTS.md"
    if not path.exists():
        path.write_text(HEADER)
    common.write_section(path, "interrupts " + args.label, text)
    print(text)


if __name__ == "__main__":
    main()
