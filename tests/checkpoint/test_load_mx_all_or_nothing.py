"""zrw.checkpoint.load_mx is all or nothing, as a converted model's load_state_dict: a file that
does not match the model (another shape, an entry missing on either side) raises an error that
names each mismatch, and the model is left exactly as it was (no entry written, no MX weight
installed)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torchao")

from torchao.prototype.mx_formats.mx_tensor import MXTensor  # noqa: E402

import zrw  # noqa: E402
from helpers.models import HF_QWEN3, make_model  # noqa: E402
from zrw.checkpoint import export_mx, load_mx  # noqa: E402


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A converted tiny Qwen3 (vocabulary 128, 2 layers) exported as MX."""
    model = make_model(seed=0, **HF_QWEN3)
    zrw.convert(model)
    path = tmp_path_factory.mktemp("mx") / "model.safetensors"
    export_mx(model, path)
    yield path
    del model
    zrw.cache.cache_clear()


def snapshot(model):
    return {n: (type(t), t.detach().clone()) for n, t in model.state_dict(keep_vars=True).items()}


def assert_unchanged(model, before):
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(before)
    for name, (kind, value) in before.items():
        assert type(after[name]) is kind and not isinstance(after[name], MXTensor), name
        assert torch.equal(after[name].detach(), value), name


@pytest.mark.parametrize(
    "config,names",
    [
        # The converted layers match, the embeddings and the head (kept in BF16) do not: torch
        # alone would write the norms first and then raise on the embeddings.
        (dict(vocab_size=256), ["model.embed_tokens.weight", "lm_head.weight"]),
        # One decoder layer more: its entries are missing from the file.
        (dict(num_hidden_layers=3), ["model.layers.2."]),
        # One decoder layer fewer: the file holds entries (MX and plain) the model has not.
        (dict(num_hidden_layers=1), ["model.layers.1."]),
    ],
    ids=["other-vocabulary", "more-layers", "fewer-layers"],
)
def test_a_file_of_another_shape_changes_nothing(exported, config, names):
    model = make_model(seed=3, **{**HF_QWEN3, **config})
    before = snapshot(model)
    with pytest.raises(ValueError, match="does not match model") as e:
        load_mx(model, exported)
    for name in names:
        assert name in str(e.value)
    assert_unchanged(model, before)


def test_a_matching_file_still_loads(exported):
    model = make_model(seed=3, **HF_QWEN3)
    assert load_mx(model, exported) is model
    assert isinstance(model.model.layers[0].mlp.up_proj.weight, MXTensor)
    compiled = torch.compile(make_model(seed=4, **HF_QWEN3), backend="eager")
    assert load_mx(compiled, exported) is compiled  # a compiled model: its model is loaded
    assert isinstance(compiled._orig_mod.model.layers[0].mlp.up_proj.weight, MXTensor)
