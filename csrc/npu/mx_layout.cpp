// Layout conversions between torch_npu's paired uint8 MX scales and zrw's canonical
// float8_e8m0fnu scales; see mx_layout.h. Plain ATen view/reshape/pad ops only.
#include "mx_layout.h"

#include <algorithm>

#include "../common/mx_format.h"

namespace zrw::npu {
namespace {

int64_t wrap(const char* what, int64_t dim, int64_t ndim) {
  TORCH_CHECK_INDEX(ndim > 0, what, ": a scale needs at least one dimension");
  TORCH_CHECK_INDEX(dim >= -ndim && dim < ndim, what, ": dim must be in [", -ndim, ", ", ndim - 1,
                    "], got ", dim);
  return dim < 0 ? dim + ndim : dim;
}

// The scale's bytes: float8_e8m0fnu and uint8 share their representation (the biased exponent).
at::Tensor as_bytes(const char* what, const at::Tensor& t) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kByte || t.scalar_type() == at::kFloat8_e8m0fnu, what,
                   ": a scale must be torch.uint8 or torch.float8_e8m0fnu, got ", t.scalar_type());
  return t.scalar_type() == at::kByte ? t : t.view(at::kByte);
}

}  // namespace

std::vector<int64_t> paired_scale_shape(at::IntArrayRef canonical_shape, int64_t dim) {
  const int64_t d = wrap("zrw npu paired_scale_shape", dim, canonical_shape.size());
  std::vector<int64_t> shape(canonical_shape.begin(), canonical_shape.end());
  shape[d] = mx::ceil_div(shape[d], 2);
  shape.push_back(2);
  return shape;
}

at::Tensor scale_to_paired(const at::Tensor& scale, int64_t dim) {
  constexpr const char* what = "zrw npu scale_to_paired";
  at::Tensor s = as_bytes(what, scale);
  const int64_t d = wrap(what, dim, s.dim());
  const int64_t nb = s.size(d), pairs = mx::ceil_div(nb, 2);
  if (nb % 2 != 0) {
    // torch_npu pads an odd block count with byte 0x00 (2^-127). Whatever the byte, a padded block
    // only ever scales zero elements; 0x00 keeps 0 * scale = 0 where 0xFF (NaN) would not.
    std::vector<int64_t> pad_shape(s.sizes().begin(), s.sizes().end());
    pad_shape[d] = 1;
    s = at::cat({s, at::zeros(pad_shape, s.options())}, d);
  }
  // (A, 2P, B) -> (A, P, 2, B) -> (A, P, B, 2): block 2i+t lands at [a, i, b, t].
  std::vector<int64_t> split(s.sizes().begin(), s.sizes().end());
  split[d] = pairs;
  split.insert(split.begin() + d + 1, 2);
  return with_standard_strides(s.reshape(split).movedim(d + 1, -1).contiguous());
}

at::Tensor scale_from_paired(const at::Tensor& paired, int64_t dim, int64_t num_blocks) {
  constexpr const char* what = "zrw npu scale_from_paired";
  const at::Tensor p = as_bytes(what, paired);
  TORCH_CHECK_VALUE(p.dim() >= 2 && p.size(-1) == 2, what,
                    ": a paired scale ends in a dim of size 2, got shape ", p.sizes());
  const int64_t d = wrap(what, dim, p.dim() - 1);
  TORCH_CHECK_VALUE(num_blocks >= 0 && p.size(d) == mx::ceil_div(num_blocks, 2), what,
                    ": a paired scale of ", num_blocks, " blocks along dim ", d, " has ",
                    mx::ceil_div(num_blocks, 2), " pairs there, got shape ", p.sizes());
  // (A, P, B, 2) -> (A, P, 2, B) -> (A, 2P, B) -> first num_blocks along d.
  const at::Tensor m = p.movedim(-1, d + 1);
  std::vector<int64_t> merged(m.sizes().begin(), m.sizes().end());
  merged[d] *= 2;
  merged.erase(merged.begin() + d + 1);
  return m.reshape(merged).narrow(d, 0, num_blocks).contiguous().view(at::kFloat8_e8m0fnu);
}

at::Tensor with_standard_strides(const at::Tensor& contiguous) {
  TORCH_INTERNAL_ASSERT(contiguous.is_contiguous());
  std::vector<int64_t> strides(contiguous.dim());
  int64_t stride = 1;
  for (int64_t i = contiguous.dim() - 1; i >= 0; --i) {
    strides[i] = stride;
    stride *= std::max<int64_t>(contiguous.size(i), 1);
  }
  if (contiguous.strides() == at::IntArrayRef(strides)) return contiguous;
  return contiguous.as_strided(contiguous.sizes(), strides, contiguous.storage_offset());
}

bool is_column_major(const at::Tensor& t) {
  return t.dim() == 2 && !t.is_contiguous() && t.t().is_contiguous();
}

at::Tensor pad_k(const at::Tensor& data, int64_t k_padded) {
  TORCH_CHECK_VALUE(data.dim() == 2 && k_padded >= data.size(1),
                    "zrw npu pad_k: expected a 2-d "
                    "operand (R, K) with K <= ",
                    k_padded, ", got shape ", data.sizes());
  const int64_t extra = k_padded - data.size(1);
  if (extra == 0) return data;
  // Padded on the bytes: constant_pad_nd has no float8 kernels on every backend, uint8 it has.
  const at::Tensor bytes = data.view(at::kByte);
  if (is_column_major(data)) {
    // The contiguous (K, R) underneath grows rows; its .t() is again column-major.
    return at::constant_pad_nd(bytes.t(), {0, 0, 0, extra}).t().view(data.scalar_type());
  }
  return at::constant_pad_nd(bytes.contiguous(), {0, extra}).view(data.scalar_type());
}

}  // namespace zrw::npu
