"""`MasterWeights`: a torch optimizer over BF16 parameters that steps FP32 masters of them
(docs/design.md §5, "The BF16-free step and the optimizer boundary"; the class docstring says
how). Every change to weight state goes through zrw.lifecycle's events.
"""

from __future__ import annotations

import copy
import multiprocessing.context
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch

from . import cache, lifecycle
from ._dtensor import local_tensor, wrap_like
from .boundary import attach
from .master_groups import (
    ParamState,
    as_group_list,
    hyper,
    refuse_duplicates,
    refuse_inner,
    resync,
)
from .record import find_optimizer_record, find_record
from .state_dict import keep_for_spawn, released_value


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

    # The optimizer boundary (zrw.boundary) restores nothing before its step: it writes its
    # masters back itself.
    zrw_keeps_masters = True

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
                f"zrw.optim.MasterWeights: max_grad_norm must be a positive number or None, "
                f"got {max_grad_norm!r}"
            )
        if isinstance(optimizer_cls, torch.optim.Optimizer):
            raise TypeError(
                f"zrw.optim.MasterWeights: optimizer_cls must be a torch.optim.Optimizer "
                f"subclass (it is built over the FP32 masters), got an instance of "
                f"{type(optimizer_cls).__name__}: pass the class and its arguments"
            )
        if isinstance(optimizer_cls, type) and not issubclass(optimizer_cls, torch.optim.Optimizer):
            raise TypeError(
                f"zrw.optim.MasterWeights: optimizer_cls must be a torch.optim.Optimizer "
                f"subclass (or a callable that returns an optimizer), got the class "
                f"{optimizer_cls.__module__}.{optimizer_cls.__qualname__}"
            )
        if not callable(optimizer_cls):
            raise TypeError(
                f"zrw.optim.MasterWeights: optimizer_cls must be a torch.optim.Optimizer "
                f"subclass (or a callable that returns an optimizer), got "
                f"{type(optimizer_cls).__name__} {optimizer_cls!r}"
            )
        if not isinstance(keep_released, bool):
            raise TypeError(
                "zrw.optim.MasterWeights: keep_released must be a bool, got "
                f"{type(keep_released).__name__}"
            )
        groups = as_group_list(params)
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
            inner_groups.append({**hyper(g), "params": masters})
        self.inner = optimizer_cls(inner_groups, **kwargs)
        if not isinstance(self.inner, torch.optim.Optimizer):
            raise TypeError(
                f"zrw.optim.MasterWeights: optimizer_cls {optimizer_cls!r} must return a "
                f"torch.optim.Optimizer, got {type(self.inner).__name__}"
            )
        refuse_inner(self.inner)
        # The outer groups take the inner optimizer's defaults (lr, betas, ...), so that what a
        # scheduler reads and writes is there; their params are the model's.
        super().__init__(groups, dict(self.inner.defaults))
        for masters in (ig["params"] for ig in self.inner.param_groups):
            self.masters.append(masters)
        self._paired = [list(g["params"]) for g in self.param_groups]  # what each master is of
        self.state = ParamState(self)
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
                    f"zrw.optim.MasterWeights: params[{i}] must be a tensor, got {type(p).__name__}"
                )
            if not p.is_floating_point():
                raise TypeError(
                    f"zrw.optim.MasterWeights: parameters must be floating point, got "
                    f"{p.dtype} (params[{i}], shape {tuple(p.shape)})"
                )
            local = local_tensor(p)
            if cache.cache_state(local).released:
                m = cache.master_of(local)
                if m is None:
                    raise RuntimeError(
                        f"zrw.optim.MasterWeights: params[{i}] ('{cache.weight_name(local)}', "
                        "shape "
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
            for k, v in hyper(ig).items():
                og[k] = v

    def _push_hyperparameters(self) -> None:
        """outer -> inner: what a scheduler or the user changed since the last step. An inner
        optimizer that keeps a hyper-parameter as a tensor (torchao's low-bit AdamW keeps `lr`
        as one, and refuses a number there) gets a number written into its tensor; the outer
        group holds that same tensor again (schedulers fill it in place)."""
        for og, ig in zip(self.param_groups, self.inner.param_groups):
            for k, v in hyper(og).items():
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
            refuse_duplicates([param_group])
        super().add_param_group(param_group)  # validates, fills the defaults
        if not self._ready:
            return  # __init__: the inner optimizer already has this group
        group = self.param_groups[-1]
        try:
            masters = self._make_masters(group["params"])
            self.inner.add_param_group({**hyper(group), "params": masters})
        except Exception:
            self.param_groups.pop()
            raise
        try:
            refuse_inner(self.inner, len(self.inner.param_groups) - 1)
        except Exception:
            self.inner.param_groups.pop()
            self.param_groups.pop()
            raise
        self.masters.append(self.inner.param_groups[-1]["params"])
        self._paired.append(list(group["params"]))
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
        """After a write-back: each parameter holds bf16 of this optimizer's master."""
        pairs = [(local_tensor(p), local_tensor(m)) for p, m in self._pairs()]
        lifecycle.written([p for p, _ in pairs], [m for _, m in pairs], digests)

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
                        "zrw.optim.MasterWeights: parameter "
                        f"'{cache.weight_name(p) or tuple(m.shape)}' "
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
        parameter): CACHED -> NONE; with keep_released RELEASED -> PENDING (the masters hold
        the values). Without keep_released, released parameters keep theirs until the
        write-back restores them. A DTensor parameter: its local shard and its master's."""
        params = [p for g in self.param_groups for p in g["params"]]
        lifecycle.drop_before_step(
            [local_tensor(p) for p in params],
            [local_tensor(m) for ms in self.masters for m in ms],
            self.keep_released,
            [p.grad is not None or getattr(p, "main_grad", None) is not None for p in params],
        )

    def _write_back(self) -> None:
        """Every parameter gets bf16(master): released ones stay released with their master
        (keep_released) or are restored from it (zrw.lifecycle.write_back)."""
        lifecycle.write_back(
            [local_tensor(p) for g in self.param_groups for p in g["params"]],
            [local_tensor(m) for ms in self.masters for m in ms],
            self.keep_released,
        )

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        resync(self)  # masters follow the param groups by identity (zrw.master_groups)
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
        resync(self)
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

    def _copied_state(self) -> Dict[str, Any]:
        """What a copy is made of: the pairing and the state view are rebuilt by the copy."""
        resync(self)
        skip = ("state", "_paired")
        state = {
            k: v
            for k, v in self.__dict__.items()
            if not k.startswith("_optimizer_") and k not in skip
        }
        rec = find_optimizer_record(self)
        state["_boundary"] = None if rec is None or rec.hooks is None else (rec.fill,)
        return state

    def __getstate__(self) -> Dict[str, Any]:
        state = self._copied_state()
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
        state = self._copied_state()
        cls = type(self)
        new = cls.__new__(cls)
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(state, memo))
        return new

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        boundary = state.pop("_boundary", None)
        super().__setstate__(state)
        if "inner" not in state:
            return  # (a torch-style state without the masters: nothing of zrw's to set up)
        self._paired = [list(g["params"]) for g in self.param_groups]
        self.state = ParamState(self)
        self._register_masters()
        # The copied parameters hold what the originals held, which may include a write their
        # masters have not taken yet: the copy's first check compares them exactly.
        pairs = [(local_tensor(p), local_tensor(m)) for p, m in self._pairs()]
        lifecycle.copied([p for p, _ in pairs], [m for _, m in pairs])
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
        resync(self)
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
