"""nn.DataParallel: every replica's call counts, collected per layer.

``nn.DataParallel`` makes fresh module copies on every forward (``replicate``): a replica
shares its original's ``__dict__`` entries, hence the hook dicts, but not its buffers (except
the first replica, which keeps the original tensors). ``torch.nn.parallel.replicate`` needs
GPUs, so :func:`replicate_like_torch` builds the copies the same way on the CPU, and
:class:`ThreadedDataParallel` scatters, replicates and runs the replicas in threads, as
``parallel_apply`` does, so the hooks really are called concurrently from copies.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import List

import pytest
import torch
from torch import nn

from dist_workers import UNEVEN, make_model, rank_batches, union_batches
from precise_bn import recompute
from reference import assert_close_exact, float64_reference


def replicate_like_torch(network: nn.Module, copies: int) -> List[nn.Module]:
    """``torch.nn.parallel.replicate`` without the device broadcast.

    Each module is copied with ``_replicate_for_data_parallel``; children are rewired to their
    copies; parameters are set as plain tensors (replicas hold no leaves); buffers are the
    original tensors in the first replica and new tensors in the others, as the broadcast gives.
    """
    modules = list(network.modules())
    index = {id(m): i for i, m in enumerate(modules)}
    replicas = [[m._replicate_for_data_parallel() for m in modules] for _ in range(copies)]
    for j, replica_modules in enumerate(replicas):
        for module, replica in zip(modules, replica_modules):
            replica._former_parameters = OrderedDict()
            for key, child in module._modules.items():
                setattr(replica, key, None if child is None else replica_modules[index[id(child)]])
            for key, param in module._parameters.items():
                if param is None:
                    replica._parameters[key] = None
                else:
                    setattr(replica, key, param.detach() if j == 0 else param.detach().clone())
            for key, buf in module._buffers.items():
                replica._buffers[key] = buf if buf is None or j == 0 else buf.clone()
    return [replica_modules[0] for replica_modules in replicas]


class ThreadedDataParallel(nn.Module):
    """DataParallel's forward on the CPU: scatter, replicate, run replicas in threads, gather."""

    def __init__(self, module: nn.Module, replicas: int):
        super().__init__()
        self.module = module
        self.replicas = replicas

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chunks = x.chunk(self.replicas)
        replicas = replicate_like_torch(self.module, len(chunks))
        outputs: List = [None] * len(chunks)
        errors: List[BaseException] = []
        start = threading.Barrier(len(chunks))

        def run(i: int) -> None:
            start.wait()
            try:
                with torch.no_grad():
                    outputs[i] = replicas[i](chunks[i])
            except BaseException as exc:  # re-raised below, as parallel_apply does
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(chunks))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return torch.cat(outputs)


def test_replica_calls_count_per_layer_and_match_union_reference():
    replicas = 3
    batches = rank_batches([[9, 6, 8]], 0)  # chunks of 3,3,3 / 2,2,2 / 3,3,2
    model = make_model()
    report = recompute(ThreadedDataParallel(model, replicas), batches)
    chunks = [chunk for batch in batches for chunk in batch.chunk(replicas)]
    check = assert_close_exact
    modules = dict(model.named_modules())
    for name, (ref_mean, ref_var, count) in float64_reference(make_model(), chunks).items():
        module = modules[name]
        check(module.running_mean, module.running_var, ref_mean, ref_var, name)
        layer = report["module." + name]
        assert (layer.elements, layer.calls) == (count, len(chunks))
        assert module.momentum == 0.1 and not module._forward_hooks and not module._forward_pre_hooks


def test_replicas_are_built_like_torch_replicate():
    model = make_model()
    first, second = replicate_like_torch(model, 2)
    bn, bn_first, bn_second = model[1], first[1], second[1]
    assert bn_first is not bn and bn_first._forward_hooks is bn._forward_hooks
    assert bn_first.running_mean is bn.running_mean
    assert bn_second.running_mean is not bn.running_mean
    assert torch.equal(bn_second.running_mean, bn.running_mean)
    assert not list(first.parameters()) and torch.equal(first[0].weight, model[0].weight)


def test_data_parallel_wrapper_on_cpu_runs_the_module():
    """Without GPUs nn.DataParallel calls its module directly; names carry its ``module.``."""
    batches = union_batches(UNEVEN, 2)
    model = make_model()
    report = recompute(nn.DataParallel(model), batches)
    for name, (ref_mean, ref_var, count) in float64_reference(make_model(), batches).items():
        module = dict(model.named_modules())[name]
        assert_close_exact(module.running_mean, module.running_var, ref_mean, ref_var, name)
        assert report["module." + name].elements == count
