"""One record per weight: everything zrw knows about a weight, in one registry
(docs/design.md §5, "Where a weight's state lives").

The native cache table (csrc/cache/weight_cache.cpp) stores a weight's FP8 bytes and its
state (none, cached, released, pending, released for good). Everything else zrw knows about
the weight
lives here, in one `WeightRecord` per weight, kept in one registry weak-keyed by the tensor the
cache works on (the parameter itself, or a DTensor parameter's local shard): a record goes
when its weight goes. Nothing is stored as an attribute on torch's own tensors, modules or
optimizers: what zrw knows about a module or an optimizer it does not own the class of lives
in the two small tables below, weak-keyed the same way.

Threads: optimizers are built and torn down on any thread while others train. Every insert
and lookup holds the registry's lock; readers that walk a table take a snapshot first
(`records()`), and the garbage collector's removals (WeakIdKeyDictionary's callbacks) never
wait for the lock.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "WeightRecord",
    "record_of",
    "find_record",
    "records",
    "ModuleRecord",
    "module_record",
    "OptimizerRecord",
    "optimizer_record",
    "find_optimizer_record",
]


@dataclass(eq=False)
class WeightRecord:
    """What zrw knows about one weight, besides the FP8 bytes and the state the native table
    holds for it.

    name      for zrw's messages (the release poison, cache_entries, errors)
    owners    the optimizers with the zrw boundary that step this weight (weak references;
              a garbage-collected optimizer simply drops out)
    masters   (optimizer, FP32 master) pairs, both weak: one per optimizer with FP32 masters
              (MasterWeights, or an optimizer that registered its own)
    current   the master whose value the weight holds since the last write-back (weak), or
              None: the weight's own storage holds its value. With two optimizers owning the
              weight, the one that did not write last takes this value before it steps
    written   the weight's signature (version, dtype, device, shape) right after that
              write-back: a write since then changes it (or, through `.data`, its bits)
    digest    a 64-bit digest of its bytes right after that write-back (zrw.cache.weight_digest),
              or None: a write through `.data` bumps no version, but changes the digest
    hold      restored for a write (apply, a cast) that the next write-back must read: not
              released again until then
    tied      the qualified names of the modules that share the weight (tied after convert),
              or None: never released while tied
    prepared  a DTensor local shard checked by zrw.parallel.prepare (a parallel engine may
              hand the layer a `to_local()` view of it)
    dtensor   the DTensor parameter a local shard belongs to (weak), where main_grad goes
    quantized_as  (cache layout, element dtype, scale mode) of its last quantization: how its
              FP8 copy is read back (a frozen weight released for good has no other value)
    main_grad the zrw layers accumulate its gradient in FP32 `main_grad` (cleared by
              `nn.Module.zero_grad` as `.grad` is)
    last_event the last lifecycle event that touched the weight (zrw.lifecycle), for verify
              mode's message

    Only the record (this module) and the lifecycle (zrw.lifecycle) write these fields
    (tests/docs/test_layering.py checks it).
    """

    name: str = ""
    owners: "weakref.WeakSet[Any]" = field(default_factory=weakref.WeakSet)
    masters: List[Tuple["weakref.ref[Any]", "weakref.ref[torch.Tensor]"]] = field(
        default_factory=list
    )
    current: Optional["weakref.ref[torch.Tensor]"] = None
    written: Optional[tuple] = None
    digest: Optional[int] = None
    hold: bool = False
    tied: Optional[Tuple[str, ...]] = None
    prepared: bool = False
    dtensor: Optional["weakref.ref[torch.Tensor]"] = None
    quantized_as: Optional[tuple] = None
    main_grad: bool = False
    last_event: str = ""

    # -- owners and masters ------------------------------------------------------------------
    def live_masters(self) -> List[Tuple[Any, torch.Tensor]]:
        """(optimizer or None, master) for each master still alive."""
        out = []
        for oref, mref in list(self.masters):
            m = mref()
            if m is not None:
                out.append((None if oref is None else oref(), m))
        return out

    def master(self) -> Optional[torch.Tensor]:
        """The master whose value the weight holds: the last one written back, else the only
        (or first) one registered, or None."""
        cur = None if self.current is None else self.current()
        if cur is not None:
            return cur
        live = self.live_masters()
        return live[0][1] if live else None

    def set_master(self, optimizer, master: torch.Tensor) -> None:
        """Register `optimizer`'s master of this weight (one per optimizer: a new one replaces
        the old)."""
        self.masters = [
            (o, m)
            for o, m in self.masters
            if m() is not None
            and (o is None or o() is not None)
            and not (o is not None and o() is optimizer)
            and not (o is None and optimizer is None)
        ]
        self.masters.append(
            (None if optimizer is None else weakref.ref(optimizer), weakref.ref(master))
        )

    def owned(self) -> bool:
        """Whether something writes this weight back exactly or restores it at a boundary: an
        optimizer with the zrw boundary, or an FP32 master."""
        return len(self.owners) > 0 or self.master() is not None


_lock = threading.RLock()
_records = WeakIdKeyDictionary()


def _get_or_add(table: WeakIdKeyDictionary, key, factory):
    """table[key], created with factory() on first use (under the registry's lock)."""
    rec = table.get(key)
    if rec is not None:
        return rec
    with _lock:
        rec = table.get(key)
        if rec is None:
            rec = factory()
            table[key] = rec
        return rec


def record_of(w: torch.Tensor) -> WeightRecord:
    """w's record, created on first use. `w` is the tensor the cache works on (a DTensor's
    local shard, never the DTensor)."""
    return _get_or_add(_records, w, WeightRecord)


def find_record(w: torch.Tensor) -> Optional[WeightRecord]:
    """w's record, or None if zrw never recorded anything about it (no lookup side effect)."""
    return _records.get(w)


def records() -> List[Tuple[torch.Tensor, WeightRecord]]:
    """A snapshot of the registry with strong references to the weights alive."""
    with _lock:
        return [(w, r) for w, r in list(_records.items()) if w is not None]


# ---- modules and optimizers of the user's ---------------------------------------------------


@dataclass(eq=False)
class ModuleRecord:
    """What zrw knows about a module whose class it does not own: the hooks zrw.convert put on
    the converted root (`root_hooks`), the optimizer step its last tie check ran at
    (`tie_step`), and the forward pre-hook zrw.parallel.prepare put on a layer
    (`parallel_hook`)."""

    root_hooks: Optional[tuple] = None
    tie_step: Optional[int] = None
    parallel_hook: Any = None


@dataclass(eq=False)
class OptimizerRecord:
    """An optimizer with the zrw boundary (zrw.optim.attach): its hook handles and how it
    restores before its step (`masters`: it writes FP32 masters back itself)."""

    hooks: Optional[tuple] = None
    masters: bool = False
    fill: Optional[str] = None


_modules = WeakIdKeyDictionary()
_optimizers = WeakIdKeyDictionary()


def module_record(module) -> ModuleRecord:
    return _get_or_add(_modules, module, ModuleRecord)


def optimizer_record(optimizer) -> OptimizerRecord:
    return _get_or_add(_optimizers, optimizer, OptimizerRecord)


def find_optimizer_record(optimizer) -> Optional[OptimizerRecord]:
    return _optimizers.get(optimizer)


def forget_optimizer(optimizer) -> None:
    with _lock:
        _optimizers.pop(optimizer, None)
