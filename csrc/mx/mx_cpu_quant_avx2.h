// The AVX2 path of the CPU quantization kernel, in intrinsics. Included by
// mx_cpu_quant_kernel.cpp inside its per-ISA namespace when the build targets AVX2 or wider;
// the portable strip kernel there stays the path for the base build, and the tests check that
// every build gives the same bytes.
//
// The whole MXFP8 encode runs in 16-bit integer lanes (16 per register instead of 8 fp32
// lanes), on bf16 bit patterns:
//
// * Amax: |x| is the bf16 bit pattern with the sign cleared; for non-negative bf16 the integer
//   order is the value order, NaN above Inf (mx::abs_key, on 16 bits), so a block amax is an
//   integer max.
// * Elements: the block scale is a power of two, so x / 2^e is exact in fp32 whenever the result
//   is an fp32 normal, and scaling only moves the exponent. Rounding x's 7-bit mantissa to the
//   element's M bits (nearest, ties to even, carrying into the exponent) therefore gives the
//   element's mantissa for EVERY block scale; the element code is
//       base(x) - ((scale_byte - bias) << M),   base(x) = bf16 exponent << M | rounded mantissa,
//   clamped to the largest finite code. The two axes of the dual quantization share base(x)
//   and differ only by that subtraction.
// * That identity holds while the element is a normal of the element format: code >= 2^M, and
//   x itself not a zero or subnormal. Any 32-element run with a lane outside it (zeros,
//   elements more than ~2^14 (E4M3) / 2^29 (E5M2) below their block's amax, NaN/Inf blocks)
//   is redone by the exact scalar path (mx::encode_elem_lane on x * 2^-e from the original
//   input, as the portable kernel does), so the bytes are the spec's for every input.
// * fp32 and fp16 inputs (fp16 widened exactly to fp32) are first staged as "jammed bf16":
//   sign, exponent and the top 7 mantissa bits, with the OR of the 16 dropped bits put into the
//   lowest kept bit. Jamming is monotone, so block amaxes keep their order, exponent and "above
//   1.75" test (both scale rules), and the jammed bit lies below every rounding position used
//   (M <= 3), so nearest-even rounding to M bits sees the same above/at/below-half decision.
// * An FP32 master quantized as its bf16/fp16 parameter (Round::BF16 / Round::F16, the
//   *_from_master ops) is rounded to that dtype while it is staged, in the same registers: to
//   bf16 by the bias add of mx::f32_to_bf16_bits_rne (the staged keys are then the bf16 values
//   themselves, exact, and serve as the exact path's elements too), to fp16 by vcvtps2ph (IEEE
//   round to nearest even, what torch's conversion runs), whose values are then staged like an
//   fp16 input. The fp32 is read once; the rounded tensor exists only chunk by chunk in L1.
#pragma once

#if !defined(__AVX2__) || !defined(ZRW_CPU_ISA)
#error "mx_cpu_quant_avx2.h is part of an AVX2 (or wider) build of mx_cpu_quant_kernel.cpp"
#endif

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
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

// Per-thread buffers for one strip chunk of up to 32 rows x kCols columns.
struct Scratch {
  // 32 x 2048 bf16 = 128 KiB: the chunk stays in L2, and pass 1 reads each row's 4 KiB as one
  // sequential stream (with 256 columns, 512-byte pieces of 32 rows took twice the copy's time).
  static constexpr int64_t kCols = 2048;
  static constexpr int64_t kBlocks = kCols / kBlock;
  alignas(32) uint16_t col_key[kCols];
  alignas(32) int16_t col_off[kCols];
  alignas(32) uint8_t col_byte[kCols];
  // Row keys/offsets/bytes, [row][block]; the tile ones use row 0.
  alignas(32) uint16_t blk_key[kBlock * kBlocks];
  alignas(32) int16_t blk_off[kBlock * kBlocks];
  alignas(32) uint8_t blk_byte[kBlock * kBlocks];
  // fp32/fp16 inputs: a chunk staged as jammed bf16 (or, for Round::BF16, as the rounded bf16).
  alignas(32) uint16_t stage[kBlock * kCols];
  // Round::F16: the chunk's elements rounded to fp16, which the exact path reads.
  alignas(32) at::Half stage_f16[kBlock * kCols];
  // Zero-padded copy of a strip's last partial 32-column block (as 16-bit keys and as the
  // original values), and its outputs.
  alignas(32) uint16_t tail_src[kBlock * kBlock];
  alignas(32) float tail_orig[kBlock * kBlock];
  alignas(32) uint8_t tail_blk[kBlock * kBlock];
  alignas(32) uint8_t tail_col[kBlock * kBlock];
  // Write the element planes with non-temporal stores (large outputs, 32-byte aligned rows):
  // they would only evict the input from the caches.
  bool nt = false;
};

// A 32-byte run of codes into the output.
inline void store_codes(uint8_t* p, __m256i v, bool nt) {
  if (nt) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), v);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
  }
}

inline __m256i abs16(__m256i x) { return _mm256_and_si256(x, _mm256_set1_epi16(0x7FFF)); }

// Max of the 16 lanes (each <= 0x7FFF) of v: phminposuw on 0x7FFF - v.
inline uint16_t hmax16(__m256i v) {
  const __m128i m = _mm_max_epi16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i flipped = _mm_xor_si128(m, _mm_set1_epi16(0x7FFF));
  return static_cast<uint16_t>(0x7FFF ^ _mm_cvtsi128_si32(_mm_minpos_epu16(flipped)));
}

// Scale bytes (E8M0) and element-code offsets of `n` (a multiple of 32) amax keys, 16 at a
// time: the vector form of mx::scale_byte_from_amax_key on bf16 keys (exponent in bits 7..14,
// mantissa in bits 0..6; "mantissa above 1.75" is mantissa > 0x60). True if any byte is 0xFF.
template <ElemFormat F>
inline bool scales_from_keys(const uint16_t* keys, int64_t n, ScaleMode mode, uint8_t* bytes,
                             int16_t* offs) {
  using E = zrw::mx::Elem<F>;
  const __m256i exp_max = _mm256_set1_epi16(0xFF);
  __m256i any_nan = _mm256_setzero_si256();
  for (int64_t i = 0; i < n; i += 32) {
    __m256i b[2];
    for (int h = 0; h < 2; ++h) {
      const __m256i k =
          _mm256_load_si256(reinterpret_cast<const __m256i*>(keys + i + 16 * h));
      const __m256i exp = _mm256_srli_epi16(k, 7);
      __m256i e = _mm256_sub_epi16(exp, _mm256_set1_epi16(127 + E::kEmax));
      if (mode == ScaleMode::RCeil) {
        // cmpgt is -1 where the amax mantissa exceeds 1.75: one more power of two.
        e = _mm256_sub_epi16(e, _mm256_cmpgt_epi16(_mm256_and_si256(k, _mm256_set1_epi16(0x7F)),
                                                   _mm256_set1_epi16(0x60)));
      }
      e = _mm256_max_epi16(_mm256_min_epi16(e, _mm256_set1_epi16(127)),
                           _mm256_set1_epi16(-127));
      __m256i byte = _mm256_add_epi16(e, _mm256_set1_epi16(127));
      // Zero (and bf16 subnormal) amax -> 0x00; NaN/Inf -> 0xFF.
      byte = _mm256_andnot_si256(_mm256_cmpeq_epi16(exp, _mm256_setzero_si256()), byte);
      const __m256i nan = _mm256_cmpeq_epi16(exp, exp_max);
      any_nan = _mm256_or_si256(any_nan, nan);
      byte = _mm256_blendv_epi8(byte, exp_max, nan);
      _mm256_store_si256(reinterpret_cast<__m256i*>(offs + i + 16 * h),
                         _mm256_slli_epi16(_mm256_sub_epi16(byte, _mm256_set1_epi16(E::kBias)),
                                           E::kMantBits));
      b[h] = byte;
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(bytes + i),
                       _mm256_permute4x64_epi64(_mm256_packus_epi16(b[0], b[1]), 0xD8));
  }
  return !_mm256_testz_si256(any_nan, any_nan);
}

// 2^-e for a scale byte, as the portable kernel multiplies by it.
inline float inv_scale(uint8_t byte) { return zrw::mx::inv_scale_from_byte(byte); }

// Input elements as fp32: bf16 travels as its bit pattern (uint16_t).
inline float to_float(uint16_t bf16_bits) {
  return zrw::mx::bits_f32(static_cast<uint32_t>(bf16_bits) << 16);
}
inline float to_float(float x) { return x; }
inline float to_float(at::Half x) { return static_cast<float>(x); }

// A chunk is read row by row (the staging of fp32/fp16 inputs, or pass 1 of a bf16 chunk), 32
// rows K elements apart. Each 64-byte step asks for the line `dist` elements further, into L2:
// the same columns of the next row, so that the next row segment streams in while this one is
// processed (the last row's points into the next strip, which comes next for K <= kCols; a
// prefetch never faults).
template <typename T>
inline void prefetch_ahead(const T* x, int64_t dist) {
  _mm_prefetch(reinterpret_cast<const char*>(x + dist), _MM_HINT_T1);
}

// The exact path for one 32-element run of a row of original input elements: every element
// through x * 2^-e and mx::encode_elem_lane, the way the portable kernel computes it.
template <ElemFormat F, BlockKind BK, bool COL, typename T>
inline void encode_run_exact(const T* x, uint8_t blk_byte, const uint8_t* col_byte,
                             uint8_t* blk_out, uint8_t* col_out) {
  const float blk_inv = inv_scale(blk_byte);
  for (int j = 0; j < kBlock; ++j) {
    const float v = to_float(x[j]);
    if constexpr (BK != BlockKind::None) {
      blk_out[j] = static_cast<uint8_t>(zrw::mx::encode_elem_lane<F>(v * blk_inv));
    }
    if constexpr (COL) {
      col_out[j] = static_cast<uint8_t>(zrw::mx::encode_elem_lane<F>(v * inv_scale(col_byte[j])));
    }
  }
}

// One chunk: `nrows` (<= 32) rows of `ncols` (a multiple of 32, <= Scratch::kCols) columns
// of bf16 (or jammed bf16) keys at `src` (row stride `ld`) and of the original elements at
// `orig` (row stride `ld_orig`; read only by the exact path), written to blk_out/col_out (row
// stride `ld_out`), with the scale bytes left in s.blk_byte ([row][block]; row 0 for tiles)
// and s.col_byte. Blocks and columns whose scale is NaN (0xFF) get element bytes kElemNaN.
// `prefetch_src`: src is the input itself (a bf16 weight), not a stage buffer.
template <ElemFormat F, BlockKind BK, bool COL, typename T>
void quantize_chunk(const uint16_t* src, int64_t ld, const T* orig, int64_t ld_orig,
                    int64_t nrows, int64_t ncols, ScaleMode mode, uint8_t* blk_out,
                    uint8_t* col_out, int64_t ld_out, Scratch& s, bool prefetch_src = false) {
  using C = Bf16Encode<F>;
  constexpr bool kNeedCols = COL || BK == BlockKind::Tile;
  const int64_t nb = ncols / kBlock;

  // Pass 1: amax keys. Rows' block keys by a horizontal max, columns' by a vertical one.
  if constexpr (kNeedCols) std::memset(s.col_key, 0, ncols * sizeof(uint16_t));
  for (int64_t r = 0; r < nrows; ++r) {
    const uint16_t* row = src + r * ld;
    for (int64_t b = 0; b < nb; ++b) {
      if (prefetch_src) prefetch_ahead(row + 32 * b, ld);
      const __m256i a0 = abs16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * b)));
      const __m256i a1 =
          abs16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * b + 16)));
      if constexpr (kNeedCols) {
        __m256i* ck = reinterpret_cast<__m256i*>(s.col_key + 32 * b);
        _mm256_store_si256(ck, _mm256_max_epi16(_mm256_load_si256(ck), a0));
        _mm256_store_si256(ck + 1, _mm256_max_epi16(_mm256_load_si256(ck + 1), a1));
      }
      if constexpr (BK == BlockKind::Row) {
        s.blk_key[r * Scratch::kBlocks + b] = hmax16(_mm256_max_epi16(a0, a1));
      }
    }
  }
  if constexpr (BK == BlockKind::Tile) {
    for (int64_t b = 0; b < nb; ++b) {
      const __m256i* ck = reinterpret_cast<const __m256i*>(s.col_key + 32 * b);
      s.blk_key[b] = hmax16(_mm256_max_epi16(_mm256_load_si256(ck), _mm256_load_si256(ck + 1)));
    }
  }

  // Scale bytes and code offsets (the key arrays are padded to 32 entries with stale keys,
  // whose results are never read, but may report a NaN: the fix-up below then finds none).
  constexpr int64_t kPad = 32;
  bool blk_nan = false, col_nan = false;
  if constexpr (BK == BlockKind::Row) {
    blk_nan = scales_from_keys<F>(s.blk_key, (nrows * Scratch::kBlocks + kPad - 1) / kPad * kPad,
                                  mode, s.blk_byte, s.blk_off);
  } else if constexpr (BK == BlockKind::Tile) {
    blk_nan = scales_from_keys<F>(s.blk_key, kPad * ((nb + kPad - 1) / kPad), mode, s.blk_byte,
                                  s.blk_off);
  }
  if constexpr (COL) col_nan = scales_from_keys<F>(s.col_key, ncols, mode, s.col_byte, s.col_off);

  // Pass 2: the elements, both layouts from one load.
  const __m256i half_minus_one = _mm256_set1_epi16(C::kHalfMinusOne);
  const __m256i one = _mm256_set1_epi16(1);
  const __m256i max_code = _mm256_set1_epi16(C::kMaxCode);
  const __m256i min_normal = _mm256_set1_epi16(C::kMinNormalCode);
  const __m256i bf16_min_normal = _mm256_set1_epi16(0x0080);
  const __m256i sign_bit = _mm256_set1_epi16(0x80);
  for (int64_t r = 0; r < nrows; ++r) {
    const uint16_t* row = src + r * ld;
    const int64_t brow = BK == BlockKind::Row ? r * Scratch::kBlocks : 0;
    uint8_t* bo = BK != BlockKind::None ? blk_out + r * ld_out : nullptr;
    uint8_t* co = COL ? col_out + r * ld_out : nullptr;
    for (int64_t b = 0; b < nb; ++b) {
      const __m256i boff = _mm256_set1_epi16(s.blk_off[brow + b]);
      __m256i blk_code[2], col_code[2];
      __m256i bad = _mm256_setzero_si256();
      for (int h = 0; h < 2; ++h) {
        const int64_t j = 32 * b + 16 * h;
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + j));
        const __m256i xa = abs16(x);
        // Round the 7-bit mantissa to M bits, ties to even, carrying into the exponent.
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi16(xa, C::kShift), one);
        const __m256i base = _mm256_srli_epi16(
            _mm256_add_epi16(_mm256_add_epi16(xa, half_minus_one), lsb), C::kShift);
        const __m256i sign = _mm256_and_si256(_mm256_srli_epi16(x, 8), sign_bit);
        __m256i low = _mm256_cmpgt_epi16(bf16_min_normal, xa);  // bf16 zero or subnormal
        if constexpr (BK != BlockKind::None) {
          const __m256i c = _mm256_sub_epi16(base, boff);
          low = _mm256_or_si256(low, _mm256_cmpgt_epi16(min_normal, c));
          blk_code[h] = _mm256_or_si256(_mm256_min_epi16(c, max_code), sign);
        }
        if constexpr (COL) {
          const __m256i c = _mm256_sub_epi16(
              base, _mm256_load_si256(reinterpret_cast<const __m256i*>(s.col_off + j)));
          low = _mm256_or_si256(low, _mm256_cmpgt_epi16(min_normal, c));
          col_code[h] = _mm256_or_si256(_mm256_min_epi16(c, max_code), sign);
        }
        bad = _mm256_or_si256(bad, low);
      }
      if (__builtin_expect(!_mm256_testz_si256(bad, bad), 0)) {
        encode_run_exact<F, BK, COL>(orig + r * ld_orig + 32 * b, s.blk_byte[brow + b],
                                     s.col_byte + 32 * b,
                                     bo ? bo + 32 * b : nullptr, co ? co + 32 * b : nullptr);
        continue;
      }
      if constexpr (BK != BlockKind::None) {
        store_codes(bo + 32 * b,
                    _mm256_permute4x64_epi64(_mm256_packus_epi16(blk_code[0], blk_code[1]), 0xD8),
                    s.nt);
      }
      if constexpr (COL) {
        store_codes(co + 32 * b,
                    _mm256_permute4x64_epi64(_mm256_packus_epi16(col_code[0], col_code[1]), 0xD8),
                    s.nt);
      }
    }
  }

  // NaN/Inf blocks and columns: their element bytes are kElemNaN.
  if (blk_nan) {
    for (int64_t r = 0; r < nrows; ++r) {
      const int64_t brow = BK == BlockKind::Row ? r * Scratch::kBlocks : 0;
      for (int64_t b = 0; b < nb; ++b) {
        if (s.blk_byte[brow + b] != zrw::mx::kScaleNaN) continue;
        std::memset(blk_out + r * ld_out + 32 * b, zrw::mx::kElemNaN, kBlock);
      }
    }
  }
  if (col_nan) {
    for (int64_t j = 0; j < ncols; ++j) {
      if (s.col_byte[j] != zrw::mx::kScaleNaN) continue;
      for (int64_t r = 0; r < nrows; ++r) col_out[r * ld_out + j] = zrw::mx::kElemNaN;
    }
  }
}

// 8 fp32 lanes -> 8 jammed bf16 keys in 32-bit lanes (see the header comment).
inline __m256i jam8(__m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i dropped = _mm256_and_si256(x, _mm256_set1_epi32(0xFFFF));
  const __m256i sticky =
      _mm256_andnot_si256(_mm256_cmpeq_epi32(dropped, _mm256_setzero_si256()),
                          _mm256_set1_epi32(1));
  return _mm256_or_si256(_mm256_srli_epi32(x, 16), sticky);
}

inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const at::Half* x) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
}

// n (a multiple of 16) fp32/fp16 elements -> jammed bf16 keys; `prefetch`: x is a row of a
// chunk of the input, whose next row is `prefetch` elements further (prefetch_ahead), not a
// small buffer (0).
template <typename T>
inline void stage_row(const T* x, uint16_t* out, int64_t n, int64_t prefetch = 0) {
  for (int64_t j = 0; j < n; j += 16) {
    if (prefetch) prefetch_ahead(x + j, prefetch);
    // packus_epi32 works per 128-bit lane; the permute puts the 16 keys back in order.
    const __m256i packed = _mm256_packus_epi32(jam8(load8(x + j)), jam8(load8(x + j + 8)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j),
                        _mm256_permute4x64_epi64(packed, 0xD8));
  }
}

// 8 fp32 lanes -> their bf16 bit patterns in 32-bit lanes, rounded to nearest even as torch
// converts (the vector form of mx::f32_to_bf16_bits_rne; NaN kept a quiet NaN).
inline __m256i round_bf16_8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  // |x| bits above +Inf's are NaN (a signed compare: |x| bits are below 2^31).
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                         _mm256_set1_epi32(0x7F800000));
  const __m256i quiet_nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, quiet_nan, nan);
}

// n (a multiple of 16) fp32 master elements -> their bf16 bit patterns: the exact bf16 values,
// both keys and elements (Round::BF16).
inline void stage_row_bf16(const float* x, uint16_t* out, int64_t n, int64_t ld) {
  for (int64_t j = 0; j < n; j += 16) {
    prefetch_ahead(x + j, ld);
    const __m256i packed = _mm256_packus_epi32(round_bf16_8(_mm256_loadu_ps(x + j)),
                                               round_bf16_8(_mm256_loadu_ps(x + j + 8)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j),
                        _mm256_permute4x64_epi64(packed, 0xD8));
  }
}

// n (a multiple of 16) fp32 master elements -> their fp16 values (`halves`, what the exact path
// reads) and those values' jammed bf16 keys (`keys`), as an fp16 input is staged (Round::F16).
inline void stage_row_f16(const float* x, at::Half* halves, uint16_t* keys, int64_t n,
                          int64_t ld) {
  constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t j = 0; j < n; j += 16) {
    prefetch_ahead(x + j, ld);
    const __m128i h0 = _mm256_cvtps_ph(_mm256_loadu_ps(x + j), kRne);
    const __m128i h1 = _mm256_cvtps_ph(_mm256_loadu_ps(x + j + 8), kRne);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(halves + j), h0);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(halves + j + 8), h1);
    const __m256i packed =
        _mm256_packus_epi32(jam8(_mm256_cvtph_ps(h0)), jam8(_mm256_cvtph_ps(h1)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(keys + j),
                        _mm256_permute4x64_epi64(packed, 0xD8));
  }
}

// An input element's value as the quantization sees it: fp32 master elements rounded to the
// parameter dtype first (Round::BF16 / F16), everything else as it is.
template <Round R, typename T>
inline float element_value(T x) {
  if constexpr (R == Round::BF16) {
    return to_float(zrw::mx::f32_to_bf16_bits_rne(x));
  } else if constexpr (R == Round::F16) {
    return zrw::mx::round_f32_to_f16_value(x);
  } else {
    return to_float(x);
  }
}

// Rows [r0, r0 + 32) (clipped to N) of one matrix (N, K) of bf16 (as uint16_t bits), fp32 or
// fp16: the strip is cut into chunks of Scratch::kCols columns (fp32/fp16 chunks staged as
// jammed bf16 first, fp32 masters rounded to the parameter dtype R while staged); a last partial
// 32-column block goes through a zero-padded copy (missing elements count as 0 for amax, as
// everywhere in zrw).
template <ElemFormat F, BlockKind BK, bool COL, Round R, typename T>
void quantize_strip(const T* src, int64_t N, int64_t K, int64_t r0, ScaleMode mode,
                    uint8_t* blk_data, uint8_t* blk_scale, uint8_t* col_data, uint8_t* col_scale,
                    Scratch& s) {
  constexpr bool kBf16 = std::is_same_v<T, uint16_t>;
  static_assert(R == Round::None || std::is_same_v<T, float>, "only fp32 masters are rounded");
  // Keys that are bf16 values themselves (not jammed): a bf16 input, or a master rounded to bf16.
  constexpr bool kExactKeys = kBf16 || R == Round::BF16;
  const int64_t nrows = std::min<int64_t>(kBlock, N - r0);
  const int64_t KB = (K + kBlock - 1) / kBlock;
  const int64_t strip = r0 / kBlock;
  const int64_t kfull = K / kBlock * kBlock;
  // Where chunk (c0, ncols)'s scale bytes go, from the scratch the chunk left them in.
  auto write_scales = [&](int64_t c0, int64_t ncols, int64_t valid_cols) {
    const int64_t nb = ncols / kBlock;
    if constexpr (BK == BlockKind::Row) {
      for (int64_t r = 0; r < nrows; ++r) {
        std::memcpy(blk_scale + (r0 + r) * KB + c0 / kBlock, s.blk_byte + r * Scratch::kBlocks,
                    nb);
      }
    } else if constexpr (BK == BlockKind::Tile) {
      std::memcpy(blk_scale + strip * KB + c0 / kBlock, s.blk_byte, nb);
    }
    if constexpr (COL) std::memcpy(col_scale + strip * K + c0, s.col_byte, valid_cols);
  };
  for (int64_t c0 = 0; c0 < kfull; c0 += Scratch::kCols) {
    const int64_t ncols = std::min(Scratch::kCols, kfull - c0);
    const T* orig = src + r0 * K + c0;
    uint8_t* blk_out = blk_data ? blk_data + r0 * K + c0 : nullptr;
    uint8_t* col_out = col_data ? col_data + r0 * K + c0 : nullptr;
    constexpr int64_t ld_stage = Scratch::kCols;
    if constexpr (kBf16) {
      quantize_chunk<F, BK, COL>(orig, K, orig, K, nrows, ncols, mode, blk_out, col_out, K, s,
                                 /*prefetch_src=*/true);
    } else if constexpr (R == Round::BF16) {
      // The staged bf16 values are the elements: the exact path reads them, not the master.
      for (int64_t r = 0; r < nrows; ++r) {
        stage_row_bf16(orig + r * K, s.stage + r * ld_stage, ncols, K);
      }
      quantize_chunk<F, BK, COL>(s.stage, ld_stage, static_cast<const uint16_t*>(s.stage),
                                 ld_stage, nrows, ncols, mode, blk_out, col_out, K, s);
    } else if constexpr (R == Round::F16) {
      for (int64_t r = 0; r < nrows; ++r) {
        stage_row_f16(orig + r * K, s.stage_f16 + r * ld_stage, s.stage + r * ld_stage, ncols,
                      K);
      }
      quantize_chunk<F, BK, COL>(s.stage, ld_stage, static_cast<const at::Half*>(s.stage_f16),
                                 ld_stage, nrows, ncols, mode, blk_out, col_out, K, s);
    } else {
      for (int64_t r = 0; r < nrows; ++r) {
        stage_row(orig + r * K, s.stage + r * ld_stage, ncols, /*prefetch=*/K);
      }
      quantize_chunk<F, BK, COL>(s.stage, ld_stage, orig, K, nrows, ncols, mode, blk_out,
                                 col_out, K, s);
    }
    write_scales(c0, ncols, ncols);
  }
  if (kfull == K) return;
  const int64_t tail = K - kfull;
  std::memset(s.tail_orig, 0, sizeof(s.tail_orig));
  for (int64_t r = 0; r < nrows; ++r) {
    for (int64_t j = 0; j < tail; ++j) {
      s.tail_orig[r * kBlock + j] = element_value<R>(src[(r0 + r) * K + kfull + j]);
    }
  }
  // Keys of the tail: bf16 values as they are, fp32/fp16 (now fp32) jammed.
  for (int64_t r = 0; r < kBlock; ++r) {
    if constexpr (kExactKeys) {
      for (int64_t j = 0; j < kBlock; ++j) {
        s.tail_src[r * kBlock + j] = static_cast<uint16_t>(
            zrw::mx::f32_bits(s.tail_orig[r * kBlock + j]) >> 16);
      }
    } else {
      stage_row(s.tail_orig + r * kBlock, s.tail_src + r * kBlock, kBlock);
    }
  }
  quantize_chunk<F, BK, COL>(s.tail_src, kBlock, s.tail_orig, kBlock, nrows, kBlock, mode,
                             s.tail_blk, s.tail_col, kBlock, s);
  write_scales(kfull, kBlock, tail);
  for (int64_t r = 0; r < nrows; ++r) {
    if (BK != BlockKind::None) {
      std::memcpy(blk_data + (r0 + r) * K + kfull, s.tail_blk + r * kBlock, tail);
    }
    if (COL) std::memcpy(col_data + (r0 + r) * K + kfull, s.tail_col + r * kBlock, tail);
  }
}

}  // namespace zrw::cpu::ZRW_CPU_ISA::avx2_path
