// The AVX2 path of the CPU quantization kernel, in intrinsics. Included by
// mx_cpu_quant_kernel.cpp inside its per-ISA namespace when the build targets AVX2 or wider (the
// AVX-512 build takes it for the sources its own path does not cover: fp16, fp32 without or with
// fp16 rounding); the portable strip kernel there stays the path for the base build, and the
// tests check that every build gives the same bytes.
//
// Numerics: the whole MXFP8 encode runs in 16-bit integer lanes (16 per register), on bf16 bit
// patterns:
//
// * Amax: |x| is the bf16 bit pattern with the sign cleared; for non-negative bf16 the integer
//   order is the value order, NaN above Inf (mx::abs_key, on 16 bits), so a block amax is an
//   integer max.
// * Elements: the block scale is a power of two, so x / 2^e is exact in fp32 whenever the result
//   is an fp32 normal, and scaling only moves the exponent. Rounding x's 7-bit mantissa to the
//   element's M bits (nearest, ties to even, carrying into the exponent) therefore gives the
//   element's mantissa for EVERY block scale; the element code is
//       base(x) - ((scale_byte - bias) << M),   base(x) = (|x| + half-1 + lsb) >> (7 - M),
//   clamped to the largest finite code. The subtraction is folded into the rounding add: one
//   per-block (or per-column) constant k = half-1 - ((scale_byte - bias) << 7), and
//       code = (|x| + lsb + k) >>arith (7 - M)
//   (no 16-bit overflow: |x| is at most the block's amax). The two planes of the dual
//   quantization share |x| + lsb and differ only by k.
// * That identity holds while the element is a normal of the element format: code >= 2^M. A
//   zero or bf16-subnormal x gives code <= 0 in every block whose byte is above the bias, and
//   blocks with a byte at or below the bias (amax below ~2^-112), or NaN/Inf blocks (0xFF), get
//   k = -0x8000, which makes every code negative. So one test, "a code below 2^M", finds every
//   run the identity does not cover, and that 32-element run is redone by the exact path
//   (mx::encode_elem_lane's operations on x * 2^-e from the original input, as the portable
//   kernel computes them, 8 fp32 lanes at a time; kElemNaN for 0xFF blocks), so the bytes are
//   the spec's for every input. (On randn data ~0.3% of runs per plane take it: elements 2^14
//   below their block's amax are e4m3 subnormals.)
// * Codes become bytes by packus (negative codes become 0) and a byte min with the largest
//   finite code; the exact-path test runs on those bytes (any byte below 2^M), one test per row
//   and 64 columns for both planes; the sign bits come from a signed-saturating pack of the
//   bf16 patterns themselves (negative -> 0x80), shared by both planes.
// * fp32 and fp16 inputs (fp16 widened exactly to fp32) are taken as "jammed bf16": sign,
//   exponent and the top 7 mantissa bits, with the OR of the 16 dropped bits put into the
//   lowest kept bit. Jamming is monotone, so block amaxes keep their order, exponent and "above
//   1.75" test (both scale rules), and the jammed bit lies below every rounding position used
//   (M <= 3), so nearest-even rounding to M bits sees the same above/at/below-half decision.
// * An FP32 master quantized as its bf16/fp16 parameter (Round::BF16 / Round::F16, the
//   *_from_master ops) is rounded to that dtype as it is loaded: to bf16 by the bias add of
//   mx::f32_to_bf16_bits_rne (a NaN first turned into +Inf, so that the add cannot carry out
//   of its payload: a 0xFF block either way, whose bytes are kElemNaN), to fp16 by
//   vcvtps2ph (IEEE round to nearest even, what torch's conversion runs), whose values are then
//   jammed like an fp16 input. The exact path rounds the master elements the same way (the
//   same bits for every non-NaN, and vcvtps2ph is mx::round_f32_to_f16_value).
//
// Layouts and traversal (the design of mx_cpu_quant_avx512.h, with a block in 2 registers):
// * Amaxes of 16 consecutive blocks along a row come from one reduction tree over their 16
//   registers (each the max of the block's two halves; 4 levels of shuffle + max, ~3
//   instructions per block instead of a horizontal max each); the tree leaves its lanes in a
//   fixed order, which one byte shuffle of the scale bytes undoes. Amaxes down the columns are
//   a vertical max.
// * Blocks along rows only (mx_quantize along the contiguous axis): the rows are streamed in
//   order, 64 blocks (2048 elements) at a time, four trees' amaxes then the codes from L1: one
//   stream per thread for the hardware prefetchers, helped by a software prefetch one group
//   ahead.
// * Blocks down the columns, 32x32 tiles, dual-axis: strips of 32 rows, in chunks of up to
//   2048 columns (128 KiB as 16-bit keys, held in L2). Pass 1 reads the chunk row by row (each
//   row segment one sequential stream, the next row prefetched meanwhile), computes the row
//   blocks' amaxes and the columns' running amaxes, and stages fp32/fp16 inputs as 16-bit keys;
//   pass 2 encodes the chunk from L2, 64 columns x 32 rows at a time (a 64-byte output line per
//   row and plane), while it prefetches the next chunk into L2. Both planes of the dual
//   quantization come from that one read, the plane whose blocks run down the columns written
//   in its final layout (no strided second pass).
// * Partial blocks (K not a multiple of 32) go through a padded copy whose missing elements
//   repeat a real one of the block (the amax is unchanged, as with zeros, and no lane falls to
//   the exact path for them); only the real bytes are copied out.
// * Data planes are written with non-temporal stores (full 64-byte lines) when they are large
//   (they would only evict the input from the caches) and aligned; scales with plain stores.
// * Threads (at::parallel_for) take runs of 64-block groups (rows only) or of strips.
#pragma once

#if !defined(__AVX2__) || !defined(ZRW_CPU_ISA)
#error "mx_cpu_quant_avx2.h is part of an AVX2 (or wider) build of mx_cpu_quant_kernel.cpp"
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#include "../common/mx_format.h"

// Inside the per-ISA namespace: the avx2 and avx512 builds both compile this header, and their
// inline functions must not be merged by the linker (an AVX-512 copy would run on AVX2 CPUs).
namespace zrw::cpu::ZRW_CPU_ISA::avx2_path {

using zrw::mx::ElemFormat;
using zrw::mx::ScaleMode;
using zrw::mx::kBlock;

// The element-format constants of the 16-bit encode (see the header comment).
template <ElemFormat F>
struct Bf16Encode {
  using E = zrw::mx::Elem<F>;
  static constexpr int kShift = 7 - E::kMantBits;  // bf16 mantissa bits dropped
  static constexpr int16_t kHalfMinusOne = (1 << (kShift - 1)) - 1;
  static constexpr int16_t kMinNormalCode = 1 << E::kMantBits;
  static constexpr int16_t kMaxCode =
      ((E::kEmax + E::kBias) << E::kMantBits) | (3 << (E::kMantBits - 2));
};

// Which layouts one pass writes: blocks along the row (per row and 32-column block), 32x32
// tiles (per 32-column block, shared by the strip's rows), blocks down the columns.
enum class BlockKind { None, Row, Tile };

// How fp32 elements are taken: as they are, or first rounded to the parameter dtype (bf16 or
// fp16) as torch converts them (see the header comment).
enum class Round { None, BF16, F16 };

inline __m256i set16(int v) { return _mm256_set1_epi16(static_cast<int16_t>(v)); }
inline __m256i abs16(__m256i x) { return _mm256_and_si256(x, set16(0x7FFF)); }

// Max of the 16 lanes (each <= 0x7FFF) of v: phminposuw on 0x7FFF - v.
inline uint16_t hmax16(__m256i v) {
  const __m128i m = _mm_max_epi16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i flipped = _mm_xor_si128(m, _mm_set1_epi16(0x7FFF));
  return static_cast<uint16_t>(0x7FFF ^ _mm_cvtsi128_si32(_mm_minpos_epu16(flipped)));
}

template <typename T>
inline void prefetch(const T* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}
template <typename T>
inline void prefetch_l2(const T* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
}

// ---- amax keys: the reduction tree ----------------------------------------------------------
// 16 registers (leaves a..p, 16 lanes each) -> one register holding each leaf's max in one lane.
// Level k halves the lanes per leaf and doubles the leaves per register.
inline __m256i fold1(__m256i a, __m256i b) {  // -> [a's 8 | b's 8]
  return _mm256_max_epi16(_mm256_permute2x128_si256(a, b, 0x20),
                          _mm256_permute2x128_si256(a, b, 0x31));
}
inline __m256i fold2(__m256i a, __m256i b) {  // -> per 128-bit lane: [a's 4 | b's 4]
  return _mm256_max_epi16(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b));
}
inline __m256i fold3(__m256i a, __m256i b) {  // -> one 32-bit lane per leaf
  const __m256 fa = _mm256_castsi256_ps(a), fb = _mm256_castsi256_ps(b);
  return _mm256_max_epi16(_mm256_castps_si256(_mm256_shuffle_ps(fa, fb, 0x88)),
                          _mm256_castps_si256(_mm256_shuffle_ps(fa, fb, 0xDD)));
}
inline __m256i fold4(__m256i a, __m256i b) {  // -> one 16-bit lane per leaf
  const __m256i lo = _mm256_max_epi16(a, _mm256_srli_epi32(a, 16));
  const __m256i hi = _mm256_max_epi16(b, _mm256_slli_epi32(b, 16));
  return _mm256_blend_epi16(lo, hi, 0xAA);
}
// The lane of leaf q in the tree's result (followed through the four levels by hand; the tests'
// bytes check it): leaves 0..7 land in the even lanes, 8..15 in the odd ones.
inline __m128i tree_lane_order() {
  return _mm_setr_epi8(0, 8, 2, 10, 4, 12, 6, 14, 1, 9, 3, 11, 5, 13, 7, 15);
}

// The tree over leaves leaf(0..15), evaluated depth first (few registers live at a time).
template <typename Leaf>
inline __m256i tree16(Leaf&& leaf) {
  __m256i h[2];
#pragma GCC unroll 2
  for (int g2 = 0; g2 < 2; ++g2) {
    __m256i f2[2];
#pragma GCC unroll 2
    for (int g1 = 0; g1 < 2; ++g1) {
      const int q = 8 * g2 + 4 * g1;
      const __m256i a = fold1(leaf(q), leaf(q + 1));
      f2[g1] = fold2(a, fold1(leaf(q + 2), leaf(q + 3)));
    }
    h[g2] = fold3(f2[0], f2[1]);
  }
  return fold4(h[0], h[1]);
}

// ---- scales ----------------------------------------------------------------------------------
// E8M0 bytes (in 16-bit lanes) of 16 amax keys: the vector form of mx::scale_byte_from_amax_key
// on bf16 keys (exponent in bits 7..14, mantissa in bits 0..6; "mantissa above 1.75" is
// mantissa > 0x60).
template <ElemFormat F>
inline __m256i scale_bytes(__m256i k, ScaleMode mode) {
  using E = zrw::mx::Elem<F>;
  const __m256i exp = _mm256_srli_epi16(k, 7);
  __m256i e = _mm256_sub_epi16(exp, set16(127 + E::kEmax));
  if (mode == ScaleMode::RCeil) {
    // cmpgt is -1 where the amax mantissa exceeds 1.75: one more power of two.
    e = _mm256_sub_epi16(e, _mm256_cmpgt_epi16(_mm256_and_si256(k, set16(0x7F)), set16(0x60)));
  }
  e = _mm256_max_epi16(_mm256_min_epi16(e, set16(127)), set16(-127));
  __m256i byte = _mm256_add_epi16(e, set16(127));
  // Zero (and bf16 subnormal) amax -> 0x00; NaN/Inf -> 0xFF.
  byte = _mm256_andnot_si256(_mm256_cmpeq_epi16(exp, _mm256_setzero_si256()), byte);
  return _mm256_or_si256(byte, _mm256_and_si256(_mm256_cmpeq_epi16(exp, set16(0xFF)),
                                                set16(0xFF)));
}

// The code constant k of each scale byte (see the header comment): -0x8000 for bytes at or below
// the bias and for 0xFF, which sends all their runs to the exact path.
template <ElemFormat F>
inline __m256i code_consts(__m256i byte) {
  using E = zrw::mx::Elem<F>;
  using C = Bf16Encode<F>;
  const __m256i k = _mm256_sub_epi16(set16(C::kHalfMinusOne),
                                     _mm256_slli_epi16(_mm256_sub_epi16(byte, set16(E::kBias)), 7));
  const __m256i exact = _mm256_or_si256(_mm256_cmpgt_epi16(byte, set16(254)),
                                        _mm256_cmpgt_epi16(set16(E::kBias + 1), byte));
  return _mm256_blendv_epi8(k, set16(-0x8000), exact);
}
template <ElemFormat F>
inline int16_t code_const(uint8_t byte) {
  using E = zrw::mx::Elem<F>;
  using C = Bf16Encode<F>;
  if (byte == zrw::mx::kScaleNaN || byte <= E::kBias) return -0x8000;
  return static_cast<int16_t>(C::kHalfMinusOne - ((byte - E::kBias) << 7));
}

// 16 bytes in 16-bit lanes -> 16 bytes.
inline __m128i narrow16(__m256i v) {
  return _mm_packus_epi16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

// The scales of 16 blocks from the tree's keys (lanes in tree order): bytes in block order into
// scale (the first n) and bytes, and the blocks' code constants into k.
template <ElemFormat F>
inline void tree_scales(__m256i keys, int n, ScaleMode mode, uint8_t* scale, uint8_t* bytes,
                        int16_t* k) {
  const __m128i b8 = _mm_shuffle_epi8(narrow16(scale_bytes<F>(keys, mode)), tree_lane_order());
  if (n == 16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(scale), b8);
  } else {
    alignas(16) uint8_t tmp[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(tmp), b8);
    std::memcpy(scale, tmp, n);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(bytes), b8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(k), code_consts<F>(_mm256_cvtepu8_epi16(b8)));
}

// ---- elements --------------------------------------------------------------------------------
// |x| + lsb: the shared part of the rounding add.
template <ElemFormat F>
inline __m256i round_base(__m256i x) {
  using C = Bf16Encode<F>;
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi16(x, C::kShift), set16(1));
  return _mm256_add_epi16(abs16(x), lsb);
}
// Codes (16-bit lanes) for one code constant (broadcast or per column).
template <ElemFormat F>
inline __m256i codes(__m256i t, __m256i k) {
  return _mm256_srai_epi16(_mm256_add_epi16(t, k), Bf16Encode<F>::kShift);
}
// Sign bytes of 32 elements (in packs order): 0x80 where negative.
inline __m256i sign_bytes(__m256i x0, __m256i x1) {
  return _mm256_and_si256(_mm256_packs_epi16(x0, x1), _mm256_set1_epi8(static_cast<char>(0x80)));
}
// 32 codes -> their bytes clamped to the largest finite code (in pack order: negative codes
// become 0, so a byte below 2^M marks a run for the exact path).
template <ElemFormat F>
inline __m256i clamped_bytes(__m256i c0, __m256i c1) {
  return _mm256_min_epu8(_mm256_packus_epi16(c0, c1), _mm256_set1_epi8(Bf16Encode<F>::kMaxCode));
}
// Clamped bytes + their sign bytes -> 32 element bytes in order.
inline __m256i in_order(__m256i m, __m256i sign) {
  return _mm256_permute4x64_epi64(_mm256_or_si256(m, sign), 0xD8);
}
// Whether any byte of m is below the element format's smallest normal code.
template <ElemFormat F>
inline bool any_low(__m256i m) {
  const __m256i below = _mm256_set1_epi8(Bf16Encode<F>::kMinNormalCode - 1);
  return _mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_min_epu8(m, below), m)) != 0;
}

inline void store32(uint8_t* p, __m256i v, bool nt) {
  if (nt) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), v);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
  }
}

// ---- sources ---------------------------------------------------------------------------------
// 8 fp32 lanes -> 8 jammed bf16 keys in 32-bit lanes: the low half plus 0xFFFF carries into
// bit 16 exactly when a dropped bit is set.
inline __m256i jam8(__m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i carry =
      _mm256_add_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0xFFFF)), _mm256_set1_epi32(0xFFFF));
  return _mm256_srli_epi32(_mm256_or_si256(x, carry), 16);
}

// 8 fp32 lanes -> their bf16 bit patterns in 32-bit lanes, rounded to nearest even as torch
// converts (mx::f32_to_bf16_bits_rne), except that a NaN becomes +Inf first (vminps returns its
// second operand for a NaN; finite values and infinities pass), so that the add cannot carry
// out of a NaN payload: the key is still an exponent-0xFF one, a 0xFF block.
inline __m256i round_bf16_8(__m256 v) {
  const __m256i u = _mm256_castps_si256(
      _mm256_min_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7F800000))));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb),
                           16);
}

// 16 source elements -> 16 keys (bf16 patterns, or jammed bf16 of fp32/fp16 values).
template <Round R>
inline __m256i keys16(const uint16_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline __m256i pack_keys(__m256i a, __m256i b) {
  // packus_epi32 works per 128-bit lane; the permute puts the 16 keys back in order.
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
}
template <Round R>
inline __m256i keys16(const float* p) {
  const __m256 f0 = _mm256_loadu_ps(p), f1 = _mm256_loadu_ps(p + 8);
  if constexpr (R == Round::BF16) {
    return pack_keys(round_bf16_8(f0), round_bf16_8(f1));
  } else if constexpr (R == Round::F16) {
    constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return pack_keys(jam8(_mm256_cvtph_ps(_mm256_cvtps_ph(f0, kRne))),
                     jam8(_mm256_cvtph_ps(_mm256_cvtps_ph(f1, kRne))));
  } else {
    return pack_keys(jam8(f0), jam8(f1));
  }
}
template <Round R>
inline __m256i keys16(const at::Half* p) {
  const __m128i* q = reinterpret_cast<const __m128i*>(p);
  return pack_keys(jam8(_mm256_cvtph_ps(_mm_loadu_si128(q))),
                   jam8(_mm256_cvtph_ps(_mm_loadu_si128(q + 1))));
}

// ---- the exact path --------------------------------------------------------------------------
// 8 input elements as the fp32 values the quantization sees: bf16 (uint16_t bits) and fp16
// widened, fp32 masters first rounded to the parameter dtype (Round::BF16 / F16). A NaN
// master element comes out as Inf (round_bf16_8): its block and column are 0xFF either way, and
// their bytes kElemNaN whatever the value.
template <Round R>
inline __m256 values8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
template <Round R>
inline __m256 values8(const float* p) {
  const __m256 v = _mm256_loadu_ps(p);
  if constexpr (R == Round::BF16) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(round_bf16_8(v), 16));
  } else if constexpr (R == Round::F16) {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    return v;
  }
}
template <Round R>
inline __m256 values8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 2^-e of 8 scale bytes (32-bit lanes): mx::inv_scale_from_byte, vectorized.
inline __m256 inv_scales8(__m256i byte) {
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(254), byte), 23);
  const __m256i b254 = _mm256_cmpeq_epi32(byte, _mm256_set1_epi32(254));
  const __m256i b255 = _mm256_cmpeq_epi32(byte, _mm256_set1_epi32(255));
  __m256i bits = _mm256_blendv_epi8(normal, _mm256_set1_epi32(0x00400000), b254);
  bits = _mm256_andnot_si256(b255, bits);
  return _mm256_castsi256_ps(bits);
}

// mx::encode_elem_lane on 8 lanes (the same operations, so the same codes), kElemNaN where the
// byte is 0xFF.
template <ElemFormat F>
inline __m256i encode8(__m256 v, __m256i byte) {
  using E = zrw::mx::Elem<F>;
  constexpr int kShift = 23 - E::kMantBits;
  constexpr int32_t kHalfMinusOne = (1 << (kShift - 1)) - 1;
  constexpr int32_t kRebias = (127 - E::kBias) << E::kMantBits;
  constexpr int32_t kMaxCode =
      ((E::kEmax + E::kBias) << E::kMantBits) | (3 << (E::kMantBits - 2));
  constexpr int32_t kMinNormalBits = (127 + E::kEminNormal) << 23;
  constexpr int32_t kSmallMagicBits = (127 + E::kEminNormal - E::kMantBits + 23) << 23;
  const __m256i bits = _mm256_castps_si256(_mm256_mul_ps(v, inv_scales8(byte)));
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
  const __m256i abs_bits = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
  const __m256i rounded = _mm256_add_epi32(
      _mm256_add_epi32(abs_bits, _mm256_set1_epi32(kHalfMinusOne)),
      _mm256_and_si256(_mm256_srli_epi32(abs_bits, kShift), _mm256_set1_epi32(1)));
  const __m256i normal_code = _mm256_min_epi32(
      _mm256_sub_epi32(_mm256_srli_epi32(rounded, kShift), _mm256_set1_epi32(kRebias)),
      _mm256_set1_epi32(kMaxCode));
  const __m256i small_code = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(abs_bits),
                                        _mm256_castsi256_ps(_mm256_set1_epi32(kSmallMagicBits)))),
      _mm256_set1_epi32(kSmallMagicBits));
  const __m256i is_normal = _mm256_cmpgt_epi32(abs_bits, _mm256_set1_epi32(kMinNormalBits - 1));
  const __m256i code = _mm256_or_si256(_mm256_blendv_epi8(small_code, normal_code, is_normal), sign);
  return _mm256_blendv_epi8(code, _mm256_set1_epi32(zrw::mx::kElemNaN),
                            _mm256_cmpeq_epi32(byte, _mm256_set1_epi32(0xFF)));
}

// 4 x 8 codes (32-bit lanes) -> 32 bytes in order.
inline __m256i narrow32(const __m256i* c) {
  const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]),
                                        _mm256_packus_epi32(c[2], c[3]));
  return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// The exact path for one 32-element run of a row: every element through x * 2^-e and the
// encode of mx::encode_elem_lane, the way the portable kernel computes it, kElemNaN for 0xFF
// blocks or columns (runs that hold a zero, a subnormal, an element below the format's normal
// range, or a NaN/Inf block). Vectorized: on randn data ~0.3% of each plane's runs come here,
// which a scalar loop made an estimated ~10% of the dual quantization's time.
// blk_out (with the block's byte) and col_out (with the columns' bytes) may be null.
template <ElemFormat F, Round R, typename T>
inline void exact_run(const T* x, uint8_t blk_byte, const uint8_t* col_bytes, uint8_t* blk_out,
                      uint8_t* col_out) {
  __m256 v[4];
  for (int q = 0; q < 4; ++q) v[q] = values8<R>(x + 8 * q);
  __m256i c[4];
  if (blk_out) {
    const __m256i byte = _mm256_set1_epi32(blk_byte);
    for (int q = 0; q < 4; ++q) c[q] = encode8<F>(v[q], byte);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(blk_out), narrow32(c));
  }
  if (col_out) {
    for (int q = 0; q < 4; ++q) {
      const __m256i byte = _mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(col_bytes + 8 * q)));
      c[q] = encode8<F>(v[q], byte);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(col_out), narrow32(c));
  }
}

// A last partial block of `n` elements, padded to 32 with copies of its first element.
template <typename T>
inline void pad_block(const T* src, int n, T* dst) {
  for (int j = 0; j < 32; ++j) dst[j] = src[j < n ? j : 0];
}

// Data planes of at least this many elements get non-temporal stores (what the AVX-512 path
// found; the 16 MiB planes of the benchmark are well above it).
constexpr int64_t kNtMinElems = int64_t{4} << 20;

// ---- blocks along rows only ------------------------------------------------------------------
// A group is up to 64 blocks (2048 elements): four reduction trees, then the codes. Four trees
// before the first code give the out-of-order core independent work for the latency of each
// tree and its scales (with one tree per 512 elements, the next group's loads waited behind the
// codes of the last one: 1.6x the time).
constexpr int kRowGroupBlocks = 64;

struct RowScratch {
  alignas(32) uint16_t stage[kRowGroupBlocks * 32];  // fp32/fp16: the group's keys
  alignas(32) int16_t k[kRowGroupBlocks];
  alignas(32) uint8_t byte[kRowGroupBlocks];
};

// Elements ahead of the current block that the row stream prefetches: one group (1024, 2048
// and 4096 were within the noise of each other on the benchmark's 4096 x 4096 bf16).
constexpr int64_t kRowPrefetch = 2048;

// `nblk` (<= 64) consecutive whole blocks at src (one row's, or a flat run of rows' whose
// length is a multiple of 32) into data/scale. FULL: 64 blocks (compile-time shapes).
template <ElemFormat F, Round R, bool FULL, typename T>
inline void row_group(const T* src, int nblk, ScaleMode mode, uint8_t* data, uint8_t* scale,
                      bool nt, RowScratch& s) {
  constexpr bool kStage = !std::is_same_v<T, uint16_t>;
  if constexpr (FULL) nblk = kRowGroupBlocks;
#pragma GCC unroll 1
  for (int t0 = 0; t0 < nblk; t0 += 16) {
    auto leaf = [&](int i) {
      const int blk = t0 + i;
      if (!FULL && blk >= nblk) return _mm256_setzero_si256();
      const T* p = src + 32 * blk;
      if constexpr (FULL) {
#pragma GCC unroll 2
        for (int q = 0; q < 32; q += 64 / static_cast<int>(sizeof(T))) {
          prefetch(p + q + kRowPrefetch);
        }
      }
      const __m256i x0 = keys16<R>(p), x1 = keys16<R>(p + 16);
      if constexpr (kStage) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(s.stage + 32 * blk), x0);
        _mm256_store_si256(reinterpret_cast<__m256i*>(s.stage + 32 * blk + 16), x1);
      }
      return _mm256_max_epi16(abs16(x0), abs16(x1));
    };
    tree_scales<F>(tree16(leaf), std::min(16, nblk - t0), mode, scale + t0, s.byte + t0,
                   s.k + t0);
  }

  const uint16_t* xs;
  if constexpr (kStage) {
    xs = s.stage;
  } else {
    xs = src;
  }
  auto encode = [&](int blk) {
    const __m256i k = _mm256_set1_epi16(s.k[blk]);
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + 32 * blk));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + 32 * blk + 16));
    const __m256i m = clamped_bytes<F>(codes<F>(round_base<F>(x0), k),
                                       codes<F>(round_base<F>(x1), k));
    if (__builtin_expect(any_low<F>(m), 0)) {
      exact_run<F, R>(src + 32 * blk, s.byte[blk], nullptr, data + 32 * blk, nullptr);
      return;
    }
    store32(data + 32 * blk, in_order(m, sign_bytes(x0, x1)), nt);
  };
  if constexpr (FULL) {
#pragma GCC unroll 4
    for (int blk = 0; blk < kRowGroupBlocks; ++blk) encode(blk);
  } else {
    for (int blk = 0; blk < nblk; ++blk) encode(blk);
  }
}

// Blocks along rows only: `rows` rows of K.
template <ElemFormat F, Round R, typename T>
void quantize_rows(const T* src, int64_t rows, int64_t K, ScaleMode mode, uint8_t* data,
                   uint8_t* scale) {
  constexpr int G = kRowGroupBlocks;
  const int64_t KB = zrw::mx::ceil_div(K, kBlock);
  const bool nt = rows * K >= kNtMinElems && reinterpret_cast<uintptr_t>(data) % 32 == 0;
  if (K % kBlock == 0) {
    // Whole blocks: the rows are one flat run of blocks, in groups of G.
    const int64_t nblocks = rows * KB, ngroups = zrw::mx::ceil_div(nblocks, G);
    at::parallel_for(0, ngroups, 16, [&](int64_t g0, int64_t g1) {
      RowScratch s;
      for (int64_t g = g0; g < g1; ++g) {
        const int n = static_cast<int>(std::min<int64_t>(G, nblocks - G * g));
        const T* x = src + 32 * G * g;
        uint8_t* d = data + 32 * G * g;
        if (n == G) {
          row_group<F, R, true>(x, G, mode, d, scale + G * g, nt, s);
        } else {
          row_group<F, R, false>(x, n, mode, d, scale + G * g, nt, s);
        }
      }
      if (nt) _mm_sfence();
    });
    return;
  }
  // A partial last block in every row: whole blocks row by row, then the padded last block.
  const int64_t kfull = K / kBlock * kBlock;
  const int last = static_cast<int>(K - kfull);
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / K), [&](int64_t r0, int64_t r1) {
    RowScratch s;
    alignas(32) T pad[32];
    alignas(32) uint8_t out[32];
    for (int64_t r = r0; r < r1; ++r) {
      const T* x = src + r * K;
      for (int64_t b0 = 0; b0 < kfull / kBlock; b0 += G) {
        const int n = static_cast<int>(std::min<int64_t>(G, kfull / kBlock - b0));
        row_group<F, R, false>(x + 32 * b0, n, mode, data + r * K + 32 * b0, scale + r * KB + b0,
                               false, s);
      }
      pad_block(x + kfull, last, pad);
      row_group<F, R, false>(pad, 1, mode, out, scale + r * KB + KB - 1, false, s);
      std::memcpy(data + r * K + kfull, out, last);
    }
  });
}

// ---- strips: blocks down the columns, 32x32 tiles, dual-axis --------------------------------
constexpr int kChunkCols = 2048;
constexpr int kChunkBlocks = kChunkCols / 32;

struct StripScratch {
  alignas(32) uint16_t stage[32 * kChunkCols];  // fp32/fp16: the chunk's keys
  alignas(32) uint16_t col_key[kChunkCols];
  alignas(32) int16_t col_k[kChunkCols];
  alignas(32) uint8_t col_byte[kChunkCols];
  alignas(32) int16_t row_k[32][kChunkBlocks];
  alignas(32) uint8_t row_byte[32][kChunkBlocks];
};

// Pass 1 over one row segment: `nblk` (<= 16) whole blocks at p. Row block scale bytes go to
// scale and row_byte/row_k; column keys are maxed into col_key; fp32/fp16 keys into stage.
template <ElemFormat F, Round R, bool ROW, bool COLKEYS, bool FULL, typename T>
inline void row_segment(const T* p, int nblk, ScaleMode mode, uint8_t* scale, int16_t* row_k,
                        uint8_t* row_byte, uint16_t* col_key, uint16_t* stage, int64_t pf) {
  constexpr bool kStage = !std::is_same_v<T, uint16_t>;
  if constexpr (FULL) nblk = 16;
  auto leaf = [&](int blk) {
    if (!FULL && blk >= nblk) return _mm256_setzero_si256();
    const T* x = p + 32 * blk;
    if (FULL && pf) {
#pragma GCC unroll 2
      for (int q = 0; q < 32; q += 64 / static_cast<int>(sizeof(T))) prefetch(x + q + pf);
    }
    const __m256i x0 = keys16<R>(x), x1 = keys16<R>(x + 16);
    if constexpr (kStage) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(stage + 32 * blk), x0);
      _mm256_store_si256(reinterpret_cast<__m256i*>(stage + 32 * blk + 16), x1);
    }
    const __m256i a0 = abs16(x0), a1 = abs16(x1);
    if constexpr (COLKEYS) {
      __m256i* ck = reinterpret_cast<__m256i*>(col_key + 32 * blk);
      _mm256_store_si256(ck, _mm256_max_epi16(_mm256_load_si256(ck), a0));
      _mm256_store_si256(ck + 1, _mm256_max_epi16(_mm256_load_si256(ck + 1), a1));
    }
    return _mm256_max_epi16(a0, a1);
  };
  if constexpr (ROW) {
    tree_scales<F>(tree16(leaf), nblk, mode, scale, row_byte, row_k);
  } else {
    for (int blk = 0; blk < nblk; ++blk) leaf(blk);
  }
}

// One chunk of one strip: rows [0, nrows) (row stride ld) of W columns (a multiple of 32), of
// which the first `wvalid` are real (column scales written for those only). Row scales at
// blk_scale + r * ld_scale, tile and column scales at blk_scale / col_scale; data planes with
// row stride ld_out.
template <ElemFormat F, BlockKind BK, bool COL, Round R, typename T>
void strip_chunk(const T* src, int64_t ld, int nrows, int W, int wvalid, ScaleMode mode,
                 uint8_t* blk_data, uint8_t* blk_scale, int64_t ld_scale, uint8_t* col_data,
                 uint8_t* col_scale, int64_t ld_out, bool nt, bool pf_ok, const T* next,
                 StripScratch& s) {
  constexpr bool kStage = !std::is_same_v<T, uint16_t>;
  constexpr bool kRow = BK == BlockKind::Row;
  constexpr bool kColKeys = COL || BK == BlockKind::Tile;
  const int nbw = W / 32;
  const int64_t pf = pf_ok ? ld : 0;  // the same columns of the next row
  if constexpr (kColKeys) std::memset(s.col_key, 0, sizeof(uint16_t) * W);

  // Pass 1.
  for (int r = 0; r < nrows; ++r) {
    for (int b0 = 0; b0 < nbw; b0 += 16) {
      const int n = std::min(16, nbw - b0);
      const T* p = src + r * ld + 32 * b0;
      uint8_t* sc = kRow ? blk_scale + r * ld_scale + b0 : nullptr;
      uint16_t* st = kStage ? s.stage + r * kChunkCols + 32 * b0 : nullptr;
      if (n == 16) {
        row_segment<F, R, kRow, kColKeys, true>(p, 16, mode, sc, &s.row_k[r][b0],
                                                &s.row_byte[r][b0], s.col_key + 32 * b0, st, pf);
      } else {
        row_segment<F, R, kRow, kColKeys, false>(p, n, mode, sc, &s.row_k[r][b0],
                                                 &s.row_byte[r][b0], s.col_key + 32 * b0, st, 0);
      }
    }
  }

  // Column and tile scales.
  alignas(32) int16_t tile_k[kChunkBlocks];
  alignas(32) uint8_t tile_byte[kChunkBlocks];
  if constexpr (COL) {
    for (int j = 0; j < W; j += 32) {
      __m256i b[2];
      for (int h = 0; h < 2; ++h) {
        b[h] = scale_bytes<F>(
            _mm256_load_si256(reinterpret_cast<const __m256i*>(s.col_key + j + 16 * h)), mode);
        _mm256_store_si256(reinterpret_cast<__m256i*>(s.col_k + j + 16 * h), code_consts<F>(b[h]));
      }
      _mm256_store_si256(reinterpret_cast<__m256i*>(s.col_byte + j),
                         _mm256_permute4x64_epi64(_mm256_packus_epi16(b[0], b[1]), 0xD8));
    }
    std::memcpy(col_scale, s.col_byte, wvalid);
  }
  if constexpr (BK == BlockKind::Tile) {
    for (int b = 0; b < nbw; ++b) {
      const __m256i* ck = reinterpret_cast<const __m256i*>(s.col_key + 32 * b);
      const uint16_t key =
          hmax16(_mm256_max_epi16(_mm256_load_si256(ck), _mm256_load_si256(ck + 1)));
      const uint8_t byte =
          zrw::mx::scale_byte_from_amax_key<F>(static_cast<uint32_t>(key) << 16, mode);
      tile_byte[b] = byte;
      tile_k[b] = code_const<F>(byte);
    }
    std::memcpy(blk_scale, tile_byte, nbw);
  }

  // Pass 2.
  const uint16_t* xs;
  int64_t ldx;
  if constexpr (kStage) {
    xs = s.stage;
    ldx = kChunkCols;
  } else {
    xs = src;
    ldx = ld;
  }
  // One row's NB (1 or 2) blocks of 32 columns from column block b0.
  auto run = [&](int r, int b0, auto nb_tag) {
    constexpr int NB = decltype(nb_tag)::value;
    if (next) {
      // The next chunk streams into L2 while this one is encoded (row r, the same columns),
      // so that memory stays busy during pass 2 (without it, dual-axis on the Zen 3 EPYC: 1.5x
      // a copy instead of 1.1-1.2x).
#pragma GCC unroll 4
      for (int q = 0; q < 32 * NB; q += 64 / static_cast<int>(sizeof(T))) {
        prefetch_l2(next + r * ld + 32 * b0 + q);
      }
    }
    const uint16_t* x = xs + r * ldx + 32 * b0;
    __m256i xv[NB][2], mb[NB], mc[NB], lo[NB];
#pragma GCC unroll 2
    for (int b = 0; b < NB; ++b) {
      const __m256i bk = kRow ? _mm256_set1_epi16(s.row_k[r][b0 + b])
                              : BK == BlockKind::Tile ? _mm256_set1_epi16(tile_k[b0 + b])
                                                      : _mm256_setzero_si256();
      __m256i bc[2], cc[2];
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        xv[b][h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * b + 16 * h));
        const __m256i t = round_base<F>(xv[b][h]);
        if constexpr (BK != BlockKind::None) bc[h] = codes<F>(t, bk);
        if constexpr (COL) {
          cc[h] = codes<F>(t, _mm256_load_si256(reinterpret_cast<const __m256i*>(
                                  s.col_k + 32 * (b0 + b) + 16 * h)));
        }
      }
      if constexpr (BK != BlockKind::None) lo[b] = mb[b] = clamped_bytes<F>(bc[0], bc[1]);
      if constexpr (COL) mc[b] = clamped_bytes<F>(cc[0], cc[1]);
      if constexpr (COL && BK != BlockKind::None) lo[b] = _mm256_min_epu8(mb[b], mc[b]);
      if constexpr (COL && BK == BlockKind::None) lo[b] = mc[b];
    }
    // One test per row and 64 columns for every lane of both planes.
    const bool any_bad = any_low<F>(NB == 2 ? _mm256_min_epu8(lo[0], lo[NB - 1]) : lo[0]);
#pragma GCC unroll 2
    for (int b = 0; b < NB; ++b) {
      const int64_t j = 32 * (b0 + b);
      if (__builtin_expect(any_bad, 0) && any_low<F>(lo[b])) {
        uint8_t byte = 0;
        if constexpr (kRow) byte = s.row_byte[r][b0 + b];
        if constexpr (BK == BlockKind::Tile) byte = tile_byte[b0 + b];
        exact_run<F, R>(src + r * ld + j, byte, s.col_byte + j,
                        BK != BlockKind::None ? blk_data + r * ld_out + j : nullptr,
                        COL ? col_data + r * ld_out + j : nullptr);
        continue;
      }
      const __m256i sign = sign_bytes(xv[b][0], xv[b][1]);
      if constexpr (BK != BlockKind::None) {
        store32(blk_data + r * ld_out + j, in_order(mb[b], sign), nt);
      }
      if constexpr (COL) store32(col_data + r * ld_out + j, in_order(mc[b], sign), nt);
    }
  };
  // Rows outer, 64-column groups inner: each row of the chunk is read from L2 as one
  // sequential stream and both planes' rows are written in order. (Column groups outer, 32 rows
  // inner, measured the same on the AVX-512 machine but 1.2x slower on a Zen 3 EPYC with AVX2
  // only: 32 rows 2*K bytes apart share one L1 set.)
  for (int r = 0; r < nrows; ++r) {
    int b0 = 0;
    for (; b0 + 2 <= nbw; b0 += 2) run(r, b0, std::integral_constant<int, 2>{});
    if (b0 < nbw) run(r, b0, std::integral_constant<int, 1>{});
  }
}

// Strips of 32 rows: blocks down the columns, 32x32 tiles, both axes, for `nmat` matrices
// (N, K) stacked densely (every plane too).
template <ElemFormat F, BlockKind BK, bool COL, Round R, typename T>
void quantize_strips(const T* src, int64_t nmat, int64_t N, int64_t K, ScaleMode mode,
                     uint8_t* blk_data, uint8_t* blk_scale, uint8_t* col_data,
                     uint8_t* col_scale) {
  const int64_t KB = zrw::mx::ceil_div(K, kBlock), NB = zrw::mx::ceil_div(N, kBlock);
  const int64_t total = nmat * NB;
  const int64_t kfull = K / kBlock * kBlock;
  const int tail = static_cast<int>(K - kfull);
  auto aligned = [](const uint8_t* p) { return reinterpret_cast<uintptr_t>(p) % 64 == 0; };
  const bool nt = K % 64 == 0 && aligned(blk_data) && aligned(col_data) &&
                  nmat * N * K >= kNtMinElems;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, kBlock * K));
  at::parallel_for(0, total, grain, [&](int64_t i0, int64_t i1) {
    auto s = std::make_unique<StripScratch>();
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / NB, strip = i % NB, r0 = strip * kBlock;
      const int nrows = static_cast<int>(std::min<int64_t>(kBlock, N - r0));
      const int64_t off = m * N * K + r0 * K;
      uint8_t* bs0 = nullptr;
      int64_t ld_scale = 0;
      if constexpr (BK == BlockKind::Row) {
        bs0 = blk_scale + m * N * KB + r0 * KB;
        ld_scale = KB;
      }
      if constexpr (BK == BlockKind::Tile) bs0 = blk_scale + m * NB * KB + strip * KB;
      uint8_t* cs0 = COL ? col_scale + m * NB * K + strip * K : nullptr;
      for (int64_t c0 = 0; c0 < kfull; c0 += kChunkCols) {
        const int W = static_cast<int>(std::min<int64_t>(kChunkCols, kfull - c0));
        // The chunk this thread takes next (the next strip starts right after this one).
        const T* next = c0 + W < kfull ? src + off + c0 + W
                                       : (i + 1 < i1 ? src + off + nrows * K : nullptr);
        strip_chunk<F, BK, COL, R>(src + off + c0, K, nrows, W, W, mode,
                                   BK != BlockKind::None ? blk_data + off + c0 : nullptr,
                                   bs0 ? bs0 + c0 / kBlock : nullptr, ld_scale,
                                   COL ? col_data + off + c0 : nullptr,
                                   COL ? cs0 + c0 : nullptr, K, nt,
                                   /*pf_ok=*/true, next, *s);
      }
      if (tail == 0) continue;
      // The last partial block: a padded copy (32 x 32), its outputs copied out.
      alignas(32) T pad[32 * 32];
      alignas(32) uint8_t bo[32 * 32], co[32 * 32];
      for (int r = 0; r < nrows; ++r) pad_block(src + off + r * K + kfull, tail, pad + 32 * r);
      strip_chunk<F, BK, COL, R>(pad, 32, nrows, 32, tail, mode, bo,
                                 bs0 ? bs0 + kfull / kBlock : nullptr, ld_scale, co,
                                 COL ? cs0 + kfull : nullptr, 32, false, false,
                                 static_cast<const T*>(nullptr), *s);
      for (int r = 0; r < nrows; ++r) {
        if (BK != BlockKind::None) std::memcpy(blk_data + off + r * K + kfull, bo + 32 * r, tail);
        if (COL) std::memcpy(col_data + off + r * K + kfull, co + 32 * r, tail);
      }
    }
    if (nt) _mm_sfence();
  });
}

}  // namespace zrw::cpu::ZRW_CPU_ISA::avx2_path
