// torch_npu's MX layouts and zrw's canonical ones, converted with plain ATen ops.
//
// Nothing here knows about NPUs: the functions run on any device's tensors (the CPU tests drive
// them directly, through the zrw_npu_test ops), so the NPU adapter and its tests share one copy.
//
// torch_npu's paired scale layout (docs/npu.md §5.5, after the aclnn golden):
// for data blocked along dim d with nb = ceil(D/32) blocks, the scale is uint8 with dim d of size
// ceil(nb/2) and a trailing dim of size 2 appended; block 2i+t sits at [..., i, ..., t]. On the
// tail axis that is "consecutive blocks in pairs", (M, ceil(K/64), 2); on another axis it is the
// golden's (Mb/2, 2, N) -> (Mb/2, N, 2) row-pair interleave, (ceil(M/64), N, 2). An odd block
// count is padded with byte 0x00. zrw's canonical scale is float8_e8m0fnu with dim d of size nb.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace zrw::npu {

// Shape of the paired scale of a canonical scale of `canonical_shape` blocked along `dim`.
std::vector<int64_t> paired_scale_shape(at::IntArrayRef canonical_shape, int64_t dim);

// Canonical scale (float8_e8m0fnu or uint8, any strides), blocked along `dim` -> contiguous uint8
// paired scale (standard strides, see with_standard_strides), odd block counts padded with 0x00.
at::Tensor scale_to_paired(const at::Tensor& scale, int64_t dim);

// Paired scale (uint8 or float8_e8m0fnu, any strides; `dim` counts the canonical dims, i.e.
// without the trailing pair dim) -> contiguous float8_e8m0fnu canonical scale with `num_blocks`
// blocks along `dim` (the pad byte of an odd count is dropped).
at::Tensor scale_from_paired(const at::Tensor& paired, int64_t dim, int64_t num_blocks);

// An MX operand (R, K) blocked along K, widened to (R, k_padded) with zero bytes (+0 in both fp8
// formats), keeping its orientation: a row-major operand stays row-major and a column-major one
// (the .t() of a contiguous (K, R)) stays the .t() of a contiguous (k_padded, R), because
// npu_quant_matmul reads the transpose attribute of each operand from its strides.
at::Tensor pad_k(const at::Tensor& data, int64_t k_padded);

// A contiguous tensor viewed with the strides at::empty would give it. Contiguity ignores the
// stride of a size-1 dim, but op-plugin's transpose attribute reads strides as they are
// (stride(d + 1) == stride(d) * size(d)), so a size-1 dim's arbitrary stride could flip it.
at::Tensor with_standard_strides(const at::Tensor& contiguous);

// Whether a 2-d tensor is the .t() of a contiguous tensor and not contiguous itself (with a size-1
// dim both can hold; zrw then treats it as row-major and pairs its scale that way too, so data and
// scale always agree on the transpose attribute).
bool is_column_major(const at::Tensor& t);

}  // namespace zrw::npu
