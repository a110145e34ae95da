"""Precise BN statistics across processes: every rank ends with the same, exact stats.

    torchrun --nproc_per_node=2 scripts/distributed_example.py
    torchrun --nproc_per_node=2 scripts/distributed_example.py --save bn.pt

Each rank recalibrates a DistributedDataParallel model on its own share of the data, and the
shares are deliberately uneven (different numbers of batches and batch sizes). recompute
runs the pass on the wrapped module, so no forward issues a collective, and merges the ranks'
statistics once at the end, weighted by their true element counts: every rank ends with the
bits one process would get from all the data. Rank 0 alone writes the checkpoint.
Uses NCCL and one GPU per process when CUDA is available, else gloo on the CPU.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader, Subset, TensorDataset

from precise_bn import recompute
from precise_bn.distributed import barrier, get_rank, get_world_size, is_main_process

SAMPLES = 45
BATCH_SIZE = 8


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
        nn.BatchNorm1d(4),
    )


def make_dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(SAMPLES, 3, 8, 8, generator=gen) * 2.0 + 1.0
    labels = torch.randint(0, 4, (SAMPLES,), generator=gen)
    return TensorDataset(images, labels)


def shard_loader(dataset: TensorDataset, rank: int, world: int) -> DataLoader:
    """Every ``world``-th sample from ``rank`` on: shares differ when ``world`` does not divide
    the dataset, and that is fine (a DistributedSampler works as well)."""
    return DataLoader(Subset(dataset, range(rank, len(dataset), world)), batch_size=BATCH_SIZE)


def bn_state(model: nn.Module) -> torch.Tensor:
    """Every BN layer's running stats in one vector."""
    layers = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    return torch.cat([t.reshape(-1) for m in layers for t in (m.running_mean, m.running_var)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", help="rank 0 writes the recalibrated state_dict here")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")  # env:// set up by torchrun
    rank, world = get_rank(), get_world_size()
    device = torch.device("cpu")
    if use_cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)

    model = make_model().to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if use_cuda else None)
    loader = shard_loader(make_dataset(), rank, world)
    report = recompute(ddp, loader, device=device)  # the whole share

    # The point of the merge: all ranks hold the same bits, so any rank's checkpoint is right.
    state = bn_state(model)
    gathered = [torch.empty_like(state) for _ in range(world)]
    dist.all_gather(gathered, state)
    identical = all(torch.equal(state, other) for other in gathered)
    if is_main_process():
        print(report)
        print("rank 0 ran {} of the {} batches; stats identical on all {} ranks: {}".format(
            len(loader), report.batches, world, identical))
        if args.save:
            torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.save)
    barrier()  # no rank goes on (e.g. to read the checkpoint) before rank 0 has written it
    del ddp  # its reducer must go before the process group it holds, or gloo aborts at exit
    dist.destroy_process_group()
    if not identical:
        raise SystemExit("rank {}: BN stats differ between ranks".format(rank))


if __name__ == "__main__":
    main()
