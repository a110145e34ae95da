"""Scenarios the sharding and launcher tests run inside each spawned gloo rank (two ranks).

Run through :func:`dist_workers.spawn_ranks` with ``table=__name__``: FSDP2 and FSDP1 models
with 1 batch on rank 0 and 9 on rank 1, the header-sized FSDP2 shard of the issue that once
gave wrong statistics silently, Accelerate and Lightning ``ddp``, and what a timeout leaves
behind.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
from torch import nn

from dist_workers import Result, make_model, outcome, raised, rank_batches
from precise_bn import DistributedError, recompute
from precise_bn.distributed import ACTIVE, Ranks

# Rank 0 reads one batch, rank 1 nine: FSDP's per-forward gathers would stop pairing up.
ONE_VS_NINE = [[5], [4, 3, 6, 2, 5, 4, 3, 6, 2]]


def header_model() -> nn.Module:
    """The issue's model: a conv of 12 float32 (48 bytes per rank, as a round's header once was)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, (1, 11)), nn.BatchNorm2d(2))


def header_batches(rank: int) -> List[torch.Tensor]:
    return [torch.randn(4, 1, 8, 16, generator=torch.Generator().manual_seed(10 * rank + i)) + 2
            for i in range(1 if rank == 0 else 9)]


def _fsdp2(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for module in model:
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            fully_shard(module)
    return fully_shard(model)


def _fsdp2_state(model: nn.Module) -> List[Any]:
    """Per FSDP2 module: sharded?, resharding after forward?, local parameter sizes."""
    from torch.distributed.fsdp import FSDPModule

    state = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            groups = module._get_fsdp_state()._fsdp_param_groups
            state.append([(g.is_sharded, g.post_forward_mesh_info is not None) for g in groups])
    state.append([p.to_local().numel() for p in model.parameters()])
    return state


def _trains(model: nn.Module, rank: int) -> torch.Tensor:
    """One training step's gradients: their collectives pair up only if the sharding is whole."""
    model.train()
    model(rank_batches([[4], [4]], rank)[0]).pow(2).mean().backward()
    grads = [p.grad for p in model.parameters()]
    return torch.cat([(g.full_tensor() if hasattr(g, "full_tensor") else g).reshape(-1) for g in grads])


def _fsdp2_uneven(rank: int, world: int) -> Result:
    model = _fsdp2(make_model())
    before = _fsdp2_state(model)
    out = outcome(model, recompute(model, rank_batches(ONE_VS_NINE, rank), progress=False))
    out["restored"] = _fsdp2_state(model) == before
    out["grads"] = _trains(model, rank)
    return out


def _fsdp2_header(rank: int, world: int) -> Result:
    model = _fsdp2(header_model())
    return outcome(model, recompute(model, header_batches(rank), timeout=20, progress=False))


def _fsdp2_failure(rank: int, world: int) -> Result:
    """Rank 1's data fails after two batches: both raise, and the sharding is as before."""
    model = _fsdp2(make_model())
    before = _fsdp2_state(model)
    batches = rank_batches(ONE_VS_NINE, rank)

    def data():
        for index, batch in enumerate(batches):
            if rank == 1 and index == 2:
                raise OSError("cannot read batch 2")
            yield batch

    out = raised(model, lambda: recompute(model, data(), progress=False))
    out["restored"] = _fsdp2_state(model) == before
    out["grads"] = _trains(model, rank)
    return out


def _fsdp1_uneven(rank: int, world: int) -> Result:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    inner = make_model()
    model = FullyShardedDataParallel(inner, device_id=torch.device("cpu"),
                                     auto_wrap_policy=ModuleWrapPolicy({nn.Conv2d}))
    sharded = [p.numel() for p in model.parameters()]
    report = recompute(model, rank_batches(ONE_VS_NINE, rank), progress=False)
    out = outcome(inner, report)
    out["names"] = [layer.name for layer in report.layers]
    out["layer_1_calls"] = report["1"].calls
    out["restored"] = [p.numel() for p in model.parameters()] == sharded and all(
        "forward" not in vars(m) for m in model.modules())
    out["grads"] = _trains(model, rank)
    return out


def _plain_uneven(rank: int, world: int) -> Result:
    model = make_model()
    return outcome(model, recompute(model, rank_batches(ONE_VS_NINE, rank), progress=False))


def _timeout_leaves_the_group_usable(rank: int, world: int) -> Result:
    """Rank 1 stalls past rank 0's timeout: both raise; the default group still all-reduces,
    and a later call works."""
    model = make_model()
    batches = rank_batches(ONE_VS_NINE, 0)

    def data():
        if rank == 1:
            time.sleep(3.0)
        yield from batches

    out = raised(model, lambda: recompute(model, data(), timeout=1.0, progress=False))
    total = torch.ones(1)
    dist.all_reduce(total)
    out["all_reduce"] = float(total)
    again = make_model()
    out["again"] = outcome(again, recompute(again, rank_batches(ONE_VS_NINE, rank), progress=False,
                                           timeout=float("inf")))
    return out


def _out_of_step(rank: int, world: int) -> Result:
    """Rank 0 plays a first round where rank 1 plays a last one: both raise, naming both."""
    try:
        Ranks(True, timeout=60.0).exchange(ACTIVE, round_="start" if rank == 0 else "end")
    except DistributedError as exc:
        return {"error": "DistributedError", "message": str(exc)}
    return {"error": None}


def _no_limit(rank: int, world: int) -> Result:
    model = make_model()
    return outcome(model, recompute(model, rank_batches(ONE_VS_NINE, rank), timeout=None, progress=False))


def _launcher_env(rank: int, world: int) -> None:
    """What torchrun would set; the process group is joined already, so none is contacted."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0",
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29400")


ACCELERATE_SAMPLES = 11  # over 2 ranks in batches of 2: the last batch is padded (even_batches)
#: Samples and batch size without even_batches: 5 batches, the last of 2, so one rank reads one fewer.
UNEVEN_SAMPLES, UNEVEN_BATCH = 14, 3


def accelerate_dataset(samples: int = ACCELERATE_SAMPLES) -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(torch.cat(rank_batches([[samples]], 0)))


def _accelerate(rank: int, world: int, even_batches: bool = True) -> Result:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    _launcher_env(rank, world)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(even_batches=even_batches))
    model = make_model()
    samples, batch_size = (ACCELERATE_SAMPLES, 2) if even_batches else (UNEVEN_SAMPLES, UNEVEN_BATCH)
    ddp, loader = accelerator.prepare(model, torch.utils.data.DataLoader(accelerate_dataset(samples),
                                                                         batch_size=batch_size))
    seen = [batch[0].clone() for batch in loader]
    out = outcome(model, recompute(ddp, loader, progress=False))
    out["seen"] = seen
    out["wrapped"] = type(ddp).__name__
    return out


LIGHTNING_BATCHES = 9  # the callback cycles each rank's batches up to its budget


def _lightning_ddp(rank: int, world: int) -> Result:
    import lightning.pytorch as pl

    from precise_bn.lightning import PreciseBNCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self(batch[0])

    _launcher_env(rank, world)
    module = Module()
    callback = PreciseBNCallback(num_batches=LIGHTNING_BATCHES, data=rank_batches(ONE_VS_NINE, rank))
    trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=world, logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False, callbacks=[callback])
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(2, 3, 6, 6)), batch_size=1)
    trainer.validate(module, dataloaders=data, verbose=False)
    return outcome(module.net)


SCENARIOS: Dict[str, Callable[[int, int], Result]] = {
    "plain_uneven": _plain_uneven,
    "fsdp2_uneven": _fsdp2_uneven,
    "fsdp2_header": _fsdp2_header,
    "fsdp2_failure": _fsdp2_failure,
    "fsdp1_uneven": _fsdp1_uneven,
    "no_limit": _no_limit,
    "out_of_step": _out_of_step,
    "timeout": _timeout_leaves_the_group_usable,
    "accelerate": _accelerate,
    "accelerate_uneven": lambda rank, world: _accelerate(rank, world, even_batches=False),
    "lightning_ddp": _lightning_ddp,
}
