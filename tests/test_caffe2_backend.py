"""The Caffe2 backend on real Caffe2 (caffe2 environment), and its absence (main environment).

Nets are laid out as data-parallel Caffe2 lays them out: one ``gpu_{i}`` name scope per device,
here on CPU device options. References are float64 over the BN inputs the test fetches itself
by running a forward net over the same feeds.
"""
from __future__ import annotations

import math
import multiprocessing
import sys

import numpy as np
import pytest
import torch
from torch import nn

from precise_bn import BatchNormHelper, update_bn_stats
from precise_bn.errors import BackendUnavailableError, ConfigError, LayerError, NonFiniteStatsError
from reference import _check, ulp32

caffe2_env = pytest.mark.caffe2_env
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
    assert feeds.taken == 3 and helper.runs == 1
    for d in ("gpu_0", "gpu_1"):
        rm, riv = fed(c2, d, "conv2")
        assert rm.tobytes() == first[d][0].tobytes() and riv.tobytes() == first[d][1].tobytes()
    helper.compute_and_update_bn_stats(curr_iter=8)
    assert feeds.taken == 6 and helper.runs == 2


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
        process.join(timeout=90)
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
