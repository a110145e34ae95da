"""A plain training loop that recomputes precise BN stats before every evaluation and checkpoint.

    python scripts/train_with_precise_bn.py [--steps 200] [--out DIR]

Trains the demo's small CNN on the 8x8 digits bundled with the package (no download, under a minute
on a CPU). Every --eval-every steps it evaluates with the running stats that training left,
then with precise stats; an EMA copy of the weights, whose BN buffers are never trained, gets its
stats from the same batches. Every --save-every steps it writes a checkpoint (into --out, or a
temporary folder removed at the end); at a step that also evaluated, the hook writes back the
evaluation's stats without another forward.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import tempfile

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from precise_bn.atomic import atomic_write
from precise_bn.digits import evaluate, load_digits, make_model
from precise_bn.hooks import PreciseBNHook


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Held-out accuracy in eval mode; the model goes back to training mode afterwards."""
    was_training = model.training
    result = evaluate(model, x, y)[0]
    model.train(was_training)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--bn-batches", type=int, default=20, help="batches per recomputation")
    parser.add_argument("--out", help="keep the checkpoints in this folder (default: a temporary one)")
    args = parser.parse_args()
    with (contextlib.nullcontext(args.out) if args.out else tempfile.TemporaryDirectory()) as out:
        os.makedirs(out, exist_ok=True)
        train(args, out)


def train(args: argparse.Namespace, out: str) -> None:
    """The training loop, writing its checkpoints into ``out``."""
    torch.manual_seed(0)
    train_x, train_y, test_x, test_y = load_digits()
    train_loader = DataLoader(TensorDataset(train_x, train_y), batch_size=16, shuffle=True)
    model = make_model()
    ema = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    hook = PreciseBNHook(model, train_loader, num_batches=args.bn_batches, extra_models=[ema])

    step = 0
    while step < args.steps:
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                for p_ema, p in zip(ema.parameters(), model.parameters()):
                    p_ema.lerp_(p, 0.05)
            step += 1
            if step % args.eval_every == 0:
                running = accuracy(model, test_x, test_y)
                hook.before_eval(step)
                precise, ema_precise = accuracy(model, test_x, test_y), accuracy(ema, test_x, test_y)
                print(
                    "step {:4d}  loss {:.3f}  test acc: running stats {:.3f}, precise {:.3f}, "
                    "EMA weights + precise {:.3f}".format(step, loss.item(), running, precise, ema_precise)
                )
            if step % args.save_every == 0:
                recomputations = hook.recomputations
                hook.before_checkpoint(step)
                path = os.path.join(out, "step_{}.pt".format(step))
                state = {"model": model.state_dict(), "ema": ema.state_dict(), "step": step}
                atomic_write(path, lambda f: torch.save(state, f))
                reused = hook.recomputations == recomputations
                print("step {:4d}  saved {} ({} stats)".format(step, path, "evaluated" if reused else "new"))
            if step == args.steps:
                break


if __name__ == "__main__":
    main()
