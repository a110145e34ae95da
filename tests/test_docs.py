"""The README stays one read long and starts with what a newcomer needs; every relative link in it
and in ``docs/`` leads to a file (and heading) that exists, and every page of ``docs/`` back to the
README; install hints work from a checkout; every ```python block runs as written, given only the
names its first line says it assumes."""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Set, Tuple

import pytest

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


def test_readme_first_screen_says_what_it_does_how_to_run_it_and_how_to_switch():
    first = "\n".join(README.read_text(encoding="utf-8").splitlines()[:FIRST_SCREEN_LINES])
    for command in ("pip install .", "precise-bn demo", "bash scripts/dev.sh demo", "bash scripts/dev.sh test",
                    "report = recompute(model, train_loader", "from precise_bn import update_bn_stats  # was: from "
                    "fvcore.nn import update_bn_stats", "from precise_bn import update_bn        # was: from "
                    "torch.optim.swa_utils import update_bn"):
        assert command in first, "the README's first {} lines lack `{}`".format(FIRST_SCREEN_LINES, command)
    assert "\n## " not in first.split("torch.optim.swa_utils import update_bn")[0], \
        "no section comes before the import lines: what it does, the two commands, the imports come first"


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


# ---------------------------------------------------------------- the pages' python blocks run

_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
#: A block's first line may say what it assumes: ``# given: model, train_loader`` and, after a
#: semicolon, where it runs: ``under torchrun`` (a process group of one), ``in the caffe2
#: environment``. Every other name a block uses, it defines or imports.
_GIVEN_LINE = re.compile(r"# given: ([\w, ]+)(?:; (under torchrun|in the caffe2 environment))?$")


def python_blocks() -> Iterator[Tuple[str, int, str]]:
    """``(page, line, code)`` of every ```python block of the README and docs/."""
    for page in _pages():
        text = page.read_text(encoding="utf-8")
        for match in _PYTHON_BLOCK.finditer(text):
            yield str(page.relative_to(REPO)), text[:match.start()].count("\n") + 2, match.group(1)


def given(code: str) -> Tuple[List[str], str]:
    """The names a block assumes and where it runs (``""``: the main environment)."""
    match = _GIVEN_LINE.match(code.splitlines()[0]) if code.strip() else None
    if not match:
        return [], ""
    return [name.strip() for name in match.group(1).split(",")], match.group(2) or ""


def small_resnet() -> "torch.nn.Module":
    """A model as the pages mean one: BN layers, ResNet-style ``layer1`` blocks, 10 classes."""
    import torch
    from torch import nn

    def conv_bn(c_in: int, c_out: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU())

    torch.manual_seed(0)
    return nn.Sequential(collections.OrderedDict(stem=conv_bn(3, 8), layer1=nn.Sequential(conv_bn(8, 8), conv_bn(8, 8)),
                                                 pool=nn.AdaptiveAvgPool2d(1), flatten=nn.Flatten(), fc=nn.Linear(8, 10)))


def image_loader() -> Any:
    """A training loader as the pages mean one: 256 shuffled batches of (images, labels)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    images, labels = torch.randn(4096, 3, 8, 8, generator=generator), torch.randint(0, 10, (4096,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=16, shuffle=True,
                                       generator=generator)


def caffe2_net() -> Tuple[Any, Any]:
    """``train_model`` and ``feeds`` of the Caffe2 pages: a SpatialBN net on two devices' name
    scopes, and one ``{blob: array}`` per iteration for each."""
    import numpy as np
    from caffe2.proto import caffe2_pb2
    from caffe2.python import brew, core, model_helper, workspace

    workspace.ResetWorkspace()
    model = model_helper.ModelHelper(name="train")
    for device in ("gpu_0", "gpu_1"):
        with core.DeviceScope(core.DeviceOption(caffe2_pb2.CPU)), core.NameScope(device):
            brew.conv(model, "data", "conv1", 3, 4, 3, pad=1)
            brew.spatial_bn(model, "conv1", "conv1_bn", 4, epsilon=1e-5, is_test=False)
    workspace.RunNetOnce(model.param_init_net)
    rng = np.random.RandomState(0)
    feeds = [{d + "/data": rng.randn(4, 3, 6, 6).astype(np.float32) for d in ("gpu_0", "gpu_1")} for _ in range(200)]
    return model, feeds


#: What a block may assume, and how the test makes it.
GIVEN = {"model": small_resnet, "train_loader": image_loader, "loader": image_loader}


def run_block(page: str, line: int) -> None:
    """Run the block of ``page`` at ``line`` as written, with the names it says it assumes."""
    code = next(c for p, n, c in python_blocks() if (p, n) == (page, line))
    names, where = given(code)
    namespace: Dict[str, Any] = {"__name__": "__main__"}
    if where == "in the caffe2 environment":
        namespace["train_model"], namespace["feeds"] = caffe2_net()
        names = [n for n in names if n not in ("train_model", "feeds")]
    unknown = [n for n in names if n not in GIVEN]
    assert not unknown, "{}:{} assumes {}; a block may assume only {}".format(page, line, unknown, sorted(GIVEN))
    namespace.update({name: GIVEN[name]() for name in names})
    if where == "under torchrun":
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 1000), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_process_group("gloo")
    exec(compile(code, "{}:{}".format(page, line), "exec"), namespace)


def _block_params(caffe2: bool) -> list:
    return [pytest.param(page, line, id="{}:{}".format(page, line)) for page, line, code in python_blocks()
            if (given(code)[1] == "in the caffe2 environment") == caffe2]


def _run_in_a_process(page: str, line: int, tmp_path: Path) -> None:
    """Each block in a process of its own (process groups, Lightning and Accelerate keep state),
    in an empty folder, importing this checkout's package and this module."""
    path = os.pathsep.join([str(REPO), str(REPO / "tests")] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    done = subprocess.run([sys.executable, "-c", "import test_docs; test_docs.run_block({!r}, {})".format(page, line)],
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, "{}:{} does not run as written:\n{}".format(page, line, done.stderr[-3000:])


@pytest.mark.main_env
@pytest.mark.parametrize("page, line", _block_params(caffe2=False))
def test_every_python_block_runs_as_written(page, line, tmp_path):
    _run_in_a_process(page, line, tmp_path)


@pytest.mark.caffe2_env
@pytest.mark.parametrize("page, line", _block_params(caffe2=True))
def test_every_caffe2_python_block_runs_as_written(page, line, tmp_path):
    _run_in_a_process(page, line, tmp_path)


def test_the_harvest_finds_blocks_and_what_they_assume():
    blocks = list(python_blocks())
    assert len(blocks) >= 10 and all(code.strip() for _, _, code in blocks)
    assert given("# given: model, loader; under torchrun\nx = 1\n") == (["model", "loader"], "under torchrun")
    assert given("import torch\n") == ([], "")
    page, line, code = blocks[0]
    assert (REPO / page).read_text(encoding="utf-8").splitlines()[line - 1] == code.splitlines()[0]


def test_every_docs_page_links_back_to_the_readme():
    for page in sorted((REPO / "docs").glob("*.md")):
        targets = [path for path, _ in _links(page)]
        assert "../README.md" in targets, "{} has no link back to the README".format(page.relative_to(REPO))


def test_the_readme_cost_figures_are_the_cost_benchmark_s():
    """The README's cost line quotes the range ``benchmarks/cost.py`` last wrote: over the models,
    the pass over the forward and over fvcore, so that a rerun that moves them fails here until
    the README says so."""
    results = (README.parent / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    section = results.split("<!-- BEGIN cost -->")[1].split("<!-- END cost -->")[0]
    forward = [float(x) for x in re.findall(r"^- precise-bn on \S+: ([\d.]+)x the forward", section, re.M)]
    fvcore = [float(x) for x in re.findall(r"^- precise-bn / fvcore on \S+: ([\d.]+) ", section, re.M)]
    assert len(forward) == len(fvcore) == 3, (forward, fvcore)
    line = "a pass costs {:.3f}x to {:.3f}x the forward and {:.3f}x to {:.3f}x fvcore's".format(
        min(forward), max(forward), min(fvcore), max(fvcore))
    assert line in " ".join(README.read_text(encoding="utf-8").split()), line
