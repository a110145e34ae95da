"""What a BN buffer's dtype holds: float64 results rounded to nearest (to bfloat16 and float16
through float32 rounded *to odd*, so never twice: docs/numerics.md), overflow refused,
underflow said."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from .aoti import dtype_name
from .errors import NonFiniteStatsError, warn

Stats = Tuple[torch.Tensor, torch.Tensor]


def round_to(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float64 ``values`` rounded to nearest (ties to even) in ``dtype``."""
    if dtype in (torch.float64, torch.float32) or not values.is_floating_point():
        return values.to(dtype)
    values = values.double()
    single = values.float()
    bits = single.view(torch.int32)
    # Truncate: where float32 rounded away from zero, step one unit back towards it.
    bits = bits - (single.double().abs() > values.abs()).to(torch.int32)
    bits = bits | (bits.view(torch.float32).double() != values).to(torch.int32)
    return bits.view(torch.float32).to(dtype)


def check_fits(names: Sequence[str], results: Sequence[Optional[Stats]], dtypes: Sequence[torch.dtype]) -> None:
    """Before anything is written: :class:`~precise_bn.NonFiniteStatsError` for a layer whose
    statistics overflow its buffers' dtype, and a :class:`~precise_bn.PreciseBNWarning` per layer
    whose nonzero statistics fall below the dtype's smallest normal (no relative precision left)."""
    for name, result, dtype in zip(names, results, dtypes):
        if result is None:
            continue
        info = torch.finfo(dtype)
        magnitudes = torch.cat([result[0].abs(), result[1]])
        largest = float(magnitudes.max())
        if largest > info.max:
            raise NonFiniteStatsError(
                "BatchNorm layer {!r}: its statistics reach {:.3g}, beyond what its {} buffers hold "
                "({:.3g}); scale its input down, or keep the layer in float64 (layer.double())".format(
                    name, largest, dtype_name(dtype), info.max))
        if not bool(((magnitudes != 0) & (magnitudes < info.tiny)).any()):
            continue
        for what, values in zip(("mean", "variance"), result):
            tiny = (values != 0) & (values.abs() < info.tiny)
            if bool(tiny.any()):
                channels = tiny.nonzero().reshape(-1).tolist()
                first = values[channels[0]:channels[0] + 1]
                warn("BatchNorm layer {!r}: the {} of {} channel(s) (first: channel {}, {:.3g}) is below the "
                     "smallest normal {} ({:.3g}) and is written as {:.3g}, keeping no relative precision".format(
                         name, what, len(channels), channels[0], float(first[0]), dtype_name(dtype), info.tiny,
                         float(round_to(first, dtype)[0])))

