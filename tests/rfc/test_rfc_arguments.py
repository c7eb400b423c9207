"""zrw.rfc's arguments: every argument of every public RFC name that has the wrong type or value
raises an error that names it (never Python's bare TypeError from deep inside), before anything
changes. `QuantizeConfig(skip="lm_head")` is one name part. The table covers every public name
of zrw.rfc: a new one that it does not list fails the test."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import zrw
import zrw.rfc as rfc

BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn


def _mx():
    return rfc.ScalingGranularity(rfc.ScalingGranularityEnum.MX, [1, 1, 32])


def _recipe(**bad):
    args = dict(
        name="r",
        weight_granularity=_mx(),
        act_granularity=_mx(),
        grad_granularity=_mx(),
        elem_dtype=E4M3,
        scale_mode="rceil",
    )
    args.update(bad)
    return lambda: rfc.QuantRecipe(**args)


def _convert_model(model=None, config=None):
    def call():
        m = nn.Sequential(nn.Linear(64, 64, dtype=BF16)) if model is None else model
        before = [type(x).__name__ for x in m.modules()] if isinstance(m, nn.Module) else None
        try:
            return rfc.convert_model(m, rfc.QuantizeConfig() if config is None else config)
        finally:
            if before is not None:
                assert [type(x).__name__ for x in m.modules()] == before  # not converted

    return call


def _quant(**bad):
    args = dict(weight=torch.ones(64, 64, dtype=BF16), dst_type=E4M3, config=rfc.QuantizeConfig())
    args.update(bad)
    return lambda: rfc.process_quant_result_fn(**args)


def _register(name):
    def call():
        before = rfc.get_recipe.__globals__["_RECIPE_FACTORIES"].copy()
        try:
            return rfc.recipe_register(name)
        finally:
            assert rfc.get_recipe.__globals__["_RECIPE_FACTORIES"] == before

    return call


# (public name, argument, a call with a wrong value of it, the error, a text it names)
CASES = [
    (
        "QuantizeConfig",
        "recipe_name",
        lambda: rfc.QuantizeConfig(recipe_name=5),
        ValueError,
        "recipe_name",
    ),
    (
        "QuantizeConfig",
        "scale_mode",
        lambda: rfc.QuantizeConfig(scale_mode="up"),
        ValueError,
        "scale_mode",
    ),
    (
        "QuantizeConfig",
        "enable_fsdp_low_precision_all_gather",
        lambda: rfc.QuantizeConfig(enable_fsdp_low_precision_all_gather=1),
        ValueError,
        "enable_fsdp_low_precision_all_gather",
    ),
    (
        "QuantizeConfig",
        "all_gather_both_planes",
        lambda: rfc.QuantizeConfig(all_gather_both_planes="y"),
        ValueError,
        "all_gather_both_planes",
    ),
    ("QuantizeConfig", "release", lambda: rfc.QuantizeConfig(release=None), ValueError, "release"),
    (
        "QuantizeConfig",
        "skip",
        lambda: rfc.QuantizeConfig(skip=5),
        TypeError,
        "skip must be None, a str",
    ),
    ("QuantizeConfig", "skip", lambda: rfc.QuantizeConfig(skip=[5]), TypeError, r"skip\[0\] = 5"),
    ("QuantizeConfig", "skip", lambda: rfc.QuantizeConfig(skip=b"lm_head"), TypeError, "skip"),
    (
        "QuantizeConfig",
        "skip",
        lambda: rfc.QuantizeConfig(skip=["lm_head", ""]),
        ValueError,
        r"skip\[1\]",
    ),
    (
        "convert_model",
        "model",
        _convert_model(model=5),
        TypeError,
        "model must be a torch.nn.Module",
    ),
    ("convert_model", "config", _convert_model(config="mxfp8"), TypeError, "config must be"),
    (
        "process_quant_result_fn",
        "weight",
        _quant(weight=[1.0]),
        TypeError,
        "weight must be a torch.Tensor",
    ),
    (
        "process_quant_result_fn",
        "weight",
        _quant(weight=torch.ones(64, dtype=BF16)),
        ValueError,
        "weight must be 2-d",
    ),
    ("process_quant_result_fn", "dst_type", _quant(dst_type=BF16), ValueError, "dst_type"),
    ("process_quant_result_fn", "dst_type", _quant(dst_type="e4m3"), ValueError, "dst_type"),
    ("process_quant_result_fn", "config", _quant(config=5), TypeError, "config must be"),
    ("process_quant_result_fn", "config", _quant(config="mxfp4"), ValueError, "config: get_recipe"),
    ("get_recipe", "name", lambda: rfc.get_recipe(5), ValueError, "recipe must be"),
    (
        "get_recipe",
        "scale_mode",
        lambda: rfc.get_recipe("mxfp8", scale_mode="up"),
        ValueError,
        "scale_mode",
    ),
    ("recipe_register", "name", _register(5), ValueError, "name must be a non-empty str"),
    ("recipe_register", "name", _register("mxfp8"), ValueError, "already registered"),
    (
        "recipe_register.<decorator>",
        "factory",
        lambda: rfc.recipe_register("new-name")(5),
        ValueError,
        "must decorate",
    ),
    (
        "ScalingGranularity",
        "stype",
        lambda: rfc.ScalingGranularity("mx", [1, 1, 32]),
        ValueError,
        "stype",
    ),
    (
        "ScalingGranularity",
        "block_size",
        lambda: rfc.ScalingGranularity(rfc.ScalingGranularityEnum.MX, 32),
        ValueError,
        "block_size",
    ),
    ("QuantRecipe", "name", _recipe(name=""), ValueError, "name"),
    (
        "QuantRecipe",
        "weight_granularity",
        _recipe(weight_granularity="mx"),
        ValueError,
        "weight_granularity",
    ),
    (
        "QuantRecipe",
        "act_granularity",
        _recipe(act_granularity=None),
        ValueError,
        "act_granularity",
    ),
    (
        "QuantRecipe",
        "grad_granularity",
        _recipe(grad_granularity=5),
        ValueError,
        "grad_granularity",
    ),
    ("QuantRecipe", "elem_dtype", _recipe(elem_dtype=BF16), ValueError, "elem_dtype"),
    ("QuantRecipe", "scale_mode", _recipe(scale_mode="up"), ValueError, "scale_mode"),
    ("MXLinear", "in_features", lambda: rfc.MXLinear("64", 64), TypeError, "in_features"),
    ("MXLinear", "out_features", lambda: rfc.MXLinear(64, -1), ValueError, "out_features"),
    ("MXLinear", "bias", lambda: rfc.MXLinear(64, 64, bias="no"), TypeError, "bias"),
    ("MXLinear", "recipe", lambda: rfc.MXLinear(64, 64, recipe=5), TypeError, "recipe"),
    ("MXLinear", "recipe", lambda: rfc.MXLinear(64, 64, recipe="mxfp4"), ValueError, "recipe"),
    ("MXLinear", "release", lambda: rfc.MXLinear(64, 64, release="yes"), TypeError, "release"),
    (
        "MXLinear",
        "release_frozen",
        lambda: rfc.MXLinear(64, 64, release_frozen=1),
        TypeError,
        "release_frozen",
    ),
    ("MXLinear", "main_grad", lambda: rfc.MXLinear(64, 64, main_grad=None), TypeError, "main_grad"),
    ("MXFP8GMM", "num_experts", lambda: rfc.MXFP8GMM(2.0, 64, 64), TypeError, "num_experts"),
    ("MXFP8GMM", "in_features", lambda: rfc.MXFP8GMM(2, None, 64), TypeError, "in_features"),
    ("MXFP8GMM", "out_features", lambda: rfc.MXFP8GMM(2, 64, "64"), TypeError, "out_features"),
    ("MXFP8GMM", "recipe", lambda: rfc.MXFP8GMM(2, 64, 64, recipe=[]), TypeError, "recipe"),
    ("MXFP8GMM", "release", lambda: rfc.MXFP8GMM(2, 64, 64, release=0), TypeError, "release"),
    (
        "MXFP8GMM",
        "release_frozen",
        lambda: rfc.MXFP8GMM(2, 64, 64, release_frozen="n"),
        TypeError,
        "release_frozen",
    ),
    ("MXFP8GMM", "main_grad", lambda: rfc.MXFP8GMM(2, 64, 64, main_grad=1), TypeError, "main_grad"),
]

# Arguments without a case, and why.
NOT_CHECKED = {
    ("MXLinear", "device"): "torch's own nn.Linear argument, checked by torch",
    ("MXLinear", "dtype"): "torch's own nn.Linear argument, checked by torch",
    ("MXFP8GMM", "device"): "torch.empty's argument, checked by torch",
    ("MXFP8GMM", "dtype"): "torch.empty's argument, checked by torch",
}
# Public names of zrw.rfc that are other modules' and tested there.
ELSEWHERE = {
    "PreQuantWeight": "zrw.fsdp's FSDP2 tensor subclass",
    "ScalingGranularityEnum": "an enum: no arguments",
    "register_mxfp8_recipe": "no arguments",
    "register_mxfp8_32x32_recipe": "no arguments",
}


@pytest.mark.parametrize(
    "call,error,text",
    [c[2:] for c in CASES],
    ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)],
)
def test_a_wrong_argument_raises_an_error_that_names_it(call, error, text):
    with pytest.raises(error, match=text):
        call()


def test_every_public_name_and_argument_is_covered():
    covered = {(name, arg) for name, arg, *_ in CASES} | set(NOT_CHECKED)
    missing = []
    for name in rfc.__all__:
        if name in ELSEWHERE:
            continue
        obj = getattr(rfc, name)
        assert callable(obj), name
        for arg in inspect.signature(obj).parameters:
            if (name, arg) not in covered:
                missing.append(f"{name}({arg})")
    assert not missing, f"public zrw.rfc arguments without a wrong-value case: {missing}"


def test_a_str_skip_is_one_name_part():
    assert rfc.QuantizeConfig(skip="lm_head").skip == ("lm_head",)
    assert rfc.QuantizeConfig(skip=["lm_head", "embed"]).skip == ("lm_head", "embed")
    model = nn.Sequential(nn.Linear(64, 64, dtype=BF16), nn.Linear(64, 64, dtype=BF16))
    summary = rfc.convert_model(model, rfc.QuantizeConfig(skip="1"))
    assert summary.converted == ["0"] and "1" in summary.skipped


def test_convert_model_takes_a_compiled_model():
    model = nn.Sequential(nn.Linear(64, 64, dtype=BF16))
    compiled = torch.compile(model, backend="eager")
    summary = rfc.convert_model(compiled, rfc.QuantizeConfig())
    assert summary.converted == ["0"]  # the model's own names, not "_orig_mod.0"
    assert isinstance(model[0], zrw.nn.MXLinear)
    assert zrw.cache.weight_name(model[0].weight) == "0.weight"
