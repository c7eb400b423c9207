"""Which backends and kernels this build of zrw has, and which can run in this process.

``zrw.backends()`` answers from the dispatcher and the installed modules, never from whether a
device is visible (docs/design.md §2): ``cpu`` is always built (the reference backend); ``cuda``
has no kernels yet (listed so that the answer has the same keys everywhere); ``npu``'s adapter
(PrivateUse1 kernels over torch_npu's MX operators, csrc/npu) is built into ``zrw._C`` on every
machine and runs only where torch_npu provides those operators, which ``operators`` reports.
"""

import sys

import torch

from . import _C

__all__ = ["MX_OPS", "NPU_OPERATORS", "backends"]

_QUANTIZE = ("mx_quantize", "mx_quantize_dual", "mx_quantize_block")
MX_OPS = (*_QUANTIZE, *(f"{op}_from_master" for op in _QUANTIZE), "mx_dequantize", "mx_matmul")

# torch_npu's operators that the NPU adapter calls, with the zrw ops that call them: npu:: operators
# of torch_npu 2.13.0, the release for torch 2.13 (tests/npu/test_real_torch_npu.py checks each
# name against its wheel). mx_dequantize uses ATen ops, not npu_anti_mx_quant (docs/npu.md §4.1).
NPU_OPERATORS = {
    "npu_dynamic_mx_quant": (
        "mx_quantize",
        "mx_quantize_dual (float32 weights)",
        "mx_quantize_from_master",
    ),
    "npu_dynamic_mx_quant_with_dual_axis": ("mx_quantize_dual", "mx_quantize_dual_from_master"),
    "npu_dynamic_block_mx_quant": ("mx_quantize_block", "mx_quantize_block_from_master"),
    "npu_quant_matmul": ("mx_matmul",),
}


def _kernels(dispatch_key):
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return [op for op in MX_OPS if has(f"zrw::{op}", dispatch_key)]


def _npu_operator_available(name):
    """Whether npu::<name> is registered with a kernel for the NPU (PrivateUse1) key."""
    qualname = f"npu::{name}"
    try:
        torch._C._dispatch_find_schema_or_throw(qualname, "")
    except RuntimeError:
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "PrivateUse1")


def _torch_npu():
    """torch_npu's version if it has been imported (zrw never imports it), else None."""
    module = sys.modules.get("torch_npu")
    return None if module is None else str(getattr(module, "__version__", "unknown"))


def backends():
    """Which backends and kernels are available: one dict per backend ("cpu", "cuda", "npu")
    with ``available`` (zrw's MX ops can run on that device in this process) and ``kernels``
    (the MX ops with a kernel for it in this build), plus ``cpu["isa"]``, ``cpu["gemm"]``
    (mx_matmul's inner GEMM: "bf16" where the CPU has native BF16 dot products, else "fp32";
    ZRW_CPU_GEMM forces one), ``cpu["native_bf16"]``, ``npu["torch_npu"]`` (its version if
    imported, else None) and ``npu["operators"]`` ({torch_npu operator: available})."""
    npu_kernels = _kernels("PrivateUse1")
    operators = {name: _npu_operator_available(name) for name in NPU_OPERATORS}
    return {
        "cpu": {
            "available": True,
            "kernels": _kernels("CPU"),
            "isa": _C.cpu_isa(),
            "gemm": _C.cpu_gemm(),
            "native_bf16": _C.cpu_native_bf16(),
        },
        "cuda": {"available": bool(_kernels("CUDA")), "kernels": _kernels("CUDA")},
        "npu": {
            # mx_dequantize needs no torch_npu operator, the other four do.
            "available": bool(npu_kernels) and all(operators.values()),
            "kernels": npu_kernels,
            "torch_npu": _torch_npu(),
            "operators": operators,
        },
    }
