"""The models, data and readings the tests share: the command-line tests name the factories in
``--model`` / ``--data`` specs (``factories:small_net``), the others import them."""
from __future__ import annotations

import os
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn


def tiny_net(classes: int = 3, dropout: Optional[float] = None) -> nn.Sequential:
    """Conv-BN-ReLU then Linear-BN1d on 3x6x6 images (BN layers ``1`` and ``5``, or ``1`` and
    ``6`` with a ``dropout`` after the ReLU): the framework hooks' model. Seed before calling."""
    layers: List[nn.Module] = [nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()]
    if dropout is not None:
        layers.append(nn.Dropout(dropout))
    layers += [nn.Flatten(), nn.Linear(64, classes), nn.BatchNorm1d(classes)]
    return nn.Sequential(*layers)


def bn_stats(model: nn.Module) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """A copy of every BN layer's running mean and variance, by layer name."""
    return {name: (m.running_mean.clone(), m.running_var.clone())
            for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


def small_net(width: int = 4, extra_layer: bool = False, num_classes: int = 3) -> nn.Module:
    """Conv-BN-ReLU twice, pooled, then Linear-BN1d: three BN layers, a few hundred weights."""
    layers: List[nn.Module] = [
        nn.Conv2d(3, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, stride=2),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, 6),
        nn.BatchNorm1d(6),
        nn.Linear(6, num_classes),
    ]
    if extra_layer:
        layers.append(nn.BatchNorm1d(num_classes))
    return nn.Sequential(*layers)


def batches(n: int = 5, batch_size: int = 6, seed: int = 0, offset: float = 3.0) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """``(input, target)`` pairs of 3x8x8 images, mean ``offset``, std 2, with a ragged last batch."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        size = batch_size if i < n - 1 else max(2, batch_size // 2)
        x = torch.randn(size, 3, 8, 8, generator=generator) * 2.0 + offset
        out.append((x, torch.zeros(size, dtype=torch.int64)))
    return out


def trained_net(seed: int = 0) -> nn.Module:
    """small_net with EMA stats from a few train-mode batches, as a training run leaves them."""
    torch.manual_seed(seed)
    net = small_net()
    with torch.no_grad():
        for x, _ in batches(n=3, seed=100 + seed, offset=1.0):
            net(x)
    return net


def no_bn_net() -> nn.Module:
    """A model without any BatchNorm layer."""
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 3))


class Caffe2StyleNet(nn.Module):
    """Module names that the model-zoo ResNet rules map to Caffe2 blobs: conv1, bn1, fc."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn1(self.conv1(x))).mean(dim=(2, 3)))


def caffe2_style_net() -> nn.Module:
    return Caffe2StyleNet()


def fixed_batches() -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """:func:`batches` with no parameters at all."""
    return batches()


# Caffe2 layer names of a non-zoo net -> Caffe2StyleNet's module names, for --caffe2-rules.
STEM_RULES = [(r"stem", "conv1"), (r"stem_bn", "bn1"), (r"head", "fc")]


# Counts the batches counted_batches handed out, so that a test can tell a refusal came before the pass.
READ = {"batches": 0}


def counted_batches() -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """:func:`batches`, counted in ``READ``."""
    for batch in batches():
        READ["batches"] += 1
        yield batch


def dict_batches() -> List[Dict[str, torch.Tensor]]:
    """:func:`batches` as ``{"image": x, "label": y}`` dicts, a layout the default convention does not know."""
    return [{"image": x, "label": y} for x, y in batches()]


def image_forward(model: nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """A ``--forward-fn`` for :func:`dict_batches`."""
    return model(batch["image"])


def broken_batches() -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Two good batches, then the data source fails."""
    for i, batch in enumerate(batches()):
        if i == 2:
            raise OSError(5, "Input/output error reading shard 2")
        yield batch


def interrupted_batches() -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Ctrl-C while the second batch is read."""
    for i, batch in enumerate(batches()):
        if i == 1:
            raise KeyboardInterrupt
        yield batch


def broken_factory() -> nn.Module:
    raise RuntimeError("weights server unreachable")


class OneSampleHead(nn.Module):
    """small_net's layers, whose own forward hands its BatchNorm1d a single sample."""

    def __init__(self) -> None:
        super().__init__()
        self.body = small_net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.body[:9](x)
        return self.body[9](features[:1])


def one_sample_head() -> nn.Module:
    return OneSampleHead()


def fails_on_rank_1() -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """:func:`batches`, except on rank 1 of a torchrun job, whose data source cannot be opened."""
    if os.environ.get("RANK") == "1":
        raise FileNotFoundError(2, "No such file or directory", "/data/shard-1")
    return batches()


def digit_shard() -> List[torch.Tensor]:
    """Rank r's share of the first 24 bundled digits under torchrun: digits 12r to 12r + 11,
    in batches of 4 (the whole 24 in one process)."""
    from precise_bn.digits import load_digits

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    share = load_digits()[0][:24].chunk(world)[rank]
    return list(share.split(4))


def terminated_batches() -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """SIGTERM while the second batch is read; refuses to send it where it would kill the process."""
    import signal

    for i, batch in enumerate(batches()):
        if i == 1:
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None), "SIGTERM would kill the tests"
            os.kill(os.getpid(), signal.SIGTERM)
        yield batch
