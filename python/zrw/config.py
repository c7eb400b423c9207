"""Quantization recipes: which granularity each tensor of a layer is scaled at.

The names follow the MindSpeed FSDP RFC ("为 FSDP 添加 MXFP8-32x32 量化支持"). ``block_size`` is
``[token_dim, input_dim, output_dim]``: ``[1, 1, 32]``, MX blocks of 32 along one axis (the
``mxfp8`` recipe: a forward copy blocked along K, a backward copy along N), or ``[1, 32, 32]``,
one scale per 32x32 weight tile (``mxfp8-32x32``: one copy serves forward and backward, so FSDP
all-gathers it once). ``get_recipe(name)`` returns a recipe; ``@recipe_register(name)`` adds one
from a zero-argument factory.

Both built-in recipes round the shared scale up (``scale_mode="rceil"``: nothing saturates),
for the reasons of docs/design.md §3 "Defaults" and docs/accuracy.md; the OCP rule is
``get_recipe(name, scale_mode="floor")``. The ops (zrw.ops, zrw.reference) keep "floor" as
their default argument.
"""

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .ops import SCALE_MODES  # the scale rules the kernels know (one source: the C++ extension)

__all__ = [
    "MX_BLOCK_1x32",
    "MX_BLOCK_32x32",
    "QuantRecipe",
    "ScalingGranularity",
    "ScalingGranularityEnum",
    "get_recipe",
    "known_recipes",
    "recipe_register",
]

MX_BLOCK_1x32 = (1, 1, 32)
MX_BLOCK_32x32 = (1, 32, 32)
MX_BLOCK_SIZES = (MX_BLOCK_1x32, MX_BLOCK_32x32)

ELEM_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class ScalingGranularityEnum(enum.Enum):
    """How many elements share one scale. zrw implements MX scaling only (per-tensor and
    per-channel scalings have no kernel here, so they are not offered)."""

    MX = "mx"  # a block of elements shares a power-of-two (E8M0) scale


@dataclass
class ScalingGranularity:
    """A scaling granularity: ``stype``, and for ``MX`` the ``block_size``, ``[1, 1, 32]`` or
    ``[1, 32, 32]`` (see the module doc), given as a list or a tuple and stored as a tuple."""

    stype: ScalingGranularityEnum
    block_size: tuple[int, ...] | list[int] | None = None

    def __post_init__(self):
        if not isinstance(self.stype, ScalingGranularityEnum):
            allowed = ", ".join(f"ScalingGranularityEnum.{m.name}" for m in ScalingGranularityEnum)
            raise ValueError(
                f"ScalingGranularity: stype must be one of {allowed}, found {self.stype!r}"
            )
        self.block_size = _checked_mx_block_size(self.block_size)

    @property
    def is_mx(self) -> bool:
        return self.stype is ScalingGranularityEnum.MX


def _checked_mx_block_size(block_size):
    allowed = " or ".join(str(list(size)) for size in MX_BLOCK_SIZES)
    is_int_sequence = isinstance(block_size, (list, tuple)) and all(
        isinstance(extent, int) and not isinstance(extent, bool) for extent in block_size
    )
    if not is_int_sequence or tuple(block_size) not in MX_BLOCK_SIZES:
        raise ValueError(
            f"ScalingGranularity: block_size for stype=MX must be {allowed}, found {block_size!r}"
        )
    return tuple(block_size)


@dataclass(frozen=True)
class QuantRecipe:
    """How a layer quantizes its weight, its input activation and its output gradient:
    ``elem_dtype`` (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``) and the MX scale rule
    ``scale_mode`` (``"rceil"``, the default, or ``"floor"``). Only weights may use 32x32 tiles:
    activations and gradients are quantized per 1x32 block along the axis each matmul reduces
    over."""

    name: str
    weight_granularity: ScalingGranularity
    act_granularity: ScalingGranularity
    grad_granularity: ScalingGranularity
    elem_dtype: torch.dtype = torch.float8_e4m3fn
    scale_mode: str = "rceil"

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"QuantRecipe: name must be a non-empty str, found {self.name!r}")
        for field_name in ("weight_granularity", "act_granularity", "grad_granularity"):
            granularity = getattr(self, field_name)
            if not isinstance(granularity, ScalingGranularity):
                raise ValueError(
                    f"QuantRecipe {self.name!r}: {field_name} must be a ScalingGranularity, "
                    f"found {granularity!r}"
                )
        for field_name in ("act_granularity", "grad_granularity"):
            granularity = getattr(self, field_name)
            if granularity.block_size != MX_BLOCK_1x32:
                raise ValueError(
                    f"QuantRecipe {self.name!r}: {field_name} block_size must be "
                    f"{list(MX_BLOCK_1x32)} (32x32 tiles are for weights only), "
                    f"found {list(granularity.block_size)}"
                )
        if self.elem_dtype not in ELEM_DTYPES:
            raise ValueError(
                f"QuantRecipe {self.name!r}: elem_dtype must be one of {ELEM_DTYPES}, "
                f"found {self.elem_dtype!r}"
            )
        if self.scale_mode not in SCALE_MODES:
            raise ValueError(
                f"QuantRecipe {self.name!r}: scale_mode must be one of {SCALE_MODES}, "
                f"found {self.scale_mode!r}"
            )

    @property
    def block_32x32(self) -> bool:
        """True when the weight is quantized in 32x32 tiles (one copy for forward and backward)."""
        granularity = self.weight_granularity
        return granularity.is_mx and granularity.block_size == MX_BLOCK_32x32

    @property
    def cache_layout(self) -> str:
        """The native cache's weight layout for this recipe (zrw.cache.RECIPES, MXWeight.recipe):
        "mxfp8-32x32" (one copy in 32x32 tiles) or "mxfp8" (two 1x32 planes)."""
        return "mxfp8-32x32" if self.block_32x32 else "mxfp8"


# name -> zero-argument factory. Factories rather than instances: ScalingGranularity is mutable, so
# every get_recipe call hands out a fresh recipe that no caller can corrupt for the next one.
_RECIPE_FACTORIES: dict[str, Callable[[], QuantRecipe]] = {}


def recipe_register(name: str):
    """Decorator registering a zero-argument factory returning the ``QuantRecipe`` named ``name``
    (ValueError if ``name`` is already registered)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"recipe_register: name must be a non-empty str, found {name!r}")
    if name in _RECIPE_FACTORIES:
        raise ValueError(
            f"recipe_register: a recipe named {name!r} is already registered; "
            f"known recipes: {known_recipes()}"
        )

    def register(factory):
        if not callable(factory):
            raise ValueError(
                f"recipe_register({name!r}) must decorate a zero-argument function returning a "
                f"QuantRecipe, found {factory!r}"
            )
        _RECIPE_FACTORIES[name] = factory
        return factory

    return register


def known_recipes() -> list[str]:
    """Names of the registered recipes, in registration order."""
    return list(_RECIPE_FACTORIES)


def get_recipe(name, scale_mode: str | None = None) -> QuantRecipe:
    """The recipe registered as ``name`` (a ``QuantRecipe`` is returned as is), with
    ``scale_mode`` ("floor" or "rceil"), when given, as its scale rule. ValueError for an
    unknown name (listing the known ones) or scale rule, or a factory whose result is not a
    QuantRecipe of that name."""
    if scale_mode is not None:
        recipe = get_recipe(name)
        if scale_mode == recipe.scale_mode:
            return recipe
        return dataclasses.replace(recipe, scale_mode=scale_mode)  # checked in __post_init__
    if isinstance(name, QuantRecipe):
        return name
    if not isinstance(name, str) or name not in _RECIPE_FACTORIES:
        raise ValueError(
            f"get_recipe: recipe must be a QuantRecipe or one of {known_recipes()}, found {name!r}"
        )
    recipe = _RECIPE_FACTORIES[name]()
    if not isinstance(recipe, QuantRecipe) or recipe.name != name:
        raise ValueError(
            f"get_recipe: the factory registered as {name!r} must return a QuantRecipe named "
            f"{name!r}, found {recipe!r}"
        )
    return recipe


def _mx(block_size):
    return ScalingGranularity(ScalingGranularityEnum.MX, block_size)


@recipe_register("mxfp8")
def register_mxfp8_recipe() -> QuantRecipe:
    """Weights, activations and gradients all in 1x32 MX blocks (a weight keeps two copies)."""
    return QuantRecipe("mxfp8", _mx(MX_BLOCK_1x32), _mx(MX_BLOCK_1x32), _mx(MX_BLOCK_1x32))


@recipe_register("mxfp8-32x32")
def register_mxfp8_32x32_recipe() -> QuantRecipe:
    """Weights in 32x32 tiles (one copy, all-gathered once); activations and gradients in 1x32."""
    return QuantRecipe("mxfp8-32x32", _mx(MX_BLOCK_32x32), _mx(MX_BLOCK_1x32), _mx(MX_BLOCK_1x32))
