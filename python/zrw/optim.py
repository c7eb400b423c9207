"""The optimizer boundary of zero-redundancy weights (DESIGN.md §5).

`attach(optimizer)` installs a step pre-hook (free the FP8 entries, then restore every released
BF16 storage) and a step post-hook (`next_step`: the next use re-quantizes the new weights).

`MasterWeights(optimizer_cls, params, **kw)` keeps FP32 masters of the (BF16) parameters — the
scheme of Megatron's mixed-precision optimizer — steps any plain torch optimizer on them and
writes every parameter back from its master. With it the restore can be "empty": the optimizer
overwrites every restored weight, including those that got no gradient this step.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional

import torch

from . import ops

_HOOKS_ATTR = "_zrw_boundary_hooks"


class MasterWeights(torch.optim.Optimizer):
    """Wraps `optimizer_cls` with FP32 master weights.

    `params` are the model's (BF16) parameters or param groups, as for any optimizer. The inner
    optimizer (`self.inner`, an `optimizer_cls`) steps FP32 copies; each step copies the gradients
    (`p.grad`, or `p.main_grad` when a layer accumulates one in FP32) into the masters, steps, and
    writes every master back into its parameter — also those that got no gradient, so that an
    "empty" restore never leaves garbage behind. Masters are registered with zrw so that
    `zrw.ops.restore(w, fill="master")` restores a released weight exactly mid-step.
    """

    def __init__(self, optimizer_cls: Callable[..., torch.optim.Optimizer], params: Iterable,
                 **kwargs: Any):
        super().__init__(params, {})
        self.optimizer_cls = optimizer_cls
        self.masters: List[List[torch.Tensor]] = []
        inner_groups = []
        for group in self.param_groups:
            masters = []
            for p in group["params"]:
                if not p.is_floating_point():
                    raise TypeError(f"MasterWeights: parameters must be floating point, got "
                                    f"{p.dtype} (shape {tuple(p.shape)})")
                m = p.detach().to(torch.float32, copy=True)
                masters.append(m)
                ops.register_master(p, m)
            self.masters.append(masters)
            g = {k: v for k, v in group.items() if k != "params"}
            g["params"] = masters
            inner_groups.append(g)
        self.inner = optimizer_cls(inner_groups, **kwargs)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, masters in zip(self.param_groups, self.masters):
            for p, m in zip(group["params"], masters):
                g = getattr(p, "main_grad", None)
                if g is None:
                    g = p.grad
                m.grad = None if g is None else g.to(torch.float32)
        self.inner.step()
        for group, masters in zip(self.param_groups, self.masters):
            for p, m in zip(group["params"], masters):
                p.copy_(m)  # every parameter: a restored storage must get its values back
                m.grad = None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if getattr(p, "main_grad", None) is not None:
                    if set_to_none:
                        p.main_grad = None
                    else:
                        p.main_grad.zero_()
        super().zero_grad(set_to_none)
        self.inner.zero_grad(set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        return {
            "inner": self.inner.state_dict(),
            "masters": [[m.clone() for m in ms] for ms in self.masters],
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        saved = state_dict["masters"]
        if [len(ms) for ms in saved] != [len(ms) for ms in self.masters]:
            raise ValueError(
                "MasterWeights.load_state_dict: masters per group must be "
                f"{[len(ms) for ms in self.masters]}, got {[len(ms) for ms in saved]}")
        with torch.no_grad():
            for ms, ss in zip(self.masters, saved):
                for m, s in zip(ms, ss):
                    if m.shape != s.shape:
                        raise ValueError(f"MasterWeights.load_state_dict: master of shape "
                                         f"{tuple(m.shape)} got a saved tensor of shape "
                                         f"{tuple(s.shape)}")
                    m.copy_(s)
        self.inner.load_state_dict(state_dict["inner"])


def attach(optimizer: torch.optim.Optimizer, fill: Optional[str] = None) -> torch.optim.Optimizer:
    """Install the zero-redundancy boundary on `optimizer`; returns it.

    Before `step()`: free every FP8 entry, then restore every released BF16 storage with `fill`.
    After `step()`: `next_step()`. `fill` defaults to "empty" for MasterWeights (it overwrites
    every parameter). An optimizer that steps the parameters themselves needs their values:
    "empty"/"zeros" would destroy the weights and are refused; pass fill="dequant" (the restored
    weight is the dequantized FP8 copy: every step then loses the precision below FP8's 3
    mantissa bits) or, better, wrap it in MasterWeights.
    """
    masters = isinstance(optimizer, MasterWeights)
    if fill is None:
        fill = "empty" if masters else None
    if fill is None or (not masters and fill in ("empty", "zeros")):
        raise ValueError(
            f"zrw.optim.attach: {type(optimizer).__name__} steps the parameters themselves, so "
            f"restoring released weights with fill={fill!r} would hand it "
            f"{'uninitialized memory' if fill in (None, 'empty') else 'zeros'} instead of the "
            "weights. Wrap it in zrw.optim.MasterWeights(optimizer_cls, params, ...) (FP32 "
            "masters; exact), or pass fill='dequant' (the weights become their FP8 copies "
            "each step: lossy)")
    if fill not in ops.FILLS:
        raise ValueError(f"zrw.optim.attach: fill must be one of {ops.FILLS}, got {fill!r}")
    if getattr(optimizer, _HOOKS_ATTR, None) is not None:
        raise RuntimeError("zrw.optim.attach: this optimizer already has the zrw boundary")

    def pre_hook(opt, args, kwargs):
        ops.restore_all(fill)
        _clear_fsdp_shard_cache()

    def post_hook(opt, args, kwargs):
        ops.next_step()

    handles = (optimizer.register_step_pre_hook(pre_hook),
               optimizer.register_step_post_hook(post_hook))
    setattr(optimizer, _HOOKS_ATTR, handles)
    return optimizer


def _clear_fsdp_shard_cache() -> None:
    import sys

    fsdp = sys.modules.get("zrw.fsdp")  # only if FSDP2 support is in use
    if fsdp is not None:
        fsdp.clear_shard_cache()


def detach(optimizer: torch.optim.Optimizer) -> None:
    """Remove the boundary hooks that attach() installed."""
    handles = getattr(optimizer, _HOOKS_ATTR, None)
    if handles is None:
        return
    for h in handles:
        h.remove()
    setattr(optimizer, _HOOKS_ATTR, None)
