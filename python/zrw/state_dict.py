"""State dicts, pickling, loads and casts of layers whose weights may be released (one level
below the layers: zrw.nn's layers mix `ReleasedWeightsStateDict` and `NamedWeight` in;
zrw.checkpoint builds its one-tensor-at-a-time saves on `materialize` and `deferring`).

  materialize(p, master)   one released weight's exact value (bf16 of its master), a fresh tensor
  frozen_values(mode)      how state_dict() gives a frozen weight released for good
  ReleasedWeightsStateDict the state_dict / load_state_dict / apply / _apply / pickling of a zrw
                           layer (see its docstring)
  NamedWeight              the layer's `zrw_name`, kept on its weight for zrw's messages
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing.context
import threading
import warnings
import weakref
from typing import Iterator

import torch
from torch import Tensor, nn

from . import cache, frozen, lifecycle, ops
from ._dtensor import is_dtensor, local_tensor, wrap_like
from .record import find_record

_state = threading.local()

frozen_mode = frozen.frozen_mode
# Fresh copies of released weights pickled for a process being spawned, kept for as long as
# its Popen object lives (see ReleasedWeightsStateDict.__getstate__).
_spawn_keepalive: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_frozen_warned = False


def warn_frozen_dequant(name: str) -> None:
    """Once per process: a state dict holds the dequantized FP8 value of a frozen weight."""
    global _frozen_warned
    if _frozen_warned:
        return
    _frozen_warned = True
    warnings.warn(
        f"zrw: state_dict() gives frozen weight '{name}' (and every other frozen weight "
        "released for good with release_frozen=True) as its dequantized MXFP8 copy: its BF16 "
        "values no longer exist in this process (lossy against the original weights; a LoRA "
        "adapter's own weights are exact). Keep the original checkpoint for the base model, "
        "convert with release_frozen=False to save exact base weights, or use "
        "zrw.checkpoint.frozen_values('raise') to refuse",
        UserWarning,
        stacklevel=4,
    )


def deferring() -> bool:
    """True inside `deferred()`: zrw layers put a released weight itself into the state dict
    (metadata only, no bytes) instead of materializing it (zrw.checkpoint's saves)."""
    return getattr(_state, "defer", 0) > 0


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Within this block state_dict() defers released weights (see `deferring`)."""
    _state.defer = getattr(_state, "defer", 0) + 1
    try:
        yield
    finally:
        _state.defer -= 1


def materialize(p: Tensor, master: Tensor) -> Tensor:
    """A fresh tensor holding released weight `p`'s value, bf16 (p's dtype) of its FP32
    master; a DTensor weight gets a DTensor laid out as it is. `master` is the master of p's
    local tensor (zrw.cache.master_of), of its shape."""
    op = "zrw.state_dict.materialize"
    if not isinstance(p, Tensor):
        raise TypeError(
            f"{op}: p must be a torch.Tensor (the released weight), got {type(p).__name__}"
        )
    if not isinstance(master, Tensor):
        raise TypeError(
            f"{op}: master must be a torch.Tensor (p's FP32 master, e.g. "
            f"zrw.cache.master_of(p)), got {type(master).__name__}"
        )
    local = local_tensor(p)
    if local_tensor(master).shape != local.shape:
        raise ValueError(
            f"{op}: master must have the shape of p's local tensor "
            f"{tuple(local.shape)}, got {tuple(master.shape)}"
        )
    with torch.no_grad():
        return wrap_like(p, master.detach().to(p.dtype, copy=True))


def released_value(p: Tensor):
    """A fresh Parameter holding released parameter `p`'s exact value (bf16 of its FP32
    master), or None if `p` is not released or has no master (pickling it then raises the
    released-weight error that names it)."""
    local = local_tensor(p)
    if not cache.cache_state(local).released:
        return None
    master = cache.master_of(local)
    if master is None:
        return None
    return nn.Parameter(materialize(p, master), requires_grad=p.requires_grad)


def frozen_value(p: Tensor) -> Tensor:
    """A frozen weight released for good, as its dequantized FP8 copy (its only value; what
    `zrw.cache.restore_frozen` writes back), with the once-per-process warning: a fresh
    tensor (a DTensor laid out as `p` for a DTensor weight); the weight stays released."""
    local = local_tensor(p)
    warn_frozen_dequant(cache.weight_name(local))
    rec = find_record(local)
    if rec is None or rec.quantized_as is None:  # (a released weight was always quantized)
        raise RuntimeError(
            f"zrw.state_dict.frozen_value: weight "
            f"'{cache.weight_name(local)}' has no record of its quantization"
        )
    layout, elem_dtype, scale_mode = rec.quantized_as
    with torch.no_grad():
        q = cache.quant_and_release(
            local, layout, False, release_frozen=True, elem_dtype=elem_dtype, scale_mode=scale_mode
        )
        value = ops.mx_dequantize(q.fwd.data, q.fwd.scale, -1, local.dtype)
    return wrap_like(p, value)


def frozen_error(where: str, names: str) -> RuntimeError:
    """The named error of a save under frozen_values('raise') that meets frozen weights
    released for good."""
    return RuntimeError(
        f"{where}: frozen weight(s) {names} are released for good (release_frozen=True) "
        "and only their MXFP8 copies exist; nothing was returned or written "
        "(zrw.checkpoint.frozen_values('raise') is in effect). Use frozen_values('dequant') "
        "for their dequantized FP8 values, or convert with release_frozen=False to keep their "
        "exact BF16 values"
    )


def keep_for_spawn(popen, t: Tensor) -> None:
    """Keep `t` alive for as long as `popen` (a process being started) lives: a tensor pickled
    for torch.multiprocessing.spawn is passed to the child by file descriptor after pickling
    ends, so a fresh copy made while pickling must outlive it."""
    _spawn_keepalive.setdefault(popen, []).append(t)


class NamedWeight:
    """`zrw_name`, the name zrw's messages give a layer's `weight`, kept on the Parameter itself
    (zrw.cache.set_weight_name), where the cache reads it outside any compiled region: a per-layer
    string read in forward would make torch.compile guard on it and recompile the forward for
    every layer. The module keeps a copy, and stamps it on its weights again whenever they are
    replaced: a parameter registered anew (a parallel engine's DTensor from
    `parallelize_module`, `load_state_dict(assign=True)`), a copy or an unpickled module
    (copy.deepcopy makes new Parameters without their attributes). A layer with other weights
    than `weight` overrides `_weight_names` (parameter name -> zrw name)."""

    @property
    def zrw_name(self) -> str:
        return cache.weight_name(self.weight) or self.__dict__.get("_layer_name", "")

    @zrw_name.setter
    def zrw_name(self, name: str) -> None:
        self.__dict__["_layer_name"] = name
        cache.set_weight_name(self.weight, name)

    def _weight_names(self) -> dict:
        return {"weight": self.__dict__.get("_layer_name")}

    def register_parameter(self, name: str, param) -> None:
        super().register_parameter(name, param)
        shown = self._weight_names().get(name) if param is not None else None
        if shown:
            cache.set_weight_name(param, shown)  # a DTensor: its local shard

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        restamp_names(self, self._weight_names())


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
        states = cache.cache_states([local_tensor(p) for _, p in params])
        return [
            (n, p, cache.master_of(local_tensor(p)))
            for (n, p), st in zip(params, states)
            if st.released
        ]

    def _materialized(self):
        """(name, released parameter, a fresh Parameter holding its exact value) for each
        released weight with an FP32 master."""
        return [
            (n, p, nn.Parameter(materialize(p, m), requires_grad=p.requires_grad))
            for n, p, m in self._released_weights()
            if m is not None
        ]

    def __getstate__(self):
        """Pickling of the layer (`torch.save(model, path)`, a process started with
        torch.multiprocessing.spawn): a released weight with an FP32 master goes into the
        copy as a fresh Parameter holding its exact value (bf16 of the master), so the copy is
        an ordinary layer with readable weights; this layer is not changed (its weights stay
        released). A released weight without a master is left as it is, and pickling it raises
        the released-weight error that names it. While a process is being started (spawn)
        the fresh Parameters live as long as its Popen object: their shared memory is passed
        to the child by file descriptor after pickling ends."""
        state = super().__getstate__()
        fresh = self._materialized()
        if not fresh:
            return state
        state = dict(state)  # nn.Module's is the instance's own __dict__
        params = state["_parameters"] = dict(state["_parameters"])
        for n, _, q in fresh:
            params[n] = q
        popen = multiprocessing.context.get_spawning_popen()
        if popen is not None:
            for _, _, q in fresh:
                keep_for_spawn(popen, q)
        return state

    def __deepcopy__(self, memo):
        """copy.deepcopy of the layer, alone or with its optimizer (`copy.deepcopy((model,
        opt))`, an EMA or best-model copy between steps): a released weight with an FP32
        master becomes, in the copy, a fresh Parameter holding its exact value, and every
        other reference to the same weight in the same deepcopy (the optimizer's param groups)
        gets that same Parameter. This layer is not changed."""
        for _, p, q in self._materialized():
            if id(p) not in memo:
                memo[id(p)] = q
                memo.setdefault(id(memo), []).append(p)  # keeps p's id unique meanwhile
        cls = type(self)
        new = cls.__new__(cls)
        memo[id(self)] = new
        state = nn.Module.__getstate__(self)
        new.__setstate__(copy.deepcopy(state, memo))
        return new

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
            local = local_tensor(p)
            if cache.restore_value(local) is not None:
                lifecycle.hold_for_write(local)

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
                same = (
                    isinstance(probe, torch.Tensor)
                    and probe.dtype == p.dtype
                    and probe.device == p.device
                )
            except Exception:
                same = False
            if same and cache.cache_state(local_tensor(p)).released:
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
            self._parameters.update(
                {
                    k: kept[k] if k in kept else current[k]
                    for k in order
                    if k in kept or k in current
                }
            )
        with torch.no_grad():
            for p in kept.values():
                if p.grad is not None:
                    g = fn(p.grad)
                    if g is not p.grad:
                        p.grad = g
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        released = self._released_weights()
        if keep_vars:
            # torch gives the live Parameters: a released one is itself (reading its data
            # raises the released-weight error that names it; loading it back changes nothing).
            super()._save_to_state_dict(destination, prefix, keep_vars)
            for n, p, _ in released:
                destination[prefix + n] = p
            return
        if deferring():
            # zrw.checkpoint materializes each released weight when it writes it: here the
            # weight itself stands for it (its cache entry, master and metadata; no bytes).
            super()._save_to_state_dict(destination, prefix, keep_vars)
            for n, p, _ in released:
                destination[prefix + n] = p
            return
        # Frozen weights released for good (release_frozen): their FP8 copy is their only value.
        frozen = {
            n: p
            for n, p, m in released
            if m is None
            and cache.cache_state(local_tensor(p)) is cache.CacheState.RELEASED_FOR_GOOD
        }
        if frozen and frozen_mode() == "raise":
            names = ", ".join(
                repr(cache.weight_name(local_tensor(p)) or n) for n, p in frozen.items()
            )
            raise frozen_error(
                f"zrw: state_dict() of '{prefix.rstrip('.') or type(self).__name__}'", names
            )
        orphans = [local_tensor(p) for n, p, m in released if m is None and n not in frozen]
        if orphans:
            names = ", ".join(repr(cache.weight_name(p) or prefix.rstrip(".")) for p in orphans)
            raise RuntimeError(
                f"zrw: state_dict() of '{prefix.rstrip('.') or type(self).__name__}': weight(s) "
                f"{names} are released (zero-redundancy weights: only their MXFP8 copies live "
                "between the first forward of a step and the optimizer step) and have no FP32 "
                "master to materialize them from; nothing was returned or written. Take the "
                "state dict after the optimizer step, use zrw.optim.MasterWeights (exact), or "
                "restore the weights first with zrw.cache.restore_all('master') (lossy "
                "dequantization where no master exists)"
            )
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for n, p, m in released:
            if n in frozen:
                destination[prefix + n] = self._frozen_value(p)
            else:
                destination[prefix + n] = materialize(p, m)

    def _frozen_value(self, p: Tensor) -> Tensor:
        return frozen_value(p)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        if local_metadata.get("assign_to_params_buffers", False):
            # load_state_dict(assign=True) replaces the parameter objects: the old weights, and
            # their entries, are simply dropped; the new ones take the old ones' zrw names.
            names = {
                n: cache.weight_name(p)
                for n, p in self._parameters.items()
                if isinstance(p, torch.Tensor) and cache.weight_name(p)
            }
            super()._load_from_state_dict(
                state_dict,
                prefix,
                local_metadata,
                strict,
                missing_keys,
                unexpected_keys,
                error_msgs,
            )
            restamp_names(self, names)
            return
        params = [(n, self._parameters.get(n)) for n in self.zrw_quantized]
        params = [(n, p) for n, p in params if isinstance(p, torch.Tensor)]
        states = cache.cache_states([local_tensor(p) for _, p in params])
        held = {}  # released weights: loaded here, hidden from nn.Module's copy_
        for (n, p), st in zip(params, states):
            if st.released and prefix + n in state_dict:
                held[n] = (p, st)
        # A state dict taken with keep_vars=True holds the released weights themselves (or,
        # detached, views of exactly their storage): loading one into itself changes nothing.
        same = {n for n, (p, _) in held.items() if _is_own_value(state_dict[prefix + n], p)}
        if held:
            saved = dict(self._parameters)
            for n in held:
                del self._parameters[n]
        first_unexpected = len(unexpected_keys)
        try:
            super()._load_from_state_dict(
                state_dict,
                prefix,
                local_metadata,
                strict,
                missing_keys,
                unexpected_keys,
                error_msgs,
            )
        finally:
            if held:
                self._parameters.clear()
                self._parameters.update(saved)
        if held:
            unexpected_keys[first_unexpected:] = [
                k for k in unexpected_keys[first_unexpected:] if k[len(prefix) :] not in held
            ]
        for n, (p, st) in held.items():
            key = prefix + n
            value = state_dict[key]
            if n in same:
                continue
            if not isinstance(value, torch.Tensor):
                error_msgs.append(
                    f'While copying the parameter named "{key}", expected '
                    f"torch.Tensor or Tensor-like object from checkpoint but "
                    f"received {type(value)}"
                )
                continue
            if tuple(value.shape) != tuple(p.shape):
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape "
                    f"{tuple(value.shape)} from checkpoint, the shape in current "
                    f"model is {tuple(p.shape)}."
                )
                continue
            if is_dtensor(p):
                # The rank's shard of the loaded value: a DTensor laid out as the weight.
                if (
                    not is_dtensor(value)
                    or value.placements != p.placements
                    or value.device_mesh != p.device_mesh
                ):
                    error_msgs.append(
                        f"zrw: {key} is a released DTensor weight of placements "
                        f"{p.placements}; load a state dict of DTensors with the same "
                        f"placements, or call zrw.cache.restore_all('master') first, got "
                        f"{type(value).__name__}"
                        f"{' ' + str(value.placements) if is_dtensor(value) else ''}"
                    )
                    continue
                value, p = value.to_local(), local_tensor(p)
            master = cache.master_of(p)
            with torch.no_grad():
                if st is cache.CacheState.RELEASED_FOR_GOOD:
                    # A frozen weight released for good: restored with these values (its entry
                    # goes; its next use quantizes and releases them again); a master it has
                    # takes them too, by the rule of truth.
                    cache.restore(p, "master", source=value.detach())
                    if master is not None:
                        cache.take_into_master(master, value.detach().to(p.dtype))
                elif master is None:
                    cache.assign_weights([p], [value.detach()])  # restored with these values
                else:
                    # The master takes the weight's new value as the weight would hold it, by
                    # the rule of truth: values equal to master.to(p.dtype) leave it alone.
                    if cache.take_into_master(master, value.detach().to(p.dtype)):
                        cache.assign_weights([p], [master], keep_released=True)
        for (n, p), st in zip(params, states):
            if n in held or prefix + n not in state_dict:
                continue
            # Its FP8 copy is stale; its master (if any) takes the loaded value at its
            # optimizer's next step (MasterWeights follows every write to a parameter).
            cache.cache_invalidate(local_tensor(p))


def _is_own_value(value, p: Tensor) -> bool:
    """Whether `value` is the Parameter `p` itself or a view of exactly its bytes (what
    `state_dict(keep_vars=True)` gave, detached): p's value, whatever p holds."""
    if value is p:
        return True
    if not isinstance(value, Tensor) or is_dtensor(value) != is_dtensor(p):
        return False
    a, b = local_tensor(value), local_tensor(p)
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
        and a.untyped_storage()._cdata == b.untyped_storage()._cdata
    )


def restamp_names(module: nn.Module, names: dict) -> None:
    """Set each named parameter's zrw name (zrw.cache.set_weight_name), where both exist."""
    for pname, name in names.items():
        param = module._parameters.get(pname)
        if param is not None and name is not None:
            cache.set_weight_name(param, name)
