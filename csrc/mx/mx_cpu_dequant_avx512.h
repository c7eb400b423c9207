// The AVX-512 path of the CPU dequantization loops (mx_cpu_dequant_kernel.cpp includes it inside
// its per-ISA namespace for AVX-512BW builds): the arithmetic of mx_cpu_dequant_avx2.h on 16
// elements per step, with masked loads and stores for a row's tail, so no element takes a scalar
// path. Same values bit for bit: the normal codes rebias the exponent, subnormals are an exact
// int -> float conversion times 2^(emin - M), the NaN/Inf codes are selected last, and the scale
// multiplies in fp32. bf16 output (mx_matmul's BF16 GEMM tiles) keeps the top half of each
// product's bits, written 16 at a time as one 256-bit store: no fp32 staging.
#pragma once

#if !defined(__AVX512BW__) || !defined(ZRW_CPU_ISA)
#error "mx_cpu_dequant_avx512.h is part of an AVX-512 build of mx_cpu_dequant_kernel.cpp"
#endif

#include <immintrin.h>

#include <cstdint>

#include "../common/mx_format.h"

namespace zrw::cpu::ZRW_CPU_ISA::avx512_dequant {

using mx::ElemFormat;

// 16 element bytes (zero-extended to 32-bit lanes) -> their fp32 values.
template <ElemFormat F>
inline __m512 decode16(__m512i byte) {
  using E = mx::Elem<F>;
  const __m512i mag = _mm512_and_si512(byte, _mm512_set1_epi32(0x7F));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(byte, _mm512_set1_epi32(0x80)), 24);
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 23 - E::kMantBits),
                                          _mm512_set1_epi32((127 - E::kBias) << 23));
  const __m512 sub = _mm512_mul_ps(
      _mm512_cvtepi32_ps(mag),
      _mm512_set1_ps(1.0f / static_cast<float>(1 << (E::kMantBits - E::kEminNormal))));
  const __mmask16 is_normal = _mm512_cmpgt_epi32_mask(mag, _mm512_set1_epi32((1 << E::kMantBits) - 1));
  __m512i v = _mm512_mask_mov_epi32(_mm512_castps_si512(sub), is_normal, normal);
  const __m512i nan = _mm512_set1_epi32(0x7FC00000);
  if constexpr (F == ElemFormat::E4M3) {
    v = _mm512_mask_mov_epi32(v, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)), nan);
  } else {
    v = _mm512_mask_mov_epi32(v, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7C)),
                              _mm512_set1_epi32(0x7F800000));
    v = _mm512_mask_mov_epi32(v, _mm512_cmpgt_epi32_mask(mag, _mm512_set1_epi32(0x7C)), nan);
  }
  return _mm512_castsi512_ps(_mm512_or_si512(v, sign));
}

// 16 scale bytes (zero-extended) -> 2^(byte - 127) as fp32 (mx::scale_from_byte).
inline __m512 scale16(__m512i byte) {
  __m512i bits = _mm512_slli_epi32(byte, 23);
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(byte, _mm512_setzero_si512()),
                               _mm512_set1_epi32(0x00400000));
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(byte, _mm512_set1_epi32(0xFF)),
                               _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(bits);
}

inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << n) - 1u);
}

// The first min(n, 16) bytes at p, zero-extended.
inline __m512i load16_bytes(const uint8_t* p, __mmask16 m) {
  return _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p));
}

// The first lanes of m of 16 products to out: fp32, or bf16 bits (the top half of each
// product's bits; exact for the products mx_matmul's BF16 path admits, see DequantizeBf16Fn).
inline void store16(float* out, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(out, m, v); }
inline void store16(uint16_t* out, __m512 v, __mmask16 m) {
  const __m256i hi = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
  _mm256_mask_storeu_epi16(out, m, hi);
}

// out[j] = decode(data[j]) * 2^(scales[j / 32] - 127), j < n.
template <ElemFormat F, typename Out>
void row_blocks(const uint8_t* data, const uint8_t* scales, int64_t n, Out* out) {
  for (int64_t j = 0; j < n; j += 16) {  // 16 divides the block: one scale per step
    const __mmask16 m = tail_mask(n - j);
    const __m512 s = _mm512_set1_ps(mx::scale_from_byte(scales[j / mx::kBlock]));
    store16(out + j, _mm512_mul_ps(decode16<F>(load16_bytes(data + j, m)), s), m);
  }
}

// out[j] = decode(data[j]) * 2^(scales[j] - 127), j < n.
template <ElemFormat F, typename Out>
void per_element(const uint8_t* data, const uint8_t* scales, int64_t n, Out* out) {
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = tail_mask(n - j);
    store16(out + j,
            _mm512_mul_ps(decode16<F>(load16_bytes(data + j, m)),
                          scale16(load16_bytes(scales + j, m))),
            m);
  }
}

}  // namespace zrw::cpu::ZRW_CPU_ISA::avx512_dequant
