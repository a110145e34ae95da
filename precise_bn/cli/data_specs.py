"""What ``--data`` names, turned into an iterable of batches: the same command reads the same batches.

``package.module:callable`` (given ``batch_size=`` and ``seed=`` when it takes them),
``imagefolder:DIR`` (torchvision's ``ImageFolder``, or the images of a flat folder; the
evaluation transform, or with ``--augment`` the training ones drawn from ``(--seed, i)``) and
``npz:FILE[:KEY]`` (one array split along its first axis). Built-in data are shuffled with
``--seed``, and under ``torch.distributed`` rank ``r`` of ``W`` reads batches ``r``, ``r + W``,
... (:class:`RankBatches`). Every spec and option: ``docs/cli.md`` ("Model and data").
"""
from __future__ import annotations

import inspect
import logging
import os
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch

from .. import distributed
from ..errors import ConfigError
from .specs import call_factory, import_optional, is_object_spec, load_callable

logger = logging.getLogger("precise_bn")

DEFAULT_BATCH_SIZE = 32
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: The evaluation transform resizes to ``size / CROP_FRACTION`` before its centre crop (256 for 224).
CROP_FRACTION = 0.875
DATA_FORMS = "package.module:callable, imagefolder:DIR or npz:FILE[:KEY]"
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def _options(spec: str, given: Mapping[str, Any], defaults: Mapping[str, Any]) -> Dict[str, Any]:
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ConfigError("--data-kwargs for {!r}: unknown option(s) {}; known: {} (--seed, --augment and "
                          "--batch-size are flags)".format(spec, ", ".join(unknown), ", ".join(sorted(defaults))))
    out = dict(defaults)
    out.update(given)
    return out


class RankBatches:
    """The batches of indices rank ``rank`` of ``world`` reads: those one process reads (all
    ``size`` samples, in ``seed``'s order when shuffled, ``batch_size`` at a time), dealt in
    turn to the ranks. Every sample is read once, by one rank, in the batch it is in on one
    process, so the ranks' merge is one process's (``DistributedSampler`` pads a shard instead)."""

    def __init__(self, size: int, batch_size: int, shuffle: bool, seed: int, drop_last: bool, rank: int = 0,
                 world: int = 1):
        self.size, self.batch_size, self.shuffle, self.seed = size, batch_size, shuffle, seed
        self.drop_last, self.rank, self.world = drop_last, rank, world

    def _all(self) -> List[List[int]]:
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed)).tolist() \
            if self.shuffle else list(range(self.size))
        batches = [order[i:i + self.batch_size] for i in range(0, self.size, self.batch_size)]
        return batches[:-1] if self.drop_last and batches and len(batches[-1]) < self.batch_size else batches

    def __iter__(self) -> Iterator[List[int]]:
        return iter(self._all()[self.rank::self.world])

    def __len__(self) -> int:
        whole = self.size // self.batch_size if self.drop_last else -(-self.size // self.batch_size)
        return len(range(self.rank, whole, self.world))


def _loader(dataset: Any, batch_size: int, options: Mapping[str, Any], seed: int) -> Iterable[Any]:
    from torch.utils.data import DataLoader

    batches = RankBatches(len(dataset), batch_size, bool(options["shuffle"]), seed, bool(options["drop_last"]),
                          distributed.get_rank(), distributed.get_world_size())
    return DataLoader(dataset, batch_sampler=batches, num_workers=int(options.get("num_workers", 0)))


class SeededSamples(torch.utils.data.Dataset):
    """``dataset[i]`` computed with torch's generator seeded from ``(seed, i)`` and restored
    after: random transforms give each sample the same draw in every run."""

    def __init__(self, dataset: Any, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(hash((self.seed, int(index))))  # ints hash alike in every process
            return self.dataset[index]


def _split_npz(rest: str) -> Tuple[str, Optional[str]]:
    head, sep, tail = rest.rpartition(":")
    if sep and head.lower().endswith((".npz", ".npy")) and tail:
        return head, tail
    return rest, None


def _npz_array(spec: str, path: str, key: Optional[str]) -> Any:
    import numpy as np

    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ConfigError("--data {!r}: cannot read {}: {}".format(spec, path, exc)) from exc
    if isinstance(loaded, np.ndarray):
        if key is not None:
            raise ConfigError("--data {!r}: {} is a single .npy array, it has no key {!r}".format(spec, path, key))
        return loaded
    with loaded:
        names = list(loaded.files)
        if key is None and len(names) != 1:
            raise ConfigError("--data {!r}: {} holds {} arrays ({}); name one with npz:{}:KEY".format(
                spec, path, len(names), ", ".join(names), path))
        key = names[0] if key is None else key
        if key not in names:
            raise ConfigError("--data {!r}: {} has no array {!r}; it has {}".format(spec, path, key, ", ".join(names)))
        try:
            return loaded[key]
        except ValueError as exc:
            raise ConfigError("--data {!r}: array {!r}: {}".format(spec, key, exc)) from exc


def _npz_data(spec: str, rest: str, kwargs: Mapping[str, Any], batch_size: int, seed: int) -> Iterable[Any]:
    import numpy as np
    from torch.utils.data import TensorDataset

    options = _options(spec, kwargs, {"shuffle": True, "drop_last": False})
    tensor = torch.from_numpy(np.ascontiguousarray(_npz_array(spec, *_split_npz(rest))))
    if tensor.is_floating_point():
        tensor = tensor.to(torch.get_default_dtype())
    if tensor.dim() == 0 or len(tensor) == 0:
        raise ConfigError("--data {!r}: the array is empty or a scalar, there are no samples".format(spec))
    return _loader(TensorDataset(tensor), batch_size, options, seed)


class FlatImages(torch.utils.data.Dataset):
    """Exactly the image files of one folder, in name order, each transformed: no labels, no
    subfolders, no other files."""

    def __init__(self, folder: str, transform: Any):
        self.files = sorted(os.path.join(folder, e) for e in os.listdir(folder)
                            if e.lower().endswith(IMAGE_EXTENSIONS) and os.path.isfile(os.path.join(folder, e)))
        self.transform = transform

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> Any:
        from torchvision.datasets.folder import default_loader

        return self.transform(default_loader(self.files[index]))


def _is_flat(spec: str, folder: str) -> bool:
    """Whether ``folder`` is a flat folder of images (else one of class subfolders)."""
    if not os.path.isdir(folder):
        raise ConfigError("--data {!r}: {} is not a folder".format(spec, folder))
    entries = os.listdir(folder)
    images = [e for e in entries if e.lower().endswith(IMAGE_EXTENSIONS) and os.path.isfile(os.path.join(folder, e))]
    if any(os.path.isdir(os.path.join(folder, e)) for e in entries):
        if images:
            logger.warning("--data %r: the %d image(s) directly in %s are not read: a folder with subfolders is read "
                           "as DIR/CLASS/IMAGE", spec, len(images), folder)
        return False
    if not images:
        raise ConfigError("--data {!r}: {} holds neither images ({}) nor class subfolders".format(
            spec, folder, ", ".join(IMAGE_EXTENSIONS)))
    return True


def _imagefolder_data(spec: str, folder: str, kwargs: Mapping[str, Any], batch_size: int, seed: int,
                      augment: bool) -> Iterable[Any]:
    options = _options(spec, kwargs, {"size": 224, "scale": (0.08, 1.0), "mean": IMAGENET_MEAN, "std": IMAGENET_STD,
                                      "shuffle": True, "drop_last": False, "num_workers": 0})
    torchvision = import_optional("torchvision", "--data imagefolder:DIR")
    T = torchvision.transforms
    size = int(options["size"])
    if augment:
        crop = [T.RandomResizedCrop(size, scale=tuple(options["scale"])), T.RandomHorizontalFlip()]
    else:
        crop = [T.Resize(round(size / CROP_FRACTION)), T.CenterCrop(size)]
    transform = T.Compose(crop + [T.ToTensor(), T.Normalize(list(options["mean"]), list(options["std"]))])
    try:
        dataset = FlatImages(folder, transform) if _is_flat(spec, folder) else \
            torchvision.datasets.ImageFolder(folder, transform=transform)
    except (FileNotFoundError, OSError) as exc:
        raise ConfigError("--data {!r}: {}".format(spec, exc)) from exc
    return _loader(SeededSamples(dataset, seed) if augment else dataset, batch_size, options, seed)


def _bare_data_spec(spec: str) -> ConfigError:
    if os.path.isdir(spec):
        hint = "; did you mean imagefolder:{}?".format(spec)
    elif spec.lower().endswith((".npz", ".npy")):
        hint = "; did you mean npz:{}?".format(spec)
    else:
        hint = ""
    return ConfigError("--data {!r}: expected {}{}".format(spec, DATA_FORMS, hint))


def _factory_data(spec: str, kwargs: Dict[str, Any], batch_size: Optional[int], seed: Optional[int]) -> Iterable[Any]:
    factory = load_callable(spec, "--data")
    try:
        parameters = inspect.signature(factory).parameters
    except ValueError:
        parameters = {}  # type: ignore[assignment]
    takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in parameters.values())
    for flag, name, value in (("--batch-size", "batch_size", batch_size), ("--seed", "seed", seed)):
        if value is None:
            continue
        if name not in parameters and not takes_kwargs:
            raise ConfigError("{}: the data factory {!r} takes no {} parameter; set it in the factory or through "
                              "--data-kwargs".format(flag, spec, name))
        kwargs.setdefault(name, value)
    data = call_factory(factory, kwargs, "--data", spec)
    if not hasattr(data, "__iter__"):
        raise ConfigError("--data {!r} returned a {}, which is not iterable".format(spec, type(data).__name__))
    return data


def check_data_spec(spec: str, augment: bool = False) -> None:
    """Refuse a ``--data`` spec of none of the forms (see the module docstring), with the spec
    most likely meant, or ``augment`` for data that decide their own, before anything is read:
    a usage error."""
    kind, _, rest = spec.partition(":")
    if not (kind in ("npz", "imagefolder") and rest or is_object_spec(spec)):
        raise _bare_data_spec(spec)
    if augment and kind != "imagefolder":
        raise ConfigError("--augment: only imagefolder: data have built-in augmentation; --data {!r} decides its "
                          "own".format(spec))


def resolve_data(spec: str, kwargs: Optional[Mapping[str, Any]] = None, batch_size: Optional[int] = None, *,
                 seed: Optional[int] = None, augment: bool = False) -> Iterable[Any]:
    """The batches ``spec`` names (see the module docstring); ``seed`` None means 0 for the
    built-in specs and nothing passed to a factory."""
    check_data_spec(spec, augment)
    kwargs = dict(kwargs or {})
    kind, _, rest = spec.partition(":")
    if kind == "npz" and rest:
        return _npz_data(spec, rest, kwargs, batch_size or DEFAULT_BATCH_SIZE, seed or 0)
    if kind == "imagefolder" and rest:
        return _imagefolder_data(spec, rest, kwargs, batch_size or DEFAULT_BATCH_SIZE, seed or 0, augment)
    return _factory_data(spec, kwargs, batch_size, seed)


def data_files(spec: str) -> List[str]:
    """The files a data spec reads directly (an ``npz:`` file), which no output may replace."""
    kind, _, rest = spec.partition(":")
    return [_split_npz(rest)[0]] if kind == "npz" and rest else []
