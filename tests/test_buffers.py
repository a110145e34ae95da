"""What a buffer's dtype holds (``precise_bn.buffers``): float64 results rounded to nearest in
bfloat16 and float16 against an exact rational reference, and underflow said out loud."""
from __future__ import annotations

import math
import random
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch
from torch import nn

from precise_bn import recompute
from precise_bn.buffers import round_to
from precise_bn.errors import PreciseBNWarning

#: (significand bits, smallest normal exponent) of each format.
FORMATS = {torch.bfloat16: (8, -126), torch.float16: (11, -14), torch.float32: (24, -126)}


def nearest(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to nearest, ties to even, in ``dtype``'s grid, in exact rationals."""
    bits, emin = FORMATS[dtype]
    if value == 0:
        return value
    exact = Fraction(value)
    exponent = max(math.frexp(abs(value))[1] - 1, emin)  # |value| in [2**exponent, 2**(exponent+1))
    spacing = Fraction(2) ** (exponent - bits + 1)
    low = math.floor(exact / spacing)
    below, above = exact - low * spacing, (low + 1) * spacing - exact
    steps = low if below < above or (below == above and low % 2 == 0) else low + 1
    return float(steps * spacing)


def _values(dtype, count=4000, seed=0):
    """Random magnitudes, and values a hair off the midpoint of two neighbours of ``dtype``,
    where rounding through float32 first lands exactly on the midpoint."""
    rng = random.Random(seed)
    bits, emin = FORMATS[dtype]
    top = 120 if dtype == torch.bfloat16 else 15
    out = [rng.uniform(-1, 1) * 2.0 ** rng.randint(emin - bits, top) for _ in range(count)]
    for _ in range(count):
        exponent = rng.randint(emin, top)
        spacing = 2.0 ** (exponent - bits + 1)
        low = 2.0 ** exponent + rng.randrange(2 ** (bits - 1)) * spacing
        hair = rng.choice((1, -1)) * spacing * 2.0 ** -rng.randint(18, 40)
        out += [low + spacing / 2, low + spacing / 2 + hair]
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_round_to_is_round_to_nearest_even_where_torch_rounds_twice(dtype):
    values = _values(dtype)
    want = torch.tensor([nearest(v, dtype) for v in values.tolist()], dtype=torch.float64)
    got = round_to(values, dtype)
    assert got.dtype == dtype
    assert torch.equal(got.double(), want)
    naive = values.to(dtype).double()
    assert int((naive != want).sum()) > 100  # double rounding: what round_to is for
    if dtype == torch.float16:  # numpy converts float64 to float16 directly, another reference
        assert torch.equal(got.double(), torch.from_numpy(values.numpy().astype(np.float16).astype(np.float64)))


def test_round_to_float32_and_float64_is_the_plain_conversion():
    values = _values(torch.float32)
    assert torch.equal(round_to(values, torch.float32).double(),
                       torch.tensor([nearest(v, torch.float32) for v in values.tolist()], dtype=torch.float64))
    assert torch.equal(round_to(values, torch.float64), values)


def _tiny_bn(std, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 3, 4, 4, generator=gen, dtype=torch.float64) * std).to(dtype) for _ in range(3)]
    for x in data:
        x[:, 2] = 0  # a dead channel: exactly 0, never a warning
    return nn.Sequential(nn.BatchNorm2d(3)).to(dtype), data


def test_a_variance_that_underflows_the_buffer_is_said_and_written_rounded():
    model, data = _tiny_bn(1e-25)  # variance about 1e-50: below float32's smallest subnormal
    with pytest.warns(PreciseBNWarning, match=r"layer '0': the variance of 2 channel\(s\) \(first: channel 0, "
                                              r"[0-9.]+e-5[01]\) is below the smallest normal float32 .* "
                                              r"written as 0, keeping no relative precision"):
        report = recompute(model, data, progress=False)
    assert model[0].running_var.tolist() == [0.0, 0.0, 0.0] and report["0"].new_var[0] > 0

    model, data = _tiny_bn(1e-20)  # variance about 1e-40: a float32 subnormal
    with pytest.warns(PreciseBNWarning, match="variance of 2 channel") as caught:
        report = recompute(model, data, progress=False)
    assert len([w for w in caught if "below the smallest normal" in str(w.message)]) == 1
    subnormal = model[0].running_var[:2].double()
    assert ((subnormal > 0) & (subnormal < torch.finfo(torch.float32).tiny)).all()
    assert torch.equal(model[0].running_var, round_to(report["0"].new_var, torch.float32))


@pytest.mark.main_env  # torch 1.10 has no CPU batch_norm for float16
def test_ordinary_small_statistics_and_dead_channels_draw_no_warning():
    model, data = _tiny_bn(1e-3, torch.float16)  # variance 1e-6: a float16 subnormal...
    with pytest.warns(PreciseBNWarning, match="smallest normal float16"):
        recompute(model, data, progress=False)
    model, data = _tiny_bn(1e-1, torch.float16)  # ...1e-2 is not
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recompute(model, data, progress=False)
