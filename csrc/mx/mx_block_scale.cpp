// mx_expand_block_scale: the per-axis scale that a 32x32 block scale stands for
// (docs/design.md §3). One implementation for every user: the native cache expands a cached 32x32
// weight's scales with it, zrw.ops.expand_block_scale (FSDP2's gathered weights) calls it. Written
// with ATen ops only, so it serves every device (CompositeExplicitAutograd).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../common/checks.h"
#include "mx_block_scale.h"

namespace zrw::mx {

at::Tensor mx_expand_block_scale(const at::Tensor& block_scale, int64_t n, int64_t k, int64_t dim) {
  constexpr const char* op = "zrw.mx_expand_block_scale";
  checks::check_scale_dtype(op, "block_scale", block_scale);
  TORCH_CHECK_VALUE(block_scale.dim() == 2 || block_scale.dim() == 3, op,
                    ": block_scale must be 2-d (ceil(N/32), ceil(K/32)) or 3-d (E, ceil(N/32), "
                    "ceil(K/32)), got shape ",
                    block_scale.sizes());
  TORCH_CHECK_VALUE(n >= 0 && k >= 0, op, ": the weight's N and K must be non-negative, got N=", n,
                    ", K=", k);
  const int64_t d = block_scale.dim();
  const int64_t nb = ceil_div(n, kBlock), kb = ceil_div(k, kBlock);
  TORCH_CHECK_VALUE(block_scale.size(d - 2) == nb && block_scale.size(d - 1) == kb, op,
                    ": block_scale of a weight with N=", n, ", K=", k, " must end in (", nb, ", ",
                    kb, "), got shape ", block_scale.sizes());
  TORCH_CHECK_INDEX(dim == -1 || dim == -2 || dim == d - 1 || dim == d - 2, op,
                    ": dim must be -1 (the forward scale, blocks along K) or -2 (the backward "
                    "scale, blocks along N), got ",
                    dim);
  const bool along_rows = dim == -1 || dim == d - 1;
  // (.., NB, KB) -> (.., N, KB): each tile row repeated 32 times, cut to n rows; or
  // (.., NB, K): each tile column repeated 32 times, cut to k. expand + reshape + clone: one
  // copy, and the clone never keeps the padding rows of the last tile alive.
  const at::Tensor b8 = block_scale.view(at::kByte);
  const at::Tensor e = b8.unsqueeze(along_rows ? d - 1 : d);
  auto sizes = e.sizes().vec();
  sizes[along_rows ? d - 1 : d] = kBlock;
  auto flat = b8.sizes().vec();
  flat[along_rows ? d - 2 : d - 1] *= kBlock;
  return e.expand(sizes)
      .reshape(flat)
      .narrow(along_rows ? d - 2 : d - 1, 0, along_rows ? n : k)
      .clone(at::MemoryFormat::Contiguous)
      .view(at::kFloat8_e8m0fnu);
}

TORCH_LIBRARY_IMPL(zrw, CompositeExplicitAutograd, m) {
  m.impl("mx_expand_block_scale", &mx_expand_block_scale);
}

}  // namespace zrw::mx
