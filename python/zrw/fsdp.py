"""FSDP2 with an MXFP8 all-gather (docs/design.md §7; the RFC rfc_fsdp_mxfp8_32x32).

`prepare(model)` wraps the weights of every layer that declares what it quantizes (a
`zrw_quantized` tuple of parameter names and a `recipe`, as zrw.nn.MXLinear, MXGroupedLinear and
MXFusedExperts do) in `PreQuantWeight`, a tensor subclass implementing FSDP2's all-gather extension
(`fsdp_pre_all_gather` in its 5-argument form, `fsdp_post_all_gather`). Call it after
zrw.convert and before `torch.distributed.fsdp.fully_shard` (FSDP2 looks the extension up when it
shards a parameter; prepare() on an already sharded model raises).

Under FSDP2 the sharded parameter is the FP32 (or param-dtype) master that the optimizer steps,
a view into FSDP's own buffer, so nothing is released there; the zero-redundancy property is
that no BF16 unsharded weight is ever gathered or materialized:
  * each rank quantizes `shard.to(param_dtype)` once per optimizer step (the bytes equal the
    single-process path: a shard holds whole 32-row blocks) and caches it for every
    micro-batch's gather, the backward re-gather included;
  * `mxfp8` gathers the plane the phase needs: forward data + scale in the forward gather,
    backward data + scale in the backward re-gather (both with both_planes=True: needed with
    reshard_after_forward=False or activation recompute);
  * `mxfp8-32x32` gathers the data once plus the compact block scale; the forward and backward
    scales are expanded after the gather;
  * FP8 travels as uint8 views (gloo refuses float8).
A shard that does not hold whole 32-row blocks (rows per rank not a multiple of 32, uneven
sharding) falls back, with a warning naming the weight, to gathering the param-dtype shard and
quantizing after the gather: correct, but that weight then exists unsharded in BF16.

Both carry the layer's QuantRecipe: its element dtype and scale rule are the ones the shard is
quantized with. The gathered weight is an `MXGatheredWeight`, a zrw.planes.MXPlanesCarrier:
shape and dtype of the unsharded parameter, data held as the MX planes; the zrw layers read the
planes (`mx_weight`), any other use raises. zrw.fsdp imports no layer and no layer imports it.
zrw.testing.shard_quantizations() counts the shard quantizations (once per weight and optimizer
step).
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from . import boundary, cache, ops, planes
from ._dtensor import _dtensor_cls, check_placements, is_dtensor
from .config import QuantRecipe, get_recipe

__all__ = ["PreQuantWeight", "MXGatheredWeight", "prepare", "clear_shard_cache"]

aten = torch.ops.aten

# Every PreQuantWeight alive, so that the optimizer boundary can drop their shard caches.
_live: "weakref.WeakSet[PreQuantWeight]" = weakref.WeakSet()
_stats = {"shard_quantizations": 0}  # zrw.testing.shard_quantizations(); written under _lock
_lock = threading.Lock()


def clear_shard_cache() -> None:
    """Drop every cached shard quantization (run at every zrw optimizer boundary)."""
    for w in list(_live):
        w._mx_planes = None


_boundary_handle = boundary.register_boundary_callback(lambda opt: clear_shard_cache())


def _type_error(op: str, arg: str, expected: str, value) -> TypeError:
    return TypeError(f"{op}: {arg} must be {expected}, got {type(value).__name__}")


def _check_carrier_args(op: str, recipe, name, flag: str, value) -> None:
    """The arguments PreQuantWeight and MXGatheredWeight share, each refused by name."""
    if not isinstance(recipe, QuantRecipe):
        raise _type_error(op, "recipe", "a zrw.QuantRecipe (zrw.get_recipe(name))", recipe)
    if not isinstance(name, str):
        raise _type_error(op, "name", "a str", name)
    if not isinstance(value, bool):
        raise _type_error(op, flag, "a bool", value)


# Ops that keep the subclass when FSDP2 manipulates the sharded parameter (chunking, copying,
# moving). In-place optimizer math runs on the inner tensor and returns it.
_PRESERVED = {
    aten.empty_like.default,
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.slice.Tensor,
    aten.copy_.default,
    aten.view.default,
    aten.as_strided.default,
    aten._to_copy.default,
    aten._pin_memory.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.clone.default,
    aten.detach.default,
    aten.alias.default,
    aten.zeros_like.default,
}


class PreQuantWeight(torch.Tensor):
    """A weight (the FP32 / param-dtype master under FSDP2) that all-gathers as MXFP8, quantized
    with `recipe` (the layer's QuantRecipe: layout, element dtype, scale rule)."""

    @staticmethod
    def __new__(cls, tensor: Tensor, recipe: QuantRecipe, name: str, both_planes: bool = False):
        op = "zrw.fsdp.PreQuantWeight"
        if not isinstance(tensor, Tensor):
            raise _type_error(op, "tensor", "a torch.Tensor", tensor)
        if not tensor.is_floating_point():
            raise TypeError(
                f"{op}: tensor must be a floating-point tensor (the weight or its master), "
                f"got {tensor.dtype}"
            )
        _check_carrier_args(op, recipe, name, "both_planes", both_planes)
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: Tensor, recipe: QuantRecipe, name: str, both_planes: bool = False):
        self._tensor = tensor
        self._mx_recipe = recipe
        self._mx_name = name
        self._mx_both_planes = both_planes
        self._mx_planes: Optional[Tuple[tuple, planes.MXWeight]] = None
        self._mx_warned = False
        _live.add(self)

    def __repr__(self) -> str:
        return (
            f"PreQuantWeight({self._mx_name!r}, recipe={self._mx_recipe.name}, "
            f"shard={tuple(self._tensor.shape)}, {self._tensor.dtype})"
        )

    def __tensor_flatten__(self):
        return ["_tensor"], (self._mx_recipe, self._mx_name, self._mx_both_planes)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return PreQuantWeight(inner["_tensor"], *meta)

    def __reduce_ex__(self, proto):
        # Checkpoints (torch.distributed.checkpoint, torch.save) hold the plain tensor: the
        # all-gather extension is a property of the live model (prepare() re-applies it), and a
        # plain tensor loads with torch.load(weights_only=True), which DCP's reader uses. Loading
        # into a PreQuantWeight copies into its inner tensor (aten.copy_ is preserved above), and
        # so do the optimizer states zeros_like made PreQuantWeight. The inner tensor is a view
        # into FSDP2's padded shard buffer: clone it so that only its own elements are written
        # (DCP clones over-sized storages itself, but cannot see through the wrapper).
        t = self._tensor.detach()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        return t.__reduce_ex__(proto)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = next(a for a in list(args) + list(kwargs.values()) if isinstance(a, cls))

        def unwrap(t):
            return t._tensor if isinstance(t, cls) else t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if func not in _PRESERVED:
            return out

        def wrap(t):
            if isinstance(t, Tensor) and not isinstance(t, cls) and t.is_floating_point():
                return cls(t, src._mx_recipe, src._mx_name, src._mx_both_planes)
            return t

        if func is aten.copy_.default:
            return args[0]
        return tree_map(wrap, out)

    # ---- the FSDP2 all-gather extension ------------------------------------------------------

    def _quantized_shard(self, param_dtype: torch.dtype) -> planes.MXWeight:
        """The shard's MX planes, quantized once per optimizer step. They are kept by the rule of
        the native cache's unreleased entries (docs/design.md §5): fresh while zrw's step
        counter, the shard's version and its bytes' address are those they were made at (a
        load into the shard, DCP's included, moves the version; the boundary also drops them).
        For "mxfp8-32x32" the compact block scale (block_scale) travels, the expanded scales
        are None."""
        t = self._tensor
        step = cache.cache_stats()["step"]
        key = (step, self._version, t._version, t.data_ptr(), str(param_dtype))
        cached = self._mx_planes
        if cached is not None and cached[0] == key:
            return cached[1]
        rcp = self._mx_recipe
        shard = self._tensor.detach().to(param_dtype)
        if rcp.block_32x32:
            data, block = ops.mx_quantize_block(shard, rcp.elem_dtype, rcp.scale_mode)
            q = planes.MXWeight(
                rcp.cache_layout, planes.MXPlane(data, None), planes.MXPlane(data, None), block
            )
        else:
            q = planes.MXWeight.from_tensors(
                rcp.cache_layout, list(ops.mx_quantize_dual(shard, rcp.elem_dtype, rcp.scale_mode))
            )
        with _lock:
            _stats["shard_quantizations"] += 1
        self._mx_planes = (key, q)
        return q

    def _whole_blocks(self, outer_size: torch.Size, world: int) -> bool:
        """Whether every rank's shard holds whole 32-row blocks (3-D stacks shard whole
        matrices, so they always do)."""
        if len(outer_size) == 3:
            return outer_size[0] % world == 0
        rows = outer_size[0]
        return rows % world == 0 and (rows // world) % 32 == 0

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        param_dtype = mp_policy.param_dtype or self.dtype
        world = mesh.size()
        if not self._whole_blocks(outer_size, world):
            if not self._mx_warned:
                names = getattr(mesh, "mesh_dim_names", None)
                over = f"mesh dimension '{names[0]}' ({world} ranks)" if names else f"{world} ranks"
                warnings.warn(
                    f"zrw.fsdp: weight '{self._mx_name}' of shape {tuple(outer_size)} does not "
                    f"shard into whole 32-row blocks over {over}: it is all-gathered in "
                    f"{param_dtype} and quantized after the gather (correct, but not "
                    "zero-redundancy for this weight; the fix: a data-parallel degree that "
                    "splits its rows into multiples of 32)",
                    stacklevel=2,
                )
                self._mx_warned = True
            shard = self._tensor.detach().to(param_dtype)
            padded_rows = -(-outer_size[0] // world)
            if shard.shape[0] < padded_rows:  # FSDP pads the last ranks' shards
                pad = shard.new_zeros((padded_rows - shard.shape[0], *shard.shape[1:]))
                shard = torch.cat([shard, pad])
            return (shard,), ("fallback", tuple(outer_size))
        q = self._quantized_shard(param_dtype)
        if world == 1:
            # A group of one rank (e.g. the experts' FSDP dimension when EP spans the DP
            # ranks): FSDP2 2.13 then copies only the first all-gather input, so every plane
            # travels packed in one uint8 buffer (which FSDP2 frees at reshard like a gather's).
            pieces = (
                [q.fwd.data, q.block_scale] if self._mx_recipe.block_32x32 else [*q.fwd, *q.bwd]
            )
            flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in pieces])
            return (flat,), ("packed", tuple(outer_size), [tuple(t.shape) for t in pieces])
        if self._mx_recipe.block_32x32:
            inputs, phase = (q.fwd.data, q.block_scale), "block"
        elif self._mx_both_planes:
            inputs, phase = (*q.fwd, *q.bwd), "both"
        else:
            # The backward re-gather runs inside the autograd engine: dgrad needs the N plane.
            bwd = torch._C._current_autograd_node() is not None
            data, scale = q.bwd if bwd else q.fwd
            # FSDP2 sizes its all-gather buffers at the first gather, so every gather must send
            # the same numels: the two scale planes differ when K is not a multiple of 32, and
            # the smaller one travels zero-padded to the larger one's size.
            width = max(q.fwd.scale.numel(), q.bwd.scale.numel())
            flat = scale.reshape(-1).view(torch.uint8)
            if flat.numel() < width:
                flat = torch.cat([flat, flat.new_zeros(width - flat.numel())])
            meta = (
                "bwd" if bwd else "fwd",
                tuple(outer_size),
                tuple(scale.shape),
                world,
                q.fwd.scale.numel() != q.bwd.scale.numel(),
            )
            return (data.view(torch.uint8), flat), meta
        return tuple(t.view(torch.uint8) for t in inputs), (phase, tuple(outer_size))

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        phase, outer_size = metadata[0], metadata[1]
        if out is not None and is_dtensor(out):
            out = out._local_tensor  # FSDP2 x TP: the unsharded parameter is a TP DTensor
        rcp = self._mx_recipe
        elem = rcp.elem_dtype
        e8 = torch.float8_e8m0fnu
        inner: List[Tensor] = []
        if phase == "fallback":
            (full,) = all_gather_outputs
            full = full[: outer_size[0]]
            if rcp.block_32x32:
                data, block = ops.mx_quantize_block(full, elem, rcp.scale_mode)
                w = _block_planes(rcp, data, block, outer_size)
            else:
                w = planes.MXWeight.from_tensors(
                    rcp.cache_layout, list(ops.mx_quantize_dual(full, elem, rcp.scale_mode))
                )
            inner = list(w.tensors())
        elif phase == "packed":
            (flat,) = all_gather_outputs
            flat, views, at = flat.reshape(-1), [], 0
            for i, shape in enumerate(metadata[2]):
                n = 1
                for d in shape:
                    n *= d
                views.append(flat[at : at + n].view(elem if i % 2 == 0 else e8).view(shape))
                at += n
            if rcp.block_32x32:
                w = _block_planes(rcp, views[0], views[1], outer_size)
                inner = [w.fwd.scale, w.bwd.scale]
            else:
                w = planes.MXWeight.from_tensors(rcp.cache_layout, views)
        elif phase == "block":
            data, block = all_gather_outputs
            w = _block_planes(rcp, data.view(elem), block.view(e8), outer_size)
            inner = [w.fwd.scale, w.bwd.scale]
        elif phase == "both":
            df, sf, db, sb = all_gather_outputs
            w = planes.MXWeight(
                rcp.cache_layout,
                planes.MXPlane(df.view(elem), sf.view(e8)),
                planes.MXPlane(db.view(elem), sb.view(e8)),
            )
        else:
            data, flat = all_gather_outputs
            local_shape, world = metadata[2], metadata[3]
            n = 1
            for d in local_shape:
                n *= d
            per_rank = flat.view(world, -1)
            # When the two scale planes differ in size (K % 32 != 0, or N % 32 != 0 in an expert
            # stack; metadata[4]) the smaller one travels padded; it is compacted into a buffer
            # of the padded size that FSDP2 manages like the gathered planes: returned as an
            # inner tensor at the first gather (whichever direction that is), its storage is
            # freed at reshard and re-allocated before every later gather, so no scale copy
            # outlives a reshard.
            if out is None:
                buf = None
                if metadata[4]:
                    buf = torch.empty(flat.numel(), dtype=torch.uint8, device=flat.device)
                    inner = [buf]
            else:
                buf = out._mx_state.get("scale_buf")
            if per_rank.shape[1] != n:
                compact = buf[: world * n].view(world, n)
                compact.copy_(per_rank[:, :n])
                per_rank = compact
            scale = per_rank.view(e8).reshape(world * local_shape[0], *local_shape[1:])
            gathered, missing = planes.MXPlane(data.view(elem), scale), planes.MXPlane(None, None)
            fwd, bwd = (gathered, missing) if phase == "fwd" else (missing, gathered)
            w = planes.MXWeight(rcp.cache_layout, fwd, bwd)
        if out is not None:
            prev = out._mx_state["planes"]
            if prev is not None and (
                phase in ("fallback", "block") or (phase == "packed" and rcp.block_32x32)
            ):
                # fallback: the planes quantized after a BF16 gather are the inner tensors FSDP2
                # got the first time: it re-allocated them and frees them at reshard. Refill in
                # place, or fresh copies would outlive every reshard. block: the same for the
                # expanded scales (the data is a view of the all-gather output).
                w = _refill(prev, w, data=phase == "fallback")
            out._set_planes(w, phase)
            return None
        g = MXGatheredWeight(
            torch.Size(outer_size), param_dtype, self.device, self._mx_recipe, self._mx_name
        )
        g._set_planes(w, phase)
        if phase in ("fwd", "bwd"):
            g._mx_state["scale_buf"] = inner[0] if inner else None
        return g, tuple(inner)


def _block_planes(recipe: QuantRecipe, data: Tensor, block: Tensor, outer_size) -> planes.MXWeight:
    """A 32x32 weight's planes: one data tensor, the block scale expanded along K and along N."""
    return planes.MXWeight(
        recipe.cache_layout,
        planes.MXPlane(data, ops.expand_block_scale(block, outer_size, -1).contiguous()),
        planes.MXPlane(data, ops.expand_block_scale(block, outer_size, -2).contiguous()),
    )


def _refill(prev: planes.MXWeight, new: planes.MXWeight, data: bool) -> planes.MXWeight:
    """`new` with each scale (and, with `data`, each data tensor) copied into `prev`'s tensor
    where both exist: FSDP2 re-allocated the storage of the inner tensors returned at the first
    gather and frees it again at reshard, so later gathers must fill those, not fresh copies."""

    def into(old: Optional[Tensor], t: Optional[Tensor]) -> Optional[Tensor]:
        if t is None or old is None:
            return t
        old.copy_(t)
        return old

    def plane(old: planes.MXPlane, p: planes.MXPlane) -> planes.MXPlane:
        return planes.MXPlane(into(old.data, p.data) if data else p.data, into(old.scale, p.scale))

    return planes.MXWeight(
        new.recipe, plane(prev.fwd, new.fwd), plane(prev.bwd, new.bwd), new.block_scale
    )


class MXGatheredWeight(planes.MXPlanesCarrier, torch.Tensor):
    """The unsharded weight FSDP2 hands to a zrw layer: the gathered MX planes, no BF16 data.

    It has the parameter's shape and dtype for autograd's sake; zrw's layers read its planes
    (`mx_weight()`, the MXPlanesCarrier interface), and any other operation on it raises an
    error naming the weight. `_mx_recipe` is the QuantRecipe the planes were quantized with.
    """

    @staticmethod
    def __new__(cls, size, dtype, device, recipe: QuantRecipe, name, requires_grad=False):
        op = "zrw.fsdp.MXGatheredWeight"
        if not isinstance(size, (tuple, list)) or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in size
        ):
            raise _type_error(op, "size", "a torch.Size or a tuple of ints", size)
        if not isinstance(dtype, torch.dtype):
            raise _type_error(op, "dtype", "a torch.dtype", dtype)
        if not isinstance(device, (torch.device, str)):
            raise _type_error(op, "device", "a torch.device or a str", device)
        _check_carrier_args(op, recipe, name, "requires_grad", requires_grad)
        return torch.Tensor._make_wrapper_subclass(
            cls, size, dtype=dtype, device=device, requires_grad=requires_grad
        )

    def __init__(self, size, dtype, device, recipe: QuantRecipe, name, requires_grad=False):
        self._mx_recipe = recipe
        self._mx_name = name
        # Shared by every alias (FSDP2 wraps the object in an nn.Parameter, a detached alias, and
        # later gathers update it through `out=`): one mutable state, updated in place.
        # "planes": the gathered MXWeight (None before the first gather; a plane not gathered is
        # MXPlane(None, None)), "phase": what the last gather sent, "scale_buf": the compacted
        # scale's buffer of a one-plane gather.
        self._mx_state: Dict[str, object] = {"planes": None, "phase": None}

    def _set_planes(self, weight: planes.MXWeight, phase: str) -> None:
        self._mx_state["planes"] = weight
        self._mx_state["phase"] = phase

    def __repr__(self) -> str:
        return (
            f"MXGatheredWeight({self._mx_name!r}, {tuple(self.shape)}, "
            f"recipe={self._mx_recipe.name}, gathered={self._mx_state['phase']})"
        )

    @property
    def zrw_name(self) -> str:
        return self._mx_name

    def mx_weight(self, need: str) -> planes.MXWeight:
        """The planes as an MXWeight; `need` is "fwd" or "bwd", the plane the caller reads."""
        w = self._mx_state["planes"]
        plane = None if w is None else {"fwd": w.fwd, "bwd": w.bwd}.get(need)
        if plane is None or plane.data is None:
            raise RuntimeError(
                f"zrw.fsdp: weight '{self._mx_name}' was all-gathered with only its "
                f"{self._mx_state['phase']} plane, but the {need} plane is needed now: activation "
                "recompute or fully_shard(reshard_after_forward=False) need both planes — call "
                "zrw.fsdp.prepare(model, both_planes=True)"
            )
        return w

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = next(a for a in list(args) + list(kwargs.values()) if isinstance(a, cls))
        # FSDP2 re-views the unsharded tensor (as_strided to the original size) and autograd
        # detaches it into an nn.Parameter: shape-preserving aliases share the planes.
        if func in (
            aten.detach.default,
            aten.alias.default,
            aten.view.default,
            aten.as_strided.default,
            aten._unsafe_view.default,
        ):
            shape = func(torch.empty(src.shape, device="meta"), *args[1:], **kwargs).shape
            if shape == src.shape:
                g = cls(src.shape, src.dtype, src.device, src._mx_recipe, src._mx_name)
                g._mx_state = src._mx_state
                return g
        raise RuntimeError(
            f"zrw.fsdp: {func} on the gathered weight '{src._mx_name}': under zrw's FSDP2 "
            "all-gather the unsharded weight exists only as its MXFP8 planes (no BF16 copy is "
            "ever materialized); only zrw layers can use it"
        )


def _fsdp_managed(model: nn.Module) -> bool:
    """Whether fully_shard has run on `model` or any module inside it."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def prepare(model: nn.Module, both_planes: bool = False) -> int:
    """Wrap the quantized weights of every zrw layer in PreQuantWeight; returns how many.

    A zrw layer is a module that declares what it quantizes: `zrw_quantized`, the names of its
    parameters, and `recipe`, its QuantRecipe (or a registered name); its forward must read a
    zrw.planes.MXPlanesCarrier in those parameters' place (zrw.nn's layers do). Call after
    zrw.convert and before fully_shard (the extension hooks are looked up when FSDP2 shards a
    parameter). both_planes=True gathers both mxfp8 planes in every gather: needed with
    fully_shard(..., reshard_after_forward=False) and with activation recompute.

    FSDP2 x TP (a 2-D mesh, torchtitan's layout): call it after `parallelize_module` on the TP
    mesh dimension and before `fully_shard` on the DP one. A weight that is already a DTensor
    of the TP engine keeps its placements; its local shard is wrapped (the DTensor then holds a
    PreQuantWeight), so FSDP2 all-gathers the MXFP8 planes of each rank's TP-local shard and the
    layer computes on the gathered TP-local planes. Its TP shards must hold whole 32-element
    blocks (refused otherwise, with an error naming the weight and the mesh dimension); FSDP2's
    rows follow the 1-D rule (whole 32-row blocks per rank, else a BF16 gather with a warning).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"zrw.fsdp.prepare: model must be a torch.nn.Module, got {type(model).__name__}"
        )
    if not isinstance(both_planes, bool):
        raise _type_error("zrw.fsdp.prepare", "both_planes", "a bool", both_planes)
    model = planes.unwrap_model(model)
    managed = _fsdp_managed(model)
    n = 0
    for mname, mod in model.named_modules():
        names = getattr(mod, "zrw_quantized", None)
        if not names:
            continue
        recipe = get_recipe(mod.recipe)
        for pname in names:
            p = getattr(mod, pname)
            qual = f"{mname}.{pname}" if mname else pname
            if isinstance(p, PreQuantWeight) or (
                is_dtensor(p) and isinstance(p._local_tensor, PreQuantWeight)
            ):
                continue
            if is_dtensor(p.data) and managed:
                raise RuntimeError(
                    f"zrw.fsdp.prepare: parameter '{mname}.{pname}' is already sharded (a "
                    "DTensor): call prepare(model) after zrw.convert and before fully_shard — "
                    "FSDP2 looks up the all-gather extension when it shards a parameter"
                )
            if is_dtensor(p):
                # Tensor parallelism first (the 2-D layout): FSDP2 will shard the local shard.
                check_placements(p, qual)
                inner = PreQuantWeight(p._local_tensor.detach(), recipe, qual, both_planes)
                value = _dtensor_cls().from_local(
                    inner,
                    p.device_mesh,
                    p.placements,
                    run_check=False,
                    shape=p.shape,
                    stride=p.stride(),
                )
            else:
                value = PreQuantWeight(p.data, recipe, qual, both_planes)
            wrapped = nn.Parameter(value, requires_grad=p.requires_grad)
            setattr(mod, pname, wrapped)
            n += 1
    return n
