// Every zrw op schema, once. Kernels register per backend in their own files
// (TORCH_LIBRARY_IMPL(zrw, CPU, m) in csrc/mx/mx_cpu.cpp, ...); a backend that is not built
// simply has no kernel, and the dispatcher's error names the op and the device.
#include <torch/library.h>

TORCH_LIBRARY(zrw, m) {
  // MX quantization (DESIGN.md §3-§4). Blocks of 32 elements share one float8_e8m0fnu scale.
  m.def("mx_quantize(Tensor x, int dim, ScalarType elem_dtype, str scale_mode) -> (Tensor, Tensor)",
        {at::Tag::pt2_compliant_tag});
  m.def("mx_quantize_dual(Tensor w, ScalarType elem_dtype, str scale_mode)"
        " -> (Tensor, Tensor, Tensor, Tensor)",
        {at::Tag::pt2_compliant_tag});
  m.def("mx_quantize_block(Tensor w, ScalarType elem_dtype, str scale_mode) -> (Tensor, Tensor)",
        {at::Tag::pt2_compliant_tag});
  m.def("mx_dequantize(Tensor data, Tensor scale, int dim, ScalarType out_dtype) -> Tensor",
        {at::Tag::pt2_compliant_tag});
  m.def("mx_matmul(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, ScalarType out_dtype)"
        " -> Tensor",
        {at::Tag::pt2_compliant_tag});
}
