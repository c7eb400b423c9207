// The CPU dequantization loops, compiled once per instruction set like the quantization kernel
// (see CMakeLists.txt): each element is decoded (mx::decode_elem) and multiplied by its block's
// scale in fp32, the same product as the reference's, and written as fp32 or, for mx_matmul's
// BF16 GEMM tiles, as bf16 bits with no fp32 staging buffer (see DequantizeBf16Fn for when that
// is exact). AVX-512 builds run the intrinsics of mx_cpu_dequant_avx512.h (fp32: 16 elements
// per step; bf16: 32 per step in 16-bit lanes, a table lookup and an exponent add), AVX2 builds
// those of mx_cpu_dequant_avx2.h (8 per step, the fp32 product's top half for bf16); the base
// build the plain loops below.
#include <ATen/ATen.h>

#include "../common/mx_format.h"
#include "mx_cpu_kernels.h"

#ifndef ZRW_CPU_ISA
#error "compile mx_cpu_dequant_kernel.cpp with -DZRW_CPU_ISA=<base|avx2|avx512>"
#endif

#if defined(__AVX512BW__)
#include "mx_cpu_dequant_avx512.h"
#elif defined(__AVX2__)
#include "mx_cpu_dequant_avx2.h"
#endif

namespace zrw::cpu::ZRW_CPU_ISA {
namespace {

using mx::ElemFormat;
using mx::kBlock;

#if defined(__AVX512BW__)
using avx512_dequant::per_element;
using avx512_dequant::row_blocks;
#elif defined(__AVX2__)
using avx2_dequant::per_element;
using avx2_dequant::row_blocks;
#else
inline void store1(float* out, float v) { *out = v; }
inline void store1(uint16_t* out, float v) {
  *out = static_cast<uint16_t>(mx::f32_bits(v) >> 16);
}

template <ElemFormat F, typename Out>
void row_blocks(const uint8_t* data, const uint8_t* scales, int64_t n, Out* out) {
  for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
    const float scale = mx::scale_from_byte(scales[b0 / kBlock]);
    const int64_t m = std::min(kBlock, n - b0);
    for (int64_t j = 0; j < m; ++j) store1(out + b0 + j, mx::decode_elem<F>(data[b0 + j]) * scale);
  }
}

template <ElemFormat F, typename Out>
void per_element(const uint8_t* data, const uint8_t* scales, int64_t n, Out* out) {
  for (int64_t j = 0; j < n; ++j) {
    store1(out + j, mx::decode_elem<F>(data[j]) * mx::scale_from_byte(scales[j]));
  }
}
#endif

template <typename Out>
void row_blocks_any(mx::ElemFormat fmt, const uint8_t* data, const uint8_t* scales, int64_t n,
                    Out* out) {
  if (fmt == ElemFormat::E4M3) {
    row_blocks<ElemFormat::E4M3>(data, scales, n, out);
  } else {
    row_blocks<ElemFormat::E5M2>(data, scales, n, out);
  }
}

template <typename Out>
void per_element_any(mx::ElemFormat fmt, const uint8_t* data, const uint8_t* scales, int64_t n,
                     Out* out) {
  if (fmt == ElemFormat::E4M3) {
    per_element<ElemFormat::E4M3>(data, scales, n, out);
  } else {
    per_element<ElemFormat::E5M2>(data, scales, n, out);
  }
}

}  // namespace

void dequantize_row_blocks(mx::ElemFormat fmt, const uint8_t* data, const uint8_t* scales,
                           int64_t n, float* out) {
  row_blocks_any(fmt, data, scales, n, out);
}

void dequantize_per_element(mx::ElemFormat fmt, const uint8_t* data, const uint8_t* scales,
                            int64_t n, float* out) {
  per_element_any(fmt, data, scales, n, out);
}

void dequantize_row_blocks_bf16(mx::ElemFormat fmt, const uint8_t* data, const uint8_t* scales,
                                int64_t n, uint16_t* out) {
  row_blocks_any(fmt, data, scales, n, out);
}

void dequantize_per_element_bf16(mx::ElemFormat fmt, const uint8_t* data, const uint8_t* scales,
                                 int64_t n, uint16_t* out) {
  per_element_any(fmt, data, scales, n, out);
}

}  // namespace zrw::cpu::ZRW_CPU_ISA
