"""The Caffe2 backend: run the aux net, read its SpatialBN batch stats, feed the result per device.

How it works, and why:

* Caffe2's ``SpatialBN`` in train mode saves each call's batch mean in ``{layer}_bn_sm`` and
  ``1 / sqrt(var + eps)`` in ``{layer}_bn_siv`` (``var`` biased). After each run of the aux net
  (:mod:`precise_bn.caffe2.net`) we read, for every device ``{prefix}_{i}/`` and layer, those
  two blobs and the element count per channel of the layer's input (batch x spatial positions).
* ``var`` is recovered as ``1 / siv^2 - eps`` in float64
  (:func:`~precise_bn.caffe2.stats.decode_saved_stats`), and every
  (device, iteration) batch is merged with Chan's formula weighted by its true element count:
  devices with different batch sizes count for what they saw, the spread of batch means is
  kept, and a dead channel ends at exactly 0.
* The merged mean and variance are fed as float32 ``{layer}_bn_rm`` / ``{layer}_bn_riv`` to
  every device under the device option of that device's SpatialBN op (``_bn_riv`` holds a
  variance despite its name), so all devices hold identical bits.
* Caffe2's CPU kernel computes the batch variance as ``E[x^2] - E[x]^2`` in float32. When a
  channel's mean is large next to its std this cancels: the saved variance loses digits
  (:func:`~precise_bn.caffe2.stats.untrusted_channels` names the channels where it may be off
  by more than ``UNTRUSTED_RTOL``, in a :class:`PreciseBNWarning` and in
  ``LayerReport.untrusted``), or
  falls below ``-eps`` and the saved inverse std is NaN, which raises
  :class:`NonFiniteStatsError` naming layer, device and iteration; the running stats are then
  restored as they were before the pass (train-mode SpatialBN also updates them in place).
* ``exact=True`` shifts each SpatialBN's input by its float32 batch mean ``c`` inside the aux
  net (:func:`precise_bn.caffe2.net.forward_only_net`: the kernel no longer cancels, so later
  layers see accurate activations too), then reads, for every device and run, the shifted input
  blob and measures it in float64 shifted again by the kernel's batch mean of it
  (:func:`~precise_bn.caffe2.stats.measure_input`), as the PyTorch exact path does; the mean is ``c`` plus the measured
  one. Nothing cancels, whatever the mean, and the kernel's variance is not used at all.

The pass itself (budget, progress, ranks, report, writing last) is the shared driver's
(:mod:`precise_bn.driver`), as for PyTorch models.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import math
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..data import CyclingBatches
from ..driver import recalibrate
from ..errors import ConfigError, LayerError, NonFiniteStatsError
from ..estimator import PopulationStats, shift_buffer_size
from ..options import Options
from ..report import BNReport
from ..signals import all_or_nothing, write
from .net import BNBlobs, device_option, devices_of_net, find_bn_layers, forward_only_net, import_caffe2
from .stats import decode_saved_stats, measure_input, untrusted_channels

logger = logging.getLogger("precise_bn")

Feeds = Dict[str, np.ndarray]
Caffe2Cache = Dict[str, Tuple[np.ndarray, np.ndarray]]
Stats = Tuple[torch.Tensor, torch.Tensor]

class Caffe2AuxModel:
    """The Caffe2 aux net and the recalibration of its BN layers.

    Built by ``BatchNormHelper(backend="caffe2").create_bn_aux_model(model, data)``.

    Args:
        model: a ``ModelHelper`` (aux or training net), ``core.Net``, ``NetDef``, or a callable
            building one; its parameters must already live in the current workspace.
        data: optional iterable of ``{blob name: ndarray}`` fed before each run (re-iterated when
            it runs out); None for nets with their own reader ops.
        settings: the helper's settings (``num_gpus``, ``root_gpu_id``, ``device_prefix``,
            ``bn_epsilon``). ``siv`` is undone with the epsilon each op's kernel used (its
            ``epsilon`` argument, else Caffe2's 1e-5); a ``bn_epsilon`` that differs from it is
            logged as a warning, since the config then disagrees with the net.
        opts: the pass's options (``num_batches`` is the helper's ``iters``).
    """

    def __init__(self, model: Any, data: Optional[Iterable[Feeds]], settings: Dict[str, Any], opts: Options):
        _, self.workspace, _ = import_caffe2()
        self.opts = opts
        self.batches: Iterator[Any] = CyclingBatches(data) if data is not None else itertools.repeat(None)
        self.net = forward_only_net(model, channels=self._channels if opts.exact else None)
        self.devices = devices_of_net(self.net, settings)
        self.layers = find_bn_layers(self.net, self.devices)
        self._check_epsilon(float(settings["bn_epsilon"]))
        self._check_params()
        self._feed_options = self._consumer_options()
        self._created = False
        logger.info("precise-bn (caffe2): aux net %r with %d ops, %d BatchNorm layers on %d device(s)",
                    self.net.name, len(self.net.op), len(self.layers), len(self.devices))

    def _channels(self, scale_blob: str) -> int:
        return int(self.workspace.FetchBlob(scale_blob).size) if self.workspace.HasBlob(scale_blob) else 0

    def _check_epsilon(self, bn_epsilon: float) -> None:
        # An op's epsilon argument is stored as float32: compare at that resolution.
        differ = [name for name, blobs in self.layers.items() if abs(blobs[0].eps - bn_epsilon) > 1e-6 * bn_epsilon]
        if differ:
            logger.warning("precise-bn (caffe2): bn_epsilon=%g differs from the epsilon of SpatialBN layers %s "
                           "(first: %g); each layer's own epsilon is used",
                           bn_epsilon, differ[:5], self.layers[differ[0]][0].eps)

    def _check_params(self) -> None:
        missing = [blob for blobs in self.layers.values() for b in blobs for blob in (b.rm, b.riv)
                   if not self.workspace.HasBlob(blob)]
        if missing:
            raise LayerError("BatchNorm running stats {} are not in the workspace: initialise the training net's "
                             "parameters (run its param_init_net or load a checkpoint) first".format(missing[:5]))
        for name, blobs in self.layers.items():
            sizes = {self.workspace.FetchBlob(b.rm).size for b in blobs}
            if len(sizes) != 1:
                raise LayerError("BatchNorm layer {!r} has different channel counts per device: {}".format(name, sizes))

    def _consumer_options(self) -> Dict[str, Any]:
        options: Dict[str, Any] = {}
        for op in self.net.op:
            for blob in op.input:
                options.setdefault(blob, device_option(self.net, op))
        return options

    def feed(self, feeds: Feeds) -> None:
        for name, value in feeds.items():
            self.workspace.FeedBlob(name, value, device_option=self._feed_options.get(name))

    def run_net(self) -> None:
        if not self._created:
            produced = {blob for op in self.net.op for blob in op.output}
            missing = [b for b in self.net.external_input if b not in produced and not self.workspace.HasBlob(b)]
            if missing:
                raise ConfigError("the aux net needs blobs that are neither in the workspace nor fed by data: {}; "
                                  "pass data=[{{blob: array}}, ...] or build the net with its reader ops".format(missing[:5]))
            self.workspace.CreateNet(self.net, overwrite=True)
            self._created = True
        self.workspace.RunNet(self.net.name)

    def snapshot(self) -> List[Tuple[BNBlobs, np.ndarray, np.ndarray]]:
        return [(b, self.workspace.FetchBlob(b.rm), self.workspace.FetchBlob(b.riv))
                for blobs in self.layers.values() for b in blobs]

    def restore(self, snapshot: Sequence[Tuple[BNBlobs, np.ndarray, np.ndarray]]) -> None:
        for b, rm, riv in snapshot:
            self.workspace.FeedBlob(b.rm, rm, device_option=b.option)
            self.workspace.FeedBlob(b.riv, riv, device_option=b.option)

    def run(self, store: Callable[[Caffe2Cache, BNReport], None]) -> BNReport:
        """Recompute and feed the stats; ``store(cache, report)`` keeps what was fed."""

        def on_write(report: BNReport) -> None:
            store({layer.name: (layer.new_mean.numpy().astype(np.float32), layer.new_var.numpy().astype(np.float32))
                   for layer in report.layers if layer.ran}, report)

        return recalibrate(lambda: _Caffe2Pass(self), self.batches, self.opts, budget_name="iters",
                           on_write=on_write, label="precise-bn (caffe2)")

    @all_or_nothing
    def apply(self, cache: Caffe2Cache) -> None:
        """Feed cached float32 ``(rm, riv)`` to every device of each layer, running no net, as one
        :func:`~precise_bn.signals.write` that an interrupt cannot split or leave behind."""
        snapshot = self.snapshot()
        fed = [(b, mean, var) for name, (mean, var) in cache.items() for b in self.layers[name]]
        write(lambda: self.restore(fed), lambda: self.restore(snapshot))


class _Caffe2Pass:
    """One pass of the driver over a :class:`Caffe2AuxModel` (see :class:`precise_bn.driver.Backend`)."""

    empty_reason = "the net has no SpatialBN layer"

    def __init__(self, aux: Caffe2AuxModel):
        self.aux = aux
        self.exact = aux.opts.exact
        self.estimator = "caffe2-exact" if self.exact else "caffe2"
        self._buffer: Optional[torch.Tensor] = None
        self.names = list(aux.layers)
        self.eps = [blobs[0].eps for blobs in aux.layers.values()]
        self.dtypes = [torch.float32] * len(self.names)
        fetch = aux.workspace.FetchBlob
        self.stats = [PopulationStats(fetch(blobs[0].rm).size, name=name) for name, blobs in aux.layers.items()]
        self.iteration = 0
        self._snapshot = aux.snapshot()

    def old_stats(self) -> List[Stats]:
        first = {b.layer: (rm, riv) for b, rm, riv in self._snapshot if b.device == self.aux.devices[0]}
        return [(torch.from_numpy(first[name][0].astype(np.float64)).reshape(-1),
                 torch.from_numpy(first[name][1].astype(np.float64)).reshape(-1)) for name in self.names]

    @contextlib.contextmanager
    def attached(self) -> Iterator[None]:
        try:
            yield
        finally:
            self.restore()

    def restore(self) -> None:
        """Every device's running stats as before the pass (train-mode SpatialBN updates them)."""
        self.aux.restore(self._snapshot)

    def running(self) -> Any:
        return contextlib.nullcontext()

    def plan(self, batches: Optional[int]) -> None:
        """Nothing to prepare: the Caffe2 backend compiles nothing."""

    def step(self, feeds: Optional[Feeds]) -> int:
        """Feed, run and read every device's batch stats of every layer; return the samples."""
        if feeds is not None:
            self.aux.feed(feeds)
        self.aux.run_net()
        self.iteration += 1
        fetch = self.aux.workspace.FetchBlob
        samples = 0
        for index, (stats, blobs) in enumerate(zip(self.stats, self.aux.layers.values())):
            for b in blobs:
                mean, var, count = self._read_exact(b) if self.exact else self._read_kernel(b)
                stats.add_call(mean, var, count)
                if index == 0:
                    samples += int(fetch(b.shape)[0])
        return samples

    def _refuse(self, b: BNBlobs, bad: np.ndarray, what: str) -> None:
        raise NonFiniteStatsError(
            "Caffe2 BatchNorm layer {!r} on device {!r}: {} in channels {} at iteration {} of {}; no stats were "
            "fed and the running stats were restored".format(
                b.layer, b.device or "<unscoped>", what, np.flatnonzero(bad)[:5].tolist(), self.iteration,
                self.aux.opts.num_batches))

    def _read_kernel(self, b: BNBlobs) -> Tuple[torch.Tensor, torch.Tensor, int]:
        """The call's stats from the kernel's saved mean and inverse std."""
        fetch = self.aux.workspace.FetchBlob
        sm, siv, dims = fetch(b.sm), fetch(b.siv), fetch(b.shape).tolist()
        bad = ~(np.isfinite(sm) & np.isfinite(siv) & (siv > 0))
        if bad.any():
            self._refuse(b, bad, "non-finite saved mean or inverse std (Caffe2's CPU SpatialBN computes the variance "
                                 "as E[x^2]-E[x]^2 in float32, which falls below -epsilon when a channel's mean is "
                                 "large next to its std; exact=True measures the input instead. NaN/Inf inputs do "
                                 "the same)")
        mean, var, _ = decode_saved_stats(sm, siv, b.eps)
        return mean, var, math.prod(dims) // dims[b.channel_axis]

    def _read_exact(self, b: BNBlobs) -> Tuple[torch.Tensor, torch.Tensor, int]:
        """The call's stats measured from its shifted input blob in float64 (see
        :func:`measure_input`); the shift ``c`` the net subtracted is added back exactly."""
        fetch = self.aux.workspace.FetchBlob
        x, sm, c = fetch(b.x), fetch(b.sm), fetch(b.shift).reshape(-1)
        shift = np.where(np.isfinite(sm), sm, 0).astype(np.float32)
        size = shift_buffer_size(torch.from_numpy(x).movedim(b.channel_axis, 0))
        if self._buffer is None or self._buffer.numel() < size:
            self._buffer = torch.empty(size, dtype=torch.float64)
        mean, var, count = measure_input(x, shift, b.channel_axis, self._buffer)
        mean += torch.from_numpy(c.astype(np.float64))
        bad = ~torch.isfinite(mean + var).numpy()
        if bad.any():
            self._refuse(b, bad, "non-finite values in the input of the SpatialBN (blob {!r})".format(b.x))
        return mean, var, count

    untrusted_reason = "because Caffe2's float32 SpatialBN kernel computes E[x^2]-E[x]^2"

    def untrusted(self, stats: Sequence[PopulationStats]) -> List[List[int]]:
        """Channels whose kernel statistics cannot be trusted (:func:`untrusted_channels`);
        none on the exact path."""
        return [[] if self.exact else untrusted_channels(layer_stats) for layer_stats in stats]

    def collect(self) -> List[PopulationStats]:
        return self.stats

    def finish(self, results: Sequence[Optional[Stats]]) -> None:
        fed = [(b, result[0].numpy().astype(np.float32), result[1].numpy().astype(np.float32))
               for blobs, result in zip(self.aux.layers.values(), results) if result is not None for b in blobs]
        write(lambda: self.aux.restore(fed), lambda: self.aux.restore(self._snapshot))
