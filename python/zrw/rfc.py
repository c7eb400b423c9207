"""The MindSpeed FSDP RFC's interface, name for name ("为 FSDP 添加 MXFP8-32x32 量化支持").

Code written against the RFC imports its names from here and runs on zrw; docs/rfc.md maps every
interface the RFC names to zrw's own. The recipe registry (ScalingGranularity,
ScalingGranularityEnum, QuantRecipe, recipe_register, get_recipe and the two registration
functions) is zrw.config's and is re-exported as is; PreQuantWeight (the FSDP2 all-gather
extension) is zrw.fsdp's, MXLinear zrw.nn's. New here:

* `QuantizeConfig`: the recipe (by name) and whether FSDP2 all-gathers the weights in MXFP8,
  applied to a model by `convert_model(model, config)` (the RFC's "model converter").
* `process_quant_result_fn(weight, dst_type, config)`: quantizes a weight the way the config's
  recipe does and returns `(weight_fwd, scale_fwd, weight_bwd, scale_bwd)`.
* `MXFP8GMM`: the RFC's name of the grouped-experts layer, zrw.nn.MXGroupedLinear itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Optional, Tuple

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
from .planes import unwrap_model

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

# The RFC's grouped matmul layer for MoE experts: zrw's grouped linear over an (E, N, K) stack,
# forward(x, counts) with x grouped by expert. (Hugging Face's fused experts modules are
# replaced by zrw.nn.MXFusedExperts, which runs this layer's numerics; zrw.convert does that.)
MXFP8GMM = MXGroupedLinear

_DST_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _skip_parts(skip) -> Tuple[str, ...]:
    """QuantizeConfig.skip as a tuple of name parts: one str is ONE name part (as zrw.convert
    takes it), an iterable must hold non-empty str; anything else names the field."""
    if isinstance(skip, str):
        skip = (skip,)
    elif isinstance(skip, (bytes, bytearray, dict)) or not isinstance(skip, Iterable):
        raise TypeError(
            "QuantizeConfig: skip must be None, a str or an iterable of str (name parts of the "
            f"modules kept in high precision), found {type(skip).__name__} ({skip!r})"
        )
    parts = tuple(skip)
    for i, part in enumerate(parts):
        if not isinstance(part, str):
            raise TypeError(
                f"QuantizeConfig: skip must hold str name parts, found skip[{i}] = {part!r} "
                f"({type(part).__name__})"
            )
        if not part:
            raise ValueError(
                f"QuantizeConfig: skip[{i}] is the empty string, which every module name "
                "contains: it would skip every module"
            )
    return parts


@dataclass
class QuantizeConfig:
    """What the model converter applies (`convert_model`).

    recipe_name: a registered recipe, "mxfp8" ([1, 1, 32]) or "mxfp8-32x32" ([1, 32, 32]).
    scale_mode: None keeps the recipe's scale rule; "floor" or "rceil" overrides it.
    enable_fsdp_low_precision_all_gather: FSDP2 all-gathers the weights as MXFP8 (zrw.fsdp.prepare
        wraps them in PreQuantWeight; call convert_model before fully_shard). False: FSDP2
        gathers the param-dtype weights and each layer quantizes them after the gather.
    all_gather_both_planes: mxfp8 only: every gather carries both planes (forward and backward
        copies), as the RFC's original MXFP8 scheme does; needed with
        reshard_after_forward=False or activation recompute. By default each gather carries the
        plane its phase needs.
    release: zero-redundancy weights (release the BF16 weight while its FP8 copy serves).
    skip: name parts of modules kept in high precision (None: zrw.convert's default,
        lm_head and embeddings).
    Unknown recipes and scale rules raise ValueError here.
    """

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
            self.skip = _skip_parts(self.skip)

    @property
    def recipe(self) -> QuantRecipe:
        """The QuantRecipe this config quantizes with."""
        rcp = get_recipe(self.recipe_name)
        if self.scale_mode is not None and self.scale_mode != rcp.scale_mode:
            rcp = dataclasses.replace(rcp, scale_mode=self.scale_mode)
        return rcp


def convert_model(model: nn.Module, config: QuantizeConfig) -> ConvertSummary:
    """The RFC's model converter: zrw.convert(model, config.recipe, release=config.release,
    skip=config.skip), then, with enable_fsdp_low_precision_all_gather, zrw.fsdp.prepare
    (before fully_shard). Returns zrw.convert's ConvertSummary."""
    if not isinstance(config, QuantizeConfig):
        raise TypeError(
            f"zrw.rfc.convert_model: config must be a zrw.rfc.QuantizeConfig, got "
            f"{type(config).__name__}"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"zrw.rfc.convert_model: model must be a torch.nn.Module, got {type(model).__name__}"
        )
    model = unwrap_model(model)  # torch.compile(model): the model it wraps
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
    torch.float8_e5m2 (the element format; it takes precedence over the recipe's). The scale
    rule is the recipe's (QuantizeConfig.scale_mode overrides it).

    * mxfp8 ([1, 1, 32]): two copies from one read (zrw.ops.mx_quantize_dual): weight_fwd blocked
      along K with scale_fwd (.., N, ceil(K/32)); weight_bwd blocked along N with scale_bwd
      (.., ceil(N/32), K).
    * mxfp8-32x32 ([1, 32, 32]): one copy in 32x32 tiles (zrw.ops.mx_quantize_block);
      `weight_bwd is weight_fwd` (the same tensor) and only the scale's view differs: scale_fwd
      (.., N, ceil(K/32)) and scale_bwd (.., ceil(N/32), K) are the tile scale expanded.

    Scales are torch.float8_e8m0fnu. A recipe zrw does not know raises ValueError (from
    get_recipe); a dst_type that is not an fp8 element format raises ValueError.
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
        return (
            data,
            ops.expand_block_scale(block, w.shape, -1),
            data,
            ops.expand_block_scale(block, w.shape, -2),
        )
    return tuple(ops.mx_quantize_dual(w.contiguous(), dst_type, recipe.scale_mode))
