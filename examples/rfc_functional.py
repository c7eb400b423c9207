"""The RFC's functional acceptance ("功能验收"): load the quantization config and train.

Written with the RFC's own names (`zrw.rfc`, mapped to zrw's in docs/rfc.md): the recipe is
looked up by name, its granularity checked, a QuantizeConfig made from it and applied by the
model converter; a small Qwen3 (transformers' class, random init, nothing downloaded) then trains
a few steps with zero-redundancy weights, and again with release off: the losses must be the
same bits. `python examples/rfc_functional.py [mxfp8|mxfp8-32x32]`
"""

import sys

import torch

import zrw
from zrw.rfc import (
    QuantizeConfig,
    ScalingGranularity,
    ScalingGranularityEnum,
    convert_model,
    get_recipe,
    process_quant_result_fn,
)


def build_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=256,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=384,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return Qwen3ForCausalLM(cfg).to(torch.bfloat16)


def train(recipe_name: str, release: bool, steps: int = 4) -> list:
    recipe = get_recipe(recipe_name)  # QuantRecipe, resolved by name
    block = [1, 32, 32] if recipe.block_32x32 else [1, 1, 32]
    assert recipe.weight_granularity == ScalingGranularity(
        stype=ScalingGranularityEnum.MX, block_size=block
    )  # validated in __post_init__
    quant_config = QuantizeConfig(recipe_name=recipe_name, release=release)
    model = build_model()
    summary = convert_model(model, quant_config)  # the model converter
    w = model.model.layers[0].mlp.down_proj.weight
    weight_fwd, scale_fwd, weight_bwd, scale_bwd = process_quant_result_fn(
        weight=w, dst_type=torch.float8_e4m3fn, config=quant_config
    )
    if release:
        print(
            f"{recipe_name}: {len(summary.converted)} layers converted; down_proj fwd/bwd "
            f"scales {tuple(scale_fwd.shape)} / {tuple(scale_bwd.shape)}, one FP8 copy: "
            f"{weight_bwd is weight_fwd}"
        )
    opt = zrw.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 256, (4, 64), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    zrw.cache.cache_clear()
    return losses


def main() -> int:
    recipe_name = sys.argv[1] if len(sys.argv) > 1 else "mxfp8-32x32"
    on = train(recipe_name, release=True)
    off = train(recipe_name, release=False)
    print(f"losses: {[round(x, 4) for x in on]}")
    print(f"release on vs off, losses bit for bit: {on == off}")
    return 0 if on == off else 1


if __name__ == "__main__":
    sys.exit(main())
