"""Checkpoint files as users have them: read without running their code, write back only BN stats.

Layouts found from the file itself:

* ``.safetensors``: a flat name -> tensor table plus a string metadata header;
* a Caffe2 / Detectron ``.pkl`` blob dictionary, through :mod:`precise_bn.caffe2_checkpoint`;
* anything ``torch.save`` wrote: a bare state dict, or a dict holding one under ``state_dict``
  (Lightning), ``model`` (detectron2, torchvision references), ``model_state`` (pycls) or a key
  the user names (``a/b`` for a nested one).

Inside the state dict the model's keys may sit under a module prefix (``module.`` from DDP,
``model.`` from a LightningModule attribute, or both); :func:`match_model` finds it by matching
the model's own keys, so a Lightning checkpoint with a loss module or an EMA copy next to the
model still works.

Why the care when writing: users reload the result with their own code. So the whole loaded
object is written back with the same serializer; only the ``running_mean`` / ``running_var``
tensors of layers that were measured change, copied *in place* into the loaded tensors (their
dtype, shape and any storage sharing are kept); optimizer state, epoch, hyper-parameters and EMA
weights keep their exact bits. Tensors are read onto the CPU and written from there. A
``precise_bn`` provenance entry is added where it cannot confuse a loader: next to the state
dict in a dict checkpoint, or in the safetensors metadata, never inside a bare state dict
(``load_state_dict(strict=True)`` would reject the extra key).
"""
from __future__ import annotations

import collections
import datetime
import inspect
import json
import logging
import os
import pickle
import re
import zipfile
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import torch
from torch import nn

from . import __version__
from .atomic import atomic_write
from .errors import BackendUnavailableError, CheckpointError, UnsafeCheckpointError
from .report import BNReport

logger = logging.getLogger("precise_bn")

#: ``torch.load(weights_only=True)`` exists (torch >= 1.13): files load without running code.
SAFE_LOAD_AVAILABLE = "weights_only" in inspect.signature(torch.load).parameters
STATE_DICT_KEYS = ("state_dict", "model", "model_state")
PROVENANCE_KEY = "precise_bn"
STAT_SUFFIXES = ("running_mean", "running_var")

StateDict = Dict[str, torch.Tensor]


@dataclass
class Checkpoint:
    """A loaded checkpoint: the whole object as read, and where its state dict sits in it.

    ``root`` is what the file holds (for Caffe2, the whole unpickled object); ``state_dict`` is the
    name -> tensor table the model is matched against (for Caffe2, the blobs converted to
    PyTorch names, and ``source_names`` maps each back to its blob). ``where`` is the path of
    keys from ``root`` to ``state_dict``, empty when the file is a bare state dict.
    """

    path: str
    format: str
    root: Any
    state_dict: StateDict
    where: Tuple[str, ...] = ()
    metadata: Dict[str, str] = field(default_factory=dict)
    legacy_format: bool = False
    source_names: Dict[str, str] = field(default_factory=dict)
    updated: List[str] = field(default_factory=list)

    @property
    def provenance(self) -> Optional[Dict[str, Any]]:
        """The ``precise_bn`` entry a previous recompute left, if any."""
        if self.format == "safetensors" and PROVENANCE_KEY in self.metadata:
            return json.loads(self.metadata[PROVENANCE_KEY])
        if self.format == "torch" and self.where and isinstance(self.root.get(PROVENANCE_KEY), dict):
            return self.root[PROVENANCE_KEY]
        return None

    def describe(self) -> str:
        place = "under " + "/".join(repr(k) for k in self.where) if self.where else "at the top level"
        return "{}: {} checkpoint, state dict {} ({} tensors)".format(
            self.path, self.format, place, len(self.state_dict)
        )


def detect_format(path: str) -> str:
    """``"safetensors"``, ``"caffe2"`` (a plain pickle named ``.pkl``/``.pickle``) or ``"torch"``.

    A zip archive is always a ``torch.save`` file, whatever its name; a non-zip file is a
    Caffe2 pickle only when its name says so (legacy ``torch.save`` files are pickles too).
    """
    lower = path.lower()
    if lower.endswith(".safetensors"):
        return "safetensors"
    if lower.endswith((".pkl", ".pickle")) and not (os.path.exists(path) and zipfile.is_zipfile(path)):
        return "caffe2"
    return "torch"


def load_checkpoint(path: str, *, key: Optional[str] = None, trust: bool = False, rules: Any = None) -> Checkpoint:
    """Read ``path`` and locate its state dict (``key``: its place, ``a/b`` for nested dicts).

    Never runs code from the file unless ``trust``: PyTorch files go through
    ``torch.load(weights_only=True)``, and on a torch without it loading is refused; Caffe2
    pickles through a loader that builds numpy arrays only. ``rules`` maps Caffe2 layer names
    to module names (see :func:`precise_bn.caffe2_checkpoint.caffe2_to_torch`; default: the
    model-zoo ResNet names).

    Raises:
        CheckpointError: the file is missing or unreadable, or holds no state dict where looked.
        UnsafeCheckpointError: the file needs code to load and ``trust`` is False.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError("{}: no such checkpoint file".format(path))
    fmt = detect_format(path)
    if key is not None and fmt != "torch":
        raise CheckpointError("{}: a {} file is one flat table of tensors; --key applies to torch.save files".format(path, fmt))
    if fmt == "safetensors":
        tensors, metadata = _load_safetensors(path)
        return Checkpoint(path, fmt, tensors, tensors, metadata=metadata)
    if fmt == "caffe2":
        from .caffe2_checkpoint import caffe2_to_torch, read_caffe2_pickle

        root, blobs = read_caffe2_pickle(path)
        state_dict, conversion = caffe2_to_torch(blobs, rules, source=path)
        logger.info("%s: Caffe2 blobs to PyTorch names: %s", path, conversion)
        names = {key: blob for blob, key in conversion.mapped.items()}
        return Checkpoint(path, fmt, root, state_dict, source_names=names)
    root = _torch_load(path, trust)
    where, state_dict = locate_state_dict(root, path, key)
    return Checkpoint(path, fmt, root, state_dict, where=where, legacy_format=not zipfile.is_zipfile(path))


def _safetensors_torch() -> Any:
    try:
        import safetensors.torch
    except ImportError as exc:
        raise BackendUnavailableError(
            ".safetensors files need the safetensors package: pip install safetensors"
        ) from exc
    return safetensors.torch


def _load_safetensors(path: str) -> Tuple[StateDict, Dict[str, str]]:
    st = _safetensors_torch()
    from safetensors import SafetensorError

    try:
        with st.safe_open(path, framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
        return st.load_file(path), metadata
    except (SafetensorError, OSError) as exc:
        raise CheckpointError("{}: cannot be read as a safetensors file: {}".format(path, exc)) from exc


def _torch_load(path: str, trust: bool) -> Any:
    if not trust and not SAFE_LOAD_AVAILABLE:
        raise UnsafeCheckpointError(
            "{}: torch {} cannot load a checkpoint without the risk of running code from it "
            "(torch.load(weights_only=True) needs torch >= 1.13); pass --trust-checkpoint "
            "(trust=True) only if you trust where this file comes from".format(path, torch.__version__)
        )
    kwargs: Dict[str, Any] = {"map_location": "cpu"}
    if SAFE_LOAD_AVAILABLE:
        kwargs["weights_only"] = not trust
    try:
        return torch.load(path, **kwargs)
    except pickle.UnpicklingError as exc:
        if trust:
            raise CheckpointError("{}: cannot be unpickled: {}".format(path, exc)) from exc
        raise UnsafeCheckpointError(
            "{}: refused: loading it needs more than tensors and plain containers ({}); "
            "nothing from it was run. Pass --trust-checkpoint (trust=True) only if you trust "
            "where this file comes from".format(path, _unpickler_complaint(str(exc)))
        ) from exc
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        raise CheckpointError("{}: cannot be read as a PyTorch checkpoint: {}".format(path, exc)) from exc


def _unpickler_complaint(message: str) -> str:
    """The one useful line of torch's weights_only error: the global or opcode it refused."""
    found = re.search(r"GLOBAL ([\w.]+)", message)
    if found:
        return "it refers to " + found.group(1)
    detail = message.split("WeightsUnpickler error:", 1)[-1].strip().splitlines()
    return detail[0] if detail else message


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
    """Find the state dict in a loaded ``torch.save`` object; return its key path and itself.

    With ``key`` (``a/b`` for nested dicts) exactly there; otherwise ``root`` itself if it is a
    mapping of names to tensors, else the one of ``state_dict``, ``model``, ``model_state``
    that is. Errors name the file and list the keys that are there.
    """
    if key is not None:
        node, where = root, []
        for part in key.split("/"):
            if not isinstance(node, Mapping) or part not in node:
                raise CheckpointError(
                    "{}: no key {!r} in the checkpoint; keys there: {}".format(
                        path, "/".join(where + [part]), _keys_of(node)
                    )
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
        raise CheckpointError(
            "{}: several state dicts ({}); choose one with --key".format(path, ", ".join(found))
        )
    raise CheckpointError(
        "{}: no state dict at the top level or under {}; top-level keys: {}; name the model's "
        "with --key".format(path, ", ".join(repr(k) for k in STATE_DICT_KEYS), _keys_of(root))
    )


def prefix_counts(keys: Iterable[str], targets: Iterable[str]) -> "collections.Counter[str]":
    """For each module prefix ``p`` (``""`` or ending in ``.``), how many ``keys`` are ``p + t``
    for some ``t`` in ``targets``: the prefix under which a model sits in a larger state dict."""
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


def _sample(names: List[str], limit: int = 12) -> str:
    return ", ".join(names[:limit]) + (" ... ({} more)".format(len(names) - limit) if len(names) > limit else "")


def match_model(ckpt: Checkpoint, model_state: Mapping[str, torch.Tensor], prefix: Optional[str] = None) -> str:
    """The module prefix under which ``model_state``'s keys sit in the checkpoint.

    Found by matching (``prefix=None``): the one prefix under which every model key exists.
    Then checked strictly, like ``load_state_dict(strict=True)`` restricted to that prefix:
    any model key missing, any checkpoint key under the prefix the model lacks, any shape that
    differs is listed in the error. Only BN's ``num_batches_tracked`` may be absent (Caffe2 and
    pre-0.4.1 checkpoints have none; it plays no part in the statistics).
    """
    if prefix is None:
        required = [k for k in model_state if not _optional(k)]
        counts = prefix_counts(ckpt.state_dict, required)
        full = sorted(p for p, c in counts.items() if c == len(required))
        if len(full) > 1:
            raise CheckpointError(
                "{}: the model's keys appear under several prefixes ({}); choose one with --prefix".format(
                    ckpt.path, ", ".join(repr(p) for p in full)
                )
            )
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
        raise CheckpointError("\n".join(lines))
    return prefix


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


def provenance(report: BNReport) -> Dict[str, Any]:
    """What the ``precise_bn`` entry records: how the stats were measured, by what, when."""
    return {
        "version": __version__,
        "torch": str(torch.__version__),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "samples": report.samples,
        "iterations": report.batches,
        "world_size": report.world_size,
        "estimator": report.estimator,
        "layers": len(report.layers) - len(report.unused),
    }


def set_provenance(ckpt: Checkpoint, info: Mapping[str, Any]) -> None:
    """Record ``info`` as the ``precise_bn`` entry where the layout has room (logged if not)."""
    if ckpt.format == "safetensors":
        ckpt.metadata[PROVENANCE_KEY] = json.dumps(dict(info), sort_keys=True)
    elif ckpt.format == "torch" and ckpt.where and isinstance(ckpt.root, dict):
        ckpt.root[PROVENANCE_KEY] = dict(info)
    else:
        logger.info(
            "%s: a %s layout has no room for a precise_bn provenance entry; none recorded",
            ckpt.path, "bare state dict" if ckpt.format == "torch" else ckpt.format,
        )


def check_output(source: str, output: str, in_place: bool) -> None:
    """Refuse to write over ``source`` unless ``in_place``; refuse ``in_place`` to another file."""
    same = os.path.abspath(output) == os.path.abspath(source) or (
        os.path.exists(output) and os.path.samefile(output, source)
    )
    if same and not in_place:
        raise CheckpointError(
            "{}: refusing to overwrite the input checkpoint; pass --in-place (in_place=True) to "
            "replace it, or choose another --output".format(source)
        )
    if in_place and not same:
        raise CheckpointError(
            "{}: in_place writes the input file itself, not {}".format(source, output)
        )


def write_file(path: str, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` atomically; an OS failure becomes a CheckpointError naming the file."""
    try:
        atomic_write(path, write)
    except OSError as exc:
        raise CheckpointError(
            "{}: writing failed ({}); any previous file there is unchanged".format(path, exc)
        ) from exc


def _safetensors_writer(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]):
    save = _safetensors_torch().save
    return lambda handle: handle.write(save(dict(tensors), metadata=dict(metadata)))


def _caffe2_writer(blobs: Mapping[str, Any], root: Any = None):
    from .caffe2_checkpoint import save_caffe2_pickle

    return lambda handle: save_caffe2_pickle(dict(blobs), handle, root=root)


def _torch_writer(obj: Any, legacy: bool = False):
    return lambda handle: torch.save(obj, handle, _use_new_zipfile_serialization=not legacy)


def _caffe2_blobs_with(ckpt: Checkpoint) -> Dict[str, Any]:
    """Each updated tensor under the name of the blob it was read from (written back into
    ``ckpt.root`` in that blob's dtype and shape)."""
    return {ckpt.source_names[key]: ckpt.state_dict[key] for key in ckpt.updated}


def save_checkpoint(ckpt: Checkpoint, output: str, *, in_place: bool = False) -> None:
    """Write ``ckpt`` (with the stats :func:`apply_bn_stats` put in) to ``output``, atomically.

    The same serializer as the input's (zip or legacy ``torch.save``, safetensors with its
    metadata, Caffe2 pickle). Refuses to overwrite the input unless ``in_place``.
    """
    check_output(ckpt.path, output, in_place)
    if ckpt.format == "safetensors":
        writer = _safetensors_writer(ckpt.state_dict, ckpt.metadata)
    elif ckpt.format == "caffe2":
        writer = _caffe2_writer(_caffe2_blobs_with(ckpt), ckpt.root)
    else:
        writer = _torch_writer(ckpt.root, ckpt.legacy_format)
    write_file(output, writer)
    logger.info("wrote %s (%d BatchNorm tensors updated)", output, len(ckpt.updated))


def save_state_dict(state_dict: Mapping[str, torch.Tensor], path: str, fmt: str, rules: Any = None) -> None:
    """Write a bare state dict as ``fmt`` (``torch``, ``safetensors`` or ``caffe2``, with the
    name ``rules`` of :func:`precise_bn.caffe2_checkpoint.torch_to_caffe2`), atomically."""
    if fmt == "safetensors":
        # safetensors refuses tensors that share memory; a state dict may hold views.
        tensors = {k: v.detach().contiguous().clone() for k, v in state_dict.items()}
        writer = _safetensors_writer(tensors, {"format": "pt"})
    elif fmt == "caffe2":
        from .caffe2_checkpoint import torch_to_caffe2

        blobs, conversion = torch_to_caffe2(dict(state_dict), rules)
        logger.info("%s: PyTorch names to Caffe2 blobs: %s", path, conversion)
        writer = _caffe2_writer(blobs)
    else:
        writer = _torch_writer(dict(state_dict))
    write_file(path, writer)


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
