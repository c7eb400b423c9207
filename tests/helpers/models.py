"""Tiny Hugging Face models converted with zrw.convert and trained under
zrw.optim.MasterWeights(AdamW) with the optimizer boundary attached (tests/nn/test_models.py,
test_bf16_free_step.py and their child processes). Tiny Qwen3 (dense) and Qwen3-MoE models are
built from configs (transformers model classes, seeded random init, BF16 — no download).
Importing this module skips the importing test module when transformers is not installed."""

import warnings

import pytest
import torch

import zrw

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


def make_model(kind, seed=0, tie=False, vocab=VOCAB, hidden=64, layers=2):
    """A tiny Qwen3 / Qwen3-MoE: 2 layers, hidden 64, 2 query heads and 1 KV head of 32,
    MoE with 4 experts of 48 (top 2) in every layer. Same seed, same weights."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    if kind == "dense":
        model = Qwen3ForCausalLM(Qwen3Config(intermediate_size=96, **common))
    else:
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(
                intermediate_size=96,
                moe_intermediate_size=48,
                num_experts=4,
                num_experts_per_tok=2,
                decoder_sparse_step=1,
                **common,
            )
        )
    return model.to(BF16).train()


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
    bad = [n for n in a if not torch.equal(a[n], b[n])]
    assert not bad, f"{what}: weights differ in {bad}"
