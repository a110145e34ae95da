"""Which BatchNorm layers of a PyTorch model a pass recomputes, and the module it runs on."""
from __future__ import annotations

import difflib
import logging
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..errors import ConfigError, LayerError, warn
from ..options import LayerSpec, check_layers

logger = logging.getLogger("precise_bn")

NamedLayer = Tuple[str, _BatchNorm]


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module a pass runs on, so that layer names are the user's and no forward costs more
    than it must: DDP's inner module (no per-forward collective) and a ``torch.compile``
    wrapper's original module (run eagerly, so the pass triggers no recompilation).

    ``nn.DataParallel`` is kept: its replicas are what spreads the batch over GPUs, and the
    capture travels into them with each layer's class and ``__dict__``.
    """
    while True:
        ddp = getattr(nn.parallel, "DistributedDataParallel", None)
        if ddp is not None and isinstance(model, ddp):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


#: Wrappers PyTorch puts between a module and its children (FSDP1, activation checkpointing):
#: left out of layer names, so that the names are the user's.
WRAPPER_NAMES = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def user_name(name: str) -> str:
    """``name`` without the wrappers' parts: ``_fsdp_wrapped_module.layer1.0.bn1`` is ``layer1.0.bn1``."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)


def named_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``model.named_modules()`` under the user's names (see :func:`user_name`)."""
    return [(user_name(name), module) for name, module in model.named_modules()]


def is_tracking_bn(module: nn.Module) -> bool:
    return isinstance(module, _BatchNorm) and module.track_running_stats


def get_bn_modules(model: nn.Module) -> List[nn.Module]:
    """BN layers in training mode that track running stats (fvcore's function of the same name)."""
    return [m for m in model.modules() if is_tracking_bn(m) and m.training]


def _check(name: str, module: _BatchNorm) -> None:
    uninitialized = getattr(nn.parameter, "UninitializedBuffer", ())
    if uninitialized and isinstance(module.running_mean, uninitialized):
        raise LayerError(
            "BatchNorm layer {!r} is lazy and not materialised yet: run one forward pass "
            "before recomputing its statistics".format(name or type(module).__name__)
        )
    if "forward" in module.__dict__:
        raise LayerError(
            "BatchNorm layer {!r} has a forward set on the instance ({!r}), which hides the "
            "layer's calls from precise-bn: delete it (del layer.forward) for the recalibration, "
            "or leave the layer out with layers=[...]".format(name or type(module).__name__, module.__dict__["forward"])
        )


def _hint(name: str, by_name: Dict[str, nn.Module]) -> str:
    """A BN layer's name that ``name`` was likely meant to be: the same layer named from an
    outer module (``"model.1"`` for ``"1"``), else the closest spelling."""
    known = [n for n, m in by_name.items() if is_tracking_bn(m)]
    close = [n for n in known if name.endswith("." + n)] or difflib.get_close_matches(name, known, n=1)
    return "; did you mean {!r}?".format(close[0]) if close else ""


def by_spec(model: nn.Module, layers: LayerSpec) -> List[NamedLayer]:
    """The layers a list of modules or qualified names designates; a ConfigError names the first
    that is not a tracking BN layer of ``model`` (hooks check this when they are built)."""
    by_name = dict(named_modules(model))
    ids = {id(m): n for n, m in named_modules(model)}
    chosen: List[NamedLayer] = []
    for item in layers or ():
        if isinstance(item, str):
            if item not in by_name:
                raise ConfigError("layers: no module named {!r} in the model{}".format(item, _hint(item, by_name)))
            name, module = item, by_name[item]
        else:
            if id(item) not in ids:
                raise ConfigError("layers: {!r} is not a submodule of the model".format(item))
            name, module = ids[id(item)], item
        if not is_tracking_bn(module):
            raise ConfigError("layers: {!r} ({}) is not a BatchNorm layer that tracks running stats".format(
                name, type(module).__name__))
        if all(module is not other for _, other in chosen):
            chosen.append((name, module))  # type: ignore[arg-type]
    return chosen


def select_layers(model: nn.Module, layers: LayerSpec = None) -> List[NamedLayer]:
    """Choose the layers to recalibrate, as ``(qualified name, module)`` pairs.

    ``layers=None``: those in training mode; if the whole model is in eval mode, all of them
    (logged, never a silent no-op). ``"all"``: every tracking BN layer. A sequence of modules or
    qualified names: exactly those. Layers with ``track_running_stats=False`` and frozen BN
    (not a ``_BatchNorm``) are never selected; a layer listed twice is taken once. Raises
    :class:`LayerError` for a lazy layer not yet materialised, one whose ``forward`` was
    replaced on the instance, and a TorchScript model or submodule.
    """
    check_layers(layers)
    _refuse_script(model)
    named = [(name, m) for name, m in named_modules(model) if is_tracking_bn(m)]
    if layers is None:
        chosen = [(n, m) for n, m in named if m.training]
        if not chosen and named and not model.training:
            logger.info("model is in eval mode: recomputing all %d BatchNorm layers", len(named))
            chosen = named
    elif layers == "all":
        chosen = named
    else:
        chosen = by_spec(model, layers)
    for name, module in chosen:
        _check(name, module)
    _check_model(model, chosen)  # type: ignore[arg-type]
    return chosen  # type: ignore[return-value]


RUNNING = ("running_mean", "running_var")


def holds_running_stats(module: nn.Module) -> bool:
    """Whether ``module`` has ``running_mean`` and ``running_var`` buffers of its own: a BN
    layer, or one precise-bn cannot capture (frozen, scripted, a functional ``batch_norm``)."""
    own = dict(module.named_buffers(recurse=False))
    return all(own.get(key) is not None for key in RUNNING)


def _refuse_script(model: nn.Module) -> None:
    """Refuse a TorchScript module, the model or inside it. Its forward is compiled code that
    calls BatchNorm without going through a layer's Python ``forward``, so no capture sees it and
    the pass would leave its statistics as they are while saying it recomputed the model; and a
    pass could not put a scripted module's state back (its tables are not Python dicts)."""
    script = torch.jit.ScriptModule
    scripted = [(name, m) for name, m in named_modules(model) if isinstance(m, script)]
    if not scripted:
        return
    name, outer = scripted[0]
    bn = sum(holds_running_stats(m) for _, m in scripted)
    where = "{} is a TorchScript module ({})".format(outer.original_name, type(outer).__name__) if outer is model \
        else "module {!r} of {} is a TorchScript module ({} {})".format(name, type(model).__name__,
                                                                        outer.original_name, type(outer).__name__)
    raise LayerError(
        "{}: its compiled forward calls BatchNorm out of precise-bn's sight, so {}. Use the Python module, as it "
        "was before torch.jit.script or torch.jit.trace, and script it afterwards (or load the Python module's "
        "state_dict() into the scripted one)".format(
            where, "none of its {} BatchNorm layer(s) can be measured".format(bn) if bn
            else "no BatchNorm call in it could be measured"))


def _check_model(model: nn.Module, chosen: List[NamedLayer]) -> None:
    """Refuse, before the pass, what it could not put back: a lazy module not materialised yet
    (the pass would materialise it), and a chosen layer's running statistics sharing memory with
    another buffer (writing one would write the other)."""
    uninitialized = tuple(getattr(nn.parameter, n) for n in ("UninitializedParameter", "UninitializedBuffer")
                          if hasattr(nn.parameter, n))
    mine = {id(m) for _, m in chosen}
    spans = []
    for name, module in named_modules(model):
        tensors = list(module._parameters.values()) + list(module._buffers.values())
        if uninitialized and any(isinstance(t, uninitialized) for t in tensors):
            raise LayerError("module {!r} ({}) is lazy and not materialised yet: run one forward pass before "
                             "recomputing".format(name, type(module).__name__))
        for key, buf in module._buffers.items():
            span = _span(buf)
            if span is not None:
                spans.append(span + (name, module, key, id(module) in mine and key in RUNNING))
    spans.sort(key=lambda s: s[:2])
    live: List[tuple] = []
    for span in spans:
        live = [other for other in live if other[0] == span[0] and other[2] > span[1]]
        for other in live:
            if other[6] or span[6]:
                _refuse_shared(*(other, span) if other[6] else (span, other))
        live.append(span)


def _span(buf: Any) -> Optional[Tuple[str, int, int]]:
    """``(device, first byte, end)`` of the memory a buffer's elements occupy; None if it has none."""
    if buf is None or buf.numel() == 0 or buf.layout != torch.strided or buf.device.type == "meta":
        return None
    try:
        start = buf.data_ptr()
    except RuntimeError:  # a tensor subclass without storage of its own
        return None
    reach = sum((size - 1) * abs(stride) for size, stride in zip(buf.shape, buf.stride()))
    return str(buf.device), start, start + (reach + 1) * buf.element_size()


def _refuse_shared(layer: tuple, other: tuple) -> None:
    (name, module, key), (other_name, other_module, other_key) = layer[3:6], other[3:6]
    kind = "BatchNorm layer" if isinstance(other_module, _BatchNorm) else "module"
    first, second = name or type(module).__name__, other_name or type(other_module).__name__
    raise LayerError(
        "BatchNorm layer {!r} and {} {!r} share memory ({}.{} and {}.{} hold the same data): writing the "
        "statistics of one would write the other's. Give each its own buffers before recomputing, for "
        "example {}.{} = {}.{}.clone()".format(first, kind, second, first, key, second, other_key, second,
                                                other_key, second, other_key))


def no_layer_message(model: nn.Module) -> str:
    """Why a model has nothing to recompute, in words that fit the case."""
    bn = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    if not bn:
        return "{} has no BatchNorm layer{}".format(type(model).__name__, _not_bn(model))
    if not any(m.track_running_stats for m in bn):
        return "none of the {} BatchNorm layers of {} tracks running stats (track_running_stats=False)".format(
            len(bn), type(model).__name__)
    return "no BatchNorm layer of {} is in training mode while the model is (pass layers='all' to " \
           "recompute them anyway)".format(type(model).__name__)


def _not_bn(model: nn.Module) -> str:
    """What a model without BN layers holds instead that looks like them, by class.

    Frozen BN is recognised by its class name (``FrozenBatchNorm2d`` of torchvision, detectron2
    and timm alike): its statistics are constants of the checkpoint, buffers that no forward
    updates, so there is nothing to recompute. Any other module with ``running_mean`` and
    ``running_var`` buffers that is not a ``_BatchNorm`` is named as such: precise-bn captures
    ``_BatchNorm`` subclasses only.
    """
    frozen: Dict[str, int] = {}
    other: Dict[str, int] = {}
    for module in model.modules():
        kind = type(module).__name__
        if "FrozenBatchNorm" in kind:
            frozen[kind] = frozen.get(kind, 0) + 1
        elif holds_running_stats(module):
            other[kind] = other.get(kind, 0) + 1
    parts = []
    if frozen:
        parts.append("{} fixed statistics, no running statistics to recompute".format(_counted(frozen)))
    if other:
        parts.append("{} running_mean and running_var but not as BatchNorm layers (subclasses of "
                     "torch.nn.modules.batchnorm._BatchNorm, the only layers precise-bn captures)".format(
                         _counted(other)))
    return "".join("; its " + part for part in parts)


def _counted(kinds: Dict[str, int]) -> str:
    """``{"FrozenBatchNorm2d": 53}`` as "53 FrozenBatchNorm2d layers hold"."""
    return " and ".join("{} {} layer{}".format(n, kind, "" if n == 1 else "s") for kind, n in kinds.items()) + (
        " holds" if sum(kinds.values()) == 1 else " hold")


def split_bn(module: nn.Module) -> List[nn.Module]:
    """The BN layers of a split BN module, or nothing if ``module`` is not one: SlowFast's
    ``SubBatchNorm3d`` (a ``bn`` used in eval mode, a ``split_bn`` in training, whose statistics
    ``aggregate_stats()`` copies into ``bn``) or timm's ``SplitBatchNorm2d`` (itself, for the
    first split of a training batch, and its ``aux_bn`` for the others). Known by their
    children, so that copies of either class are recognised too."""
    children = module._modules
    parts = [children.get("bn"), children.get("split_bn")]
    if all(isinstance(part, _BatchNorm) for part in parts):
        return parts  # type: ignore[return-value]
    aux = children.get("aux_bn")
    if isinstance(module, _BatchNorm) and aux is not None and any(isinstance(m, _BatchNorm) for m in aux.modules()):
        return [module] + [m for m in aux.modules() if isinstance(m, _BatchNorm)]
    return []


def warn_if_split_bn(model: nn.Module, layers: List[NamedLayer]) -> None:
    """One warning when an eval-mode model has split BN among ``layers``: what a pass measures
    there is not what the model's own bookkeeping expects (docs/integrations.md, "Split BatchNorm")."""
    if model.training:
        return
    chosen = {id(m) for _, m in layers}
    found: Dict[str, List[str]] = {}
    for name, module in named_modules(model):
        if any(id(part) in chosen for part in split_bn(module)):
            found.setdefault("split_bn" if "split_bn" in module._modules else "aux_bn", []).append(name or "(model)")
    advice = {
        "split_bn": "{} with a `bn` and a `split_bn` (SlowFast's SubBatchNorm3d): in eval mode `bn` is measured "
                    "directly and `split_bn` never runs, so aggregate_stats() (SlowFast's aggregate_sub_bn_stats) "
                    "would overwrite the new statistics with split_bn's old ones. Recompute with the model in train "
                    "mode, then call aggregate_sub_bn_stats(model)",
        "aux_bn": "{} with `aux_bn` (timm's SplitBatchNorm2d): a pass runs their training forward, which gives the "
                  "layer the first 1/num_splits of each batch and its aux_bn the others. Recompute with the model in "
                  "train mode on batches built as in training (the clean split first)",
    }
    parts = [advice[kind].format(_names(names)) for kind, names in found.items()]
    if parts:
        warn("{} is in eval mode and has split BatchNorm: {} (docs/integrations.md, \"Split BatchNorm\")".format(
            type(model).__name__, "; ".join(parts)))


def _names(names: List[str]) -> str:
    """Up to three module names, and how many there are."""
    return "{} module{} ({}{})".format(len(names), "" if len(names) == 1 else "s",
                                       ", ".join(repr(n) for n in names[:3]), ", ..." if len(names) > 3 else "")
