"""The Caffe2 backend: a forward-only aux net, its SpatialBN batch stats, fed back per device.

How it works, and why:

* Caffe2's ``SpatialBN`` in train mode (``is_test=0``) saves each call's batch mean in
  ``{layer}_bn_sm`` and ``1 / sqrt(var + eps)`` in ``{layer}_bn_siv`` (``var`` biased). The
  aux net runs the model's forward ops with every SpatialBN in train mode; after each run we
  read, for every device ``{prefix}_{i}/`` and layer, those two blobs and the element count per
  channel of the layer's input (batch x spatial positions, read from a ``Shape`` op appended to
  the aux net, so no activation is copied out of the workspace).
* ``var`` is recovered as ``1 / siv^2 - eps`` in float64 by
  :meth:`PopulationStats.add_caffe2`, and every (device, iteration) batch is merged with Chan's
  formula weighted by its true element count: devices with different batch sizes count for
  what they saw, the spread of batch means is kept, and a dead channel ends at exactly 0.
* The merged mean and variance are fed as float32 ``{layer}_bn_rm`` / ``{layer}_bn_riv`` to
  every device under the device option of that device's SpatialBN op (``_bn_riv`` holds a
  variance despite its name), so all devices hold identical bits.
* Caffe2's CPU kernel computes the batch variance as ``E[x^2] - E[x]^2`` in float32. When a
  channel's mean is large next to its std this cancels, falls below ``-eps`` and the saved
  inverse std is NaN. Nothing recovers the lost digits, so such a run raises
  :class:`NonFiniteStatsError` naming layer, device and iteration, and the running stats are
  restored as they were before the pass (train-mode SpatialBN also updates them in place).

The aux net is the backward slice of the model's net from its SpatialBN inputs: only ops that
contribute to some BN layer's input are kept, so gradient, loss-only and optimizer ops (and the
head after the last BN layer) never run. Parameters are shared by blob name with the training
net in the same workspace; nothing is initialised here.

Caffe2 is imported lazily: ``import precise_bn`` never needs it.
"""
from __future__ import annotations

import logging
import math
import re
import time
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from . import distributed
from .data import CyclingBatches
from .errors import (
    BackendUnavailableError,
    ConfigError,
    EmptyDataError,
    LayerError,
    NonFiniteStatsError,
)
from .estimator import PopulationStats
from .report import BNReport, LayerReport
from .torch_backend import _progress_bar

logger = logging.getLogger("precise_bn")

Feeds = Dict[str, np.ndarray]
Caffe2Cache = Dict[str, Tuple[np.ndarray, np.ndarray]]

CAFFE2_INSTALL_HINT = (
    "Caffe2 ships only in PyTorch wheels up to 1.10.2: create a Python 3.9 environment and run "
    "`pip install torch==1.10.2 'numpy<1.24' 'protobuf<4' six future` "
    "(`bash scripts/dev.sh setup` builds it as .venv-caffe2)"
)

# The epsilon Caffe2's SpatialBN uses when the op carries no ``epsilon`` argument.
CAFFE2_DEFAULT_EPS = 1e-5


def import_caffe2() -> Tuple[Any, Any, Any]:
    """Return ``(core, workspace, caffe2_pb2)``, or raise BackendUnavailableError saying how to get them."""
    try:
        from caffe2.proto import caffe2_pb2
        from caffe2.python import core, workspace
    except ImportError as exc:
        raise BackendUnavailableError(
            "the caffe2 backend needs Caffe2 ({}). {}".format(exc, CAFFE2_INSTALL_HINT)
        ) from exc
    return core, workspace, caffe2_pb2


class BNBlobs(NamedTuple):
    """The blobs of one SpatialBN layer on one device, and how to read its element count."""

    layer: str
    device: str
    option: Any
    rm: str
    riv: str
    sm: str
    siv: str
    shape: str
    channel_axis: int
    eps: float


def _arg(op: Any, name: str) -> Any:
    for arg in op.arg:
        if arg.name == name:
            return arg
    return None


def _is_gradient(op: Any) -> bool:
    return bool(op.is_gradient_op) or op.type.endswith("Gradient")


def _is_forward_bn(op: Any) -> bool:
    return op.type == "SpatialBN" and not _is_gradient(op)


def _device_option(net: Any, op: Any) -> Any:
    """Where ``op`` runs: its own device option, else the net's."""
    return op.device_option if op.HasField("device_option") else net.device_option


def _net_proto(model: Any) -> Any:
    """The NetDef of a ModelHelper, a core.Net or a NetDef, or of what a callable returns."""
    core, _, caffe2_pb2 = import_caffe2()
    from caffe2.python import model_helper

    net_types = (caffe2_pb2.NetDef, core.Net, model_helper.ModelHelper)
    if callable(model) and not isinstance(model, net_types):
        model = model()
    if isinstance(model, caffe2_pb2.NetDef):
        return model
    if isinstance(model, core.Net):
        return model.Proto()
    if isinstance(model, model_helper.ModelHelper):
        return model.net.Proto()
    raise ConfigError(
        "model must be a caffe2 ModelHelper, core.Net, NetDef or a callable building one, got {}".format(
            type(model).__name__
        )
    )


def forward_only_net(model: Any) -> Any:
    """Build the aux NetDef: the ops feeding some SpatialBN input, with SpatialBN in train mode.

    ``model`` is an aux net already (kept as it is, minus the ops after the last BN layer) or a
    training net: gradient ops, loss-only ops and optimizer updates contribute to no BN input
    and are dropped. Each SpatialBN gets ``is_test=0`` (a test-mode op also gets the running
    and saved stats outputs a train-mode op writes), followed by a ``Shape`` op on its input.
    The aux net is named after the source net plus ``_precise_bn_aux``.
    """
    _, _, caffe2_pb2 = import_caffe2()
    source = _net_proto(model)
    needed: set = set()
    kept = []
    for op in reversed(source.op):
        if _is_gradient(op):
            continue
        if _is_forward_bn(op) or needed.intersection(op.output):
            kept.append(op)
            needed.difference_update(op.output)
            needed.update(op.input)
    if not any(_is_forward_bn(op) for op in kept):
        raise LayerError(
            "net {!r} has no SpatialBN op: nothing to recompute (params ending in _bn_s consumed "
            "by AffineChannel are BN folded into a fixed affine map, with no statistics)".format(
                source.name
            )
        )
    aux = caffe2_pb2.NetDef()
    aux.name = (source.name or "net") + "_precise_bn_aux"
    if source.HasField("type"):
        aux.type = source.type
    if source.HasField("num_workers"):
        aux.num_workers = source.num_workers
    if source.HasField("device_option"):
        aux.device_option.CopyFrom(source.device_option)
    produced: set = set()
    external: List[str] = []
    for op in reversed(kept):
        new = aux.op.add()
        new.CopyFrom(op)
        for blob in op.input:
            if blob not in produced and blob not in external:
                external.append(blob)
        if _is_forward_bn(op):
            _set_train_mode(new)
            shape = aux.op.add()
            shape.type = "Shape"
            shape.input.append(op.input[0])
            shape.output.append(_shape_blob(new))
            if op.HasField("device_option"):
                shape.device_option.CopyFrom(op.device_option)
            produced.update(shape.output)
        produced.update(new.output)
    aux.external_input.extend(external)
    return aux


def _set_train_mode(op: Any) -> None:
    is_test = _arg(op, "is_test")
    if is_test is None:
        is_test = op.arg.add()
        is_test.name = "is_test"
    is_test.i = 0
    if len(op.output) == 1:
        scale = op.input[1]
        stem = scale[: -len("_s")] if scale.endswith("_s") else op.output[0]
        op.output.extend([op.input[3], op.input[4], stem + "_sm", stem + "_siv"])


def _shape_blob(bn_op: Any) -> str:
    return bn_op.output[3] + "_precise_bn_shape"


def _layer_name(scale_blob: str) -> str:
    base = scale_blob.rsplit("/", 1)[-1]
    for suffix in ("_bn_s", "_s"):
        if base.endswith(suffix):
            return base[: -len(suffix)]
    return base


def find_bn_layers(aux: Any, devices: Sequence[str]) -> Dict[str, List[BNBlobs]]:
    """Map layer name (device scope and ``_bn_s`` removed) to its blobs on each device, in order.

    A layer is a train-mode SpatialBN op of ``aux``; its device is the ``{prefix}_{i}`` name
    scope of its scale parameter (``""`` for an unscoped single-device net). Every device must
    hold the same layers, and a layer must run once per net run (its saved stats are
    overwritten by a second call). Each layer keeps the epsilon its kernel used for ``siv``.
    """
    by_device: Dict[str, Dict[str, BNBlobs]] = {device: {} for device in devices}
    for op in aux.op:
        if not _is_forward_bn(op):
            continue
        scale = op.input[1]
        device = _device_of(scale, devices)
        layer = _layer_name(scale)
        if device is None:
            raise ConfigError(
                "SpatialBN layer {!r} (scale blob {!r}) is on no expected device {}: check "
                "num_gpus, root_gpu_id and device_prefix".format(layer, scale, list(devices))
            )
        if layer in by_device[device]:
            raise LayerError(
                "SpatialBN layer {!r} on device {!r} runs more than once per net run: its saved "
                "batch stats {!r} keep only the last call, so it cannot be measured".format(
                    layer, device or "<unscoped>", op.output[3]
                )
            )
        eps_arg = _arg(op, "epsilon")
        order = _arg(op, "order")
        nhwc = order is not None and order.s in (b"NHWC", "NHWC")
        by_device[device][layer] = BNBlobs(
            layer=layer,
            device=device,
            option=_device_option(aux, op),
            rm=op.input[3],
            riv=op.input[4],
            sm=op.output[3],
            siv=op.output[4],
            shape=_shape_blob(op),
            channel_axis=-1 if nhwc else 1,
            eps=float(eps_arg.f) if eps_arg is not None else CAFFE2_DEFAULT_EPS,
        )
    names = list(by_device[devices[0]])
    for device in devices:
        if list(by_device[device]) != names:
            raise ConfigError(
                "devices hold different SpatialBN layers: {} has {}, {} has {}".format(
                    devices[0] or "<unscoped>", names, device or "<unscoped>", list(by_device[device])
                )
            )
    return {name: [by_device[device][name] for device in devices] for name in names}


def _device_of(blob: str, devices: Sequence[str]) -> Optional[str]:
    for device in devices:
        if (device == "" and "/" not in blob) or (device and blob.startswith(device + "/")):
            return device
    return None


def _devices(aux: Any, settings: Dict[str, Any]) -> List[str]:
    """``{prefix}_{root}`` ... ``{prefix}_{root + num_gpus - 1}``; ``[""]`` for an unscoped net."""
    prefix = settings["device_prefix"]
    num, root = int(settings["num_gpus"]), int(settings["root_gpu_id"])
    if num <= 0 or root < 0:
        raise ConfigError("num_gpus must be > 0 and root_gpu_id >= 0, got {} and {}".format(num, root))
    scoped = re.compile(r"^{}_\d+/".format(re.escape(prefix)))
    bn_scales = [op.input[1] for op in aux.op if _is_forward_bn(op)]
    if num == 1 and not any(scoped.match(blob) for blob in bn_scales):
        return [""]
    return ["{}_{}".format(prefix, root + i) for i in range(num)]


class Caffe2AuxModel:
    """The Caffe2 aux net and the pass that measures and writes its BN layers' stats.

    Built by ``BatchNormHelper(backend="caffe2").create_bn_aux_model(model, data)``.

    Args:
        model: a ``ModelHelper`` (aux or training net), ``core.Net``, ``NetDef``, or a callable
            building one; its parameters must already live in the current workspace.
        data: optional iterable of ``{blob name: ndarray}`` fed before each run (re-iterated when
            it runs out); None for nets with their own reader ops.
        settings: the helper's settings (``num_gpus``, ``root_gpu_id``, ``device_prefix``,
            ``log_period``, ``bn_epsilon``). ``siv`` is undone with the epsilon each op's
            kernel used (its ``epsilon`` argument, else Caffe2's 1e-5); a ``bn_epsilon`` that
            differs from it is logged as a warning, since the config then disagrees with the net.
        progress: None/False, or True/"tqdm" for a tqdm bar.
        sync: merge across ranks (default: whenever a torch.distributed group exists).
        group: the process group to merge over.
    """

    def __init__(
        self,
        model: Any,
        data: Optional[Iterable[Feeds]],
        settings: Dict[str, Any],
        progress: Any = None,
        sync: Optional[bool] = None,
        group: Any = None,
    ):
        _, self.workspace, _ = import_caffe2()
        self.settings = settings
        self.progress = progress
        self.sync = sync
        self.group = group
        self.batches = CyclingBatches(data) if data is not None else None
        self.net = forward_only_net(model)
        self.devices = _devices(self.net, settings)
        self.layers = find_bn_layers(self.net, self.devices)
        self._check_epsilon(float(settings["bn_epsilon"]))
        self._check_params()
        self._feed_options = self._consumer_options()
        self._created = False
        logger.info(
            "precise-bn (caffe2): aux net %r with %d ops, %d BatchNorm layers on %d device(s)",
            self.net.name, len(self.net.op), len(self.layers), len(self.devices),
        )

    def _check_epsilon(self, bn_epsilon: float) -> None:
        # An op's epsilon argument is stored as float32: compare at that resolution.
        differ = [
            name
            for name, blobs in self.layers.items()
            if abs(blobs[0].eps - bn_epsilon) > 1e-6 * bn_epsilon
        ]
        if differ:
            logger.warning(
                "precise-bn (caffe2): bn_epsilon=%g differs from the epsilon of SpatialBN layers "
                "%s (first: %g); each layer's own epsilon is used",
                bn_epsilon, differ[:5], self.layers[differ[0]][0].eps,
            )

    def _check_params(self) -> None:
        missing = [
            blob
            for blobs in self.layers.values()
            for b in blobs
            for blob in (b.rm, b.riv)
            if not self.workspace.HasBlob(blob)
        ]
        if missing:
            raise LayerError(
                "BatchNorm running stats {} are not in the workspace: initialise the training "
                "net's parameters (run its param_init_net or load a checkpoint) first".format(missing[:5])
            )
        for name, blobs in self.layers.items():
            sizes = {self.workspace.FetchBlob(b.rm).size for b in blobs}
            if len(sizes) != 1:
                raise LayerError(
                    "BatchNorm layer {!r} has different channel counts per device: {}".format(name, sizes)
                )

    def _consumer_options(self) -> Dict[str, Any]:
        options: Dict[str, Any] = {}
        for op in self.net.op:
            for blob in op.input:
                options.setdefault(blob, _device_option(self.net, op))
        return options

    def _feed(self, feeds: Feeds) -> None:
        for name, value in feeds.items():
            self.workspace.FeedBlob(name, value, device_option=self._feed_options.get(name))

    def _create(self) -> None:
        produced = {blob for op in self.net.op for blob in op.output}
        missing = [b for b in self.net.external_input if b not in produced and not self.workspace.HasBlob(b)]
        if missing:
            raise ConfigError(
                "the aux net needs blobs that are neither in the workspace nor fed by data: {}; "
                "pass data=[{{blob: array}}, ...] or build the net with its reader ops".format(missing[:5])
            )
        self.workspace.CreateNet(self.net, overwrite=True)
        self._created = True

    def _snapshot(self) -> List[Tuple[BNBlobs, np.ndarray, np.ndarray]]:
        return [
            (b, self.workspace.FetchBlob(b.rm), self.workspace.FetchBlob(b.riv))
            for blobs in self.layers.values()
            for b in blobs
        ]

    def _restore(self, snapshot: List[Tuple[BNBlobs, np.ndarray, np.ndarray]]) -> None:
        for b, rm, riv in snapshot:
            self.workspace.FeedBlob(b.rm, rm, device_option=b.option)
            self.workspace.FeedBlob(b.riv, riv, device_option=b.option)

    def _read(self, stats: Dict[str, PopulationStats], iteration: int, iters: int) -> int:
        """Add every device's batch stats of every layer; return the samples seen this run."""
        fetch = self.workspace.FetchBlob
        samples = 0
        for index, (name, blobs) in enumerate(self.layers.items()):
            for b in blobs:
                sm, siv, shape = fetch(b.sm), fetch(b.siv), fetch(b.shape)
                bad = ~(np.isfinite(sm) & np.isfinite(siv) & (siv > 0))
                if bad.any():
                    raise NonFiniteStatsError(
                        "Caffe2 BatchNorm layer {!r} on device {!r}: non-finite saved mean or inverse "
                        "std in channels {} at iteration {} of {}. Caffe2's CPU SpatialBN computes the "
                        "variance as E[x^2]-E[x]^2 in float32, which falls below -epsilon when a "
                        "channel's mean is large next to its std (NaN/Inf inputs do the same); no "
                        "stats were fed and the running stats were restored".format(
                            name, b.device or "<unscoped>", np.flatnonzero(bad)[:5].tolist(), iteration, iters
                        )
                    )
                dims = shape.tolist()
                count = math.prod(dims) // dims[b.channel_axis]
                stats[name].add_caffe2(sm, siv, b.eps, count)
                if index == 0:
                    samples += dims[0]
        return samples

    def _run(self, stats: Dict[str, PopulationStats], iters: int) -> int:
        """Feed, run and read ``iters`` times; return the samples seen (first layer's batch)."""
        log_period = int(self.settings["log_period"])
        samples = 0
        bar = _progress_bar(self.progress, iters)
        try:
            tick = time.perf_counter()
            for iteration in range(1, iters + 1):
                if self.batches is not None:
                    try:
                        self._feed(next(self.batches))
                    except StopIteration:
                        raise EmptyDataError("the caffe2 aux data gave no feed: nothing to measure") from None
                if not self._created:
                    self._create()
                self.workspace.RunNet(self.net.name)
                samples += self._read(stats, iteration, iters)
                if bar is not None:
                    bar.update(1)
                if log_period and iteration % log_period == 0:
                    now = time.perf_counter()
                    seconds = (now - tick) / log_period
                    logger.info("precise-bn (caffe2): iter %d/%d, %.4f s/iter", iteration, iters, seconds)
                    tick = now
        finally:
            if bar is not None:
                bar.close()
        return samples

    def compute(self, iters: int) -> Tuple[Caffe2Cache, BNReport]:
        """Run the aux net ``iters`` times, merge every batch of every device (and rank), feed.

        Returns the fed float32 ``(rm, riv)`` per layer (for :meth:`apply`) and a report.
        Raises NonFiniteStatsError (naming layer, device, iteration) or EmptyDataError with
        every device's running stats as they were before the call; with a process group, a
        failure on one rank makes the others raise DistributedError instead of waiting.
        """
        started = time.perf_counter()
        sync = distributed.resolve_sync(self.sync, self.group)
        stats = {
            name: PopulationStats(self.workspace.FetchBlob(blobs[0].rm).size, name=name)
            for name, blobs in self.layers.items()
        }
        snapshot = self._snapshot()
        try:
            with distributed.abort_merge_on_error(sync, self.group):
                samples = self._run(stats, iters)
            merged, batches = list(stats.values()), iters
            if sync:
                merged, batches, samples = distributed.merge_ranks(merged, iters, samples, self.group)
            results = [s.finalize() for s in merged]
        except BaseException:
            self._restore(snapshot)
            raise
        cache = {
            name: (mean.numpy().astype(np.float32), var.numpy().astype(np.float32))
            for name, (mean, var) in zip(self.layers, results)
        }
        self.apply(cache)
        old = {b.layer: (rm, riv) for b, rm, riv in snapshot if b.device == self.devices[0]}
        report = BNReport(
            batches=batches,
            samples=samples,
            world_size=distributed.get_world_size(self.group) if sync else 1,
            estimator="caffe2",
        )
        for (name, blobs), s, (mean, var) in zip(self.layers.items(), merged, results):
            report.layers.append(
                LayerReport(
                    name=name,
                    elements=s.count,
                    calls=s.calls,
                    old_mean=torch.from_numpy(old[name][0].astype(np.float64)),
                    old_var=torch.from_numpy(old[name][1].astype(np.float64)),
                    new_mean=mean,
                    new_var=var,
                    eps=blobs[0].eps,
                    clamped=s.clamped,
                )
            )
        report.seconds = time.perf_counter() - started
        logger.info(
            "precise-bn (caffe2): recomputed %d layers from %d iterations x %d device(s) in %.2f s",
            len(self.layers), iters, len(self.devices), report.seconds,
        )
        return cache, report

    def apply(self, cache: Caffe2Cache) -> None:
        """Feed cached float32 ``(rm, riv)`` to every device of each layer, running no net."""
        for name, (mean, var) in cache.items():
            for b in self.layers[name]:
                self.workspace.FeedBlob(b.rm, mean, device_option=b.option)
                self.workspace.FeedBlob(b.riv, var, device_option=b.option)
