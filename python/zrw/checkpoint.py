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

Between BF16-free steps (zrw.optim.MasterWeights, the default) the weights stay released: a save
allocates one weight's BF16 bytes at a time, and nothing is restored or re-quantized.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import uuid
from typing import Dict, Iterator, Optional, Tuple

import torch
from torch import Tensor

from . import cache
from ._dtensor import is_dtensor, local_tensor

# zrw.state_dict (one level down, where the layers' state-dict logic lives) holds these; this
# module is their public home.
from .state_dict import (  # noqa: F401
    FROZEN_MODES,
    deferred,
    deferring,
    frozen_error,
    frozen_mode,
    frozen_value,
    frozen_values,
    materialize,
    warn_frozen_dequant,
)

# safetensors' dtype names (its format: an 8-byte little-endian header length, a JSON header
# naming each tensor's dtype, shape and byte range, then the bytes).
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def _plan(model: torch.nn.Module) -> Dict[str, Tensor]:
    """model.state_dict() with each released weight as itself (materialized later)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"zrw.checkpoint: model must be a torch.nn.Module, got {type(model).__name__}"
        )
    with deferred():
        return model.state_dict()


def _master(name: str, t: Tensor) -> Optional[Tensor]:
    """The FP32 master of state-dict entry `name` if it is a released weight, None if it is
    not released or is a frozen weight released for good that state_dict() would give as its
    dequantized FP8 copy (frozen_values('dequant'), the default). A frozen weight under
    frozen_values('raise'), and any other released weight without a master, raise a named
    error."""
    local = local_tensor(t)
    state = cache.cache_state(local)
    if not state.released:
        return None
    master = cache.master_of(local)
    if master is not None:
        return master
    shown = cache.weight_name(local) or name
    if state is cache.CacheState.RELEASED_FOR_GOOD:
        if frozen_mode() == "raise":
            raise frozen_error("zrw.checkpoint", repr(shown))
        return None
    raise RuntimeError(
        f"zrw.checkpoint: weight '{shown}' ({name}) is released and has no FP32 master to "
        "materialize it from; nothing more was written. Save after the optimizer step with "
        "zrw.optim.MasterWeights, or restore the weights first with "
        "zrw.cache.restore_all('master')"
    )


def _value(name: str, t: Tensor) -> Tensor:
    """The tensor to save for state-dict entry `name`: a released weight's exact value (a
    frozen weight released for good: its dequantized FP8 copy, as state_dict() gives it),
    else `t` itself (also when it is not a tensor: a module's extra state)."""
    if not isinstance(t, Tensor):
        return t
    master = _master(name, t)
    if master is not None:
        return materialize(t, master)
    if cache.cache_state(local_tensor(t)) is cache.CacheState.RELEASED_FOR_GOOD:
        return frozen_value(t)
    return t


def iter_state_dict(model: torch.nn.Module) -> Iterator[Tuple[str, Tensor]]:
    """(name, tensor) for every entry of `model.state_dict()`, in its order. A released weight
    is materialized (exactly, from its FP32 master) only when its turn comes; drop it before
    asking for the next to keep at most one in memory. A released weight without a master
    raises a named error when reached. A `model` that is not an nn.Module raises TypeError at
    the call, before anything is iterated."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"zrw.checkpoint.iter_state_dict: model must be a torch.nn.Module, got "
            f"{type(model).__name__}"
        )

    def entries() -> Iterator[Tuple[str, Tensor]]:
        for name, t in _plan(model).items():
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
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{op}: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"{op}: path must be a str or an os.PathLike, got {type(path).__name__}"
            + (" (decode it: os.fsdecode(path))" if isinstance(path, bytes) else "")
        )
    path = os.fspath(path)
    if not isinstance(path, str):
        raise TypeError(
            f"{op}: path must be a str or an os.PathLike giving a str, got an "
            f"os.PathLike giving {type(path).__name__}"
        )
    if not path:
        raise ValueError(f"{op}: path must name a file, got ''")
    if os.path.isdir(path):
        raise ValueError(f"{op}: path must name a file, got the directory {path!r}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{op}: the directory of path {path!r} does not exist ({folder!r})")
    plan = _plan(model)
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
        if t.dtype not in _DTYPES:
            raise TypeError(
                f"zrw.checkpoint.save_safetensors: '{name}' has dtype {t.dtype}, "
                f"which safetensors cannot hold (supported: "
                f"{', '.join(str(d) for d in _DTYPES)})"
            )
        _master(name, t)  # a released weight without a master: raises before any write
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    # Unique per call (process, thread, and a random part), created exclusively ("xb").
    tmp = f"{path}.zrw-tmp-{os.getpid()}-{threading.get_ident()}-{uuid.uuid4().hex[:12]}"
    created = False
    try:
        with open(tmp, "xb") as f:
            created = True
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for name in names:
                value = _value(name, plan[name])
                data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                f.write(memoryview(data.numpy()))  # no copy of the bytes
                del value, data
        os.replace(tmp, path)
    finally:
        if created and os.path.exists(tmp):
            os.remove(tmp)
