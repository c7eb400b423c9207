"""The native weight cache and the release / restore lifecycle (docs/design.md §5).

These are stateful, eager-only calls: they run from layers and optimizer hooks, never inside a
compiled graph (dynamo is told to skip them). The op wrappers of zrw.ops are stateless; this
module is everything that changes what a weight holds:

  quant_and_release(w)    first use in a step: quantize, file the FP8 copy, release the BF16
  restore(w, fill)        bring one released weight back (raises if it is not released)
  restore_weights(ws, ..) the boundary of one optimizer: exactly the weights it owns
  assign_weights(ws, srcs) write new values (an FP32 master) into weights, released or not;
                          keep_released=True: a released weight stays released and its next
                          use quantizes straight from the master (the BF16-free step)
  restore_all(fill)       every released trainable weight
  restore_value(w)        bring a weight's exact value back (its master, else its FP8 copy)
  cache_state(w)          a CacheState: NONE, CACHED, RELEASED or RELEASED_FOR_GOOD
  register_boundary_callback(fn)  run fn(optimizer) at every zrw optimizer boundary

A DTensor weight (tensor / expert parallelism, zrw.parallel) is cached by its local shard: every
call here given a DTensor (weight, master or source) works on its local tensor.

Guarantees (docs/guarantees.md; docs/design.md §5, "Safety invariants"): a restore checks that
the weight still has the storage, dtype and size it was released with, allocates its bytes and
fills them before it clears the release poison, and runs under the cache's lock; a weight it
could not restore keeps its entry and its FP8 copy, and the error names it. No fill hands out
uninitialized memory unless the caller asked for "empty".
"""

from __future__ import annotations

import contextlib
import enum
import threading
import warnings
from collections import OrderedDict
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from . import _C
from ._dtensor import local_tensor as _local
from .ops import E4M3
from .planes import MXWeight
from .record import find_record, record_of, records

# One source: the native cache's names (csrc/common/names.h).
FILLS = tuple(_C.fill_names())
RECIPES = tuple(_C.cache_recipes())

_release_state = threading.local()

# Why torch.compile breaks the graph at zrw's stateful calls (dynamo names it in its message,
# e.g. under fullgraph=True).
EAGER_ONLY = (
    "zrw's weight cache is eager-only: a converted model's forward breaks the graph "
    "at each zrw layer's cache lookup (and at the model's once-per-step tie check), "
    "so torch.compile(model, fullgraph=True) cannot compile it; compile without "
    "fullgraph=True (docs/guarantees.md)"
)


class CacheState(str, enum.Enum):
    """What the native cache holds for a weight (zrw.cache.cache_state). A str enum: each state
    compares equal to its name's value ("none", "cached", "released", "released_for_good")."""

    NONE = "none"  # no entry
    CACHED = "cached"  # its FP8 copy is cached, its storage kept
    RELEASED = "released"  # cached, storage released until the boundary
    RELEASED_FOR_GOOD = "released_for_good"  # a frozen weight released with release_frozen

    @property
    def released(self) -> bool:
        """Whether the weight's storage is released (RELEASED or RELEASED_FOR_GOOD)."""
        return self in (CacheState.RELEASED, CacheState.RELEASED_FOR_GOOD)

    @property
    def cached(self) -> bool:
        """Whether the weight has an entry (anything but NONE)."""
        return self is not CacheState.NONE

    def __str__(self) -> str:
        return self.value


# The native cache's state codes (csrc/cache/weight_cache.cpp, WeightCache::state), in order.
_STATES = (CacheState.NONE, CacheState.CACHED, CacheState.RELEASED, CacheState.RELEASED_FOR_GOOD)


@contextlib.contextmanager
def no_release() -> Iterator[None]:
    """Within this block quant_and_release caches FP8 copies but never releases a BF16 storage.

    For code that never reaches an optimizer step (a reference model): nothing would restore
    what it released. Under `torch.no_grad()` nothing is released either, and nothing is cached
    (each call quantizes the weight's current values: an eval never reaches a step boundary,
    so a cached copy could miss a write through `.data`).
    """
    prev = getattr(_release_state, "disabled", 0)
    _release_state.disabled = prev + 1
    try:
        yield
    finally:
        _release_state.disabled = prev


def release_enabled() -> bool:
    """False inside zrw.no_release()."""
    return getattr(_release_state, "disabled", 0) == 0


def _check_tensor(op: str, arg: str, t) -> Tensor:
    """t, checked to be a tensor; a DTensor gives its local shard."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    return _local(t)


def _check_weight(op: str, w, arg: str = "w") -> Tensor:
    w = _check_tensor(op, arg, w)
    if w.dim() not in (2, 3):
        raise ValueError(
            f"{op}: {arg} must be a 2-d (N, K) or 3-d (E, N, K) weight, got shape {tuple(w.shape)}"
        )
    return w


def _export_error(op: str, what: str) -> RuntimeError:
    """The weight cache is eager-only: under torch.export (and pipelining's `pipeline()`, which
    traces with it) the release decision would be made on fake weights and frozen into the
    graph, and zrw's autograd functions would be traced into forward-only ops (the exported
    graph has no backward). Refused with this error, which says what to do instead."""
    return RuntimeError(
        f"{op}: {what} cannot be traced by torch.export: zrw's weight cache is eager-only "
        "(the graph would fix whether a weight is released at trace time and lose zrw's "
        "autograd functions, so it could not train). For pipeline parallelism build each "
        "stage by hand, torch.distributed.pipelining.PipelineStage(submodule, stage_index, "
        "num_stages, device), instead of pipeline() (docs/distributed.md: Pipeline parallelism)"
    )


def _check_fill(op: str, fill) -> None:
    if not isinstance(fill, str):
        raise TypeError(f"{op}: fill must be a str, one of {FILLS}, got {type(fill).__name__}")
    if fill not in FILLS:
        raise ValueError(f"{op}: fill must be one of {FILLS}, got {fill!r}")


def _tensor_list(op: str, arg: str, ts) -> List[Tensor]:
    if isinstance(ts, (Tensor, str, bytes, dict)) or not isinstance(ts, Iterable):
        raise TypeError(
            f"{op}: {arg} must be an iterable of tensors (a list, not a single "
            f"tensor, name or dict), got {type(ts).__name__}"
        )
    return [_check_tensor(op, f"{arg}[{i}]", t) for i, t in enumerate(ts)]


def quant_and_release(
    w: Tensor,
    recipe: str = "mxfp8",
    release: bool = True,
    *,
    release_frozen: bool = False,
    elem_dtype: torch.dtype = E4M3,
    scale_mode: str = "floor",
    name: Optional[str] = None,
    require_owner: bool = False,
    trainable: Optional[bool] = None,
) -> MXWeight:
    """The fused op of zero-redundancy weights: cache lookup; on a miss quantize, insert, release.

    On the first call in a step, w (N, K) or (E, N, K) is quantized ("mxfp8": both 1x32 planes
    from one read; "mxfp8-32x32": one copy with 32x32 tiles) and filed in the native cache; its
    storage is released (freed and poisoned) when the guard allows: a leaf that requires grad,
    under grad mode, outside zrw.no_release(), whose storage it alone owns and fills exactly.
    Frozen weights (requires_grad=False) are released only with release_frozen=True, and then
    stay FP8-only for good. Later calls in the same step return the cached tensors without
    touching w. Under torch.no_grad() a weight without a current entry is quantized but not
    filed. `name` appears in the error raised by any access to the released weight; None takes
    the name set with `set_weight_name` (the layers set their parameters' names there, so that
    a compiled forward never reads a per-layer string and recompiles for each layer).
    require_owner=True (what the zrw layers pass): a trainable weight is released only when
    `is_owned(w)`, i.e. an optimizer with the zrw boundary steps it or it has an FP32 master;
    any other keeps its BF16 storage and is quantized afresh at every use (nothing starts a new
    step for it, so a cached copy could go stale). A weight the layers restored for a write
    (apply, a cast) is held (its record's `hold`) until its optimizer's next write-back, so
    that MasterWeights reads what was written.
    `trainable` (None: `w.requires_grad`) says whether an optimizer steps `w`: a DTensor
    weight's local shard never requires grad itself (its DTensor does), so zrw.parallel passes
    the DTensor's flag for it.
    """
    if torch.compiler.is_compiling() and not torch.compiler.is_exporting():
        # torch.compile: a graph break, with EAGER_ONLY's reason (the copy runs eagerly, where
        # is_compiling() is False). torch.export is refused below, by name.
        return _eager_quant_and_release(
            w,
            recipe,
            release,
            release_frozen=release_frozen,
            elem_dtype=elem_dtype,
            scale_mode=scale_mode,
            name=name,
            require_owner=require_owner,
            trainable=trainable,
        )
    op = "zrw.cache.quant_and_release"
    if trainable is None:
        trainable = w.requires_grad if isinstance(w, Tensor) else False
    elif not isinstance(trainable, bool):
        raise TypeError(f"{op}: trainable must be a bool or None, got {type(trainable).__name__}")
    w = _check_weight(op, w)  # a DTensor: its local shard
    if not isinstance(recipe, str):
        raise TypeError(
            f"{op}: recipe must be a str, one of {RECIPES}, got {type(recipe).__name__}"
        )
    for arg, flag in (("release", release), ("release_frozen", release_frozen)):
        if not isinstance(flag, (bool, int)):
            raise TypeError(f"{op}: {arg} must be a bool, got {type(flag).__name__}")
    if not isinstance(elem_dtype, torch.dtype):
        raise TypeError(
            f"{op}: elem_dtype must be a torch.dtype (torch.float8_e4m3fn or "
            f"torch.float8_e5m2), got {type(elem_dtype).__name__}"
        )
    if not isinstance(scale_mode, str):
        raise TypeError(f"{op}: scale_mode must be a str, got {type(scale_mode).__name__}")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"{op}: name must be a str or None, got {type(name).__name__}")
    if torch.compiler.is_exporting():
        shown = name or weight_name(w)  # (torch.export traces fake copies: they have no name)
        raise _export_error(op, f"the zrw weight {shown!r}" if shown else "a zrw layer's weight")
    if w.is_meta:
        shown = name or weight_name(w) or f"<unnamed weight of shape {tuple(w.shape)}>"
        raise ValueError(
            f"{op}: weight {shown!r} is on the meta device (no data): it can be neither "
            "quantized nor released. Materialize the model first (e.g. "
            "model.to_empty(device='cpu') and load or initialize its weights)"
        )
    rec = record_of(w)
    layout = (recipe, elem_dtype, scale_mode)
    if rec.quantized_as != layout:
        rec.quantized_as = layout
    if name is None:
        name = rec.name
    elif name and not rec.name:
        rec.name = name  # messages outside the cache (the optimizer guard) use it too
    release = release and release_enabled()
    grad = torch.is_grad_enabled()
    if grad and trainable and (require_owner or not release):
        release = _training_use(op, w, rec, release, name)
    elif grad and release and release_frozen and not trainable and rec.masters:
        # A frozen weight about to be released for good: its master (an optimizer keeps one)
        # takes what was written since the last write-back first, as for a trainable weight.
        if _STATES[torch.ops.zrw.cache_state.default(w)] is CacheState.NONE:
            _sync_before_release(w, rec)
    # Under no_grad nothing is released and the guard never asks: the weight's own flag.
    tensors = torch.ops.zrw.quant_and_release.default(
        w,
        recipe,
        release,
        release_frozen,
        elem_dtype,
        scale_mode,
        name,
        trainable if grad else w.requires_grad,
    )
    if release and release_frozen and not trainable and type(w) is torch.nn.Parameter:
        _mark_fp8_only(w, rec)
    return MXWeight.from_tensors(recipe, tensors)


def _training_use(op: str, w: Tensor, rec, release: bool, name: str) -> bool:
    """The transitions of a trainable weight's use in training (docs/design.md §5, "Events
    and transitions"), before the native lookup. Returns whether the lookup may release it.

    - released for good while frozen, now trainable: restored exactly from its master, or a
      named error (its BF16 values no longer exist) before anything changes;
    - no owner (no optimizer with the zrw boundary, no FP32 master): nothing would start a new
      step for it, so its FP8 copy is made afresh at every use (a write through `.data`
      between uses is never served stale) and its BF16 storage is kept;
    - held (restored for a write the next write-back reads) or tied: cached, not released;
    - else, at its first use in a step: its master takes what was written since the last
      write-back (_sync_before_release)."""
    state = _STATES[torch.ops.zrw.cache_state.default(w)]
    if state is CacheState.RELEASED_FOR_GOOD:
        _unfreeze(op, w, rec, name)
        state = CacheState.NONE
    if not rec.owned():
        if state.released:
            restore_value(w)  # its owner is gone: exact from the master its entry keeps
        elif state.cached:
            torch.ops.zrw.cache_invalidate(w, "dequant")
        if release:
            _warn_unowned(name)
        return False
    if not release:
        return False
    if rec.hold or rec.tied:
        return False
    if state is CacheState.NONE:
        _sync_before_release(w, rec)
    return True


def _unfreeze(op: str, w: Tensor, rec, name: str) -> None:
    """A weight released for good while frozen (release_frozen) is trainable again: its value
    comes back exactly from its FP32 master, or the use is refused by name."""
    master = rec.master()
    if master is None:
        master = torch.ops.zrw.cache_master(w)
    if master is None:
        shown = name or f"<unnamed weight of shape {tuple(w.shape)}>"
        raise RuntimeError(
            f"{op}: weight {shown!r} was released for good while frozen (release_frozen=True): "
            "only its MXFP8 copy exists, and it has no FP32 master to train from, but it "
            "requires grad again. Nothing was changed. Either unfreeze it only after "
            "zrw.cache.restore_frozen(model) (its dequantized FP8 values become its BF16 "
            "weights: lossy), or build the optimizer over it before it is released "
            "(zrw.optim.AdamW / MasterWeights keep its exact FP32 master)"
        )
    torch.ops.zrw.restore(w, "master", master)


def _quant_and_release_eagerly(*args, **kwargs) -> MXWeight:
    return quant_and_release(*args, **kwargs)


# The stateful lookup, never traced: torch.compile breaks the graph here (quant_and_release
# sends dynamo to it; eager calls skip the wrapper's cost).
_eager_quant_and_release = torch._dynamo.disable(_quant_and_release_eagerly, reason=EAGER_ONLY)


_unowned_warned = False


def _warn_unowned(name: str) -> None:
    """Once per process: a trainable weight used in training that no optimizer with the zrw
    boundary owns keeps its BF16 storage (the Hugging Face Trainer's own default optimizer, an
    optimizer built after the first forward, or none)."""
    global _unowned_warned
    if _unowned_warned:
        return
    _unowned_warned = True
    warnings.warn(
        f"zrw: weight '{name or '<unnamed>'}' (and any other in the same case) is trained, but no "
        "optimizer with the zrw boundary owns it, so its BF16 storage is kept: training is "
        "exact, without the zero-redundancy saving. Build the optimizer before the first "
        "training forward as zrw.optim.AdamW(params, ...) or "
        "zrw.optim.attach(zrw.optim.MasterWeights(...)); with Hugging Face's Trainer or TRL's "
        'SFTTrainer pass optimizer_cls_and_kwargs=(zrw.optim.AdamW, {"lr": ...}). (If the '
        "optimizer is built later, the release starts with its first step.)",
        UserWarning,
        stacklevel=3,
    )


def _sync_before_release(w: Tensor, rec) -> None:
    """A weight with an FP32 master that is about to be released (its first use in a step,
    with no entry yet) and was written since its optimizer's last write-back (a
    load_state_dict, an apply, a write through `.data` between steps): its master takes the
    written value now (take_into_master), since nothing can read the weight once it is
    released (MasterWeights reads the unreleased ones at its step)."""
    master = rec.master()
    if master is None or master.shape != w.shape:
        return  # (MasterWeights' step names a change of shape)
    if unchanged_since_write_back(w, rec, master):
        return
    take_into_master(master, w)


def take_into_master(master: Tensor, value: Tensor) -> bool:
    """The rule of truth for a weight with an FP32 master: the master is the value, and a
    write to the weight (`value`, in the weight's dtype) reaches the master only if its bits
    differ from `master.to(value.dtype)`. Loading the values a write-back wrote (a checkpoint
    taken from this run, a state dict read back, the optimizer's state loaded before the
    model's) leaves the master's FP32 bits alone; a tensor written with other values replaces
    the master (the values the next step starts from are the written ones, as for a fresh
    optimizer built over them). Returns whether the master changed."""
    master, value = _local(master), _local(value)
    if master.shape != value.shape:
        raise ValueError(
            f"zrw.cache.take_into_master: value must have the master's shape "
            f"{tuple(master.shape)}, got {tuple(value.shape)}"
        )
    if value.dtype == master.dtype:
        unchanged = torch.equal(master, value)
    else:
        unchanged = holds_master(value, master)
    if unchanged:
        return False
    with torch.no_grad():
        master.copy_(value.detach())
    return True


def set_weight_name(w: Tensor, name: str) -> None:
    """Name `w` for zrw's messages (the release poison, cache_entries) where a call passes none."""
    w = _check_tensor("zrw.cache.set_weight_name", "w", w)
    if not isinstance(name, str):
        raise TypeError(f"zrw.cache.set_weight_name: name must be a str, got {type(name).__name__}")
    record_of(w).name = name


def weight_name(w: Tensor) -> str:
    """The name set with `set_weight_name`, or ""."""
    rec = find_record(_check_tensor("zrw.cache.weight_name", "w", w))
    return "" if rec is None else rec.name


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 20  # elements compared at a time: the check's transient stays small


def weight_signature(p: torch.Tensor):
    """What changes when a parameter is written through autograd-visible ops (its version) or
    is cast (dtype, device, shape): read without touching a released weight's bytes. Writes
    through `.data` change none of it: holds_master compares the bits."""
    return (p._version, p.dtype, p.device, tuple(p.shape))


def weight_digest(p: torch.Tensor) -> Optional[int]:
    """A 64-bit digest of p's bytes (zrw._C.bits_digest), or None where it is not taken (not a
    contiguous CPU tensor). Read-only; p must not be released (its data pointer raises).
    MasterWeights records it after each write-back and compares it before the next step: a
    write through `.data` (which bumps no version counter) changes it, and an unchanged
    parameter is then known to hold `master.to(p.dtype)` without comparing it with its master
    (4N bytes read per step instead of about 10N with temporaries)."""
    if p.device.type != "cpu" or not p.is_contiguous():
        return None
    return _C.bits_digest(p.data_ptr(), p.numel() * p.element_size())


def unchanged_since_write_back(p: Tensor, rec, master: Tensor) -> bool:
    """Whether p still holds what `master`'s last write-back wrote: its record says that master
    wrote it last, and neither its signature (version, dtype, device, shape) nor the digest of
    its bytes changed since."""
    if rec is None or rec.digest is None or rec.written is None:
        return False
    cur = None if rec.current is None else rec.current()
    return cur is master and weight_signature(p) == rec.written and weight_digest(p) == rec.digest


def holds_master(p: torch.Tensor, m: torch.Tensor) -> bool:
    """Whether p's bits are exactly m.to(p.dtype) (what the write-back wrote): catches writes
    that bump no version (through `.data`). Compared in chunks of _CHUNK elements."""
    if p.shape != m.shape or p.device != m.device or p.element_size() not in _BITS:
        return False
    bits = _BITS[p.element_size()]
    pf, mf = p.detach().reshape(-1), m.detach().reshape(-1)
    for i in range(0, pf.numel(), _CHUNK):
        a = pf[i : i + _CHUNK].contiguous()
        b = mf[i : i + _CHUNK].to(p.dtype)
        if not torch.equal(a.view(bits), b.view(bits)):
            return False
    return True


# Owners and masters live in each weight's record (zrw.record): the optimizers with the zrw
# boundary that step it, and one FP32 master per optimizer that keeps masters. `is_owned` reads
# them: the zrw layers release a trainable weight only when something will write it back
# exactly or restore it at a boundary, never one that no optimizer owns (it would stay released
# for good, readable only as its lossy FP8 dequantization).


def register_owner(weights: Iterable[Tensor], optimizer) -> None:
    """Record that `optimizer` (with the zrw boundary) steps these weights (zrw.optim.attach
    calls it)."""
    ws = _tensor_list("zrw.cache.register_owner", "weights", weights)
    for w in ws:
        record_of(w).owners.add(optimizer)


def unregister_owner(weights: Iterable[Tensor], optimizer) -> None:
    """Forget `optimizer` as the owner of these weights (zrw.optim.detach)."""
    ws = _tensor_list("zrw.cache.unregister_owner", "weights", weights)
    for w in ws:
        rec = find_record(w)
        if rec is not None:
            rec.owners.discard(optimizer)


def is_owned(w: Tensor) -> bool:
    """Whether a live optimizer with the zrw boundary steps `w`, or `w` has an FP32 master
    (MasterWeights, register_master): then a release of `w` ends at that optimizer's boundary
    or is undone exactly from the master."""
    w = _check_tensor("zrw.cache.is_owned", "w", w)
    rec = find_record(w)
    return rec is not None and rec.owned()


def _registered_masters() -> List[tuple]:
    """(weight, master) for each weight with a live master, with strong references, so that an
    optimizer torn down meanwhile cannot take a master away from a restore that chose it."""
    pairs = []
    for w, rec in records():
        m = rec.master()
        if m is not None:
            pairs.append((w, m))
    return pairs


def register_master(weight: Tensor, master: Tensor, optimizer=None) -> None:
    """Record the FP32 master of `weight` so that fill="master" can restore it exactly.
    `optimizer`: the optimizer that keeps it (one master per optimizer; None for a master
    registered by hand, which replaces the previous such one)."""
    weight = _check_tensor("zrw.cache.register_master", "weight", weight)
    master = _check_tensor("zrw.cache.register_master", "master", master)
    if master.shape != weight.shape:
        raise ValueError(
            f"zrw.cache.register_master: master must have the weight's shape "
            f"{tuple(weight.shape)}, got {tuple(master.shape)}"
        )
    record_of(weight).set_master(optimizer, master)


def master_of(weight: Tensor) -> Optional[Tensor]:
    """The FP32 master of `weight`: the one registered (by MasterWeights), else the one its cache
    entry holds while it is released after a keep_released write-back, or None. (For a DTensor
    weight: its local shard's master.)"""
    weight = _check_tensor("zrw.cache.master_of", "weight", weight)
    rec = find_record(weight)
    master = None if rec is None else rec.master()
    return cache_master(weight) if master is None else master


def cache_master(w: Tensor) -> Optional[Tensor]:
    """The FP32 master that w's cache entry holds while w is released by a keep_released
    write-back (the BF16-free step), or None."""
    w = _check_tensor("zrw.cache.cache_master", "w", w)
    return torch.ops.zrw.cache_master(w)


def _no_master_error(op: str, w: Tensor) -> ValueError:
    name = weight_name(w) or f"<unnamed weight of shape {tuple(w.shape)}>"
    return ValueError(
        f"{op}: fill='master' needs the FP32 master of weight '{name}', but it has none: wrap "
        "the optimizer in zrw.optim.MasterWeights, or use fill='dequant' (lossy)"
    )


@torch._dynamo.disable(reason=EAGER_ONLY)
def restore(w: Tensor, fill: str = "master", source: Optional[Tensor] = None) -> None:
    """Bring back one released weight's BF16 storage (original byte count) and drop its entry.

    fill: "master" (bf16 of the MasterWeights FP32 master — exactly what the optimizer would
    write; for a mid-step checkpoint or eval), "dequant" (from the FP8 copy; lossy), "zeros", or
    "empty" (uninitialized; only when something overwrites it next). Raises (docs/design.md §8) for
    a weight that is not released, and for one whose data was replaced since its release
    (`w.data = t`); on any error the weight stays released and restorable.
    `source` (fill "master" only): the values to restore instead of the registered master (a
    tensor of w's shape, rounded to w's dtype; e.g. a loaded state-dict value).
    """
    op = "zrw.cache.restore"
    w = _check_tensor(op, "w", w)
    _check_fill(op, fill)
    if source is not None:
        source = _check_tensor(op, "source", source)
        if fill != "master":
            raise ValueError(f"{op}: source is only read by fill='master', got fill={fill!r}")
        if source.shape != w.shape:
            raise ValueError(
                f"{op}: source must have the weight's shape {tuple(w.shape)}, got "
                f"{tuple(source.shape)}"
            )
    elif fill == "master":
        source = master_of(w)
        if source is None and _STATES[torch.ops.zrw.cache_state(w)].released:
            raise _no_master_error(op, w)
    torch.ops.zrw.restore(w, fill, source)
    _unmark_fp8_only(w)


@torch._dynamo.disable(reason=EAGER_ONLY)
def restore_value(w: Tensor) -> Optional[Tensor]:
    """Bring back `w`'s value so that it can be read or written: a released weight is restored
    exactly from its FP32 master, or, without one, from its FP8 copy (its only value: a frozen
    weight released for good, or one whose optimizer restores by dequantization anyway); an
    unreleased weight's FP8 copy is dropped (it goes stale on a write). Returns w's master (or
    None), so that the caller can hold w until the master has read a write."""
    w = _check_tensor("zrw.cache.restore_value", "w", w)
    state = cache_state(w)
    master = master_of(w)
    if state.released:
        torch.ops.zrw.restore(w, "master" if master is not None else "dequant", master)
        _unmark_fp8_only(w)
    elif state.cached:
        torch.ops.zrw.cache_invalidate(w, "dequant")
    return master


@torch._dynamo.disable(reason=EAGER_ONLY)
def restore_weights(weights: Iterable[Tensor], fill: str = "master") -> int:
    """The boundary of one optimizer: for exactly these weights, drop their FP8 entries and
    restore the released ones with `fill` ("master" takes each weight's registered master).
    Entries of frozen weights released with release_frozen stay. Every weight is restored or
    left exactly as it was; the error after the loop names those that could not be restored.
    Returns the number restored."""
    op = "zrw.cache.restore_weights"
    ws = _tensor_list(op, "weights", weights)
    _check_fill(op, fill)
    sources: List[Optional[Tensor]] = [None] * len(ws)
    if fill == "master":
        states = torch.ops.zrw.cache_states(ws)
        for i, (w, st) in enumerate(zip(ws, states)):
            sources[i] = master_of(w)
            if sources[i] is None and _STATES[st] is CacheState.RELEASED:
                raise _no_master_error(op, w)
    return torch.ops.zrw.restore_weights(ws, fill, sources)


@torch._dynamo.disable(reason=EAGER_ONLY)
def assign_weights(
    weights: Sequence[Tensor], sources: Sequence[Tensor], keep_released: bool = False
) -> int:
    """Write each source's values (rounded to the weight's dtype, as `w.copy_(source)`) into its
    weight and drop the weight's FP8 entry: a released weight gets fresh bytes that are filled
    before the release poison is cleared (no reader ever sees uninitialized memory), any other
    is written in place. Frozen entries (release_frozen) stay. The write-back of
    MasterWeights. Returns the number of released weights restored.

    keep_released=True is the BF16-free write-back, and the hook for an optimizer that keeps
    its own FP32 masters: a released weight is not restored; its FP8 copy is dropped and its
    entry keeps the source (which must be the float32 master, on the weight's device, and must
    not change until the next write-back) as the weight's value. The weight's next use
    quantizes straight from the master with one fused op that rounds each element to the
    weight's dtype first (the same bytes as quantizing `master.to(w.dtype)`); a restore (any
    fill but "zeros"/"empty") writes `master.to(w.dtype)` exactly. Weights that are not released
    are written in place as above. Returns the number of weights kept released."""
    op = "zrw.cache.assign_weights"
    ws = _tensor_list(op, "weights", weights)
    srcs = _tensor_list(op, "sources", sources)
    if len(ws) != len(srcs):
        raise ValueError(
            f"{op}: weights and sources must have the same length, got {len(ws)} and {len(srcs)}"
        )
    if not isinstance(keep_released, bool):
        raise TypeError(f"{op}: keep_released must be a bool, got {type(keep_released).__name__}")
    return torch.ops.zrw.assign_weights(ws, srcs, keep_released)


@torch._dynamo.disable(reason=EAGER_ONLY)
def write_back(
    weights: Sequence[Tensor], sources: Sequence[Tensor], keep_released: bool
) -> List[Optional[int]]:
    """assign_weights for MasterWeights' write-back: also returns, per weight, the digest of
    the bytes it wrote in place (what `weight_digest` reads from them afterwards), taken right
    after each write, from cache, or None (released, or not a contiguous CPU tensor). Arguments
    checked by the caller."""
    digests = torch.empty(len(weights), 2, dtype=torch.int64)
    torch.ops.zrw.assign_weights(weights, sources, keep_released, digests)
    return [d & _U64 if taken else None for taken, d in digests.tolist()]


_U64 = (1 << 64) - 1


@torch._dynamo.disable(reason=EAGER_ONLY)
def restore_all(fill: str = "master") -> int:
    """Restore every released trainable weight and drop every trainable weight's FP8 entry.

    Entries of frozen weights released with release_frozen survive. fill="master" (the
    default) restores the weights known to MasterWeights exactly from their masters and any
    other released weight by dequantization (lossy); "dequant", "zeros" and "empty"
    (uninitialized: only for a caller that overwrites every weight next) apply to all.
    All-or-nothing per weight: the error names every weight that could not be restored, and
    each of them keeps its entry and FP8 copy. Returns the number of weights restored.
    """
    op = "zrw.cache.restore_all"
    _check_fill(op, fill)
    if fill != "master":
        return torch.ops.zrw.restore_all(fill, [])
    errors = []
    n = 0
    # The weights with a live master first (restore_weights skips frozen entries), then the rest
    # (a weight whose cache entry keeps its master is restored from it exactly there too).
    # A snapshot with strong references: optimizers built or deleted on other threads meanwhile
    # change neither the set of weights nor their masters under this call.
    pairs = _registered_masters()
    with_master = [w for w, _ in pairs]
    try:
        n += torch.ops.zrw.restore_weights(with_master, "master", [m for _, m in pairs])
    except RuntimeError as e:
        errors.append(str(e))
    # The lossy fill below never reaches a weight with a master: neither one left released
    # above (it keeps its entry) nor one that another thread's forward released again since.
    try:
        n += torch.ops.zrw.restore_all("dequant", with_master)
    except RuntimeError as e:
        errors.append(str(e))
    if errors:
        raise RuntimeError("\n".join(errors))
    return n


def cache_state(w: Tensor) -> CacheState:
    """CacheState.NONE: w has no cache entry; CACHED: its FP8 copy is cached; RELEASED: cached
    and its storage released until the optimizer boundary; RELEASED_FOR_GOOD: a frozen weight
    released with release_frozen (its FP8 copy is its only value)."""
    w = _check_tensor("zrw.cache.cache_state", "w", w)
    return _STATES[torch.ops.zrw.cache_state(w)]


def cache_states(weights: Iterable[Tensor]) -> List[CacheState]:
    """cache_state of each weight, in one call."""
    return [
        _STATES[s]
        for s in torch.ops.zrw.cache_states(
            _tensor_list("zrw.cache.cache_states", "weights", weights)
        )
    ]


def is_released(w: Tensor) -> bool:
    """Whether w's BF16 storage is currently released by zrw."""
    _check_tensor("zrw.cache.is_released", "w", w)
    return cache_state(w).released


def is_cached(w: Tensor) -> bool:
    """Whether the cache holds an FP8 copy of w."""
    _check_tensor("zrw.cache.is_cached", "w", w)
    return cache_state(w).cached


def next_step() -> None:
    """Start a new optimizer step: every trainable weight that is not released is re-quantized
    at its next use (a released weight cannot have changed: its copy stays valid)."""
    torch.ops.zrw.next_step()


def cache_clear(fill: str = "dequant") -> None:
    """Drop every entry; released weights are restored first (default by dequantization, the
    only source left for a frozen weight — lossy), so no weight loses its only copy. A weight
    that cannot be restored keeps its entry, and the error names it."""
    _check_fill("zrw.cache.cache_clear", fill)
    if fill == "master":
        restore_all("master")
        fill = "dequant"
    try:
        torch.ops.zrw.cache_clear(fill)
    finally:
        for w, _ in records():  # frozen weights restored: ordinary Parameters again
            if type(w) is FP8OnlyParameter and not cache_state(w).released:
                _unmark_fp8_only(w)


def cache_invalidate(w: Tensor, fill: str = "dequant") -> bool:
    """Drop w's entry (restoring it first with `fill` if released). False if w had none. A
    weight whose data was replaced since its release (`w.data = t`) keeps the new data: its
    entry is dropped without writing into it."""
    op = "zrw.cache.cache_invalidate"
    w = _check_tensor(op, "w", w)
    _check_fill(op, fill)
    if fill == "master":
        state = cache_state(w)
        if not state.released:  # nothing released: nothing to fill
            return state.cached and torch.ops.zrw.cache_invalidate(w, "dequant")
        restore(w, "master")  # raises the explanatory error if w has no master
        return True
    dropped = torch.ops.zrw.cache_invalidate(w, fill)
    _unmark_fp8_only(w)
    return dropped


def restore_frozen(model_or_weights, fill: str = "dequant") -> int:
    """Bring back every frozen weight released for good (release_frozen=True) among the
    parameters of a module (or a list of weights), from its FP8 copy: its only value, so this
    is lossy against the BF16 weight it was made from. Afterwards the weights are ordinary
    tensors that can be written (PEFT's merge_and_unload, an in-place update); their next use
    in a layer with release_frozen quantizes the written values and releases them again.
    (restore_all skips frozen weights: their FP8 copy is kept across steps on purpose.)
    Returns the number restored."""
    op = "zrw.cache.restore_frozen"
    if fill != "dequant":
        raise ValueError(
            f"{op}: fill must be 'dequant' (a frozen weight released for good has "
            f"only its FP8 copy), got {fill!r}"
        )
    if isinstance(model_or_weights, torch.nn.Module):
        ws = [_local(p) for p in model_or_weights.parameters()]
    else:
        ws = _tensor_list(op, "model_or_weights", model_or_weights)
    frozen = [w for w, st in zip(ws, cache_states(ws)) if st is CacheState.RELEASED_FOR_GOOD]
    for w in frozen:
        torch.ops.zrw.cache_invalidate(w, "dequant")
        _unmark_fp8_only(w)
    return len(frozen)


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


@contextlib.contextmanager
def frozen_values(mode: str) -> Iterator[None]:
    """Within this block each frozen weight released for good is handled as `mode` says:
    "dequant" (state_dict() and every save built on it, torch.save of a state dict, PEFT's
    save_pretrained, Trainer checkpoints, give its dequantized FP8 copy, the only value left,
    lossy against the BF16 weight it was made from; a write to it, PEFT's merge_and_unload,
    fills it from that copy first) or "raise" (a named error for both)."""
    if mode not in FROZEN_MODES:
        raise ValueError(
            f"zrw.cache.frozen_values: mode must be one of {FROZEN_MODES}, got {mode!r}"
        )
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
                torch.ops.zrw.cache_invalidate(w, "dequant")  # replaced: nothing written
                _unmark_fp8_only(w)
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


def _mark_fp8_only(w: Tensor, rec) -> None:
    """After a use that may have released frozen Parameter `w` for good: without an FP32
    master its FP8 copy is its only value, and a write to it must see it (FP8OnlyParameter)."""
    if _STATES[torch.ops.zrw.cache_state.default(w)] is not CacheState.RELEASED_FOR_GOOD:
        return
    if rec.master() is not None or torch.ops.zrw.cache_master(w) is not None:
        return
    w.__class__ = FP8OnlyParameter


def _unmark_fp8_only(w: Tensor) -> None:
    if type(w) is FP8OnlyParameter:
        w.__class__ = torch.nn.Parameter


def _write_to_fp8_only(w: Tensor, how: str) -> None:
    """A write (through `how`) to a weight released for good: filled from its FP8 copy (with
    the once-per-process warning that this rounds) or, with an FP32 master, exactly from it;
    refused by name under frozen_values("raise"), with nothing changed. A weight no longer in
    that state (restored meanwhile by another path) only gets its class back."""
    state = _STATES[torch.ops.zrw.cache_state.default(w)]
    if state is CacheState.RELEASED_FOR_GOOD:
        master = master_of(w)
        name = weight_name(w) or f"<unnamed weight of shape {tuple(w.shape)}>"
        if master is not None:
            torch.ops.zrw.restore(w, "master", master)
        elif frozen_mode() == "raise":
            raise RuntimeError(
                f"zrw.cache: a write through {how} to frozen weight {name!r}, released for "
                "good (release_frozen=True): only its MXFP8 copy holds its values, and "
                "zrw.checkpoint.frozen_values('raise') is in effect, so it is not filled from "
                "that copy (lossy). Nothing was changed. Write it outside that block (e.g. "
                "PEFT's merge_and_unload: the base is filled from its dequantized FP8 copy, "
                "with a warning), call zrw.cache.restore_frozen(model) first, or convert with "
                "release_frozen=False to keep the exact BF16 base"
            )
        else:
            torch.ops.zrw.cache_invalidate(w, "dequant")
            _warn_frozen_write(name, how)
    _unmark_fp8_only(w)


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


def cache_stats() -> Dict[str, int]:
    """entries, fp8_bytes (held), released / released_bytes (BF16 bytes currently freed), frozen,
    pending (released weights waiting to be quantized from their master), restored /
    restored_bytes (released storages given bytes again, since cache_clear), hits, misses, step,
    and skip_<reason> counts: release_false, no_grad, non_leaf, frozen, flat_buffer (storage
    larger than the tensor or at an offset), aliased (storage shared)."""
    if torch.compiler.is_exporting():
        raise _export_error(
            "zrw.cache.cache_stats", "a converted model (its forward reads the cache)"
        )
    names, values = torch.ops.zrw.cache_stats()
    return dict(zip(names, values))


def cache_entries() -> List[Dict[str, object]]:
    """One dict per entry: name, status ("released" or the skip reason), hits, misses,
    storage_bytes."""
    cols = torch.ops.zrw.cache_entries()
    keys = ("name", "status", "hits", "misses", "storage_bytes")
    return [dict(zip(keys, row)) for row in zip(*cols)]


# ---- the optimizer boundary's callbacks ------------------------------------------------------
# An OrderedDict, as torch's own hook tables: RemovableHandle keeps a weak reference to it.
_boundary_callbacks: "OrderedDict[int, Callable[[torch.optim.Optimizer], None]]" = OrderedDict()


def register_boundary_callback(fn: Callable[[torch.optim.Optimizer], None]) -> RemovableHandle:
    """Call `fn(optimizer)` at every zrw optimizer boundary, before the step (and before any
    restore). zrw.fsdp registers the drop of its shard caches here. Returns a handle whose
    `remove()` unregisters it. (Also zrw.optim.register_boundary_callback.)"""
    if not callable(fn):
        raise TypeError(
            f"zrw.cache.register_boundary_callback: fn must be callable, got {type(fn).__name__}"
        )
    handle = RemovableHandle(_boundary_callbacks)
    _boundary_callbacks[handle.id] = fn
    return handle


def run_boundary_callbacks(optimizer: torch.optim.Optimizer) -> None:
    """Run every registered boundary callback with `optimizer` (zrw.optim's boundary)."""
    for fn in list(_boundary_callbacks.values()):
        fn(optimizer)
