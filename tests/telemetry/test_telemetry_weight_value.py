"""zrw.telemetry measures the weight value the layer quantizes, as zrw.cache decides it: a weight
that is not released is its storage (also right after a load_state_dict, before its FP32 master
has taken the loaded value), a released weight its FP32 master rounded to its dtype. And a
torch.compile wrapper is measured as the model it wraps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zrw
import zrw.telemetry as telemetry

BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn


pytestmark = pytest.mark.usefixtures("clean_cache")


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64)).to(BF16)


def _x():
    return torch.randn(8, 64, dtype=BF16, generator=torch.Generator().manual_seed(1))


def _step(model, opt):
    model(_x()).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _weight_stats(model, **kwargs):
    with telemetry.collect(model, tensors=("weight",), **kwargs) as tel:
        model(_x())
    return {layer: s for (layer, _, _), s in tel.stats().items()}


def _expected(value, recipe):
    return telemetry.quant_stats(value, -1, E4M3, recipe.scale_mode, recipe.block_32x32)


def _same(a, b):
    return (a.sqnr_db, a.saturated, a.flushed, a.elements) == (
        b.sqnr_db,
        b.saturated,
        b.flushed,
        b.elements,
    )


@pytest.mark.parametrize(
    "when,release",
    [
        ("before the first step", True),  # unreleased, its master not synced yet
        ("between steps", False),  # release off: never released
        ("between steps", True),  # BF16-free step: released, its master takes the load
    ],
)
def test_a_loaded_weight_is_measured_with_its_loaded_value(when, release):
    model = _mlp()
    zrw.convert(model, release=release)
    opt = zrw.optim.AdamW(model.parameters(), lr=1e-2)
    if when == "between steps":
        _step(model, opt)
        _step(model, opt)
    loaded = _mlp(seed=5).state_dict()
    model.load_state_dict(loaded)
    stats = _weight_stats(model)
    for layer in ("0", "2"):
        assert _same(stats[layer], _expected(loaded[f"{layer}.weight"], model[int(layer)].recipe))
    # What the layer actually quantized in that forward is the same value.
    for layer in ("0", "2"):
        w = model[int(layer)].weight
        value = zrw.cache.master_of(w).to(BF16) if zrw.cache.is_released(w) else w.detach().clone()
        assert torch.equal(value, loaded[f"{layer}.weight"])


def test_a_compiled_model_is_measured_as_the_model_it_wraps():
    model = _mlp()
    zrw.convert(model)
    opt = zrw.optim.AdamW(model.parameters(), lr=1e-2)  # (owned: released at its first use)
    compiled = torch.compile(model, backend="eager")
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    eager = _weight_stats(model)
    with telemetry.collect(compiled, layers="2") as tel:
        compiled(_x()).float().sum().backward()
    layers = {layer for layer, _, _ in tel.stats()}
    assert layers == {"2"}  # the model's own names, not "_orig_mod.2"
    assert {t for _, t, _ in tel.stats()} == {"weight", "weight_bwd", "activation", "gradient"}
    got = tel.stats()[("2", "weight", model[2].recipe.scale_mode)]
    assert _same(got, eager["2"])
    assert hooks == sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    opt.zero_grad()
