"""Bad inputs to the training layers raise errors that name the argument, what was expected and
what was found (docs/design.md §8): TypeError for a wrong type or dtype, ValueError for a wrong
value or shape. An input of the wrong dtype is the input's fault, never reported as the weight's."""

import re

import pytest
import torch

import zrw
from zrw.nn import MXGroupedLinear, MXLinear, mx_grouped_linear, mx_linear

pytestmark = pytest.mark.usefixtures("clean_cache")

BF16 = torch.bfloat16
INPUT_DTYPES = r"torch\.bfloat16, torch\.float16 or torch\.float32"


def _linear():
    layer = MXLinear(64, 32, release=False, dtype=BF16)
    layer.zrw_name = "proj.weight"
    return layer


def _grouped():
    return MXGroupedLinear(3, 64, 32, release=False, dtype=BF16)


X = torch.randn(6, 64).to(BF16)


@pytest.mark.parametrize(
    "dtype",
    [torch.int64, torch.int32, torch.float64, torch.bool, torch.float8_e4m3fn, torch.complex64],
)
def test_linear_input_of_a_wrong_dtype_is_named_input(dtype):
    layer = _linear()
    x = torch.ones(6, 64).to(dtype)
    with pytest.raises(
        TypeError,
        match=rf"^zrw\.nn\.functional\.mx_linear: input must be {INPUT_DTYPES}, got "
        rf"{re.escape(str(dtype))}$",
    ):
        layer(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_linear_accepts_every_input_dtype_it_documents(dtype):
    layer = _linear()
    assert layer(X.to(dtype)).shape == (6, 32)


def test_linear_input_must_be_a_tensor_of_at_least_one_dimension():
    layer = _linear()
    with pytest.raises(
        TypeError,
        match=r"^zrw\.nn\.functional\.mx_linear: input must be a torch\.Tensor, got NoneType$",
    ):
        layer(None)
    with pytest.raises(
        TypeError,
        match=r"^zrw\.nn\.functional\.mx_linear: input must be a torch\.Tensor, got list$",
    ):
        layer([[1.0] * 64])
    with pytest.raises(
        ValueError,
        match=r"^zrw\.nn\.functional\.mx_linear: input must have at least one dimension "
        r"\(\.\.\., K\), got a 0-d tensor$",
    ):
        layer(torch.tensor(1.0, dtype=BF16))
    assert layer(X[0]).shape == (32,)  # 1-d: one token


@pytest.mark.parametrize("shape", [(), (64,), (2, 32, 64)])
def test_linear_weight_that_is_not_2d_is_a_value_error_naming_it(shape):
    w = torch.ones(shape, dtype=BF16)
    zrw.cache.set_weight_name(w, "odd.weight")
    with pytest.raises(
        ValueError,
        match=rf"^zrw\.nn\.functional\.mx_linear: weight 'odd\.weight' must be 2-d \(N, K\), "
        rf"got shape {re.escape(str(tuple(shape)))}$",
    ):
        mx_linear(X, w, None, zrw.get_recipe("mxfp8"), release=False)
    # An unnamed weight is still named as the weight.
    with pytest.raises(
        ValueError, match=r"^zrw\.nn\.functional\.mx_linear: weight must be 2-d \(N, K\)"
    ):
        mx_linear(X, torch.ones(shape, dtype=BF16), None, zrw.get_recipe("mxfp8"), release=False)


def test_linear_none_arguments_are_type_errors_naming_them():
    layer = _linear()
    recipe = layer.recipe
    with pytest.raises(
        TypeError,
        match=r"^zrw\.nn\.functional\.mx_linear: weight must be a torch\.Tensor, got NoneType$",
    ):
        mx_linear(X, None, None, recipe)
    with pytest.raises(
        TypeError,
        match=r"^zrw\.nn\.functional\.mx_linear: input must be a torch\.Tensor, got NoneType$",
    ):
        mx_linear(None, layer.weight, None, recipe)
    with pytest.raises(
        TypeError,
        match=r"^zrw\.nn\.functional\.mx_linear: recipe must be a zrw\.QuantRecipe or a "
        r"registered recipe name, got NoneType$",
    ):
        mx_linear(X, layer.weight, None, None)
    with pytest.raises(
        TypeError,
        match=r"^zrw\.nn\.functional\.mx_linear: bias must be a torch\.Tensor or None, got float$",
    ):
        mx_linear(X, layer.weight, 0.0, recipe)
    with pytest.raises(
        ValueError,
        match=r"^zrw\.nn\.functional\.mx_linear: bias must have shape \(32,\) \(the "
        r"weight's out_features\), got \(31,\)$",
    ):
        mx_linear(X, layer.weight, torch.zeros(31, dtype=BF16), recipe)
    # A recipe may be given by its registered name; an unknown one is named by get_recipe.
    assert mx_linear(X, layer.weight, None, "mxfp8-32x32", release=False).shape == (6, 32)
    with pytest.raises(ValueError, match=r"get_recipe: recipe must be .* found 'nope'"):
        mx_linear(X, layer.weight, None, "nope")


def test_linear_bad_input_leaves_the_weight_untouched():
    # The checks run before the weight is quantized or released.
    layer = MXLinear(64, 32, dtype=BF16)
    before = layer.weight.detach().clone()
    with pytest.raises(TypeError):
        layer(X.double())
    assert not zrw.cache.is_cached(layer.weight)
    assert torch.equal(layer.weight.detach(), before)


# ------------------------------------------------------------------------------------------------
# MXGroupedLinear / mx_grouped_linear: counts


@pytest.mark.parametrize(
    "counts, pattern",
    [
        ([7, -1, 0], r"counts must be >= 0 \(rows per expert\), got counts\[1\] = -1$"),
        (
            torch.tensor([8, -2, 0]),
            r"counts must be >= 0 \(rows per expert\), got counts\[1\] = -2$",
        ),
    ],
)
def test_grouped_negative_counts_are_refused(counts, pattern):
    with pytest.raises(ValueError, match=rf"^zrw\.nn\.functional\.mx_grouped_linear: {pattern}"):
        _grouped()(X, counts)


@pytest.mark.parametrize(
    "counts, pattern",
    [
        ([3.0, 3.0, 0.0], r"counts must be ints, got counts\[0\] = 3\.0 \(float\)$"),
        ([2, 4.5, 0], r"counts must be ints, got counts\[1\] = 4\.5 \(float\)$"),
        ([True, 5, 0], r"counts must be ints, got counts\[0\] = True \(bool\)$"),
        (
            [torch.tensor(3.0), 3, 0],
            r"counts must be ints, got counts\[0\] = tensor\(3\.\) "
            r"\(Tensor\)$",
        ),
        (
            torch.tensor([3.0, 3.0, 0.0]),
            r"counts must be ints \(a sequence or a 1-d integer "
            r"tensor\), got a tensor of torch\.float32$",
        ),
        (torch.tensor([True, True, False]), r"counts must be ints .* got a tensor of torch\.bool$"),
        (None, r"counts must be a sequence of ints or a 1-d integer tensor, got NoneType$"),
        (6, r"counts must be a sequence of ints or a 1-d integer tensor, got int$"),
    ],
)
def test_grouped_non_integer_counts_are_type_errors(counts, pattern):
    with pytest.raises(TypeError, match=rf"^zrw\.nn\.functional\.mx_grouped_linear: {pattern}"):
        _grouped()(X, counts)


def test_grouped_counts_tensor_must_be_1d():
    with pytest.raises(
        ValueError,
        match=r"^zrw\.nn\.functional\.mx_grouped_linear: counts must be a 1-d tensor \(one "
        r"count per expert\), got shape \(1, 3\)$",
    ):
        _grouped()(X, torch.tensor([[2, 2, 2]]))


def test_grouped_accepts_ints_and_integer_tensors_alike():
    layer = _grouped()
    ref = layer(X, [2, 0, 4])
    for counts in (
        [2, 0, 4],
        (2, 0, 4),
        torch.tensor([2, 0, 4]),
        torch.tensor([2, 0, 4], dtype=torch.int32),
        list(torch.tensor([2, 0, 4])),
    ):
        assert torch.equal(layer(X, counts), ref), counts


def test_grouped_input_and_weight_are_named():
    layer = _grouped()
    with pytest.raises(
        TypeError,
        match=rf"^zrw\.nn\.functional\.mx_grouped_linear: x must be {INPUT_DTYPES}, got "
        r"torch\.int32$",
    ):
        layer(X.int(), [2, 2, 2])
    with pytest.raises(
        TypeError,
        match=r"^zrw\.nn\.functional\.mx_grouped_linear: x must be a torch\.Tensor, got NoneType$",
    ):
        layer(None, [2, 2, 2])
    with pytest.raises(
        ValueError,
        match=r"^zrw\.nn\.functional\.mx_grouped_linear: x must be 2-d \(T, K\), rows "
        r"grouped by expert, got shape \(1, 6, 64\)$",
    ):
        layer(X[None], [2, 2, 2])
    with pytest.raises(
        TypeError,
        match=r"^zrw\.nn\.functional\.mx_grouped_linear: weight must be a torch\.Tensor, "
        r"got NoneType$",
    ):
        mx_grouped_linear(X, None, [2, 2, 2], layer.recipe)
    flat = torch.ones(32, 64, dtype=BF16)
    zrw.cache.set_weight_name(flat, "moe.experts")
    with pytest.raises(
        ValueError,
        match=r"^zrw\.nn\.functional\.mx_grouped_linear: weight 'moe\.experts' must be 3-d "
        r"\(E, N, K\), got shape \(32, 64\)$",
    ):
        mx_grouped_linear(X, flat, [6], layer.recipe)
    with pytest.raises(TypeError, match=r"^zrw\.nn\.functional\.mx_grouped_linear: recipe must be"):
        mx_grouped_linear(X, layer.weight, [2, 2, 2], None)
