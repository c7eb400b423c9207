// The AVX-512 path of the CPU dequantization loops (mx_cpu_dequant_kernel.cpp includes it inside
// its per-ISA namespace for AVX-512BW builds): the arithmetic of mx_cpu_dequant_avx2.h on 16
// elements per step, with masked loads and stores for a row's tail, so no element takes a scalar
// path. Same values bit for bit: the normal codes rebias the exponent, subnormals are an exact
// int -> float conversion times 2^(emin - M), the NaN/Inf codes are selected last, and the scale
// multiplies in fp32. bf16 output (mx_matmul's BF16 GEMM tiles) is computed in 16-bit lanes,
// 32 elements per step, with no fp32 at all (see "bf16 output" below).
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

// ---- fp32 output: 16 elements per step -----------------------------------------------------

// out[j] = decode(data[j]) * 2^(scales[j / 32] - 127), j < n.
template <ElemFormat F>
void row_blocks(const uint8_t* data, const uint8_t* scales, int64_t n, float* out) {
  for (int64_t j = 0; j < n; j += 16) {  // 16 divides the block: one scale per step
    const __mmask16 m = tail_mask(n - j);
    const __m512 s = _mm512_set1_ps(mx::scale_from_byte(scales[j / mx::kBlock]));
    _mm512_mask_storeu_ps(out + j, m, _mm512_mul_ps(decode16<F>(load16_bytes(data + j, m)), s));
  }
}

// out[j] = decode(data[j]) * 2^(scales[j] - 127), j < n.
template <ElemFormat F>
void per_element(const uint8_t* data, const uint8_t* scales, int64_t n, float* out) {
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = tail_mask(n - j);
    _mm512_mask_storeu_ps(out + j, m,
                          _mm512_mul_ps(decode16<F>(load16_bytes(data + j, m)),
                                        scale16(load16_bytes(scales + j, m))));
  }
}

// ---- bf16 output: 32 elements (one block) per step, in 16-bit lanes -------------------------
// The tiles of mx_matmul's BF16 path, where every product is a normal bf16 value or zero
// (bf16_exact in mx_cpu.cpp), so the product is the element's own bf16 value with its
// exponent moved by the scale: a table lookup (the 128 magnitudes as bf16 bits, four registers,
// two vpermt2w and a blend) and one 16-bit add of (scale - 127) << 7, no fp32 at all. Zeros,
// NaN and Inf codes keep their table value (the add is masked off), as the fp32 product keeps
// them. Outside that precondition the result is not the product (the other ISAs' kernels
// truncate an fp32 product instead); mx_matmul never calls it there.

template <ElemFormat F>
struct MagnitudeTable {
  __m512i t[4];  // entries 0..31, 32..63, 64..95, 96..127: bf16 bits of decode(code)
  MagnitudeTable() {
    alignas(64) uint16_t v[128];
    for (int c = 0; c < 128; ++c) {
      v[c] = static_cast<uint16_t>(mx::f32_bits(mx::decode_elem<F>(static_cast<uint8_t>(c))) >>
                                   16);
    }
    for (int i = 0; i < 4; ++i) t[i] = _mm512_load_si512(v + 32 * i);
  }
};

template <ElemFormat F>
inline const MagnitudeTable<F>& magnitude_table() {
  static const MagnitudeTable<F> table;
  return table;
}

inline __mmask32 tail_mask32(int64_t n) {
  return n >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << n) - 1u);
}

// 32 element bytes (zero-extended to 16-bit lanes) with their exponent offsets (scale - 127,
// shifted into bf16's exponent field) -> the products' bf16 bits.
template <ElemFormat F>
inline __m512i decode32_bf16(__m512i byte, __m512i exp_off, const MagnitudeTable<F>& tab) {
  const __m512i mag = _mm512_and_si512(byte, _mm512_set1_epi16(0x7F));
  const __m512i lo = _mm512_permutex2var_epi16(tab.t[0], mag, tab.t[1]);  // index bit 5 picks
  const __m512i hi = _mm512_permutex2var_epi16(tab.t[2], mag, tab.t[3]);
  const __m512i v = _mm512_mask_mov_epi16(lo, _mm512_test_epi16_mask(mag, _mm512_set1_epi16(0x40)),
                                          hi);
  const __m512i expo = _mm512_and_si512(v, _mm512_set1_epi16(0x7F80));
  const __mmask32 finite_nonzero =
      _mm512_test_epi16_mask(v, v) & _mm512_cmpneq_epi16_mask(expo, _mm512_set1_epi16(0x7F80));
  const __m512i scaled = _mm512_mask_add_epi16(v, finite_nonzero, v, exp_off);
  return _mm512_or_si512(scaled, _mm512_slli_epi16(_mm512_and_si512(byte, _mm512_set1_epi16(0x80)),
                                                   8));
}

inline __m512i load32_bytes(const uint8_t* p, __mmask32 m) {
  return _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(m, p));
}

// out[j] = bf16 bits of decode(data[j]) * 2^(scales[j / 32] - 127), j < n.
template <ElemFormat F>
void row_blocks(const uint8_t* data, const uint8_t* scales, int64_t n, uint16_t* out) {
  const MagnitudeTable<F>& tab = magnitude_table<F>();
  for (int64_t j = 0; j < n; j += mx::kBlock) {
    const __mmask32 m = tail_mask32(n - j);
    const __m512i off = _mm512_set1_epi16(
        static_cast<int16_t>((static_cast<int>(scales[j / mx::kBlock]) - 127) * 128));
    _mm512_mask_storeu_epi16(out + j, m, decode32_bf16<F>(load32_bytes(data + j, m), off, tab));
  }
}

// out[j] = bf16 bits of decode(data[j]) * 2^(scales[j] - 127), j < n.
template <ElemFormat F>
void per_element(const uint8_t* data, const uint8_t* scales, int64_t n, uint16_t* out) {
  const MagnitudeTable<F>& tab = magnitude_table<F>();
  for (int64_t j = 0; j < n; j += 32) {
    const __mmask32 m = tail_mask32(n - j);
    const __m512i off = _mm512_slli_epi16(
        _mm512_sub_epi16(load32_bytes(scales + j, m), _mm512_set1_epi16(127)), 7);
    _mm512_mask_storeu_epi16(out + j, m, decode32_bf16<F>(load32_bytes(data + j, m), off, tab));
  }
}

}  // namespace zrw::cpu::ZRW_CPU_ISA::avx512_dequant
