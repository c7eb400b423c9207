"""The optimizer boundary of zero-redundancy weights (docs/design.md §5).

`MasterWeights(optimizer_cls, params, **kw)` is a torch.optim.Optimizer with FP32 masters (the
scheme of Megatron's mixed-precision optimizer): it steps any plain torch optimizer on the
masters and writes every master back into its parameter. By default (keep_released=True, the
BF16-free step) a released weight stays released through the step: its FP8 copy is dropped
before the inner step, and its next use quantizes straight from the master, so no BF16 weight
storage is allocated during training. With keep_released=False (the seed's design) the
write-back restores a released weight from its master, filling its bytes before the release
poison is cleared. Either way a step needs no restore before it and never exposes
uninitialized memory. Its param groups carry the hyper-parameters (LR schedulers, manual
changes and `add_param_group` work as with any optimizer).

`attach(optimizer)` installs the boundary on any optimizer: before `step()` the boundary
callbacks run (zrw.fsdp drops its shard caches there) and, for an optimizer that steps the
parameters themselves, exactly the parameters it owns are restored with `fill`; a closure
passed to `step()` runs under zrw.no_release(); after `step()`, `next_step()`.

Every optimizer in the process is guarded: one that would step a released weight without a
zrw boundary raises before it touches its state.
"""

from __future__ import annotations

import copy
import inspect
import multiprocessing.context
import sys
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import cache
from ._dtensor import local_tensor, wrap_like
from .record import (
    find_optimizer_record,
    find_record,
    forget_optimizer,
    optimizer_record,
    record_of,
)
from .state_dict import keep_for_spawn, released_value

# The boundary's callbacks live in zrw.cache (zrw.fsdp registers there without importing this
# module); this is the public name.
register_boundary_callback = cache.register_boundary_callback


def _locals(ts) -> List[torch.Tensor]:
    """Each tensor's local shard (zrw._dtensor.local_tensor): what the cache works on."""
    return [local_tensor(t) for t in ts]


def _params_of(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _as_group_list(params: Any) -> List[Dict[str, Any]]:
    """`params` as torch.optim.Optimizer accepts them, as a list of group dicts."""
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "MasterWeights: params must be an iterable of tensors or of param-group "
            f"dicts, got a single {type(params).__name__}"
        )
    if isinstance(params, (str, bytes, dict)) or not isinstance(params, Iterable):
        raise TypeError(
            "MasterWeights: params must be an iterable of tensors or of param-group "
            f"dicts (e.g. model.parameters()), got {type(params).__name__}"
        )
    groups = list(params)
    if not groups:
        raise ValueError("MasterWeights: got an empty parameter list")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    out = []
    for gi, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g:
            raise TypeError(
                f"MasterWeights: param group {gi} must be a dict with 'params' (as "
                f"group 0 is), got {type(g).__name__}"
                + (f" with keys {sorted(map(str, g))}" if isinstance(g, dict) else "")
            )
        g = dict(g)
        ps = g["params"]
        if not isinstance(ps, torch.Tensor) and (
            isinstance(ps, (str, bytes, dict)) or not isinstance(ps, Iterable)
        ):
            raise TypeError(
                f"MasterWeights: param group {gi}'s 'params' must be a tensor or an "
                f"iterable of tensors, got {type(ps).__name__}"
            )
        g["params"] = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        for pi, p in enumerate(g["params"]):
            if not isinstance(p, torch.Tensor):
                where = (
                    f"params[{pi}]" if len(groups) == 1 else f"param_groups[{gi}]['params'][{pi}]"
                )
                raise TypeError(f"MasterWeights: {where} must be a tensor, got {type(p).__name__}")
        out.append(g)
    _refuse_duplicates(out)
    return out


def _refuse_duplicates(groups: List[Dict[str, Any]], seen: Optional[Dict[int, str]] = None) -> None:
    """A parameter listed twice would get two FP32 masters, and the one written back last
    would win: refused (torch warns within a group and refuses across groups)."""
    seen = {} if seen is None else dict(seen)
    for gi, g in enumerate(groups):
        for pi, p in enumerate(g["params"]):
            where = f"param_groups[{gi}]['params'][{pi}]"
            if id(p) in seen:
                raise ValueError(
                    f"MasterWeights: {where} (shape {tuple(p.shape)}) is the same parameter as "
                    f"{seen[id(p)]}: each parameter must be listed once (one FP32 master per "
                    "parameter); pass model.parameters() or de-duplicate the list"
                )
            seen[id(p)] = where


def _hyper(group: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _device_kinds(kind: str) -> Optional[List[str]]:
    """The device types on which torch's optimizers run with capturable=True / fused=True
    (torch's own lists; None where this torch has none to ask)."""
    try:
        if kind == "capturable":
            from torch.optim.optimizer import _get_capturable_supported_devices

            return list(_get_capturable_supported_devices())
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return list(_get_fused_kernels_supported_devices())
    except ImportError:  # pragma: no cover - a torch without the private helpers
        return None


def _refuse_inner(inner: torch.optim.Optimizer, start: int = 0) -> None:
    """The inner optimizers whose step cannot compose with FP32 masters on their device are
    refused here, at construction (or add_param_group), by name: their own step would fail at
    the first step, or do something else than asked, silently (docs/design.md §5).

    - torchao's low-bit AdamW with bf16_stochastic_round=True: it rounds BF16 *parameters*
      stochastically; the inner optimizer here steps FP32 masters, where torchao skips it, and
      the write-back rounds each master to the nearest BF16 (the release-off run's bits). The
      flag would be a silent no-op.
    - capturable=True / fused=True on a device torch has no such kernel for (capturable is
      CUDA/XPU/HPU/XLA only: on CPU torch's step asserts at the first step)."""
    name = f"{type(inner).__module__}.{type(inner).__qualname__}"
    if getattr(inner, "bf16_stochastic_round", False) is True:
        raise ValueError(
            f"MasterWeights: {name}(bf16_stochastic_round=True) rounds BF16 parameters "
            "stochastically, but here it steps the FP32 masters (where torchao skips the "
            "rounding) and each BF16 weight is the round-to-nearest of its master: the flag "
            "would do nothing. Pass bf16_stochastic_round=False (the masters keep the "
            "precision the rounding was meant to recover)"
        )
    for gi in range(start, len(inner.param_groups)):
        group = inner.param_groups[gi]
        devices = sorted({m.device.type for m in group["params"]})
        for kind in ("capturable", "fused"):
            if group.get(kind) is not True:
                continue
            supported = _device_kinds(kind)
            bad = [d for d in devices if supported is not None and d not in supported]
            if bad:
                cpu_hint = (
                    " (fused=True runs on CPU)" if kind == "capturable" and bad == ["cpu"] else ""
                )
                raise ValueError(
                    f"MasterWeights: {name}({kind}=True) in param group {gi} needs its "
                    f"parameters on {supported}, but the FP32 masters are on {bad} (their "
                    f"parameters' device): torch's step would fail at the first step. Pass "
                    f"{kind}=False{cpu_hint}"
                )


class MasterWeights(torch.optim.Optimizer):
    """A torch optimizer over (BF16) parameters that steps FP32 masters of them.

    `params` are the model's parameters or param groups, as for any optimizer; `optimizer_cls`
    and `kwargs` build the inner optimizer (`self.inner`) over the FP32 masters
    (`self.masters`, one list per group). Each step converts the gradients (`p.grad`, or
    `p.main_grad` when a layer accumulates one in FP32) into the masters' FP32 gradients,
    freeing each BF16 `p.grad` as soon as it is converted (so the two never coexist in full:
    after `step()` the parameters' `.grad` are None, as after `zero_grad()`), steps the inner
    optimizer, and writes every master back into its parameter — also those that got no
    gradient (an MoE expert no token chose), so every weight holds bf16 of its master.

    keep_released=True (the default; zrw.cache.assign_weights(..., keep_released=True)): a
    released weight stays released. Its FP8 copy is dropped before the inner step (the master
    is the copy), and its next use quantizes straight from the master with one fused op that
    rounds to the weight's dtype first: the same bytes as the BF16 weight would give, so
    training is bit for bit the release-off run, with no BF16 weight storage allocated after
    the first step. A direct read of such a weight between steps raises; `model.state_dict()`
    (zrw layers) materializes it from the master, `model.load_state_dict()` writes the masters,
    `zrw.cache.restore_all("master")` or `zrw.optim.detach(opt)` bring the BF16 weights back.
    keep_released=False: the write-back restores each released weight from its master (the
    seed's design: BF16 weights are readable between steps, at the cost of holding them
    through the optimizer step). `zrw.optim.attach` adds `next_step` and the boundary
    callbacks in both modes.

    The param groups carry the inner optimizer's hyper-parameters and are the ones to change:
    LR schedulers, manual `param_groups[i]["lr"] = ...` and `add_param_group` reach the inner
    optimizer at the next step. `step(closure)` works with every inner optimizer, LBFGS
    included (the closure sees the parameters written from the masters it is evaluated at).
    `state_dict`/`load_state_dict` hold the masters and the inner state; a load that fails
    changes nothing. Masters are registered with zrw so that `zrw.cache.restore(w, "master")`
    restores a released weight exactly mid-step.
    """

    def __init__(
        self,
        optimizer_cls: Callable[..., torch.optim.Optimizer],
        params: Iterable,
        *,
        keep_released: bool = True,
        max_grad_norm: Optional[float] = None,
        **kwargs: Any,
    ):
        if max_grad_norm is not None and (
            isinstance(max_grad_norm, bool)
            or not isinstance(max_grad_norm, (int, float))
            or not max_grad_norm > 0
        ):
            raise ValueError(
                f"MasterWeights: max_grad_norm must be a positive number or None, "
                f"got {max_grad_norm!r}"
            )
        if isinstance(optimizer_cls, torch.optim.Optimizer):
            raise TypeError(
                f"MasterWeights: optimizer_cls must be a torch.optim.Optimizer "
                f"subclass (it is built over the FP32 masters), got an instance of "
                f"{type(optimizer_cls).__name__}: pass the class and its arguments"
            )
        if isinstance(optimizer_cls, type) and not issubclass(optimizer_cls, torch.optim.Optimizer):
            raise TypeError(
                f"MasterWeights: optimizer_cls must be a torch.optim.Optimizer "
                f"subclass (or a callable that returns an optimizer), got the class "
                f"{optimizer_cls.__module__}.{optimizer_cls.__qualname__}"
            )
        if not callable(optimizer_cls):
            raise TypeError(
                f"MasterWeights: optimizer_cls must be a torch.optim.Optimizer "
                f"subclass (or a callable that returns an optimizer), got "
                f"{type(optimizer_cls).__name__} {optimizer_cls!r}"
            )
        if not isinstance(keep_released, bool):
            raise TypeError(
                f"MasterWeights: keep_released must be a bool, got {type(keep_released).__name__}"
            )
        groups = _as_group_list(params)
        self.optimizer_cls = optimizer_cls
        self.keep_released = keep_released
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.last_grad_norm: Optional[float] = None  # before clipping, of the last step
        self.masters: List[List[torch.Tensor]] = []
        self._ready = False
        self._keep_grads = False  # zero_grad(set_to_none=False) seen: keep the BF16 grads
        self._freed: List[Any] = []  # (param, master) whose grad this step freed
        self._freed_last: List[Any] = []  # ... and the last successful one
        inner_groups = []
        for g in groups:
            masters = self._make_masters(g["params"])
            inner_groups.append({**_hyper(g), "params": masters})
        self.inner = optimizer_cls(inner_groups, **kwargs)
        if not isinstance(self.inner, torch.optim.Optimizer):
            raise TypeError(
                f"MasterWeights: optimizer_cls {optimizer_cls!r} must return a "
                f"torch.optim.Optimizer, got {type(self.inner).__name__}"
            )
        _refuse_inner(self.inner)
        # The outer groups take the inner optimizer's defaults (lr, betas, ...), so that what a
        # scheduler reads and writes is there; their params are the model's.
        super().__init__(groups, dict(self.inner.defaults))
        for masters in (ig["params"] for ig in self.inner.param_groups):
            self.masters.append(masters)
        self._pull_hyperparameters()
        self._register_masters()
        self._record_written()
        self._ready = True

    @staticmethod
    def _make_masters(params: List[torch.Tensor]) -> List[torch.Tensor]:
        """An FP32 copy of each parameter's value. A released parameter's value is its current
        master's (another optimizer with masters owns it too): copied from there, exactly;
        one released for good without a master has no exact value left, and is refused."""
        masters = []
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(
                    f"MasterWeights: params[{i}] must be a tensor, got {type(p).__name__}"
                )
            if not p.is_floating_point():
                raise TypeError(
                    f"MasterWeights: parameters must be floating point, got "
                    f"{p.dtype} (params[{i}], shape {tuple(p.shape)})"
                )
            local = local_tensor(p)
            if cache.cache_state(local).released:
                m = cache.master_of(local)
                if m is None:
                    raise RuntimeError(
                        f"MasterWeights: params[{i}] ('{cache.weight_name(local)}', shape "
                        f"{tuple(p.shape)}) is released and has no FP32 master (a frozen weight "
                        "released for good keeps only its MXFP8 copy): its exact value is gone. "
                        "Build the optimizer before the weight's first training forward, or "
                        "call zrw.cache.restore_frozen(model) first (lossy)"
                    )
                with torch.no_grad():  # the weight holds m.to(p.dtype): that, in FP32
                    value = m.detach().to(p.dtype).to(torch.float32)
                masters.append(wrap_like(p, value))
                continue
            masters.append(p.detach().to(torch.float32, copy=True))
        return masters

    def _register_masters(self, start: int = 0) -> None:
        for group, masters in zip(self.param_groups[start:], self.masters[start:]):
            for p, m in zip(group["params"], masters):
                cache.register_master(local_tensor(p), local_tensor(m), self)

    def _pull_hyperparameters(self) -> None:
        """inner -> outer: the hyper-parameters the inner optimizer filled in."""
        for og, ig in zip(self.param_groups, self.inner.param_groups):
            for k, v in _hyper(ig).items():
                og[k] = v

    def _push_hyperparameters(self) -> None:
        """outer -> inner: what a scheduler or the user changed since the last step. An inner
        optimizer that keeps a hyper-parameter as a tensor (torchao's low-bit AdamW keeps `lr`
        as one, and refuses a number there) gets a number written into its tensor; the outer
        group holds that same tensor again (schedulers fill it in place)."""
        for og, ig in zip(self.param_groups, self.inner.param_groups):
            for k, v in _hyper(og).items():
                cur = ig.get(k)
                if (
                    isinstance(cur, torch.Tensor)
                    and not isinstance(v, torch.Tensor)
                    and isinstance(v, (int, float))
                    and not isinstance(v, bool)
                    and cur.numel() == 1
                ):
                    cur.fill_(v)
                    og[k] = cur
                else:
                    ig[k] = v

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if self._ready and isinstance(param_group, dict) and "params" in param_group:
            ps = param_group["params"]
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
            param_group = {**param_group, "params": ps}
            # Within the group (torch refuses a parameter of another group itself).
            _refuse_duplicates([param_group])
        super().add_param_group(param_group)  # validates, fills the defaults
        if not self._ready:
            return  # __init__: the inner optimizer already has this group
        group = self.param_groups[-1]
        try:
            masters = self._make_masters(group["params"])
            self.inner.add_param_group({**_hyper(group), "params": masters})
        except Exception:
            self.param_groups.pop()
            raise
        try:
            _refuse_inner(self.inner, len(self.inner.param_groups) - 1)
        except Exception:
            self.inner.param_groups.pop()
            self.param_groups.pop()
            raise
        self.masters.append(self.inner.param_groups[-1]["params"])
        self._pull_hyperparameters()
        self._register_masters(len(self.param_groups) - 1)
        self._record_written()

    # -- masters follow every write to the parameters -------------------------------------
    #
    # Between two write-backs a parameter may be written by anything: model.load_state_dict
    # (strict or not), model.apply(init_fn), an in-place write under no_grad or through
    # `.data`, a dtype cast (`p.data = p.float()`), or another optimizer that steps it too.
    # Its master must then take the new value, as the optimizer of a release-off run or of
    # plain PyTorch would step it, by the rule of truth (zrw.cache.take_into_master): an
    # element reaches the master only where its bits differ from master.to(p.dtype), so that
    # loading the values a write-back wrote never rounds a master. A released weight cannot be
    # written (its storage is poisoned): its value is its current master's (its record's
    # `current`, the one written back last), the layers update that master when they load into
    # it or restore it, and zrw.cache syncs a written weight before its first use releases it.

    def _pairs(self):
        for group, masters in zip(self.param_groups, self.masters):
            for p, m in zip(group["params"], masters):
                yield p, m

    def _record_written(self, digests: Optional[List[Optional[int]]] = None) -> None:
        """After a write-back: each parameter holds bf16 of this optimizer's master, and its
        record says so (what it looks like then, and which master is its value). `digests`:
        those the write-back took as it wrote (cache.write_back), one per parameter in order;
        the others are read now."""
        pairs = [(local_tensor(p), local_tensor(m)) for p, m in self._pairs()]
        states = cache.cache_states([p for p, _ in pairs]) if pairs else []
        if digests is None or len(digests) != len(pairs):
            digests = [None] * len(pairs)
        for (local, m), st, digest in zip(pairs, states, digests):
            rec = record_of(local)
            rec.written = cache.weight_signature(local)
            if st.released:
                rec.digest = None
            else:
                rec.digest = digest if digest is not None else cache.weight_digest(local)
            rec.current = weakref.ref(m)
            rec.hold = False  # its write was read: it may be released again

    def _sync_masters(self) -> int:
        """Each master takes what its parameter holds now, by the rule of truth. Returns the
        number of masters changed."""
        pairs = [(local_tensor(p), local_tensor(m)) for p, m in self._pairs()]
        if not pairs:
            return 0
        states = cache.cache_states([p for p, _ in pairs])
        n = 0
        with torch.no_grad():
            for (p, m), st in zip(pairs, states):
                rec = find_record(p)
                if st.released:
                    current = None if rec is None else rec.master()
                    if current is not None and current is not m:
                        # Another optimizer wrote it back last: its value is that master's.
                        n += cache.take_into_master(m, current.to(p.dtype))
                    continue
                if cache.unchanged_since_write_back(p, rec, m):
                    continue
                if p.shape != m.shape:
                    raise RuntimeError(
                        f"MasterWeights: parameter '{cache.weight_name(p) or tuple(m.shape)}' "
                        f"changed shape from {tuple(m.shape)} to {tuple(p.shape)} after the "
                        "optimizer was built; build a new optimizer for the new parameters"
                    )
                n += cache.take_into_master(m, p)
        return n

    def _grads_to_masters(self) -> None:
        """FP32 gradients of the masters. Each BF16 gradient is freed once converted (so the
        BF16 gradients and their FP32 copies never coexist in full), unless the gradients are
        kept between steps (zero_grad(set_to_none=False), as torch keeps them) or clipped
        (max_grad_norm: a step that fails after clipping gives back the unclipped gradients,
        so they stay until the step succeeded); a failed step gives them back
        (_return_grads). A `main_grad` (FP32, accumulated by the layers) is read as it is, and
        cleared once the step succeeded."""
        self._freed = []
        self._aliased = []  # masters whose .grad is the user's own tensor (main_grad, fp32 grad)
        keep = self._keep_grads or self.max_grad_norm is not None
        for p, m in self._pairs():
            g = getattr(p, "main_grad", None)
            if g is None:
                g = p.grad
                if g is None:
                    m.grad = None
                    continue
                m.grad = g.to(torch.float32)
                if not keep:
                    p.grad = None
                    self._freed.append((p, m))
            else:
                m.grad = g.to(torch.float32)
            if m.grad is g:
                self._aliased.append(m)
            del g

    def _clip(self) -> None:
        """max_grad_norm: clip the FP32 gradients of the masters together (the norm over every
        parameter's gradient, main_grad or .grad), with the numbers of
        torch.nn.utils.clip_grad_norm_; the way to clip with main_grad=True, which gradient
        clipping on the model's `.grad` cannot see (Megatron clips in its optimizer too). A
        gradient that is the user's own tensor (main_grad, an fp32 `.grad`) is not scaled in
        place: the master gets a scaled copy, so that a failed step leaves it as it was. The
        norm before clipping is `last_grad_norm`."""
        masters = [m for ms in self.masters for m in ms if m.grad is not None]
        if self.max_grad_norm is None or not masters:
            return
        norm = torch.nn.utils.get_total_norm([m.grad for m in masters], 2.0)
        coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
        aliased = {id(m) for m in self._aliased}
        for m in masters:
            c = coef.to(m.grad.device)
            if id(m) in aliased:
                m.grad = m.grad * c
            else:
                m.grad.mul_(c)
        self.last_grad_norm = float(norm)

    def _return_grads(self) -> None:
        """After a failed step: the parameters get back the gradients converted for it (exact:
        fp32 holds every bf16/fp16 value; clipped gradients were never freed), so that a
        retried step() steps what this one would have."""
        for p, m in getattr(self, "_freed", ()):
            if p.grad is None and m.grad is not None:
                p.grad = m.grad.to(p.dtype)
        self._freed = []

    def _release_kept_grads(self) -> None:
        """After a successful clipped step: the BF16 gradients kept for a retry go, as an
        unclipped step frees them."""
        if self.max_grad_norm is None or self._keep_grads:
            return
        for p, m in self._pairs():
            if getattr(p, "main_grad", None) is None and p.grad is not None:
                p.grad = None
                self._freed.append((p, m))

    def _drop_stale_copies(self) -> None:
        """Before the inner step the FP8 copies are dead weight (the step changes every
        parameter): those of parameters that kept their BF16 storage go now; with
        keep_released, those of released parameters too (their masters hold their values,
        exactly: every parameter is bf16 of its master between steps). Without keep_released,
        released parameters keep theirs until the write-back restores them."""
        # A DTensor parameter (tensor / expert parallelism): its local shard, and the local
        # shard of its DTensor master.
        params = [local_tensor(p) for g in self.param_groups for p in g["params"]]
        masters = [local_tensor(m) for ms in self.masters for m in ms]
        released_p, released_m = [], []
        for p, m, state in zip(params, masters, cache.cache_states(params)):
            if state is cache.CacheState.CACHED:
                cache.cache_invalidate(p)
            elif state is cache.CacheState.RELEASED and self.keep_released:
                released_p.append(p)
                released_m.append(m)
        if released_p:
            cache.assign_weights(released_p, released_m, keep_released=True)

    def _write_back(self) -> None:
        """Every parameter gets bf16(master): released ones stay released with their master
        (keep_released) or are restored from it."""
        params = [p for g in self.param_groups for p in g["params"]]
        masters = [m for ms in self.masters for m in ms]
        # A DTensor parameter (tensor / expert parallelism): its local shard gets the local
        # shard of its DTensor master.
        digests = None
        try:
            digests = cache.write_back(
                [local_tensor(p) for p in params],
                [local_tensor(m) for m in masters],
                self.keep_released,
            )
        finally:
            self._record_written(digests)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        self._push_hyperparameters()
        self._sync_masters()
        self._drop_stale_copies()
        ok = False
        try:
            if closure is None:
                self._grads_to_masters()
                self._clip()
                loss = self.inner.step()
            else:
                evaluations = 0

                def inner_closure():
                    nonlocal evaluations
                    if evaluations:  # the inner optimizer moved the masters since the last call
                        self._write_back()
                    evaluations += 1
                    with torch.enable_grad():
                        loss = closure()
                    self._grads_to_masters()
                    self._clip()
                    return loss

                loss = self.inner.step(inner_closure)
            ok = True
            return loss
        finally:
            if not ok:
                # The gradients go back to the parameters, so that step() can be retried.
                self._return_grads()
            else:
                self._release_kept_grads()
                self._freed_last, self._freed = self._freed, []
                for p, _ in self._pairs():
                    if getattr(p, "main_grad", None) is not None:
                        p.main_grad = None  # consumed, as .grad is
            # Also after an exception: every parameter holds bf16 of its (possibly partly
            # stepped) master, never uninitialized memory.
            self._write_back()
            for masters in self.masters:
                for m in masters:
                    m.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch.optim.Optimizer.zero_grad, also for `main_grad`. With set_to_none=False the
        gradients stay allocated between steps, as torch keeps them: step() no longer frees
        the BF16 gradients it converted, and those it freed before come back as zeros (so a
        parameter that gets no gradient in the next backward is stepped with a zero gradient,
        as torch's optimizer steps it)."""
        if not isinstance(set_to_none, bool):
            raise TypeError(
                f"MasterWeights.zero_grad: set_to_none must be a bool, got "
                f"{type(set_to_none).__name__}"
            )
        for group in self.param_groups:
            for p in group["params"]:
                if getattr(p, "main_grad", None) is not None:
                    if set_to_none:
                        p.main_grad = None
                    else:
                        p.main_grad.zero_()
        if not set_to_none:
            self._keep_grads = True
            for p, _ in self._freed_last:
                if p.grad is None:
                    p.grad = torch.zeros_like(p, memory_format=torch.preserve_format)
        self._freed_last = []
        super().zero_grad(set_to_none)
        self.inner.zero_grad(set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        """The masters and the inner optimizer's state. The hooks registered with
        `register_state_dict_pre_hook` / `register_state_dict_post_hook` run as torch's
        optimizers run them (a post hook may return a replacement dict)."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        self._push_hyperparameters()
        self._sync_masters()  # a model loaded since the last step: its values are the masters
        state_dict = {
            "inner": self.inner.state_dict(),
            "masters": [[m.clone() for m in ms] for ms in self.masters],
        }
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    # -- copies: pickling and copy.deepcopy ----------------------------------------------------
    #
    # torch's optimizers pickle only defaults, state and param groups; a MasterWeights is also
    # its inner optimizer and its masters, and its boundary (zrw.optim.attach) is part of what
    # it is: a copy has all of them, its masters registered for its own parameters, and the
    # boundary installed afresh. A released parameter has no bytes to copy: the copy gets a
    # fresh Parameter holding its exact value (bf16 of its master), the same one the model's
    # layers give it when both are deep-copied together.

    def __getstate__(self) -> Dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_optimizer_")}
        rec = find_optimizer_record(self)
        state["_boundary"] = None if rec is None or rec.hooks is None else (rec.fill,)
        popen = multiprocessing.context.get_spawning_popen()
        groups = []
        for g in self.param_groups:
            params = []
            for p in g["params"]:
                fresh = released_value(p)
                if fresh is not None and popen is not None:
                    keep_for_spawn(popen, fresh)
                params.append(p if fresh is None else fresh)
            groups.append({**g, "params": params})
        state["param_groups"] = groups
        return state

    def __deepcopy__(self, memo):
        for g in self.param_groups:
            for p in g["params"]:
                if id(p) not in memo:
                    fresh = released_value(p)
                    if fresh is not None:
                        memo[id(p)] = fresh
                        memo.setdefault(id(memo), []).append(p)
        cls = type(self)
        new = cls.__new__(cls)
        memo[id(self)] = new
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_optimizer_")}
        rec = find_optimizer_record(self)
        state["_boundary"] = None if rec is None or rec.hooks is None else (rec.fill,)
        new.__setstate__(copy.deepcopy(state, memo))
        return new

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        boundary = state.pop("_boundary", None)
        super().__setstate__(state)
        if "inner" not in state:
            return  # (a torch-style state without the masters: nothing of zrw's to set up)
        self._register_masters()
        # The copied parameters hold what the originals held, which may include a write their
        # masters have not taken yet: the copy's first check compares them exactly.
        for p, m in self._pairs():
            rec = record_of(local_tensor(p))
            rec.current = weakref.ref(local_tensor(m))
            rec.written = rec.digest = None
        if boundary is not None:
            attach(self, boundary[0])

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads masters, inner state and hyper-parameters together: everything is checked
        before anything changes, so a load that fails leaves the optimizer as it was."""
        op = "MasterWeights.load_state_dict"
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()  # shallow, as torch's optimizers take it
            for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
                result = pre_hook(self, state_dict)
                if result is not None:
                    state_dict = result
        if not isinstance(state_dict, dict) or not {"inner", "masters"} <= set(state_dict):
            raise ValueError(
                f"{op}: expected a dict with 'inner' and 'masters' (from "
                f"MasterWeights.state_dict), got "
                + (
                    f"{sorted(state_dict)}"
                    if isinstance(state_dict, dict)
                    else type(state_dict).__name__
                )
            )
        saved, inner_sd = state_dict["masters"], state_dict["inner"]
        ours = [len(ms) for ms in self.masters]
        if [len(ms) for ms in saved] != ours:
            raise ValueError(
                f"{op}: masters per group must be {ours}, got {[len(ms) for ms in saved]}"
            )
        for gi, (ms, ss) in enumerate(zip(self.masters, saved)):
            for pi, (m, s) in enumerate(zip(ms, ss)):
                if not isinstance(s, torch.Tensor) or m.shape != s.shape:
                    found = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
                    raise ValueError(
                        f"{op}: master {pi} of group {gi} has shape "
                        f"{tuple(m.shape)}, got a saved tensor of shape {found}"
                    )
        inner_groups = inner_sd.get("param_groups") if isinstance(inner_sd, dict) else None
        if (
            not isinstance(inner_groups, list)
            or [len(g.get("params", ())) for g in inner_groups] != ours
        ):
            raise ValueError(
                f"{op}: the inner optimizer's state must have {ours} parameters "
                "per group, like the masters"
            )
        # torch's load_state_dict checks the same structure before it changes anything, then
        # swaps its state in at once; the masters are copied only after it succeeded.
        self.inner.load_state_dict(inner_sd)
        with torch.no_grad():
            for ms, ss in zip(self.masters, saved):
                for m, s in zip(ms, ss):
                    m.copy_(s)
        self._pull_hyperparameters()
        # The parameters are bf16 of their masters again (released ones take the new masters'
        # values at their next use; their old FP8 copies go).
        self._write_back()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


# zrw.optim.AdamW(state_dtype=...): the AdamW that steps the masters, by the dtype of its moments.
STATE_DTYPES: Dict[Optional[str], str] = {
    None: "torch.optim.AdamW",
    "fp32": "torch.optim.AdamW",
    "int8": "torchao.optim.AdamW8bit",
    "fp8": "torchao.optim.AdamWFp8",
    "int4": "torchao.optim.AdamW4bit",
}


def adamw_class(state_dtype: Optional[str], kwargs: Optional[Dict[str, Any]] = None) -> type:
    """The optimizer class zrw.optim.AdamW(state_dtype=...) steps its masters with
    (STATE_DTYPES); `kwargs`, the extra keyword arguments meant for it, are checked against its
    signature so that one it does not take is refused by name (torch's foreach / fused /
    capturable with a torchao class, torchao's block_size with torch's)."""
    op = "zrw.optim.AdamW"
    if state_dtype is not None and not isinstance(state_dtype, str):
        raise TypeError(
            f"{op}: state_dtype must be None or a str, one of {list(STATE_DTYPES)}, got "
            f"{type(state_dtype).__name__}"
        )
    if state_dtype not in STATE_DTYPES:
        hint = (
            " (torch's AdamW keeps its moments in the masters' dtype, FP32, and torchao has no "
            "BF16-moment AdamW: 'fp8' or 'int8' keep them in 1 byte)"
            if state_dtype in ("bf16", "bfloat16", "fp16", "float16")
            else ""
        )
        raise ValueError(
            f"{op}: state_dtype must be one of {list(STATE_DTYPES)}, got {state_dtype!r}{hint}"
        )
    path = STATE_DTYPES[state_dtype]
    if path == "torch.optim.AdamW":
        cls = torch.optim.AdamW
    else:
        try:
            import torchao.optim as ao  # optional: only the low-bit states need it
        except ImportError as e:
            raise ImportError(
                f"{op}: state_dtype={state_dtype!r} steps the masters with {path}, and "
                f"torchao is not installed ({e}); install torchao, or pass state_dtype=None"
            ) from e
        cls = getattr(ao, path.rsplit(".", 1)[1])
    if kwargs:
        takes = inspect.signature(cls).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in takes.values()):
            extra = sorted(k for k in kwargs if k not in takes)
            if extra:
                own = [k for k, p in takes.items() if p.kind is p.KEYWORD_ONLY]
                raise TypeError(
                    f"{op}: {', '.join(f'{k}=' for k in extra)} is not an argument of {path} "
                    f"(state_dtype={state_dtype!r}); its own keyword arguments: {own}"
                )
    return cls


class AdamW(MasterWeights):
    """torch.optim.AdamW on FP32 masters with the zrw boundary attached on construction: the
    ready optimizer of zero-redundancy weights, with the BF16-free step (keep_released=True).

    Built as torch's AdamW is, `zrw.optim.AdamW(params, lr=..., betas=..., weight_decay=...)`,
    so that the paths that build an optimizer from a class and its keyword arguments work:
    Hugging Face Trainer's `optimizer_cls_and_kwargs=(zrw.optim.AdamW, {"lr": ...})` (param
    groups with and without weight decay), `optimizers=(zrw.optim.AdamW(model.parameters()),
    None)`, accelerate's `prepare`. torch's defaults (lr 1e-3, weight_decay 1e-2).

    `state_dtype` picks the AdamW that steps the masters, and with it the bytes of its two
    moments per weight element (STATE_DTYPES): None or "fp32", torch.optim.AdamW (8 bytes);
    "int8", torchao.optim.AdamW8bit; "fp8", torchao.optim.AdamWFp8 (2 bytes and a 4-byte scale
    per block of 256); "int4", torchao.optim.AdamW4bit (1 byte, a scale per 128). The same
    update rule and defaults; torchao keeps the moments of a tensor with fewer than 4096
    elements, or one not a multiple of its block, in FP32. Further keyword arguments go to that
    class (torch's foreach / fused; torchao's block_size), and one it does not take is refused
    by name. It is `MasterWeights(cls, params, ...)` with the boundary attached: nothing else
    changes (docs/training.md, "Low-bit optimizer states")."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        keep_released: bool = True,
        max_grad_norm: Optional[float] = None,
        state_dtype: Optional[str] = None,
        **kwargs: Any,
    ):
        super().__init__(
            adamw_class(state_dtype, kwargs),
            params,
            keep_released=keep_released,
            max_grad_norm=max_grad_norm,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            **kwargs,
        )
        attach(self)


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
    masters = own_masters or isinstance(optimizer, MasterWeights)
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
        cache.run_boundary_callbacks(opt)
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
        if st is cache.CacheState.RELEASED and cache.master_of(p) is not None
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


def _main_grad_params(optimizer: "MasterWeights") -> List[torch.Tensor]:
    return [p for p in _params_of(optimizer) if getattr(p, "main_grad", None) is not None]


def _refuse_unclipped_main_grad(optimizer: "MasterWeights") -> None:
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
    if trainer is None:
        return
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
    Trainer that clips `.grad` is refused here too (_refuse_unclipped_main_grad)."""
    if isinstance(optimizer, MasterWeights):
        _refuse_unclipped_main_grad(optimizer)
        return
    fp32_only = [
        p
        for p in _params_of(optimizer)
        if p.grad is None and getattr(p, "main_grad", None) is not None
    ]
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
    params = [p for p in _params_of(optimizer) if p.grad is not None]
    if not params:
        return
    states = cache.cache_states(_locals(params))
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
