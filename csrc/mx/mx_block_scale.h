#pragma once

#include <ATen/ATen.h>

namespace zrw::mx {

// The per-axis scale of a 32x32-quantized weight with N rows and K columns: dim -1 gives
// (.., N, ceil(K/32)) (forward), dim -2 (.., ceil(N/32), K) (backward).
at::Tensor mx_expand_block_scale(const at::Tensor& block_scale, int64_t n, int64_t k, int64_t dim);

}  // namespace zrw::mx
