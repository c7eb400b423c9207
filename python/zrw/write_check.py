"""The write check (docs/design.md §5, rule 1): what shows that a parameter was written since
its optimizer's write-back, without reading a released weight's bytes: its signature (version,
dtype, device, shape), a 64-bit digest of its bytes (zrw._C.bits_digest: a write through `.data`
bumps no version but changes it), and a chunked bitwise comparison with its master."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _C

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 20  # elements compared at a time: the check's transient stays small


def tensor_arg(op: str, arg: str, t) -> None:
    """The write check's and the rule of truth's public calls (zrw.cache re-exports them) refuse
    a non-tensor by name."""
    if not isinstance(t, Tensor):
        raise TypeError(f"zrw.cache.{op}: {arg} must be a torch.Tensor, got {type(t).__name__}")


def weight_signature(p: Tensor):
    tensor_arg("weight_signature", "p", p)
    return (p._version, p.dtype, p.device, tuple(p.shape))


def plain_tensor(p: Tensor) -> Optional[Tensor]:
    """The plain tensor holding p's bytes: a wrapper subclass with one inner tensor (FSDP2's
    PreQuantWeight around a rank's shard) is unwrapped; None where there is no single one."""
    while hasattr(p, "__tensor_flatten__"):
        inner, _ = p.__tensor_flatten__()
        if len(inner) != 1:
            return None
        p = getattr(p, inner[0])
    return p


def weight_digest(p: Tensor) -> Optional[int]:
    """A 64-bit digest of p's bytes, or None where it is not taken (not a contiguous CPU
    tensor). Read-only; p must not be released."""
    tensor_arg("weight_digest", "p", p)
    p = plain_tensor(p)
    if p is None or p.device.type != "cpu" or not p.is_contiguous():
        return None
    return _C.bits_digest(p.data_ptr(), p.numel() * p.element_size())


def holds_master(p: Tensor, m: Tensor) -> bool:
    """Whether p's bits are exactly m.to(p.dtype), compared in chunks."""
    tensor_arg("holds_master", "p", p)
    tensor_arg("holds_master", "m", m)
    if p.shape != m.shape or p.device != m.device or p.element_size() not in _BITS:
        return False
    bits = _BITS[p.element_size()]
    pf, mf = p.detach().reshape(-1), m.detach().reshape(-1)
    for i in range(0, pf.numel(), _CHUNK):
        a = pf[i : i + _CHUNK].contiguous()
        b = mf[i : i + _CHUNK].to(p.dtype)
        if not torch.equal(a.view(bits), b.view(bits)):
            return False
    return True
