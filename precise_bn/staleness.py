"""Whether a model's stored BN statistics fit its data: the rule behind ``precise_bn.check``.

A channel's stored mean (variance) is *off* when it lies beyond the tolerance by more than
sampling explains (Student's t, the measured standard error counted for both sides), at a
family-wise level ``alpha`` over the model (Holm). A layer with a channel off is stale; a model
*fits* only when none is and every channel it varies was tested on :data:`MIN_CALLS` calls or
more, else it is *untested*. Derivation and measured rates: docs/check.md.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .errors import ConfigError
from .precision import t_tail
from .report import BNReport, LayerReport, counted, glossary, table

#: Default tolerance: the mean within 5% of the std, the variance within 10% of itself.
DEFAULT_TOLERANCE = (0.05, 0.1)
#: Default family-wise false-alarm level over every channel of the model.
DEFAULT_ALPHA = 0.01
#: The standard error of a difference between two estimates of similar precision: sqrt(2) times either's.
PAIRED = math.sqrt(2.0)
#: Calls a layer must run for a "fits": below 8 degrees of freedom t's far tails, where Holm's
#: thresholds lie, swallow large drifts (docs/check.md). Fewer can still show a layer stale.
MIN_CALLS = 9
STATISTICS = ("mean", "var")


@dataclass(frozen=True)
class Rule:
    """What counts as stale: ``tolerance`` ``(mean in std units, variance relative)`` and the
    family-wise false-alarm level ``alpha``; checked when built."""

    tolerance: Tuple[float, float] = DEFAULT_TOLERANCE
    alpha: float = DEFAULT_ALPHA

    def __post_init__(self) -> None:
        value = self.tolerance
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2 or not all(
                _real(v) and 0 <= v < math.inf for v in value):
            raise ConfigError("tolerance must be two numbers >= 0, (mean in std units, variance relative), "
                              "got {!r}".format(value))
        object.__setattr__(self, "tolerance", (float(value[0]), float(value[1])))
        if not (_real(self.alpha) and 0 < self.alpha < 1):
            raise ConfigError("alpha must be a number in (0, 1), got {!r}".format(self.alpha))
        object.__setattr__(self, "alpha", float(self.alpha))


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def holm(p: torch.Tensor) -> torch.Tensor:
    """Holm's step-down adjusted p-values of the 1-D ``p`` (rejected at ``alpha`` when at most it)."""
    m = p.numel()
    order = torch.argsort(p)
    scaled = (p[order] * torch.arange(m, 0, -1, dtype=p.dtype)).clamp(max=1.0)
    adjusted = torch.empty_like(p)
    adjusted[order] = torch.cummax(scaled, 0)[0] if m else scaled
    return adjusted


@dataclass
class Worst:
    """One channel's figures for one statistic: stored, measured, drift and its standard error
    (mean in std units, variance relative), tolerance, Holm-adjusted p-value."""

    channel: int
    statistic: str
    stored: float
    measured: float
    drift: float
    stderr: float
    tolerance: float
    p: float

    def describe(self) -> str:
        what, unit = ("mean", "std") if self.statistic == "mean" else ("variance", "relative")
        return ("channel {}'s {}: stored {:.6g}, measured {:.6g}: drift {:.3g} ({}), tolerance {:g}, standard "
                "error {:.2g}; p = {:.2g}").format(self.channel, what, self.stored, self.measured, self.drift, unit,
                                                   self.tolerance, self.stderr, self.p)


@dataclass
class LayerFit:
    """One layer's verdict. Per statistic (``"mean"``, ``"var"``), each channel's drift and its
    standard error in the tolerance's units, its p-value ``unadjusted`` and Holm-adjusted
    (``p``): NaN where the channel was not tested (see :data:`DEFINITIONS`), everywhere when the
    layer never ran."""

    layer: LayerReport
    drift: Dict[str, torch.Tensor]
    stderr: Dict[str, torch.Tensor]
    unadjusted: Dict[str, torch.Tensor]
    p: Dict[str, torch.Tensor]
    rule: Rule

    @property
    def name(self) -> str:
        return self.layer.name

    @property
    def tested(self) -> int:
        """Channels whose mean and variance were both tested."""
        return int(self._both_tested().sum())

    def _both_tested(self) -> torch.Tensor:
        return ~self.p["mean"].isnan() & ~self.p["var"].isnan()

    @property
    def untested(self) -> int:
        """Channels with a variance on the data that were not tested on both statistics, all of
        them when the layer ran fewer than :data:`MIN_CALLS` calls; 0 when it never ran."""
        if not self.layer.ran:
            return 0
        assert self.layer.new_var is not None
        varies = self.layer.new_var > 0
        if self.layer.calls >= MIN_CALLS:
            varies &= ~self._both_tested()
        return int(varies.sum())

    def off(self, statistic: str) -> List[int]:
        """Channels whose ``statistic`` (``"mean"`` or ``"var"``) is off."""
        return (self.p[statistic] <= self.rule.alpha).nonzero().reshape(-1).tolist()

    @property
    def stale(self) -> bool:
        return bool(self.off("mean") or self.off("var"))

    @property
    def verdict(self) -> str:
        if not self.layer.ran:
            return "never ran"
        return "stale" if self.stale else ("untested" if self.untested else "fits")

    def untested_by_reason(self) -> Dict[str, int]:
        """:attr:`untested` channels per reason: ``"calls"``, a flag of
        :data:`~precise_bn.precision.FLAGS`, or ``"zero"`` (a standard error of 0)."""
        if not self.untested:
            return {}
        if self.layer.calls < MIN_CALLS:
            return {"calls": self.untested}
        assert self.layer.new_var is not None
        left = (self.layer.new_var > 0) & ~self._both_tested()
        out: Dict[str, int] = {}
        for reason, channels in self.layer.se_reasons.items():
            out[reason] = int(left[channels].sum())
            left[channels] = False
        out["zero"] = int(left.sum())
        return {reason: count for reason, count in out.items() if count}

    def smallest_p(self, statistic: str) -> Optional[float]:
        p = self.p[statistic][~self.p[statistic].isnan()]
        return float(p.min()) if p.numel() else None

    @property
    def worst(self) -> Optional[Worst]:
        """The channel and statistic of smallest adjusted p-value (then largest drift); None if none."""
        p = torch.stack([self.p[key] for key in STATISTICS])
        if not p.numel() or bool(p.isnan().all()):
            return None
        p = torch.where(p.isnan(), torch.full_like(p, math.inf), p)
        drift = torch.stack([self.drift[key] for key in STATISTICS])
        excess = torch.where(drift.isinf(), drift, drift / torch.stack([self.stderr[key] for key in STATISTICS]))
        excess = torch.where(p == p.min(), excess, torch.full_like(excess, -math.inf))
        index, channel = divmod(int(excess.argmax()), p.shape[1])
        stored, measured = (self.layer.old_mean, self.layer.new_mean) if index == 0 else \
            (self.layer.old_var, self.layer.new_var)
        assert measured is not None
        key = STATISTICS[index]
        return Worst(channel, key, float(stored[channel]), float(measured[channel]), float(self.drift[key][channel]),
                     float(self.stderr[key][channel]), self.rule.tolerance[index], float(p[index, channel]))

    def to_dict(self) -> Dict[str, Any]:
        worst = self.worst
        return {"name": self.name, "verdict": self.verdict, "channels": int(self.layer.old_mean.numel()),
                "tested": self.tested, "untested": self.untested, "mean_drift": self.layer.mean_drift,
                "var_drift": self.layer.var_drift,
                "mean_p": self.smallest_p("mean"), "var_p": self.smallest_p("var"),
                "mean_off": self.off("mean"), "var_off": self.off("var"),
                "worst": None if worst is None else vars(worst)}


Tests = Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor], Dict[str, torch.Tensor]]


def _interval_p(estimate: torch.Tensor, low: float, high: float, se: torch.Tensor, dof: torch.Tensor) -> torch.Tensor:
    """The p-value of "the true value lies in [low, high]": beyond either edge, from the nearest."""
    outside = torch.max(estimate - high, low - estimate) / se
    return (t_tail(outside, dof) + t_tail(outside + (high - low) / se, dof)).clamp(max=1.0)


def _tests(layer: LayerReport, rule: Rule) -> Tests:
    """Per statistic, each channel's drift and standard error in the tolerance's units and its
    p-value before Holm's adjustment (NaN where it cannot be tested, see :data:`DEFINITIONS`).

    The mean is tested on its offset in std units; the variance on the log of its ratio
    ``(stored + eps) / (measured + eps)`` (the relative drift is that ratio minus 1), whose
    Student's t is far closer to the truth than the ratio's own for skewed per-call variances."""
    if not layer.ran:
        nan = torch.full(layer.old_mean.shape, math.nan, dtype=torch.float64)
        return {key: nan for key in STATISTICS}, {key: nan for key in STATISTICS}, {key: nan for key in STATISTICS}
    assert layer.new_mean is not None and layer.new_var is not None
    assert layer.mean_stderr is not None and layer.var_stderr is not None
    scale = layer.new_var + layer.eps
    stored = layer.old_var + layer.eps
    offset = (layer.old_mean - layer.new_mean) / scale.sqrt()
    inf = torch.full_like(scale, math.inf)  # a stored NaN or inf, or a negative variance, is off
    ok = {"mean": torch.isfinite(layer.old_mean), "var": torch.isfinite(layer.old_var) & (stored > 0)}
    estimates = {"mean": torch.where(ok["mean"], offset, inf),
                 "var": torch.where(ok["var"], (stored / scale).log(), inf)}
    drift = {"mean": torch.where(ok["mean"], offset.abs(), inf),
             "var": torch.where(ok["var"], (stored / scale - 1).abs(), inf)}
    stderr = {"mean": PAIRED * layer.mean_stderr / scale.sqrt(), "var": PAIRED * layer.var_stderr / scale}
    mean_tol, var_tol = rule.tolerance
    bounds = {"mean": (-mean_tol, mean_tol), "var": (math.log1p(-var_tol) if var_tol < 1 else -math.inf,
                                                     math.log1p(var_tol))}
    dof = torch.tensor(float(layer.calls - 1), dtype=torch.float64)
    trusted = layer.new_var > 0
    trusted[layer.se_untrusted] = False
    raw = {}
    for key in STATISTICS:
        tested = trusted & (stderr[key] > 0)  # False for NaN (a single call)
        raw[key] = torch.full_like(scale, math.nan)
        raw[key][tested] = _interval_p(estimates[key][tested], *bounds[key], stderr[key][tested], dof)
        raw[key][~ok[key]] = 0.0  # whatever the data: no sample explains it
    return drift, stderr, raw


@dataclass
class CheckReport:
    """What :func:`precise_bn.check` found: ``verdict`` (``"fits"``, ``"stale"`` or
    ``"untested"``: no verdict, too little data), ``stale`` the layers whose stored statistics do
    not fit, ``untested`` the channels per layer the data could not vouch for; ``layers`` holds
    each layer's verdict, ``measured`` the measurement (a :class:`~precise_bn.BNReport`:
    ``old_*`` stored, ``new_*`` measured). ``tests`` counts the tests Holm's procedure was run
    over. Gate on ``report.fits``: ``not report.stale`` also holds when nothing could be tested."""

    layers: List[LayerFit]
    measured: BNReport
    rule: Rule
    tests: int

    @property
    def stale(self) -> List[str]:
        return [fit.name for fit in self.layers if fit.stale]

    @property
    def untested(self) -> Dict[str, int]:
        """Per layer that has any, how many channels the data could not vouch for (:attr:`LayerFit.untested`)."""
        return {fit.name: fit.untested for fit in self.layers if fit.untested}

    @property
    def verdict(self) -> str:
        """``"stale"`` when a layer is stale (recomputing fixes every channel alike), else
        ``"untested"`` when a channel could not be tested (no verdict), else ``"fits"``."""
        return "stale" if self.stale else ("untested" if self.untested else "fits")

    @property
    def fits(self) -> bool:
        """True only when the verdict is ``"fits"``."""
        return self.verdict == "fits"

    def batches_needed(self) -> int:
        """The fewest batches that give every untested layer :data:`MIN_CALLS` calls (at least this run's)."""
        read = self.measured.batches
        return max([read] + [-(-MIN_CALLS * read // fit.layer.calls) for fit in self.layers
                             if fit.untested and fit.layer.calls < MIN_CALLS])

    def __getitem__(self, name: str) -> LayerFit:
        for fit in self.layers:
            if fit.name == name:
                return fit
        raise KeyError(name)

    def __len__(self) -> int:
        return len(self.layers)

    def to_dict(self) -> Dict[str, Any]:
        return {"verdict": self.verdict, "stale": self.stale, "untested": self.untested, "min_calls": MIN_CALLS,
                "tolerance": {"mean": self.rule.tolerance[0], "var": self.rule.tolerance[1]},
                "alpha": self.rule.alpha, "tests": self.tests, "definitions": dict(DEFINITIONS),
                "layers": [fit.to_dict() for fit in self.layers], "measurement": self.measured.to_dict(True)}

    def summary(self) -> str:
        m, stale, untested = self.measured, self.stale, self.untested
        verdict = "{} stale: {}".format(len(stale), ", ".join(stale)) if stale else "every layer fits"
        if untested and not stale:
            verdict = "no verdict: {} untested in {}".format(counted(sum(untested.values()), "channel"),
                                                            counted(len(untested), "layer"))
        return ("precise-bn check: {} BatchNorm layer{}, {} batch{} ({} samples), world size {}; tolerance: mean "
                "{:g} std, variance {:g} relative; alpha {:g} over {} tests (Holm); {}").format(
            len(self.layers), "" if len(self.layers) == 1 else "s", m.batches, "" if m.batches == 1 else "es",
            m.samples, m.world_size, self.rule.tolerance[0], self.rule.tolerance[1], self.rule.alpha, self.tests,
            verdict)

    def __str__(self) -> str:
        rows: List[Sequence[str]] = [["layer", "channels", "mean drift", "mean p", "var drift", "var p", "verdict"]]
        for fit in self.layers:
            rows.append([fit.name, "{}/{}".format(fit.tested, fit.layer.old_mean.numel()),
                         "{:.4g}".format(fit.layer.mean_drift), _p_cell(fit.smallest_p("mean")),
                         "{:.4g}".format(fit.layer.var_drift), _p_cell(fit.smallest_p("var")), fit.verdict])
        notes = [("channels", "channels_tested"), ("mean drift", "mean_drift"), ("var drift", "var_drift"),
                 ("mean p, var p", "p")]
        return "\n".join([self.summary(), table(rows), glossary([(title, DEFINITIONS[key]) for title, key in notes])])


def _p_cell(value: Optional[float]) -> str:
    return "-" if value is None else "{:.2g}".format(value)


#: What the check's numbers mean; printed under its table and in its JSON report.
DEFINITIONS = {
    "channels_tested": "channels tested / channels: a channel is tested when its layer ran at least 2 calls and "
                       "it has a variance on the data and standard errors that are not zero and can be trusted "
                       "(not se_untrusted); a layer is untested (no verdict, not a pass) when a channel with a "
                       "variance is not tested, or its layer ran fewer than {} calls".format(MIN_CALLS),
    "mean_drift": "largest |stored mean - measured mean| / sqrt(measured var + eps) over the layer's channels",
    "var_drift": "largest |stored var - measured var| / (measured var + eps) over the layer's channels",
    "p": "smallest over the layer's channels of the Holm-adjusted p-value of \"the true drift is within the "
         "tolerance\" (Student's t, the measured standard error counted for both sides); the layer is stale when "
         "it is at most alpha",
}


def judge(measured: BNReport, rule: Rule) -> CheckReport:
    """The verdict of ``rule`` on a measurement whose old statistics are the stored ones."""
    tests = [_tests(layer, rule) for layer in measured.layers]
    raw = [p[key] for _, _, p in tests for key in STATISTICS]
    flat = torch.cat(raw) if raw else torch.zeros(0, dtype=torch.float64)
    tested = ~flat.isnan()
    adjusted = flat.clone()
    adjusted[tested] = holm(flat[tested])
    pieces = iter(adjusted.split([p.numel() for p in raw]))
    fits = [LayerFit(layer, drift, stderr, unadjusted, {key: next(pieces) for key in STATISTICS}, rule)
            for layer, (drift, stderr, unadjusted) in zip(measured.layers, tests)]
    return CheckReport(fits, measured, rule, int(tested.sum()))
