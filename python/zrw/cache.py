"""The weight cache's public API (docs/design.md §5): the calls a layer, an optimizer or a user
makes, each checking its arguments and then running the lifecycle event it stands for
(zrw.lifecycle, the state machine and the only writer of weight state).

  quant_and_release(w)    first use in a step: quantize, file the FP8 copy, release the BF16
  restore(w, fill)        bring one released weight back (raises if it is not released)
  restore_weights(ws, ..) the boundary of one optimizer: exactly the weights it owns
  assign_weights(ws, srcs) write new values (an FP32 master) into weights, released or not;
                          keep_released=True: a released weight stays released and its next
                          use quantizes straight from the master (the BF16-free step)
  restore_all(fill)       every released trainable weight
  restore_value(w)        bring a weight's exact value back (its master, else its FP8 copy)
  cache_state(w)          a CacheState: NONE, CACHED, RELEASED, PENDING or RELEASED_FOR_GOOD
  verify()                re-quantize at every use and compare with the copy served

These are stateful, eager-only calls: they run from layers and optimizer hooks, never inside a
compiled graph (dynamo is told to skip them). A DTensor weight (tensor / expert parallelism) is
cached by its local shard: every call here given a DTensor works on its local tensor. Frozen
weights released for good (FP8OnlyParameter, frozen_values, restore_frozen) live in zrw.frozen
and the optimizer boundary's callbacks in zrw.boundary; both are re-exported here.

Guarantees (docs/guarantees.md; docs/design.md §5, "Safety invariants"): a restore checks that
the weight still has the storage, dtype and size it was released with, allocates its bytes and
fills them before it clears the release poison, and runs under the cache's lock; a weight it
could not restore keeps its entry and its FP8 copy, and the error names it. No fill hands out
uninitialized memory unless the caller asked for "empty".
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence

import torch
from torch import Tensor

from . import frozen, lifecycle
from ._dtensor import local_tensor as _local
from .frozen import FROZEN_MODES, FP8OnlyParameter, frozen_mode, frozen_values, restore_frozen
from .lifecycle import (
    FILLS,
    RECIPES,
    CacheState,
    holds_master,
    no_release,
    release_enabled,
    take_into_master,
    unchanged_since_write_back,
    weight_digest,
    weight_signature,
)
from .ops import E4M3, E5M2, SCALE_MODES
from .planes import MXWeight
from .record import find_record, records
from .verify import StaleCopyError, verify

__all__ = [
    "CacheState",
    "FILLS",
    "FP8OnlyParameter",
    "FROZEN_MODES",
    "RECIPES",
    "StaleCopyError",
    "assign_weights",
    "cache_clear",
    "cache_entries",
    "cache_invalidate",
    "cache_master",
    "cache_state",
    "cache_states",
    "cache_stats",
    "frozen_mode",
    "frozen_values",
    "holds_master",
    "is_cached",
    "is_owned",
    "is_released",
    "master_of",
    "next_step",
    "no_release",
    "quant_and_release",
    "register_master",
    "register_owner",
    "release_enabled",
    "restore",
    "restore_all",
    "restore_frozen",
    "restore_value",
    "restore_weights",
    "set_weight_name",
    "take_into_master",
    "unchanged_since_write_back",
    "unregister_owner",
    "verify",
    "weight_digest",
    "weight_name",
    "weight_signature",
    "write_back",
]

_ELEM_DTYPES = (E4M3, E5M2)

# Why torch.compile breaks the graph at zrw's stateful calls (dynamo names it in its message,
# e.g. under fullgraph=True).
EAGER_ONLY = (
    "zrw's weight cache is eager-only: a converted model's forward breaks the graph "
    "at each zrw layer's cache lookup (and at the model's once-per-step tie check), "
    "so torch.compile(model, fullgraph=True) cannot compile it; compile without "
    "fullgraph=True (docs/guarantees.md)"
)


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


def _as_list(ts):
    """An iterable that _tensor_list takes, as a list (a generator read once); anything else
    as it is, for _tensor_list to refuse."""
    if isinstance(ts, (Tensor, str, bytes, dict)) or not isinstance(ts, Iterable):
        return ts
    return list(ts)


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
    # Checked here, as the native op checks them, so that a refused use changes nothing.
    if recipe not in RECIPES:
        raise ValueError(f'{op}: recipe must be "{RECIPES[0]}" or "{RECIPES[1]}", got "{recipe}"')
    if elem_dtype not in _ELEM_DTYPES:
        raise TypeError(
            f"{op}: elem_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {elem_dtype}"
        )
    if scale_mode not in SCALE_MODES:
        raise ValueError(
            f'{op}: scale_mode must be "{SCALE_MODES[0]}" or "{SCALE_MODES[1]}", got "{scale_mode}"'
        )
    tensors = lifecycle.use(
        op,
        w,
        (recipe, elem_dtype, scale_mode),
        bool(release),
        bool(release_frozen),
        name,
        require_owner,
        trainable,
    )
    if release and release_frozen and not trainable:
        frozen.mark(w)
    return MXWeight.from_tensors(recipe, tensors)


def _quant_and_release_eagerly(*args, **kwargs) -> MXWeight:
    return quant_and_release(*args, **kwargs)


# The stateful lookup, never traced: torch.compile breaks the graph here (quant_and_release
# sends dynamo to it; eager calls skip the wrapper's cost).
_eager_quant_and_release = torch._dynamo.disable(_quant_and_release_eagerly, reason=EAGER_ONLY)


_unowned_warned = False


def set_weight_name(w: Tensor, name: str) -> None:
    """Name `w` for zrw's messages (the release poison, cache_entries) where a call passes none."""
    w = _check_tensor("zrw.cache.set_weight_name", "w", w)
    if not isinstance(name, str):
        raise TypeError(f"zrw.cache.set_weight_name: name must be a str, got {type(name).__name__}")
    lifecycle.name_weight(w, name)


def weight_name(w: Tensor) -> str:
    """The name set with `set_weight_name`, or ""."""
    rec = find_record(_check_tensor("zrw.cache.weight_name", "w", w))
    return "" if rec is None else rec.name


def _check_optimizer(op: str, optimizer) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{op}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )


def register_owner(weights: Iterable[Tensor], optimizer) -> None:
    """Record that `optimizer` (with the zrw boundary) steps these weights (zrw.optim.attach
    calls it)."""
    ws = _tensor_list("zrw.cache.register_owner", "weights", weights)
    _check_optimizer("zrw.cache.register_owner", optimizer)
    lifecycle.own(ws, optimizer)


def unregister_owner(weights: Iterable[Tensor], optimizer) -> None:
    """Forget `optimizer` as the owner of these weights (zrw.optim.detach)."""
    ws = _tensor_list("zrw.cache.unregister_owner", "weights", weights)
    _check_optimizer("zrw.cache.unregister_owner", optimizer)
    lifecycle.disown(ws, optimizer)


def is_owned(w: Tensor) -> bool:
    """Whether a live optimizer with the zrw boundary steps `w`, or `w` has an FP32 master
    (MasterWeights, register_master): then a release of `w` ends at that optimizer's boundary
    or is undone exactly from the master."""
    w = _check_tensor("zrw.cache.is_owned", "w", w)
    rec = find_record(w)
    return rec is not None and rec.owned()


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
    lifecycle.add_master(weight, master, optimizer)


def master_of(weight: Tensor) -> Optional[Tensor]:
    """The FP32 master of `weight`: the one registered (by MasterWeights), else the one its cache
    entry holds while it is released after a keep_released write-back, or None. (For a DTensor
    weight: its local shard's master.)"""
    return lifecycle.master_of(_check_tensor("zrw.cache.master_of", "weight", weight))


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
        if source is None and lifecycle.state(w).released:
            raise _no_master_error(op, w)
    lifecycle.restore(w, fill, source)
    frozen.unmark(w)


@torch._dynamo.disable(reason=EAGER_ONLY)
def restore_value(w: Tensor) -> Optional[Tensor]:
    """Bring back `w`'s value so that it can be read or written: a released weight is restored
    exactly from its FP32 master, or, without one, from its FP8 copy (its only value: a frozen
    weight released for good, or one whose optimizer restores by dequantization anyway); an
    unreleased weight's FP8 copy is dropped (it goes stale on a write). Returns w's master (or
    None), so that the caller can hold w until the master has read a write."""
    w = _check_tensor("zrw.cache.restore_value", "w", w)
    master = lifecycle.restore_value(w)
    frozen.unmark(w)
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
        for i, (w, st) in enumerate(zip(ws, lifecycle.states(ws))):
            sources[i] = lifecycle.master_of(w)
            if sources[i] is None and st in (CacheState.RELEASED, CacheState.PENDING):
                raise _no_master_error(op, w)
    return lifecycle.boundary(ws, fill, sources)


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
    return lifecycle.assign(ws, srcs, keep_released)


@torch._dynamo.disable(reason=EAGER_ONLY)
def write_back(
    weights: Sequence[Tensor], sources: Sequence[Tensor], keep_released: bool
) -> List[Optional[int]]:
    """assign_weights for MasterWeights' write-back: also returns, per weight, the digest of
    the bytes it wrote in place (what `weight_digest` reads from them afterwards), taken right
    after each write, from cache, or None (released, or not a contiguous CPU tensor). Arguments
    checked as assign_weights checks them. The records say which master each weight holds."""
    op = "zrw.cache.write_back"
    ws, srcs = _as_list(weights), _as_list(sources)
    _tensor_list(op, "weights", ws)  # checked; passed as given (the lifecycle unwraps them)
    _tensor_list(op, "sources", srcs)
    if len(ws) != len(srcs):
        raise ValueError(
            f"{op}: weights and sources must have the same length, got {len(ws)} and {len(srcs)}"
        )
    if not isinstance(keep_released, bool):
        raise TypeError(f"{op}: keep_released must be a bool, got {type(keep_released).__name__}")
    return lifecycle.write_back(ws, srcs, keep_released)


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
    _check_fill("zrw.cache.restore_all", fill)
    return lifecycle.restore_all(fill)


def cache_state(w: Tensor) -> CacheState:
    """CacheState.NONE: w has no cache entry; CACHED: its FP8 copy is cached; RELEASED: cached
    and its storage released until the optimizer boundary; RELEASED_FOR_GOOD: a frozen weight
    released with release_frozen (its FP8 copy is its only value)."""
    return lifecycle.state(_check_tensor("zrw.cache.cache_state", "w", w))


def cache_states(weights: Iterable[Tensor]) -> List[CacheState]:
    """cache_state of each weight, in one call."""
    return lifecycle.states(_tensor_list("zrw.cache.cache_states", "weights", weights))


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
    lifecycle.next_step()


def cache_clear(fill: str = "dequant") -> None:
    """Drop every entry; released weights are restored first (default by dequantization, the
    only source left for a frozen weight — lossy), so no weight loses its only copy. A weight
    that cannot be restored keeps its entry, and the error names it."""
    _check_fill("zrw.cache.cache_clear", fill)
    try:
        lifecycle.clear(fill)
    finally:
        for w, _ in records():  # frozen weights restored: ordinary Parameters again
            frozen.unmark(w)


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
            return state.cached and lifecycle.invalidate(w, "dequant")
        restore(w, "master")  # raises the explanatory error if w has no master
        return True
    dropped = lifecycle.invalidate(w, fill)
    frozen.unmark(w)
    return dropped


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
