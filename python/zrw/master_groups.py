"""MasterWeights' param groups: what a group may hold, the inner optimizers that cannot step FP32
masters, and which master belongs to which parameter (docs/design.md §5).

Masters follow the parameters by identity, as torch's optimizer state follows its parameters:
a parameter replaced in, appended to or removed from `param_groups[i]["params"]` gets a fresh
master and fresh inner state, keeps its own, or gives them up, at the next step (`resync`), and
`MasterWeights.state` is a view of each parameter's inner state (`ParamState`), so that
`opt.state.pop(p)` and `opt.state[p] = {}` reset p's moments as they do in torch.
"""

from __future__ import annotations

import weakref
from collections.abc import MutableMapping
from typing import Any, Dict, Iterable, Iterator, List, Optional

import torch

from . import lifecycle
from ._dtensor import local_tensor


def as_group_list(params: Any) -> List[Dict[str, Any]]:
    """`params` as torch.optim.Optimizer accepts them, as a list of group dicts."""
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "zrw.optim.MasterWeights: params must be an iterable of tensors or of param-group "
            f"dicts, got a single {type(params).__name__}"
        )
    if isinstance(params, (str, bytes, dict)) or not isinstance(params, Iterable):
        raise TypeError(
            "zrw.optim.MasterWeights: params must be an iterable of tensors or of param-group "
            f"dicts (e.g. model.parameters()), got {type(params).__name__}"
        )
    groups = list(params)
    if not groups:
        raise ValueError("zrw.optim.MasterWeights: got an empty parameter list")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    out = []
    for gi, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g:
            raise TypeError(
                f"zrw.optim.MasterWeights: param group {gi} must be a dict with 'params' (as "
                f"group 0 is), got {type(g).__name__}"
                + (f" with keys {sorted(map(str, g))}" if isinstance(g, dict) else "")
            )
        g = dict(g)
        ps = g["params"]
        if not isinstance(ps, torch.Tensor) and (
            isinstance(ps, (str, bytes, dict)) or not isinstance(ps, Iterable)
        ):
            raise TypeError(
                f"zrw.optim.MasterWeights: param group {gi}'s 'params' must be a tensor or an "
                f"iterable of tensors, got {type(ps).__name__}"
            )
        g["params"] = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        for pi, p in enumerate(g["params"]):
            if not isinstance(p, torch.Tensor):
                where = (
                    f"params[{pi}]" if len(groups) == 1 else f"param_groups[{gi}]['params'][{pi}]"
                )
                raise TypeError(
                    f"zrw.optim.MasterWeights: {where} must be a tensor, got {type(p).__name__}"
                )
        out.append(g)
    refuse_duplicates(out)
    return out


def refuse_duplicates(groups: List[Dict[str, Any]], seen: Optional[Dict[int, str]] = None) -> None:
    """A parameter listed twice would get two FP32 masters, and the one written back last
    would win: refused (torch warns within a group and refuses across groups)."""
    seen = {} if seen is None else dict(seen)
    for gi, g in enumerate(groups):
        for pi, p in enumerate(g["params"]):
            where = f"param_groups[{gi}]['params'][{pi}]"
            if id(p) in seen:
                raise ValueError(
                    f"zrw.optim.MasterWeights: {where} (shape {tuple(p.shape)}) is the same "
                    f"parameter as "
                    f"{seen[id(p)]}: each parameter must be listed once (one FP32 master per "
                    "parameter); pass model.parameters() or de-duplicate the list"
                )
            seen[id(p)] = where


def hyper(group: Dict[str, Any]) -> Dict[str, Any]:
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


def refuse_inner(inner: torch.optim.Optimizer, start: int = 0) -> None:
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
            f"zrw.optim.MasterWeights: {name}(bf16_stochastic_round=True) rounds BF16 parameters "
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
                    f"zrw.optim.MasterWeights: {name}({kind}=True) in param group {gi} needs its "
                    f"parameters on {supported}, but the FP32 masters are on {bad} (their "
                    f"parameters' device): torch's step would fail at the first step. Pass "
                    f"{kind}=False{cpu_hint}"
                )


def resync(opt) -> bool:
    """Pair `opt`'s masters with its param groups' parameters by identity again: each
    parameter keeps its master and inner state; a new one gets a fresh master (its value,
    exactly) and fresh state; a removed one gives them up and is no longer owned. Everything
    is checked and every new master made before anything changes. Returns whether anything
    changed."""
    if len(opt.param_groups) != len(opt.masters):
        raise RuntimeError(
            f"zrw.optim.MasterWeights: param_groups must keep its {len(opt.masters)} "
            "group(s) (add one "
            f"with add_param_group), got {len(opt.param_groups)}"
        )
    plan = []
    for gi, (group, paired, masters) in enumerate(zip(opt.param_groups, opt._paired, opt.masters)):
        params = group["params"]
        if len(params) == len(paired) and all(a is b for a, b in zip(params, paired)):
            continue
        if not isinstance(params, list):
            raise TypeError(
                f"zrw.optim.MasterWeights: param_groups[{gi}]['params'] must stay a list of "
                "tensors, "
                f"got {type(params).__name__}"
            )
        refuse_duplicates([group])
        by_id = {id(p): m for p, m in zip(paired, masters)}
        fresh = iter(opt._make_masters([p for p in params if id(p) not in by_id]))
        new_masters = [by_id[id(p)] if id(p) in by_id else next(fresh) for p in params]
        plan.append((gi, list(params), new_masters))
    seen: Dict[int, str] = {}
    for gi, group in enumerate(opt.param_groups):  # across groups, after the change
        refuse_duplicates([group], {k: v for k, v in seen.items()})
        seen.update({id(p): f"param_groups[{gi}]" for p in group["params"]})
    for gi, params, new_masters in plan:
        kept = {id(m) for m in new_masters}
        gone = [(p, m) for p, m in zip(opt._paired[gi], opt.masters[gi]) if id(m) not in kept]
        lifecycle.leave([local_tensor(p) for p, _ in gone], [local_tensor(m) for _, m in gone], opt)
        for _, m in gone:
            opt.inner.state.pop(m, None)
        opt.inner.param_groups[gi]["params"] = new_masters
        opt.masters[gi] = new_masters
        opt._paired[gi] = params
        lifecycle.own([local_tensor(p) for p in params], opt)
        for p, m in zip(params, new_masters):
            lifecycle.add_master(local_tensor(p), local_tensor(m), opt)
    return bool(plan)


class ParamState(MutableMapping):
    """`MasterWeights.state`: torch's per-parameter optimizer state, seen through each
    parameter's master (the inner optimizer's state of it). Reading, setting and deleting a
    parameter's entry reads, sets and deletes its master's; a tensor the optimizer does not
    step keeps an entry of its own here, as in torch's defaultdict."""

    def __init__(self, opt):
        # Weak: the optimizer holds this view, and a cycle would keep its masters and moments
        # alive until the garbage collector runs.
        self._ref = weakref.ref(opt)
        self._other: Dict[Any, Any] = {}

    @property
    def _opt(self):
        opt = self._ref()
        if opt is None:
            raise RuntimeError("zrw.optim.MasterWeights.state: its optimizer is gone")
        return opt

    def _master(self, p) -> Optional[torch.Tensor]:
        resync(self._opt)
        for params, masters in zip(self._opt._paired, self._opt.masters):
            for q, m in zip(params, masters):
                if q is p:
                    return m
        return None

    def __getitem__(self, p):
        m = self._master(p)
        if m is None:
            return self._other.setdefault(p, {})
        return self._opt.inner.state[m]

    def __setitem__(self, p, value) -> None:
        m = self._master(p)
        if m is None:
            self._other[p] = value
        else:
            self._opt.inner.state[m] = value

    def __delitem__(self, p) -> None:
        m = self._master(p)
        if m is None:
            del self._other[p]
        elif m in self._opt.inner.state:
            del self._opt.inner.state[m]
        else:
            raise KeyError(p)

    def __contains__(self, p) -> bool:
        m = self._master(p)
        return p in self._other if m is None else m in self._opt.inner.state

    def __iter__(self) -> Iterator:
        state = self._opt.inner.state
        for params, masters in zip(self._opt._paired, self._opt.masters):
            for p, m in zip(params, masters):
                if m in state:
                    yield p
        yield from self._other

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"ParamState({len(self)} parameter(s) with state)"
