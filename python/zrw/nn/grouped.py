"""MoE experts on MXFP8: a grouped linear over a 3-D expert stack (E, N, K), and a drop-in
replacement for Hugging Face transformers' fused expert modules (e.g. Qwen3MoeExperts, whose
`gate_up_proj` is (E, 2I, H) and `down_proj` (E, H, I)).

Tokens are grouped by expert; each expert's group goes through exactly MXLinear's numerics
(zrw.nn.linear): x blocked along K for the forward, dy along N for dgrad, both along the group's
tokens for wgrad. The whole stack is quantized once per step by quant_and_release (a 3-D weight
is quantized per matrix), so each expert's planes are slices of one cached copy.
"""
from __future__ import annotations

import numbers
from typing import List, Optional, Sequence

import torch
from torch import Tensor, nn

from .. import ops
from .. import cache
from .. import parallel
from ..config import QuantRecipe, get_recipe
from .linear import (NamedWeight, ReleasedWeightsStateDict, _weight_planes,
                     check_layer_args, restamp_names)


class _MXGroupedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, counts: Sequence[int], w_fwd: Tensor,
                w_fwd_scale: Tensor, w_bwd: Tensor, w_bwd_scale: Tensor,
                elem_dtype: torch.dtype, scale_mode: str,
                main_grad_owner: Optional[Tensor] = None):
        E, N, K = weight.shape
        y = x.new_empty(x.shape[0], N)
        saved: List[Tensor] = []
        off = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            xe = x[off:off + c]
            qk, sk, qm, sm = ops.mx_quantize_dual(xe, elem_dtype, scale_mode)
            y[off:off + c] = ops.mx_matmul(qk, sk, w_fwd[e], w_fwd_scale[e], x.dtype)
            saved += [qm, sm]
            off += c
        ctx.gathered = weight if w_bwd is None else None
        ctx.save_for_backward(w_bwd, w_bwd_scale, *saved)
        ctx.counts = list(counts)
        ctx.elem_dtype, ctx.scale_mode = elem_dtype, scale_mode
        ctx.x_dtype, ctx.w_dtype, ctx.w_shape = x.dtype, weight.dtype, weight.shape
        ctx.w_requires_grad = weight.requires_grad
        ctx.main_grad_owner = main_grad_owner  # accumulate FP32 main_grad there instead of .grad
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        w_bwd, w_bwd_scale, *saved = ctx.saved_tensors
        if ctx.gathered is not None:
            w_bwd, w_bwd_scale = ctx.gathered.mx_weight("bwd").bwd
        dy = dy.contiguous()
        E, N, K = ctx.w_shape
        dx = dy.new_empty(dy.shape[0], K) if ctx.needs_input_grad[0] else None
        owner = ctx.main_grad_owner
        dw_dtype = ctx.w_dtype if owner is None else torch.float32
        dw = dy.new_zeros(ctx.w_shape, dtype=dw_dtype) if ctx.w_requires_grad else None
        off = 0
        i = 0
        for e, c in enumerate(ctx.counts):
            if c == 0:
                continue
            qn, sn, qm, sm = ops.mx_quantize_dual(dy[off:off + c], ctx.elem_dtype, ctx.scale_mode)
            if dx is not None:
                dx[off:off + c] = ops.mx_matmul(qn, sn, w_bwd[e].t(), w_bwd_scale[e].t(),
                                                ctx.x_dtype)
            if dw is not None:
                qx_m, sx_m = saved[i], saved[i + 1]
                dw[e] = ops.mx_matmul(qm.t(), sm.t(), qx_m.t(), sx_m.t(), dw_dtype)
            i += 2
            off += c
        if owner is not None and dw is not None:
            # Megatron-style: the stack's FP32 gradient accumulates in owner.main_grad (for a
            # sharded stack, a DTensor laid out like its parameter), no .grad.
            g = parallel.wrap_like(owner, dw)
            if getattr(owner, "main_grad", None) is None:
                owner.main_grad = g
            else:
                owner.main_grad.add_(g)
            dw = None
        return dx, dw, None, None, None, None, None, None, None, None


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def checked_counts(op: str, counts) -> List[int]:
    """counts as a list of Python ints: a sequence of ints (or of 0-d integer tensors) or a 1-d
    integer tensor. Floats, bools and float tensors are a TypeError, negative counts a
    ValueError, each naming counts (and the entry)."""
    if isinstance(counts, Tensor):
        if not _is_integer_dtype(counts.dtype):
            raise TypeError(f"{op}: counts must be ints (a sequence or a 1-d integer tensor), got "
                            f"a tensor of {counts.dtype}")
        if counts.dim() != 1:
            raise ValueError(f"{op}: counts must be a 1-d tensor (one count per expert), got "
                             f"shape {tuple(counts.shape)}")
        values = counts.tolist()
    else:
        if counts is None or isinstance(counts, (str, bytes)) or not hasattr(counts, "__iter__"):
            raise TypeError(f"{op}: counts must be a sequence of ints or a 1-d integer tensor, "
                            f"got {type(counts).__name__}")
        values = []
        for e, c in enumerate(counts):
            if isinstance(c, Tensor) and c.dim() == 0 and _is_integer_dtype(c.dtype):
                c = int(c)
            elif not isinstance(c, numbers.Integral) or isinstance(c, bool):
                raise TypeError(f"{op}: counts must be ints, got counts[{e}] = {c!r} "
                                f"({type(c).__name__})")
            values.append(int(c))
    for e, c in enumerate(values):
        if c < 0:
            raise ValueError(f"{op}: counts must be >= 0 (rows per expert), got counts[{e}] = {c}")
    return values


def mx_grouped_linear(x: Tensor, weight: Tensor, counts: Sequence[int], recipe: QuantRecipe,
                      release: bool = True, release_frozen: bool = False,
                      name: Optional[str] = None, main_grad: bool = False) -> Tensor:
    """y[rows of expert e] = x[rows of expert e] @ weight[e].T on MXFP8 operands.

    x: (T, K) bf16, fp16 or fp32, with its rows grouped by expert, counts[e] >= 0 rows for expert
    e (sum(counts) == T; Python ints or an integer tensor); weight: (E, N, K). `recipe` is a
    QuantRecipe or a registered name. Returns (T, N). `name` (for messages) defaults to the
    weight's own (zrw.cache.set_weight_name). `main_grad=True` accumulates the stack's gradient
    in FP32 into `weight.main_grad` instead of `.grad` (as Megatron does; zrw.convert's
    main_grad).
    """
    op = "mx_grouped_linear"
    recipe = check_layer_args(op, x, "x", weight, "(E, N, K)", recipe, name)
    shown = cache.weight_name(weight) if name is None else name
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-d (T, K), rows grouped by expert, got shape "
                         f"{tuple(x.shape)}")
    counts = checked_counts(op, counts)
    if len(counts) != weight.shape[0] or sum(counts) != x.shape[0]:
        raise ValueError(f"mx_grouped_linear: counts must have one entry per expert "
                         f"({weight.shape[0]}) summing to the {x.shape[0]} rows of x, got "
                         f"{len(counts)} entries summing to {sum(counts)}")
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"mx_grouped_linear: x's last dim must equal weight '{shown}''s K "
                         f"{weight.shape[-1]}, got x of shape {tuple(x.shape)}")
    if parallel.is_dtensor(weight):
        raise TypeError(
            f"{op}: expert stack '{shown}' is a DTensor ({weight.placements}) inside forward: "
            "zrw runs an expert stack on the local shard the parallel engine hands its forward "
            "(transformers' tp_plan / ep_plan: moe_tp_experts, ep_dispatch_experts); a DTensor "
            "expert stack without such an engine style is not supported")
    q = _weight_planes(weight, recipe, release, release_frozen, name)
    owner = parallel.main_grad_owner(weight) if main_grad else None
    return _MXGroupedFn.apply(x.contiguous(), weight, counts, q.fwd.data, q.fwd.scale,
                              q.bwd.data, q.bwd.scale, recipe.elem_dtype, recipe.scale_mode,
                              owner)


class MXGroupedLinear(NamedWeight, ReleasedWeightsStateDict, nn.Module):
    """A stack of E expert linears (E, out_features, in_features) on MXFP8, tokens grouped by
    expert: forward(x, counts) with x (T, in_features) grouped, counts[e] rows per expert."""

    zrw_quantized = ("weight",)  # with self.recipe: what zrw.fsdp.prepare wraps (see MXLinear)

    def __init__(self, num_experts: int, in_features: int, out_features: int,
                 recipe: str | QuantRecipe = "mxfp8", release: bool = True, device=None,
                 dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features,
                                               device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=in_features ** -0.5)
        self.recipe = get_recipe(recipe)
        self.release = release
        self.zrw_name = "MXGroupedLinear.weight"

    def forward(self, x: Tensor, counts: Sequence[int]) -> Tensor:
        return mx_grouped_linear(x, self.weight, counts, self.recipe, self.release)


def is_fused_experts(module: nn.Module) -> bool:
    """Hugging Face's fused-experts layout: 3-D `gate_up_proj` (E, 2I, H) and `down_proj`
    (E, H, I) parameters, an `act_fn`, and forward(hidden, top_k_index, top_k_weights)."""
    gu = module._parameters.get("gate_up_proj")
    dp = module._parameters.get("down_proj")
    return (gu is not None and dp is not None and gu.dim() == 3 and dp.dim() == 3
            and hasattr(module, "act_fn"))


class MXFusedExperts(ReleasedWeightsStateDict, nn.Module):
    """Drop-in replacement for a Hugging Face fused-experts module, on MXFP8.

    Keeps the original `gate_up_proj` / `down_proj` Parameter objects (same state_dict keys) and
    the routing semantics of the original forward: out[t] = sum over the token's top-k experts of
    weight * down(act(gate) * up).
    """

    # With self.recipe: what zrw.fsdp.prepare wraps (see MXLinear).
    zrw_quantized = ("gate_up_proj", "down_proj")

    def __init__(self, source: nn.Module, recipe: str | QuantRecipe = "mxfp8",
                 release: bool = True, release_frozen: bool = False, name: str = "",
                 main_grad: bool = False):
        super().__init__()
        if not is_fused_experts(source):
            raise TypeError(f"MXFusedExperts: {type(source).__name__} is not a fused-experts "
                            "module (3-d gate_up_proj and down_proj parameters, act_fn)")
        self.gate_up_proj = source.gate_up_proj
        self.down_proj = source.down_proj
        self.act_fn = source.act_fn
        self.num_experts = self.gate_up_proj.shape[0]
        self.recipe = get_recipe(recipe)
        self.release, self.release_frozen = release, release_frozen
        self.main_grad = main_grad
        # Each expert stack carries its name (see NamedWeight: read outside compiled regions).
        self.zrw_name = name
        restamp_names(self, self._stack_names())
        self.training = source.training
        self.source_type = type(source).__name__

    def _stack_names(self) -> dict:
        base = self.zrw_name or "experts"
        return {"gate_up_proj": f"{base}.gate_up_proj", "down_proj": f"{base}.down_proj"}

    def __setstate__(self, state) -> None:  # copies and unpickling: see NamedWeight
        super().__setstate__(state)
        restamp_names(self, self._stack_names())

    def forward(self, hidden_states: Tensor, top_k_index: Tensor,
                top_k_weights: Tensor) -> Tensor:
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
        # The stacks as a parallel engine hands them (to_local() views of DTensors) carry no
        # name of their own: pass the layer's, for zrw's messages.
        names = (self._stack_names()
                 if parallel.engine_view_owner(self.gate_up_proj) is not None else {})
        main_grad = getattr(self, "main_grad", False)  # (modules pickled before it existed)
        gu = mx_grouped_linear(x, self.gate_up_proj, counts, self.recipe, self.release,
                               self.release_frozen, names.get("gate_up_proj"), main_grad)
        gate, up = gu.chunk(2, dim=-1)
        h = self.act_fn(gate) * up
        out = mx_grouped_linear(h, self.down_proj, counts, self.recipe, self.release,
                                self.release_frozen, names.get("down_proj"), main_grad)
        out = out * top_k_weights.reshape(-1)[order, None]
        final = torch.zeros_like(hidden_states)
        final.index_add_(0, token_of, out.to(final.dtype))
        return final

    def extra_repr(self) -> str:
        return (f"{self.source_type}: experts={self.num_experts}, "
                f"gate_up_proj={tuple(self.gate_up_proj.shape)}, "
                f"down_proj={tuple(self.down_proj.shape)}, recipe={self.recipe.name}, "
                f"release={self.release}")
