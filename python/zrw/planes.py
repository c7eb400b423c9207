"""Low-level types for a weight held as MX planes, the zrw layer protocol, and the model
argument every public function that takes a model shares (no imports from the rest of zrw).

`MXPlane` is one GEMM direction's operand, `MXWeight` a weight's cached MXFP8 copy (both
directions). `MXPlanesCarrier` marks a tensor that carries its weight as MX planes instead of
data (FSDP2's gathered weight): the layers ask it for its planes through `mx_weight(need)`.
zrw.nn and zrw.fsdp both import this module; neither imports the other. A zrw layer is any
module that declares what it quantizes (`zrw_quantized`, the names of its parameters) and how
(`recipe`): `is_zrw_layer`; zrw.fsdp, zrw.parallel and zrw.convert read that protocol, never a
layer class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, List, Optional, Tuple

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
    """The cached MXFP8 copy of one weight W (N, K) or (E, N, K). fwd: data blocked along K,
    scale (.., N, ceil(K/32)), the forward GEMM's operand; bwd: data blocked along N, scale
    (.., ceil(N/32), K) (dgrad uses bwd.data.t()). For "mxfp8-32x32", fwd.data is bwd.data and
    block_scale (.., ceil(N/32), ceil(K/32)) is set; the scales are its expansions."""

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
    """Mixin of a tensor that holds a weight as MX planes instead of data: `mx_weight(need)`
    returns them as an MXWeight, `need` ("fwd" or "bwd") naming the plane the caller is about
    to read (a carrier may hold only one). `zrw_name` names the weight."""

    zrw_name: str = ""

    def mx_weight(self, need: str) -> MXWeight:  # pragma: no cover - interface
        raise NotImplementedError


def is_zrw_layer(module) -> bool:
    """A module that declares what it quantizes (`zrw_quantized`) and how (`recipe`)."""
    return bool(getattr(module, "zrw_quantized", None)) and hasattr(module, "recipe")


def unwrap_model(model):
    """The module a `torch.compile(model)` wrapper stands for (its `_orig_mod`, through any
    number of wrappers), or `model` itself. Every public zrw function that takes a model works
    on the model itself, so that a compiled one is converted, prepared, saved, exported, loaded
    and measured with the model's names and hooks; the wrapper is left as it is."""
    while isinstance(model, OptimizedModule) and isinstance(
        getattr(model, "_orig_mod", None), torch.nn.Module
    ):
        model = model._orig_mod
    return model


def checked_model(op: str, model) -> torch.nn.Module:
    """`model`, refused by name unless an nn.Module, unwrapped (`unwrap_model`)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{op}: model must be a torch.nn.Module, got {type(model).__name__}")
    return unwrap_model(model)


def name_list(
    op: str, arg: str, value, what: str, empty: str = "", none_ok: bool = False
) -> Tuple[str, ...]:
    """`value` as a tuple of str: one str is ONE name (never its characters), else an iterable
    of str ({what}); with `empty` (why, after "which every "), names are name parts and an
    empty one is refused.
    Anything else is the error that names `arg` (and says None is allowed where `none_ok`)."""
    if isinstance(value, str):
        value = (value,)
    elif isinstance(value, (bytes, bytearray, dict)) or not isinstance(value, Iterable):
        none = "None, " if none_ok else ""
        raise TypeError(
            f"{op}: {arg} must be {none}a str or an iterable of str ({what}), "
            f"got {type(value).__name__}"
        )
    out = tuple(value)
    for i, v in enumerate(out):
        if not isinstance(v, str):
            kind = "name parts" if empty else "names"
            raise TypeError(
                f"{op}: {arg} must hold str {kind}, got {arg}[{i}] = {v!r} ({type(v).__name__})"
            )
        if empty and not v:
            raise ValueError(f"{op}: {arg}[{i}] is the empty string, which every {empty}")
    return out
