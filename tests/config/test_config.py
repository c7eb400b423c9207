"""zrw.config: the RFC's ScalingGranularity, QuantRecipe and recipe registry, and every error."""

import dataclasses
import re

import pytest
import torch

from zrw import config
from zrw.config import (
    QuantRecipe,
    ScalingGranularity,
    ScalingGranularityEnum,
    get_recipe,
    known_recipes,
    recipe_register,
)

MX = ScalingGranularityEnum.MX


@pytest.fixture
def isolated_registry(monkeypatch):
    """Recipes registered by a test vanish after it."""
    monkeypatch.setattr(config, "_RECIPE_FACTORIES", dict(config._RECIPE_FACTORIES))


def mx(block_size=(1, 1, 32)):
    return ScalingGranularity(MX, block_size)


def recipe(**overrides):
    fields = dict(
        name="custom", weight_granularity=mx(), act_granularity=mx(), grad_granularity=mx()
    )
    fields.update(overrides)
    return QuantRecipe(**fields)


# ------------------------------------------------------------------------------------------------
# ScalingGranularity


@pytest.mark.parametrize("block_size", [[1, 1, 32], (1, 1, 32), [1, 32, 32], (1, 32, 32)])
def test_mx_block_sizes_are_accepted_and_stored_as_tuples(block_size):
    granularity = ScalingGranularity(stype=MX, block_size=block_size)
    assert granularity.block_size == tuple(block_size)
    assert isinstance(granularity.block_size, tuple)
    assert granularity.is_mx


@pytest.mark.parametrize(
    "block_size",
    [
        None,
        [1, 32],
        [1, 1, 16],
        [1, 32, 1],
        [32, 32, 1],
        [1, 1, 32, 1],
        "1,1,32",
        [1, 1, 32.0],
        [True, 1, 32],
    ],
)
def test_other_mx_block_sizes_are_refused(block_size):
    expected = re.escape(
        "ScalingGranularity: block_size for stype=MX must be [1, 1, 32] or [1, 32, 32], "
        f"found {block_size!r}"
    )
    with pytest.raises(ValueError, match=expected):
        ScalingGranularity(MX, block_size)


def test_mx_is_the_only_granularity():
    # Per-tensor and per-channel scalings have no kernel in zrw: they are not offered at all.
    assert [m.name for m in ScalingGranularityEnum] == ["MX"]
    with pytest.raises(ValueError, match=re.escape("block_size for stype=MX must be")):
        ScalingGranularity(MX)  # a block size is required


def test_stype_must_be_the_enum():
    expected = re.escape(
        "ScalingGranularity: stype must be one of ScalingGranularityEnum.MX, found 'MX'"
    )
    with pytest.raises(ValueError, match=expected):
        ScalingGranularity("MX", [1, 1, 32])


# ------------------------------------------------------------------------------------------------
# QuantRecipe


def test_recipe_defaults_and_is_frozen():
    made = recipe()
    assert made.elem_dtype == torch.float8_e4m3fn
    assert made.scale_mode == "rceil"  # the default, as docs/accuracy.md explains
    assert not made.block_32x32
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.scale_mode = "floor"


def test_block_32x32_follows_the_weight_granularity():
    assert recipe(weight_granularity=mx((1, 32, 32))).block_32x32
    assert not recipe(weight_granularity=mx((1, 1, 32))).block_32x32


@pytest.mark.parametrize("elem_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
def test_recipe_accepts_both_element_formats_and_scale_modes(elem_dtype, scale_mode):
    made = recipe(elem_dtype=elem_dtype, scale_mode=scale_mode)
    assert (made.elem_dtype, made.scale_mode) == (elem_dtype, scale_mode)


def test_recipe_errors():
    with pytest.raises(
        ValueError, match=re.escape("QuantRecipe: name must be a non-empty str, found ''")
    ):
        recipe(name="")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "QuantRecipe 'custom': act_granularity must be a ScalingGranularity, found [1, 1, 32]"
        ),
    ):
        recipe(act_granularity=[1, 1, 32])
    with pytest.raises(
        ValueError,
        match=re.escape(
            "QuantRecipe 'custom': grad_granularity block_size must be [1, 1, 32] "
            "(32x32 tiles are for weights only), found [1, 32, 32]"
        ),
    ):
        recipe(grad_granularity=mx((1, 32, 32)))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "QuantRecipe 'custom': elem_dtype must be one of "
            "(torch.float8_e4m3fn, torch.float8_e5m2), found torch.bfloat16"
        ),
    ):
        recipe(elem_dtype=torch.bfloat16)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "QuantRecipe 'custom': scale_mode must be one of ('floor', 'rceil'), found 'ceil'"
        ),
    ):
        recipe(scale_mode="ceil")


# ------------------------------------------------------------------------------------------------
# registry


def test_builtin_recipes():
    assert known_recipes()[:2] == ["mxfp8", "mxfp8-32x32"]

    mxfp8 = get_recipe("mxfp8")
    assert mxfp8.name == "mxfp8"
    assert mxfp8.weight_granularity == mx((1, 1, 32))
    assert mxfp8.act_granularity == mx((1, 1, 32))
    assert mxfp8.grad_granularity == mx((1, 1, 32))
    assert (mxfp8.elem_dtype, mxfp8.scale_mode) == (torch.float8_e4m3fn, "rceil")
    assert not mxfp8.block_32x32

    tiled = get_recipe("mxfp8-32x32")
    assert tiled.name == "mxfp8-32x32"
    assert tiled.weight_granularity == mx((1, 32, 32))
    assert tiled.act_granularity == mx((1, 1, 32))
    assert tiled.grad_granularity == mx((1, 1, 32))
    assert (tiled.elem_dtype, tiled.scale_mode) == (torch.float8_e4m3fn, "rceil")
    assert tiled.block_32x32


def test_get_recipe_hands_out_fresh_granularities():
    # ScalingGranularity is mutable; one caller's edit must not leak into the next get_recipe.
    first = get_recipe("mxfp8-32x32")
    first.weight_granularity.block_size = (1, 1, 32)
    assert get_recipe("mxfp8-32x32").block_32x32


def test_get_recipe_passes_a_recipe_through():
    made = recipe()
    assert get_recipe(made) is made


@pytest.mark.parametrize("unknown", ["mxfp4", "MXFP8", "", None, 32])
def test_get_recipe_names_the_unknown_value_and_the_known_ones(unknown):
    expected = re.escape(
        f"get_recipe: recipe must be a QuantRecipe or one of {known_recipes()}, found {unknown!r}"
    )
    with pytest.raises(ValueError, match=expected) as raised:
        get_recipe(unknown)
    assert "'mxfp8'" in str(raised.value) and "'mxfp8-32x32'" in str(raised.value)


def test_recipe_register_adds_a_recipe(isolated_registry):
    @recipe_register("mxfp8-rceil")
    def make_rceil_recipe():
        return recipe(name="mxfp8-rceil", scale_mode="rceil")

    assert make_rceil_recipe().scale_mode == "rceil"  # the decorator returns the factory unchanged
    assert "mxfp8-rceil" in known_recipes()
    assert get_recipe("mxfp8-rceil").scale_mode == "rceil"


def test_recipe_register_refuses_a_duplicate_name(isolated_registry):
    expected = re.escape(
        "recipe_register: a recipe named 'mxfp8' is already registered; "
        f"known recipes: {known_recipes()}"
    )
    with pytest.raises(ValueError, match=expected):
        recipe_register("mxfp8")


def test_recipe_register_errors(isolated_registry):
    with pytest.raises(
        ValueError, match=re.escape("recipe_register: name must be a non-empty str, found None")
    ):
        recipe_register(None)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "recipe_register('not-callable') must decorate a zero-argument function returning a "
            "QuantRecipe, found 3"
        ),
    ):
        recipe_register("not-callable")(3)


def test_get_recipe_checks_what_a_factory_returns(isolated_registry):
    recipe_register("misnamed")(lambda: recipe(name="other"))
    recipe_register("not-a-recipe")(lambda: "mxfp8")
    with pytest.raises(
        ValueError,
        match=r"get_recipe: the factory registered as 'misnamed' must return a QuantRecipe named "
        r"'misnamed', found QuantRecipe\(name='other'",
    ):
        get_recipe("misnamed")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "get_recipe: the factory registered as 'not-a-recipe' must return a QuantRecipe named "
            "'not-a-recipe', found 'mxfp8'"
        ),
    ):
        get_recipe("not-a-recipe")


def test_scale_modes_have_one_source():
    # The recipe check, the fake kernels and the wrappers all use the names the C++ extension
    # exports (csrc/common/names.h), so a new scale rule cannot be known to one and not the others.
    import zrw._fake
    import zrw.config
    import zrw.ops

    assert zrw.config.SCALE_MODES is zrw.ops.SCALE_MODES
    assert zrw._fake.SCALE_MODES is zrw.ops.SCALE_MODES
    assert zrw.ops.SCALE_MODES == tuple(zrw._C.scale_modes()) == ("floor", "rceil")
