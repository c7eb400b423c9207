"""Saving a model whose weights are released, one tensor at a time.

`model.state_dict()` materializes every released weight from its FP32 master (exact BF16) and
holds them all; `iter_state_dict` and `save_safetensors` never hold more than one (`materialize`
makes one released weight's exact value). Between BF16-free steps the weights stay released: a
save allocates one weight's BF16 bytes at a time, and nothing is restored or re-quantized.
The training grid exported as torchao MX tensors (`export_mx`, `iter_mx_state_dict`, `load_mx`,
`save_mx_pretrained`; docs/export.md) is zrw.mx_export's, public here.
"""

from __future__ import annotations

import os
from typing import Dict, Iterator, Optional, Tuple

import torch
from torch import Tensor

from ._safetensors import DTYPES, checked_entry, checked_path, state_plan, write_file
from ._safetensors import saved_value as _value  # (the name tests replace to fail a save)

# zrw.frozen, zrw.state_dict and zrw.mx_export (lower levels) hold these; this is their public home.
from .frozen import FROZEN_MODES, frozen_mode, frozen_values  # noqa: F401
from .mx_export import export_mx, iter_mx_state_dict, load_mx, save_mx_pretrained  # noqa: F401
from .planes import checked_model
from .state_dict import (  # noqa: F401
    deferred,
    deferring,
    frozen_error,
    frozen_value,
    materialize,
    warn_frozen_dequant,
)

__all__ = [
    "FROZEN_MODES",
    "export_mx",
    "frozen_mode",
    "frozen_values",
    "iter_mx_state_dict",
    "iter_state_dict",
    "load_mx",
    "materialize",
    "save_mx_pretrained",
    "save_safetensors",
]


def iter_state_dict(model: torch.nn.Module) -> Iterator[Tuple[str, Tensor]]:
    """(name, tensor) for every entry of `model.state_dict()`, in its order. A released weight
    is materialized (exactly, from its FP32 master) only when its turn comes; drop it before
    asking for the next to keep at most one in memory. A released weight without a master
    raises a named error when reached; a `model` that is not an nn.Module raises at the call."""
    model = checked_model("zrw.checkpoint.iter_state_dict", model)

    def entries() -> Iterator[Tuple[str, Tensor]]:
        for name, t in state_plan(model).items():
            yield name, _value(name, t)

    return entries()


def save_safetensors(
    model: torch.nn.Module, path: "str | os.PathLike", metadata: Optional[Dict[str, str]] = None
) -> None:
    """Write `model.state_dict()` to `path` in the safetensors format, one tensor at a time: a
    released weight is materialized from its FP32 master, written and dropped before the next.
    `metadata` (str to str) goes into the header; None writes {"format": "pt"}, as
    safetensors.torch does. Tied weights are written once per name.

    Every check (dtypes, masters, DTensors) runs before the file is opened, so a refused save
    leaves an existing `path` untouched. `path` is a str or an os.PathLike giving a str (a bytes
    path is refused) in an existing directory. The bytes go to a temporary file of the same
    directory, unique to this call, which replaces `path` atomically once complete: concurrent
    saves to one path (threads or processes) each write their own file, and `path` ends as one
    of them, whole."""
    op = "zrw.checkpoint.save_safetensors"
    model = checked_model(op, model)
    path = checked_path(op, path)
    plan = state_plan(model)
    if metadata is None:
        metadata = {"format": "pt"}  # what safetensors.torch and transformers write
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise TypeError(f"{op}: metadata must be a dict of str to str, got {metadata!r}")
    names = sorted(plan)
    for name in names:
        checked_entry(op, name, plan[name], DTYPES)
    entries = [(name, plan[name].dtype, plan[name].shape) for name in names]
    write_file(path, metadata, entries, lambda name: _value(name, plan[name]))
