"""FSDP2's MXFP8 all-gather quantizes with the layer's own QuantRecipe: a registered recipe's
element dtype (e5m2) and scale rule (rceil) reach the hooks, for both weight layouts.

Real 2-rank runs (gloo on CPU) of tests/fsdp/fsdp_worker.py (one launch: for each recipe the
zrw, bf16 and single-process runs), compared as tests/fsdp/test_fsdp.py does: bitwise with
FSDP2's plain BF16 all-gather of the same model (whose layers quantize the gathered weight with
their recipe), the gathered planes byte for byte with the single-process quantization of the
full weight under the recipe, and the single-process run up to the order of the gradient
reduction."""

import pytest
import torch

import zrw
from helpers import fsdp_runs, ranks

ARGS = "--steps 2 --micro-batches 1 --opt sgd --lr 0.5"
MODES = ("zrw", "bf16", "single")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    args = [
        a
        for recipe in fsdp_runs.TEST_RECIPES
        for mode in MODES
        for a in ("--run", f"--recipe {recipe} --mode {mode} {ARGS}")
    ]
    out = iter(ranks.launch(fsdp_runs.WORKER, tmp_path_factory.mktemp("recipe"), *args))
    return {recipe: {mode: next(out) for mode in MODES} for recipe in fsdp_runs.TEST_RECIPES}


@pytest.mark.parametrize("recipe", list(fsdp_runs.TEST_RECIPES))
def test_registered_e5m2_rceil_recipe_reaches_the_all_gather(runs, recipe):
    fsdp_runs.register_test_recipes()
    rcp = zrw.get_recipe(recipe)
    assert (rcp.elem_dtype, rcp.scale_mode) == (torch.float8_e5m2, "rceil")
    args = ["--recipe", recipe, *ARGS.split()]
    z, b, s = (runs[recipe][m] for m in MODES)

    # The gathered planes are the recipe's quantization of the full weight, byte for byte (and
    # not the built-in recipe's, e4m3 with its scale rule: the comparison can tell them apart).
    builtin_mode = zrw.get_recipe(rcp.cache_layout).scale_mode
    for name in ("fc1", "fc2"):
        got = z["planes"][name]
        w = fsdp_runs.initial_weight(f"{name}.weight", args)
        if rcp.block_32x32:
            data, block = zrw.ops.mx_quantize_block(w, rcp.elem_dtype, rcp.scale_mode)
            ref = {
                "fwd_data": data,
                "fwd_scale": zrw.ops.expand_block_scale(block, w.shape, -1),
                "bwd_scale": zrw.ops.expand_block_scale(block, w.shape, -2),
            }
            builtin = zrw.ops.mx_quantize_block(w, torch.float8_e4m3fn, builtin_mode)[0]
        else:
            data, scale = zrw.ops.mx_quantize_dual(w, rcp.elem_dtype, rcp.scale_mode)[:2]
            ref = {"fwd_data": data, "fwd_scale": scale}
            builtin = zrw.ops.mx_quantize_dual(w, torch.float8_e4m3fn, builtin_mode)[0]
        assert got["fwd_data"].shape == builtin.shape
        assert not torch.equal(got["fwd_data"], builtin.view(torch.uint8))
        for k, v in ref.items():
            assert torch.equal(got[k], v.contiguous().view(torch.uint8)), (name, k)

    # Training: bitwise the FSDP2 run that gathers BF16 and quantizes with the layer's recipe,
    # and the single-process run with the same recipe up to the gradients' reduction order.
    fsdp_runs.assert_trains_like_bf16_gather_and_single_process(z, b, s, args)
    assert z["warnings"] == []
