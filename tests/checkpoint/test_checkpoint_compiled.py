"""Every zrw.checkpoint function that takes a model takes a `torch.compile(model)` wrapper as
the model it wraps (its `_orig_mod`): the same names (never the wrapper's `_orig_mod.` prefix)
and the same bytes as the model itself, so a checkpoint or an MX export of a compiled model
loads into an uncompiled one and back."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchao")
safetensors = pytest.importorskip("safetensors.torch")

from torchao.prototype.mx_formats.mx_tensor import MXTensor  # noqa: E402

import zrw  # noqa: E402
from helpers.models import HF_QWEN3, make_model  # noqa: E402
from zrw import checkpoint  # noqa: E402


def u8(t):
    return t.contiguous().view(torch.uint8)


@pytest.fixture(scope="module")
def trained():
    """A converted tiny Qwen3 after one BF16-free step (its weights released), and a compiled
    wrapper of it."""
    zrw.cache.cache_clear()
    model = make_model(seed=0, **HF_QWEN3)
    zrw.convert(model)
    opt = zrw.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    yield model, torch.compile(model, backend="eager")
    del opt
    zrw.cache.cache_clear()


def test_iter_state_dict_and_save_safetensors(trained, tmp_path):
    model, compiled = trained
    ref = dict(checkpoint.iter_state_dict(model))
    got = dict(checkpoint.iter_state_dict(compiled))
    assert list(got) == list(ref) and not any(k.startswith("_orig_mod") for k in got)
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    checkpoint.save_safetensors(model, tmp_path / "model.safetensors")
    checkpoint.save_safetensors(compiled, tmp_path / "compiled.safetensors")
    assert (tmp_path / "model.safetensors").read_bytes() == (
        tmp_path / "compiled.safetensors"
    ).read_bytes()


def test_export_mx_and_iter_mx_state_dict(trained, tmp_path):
    model, compiled = trained
    ref = checkpoint.export_mx(model)
    got = checkpoint.export_mx(compiled)
    assert list(got) == list(ref)
    assert [k for k, _ in checkpoint.iter_mx_state_dict(compiled)] == list(ref)
    for k, t in ref.items():
        if isinstance(t, MXTensor):
            assert torch.equal(u8(got[k].qdata), u8(t.qdata)), k
        else:
            assert torch.equal(got[k], t), k
    checkpoint.export_mx(model, tmp_path / "model.safetensors")
    checkpoint.export_mx(compiled, tmp_path / "compiled.safetensors")
    assert (tmp_path / "model.safetensors").read_bytes() == (
        tmp_path / "compiled.safetensors"
    ).read_bytes()


def test_load_mx_into_a_compiled_model(trained, tmp_path):
    model, _ = trained
    checkpoint.export_mx(model, tmp_path / "mx.safetensors")
    fresh = torch.compile(make_model(seed=5, **HF_QWEN3), backend="eager")
    assert checkpoint.load_mx(fresh, tmp_path / "mx.safetensors") is fresh
    weight = fresh._orig_mod.model.layers[0].mlp.up_proj.weight
    assert isinstance(weight, MXTensor)


def test_save_mx_pretrained(trained, tmp_path):
    model, compiled = trained
    checkpoint.save_mx_pretrained(model, tmp_path / "model")
    checkpoint.save_mx_pretrained(compiled, tmp_path / "compiled")
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        assert (tmp_path / "model" / name).read_bytes() == (
            tmp_path / "compiled" / name
        ).read_bytes()
    cfg = json.loads((tmp_path / "compiled" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "torchao"
