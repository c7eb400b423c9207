"""The tiny Hugging Face model the tests in tests/hf share: a Qwen3 from a config with random
init, in bf16 (nothing is downloaded)."""

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

BF16 = torch.bfloat16


def tiny_qwen3(seed=0, **config):
    """A 2-layer Qwen3, hidden 64, vocabulary 128; `config` overrides Qwen3Config fields."""
    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    cfg.update(config)
    return Qwen3ForCausalLM(Qwen3Config(**cfg)).to(BF16)
