"""What every benchmark script shares: timing against an adjacent floor run at steady state,
the command line, markdown tables, the machine's description, and writing its own section of a
results page, which states its machine once.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import logging
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

import precise_bn
from precise_bn import compiled
from precise_bn.atomic import atomic_write

REPO = Path(__file__).resolve().parents[1]
FLOOR = "forward (floor)"

log = logging.getLogger("precise_bn.benchmarks")

#: Collect garbage before every timed run, so that no collection falls inside one. ``--quick``
#: turns it off: with torchvision and matplotlib loaded a full collection takes tenths of a
#: second, longer than the quick runs themselves.
COLLECT = True


def collect() -> None:
    if COLLECT:
        gc.collect()


def settle() -> None:
    """Steady state, before anything is timed: load (or compile, once per machine) the float64
    sums of every form the warm-up runs measured, what a long pass does after its first batch,
    so that no compile runs during a timed run and every timed call uses the compiled sums. A
    no-op with ``PRECISE_BN_COMPILE=never``; a failed compile is logged (the eager sums then run)."""
    compiled.KERNELS.compile_seen()
    if compiled.KERNELS.failures:
        log.warning("compiling the float64 sums failed, timing the eager ones: %s", compiled.KERNELS.failures)


@contextlib.contextmanager
def compile_policy(policy: str) -> Iterator[None]:
    """``PRECISE_BN_COMPILE=policy`` inside the block (read at every decision), as it was after."""
    before = os.environ.get("PRECISE_BN_COMPILE")
    os.environ["PRECISE_BN_COMPILE"] = policy
    try:
        yield
    finally:
        if before is None:
            del os.environ["PRECISE_BN_COMPILE"]
        else:
            os.environ["PRECISE_BN_COMPILE"] = before


@contextlib.contextmanager
def eager_sums() -> Iterator[compiled.Kernels]:
    """Inside the block every call is measured by the eager float64 operators, whatever this
    process compiled: a fresh, empty :class:`~precise_bn.compiled.Kernels` under
    ``PRECISE_BN_COMPILE=never`` (yielded, so that its ``eager_elements`` can be read)."""
    saved = compiled.KERNELS
    compiled.KERNELS = fresh = compiled.Kernels()
    try:
        with compile_policy("never"):
            yield fresh
    finally:
        compiled.KERNELS = saved


def sums_text() -> str:
    """How this process measures the float64 sums: the compile policy and what it compiled."""
    ready = sorted(compiled.kernel_name(where[:2] + (where[2].type,)) for where in compiled.KERNELS.ready)
    return "Float64 sums: `PRECISE_BN_COMPILE={}`; compiled sums loaded in this process: {}.".format(
        os.environ.get("PRECISE_BN_COMPILE", "auto"), ", ".join(ready) if ready else "none (eager operators)")


@dataclasses.dataclass
class Timing:
    """Per-repetition ratios to the floor, and the seconds of the floor run each was paired with."""

    ratios: List[float]
    floor_seconds: List[float]

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def seconds(self) -> float:
        """Median seconds of the method itself."""
        return statistics.median(r * f for r, f in zip(self.ratios, self.floor_seconds))

    def versus(self, other: "Timing") -> float:
        """Median over repetitions of this method's time over ``other``'s (same repetitions)."""
        return statistics.median(a / b for a, b in zip(self.ratios, other.ratios))

    def cell(self) -> str:
        return "{:.3f} ({:.2f}-{:.2f})".format(self.median, min(self.ratios), max(self.ratios))


def rotated_seconds(
    runs: Mapping[str, Callable[[], Any]], reps: int, clock: Callable[[], float] = time.perf_counter
) -> Dict[str, List[float]]:
    """Seconds of every run in each of ``reps`` repetitions, after one untimed warm-up each
    and :func:`settle`, the order rotated by one each repetition so that no run always goes first (cold caches)
    or last. ``clock`` is wall time by default; ``time.process_time`` gives CPU time."""
    names = list(runs)
    for run in runs.values():
        run()
    settle()
    seconds: Dict[str, List[float]] = {name: [] for name in names}
    for rep in range(reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            collect()
            start = clock()
            runs[name]()
            seconds[name].append(clock() - start)
    return seconds


def _timed(run: Callable[[], Any], clock: Callable[[], float]) -> float:
    collect()
    start = clock()
    run()
    return clock() - start


def time_ratios(
    runs: Mapping[str, Callable[[], Any]], reps: int, floor: str = FLOOR, min_seconds: float = 0.0,
    clock: Callable[[], float] = time.perf_counter,
) -> Dict[str, Timing]:
    """Time of every run over the floor's (wall time, or ``clock``), each ratio from a floor run
    timed right next to it, after one untimed warm-up of every run and :func:`settle`.

    Each repetition times, for every method in turn (order rotated by one each repetition), the
    floor and the method back to back, the floor first on even repetitions and last on odd ones.
    A ratio of two adjacent runs cancels the drift of a shared machine, which moves ratios
    taken several runs apart by a few points. ``reps`` repetitions, and more (up to four times
    as many) until ``min_seconds`` have been spent, so that cheap cases get as many samples as
    the machine's noise needs.
    """
    methods = [name for name in runs if name != floor]
    for run in runs.values():
        run()
    settle()
    ratios: Dict[str, List[float]] = {name: [] for name in methods}
    floors: Dict[str, List[float]] = {name: [] for name in methods}
    started = time.perf_counter()
    rep = 0
    while rep < reps or (time.perf_counter() - started < min_seconds and rep < 4 * reps):
        k = rep % max(len(methods), 1)
        for name in methods[k:] + methods[:k]:
            if rep % 2 == 0:
                base, other = _timed(runs[floor], clock), _timed(runs[name], clock)
            else:
                other, base = _timed(runs[name], clock), _timed(runs[floor], clock)
            ratios[name].append(other / base)
            floors[name].append(base)
        rep += 1
    timings = {name: Timing(ratios[name], floors[name]) for name in methods}
    every_floor = [f for name in methods for f in floors[name]] or [_timed(runs[floor], clock)]
    timings[floor] = Timing([1.0] * len(every_floor), every_floor)
    return timings


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs (CI)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent,
                        help="folder for RESULTS.md and the plots (default: benchmarks/)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads for everything timed (default 2; 1 with --quick, "
                        "where two threads spinning on a busy machine only add noise)")


def parse_common(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """Parse, fix the thread count, create the output folder and turn on progress logging."""
    global COLLECT
    args = parser.parse_args(argv)
    COLLECT = not args.quick
    if args.threads is None:
        args.threads = 1 if args.quick else 2
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    return args


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def target_line(text: str, ok: bool) -> str:
    return "- {}: **{}**".format(text, "met" if ok else "missed")


def fmt_err(value: float) -> str:
    return "{:.1e}".format(value) if value == value and value != float("inf") else str(value)


def machine_text() -> str:
    """This machine and its software, as a page states them once: CPU, cores, system, Python and
    the versions of torch, of the packages a benchmark may use and of precise-bn."""
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = re.search(r"model name\s*:\s*(.*)", f.read()).group(1)
    except (OSError, AttributeError):
        pass
    versions = ["Python {}".format(platform.python_version()), "torch {}".format(torch.__version__)]
    for module in ("torchvision", "fvcore", "numpy", "matplotlib"):
        try:
            mod = __import__(module)
            versions.append("{} {}".format(module, getattr(mod, "__version__", "?")))
        except ImportError:
            pass
    versions.append("precise-bn {}".format(precise_bn.__version__))
    return "{} ({} logical cores), {}; {}".format(cpu, os.cpu_count(), platform.platform(), ", ".join(versions))


def run_text(threads: int, sums: Optional[str] = None) -> str:
    """What one run adds to its page's machine: threads, date, load, and how the float64 sums
    ran (``sums``, else :func:`sums_text`)."""
    return "torch.set_num_threads({}). Run {}; 1-minute load average {:.2f}. {}".format(
        threads, datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), os.getloadavg()[0], sums or sums_text())


def environment_text(threads: int, sums: Optional[str] = None) -> str:
    """The machine and the run, for a page that holds a single report (``CALIBRATION.md``)."""
    return "Machine: {}. {}".format(machine_text(), run_text(threads, sums))


def command_line(argv: Optional[Sequence[str]] = None) -> str:
    """The command that is running: ``sys.argv``, or this script with ``argv`` when a script's
    ``main(argv)`` was called from Python."""
    args = sys.argv[1:] if argv is None else list(argv)
    return "python " + " ".join([os.path.relpath(sys.argv[0], REPO)] + args)


#: The title a page of sections starts with when a script creates it.
PAGE_TITLES = {"RESULTS.md": "precise-bn benchmarks", "SHIFT_RESULTS.md": "Recalibration under distribution shift",
               "DISTRIBUTED_RESULTS.md": "Merging statistics across ranks",
               "COMPRESSION_RESULTS.md": "Recalibrating pruned subnets",
               "CAFFE2_RESULTS.md": "The Caffe2 backend against the original helper",
               "INTERRUPTS.md": "Interrupt trials"}
MACHINE = "machine"


def _markers(key: str) -> Tuple[str, str]:
    return "<!-- BEGIN {} -->".format(key), "<!-- END {} -->".format(key)


def _machine_block(machine: str) -> str:
    begin, end = _markers(MACHINE)
    return "{}\nMachine: {}. Every section below ran on it unless it names another.\n{}".format(begin, machine, end)


def _page_machine(text: str) -> Optional[str]:
    found = re.search(r"<!-- BEGIN machine -->\nMachine: (.*)\. Every section below", text)
    return found.group(1) if found else None


def _with_machine(text: str, machine: str) -> str:
    """``text`` with a machine block: the one it has, else one stating ``machine``, placed before
    the first section."""
    if _page_machine(text) is not None:
        return text
    first = text.find("<!-- BEGIN ")
    if first < 0:
        return text.rstrip("\n") + "\n\n" + _machine_block(machine) + "\n"
    return text[:first] + _machine_block(machine) + "\n\n" + text[first:]


def _naming_machine(body: str, machine: str) -> str:
    """A section's ``body`` with a line naming its own machine under its title."""
    title, _, rest = body.strip().partition("\n")
    return "{}\n\nRan on another machine than the rest of this page: {}.\n{}".format(title, machine, rest)


def write_section(path: Path, key: str, body: str) -> None:
    """Replace the part of ``path`` between this key's markers, keeping the rest of the file.

    Each script owns its section of a page, so either can be rerun alone, and text written
    around the sections by hand survives. The page states its machine once (a ``machine``
    block, written by the first section); a section run on another machine names its own.
    """
    begin, end = _markers(key)
    text = path.read_text() if path.exists() else "# {}\n".format(PAGE_TITLES.get(path.name, path.stem))
    machine = machine_text()
    text = _with_machine(text, machine)
    if _page_machine(text) != machine:
        body = _naming_machine(body, machine)
    block = "{}\n{}\n{}".format(begin, body.strip(), end)
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.touch()  # a new file gets the usual permissions, which atomic_write then keeps
    atomic_write(path, lambda f: f.write(text.encode()))


_OLD_MACHINE = re.compile(r"Machine: (?P<where>[^;\n]+ \(\d+ logical cores\), \S+); "
                          r"(?P<threads>torch\.set_num_threads\(\d+\)\.) (?P<versions>[^\n]*?precise-bn [^\s]+?)\. Run ")


def machine_once(text: str) -> str:
    """A page whose sections each state the machine (as scripts wrote them before the page
    stated it once) with the machine stated once: the machine most of its sections ran on goes
    into the page's machine block (unless it has one), each section keeps its threads, date
    and load, and a section run elsewhere names its machine."""
    sections = re.findall(r"<!-- BEGIN (.+?) -->\n(.*?)\n<!-- END \1 -->", text, re.S)
    machines = {}
    for key, body in sections:
        found = _OLD_MACHINE.search(body)
        if found and key != MACHINE:
            machines[key] = "{}; {}".format(found.group("where"), found.group("versions"))
    if not machines:
        return text
    counts = list(machines.values())
    text = _with_machine(text, max(counts, key=counts.count))
    page = _page_machine(text)
    for key, machine in machines.items():
        begin, end = _markers(key)
        head, rest = text.split(begin + "\n", 1)
        body, tail = rest.split("\n" + end, 1)
        body = _OLD_MACHINE.sub(lambda m: m.group("threads") + " Run ", body, count=1)
        if machine != page:
            body = _naming_machine(body, machine)
        text = head + begin + "\n" + body.strip() + "\n" + end + tail
    return text


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plain_log_ticks(ax, values: Sequence[float]) -> None:
    """Tick a log-scaled x axis at exactly ``values``, written as plain numbers, and grid it."""
    ax.set_xticks(list(values))
    ax.set_xticklabels([str(v) for v in values], rotation=45 if len(values) > 4 else 0)
    ax.minorticks_off()
    ax.grid(True, alpha=0.3)


def section_head(title: str, argv: Optional[Sequence[str]]) -> List[str]:
    """A section's title and the line naming the command and the run (the page states the machine)."""
    return ["## " + title, "Command: `{}`. {}".format(command_line(argv), run_text(torch.get_num_threads()))]


if __name__ == "__main__":  # python benchmarks/common.py PAGE...: state the machine once on pages written before
    for name in sys.argv[1:]:
        page = Path(name)
        page.write_text(machine_once(page.read_text(encoding="utf-8")), encoding="utf-8")
