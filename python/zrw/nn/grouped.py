"""MoE experts on MXFP8: a grouped linear over a 3-D expert stack (E, N, K), and a drop-in
replacement for Hugging Face's fused expert modules (e.g. Qwen3MoeExperts). Each expert's token
group goes through exactly MXLinear's numerics (zrw.nn.functional); the whole stack is quantized
once per step (per matrix), so each expert's planes are slices of one cached copy.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

from .._dtensor import engine_view_owner
from ..config import QuantRecipe
from ..state_dict import NamedWeight, ReleasedWeightsStateDict, restamp_names
from ..weights import WeightPolicy
from .functional import grouped_linear, mx_grouped_linear  # noqa: F401  (zrw.nn.mx_grouped_linear)
from .linear import check_layer_init


class MXGroupedLinear(NamedWeight, ReleasedWeightsStateDict, nn.Module):
    """A stack of E expert linears (E, out_features, in_features) on MXFP8, tokens grouped by
    expert: forward(x, counts) with x (T, in_features) grouped, counts[e] rows per expert."""

    zrw_quantized = ("weight",)  # with self.recipe: what zrw.fsdp.prepare wraps (see MXLinear)

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        recipe: str | QuantRecipe = "mxfp8",
        release: bool = True,
        device=None,
        dtype=None,
        release_frozen: bool = False,
        main_grad: bool = False,
    ):
        sizes = dict(num_experts=num_experts, in_features=in_features, out_features=out_features)
        flags = dict(release=release, release_frozen=release_frozen, main_grad=main_grad)
        rcp = check_layer_init("zrw.nn.grouped.MXGroupedLinear", sizes, flags, recipe)
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_experts, out_features, in_features, device=device, dtype=dtype)
        )
        nn.init.normal_(self.weight, std=in_features**-0.5)
        self.recipe = rcp
        self.release, self.release_frozen, self.main_grad = release, release_frozen, main_grad
        self.zrw_name = "MXGroupedLinear.weight"

    @property
    def policy(self) -> WeightPolicy:
        """How this layer quantizes its weight (zrw.weights.WeightPolicy)."""
        return WeightPolicy.cached(self)

    def forward(self, x: Tensor, counts: Sequence[int]) -> Tensor:
        return grouped_linear(x, self.weight, counts, WeightPolicy.cached(self))


def is_fused_experts(module: nn.Module) -> bool:
    """Hugging Face's fused-experts layout: 3-D `gate_up_proj` (E, 2I, H) and `down_proj`
    (E, H, I) parameters, an `act_fn`, and forward(hidden, top_k_index, top_k_weights)."""
    stacks = [module._parameters.get(n) for n in ("gate_up_proj", "down_proj")]
    return all(p is not None and p.dim() == 3 for p in stacks) and hasattr(module, "act_fn")


class MXFusedExperts(NamedWeight, ReleasedWeightsStateDict, nn.Module):
    """Drop-in replacement for a Hugging Face fused-experts module, on MXFP8.

    Keeps the original `gate_up_proj` / `down_proj` Parameter objects (same state_dict keys) and
    the routing semantics of the original forward: out[t] = sum over the token's top-k experts of
    weight * down(act(gate) * up).
    """

    # With self.recipe: what zrw.fsdp.prepare wraps (see MXLinear).
    zrw_quantized = ("gate_up_proj", "down_proj")
    zrw_name = ""  # a plain attribute here: the base of the two stacks' names

    def __init__(
        self,
        source: nn.Module,
        recipe: str | QuantRecipe = "mxfp8",
        release: bool = True,
        release_frozen: bool = False,
        name: str = "",
        main_grad: bool = False,
    ):
        op = "zrw.nn.grouped.MXFusedExperts"
        if not isinstance(source, nn.Module) or not is_fused_experts(source):
            raise TypeError(
                f"{op}: source must be a fused-experts module (3-d gate_up_proj and down_proj "
                f"parameters, act_fn), got {type(source).__name__}"
            )
        flags = {"release": release, "release_frozen": release_frozen, "main_grad": main_grad}
        recipe = check_layer_init(op, {}, flags, recipe)
        if not isinstance(name, str):
            raise TypeError(f"{op}: name must be a str, got {type(name).__name__}")
        super().__init__()
        self.gate_up_proj = source.gate_up_proj
        self.down_proj = source.down_proj
        self.act_fn = source.act_fn
        self.num_experts = self.gate_up_proj.shape[0]
        self.recipe = recipe
        self.release, self.release_frozen, self.main_grad = release, release_frozen, main_grad
        # Each expert stack carries its name (see NamedWeight: read outside compiled regions).
        self.zrw_name = name
        restamp_names(self, self._weight_names())
        self.training = source.training
        self.source_type = type(source).__name__

    def _weight_names(self) -> dict:
        base = self.__dict__.get("zrw_name") or "experts"
        return {"gate_up_proj": f"{base}.gate_up_proj", "down_proj": f"{base}.down_proj"}

    @property
    def policy(self) -> WeightPolicy:
        """How this layer quantizes its stacks (zrw.weights.WeightPolicy)."""
        return WeightPolicy.cached(self)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        T, H = hidden_states.shape
        k = top_k_index.shape[-1]
        with torch.no_grad():
            flat = top_k_index.reshape(-1)
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=self.num_experts)[: self.num_experts].tolist()
            token_of = order // k
        n_routed = sum(counts)
        order, token_of = order[:n_routed], token_of[:n_routed]  # drops any index >= E
        x = hidden_states[token_of]
        # The names for messages are the stacks' own (NamedWeight stamps every stack registered
        # on the layer). transformers' expert styles swap in to_local() views through
        # `module._parameters[...]`, which no hook sees: those views get the layer's names.
        names = self._weight_names() if engine_view_owner(self.gate_up_proj) is not None else {}
        policy = WeightPolicy.cached(self)
        gu = grouped_linear(x, self.gate_up_proj, counts, policy.named(names.get("gate_up_proj")))
        gate, up = gu.chunk(2, dim=-1)
        h = self.act_fn(gate) * up
        out = grouped_linear(h, self.down_proj, counts, policy.named(names.get("down_proj")))
        out = out * top_k_weights.reshape(-1)[order, None]
        final = torch.zeros_like(hidden_states)
        final.index_add_(0, token_of, out.to(final.dtype))
        return final

    def extra_repr(self) -> str:
        return (
            f"{self.source_type}: experts={self.num_experts}, "
            f"gate_up_proj={tuple(self.gate_up_proj.shape)}, "
            f"down_proj={tuple(self.down_proj.shape)}, recipe={self.recipe.name}, "
            f"release={self.release}"
        )
