"""Storage queries that must answer, not abort, on a weight zrw released.

zrw releases a weight's BF16 storage by freeing it and poisoning it with c10's data-pointer
error (`StorageImpl::release_data_and_set_meta_custom_data_ptr_error_msg_`, see
csrc/cache/weight_cache.cpp): any read or write of the storage's data pointer then throws a
c10::Error that torch's bindings turn into a Python RuntimeError naming the weight.

One binding of torch (checked up to 2.13) does not: `UntypedStorage.is_shared`
(THPStorage_isShared in torch/csrc/StorageSharing.cpp) reads `storage.data_ptr()` to ask the
allocator whether the bytes are mapped shared memory, but has no HANDLE_TH_ERRORS around it,
so the C++ exception escapes into CPython and std::terminate aborts the process (SIGABRT).
`Tensor.is_shared()` and `TypedStorage.is_shared()` / `_is_shared()` all end there, and so
does any library code that asks (torch.multiprocessing, DataLoader pinning, checkpointers).
Every other Tensor and storage query that touches the data pointer raises the named error
(tests/cache/test_released_queries.py checks them all in child processes).

The poison cannot be made softer without letting reads through (c10 checks one flag for every
data-pointer access), so the fix is here, in one place: `torch.UntypedStorage.is_shared` is
replaced at import by `_is_shared` below, which first probes the data pointer through a
binding that does catch the error (`_get_filename`: the same const `data_ptr()` access, no
side effect, no allocation, no copy-on-write materialization). A storage zrw released holds no
memory, so it is not shared: False, on every device. A storage poisoned by someone else keeps
torch's error, now raised instead of aborting (on CUDA torch answers True without reading the
pointer, and still does). Every other storage goes to torch's own is_shared, unchanged.

Known limit: like any read of a weight's data from another thread during a training step (the
Threads guarantee in docs/guarantees.md), a release between the probe and torch's call is a
race in the caller's code.
"""

from __future__ import annotations

import torch

# The prefix of the poison message set by release_storage_locked in csrc/cache/weight_cache.cpp.
RELEASED_PREFIX = "zrw: the BF16 storage of weight '"

_torch_is_shared = torch._C.StorageBase.is_shared


def _is_shared(self) -> bool:
    # Probe with a binding that turns the poison into a RuntimeError (torch's is_shared would
    # let it escape and abort): released by zrw -> False (on every device: it holds no memory
    # to share); poisoned otherwise -> torch's error, except on CUDA, where torch answers
    # without reading the pointer.
    try:
        self._get_filename()
    except RuntimeError as e:
        if str(e).startswith(RELEASED_PREFIX):
            return False
        if self.device.type != "cuda":
            raise
    return _torch_is_shared(self)


_is_shared.__doc__ = _torch_is_shared.__doc__
_is_shared.__name__ = "is_shared"
_is_shared.__qualname__ = "UntypedStorage.is_shared"


def install() -> None:
    """Replace torch.UntypedStorage.is_shared by `_is_shared` (idempotent)."""
    if torch.UntypedStorage.__dict__.get("is_shared") is not _is_shared:
        torch.UntypedStorage.is_shared = _is_shared


install()
