"""The native weight cache and the release / restore lifecycle (DESIGN.md §5).

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

A DTensor weight (tensor / expert parallelism, zrw.parallel) is cached by its local shard: every
call here given a DTensor (weight, master or source) works on its local tensor.

Guarantees (the README's "Guarantees" section): a restore checks that the weight still has the
storage, dtype and size it was released with, allocates its bytes and fills them before it
clears the release poison, and runs under the cache's lock; a weight it could not restore keeps
its entry and its FP8 copy, and the error names it. No fill hands out uninitialized memory
unless the caller asked for "empty".
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Dict, Iterable, Iterator, List, Optional, Sequence

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from . import _C
from ._dtensor import local_tensor as _local
from .ops import E4M3
from .planes import MXWeight

# One source: the native cache's names (csrc/common/names.h).
FILLS = tuple(_C.fill_names())
RECIPES = tuple(_C.cache_recipes())

_release_state = threading.local()


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
        raise ValueError(f"{op}: {arg} must be a 2-d (N, K) or 3-d (E, N, K) weight, got shape "
                         f"{tuple(w.shape)}")
    return w


def _check_fill(op: str, fill) -> None:
    if fill not in FILLS:
        raise ValueError(f"{op}: fill must be one of {FILLS}, got {fill!r}")


def _tensor_list(op: str, arg: str, ts) -> List[Tensor]:
    if isinstance(ts, Tensor) or not isinstance(ts, Iterable):
        raise TypeError(f"{op}: {arg} must be an iterable of tensors, got {type(ts).__name__}")
    return [_check_tensor(op, f"{arg}[{i}]", t) for i, t in enumerate(ts)]


@torch._dynamo.disable
def quant_and_release(
    w: Tensor,
    recipe: str = "mxfp8",
    release: bool = True,
    *,
    release_frozen: bool = False,
    elem_dtype: torch.dtype = E4M3,
    scale_mode: str = "floor",
    name: Optional[str] = None,
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
    """
    trainable = w.requires_grad if isinstance(w, Tensor) else False
    w = _check_weight("zrw.cache.quant_and_release", w)  # a DTensor: its local shard
    release = release and release_enabled()
    if name is None:
        name = weight_name(w)
    elif name and not weight_name(w):
        set_weight_name(w, name)  # messages outside the cache (the optimizer guard) use it too
    with trainable_as(w, trainable):
        tensors = torch.ops.zrw.quant_and_release(
            w, recipe, release, release_frozen, elem_dtype, scale_mode, name
        )
    return MXWeight.from_tensors(recipe, tensors)


@contextlib.contextmanager
def trainable_as(w: Tensor, trainable: bool) -> Iterator[None]:
    """Within this block `w`, a DTensor's local shard (which never requires grad itself: its
    DTensor does), counts as the trainable leaf it stands for when `trainable`, so that the
    release guard releases it until the optimizer boundary instead of treating it as frozen.
    Only under grad mode; a tensor that already requires grad is left as it is."""
    flip = trainable and not w.requires_grad and torch.is_grad_enabled()
    if flip:
        w.requires_grad_(True)
    try:
        yield
    finally:
        if flip:
            w.requires_grad_(False)


def set_weight_name(w: Tensor, name: str) -> None:
    """Name `w` for zrw's messages (the release poison, cache_entries) where a call passes none."""
    _local(w)._zrw_name = name


def weight_name(w: Tensor) -> str:
    """The name set with `set_weight_name`, or ""."""
    return getattr(_local(w), "_zrw_name", "") or ""


# Masters registered by zrw.optim.MasterWeights: weight -> a weak reference to its FP32 master,
# keyed weakly by identity (a WeakKeyDictionary would compare tensors with ==, elementwise).
# Weak both ways: the optimizer owns its masters; a deleted optimizer takes them with it.
_masters = WeakIdKeyDictionary()


def register_master(weight: Tensor, master: Tensor) -> None:
    """Record the FP32 master of `weight` so that fill="master" can restore it exactly."""
    weight = _check_tensor("zrw.cache.register_master", "weight", weight)
    master = _check_tensor("zrw.cache.register_master", "master", master)
    if master.shape != weight.shape:
        raise ValueError(f"zrw.cache.register_master: master must have the weight's shape "
                         f"{tuple(weight.shape)}, got {tuple(master.shape)}")
    _masters[weight] = weakref.ref(master)


def master_of(weight: Tensor) -> Optional[Tensor]:
    """The FP32 master of `weight`: the one registered (by MasterWeights), else the one its cache
    entry holds while it is released after a keep_released write-back, or None. (For a DTensor
    weight: its local shard's master.)"""
    weight = _check_tensor("zrw.cache.master_of", "weight", weight)
    ref = _masters.get(weight)
    master = None if ref is None else ref()
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
        "the optimizer in zrw.optim.MasterWeights, or use fill='dequant' (lossy)")


@torch._dynamo.disable
def restore(w: Tensor, fill: str = "master") -> None:
    """Bring back one released weight's BF16 storage (original byte count) and drop its entry.

    fill: "master" (bf16 of the MasterWeights FP32 master — exactly what the optimizer would
    write; for a mid-step checkpoint or eval), "dequant" (from the FP8 copy; lossy), "zeros", or
    "empty" (uninitialized; only when something overwrites it next). Raises (DESIGN.md §8) for a
    weight that is not released, and for one whose data was replaced since its release
    (`w.data = t`); on any error the weight stays released and restorable.
    """
    op = "zrw.cache.restore"
    w = _check_tensor(op, "w", w)
    _check_fill(op, fill)
    source = None
    if fill == "master":
        source = master_of(w)
        if source is None and torch.ops.zrw.cache_state(w) >= 2:
            raise _no_master_error(op, w)
    torch.ops.zrw.restore(w, fill, source)


@torch._dynamo.disable
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
            if sources[i] is None and st == 2:
                raise _no_master_error(op, w)
    return torch.ops.zrw.restore_weights(ws, fill, sources)


@torch._dynamo.disable
def assign_weights(weights: Sequence[Tensor], sources: Sequence[Tensor],
                   keep_released: bool = False) -> int:
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
        raise ValueError(f"{op}: weights and sources must have the same length, got {len(ws)} "
                         f"and {len(srcs)}")
    if not isinstance(keep_released, bool):
        raise TypeError(f"{op}: keep_released must be a bool, got {type(keep_released).__name__}")
    return torch.ops.zrw.assign_weights(ws, srcs, keep_released)


@torch._dynamo.disable
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
    # The weights with a live master first (restore_weights skips frozen entries), then the rest.
    with_master = [w for w in list(_masters.keys()) if master_of(w) is not None]
    failed: List[Tensor] = []
    try:
        n += restore_weights(with_master, "master")
    except RuntimeError as e:
        errors.append(str(e))
        # Those left released keep their entries: the lossy fill below must not reach them.
        failed = [w for w, st in zip(with_master, cache_states(with_master)) if st == 2]
    try:
        n += torch.ops.zrw.restore_all("dequant", failed)
    except RuntimeError as e:
        errors.append(str(e))
    if errors:
        raise RuntimeError("\n".join(errors))
    return n


def cache_state(w: Tensor) -> int:
    """0: w has no cache entry; 1: its FP8 copy is cached; 2: cached and its storage released
    until the optimizer boundary; 3: released for good (a frozen weight, release_frozen)."""
    w = _check_tensor("zrw.cache.cache_state", "w", w)
    return torch.ops.zrw.cache_state(w)


def cache_states(weights: Iterable[Tensor]) -> List[int]:
    """cache_state of each weight, in one call."""
    return list(torch.ops.zrw.cache_states(_tensor_list("zrw.cache.cache_states", "weights",
                                                        weights)))


def is_released(w: Tensor) -> bool:
    """Whether w's BF16 storage is currently released by zrw."""
    return cache_state(w) >= 2


def is_cached(w: Tensor) -> bool:
    """Whether the cache holds an FP8 copy of w."""
    return cache_state(w) != 0


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
    torch.ops.zrw.cache_clear(fill)


def cache_invalidate(w: Tensor, fill: str = "dequant") -> bool:
    """Drop w's entry (restoring it first with `fill` if released). False if w had none. A
    weight whose data was replaced since its release (`w.data = t`) keeps the new data: its
    entry is dropped without writing into it."""
    op = "zrw.cache.cache_invalidate"
    w = _check_tensor(op, "w", w)
    _check_fill(op, fill)
    if fill == "master":
        state = torch.ops.zrw.cache_state(w)
        if state < 2:  # nothing released: nothing to fill
            return state != 0 and torch.ops.zrw.cache_invalidate(w, "dequant")
        restore(w, "master")  # raises the explanatory error if w has no master
        return True
    return torch.ops.zrw.cache_invalidate(w, fill)


def cache_stats() -> Dict[str, int]:
    """entries, fp8_bytes (held), released / released_bytes (BF16 bytes currently freed), frozen,
    pending (released weights waiting to be quantized from their master), restored /
    restored_bytes (released storages given bytes again, since cache_clear), hits, misses, step,
    and skip_<reason> counts: release_false, no_grad, non_leaf, frozen, flat_buffer (storage
    larger than the tensor or at an offset), aliased (storage shared)."""
    names, values = torch.ops.zrw.cache_stats()
    return dict(zip(names, values))


def cache_entries() -> List[Dict[str, object]]:
    """One dict per entry: name, status ("released" or the skip reason), hits, misses,
    storage_bytes."""
    cols = torch.ops.zrw.cache_entries()
    keys = ("name", "status", "hits", "misses", "storage_bytes")
    return [dict(zip(keys, row)) for row in zip(*cols)]
