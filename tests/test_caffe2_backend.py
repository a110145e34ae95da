"""The Caffe2 backend on real Caffe2 (caffe2 environment), and its absence (main environment).

Nets are laid out as data-parallel Caffe2 lays them out: one ``gpu_{i}`` name scope per device,
here on CPU device options. References are float64 over the BN inputs the test fetches itself
by running a forward net over the same feeds.
"""
from __future__ import annotations

import math
import multiprocessing
import sys
import types
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from precise_bn import BatchNormHelper, update_bn_stats
from precise_bn.caffe2.stats import UNTRUSTED_RTOL, decode_saved_stats, untrusted_channels
from precise_bn.errors import BackendUnavailableError, ConfigError, LayerError, NonFiniteStatsError, PreciseBNWarning
from precise_bn.estimator import PopulationStats
from reference import _check, assert_close_exact, ulp32

caffe2_env = pytest.mark.caffe2_env
# Caffe2's own modules use numpy aliases and inspect functions that are deprecated; ours are not.
pytestmark = pytest.mark.filterwarnings(r"ignore::DeprecationWarning:caffe2\.python")
EPS = 1e-5
U32 = 2.0 ** -24


def caffe2_modules():
    """``(core, workspace, brew, model_helper, cpu device option)`` on a fresh workspace."""
    from caffe2.proto import caffe2_pb2
    from caffe2.python import brew, core, model_helper, workspace

    workspace.ResetWorkspace()
    return core, workspace, brew, model_helper, core.DeviceOption(caffe2_pb2.CPU)


@pytest.fixture
def c2():
    modules = caffe2_modules()
    yield modules
    modules[1].ResetWorkspace()


# ---------------------------------------------------------------- nets and data


def add_forward(c2, model, scope):
    """data -> in_bn (sees the raw, large-mean data) -> conv1 -> conv1_bn (channel 2 dead) -> relu
    -> conv2 -> conv2_bn. Returns the BN input blob of each layer."""
    core, _, brew, _, cpu = c2
    with core.DeviceScope(cpu), core.NameScope(scope):
        brew.spatial_bn(model, "data", "in_bn", 3, epsilon=EPS, is_test=False)
        brew.conv(model, "in_bn", "conv1", 3, 4, 3, pad=1)
        brew.spatial_bn(model, "conv1", "conv1_bn", 4, epsilon=EPS, is_test=False)
        brew.relu(model, "conv1_bn", "conv1_relu")
        brew.conv(model, "conv1_relu", "conv2", 4, 5, 1)
        brew.spatial_bn(model, "conv2", "conv2_bn", 5, epsilon=EPS, is_test=False)
    prefix = scope + "/" if scope else ""
    return {"in": prefix + "data", "conv1": prefix + "conv1", "conv2": prefix + "conv2"}


def set_params(c2, model, scopes, seed=0):
    """Random weights and BN affine params, identical on every device; conv1 channel 2 dead."""
    _, workspace, _, _, _ = c2
    workspace.RunNetOnce(model.param_init_net)
    rng = np.random.RandomState(seed)
    first = scopes[0] + "/" if scopes[0] else ""
    for param in model.params:
        name = str(param)
        if not name.startswith(first):
            continue
        value = workspace.FetchBlob(name)
        value = (rng.randn(*value.shape) * 0.5 + (1.0 if name.endswith("_s") else 0.0)).astype(np.float32)
        if name.endswith("conv1_w") or name.endswith("conv1_b"):
            value[2] = 0.0
        for scope in scopes:
            target = (scope + "/" if scope else "") + name[len(first):]
            workspace.FeedBlob(target, value)


def two_device_data(iters, seed=1, sizes=(5, 3), offsets=(50.0, 53.0), huge=None):
    """One feed per iteration: gpu_0 and gpu_1 with different batch sizes and means.

    ``huge=(iteration, mean)`` gives gpu_1 a mean Caffe2's float32 kernel cannot survive there.
    """
    rng = np.random.RandomState(seed)
    feeds = []
    for it in range(iters):
        feed = {}
        for device, (size, offset) in enumerate(zip(sizes, offsets)):
            if huge is not None and device == 1 and it == huge[0]:
                offset = huge[1]
            x = offset + rng.randn(size, 3, 6, 6) * np.array([1.0, 2.0, 0.5]).reshape(1, 3, 1, 1)
            feed["gpu_{}/data".format(device)] = x.astype(np.float32)
        feeds.append(feed)
    return feeds


def forward_reference(c2, net, feeds, inputs_by_device):
    """Run ``net`` on every feed, keep each layer's BN input on every device, reduce in float64.

    Returns layer -> (mean, var, second moment E[x^2], largest per-call elements per channel).
    """
    _, workspace, _, _, _ = c2
    parts = {layer: [] for layer in inputs_by_device[0]}
    calls = {layer: 0 for layer in parts}
    for feed in feeds:
        for name, value in feed.items():
            workspace.FeedBlob(name, value)
        workspace.RunNetOnce(net)
        for inputs in inputs_by_device:
            for layer, blob in inputs.items():
                x = workspace.FetchBlob(blob).astype(np.float64)
                flat = x.transpose(1, 0, 2, 3).reshape(x.shape[1], -1)
                parts[layer].append(flat)
                calls[layer] = max(calls[layer], flat.shape[1])
    out = {}
    for layer, chunks in parts.items():
        x = np.concatenate(chunks, axis=1)
        mean = x.mean(axis=1)
        var = ((x - mean[:, None]) ** 2).mean(axis=1)
        out[layer] = (mean, var, (x * x).mean(axis=1), calls[layer])
    return out


def assert_kernel_close(mean, var, ref, what):
    """The float64 reference, within what Caffe2's float32 SpatialBN kernel allows.

    The kernel sums x and x^2 over a call's n elements per channel in float32 and forms
    E[x^2]-E[x]^2: rounding errors of an n-term float32 sum grow like sqrt(n) roundings, of |x|
    for the mean and of E[x^2] (which for a large mean dwarfs the variance) for the variance,
    and the fed value adds one float32 rounding. The merge over calls is exact, so a weighted
    average of per-call errors stays inside the per-call bound.
    """
    ref_mean, ref_var, second, n = ref
    k = 2.0 * math.sqrt(n) * U32
    std = np.sqrt(ref_var)
    mean_tol = k * (np.abs(ref_mean) + std)
    var_tol = k * second + 2.0 * std * mean_tol + ulp32(torch.from_numpy(ref_var)).numpy()
    arrays = (mean, var, ref_mean, ref_var, mean_tol, var_tol)
    _check(*(torch.from_numpy(np.asarray(a, np.float64)) for a in arrays), what)


def fed(c2, device, layer):
    _, workspace, _, _, _ = c2
    prefix = device + "/" if device else ""
    return workspace.FetchBlob(prefix + layer + "_bn_rm"), workspace.FetchBlob(prefix + layer + "_bn_riv")


class CountingFeeds:
    """An iterable of feeds that counts how many it handed out (runs of the aux net)."""

    def __init__(self, feeds):
        self.feeds = feeds
        self.taken = 0

    def __iter__(self):
        for feed in self.feeds:
            self.taken += 1
            yield feed


def single_device_model(c2, name):
    """The forward net without name scope (one device), with its BN inputs."""
    model = c2[3].ModelHelper(name=name)
    inputs = add_forward(c2, model, "")
    return model, inputs


def two_device_model(c2):
    _, _, _, model_helper, _ = c2
    model = model_helper.ModelHelper(name="aux")
    inputs = [add_forward(c2, model, "gpu_{}".format(i)) for i in range(2)]
    set_params(c2, model, ["gpu_0", "gpu_1"])
    return model, inputs


# ---------------------------------------------------------------- tests


@caffe2_env
def test_two_devices_match_float64_reference_and_agree(c2):
    model, inputs = two_device_model(c2)
    feeds = two_device_data(6)
    helper = BatchNormHelper(backend="caffe2", iters=6, num_gpus=2, root_gpu_id=0,
                             device_prefix="gpu", bn_epsilon=EPS, log_period=2)
    helper.create_bn_aux_model(model, feeds)
    report = helper.compute_and_update_bn_stats(curr_iter=100)
    result = {layer: fed(c2, "gpu_0", layer) for layer in ("in", "conv1", "conv2")}
    for layer, (rm, riv) in result.items():
        other = fed(c2, "gpu_1", layer)
        assert rm.dtype == np.float32 and riv.dtype == np.float32
        assert rm.tobytes() == other[0].tobytes() and riv.tobytes() == other[1].tobytes(), layer
    ref = forward_reference(c2, model.net, feeds, inputs)
    for layer, (rm, riv) in result.items():
        assert_kernel_close(rm, riv, ref[layer], layer)
    assert result["conv1"][1][2] == 0.0 and ref["conv1"][1][2] == 0.0
    assert report["in"].elements == (5 + 3) * 6 * 36 and report["in"].calls == 12
    assert report.samples == 6 * 8 and report.batches == 6 and report.estimator == "caffe2"
    # equal weight per device, the old helper's rule, would be far outside the bound above
    per_device = [
        np.concatenate([f["gpu_{}/data".format(d)] for f in feeds]).astype(np.float64).mean((0, 2, 3))
        for d in range(2)
    ]
    assert np.all(np.abs((per_device[0] + per_device[1]) / 2 - result["in"][0]) > 0.1)


@caffe2_env
def test_prior_pools_the_nets_running_stats_with_the_target(c2):
    """``prior=N`` on the Caffe2 path: the blobs' old stats, as N samples, pooled with the
    n = 48 samples read (Chan's formula), against the float64 reference of the target."""
    model, inputs = two_device_model(c2)
    feeds = two_device_data(6)
    helper = BatchNormHelper(backend="caffe2", iters=6, num_gpus=2, root_gpu_id=0, device_prefix="gpu",
                             bn_epsilon=EPS, prior=16)
    helper.create_bn_aux_model(model, feeds)
    layers = ("in", "conv1", "conv2")
    old = {layer: [a.astype(np.float64) for a in fed(c2, "gpu_0", layer)] for layer in layers}
    report = helper.compute_and_update_bn_stats(curr_iter=100)
    result = {layer: fed(c2, "gpu_0", layer) for layer in layers}
    ref = forward_reference(c2, model.net, feeds, inputs)
    n, prior = report.samples, 16
    assert n == 48
    for layer in layers:
        (mean_s, var_s), (mean_t, var_t) = old[layer], ref[layer][:2]
        mean = (prior * mean_s + n * mean_t) / (prior + n)
        var = (prior * var_s + n * var_t) / (prior + n) + prior * n * (mean_s - mean_t) ** 2 / (prior + n) ** 2
        np.testing.assert_allclose(result[layer][0], mean, rtol=1e-5, atol=1e-5, err_msg=layer)
        np.testing.assert_allclose(result[layer][1], var, rtol=1e-4, atol=1e-6, err_msg=layer)
        assert not np.allclose(var, (prior * var_s + n * var_t) / (prior + n), rtol=1e-3)


@caffe2_env
def test_same_iteration_reapplies_cache_without_running(c2):
    _, workspace, _, _, _ = c2
    model, _ = two_device_model(c2)
    feeds = CountingFeeds(two_device_data(3))
    helper = BatchNormHelper(backend="caffe2", iters=3, num_gpus=2)
    helper.create_bn_aux_model(model, feeds)
    helper.compute_and_update_bn_stats(curr_iter=7)
    first = {d: fed(c2, d, "conv2") for d in ("gpu_0", "gpu_1")}
    assert feeds.taken == 3
    for d in ("gpu_0", "gpu_1"):
        workspace.FeedBlob(d + "/conv2_bn_rm", np.full(5, 9.0, np.float32))
        workspace.FeedBlob(d + "/conv2_bn_riv", np.full(5, 9.0, np.float32))
    helper.compute_and_update_bn_stats(curr_iter=7)
    assert feeds.taken == 3 and helper.recomputations == 1
    for d in ("gpu_0", "gpu_1"):
        rm, riv = fed(c2, d, "conv2")
        assert rm.tobytes() == first[d][0].tobytes() and riv.tobytes() == first[d][1].tobytes()
    helper.compute_and_update_bn_stats(curr_iter=8)
    assert feeds.taken == 6 and helper.recomputations == 2


@caffe2_env
def test_non_finite_batch_stats_refused_and_nothing_fed(c2):
    model, _ = two_device_model(c2)
    before = {(d, layer): fed(c2, d, layer) for d in ("gpu_0", "gpu_1") for layer in ("in", "conv1", "conv2")}
    # mean 1e4 with std ~1: float32 E[x^2]-E[x]^2 falls below -eps and the kernel's siv is NaN
    feeds = two_device_data(4, huge=(2, 1e4))
    helper = BatchNormHelper(backend="caffe2", iters=4, num_gpus=2)
    helper.create_bn_aux_model(model, feeds)
    with pytest.raises(NonFiniteStatsError) as info:
        helper.compute_and_update_bn_stats(curr_iter=1)
    message = str(info.value)
    assert "'in'" in message and "'gpu_1'" in message and "iteration 3 of 4" in message
    for (d, layer), (rm, riv) in before.items():
        now = fed(c2, d, layer)
        assert now[0].tobytes() == rm.tobytes() and now[1].tobytes() == riv.tobytes(), (d, layer)


@caffe2_env
def test_aux_net_derived_from_training_net(c2):
    core, workspace, brew, model_helper, cpu = c2
    from caffe2.python import optimizer

    train = model_helper.ModelHelper(name="train")
    inputs = add_forward(c2, train, "")
    with core.DeviceScope(cpu):
        brew.fc(train, "conv2_bn", "pred", 5 * 36, 2)
        softmax = train.net.Softmax("pred", "softmax")
        xent = train.net.LabelCrossEntropy([softmax, "label"], "xent")
        loss = train.net.AveragedLoss(xent, "loss")
        train.AddGradientOperators([loss])
        optimizer.build_sgd(train, base_learning_rate=0.5)
    set_params(c2, train, [""])
    forward, _ = single_device_model(c2, "forward")
    rng = np.random.RandomState(3)
    feeds = [{"data": (rng.randn(4, 3, 6, 6) + 2.0).astype(np.float32), "label": np.zeros(4, np.int32)}
             for _ in range(3)]
    weights = {str(p): workspace.FetchBlob(str(p)).copy() for p in train.params}
    helper = BatchNormHelper(backend="caffe2", iters=3)
    aux = helper.create_bn_aux_model(lambda: train, feeds)
    kinds = {op.type for op in aux.net.op}
    assert not any(op.is_gradient_op or op.type.endswith("Gradient") for op in aux.net.op)
    assert kinds == {"SpatialBN", "Conv", "Relu", "Shape"}
    assert all(a.i == 0 for op in aux.net.op if op.type == "SpatialBN" for a in op.arg if a.name == "is_test")
    helper.compute_and_update_bn_stats()
    for name, value in weights.items():
        assert workspace.FetchBlob(name).tobytes() == value.tobytes(), "{} was updated".format(name)
    result = {layer: fed(c2, "", layer) for layer in inputs}
    ref = forward_reference(c2, forward.net, feeds, [inputs])
    for layer, (rm, riv) in result.items():
        assert_kernel_close(rm, riv, ref[layer], layer)


@caffe2_env
@pytest.mark.parametrize(
    "order,shape,is_test", [("NCHW", (3, 4, 2, 5, 5), False), ("NHWC", (3, 5, 5, 4), True)]
)
def test_channel_axis_video_inputs_and_test_mode_nets(c2, order, shape, is_test):
    """A 5-D (N, C, T, H, W) video input and an NHWC input: the count is all non-channel
    elements. The NHWC net is built for inference (is_test=1): the aux net turns it to train mode."""
    core, workspace, brew, model_helper, cpu = c2
    model = model_helper.ModelHelper(name="layout")
    with core.DeviceScope(cpu):
        brew.spatial_bn(model, "data", "video_bn", 4, epsilon=EPS, is_test=is_test, order=order)
    workspace.RunNetOnce(model.param_init_net)
    rng = np.random.RandomState(2)
    sizes = (3, 7, 2)
    feeds = [{"data": (rng.randn(n, *shape[1:]) * 3 + 1).astype(np.float32)} for n in sizes]
    helper = BatchNormHelper(backend="caffe2", iters=3)
    helper.create_bn_aux_model(model, feeds)
    report = helper.compute_and_update_bn_stats()
    axis = 1 if order == "NCHW" else -1
    x = np.concatenate(
        [np.moveaxis(f["data"].astype(np.float64), axis, 0).reshape(4, -1) for f in feeds], axis=1
    )
    per_call = x.shape[1] // sum(sizes) * max(sizes)
    ref = (x.mean(1), x.var(1), (x * x).mean(1), per_call)
    assert report["video"].elements == x.shape[1]
    assert_kernel_close(*fed(c2, "", "video"), ref, order)


@caffe2_env
def test_layout_errors_name_what_is_wrong(c2):
    core, _, _, model_helper, cpu = c2
    model, _ = two_device_model(c2)
    with pytest.raises(ConfigError, match="gpu_2"):
        BatchNormHelper(backend="caffe2", iters=1, num_gpus=3).create_bn_aux_model(model)
    with pytest.raises(ConfigError, match="root_gpu_id"):
        BatchNormHelper(backend="caffe2", iters=1, num_gpus=1, root_gpu_id=1).create_bn_aux_model(model)
    folded = model_helper.ModelHelper(name="folded")
    with core.DeviceScope(cpu):
        folded.net.AffineChannel(["data", "res_conv1_bn_s", "res_conv1_bn_b"], "res_conv1_bn")
    with pytest.raises(LayerError, match="AffineChannel"):
        BatchNormHelper(backend="caffe2", iters=1).create_bn_aux_model(folded)
    uninitialised, _ = single_device_model(c2, "fresh")
    with pytest.raises(LayerError, match="param_init_net"):
        BatchNormHelper(backend="caffe2", iters=1).create_bn_aux_model(uninitialised)


RANK_BATCHES = ((5, 2, 4), (2, 6, 3))  # per rank, per iteration: uneven sizes


def rank_feeds(rank):
    rng = np.random.RandomState(40 + rank)
    return [
        {"data": (rng.randn(n, 3, 6, 6) * (1 + rank) + 2.0 * rank).astype(np.float32)}
        for n in RANK_BATCHES[rank]
    ]


def _rank_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    c2 = caffe2_modules()
    model, inputs = single_device_model(c2, "rank")
    set_params(c2, model, [""])
    helper = BatchNormHelper(backend="caffe2", iters=len(RANK_BATCHES[rank]))
    helper.create_bn_aux_model(model, rank_feeds(rank))
    report = helper.compute_and_update_bn_stats()
    stats = {}
    for layer in inputs:
        stats[layer + "_rm"], stats[layer + "_riv"] = fed(c2, "", layer)
    # then rank 1 alone meets a batch the float32 kernel turns into NaN: every rank must raise
    feeds = rank_feeds(rank)
    if rank == 1:
        feeds[1]["data"] += np.float32(1e4)
    failing = BatchNormHelper(backend="caffe2", iters=len(feeds))
    failing.create_bn_aux_model(model, feeds)
    try:
        failing.compute_and_update_bn_stats()
        error = "none"
    except Exception as exc:  # the type is what the parent checks
        error = type(exc).__name__
    unchanged = all(fed(c2, "", layer)[1].tobytes() == stats[layer + "_riv"].tobytes() for layer in inputs)
    # rank 0 alone would distrust its mean/std = 100 channels; merged with rank 1's wide spread
    # they are fine, and both ranks must say the same
    rng = np.random.RandomState(rank)
    spread = [{"data": (100.0 + rng.randn(4, 3, 6, 6) * (1 + 49 * rank)).astype(np.float32)} for _ in range(2)]
    untrusted = []
    for sync in (True, False):
        checked = BatchNormHelper(backend="caffe2", iters=2, sync=sync)
        checked.create_bn_aux_model(model, spread)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PreciseBNWarning)
            untrusted += [checked.compute_and_update_bn_stats()[layer].untrusted for layer in inputs]
    path = str(out_dir / "rank{}.npz".format(rank))
    np.savez(path, world_size=report.world_size, samples=report.samples, error=error,
             unchanged=unchanged, untrusted=np.array([len(u) for u in untrusted]), **stats)
    dist.destroy_process_group()


@caffe2_env
def test_ranks_merge_exactly_end_identical_and_fail_together(c2, tmp_path):
    world = len(RANK_BATCHES)
    ctx = multiprocessing.get_context("spawn")
    init = str(tmp_path / "init")
    ranks = [ctx.Process(target=_rank_worker, args=(r, world, init, tmp_path)) for r in range(world)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=900)  # a hang guard: the ranks take seconds
    for process in ranks:
        if process.is_alive():
            process.terminate()
    assert [p.exitcode for p in ranks] == [0] * world
    results = [np.load(str(tmp_path / "rank{}.npz".format(r))) for r in range(world)]
    model, inputs = single_device_model(c2, "union")
    set_params(c2, model, [""])
    ref = forward_reference(c2, model.net, rank_feeds(0) + rank_feeds(1), [inputs])
    for layer in inputs:
        for key in (layer + "_rm", layer + "_riv"):
            assert results[0][key].tobytes() == results[1][key].tobytes(), key
        assert_kernel_close(results[0][layer + "_rm"], results[0][layer + "_riv"], ref[layer], layer)
    for result in results:
        assert int(result["world_size"]) == world and int(result["samples"]) == sum(map(sum, RANK_BATCHES))
        assert bool(result["unchanged"])
    assert [str(r["error"]) for r in results] == ["DistributedError", "NonFiniteStatsError"]
    # merged: nothing to distrust on either rank; each rank alone (sync=False): rank 0's "in" layer
    assert [r["untrusted"].tolist() for r in results] == [[0, 0, 0, 3, 0, 0], [0, 0, 0, 0, 0, 0]]


# Torch twin of the Caffe2 model-zoo ResNet below, with torchvision's module names.
class TinyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(4, 6, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(6)
        self.downsample = nn.Sequential(nn.Conv2d(4, 6, 1, bias=False), nn.BatchNorm2d(6))

    def forward(self, x):
        out = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(out + self.downsample(x))


class TinyResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.layer1 = nn.Sequential(TinyBlock())
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        x = self.layer1(torch.relu(self.bn1(self.conv1(x))))
        return self.fc(x.mean((2, 3)))


def add_zoo_resnet(c2, model, scope):
    core, _, brew, _, cpu = c2
    with core.DeviceScope(cpu), core.NameScope(scope):
        brew.conv(model, "data", "conv1", 3, 4, 3, pad=1, no_bias=True)
        brew.spatial_bn(model, "conv1", "res_conv1_bn", 4, epsilon=EPS, is_test=False)
        brew.relu(model, "res_conv1_bn", "res_conv1_bn")
        brew.conv(model, "res_conv1_bn", "res2_0_branch2a", 4, 6, 1, no_bias=True)
        brew.spatial_bn(model, "res2_0_branch2a", "res2_0_branch2a_bn", 6, epsilon=EPS, is_test=False)
        brew.relu(model, "res2_0_branch2a_bn", "res2_0_branch2a_bn")
        brew.conv(model, "res2_0_branch2a_bn", "res2_0_branch2b", 6, 6, 3, pad=1, no_bias=True)
        brew.spatial_bn(model, "res2_0_branch2b", "res2_0_branch2b_bn", 6, epsilon=EPS, is_test=False)
        brew.conv(model, "res_conv1_bn", "res2_0_branch1", 4, 6, 1, no_bias=True)
        brew.spatial_bn(model, "res2_0_branch1", "res2_0_branch1_bn", 6, epsilon=EPS, is_test=False)
        brew.sum(model, ["res2_0_branch2b_bn", "res2_0_branch1_bn"], "res2_0_sum")
        brew.relu(model, "res2_0_sum", "res2_0_sum")
        brew.average_pool(model, "res2_0_sum", "pool", global_pooling=True)
        brew.fc(model, "pool", "pred", 6, 3)


@caffe2_env
def test_parity_with_torch_backend_after_conversion(c2):
    _, workspace, _, model_helper, _ = c2
    from precise_bn.caffe2.names import caffe2_to_torch

    model = model_helper.ModelHelper(name="zoo")
    for i in range(2):
        add_zoo_resnet(c2, model, "gpu_{}".format(i))
    set_params(c2, model, ["gpu_0", "gpu_1"], seed=5)
    blobs = {name[len("gpu_0/"):]: workspace.FetchBlob(name) for name in workspace.Blobs()
             if name.startswith("gpu_0/") and name.rsplit("_", 1)[-1] in ("w", "b", "s", "rm", "riv")}
    torch_model = TinyResNet()
    state, conversion = caffe2_to_torch(blobs, target=torch_model)
    assert conversion.ok, str(conversion)
    torch_model.load_state_dict(state, strict=False)
    feeds = two_device_data(3, seed=7, offsets=(0.5, -0.5))

    helper = BatchNormHelper(backend="caffe2", iters=3, num_gpus=2)
    helper.create_bn_aux_model(model, feeds)
    helper.compute_and_update_bn_stats()
    batches = [torch.from_numpy(f["gpu_{}/data".format(d)]) for f in feeds for d in range(2)]
    update_bn_stats(torch_model, batches, num_iters=None)

    modules = dict(torch_model.named_modules())
    for caffe2_layer, torch_name in conversion.mapped.items():
        if not caffe2_layer.endswith("_bn_rm"):
            continue
        rm, riv = fed(c2, "gpu_0", caffe2_layer[: -len("_bn_rm")])
        module = modules[torch_name.rsplit(".", 1)[0]]
        var = module.running_var.double().numpy()
        np.testing.assert_allclose(riv, var, rtol=1e-4, err_msg=caffe2_layer)
        np.testing.assert_allclose(rm, module.running_mean.double().numpy(), rtol=1e-4,
                                   atol=1e-4 * np.sqrt(var).max(), err_msg=caffe2_layer)


@pytest.mark.main_env
def test_backend_without_caffe2_says_how_to_get_it():
    import precise_bn.caffe2.backend  # noqa: F401 (importing the module never needs caffe2)

    assert "caffe2" not in sys.modules
    helper = BatchNormHelper(backend="caffe2", iters=2)
    with pytest.raises(BackendUnavailableError, match="torch==1.10.2"):
        helper.create_bn_aux_model(object())


# ---------------------------------------------------------------- exact path and untrusted channels


def shifted_data(iters, means, seed=3, sizes=(5, 3)):
    """One feed per iteration, two devices; channel c has std (1, 2, 0.5)[c] and mean ``means[c]``
    (plus a device offset of one std)."""
    rng = np.random.RandomState(seed)
    std = np.array([1.0, 2.0, 0.5]).reshape(1, 3, 1, 1)
    mean = np.asarray(means, np.float64).reshape(1, 3, 1, 1)
    feeds = []
    for _ in range(iters):
        feeds.append({"gpu_{}/data".format(d): (mean + (d + rng.randn(n, 3, 6, 6)) * std).astype(np.float32)
                      for d, n in enumerate(sizes)})
    return feeds


def aux_reference(c2, aux, feeds, inputs):
    """Float64 stats of every SpatialBN input as the aux net itself produces them (its exact
    path normalises shifted inputs, which changes the float32 rounding later layers see)."""
    ref = forward_reference(c2, aux.net, feeds, inputs)
    return {layer: tuple(torch.from_numpy(np.asarray(v, np.float64)) for v in values[:2])
            for layer, values in ref.items()}


@caffe2_env
@pytest.mark.parametrize("ratio", [1e2, 1e3, 3e3, 1e4])
def test_exact_meets_the_exact_bound_where_the_kernel_cannot(c2, ratio):
    """mean/std = ratio in every channel of the first layer: Caffe2's kernel loses the variance
    (NaN at 1e4); the exact path stays within 1e-7 of a float64 two-pass reference, on every
    layer, on both devices."""
    model, inputs = two_device_model(c2)
    feeds = shifted_data(3, ratio * np.array([1.0, -2.0, 0.5]))
    helper = BatchNormHelper(backend="caffe2", iters=3, num_gpus=2, exact=True)
    aux = helper.create_bn_aux_model(model, feeds)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PreciseBNWarning)
        report = helper.compute_and_update_bn_stats()
    assert report.estimator == "caffe2-exact" and report.batches == 3
    result = {(d, layer): fed(c2, d, layer) for d in ("gpu_0", "gpu_1") for layer in ("in", "conv1", "conv2")}
    ref = aux_reference(c2, aux, feeds, inputs)  # runs the net again: its SpatialBNs move the running stats
    for layer in ("in", "conv1", "conv2"):
        rm, riv = result["gpu_0", layer]
        other = result["gpu_1", layer]
        assert rm.tobytes() == other[0].tobytes() and riv.tobytes() == other[1].tobytes(), layer
        assert_close_exact(torch.from_numpy(rm), torch.from_numpy(riv), *ref[layer], layer)
        assert report[layer].untrusted == []
    assert result["gpu_0", "conv1"][1][2] == 0.0  # the dead channel
    data = np.concatenate([np.moveaxis(f[k], 1, 0).reshape(3, -1) for f in feeds for k in sorted(f)], 1)
    assert np.abs(ref["in"][0].numpy() / np.sqrt(ref["in"][1].numpy()) / ratio).min() > 0.4
    assert ref["in"][1].numpy() == pytest.approx(data.astype(np.float64).var(1), rel=1e-12)


@caffe2_env
def test_exact_reads_inputs_an_in_place_layer_overwrites(c2):
    core, workspace, brew, model_helper, cpu = c2
    model = model_helper.ModelHelper(name="inplace")
    plain = model_helper.ModelHelper(name="plain")
    for net in (model, plain):
        with core.DeviceScope(cpu):
            brew.conv(net, "data", "conv", 3, 4, 1)
    with core.DeviceScope(cpu):
        brew.spatial_bn(model, "conv", "conv", 4, epsilon=EPS, is_test=False)  # output over its input
        model.net.Relu("conv", "conv")
    workspace.RunNetOnce(model.param_init_net)
    workspace.FeedBlob("conv_b", np.full(4, 3e3, np.float32))
    rng = np.random.RandomState(4)
    feeds = [{"data": rng.randn(n, 3, 5, 5).astype(np.float32)} for n in (4, 2, 3)]
    helper = BatchNormHelper(backend="caffe2", iters=3, exact=True)
    helper.create_bn_aux_model(model, feeds)
    report = helper.compute_and_update_bn_stats()
    ref = forward_reference(c2, plain.net, feeds, [{"conv": "conv"}])["conv"]
    written = (workspace.FetchBlob("conv_rm"), workspace.FetchBlob("conv_riv"))
    assert_close_exact(*(torch.from_numpy(np.asarray(v, np.float64)) for v in written + ref[:2]), "conv")
    assert report["conv"].elements == 9 * 25


@caffe2_env
def test_without_exact_untrusted_channels_are_named_in_a_warning_and_the_report(c2):
    model, _ = two_device_model(c2)
    feeds = shifted_data(4, [0.0, 300.0, 0.25])  # channel 1: mean/std = 150
    helper = BatchNormHelper(backend="caffe2", iters=4, num_gpus=2)
    helper.create_bn_aux_model(model, feeds)
    with pytest.warns(PreciseBNWarning, match=r"in 1 layer\(s\).*in \(channels 1\).*exact=True"):
        report = helper.compute_and_update_bn_stats()
    assert report["in"].untrusted == [1] and report["conv1"].untrusted == report["conv2"].untrusted == []
    assert report.to_dict()["layers"][0]["untrusted"] == [1]
    # the flagged channel is where the kernel's variance is really off, the others are not
    _, riv = fed(c2, "gpu_0", "in")
    data = np.concatenate([np.moveaxis(f[k], 1, 0).reshape(3, -1) for f in feeds for k in sorted(f)], 1)
    rel = np.abs(riv - data.astype(np.float64).var(1)) / data.astype(np.float64).var(1)
    assert rel[1] > 10 * max(rel[0], rel[2]) and rel[0] < UNTRUSTED_RTOL and rel[2] < UNTRUSTED_RTOL


def _stats(mean, var, counts):
    stats = PopulationStats(len(mean))
    for n in counts:
        stats.add_call(torch.tensor(mean, dtype=torch.float64), torch.tensor(var, dtype=torch.float64), n)
    return stats


def test_untrusted_criterion_follows_mean_over_std_and_elements():
    # bound = 2 log2(n) 2^-24 (mean^2 + var) / var against 1e-3
    assert untrusted_channels(_stats([0.0, 25.0, 100.0, 0.0], [1.0, 1.0, 1.0, 0.0], [2 ** 10] * 3)) == [2]
    assert untrusted_channels(_stats([0.0, 25.0, 100.0, 0.0], [1.0, 1.0, 1.0, 0.0], [2 ** 20] * 3)) == [1, 2]
    assert untrusted_channels(_stats([5.0, 0.0], [0.0, 0.0], [64])) == [0]  # clamped: no variance left
    assert untrusted_channels(PopulationStats(3)) == []


@caffe2_env
@pytest.mark.parametrize("shape", [(4, 32, 16, 16), (8, 32, 4, 16, 16)])
def test_the_kernels_variance_error_stays_within_the_untrusted_bound(c2, shape):
    """Caffe2's own SpatialBN on channels of mean/std 1 to 300: the error of its variance never
    exceeds the bound :func:`untrusted_channels` uses, and the channels it names are those where
    the bound passes UNTRUSTED_RTOL."""
    core, workspace, _, _, _ = c2
    rng = np.random.RandomState(5)
    channels = shape[1]
    ratio = np.repeat([1.0, 10.0, 100.0, 300.0], channels // 4) * rng.choice([-1.0, 1.0], channels)
    std = np.exp(rng.randn(channels))
    view = [1, channels] + [1] * (len(shape) - 2)
    x = (rng.randn(*shape) * std.reshape(view) + (ratio * std).reshape(view)).astype(np.float32)
    workspace.FeedBlob("x", x)
    for name, value in (("s", 1.0), ("b", 0.0), ("rm", 0.0), ("riv", 1.0)):
        workspace.FeedBlob(name, np.full(channels, value, np.float32))
    workspace.RunOperatorOnce(core.CreateOperator("SpatialBN", ["x", "s", "b", "rm", "riv"],
                                                  ["y", "rm", "riv", "sm", "siv"], is_test=0, epsilon=EPS))
    mean, var, _ = decode_saved_stats(workspace.FetchBlob("sm"), workspace.FetchBlob("siv"), EPS)
    rows = np.moveaxis(x.astype(np.float64), 1, 0).reshape(channels, -1)
    stats = PopulationStats(channels)
    stats.add_call(mean, var, rows.shape[1])
    true_mean, true_var = rows.mean(1), rows.var(1)
    bound = 2 * math.log2(rows.shape[1]) * U32 * (true_mean ** 2 + true_var) / true_var
    assert np.all(np.abs(var.numpy() - true_var) / true_var <= bound)
    assert untrusted_channels(stats) == np.flatnonzero(bound > UNTRUSTED_RTOL).tolist() != []


def test_decode_saved_stats_recovers_variance_and_snaps_dead_channel():
    eps = 1e-5
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 50, generator=gen, dtype=torch.float64) * torch.tensor([[2.0], [0.01], [0.0]]) + 4
    mean, var = x.mean(1), x.var(1, unbiased=False)
    siv = (1.0 / torch.sqrt(var + eps)).float()
    got_mean, got_var, negative = decode_saved_stats(mean.float().numpy(), siv.numpy(), eps)
    assert got_var[2].item() == 0.0 and negative == 0
    # siv carries a float32 rounding: var + eps is known to ~2 float32 ulps.
    assert ((got_var - var).abs() <= 4 * 2.0 ** -24 * (var + eps)).all()
    assert torch.equal(got_mean, mean.float().double())


def test_decode_saved_stats_clamps_and_counts_negative_variances():
    eps = 1e-3
    siv = np.array([1.0 / (eps ** 0.5) * 1.01, 1.0], dtype=np.float32)  # 1/siv^2 < eps
    _, var, negative = decode_saved_stats(np.zeros(2, np.float32), siv, eps)
    assert var[0].item() == 0.0 and negative == 1
    assert var[1].item() == pytest.approx(1.0 - eps)


@caffe2_env
def test_operators_take_numpy_scalar_arguments(c2):
    """numpy >= 1.23 lacks np.asscalar, which Caffe2 1.10 calls for numpy scalar arguments."""
    core, workspace, _, _, _ = c2
    op = core.CreateOperator("ConstantFill", [], ["x"], shape=[2], value=np.float32(0.1), dtype=np.int32(1))
    workspace.RunOperatorOnce(op)
    assert workspace.FetchBlob("x").tolist() == [np.float32(0.1)] * 2
    from caffe2.python import data_parallel_model  # noqa: F401 (imports networkx through memonger)


# ---------------------------------------------------------------- the original helper's calls


def original_modules(monkeypatch, cfg, builder):
    """Stand-ins for video-nonlocal-net's ``core.config`` and ``models.model_builder_video``,
    registered where its training script's imports put them."""
    config = types.ModuleType("core.config")
    config.config = cfg
    models = types.ModuleType("models.model_builder_video")
    models.ModelBuilder = builder
    monkeypatch.setitem(sys.modules, "core.config", config)
    monkeypatch.setitem(sys.modules, "models.model_builder_video", models)


def original_config(iters=3, gpus=2):
    ns = types.SimpleNamespace
    return ns(TRAIN=ns(ITER_COMPUTE_PRECISE_BN=iters, DATA_TYPE="train"), NUM_GPUS=gpus, ROOT_GPU_ID=0,
              MODEL=ns(MODEL_NAME="resnet_video", BN_EPSILON=EPS), LOG_PERIOD=1, CUDNN_WORKSPACE_LIMIT=256)


@caffe2_env
def test_original_three_calls_work_after_changing_only_the_import(c2, monkeypatch):
    core, workspace, _, model_helper, cpu = c2
    train_model, inputs = two_device_model(c2)  # the training net, its parameters initialised
    clips = shifted_data(1, [1.0, -1.0, 0.5])[0]
    for name, value in clips.items():
        workspace.FeedBlob(name.replace("data", "clips"), value)
    built = []

    class ModelBuilder(model_helper.ModelHelper):
        """Builds the forward net with a reader op, as the original's builder does."""

        def __init__(self, **kwargs):
            built.append(kwargs)
            super().__init__(name=kwargs["name"])

        def build_model(self, node_id=0):
            built.append(node_id)
            for i in range(2):
                with core.DeviceScope(cpu), core.NameScope("gpu_{}".format(i)):
                    self.net.Copy("clips", "data")
                add_forward(c2, self, "gpu_{}".format(i))

    original_modules(monkeypatch, original_config(), ModelBuilder)
    from precise_bn import helper as bn_helper  # the one line a user of the original changes

    bn_aux = bn_helper.BatchNormHelper()
    bn_aux.create_bn_aux_model(node_id=1)
    report = bn_aux.compute_and_update_bn_stats(41)

    assert built == [dict(name="resnet_video_bn_aux", train=True, use_cudnn=True, cudnn_exhaustive_search=True,
                          ws_nbytes_limit=256 * 1024 * 1024, split="train", use_mem_cache=False,
                          force_fw_only=True), 1]
    assert report.batches == 3 and report.world_size == 1 and bn_aux.iters == 3
    result = {(d, layer): fed(c2, d, layer) for d in ("gpu_0", "gpu_1") for layer in ("in", "conv1", "conv2")}
    bn_aux.compute_and_update_bn_stats(41)
    assert bn_aux.recomputations == 1
    ref = forward_reference(c2, train_model.net, [clips], inputs)
    for layer in ("in", "conv1", "conv2"):
        rm, riv = result["gpu_0", layer]
        assert rm.tobytes() == result["gpu_1", layer][0].tobytes() and riv.tobytes() == result["gpu_1", layer][1].tobytes()
        assert_kernel_close(rm, riv, ref[layer], layer)
