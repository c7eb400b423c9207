"""The MXFP8 GEMMs of zrw's layers: their autograd functions and functional forms, in one place.

Numerics (docs/design.md §6), for x (M, K), W (N, K), dy (M, N):
  forward  y  = mx_matmul(Q_K(x), W_fwd)                 x blocked along K, W_fwd along K
  dgrad    dx = mx_matmul(Q_N(dy), W_bwd.t())            dy along N, W_bwd along N
  wgrad    dW = mx_matmul(Q_M(dy).t(), Q_M(x).t())       both along M (tokens)
all with FP32 accumulation. An expert stack (E, N, K) runs each expert's group of tokens through
exactly these numerics. The weight planes come from zrw.weights.weight_planes (the native cache,
FSDP2's gathered planes or a DTensor's local shard), called in the forward under the caller's
grad mode (which the release guard reads); never from a BF16 weight saved for backward. The
activation is quantized along both axes in one read (mx_quantize_dual); the functions save its
FP8 M-plane, not the BF16 activation. With main_grad the FP32 weight gradient accumulates in
the parameter's `main_grad` (zrw.weights.accumulate_main_grad) instead of `.grad`.
"""

from __future__ import annotations

import math
import numbers
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from .. import cache
from .._dtensor import (
    _dtensor_cls,
    check_dtensor,
    check_placements,
    check_tensor,
    is_dtensor,
    shard_info,
)
from ..config import QuantRecipe, get_recipe
from ..planes import MXPlanesCarrier, MXWeight
from ..weights import (
    WeightPolicy,
    accumulate_main_grad,
    check_policy,
    check_recipe,
    planes,
    quant_local,
    resolve,
    weight_planes,
)
from ..weights import main_grad_owner as _main_grad_owner

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# The name the errors of the functional forms (and so of the layers, which call them) give.
_LINEAR = "zrw.nn.functional.mx_linear"
_GROUPED = "zrw.nn.functional.mx_grouped_linear"

# The functional forms a user calls; the layers' own path, `linear` / `grouped_linear`, takes
# their zrw.weights.WeightPolicy.
__all__ = ["INPUT_DTYPES", "dtensor_linear", "mx_grouped_linear", "mx_linear"]

# The GEMMs' ops run inside the autograd functions below, where no input requires grad: the
# dispatcher is sent straight past the Autograd key (zrw._autograd's refusal of differentiable
# inputs, a Python kernel, would cost a Python round trip per op for nothing).
_below_autograd = torch._C._AutoDispatchBelowAutograd
# ...and they call the op overloads themselves: their operands are made here (the planes from
# the cache, the activation checked by the layer), so zrw.ops' Python type checks would only
# repeat what the C++ kernels check anyway.
_quantize_dual = torch.ops.zrw.mx_quantize_dual.default
_matmul = torch.ops.zrw.mx_matmul.default


class _MXLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x2d: Tensor,
        weight: Tensor,
        bias: Optional[Tensor],
        w_fwd: Tensor,
        w_fwd_scale: Tensor,
        w_bwd: Tensor,
        w_bwd_scale: Tensor,
        elem_dtype: torch.dtype,
        scale_mode: str,
        main_grad_owner: Optional[Tensor],
    ):
        with _below_autograd():
            qx_k, sx_k, qx_m, sx_m = _quantize_dual(x2d, elem_dtype, scale_mode)
            y = _matmul(qx_k, sx_k, w_fwd, w_fwd_scale, x2d.dtype)
        if bias is not None:
            y = y + bias
        ctx.gathered = weight if w_bwd is None else None
        ctx.save_for_backward(qx_m, sx_m, w_bwd, w_bwd_scale)
        ctx.main_grad_owner = main_grad_owner  # accumulate FP32 main_grad there, no .grad
        ctx.has_bias = bias is not None
        ctx.elem_dtype, ctx.scale_mode = elem_dtype, scale_mode
        ctx.x_dtype, ctx.w_dtype = x2d.dtype, weight.dtype
        ctx.w_requires_grad = weight.requires_grad
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        qx_m, sx_m, w_bwd, w_bwd_scale = ctx.saved_tensors
        if ctx.gathered is not None:
            # FSDP2: the backward re-gather has just filled the weight's backward plane.
            w_bwd, w_bwd_scale = ctx.gathered.mx_weight("bwd").bwd
        dy = dy.contiguous()
        dx = dw = None
        owner = ctx.main_grad_owner
        with _below_autograd():
            qdy_n, sdy_n, qdy_m, sdy_m = _quantize_dual(dy, ctx.elem_dtype, ctx.scale_mode)
            if ctx.needs_input_grad[0]:
                dx = _matmul(qdy_n, sdy_n, w_bwd.t(), w_bwd_scale.t(), ctx.x_dtype)
            if ctx.w_requires_grad:
                dw_dtype = ctx.w_dtype if owner is None else torch.float32
                dw = _matmul(qdy_m.t(), sdy_m.t(), qx_m.t(), sx_m.t(), dw_dtype)
        if ctx.w_requires_grad:
            if owner is not None:
                accumulate_main_grad(owner, dw)
                dw = None
        db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None, None, None, None, None


class _MXGroupedFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        weight: Tensor,
        counts: Sequence[int],
        w_fwd: Tensor,
        w_fwd_scale: Tensor,
        w_bwd: Tensor,
        w_bwd_scale: Tensor,
        elem_dtype: torch.dtype,
        scale_mode: str,
        main_grad_owner: Optional[Tensor] = None,
    ):
        E, N, K = weight.shape
        y = x.new_empty(x.shape[0], N)
        saved: List[Tensor] = []
        off = 0
        with _below_autograd():
            for e, c in enumerate(counts):
                if c == 0:
                    continue
                xe = x[off : off + c]
                qk, sk, qm, sm = _quantize_dual(xe, elem_dtype, scale_mode)
                y[off : off + c] = _matmul(qk, sk, w_fwd[e], w_fwd_scale[e], x.dtype)
                saved += [qm, sm]
                off += c
        ctx.gathered = weight if w_bwd is None else None
        ctx.save_for_backward(w_bwd, w_bwd_scale, *saved)
        ctx.counts = list(counts)
        ctx.elem_dtype, ctx.scale_mode = elem_dtype, scale_mode
        ctx.x_dtype, ctx.w_dtype, ctx.w_shape = x.dtype, weight.dtype, weight.shape
        ctx.w_requires_grad = weight.requires_grad
        ctx.main_grad_owner = main_grad_owner  # accumulate FP32 main_grad there, no .grad
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
        with _below_autograd():
            for e, c in enumerate(ctx.counts):
                if c == 0:
                    continue
                qn, sn, qm, sm = _quantize_dual(dy[off : off + c], ctx.elem_dtype, ctx.scale_mode)
                if dx is not None:
                    dx[off : off + c] = _matmul(
                        qn, sn, w_bwd[e].t(), w_bwd_scale[e].t(), ctx.x_dtype
                    )
                if dw is not None:
                    qx_m, sx_m = saved[i], saved[i + 1]
                    dw[e] = _matmul(qm.t(), sm.t(), qx_m.t(), sx_m.t(), dw_dtype)
                i += 2
                off += c
        if owner is not None and dw is not None:
            accumulate_main_grad(owner, dw)
            dw = None
        return dx, dw, None, None, None, None, None, None, None, None


# ---- argument checks -----------------------------------------------------------------------


def check_layer_args(
    op: str, x, x_arg: str, weight, weight_shape: str, recipe, name: Optional[str]
) -> QuantRecipe:
    """The arguments every zrw layer shares, each refused with an error naming it
    (docs/design.md §8): TypeError for a wrong type or dtype, ValueError for a wrong rank.
    `weight_shape` is the weight's layout, "(N, K)" or "(E, N, K)"; its rank is the number of its
    letters. Returns the recipe (a QuantRecipe, or the one registered under a str name)."""
    if not isinstance(weight, Tensor):
        raise TypeError(f"{op}: weight must be a torch.Tensor, got {type(weight).__name__}")
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}: {x_arg} must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(recipe, str):
        recipe = get_recipe(recipe)
    elif not isinstance(recipe, QuantRecipe):
        raise TypeError(
            f"{op}: recipe must be a zrw.QuantRecipe or a registered recipe name, "
            f"got {type(recipe).__name__}"
        )
    rank = weight_shape.count(",") + 1
    if weight.dim() != rank:
        shown = cache.weight_name(weight) if name is None else name
        label = f"weight '{shown}'" if shown else "weight"
        raise ValueError(
            f"{op}: {label} must be {rank}-d {weight_shape}, got shape {tuple(weight.shape)}"
        )
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(
            f"{op}: {x_arg} must be torch.bfloat16, torch.float16 or torch.float32, got {x.dtype}"
        )
    return recipe


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def checked_counts(op: str, counts) -> List[int]:
    """counts as a list of Python ints: a sequence of ints (or of 0-d integer tensors) or a 1-d
    integer tensor. Floats, bools and float tensors are a TypeError, negative counts a
    ValueError, each naming counts (and the entry)."""
    if isinstance(counts, Tensor):
        if not _is_integer_dtype(counts.dtype):
            raise TypeError(
                f"{op}: counts must be ints (a sequence or a 1-d integer tensor), got "
                f"a tensor of {counts.dtype}"
            )
        if counts.dim() != 1:
            raise ValueError(
                f"{op}: counts must be a 1-d tensor (one count per expert), got "
                f"shape {tuple(counts.shape)}"
            )
        values = counts.tolist()
    else:
        if counts is None or isinstance(counts, (str, bytes)) or not hasattr(counts, "__iter__"):
            raise TypeError(
                f"{op}: counts must be a sequence of ints or a 1-d integer tensor, "
                f"got {type(counts).__name__}"
            )
        values = []
        for e, c in enumerate(counts):
            if isinstance(c, Tensor) and c.dim() == 0 and _is_integer_dtype(c.dtype):
                c = int(c)
            elif not isinstance(c, numbers.Integral) or isinstance(c, bool):
                raise TypeError(
                    f"{op}: counts must be ints, got counts[{e}] = {c!r} ({type(c).__name__})"
                )
            values.append(int(c))
    for e, c in enumerate(values):
        if c < 0:
            raise ValueError(f"{op}: counts must be >= 0 (rows per expert), got counts[{e}] = {c}")
    return values


# ---- linear ----------------------------------------------------------------------------------


def mx_linear(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    recipe: QuantRecipe,
    release: bool = True,
    release_frozen: bool = False,
    name: Optional[str] = None,
    main_grad: bool = False,
) -> Tensor:
    """Functional MXLinear: y = x @ W.T + b on MXFP8 operands; x (..., K) bf16, fp16 or fp32,
    W (N, K), bias (N,) or None. `recipe` is a QuantRecipe or a registered name. `name` (for
    messages) defaults to the weight's own (zrw.cache.set_weight_name). A DTensor weight (tensor
    parallelism) computes on the rank's local shard (`dtensor_linear`). The flags make one
    zrw.weights.WeightPolicy; the layers pass theirs to `linear` directly."""
    recipe = check_layer_args(_LINEAR, x, "input", weight, "(N, K)", recipe, name)
    return _linear(x, weight, bias, WeightPolicy(recipe, release, release_frozen, main_grad, name))


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], policy: WeightPolicy) -> Tensor:
    """mx_linear with the weight's policy (recipe, release flags, main_grad, name) as one
    object: what MXLinear's forward calls with its cached `policy`."""
    policy = check_policy(_LINEAR, policy)
    check_layer_args(_LINEAR, x, "input", weight, "(N, K)", policy.recipe, policy.name)
    return _linear(x, weight, bias, policy)


def _linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], policy: WeightPolicy) -> Tensor:
    """linear after the arguments every layer shares were checked (check_layer_args)."""
    if x.dim() < 1:
        raise ValueError(
            f"{_LINEAR}: input must have at least one dimension (..., K), got a 0-d tensor"
        )
    if bias is not None:
        if not isinstance(bias, Tensor):
            raise TypeError(
                f"{_LINEAR}: bias must be a torch.Tensor or None, got {type(bias).__name__}"
            )
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(
                f"{_LINEAR}: bias must have shape ({weight.shape[0]},) (the "
                f"weight's out_features), got {tuple(bias.shape)}"
            )
    h = resolve(weight)  # what the weight is, decided once for this call
    if x.shape[-1] != weight.shape[-1]:
        name = policy.name or h.name
        raise ValueError(
            f"{_LINEAR}: input's last dim must equal weight '{name}''s in_features "
            f"{weight.shape[-1]}, got input of shape {tuple(x.shape)}"
        )
    if h.kind == "dtensor":
        return _dtensor_linear(x, weight, bias, policy)
    return apply_mx_linear(
        x,
        weight,
        bias,
        planes(h, policy),
        policy.recipe,
        policy.main_grad,
        main_grad_owner=h.grad_owner,
    )


def apply_mx_linear(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    q: MXWeight,
    recipe: QuantRecipe,
    main_grad: bool = False,
    main_grad_owner: Optional[Tensor] = None,
) -> Tensor:
    """The MXLinear GEMMs with the weight's planes `q` already looked up; `weight` is the
    tensor autograd hands the weight gradient (for a sharded weight, the view of its local
    shard) and `main_grad_owner` the parameter that accumulates main_grad (default: the
    parameter `weight` stands for)."""
    if not main_grad:
        main_grad_owner = None
    elif main_grad_owner is None:
        main_grad_owner = _main_grad_owner(weight)
    x2d = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # also with no input features
    if not x2d.is_contiguous():
        x2d = x2d.contiguous()
    y = _MXLinearFn.apply(
        x2d,
        weight,
        bias,
        q.fwd.data,
        q.fwd.scale,
        q.bwd.data,
        q.bwd.scale,
        recipe.elem_dtype,
        recipe.scale_mode,
        main_grad_owner,
    )
    return y.reshape(*x.shape[:-1], weight.shape[0])


def dtensor_linear(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    recipe: QuantRecipe,
    release: bool,
    release_frozen: bool,
    name: Optional[str],
    main_grad: bool,
) -> Tensor:
    """y = x @ W.T (+ b) for a DTensor weight W (N, K), on the rank's local shard, with the
    placements PyTorch's DTensor engine gives F.linear:
      W Shard(0) (colwise):  x Replicate -> y Shard(-1); x's gradient is a partial sum
      W Shard(1) (rowwise):  x Shard(-1) -> y Partial (the engine reduces it); a replicated
                             bias is added after the reduction
      W Replicate:           x replicated -> y replicated
    x is redistributed to the placement it needs (the engine's collective) when it arrives
    otherwise. Returns a DTensor. (Also zrw.parallel.dtensor_linear.)"""
    check_recipe("zrw.nn.functional.dtensor_linear", recipe)
    return _dtensor_linear(
        x, weight, bias, WeightPolicy(recipe, release, release_frozen, main_grad, name)
    )


def _dtensor_linear(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], policy: WeightPolicy
) -> Tensor:
    """dtensor_linear with the weight's policy as one object."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    recipe, release, release_frozen = policy.recipe, policy.release, policy.release_frozen
    main_grad, name = policy.main_grad, policy.name
    op = "zrw.nn.functional.dtensor_linear"
    check_dtensor(op, "weight", weight)
    check_tensor(op, "x", x)
    if bias is not None:
        check_tensor(op, "bias", bias)
    check_recipe(op, recipe)
    owner = weight._local_tensor
    # FSDP2 x TP: the gathered TP-local weight carries its MX planes (zrw.fsdp).
    carrier = isinstance(owner, MXPlanesCarrier)
    name = name or cache.weight_name(owner) or cache.weight_name(weight) or None
    shown = name or "MXLinear.weight"
    check_placements(weight, shown)
    if not is_dtensor(x):
        raise TypeError(
            f"{_LINEAR}: weight '{shown}' is a DTensor ({weight.placements} on a mesh of "
            f"{weight.device_mesh.size()}), so the input must be a DTensor on the same mesh "
            f"(the parallel style prepares it), got a plain {type(x).__name__} of shape "
            f"{tuple(x.shape)}"
        )
    mesh = weight.device_mesh
    if x.device_mesh != mesh:
        raise ValueError(
            f"{_LINEAR}: the input of weight '{shown}' lives on another device "
            f"mesh ({x.device_mesh}) than the weight ({mesh})"
        )
    (wp,) = weight.placements
    wdim, factor = shard_info(wp)
    if factor != 1:
        raise ValueError(
            f"{_LINEAR}: weight '{shown}' is sharded {wp} (packed parts): such a weight reaches "
            "zrw as its local shard through the engine style that packed it (transformers' "
            "packed_colwise), never as a DTensor inside forward"
        )
    if wdim is not None:
        wdim %= weight.dim()
    last = x.dim() - 1
    x_grad = None
    if wdim is None:
        (xp,) = x.placements
        if xp.is_partial() or (xp.is_shard() and xp.dim % x.dim() == last):
            raise ValueError(
                f"{_LINEAR}: weight '{shown}' is replicated, so its input must not be "
                f"sharded along in_features nor partial, got {x.placements}"
            )
        if xp.is_shard():
            raise ValueError(
                f"{_LINEAR}: weight '{shown}' is replicated and its input sharded {xp}: "
                "the weight gradient would be a partial sum over ranks; shard the weight "
                "(ColwiseParallel / RowwiseParallel) or replicate the input"
            )
        want, out = Replicate(), Replicate()
    elif wdim == 0:  # Shard(0): out_features
        want, out, x_grad = Replicate(), Shard(last), Partial()
    else:  # Shard(1): in_features
        want, out = Shard(last), Partial()
    if x.placements != (want,):
        x = x.redistribute(mesh, [want])
    # Quantize (and release) before any view of the local tensor exists (the guard refuses
    # to free a storage another tensor holds), then take the autograd-connected view.
    if carrier:
        q = weight_planes(owner, policy.named(name))
    else:
        q = quant_local(owner, weight.requires_grad, recipe, release, release_frozen, name)
    w_local = weight.to_local()
    x_local = x.to_local(grad_placements=None if x_grad is None else [x_grad])
    b_local, b_after = None, None
    if bias is not None:
        if wdim == 1:
            b_after = bias  # replicated: added once, after the engine's reduction
        else:
            b_local = bias.to_local() if is_dtensor(bias) else bias
    y_local = apply_mx_linear(
        x_local, w_local, b_local, q, recipe, main_grad, main_grad_owner=weight
    )
    shape = (*x.shape[:-1], weight.shape[0])
    stride = torch.empty(shape, device="meta").stride()
    y = _dtensor_cls().from_local(
        y_local, mesh, [out], run_check=False, shape=torch.Size(shape), stride=stride
    )
    if b_after is not None:
        y = y + b_after
    return y


# ---- grouped (experts) -----------------------------------------------------------------------


def mx_grouped_linear(
    x: Tensor,
    weight: Tensor,
    counts: Sequence[int],
    recipe: QuantRecipe,
    release: bool = True,
    release_frozen: bool = False,
    name: Optional[str] = None,
    main_grad: bool = False,
) -> Tensor:
    """y[rows of expert e] = x[rows of expert e] @ weight[e].T on MXFP8 operands.

    x: (T, K) bf16, fp16 or fp32, with its rows grouped by expert, counts[e] >= 0 rows for expert
    e (sum(counts) == T; Python ints or an integer tensor); weight: (E, N, K). `recipe` is a
    QuantRecipe or a registered name. Returns (T, N). `name` (for messages) defaults to the
    weight's own (zrw.cache.set_weight_name). `main_grad=True` accumulates the stack's gradient
    in FP32 into `weight.main_grad` instead of `.grad` (as Megatron does; zrw.convert's
    main_grad).
    """
    recipe = check_layer_args(_GROUPED, x, "x", weight, "(E, N, K)", recipe, name)
    return _grouped_linear(
        x, weight, counts, WeightPolicy(recipe, release, release_frozen, main_grad, name)
    )


def grouped_linear(
    x: Tensor, weight: Tensor, counts: Sequence[int], policy: WeightPolicy
) -> Tensor:
    """mx_grouped_linear with the stack's policy as one object: what the expert layers' forward
    calls with their cached `policy`."""
    policy = check_policy(_GROUPED, policy)
    check_layer_args(_GROUPED, x, "x", weight, "(E, N, K)", policy.recipe, policy.name)
    return _grouped_linear(x, weight, counts, policy)


def _grouped_linear(
    x: Tensor, weight: Tensor, counts: Sequence[int], policy: WeightPolicy
) -> Tensor:
    """grouped_linear after the arguments every layer shares were checked (check_layer_args)."""
    recipe, name, main_grad = policy.recipe, policy.name, policy.main_grad
    op = _GROUPED
    shown = cache.weight_name(weight) if name is None else name
    if x.dim() != 2:
        raise ValueError(
            f"{op}: x must be 2-d (T, K), rows grouped by expert, got shape {tuple(x.shape)}"
        )
    counts = checked_counts(op, counts)
    if len(counts) != weight.shape[0] or sum(counts) != x.shape[0]:
        raise ValueError(
            f"{_GROUPED}: counts must have one entry per expert "
            f"({weight.shape[0]}) summing to the {x.shape[0]} rows of x, got "
            f"{len(counts)} entries summing to {sum(counts)}"
        )
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"{_GROUPED}: x's last dim must equal weight '{shown}''s K "
            f"{weight.shape[-1]}, got x of shape {tuple(x.shape)}"
        )
    if is_dtensor(weight):
        raise TypeError(
            f"{op}: expert stack '{shown}' is a DTensor ({weight.placements}) inside forward: "
            "zrw runs an expert stack on the local shard the parallel engine hands its forward "
            "(transformers' tp_plan / ep_plan: moe_tp_experts, ep_dispatch_experts); a DTensor "
            "expert stack without such an engine style is not supported"
        )
    h = resolve(weight)
    q = planes(h, policy)
    owner = h.grad_owner if main_grad else None
    return _MXGroupedFn.apply(
        x.contiguous(),
        weight,
        counts,
        q.fwd.data,
        q.fwd.scale,
        q.bwd.data,
        q.bwd.scale,
        recipe.elem_dtype,
        recipe.scale_mode,
        owner,
    )
