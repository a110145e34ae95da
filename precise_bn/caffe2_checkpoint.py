"""Caffe2 ``.pkl`` checkpoints: safe loading, atomic saving, and blob names to and from PyTorch.

Caffe2 tools (Detectron, video non-local nets, R(2+1)D) pickle ``{"blobs": {name: ndarray}}``
(Detectron adds a ``"cfg"`` string next to it) or a flat ``{name: ndarray}``, often from
Python 2. Unpickling runs whatever callable the file names, so :func:`read_caffe2_pickle`
resolves only numpy's array, dtype and scalar rebuilders and plain containers; any other global
is refused before anything is called. Writing back keeps every entry of the file and its
layout; only the blobs given change.

Naming: a blob name splits into a layer and a parameter suffix, ``{layer}_w`` / ``_b`` for
convolutions and FC layers and ``{layer}_s`` / ``_b`` / ``_rm`` / ``_riv`` for SpatialBN
(``res2_0_branch2a_bn_s`` is layer ``res2_0_branch2a_bn``, weight). Rules map the layer part
only; the suffix decides the PyTorch parameter (``_riv`` is a variance and is copied as is into
``running_var``). Values are copied bit for bit, so Caffe2 -> PyTorch -> Caffe2 returns every
mapped blob unchanged.

This module needs numpy and torch only, never Caffe2.
"""
from __future__ import annotations

import collections
import copy
import importlib
import os
import pickle
import re
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .atomic import PathLike, atomic_write
from .errors import CheckpointError, UnsafeCheckpointError

Replacement = Union[str, Callable[["re.Match[str]"], str]]
RuleList = Sequence[Tuple[str, Replacement]]
NameMap = Union[RuleList, Callable[[str], Optional[str]]]
Rules = Optional[NameMap]
ShapeMismatch = Tuple[str, str, Tuple[int, ...], Tuple[int, ...]]


def _stage(match: "re.Match[str]", offset: int) -> str:
    return str(int(match.group(1)) + offset)


# Caffe2 model-zoo ResNet layer names -> torchvision ResNet module names. Stage s of Caffe2
# (res2..res5) is torchvision's layer{s-1}; branch2a/b/c are conv1/2/3 (BasicBlock has a, b).
RESNET_RULES: List[Tuple[str, Replacement]] = [
    (r"conv1", "conv1"),
    (r"res_conv1_bn", "bn1"),
    (r"res(\d+)_(\d+)_branch2([abc])", lambda m: "layer{}.{}.conv{}".format(
        _stage(m, -1), m.group(2), "abc".index(m.group(3)) + 1)),
    (r"res(\d+)_(\d+)_branch2([abc])_bn", lambda m: "layer{}.{}.bn{}".format(
        _stage(m, -1), m.group(2), "abc".index(m.group(3)) + 1)),
    (r"res(\d+)_(\d+)_branch1", lambda m: "layer{}.{}.downsample.0".format(_stage(m, -1), m.group(2))),
    (r"res(\d+)_(\d+)_branch1_bn", lambda m: "layer{}.{}.downsample.1".format(_stage(m, -1), m.group(2))),
    (r"pred", "fc"),
]

# The inverse of RESNET_RULES: torchvision module names -> Caffe2 layer names.
RESNET_TORCH_RULES: List[Tuple[str, Replacement]] = [
    (r"conv1", "conv1"),
    (r"bn1", "res_conv1_bn"),
    (r"layer(\d+)\.(\d+)\.conv([123])", lambda m: "res{}_{}_branch2{}".format(
        _stage(m, 1), m.group(2), "abc"[int(m.group(3)) - 1])),
    (r"layer(\d+)\.(\d+)\.bn([123])", lambda m: "res{}_{}_branch2{}_bn".format(
        _stage(m, 1), m.group(2), "abc"[int(m.group(3)) - 1])),
    (r"layer(\d+)\.(\d+)\.downsample\.0", lambda m: "res{}_{}_branch1".format(_stage(m, 1), m.group(2))),
    (r"layer(\d+)\.(\d+)\.downsample\.1", lambda m: "res{}_{}_branch1_bn".format(_stage(m, 1), m.group(2))),
    (r"fc", "pred"),
]

# Blob suffix -> PyTorch parameter, longest suffixes first.
_CAFFE2_SUFFIXES = (
    ("_riv", "running_var"), ("_rm", "running_mean"), ("_s", "weight"), ("_w", "weight"), ("_b", "bias")
)
_TORCH_BN_SUFFIXES = {"weight": "_s", "bias": "_b", "running_mean": "_rm", "running_var": "_riv"}
_TORCH_SUFFIXES = {"weight": "_w", "bias": "_b"}

# Blobs that are not model state: optimizer state, learning rate and iteration counters,
# gradients, SpatialBN's per-batch saved mean / inverse std.
_CAFFE2_SKIP = re.compile(
    r"(_momentum|_grad|_sm|_siv|_first_moment|_second_moment|_lr|_lr_cpu)$"
    r"|(^|/)(lr|iter|ITER|iteration_mutex|optimizer_iteration|ONE_\d+_\d+)$"
)
_TORCH_SKIP = re.compile(r"(^|\.)num_batches_tracked$")


@dataclass
class ConversionReport:
    """What a conversion did with every key.

    ``mapped``: source key -> destination key. ``skipped``: left out on purpose (optimizer
    state, counters, saved batch stats). ``unmatched``: no rule or suffix maps them, left out.
    ``unexpected``: mapped, but the target has no such key, left out. ``missing``: target keys
    nothing filled. ``shape_mismatches``: (source, destination, source shape, target shape),
    left out. The last three are only filled when a target is given.
    """

    mapped: Dict[str, str] = field(default_factory=dict)
    skipped: List[str] = field(default_factory=list)
    unmatched: List[str] = field(default_factory=list)
    unexpected: List[str] = field(default_factory=list)
    missing: List[str] = field(default_factory=list)
    shape_mismatches: List[ShapeMismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every key found a home and the target (if any) is fully filled."""
        return not (self.unmatched or self.unexpected or self.missing or self.shape_mismatches)

    def __str__(self) -> str:
        rows = ["{} mapped, {} skipped, {} unmatched, {} unexpected, {} missing, {} shape mismatches".format(
            len(self.mapped), len(self.skipped), len(self.unmatched), len(self.unexpected),
            len(self.missing), len(self.shape_mismatches))]
        for title in ("unmatched", "unexpected", "missing"):
            keys = getattr(self, title)
            if keys:
                rows.append("  {}: {}".format(title, ", ".join(keys)))
        for source, dest, have, want in self.shape_mismatches:
            rows.append("  shape mismatch: {} {} -> {} {}".format(source, have, dest, want))
        return "\n".join(rows)


def _numpy_module(name: str) -> Any:
    """numpy's ``core`` submodule ``name`` under its numpy 2 (``_core``) or numpy 1 (``core``) path."""
    try:
        return importlib.import_module("numpy._core." + name)
    except ImportError:
        return importlib.import_module("numpy.core." + name)


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    """``_codecs.encode`` as Python 3 protocol-2 pickles use it for bytes: latin-1 only."""
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError("_codecs.encode with {!r} is not a bytes literal".format(encoding))
    return text.encode("latin1")


def _allowed_globals() -> Dict[Tuple[str, str], Any]:
    multiarray, numeric = _numpy_module("multiarray"), _numpy_module("numeric")
    allowed: Dict[Tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("builtins", "complex"): complex,
        ("builtins", "bytearray"): bytearray,
        ("_codecs", "encode"): _latin1_encode,
    }
    for package in ("numpy.core", "numpy._core"):
        allowed[(package + ".multiarray", "_reconstruct")] = multiarray._reconstruct
        allowed[(package + ".multiarray", "scalar")] = multiarray.scalar
        allowed[(package + ".numeric", "_frombuffer")] = numeric._frombuffer
    return allowed


class _RestrictedUnpickler(pickle.Unpickler):
    """Builds numpy arrays, dtypes, scalars and plain containers; refuses every other global.

    ``encoding="latin1"`` reads Python 2 ``str`` objects (blob names, array bytes) as numpy
    expects them.
    """

    def __init__(self, handle: Any, path: str):
        super().__init__(handle, encoding="latin1")
        self.path = path
        self.allowed = _allowed_globals()

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is None:
            raise UnsafeCheckpointError(
                "{}: refused to load the global {}.{}: a Caffe2 checkpoint holds only numpy "
                "arrays, dtypes, scalars and plain containers, and this pickle would call other "
                "code while loading; nothing was run".format(self.path, module, name)
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(
            "{}: refused a persistent reference {!r}: not a Caffe2 blob pickle; nothing was run".format(
                self.path, pid
            )
        )


def _blob_table(root: Any, name: str) -> Dict[Any, Any]:
    """The blob dictionary in a loaded file: ``root["blobs"]``, or ``root`` itself when flat."""
    table = root.get("blobs", root) if isinstance(root, dict) else None
    if not isinstance(table, dict):
        raise CheckpointError(
            "{}: expected {{'blobs': {{name: array}}}} or {{name: array}}, got {}".format(
                name, type(root).__name__
            )
        )
    return table


def _blob_name(key: Any) -> str:
    return key.decode("latin1") if isinstance(key, bytes) else str(key)


def read_caffe2_pickle(path: PathLike) -> Tuple[Any, Dict[str, np.ndarray]]:
    """Read a Caffe2 ``.pkl`` (``{"blobs": {...}}`` or flat), Python 2 pickles included.

    Returns the whole object the file holds (a config string, an iteration count next to
    ``"blobs"`` included; give it to :func:`save_caffe2_pickle` as ``root`` to write the file
    back) and its blobs: blob name -> ndarray, numpy scalars as 0-d arrays; entries of the blob
    dictionary that are not arrays are left out of the blobs.

    Raises:
        UnsafeCheckpointError: the pickle names a global other than numpy's array/dtype/scalar
            rebuilders or plain containers (nothing is run).
        CheckpointError: the file is missing, not a pickle, or holds no blob dictionary.
    """
    name = os.fspath(path)
    try:
        with open(name, "rb") as handle:
            root = _RestrictedUnpickler(handle, name).load()
    except UnsafeCheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError("{}: cannot read the checkpoint: {}".format(name, exc)) from exc
    except Exception as exc:
        raise CheckpointError(
            "{}: not a Caffe2 blob pickle: {}: {}".format(name, type(exc).__name__, exc)
        ) from exc
    blobs = {
        _blob_name(key): np.asarray(value)
        for key, value in _blob_table(root, name).items()
        if isinstance(value, (np.ndarray, np.generic))
    }
    return root, blobs


def load_caffe2_pickle(path: PathLike) -> Dict[str, np.ndarray]:
    """The blobs of a Caffe2 ``.pkl``: blob name -> ndarray (see :func:`read_caffe2_pickle`)."""
    return read_caffe2_pickle(path)[1]


def _with_blobs(root: Any, blobs: Mapping[str, np.ndarray], where: str) -> Any:
    """A shallow copy of ``root`` whose blob dictionary holds ``blobs`` under the keys, dtypes
    and shapes of the blobs they replace (numpy scalars stay scalars); ``root`` is unchanged."""
    table = _blob_table(root, where)
    keys = {_blob_name(k): k for k, v in table.items() if isinstance(v, (np.ndarray, np.generic))}
    unknown = sorted(set(blobs) - set(keys))
    if unknown:
        raise CheckpointError(
            "{}: no blob {} in the checkpoint to write back into".format(where, ", ".join(unknown))
        )
    new_table = copy.copy(table)
    for name, array in blobs.items():
        old = table[keys[name]]
        value = array.astype(old.dtype).reshape(np.shape(old))
        new_table[keys[name]] = value[()] if isinstance(old, np.generic) else value
    if table is root:
        return new_table
    new_root = copy.copy(root)
    new_root["blobs"] = new_table
    return new_root


def save_caffe2_pickle(blobs: Mapping[str, Any], path: Union[PathLike, BinaryIO], root: Any = None) -> None:
    """Write ``{"blobs": {name: ndarray}}`` to ``path`` atomically (temporary file, fsync,
    rename), or into an open binary file whose writer handles atomicity.

    With ``root`` (the object :func:`read_caffe2_pickle` returned) the file keeps the layout and
    every entry of ``root``: only the named ``blobs`` change, each cast to the dtype and shape
    of the blob it replaces, so readers of the original file read the new one alike.

    Protocol 2, the highest that the Python 2 Caffe2 tools can read.
    """
    where = getattr(path, "name", "<stream>") if hasattr(path, "write") else os.fspath(path)
    out: Dict[str, np.ndarray] = {}
    for key, value in blobs.items():
        array = _to_numpy(value)
        if array.dtype == object:
            raise CheckpointError(
                "{}: blob {!r} is not a numeric array ({})".format(where, key, type(value).__name__)
            )
        out[str(key)] = array
    content = {"blobs": out} if root is None else _with_blobs(root, out, where)
    if hasattr(path, "write"):
        pickle.dump(content, path, protocol=2)
    else:
        atomic_write(path, lambda handle: pickle.dump(content, handle, protocol=2))


def map_name(name: str, rules: NameMap) -> Optional[str]:
    """Apply ``rules`` to a layer name: the first regex rule that matches the whole name, or
    the callable; None when nothing matches."""
    if callable(rules):
        return rules(name)
    for pattern, replacement in rules:
        match = re.fullmatch(pattern, name)
        if match is not None:
            return replacement(match) if callable(replacement) else match.expand(replacement)
    return None


def split_caffe2_name(blob: str) -> Optional[Tuple[str, str]]:
    """``"res2_0_branch2a_bn_riv"`` -> ``("res2_0_branch2a_bn", "running_var")``; None if no suffix fits."""
    for suffix, param in _CAFFE2_SUFFIXES:
        if blob.endswith(suffix) and len(blob) > len(suffix):
            return blob[: -len(suffix)], param
    return None


def folded_bn_layers(blobs: Mapping[str, Any]) -> List[str]:
    """Layers with a scale ``_s`` and bias ``_b`` but no ``_rm`` / ``_riv``: BN folded into
    AffineChannel."""
    names = set(blobs)
    layers = [blob[: -len("_s")] for blob in names if blob.endswith("_s")]
    return sorted(
        layer for layer in layers
        if layer + "_b" in names and not {layer + "_rm", layer + "_riv"} <= names
    )


def check_bn_stats(blobs: Mapping[str, Any], source: str = "checkpoint") -> None:
    """Raise CheckpointError when some BN layer was folded into AffineChannel.

    Such a layer computes ``y = s * x + b`` with its statistics already absorbed
    (``s = gamma / sqrt(var + eps)``, ``b = beta - mean * s``); the checkpoint keeps no running
    mean or variance and the layer never normalises, so there is nothing to recompute.
    """
    folded = folded_bn_layers(blobs)
    if folded:
        raise CheckpointError(
            "{}: {} layer(s) have _bn_s/_bn_b but no _bn_rm/_bn_riv (first: {}): their BatchNorm "
            "was folded into AffineChannel, y = s * x + b, with the statistics already absorbed into "
            "s and b. There are no running statistics to recompute and the layer never normalises, "
            "so precise BN has no meaning for this checkpoint: recompute from the training checkpoint "
            "with unfolded BN, or convert with require_bn_stats=False to keep the fixed affine "
            "layers as they are".format(source, len(folded), ", ".join(folded[:5]))
        )


def _to_torch(blob: str, array: np.ndarray) -> torch.Tensor:
    native = np.array(array, dtype=array.dtype.newbyteorder("="), order="C", copy=True)
    try:
        return torch.from_numpy(native)
    except TypeError as exc:
        raise CheckpointError(
            "blob {!r} of dtype {} has no PyTorch tensor type".format(blob, array.dtype)
        ) from exc


def _to_numpy(tensor: Any) -> np.ndarray:
    if torch.is_tensor(tensor):
        return tensor.detach().cpu().numpy().copy()
    return np.array(tensor, copy=True)


def _target_state(target: Any) -> Optional[Dict[str, Tuple[int, ...]]]:
    """Key -> shape of a target ``nn.Module``, state dict or blob dict."""
    if target is None:
        return None
    state = target.state_dict() if isinstance(target, torch.nn.Module) else target
    return {
        key: tuple(value.shape) if torch.is_tensor(value) else np.shape(value)
        for key, value in state.items()
    }


def _check_against(
    converted: Dict[str, Any],
    report: ConversionReport,
    shapes: Optional[Dict[str, Tuple[int, ...]]],
    skip: "re.Pattern[str]",
) -> Dict[str, Any]:
    """Drop keys the target lacks or holds in another shape (reported), list what it misses."""
    if shapes is None:
        return converted
    kept: Dict[str, Any] = {}
    source_of = {dest: source for source, dest in report.mapped.items()}
    for dest, value in converted.items():
        if dest not in shapes:
            report.unexpected.append(source_of[dest])
        elif tuple(value.shape) != tuple(shapes[dest]):
            report.shape_mismatches.append((source_of[dest], dest, tuple(value.shape), tuple(shapes[dest])))
        else:
            kept[dest] = value
    report.missing.extend(key for key in shapes if key not in converted and not skip.search(key))
    return kept


def _add(out: Dict[str, Any], report: ConversionReport, source: str, dest: str, value: Any) -> None:
    if dest in out:
        first = next(key for key, mapped in report.mapped.items() if mapped == dest)
        raise CheckpointError(
            "{!r} and {!r} both map to {!r}: fix the name rules".format(first, source, dest)
        )
    out[dest] = value
    report.mapped[source] = dest


def caffe2_to_torch(
    blobs: Mapping[str, np.ndarray],
    rules: Rules = None,
    target: Any = None,
    require_bn_stats: bool = True,
    source: str = "checkpoint",
) -> Tuple[Dict[str, torch.Tensor], ConversionReport]:
    """Caffe2 blobs -> PyTorch state dict, bit for bit (a big-endian blob becomes native-endian).

    Args:
        blobs: blob name -> ndarray, e.g. from :func:`load_caffe2_pickle`.
        rules: maps Caffe2 layer names to PyTorch module names: ``[(regex, replacement), ...]``
            (first full match wins; the replacement is a ``re`` template or a function of the
            match) or a callable ``name -> name or None``. Default: :data:`RESNET_RULES`.
        target: an ``nn.Module`` or state dict to check keys and shapes against; keys it lacks
            or holds in another shape are left out and reported.
        require_bn_stats: refuse checkpoints whose BN was folded into AffineChannel
            (:func:`check_bn_stats`); pass False to convert them for other uses.
        source: the checkpoint's name in error messages.
    """
    if require_bn_stats:
        check_bn_stats(blobs, source)
    rules = RESNET_RULES if rules is None else rules
    report = ConversionReport()
    out: Dict[str, torch.Tensor] = {}
    for blob, value in blobs.items():
        if _CAFFE2_SKIP.search(blob):
            report.skipped.append(blob)
            continue
        split = split_caffe2_name(blob)
        module = map_name(split[0], rules) if split is not None else None
        if module is None:
            report.unmatched.append(blob)
            continue
        dest = "{}.{}".format(module, split[1]) if module else split[1]
        _add(out, report, blob, dest, _to_torch(blob, np.asarray(value)))
    return _check_against(out, report, _target_state(target), _TORCH_SKIP), report


def torch_to_caffe2(
    state_dict: Mapping[str, Any],
    rules: Rules = None,
    base: Optional[Mapping[str, np.ndarray]] = None,
) -> Tuple[Dict[str, np.ndarray], ConversionReport]:
    """PyTorch state dict -> Caffe2 blobs, bit for bit (float32 stays float32).

    A module with ``running_mean`` is a BN layer: weight, bias, running_mean, running_var
    become ``_s``, ``_b``, ``_rm``, ``_riv``; other modules' weight and bias become ``_w``,
    ``_b``; ``num_batches_tracked`` is skipped.

    Args:
        state_dict: the PyTorch state dict (or a module's ``state_dict()``).
        rules: maps PyTorch module names to Caffe2 layer names, as in :func:`caffe2_to_torch`.
            Default: :data:`RESNET_TORCH_RULES`.
        base: the original Caffe2 blobs. The result starts from a copy of them, so blobs a
            conversion never carries (momentum, learning rate, iteration) survive a round trip;
            keys and shapes are checked against them.
    """
    rules = RESNET_TORCH_RULES if rules is None else rules
    report = ConversionReport()
    bn_modules = {key.rsplit(".", 1)[0] for key in state_dict if key.endswith("running_mean")}
    out: Dict[str, np.ndarray] = {}
    for key, value in state_dict.items():
        if _TORCH_SKIP.search(key):
            report.skipped.append(key)
            continue
        module, _, param = key.rpartition(".")
        suffix = (_TORCH_BN_SUFFIXES if module in bn_modules else _TORCH_SUFFIXES).get(param)
        layer = map_name(module, rules) if suffix is not None else None
        if layer is None:
            report.unmatched.append(key)
            continue
        _add(out, report, key, layer + suffix, _to_numpy(value))
    checked = _check_against(out, report, _target_state(base), _CAFFE2_SKIP)
    if base is None:
        return checked, report
    merged = {key: np.array(value, copy=True) for key, value in base.items()}
    merged.update(checked)
    return merged, report
