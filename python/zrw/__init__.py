"""zrw: zero-redundancy weights for MXFP8 training.

Importing zrw loads the C++ extension `zrw._C`, which registers the `torch.ops.zrw.*` ops and
their CPU kernels; `zrw.ops` wraps them one-to-one, `zrw.reference` is their plain-PyTorch spec.
"""

import torch  # noqa: F401  (libtorch is loaded before the extension that links to it)

try:
    from . import _C  # noqa: F401  (registers torch.ops.zrw.*)
except ImportError as e:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "zrw's C++ extension zrw._C could not be loaded "
        f"({e}). Rebuild it against the installed torch: "
        "`pip install --no-build-isolation -e .` from the zrw checkout "
        "(torch must be installed first, e.g. `pip install torch==2.13.0`)."
    ) from e

from . import _fake  # noqa: E402,F401  (fake kernels for torch.compile / FakeTensor)
from . import _autograd  # noqa: E402,F401  (the MX ops refuse inputs that require grad)
from . import _released_queries  # noqa: E402,F401  (is_shared of a released weight: no abort)
from . import config, ops, planes, record, reference  # noqa: E402,F401
from . import cache  # noqa: E402,F401

# The design's entry points for custom layers (docs/design.md §4): zrw.ops.quant_and_release,
# zrw.ops.restore and zrw.ops.restore_all are zrw.cache's calls themselves (one
# implementation). They are bound here, at the package root, so that zrw.ops, the lowest
# layer, imports nothing above it (zrw.cache builds on zrw.ops).
ops.quant_and_release = cache.quant_and_release
ops.restore = cache.restore
ops.restore_all = cache.restore_all
ops.__all__ += ["quant_and_release", "restore", "restore_all"]
from .config import QuantRecipe, get_recipe, recipe_register  # noqa: E402,F401
from .planes import MXWeight  # noqa: E402,F401
from .cache import no_release  # noqa: E402,F401
from . import checkpoint, memory, nn, optim, parallel, telemetry  # noqa: E402,F401
from .nn import convert  # noqa: E402,F401
from .backends import backends  # noqa: E402,F401

__version__ = "0.1.0"

# The public API of the package root; the user-facing modules are reached as attributes too
# (zrw.cache, zrw.optim, zrw.nn, ..., and zrw.fsdp, zrw.rfc, zrw.testing once imported).
__all__ = [
    "MXWeight",
    "QuantRecipe",
    "backends",
    "cache",
    "checkpoint",
    "config",
    "convert",
    "get_recipe",
    "memory",
    "nn",
    "no_release",
    "ops",
    "optim",
    "parallel",
    "recipe_register",
    "reference",
    "telemetry",
]
