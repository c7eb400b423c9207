// The CPU dequantization loops, compiled once per instruction set like the quantization kernel
// (see CMakeLists.txt): each element is decoded (mx::decode_elem) and multiplied by its block's
// scale in fp32, the same product as the reference's. AVX2 and wider builds run the intrinsics
// of mx_cpu_dequant_avx2.h (~8 elements per step); the base build the plain loops below.
#include <ATen/ATen.h>

#include "../common/mx_format.h"
#include "mx_cpu_kernels.h"

#ifndef ZRW_CPU_ISA
#error "compile mx_cpu_dequant_kernel.cpp with -DZRW_CPU_ISA=<base|avx2|avx512>"
#endif

#if defined(__AVX2__)
#include "mx_cpu_dequant_avx2.h"
#endif

namespace zrw::cpu::ZRW_CPU_ISA {
namespace {

using mx::ElemFormat;
using mx::kBlock;

#if defined(__AVX2__)
using avx2_dequant::per_element;
using avx2_dequant::row_blocks;
#else
template <ElemFormat F>
void row_blocks(const uint8_t* data, const uint8_t* scales, int64_t n, float* out) {
  for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
    const float scale = mx::scale_from_byte(scales[b0 / kBlock]);
    const int64_t m = std::min(kBlock, n - b0);
    for (int64_t j = 0; j < m; ++j) out[b0 + j] = mx::decode_elem<F>(data[b0 + j]) * scale;
  }
}

template <ElemFormat F>
void per_element(const uint8_t* data, const uint8_t* scales, int64_t n, float* out) {
  for (int64_t j = 0; j < n; ++j) {
    out[j] = mx::decode_elem<F>(data[j]) * mx::scale_from_byte(scales[j]);
  }
}
#endif

}  // namespace

void dequantize_row_blocks(mx::ElemFormat fmt, const uint8_t* data, const uint8_t* scales,
                           int64_t n, float* out) {
  if (fmt == ElemFormat::E4M3) {
    row_blocks<ElemFormat::E4M3>(data, scales, n, out);
  } else {
    row_blocks<ElemFormat::E5M2>(data, scales, n, out);
  }
}

void dequantize_per_element(mx::ElemFormat fmt, const uint8_t* data, const uint8_t* scales,
                            int64_t n, float* out) {
  if (fmt == ElemFormat::E4M3) {
    per_element<ElemFormat::E4M3>(data, scales, n, out);
  } else {
    per_element<ElemFormat::E5M2>(data, scales, n, out);
  }
}

}  // namespace zrw::cpu::ZRW_CPU_ISA
