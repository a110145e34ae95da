"""What ``--model`` (``package.module:callable``, ``file.py:callable``, ``torchvision:NAME``,
``timm:NAME``), ``--forward-fn`` and ``--caffe2-rules`` name, as Python objects (docs/cli.md)."""
from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.util
import inspect
import os
import re
import sys
from typing import Any, Callable, List, Mapping, Optional

import torch
from torch import nn

from ..errors import BackendUnavailableError, ConfigError

MODEL_FORMS = "package.module:callable, torchvision:NAME or timm:NAME"


def import_optional(name: str, what: str) -> Any:
    """Import ``name`` or say how to install it, naming ``what`` needs it."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise BackendUnavailableError(
            "{} needs the {} package, which is not installed ({}): pip install {}".format(what, name, exc, name)
        ) from exc


def is_object_spec(spec: str) -> bool:
    """Whether ``spec`` has the form ``package.module:attr`` (or ``file.py:attr``)."""
    module_name, sep, attr = spec.rpartition(":")
    return bool(sep and module_name and attr)


def check_object_spec(spec: str, option: str) -> None:
    """Refuse a ``spec`` not of the form ``package.module:name`` (a usage error, named by ``option``)."""
    if not is_object_spec(spec):
        raise ConfigError("{} {!r}: expected 'package.module:name'".format(option, spec))


def load_object(spec: str, option: str) -> Any:
    """Import ``package.module:attr.attr`` or ``file.py:attr``; ``option`` names the flag in errors."""
    check_object_spec(spec, option)
    module_name, _, attr = spec.rpartition(":")
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise ConfigError("{} {!r}: no such file {}".format(option, spec, module_name))
        loader_spec = importlib.util.spec_from_file_location(
            os.path.splitext(os.path.basename(module_name))[0], module_name
        )
        module = importlib.util.module_from_spec(loader_spec)
        loader_spec.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError("{} {!r}: cannot import {}: {}".format(option, spec, module_name, exc)) from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError("{} {!r}: {} has no attribute {!r}".format(option, spec, module_name, part))
        obj = getattr(obj, part)
    return obj


def load_callable(spec: str, option: str) -> Callable[..., Any]:
    """:func:`load_object`, which must be callable (a model or data factory, a forward_fn)."""
    obj = load_object(spec, option)
    if not callable(obj):
        raise ConfigError("{} {!r}: {} is not callable".format(option, spec, type(obj).__name__))
    return obj


def call_factory(factory: Callable[..., Any], kwargs: Mapping[str, Any], option: str, spec: str) -> Any:
    """``factory(**kwargs)``, after checking that its signature takes them."""
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise ConfigError("{} {!r}: cannot be called with {}: {}".format(option, spec, dict(kwargs), exc)) from exc
    except ValueError:  # no signature (some builtins): let the call itself decide
        pass
    return factory(**kwargs)


def _unknown_name(kind: str, name: str, names: List[str]) -> ConfigError:
    close = difflib.get_close_matches(name, names, n=5)
    hint = "; did you mean {}?".format(", ".join(close)) if close else ""
    return ConfigError("--model {}:{}: no such model in {}{}".format(kind, name, kind, hint))


def _model_names(kind: str) -> List[str]:
    """The model names ``torchvision`` or ``timm`` offer, or [] when it is not installed."""
    if importlib.util.find_spec(kind) is None:
        return []
    module = importlib.import_module(kind)
    lister = getattr(module.models, "list_models", None) if kind == "torchvision" else module.list_models
    return list(lister()) if lister is not None else []


def _bare_model_name(spec: str) -> ConfigError:
    for kind in ("torchvision", "timm"):
        if spec in _model_names(kind):
            return ConfigError("--model {!r}: expected {}; did you mean {}:{}?".format(spec, MODEL_FORMS, kind, spec))
    return ConfigError("--model {!r}: expected {}".format(spec, MODEL_FORMS))


def check_model_spec(spec: str) -> None:
    """Refuse a ``--model`` spec of none of the forms, with the one most likely meant."""
    kind, _, name = spec.partition(":")
    if not name or (kind not in ("torchvision", "timm") and not is_object_spec(spec)):
        raise _bare_model_name(spec)


def resolve_model(spec: str, kwargs: Optional[Mapping[str, Any]] = None) -> nn.Module:
    """Build the model ``spec`` names (see the module docstring), with ``kwargs``."""
    check_model_spec(spec)
    kwargs = dict(kwargs or {})
    kind, _, name = spec.partition(":")
    if kind == "torchvision":
        torchvision = import_optional("torchvision", "--model torchvision:NAME")
        models = torchvision.models
        if not hasattr(models, "list_models"):
            raise BackendUnavailableError(
                "--model torchvision:NAME needs torchvision >= 0.14 (found {}): pip install -U torchvision".format(
                    torchvision.__version__
                )
            )
        names = models.list_models()
        if name not in names:
            raise _unknown_name("torchvision", name, names)
        kwargs.setdefault("weights", None)
        model = models.get_model(name, **kwargs)
    elif kind == "timm":
        timm = import_optional("timm", "--model timm:NAME")
        names = timm.list_models()
        if name not in names:
            raise _unknown_name("timm", name, names)
        kwargs.setdefault("pretrained", False)
        model = timm.create_model(name, **kwargs)
    else:
        model = call_factory(load_callable(spec, "--model"), kwargs, "--model", spec)
    if not isinstance(model, nn.Module):
        raise ConfigError("--model {!r} returned a {}, not an nn.Module".format(spec, type(model).__name__))
    return model


#: At most this many architectures are built when looking for one that fits a checkpoint.
MAX_CANDIDATES = 30


def _meta_device() -> Any:
    """Build models without allocating or initialising their weights (torch >= 2.0)."""
    return torch.device("meta") if hasattr(torch.device, "__enter__") else contextlib.nullcontext()


def same_family(spec: str) -> List[str]:
    """Other torchvision or timm specs whose names start like ``spec``'s, closest first (None for a
    callable): the candidates when a checkpoint does not fit."""
    kind, _, name = spec.partition(":")
    stem = re.match(r"[a-z]*", name)
    if kind not in ("torchvision", "timm") or not stem or not stem.group():
        return []
    names = [n for n in _model_names(kind) if n.startswith(stem.group()) and n != name]
    closest = sorted(names, key=lambda n: -difflib.SequenceMatcher(None, name, n).ratio())
    return ["{}:{}".format(kind, n) for n in closest[:MAX_CANDIDATES]]


def build_on_meta(spec: str, kwargs: Mapping[str, Any]) -> Optional[nn.Module]:
    """:func:`resolve_model` without weights (None when ``kwargs`` do not suit that model)."""
    try:
        with _meta_device():
            return resolve_model(spec, kwargs)
    except Exception:  # a candidate that cannot be built so is simply not a candidate
        return None
