"""The benchmark settings: models, their inputs, and shifted data.

A :class:`Case` names a model of :data:`BUILDERS`, its input shape, batch size and number of
batches; weights and batches depend only on its seed, so any process rebuilds exactly the same
case from its fields.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

Batches = List[torch.Tensor]


def bn_mlp(in_features: int = 64, width: int = 256, depth: int = 4, classes: int = 10,
           table_mib: int = 0) -> nn.Module:
    """``depth`` blocks of Linear -> BatchNorm1d -> ReLU, then a classifier; with ``table_mib``,
    the model also holds a float32 buffer of that many MiB that its forward never reads (a
    lookup table, as positional encodings are)."""
    layers: List[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(in_features if i == 0 else width, width), nn.BatchNorm1d(width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, classes))
    if table_mib:
        model.register_buffer("table", torch.rand(table_mib * 2 ** 18))
    return model


class _Block(nn.Module):
    """A ResNet basic block in 2 or 3 spatial dimensions."""

    def __init__(self, dims: int, cin: int, cout: int, stride: int):
        super().__init__()
        conv = nn.Conv2d if dims == 2 else nn.Conv3d
        bn = nn.BatchNorm2d if dims == 2 else nn.BatchNorm3d
        self.conv1 = conv(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = bn(cout)
        self.conv2 = conv(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = bn(cout)
        self.shortcut = (
            nn.Sequential(conv(cin, cout, 1, stride, bias=False), bn(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def small_resnet(
    dims: int = 2, widths: Sequence[int] = (32, 64, 128), blocks: int = 2, classes: int = 10
) -> nn.Module:
    """A ResNet-style CNN (``dims=2``) or video CNN (``dims=3``): a stem, then ``blocks`` basic
    blocks per stage of ``widths``, each stage after the first halving the resolution."""
    conv = nn.Conv2d if dims == 2 else nn.Conv3d
    bn = nn.BatchNorm2d if dims == 2 else nn.BatchNorm3d
    pool = nn.AdaptiveAvgPool2d(1) if dims == 2 else nn.AdaptiveAvgPool3d(1)
    layers: List[nn.Module] = [conv(3, widths[0], 3, 1, 1, bias=False), bn(widths[0]), nn.ReLU()]
    cin = widths[0]
    for stage, width in enumerate(widths):
        for b in range(blocks):
            layers.append(_Block(dims, cin, width, 2 if stage > 0 and b == 0 else 1))
            cin = width
    return nn.Sequential(*layers, pool, nn.Flatten(), nn.Linear(cin, classes))


def _torchvision(name: str) -> nn.Module:
    import torchvision

    video = name == "r2plus1d_18"
    return getattr(torchvision.models.video if video else torchvision.models, name)(weights=None)


def _timm(name: str) -> nn.Module:
    import timm

    return timm.create_model(name, pretrained=False)


BUILDERS: Dict[str, Callable[..., nn.Module]] = {
    "efficientnet_b0": functools.partial(_timm, "efficientnet_b0"),
    "regnety_016": functools.partial(_timm, "regnety_016"),
    "resnet50d": functools.partial(_timm, "resnet50d"),
    "resnet18": functools.partial(_torchvision, "resnet18"),
    "resnet50": functools.partial(_torchvision, "resnet50"),
    "mobilenet_v3_large": functools.partial(_torchvision, "mobilenet_v3_large"),
    "mobilenet_v3_small": functools.partial(_torchvision, "mobilenet_v3_small"),
    "r2plus1d_18": functools.partial(_torchvision, "r2plus1d_18"),
    "resnet_style_2d": functools.partial(small_resnet, 2),
    "video_cnn_3d": functools.partial(small_resnet, 3),
    "bn_mlp": bn_mlp,
}


def bn_layers(model: nn.Module) -> List[Tuple[str, _BatchNorm]]:
    """The BN layers every method recomputes: those that track stats and are in train mode."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, _BatchNorm) and m.track_running_stats and m.training
    ]


class ChannelOffset:
    """Forward pre-hook adding a constant per-channel offset to a BN layer's input.

    It stands for a layer whose input has a large mean next to its spread (raw features,
    a bias that grew during training): the hook belongs to the model, so every method and the
    float64 reference see the same shifted input, and the BN layer normalises the offset away.
    """

    def __init__(self, offset: torch.Tensor):
        self.offset = offset

    def __call__(self, module: nn.Module, args: Tuple[Any, ...]) -> Tuple[Any, ...]:
        x = args[0]
        return (x + self.offset.view([1, -1] + [1] * (x.dim() - 2)),) + tuple(args[1:])


def shift_first_bn(model: nn.Module, batch: torch.Tensor, low: float = 1e2, high: float = 1e4) -> str:
    """Give the first BN layer that runs inputs whose channel means are ``low``..``high`` times
    their std (log-spaced over the channels, std measured on ``batch``); returns its name."""
    seen: List[Tuple[str, torch.Tensor]] = []
    probe = copy.deepcopy(model)
    handles = [
        m.register_forward_pre_hook(lambda mod, args, name=name: seen.append((name, args[0])))
        for name, m in bn_layers(probe)
    ]
    with torch.no_grad():
        probe(batch)
    for handle in handles:
        handle.remove()
    name, x = seen[0]
    dims = [d for d in range(x.dim()) if d != 1]
    std = x.double().std(dim=dims)
    ratios = torch.logspace(torch.log10(torch.tensor(low)), torch.log10(torch.tensor(high)), std.numel())
    offset = (ratios.double() * std).float()
    dict(model.named_modules())[name].register_forward_pre_hook(ChannelOffset(offset))
    return name


@dataclasses.dataclass
class Case:
    """One benchmark setting: a model from :data:`BUILDERS`, its input and its data.

    ``data="shifted"`` applies :func:`shift_first_bn`. Weights and batches depend only on
    ``seed``, so a worker process rebuilds exactly the same case from its fields.
    """

    model: str
    sample_shape: Tuple[int, ...]
    batch_size: int
    batches: int
    data: str = "normal"
    options: Dict[str, Any] = dataclasses.field(default_factory=dict)
    seed: int = 0

    def build(self) -> Tuple[nn.Module, Batches]:
        torch.manual_seed(self.seed)
        model = BUILDERS[self.model](**self.options).train()
        gen = torch.Generator().manual_seed(self.seed + 1)
        batches = [
            torch.randn((self.batch_size,) + tuple(self.sample_shape), generator=gen)
            for _ in range(self.batches)
        ]
        if self.data == "shifted":
            shift_first_bn(model, batches[0])
        elif self.data != "normal":
            raise ValueError("Case.data must be 'normal' or 'shifted', got {!r}".format(self.data))
        return model, batches

    def describe(self, model: nn.Module) -> List[Any]:
        """Table cells: model, options, input, batch, batches, BN layers, BN channels, parameters."""
        layers = bn_layers(model)
        return [
            self.model,
            ", ".join("{}={}".format(k, v) for k, v in sorted(self.options.items())) or "-",
            "x".join(str(s) for s in self.sample_shape),
            self.batch_size,
            self.batches,
            len(layers),
            sum(m.num_features for _, m in layers),
            "{:.1f}M".format(sum(p.numel() for p in model.parameters()) / 1e6),
        ]


CASE_HEADERS = ["model", "options", "input (C x [T x] H x W)", "batch", "batches", "BN layers", "BN channels", "params"]
