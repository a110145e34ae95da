"""What ``--model`` and ``--data`` name, turned into a module and an iterable of batches.

Model specs:

* ``package.module:callable`` (or ``path/to/file.py:callable``): called with ``--model-kwargs``;
  must return an ``nn.Module``. The current folder is importable, as with ``python -m``.
* ``torchvision:NAME``: any name of ``torchvision.models.list_models()`` (classification,
  video, segmentation, ...), built without weights since the checkpoint provides them.
* ``timm:NAME``: ``timm.create_model(NAME, pretrained=False)``.

Data specs:

* ``package.module:callable``: returns an iterable of batches (a DataLoader, a list, ...);
  ``--batch-size`` is passed as ``batch_size=`` when the callable takes that parameter.
* ``imagefolder:DIR``: torchvision's ``ImageFolder`` with the usual *training* transforms
  (random resized crop, horizontal flip, normalisation), because BN statistics must describe
  the inputs the layers saw in training. Options (``--data-kwargs``): ``size``, ``scale``,
  ``mean``, ``std``, ``shuffle``, ``seed``, ``drop_last``, ``num_workers``.
* ``npz:FILE[:KEY]``: one array of a ``.npz`` (or a ``.npy``), split into batches along its
  first axis; floating arrays become the default float dtype. Options: ``shuffle``, ``seed``,
  ``drop_last`` (a last batch of one sample breaks a BatchNorm1d in training mode).

Built-in data are shuffled with a fixed seed by default: a sample budget smaller than the data
then sees a representative subset, not the first classes of a sorted folder. Under
``torch.distributed`` each rank reads its own shard.
"""
from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import os
import sys
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import torch
from torch import nn

from .. import distributed
from ..errors import BackendUnavailableError, ConfigError

DEFAULT_BATCH_SIZE = 32
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _import_optional(name: str, what: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise BackendUnavailableError(
            "{} needs the {} package, which is not installed ({}): pip install {}".format(what, name, exc, name)
        ) from exc


def load_object(spec: str, option: str) -> Any:
    """Import ``package.module:attr.attr`` or ``file.py:attr``; ``option`` names the flag in errors."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ConfigError("{} {!r}: expected 'package.module:name'".format(option, spec))
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
    """:func:`load_object`, which must be callable (a model or data factory)."""
    obj = load_object(spec, option)
    if not callable(obj):
        raise ConfigError("{} {!r}: {} is not callable".format(option, spec, type(obj).__name__))
    return obj


def _call(factory: Callable[..., Any], kwargs: Mapping[str, Any], option: str, spec: str) -> Any:
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


def resolve_model(spec: str, kwargs: Optional[Mapping[str, Any]] = None) -> nn.Module:
    """Build the model ``spec`` names (see the module docstring), with ``kwargs``."""
    kwargs = dict(kwargs or {})
    kind, _, name = spec.partition(":")
    if kind == "torchvision" and name:
        torchvision = _import_optional("torchvision", "--model torchvision:NAME")
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
    elif kind == "timm" and name:
        timm = _import_optional("timm", "--model timm:NAME")
        names = timm.list_models()
        if name not in names:
            raise _unknown_name("timm", name, names)
        kwargs.setdefault("pretrained", False)
        model = timm.create_model(name, **kwargs)
    else:
        model = _call(load_callable(spec, "--model"), kwargs, "--model", spec)
    if not isinstance(model, nn.Module):
        raise ConfigError("--model {!r} returned a {}, not an nn.Module".format(spec, type(model).__name__))
    return model


def _options(spec: str, given: Mapping[str, Any], defaults: Mapping[str, Any]) -> Dict[str, Any]:
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ConfigError(
            "--data-kwargs for {!r}: unknown option(s) {}; known: {}".format(
                spec, ", ".join(unknown), ", ".join(sorted(defaults))
            )
        )
    out = dict(defaults)
    out.update(given)
    return out


def _loader(dataset: Any, batch_size: int, options: Mapping[str, Any]) -> Iterable[Any]:
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(
        dataset,
        num_replicas=distributed.get_world_size(),
        rank=distributed.get_rank(),
        shuffle=bool(options["shuffle"]),
        seed=int(options["seed"]),
    )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=int(options.get("num_workers", 0)),
        drop_last=bool(options["drop_last"]),
    )


def _split_npz(rest: str) -> Tuple[str, Optional[str]]:
    head, sep, tail = rest.rpartition(":")
    if sep and head.lower().endswith((".npz", ".npy")) and tail:
        return head, tail
    return rest, None


def _npz_data(spec: str, rest: str, kwargs: Mapping[str, Any], batch_size: int) -> Iterable[Any]:
    import numpy as np

    options = _options(spec, kwargs, {"shuffle": True, "seed": 0, "drop_last": False})
    path, key = _split_npz(rest)
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ConfigError("--data {!r}: cannot read {}: {}".format(spec, path, exc)) from exc
    if isinstance(loaded, np.ndarray):
        if key is not None:
            raise ConfigError("--data {!r}: {} is a single .npy array, it has no key {!r}".format(spec, path, key))
        array = loaded
    else:
        with loaded:
            names = list(loaded.files)
            if key is None and len(names) != 1:
                raise ConfigError(
                    "--data {!r}: {} holds {} arrays ({}); name one with npz:{}:KEY".format(
                        spec, path, len(names), ", ".join(names), path
                    )
                )
            key = names[0] if key is None else key
            if key not in names:
                raise ConfigError("--data {!r}: {} has no array {!r}; it has {}".format(spec, path, key, ", ".join(names)))
            try:
                array = loaded[key]
            except ValueError as exc:
                raise ConfigError("--data {!r}: array {!r}: {}".format(spec, key, exc)) from exc
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if tensor.is_floating_point():
        tensor = tensor.to(torch.get_default_dtype())
    if tensor.dim() == 0 or len(tensor) == 0:
        raise ConfigError("--data {!r}: the array is empty or a scalar, there are no samples".format(spec))
    from torch.utils.data import TensorDataset

    return _loader(TensorDataset(tensor), batch_size, options)


def _imagefolder_data(spec: str, folder: str, kwargs: Mapping[str, Any], batch_size: int) -> Iterable[Any]:
    options = _options(
        spec,
        kwargs,
        {
            "size": 224,
            "scale": (0.08, 1.0),
            "mean": IMAGENET_MEAN,
            "std": IMAGENET_STD,
            "shuffle": True,
            "seed": 0,
            "drop_last": False,
            "num_workers": 0,
        },
    )
    torchvision = _import_optional("torchvision", "--data imagefolder:DIR")
    T = torchvision.transforms
    transform = T.Compose(
        [
            T.RandomResizedCrop(options["size"], scale=tuple(options["scale"])),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize(list(options["mean"]), list(options["std"])),
        ]
    )
    try:
        dataset = torchvision.datasets.ImageFolder(folder, transform=transform)
    except (FileNotFoundError, OSError) as exc:
        raise ConfigError("--data {!r}: {}".format(spec, exc)) from exc
    return _loader(dataset, batch_size, options)


def resolve_data(
    spec: str, kwargs: Optional[Mapping[str, Any]] = None, batch_size: Optional[int] = None
) -> Iterable[Any]:
    """The batches ``spec`` names (see the module docstring)."""
    kwargs = dict(kwargs or {})
    kind, _, rest = spec.partition(":")
    if kind == "npz" and rest:
        return _npz_data(spec, rest, kwargs, batch_size or DEFAULT_BATCH_SIZE)
    if kind == "imagefolder" and rest:
        return _imagefolder_data(spec, rest, kwargs, batch_size or DEFAULT_BATCH_SIZE)
    factory = load_callable(spec, "--data")
    if batch_size is not None:
        try:
            parameters = inspect.signature(factory).parameters
        except ValueError:
            parameters = {}
        takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in parameters.values())
        if "batch_size" not in parameters and not takes_kwargs:
            raise ConfigError(
                "--batch-size: the data factory {!r} takes no batch_size parameter; set the batch "
                "size in the factory or through --data-kwargs".format(spec)
            )
        kwargs.setdefault("batch_size", batch_size)
    data = _call(factory, kwargs, "--data", spec)
    if not hasattr(data, "__iter__"):
        raise ConfigError("--data {!r} returned a {}, which is not iterable".format(spec, type(data).__name__))
    return data
