// The vector abstraction the CPU kernels are written over, one per instruction set: the kernels
// (mx_cpu_quant_kernel.cpp, mx_cpu_dequant_kernel.cpp) are compiled once per ISA (CMakeLists.txt)
// and include this header inside their per-ISA namespace, so each build gets its own lane count:
//
//   base    8 x 16-bit lanes (128 bits: SSE2 on x86-64, NEON on Arm)
//   avx2    16 lanes (256 bits)
//   avx512  32 lanes (512 bits: one register is one 32-element block)
//
// The vectors are GCC vector extensions (`vector_size`), so the arithmetic, compares, shuffles
// (__builtin_shufflevector) and narrowing (__builtin_convertvector) are written once and lowered
// to each ISA's instructions by the compiler. The few things that are not (a test of any lane,
// non-temporal stores, a NaN-to-Inf min, an in-order pack on SSE2, fp16 conversion) are the
// per-ISA parts at the end of this header.
#pragma once

#if !defined(ZRW_CPU_ISA)
#error "mx_cpu_simd.h is part of a per-ISA build of the CPU kernels"
#endif

#include <cstdint>
#include <utility>

#include "../common/mx_format.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

// Inside the per-ISA namespace: the builds' inline functions must not be merged by the linker
// (an AVX-512 copy would run on AVX2 CPUs).
namespace zrw::cpu::ZRW_CPU_ISA::simd {

#if defined(__AVX512BW__)
constexpr int kLanes = 32;
#elif defined(__AVX2__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif

typedef int16_t V __attribute__((vector_size(2 * kLanes)));  // 16-bit lanes
typedef uint16_t VU __attribute__((vector_size(2 * kLanes)));
typedef uint8_t VB __attribute__((vector_size(kLanes)));  // the lanes as bytes
// The same register as kLanes / 2 32-bit lanes (fp32 arithmetic: the exact path, dequantization,
// fp32 sources), and those lanes narrowed to 16 and 8 bits.
constexpr int kLanes32 = kLanes / 2;
typedef float VF __attribute__((vector_size(2 * kLanes)));
typedef uint32_t VU32 __attribute__((vector_size(2 * kLanes)));
typedef int32_t VI32 __attribute__((vector_size(2 * kLanes)));
typedef uint16_t VH32 __attribute__((vector_size(kLanes)));
typedef uint8_t VB32 __attribute__((vector_size(kLanes / 2)));

template <typename T>
inline T load(const void* p) {
  T v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
template <typename T>
inline void store(void* p, T v) {
  __builtin_memcpy(p, &v, sizeof(v));
}
inline V splat(int v) { return V{} + static_cast<int16_t>(v); }
inline V vmax(V a, V b) { return a > b ? a : b; }
inline V vmin(V a, V b) { return a < b ? a : b; }
// Lanes 0..255 -> bytes.
inline VB narrow(V v) { return __builtin_convertvector(v, VB); }
// Logical shift right of 16-bit lanes.
template <int S>
inline V srl(V v) {
  return reinterpret_cast<V>(reinterpret_cast<VU>(v) >> S);
}

inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

// ---- the per-ISA parts ------------------------------------------------------------------------

// Whether any lane of v is nonzero.
inline bool any(V v) {
#if defined(__AVX512BW__)
  const __m512i x = reinterpret_cast<__m512i>(v);
  return _mm512_test_epi16_mask(x, x) != 0;
#elif defined(__AVX2__)
  const __m256i x = reinterpret_cast<__m256i>(v);
  return !_mm256_testz_si256(x, x);
#else
  typedef uint64_t U64 __attribute__((vector_size(16)));
  const U64 t = reinterpret_cast<U64>(v);
  return (t[0] | t[1]) != 0;
#endif
}

// (GCC 12 reports the pass-through operand of its own AVX-512 narrowing intrinsics as maybe
// uninitialized.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// 32 lanes of 0..255 (32 / kLanes registers) -> 32 bytes at p; non-temporal (`nt`, p aligned to
// 32) where the ISA has such a store.
inline void store_32_bytes(uint8_t* p, const V* c, bool nt) {
#if defined(__AVX512BW__)
  const __m256i b = _mm512_cvtepi16_epi8(reinterpret_cast<__m512i>(c[0]));
#elif defined(__AVX2__)
  const __m256i b = _mm256_permute4x64_epi64(
      _mm256_packus_epi16(reinterpret_cast<__m256i>(c[0]), reinterpret_cast<__m256i>(c[1])), 0xD8);
#endif
#if defined(__AVX2__)
  if (nt) return _mm256_stream_si256(reinterpret_cast<__m256i*>(p), b);
  return _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), b);
#else
  // Two registers to 16 bytes at a time (one pack, one store; not one per 8 bytes).
  static_assert(kLanes == 8, "the base build has 128-bit registers");
  (void)nt;
  typedef int16_t V16 __attribute__((vector_size(32)));
  typedef uint8_t VB16 __attribute__((vector_size(16)));
  for (int h = 0; h < 4; h += 2) {
    const V16 two = __builtin_shufflevector(c[h], c[h + 1], 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                            12, 13, 14, 15);
    store(p + kLanes * h, __builtin_convertvector(two, VB16));
  }
#endif
}
#pragma GCC diagnostic pop

#if defined(__AVX2__) && !defined(__AVX512BW__)
// 32 bytes in packus' order (each 128-bit half of the two source registers interleaved) -> in
// element order at p; non-temporal (`nt`, p aligned to 32).
inline void store_packed_run(uint8_t* p, __m256i b, bool nt) {
  b = _mm256_permute4x64_epi64(b, 0xD8);
  if (nt) return _mm256_stream_si256(reinterpret_cast<__m256i*>(p), b);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), b);
}
#endif

// min(v, +Inf) lane by lane, a NaN lane giving +Inf: x86's minps returns its second operand
// when either is a NaN, so it is one instruction there (the compare-and-select elsewhere has the
// same result).
inline VF nan_to_inf(VF v) {
  const VF inf = reinterpret_cast<VF>(VU32{} + 0x7F800000u);
#if defined(__AVX512BW__)
  return reinterpret_cast<VF>(
      _mm512_min_ps(reinterpret_cast<__m512>(v), reinterpret_cast<__m512>(inf)));
#elif defined(__AVX2__)
  return reinterpret_cast<VF>(
      _mm256_min_ps(reinterpret_cast<__m256>(v), reinterpret_cast<__m256>(inf)));
#elif defined(__SSE2__)
  return reinterpret_cast<VF>(
      _mm_min_ps(reinterpret_cast<__m128>(v), reinterpret_cast<__m128>(inf)));
#else
  return v < inf ? v : inf;
#endif
}

// Two registers of 32-bit lanes (values in -0x8000 .. 0x7FFF) -> one of 16-bit lanes, a's lanes
// then b's: one packssdw on SSE2 (the wider ISAs' packs work per 128-bit chunk: the generic
// conversion there).
template <int... I>
inline V pack_i32(VI32 a, VI32 b, std::integer_sequence<int, I...>) {
#if defined(__SSE2__) && !defined(__AVX2__)
  return reinterpret_cast<V>(
      _mm_packs_epi32(reinterpret_cast<__m128i>(a), reinterpret_cast<__m128i>(b)));
#else
  return __builtin_convertvector(__builtin_shufflevector(a, b, I...), V);
#endif
}
inline V pack_i32(VI32 a, VI32 b) {
  return pack_i32(a, b, std::make_integer_sequence<int, kLanes>{});
}

// Orders the non-temporal stores before what follows (the end of a parallel_for chunk).
inline void store_fence() {
#if defined(__AVX2__)
  _mm_sfence();
#endif
}

// n fp16 values (bits) -> fp32: vcvtph2ps where the build has F16C, else exact scalar code.
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0) return mx::bits_f32(mx::f32_bits(static_cast<float>(m) * 0x1p-24f) | sign);
  if (e == 31) return mx::bits_f32(sign | 0x7F800000u | (m << 13));
  return mx::bits_f32(sign | ((e + 112) << 23) | (m << 13));
}
inline void f16_to_f32(const uint16_t* p, float* out, int n) {
  int j = 0;
#if defined(__F16C__)
  for (; j + 8 <= n; j += 8) {
    _mm256_storeu_ps(out + j,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + j))));
  }
#endif
  for (; j < n; ++j) out[j] = f16_to_f32(p[j]);
}
// n fp32 values rounded to fp16 (nearest even) and back: mx::round_f32_to_f16_value.
inline void round_to_f16(const float* p, float* out, int n) {
  int j = 0;
#if defined(__F16C__)
  for (; j + 8 <= n; j += 8) {
    _mm256_storeu_ps(
        out + j, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(p + j),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
  }
#endif
  for (; j < n; ++j) out[j] = mx::round_f32_to_f16_value(p[j]);
}

}  // namespace zrw::cpu::ZRW_CPU_ISA::simd
