"""zrw.convert and zrw.nn.hold_tied_weights take a `torch.compile(model)` wrapper as the model it
wraps: the weights get the model's own names (never `_orig_mod.`), the hooks convert installs
on the converted root are the model's (so a load through the model itself is all or nothing),
and training through the wrapper gives bit for bit what the uncompiled model gives."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zrw

BF16 = torch.bfloat16


pytestmark = pytest.mark.usefixtures("clean_cache")


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64)).to(BF16)


def test_convert_names_the_weights_as_the_model_does():
    model = _mlp()
    summary = zrw.convert(torch.compile(model, backend="eager"))
    assert summary.converted == ["0", "2"]
    assert summary.released_weights == ["0.weight", "2.weight"]
    assert zrw.cache.weight_name(model[0].weight) == "0.weight"
    assert isinstance(model[2], zrw.nn.MXLinear)


def test_a_load_into_the_model_of_a_converted_compiled_wrapper_is_all_or_nothing():
    model = _mlp()
    zrw.convert(torch.compile(model, backend="eager"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = dict(before)
    bad["0.bias"] = torch.zeros(96, dtype=BF16)  # valid, and first
    bad["2.weight"] = torch.zeros(3, 3, dtype=BF16)  # wrong shape
    with pytest.raises(RuntimeError, match="size mismatch for 2.weight"):
        model.load_state_dict(bad)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_training_a_compiled_converted_model_equals_the_model():
    def train(compile_it):
        model = _mlp()
        zrw.convert(torch.compile(model, backend="eager") if compile_it else model)
        run = torch.compile(model, backend="eager") if compile_it else model
        opt = zrw.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(8, 64, dtype=BF16, generator=torch.Generator().manual_seed(1))
        losses = []
        for _ in range(3):
            loss = run(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, {k: v.clone() for k, v in model.state_dict().items()}

    (a, wa), (b, wb) = train(False), train(True)
    assert a == b
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_hold_tied_weights_takes_a_compiled_model():
    model = _mlp()
    model[2].weight = nn.Parameter(torch.randn(64, 96, dtype=BF16))
    zrw.convert(model)
    model.tail = nn.Linear(96, 64, dtype=BF16)
    model.tail.weight = model[2].weight  # tied after convert
    compiled = torch.compile(model, backend="eager")
    assert zrw.nn.hold_tied_weights(compiled) == ["2.weight"]  # the model's own name
    with pytest.raises(TypeError, match="hold_tied_weights: model must be a torch.nn.Module"):
        zrw.nn.hold_tied_weights("model")
