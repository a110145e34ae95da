"""Caffe2 blob names to and from PyTorch state-dict keys: rules map the layer part, the suffix the
parameter, values copied bit for bit (docs/caffe2.md, "precise-bn convert"). No Caffe2 needed."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ..errors import CheckpointError
from .checkpoint import to_numpy

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
CAFFE2_NOT_STATE = _CAFFE2_SKIP = re.compile(
    r"(_momentum|_grad|_sm|_siv|_first_moment|_second_moment|_lr|_lr_cpu)$"
    r"|(^|/)(lr|iter|ITER|iteration_mutex|optimizer_iteration|ONE_\d+_\d+)$"
)
_TORCH_SKIP = re.compile(r"(^|\.)num_batches_tracked$")

#: What a conversion does with a name no rule maps.
UNMAPPED_POLICIES = ("error", "keep", "drop")


@dataclass
class ConversionReport:
    """What a conversion did with every key: ``mapped`` (source -> destination), ``skipped`` (not
    model state), ``unmatched`` (no rule; ``kept`` under their names), and against a target,
    ``unexpected``, ``missing`` and ``shape_mismatches`` (source, destination, shapes), left out."""

    mapped: Dict[str, str] = field(default_factory=dict)
    skipped: List[str] = field(default_factory=list)
    unmatched: List[str] = field(default_factory=list)
    kept: List[str] = field(default_factory=list)
    unexpected: List[str] = field(default_factory=list)
    missing: List[str] = field(default_factory=list)
    shape_mismatches: List[ShapeMismatch] = field(default_factory=list)

    @property
    def dropped(self) -> List[str]:
        """Unmatched keys left out (``unmapped="drop"``)."""
        return [key for key in self.unmatched if key not in self.kept]

    @property
    def ok(self) -> bool:
        """True when every key found a home and the target (if any) is fully filled."""
        return not (self.dropped or self.unexpected or self.missing or self.shape_mismatches)

    def __str__(self) -> str:
        rows = ["{} mapped ({} kept under their own names), {} skipped, {} dropped, {} unexpected, {} missing, "
                "{} shape mismatches".format(len(self.mapped), len(self.kept), len(self.skipped), len(self.dropped),
                                             len(self.unexpected), len(self.missing), len(self.shape_mismatches))]
        for title in ("skipped", "kept", "dropped", "unexpected", "missing"):
            keys = getattr(self, title)
            if keys:
                rows.append("  {}: {}".format(title, ", ".join(keys)))
        for source, dest, have, want in self.shape_mismatches:
            rows.append("  shape mismatch: {} {} -> {} {}".format(source, have, dest, want))
        return "\n".join(rows)


def map_name(name: str, rules: NameMap) -> Optional[str]:
    """``rules`` applied to a layer name (first full regex match, or the callable); None if none."""
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
    """Layers with ``_s`` and ``_b`` but no ``_rm`` / ``_riv``: BN folded into AffineChannel."""
    names = set(blobs)
    layers = [blob[: -len("_s")] for blob in names if blob.endswith("_s")]
    return sorted(
        layer for layer in layers
        if layer + "_b" in names and not {layer + "_rm", layer + "_riv"} <= names
    )


def check_bn_stats(blobs: Mapping[str, Any], source: str = "checkpoint") -> None:
    """Raise CheckpointError when some BN layer was folded into AffineChannel: its statistics are
    absorbed into ``s`` and ``b`` and it never normalises, so there is nothing to recompute."""
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


def _settle_unmapped(out: Dict[str, Any], report: ConversionReport, values: Mapping[str, Any],
                     unmapped: str, source: str) -> None:
    """Apply the ``unmapped`` policy to ``report.unmatched`` (``values``: each one's tensor)."""
    if not report.unmatched or unmapped == "drop":
        return
    if unmapped == "error":
        names = report.unmatched
        raise CheckpointError(
            "{}: {} tensor(s) have names no rule maps: {}. Nothing was written: keep them under their own "
            "names (--keep-unmapped, unmapped='keep'), leave them out (--drop-unmapped, unmapped='drop'), or "
            "give rules that map them (--caffe2-rules, rules=...)".format(source, len(names), ", ".join(names)))
    for key in report.unmatched:
        _add(out, report, key, key, values[key])
        report.kept.append(key)


def _check_policy(unmapped: str) -> None:
    if unmapped not in UNMAPPED_POLICIES:
        raise CheckpointError("unmapped must be one of {}, got {!r}".format(UNMAPPED_POLICIES, unmapped))


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
    unmapped: str = "error",
) -> Tuple[Dict[str, torch.Tensor], ConversionReport]:
    """Caffe2 blobs -> PyTorch state dict, bit for bit (big-endian blobs become native-endian).
    ``rules``: ``[(regex, replacement), ...]`` (first full match) or a callable, default
    :data:`RESNET_RULES`; ``target``: a module or state dict whose keys and shapes are checked;
    ``require_bn_stats``: refuse folded BN; ``unmapped``: one of :data:`UNMAPPED_POLICIES`."""
    _check_policy(unmapped)
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
    unmatched = {blob: _to_torch(blob, np.asarray(blobs[blob])) for blob in report.unmatched} if unmapped == "keep" else {}
    _settle_unmapped(out, report, unmatched, unmapped, source)
    return _check_against(out, report, _target_state(target), _TORCH_SKIP), report


def torch_to_caffe2(
    state_dict: Mapping[str, Any],
    rules: Rules = None,
    base: Optional[Mapping[str, np.ndarray]] = None,
    unmapped: str = "error",
    source: str = "state dict",
) -> Tuple[Dict[str, np.ndarray], ConversionReport]:
    """PyTorch state dict -> Caffe2 blobs, bit for bit (BN: ``_s``, ``_b``, ``_rm``, ``_riv``; others
    ``_w``, ``_b``). ``rules`` as in :func:`caffe2_to_torch` (default :data:`RESNET_TORCH_RULES`);
    ``base``: the original blobs, copied first so that momentum and counters survive a round trip."""
    _check_policy(unmapped)
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
        _add(out, report, key, layer + suffix, to_numpy(value))
    unmatched = {key: to_numpy(state_dict[key]) for key in report.unmatched} if unmapped == "keep" else {}
    _settle_unmapped(out, report, unmatched, unmapped, source)
    checked = _check_against(out, report, _target_state(base), _CAFFE2_SKIP)
    if base is None:
        return checked, report
    merged = {key: np.array(value, copy=True) for key, value in base.items()}
    merged.update(checked)
    return merged, report
