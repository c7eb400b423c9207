"""MXLinear: nn.Linear whose GEMMs run on MXFP8 operands, with the weight from the native cache
(the GEMMs: zrw.nn.functional; state dicts, pickling, loads and casts: zrw.state_dict)."""

from __future__ import annotations

from torch import Tensor, nn

from ..config import QuantRecipe, get_recipe
from ..state_dict import NamedWeight, ReleasedWeightsStateDict
from ..weights import WeightPolicy
from .functional import linear, mx_linear  # noqa: F401  (zrw.nn.mx_linear)


def check_layer_init(op: str, sizes: dict, flags: dict, recipe) -> QuantRecipe:
    """The constructor arguments zrw's layer classes share, each refused with an error that
    names it before the layer is built: sizes are ints >= 0, flags bools, the recipe a
    QuantRecipe or a registered name. Returns the recipe."""
    for arg, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{op}: {arg} must be an int, got {type(value).__name__} ({value!r})")
        if value < 0:
            raise ValueError(f"{op}: {arg} must be >= 0, got {value}")
    for arg, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{op}: {arg} must be a bool, got {type(value).__name__} ({value!r})")
    if not isinstance(recipe, (str, QuantRecipe)):
        raise TypeError(
            f"{op}: recipe must be a zrw.QuantRecipe or a registered recipe name, got "
            f"{type(recipe).__name__}"
        )
    try:
        return get_recipe(recipe)
    except ValueError as e:
        raise ValueError(f"{op}: recipe: {e}") from None


class MXLinear(NamedWeight, ReleasedWeightsStateDict, nn.Linear):
    """Drop-in nn.Linear training on MXFP8 with zero-redundancy weights: the weight (and bias)
    are ordinary parameters (same objects, same state_dict keys), the GEMMs read the weight's
    cached MXFP8 copy, and with release=True the BF16 weight's storage is freed from its first
    use in a step (docs/design.md §5). `main_grad=True` accumulates the weight gradient in FP32
    into `weight.main_grad` instead of `.grad` (as Megatron does)."""

    # What this layer quantizes, with `self.recipe` (read by zrw.fsdp.prepare): these parameters
    # may be replaced by a zrw.planes.MXPlanesCarrier (FSDP2's gathered weight).
    zrw_quantized = ("weight",)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        recipe: str | QuantRecipe = "mxfp8",
        release: bool = True,
        release_frozen: bool = False,
        main_grad: bool = False,
        device=None,
        dtype=None,
    ):
        flags = {"release": release, "release_frozen": release_frozen, "main_grad": main_grad}
        sizes = {"in_features": in_features, "out_features": out_features}
        rcp = check_layer_init("zrw.nn.linear.MXLinear", sizes, {"bias": bias, **flags}, recipe)
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = rcp
        self.release, self.release_frozen, self.main_grad = release, release_frozen, main_grad
        self.zrw_name = "MXLinear.weight"

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        recipe: str | QuantRecipe = "mxfp8",
        release: bool = True,
        release_frozen: bool = False,
        main_grad: bool = False,
        name: str = "",
    ) -> "MXLinear":
        """An MXLinear that takes over `linear`'s parameters (the same Parameter objects)."""
        op = "MXLinear.from_linear"
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{op}: linear must be a torch.nn.Linear, got {type(linear).__name__}")
        flags = {"release": release, "release_frozen": release_frozen, "main_grad": main_grad}
        recipe = check_layer_init(op, {}, flags, recipe)
        if not isinstance(name, str):
            raise TypeError(f"{op}: name must be a str, got {type(name).__name__}")
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.in_features, m.out_features = linear.in_features, linear.out_features
        m.weight = linear.weight
        m.bias = linear.bias
        m.recipe = recipe
        m.release, m.release_frozen, m.main_grad = release, release_frozen, main_grad
        m.zrw_name = name or "MXLinear.weight"
        # Hooks and training flag carry over, so the swap is invisible to the rest of the model.
        m.training = linear.training
        m._forward_hooks = linear._forward_hooks
        m._forward_pre_hooks = linear._forward_pre_hooks
        return m

    @property
    def policy(self) -> WeightPolicy:
        """How this layer quantizes its weight (zrw.weights.WeightPolicy)."""
        return WeightPolicy.cached(self)

    def forward(self, x: Tensor) -> Tensor:
        # The name for messages is the weight's own (NamedWeight stamps it on every weight the
        # layer gets, a parallel engine's DTensor included): never a per-layer string here.
        return linear(x, self.weight, self.bias, WeightPolicy.cached(self))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}, release={self.release}"
