"""zrw's optimizers (docs/design.md §5; docs/training.md): `AdamW`, the ready optimizer of
zero-redundancy weights, and the public names of the boundary (zrw.boundary) and of
`MasterWeights` (zrw.master_weights).
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, Iterable, Optional

import torch

from .boundary import attach, detach, has_boundary, register_boundary_callback
from .master_weights import MasterWeights

__all__ = [
    "AdamW",
    "MasterWeights",
    "STATE_DTYPES",
    "adamw_class",
    "attach",
    "detach",
    "has_boundary",
    "register_boundary_callback",
]


# zrw.optim.AdamW(state_dtype=...): the AdamW that steps the masters, by the dtype of its moments.
STATE_DTYPES: Dict[Optional[str], str] = {
    None: "torch.optim.AdamW",
    "fp32": "torch.optim.AdamW",
    "int8": "torchao.optim.AdamW8bit",
    "fp8": "torchao.optim.AdamWFp8",
    "int4": "torchao.optim.AdamW4bit",
}


def adamw_class(state_dtype: Optional[str], kwargs: Optional[Dict[str, Any]] = None) -> type:
    """The optimizer class zrw.optim.AdamW(state_dtype=...) steps its masters with
    (STATE_DTYPES); `kwargs`, the extra keyword arguments meant for it, are checked against its
    signature so that one it does not take is refused by name (torch's foreach / fused /
    capturable with a torchao class, torchao's block_size with torch's)."""
    return _adamw_class("zrw.optim.adamw_class", state_dtype, kwargs)


def _adamw_class(op: str, state_dtype, kwargs) -> type:
    """adamw_class, its errors named for `op` (the function the user called)."""
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"{op}: kwargs must be None or a dict, got {type(kwargs).__name__}")
    if state_dtype is not None and not isinstance(state_dtype, str):
        raise TypeError(
            f"{op}: state_dtype must be None or a str, one of {list(STATE_DTYPES)}, got "
            f"{type(state_dtype).__name__}"
        )
    if state_dtype not in STATE_DTYPES:
        hint = (
            " (torch's AdamW keeps its moments in the masters' dtype, FP32, and torchao has no "
            "BF16-moment AdamW: 'fp8' or 'int8' keep them in 1 byte)"
            if state_dtype in ("bf16", "bfloat16", "fp16", "float16")
            else ""
        )
        raise ValueError(
            f"{op}: state_dtype must be one of {list(STATE_DTYPES)}, got {state_dtype!r}{hint}"
        )
    path = STATE_DTYPES[state_dtype]
    if path == "torch.optim.AdamW":
        cls = torch.optim.AdamW
    else:
        try:
            import torchao.optim as ao  # optional: only the low-bit states need it
        except ImportError as e:
            raise ImportError(
                f"{op}: state_dtype={state_dtype!r} steps the masters with {path}, and "
                f"torchao is not installed ({e}); install torchao, or pass state_dtype=None"
            ) from e
        cls = getattr(ao, path.rsplit(".", 1)[1])
    if kwargs:
        takes = inspect.signature(cls).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in takes.values()):
            extra = sorted(k for k in kwargs if k not in takes)
            if extra:
                own = [k for k, p in takes.items() if p.kind is p.KEYWORD_ONLY]
                raise TypeError(
                    f"{op}: {', '.join(f'{k}=' for k in extra)} is not an argument of {path} "
                    f"(state_dtype={state_dtype!r}); its own keyword arguments: {own}"
                )
    return cls


class AdamW(MasterWeights):
    """torch.optim.AdamW on FP32 masters with the zrw boundary attached on construction: the
    ready optimizer of zero-redundancy weights, with the BF16-free step (keep_released=True).

    Built as torch's AdamW is, `zrw.optim.AdamW(params, lr=..., betas=..., weight_decay=...)`,
    so that the paths that build an optimizer from a class and its keyword arguments work:
    Hugging Face Trainer's `optimizer_cls_and_kwargs=(zrw.optim.AdamW, {"lr": ...})` (param
    groups with and without weight decay), `optimizers=(zrw.optim.AdamW(model.parameters()),
    None)`, accelerate's `prepare`. torch's defaults (lr 1e-3, weight_decay 1e-2).

    `state_dtype` picks the AdamW that steps the masters, and with it the bytes of its two
    moments per weight element (STATE_DTYPES): None or "fp32", torch.optim.AdamW (8 bytes);
    "int8", torchao.optim.AdamW8bit; "fp8", torchao.optim.AdamWFp8 (2 bytes and a 4-byte scale
    per block of 256); "int4", torchao.optim.AdamW4bit (1 byte, a scale per 128). The same
    update rule and defaults; torchao keeps the moments of a tensor with fewer than 4096
    elements, or one not a multiple of its block, in FP32. Further keyword arguments go to that
    class (torch's foreach / fused; torchao's block_size), and one it does not take is refused
    by name. It is `MasterWeights(cls, params, ...)` with the boundary attached: nothing else
    changes (docs/training.md, "Low-bit optimizer states")."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        keep_released: bool = True,
        max_grad_norm: Optional[float] = None,
        state_dtype: Optional[str] = None,
        **kwargs: Any,
    ):
        super().__init__(
            _adamw_class("zrw.optim.AdamW", state_dtype, kwargs),
            params,
            keep_released=keep_released,
            max_grad_norm=max_grad_norm,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            **kwargs,
        )
        attach(self)
