"""Tensor and expert parallelism on the engines users already run (DESIGN.md §7).

zrw brings no parallel engine of its own. The weights are sharded by
  * PyTorch's DTensor engine: torch.distributed.tensor.parallel.parallelize_module with
    ColwiseParallel / RowwiseParallel (the torchtitan way): the sharded weights stay DTensors
    inside forward, and MXLinear computes on their local shards (`dtensor_linear`);
  * transformers' own distributed engine: the model's `base_model_tp_plan` / `base_model_ep_plan`
    applied through `DistributedConfig` (`apply_plan`, which runs what
    `from_pretrained(..., distributed_config=...)` runs). Its linear styles keep DTensors in a
    training forward (as above); its expert styles (`moe_tp_experts`, `ep_dispatch_experts`) hand
    the experts' forward `to_local()` views of their DTensor parameters.
Either way each rank quantizes ITS LOCAL SHARD (the DTensor's local tensor) once per optimizer
step, caches it, releases the local BF16 storage, and gets it back at the optimizer boundary
(zrw.optim.MasterWeights keeps DTensor masters and writes them into the local tensors). Nothing is
all-gathered in BF16; the collectives are the engine's.

Order: zrw.convert BEFORE transformers' plan is applied (its wrappers close over the original
modules, which convert would replace: convert refuses such modules with an error that says so);
with parallelize_module either order works. Then `prepare(model)` once after sharding: it checks
every local shard, names it, and installs the forward pre-hook that quantizes and releases the
local shards before an engine wrapper runs (a `to_local()` view shares the storage, and the
release guard never frees a storage another tensor holds). Build the optimizer after sharding.

Blocks: MXFP8 blocks run along both axes of a weight (the forward plane along K, the backward
plane along N). A shard boundary inside a 32-element block would give the rank other scales than
the unsharded weight, so a weight whose shards do not hold whole blocks is refused with an error
that names it (use a parallel degree that splits the axis into multiples of 32, or keep the layer
in BF16 with zrw.convert's `skip`). The expert axis of an expert stack is never blocked.

Numerics: a TP layer's partial products are reduced by the engine, in the activation dtype, as for
a BF16 layer; EP moves whole tokens and changes nothing but the order of the rows.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor

from . import cache
from ._dtensor import _dtensor_cls, is_dtensor  # noqa: F401 (zrw.parallel's API)
from ._dtensor import local_tensor as _local_tensor
from .config import QuantRecipe

BLOCK = 32


def _check_tensor(op: str, arg: str, t) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _check_dtensor(op: str, arg: str, t) -> Tensor:
    if not is_dtensor(t):
        raise TypeError(f"{op}: {arg} must be a DTensor (torch.distributed.tensor), got "
                        f"{'a plain ' if isinstance(t, Tensor) else ''}{type(t).__name__}")
    return t


def _check_recipe(op: str, recipe) -> QuantRecipe:
    if not isinstance(recipe, QuantRecipe):
        raise TypeError(f"{op}: recipe must be a zrw.QuantRecipe (zrw.get_recipe(name)), got "
                        f"{type(recipe).__name__}")
    return recipe


def _check_module(op: str, model) -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{op}: model must be a torch.nn.Module, got {type(model).__name__}")
    return model


def local_tensor(t: Tensor) -> Tensor:
    """The tensor zrw's cache works on: a DTensor's local shard (the tensor that owns the rank's
    storage, not a `to_local()` view of it), any other tensor itself."""
    return _local_tensor(_check_tensor("zrw.parallel.local_tensor", "t", t))


def local_tensors(ts) -> List[Tensor]:
    """local_tensor of each tensor of the iterable `ts` (a list, not a single tensor)."""
    op = "zrw.parallel.local_tensors"
    if isinstance(ts, (Tensor, str, bytes, dict)) or not isinstance(ts, Iterable):
        raise TypeError(f"{op}: ts must be an iterable of tensors (a list, not a single tensor, "
                        f"name or dict), got {type(ts).__name__}")
    return [_local_tensor(_check_tensor(op, f"ts[{i}]", t)) for i, t in enumerate(ts)]


def engine_view_owner(w: Tensor) -> Optional[Tensor]:
    """If `w` is a `DTensor.to_local()` view made in a grad-mode forward (transformers' expert
    styles swap a module's DTensor parameters for such views while its forward runs), the local
    tensor it views; else None."""
    _check_tensor("zrw.parallel.engine_view_owner", "w", w)
    base = getattr(w, "_base", None)
    if base is None or w.grad_fn is None:
        return None
    if type(w.grad_fn).__name__ != "_ToTorchTensorBackward":
        return None
    if (w.shape != base.shape or w.stride() != base.stride()
            or w.storage_offset() != base.storage_offset()):
        return None
    return base


def main_grad_owner(weight: Tensor) -> Tensor:
    """The parameter that accumulates `weight`'s main_grad: for an engine's to_local() view,
    the DTensor parameter it shows (recorded by `prepare`); else `weight` itself."""
    _check_tensor("zrw.parallel.main_grad_owner", "weight", weight)
    base = engine_view_owner(weight)
    ref = getattr(base, "_zrw_dtensor", None) if base is not None else None
    param = ref() if ref is not None else None
    return weight if param is None else param


@torch._dynamo.disable
def quant_local(owner: Tensor, requires_grad: bool, recipe: QuantRecipe, release: bool,
                release_frozen: bool, name: Optional[str] = None):
    """quant_and_release on a rank's local shard, trainable as its DTensor (or the engine's
    view of it) is (zrw.cache.trainable_as)."""
    from .nn.linear import cache_recipe

    _check_tensor("zrw.parallel.quant_local", "owner", owner)
    _check_recipe("zrw.parallel.quant_local", recipe)
    with cache.trainable_as(owner, requires_grad):
        return cache.quant_and_release(owner, cache_recipe(recipe), release,
                                       release_frozen=release_frozen, elem_dtype=recipe.elem_dtype,
                                       scale_mode=recipe.scale_mode, name=name,
                                       require_owner=True)


def quant_engine_view(view: Tensor, owner: Tensor, recipe: QuantRecipe, release: bool,
                      release_frozen: bool, name: Optional[str] = None):
    """The planes of a weight the engine handed to forward as a `to_local()` view: those of
    its local tensor, which `prepare`'s pre-hook quantized (and released) before the view
    existed."""
    _check_tensor("zrw.parallel.quant_engine_view", "view", view)
    _check_tensor("zrw.parallel.quant_engine_view", "owner", owner)
    if not getattr(owner, "_zrw_prepared", False):
        shown = name or cache.weight_name(owner) or f"<weight of local shape {tuple(owner.shape)}>"
        raise RuntimeError(
            f"zrw: weight '{shown}' reaches its layer as a DTensor.to_local() view (a "
            "parallel engine, e.g. transformers' moe_tp_experts / ep_dispatch_experts, hands "
            "the layer its local shard), but zrw.parallel.prepare(model) has not run on it. "
            "Call zrw.parallel.prepare(model) once after the model is sharded: it checks the "
            "local shards and quantizes and releases them before the engine makes the view")
    return quant_local(owner, view.requires_grad, recipe, release, release_frozen, name)


# ---- placements ------------------------------------------------------------------------------

def _shard_info(p) -> Tuple[Optional[int], int]:
    """(sharded dim, split factor) of a 1-d placement; (None, 1) for Replicate."""
    if p.is_replicate():
        return None, 1
    if hasattr(p, "split_factor"):  # _StridedShard: packed parts, each sharded (not a Shard)
        return p.dim, int(p.split_factor)
    if p.is_shard():
        return p.dim, 1
    raise ValueError(f"placement {p} is neither a shard nor a replica")


def check_placements(w: Tensor, name: str) -> None:
    """A zrw weight that is a DTensor: a 1-d mesh, one Shard / _StridedShard / Replicate
    placement, and shards holding whole 32-element blocks along both blocked axes."""
    _check_dtensor("zrw.parallel.check_placements", "w", w)
    if not isinstance(name, str):
        raise TypeError(f"zrw.parallel.check_placements: name must be a str, got "
                        f"{type(name).__name__}")
    mesh = w.device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"zrw: weight '{name}' is a DTensor on a {mesh.ndim}-d device mesh "
            f"{tuple(mesh.shape)} with placements {w.placements}: zrw's layers compute on the "
            "local shard of a 1-d (tensor- or expert-parallel) mesh; weights sharded over 2-d "
            "meshes (e.g. FSDP2 x TP) are not supported yet")
    (p,) = w.placements
    if p.is_partial():
        raise ValueError(f"zrw: weight '{name}' has placement {p}: a weight must be sharded "
                         "or replicated, not a pending sum")
    dim, factor = _shard_info(p)
    if dim is None:
        return
    dim %= w.dim()
    if dim < w.dim() - 2:
        return  # the expert axis of an (E, N, K) stack: whole matrices per rank
    world = mesh.size()
    size = w.shape[dim]
    if world == 1:
        return
    axis = "N (out_features; the backward plane's blocks)" if dim == w.dim() - 2 else \
        "K (in_features; the forward plane's blocks)"
    if size % factor:
        raise ValueError(f"zrw: weight '{name}' packs {factor} parts along dim {dim} of size "
                         f"{size}, which does not divide into them")
    part = size // factor
    chunk = math.ceil(part / world)
    if chunk % BLOCK or (factor > 1 and part % BLOCK):
        got = f"{chunk} per rank" if factor == 1 else \
            f"{chunk} per rank of each of its {factor} packed parts of {part}"
        raise ValueError(
            f"zrw: weight '{name}' (global shape {tuple(w.shape)}) is sharded {p} over {world} "
            f"ranks: dim {dim}, its {axis}, is split into {got}, not a multiple of the MX "
            f"block ({BLOCK}). A shard boundary inside a block would give this rank other "
            "scales than the unsharded weight. Use a parallel degree that splits this axis "
            f"into multiples of {BLOCK}, or keep the layer in BF16 (zrw.convert(model, "
            "skip=[...]) before sharding)")


def wrap_like(param: Tensor, local: Tensor) -> Tensor:
    """A local tensor (e.g. an FP32 gradient of the local shard) as a DTensor laid out like
    `param`; `local` itself when `param` is not a DTensor."""
    _check_tensor("zrw.parallel.wrap_like", "param", param)
    _check_tensor("zrw.parallel.wrap_like", "local", local)
    if not is_dtensor(param):
        return local
    return _dtensor_cls().from_local(local, param.device_mesh, param.placements,
                                     run_check=False, shape=param.shape, stride=param.stride())


# ---- MXLinear on a DTensor weight ------------------------------------------------------------

def dtensor_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], recipe: QuantRecipe,
                   release: bool, release_frozen: bool, name: Optional[str],
                   main_grad: bool) -> Tensor:
    """y = x @ W.T (+ b) for a DTensor weight W (N, K), on the rank's local shard, with the
    placements PyTorch's DTensor engine gives F.linear:
      W Shard(0) (colwise):  x Replicate -> y Shard(-1); x's gradient is a partial sum
      W Shard(1) (rowwise):  x Shard(-1) -> y Partial (the engine reduces it); a replicated
                             bias is added after the reduction
      W Replicate:           x replicated -> y replicated
    x is redistributed to the placement it needs (the engine's collective) when it arrives
    otherwise. Returns a DTensor."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    from .nn.linear import apply_mx_linear

    op = "zrw.parallel.dtensor_linear"
    _check_dtensor(op, "weight", weight)
    _check_tensor(op, "x", x)
    if bias is not None:
        _check_tensor(op, "bias", bias)
    _check_recipe(op, recipe)
    owner = weight._local_tensor
    name = name or cache.weight_name(owner) or cache.weight_name(weight) or None
    shown = name or "MXLinear.weight"
    check_placements(weight, shown)
    if not is_dtensor(x):
        raise TypeError(
            f"mx_linear: weight '{shown}' is a DTensor ({weight.placements} on a mesh of "
            f"{weight.device_mesh.size()}), so the input must be a DTensor on the same mesh "
            f"(the parallel style prepares it), got a plain {type(x).__name__} of shape "
            f"{tuple(x.shape)}")
    mesh = weight.device_mesh
    if x.device_mesh != mesh:
        raise ValueError(f"mx_linear: the input of weight '{shown}' lives on another device "
                         f"mesh ({x.device_mesh}) than the weight ({mesh})")
    (wp,) = weight.placements
    wdim, factor = _shard_info(wp)
    if factor != 1:
        raise ValueError(
            f"mx_linear: weight '{shown}' is sharded {wp} (packed parts): such a weight reaches "
            "zrw as its local shard through the engine style that packed it (transformers' "
            "packed_colwise), never as a DTensor inside forward")
    if wdim is not None:
        wdim %= weight.dim()
    last = x.dim() - 1
    x_grad = None
    if wdim is None:
        (xp,) = x.placements
        if xp.is_partial() or (xp.is_shard() and xp.dim % x.dim() == last):
            raise ValueError(
                f"mx_linear: weight '{shown}' is replicated, so its input must not be "
                f"sharded along in_features nor partial, got {x.placements}")
        if xp.is_shard():
            raise ValueError(
                f"mx_linear: weight '{shown}' is replicated and its input sharded {xp}: "
                "the weight gradient would be a partial sum over ranks; shard the weight "
                "(ColwiseParallel / RowwiseParallel) or replicate the input")
        want, out = Replicate(), Replicate()
    elif wdim == 0:  # Shard(0): out_features
        want, out, x_grad = Replicate(), Shard(last), Partial()
    else:  # Shard(1): in_features
        want, out = Shard(last), Partial()
    if x.placements != (want,):
        x = x.redistribute(mesh, [want])
    # Quantize (and release) before any view of the local tensor exists (the guard refuses
    # to free a storage another tensor holds), then take the autograd-connected view.
    q = quant_local(owner, weight.requires_grad, recipe, release, release_frozen, name)
    w_local = weight.to_local()
    x_local = x.to_local(grad_placements=None if x_grad is None else [x_grad])
    b_local, b_after = None, None
    if bias is not None:
        if wdim == 1:
            b_after = bias  # replicated: added once, after the engine's reduction
        else:
            b_local = bias.to_local() if is_dtensor(bias) else bias
    y_local = apply_mx_linear(x_local, w_local, b_local, q, recipe, main_grad,
                              main_grad_owner=weight)
    shape = (*x.shape[:-1], weight.shape[0])
    stride = torch.empty(shape, device="meta").stride()
    y = _dtensor_cls().from_local(y_local, mesh, [out], run_check=False, shape=torch.Size(shape),
                                  stride=stride)
    if b_after is not None:
        y = y + b_after
    return y


# ---- prepare -----------------------------------------------------------------------------------

@dataclass
class ParallelSummary:
    """What `prepare` found on this rank. `local_elements`: elements of the converted weights
    this rank holds (its shards; replicated weights whole); `release_bytes`: the BF16 bytes its
    first forward of a step releases (2 per local element of a bf16 weight that is released)."""

    rank: int = 0
    world: int = 1
    weights: Dict[str, str] = field(default_factory=dict)   # name -> placement (or "local")
    local_elements: int = 0
    release_bytes: int = 0
    hooked_modules: int = 0

    def __str__(self) -> str:
        return (f"zrw.parallel.prepare (rank {self.rank} of {self.world}): "
                f"{len(self.weights)} converted weights, {self.local_elements} local elements, "
                f"{self.release_bytes / 2**20:.2f} MiB of BF16 released per step")


def _pre_quantize_local_shards(module, args, kwargs=None):
    """Forward pre-hook of a zrw layer with DTensor weights: quantize (and release) the local
    shards now, before an engine's forward wrapper swaps in `to_local()` views of them."""
    if not torch.is_grad_enabled():
        return None  # eval / inference: nothing is cached or released (zrw.cache)
    for pname in module.zrw_quantized:
        p = module._parameters.get(pname)
        if is_dtensor(p):
            quant_local(p._local_tensor, p.requires_grad, module.recipe, module.release,
                        getattr(module, "release_frozen", False), cache.weight_name(
                            p._local_tensor) or None)
    return None


def _is_fsdp_module(mod) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(mod, FSDPModule)


def prepare(model: torch.nn.Module) -> ParallelSummary:
    """Get a converted, sharded model ready for zero-redundancy training on its local shards.

    Call once after the parallel engine sharded the model (and after zrw.convert), before the
    optimizer is built. For every zrw layer whose quantized parameters are DTensors: checks
    the mesh and placements (1-d, sharded or replicated, whole 32-element blocks per shard:
    each refusal names the weight), names the local shard for zrw's messages, and installs a
    forward pre-hook that quantizes and releases the local shards at the layer's first use in
    a step. Returns what this rank holds (ParallelSummary). Idempotent."""
    from .nn.convert import is_zrw_layer

    _check_module("zrw.parallel.prepare", model)
    summary = ParallelSummary()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        summary.rank = torch.distributed.get_rank()
        summary.world = torch.distributed.get_world_size()
    for mname, mod in model.named_modules():
        if not is_zrw_layer(mod):
            continue
        if _is_fsdp_module(mod):
            raise TypeError(
                f"zrw.parallel.prepare: '{mname}' is managed by FSDP2 (fully_shard): its "
                "weights are gathered, not computed on as local shards; use zrw.fsdp.prepare "
                "for it")
        sharded = False
        for pname in mod.zrw_quantized:
            p = mod._parameters.get(pname)
            if p is None:
                continue
            qual = f"{mname}.{pname}" if mname else pname
            local = local_tensor(p)
            if is_dtensor(p):
                check_placements(p, qual)
                sharded = True
                summary.weights[qual] = str(p.placements[0])
                local._zrw_prepared = True
                local._zrw_dtensor = weakref.ref(p)  # main_grad's owner, seen from a view
                if not cache.weight_name(local):
                    cache.set_weight_name(local, qual)
            else:
                summary.weights[qual] = "local"
            summary.local_elements += local.numel()
            if mod.release and (p.requires_grad or getattr(mod, "release_frozen", False)):
                summary.release_bytes += local.numel() * local.element_size()
        if sharded and getattr(mod, "_zrw_parallel_hook", None) is None:
            mod._zrw_parallel_hook = mod.register_forward_pre_hook(_pre_quantize_local_shards)
            summary.hooked_modules += 1
    return summary


# ---- transformers' engine ----------------------------------------------------------------------

def apply_plan(model: torch.nn.Module, distributed_config) -> torch.nn.Module:
    """Shard a transformers model built in memory with transformers' own engine: its
    `base_model_tp_plan` / `base_model_ep_plan` under `distributed_config` (a
    transformers.distributed.DistributedConfig or a dict). Runs the two steps
    `from_pretrained(..., distributed_config=...)` runs around weight loading
    (`prepare_distribute_model`, then `maybe_distribute_model`); every rank must hold the same
    full weights (the same seed or checkpoint): each keeps its own shard of them. Returns the
    sharded model. Call after zrw.convert, then zrw.parallel.prepare(model)."""
    op = "zrw.parallel.apply_plan"
    _check_module(op, model)
    cls = type(model)
    if not hasattr(cls, "maybe_distribute_model"):
        raise TypeError(f"zrw.parallel.apply_plan: model must be a transformers PreTrainedModel "
                        f"(with the distributed engine), got {cls.__name__}")
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # pragma: no cover - another transformers layout: dicts only checked
        DistributedConfig = ()
    if not isinstance(distributed_config, (dict, DistributedConfig)):
        raise TypeError(f"{op}: distributed_config must be a transformers DistributedConfig or a "
                        f"dict, got {type(distributed_config).__name__}")
    dc, _device_map, mesh_manager = cls.prepare_distribute_model(distributed_config)
    return cls.maybe_distribute_model(model, dc, mesh_manager)
