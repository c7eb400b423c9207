"""Saving a model whose weights are released, one tensor at a time.

`model.state_dict()` materializes every released weight from its FP32 master (exact BF16), and
the dict it returns holds them all: the model's BF16 size (2 bytes per converted element) for
as long as the caller keeps it. The calls here never hold more than one materialized weight:

  iter_state_dict(model)          (name, tensor) pairs of model.state_dict(); a released weight
                                  is materialized when its turn comes, and is the caller's to
                                  drop before the next one is made
  save_safetensors(model, path)   a .safetensors file (loadable by safetensors.torch.load_file
                                  and transformers' from_pretrained), written tensor by tensor
  materialize(p, master)          one released weight's exact value (bf16 of its master), as
                                  the zrw layers' state_dict() and pickling also make it

The training grid exported (docs/export.md; zrw.mx_export, whose public names are these): each
converted weight's forward MXFP8 plane, byte for byte, as torchao's MX inference tensor
(MXTensor), the rest of the state dict as it is:

  export_mx(model, path=None)     the state dict with MXTensor weights, or (path) a safetensors
                                  file in torchao's format, written tensor by tensor
  iter_mx_state_dict(model)       its (name, tensor) pairs, one MX weight copied at a time
  load_mx(model, path)            such a file into an unconverted model of the architecture
  save_mx_pretrained(model, dir)  a directory transformers' from_pretrained loads (TorchAoConfig)

Between BF16-free steps (zrw.optim.MasterWeights, the default) the weights stay released: a save
allocates one weight's BF16 bytes at a time, and nothing is restored or re-quantized.
"""

from __future__ import annotations

import os
from typing import Dict, Iterator, Optional, Tuple

import torch
from torch import Tensor

from ._dtensor import is_dtensor
from ._safetensors import (
    DTYPES,
    checked_model,
    checked_path,
    released_master,
    state_plan,
    write_file,
)
from ._safetensors import saved_value as _value  # (the name tests replace to fail a save)

# zrw.frozen and zrw.state_dict (lower levels) hold these; this module is their public home.
from .frozen import FROZEN_MODES, frozen_mode, frozen_values  # noqa: F401
from .mx_export import export_mx, iter_mx_state_dict, load_mx, save_mx_pretrained  # noqa: F401
from .state_dict import (  # noqa: F401
    deferred,
    deferring,
    frozen_error,
    frozen_value,
    materialize,
    warn_frozen_dequant,
)


def iter_state_dict(model: torch.nn.Module) -> Iterator[Tuple[str, Tensor]]:
    """(name, tensor) for every entry of `model.state_dict()`, in its order. A released weight
    is materialized (exactly, from its FP32 master) only when its turn comes; drop it before
    asking for the next to keep at most one in memory. A released weight without a master
    raises a named error when reached. A `model` that is not an nn.Module raises TypeError at
    the call, before anything is iterated."""
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
    safetensors.torch does.
    Every check (dtypes, masters, DTensors) runs before the file is opened, so a refused save
    leaves an existing `path` untouched. Tensors that share storage (tied weights) are written
    once per name. `path` is a str or an os.PathLike giving a str (as safetensors.torch takes;
    a bytes path is refused); its directory must exist. The bytes go to a temporary file of
    the same directory, unique to this call, which replaces `path` atomically (os.replace) once
    complete: concurrent saves to one path (threads or processes) each write their own file,
    and `path` ends as one of them, whole."""
    op = "zrw.checkpoint.save_safetensors"
    model = checked_model(op, model)
    path = checked_path(op, path)
    plan = state_plan(model)
    if metadata is None:
        metadata = {"format": "pt"}  # what safetensors.torch and transformers write
    if not (
        isinstance(metadata, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise TypeError(
            "zrw.checkpoint.save_safetensors: metadata must be a dict of str to str, "
            f"got {metadata!r}"
        )
    header: Dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    names = sorted(plan)
    for name in names:
        t = plan[name]
        if not isinstance(t, Tensor):
            raise TypeError(
                f"zrw.checkpoint.save_safetensors: state-dict entry '{name}' must "
                f"be a tensor, got {type(t).__name__}"
            )
        if is_dtensor(t):
            raise TypeError(
                f"zrw.checkpoint.save_safetensors: '{name}' is a DTensor (a "
                "sharded model); save it with torch.distributed.checkpoint"
            )
        if t.dtype not in DTYPES:
            raise TypeError(
                f"zrw.checkpoint.save_safetensors: '{name}' has dtype {t.dtype}, "
                f"which safetensors cannot hold (supported: "
                f"{', '.join(str(d) for d in DTYPES)})"
            )
        released_master(name, t)  # a released weight without a master: raises before any write
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    write_file(path, header, names, lambda name: _value(name, plan[name]))
