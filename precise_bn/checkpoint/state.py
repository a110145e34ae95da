"""State dicts inside checkpoints: where the model's tensors sit (under a wrapper's prefix, found by
matching the model's own keys), matching them to a model, putting new BN statistics in; no I/O."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import torch
from torch import nn

from ..errors import CheckpointError, Fix
from ..report import BNReport

STATE_DICT_KEYS = ("state_dict", "model", "model_state")
PROVENANCE_KEY = "precise_bn"
STAT_SUFFIXES = ("running_mean", "running_var")

StateDict = Dict[str, torch.Tensor]


@dataclass
class Checkpoint:
    """A loaded checkpoint: ``root`` as read, its ``state_dict`` at the key path ``where`` (for Caffe2,
    the blobs under PyTorch names, ``source_names`` mapping them back)."""

    path: str
    format: str
    root: Any
    state_dict: StateDict
    where: Tuple[str, ...] = ()
    metadata: Dict[str, str] = field(default_factory=dict)
    legacy_format: bool = False
    source_names: Dict[str, str] = field(default_factory=dict)
    updated: List[str] = field(default_factory=list)

    def describe(self) -> str:
        place = "under " + "/".join(repr(k) for k in self.where) if self.where else "at the top level"
        return "{}: {} checkpoint, state dict {} ({} tensors)".format(
            self.path, self.format, place, len(self.state_dict)
        )


def _is_state_dict(obj: Any) -> bool:
    return (
        isinstance(obj, Mapping)
        and len(obj) > 0
        and all(isinstance(k, str) and torch.is_tensor(v) for k, v in obj.items())
    )


def _keys_of(node: Any) -> str:
    if not isinstance(node, Mapping):
        return "(not a dict: {})".format(type(node).__name__)
    return ", ".join(repr(k) for k in list(node)[:20]) + (", ..." if len(node) > 20 else "")


def locate_state_dict(root: Any, path: str, key: Optional[str] = None) -> Tuple[Tuple[str, ...], StateDict]:
    """The key path and state dict of a loaded ``torch.save`` object: at ``key`` (``a/b``), else
    ``root`` or its ``state_dict``, ``model`` or ``model_state``; errors list the keys there."""
    if key is not None:
        node, where = root, []
        for part in key.split("/"):
            if not isinstance(node, Mapping) or part not in node:
                raise CheckpointError(
                    "{}: no key {!r} in the checkpoint; keys there: {}".format(
                        path, "/".join(where + [part]), _keys_of(node)
                    ), *_key_fixes(root)
                )
            node = node[part]
            where.append(part)
        if not _is_state_dict(node):
            raise CheckpointError(
                "{}: {!r} holds a {}, not a state dict (a dict of names to tensors)".format(
                    path, key, type(node).__name__
                )
            )
        return tuple(where), node
    if _is_state_dict(root):
        return (), root
    if isinstance(root, nn.Module):
        raise CheckpointError(
            "{}: holds a pickled {} module, not a state dict; save model.state_dict() instead".format(
                path, type(root).__name__
            )
        )
    if not isinstance(root, Mapping):
        raise CheckpointError("{}: holds a {}, not a state dict or a dict holding one".format(path, type(root).__name__))
    found = [k for k in STATE_DICT_KEYS if _is_state_dict(root.get(k))]
    if len(found) == 1:
        return (found[0],), root[found[0]]
    if found:
        raise CheckpointError("{}: several state dicts ({}); choose the model's".format(path, ", ".join(found)),
                              *[Fix("key", k) for k in found])
    fixes = _key_fixes(root)
    raise CheckpointError(
        "{}: no state dict at the top level or under {}; top-level keys: {}{}".format(
            path, ", ".join(repr(k) for k in STATE_DICT_KEYS), _keys_of(root),
            "" if fixes else "; none deeper either"), *fixes)


def _key_fixes(root: Any, limit: int = 5) -> List[Fix]:
    """A ``key`` for each state dict nested in ``root`` (three levels deep at most)."""
    found: List[str] = []

    def walk(node: Any, where: List[str]) -> None:
        if len(found) >= limit or len(where) > 3 or not isinstance(node, Mapping):
            return
        if where and _is_state_dict(node):
            found.append("/".join(where))
            return
        for k, v in node.items():
            if isinstance(k, str) and "/" not in k:
                walk(v, where + [k])

    walk(root, [])
    return [Fix("key", k, "({} tensors)".format(len(_node(root, k)))) for k in found]


def _node(root: Any, key: str) -> Any:
    for part in key.split("/"):
        root = root[part]
    return root


def prefix_counts(keys: Iterable[str], targets: Iterable[str]) -> "collections.Counter[str]":
    """For each module prefix ``p``, how many ``keys`` are ``p + t`` for a ``t`` of ``targets``."""
    wanted = set(targets)
    counts: "collections.Counter[str]" = collections.Counter()
    for key in keys:
        start = 0
        while True:
            if key[start:] in wanted:
                counts[key[:start]] += 1
            dot = key.find(".", start)
            if dot < 0:
                break
            start = dot + 1
    return counts


#: Prefixes a wrapper adds to every key: ``module.`` (DDP, DataParallel), ``model.`` (a
#: LightningModule's attribute), ``_orig_mod.`` (``torch.compile``).
WRAPPER_PREFIXES = ("module.", "model.", "_orig_mod.")


def wrapper_prefix(keys: Iterable[str]) -> str:
    """The wrapper prefixes every key starts with (several nest: ``model.module.``), or ``""``."""
    names, prefix = list(keys), ""
    while names:
        found = [p for p in WRAPPER_PREFIXES if all(k.startswith(prefix + p) for k in names)]
        if not found:
            break
        prefix += found[0]
    return prefix


def _sample(names: List[str], limit: int = 12) -> str:
    return ", ".join(names[:limit]) + (" ... ({} more)".format(len(names) - limit) if len(names) > limit else "")


def match_model(ckpt: Checkpoint, model_state: Mapping[str, torch.Tensor], prefix: Optional[str] = None) -> str:
    """The prefix under which ``model_state``'s keys sit (found when None), checked as
    ``load_state_dict(strict=True)`` would, but for an absent ``num_batches_tracked``."""
    if prefix is None:
        required = [k for k in model_state if not _optional(k)]
        counts = prefix_counts(ckpt.state_dict, required)
        full = sorted(p for p, c in counts.items() if c == len(required))
        if len(full) > 1:
            raise CheckpointError("{}: the model's keys appear under several prefixes ({}); choose one".format(
                ckpt.path, ", ".join(repr(p) for p in full)), *[Fix("prefix", p) for p in full])
        prefix = full[0] if full else (counts.most_common(1)[0][0] if counts else "")
    is_lazy = getattr(nn.parameter, "is_lazy", lambda t: False)
    missing = [k for k in model_state if prefix + k not in ckpt.state_dict and not _optional(k)]
    unexpected = [k for k in ckpt.state_dict if k.startswith(prefix) and k[len(prefix):] not in model_state]
    shapes = [
        "{} (checkpoint {}, model {})".format(
            k, tuple(ckpt.state_dict[prefix + k].shape), tuple(v.shape)
        )
        for k, v in model_state.items()
        if prefix + k in ckpt.state_dict and not is_lazy(v) and ckpt.state_dict[prefix + k].shape != v.shape
    ]
    if missing or unexpected or shapes:
        lines = ["{}: the checkpoint does not match the model (key prefix {!r}):".format(ckpt.path, prefix)]
        for title, names in (
            ("missing from the checkpoint", missing),
            ("in the checkpoint but not in the model", unexpected),
            ("different shapes", shapes),
        ):
            if names:
                lines.append("  {} ({}): {}".format(title, len(names), _sample(names)))
        fixes = _prefix_fixes(ckpt, model_state, prefix)
        if not (missing or unexpected):
            fixes += _head_fixes(ckpt, model_state, prefix)
        raise CheckpointError("\n".join(lines), *fixes)
    return prefix


def _prefix_fixes(ckpt: Checkpoint, model_state: Mapping[str, torch.Tensor], prefix: str) -> List[Fix]:
    """Another prefix under which every model key is found, with the same shapes."""
    required = [k for k in model_state if not _optional(k)]
    counts = prefix_counts(ckpt.state_dict, required)
    return [Fix("prefix", p, "(every model key is there)") for p in sorted(counts)
            if p != prefix and counts[p] == len(required)
            and all(ckpt.state_dict[p + k].shape == model_state[k].shape for k in required)]


def _head_fixes(ckpt: Checkpoint, model_state: Mapping[str, torch.Tensor], prefix: str) -> List[Fix]:
    """``num_classes`` when only the last module's first dimension differs: a fine-tuned head."""
    differ = [(tuple(ckpt.state_dict[prefix + k].shape), tuple(v.shape), k) for k, v in model_state.items()
              if prefix + k in ckpt.state_dict and ckpt.state_dict[prefix + k].shape != v.shape]
    last = [k for k in model_state if not _optional(k)][-1].rpartition(".")[0]
    firsts = {(a[0], b[0]) if a and b and a[1:] == b[1:] else None for a, b, _ in differ}
    if len(firsts) != 1 or None in firsts or any(k.rpartition(".")[0] != last for _, _, k in differ):
        return []
    (classes, model_classes), = firsts
    return [Fix("model_kwargs", {"num_classes": classes}, "(the checkpoint's {} has {} outputs, the model's {})".format(
        differ[0][2], classes, model_classes))]


def _optional(key: str) -> bool:
    return key == "num_batches_tracked" or key.endswith(".num_batches_tracked")


def load_into_model(model: nn.Module, ckpt: Checkpoint, prefix: str) -> None:
    """Copy the checkpoint's tensors under ``prefix`` into ``model`` (strict; an absent
    ``num_batches_tracked`` keeps the model's own)."""
    state = {k: ckpt.state_dict.get(prefix + k, v) for k, v in model.state_dict().items()}
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise CheckpointError("{}: loading into the model failed: {}".format(ckpt.path, exc)) from exc


def bn_stats_of(model: nn.Module, report: BNReport) -> StateDict:
    """The new ``running_mean``/``running_var`` of every layer the report says ran, by model key."""
    modules = dict(model.named_modules())
    out: StateDict = {}
    for layer in report.layers:
        if layer.ran:
            for suffix in STAT_SUFFIXES:
                key = layer.name + "." + suffix if layer.name else suffix
                out[key] = getattr(modules[layer.name], suffix).detach().cpu()
    return out


def apply_bn_stats(ckpt: Checkpoint, prefix: str, stats: Mapping[str, torch.Tensor]) -> None:
    """Copy ``stats`` (model keys) into the checkpoint's own tensors, in place, in their dtype."""
    with torch.no_grad():
        for key, value in stats.items():
            target = ckpt.state_dict[prefix + key]
            target.copy_(value.to(dtype=target.dtype).reshape(target.shape))
            ckpt.updated.append(prefix + key)


def bn_layers(state_dict: Mapping[str, torch.Tensor]) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """BN layers in a state dict, read from its keys: name -> (running_mean, running_var)."""
    out = {}
    for key, value in state_dict.items():
        if key.endswith(".running_mean") or key == "running_mean":
            name = key[: -len("running_mean")].rstrip(".")
            var = state_dict.get(key[: -len("running_mean")] + "running_var")
            if var is not None:
                out[name] = (value, var)
    return out
