// Test-only entry points to the NPU adapter: the namespace zrw_npu_test (not zrw's API; zrw's one
// TORCH_LIBRARY(zrw, m) stays in registration.cpp). tests/npu drives them on CPU tensors.
//
// Where they live. This file is compiled into its own library, libzrw_npu_test_ops.so, never into
// zrw._C: `import zrw` registers no zrw_npu_test op. CMake builds it with the adapter's object
// files (zrw_npu_adapter, the very code linked into _C, which registers nothing itself) when
// ZRW_TEST_OPS is ON, the default, into build/test_ops/ of the source tree, outside the package a
// wheel ships; the tests load it with torch.ops.load_library (tests/npu/npu_test_ops.py), as
// PyTorch's tests load theirs.
//
// Why a mirror namespace. The adapter's kernels are registered for PrivateUse1, and CPU tensors
// never dispatch there. The alternatives reach that key but not the adapter's code as it runs:
//  - a fake PrivateUse1 device (torch.utils.rename_privateuse1_backend plus an allocator and
//    aten kernels for it, like torch's openreg test backend) is a backend of its own to build, and
//    a process-wide PrivateUse1 backend inside zrw._C would collide with torch_npu's;
//  - adding PrivateUse1 to the thread-local dispatch keys (torch._C._IncludeDispatchKeyGuard)
//    routes CPU tensors to zrw's PrivateUse1 kernels, but every aten op inside them then goes to
//    PrivateUse1 too and finds no kernel.
// So the same kernel functions are registered, by the same function (impl_mx_npu_kernels), for
// the CPU key of a namespace whose schemas mirror zrw's: argument mapping, layout conversion and
// padding run unchanged; only the dispatch key differs. The tests check that the mirrored schemas
// equal zrw's, and use the include guard (as far as it goes: up to the operator lookup) to check
// that zrw's PrivateUse1 key reaches the adapter.
#include <torch/library.h>

#include "mx_layout.h"
#include "mx_npu.h"

TORCH_LIBRARY(zrw_npu_test, m) {
  // zrw's MX op schemas, verbatim (tests/npu/test_adapter.py compares them with zrw's).
  m.def(
      "mx_quantize(Tensor x, int dim, ScalarType elem_dtype, str scale_mode)"
      " -> (Tensor, Tensor)");
  m.def(
      "mx_quantize_dual(Tensor w, ScalarType elem_dtype, str scale_mode)"
      " -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("mx_quantize_block(Tensor w, ScalarType elem_dtype, str scale_mode) -> (Tensor, Tensor)");
  m.def(
      "mx_quantize_from_master(Tensor master, int dim, ScalarType param_dtype,"
      " ScalarType elem_dtype, str scale_mode) -> (Tensor, Tensor)");
  m.def(
      "mx_quantize_dual_from_master(Tensor master, ScalarType param_dtype,"
      " ScalarType elem_dtype, str scale_mode) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "mx_quantize_block_from_master(Tensor master, ScalarType param_dtype,"
      " ScalarType elem_dtype, str scale_mode) -> (Tensor, Tensor)");
  m.def("mx_dequantize(Tensor data, Tensor scale, int dim, ScalarType out_dtype) -> Tensor");
  m.def(
      "mx_matmul(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, ScalarType out_dtype)"
      " -> Tensor");
  // The shared layout conversions (mx_layout.h).
  m.def("scale_to_paired(Tensor scale, int dim) -> Tensor");
  m.def("scale_from_paired(Tensor paired, int dim, int num_blocks) -> Tensor");
  m.def("pad_k(Tensor data, int k_padded) -> Tensor");
}

TORCH_LIBRARY_IMPL(zrw_npu_test, CPU, m) {
  zrw::npu::impl_mx_npu_kernels(m);
  m.impl("scale_to_paired", &zrw::npu::scale_to_paired);
  m.impl("scale_from_paired", &zrw::npu::scale_from_paired);
  // An op must not return its input: without padding, hand back a copy.
  m.impl("pad_k", [](const at::Tensor& data, int64_t k_padded) {
    const at::Tensor out = zrw::npu::pad_k(data, k_padded);
    return out.is_same(data) ? data.clone() : out;
  });
}
