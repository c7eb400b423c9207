"""Tensor and expert parallelism on the engines users already run (docs/design.md §7).

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

from dataclasses import dataclass, field
from typing import Dict, Iterable, List

import torch
from torch import Tensor

from . import cache, lifecycle

# The helpers the layers and the cache use live below them (zrw._dtensor, zrw.weights,
# zrw.nn.functional); zrw.parallel is their public home.
from ._dtensor import (  # noqa: F401  # noqa: F401
    BLOCK,
    _dtensor_cls,
    check_placements,
    check_tensor,
    engine_view_owner,
    is_dtensor,
    wrap_like,
)
from ._dtensor import local_tensor as _local_tensor
from ._dtensor import shard_info as _shard_info  # noqa: F401
from .nn.functional import dtensor_linear  # noqa: F401
from .planes import is_zrw_layer, unwrap_model
from .record import module_record
from .weights import (  # noqa: F401
    main_grad_owner,
    prepare_local_shards,
    quant_engine_view,
    quant_local,  # noqa: F401
)

__all__ = [
    "ParallelSummary",
    "apply_plan",
    "check_placements",
    "dtensor_linear",
    "engine_view_owner",
    "is_dtensor",
    "local_tensor",
    "local_tensors",
    "main_grad_owner",
    "prepare",
    "quant_engine_view",
    "quant_local",
    "wrap_like",
]


def _check_module(op: str, model) -> torch.nn.Module:
    """`model`, checked; a torch.compile wrapper gives the model it wraps."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{op}: model must be a torch.nn.Module, got {type(model).__name__}")
    return unwrap_model(model)


def local_tensor(t: Tensor) -> Tensor:
    """The tensor zrw's cache works on: a DTensor's local shard (the tensor that owns the rank's
    storage, not a `to_local()` view of it), any other tensor itself."""
    return _local_tensor(check_tensor("zrw.parallel.local_tensor", "t", t))


def local_tensors(ts) -> List[Tensor]:
    """local_tensor of each tensor of the iterable `ts` (a list, not a single tensor)."""
    op = "zrw.parallel.local_tensors"
    if isinstance(ts, (Tensor, str, bytes, dict)) or not isinstance(ts, Iterable):
        raise TypeError(
            f"{op}: ts must be an iterable of tensors (a list, not a single tensor, "
            f"name or dict), got {type(ts).__name__}"
        )
    return [_local_tensor(check_tensor(op, f"ts[{i}]", t)) for i, t in enumerate(ts)]


# ---- prepare -----------------------------------------------------------------------------------


@dataclass
class ParallelSummary:
    """What `prepare` found on this rank. `local_elements`: elements of the converted weights
    this rank holds (its shards; replicated weights whole); `release_bytes`: the BF16 bytes its
    first forward of a step releases (2 per local element of a bf16 weight that is released)."""

    rank: int = 0
    world: int = 1
    weights: Dict[str, str] = field(default_factory=dict)  # name -> placement (or "local")
    local_elements: int = 0
    release_bytes: int = 0
    hooked_modules: int = 0

    def __str__(self) -> str:
        return (
            f"zrw.parallel.prepare (rank {self.rank} of {self.world}): "
            f"{len(self.weights)} converted weights, {self.local_elements} local elements, "
            f"{self.release_bytes / 2**20:.2f} MiB of BF16 released per step"
        )


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
    model = _check_module("zrw.parallel.prepare", model)
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
                "for it"
            )
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
                lifecycle.prepared(local, p)  # main_grad's owner, seen from a view
                if not cache.weight_name(local):
                    cache.set_weight_name(local, qual)
            else:
                summary.weights[qual] = "local"
            summary.local_elements += local.numel()
            if mod.release and (p.requires_grad or getattr(mod, "release_frozen", False)):
                summary.release_bytes += local.numel() * local.element_size()
        mrec = module_record(mod)
        if sharded and mrec.parallel_hook is None:
            mrec.parallel_hook = mod.register_forward_pre_hook(prepare_local_shards)
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
    given, model = model, _check_module(op, model)
    cls = type(model)
    if not hasattr(cls, "maybe_distribute_model"):
        raise TypeError(
            f"zrw.parallel.apply_plan: model must be a transformers PreTrainedModel "
            f"(with the distributed engine), got {cls.__name__}"
        )
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # pragma: no cover - another transformers layout: dicts only checked
        DistributedConfig = ()
    if not isinstance(distributed_config, (dict, DistributedConfig)):
        raise TypeError(
            f"{op}: distributed_config must be a transformers DistributedConfig or a "
            f"dict, got {type(distributed_config).__name__}"
        )
    dc, _device_map, mesh_manager = cls.prepare_distribute_model(distributed_config)
    out = cls.maybe_distribute_model(model, dc, mesh_manager)
    return given if out is model else out
