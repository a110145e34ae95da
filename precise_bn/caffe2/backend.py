"""The Caffe2 backend: run the aux net, measure every device's SpatialBN inputs in float64 (never
Caffe2's float32 statistics), feed every device the same merged result (docs/caffe2.md)."""
from __future__ import annotations

import contextlib
import itertools
import logging
import math
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..buffers import Stats
from ..data import CyclingBatches
from ..driver import recalibrate
from ..errors import ConfigError, LayerError, NonFiniteStatsError
from ..estimator import PopulationStats, combine_calls
from ..options import Options
from ..report import BNReport
from ..signals import all_or_nothing, write
from .net import BNBlobs, device_option, devices_of_net, find_bn_layers, forward_only_net, import_caffe2
from .stats import CHUNK, measure_input

logger = logging.getLogger("precise_bn")

Feeds = Dict[str, np.ndarray]
Caffe2Cache = Dict[str, Tuple[np.ndarray, np.ndarray]]

class Caffe2AuxModel:
    """The Caffe2 aux net of ``model`` (a ``ModelHelper``, net, ``NetDef`` or a callable building
    one, parameters in the workspace), ``data`` (``{blob: ndarray}`` feeds, or None for reader
    ops) fed before each run; a ``bn_epsilon`` setting other than a layer's own is warned of."""

    def __init__(self, model: Any, data: Optional[Iterable[Feeds]], settings: Dict[str, Any], opts: Options):
        _, self.workspace, caffe2_pb2 = import_caffe2()
        self._cpu = caffe2_pb2.CPU
        self.opts = opts
        self.batches: Iterator[Any] = CyclingBatches(data) if data is not None else itertools.repeat(None)
        self.net = forward_only_net(model)
        self.devices = devices_of_net(self.net, settings)
        self.layers = find_bn_layers(self.net, self.devices)
        self._check_epsilon(float(settings["bn_epsilon"]))
        self._check_params()
        self._feed_options = self._consumer_options()
        self._created = False
        logger.info("precise-bn (caffe2): aux net %r with %d ops, %d BatchNorm layers on %d device(s)",
                    self.net.name, len(self.net.op), len(self.layers), len(self.devices))

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

    def fetch_input(self, b: BNBlobs) -> np.ndarray:
        """``b``'s SpatialBN input after a run: the blob itself on the CPU (until the next run), else a copy."""
        if b.option.device_type == self._cpu:
            return self.workspace.C.Workspace.current.create_blob(b.x).as_tensor().data
        return self.workspace.FetchBlob(b.x)

    def snapshot(self) -> List[Tuple[BNBlobs, np.ndarray, np.ndarray]]:
        return [(b, self.workspace.FetchBlob(b.rm), self.workspace.FetchBlob(b.riv))
                for blobs in self.layers.values() for b in blobs]

    def restore(self, snapshot: Sequence[Tuple[BNBlobs, np.ndarray, np.ndarray]]) -> None:
        for b, rm, riv in snapshot:
            self.workspace.FeedBlob(b.rm, rm, device_option=b.option)
            self.workspace.FeedBlob(b.riv, riv, device_option=b.option)

    def run(self, store: Callable[[Caffe2Cache, BNReport], None]) -> BNReport:
        """Recompute and feed the stats; ``store(cache, report)`` keeps what was fed."""
        report = recalibrate(_Caffe2Pass(self), self.batches, self.opts)
        store({layer.name: (layer.new_mean.numpy().astype(np.float32), layer.new_var.numpy().astype(np.float32))
               for layer in report.layers if layer.ran}, report)
        return report

    @all_or_nothing
    def apply(self, cache: Caffe2Cache) -> None:
        """Feed cached ``(rm, riv)`` to every device of each layer as one :func:`~precise_bn.signals.write`."""
        snapshot = self.snapshot()
        fed = [(b, mean, var) for name, (mean, var) in cache.items() for b in self.layers[name]]
        write(lambda: self.restore(fed), lambda: self.restore(snapshot))


class _Caffe2Pass:
    """One pass of the driver over a :class:`Caffe2AuxModel` (see :class:`precise_bn.driver.Backend`)."""

    empty_reason = "the net has no SpatialBN layer"
    label = "precise-bn (caffe2)"
    kind = "caffe2"
    budget_name = "iters"
    not_recomputed: Sequence[str] = ()
    changed_buffers: Sequence[str] = ()
    changed_parameters: Sequence[str] = ()

    def __init__(self, aux: Caffe2AuxModel):
        self.aux = aux
        self.names = list(aux.layers)
        self.eps = [blobs[0].eps for blobs in aux.layers.values()]
        self.dtypes = [torch.float32] * len(self.names)
        fetch = aux.workspace.FetchBlob
        self.stats = [PopulationStats(fetch(blobs[0].rm).size, name=name) for name, blobs in aux.layers.items()]
        self._rows = max(32, len(aux.devices))
        self._calls = [_Calls(stats, self._rows) for stats in self.stats]
        self._buffer = np.empty(CHUNK)
        self.iteration = 0
        self._snapshot: Optional[List[Tuple[BNBlobs, np.ndarray, np.ndarray]]] = None

    def choose(self) -> None:
        """Every SpatialBN layer of the net: keep their running stats as they are now."""
        self._snapshot = self.aux.snapshot()

    def prepare(self, batches: Optional[int]) -> List[Stats]:
        """The running stats :meth:`choose` kept: nothing else to prepare."""
        assert self._snapshot is not None
        first = {b.layer: (rm, riv) for b, rm, riv in self._snapshot if b.device == self.aux.devices[0]}
        return [(torch.from_numpy(first[name][0].astype(np.float64)).reshape(-1),
                 torch.from_numpy(first[name][1].astype(np.float64)).reshape(-1)) for name in self.names]

    def restore(self) -> None:
        """Every device's running stats as before the pass (train-mode SpatialBN updates them)."""
        if self._snapshot is not None:
            self.aux.restore(self._snapshot)

    def running(self) -> Any:
        return contextlib.nullcontext()

    def step(self, feeds: Optional[Feeds]) -> int:
        """Feed and run the net, measure every device's input of every layer; return the samples."""
        if feeds is not None:
            self.aux.feed(feeds)
        self.aux.run_net()
        self.iteration += 1
        if max(len(calls.counts) for calls in self._calls) + len(self.aux.devices) > self._rows:
            self.collect()
        samples = 0
        for index, (calls, blobs) in enumerate(zip(self._calls, self.aux.layers.values())):
            for b in blobs:
                x = self.aux.fetch_input(b)
                mean, var = calls.row()
                count = measure_input(x, b.channel_axis, (mean, var), self._buffer)
                if not math.isfinite(float(var.sum())):  # NaN or Inf anywhere in x makes var NaN
                    self._refuse(b, var)
                calls.add(count)
                if index == 0:
                    samples += x.shape[0]
        return samples

    def _refuse(self, b: BNBlobs, var: np.ndarray) -> None:
        """Raise for a non-finite input, naming the layers before it whose kernel cancelled (NaN out)."""
        fetch = self.aux.workspace.FetchBlob
        before = self.names[:self.names.index(b.layer)]
        cancelled = [name for name in before for a in self.aux.layers[name]
                     if a.device == b.device and not _kernel_finite(fetch(a.siv))]
        raise NonFiniteStatsError(
            "Caffe2 BatchNorm layer {!r} on device {!r}: NaN or Inf in its input (blob {!r}) in channels {} at "
            "iteration {} of {}; no stats were fed and the running stats were restored{}".format(
                b.layer, b.device or "<unscoped>", b.x, np.flatnonzero(~np.isfinite(var))[:5].tolist(),
                self.iteration, self.aux.opts.num_batches, _cancelled_text(cancelled)))

    def collect(self) -> List[PopulationStats]:
        """Merge the pending calls, layers of equal element counts through one ``combine_calls``."""
        groups: Dict[Tuple[int, ...], List[_Calls]] = {}
        for calls in self._calls:
            if calls.counts:
                groups.setdefault(tuple(calls.counts), []).append(calls)
        for counts, members in groups.items():
            means, variances = (torch.cat([calls.block[i, :len(counts)] for calls in members], dim=1) for i in (0, 1))
            center = torch.cat([calls.stats.center_for(calls.block[0, 0]) for calls in members])
            combined = combine_calls(means, variances, list(counts), center)
            for calls, part in zip(members, combined.split([calls.stats.num_channels for calls in members])):
                calls.stats.add(part)
                calls.counts = []
        return self.stats

    def write(self, results: Sequence[Optional[Stats]], report: BNReport) -> None:
        """Feed every device the results rounded to nearest float32 (old stats where none)."""
        fed = [(b, result[0].numpy().astype(np.float32), result[1].numpy().astype(np.float32))
               for blobs, result in zip(self.aux.layers.values(), results) if result is not None for b in blobs]

        def change() -> None:
            self.restore()
            self.aux.restore(fed)

        write(change, self.restore)


def _kernel_finite(siv: np.ndarray) -> bool:
    return bool(np.all(np.isfinite(siv) & (siv > 0)))


def _cancelled_text(layers: Sequence[str]) -> str:
    if not layers:
        return ""
    return (". Before it, Caffe2's float32 SpatialBN kernel of {} cancelled (it computes E[x^2]-E[x]^2, which "
            "falls below -epsilon when a channel's mean is large next to its std) and output NaN; the training "
            "net's kernel does the same on this data: bring that layer's input closer to zero mean".format(
                ", ".join(repr(name) for name in layers)))


class _Calls:
    """A layer's calls not merged yet: their float64 means and variances, one row each."""

    def __init__(self, stats: PopulationStats, rows: int):
        self.stats = stats
        self.block = torch.empty(2, rows, stats.num_channels, dtype=torch.float64)
        self.values = self.block.numpy()
        self.counts: List[int] = []

    def row(self) -> Tuple[np.ndarray, np.ndarray]:
        """Where the next call's mean and variance go."""
        k = len(self.counts)
        return self.values[0, k], self.values[1, k]

    def add(self, count: int) -> None:
        """Keep the row just written, for ``count`` elements per channel (nothing kept for 0)."""
        if count:
            self.counts.append(count)
