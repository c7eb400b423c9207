"""torchao 0.18's ``to_mx`` as an independent oracle of zrw.reference (tests/ops/
test_reference_torchao.py lists where torchao departs from docs/design.md §3). Importing this module
skips the importing test module when torchao is not installed."""

import logging
import warnings

import pytest
import torch

from helpers.quant import as_bytes
from zrw import reference as ref


def _import_torchao_quietly():
    # torchao's import logs a warning per CUDA .so it cannot load and trips a torch pytree
    # deprecation warning: noise on a CPU machine, not a signal for these tests.
    noisy_loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    old_levels = [logger.level for logger in noisy_loggers]
    try:
        for logger in noisy_loggers:
            logger.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
            mx_config = pytest.importorskip("torchao.prototype.mx_formats.config")
    finally:
        for logger, level in zip(noisy_loggers, old_levels):
            logger.setLevel(level)
    return mx_tensor.to_mx, mx_config.ScaleCalculationMode


to_mx, ScaleCalculationMode = _import_torchao_quietly()

TORCHAO_MODE = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL}


def torchao_quantize(x, elem_dtype, scale_mode):
    """(data, scale) from torchao, in the reference's return order."""
    scale, data = to_mx(x, elem_dtype, ref.BLOCK, TORCHAO_MODE[scale_mode])
    return data, scale


def hard_input(rows, cols, dtype, seed):
    """randn with a wide exponent spread plus the blocks where rounding rules are tested hardest.

    Rows differ by up to 2^+-40 and elements by up to 2^+-12 within a row, so blocks see fp8
    subnormals and elements that round to zero. Planted blocks: amax mantissas 1.75 (fits exactly
    under both rules) and 1.7578125 / 1.875 (rceil takes one more exponent, floor saturates), and
    blocks full of exact e4m3/e5m2 ties.
    """
    gen = torch.Generator().manual_seed(seed)
    row_shift = torch.randint(-40, 41, (rows, 1), generator=gen)
    element_shift = torch.randint(-12, 13, (rows, cols), generator=gen)
    x = torch.randn(rows, cols, generator=gen, dtype=torch.float64) * torch.exp2(
        (row_shift + element_shift).double()
    )
    blocks = x.view(rows, cols // ref.BLOCK, ref.BLOCK)
    for index, mantissa in enumerate((1.75, 1.7578125, 1.875, 1.9921875)):
        block, binade = blocks[3 * index, 0], 5 * index
        block.mul_(2.0**binade / block.abs().max())
        block[7] = -mantissa * 2.0**binade  # the amax: every other |element| is <= 2^binade
    # Ties. With amax 2^8, e4m3 elements are the values themselves, and 1 + odd/16 lies halfway
    # between two e4m3 neighbours (step 1/8 in [1, 2)). With amax 2^15, e5m2 elements are the
    # values themselves and 1 + odd/8 is halfway between e5m2 neighbours (step 1/4); the same block
    # under e4m3 is scaled by 2^-7 into e4m3's subnormals, where it holds ties again.
    odd = torch.arange(1, 2 * ref.BLOCK, 2, dtype=torch.float64)
    blocks[1, 1] = 1 + (odd / 16) % 1
    blocks[1, 1, 0] = 2.0**8
    blocks[2, 1] = -(1 + (odd / 8) % 1)
    blocks[2, 1, 0] = 2.0**15
    return x.to(dtype)


def spec_following_blocks(spec_scale, x):
    """Blocks where torchao 0.18 is expected to follow the spec: finite, scale byte not 0x00."""
    blocks = x.reshape(*x.shape[:-1], -1, ref.BLOCK)
    finite = torch.isfinite(blocks).all(dim=-1)
    return finite & (as_bytes(spec_scale) != 0)
