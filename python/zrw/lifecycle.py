"""The weight lifecycle as code: the state machine of docs/design.md §5.

One function per event row of §5's "Events and transitions" table (the list is §5's "Where each
rule is enforced"). These functions are the ONLY writers of a weight's record fields
(zrw.record) and of its native state (the table of csrc/cache/weight_cache.cpp):
tests/docs/test_layering.py rejects an assignment to a record field anywhere else. Each event
decides first and writes after: an event with no legal transition raises a named error before
anything changes.

Callers (zrw.cache's public functions, the layers, the optimizer boundary, MasterWeights) check
their arguments; every weight given here is already the tensor the cache works on (a DTensor
parameter's local shard). Every event stamps the record's `last_event`, which verify mode
(`verify()`, or ZRW_VERIFY=1 for a whole run) names when it finds a stale FP8 copy.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import warnings
import weakref
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _C
from . import verify as verify_mode
from ._dtensor import local_tensor as _local
from .record import WeightRecord, find_record, record_of, records
from .verify import verifying
from .write_check import holds_master, plain_tensor, tensor_arg, weight_digest, weight_signature

# One source: the native cache's names (csrc/common/names.h).
FILLS = tuple(_C.fill_names())
RECIPES = tuple(_C.cache_recipes())


class CacheState(str, enum.Enum):
    """A weight's state in the native cache (docs/design.md §5, "The states"); the names are
    csrc/common/names.h's. A str enum: each state compares equal to its name."""

    NONE = "none"  # no entry: the storage holds the value
    CACHED = "cached"  # its FP8 copy is cached, its storage kept
    RELEASED = "released"  # cached, storage released until the boundary
    RELEASED_FOR_GOOD = "released_for_good"  # a frozen weight released with release_frozen
    PENDING = "pending"  # released, no copy yet: its next use quantizes from the entry's master

    @property
    def released(self) -> bool:
        """Whether the weight's storage is released (RELEASED, PENDING or RELEASED_FOR_GOOD)."""
        return self not in (CacheState.NONE, CacheState.CACHED)

    @property
    def cached(self) -> bool:
        """Whether the weight has an entry (anything but NONE)."""
        return self is not CacheState.NONE

    def __str__(self) -> str:
        return self.value


# The native codes are positions in names.h's kStates.
_STATES = tuple(CacheState(n) for n in _C.state_names())


# The events of docs/design.md §5 ("Where each rule is enforced"): the functions below that
# change a weight's state; tests/cache/test_stateful.py names the rules that cause each.
EVENTS = tuple(
    "use boundary drop_before_step write_back next_step take_into_master restore restore_value "
    "restore_all assign invalidate clear fill_frozen hold_for_write tie own disown add_master "
    "leave copied".split()
)


def state(w: Tensor) -> CacheState:
    return _STATES[torch.ops.zrw.cache_state.default(w)]


def states(ws: Sequence[Tensor]) -> List[CacheState]:
    return [_STATES[s] for s in torch.ops.zrw.cache_states(list(ws))] if ws else []


def _touch(rec: WeightRecord, event: str) -> None:
    if rec.last_event != event:
        rec.last_event = event


def _stamp(w: Tensor, event: str) -> None:
    rec = find_record(w)
    if rec is not None:
        _touch(rec, event)


def shown_name(w: Tensor, name: Optional[str] = None) -> str:
    """The weight's name for a message: `name`, its record's, or its shape."""
    if name:
        return name
    rec = find_record(w)
    if rec is not None and rec.name:
        return rec.name
    return f"<unnamed weight of shape {tuple(w.shape)}>"


# ---- no_release -----------------------------------------------------------------------------

_local_state = threading.local()


@contextlib.contextmanager
def no_release() -> Iterator[None]:
    """Within this block quant_and_release caches FP8 copies but never releases a BF16 storage."""
    prev = getattr(_local_state, "no_release", 0)
    _local_state.no_release = prev + 1
    try:
        yield
    finally:
        _local_state.no_release = prev


def release_enabled() -> bool:
    return getattr(_local_state, "no_release", 0) == 0


def current_value(w: Tensor) -> Optional[Tensor]:
    """The value a use must quantize (docs/design.md §5): bf16 of the master for a released
    weight that has one, its storage for one that is not released, None for a weight whose
    FP8 copy is its only value."""
    st = state(w)
    if not st.released:
        return w.detach()
    master = master_of(w)
    return None if master is None else master.detach().to(w.dtype)


def _verify(w: Tensor, rec: WeightRecord, served: List[Tensor], layout: tuple) -> None:
    value = current_value(w)
    if value is not None:
        verify_mode.check(served, value, layout, shown_name(w), str(state(w)), rec.last_event)


# ---- names, owners, masters, ties, holds --------------------------------------------------------


def name_weight(w: Tensor, name: str) -> None:
    rec = record_of(w)
    if rec.name != name:
        rec.name = name


def own(ws: Sequence[Tensor], optimizer) -> None:
    """An optimizer with the zrw boundary steps these weights."""
    for w in ws:
        rec = record_of(w)
        rec.owners.add(optimizer)
        _touch(rec, "own")


def disown(ws: Sequence[Tensor], optimizer) -> None:
    """The owner is detached (zrw.optim.detach)."""
    for w in ws:
        rec = find_record(w)
        if rec is not None:
            rec.owners.discard(optimizer)
            _touch(rec, "disown")


def leave(ws: Sequence[Tensor], masters: Sequence[Tensor], optimizer) -> None:
    """`optimizer` stops stepping these weights (removed from its param groups): a released
    one whose value is its master here is restored exactly from it first (RELEASED/PENDING ->
    NONE), then the optimizer's master and ownership go."""
    for w, m in zip(ws, masters):
        rec = find_record(w)
        if rec is None:
            continue
        if state(w) in (CacheState.RELEASED, CacheState.PENDING) and rec.master() is m:
            torch.ops.zrw.restore(w, "master", m)
        rec.owners.discard(optimizer)
        rec.masters = [(o, r) for o, r in rec.masters if o is None or o() is not optimizer]
        if rec.current is not None and rec.current() is m:
            rec.current = None
        _touch(rec, "leave")


def add_master(w: Tensor, master: Tensor, optimizer=None) -> None:
    """`optimizer` keeps `master` as w's FP32 master (one per optimizer)."""
    rec = record_of(w)
    rec.set_master(optimizer, master)
    _touch(rec, "add_master")


def tie(w: Tensor, names: Optional[Tuple[str, ...]]) -> None:
    """w is shared by the modules `names` (None: not tied any more); never released while tied."""
    rec = record_of(w) if names else find_record(w)
    if rec is not None and rec.tied != names:
        rec.tied = names
        _touch(rec, "tie")


def hold_for_write(w: Tensor) -> None:
    """w was restored for a write (apply, a cast) that the next write-back must read."""
    rec = record_of(w)
    rec.hold = True
    _touch(rec, "hold_for_write")


def main_grad_started(owner: Tensor) -> None:
    rec = record_of(owner)
    rec.main_grad = True


def prepared(local: Tensor, dtensor: Tensor) -> None:
    """zrw.parallel.prepare checked `local`, the local shard of DTensor parameter `dtensor`."""
    rec = record_of(local)
    rec.prepared = True
    rec.dtensor = weakref.ref(dtensor)


def master_of(w: Tensor) -> Optional[Tensor]:
    """The FP32 master w holds the value of: the one registered, else its entry's (PENDING)."""
    rec = find_record(w)
    master = None if rec is None else rec.master()
    return torch.ops.zrw.cache_master(w) if master is None else master


def registered_masters() -> List[tuple]:
    """(weight, master) for each weight with a live master, with strong references."""
    pairs = []
    for w, rec in records():
        m = rec.master()
        if m is not None:
            pairs.append((w, m))
    return pairs


# ---- the rule of truth --------------------------------------------------------------------------

_U64 = (1 << 64) - 1


def unchanged_since_write_back(p: Tensor, rec: Optional[WeightRecord], master: Tensor) -> bool:
    """Whether p holds exactly what the last write-back from `master` wrote (its record `rec`
    says: signature, digest and the master written)."""
    tensor_arg("unchanged_since_write_back", "p", p)
    if rec is not None and not isinstance(rec, WeightRecord):
        raise TypeError(
            "zrw.cache.unchanged_since_write_back: rec must be a zrw.record.WeightRecord or "
            f"None, got {type(rec).__name__}"
        )
    tensor_arg("unchanged_since_write_back", "master", master)
    if rec is None or rec.digest is None or rec.written is None:
        return False
    cur = None if rec.current is None else rec.current()
    return cur is master and weight_signature(p) == rec.written and weight_digest(p) == rec.digest


def take_into_master(master: Tensor, value: Tensor) -> bool:
    """Rule of truth 1: a write reaches the master only if its bits differ from
    master.to(value.dtype). Returns whether the master changed."""
    tensor_arg("take_into_master", "master", master)
    tensor_arg("take_into_master", "value", value)
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


def _sync_before_release(w: Tensor, rec: WeightRecord) -> None:
    """The master takes what was written since the last write-back before a release hides it."""
    master = rec.master()
    if master is None or master.shape != w.shape:
        return
    if unchanged_since_write_back(w, rec, master):
        return
    take_into_master(master, w)


# ---- use: first use, later use, PENDING's next use, unfreeze ------------------------------------

_unowned_warned = False


def _warn_unowned(name: str) -> None:
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
        stacklevel=4,
    )


def _unfreeze_master(op: str, w: Tensor, rec: WeightRecord, name: str) -> Tensor:
    """Rule of truth 4: the master a weight released for good is made trainable from, or the
    named refusal."""
    master = rec.master()
    if master is None:
        master = torch.ops.zrw.cache_master(w)
    if master is None:
        raise RuntimeError(
            f"{op}: weight {shown_name(w, name)!r} was released for good while frozen "
            "(release_frozen=True): only its MXFP8 copy exists, and it has no FP32 master to "
            "train from, but it requires grad again. Nothing was changed. Either unfreeze it "
            "only after zrw.cache.restore_frozen(model) (its dequantized FP8 values become its "
            "BF16 weights: lossy), or build the optimizer over it before it is released "
            "(zrw.optim.AdamW / MasterWeights keep its exact FP32 master)"
        )
    return master


def _training_use(op: str, w: Tensor, rec: WeightRecord, release: bool, name: str) -> bool:
    """A trainable weight's use in training, before the native lookup: decides, then writes.
    Returns whether the lookup may release it."""
    st = state(w)
    master = None
    if st is CacheState.RELEASED_FOR_GOOD:
        master = _unfreeze_master(op, w, rec, name)  # raises before anything changes
    if master is not None:
        torch.ops.zrw.restore(w, "master", master)
        _touch(rec, "unfreeze")
        st = CacheState.NONE
    if not rec.owned():
        # Rule of truth 2: nothing starts a new step for it, so it is quantized afresh.
        if st.released:
            restore_value(w)  # its owner is gone: exact from the master its entry keeps
        elif st.cached:
            torch.ops.zrw.cache_invalidate(w, "dequant")
        if release:
            _warn_unowned(name)
        return False
    if not release or rec.hold or rec.tied:
        return False
    if not st.released:  # (CACHED: an eval's copy, which this use may release)
        _sync_before_release(w, rec)
    return True


def use(
    op: str,
    w: Tensor,
    layout: tuple,
    release: bool,
    release_frozen: bool,
    name: Optional[str],
    require_owner: bool,
    trainable: bool,
    rec: Optional[WeightRecord] = None,
) -> List[Tensor]:
    """A use of weight w by a layer (first use in a step, later use, PENDING's next use): the
    native lookup, quantizing, filing and releasing as the guard allows. Returns the entry's
    tensors. Arguments checked by zrw.cache.quant_and_release."""
    recipe, elem_dtype, scale_mode = layout
    if rec is None:
        rec = record_of(w)
    if name is None:
        name = rec.name
    release = release and release_enabled()
    grad = torch.is_grad_enabled()
    if grad and trainable and (require_owner or not release):
        release = _training_use(op, w, rec, release, name)
    elif grad and release and release_frozen and not trainable and rec.masters:
        # About to be released for good: its master takes what its storage holds first.
        if not state(w).released:
            _sync_before_release(w, rec)
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
    # Written only once the native lookup succeeded: a refused use changes nothing.
    if rec.quantized_as != layout:
        rec.quantized_as = layout
    if name and not rec.name:
        rec.name = name  # messages outside the cache (the optimizer guard) use it too
    _touch(rec, "use")
    if verifying() and not torch.is_inference_mode_enabled():
        _verify(w, rec, tensors, layout)
    return tensors


def served(w: Tensor, layout: tuple, name: str = "") -> List[Tensor]:
    """What a use would be served now, read without side effects (the cache's inference read:
    no entry, state or record changes): the cached copy, or the quantization of the value."""
    recipe, elem_dtype, scale_mode = layout
    with torch.inference_mode():
        return torch.ops.zrw.quant_and_release.default(
            w, recipe, False, False, elem_dtype, scale_mode, shown_name(w, name), w.requires_grad
        )


# ---- restores, the boundary, the write-back, next step ------------------------------------------


def restore(w: Tensor, fill: str, source: Optional[Tensor]) -> None:
    torch.ops.zrw.restore(w, fill, source)
    _stamp(w, f"restore({fill})")


def restore_value(w: Tensor) -> Optional[Tensor]:
    """Bring back w's value to be read or written (exact from its master, else its FP8 copy);
    an unreleased weight's copy is dropped. Returns w's master."""
    st = state(w)
    master = master_of(w)
    if st.released:
        torch.ops.zrw.restore(w, "master" if master is not None else "dequant", master)
    elif st.cached:
        torch.ops.zrw.cache_invalidate(w, "dequant")
    _stamp(w, "restore_value")
    return master


def boundary(ws: List[Tensor], fill: str, sources: List[Optional[Tensor]]) -> int:
    """The boundary of a plain optimizer: its weights back to NONE (restored with `fill`)."""
    n = torch.ops.zrw.restore_weights(ws, fill, sources)
    for w in ws:
        _stamp(w, "boundary")
    return n


def drop_before_step(
    params: List[Tensor], masters: List[Tensor], keep_released: bool, stepped: List[bool]
) -> None:
    """MasterWeights, before the inner step: CACHED -> NONE; with keep_released
    RELEASED/PENDING -> PENDING (the master is the value). A weight released for good whose
    master the step is about to change (`stepped`: it has a gradient, e.g. frozen after its
    backward) comes back exactly from the master -> NONE: its FP8 copy would be stale."""
    released_p, released_m = [], []
    for p, m, st, moves in zip(params, masters, states(params), stepped):
        if st is CacheState.RELEASED_FOR_GOOD and moves:
            torch.ops.zrw.restore(p, "master", m)
        elif st is CacheState.CACHED:
            torch.ops.zrw.cache_invalidate(p, "dequant")
        elif st in (CacheState.RELEASED, CacheState.PENDING) and keep_released:
            released_p.append(p)
            released_m.append(m)
    if released_p:
        torch.ops.zrw.assign_weights(released_p, released_m, True)
    for p in params:
        _stamp(p, "drop_before_step")


def assign(ws: List[Tensor], srcs: List[Tensor], keep_released: bool) -> int:
    """Write sources into weights (released ones restored, or kept PENDING)."""
    n = torch.ops.zrw.assign_weights(ws, srcs, keep_released)
    for w in ws:
        _stamp(w, "assign")
    return n


def write_back(
    params: List[Tensor], masters: List[Tensor], keep_released: bool
) -> List[Optional[int]]:
    """MasterWeights' write-back: every parameter gets bf16 of its master (released ones stay
    PENDING or are restored), and its record says which master is its value and what it
    looked like right after (signature and digest, taken by the write itself, from cache)."""
    digests: List[Optional[int]] = [None] * len(params)
    try:
        if params:
            raw = torch.empty(len(params), 2, dtype=torch.int64)
            # The plain tensors (FSDP2's PreQuantWeight wraps a rank's shard: its bytes and the
            # digest are its inner tensor's; such a shard is never in the native table).
            plain = [q if q is not None else p for p, q in zip(params, map(plain_tensor, params))]
            torch.ops.zrw.assign_weights(plain, masters, keep_released, raw)
            digests = [d & _U64 if taken else None for taken, d in raw.tolist()]
    finally:
        written(params, masters, digests)
    return digests


def written(params: List[Tensor], masters: List[Tensor], digests=None) -> None:
    """After a write-back: each parameter holds bf16 of its master."""
    if digests is None or len(digests) != len(params):
        digests = [None] * len(params)
    for p, m, st, digest in zip(params, masters, states(params), digests):
        rec = record_of(p)
        rec.written = weight_signature(p)
        if st.released:
            rec.digest = None
        else:
            rec.digest = digest if digest is not None else weight_digest(p)
        rec.current = weakref.ref(m)
        rec.hold = False  # its write was read: it may be released again
        _touch(rec, "write_back")


def copied(params: List[Tensor], masters: List[Tensor]) -> None:
    """A copied optimizer (deepcopy, pickle): its parameters may hold a write their masters
    have not taken yet, so its first check compares them exactly."""
    for p, m in zip(params, masters):
        rec = record_of(p)
        rec.current = weakref.ref(m)
        rec.written = rec.digest = None
        _touch(rec, "copied")


def next_step() -> None:
    torch.ops.zrw.next_step()


def invalidate(w: Tensor, fill: str) -> bool:
    dropped = torch.ops.zrw.cache_invalidate(w, fill)
    _stamp(w, "invalidate")
    return dropped


def clear(fill: str) -> None:
    """Every entry dropped, released weights restored first: with "master" each one that has a
    master (a frozen one released for good included) exactly from it, the rest by
    dequantization (their only value)."""
    if fill == "master":
        restore_all("master")
        for w, m in registered_masters():
            if state(w) is CacheState.RELEASED_FOR_GOOD:
                torch.ops.zrw.restore(w, "master", m)
        fill = "dequant"
    torch.ops.zrw.cache_clear(fill)


def restore_all(fill: str) -> int:
    """Every released trainable weight restored: with fill="master" those with a live master
    exactly (all-or-nothing per weight), then the rest by dequantization."""
    if fill != "master":
        return torch.ops.zrw.restore_all(fill, [])
    errors, n = [], 0
    pairs = registered_masters()
    with_master = [w for w, _ in pairs]
    try:
        n += torch.ops.zrw.restore_weights(with_master, "master", [m for _, m in pairs])
    except RuntimeError as e:
        errors.append(str(e))
    try:
        n += torch.ops.zrw.restore_all("dequant", with_master)
    except RuntimeError as e:
        errors.append(str(e))
    if errors:
        raise RuntimeError("\n".join(errors))
    return n


def fill_frozen(w: Tensor) -> bool:
    """A write to a weight released for good: filled exactly from its master (True) or from its
    dequantized FP8 copy (False) -> NONE."""
    master = master_of(w)
    if master is not None:
        torch.ops.zrw.restore(w, "master", master)
    else:
        torch.ops.zrw.cache_invalidate(w, "dequant")
    _stamp(w, "frozen_write")
    return master is not None
