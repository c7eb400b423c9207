"""What zrw.checkpoint and zrw.mx_export share: the state dict entry by entry (a released
weight as itself until its turn, then its exact value) and the safetensors file writer."""

from __future__ import annotations

import json
import math
import os
import struct
import threading
import uuid
from typing import Dict, Optional

import torch
from torch import Tensor

from . import cache
from ._dtensor import is_dtensor, local_tensor
from .frozen import frozen_mode
from .state_dict import deferred, frozen_error, frozen_value, materialize

# safetensors' dtype names (its format: an 8-byte little-endian header length, a JSON header
# naming each tensor's dtype, shape and byte range, then the bytes).
DTYPES = {
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
MX_DTYPES = {**DTYPES, torch.float8_e8m0fnu: "F8_E8M0"}  # with the MX export's scales


def state_plan(model: torch.nn.Module) -> Dict[str, Tensor]:
    """model.state_dict() with each released weight as itself (materialized later)."""
    with deferred():
        return model.state_dict()


def released_master(name: str, t: Tensor) -> Optional[Tensor]:
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


def saved_value(name: str, t: Tensor) -> Tensor:
    """The tensor to save for state-dict entry `name`: a released weight's exact value (a
    frozen weight released for good: its dequantized FP8 copy, as state_dict() gives it),
    else `t` itself (also when it is not a tensor: a module's extra state)."""
    if not isinstance(t, Tensor):
        return t
    master = released_master(name, t)
    if master is not None:
        return materialize(t, master)
    if cache.cache_state(local_tensor(t)) is cache.CacheState.RELEASED_FOR_GOOD:
        return frozen_value(t)
    return t


def checked_entry(op: str, name: str, t, dtypes: dict) -> None:
    """State-dict entry `name` is a tensor a file can hold (not a DTensor, a dtype of
    `dtypes`) and, if released, has a master: refused by name before any write."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: state-dict entry '{name}' must be a tensor, got {type(t).__name__}")
    if is_dtensor(t):
        raise TypeError(
            f"{op}: '{name}' is a DTensor (a sharded model); save it with "
            "torch.distributed.checkpoint"
        )
    if t.dtype not in dtypes:
        raise TypeError(
            f"{op}: '{name}' has dtype {t.dtype}, which safetensors cannot hold (supported: "
            f"{', '.join(str(d) for d in dtypes)})"
        )
    released_master(name, t)


def fspath(op: str, arg: str, value, what: str) -> str:
    """`value`, a str or an os.PathLike giving a str, as a non-empty str naming a `what`
    ("file" or "directory"), or the error that names `arg`."""
    if not isinstance(value, (str, os.PathLike)):
        decode = f" (decode it: os.fsdecode({arg}))" if isinstance(value, bytes) else ""
        raise TypeError(
            f"{op}: {arg} must be a str or an os.PathLike, got {type(value).__name__}{decode}"
        )
    path = os.fspath(value)
    if not isinstance(path, str):
        raise TypeError(
            f"{op}: {arg} must be a str or an os.PathLike giving a str, got an "
            f"os.PathLike giving {type(path).__name__}"
        )
    if not path:
        raise ValueError(f"{op}: {arg} must name a {what}, got ''")
    return path


def checked_path(op: str, path) -> str:
    """`path` as a str naming a file whose directory exists, or the error that names it."""
    path = fspath(op, "path", path, "file")
    if os.path.isdir(path):
        raise ValueError(f"{op}: path must name a file, got the directory {path!r}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{op}: the directory of path {path!r} does not exist ({folder!r})")
    return path


def temporary_name() -> str:
    """A file name unique to this call: process, thread and a random part."""
    return f"zrw-tmp-{os.getpid()}-{threading.get_ident()}-{uuid.uuid4().hex[:12]}"


def write_file(path: str, metadata: Dict[str, str], entries, produce) -> None:
    """Write a safetensors file: `metadata` (if any), then for each (name, dtype, shape) of
    `entries` (checked), in order, the bytes of `produce(name)`, dropped before the next. They
    go to a temporary file beside `path`, unique to this call, that replaces it once complete."""
    header: Dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": MX_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    tmp = f"{path}.{temporary_name()}"
    created = False
    try:
        with open(tmp, "xb") as f:
            created = True
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for name, _, _ in entries:
                value = produce(name)
                data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                f.write(memoryview(data.numpy()))  # no copy of the bytes
                del value, data
        os.replace(tmp, path)
    finally:
        if created and os.path.exists(tmp):
            os.remove(tmp)
