"""MXLinear: nn.Linear whose GEMMs run on MXFP8 operands, with the weight from the native cache.

Numerics (DESIGN.md §6), for x (M, K), W (N, K), dy (M, N):
  forward  y  = mx_matmul(Q_K(x), W_fwd)                 x blocked along K, W_fwd along K
  dgrad    dx = mx_matmul(Q_N(dy), W_bwd.t())            dy along N, W_bwd along N
  wgrad    dW = mx_matmul(Q_M(dy).t(), Q_M(x).t())       both along M (tokens)
all with FP32 accumulation. The weight planes come from zrw.cache.quant_and_release, called in the
module's forward (under the caller's grad mode, which the release guard reads) — never from a
BF16 weight saved for backward. The activation is quantized along both axes in one read
(mx_quantize_dual); the function saves its FP8 M-plane, not the BF16 activation.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from .. import ops
from .. import parallel
from .. import planes
from .. import cache
from .. import checkpoint
from ..config import QuantRecipe, get_recipe


def cache_recipe(recipe: QuantRecipe) -> str:
    """The native cache's weight layout for a recipe: one 32x32 copy or two 1x32 planes."""
    return "mxfp8-32x32" if recipe.block_32x32 else "mxfp8"


class _MXLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d: Tensor, weight: Tensor, bias: Optional[Tensor], w_fwd: Tensor,
                w_fwd_scale: Tensor, w_bwd: Tensor, w_bwd_scale: Tensor, elem_dtype: torch.dtype,
                scale_mode: str, main_grad: bool, main_grad_owner: Optional[Tensor]):
        qx_k, sx_k, qx_m, sx_m = ops.mx_quantize_dual(x2d, elem_dtype, scale_mode)
        y = ops.mx_matmul(qx_k, sx_k, w_fwd, w_fwd_scale, x2d.dtype)
        if bias is not None:
            y = y + bias
        ctx.gathered = weight if w_bwd is None else None
        ctx.save_for_backward(qx_m, sx_m, w_bwd, w_bwd_scale)
        # main_grad accumulates on the parameter itself (a DTensor's, when `weight` is the
        # autograd view of its local shard).
        owner = weight if main_grad_owner is None else main_grad_owner
        ctx.weight = owner if main_grad else None
        ctx.has_bias = bias is not None
        ctx.elem_dtype, ctx.scale_mode, ctx.main_grad = elem_dtype, scale_mode, main_grad
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
        qdy_n, sdy_n, qdy_m, sdy_m = ops.mx_quantize_dual(dy, ctx.elem_dtype, ctx.scale_mode)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = ops.mx_matmul(qdy_n, sdy_n, w_bwd.t(), w_bwd_scale.t(), ctx.x_dtype)
        dw = None
        if ctx.w_requires_grad:
            if ctx.main_grad:
                # Megatron-style: accumulate in FP32 into weight.main_grad, no .grad.
                w = ctx.weight
                g = parallel.wrap_like(w, ops.mx_matmul(qdy_m.t(), sdy_m.t(), qx_m.t(),
                                                        sx_m.t(), torch.float32))
                if getattr(w, "main_grad", None) is None:
                    w.main_grad = g
                else:
                    w.main_grad.add_(g)
            else:
                dw = ops.mx_matmul(qdy_m.t(), sdy_m.t(), qx_m.t(), sx_m.t(), ctx.w_dtype)
        db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None, None, None, None, None, None


def _weight_planes(weight: Tensor, recipe: QuantRecipe, release: bool, release_frozen: bool,
                   name: Optional[str]) -> planes.MXWeight:
    """The weight's MX planes: from the weight itself when it carries them (an MXPlanesCarrier,
    e.g. FSDP2's MXFP8 all-gather; bwd is None: it is read from the weight in backward, after
    FSDP2's re-gather), else from the native cache."""
    if isinstance(weight, planes.MXPlanesCarrier):
        # FSDP2 frees the gathered planes at reshard and refills them at the backward
        # re-gather: backward must read them from the weight then, never keep forward's.
        q = weight.mx_weight("fwd")
        return planes.MXWeight(q.recipe, q.fwd, planes.MXPlane(None, None))
    owner = parallel.engine_view_owner(weight)
    if owner is not None:
        # A DTensor's local shard, handed to forward as a to_local() view by a parallel
        # engine: the cache works on the local tensor the view shows.
        return parallel.quant_engine_view(weight, owner, recipe, release, release_frozen, name)
    return cache.quant_and_release(weight, cache_recipe(recipe), release,
                                   release_frozen=release_frozen, elem_dtype=recipe.elem_dtype,
                                   scale_mode=recipe.scale_mode, name=name, require_owner=True)


INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_layer_args(op: str, x, x_arg: str, weight, weight_shape: str, recipe,
                     name: Optional[str]) -> QuantRecipe:
    """The arguments every zrw layer shares, each refused with an error naming it (DESIGN.md §8):
    TypeError for a wrong type or dtype, ValueError for a wrong rank. `weight_shape` is the
    weight's layout, "(N, K)" or "(E, N, K)"; its rank is the number of its letters. Returns the
    recipe (a QuantRecipe, or the one registered under a str name)."""
    if not isinstance(weight, Tensor):
        raise TypeError(f"{op}: weight must be a torch.Tensor, got {type(weight).__name__}")
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}: {x_arg} must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(recipe, str):
        recipe = get_recipe(recipe)
    elif not isinstance(recipe, QuantRecipe):
        raise TypeError(f"{op}: recipe must be a zrw.QuantRecipe or a registered recipe name, "
                        f"got {type(recipe).__name__}")
    rank = weight_shape.count(",") + 1
    if weight.dim() != rank:
        shown = cache.weight_name(weight) if name is None else name
        label = f"weight '{shown}'" if shown else "weight"
        raise ValueError(f"{op}: {label} must be {rank}-d {weight_shape}, got shape "
                         f"{tuple(weight.shape)}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{op}: {x_arg} must be torch.bfloat16, torch.float16 or torch.float32, "
                        f"got {x.dtype}")
    return recipe


def mx_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], recipe: QuantRecipe,
              release: bool = True, release_frozen: bool = False, name: Optional[str] = None,
              main_grad: bool = False) -> Tensor:
    """Functional MXLinear: y = x @ W.T + b on MXFP8 operands; x (..., K) bf16, fp16 or fp32,
    W (N, K), bias (N,) or None. `recipe` is a QuantRecipe or a registered name. `name` (for
    messages) defaults to the weight's own (zrw.cache.set_weight_name)."""
    recipe = check_layer_args("mx_linear", x, "input", weight, "(N, K)", recipe, name)
    if x.dim() < 1:
        raise ValueError("mx_linear: input must have at least one dimension (..., K), got a 0-d "
                         "tensor")
    if bias is not None:
        if not isinstance(bias, Tensor):
            raise TypeError(f"mx_linear: bias must be a torch.Tensor or None, got "
                            f"{type(bias).__name__}")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"mx_linear: bias must have shape ({weight.shape[0]},) (the "
                             f"weight's out_features), got {tuple(bias.shape)}")
    if x.shape[-1] != weight.shape[-1]:
        name = cache.weight_name(weight) if name is None else name
        raise ValueError(f"mx_linear: input's last dim must equal weight '{name}''s in_features "
                         f"{weight.shape[-1]}, got input of shape {tuple(x.shape)}")
    if parallel.is_dtensor(weight):
        # Sharded by a tensor-parallel engine: compute on this rank's local shard.
        return parallel.dtensor_linear(x, weight, bias, recipe, release, release_frozen, name,
                                       main_grad)
    q = _weight_planes(weight, recipe, release, release_frozen, name)
    return apply_mx_linear(x, weight, bias, q, recipe, main_grad)


def apply_mx_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], q: planes.MXWeight,
                    recipe: QuantRecipe, main_grad: bool = False,
                    main_grad_owner: Optional[Tensor] = None) -> Tensor:
    """The MXLinear GEMMs with the weight's planes `q` already looked up; `weight` is the
    tensor autograd hands the weight gradient (for a sharded weight, the view of its local
    shard) and `main_grad_owner` the parameter that accumulates main_grad (default: weight)."""
    if main_grad and main_grad_owner is None:
        main_grad_owner = parallel.main_grad_owner(weight)
    x2d = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # also with no input features
    if not x2d.is_contiguous():
        x2d = x2d.contiguous()
    y = _MXLinearFn.apply(x2d, weight, bias, q.fwd.data, q.fwd.scale, q.bwd.data, q.bwd.scale,
                          recipe.elem_dtype, recipe.scale_mode, main_grad, main_grad_owner)
    return y.reshape(*x.shape[:-1], weight.shape[0])


class NamedWeight:
    """`zrw_name`, the name zrw's messages give a layer's `weight`, kept on the Parameter itself
    (zrw.cache.set_weight_name), where the cache reads it outside any compiled region: a per-layer
    string read in forward would make torch.compile guard on it and recompile the forward for
    every layer. The module keeps a copy, and stamps it on its weight again when it is copied or
    unpickled (copy.deepcopy makes new Parameters without their attributes)."""

    @property
    def zrw_name(self) -> str:
        return cache.weight_name(self.weight) or self.__dict__.get("_zrw_layer_name", "")

    @zrw_name.setter
    def zrw_name(self, name: str) -> None:
        self.__dict__["_zrw_layer_name"] = name
        cache.set_weight_name(self.weight, name)

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        restamp_names(self, {"weight": self.__dict__.get("_zrw_layer_name")})


class ReleasedWeightsStateDict:
    """state_dict() and load_state_dict() of a zrw layer whose quantized parameters
    (`zrw_quantized`) may be released.

    Saving: a released weight with an FP32 master (zrw.optim.MasterWeights, or
    zrw.cache.register_master) is materialized as a fresh `master.to(w.dtype)`, one tensor at a
    time: exactly the BF16 weight, while the weight itself stays released (nothing is restored
    or re-quantized). A released weight without a master (mid-step with a plain optimizer, or a
    frozen weight released for good) makes state_dict() raise a named error before anything is
    returned, so `torch.save(model.state_dict(), path)` fails before it opens (and truncates)
    `path`.

    Loading: a released weight with a master takes the loaded values into its master and stays
    released (its FP8 copy is dropped; its next use quantizes the new values); a released weight
    without a master, or a frozen weight released for good (release_frozen), is restored with
    the loaded values (its next use quantizes and releases them again); any other weight is
    loaded as usual,
    and its master (if any) follows it. So a model's load_state_dict never leaves a master
    behind its weight."""

    def _released_weights(self):
        """(name, parameter, FP32 master or None) of each quantized parameter that is released.
        A DTensor weight (tensor / expert parallelism): the cache holds its local shard, and
        the master is that shard's."""
        params = [(n, self._parameters.get(n)) for n in self.zrw_quantized]
        params = [(n, p) for n, p in params if isinstance(p, torch.Tensor)]
        states = cache.cache_states([parallel.local_tensor(p) for _, p in params])
        return [(n, p, cache.master_of(parallel.local_tensor(p)))
                for (n, p), st in zip(params, states) if st >= 2]

    def __getstate__(self):
        """Pickling and copy.deepcopy of the layer (`torch.save(model, path)`, an EMA or
        best-model copy between steps): a released weight with an FP32 master goes into the
        copy as a fresh Parameter holding its exact value (bf16 of the master), so the copy is
        an ordinary layer with readable weights; this layer is not changed (its weights stay
        released). A released weight without a master is left as it is, and pickling it raises
        the released-weight error that names it."""
        state = super().__getstate__()
        released = [(n, p, m) for n, p, m in self._released_weights() if m is not None]
        if not released:
            return state
        state = dict(state)  # nn.Module's is the instance's own __dict__
        params = state["_parameters"] = dict(state["_parameters"])
        for n, p, m in released:
            params[n] = nn.Parameter(checkpoint.materialize(p, m), requires_grad=p.requires_grad)
        return state

    def _restore_released(self) -> None:
        """Bring this layer's released weights back, exactly from their FP32 masters (a weight
        without one has only its FP8 copy left: a frozen weight released for good, or one of
        an optimizer attached with fill='dequant', whose boundary dequantizes it anyway), and
        drop the FP8 copies of the others. A weight with a master is then held (not released
        again) until its optimizer's next write-back, which reads what was written into it
        (MasterWeights follows every write to a parameter)."""
        for n in self.zrw_quantized:
            p = self._parameters.get(n)
            if not isinstance(p, torch.Tensor):
                continue
            local = parallel.local_tensor(p)
            state = cache.cache_state(local)
            master = cache.master_of(local)
            if state >= 2:
                cache.restore(local, "master" if master is not None else "dequant")
            elif state == 1:
                cache.cache_invalidate(local)
            if master is not None:
                local._zrw_hold = True

    def apply(self, fn):
        """nn.Module.apply (`model.apply(init_fn)`): `fn` sees this layer's weights with their
        values (released ones are restored first, see _restore_released), so a
        re-initialization works as on nn.Linear; the optimizer's next step takes the new
        values into its masters, and the step after it releases them again."""
        self._restore_released()
        return super().apply(fn)

    def _apply(self, fn, recurse=True):
        """Casts and moves (`model.to(dtype)`, `.half()`, `.float()`, `share_memory()`): a
        function that keeps a released weight's dtype and device leaves it released (its value
        cannot change: only its FP8 copy and master exist); one that changes them gets the
        weight restored first (see _restore_released), so the cast reads its exact value."""
        kept = {}
        changes = False
        for n in self.zrw_quantized:
            p = self._parameters.get(n)
            if not isinstance(p, torch.Tensor):
                continue
            try:
                probe = fn(torch.empty(0, dtype=p.dtype, device=p.device))
                same = (isinstance(probe, torch.Tensor) and probe.dtype == p.dtype
                        and probe.device == p.device)
            except Exception:
                same = False
            if same and cache.cache_state(parallel.local_tensor(p)) >= 2:
                kept[n] = p
            elif not same:
                changes = True
        if changes:
            self._restore_released()
            return super()._apply(fn, recurse)
        if not kept:
            return super()._apply(fn, recurse)
        order = list(self._parameters)
        for n in kept:
            del self._parameters[n]
        try:
            out = super()._apply(fn, recurse)
        finally:
            current = dict(self._parameters)
            self._parameters.clear()
            self._parameters.update({k: kept[k] if k in kept else current[k] for k in order
                                     if k in kept or k in current})
        with torch.no_grad():
            for p in kept.values():
                if p.grad is not None:
                    g = fn(p.grad)
                    if g is not p.grad:
                        p.grad = g
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        released = self._released_weights()
        if checkpoint.deferring():
            # zrw.checkpoint materializes each released weight when it writes it: here the
            # weight itself stands for it (its cache entry, master and metadata; no bytes).
            super()._save_to_state_dict(destination, prefix, keep_vars)
            for n, p, _ in released:
                destination[prefix + n] = p
            return
        # Frozen weights released for good (release_frozen): their FP8 copy is their only value.
        frozen = {n: p for n, p, m in released
                  if m is None and cache.cache_state(parallel.local_tensor(p)) == 3}
        if frozen and checkpoint.frozen_mode() == "raise":
            names = ", ".join(repr(cache.weight_name(parallel.local_tensor(p)) or n)
                              for n, p in frozen.items())
            raise RuntimeError(
                f"zrw: state_dict() of '{prefix.rstrip('.') or type(self).__name__}': frozen "
                f"weight(s) {names} are released for good (release_frozen=True) and only their "
                "MXFP8 copies exist; nothing was returned (zrw.checkpoint.frozen_values('raise') "
                "is in effect). Use frozen_values('dequant') for their dequantized FP8 values, "
                "or convert with release_frozen=False to keep their exact BF16 values")
        orphans = [parallel.local_tensor(p) for n, p, m in released
                   if m is None and n not in frozen]
        if orphans:
            names = ", ".join(repr(cache.weight_name(p) or prefix.rstrip(".")) for p in orphans)
            raise RuntimeError(
                f"zrw: state_dict() of '{prefix.rstrip('.') or type(self).__name__}': weight(s) "
                f"{names} are released (zero-redundancy weights: only their MXFP8 copies live "
                "between the first forward of a step and the optimizer step) and have no FP32 "
                "master to materialize them from; nothing was returned or written. Take the "
                "state dict after the optimizer step, use zrw.optim.MasterWeights (exact), or "
                "restore the weights first with zrw.cache.restore_all('master') (lossy "
                "dequantization where no master exists)")
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for n, p, m in released:
            if n in frozen:
                destination[prefix + n] = self._frozen_value(p)
            else:
                destination[prefix + n] = checkpoint.materialize(p, m)

    def _frozen_value(self, p: Tensor) -> Tensor:
        """A frozen weight released for good, as its dequantized FP8 copy (its only value;
        what `zrw.cache.restore_frozen` writes back): a fresh tensor, the weight stays
        released."""
        checkpoint.warn_frozen_dequant(cache.weight_name(parallel.local_tensor(p)))
        local = parallel.local_tensor(p)
        with torch.no_grad():
            q = cache.quant_and_release(local, cache_recipe(self.recipe), False,
                                        release_frozen=True,
                                        elem_dtype=self.recipe.elem_dtype,
                                        scale_mode=self.recipe.scale_mode)
            value = ops.mx_dequantize(q.fwd.data, q.fwd.scale, -1, local.dtype)
        return parallel.wrap_like(p, value)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        if local_metadata.get("assign_to_params_buffers", False):
            # load_state_dict(assign=True) replaces the parameter objects: the old weights, and
            # their entries, are simply dropped; the new ones take the old ones' zrw names.
            names = {n: cache.weight_name(p) for n, p in self._parameters.items()
                     if isinstance(p, torch.Tensor) and cache.weight_name(p)}
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                          missing_keys, unexpected_keys, error_msgs)
            restamp_names(self, names)
            return
        params = [(n, self._parameters.get(n)) for n in self.zrw_quantized]
        params = [(n, p) for n, p in params if isinstance(p, torch.Tensor)]
        states = cache.cache_states([parallel.local_tensor(p) for _, p in params])
        held = {}  # released weights: loaded here, hidden from nn.Module's copy_
        for (n, p), st in zip(params, states):
            if st >= 2 and prefix + n in state_dict:
                held[n] = (p, st)
        if held:
            saved = dict(self._parameters)
            for n in held:
                del self._parameters[n]
        first_unexpected = len(unexpected_keys)
        try:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                          missing_keys, unexpected_keys, error_msgs)
        finally:
            if held:
                self._parameters.clear()
                self._parameters.update(saved)
        if held:
            unexpected_keys[first_unexpected:] = [
                k for k in unexpected_keys[first_unexpected:]
                if k[len(prefix):] not in held]
        for n, (p, st) in held.items():
            key = prefix + n
            value = state_dict[key]
            if not isinstance(value, torch.Tensor):
                error_msgs.append(f'While copying the parameter named "{key}", expected '
                                  f"torch.Tensor or Tensor-like object from checkpoint but "
                                  f"received {type(value)}")
                continue
            if tuple(value.shape) != tuple(p.shape):
                error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                                  f"{tuple(value.shape)} from checkpoint, the shape in current "
                                  f"model is {tuple(p.shape)}.")
                continue
            if parallel.is_dtensor(p):
                # The rank's shard of the loaded value: a DTensor laid out as the weight.
                if (not parallel.is_dtensor(value) or value.placements != p.placements
                        or value.device_mesh != p.device_mesh):
                    error_msgs.append(
                        f"zrw: {key} is a released DTensor weight of placements "
                        f"{p.placements}; load a state dict of DTensors with the same "
                        f"placements, or call zrw.cache.restore_all('master') first, got "
                        f"{type(value).__name__}"
                        f"{' ' + str(value.placements) if parallel.is_dtensor(value) else ''}")
                    continue
                value, p = value.to_local(), parallel.local_tensor(p)
            master = cache.master_of(p)
            with torch.no_grad():
                if st == 3:
                    # A frozen weight released for good: restored with these values (its entry
                    # goes; its next use quantizes and releases them again); a master it has
                    # takes them too.
                    torch.ops.zrw.restore(p, "master", value.detach())
                    if master is not None:
                        master.copy_(value.detach().to(p.dtype))
                elif master is None:
                    cache.assign_weights([p], [value.detach()])  # restored with these values
                else:
                    # The master takes the weight's new value as the weight would hold it.
                    master.copy_(value.detach().to(p.dtype))
                    cache.assign_weights([p], [master], keep_released=True)
        for (n, p), st in zip(params, states):
            if n in held or prefix + n not in state_dict:
                continue
            # Its FP8 copy is stale; its master (if any) takes the loaded value at its
            # optimizer's next step (MasterWeights follows every write to a parameter).
            cache.cache_invalidate(parallel.local_tensor(p))


def restamp_names(module: nn.Module, names: dict) -> None:
    """Set each named parameter's zrw name (zrw.cache.set_weight_name), where both exist."""
    for pname, name in names.items():
        param = module._parameters.get(pname)
        if param is not None and name is not None:
            cache.set_weight_name(param, name)


class MXLinear(NamedWeight, ReleasedWeightsStateDict, nn.Linear):
    """Drop-in nn.Linear training on MXFP8 with zero-redundancy weights.

    The weight (and bias) are ordinary parameters — same objects, same state_dict keys — but the
    forward and backward GEMMs read the cached MXFP8 copy of the weight, and with release=True
    the BF16 weight's storage is freed from the first forward of a step until the optimizer
    boundary (zrw.optim.attach) restores it. `main_grad=True` accumulates the weight gradient in
    FP32 into `weight.main_grad` instead of `.grad` (as Megatron does).
    """

    # What this layer quantizes, with `self.recipe` (read by zrw.fsdp.prepare): these parameters
    # may be replaced by a zrw.planes.MXPlanesCarrier (FSDP2's gathered weight).
    zrw_quantized = ("weight",)

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 recipe: str | QuantRecipe = "mxfp8", release: bool = True,
                 release_frozen: bool = False, main_grad: bool = False, device=None,
                 dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = get_recipe(recipe)
        self.release = release
        self.release_frozen = release_frozen
        self.main_grad = main_grad
        self.zrw_name = "MXLinear.weight"

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: str | QuantRecipe = "mxfp8",
                    release: bool = True, release_frozen: bool = False, main_grad: bool = False,
                    name: str = "") -> "MXLinear":
        """An MXLinear that takes over `linear`'s parameters (the same Parameter objects)."""
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.in_features, m.out_features = linear.in_features, linear.out_features
        m.weight = linear.weight
        m.bias = linear.bias
        m.recipe = get_recipe(recipe)
        m.release, m.release_frozen, m.main_grad = release, release_frozen, main_grad
        m.zrw_name = name or "MXLinear.weight"
        # Hooks and training flag carry over, so the swap is invisible to the rest of the model.
        m.training = linear.training
        m._forward_hooks = linear._forward_hooks
        m._forward_pre_hooks = linear._forward_pre_hooks
        return m

    def forward(self, x: Tensor) -> Tensor:
        # A sharded weight is a new Parameter (the engine's DTensor) without the layer's name.
        name = self.zrw_name if parallel.is_dtensor(self.weight) else None
        return mx_linear(x, self.weight, self.bias, self.recipe, self.release,
                         self.release_frozen, name, self.main_grad)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, recipe={self.recipe.name}, release={self.release}")
