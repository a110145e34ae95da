"""What each rank of the two-rank mmengine test runs (through :func:`dist_workers.spawn_ranks`
with ``table=__name__``): a Runner under DDP on the process group the spawn set up, the hook
with ``num_samples=16`` over batches of 8, a checkpoint and a validation after the one epoch;
then a checkpoint of new weights written on rank 0 alone."""
from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any, Dict

import torch

from dist_workers import Result
from precise_bn.mmengine import ExactPreciseBNHook
from test_mmengine import Net, Recorder, bn_state, make_runner, sampled


def runner_run(rank: int, world: int) -> Result:
    os.environ.setdefault("LOCAL_RANK", str(rank))
    work_dir = tempfile.mkdtemp(prefix="precise-bn-mmengine-rank{}-".format(rank))
    torch.manual_seed(0)
    model = Net()
    record = Recorder(model)
    hook = ExactPreciseBNHook(num_samples=16, forward_fn=record, timeout=120.0)
    runner = make_runner(work_dir, model, [hook], dict(by_epoch=True, max_epochs=1, val_interval=1),
                         train_loader=sampled("DefaultSampler", n=32), launcher="pytorch",
                         cfg=dict(model_wrapper_cfg=dict(type="MMDistributedDataParallel", device_ids=None,
                                                          broadcast_buffers=False)),
                         experiment_name="precise-bn-two-ranks")
    runner.train()
    report = hook.hook.last_report
    result: Dict[str, Any] = {"passes": record.passes, "report": (report.samples, report.batches, report.world_size),
                              "stats": bn_state(model), "validated": model.validated}
    if rank == 0:
        saved = torch.load(os.path.join(work_dir, "epoch_1.pth"), map_location="cpu", weights_only=False)
        result["file"] = saved["state_dict"]
        # New weights, and a checkpoint mmengine writes on rank 0 alone: no pass can run there.
        with torch.no_grad():
            model.net[0].weight.mul_(1.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runner.save_checkpoint(work_dir, "late.pth")
        result["late"] = [str(w.message) for w in caught if "rank 0 alone" in str(w.message)]
        result["late_file"] = torch.load(os.path.join(work_dir, "late.pth"), map_location="cpu",
                                         weights_only=False)["state_dict"]
    return result


SCENARIOS = {"runner": runner_run}
