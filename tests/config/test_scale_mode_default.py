"""The built-in recipes' scale rule (decided by the accuracy benchmark, docs/accuracy.md)
and the other rule one argument away: get_recipe(name, scale_mode=...)."""

import dataclasses

import pytest
import torch

import zrw
import zrw.rfc
from helpers.bitwise import same_bits
from zrw import reference as ref

DEFAULT = "rceil"  # docs/accuracy.md: why
OTHER = "floor"
E4M3 = torch.float8_e4m3fn


@pytest.mark.parametrize("name", ["mxfp8", "mxfp8-32x32"])
def test_builtin_recipes_default_to_rceil(name):
    assert zrw.get_recipe(name).scale_mode == DEFAULT
    assert (
        zrw.QuantRecipe(
            name="custom",
            weight_granularity=zrw.get_recipe(name).weight_granularity,
            act_granularity=zrw.get_recipe(name).act_granularity,
            grad_granularity=zrw.get_recipe(name).grad_granularity,
        ).scale_mode
        == DEFAULT
    )
    assert zrw.rfc.QuantizeConfig(recipe_name=name).recipe.scale_mode == DEFAULT


@pytest.mark.parametrize("name", ["mxfp8", "mxfp8-32x32"])
@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_the_other_rule_is_one_argument_away(name, mode):
    made = zrw.get_recipe(name, scale_mode=mode)
    assert made.scale_mode == mode
    assert dataclasses.replace(made, scale_mode=DEFAULT) == zrw.get_recipe(name)
    assert zrw.get_recipe(made, scale_mode=mode) is made
    with pytest.raises(ValueError, match="scale_mode"):
        zrw.get_recipe(name, scale_mode="ceil")


@pytest.mark.parametrize("name", ["mxfp8", "mxfp8-32x32"])
@pytest.mark.parametrize("mode", [None, OTHER])
def test_converted_layers_quantize_with_the_chosen_rule(name, mode):
    """A converted layer's cached weight planes are the reference's under the rule asked for
    (the default one, or the other one through get_recipe)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=False)).to(torch.bfloat16)
    # Values whose blocks' amax mantissas exceed 1.75 in places: floor and rceil differ there.
    with torch.no_grad():
        model[0].weight.mul_(torch.linspace(0.5, 1.99, 64).to(torch.bfloat16))
    w = model[0].weight.detach().clone()
    recipe = zrw.get_recipe(name, scale_mode=mode)
    zrw.convert(model, recipe, release=False)
    model(torch.randn(8, 64, dtype=torch.bfloat16))
    q = zrw.cache.quant_and_release(
        model[0].weight, recipe.cache_layout, False, scale_mode=recipe.scale_mode
    )  # a hit: the cached copy
    want_mode = mode or DEFAULT
    if recipe.block_32x32:
        want = ref.expand_block_scale(ref.mx_quantize_block(w, E4M3, want_mode)[1], w.shape, -1)
        other = ref.expand_block_scale(
            ref.mx_quantize_block(w, E4M3, "floor" if want_mode == "rceil" else "rceil")[1],
            w.shape,
            -1,
        )
    else:
        want = ref.mx_quantize(w, -1, E4M3, want_mode)[1]
        other = ref.mx_quantize(w, -1, E4M3, "floor" if want_mode == "rceil" else "rceil")[1]
    assert same_bits(q.fwd.scale, want)
    assert not same_bits(want, other)  # rules differ here
    zrw.cache.cache_clear()
