"""timm models, whose BN layers are timm's own subclasses (``BatchNormAct2d`` runs its own
forward: normalisation, then activation), recomputed against the float64 reference."""
from __future__ import annotations

import pytest
import timm
import torch

from precise_bn import recompute
from reference import assert_close_exact, float64_reference

pytestmark = pytest.mark.main_env


@pytest.mark.parametrize("name", ["efficientnet_b0", "resnet18"])
def test_timm_model_matches_the_float64_reference(name):
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 3, 48, 48, generator=gen) for _ in range(3)]
    reference = float64_reference(model, batches)
    report = recompute(model, batches)
    modules = dict(model.named_modules())
    kinds = {type(modules[layer.name]).__name__ for layer in report.layers}
    assert len(report.layers) == len(reference) > 10
    if name == "efficientnet_b0":
        assert kinds == {"BatchNormAct2d"}
    for layer_name, (ref_mean, ref_var, count) in reference.items():
        module = modules[layer_name]
        assert_close_exact(module.running_mean, module.running_var, ref_mean, ref_var, layer_name)
        assert report[layer_name].elements == count
    assert all(type(m).__name__ in kinds | {"BatchNorm2d"} for m in model.modules() if hasattr(m, "running_mean"))
