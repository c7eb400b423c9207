"""The MindSpeed FSDP RFC's interface, name for name ("为 FSDP 添加 MXFP8-32x32 量化支持"):
code written against the RFC imports its names from here and runs on zrw (docs/rfc.md maps
each to zrw's own). The recipe registry is zrw.config's, PreQuantWeight zrw.fsdp's, MXLinear
zrw.nn's and MXFP8GMM is zrw.nn.MXGroupedLinear; new here are QuantizeConfig, convert_model
(the RFC's "model converter") and process_quant_result_fn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from . import fsdp, ops
from .config import (
    QuantRecipe,
    ScalingGranularity,
    ScalingGranularityEnum,
    get_recipe,
    known_recipes,
    recipe_register,
    register_mxfp8_32x32_recipe,
    register_mxfp8_recipe,
)
from .fsdp import PreQuantWeight
from .nn import ConvertSummary, MXGroupedLinear, MXLinear, convert
from .planes import checked_model, name_list

__all__ = [
    "MXFP8GMM",
    "MXLinear",
    "PreQuantWeight",
    "QuantRecipe",
    "QuantizeConfig",
    "ScalingGranularity",
    "ScalingGranularityEnum",
    "convert_model",
    "get_recipe",
    "process_quant_result_fn",
    "recipe_register",
    "register_mxfp8_32x32_recipe",
    "register_mxfp8_recipe",
]

# The RFC's grouped matmul for MoE experts (Hugging Face's fused experts modules become
# zrw.nn.MXFusedExperts, which runs its numerics).
MXFP8GMM = MXGroupedLinear

_DST_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class QuantizeConfig:
    """What the model converter applies (`convert_model`); a bad field raises here.

    recipe_name: a registered recipe, "mxfp8" ([1, 1, 32]) or "mxfp8-32x32" ([1, 32, 32]).
    scale_mode: None keeps the recipe's scale rule; "floor" or "rceil" overrides it.
    enable_fsdp_low_precision_all_gather: FSDP2 all-gathers the weights as MXFP8 (zrw.fsdp.prepare;
        call convert_model before fully_shard). False: each layer quantizes after the gather.
    all_gather_both_planes: mxfp8 only: every gather carries both planes, as the RFC's original
        scheme does (needed with reshard_after_forward=False or activation recompute); by
        default each gather carries the plane its phase needs.
    release: zero-redundancy weights. skip: name parts of modules kept in high precision (None:
    zrw.convert's default)."""

    recipe_name: str = "mxfp8"
    scale_mode: Optional[str] = None
    enable_fsdp_low_precision_all_gather: bool = False
    all_gather_both_planes: bool = False
    release: bool = True
    skip: Optional[Tuple[str, ...]] = None

    def __post_init__(self):
        if not isinstance(self.recipe_name, str) or self.recipe_name not in known_recipes():
            raise ValueError(
                f"QuantizeConfig: recipe_name must be one of {known_recipes()}, "
                f"found {self.recipe_name!r}"
            )
        if self.scale_mode is not None and self.scale_mode not in ops.SCALE_MODES:
            raise ValueError(
                f"QuantizeConfig: scale_mode must be None or one of "
                f"{ops.SCALE_MODES}, found {self.scale_mode!r}"
            )
        for name in ("enable_fsdp_low_precision_all_gather", "all_gather_both_planes", "release"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"QuantizeConfig: {name} must be a bool, found {getattr(self, name)!r}"
                )
        if self.skip is not None:
            what = "name parts of the modules kept in high precision"
            why = "module name contains: it would skip every module"
            self.skip = name_list("QuantizeConfig", "skip", self.skip, what, why, none_ok=True)

    @property
    def recipe(self) -> QuantRecipe:
        """The QuantRecipe this config quantizes with."""
        return get_recipe(self.recipe_name, scale_mode=self.scale_mode)


def convert_model(model: nn.Module, config: QuantizeConfig) -> ConvertSummary:
    """The RFC's model converter: zrw.convert(model, config.recipe, release=config.release,
    skip=config.skip), then, with enable_fsdp_low_precision_all_gather, zrw.fsdp.prepare
    (before fully_shard). Returns zrw.convert's ConvertSummary."""
    if not isinstance(config, QuantizeConfig):
        raise TypeError(
            f"zrw.rfc.convert_model: config must be a zrw.rfc.QuantizeConfig, got "
            f"{type(config).__name__}"
        )
    model = checked_model("zrw.rfc.convert_model", model)
    summary = convert(model, config.recipe, release=config.release, skip=config.skip)
    if config.enable_fsdp_low_precision_all_gather:
        fsdp.prepare(model, both_planes=config.all_gather_both_planes)
    return summary


def _recipe_of(config) -> QuantRecipe:
    if isinstance(config, QuantizeConfig):
        return config.recipe
    if isinstance(config, (QuantRecipe, str)):
        try:
            return get_recipe(config)
        except ValueError as e:  # an unknown name: the message names this argument
            raise ValueError(f"process_quant_result_fn: config: {e}") from None
    raise TypeError(
        f"process_quant_result_fn: config must be a zrw.rfc.QuantizeConfig (or a "
        f"QuantRecipe / registered recipe name), got {type(config).__name__}"
    )


def process_quant_result_fn(
    weight: Tensor, dst_type: torch.dtype, config
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Quantize `weight` as `config`'s recipe does: (weight_fwd, scale_fwd, weight_bwd, scale_bwd).

    weight: (N, K) or (E, N, K), bf16, fp16 or fp32. dst_type: torch.float8_e4m3fn or
    torch.float8_e5m2 (it takes precedence over the recipe's element format); the scale rule is
    the recipe's. mxfp8: zrw.ops.mx_quantize_dual, weight_fwd blocked along K, weight_bwd along
    N. mxfp8-32x32: zrw.ops.mx_quantize_block, `weight_bwd is weight_fwd` and the scales are the
    tile scale expanded along K, (.., N, ceil(K/32)), and along N, (.., ceil(N/32), K). Scales
    are torch.float8_e8m0fnu.
    """
    if not isinstance(weight, Tensor):
        raise TypeError(
            f"process_quant_result_fn: weight must be a torch.Tensor, got {type(weight).__name__}"
        )
    recipe = _recipe_of(config)
    if not isinstance(dst_type, torch.dtype) or dst_type not in _DST_TYPES:
        raise ValueError(
            f"process_quant_result_fn: dst_type must be torch.float8_e4m3fn or "
            f"torch.float8_e5m2, got {dst_type!r}"
        )
    if weight.dim() not in (2, 3):
        raise ValueError(
            f"process_quant_result_fn: weight must be 2-d (N, K) or 3-d (E, N, K), "
            f"got shape {tuple(weight.shape)}"
        )
    w = weight.detach()
    if recipe.block_32x32:
        data, block = ops.mx_quantize_block(w.contiguous(), dst_type, recipe.scale_mode)
        fwd, bwd = (ops.expand_block_scale(block, w.shape, d) for d in (-1, -2))
        return data, fwd, data, bwd
    return tuple(ops.mx_quantize_dual(w.contiguous(), dst_type, recipe.scale_mode))
