"""What a refused call must leave as it was (docs/design.md §8: an error is raised before
anything changes).

  snapshot(*roots, dirs=())   everything below, taken now
  assert_same(before, after)  fails naming each part that differs
  unchanged(*roots, dirs=())  a context manager: snapshot, run the block (whether it raises or
                              not), snapshot again and assert_same; tests/conftest.py offers it
                              as the fixture `nothing_changes`

A snapshot holds, process-wide:
  * the weight-record registry (zrw.record.records()): every field of every record, weak
    references resolved to the identity of what they point to (a record that holds nothing
    but defaults counts as no record: creating one is not a change);
  * the module and optimizer records (hooks zrw installed on a converted root or an optimizer);
  * the native state of every recorded weight (zrw.cache.cache_states), cache_stats() without
    hits and misses, and cache_entries() without hits and misses;
  * torch's global hooks and the torch methods zrw may patch;
  * the bytes, dtype, shape and version counter of every recorded weight that is not released
    and of each of its FP32 masters;
and for the given roots: a module's submodules (names and classes), parameters (names and
identities) and the bytes of each parameter and buffer that is not released; an optimizer's
parameters, state keys and param-group settings; a tensor's bytes; and the files in `dirs`.
The snapshot keeps every weight it saw alive, so identities stay meaningful until it is dropped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import weakref
from typing import Any, Dict, Iterator, List, Tuple

import torch
import torch.optim.optimizer as torch_optimizer
from torch.nn.modules import module as torch_module
from torch.utils.weak import WeakIdKeyDictionary

import zrw
from zrw import cache, record

_PLAIN = (type(None), bool, int, float, str, bytes, torch.dtype, torch.device, enum.Enum)


def _resolve(v) -> Any:
    """A comparable form of a record field: weak references by the identity they point to,
    objects by identity, containers element by element."""
    if isinstance(v, _PLAIN):
        return v
    if isinstance(v, weakref.ref):
        target = v()
        return ("ref", None if target is None else id(target))
    if isinstance(v, weakref.WeakSet):
        return ("weakset", tuple(sorted(id(o) for o in list(v))))
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_resolve(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple(sorted((repr(k), _resolve(x)) for k, x in v.items())))
    return ("object", type(v).__name__, id(v))


def _fields(rec) -> Dict[str, Any]:
    return {f.name: _resolve(getattr(rec, f.name)) for f in dataclasses.fields(rec)}


_EMPTY_RECORD = _fields(record.WeightRecord())


def _local(t: torch.Tensor) -> torch.Tensor:
    return zrw.parallel.local_tensor(t)


def _bytes(t: torch.Tensor, state=None) -> Dict[str, Any]:
    """dtype, shape, version counter and bytes of t; bytes None where they cannot be read: a
    released weight (its storage is poisoned), a meta tensor."""
    t = _local(t)
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()  # a wrapper subclass (zrw.fsdp): its inner tensors
        return {n: _bytes(getattr(t, n)) for n in names}
    out = {"dtype": t.dtype, "shape": tuple(t.shape), "version": t._version, "bytes": None}
    if state is None:
        state = cache.cache_state(t)
    if not state.released and t.device.type != "meta":
        with torch.no_grad():
            flat = t.detach().reshape(-1).contiguous()
            out["bytes"] = flat.view(torch.uint8).cpu().clone() if flat.numel() else b""
    return out


def _key(w: torch.Tensor) -> str:
    return f"{cache.weight_name(w) or 'unnamed'}@{id(w):x}"


def _tables(table: WeakIdKeyDictionary) -> Dict[int, Tuple[Any, Dict[str, Any]]]:
    return {id(k): (k, _fields(r)) for k, r in list(table.items()) if k is not None}


def _globals() -> Dict[str, Any]:
    return {
        "optimizer_step_pre_hooks": tuple(torch_optimizer._global_optimizer_pre_hooks),
        "optimizer_step_post_hooks": tuple(torch_optimizer._global_optimizer_post_hooks),
        "module_forward_pre_hooks": tuple(torch_module._global_forward_pre_hooks),
        "module_forward_hooks": tuple(torch_module._global_forward_hooks),
        "Module.zero_grad": id(torch.nn.Module.zero_grad),
        "UntypedStorage.is_shared": id(torch.UntypedStorage.is_shared),
    }


def _root(obj) -> Dict[str, Any]:
    if isinstance(obj, torch.nn.Module):
        params = list(obj.named_parameters(remove_duplicate=False))
        return {
            "modules": [(n, type(m).__name__) for n, m in obj.named_modules()],
            "parameters": [(n, id(p)) for n, p in params],
            "values": {n: _bytes(t) for n, t in params + list(obj.named_buffers())},
            "hooks": [
                (n, len(m._forward_pre_hooks), len(m._forward_hooks), len(m._backward_hooks))
                for n, m in obj.named_modules()
            ],
        }
    if isinstance(obj, torch.optim.Optimizer):
        return {
            "groups": [
                (
                    [id(p) for p in g["params"]],
                    sorted((k, repr(v)) for k, v in g.items() if k != "params"),
                )
                for g in obj.param_groups
            ],
            "state": sorted(id(p) for p in obj.state),
            "hooks": (len(obj._optimizer_step_pre_hooks), len(obj._optimizer_step_post_hooks)),
        }
    if isinstance(obj, torch.Tensor):
        return {"id": id(obj), **_bytes(obj)}
    raise TypeError(f"refusal.snapshot: a root must be a module, optimizer or tensor, got {obj!r}")


@dataclasses.dataclass
class Snapshot:
    parts: Dict[str, Any]
    alive: List[Any]  # keeps what the snapshot names by identity alive


def snapshot(*roots, dirs=()) -> Snapshot:
    alive: List[Any] = list(roots)
    recs = {}
    for w, r in record.records():
        fields = _fields(r)
        if fields != _EMPTY_RECORD:
            recs[_key(w)] = fields
        alive.append(w)
    weights = [w for w, _ in record.records()]
    states = cache.cache_states(weights)
    values = {}
    for w, state in zip(weights, states):
        values[_key(w)] = _bytes(w, state)
        rec = record.find_record(w)
        for i, (_, m) in enumerate([] if rec is None else rec.live_masters()):
            values[f"{_key(w)} master {i}@{id(m):x}"] = _bytes(m)
            alive.append(m)
    modules = _tables(record._modules)
    optimizers = _tables(record._optimizers)
    alive += [k for k, _ in modules.values()] + [k for k, _ in optimizers.values()]
    parts = {
        "records": recs,
        "states": {_key(w): s for w, s in zip(weights, states)},
        "stats": {k: v for k, v in cache.cache_stats().items() if k not in ("hits", "misses")},
        "entries": [
            {k: v for k, v in e.items() if k not in ("hits", "misses")}
            for e in cache.cache_entries()
        ],
        "weight values": values,
        "module records": {k: f for k, (_, f) in modules.items()},
        "optimizer records": {k: f for k, (_, f) in optimizers.items()},
        "torch globals": _globals(),
        "roots": [_root(r) for r in roots],
        "files": [(str(d), sorted(os.listdir(d))) for d in dirs],
    }
    return Snapshot(parts, alive)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _differences(a, b, where: str) -> List[str]:
    if _same(a, b):
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}[{k!r}] added" for k in b.keys() - a.keys()]
        out += [f"{where}[{k!r}] removed" for k in a.keys() - b.keys()]
        for k in a.keys() & b.keys():
            out += _differences(a[k], b[k], f"{where}[{k!r}]")
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            out += _differences(x, y, f"{where}[{i}]")
        return out
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return [f"{where}: the bytes differ"]
    return [f"{where}: {a!r} -> {b!r}"]


def assert_same(before: Snapshot, after: Snapshot) -> None:
    diffs = []
    for part in before.parts:
        diffs += _differences(before.parts[part], after.parts[part], part)
    assert not diffs, "the refused call changed state:\n  " + "\n  ".join(diffs[:20])


@contextlib.contextmanager
def unchanged(*roots, dirs=()) -> Iterator[Snapshot]:
    """Snapshot, run the block, and assert that nothing changed (also when the block raises:
    the error propagates after the check, so `pytest.raises` goes inside)."""
    before = snapshot(*roots, dirs=dirs)
    try:
        yield before
    finally:
        assert_same(before, snapshot(*roots, dirs=dirs))
