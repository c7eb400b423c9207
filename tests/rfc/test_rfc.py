"""The RFC's interface, name for name (zrw.rfc; table in docs/rfc.md): each name called as the
RFC's own examples call it ("调用参考代码"), with values checked against zrw.reference."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import zrw
import zrw.config
import zrw.rfc
from helpers.bitwise import same_bits
from zrw import reference
from zrw.fsdp import PreQuantWeight
from zrw.rfc import (
    MXFP8GMM,
    MXLinear,
    QuantizeConfig,
    ScalingGranularity,
    ScalingGranularityEnum,
    convert_model,
    get_recipe,
    process_quant_result_fn,
    recipe_register,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_every_name_the_rfc_uses_is_there():
    for name in (
        "ScalingGranularity",
        "ScalingGranularityEnum",
        "QuantRecipe",
        "recipe_register",
        "get_recipe",
        "register_mxfp8_32x32_recipe",
        "QuantizeConfig",
        "process_quant_result_fn",
        "PreQuantWeight",
        "MXLinear",
        "MXFP8GMM",
    ):
        assert hasattr(zrw.rfc, name), name
    assert MXFP8GMM is zrw.nn.MXGroupedLinear and MXLinear is zrw.nn.MXLinear
    assert zrw.rfc.PreQuantWeight is PreQuantWeight
    assert zrw.rfc.register_mxfp8_32x32_recipe is zrw.config.register_mxfp8_32x32_recipe


def test_scaling_granularity_as_in_the_rfc():
    # 3.5.2.1: "创建 MXFP8-32x32 配置"
    granularity = ScalingGranularity(stype=ScalingGranularityEnum.MX, block_size=[1, 32, 32])
    assert granularity.block_size == (1, 32, 32)
    ScalingGranularity(stype=ScalingGranularityEnum.MX, block_size=[1, 1, 32])
    with pytest.raises(ValueError, match="block_size"):  # "抛出 ValueError"
        ScalingGranularity(stype=ScalingGranularityEnum.MX, block_size=[1, 64, 64])


def test_get_recipe_and_recipe_register_as_in_the_rfc(monkeypatch):
    # 3.5.2.2: "获取 MXFP8-32x32 配方"
    recipe = get_recipe("mxfp8-32x32")
    assert recipe.name == "mxfp8-32x32" and recipe.block_32x32
    assert recipe.weight_granularity.block_size == (1, 32, 32)
    assert recipe.elem_dtype == E4M3
    # @recipe_register(name) on a zero-argument factory; the registry is restored afterwards.
    monkeypatch.setattr(zrw.config, "_RECIPE_FACTORIES", dict(zrw.config._RECIPE_FACTORIES))

    @recipe_register("mxfp8-32x32-e5m2")
    def register_mxfp8_32x32_e5m2_recipe():
        return dataclasses.replace(
            get_recipe("mxfp8-32x32"), name="mxfp8-32x32-e5m2", elem_dtype=E5M2
        )

    assert get_recipe("mxfp8-32x32-e5m2").elem_dtype == E5M2
    assert QuantizeConfig(recipe_name="mxfp8-32x32-e5m2").recipe.block_32x32


@pytest.mark.parametrize("shape", [(96, 64), (2, 64, 96), (70, 50)])
def test_process_quant_result_fn_as_in_the_rfc(shape):
    torch.manual_seed(0)
    model_weight = torch.randn(*shape, dtype=torch.bfloat16)
    # 3.5.2.3: mxfp8 -> dual-axis quantization, two weights
    quant_config = QuantizeConfig(recipe_name="mxfp8")
    weight_fwd, scale_fwd, weight_bwd, scale_bwd = process_quant_result_fn(
        weight=model_weight, dst_type=torch.float8_e4m3fn, config=quant_config
    )
    mode = quant_config.recipe.scale_mode
    ref = reference.mx_quantize_dual(model_weight, E4M3, mode)
    for got, want in zip((weight_fwd, scale_fwd, weight_bwd, scale_bwd), ref):
        assert got.dtype == want.dtype and torch.equal(
            got.view(torch.uint8), want.view(torch.uint8)
        )
    assert weight_bwd.data_ptr() != weight_fwd.data_ptr()
    # mxfp8-32x32 -> block quantization: the backward weight is the forward one
    quant_config = QuantizeConfig(recipe_name="mxfp8-32x32")
    weight_fwd, scale_fwd, weight_bwd, scale_bwd = process_quant_result_fn(
        weight=model_weight, dst_type=torch.float8_e4m3fn, config=quant_config
    )
    data, block = reference.mx_quantize_block(model_weight, E4M3, mode)
    assert weight_bwd is weight_fwd
    assert same_bits(weight_fwd, data)
    for got, dim in ((scale_fwd, -1), (scale_bwd, -2)):
        want = reference.expand_block_scale(block, model_weight.shape, dim)
        assert same_bits(got, want)
    # the scales serve the GEMMs: dequantizing either view gives the same weight
    fwd = reference.mx_dequantize(weight_fwd, scale_fwd, -1, torch.float32)
    bwd = reference.mx_dequantize(weight_bwd, scale_bwd, -2, torch.float32)
    assert torch.equal(fwd, bwd)


def test_process_quant_result_fn_dst_type_scale_mode_and_errors():
    w = torch.randn(64, 64, dtype=torch.bfloat16) * 100
    for mode in ("floor", "rceil"):
        cfg = QuantizeConfig(recipe_name="mxfp8", scale_mode=mode)
        out = process_quant_result_fn(w, torch.float8_e5m2, cfg)
        ref = reference.mx_quantize_dual(w, E5M2, mode)
        assert out[0].dtype == E5M2
        assert all(same_bits(a, b) for a, b in zip(out, ref))
    # "当 recipe_name 不支持时,抛出 ValueError"
    with pytest.raises(ValueError, match="recipe_name"):
        QuantizeConfig(recipe_name="mxfp8-64x64")
    with pytest.raises(ValueError, match="mxfp8-64x64"):
        process_quant_result_fn(w, E4M3, "mxfp8-64x64")
    with pytest.raises(ValueError, match="dst_type"):
        process_quant_result_fn(w, torch.int8, QuantizeConfig())
    with pytest.raises(ValueError, match="scale_mode"):
        QuantizeConfig(scale_mode="round")
    with pytest.raises(ValueError, match="2-d"):
        process_quant_result_fn(torch.randn(64), E4M3, QuantizeConfig())
    with pytest.raises(TypeError, match="config"):
        process_quant_result_fn(w, E4M3, {"recipe_name": "mxfp8"})


def test_mxfp8gmm_is_the_grouped_experts_layer():
    torch.manual_seed(0)
    gmm = MXFP8GMM(4, 64, 96, recipe="mxfp8-32x32", release=False, dtype=torch.bfloat16)
    assert isinstance(gmm, zrw.nn.MXGroupedLinear) and gmm.recipe.name == "mxfp8-32x32"
    x = torch.randn(40, 64, dtype=torch.bfloat16, requires_grad=True)
    counts = [10, 0, 20, 10]
    y = gmm(x, counts)
    assert y.shape == (40, 96)
    y.float().sum().backward()
    assert x.grad.shape == x.shape and gmm.weight.grad.shape == gmm.weight.shape
    zrw.cache.cache_clear()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)).to(torch.bfloat16)


def test_quantize_config_applied_by_the_model_converter():
    # "用户指定 recipe_name -> QuantRecipe -> ScalingGranularity -> QuantizeConfig -> 模型转换器"
    model = _model()
    cfg = QuantizeConfig(recipe_name="mxfp8-32x32", scale_mode="floor")
    summary = convert_model(model, cfg)
    assert summary.recipe == "mxfp8-32x32" and summary.converted == ["0", "2"]
    assert isinstance(model[0], MXLinear) and model[0].recipe.scale_mode == "floor"
    assert model[0].recipe.block_32x32
    assert not any(isinstance(p.data, PreQuantWeight) for p in model.parameters())
    # with the FSDP low-precision all-gather: the weights carry zrw's all-gather extension
    model = _model()
    convert_model(
        model,
        QuantizeConfig(
            recipe_name="mxfp8",
            enable_fsdp_low_precision_all_gather=True,
            all_gather_both_planes=True,
            release=False,
        ),
    )
    wrapped = [p for p in model.parameters() if isinstance(p.data, PreQuantWeight)]
    assert len(wrapped) == 2
    skip = _model()
    assert convert_model(skip, QuantizeConfig(skip="2")).converted == ["0"]
    with pytest.raises(TypeError, match="QuantizeConfig"):
        convert_model(_model(), "mxfp8")


# -m slow: the second recipe (release on = off for mxfp8-32x32 is tests/nn/test_models.py's).
@pytest.mark.parametrize("recipe", ["mxfp8", pytest.param("mxfp8-32x32", marks=pytest.mark.slow)])
def test_functional_acceptance_example(recipe):
    """examples/rfc_functional.py, the RFC's functional acceptance: loads the config, trains a
    Qwen3 with the RFC's names, release on and off give the same losses."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(
        [sys.executable, os.path.join(root, "examples", "rfc_functional.py"), recipe],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "release on vs off, losses bit for bit: True" in out.stdout
    assert f"one FP8 copy: {recipe == 'mxfp8-32x32'}" in out.stdout
