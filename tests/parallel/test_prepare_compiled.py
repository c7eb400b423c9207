"""The preparing calls that take a model take a `torch.compile(model)` wrapper as the model it
wraps: zrw.cache.restore_frozen, zrw.parallel.prepare and zrw.fsdp.prepare name the weights as
the model does (never with the wrapper's `_orig_mod.` prefix). One process, no process group:
the weights are plain tensors (parallel.prepare lists them as "local")."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zrw
import zrw.fsdp

BF16 = torch.bfloat16


pytestmark = pytest.mark.usefixtures("clean_cache")


def _converted(**kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64)).to(BF16)
    zrw.convert(model, **kwargs)
    return model


def test_restore_frozen_takes_a_compiled_model():
    model = _converted(release_frozen=True)
    for p in model.parameters():
        p.requires_grad_(False)
    model(torch.randn(4, 64, dtype=BF16))
    assert zrw.cache.cache_stats()["frozen"] == 2
    assert zrw.cache.restore_frozen(torch.compile(model, backend="eager")) == 2
    assert zrw.cache.cache_stats()["frozen"] == 0


def test_parallel_prepare_names_the_weights_of_a_compiled_model_as_the_model():
    model = _converted()
    summary = zrw.parallel.prepare(torch.compile(model, backend="eager"))
    assert sorted(summary.weights) == ["0.weight", "2.weight"]


def test_fsdp_prepare_names_the_weights_of_a_compiled_model_as_the_model():
    model = _converted()
    assert zrw.fsdp.prepare(torch.compile(model, backend="eager")) == 2
    assert "'0.weight'" in repr(model[0].weight.data)
