"""DTensor recognition, shared by zrw.cache (which caches a DTensor weight by its local shard)
and zrw.parallel (which builds on it). torch.distributed.tensor is imported on first use."""
from __future__ import annotations

import torch
from torch import Tensor

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


def local_tensor(t: Tensor) -> Tensor:
    """The tensor zrw's cache works on: a DTensor's local shard (the tensor that owns the rank's
    storage, not a `to_local()` view of it), any other tensor itself."""
    return t._local_tensor if is_dtensor(t) else t
