"""Every DTensor helper zrw needs, below everything that handles weights (zrw.cache caches a
DTensor weight by its local shard; the layers compute on local shards; zrw.parallel builds on
them). Imports nothing from zrw; torch.distributed.tensor is imported on first use.

The public names are re-exported by zrw.parallel, and the messages name them there.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

BLOCK = 32  # elements of an MX block along each blocked axis

_DTensor = None


def _dtensor_cls():
    global _DTensor
    if _DTensor is None:
        if not torch.distributed.is_available():
            _DTensor = ()
        else:
            from torch.distributed.tensor import DTensor

            _DTensor = DTensor
    return _DTensor


def is_dtensor(t) -> bool:
    """Whether `t` is a torch.distributed.tensor.DTensor (a Parameter wrapping one included)."""
    cls = _dtensor_cls()
    return bool(cls) and isinstance(t, cls)


def check_tensor(op: str, arg: str, t) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_dtensor(op: str, arg: str, t) -> Tensor:
    if not is_dtensor(t):
        raise TypeError(
            f"{op}: {arg} must be a DTensor (torch.distributed.tensor), got "
            f"{'a plain ' if isinstance(t, Tensor) else ''}{type(t).__name__}"
        )
    return t


def local_tensor(t: Tensor) -> Tensor:
    """The tensor zrw's cache works on: a DTensor's local shard (the tensor that owns the rank's
    storage, not a `to_local()` view of it), any other tensor itself."""
    return t._local_tensor if is_dtensor(t) else t


def wrap_like(param: Tensor, local: Tensor) -> Tensor:
    """A local tensor (e.g. an FP32 gradient of the local shard) as a DTensor laid out like
    `param`; `local` itself when `param` is not a DTensor."""
    check_tensor("zrw._dtensor.wrap_like", "param", param)
    check_tensor("zrw._dtensor.wrap_like", "local", local)
    if not is_dtensor(param):
        return local
    return _dtensor_cls().from_local(
        local,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def engine_view_owner(w: Tensor) -> Optional[Tensor]:
    """If `w` is a `DTensor.to_local()` view made in a grad-mode forward (transformers' expert
    styles swap a module's DTensor parameters for such views while its forward runs), the local
    tensor it views; else None.

    Recognized by what such a view is, not by the private name of the engine's autograd node:
    an autograd-connected alias (same shape, strides and offset) of a leaf that autograd does
    not track itself (a DTensor's local shard never requires grad: its DTensor does)."""
    check_tensor("zrw._dtensor.engine_view_owner", "w", w)
    base = getattr(w, "_base", None)
    if base is None or w.grad_fn is None or base.grad_fn is not None or base.requires_grad:
        return None
    if (
        w.shape != base.shape
        or w.stride() != base.stride()
        or w.storage_offset() != base.storage_offset()
    ):
        return None
    return base


def shard_info(p) -> Tuple[Optional[int], int]:
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
    check_dtensor("zrw._dtensor.check_placements", "w", w)
    if not isinstance(name, str):
        raise TypeError(
            f"zrw._dtensor.check_placements: name must be a str, got {type(name).__name__}"
        )
    mesh = w.device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"zrw: weight '{name}' is a DTensor on a {mesh.ndim}-d device mesh "
            f"{tuple(mesh.shape)} with placements {w.placements}: zrw's layers compute on the "
            "local shard of a 1-d (tensor- or expert-parallel) mesh. For FSDP2 x TP on a 2-d "
            "mesh, call zrw.fsdp.prepare(model) after parallelize_module (on the TP mesh "
            "dimension) and before fully_shard (on the DP one): FSDP2 then gathers the TP-local "
            "weight's MXFP8 planes and the layer sees a 1-d TP DTensor"
        )
    (p,) = w.placements
    if p.is_partial():
        raise ValueError(
            f"zrw: weight '{name}' has placement {p}: a weight must be sharded "
            "or replicated, not a pending sum"
        )
    dim, factor = shard_info(p)
    if dim is None:
        return
    dim %= w.dim()
    if dim < w.dim() - 2:
        return  # the expert axis of an (E, N, K) stack: whole matrices per rank
    world = mesh.size()
    size = w.shape[dim]
    if world == 1:
        return
    axis = (
        "N (out_features; the backward plane's blocks)"
        if dim == w.dim() - 2
        else "K (in_features; the forward plane's blocks)"
    )
    if size % factor:
        raise ValueError(
            f"zrw: weight '{name}' packs {factor} parts along dim {dim} of size "
            f"{size}, which does not divide into them"
        )
    part = size // factor
    chunk = math.ceil(part / world)
    if chunk % BLOCK or (factor > 1 and part % BLOCK):
        got = (
            f"{chunk} per rank"
            if factor == 1
            else f"{chunk} per rank of each of its {factor} packed parts of {part}"
        )
        names = mesh.mesh_dim_names
        over = f"mesh dimension '{names[0]}' ({world} ranks)" if names else f"{world} ranks"
        raise ValueError(
            f"zrw: weight '{name}' (global shape {tuple(w.shape)}) is sharded {p} over {over}"
            f": dim {dim}, its {axis}, is split into {got}, not a multiple of the MX "
            f"block ({BLOCK}). A shard boundary inside a block would give this rank other "
            "scales than the unsharded weight. Use a parallel degree that splits this axis "
            f"into multiples of {BLOCK}, or keep the layer in BF16 (zrw.convert(model, "
            "skip=[...]) before sharding)"
        )
