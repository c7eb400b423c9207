// zrw's NPU kernels for the PrivateUse1 key, apart from the kernel functions (mx_npu.cpp) so that
// those can be linked into another library without registering zrw's kernels a second time.
#include <torch/library.h>

#include "mx_npu.h"

TORCH_LIBRARY_IMPL(zrw, PrivateUse1, m) { zrw::npu::impl_mx_npu_kernels(m); }
