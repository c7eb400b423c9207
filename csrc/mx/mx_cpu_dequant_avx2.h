// The AVX2 path of the CPU dequantization loops (mx_cpu_dequant_kernel.cpp includes it inside
// its per-ISA namespace for AVX2 and wider builds): GCC 12 turns the selects of
// mx::decode_elem_lane into branches and leaves those loops scalar, so the same arithmetic is
// written here with intrinsics, 8 elements per step. Same values bit for bit: the normal codes
// rebias the exponent, subnormals are an exact int -> float conversion times 2^(emin - M), the
// NaN/Inf codes are selected last, and the scale multiplies in fp32.
#pragma once

#if !defined(__AVX2__) || !defined(ZRW_CPU_ISA)
#error "mx_cpu_dequant_avx2.h is part of an AVX2 (or wider) build of mx_cpu_dequant_kernel.cpp"
#endif

#include <immintrin.h>

#include <cstdint>

#include "../common/mx_format.h"

namespace zrw::cpu::ZRW_CPU_ISA::avx2_dequant {

using mx::ElemFormat;

// 8 element bytes (zero-extended to 32-bit lanes) -> their fp32 values.
template <ElemFormat F>
inline __m256 decode8(__m256i byte) {
  using E = mx::Elem<F>;
  const __m256i mag = _mm256_and_si256(byte, _mm256_set1_epi32(0x7F));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(byte, _mm256_set1_epi32(0x80)), 24);
  const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(
      _mm256_slli_epi32(mag, 23 - E::kMantBits), _mm256_set1_epi32((127 - E::kBias) << 23)));
  const __m256 sub = _mm256_mul_ps(
      _mm256_cvtepi32_ps(mag),
      _mm256_set1_ps(1.0f / static_cast<float>(1 << (E::kMantBits - E::kEminNormal))));
  const __m256i is_normal = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32((1 << E::kMantBits) - 1));
  __m256 v = _mm256_blendv_ps(sub, normal, _mm256_castsi256_ps(is_normal));
  const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));
  if constexpr (F == ElemFormat::E4M3) {
    v = _mm256_blendv_ps(
        v, nan, _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F))));
  } else {
    v = _mm256_blendv_ps(
        v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7F800000)),
        _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7C))));
    v = _mm256_blendv_ps(
        v, nan, _mm256_castsi256_ps(_mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7C))));
  }
  return _mm256_or_ps(v, _mm256_castsi256_ps(sign));
}

// 8 scale bytes (zero-extended) -> 2^(byte - 127) as fp32 (mx::scale_from_byte).
inline __m256 scale8(__m256i byte) {
  __m256i bits = _mm256_slli_epi32(byte, 23);
  bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x00400000),
                            _mm256_cmpeq_epi32(byte, _mm256_setzero_si256()));
  bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7FC00000),
                            _mm256_cmpeq_epi32(byte, _mm256_set1_epi32(0xFF)));
  return _mm256_castsi256_ps(bits);
}

inline __m256i load8_bytes(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// 8 products to out: fp32, or bf16 bits (the top half of each product's bits; exact for the
// products mx_matmul's BF16 path admits, see DequantizeBf16Fn).
inline void store8(float* out, __m256 v) { _mm256_storeu_ps(out, v); }
inline void store8(uint16_t* out, __m256 v) {
  const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                   _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)));
}
inline void store1(float* out, float v) { *out = v; }
inline void store1(uint16_t* out, float v) {
  *out = static_cast<uint16_t>(mx::f32_bits(v) >> 16);
}

// out[j] = decode(data[j]) * 2^(scales[j / 32] - 127), j < n.
template <ElemFormat F, typename Out>
void row_blocks(const uint8_t* data, const uint8_t* scales, int64_t n, Out* out) {
  int64_t j = 0;
  for (; j + mx::kBlock <= n; j += mx::kBlock) {
    const __m256 s = _mm256_set1_ps(mx::scale_from_byte(scales[j / mx::kBlock]));
    for (int64_t i = 0; i < mx::kBlock; i += 8) {
      store8(out + j + i, _mm256_mul_ps(decode8<F>(load8_bytes(data + j + i)), s));
    }
  }
  if (j == n) return;
  const float s = mx::scale_from_byte(scales[j / mx::kBlock]);
  for (; j < n; ++j) store1(out + j, mx::decode_elem<F>(data[j]) * s);
}

// out[j] = decode(data[j]) * 2^(scales[j] - 127), j < n.
template <ElemFormat F, typename Out>
void per_element(const uint8_t* data, const uint8_t* scales, int64_t n, Out* out) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    store8(out + j, _mm256_mul_ps(decode8<F>(load8_bytes(data + j)),
                                  scale8(load8_bytes(scales + j))));
  }
  for (; j < n; ++j) store1(out + j, mx::decode_elem<F>(data[j]) * mx::scale_from_byte(scales[j]));
}

}  // namespace zrw::cpu::ZRW_CPU_ISA::avx2_dequant
