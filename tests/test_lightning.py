"""PreciseBNCallback in a real lightning.Trainer on CPU: validation and checkpoints share the stats."""
from __future__ import annotations

import copy
import importlib
import logging
import sys
from pathlib import Path

import lightning
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from precise_bn import BackendUnavailableError, BatchError, ConfigError, PreciseBNWarning, recompute
from precise_bn.data import smart_forward as default_forward
from precise_bn.lightning import PreciseBNCallback
import test_training_unchanged as unchanged
from factories import bn_stats, tiny_net
from reference import assert_close_exact, float64_reference

pytestmark = pytest.mark.main_env


class TinyNet(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = tiny_net()
        self.validated = {}  # global step -> BN stats seen by validation_step

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        if not self.trainer.sanity_checking:
            self.validated.setdefault(self.global_step, bn_stats(self.model))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


def loader(n: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 6, 6, generator=g) * 3 + 2
    return DataLoader(TensorDataset(x, torch.randint(0, 3, (n,), generator=g)), batch_size=8)


@pytest.mark.parametrize("attribute", [None, "model"])
def test_checkpoints_carry_the_stats_validation_used(tmp_path: Path, attribute):
    torch.manual_seed(0)
    net = TinyNet()
    used = {}  # global step -> batches of that recomputation

    def recording_forward(module, batch):
        used.setdefault(trainer.global_step, []).append(batch)
        return default_forward(module, batch)

    callback = PreciseBNCallback(num_batches=3, attribute=attribute, forward_fn=recording_forward)
    trainer = lightning.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        callbacks=[
            callback,
            ModelCheckpoint(dirpath=tmp_path / "epoch", save_top_k=-1),
            ModelCheckpoint(dirpath=tmp_path / "mid", every_n_train_steps=3, save_top_k=-1),
        ],
    )
    trainer.fit(net, loader(32, seed=1), loader(16, seed=2))

    # 4 steps per epoch: mid-epoch checkpoints at steps 3 and 6, validation + checkpoint at 4 and 8
    assert sorted(used) == [3, 4, 6, 8] and callback.hook.recomputations == 4
    assert sorted(net.validated) == [4, 8]
    files = sorted(tmp_path.glob("*/*.ckpt"))
    assert sorted(int(f.stem.split("step=")[1]) for f in files) == [3, 4, 6, 8]
    for path in files:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        step = checkpoint["global_step"]
        replay = TinyNet()
        replay.load_state_dict(checkpoint["state_dict"])
        saved = bn_stats(replay.model)
        assert len(used[step]) == 3
        recompute(replay.model, used[step])
        for name, (mean, var) in bn_stats(replay.model).items():
            assert torch.equal(saved[name][0], mean) and torch.equal(saved[name][1], var), (path, name)
            if step in net.validated:
                seen = net.validated[step][name]
                assert torch.equal(seen[0], mean) and torch.equal(seen[1], var), (path, name)
        for name, (mean, var, _) in float64_reference(replay.model, used[step]).items():
            assert_close_exact(saved[name][0], saved[name][1], mean, var, what="{} {}".format(path.name, name))


def test_stats_written_into_a_collected_copy_of_the_state_dict():
    """Strategies that gather copies: the callback must write its stats into the dict itself."""
    torch.manual_seed(0)
    net = TinyNet()
    trainer = lightning.Trainer(
        max_steps=2, accelerator="cpu", devices=1, enable_progress_bar=False, enable_model_summary=False,
        logger=False, enable_checkpointing=False, limit_val_batches=0,
    )
    callback = PreciseBNCallback(num_batches=2, data=loader(16, seed=3))
    trainer.fit(net, loader(16, seed=1))
    collected = copy.deepcopy(net.state_dict())
    checkpoint = {"state_dict": dict(collected)}
    callback.on_save_checkpoint(trainer, net, checkpoint)
    precise = bn_stats(net)
    assert precise.keys() == {"model.1", "model.5"}
    for name, (mean, var) in precise.items():
        assert torch.equal(checkpoint["state_dict"][name + ".running_mean"], mean)
        assert torch.equal(checkpoint["state_dict"][name + ".running_var"], var)
        assert not torch.equal(collected[name + ".running_var"], var)


def test_ddp_merges_every_rank_shard(tmp_path: Path):
    """Two spawned CPU ranks (gloo): each recomputes on its shard; the file holds the merged stats."""
    torch.manual_seed(0)
    train = loader(32, seed=1)  # 2 ranks x 2 batches of 8: each recomputation sees every sample
    trainer = lightning.Trainer(
        max_epochs=1, accelerator="cpu", devices=2, strategy="ddp_spawn", enable_progress_bar=False,
        enable_model_summary=False, logger=False, num_sanity_val_steps=0,
        callbacks=[PreciseBNCallback(num_batches=2), ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)],
    )
    trainer.fit(TinyNet(), train, loader(16, seed=2))
    (path,) = tmp_path.glob("*.ckpt")
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    replay = TinyNet()
    replay.load_state_dict(checkpoint["state_dict"])
    saved = bn_stats(replay.model)
    # Lightning's sampler shuffles the shards, so only the first BN layer, whose input does not
    # depend on which samples share a batch, can be replayed: over all 32 samples, not one shard.
    mean, var, count = float64_reference(replay.model, [x for x, _ in train], names=["1"])["1"]
    assert count == 32 * 4 * 4
    assert_close_exact(saved["1"][0], saved["1"][1], mean, var, what="merged layer 1")


def test_validate_without_training_data_leaves_the_stats_and_warns():
    net = TinyNet()
    before = bn_stats(net)
    trainer = lightning.Trainer(
        accelerator="cpu", devices=1, enable_progress_bar=False, enable_model_summary=False, logger=False,
        callbacks=[PreciseBNCallback(num_batches=2)],
    )
    with pytest.warns(PreciseBNWarning, match="no training dataloader"):
        trainer.validate(net, loader(16, seed=2), verbose=False)
    for name, (mean, var) in bn_stats(net).items():
        assert torch.equal(mean, before[name][0]) and torch.equal(var, before[name][1])


def test_options_are_checked_when_the_callback_is_built():
    with pytest.raises(ConfigError, match="min_batches"):
        PreciseBNCallback(min_batches=0)


def test_unknown_attribute_is_named():
    with pytest.raises(ConfigError, match="'backbone'"):
        PreciseBNCallback(attribute="backbone").target(TinyNet())


def test_falls_back_to_pytorch_lightning_then_names_the_install(monkeypatch):
    import pytorch_lightning

    import precise_bn

    monkeypatch.setattr(precise_bn, "lightning", sys.modules["precise_bn.lightning"])  # restored afterwards
    monkeypatch.delitem(sys.modules, "precise_bn.lightning")
    for name in ("lightning", "lightning.pytorch"):
        monkeypatch.setitem(sys.modules, name, None)
    fallback = importlib.import_module("precise_bn.lightning")
    assert issubclass(fallback.PreciseBNCallback, pytorch_lightning.Callback)

    monkeypatch.delitem(sys.modules, "precise_bn.lightning")
    monkeypatch.setitem(sys.modules, "pytorch_lightning", None)
    with pytest.raises(BackendUnavailableError, match="pip install"):
        importlib.import_module("precise_bn.lightning")


def fit_with_checkpoints(tmp_path: Path):
    """TinyNet fitted for 2 epochs (steps 4 and 8 validated and saved); the batches each
    recomputation read, by call."""
    torch.manual_seed(0)
    net = TinyNet()
    used = []

    def recording_forward(module, batch):
        used.append(batch)
        return default_forward(module, batch)

    callback = PreciseBNCallback(num_batches=3, forward_fn=recording_forward)
    trainer = lightning.Trainer(
        max_epochs=2, accelerator="cpu", devices=1, enable_progress_bar=False, enable_model_summary=False,
        logger=False, callbacks=[callback, ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)],
    )
    trainer.fit(net, loader(32, seed=1), loader(16, seed=2))
    return net, trainer, callback, used


def assert_validated_with_recomputed(module: TinyNet, batches) -> None:
    """What validation saw is what recompute gives the module's current weights on ``batches``."""
    replay = copy.deepcopy(module)
    recompute(replay.model, batches)
    expected = bn_stats(replay.model)
    (seen,) = module.validated.values()
    for name, (mean, var) in expected.items():
        assert torch.equal(seen[name][0], mean) and torch.equal(seen[name][1], var), name


def test_validate_a_checkpoint_after_fit_recomputes_for_its_weights(tmp_path: Path):
    net, trainer, callback, used = fit_with_checkpoints(tmp_path)
    fitted = bn_stats(net.model)
    (step4,) = tmp_path.glob("*step=4.ckpt")
    net.validated, used[:] = {}, []
    trainer.validate(net, loader(16, seed=2), ckpt_path=str(step4), verbose=False)
    assert trainer.global_step == 8 and len(used) == 3 and callback.hook.recomputations == 3
    assert_validated_with_recomputed(net, used)
    (seen,) = net.validated.values()
    assert not torch.equal(seen["1"][1], fitted["1"][1])  # not the stats cached at step 8


def test_validate_another_module_after_fit_recomputes_for_it(tmp_path: Path):
    net, trainer, callback, used = fit_with_checkpoints(tmp_path)
    (step4,) = tmp_path.glob("*step=4.ckpt")
    other = TinyNet.load_from_checkpoint(step4)
    used[:] = []
    trainer.validate(other, loader(16, seed=2), verbose=False)
    assert len(used) == 3 and callback.hook.model is other
    assert_validated_with_recomputed(other, used)
    assert not torch.equal(bn_stats(other.model)["1"][1], bn_stats(net.model)["1"][1])


def small_trainer(**kwargs) -> lightning.Trainer:
    settings = dict(max_steps=2, accelerator="cpu", devices=1, enable_progress_bar=False,
                    enable_model_summary=False, logger=False, num_sanity_val_steps=0)
    settings.update(kwargs)
    return lightning.Trainer(**settings)


@pytest.mark.parametrize("kwargs, match", [
    ({"attribute": "modle"}, "'modle'.*did you mean 'model'"),
    ({"layers": ["9"]}, "no module named '9'"),
    ({"attribute": "model", "layers": ["model.1"]}, "no module named 'model.1'.*did you mean '1'"),
])
def test_attribute_and_layers_fail_at_setup_before_training(kwargs, match):
    net = TinyNet()
    before = {name: p.detach().clone() for name, p in net.named_parameters()}
    trainer = small_trainer(callbacks=[PreciseBNCallback(num_batches=2, **kwargs)])
    with pytest.raises(ConfigError, match=match):
        trainer.fit(net, loader(16, seed=1), loader(8, seed=2))
    assert all(torch.equal(p, before[name]) for name, p in net.named_parameters())  # not one step trained


class DictNet(TinyNet):
    def forward(self, x):
        return self.model(x["image"])

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch), batch["label"])


class DictBatches(torch.utils.data.Dataset):
    def __init__(self, n: int):
        g = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(n, 3, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"image": self.x[i], "label": self.y[i]}


def test_a_dict_batch_without_forward_fn_is_a_batch_error():
    trainer = small_trainer(callbacks=[PreciseBNCallback(num_batches=2, attribute="model")],
                            val_check_interval=1)
    with pytest.raises(BatchError, match="'image'.*forward_fn"):
        trainer.fit(DictNet(), DataLoader(DictBatches(16), batch_size=8), loader(8, seed=2))


def test_a_training_loader_that_is_not_a_dataloader_is_refused_before_training():
    net = TinyNet()
    trainer = small_trainer(callbacks=[PreciseBNCallback(num_batches=2)])
    batches = [(x, y) for x, y in loader(16, seed=1)]

    class Stream:  # Lightning takes any iterable; iterating this one might well consume a stream
        def __iter__(self):
            return iter(batches)

    with pytest.raises(ConfigError, match="Stream, not a torch DataLoader.*pass data="):
        trainer.fit(net, Stream(), loader(8, seed=2))


def test_weights_only_checkpoints(tmp_path: Path):
    """At validation end they hold the validated stats; on a step count they do not, with a warning."""
    torch.manual_seed(0)
    net = TinyNet()
    callbacks = [PreciseBNCallback(num_batches=3),
                 ModelCheckpoint(dirpath=tmp_path / "val", save_weights_only=True, save_top_k=-1),
                 ModelCheckpoint(dirpath=tmp_path / "steps", save_weights_only=True, save_top_k=-1,
                                 every_n_train_steps=4)]
    trainer = small_trainer(max_steps=-1, max_epochs=2, callbacks=callbacks)
    with pytest.warns(PreciseBNWarning, match="weights-only.*step count"):
        trainer.fit(net, loader(32, seed=1), loader(16, seed=2))
    assert sorted(net.validated) == [4, 8]
    for path in sorted((tmp_path / "val").glob("*.ckpt")):
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        seen = net.validated[checkpoint["global_step"]]
        for name, (mean, var) in seen.items():
            assert torch.equal(checkpoint["state_dict"]["model." + name + ".running_var"], var), (path, name)
    stepped = torch.load(tmp_path / "steps" / "epoch=0-step=4.ckpt", map_location="cpu", weights_only=False)
    assert not torch.equal(stepped["state_dict"]["model.1.running_var"], net.validated[4]["1"][1])


class AugmentedLitNet(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = unchanged.make_net()
        self.samples_trained = 0

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.samples_trained += len(x)
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def augmented_run(with_callback: bool, workers: int) -> dict:
    unchanged.seed_all(0)
    module = AugmentedLitNet()
    train = DataLoader(unchanged.Augmented(48), batch_size=8, shuffle=True, num_workers=workers,
                       persistent_workers=workers > 0)
    val = DataLoader(unchanged.Augmented(16), batch_size=8)
    trainer = lightning.Trainer(
        max_epochs=2, accelerator="cpu", devices=1, enable_progress_bar=False, enable_model_summary=False,
        logger=False, enable_checkpointing=False, num_sanity_val_steps=0, val_check_interval=0.5,
        callbacks=[PreciseBNCallback(num_batches=2)] if with_callback else [],
    )
    trainer.fit(module, train, val)
    assert module.samples_trained == 2 * 48  # the training loop read every sample of both epochs
    if with_callback:
        assert trainer.callbacks[0].hook.recomputations == 4  # validation twice an epoch
    return {name: p.detach().clone() for name, p in module.named_parameters()}


@pytest.mark.parametrize("workers", [0, 1])
def test_lightning_run_unchanged_by_the_callback(workers):
    unchanged.assert_same_parameters(augmented_run(True, workers), augmented_run(False, workers))


def recorded_fit(tmp_path: Path, callbacks: list, max_epochs: int = 2, ours_first: bool = True):
    """TinyNet fitted with PreciseBNCallback(num_batches=3) and ``callbacks`` (after it, or
    before); the batches each recomputation read, by global step (those the module itself got)."""
    torch.manual_seed(0)
    net = TinyNet()
    used = {}

    def recording_forward(module, batch):
        if module is net:
            used.setdefault(trainer.global_step, []).append(batch)
        return default_forward(module, batch)

    callback = PreciseBNCallback(num_batches=3, forward_fn=recording_forward)
    trainer = lightning.Trainer(
        max_epochs=max_epochs, accelerator="cpu", devices=1, enable_progress_bar=False, enable_model_summary=False,
        logger=False, callbacks=[*([callback] + callbacks if ours_first else callbacks + [callback]),
                                 ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)],
    )
    trainer.fit(net, loader(32, seed=1), loader(16, seed=2))
    return net, trainer, callback, used


def assert_precise(state: dict, batches, what: str) -> None:
    """``state``'s BN statistics are the float64 population statistics of ``batches`` under its weights."""
    replay = TinyNet()
    replay.load_state_dict(state)
    for name, (mean, var, _) in float64_reference(replay.model, batches).items():
        assert_close_exact(state["model.{}.running_mean".format(name)], state["model.{}.running_var".format(name)],
                             mean, var, what="{} {}".format(what, name))


@pytest.mark.parametrize("ours_first", [True, False], ids=["callback-first", "averaging-first"])
def test_weight_averaging_validates_and_saves_the_average_with_its_own_statistics(tmp_path: Path, ours_first):
    """EMAWeightAveraging swaps the average in for validation, moves the trained weights to
    current_model_state in checkpoints (before or after this callback's on_save_checkpoint,
    by their order) and copies the average into the module when fit ends."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    averaging = EMAWeightAveraging(decay=0.5)
    net, trainer, callback, used = recorded_fit(tmp_path, [averaging], ours_first=ours_first)
    assert sorted(used) == [4, 8] and callback.hook.recomputations == 2
    for path in sorted(tmp_path.glob("*.ckpt")):
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        step = checkpoint["global_step"]
        averaged, trained = checkpoint["state_dict"], checkpoint["current_model_state"]
        assert not torch.equal(averaged["model.0.weight"], trained["model.0.weight"])
        assert_precise(averaged, used[step], "averaged, {}".format(path.name))
        assert_precise(trained, used[step], "trained, {}".format(path.name))
        for name, (mean, var) in net.validated[step].items():  # validation ran the average, with its stats
            assert torch.equal(averaged["model." + name + ".running_mean"], mean), (path, name)
            assert torch.equal(averaged["model." + name + ".running_var"], var), (path, name)
    # After fit the module holds the average, copied in through .data: validate() recomputes for it.
    net.validated, used_before = {}, dict(used)
    used.clear()
    trainer.validate(net, loader(16, seed=2), verbose=False)
    assert callback.hook.recomputations == 3 and len(used[8]) == 3
    assert_validated_with_recomputed(net, used[8])
    assert used_before.keys() == {4, 8}


def test_stochastic_weight_averaging_gets_statistics_for_the_averaged_weights(tmp_path: Path):
    """Lightning copies the SWA average into the module for one last epoch; the validation and
    the checkpoint after it get that module's statistics, recomputed."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
    net, trainer, callback, used = recorded_fit(tmp_path, [swa])
    last = max(tmp_path.glob("*.ckpt"), key=lambda p: torch.load(p, weights_only=False)["global_step"])
    checkpoint = torch.load(last, map_location="cpu", weights_only=False)
    step = checkpoint["global_step"]
    for (name, p), q in zip(net.named_parameters(), swa._average_model.parameters()):
        assert torch.equal(checkpoint["state_dict"][name], q.detach()), name  # the average, saved
    assert_precise(checkpoint["state_dict"], used[step], "SWA")
    for name, (mean, var) in net.validated[step].items():
        assert torch.equal(checkpoint["state_dict"]["model." + name + ".running_var"], var), name


def test_lines_go_to_lightnings_log(tmp_path: Path):
    from precise_bn.lightning import LOGGER

    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    LOGGER.addHandler(handler)
    try:
        recorded_fit(tmp_path, [], max_epochs=1)
    finally:
        LOGGER.removeHandler(handler)
    assert LOGGER.getEffectiveLevel() <= logging.INFO and LOGGER.name.startswith(lightning.pytorch.__name__)
    (computed, written) = lines
    assert computed.startswith("precise-bn: 2 BatchNorm layers, 3 batches (24 samples), world size 1")
    assert computed.endswith("; for the evaluation at step 4") and " s; stopped: num_batches" in computed
    assert written == "precise-bn: the checkpoint at step 4 gets the statistics recomputed for that step and " \
                      "those weights"
