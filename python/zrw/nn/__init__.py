"""Training layers on MXFP8 with zero-redundancy weights (docs/design.md §6)."""

from .convert import ConvertSummary, convert, hold_tied_weights  # noqa: F401
from .grouped import MXFusedExperts, MXGroupedLinear, mx_grouped_linear  # noqa: F401
from .linear import MXLinear, mx_linear  # noqa: F401

__all__ = [
    "ConvertSummary",
    "MXFusedExperts",
    "MXGroupedLinear",
    "MXLinear",
    "convert",
    "hold_tied_weights",
    "mx_grouped_linear",
    "mx_linear",
]
