// zrw's NPU kernels for the PrivateUse1 key. Only zrw._C compiles this file: the kernel functions
// (mx_npu.cpp) are linked into the test library libzrw_npu_test_ops too, which registers them for
// the CPU key of its own namespace (npu_test_ops.cpp), and which would register zrw's PrivateUse1
// kernels a second time if this block lived with them.
#include <torch/library.h>

#include "mx_npu.h"

TORCH_LIBRARY_IMPL(zrw, PrivateUse1, m) { zrw::npu::impl_mx_npu_kernels(m); }
