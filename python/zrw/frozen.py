"""Frozen weights released for good (docs/design.md §5): their one home.

A frozen weight released with release_frozen=True keeps only its MXFP8 copy. This module holds
what that state needs beyond the lifecycle's transitions: the `FP8OnlyParameter` class such a
Parameter has while it is in that state (a write to it must fill it first, and only the
tensor's class can see a write to a freed storage), `frozen_values` (how its lossy value is
given out and taken in), and `restore_frozen`. The transitions themselves are zrw.lifecycle's.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import ContextManager, Iterator

import torch
from torch import Tensor

from . import lifecycle
from ._dtensor import local_tensor as _local
from .lifecycle import CacheState

# ---- frozen weights released for good without a master: the FP8 copy is their only value ----
#
# docs/design.md §5, "Events and transitions". A frozen weight released for good
# (release_frozen=True) that no FP32 master backs has no BF16 value left in the process. A
# write to it (PEFT's merge_and_unload: `base_layer.weight.data += delta`; `w.data.add_(..)`,
# `w.copy_(t)` under no_grad) first fills it from its dequantized FP8 copy, its only value,
# with one warning that this rounds, and then applies: what PEFT does for its quantized bases.
# The write reaches the weight's storage through torch's own ops, and a poisoned storage gives
# Python no hook; so while a weight is in that state its Parameter's class is FP8OnlyParameter,
# an nn.Parameter subclass whose __torch_function__ sees `.data` and in-place calls on it.
# Its class goes back to nn.Parameter when it leaves the state (a write, restore_frozen).
# Under frozen_values("raise") the write is refused by name instead and nothing changes.

FROZEN_MODES = ("dequant", "raise")
_frozen_state = threading.local()
_frozen_write_warned = False


def frozen_mode() -> str:
    """How zrw gives out or takes in the lossy FP8 value of a frozen weight released for good
    (release_frozen=True), whose MXFP8 copy is its only value: "dequant" (the default:
    state_dict() gives its dequantized FP8 values, and a write to it fills it from them first,
    each with a warning once per process) or "raise" (both are refused with a named error).
    Set it with `frozen_values` (zrw.checkpoint.frozen_values)."""
    return getattr(_frozen_state, "mode", "dequant")


def frozen_values(mode: str) -> ContextManager[None]:
    """Within this block each frozen weight released for good is handled as `mode` says:
    "dequant" (state_dict() and every save built on it, torch.save of a state dict, PEFT's
    save_pretrained, Trainer checkpoints, give its dequantized FP8 copy, the only value left,
    lossy against the BF16 weight it was made from; a write to it, PEFT's merge_and_unload,
    fills it from that copy first) or "raise" (a named error for both). A wrong mode is refused
    by the call itself, before the block."""
    op = "zrw.cache.frozen_values"
    if not isinstance(mode, str):
        raise TypeError(
            f"{op}: mode must be a str, one of {FROZEN_MODES}, got {type(mode).__name__}"
        )
    if mode not in FROZEN_MODES:
        raise ValueError(f"{op}: mode must be one of {FROZEN_MODES}, got {mode!r}")
    return _frozen_values(mode)


@contextlib.contextmanager
def _frozen_values(mode: str) -> Iterator[None]:
    prev = frozen_mode()
    _frozen_state.mode = mode
    try:
        yield
    finally:
        _frozen_state.mode = prev


# In-place Tensor methods that change a tensor's metadata or autograd state, not its values:
# they pass through (a released weight's poison still refuses what would read its bytes).
_NOT_WRITES = frozenset(
    {
        "requires_grad_",
        "share_memory_",
        "detach_",
        "set_",
        "resize_",
        "resize_as_",
        "as_strided_",
        "squeeze_",
        "unsqueeze_",
        "transpose_",
        "t_",
        "swapdims_",
        "swapaxes_",
        "rename_",
    }
)
_DUNDER_WRITES = frozenset(
    {"__setitem__"}
    | {
        f"__i{op}__"
        for op in ("add sub mul matmul truediv floordiv mod pow and or xor lshift rshift".split())
    }
)
_DATA_GET = torch.Tensor.data.__get__
_PASS_THROUGH = torch._C._disabled_torch_function_impl
_DATA_SET = torch.Tensor.data.__set__


def _is_write(func) -> bool:
    name = getattr(func, "__name__", "")
    if name in _DUNDER_WRITES:
        return True
    return name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES


class FP8OnlyParameter(torch.nn.Parameter):
    """The class of a frozen Parameter released for good without an FP32 master while it is
    in that state (see above; docs/design.md §5). Every op passes through as on nn.Parameter;
    `.data` and in-place writes on the parameter itself first fill it from its dequantized
    FP8 copy (`_write_to_fp8_only`); `w.data = t` takes `t` and drops the FP8 copy. Copies
    and pickles behave as for any released weight (the poison's error names it)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        w = args[0] if args else None
        if isinstance(w, cls):
            if func == _DATA_SET:
                with torch._C.DisableTorchFunctionSubclass():
                    out = func(*args, **kwargs)
                lifecycle.invalidate(w, "dequant")  # replaced: nothing written
                unmark(w)
                return out
            if func == _DATA_GET:
                _write_to_fp8_only(w, "`.data`")
            elif _is_write(func):
                _write_to_fp8_only(w, f"`{func.__name__}`")
        # Everything else as on nn.Parameter (torch's own pass-through, in C).
        return _PASS_THROUGH(func, types, args, kwargs)

    def __deepcopy__(self, memo):
        with torch._C.DisableTorchFunctionSubclass():
            return torch.nn.Parameter.__deepcopy__(self, memo)

    def __reduce_ex__(self, proto):
        with torch._C.DisableTorchFunctionSubclass():
            return torch.nn.Parameter.__reduce_ex__(self, proto)


def mark(w: Tensor) -> None:
    """After a use that may have released frozen Parameter `w` for good: without an FP32
    master its FP8 copy is its only value, and a write to it must see it (FP8OnlyParameter)."""
    if type(w) is not torch.nn.Parameter:
        return
    if lifecycle.state(w) is not CacheState.RELEASED_FOR_GOOD:
        return
    if lifecycle.master_of(w) is not None:
        return
    w.__class__ = FP8OnlyParameter


def unmark(w: Tensor) -> None:
    """`w` left the state (a restore, an invalidation): an ordinary Parameter again."""
    if type(w) is FP8OnlyParameter and not lifecycle.state(w).released:
        w.__class__ = torch.nn.Parameter


def _write_to_fp8_only(w: Tensor, how: str) -> None:
    """A write (through `how`) to a weight released for good: filled from its FP8 copy (with
    the once-per-process warning that this rounds) or, with an FP32 master, exactly from it;
    refused by name under frozen_values("raise"), with nothing changed. A weight no longer in
    that state (restored meanwhile by another path) only gets its class back."""
    if lifecycle.state(w) is CacheState.RELEASED_FOR_GOOD:
        name = lifecycle.shown_name(w)
        if lifecycle.master_of(w) is None and frozen_mode() == "raise":
            raise RuntimeError(
                f"zrw.cache: a write through {how} to frozen weight {name!r}, released for "
                "good (release_frozen=True): only its MXFP8 copy holds its values, and "
                "zrw.checkpoint.frozen_values('raise') is in effect, so it is not filled from "
                "that copy (lossy). Nothing was changed. Write it outside that block (e.g. "
                "PEFT's merge_and_unload: the base is filled from its dequantized FP8 copy, "
                "with a warning), call zrw.cache.restore_frozen(model) first, or convert with "
                "release_frozen=False to keep the exact BF16 base"
            )
        if not lifecycle.fill_frozen(w):
            _warn_frozen_write(name, how)
    unmark(w)


def _warn_frozen_write(name: str, how: str) -> None:
    """Once per process: a write to a frozen weight released for good rounded its base."""
    global _frozen_write_warned
    if _frozen_write_warned:
        return
    _frozen_write_warned = True
    warnings.warn(
        f"zrw: a write through {how} to frozen weight '{name}' (and to every other frozen "
        "weight released for good written after it, e.g. by PEFT's merge_and_unload) first "
        "filled it from its dequantized MXFP8 copy, its only value since release_frozen=True "
        "released it: the result rounds the base weights to MXFP8 (as a merge into a "
        "quantized base does). The written weights are ordinary BF16 weights again; their "
        "next use quantizes them. Keep the original checkpoint for the exact base, or use "
        "zrw.checkpoint.frozen_values('raise') to refuse",
        UserWarning,
        stacklevel=4,
    )


def restore_frozen(model_or_weights, fill: str = "dequant") -> int:
    """Bring back every frozen weight released for good (release_frozen=True) among the
    parameters of a module (or a list of weights), from its FP8 copy: its only value, so this
    is lossy against the BF16 weight it was made from. Afterwards the weights are ordinary
    tensors that can be written (PEFT's merge_and_unload, an in-place update); their next use
    in a layer with release_frozen quantizes the written values and releases them again.
    (restore_all skips frozen weights: their FP8 copy is kept across steps on purpose.)
    Returns the number restored."""
    op = "zrw.cache.restore_frozen"
    if not isinstance(fill, str):
        raise TypeError(f"{op}: fill must be the str 'dequant', got {type(fill).__name__}")
    if fill != "dequant":
        raise ValueError(
            f"{op}: fill must be 'dequant' (a frozen weight released for good has "
            f"only its FP8 copy), got {fill!r}"
        )
    if isinstance(model_or_weights, torch.nn.Module):
        ws = [_local(p) for p in model_or_weights.parameters()]
    else:
        ws = _tensor_list(op, "model_or_weights", model_or_weights)
    frozen = [w for w, st in zip(ws, lifecycle.states(ws)) if st is CacheState.RELEASED_FOR_GOOD]
    for w in frozen:
        lifecycle.invalidate(w, "dequant")
        unmark(w)
    return len(frozen)


def _tensor_list(op: str, arg: str, ts):
    if isinstance(ts, (Tensor, str, bytes, dict)) or not hasattr(ts, "__iter__"):
        raise TypeError(
            f"{op}: {arg} must be an iterable of tensors (a list, not a single "
            f"tensor, name or dict), got {type(ts).__name__}"
        )
    out = []
    for i, t in enumerate(ts):
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: {arg}[{i}] must be a torch.Tensor, got {type(t).__name__}")
        out.append(_local(t))
    return out
