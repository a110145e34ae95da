"""The Caffe2 backend on real Caffe2 (caffe2 environment), and its absence (main environment).

Nets are laid out as data-parallel Caffe2 lays them out: one ``gpu_{i}`` name scope per device,
here on CPU device options. References are float64 over the BN inputs the test fetches itself
by running a forward net over the same feeds.
"""
from __future__ import annotations

import multiprocessing
import sys
import types
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from precise_bn import BatchNormHelper, update_bn_stats
from precise_bn.errors import BackendUnavailableError, ConfigError, LayerError, NonFiniteStatsError, PreciseBNWarning
from reference import assert_close_exact

caffe2_env = pytest.mark.caffe2_env
# Caffe2's own modules use numpy aliases and inspect functions that are deprecated; ours are not.
pytestmark = pytest.mark.filterwarnings(r"ignore::DeprecationWarning:caffe2\.python")
EPS = 1e-5


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
    """Run ``net`` on every feed, keep each layer's BN input on every device, and return each
    layer's float64 two-pass ``(mean, biased var)`` over all of them."""
    _, workspace, _, _, _ = c2
    parts = {layer: [] for layer in inputs_by_device[0]}
    for feed in feeds:
        for name, value in feed.items():
            workspace.FeedBlob(name, value)
        workspace.RunNetOnce(net)
        for inputs in inputs_by_device:
            for layer, blob in inputs.items():
                x = workspace.FetchBlob(blob).astype(np.float64)
                parts[layer].append(np.moveaxis(x, 1, 0).reshape(x.shape[1], -1))
    return {layer: two_pass(np.concatenate(chunks, axis=1)) for layer, chunks in parts.items()}


def two_pass(rows):
    """Float64 mean and biased variance of each row, the mean subtracted before squaring."""
    mean = rows.mean(axis=1)
    return mean, ((rows - mean[:, None]) ** 2).mean(axis=1)


def assert_exact(mean, var, ref, what):
    """The float64 reference, within the exact bound, as float32 buffers hold it."""
    assert mean.dtype == np.float32 and var.dtype == np.float32, what
    assert_close_exact(torch.from_numpy(mean), torch.from_numpy(var),
                       *(torch.from_numpy(np.asarray(v, np.float64)) for v in ref[:2]), what)


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


def no_warning_of_ours(run):
    """``run()``'s result; it must draw no warning (Caffe2's own deprecation warnings aside)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run()
    assert [str(w.message) for w in caught if "caffe2" not in w.filename] == []
    return result


@caffe2_env
def test_two_devices_match_float64_reference_and_agree(c2):
    """An ordinary run: exact on every layer (a dead channel at exactly 0), identical bits on
    both devices, and not one warning."""
    model, inputs = two_device_model(c2)
    feeds = two_device_data(6)
    helper = BatchNormHelper(backend="caffe2", iters=6, num_gpus=2, root_gpu_id=0,
                             device_prefix="gpu", bn_epsilon=EPS, log_period=2)
    helper.create_bn_aux_model(model, feeds)
    report = no_warning_of_ours(lambda: helper.compute_and_update_bn_stats(curr_iter=100))
    result = {layer: fed(c2, "gpu_0", layer) for layer in ("in", "conv1", "conv2")}
    for layer, (rm, riv) in result.items():
        other = fed(c2, "gpu_1", layer)
        assert rm.dtype == np.float32 and riv.dtype == np.float32
        assert rm.tobytes() == other[0].tobytes() and riv.tobytes() == other[1].tobytes(), layer
    ref = forward_reference(c2, model.net, feeds, inputs)
    for layer, (rm, riv) in result.items():
        assert_exact(rm, riv, ref[layer], layer)
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
@pytest.mark.parametrize("poison", ["nan", "cancel"])
def test_non_finite_inputs_refused_naming_where_and_nothing_fed(c2, poison):
    """gpu_1's data at iteration 3 holds a NaN ("nan": layer "in" reads it), or has mean 1e4
    with std ~1 ("cancel"): "in" is measured exactly, but Caffe2's float32 kernel of "in"
    computes E[x^2]-E[x]^2 below -eps and outputs NaN, which conv1 reads; the error says so."""
    model, _ = two_device_model(c2)
    before = {(d, layer): fed(c2, d, layer) for d in ("gpu_0", "gpu_1") for layer in ("in", "conv1", "conv2")}
    feeds = two_device_data(4, huge=(2, 1e4) if poison == "cancel" else None)
    if poison == "nan":
        feeds[2]["gpu_1/data"][1, 2, 3, 4] = np.nan
    helper = BatchNormHelper(backend="caffe2", iters=4, num_gpus=2)
    helper.create_bn_aux_model(model, feeds)
    with pytest.raises(NonFiniteStatsError) as info:
        helper.compute_and_update_bn_stats(curr_iter=1)
    message = str(info.value)
    assert "'gpu_1'" in message and "iteration 3 of 4" in message
    if poison == "nan":
        assert "layer 'in'" in message and "channels [2]" in message and "cancelled" not in message
    else:
        assert "layer 'conv1'" in message and "kernel of 'in' cancelled" in message
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
    assert kinds == {"SpatialBN", "Conv", "Relu"}
    assert all(a.i == 0 for op in aux.net.op if op.type == "SpatialBN" for a in op.arg if a.name == "is_test")
    helper.compute_and_update_bn_stats()
    for name, value in weights.items():
        assert workspace.FetchBlob(name).tobytes() == value.tobytes(), "{} was updated".format(name)
    result = {layer: fed(c2, "", layer) for layer in inputs}
    ref = forward_reference(c2, forward.net, feeds, [inputs])
    for layer, (rm, riv) in result.items():
        assert_exact(rm, riv, ref[layer], layer)


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
    ref = two_pass(x)
    assert report["video"].elements == x.shape[1]
    assert_exact(*fed(c2, "", "video"), ref, order)


@caffe2_env
def test_layout_errors_name_what_is_wrong(c2):
    core, _, brew, model_helper, cpu = c2
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
    shared = model_helper.ModelHelper(name="shared")
    with core.DeviceScope(cpu):
        brew.spatial_bn(shared, "data", "twice_bn", 3, epsilon=EPS, is_test=False)
        shared.net.SpatialBN(["twice_bn", "twice_bn_s", "twice_bn_b", "twice_bn_rm", "twice_bn_riv"], ["again"],
                             epsilon=EPS, is_test=1)
    with pytest.raises(LayerError, match="'twice' on device '<unscoped>' runs more than once"):
        BatchNormHelper(backend="caffe2", iters=1).create_bn_aux_model(shared)
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
    # then rank 1 alone meets a batch of mean 1e4 on which the float32 kernel of "in" outputs NaN,
    # which conv1 reads: every rank must raise
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
    path = str(out_dir / "rank{}.npz".format(rank))
    np.savez(path, world_size=report.world_size, samples=report.samples, error=error,
             unchanged=unchanged, **stats)
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
        assert_exact(results[0][layer + "_rm"], results[0][layer + "_riv"], ref[layer], layer)
    for result in results:
        assert int(result["world_size"]) == world and int(result["samples"]) == sum(map(sum, RANK_BATCHES))
        assert bool(result["unchanged"])
    assert [str(r["error"]) for r in results] == ["DistributedError", "NonFiniteStatsError"]


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


# ---------------------------------------------------------------- far means, in-place layers, the float32 write


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


@caffe2_env
@pytest.mark.parametrize("ratio", [1e2, 1e3])
def test_exact_where_the_kernels_own_statistics_are_not(c2, ratio):
    """mean/std = ratio in every channel of the first layer: the variance Caffe2's float32
    kernel saves is off by far more than 1e-7 there, but what is written is within 1e-7 of a
    float64 two-pass reference on every layer and both devices, with no warning; ``exact=True``
    is accepted and changes no bit."""
    _, workspace, _, _, _ = c2
    model, inputs = two_device_model(c2)
    feeds = shifted_data(3, ratio * np.array([1.0, -2.0, 0.5]))
    helper = BatchNormHelper(backend="caffe2", iters=3, num_gpus=2)
    helper.create_bn_aux_model(model, feeds)
    report = no_warning_of_ours(helper.compute_and_update_bn_stats)
    assert report.estimator == "caffe2" and report.batches == 3
    result = {(d, layer): fed(c2, d, layer) for d in ("gpu_0", "gpu_1") for layer in ("in", "conv1", "conv2")}
    with pytest.warns(DeprecationWarning, match="exact is deprecated and ignored"):
        exact = BatchNormHelper(backend="caffe2", iters=3, num_gpus=2, exact=True)
    exact.create_bn_aux_model(model, feeds)
    exact.compute_and_update_bn_stats()
    for (d, layer), (rm, riv) in result.items():
        again = fed(c2, d, layer)
        assert rm.tobytes() == again[0].tobytes() and riv.tobytes() == again[1].tobytes(), (d, layer)
    ref = forward_reference(c2, model.net, feeds, inputs)  # runs the net: its SpatialBNs move the running stats
    for layer in ("in", "conv1", "conv2"):
        rm, riv = result["gpu_0", layer]
        other = result["gpu_1", layer]
        assert rm.tobytes() == other[0].tobytes() and riv.tobytes() == other[1].tobytes(), layer
        assert_exact(rm, riv, ref[layer], layer)
    assert result["gpu_0", "conv1"][1][2] == 0.0  # the dead channel
    # the last call's own variance, as the kernel saved it, against the same call's input
    x = np.moveaxis(feeds[-1]["gpu_1/data"].astype(np.float64), 1, 0).reshape(3, -1)
    kernel_var = 1.0 / workspace.FetchBlob("gpu_1/in_bn_siv").astype(np.float64) ** 2 - EPS
    assert np.max(np.abs(kernel_var / x.var(1) - 1)) > 1e-5
    assert np.abs(ref["in"][0] / np.sqrt(ref["in"][1]) / ratio).min() > 0.4


def far_channels(rng, shape, axis, jump=False):
    """float32 data with channels on ``axis``: mean/std 1e4 and -1e4 (std 1 and 3e-3), a
    channel constant at 3.7 (dead, but not 0), and one constant at 3.7 but, with ``jump``, for
    one element."""
    view = [1] * len(shape)
    view[axis] = 4
    x = rng.randn(*shape) * np.array([1.0, 3e-3, 0.0, 0.0]).reshape(view)
    x = x + np.array([1e4, -30.0, 3.7, 3.7]).reshape(view)
    if jump:
        rare = np.moveaxis(x, axis, 0)[3]
        rare[tuple(rng.randint(n) for n in rare.shape)] = 250.0
    return x.astype(np.float32)


@caffe2_env
@pytest.mark.parametrize("order,shape", [("NCHW", (4, 5, 5)), ("NHWC", (5, 5, 4)), ("NCHW", (4, 2, 5, 5))])
def test_far_means_dead_channels_and_ragged_batches_written_correctly_rounded(c2, order, shape):
    """One SpatialBN on two devices fed 1 to 6 samples a call: each written statistic is the
    float64 two-pass one over every element, rounded to nearest float32, bit for bit; the dead
    channel's variance is exactly 0. (The kernel's own output is NaN here; nothing reads it.)"""
    core, workspace, brew, model_helper, cpu = c2
    model = model_helper.ModelHelper(name="far")
    for device in ("gpu_0", "gpu_1"):
        with core.DeviceScope(cpu), core.NameScope(device):
            brew.spatial_bn(model, "data", "far_bn", 4, epsilon=EPS, is_test=False, order=order)
    workspace.RunNetOnce(model.param_init_net)
    rng = np.random.RandomState(6)
    axis = 1 if order == "NCHW" else -1
    sizes = ((1, 6), (4, 2), (3, 5), (6, 1))
    feeds = [{"gpu_{}/data".format(d): far_channels(rng, (n,) + shape, axis, jump=(i, d) == (2, 1))
              for d, n in enumerate(pair)} for i, pair in enumerate(sizes)]
    helper = BatchNormHelper(backend="caffe2", iters=len(feeds), num_gpus=2)
    helper.create_bn_aux_model(model, feeds)
    report = no_warning_of_ours(helper.compute_and_update_bn_stats)
    x = np.concatenate([np.moveaxis(f[k].astype(np.float64), axis, 0).reshape(4, -1) for f in feeds for k in f], 1)
    mean, var = two_pass(x)
    assert report["far"].elements == x.shape[1] and report.samples == sum(map(sum, sizes))
    for device in ("gpu_0", "gpu_1"):
        rm, riv = fed(c2, device, "far")
        assert rm.tobytes() == mean.astype(np.float32).tobytes(), (device, rm - mean)
        assert riv.tobytes() == var.astype(np.float32).tobytes(), (device, riv / var - 1)
    assert var[2] == 0.0 and var[3] > 0


@caffe2_env
def test_statistics_that_underflow_float32_are_said_and_written_as_0(c2):
    """A channel of std 1e-26 has a variance near 1e-52, below float32's smallest subnormal: it is
    written as 0 (the float64 value rounded to nearest, as every other), and a warning names the
    layer."""
    core, workspace, brew, model_helper, cpu = c2
    model = model_helper.ModelHelper(name="tiny")
    with core.DeviceScope(cpu):
        brew.spatial_bn(model, "data", "tiny_bn", 3, epsilon=EPS, is_test=False)
    workspace.RunNetOnce(model.param_init_net)
    rng = np.random.RandomState(7)
    scale = np.array([1.0, 1e-26, 1e-21]).reshape(1, 3, 1, 1)
    feeds = [{"data": (rng.randn(4, 3, 5, 5) * scale).astype(np.float32)} for _ in range(2)]
    helper = BatchNormHelper(backend="caffe2", iters=2)
    helper.create_bn_aux_model(model, feeds)
    with pytest.warns(PreciseBNWarning, match=r"\btiny\b.*\de-5[23]"):
        helper.compute_and_update_bn_stats()
    _, riv = fed(c2, "", "tiny")
    x = np.concatenate([np.moveaxis(f["data"].astype(np.float64), 1, 0).reshape(3, -1) for f in feeds], 1)
    var = two_pass(x)[1]
    assert riv.tobytes() == var.astype(np.float32).tobytes() and riv[1] == 0.0 and 0 < riv[2] < 1.2e-38


@caffe2_env
def test_inputs_that_later_ops_overwrite_in_place_are_measured(c2):
    """conv -> SpatialBN in place (its output over its input) -> ReLU in place -> a second
    SpatialBN: both layers' inputs are measured as they were when each layer read them, against
    a reference net built without in-place ops."""
    core, workspace, brew, model_helper, cpu = c2
    model = model_helper.ModelHelper(name="inplace")
    with core.DeviceScope(cpu):
        brew.conv(model, "data", "conv", 3, 4, 1)
        brew.spatial_bn(model, "conv", "conv", 4, epsilon=EPS, is_test=False)
        model.net.Relu("conv", "conv")
        brew.spatial_bn(model, "conv", "second", 4, epsilon=EPS, is_test=False)
    workspace.RunNetOnce(model.param_init_net)
    workspace.FeedBlob("conv_b", np.full(4, 3e2, np.float32))
    plain = core.Net("plain")
    with core.DeviceScope(cpu):
        plain.Conv(["data", "conv_w", "conv_b"], "c", kernel=1)
        plain.SpatialBN(["c", "conv_s", "conv_b", "conv_rm", "conv_riv"], ["n", "conv_rm", "conv_riv", "sm", "siv"],
                        epsilon=EPS, is_test=0)
        plain.Relu("n", "r")
    rng = np.random.RandomState(4)
    feeds = [{"data": rng.randn(n, 3, 5, 5).astype(np.float32)} for n in (4, 2, 3)]
    helper = BatchNormHelper(backend="caffe2", iters=3)
    aux = helper.create_bn_aux_model(model, feeds)
    assert [op.type for op in aux.net.op] == ["Conv", "SpatialBN", "Relu", "SpatialBN"]
    report = helper.compute_and_update_bn_stats()
    written = {layer: (workspace.FetchBlob(layer + "_rm"), workspace.FetchBlob(layer + "_riv"))
               for layer in ("conv", "second")}
    ref = forward_reference(c2, plain.Proto(), feeds, [{"conv": "c", "second": "r"}])
    for layer, (rm, riv) in written.items():
        assert_exact(rm, riv, ref[layer], layer)
    assert report["conv"].elements == report["second"].elements == 9 * 25
    assert ref["second"][0].min() > 0.1  # the ReLU's output, not its input


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
    from precise_bn import bn_helper  # the one line a user of the original changes

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
        assert_exact(rm, riv, ref[layer], layer)
