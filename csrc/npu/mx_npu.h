// The NPU adapter: zrw's MX ops on torch_npu's MX operators (mx_npu.cpp).
#pragma once

#include <torch/library.h>

namespace zrw::npu {

// Registers the adapter's kernels for mx_quantize, mx_quantize_dual, mx_quantize_block, their
// *_from_master forms, mx_dequantize and mx_matmul in `m`. Called for zrw's PrivateUse1 key in
// zrw._C (mx_npu_registration.cpp) and, so that the CPU tests run the very same functions, for the
// CPU key of the mirror namespace zrw_npu_test in the test-only library libzrw_npu_test_ops
// (npu_test_ops.cpp), which zrw does not ship.
void impl_mx_npu_kernels(torch::Library& m);

}  // namespace zrw::npu
