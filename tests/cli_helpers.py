"""Running the ``precise-bn`` command in-process on files a test wrote, and comparing checkpoints bit for bit."""
from __future__ import annotations

import socket
from pathlib import Path
from typing import Any, Iterable, List, Mapping, NamedTuple, Sequence, Set, Tuple

import torch

from precise_bn.checkpoint.serializers import SAFE_LOAD_AVAILABLE
from precise_bn.cli import main

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

# A torch without weights_only refuses every untrusted pickle; the layout tests then trust
# their own files, and test_checkpoint checks the refusal itself.
TRUST: List[str] = [] if SAFE_LOAD_AVAILABLE else ["--trust-checkpoint"]

Path_ = Tuple[Any, ...]


class Result(NamedTuple):
    """What a command run gave: its exit status and what it printed."""

    returncode: int
    stdout: str
    stderr: str


def torchrun(ranks: int) -> List[str]:
    """``python -m torch.distributed.run`` arguments for ``ranks`` local ranks: a static rendezvous
    on a free port, since torch 1.10's ``--standalone`` (a c10d rendezvous on a fixed port) could
    hang its launcher when two launches followed each other."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return ["-m", "torch.distributed.run", "--nnodes", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
            "--nproc_per_node", str(ranks)]


def run_cli(capsys: Any, *args: Any) -> Result:
    """``precise-bn ARGS`` in this process (``main``), its output taken from ``capsys``."""
    capsys.readouterr()
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return Result(code, out, err)


def load(path: Any, trusted: bool = False) -> Any:
    """Load a file the way a user's code would, without running code from it unless ``trusted``."""
    if SAFE_LOAD_AVAILABLE:
        return torch.load(str(path), map_location="cpu", weights_only=not trusted)
    return torch.load(str(path), map_location="cpu")


def _bits(t: torch.Tensor) -> Tuple[str, Tuple[int, ...], bytes]:
    return str(t.dtype), tuple(t.shape), t.detach().cpu().contiguous().numpy().tobytes()


def assert_same_except(original: Any, written: Any, changed: Set[Path_], path: Path_ = ()) -> Set[Path_]:
    """Walk both objects: every leaf not in ``changed`` must be identical (tensors: dtype,
    shape and bytes). Returns the ``changed`` paths found; extra keys in ``written`` fail."""
    found: Set[Path_] = set()
    if path in changed:
        assert torch.is_tensor(written) and _bits(original)[:2] == _bits(written)[:2], path
        return {path}
    if torch.is_tensor(original):
        assert torch.is_tensor(written) and _bits(original) == _bits(written), "tensor {} changed".format(path)
    elif isinstance(original, Mapping):
        assert isinstance(written, Mapping) and list(written) == list(original), "keys at {}: {} vs {}".format(
            path, list(written), list(original)
        )
        for key in original:
            found |= assert_same_except(original[key], written[key], changed, path + (key,))
    elif isinstance(original, (list, tuple)):
        assert type(written) is type(original) and len(written) == len(original), path
        for i, (a, b) in enumerate(zip(original, written)):
            found |= assert_same_except(a, b, changed, path + (i,))
    else:
        assert type(written) is type(original) and written == original, "{}: {!r} vs {!r}".format(path, written, original)
    return found


def bn_paths(where: Sequence[Any], prefix: str, names: Iterable[str]) -> Set[Path_]:
    """Key paths of the running stats of the BN layers ``names`` in a checkpoint."""
    return {tuple(where) + (prefix + name + "." + stat,) for name in names for stat in ("running_mean", "running_var")}


def without(mapping: Mapping[str, Any], key: str) -> dict:
    """A copy of ``mapping`` without ``key`` (the provenance entry a write adds)."""
    return {k: v for k, v in mapping.items() if k != key}
