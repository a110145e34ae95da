"""Per-layer population statistics, accumulated exactly in float64.

Why this shape of estimator:

* ``E[x^2] - E[x]^2`` in float32 (fvcore, the original Caffe2 helper) cancels catastrophically
  when a channel's mean is large next to its std: with mean/std = 1e4 the two terms agree in
  all 8 significant digits float32 has, and the variance comes out as noise, often negative.
  We keep instead, per channel, the element count ``n``, the mean and ``M2 = sum (x - mean)^2``,
  all in float64, and merge batches with Chan et al.'s parallel formula::

      delta = mean_b - mean_a
      mean  = mean_a + delta * n_b / n
      M2    = M2_a + M2_b + delta^2 * n_a * n_b / n

  Every term is non-negative, so ``M2`` can never go below zero, and no large numbers are
  subtracted from each other.
* Weighting by the true element count ``n`` (batch x spatial positions, per call) instead of
  averaging per-batch variances makes ragged batches, reused layers and uneven ranks exact;
  the plain average of per-batch *unbiased* variances (swa_utils, pycls) is biased whenever
  batches differ in size and always ignores the spread of the batch means.
* The result is the *biased* variance of every element seen, which is what BatchNorm divides
  by at inference. ``finalize(unbiased=True)`` gives ``M2 / (n - 1)`` for those who want it.

This module knows nothing of modules, hooks or processes: it only merges numbers.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Union

import torch

from .errors import NonFiniteStatsError

Number = Union[int, float]

# float32 carries 24 significant bits: a saved inverse std is only known to 2**-24 relative.
_FLOAT32_REL = 2.0 ** -24


def combine_calls(
    means: torch.Tensor, variances: torch.Tensor, counts: Sequence[int], unbiased: bool = False
) -> Tuple[int, torch.Tensor, torch.Tensor]:
    """Combine k calls into ``(count, mean, M2)`` per channel, ready for
    :meth:`PopulationStats.add_moments`.

    ``means`` and ``variances`` are float64 ``(k, C)`` work buffers, **overwritten** here;
    ``counts`` holds the k (positive) element counts; ``unbiased`` says the variances carry
    Bessel's correction. The calls are combined exactly around their own weighted mean
    (``M2 = sum M2_i + sum n_i (mean_i - mean)^2``, every term non-negative): thirteen
    operators for the k calls instead of four per call, and no temporary of the block's size
    (on a CPU, each fresh megabyte costs page faults).
    """
    total = sum(counts)
    weights = torch.tensor(counts, dtype=torch.float64, device=means.device)
    mean = torch.matmul(weights, means).div_(total)
    m2 = torch.matmul(weights - 1.0 if unbiased else weights, variances)
    deviation = means.sub_(mean)
    m2.add_(torch.matmul(weights, deviation.mul_(deviation)))
    return total, mean, m2


class PopulationStats:
    """Running (count, mean, M2) per channel of one BN layer, in float64.

    ``count`` is a Python int (elements per channel: batch size times spatial positions, summed
    over calls), so it stays exact and reading it never synchronises a GPU.
    """

    def __init__(self, num_channels: int, name: str = "", device: Optional[torch.device] = None):
        self.name = name
        self.num_channels = int(num_channels)
        self.count = 0
        self.calls = 0
        self.clamped = 0
        self.mean = torch.zeros(self.num_channels, dtype=torch.float64, device=device)
        self.m2 = torch.zeros(self.num_channels, dtype=torch.float64, device=device)

    @property
    def device(self) -> torch.device:
        return self.mean.device

    def __repr__(self) -> str:
        return "PopulationStats(name={!r}, channels={}, count={}, calls={})".format(
            self.name, self.num_channels, self.count, self.calls
        )

    def add_batch(
        self, mean: torch.Tensor, var: torch.Tensor, count: int, unbiased: bool = False
    ) -> None:
        """Add one call's per-channel statistics over ``count`` elements per channel.

        ``var`` is the biased batch variance, or with ``unbiased=True`` the Bessel-corrected one
        that PyTorch stores in ``running_var`` after a train-mode call; it is turned back into
        the sum of squared deviations exactly: ``M2_b = var * (count - 1)``.
        """
        if count <= 0:
            return
        scale = float(count - 1) if unbiased else float(count)
        self._merge_moments(count, mean, var, scale, calls=1)

    def add_caffe2(self, sm, siv, eps: float, count: int) -> None:
        """Add one Caffe2 SpatialBN call: saved mean ``sm`` and saved inverse std ``siv``.

        Caffe2 saves ``siv = 1 / sqrt(var + eps)`` in float32, so ``var = 1 / siv^2 - eps`` is
        recovered in float64. Anything below the resolution of a float32 ``siv`` (two float32
        ulps of ``var + eps``) cannot be told apart from zero: a dead channel comes back as
        exactly 0 instead of a tiny signed residue, and a negative value is clamped and
        counted in ``clamped``.
        """
        if count <= 0:
            return
        sm = torch.as_tensor(sm).to(self.device, torch.float64).reshape(-1)
        siv = torch.as_tensor(siv).to(self.device, torch.float64).reshape(-1)
        var_eps = 1.0 / (siv * siv)
        var = var_eps - float(eps)
        resolution = var_eps * (4.0 * _FLOAT32_REL)
        self.clamped += int((var < 0).sum().item())
        var = torch.where(var < resolution, torch.zeros_like(var), var)
        self._merge_moments(count, sm, var, float(count), calls=1)

    def add_moments(self, count: int, mean: torch.Tensor, m2: torch.Tensor, calls: int = 1) -> None:
        """Add a group of ``calls`` calls with ``count`` elements per channel, already combined
        into float64 ``mean`` and ``M2`` (see :func:`combine_calls`)."""
        self._merge_moments(count, mean, m2, 1.0, calls=calls)

    def merge(self, other: "PopulationStats") -> None:
        """Merge another estimator of the same layer (another device, rank or pass)."""
        if other.num_channels != self.num_channels:
            raise ValueError(
                "cannot merge {} channels of {!r} into {} channels of {!r}".format(
                    other.num_channels, other.name, self.num_channels, self.name
                )
            )
        self.clamped += other.clamped
        if other.count == 0:
            self.calls += other.calls
            return
        self._merge_moments(other.count, other.mean, other.m2, 1.0, calls=other.calls)

    def _merge_moments(
        self, n_b: int, mean_b: torch.Tensor, m2_like: torch.Tensor, m2_scale: float, calls: int
    ) -> None:
        """Chan's merge of a group with ``n_b`` elements, mean ``mean_b``, M2 = m2_like*scale.

        Called once per BN call, so it issues four kernels and no conversion copies: an op
        mixing float32 inputs with the float64 state computes in float64 (type promotion).
        """
        if mean_b.device != self.device:
            mean_b, m2_like = mean_b.to(self.device), m2_like.to(self.device)
        if mean_b.dim() != 1:
            mean_b, m2_like = mean_b.reshape(-1), m2_like.reshape(-1)
        n_a = self.count
        n = n_a + n_b
        if n_a == 0:
            self.mean.copy_(mean_b)
            self.m2.copy_(m2_like).mul_(m2_scale)
        else:
            delta = torch.sub(mean_b, self.mean)
            self.mean.add_(delta, alpha=n_b / n)
            self.m2.add_(m2_like, alpha=m2_scale).addcmul_(delta, delta, value=n_a * n_b / n)
        self.count = n
        self.calls += calls

    def finalize(self, unbiased: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
        """Return float64 ``(mean, var)``: the biased population variance ``M2 / n`` by default.

        Raises NonFiniteStatsError (naming the layer) when any channel is NaN or Inf, which
        happens only when the data or the network produced non-finite activations.
        """
        if self.count == 0:
            raise ValueError("layer {!r} saw no element; nothing to finalize".format(self.name))
        # NaN and Inf propagate through a sum, so one reduction screens every channel; only a
        # non-finite (or overflowing) total pays for the per-channel search.
        if not math.isfinite(float(self.mean.sum() + self.m2.sum())):
            self._raise_if_non_finite()
        denom = self.count - 1 if unbiased and self.count > 1 else self.count
        return self.mean.clone(), self.m2 / float(denom)

    def _raise_if_non_finite(self) -> None:
        bad = ~(torch.isfinite(self.mean) & torch.isfinite(self.m2))
        if bool(bad.any()):
            channels = bad.nonzero().reshape(-1).tolist()
            raise NonFiniteStatsError(
                "BatchNorm layer {!r}: non-finite statistics in {} of {} channels (first: {}) "
                "after {} calls; a batch or an activation contains NaN or Inf".format(
                    self.name, len(channels), self.num_channels, channels[:5], self.calls
                )
            )

    def state(self) -> torch.Tensor:
        """Pack ``[count, mean..., M2...]`` in one float64 vector (for collectives)."""
        head = torch.tensor([float(self.count)], dtype=torch.float64, device=self.device)
        return torch.cat([head, self.mean, self.m2])

    @classmethod
    def from_state(
        cls, packed: torch.Tensor, name: str = "", calls: int = 0
    ) -> "PopulationStats":
        """Inverse of :meth:`state`."""
        channels = (packed.numel() - 1) // 2
        stats = cls(channels, name=name, device=packed.device)
        stats.count = int(packed[0].item())
        stats.mean.copy_(packed[1 : 1 + channels])
        stats.m2.copy_(packed[1 + channels :])
        stats.calls = calls
        return stats
