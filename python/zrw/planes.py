"""Low-level types for a weight held as MX planes, and the zrw layer protocol (no imports from
the rest of zrw).

`MXPlane` is one GEMM direction's operand, `MXWeight` a weight's cached MXFP8 copy (both
directions). `MXPlanesCarrier` marks a tensor that carries its weight as MX planes instead of
data (FSDP2's gathered weight, zrw.fsdp.MXGatheredWeight): the layers ask it for its planes
through `mx_weight(need)` and never look at its data. zrw.nn and zrw.fsdp both import this
module; neither imports the other.

A zrw layer is any module that declares what it quantizes (`zrw_quantized`, the names of its
parameters) and how (`recipe`): `is_zrw_layer`. zrw.fsdp, zrw.parallel and zrw.convert read
that protocol, never a layer class.

`unwrap_model` gives the model a `torch.compile` wrapper stands for: every public zrw function
that takes a model calls it first, so that a compiled model is converted, prepared, saved,
exported, loaded and measured as the model itself (its names, hooks and parameters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Optional

import torch
from torch import Tensor
from torch._dynamo.eval_frame import OptimizedModule


@dataclass(frozen=True)
class MXPlane:
    """One GEMM direction's operand: fp8 data and its e8m0 scale (blocks of 32 along one axis).
    A field is None where it is not held (a plane not gathered, a 32x32 scale not expanded)."""

    data: Optional[Tensor]
    scale: Optional[Tensor]

    def __iter__(self):
        return iter((self.data, self.scale))


@dataclass(frozen=True)
class MXWeight:
    """The cached MXFP8 copy of one weight W (N, K) or (E, N, K).

    fwd: data (.., N, K) blocked along K with scale (.., N, ceil(K/32)) — the forward GEMM's
    operand. bwd: data (.., N, K) blocked along N with scale (.., ceil(N/32), K) — dgrad uses
    bwd.data.t(). For "mxfp8-32x32", fwd.data is bwd.data (one FP8 tensor) and block_scale
    (.., ceil(N/32), ceil(K/32)) is set; fwd/bwd scales are its row/column expansions.
    """

    recipe: str
    fwd: MXPlane
    bwd: MXPlane
    block_scale: Optional[Tensor] = None

    @staticmethod
    def from_tensors(recipe: str, tensors: List[Tensor]) -> "MXWeight":
        """From the native cache's list: [data_fwd, scale_fwd, data_bwd, scale_bwd] ("mxfp8")
        or [data, scale_fwd, data, scale_bwd, block_scale] ("mxfp8-32x32")."""
        if recipe == "mxfp8":
            df, sf, db, sb = tensors
            return MXWeight(recipe, MXPlane(df, sf), MXPlane(db, sb))
        data, sf, data_b, sb, block = tensors
        return MXWeight(recipe, MXPlane(data, sf), MXPlane(data_b, sb), block)

    def tensors(self) -> Iterator[Tensor]:
        """The tensors held: fwd.data, fwd.scale, bwd.data, bwd.scale, block_scale, those that
        are None skipped (a tensor both planes share comes twice)."""
        for t in (*self.fwd, *self.bwd, self.block_scale):
            if t is not None:
                yield t


class MXPlanesCarrier:
    """Mixin of a tensor that holds a weight as MX planes instead of data.

    `mx_weight(need)` returns the planes as an MXWeight; `need` ("fwd" or "bwd") names the plane
    the caller is about to read (a carrier may hold only one). `zrw_name` names the weight."""

    zrw_name: str = ""

    def mx_weight(self, need: str) -> MXWeight:  # pragma: no cover - interface
        raise NotImplementedError


def is_zrw_layer(module) -> bool:
    """A module that declares what it quantizes (`zrw_quantized`) and how (`recipe`)."""
    return bool(getattr(module, "zrw_quantized", None)) and hasattr(module, "recipe")


def unwrap_model(model):
    """The module a `torch.compile(model)` wrapper stands for (its `_orig_mod`, through any
    number of wrappers), or `model` itself. The wrapper shares the model's parameters and
    modules, but its names carry the prefix `_orig_mod.` and hooks installed on it are not the
    model's own: zrw works on the model and leaves the wrapper as it is."""
    while isinstance(model, OptimizedModule) and isinstance(
        getattr(model, "_orig_mod", None), torch.nn.Module
    ):
        model = model._orig_mod
    return model
