"""The optimizer boundary of zero-redundancy weights (docs/design.md §5, "The BF16-free step and
the optimizer boundary").

`attach(optimizer)` installs the boundary on any optimizer: before `step()` the boundary
callbacks run (zrw.fsdp drops its shard caches there) and, for an optimizer that steps the
parameters themselves, exactly the parameters it owns are restored with `fill`; a closure
passed to `step()` runs under zrw.no_release(); after `step()`, `next_step()`. `detach` undoes
it. An optimizer that keeps FP32 masters itself (zrw.optim.MasterWeights: its class says so
with `zrw_keeps_masters = True`) writes them back itself and is restored nothing.

Every optimizer in the process is guarded by one global step pre-hook: one without the
boundary that would step a released weight raises before it touches its state. It looks only
at parameters zrw has a record of, so an optimizer of an unconverted model pays a dict lookup
per parameter.
"""

from __future__ import annotations

import sys
import warnings
from collections import OrderedDict
from typing import Any, Callable, List, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from . import cache, lifecycle
from ._dtensor import local_tensor
from .record import find_optimizer_record, find_record, forget_optimizer, optimizer_record

# ---- the optimizer boundary's callbacks ------------------------------------------------------
# An OrderedDict, as torch's own hook tables: RemovableHandle keeps a weak reference to it.
_boundary_callbacks: "OrderedDict[int, Callable[[torch.optim.Optimizer], None]]" = OrderedDict()


def register_boundary_callback(fn: Callable[[torch.optim.Optimizer], None]) -> RemovableHandle:
    """Call `fn(optimizer)` at every zrw optimizer boundary, before the step (and before any
    restore). zrw.fsdp registers the drop of its shard caches here. Returns a handle whose
    `remove()` unregisters it."""
    if not callable(fn):
        raise TypeError(
            f"zrw.optim.register_boundary_callback: fn must be callable, got {type(fn).__name__}"
        )
    handle = RemovableHandle(_boundary_callbacks)
    _boundary_callbacks[handle.id] = fn
    return handle


def run_boundary_callbacks(optimizer: torch.optim.Optimizer) -> None:
    """Run every registered boundary callback with `optimizer` (zrw.optim's boundary)."""
    for fn in list(_boundary_callbacks.values()):
        fn(optimizer)


def _locals(ts) -> List[torch.Tensor]:
    """Each tensor's local shard (zrw._dtensor.local_tensor): what the cache works on."""
    return [local_tensor(t) for t in ts]


def _params_of(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _wrap_closure(args, kwargs):
    """The step's closure, run under zrw.no_release(): it re-evaluates the model inside
    step(), where a released weight could not be written by the optimizer. (A step hook's
    args start with the optimizer itself: step is wrapped unbound.)"""
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is None:
        return None

    def no_release_closure():
        with cache.no_release():
            return closure()

    if "closure" in kwargs:
        return args, {**kwargs, "closure": no_release_closure}
    return (args[0], no_release_closure, *args[2:]), kwargs


def attach(
    optimizer: torch.optim.Optimizer, fill: Optional[str] = None, *, own_masters: bool = False
) -> torch.optim.Optimizer:
    """Install the zero-redundancy boundary on `optimizer`; returns it.

    Before `step()`: the boundary callbacks; then, for an optimizer that steps the parameters
    themselves, exactly the parameters it owns are restored with `fill` and their FP8 entries
    dropped (weights of other optimizers keep theirs). After `step()`: `next_step()`. A closure
    passed to `step()` runs under zrw.no_release().

    MasterWeights restores its released parameters from their masters when it writes them
    back, so `fill` is "master" (or None) for it. Any other optimizer needs the weights' values:
    "empty"/"zeros" would destroy them and are refused; pass fill="dequant" (the restored
    weight is the dequantized FP8 copy: every step then loses the precision below FP8's 3
    mantissa bits) or, better, wrap it in MasterWeights.

    own_masters=True is the hook for an optimizer that keeps FP32 masters of its own (as
    Megatron's or a hand-written mixed-precision optimizer does) and writes them into the
    parameters itself: nothing is restored before its step; its write-back must be
    `zrw.cache.assign_weights(params, masters, keep_released=True)` (the BF16-free step: a
    released weight stays released and its next use quantizes from the master) or
    `keep_released=False` (restore from the master), never `p.copy_(master)`, which raises on a
    released weight. Register each master with `zrw.cache.register_master(p, master)` so that
    restores and `state_dict()` read it exactly. `fill` must be None then.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"zrw.optim.attach: optimizer must be a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}"
        )
    if fill is not None and not isinstance(fill, str):
        raise TypeError(
            f"zrw.optim.attach: fill must be None or a str, one of {cache.FILLS}, "
            f"got {type(fill).__name__}"
        )
    if fill is not None and fill not in cache.FILLS:
        raise ValueError(f"zrw.optim.attach: fill must be one of {cache.FILLS}, got {fill!r}")
    if not isinstance(own_masters, bool):
        raise TypeError(
            f"zrw.optim.attach: own_masters must be a bool, got {type(own_masters).__name__}"
        )
    if own_masters and fill is not None:
        raise ValueError(
            f"zrw.optim.attach: with own_masters=True the optimizer writes its "
            f"masters back itself (zrw.cache.assign_weights) and nothing is "
            f"restored before its step, so fill must be None, got {fill!r}"
        )
    masters = own_masters or getattr(optimizer, "zrw_keeps_masters", False)
    if masters and fill not in (None, "master", "empty"):
        raise ValueError(
            f"zrw.optim.attach: MasterWeights restores released weights from their FP32 masters "
            f"(exact); fill={fill!r} would be overwritten at once: pass fill=None or 'master'"
        )
    if not masters and fill in (None, "empty", "zeros", "master"):
        what = {
            None: "uninitialized memory",
            "empty": "uninitialized memory",
            "zeros": "zeros",
            "master": "a master it does not keep",
        }[fill]
        raise ValueError(
            f"zrw.optim.attach: {type(optimizer).__name__} steps the parameters themselves, so "
            f"restoring released weights with fill={fill!r} would hand it {what} instead of the "
            "weights. Wrap it in zrw.optim.MasterWeights(optimizer_cls, params, ...) (FP32 "
            "masters; exact), or pass fill='dequant' (the weights become their FP8 copies "
            "each step: lossy)"
        )
    if has_boundary(optimizer):
        raise RuntimeError("zrw.optim.attach: this optimizer already has the zrw boundary")

    def pre_hook(opt, args, kwargs):
        cache.register_owner(_locals(_params_of(opt)), opt)  # add_param_group
        run_boundary_callbacks(opt)
        if not masters:
            cache.restore_weights(_locals(_params_of(opt)), fill)
        return _wrap_closure(args, kwargs)

    def post_hook(opt, args, kwargs):
        cache.next_step()

    handles = (
        optimizer.register_step_pre_hook(pre_hook),
        optimizer.register_step_post_hook(post_hook),
    )
    rec = optimizer_record(optimizer)
    rec.hooks, rec.masters, rec.fill = handles, masters, fill
    cache.register_owner(_locals(_params_of(optimizer)), optimizer)
    return optimizer


def has_boundary(optimizer: torch.optim.Optimizer) -> bool:
    """Whether zrw.optim.attach installed the boundary on `optimizer`."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"zrw.optim.has_boundary: optimizer must be a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}"
        )
    rec = find_optimizer_record(optimizer)
    return rec is not None and rec.hooks is not None


def detach(optimizer: torch.optim.Optimizer) -> None:
    """Remove the boundary hooks that attach() installed, and leave zero-redundancy for the
    optimizer's parameters: those released with an FP32 master (MasterWeights, or registered
    with zrw.cache.register_master) get their BF16 values back exactly. An optimizer without the
    boundary is left as it is; anything that is not an optimizer raises TypeError."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"zrw.optim.detach: optimizer must be a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}"
        )
    rec = find_optimizer_record(optimizer)
    if rec is None or rec.hooks is None:
        return
    handles = rec.hooks
    params = _locals(_params_of(optimizer))
    mastered = [
        p
        for p, st in zip(params, cache.cache_states(params))
        if st in (cache.CacheState.RELEASED, cache.CacheState.PENDING)
        and cache.master_of(p) is not None
    ]
    if mastered:
        cache.restore_weights(mastered, "master")
    for h in handles:
        h.remove()
    forget_optimizer(optimizer)
    cache.unregister_owner(params, optimizer)


def _running_hf_trainer() -> Any:
    """The Hugging Face Trainer (or a subclass: TRL's SFTTrainer) whose training loop is on the
    call stack, or None. The Trainer hands the optimizer it steps nothing of its arguments, so
    its `args.max_grad_norm` is read from the frame of its method that calls `step()`: only
    when transformers' trainer module is loaded (never imported here), and only for a step
    over main_grad weights (docs/design.md §5, main_grad)."""
    module = sys.modules.get("transformers.trainer")
    trainer_cls = getattr(module, "Trainer", None)
    if not isinstance(trainer_cls, type):
        return None
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            obj = frame.f_locals.get("self")
            if isinstance(obj, trainer_cls):
                return obj
        frame = frame.f_back
    return None


def _steps(trainer, optimizer) -> bool:
    """Whether `trainer`'s optimizer is `optimizer` (accelerate wraps it: `.optimizer`)."""
    opt = getattr(trainer, "optimizer", None)
    for _ in range(4):
        if opt is optimizer:
            return True
        opt = getattr(opt, "optimizer", None)
    return False


def _main_grad_params(optimizer) -> List[torch.Tensor]:
    return [p for p in _params_of(optimizer) if getattr(p, "main_grad", None) is not None]


def refuse_unclipped_main_grad(optimizer) -> None:
    """main_grad under the Hugging Face Trainer (docs/huggingface.md). The Trainer clips with
    `clip_grad_norm_(model.parameters(), args.max_grad_norm)`, which reads `.grad` only: a
    weight whose gradient is in its FP32 main_grad would go unclipped and be left out of the
    logged norm. With `max_grad_norm > 0` the step is refused here, before anything changes,
    naming the two settings that clip it right; with `max_grad_norm=0` (clipping in
    MasterWeights, over every FP32 gradient) one warning says that the Trainer's logged
    `grad_norm` still covers `.grad` only."""
    fp32_only = _main_grad_params(optimizer)
    if not fp32_only:
        return
    trainer = _running_hf_trainer()
    if trainer is None or not _steps(trainer, optimizer):
        return  # only the Trainer's own optimizer is its business
    clip = getattr(getattr(trainer, "args", None), "max_grad_norm", None)
    names = ", ".join(
        repr(cache.weight_name(local_tensor(p)) or f"<shape {tuple(p.shape)}>")
        for p in fp32_only[:8]
    )
    more = f" and {len(fp32_only) - 8} more" if len(fp32_only) > 8 else ""
    if isinstance(clip, (int, float)) and clip > 0:
        own = optimizer.max_grad_norm
        raise RuntimeError(
            f"zrw.optim.{type(optimizer).__name__}.step: Hugging Face's Trainer clips the "
            f"gradients with TrainingArguments.max_grad_norm={clip} over the parameters' .grad "
            f"only, but {len(fp32_only)} weight(s) keep their gradient in FP32 main_grad "
            f"(zrw.convert(..., main_grad=True)): {names}{more}; they would go unclipped and "
            "the logged grad_norm would leave them out. Nothing was stepped. Clip in the "
            "optimizer instead, over every FP32 gradient, main_grad included: pass "
            "TrainingArguments(max_grad_norm=0) and zrw.optim.AdamW(..., max_grad_norm="
            f"{clip}) (MasterWeights(..., max_grad_norm=...); its norm before clipping is "
            "optimizer.last_grad_norm)"
            + (
                ""
                if own is None
                else f" (this optimizer already clips with max_grad_norm={own}: the Trainer "
                "would clip the .grad gradients a second time)"
            )
        )
    if not getattr(optimizer, "_warned_trainer_norm", False):
        optimizer._warned_trainer_norm = True  # once per optimizer
        warnings.warn(
            f"zrw: the grad_norm that Hugging Face's Trainer logs is the norm of the "
            f"parameters' .grad only; {len(fp32_only)} weight(s) keep their gradient in FP32 "
            f"main_grad and are not in it ({names}{more}). The norm over every gradient is "
            "the optimizer's last_grad_norm (computed when it clips: "
            "zrw.optim.AdamW(..., max_grad_norm=...))",
            UserWarning,
            stacklevel=4,
        )


def _refuse_released_params(optimizer, args, kwargs) -> None:
    """Global step pre-hook: an optimizer without the zrw boundary that would step a released
    weight raises here, before it changes any state (its step would fail on the weight's
    poison half-way, after updating others). A MasterWeights over main_grad weights under a
    Trainer that clips `.grad` is refused here too (refuse_unclipped_main_grad). Only
    parameters zrw has a record of are looked at: an unconverted model's optimizer pays one
    dict lookup per parameter."""
    if getattr(optimizer, "zrw_keeps_masters", False):
        refuse_unclipped_main_grad(optimizer)
        return
    known = [p for p in _params_of(optimizer) if find_record(local_tensor(p)) is not None]
    if not known:
        return
    fp32_only = [p for p in known if p.grad is None and getattr(p, "main_grad", None) is not None]
    if fp32_only:
        names = ", ".join(
            repr(cache.weight_name(local_tensor(p)) or f"<shape {tuple(p.shape)}>")
            for p in fp32_only[:8]
        )
        raise RuntimeError(
            f"zrw: {type(optimizer).__name__}.step() would skip {len(fp32_only)} weight(s) "
            f"whose gradients are only in their FP32 main_grad (zrw.convert(..., "
            f"main_grad=True)): {names}. Nothing was stepped. main_grad is read by "
            "zrw.optim.MasterWeights and zrw.optim.AdamW (with Hugging Face's Trainer: "
            "optimizer_cls_and_kwargs=(zrw.optim.AdamW, {...})); other optimizers read .grad: "
            "convert without main_grad for them"
        )
    if has_boundary(optimizer):
        return
    params = [p for p in known if p.grad is not None]
    if not params:
        return
    states = lifecycle.states(_locals(params))
    released = [local_tensor(p) for p, st in zip(params, states) if st.released]
    if released:
        names = ", ".join(
            repr(cache.weight_name(p) or f"<shape {tuple(p.shape)}>") for p in released[:8]
        )
        more = f" and {len(released) - 8} more" if len(released) > 8 else ""
        raise RuntimeError(
            f"zrw: {type(optimizer).__name__}.step() would update {len(released)} weight(s) "
            f"whose BF16 storage is released: {names}{more}. Nothing was stepped. Install the "
            "zero-redundancy boundary on this optimizer (zrw.optim.attach(optimizer, "
            "fill='dequant'), or use zrw.optim.MasterWeights), or restore the weights first "
            "(zrw.cache.restore_all('master'))"
        )


_global_guard = register_optimizer_step_pre_hook(_refuse_released_params)
