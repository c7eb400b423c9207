"""The MX ops are not differentiable: under grad mode an input that requires grad is refused.

Quantization has no useful derivative of its own (round-to-nearest is flat almost everywhere,
and a straight-through estimate is a modelling choice); the training layers own the gradient
formulas (zrw.nn.MXLinear, MXGroupedLinear: torch.autograd.Functions that call these ops with
grad mode off). Without a kernel at the Autograd key the dispatcher would run the op and only
warn ("autograd kernel was not registered"), and the gradient would silently vanish. The kernel
registered here raises at call time instead, naming the op and the argument; everything else
(no_grad, inputs that do not require grad, inference mode) goes straight to the backend kernels
below autograd, exactly as without it.
"""

import torch
from torch import Tensor

# The ops that compute on MX data. The cache ops (quant_and_release, restore, ...) quantize
# below autograd inside C++ and return fresh FP8 tensors; they are not listed here.
NOT_DIFFERENTIABLE = (
    "mx_quantize",
    "mx_quantize_dual",
    "mx_quantize_block",
    "mx_quantize_from_master",
    "mx_quantize_dual_from_master",
    "mx_quantize_block_from_master",
    "mx_dequantize",
    "mx_matmul",
    "mx_expand_block_scale",
)

_lib = torch.library.Library("zrw", "IMPL")


def _refusing_autograd_kernel(name: str):
    op = getattr(torch.ops.zrw, name).default
    arg_names = [a.name for a in op._schema.arguments]

    def kernel(keyset, *args):
        if torch.is_grad_enabled():
            for arg, value in zip(arg_names, args):
                if isinstance(value, Tensor) and value.requires_grad:
                    raise RuntimeError(
                        f"zrw.{name} is not differentiable, but its argument {arg} requires grad "
                        "(under grad mode): its gradient would silently vanish. Train through "
                        "zrw.nn.MXLinear / MXGroupedLinear or write a torch.autograd.Function "
                        f"whose backward calls zrw ops; or pass {arg}.detach() (or call it "
                        "under torch.no_grad()) if no gradient is wanted"
                    )
        return op.redispatch(keyset & torch._C._after_autograd_keyset, *args)

    return kernel


for _name in NOT_DIFFERENTIABLE:
    _lib.impl(_name, _refusing_autograd_kernel(_name), "Autograd", with_keyset=True)
