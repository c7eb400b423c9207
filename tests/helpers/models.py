"""Tiny Hugging Face models, the one factory every test and rank worker builds them with
(make_model), and their training under zrw.optim.MasterWeights(AdamW) with the optimizer boundary
attached (setup, train). Tiny Qwen3 (dense) and Qwen3-MoE models are built from configs
(transformers model classes, seeded random init, BF16 — no download). Importing this module skips
the importing test module when transformers is not installed."""

import warnings

import pytest
import torch

import zrw
from helpers.bitwise import same_bits

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.modeling_layers import GradientCheckpointingLayer  # noqa: E402

RECIPES = ["mxfp8", "mxfp8-32x32"]
KINDS = ["dense", "moe"]
BF16 = torch.bfloat16
VOCAB = 128


def make_model(
    kind="dense",
    seed=0,
    tie=False,
    vocab=VOCAB,
    hidden=64,
    layers=2,
    *,
    heads=2,
    kv_heads=1,
    head_dim=32,
    ffn=96,
    moe_ffn=48,
    experts=4,
    dtype=BF16,
    **config,
):
    """The tests' one tiny Qwen3 ("dense") / Qwen3-MoE ("moe") factory: by default 2 layers,
    hidden 64, 2 query heads and 1 KV head of 32, an MLP of 96, and for MoE 4 experts of 48 (top
    2) in every layer. Same seed, same weights. `config` sets (or overrides) fields of the
    transformers config; `dtype=None` keeps the constructor's FP32 (for callers that cast
    parts)."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn)
    cfg.update(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    cfg.update(num_hidden_layers=layers, max_position_embeddings=64, tie_word_embeddings=tie)
    if kind == "dense":
        model = Qwen3ForCausalLM(Qwen3Config(**{**cfg, **config}))
    else:
        cfg.update(moe_intermediate_size=moe_ffn, num_experts=experts, num_experts_per_tok=2)
        cfg.update(decoder_sparse_step=1)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**cfg, **config}))
    if dtype is not None:
        model = model.to(dtype)
    return model.train()


# The Hugging Face integration tests' Qwen3 (tests/hf, tests/checkpoint): 4 query heads and 2 KV
# heads of 16, an MLP of 128: make_model("dense", **HF_QWEN3).
HF_QWEN3 = dict(heads=4, kv_heads=2, head_dim=16, ffn=128)


def enable_checkpointing(model, mode):
    """HF activation checkpointing of every decoder layer (GradientCheckpointingLayer)."""
    kw = {"use_reentrant": mode == "reentrant"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecated alias, if it is the one
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(kw)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    layers = model.model.layers
    assert all(
        isinstance(layer, GradientCheckpointingLayer) and layer.gradient_checkpointing
        for layer in layers
    )


def make_batches(steps, micro, seed=1, batch=2, seq=16, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    return [
        [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(micro)]
        for _ in range(steps)
    ]


def setup(kind, recipe, release=True, ckpt=None, lr=1e-3, seed=0, **model_kw):
    model = make_model(kind, seed=seed, **model_kw)
    summary = zrw.convert(model, recipe, release=release)
    if ckpt is not None:
        enable_checkpointing(model, ckpt)
    opt = zrw.optim.attach(zrw.optim.MasterWeights(torch.optim.AdamW, model.parameters(), lr=lr))
    return model, opt, summary


def train(model, opt, batches, after_backward=None):
    """Steps of microbatches (the mean of their losses), then the optimizer; returns every
    microbatch's loss (fp32, bitwise comparable)."""
    losses = []
    for s, step in enumerate(batches):
        for i, ids in enumerate(step):
            loss = model(input_ids=ids, labels=ids).loss
            (loss / len(step)).backward()
            losses.append(loss.detach().clone())
            if after_backward is not None:
                after_backward(s, i)
        opt.step()
        opt.zero_grad()
    return torch.stack(losses)


def weights(model):
    """Every parameter's value, read through state_dict(): a weight released by the BF16-free
    step is materialized from its master there."""
    sd = model.state_dict()
    return {n: sd[n].detach().clone() for n, _ in model.named_parameters()}


def assert_same_weights(a, b, what):
    assert a.keys() == b.keys()
    bad = [n for n in a if not same_bits(a[n], b[n])]
    assert not bad, f"{what}: weights differ in {bad}"
