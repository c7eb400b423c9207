// The AVX-512 path of the CPU quantization kernel (bf16 inputs, and FP32 masters rounded to
// bf16), in intrinsics. Included by mx_cpu_quant_kernel.cpp inside its per-ISA namespace when
// the build targets AVX-512BW, after mx_cpu_quant_avx2.h, whose 16-bit encode it runs with 32
// lanes per register: one register is one 32-element block, so
//
// * a block's element codes need one broadcast offset (blocks along the row), or one offset
//   vector shared by the 32 rows of a strip (blocks down the columns: lane j is column j);
// * the amaxes of 32 blocks along rows come from one reduction tree over the 32 registers
//   (5 levels of shuffle + max: ~3 instructions per block instead of a horizontal max each),
//   and the amaxes down the columns are a plain vertical max over the same registers;
// * zeros, NaN/Inf blocks and columns and partial blocks (masked loads fill zeros, masked
//   stores write only the real elements) are handled in the registers with AVX-512 masks.
//   Only runs holding an element below its format's normal range relative to the block
//   (or a bf16 subnormal) take the exact scalar path, as in the AVX2 path.
//
// Layouts and traversal:
// * blocks along rows only (mx_quantize along the contiguous axis): the rows are streamed in
//   order, 32 blocks (1024 elements, 2 KiB of bf16) at a time: the hardware prefetchers see
//   one stream per thread.
// * blocks down the columns, 32x32 tiles, dual-axis: strips of 32 rows, in chunks of up to
//   2048 columns (128 KiB of bf16, held in L2). Pass 1 reads the chunk row by row (each row
//   segment one sequential 4 KiB stream, the next row prefetched meanwhile) and computes the
//   row blocks' amaxes and the columns' running amaxes; pass 2 encodes it from L2, 64 columns
//   x 32 rows at a time (a 64-byte output line per row and plane). Both planes of the dual
//   quantization come from that one read, the plane whose blocks run down the columns in its
//   final layout (no strided second pass).
// * Data planes are written with non-temporal stores (full 64-byte lines) when they are large
//   (they would only evict the input from the caches) and aligned; scales with plain stores.
#pragma once

#if !defined(__AVX512BW__) || !defined(ZRW_CPU_ISA)
#error "mx_cpu_quant_avx512.h is part of an AVX-512 build of mx_cpu_quant_kernel.cpp"
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

// GCC 12 reports its own _mm512_undefined_epi32() (the pass-through operand of the unmasked
// shuffles and unpacks) as maybe uninitialized.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace zrw::cpu::ZRW_CPU_ISA::avx512_path {

using zrw::mx::ElemFormat;
using zrw::mx::ScaleMode;
using zrw::mx::kBlock;
using avx2_path::BlockKind;
using avx2_path::Bf16Encode;

inline __m512i set16(int v) { return _mm512_set1_epi16(static_cast<int16_t>(v)); }
inline __mmask32 lanes_mask(int n) {
  return n >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << n) - 1u);
}

// ---- amax keys ------------------------------------------------------------------------------
// The reduction tree: 32 registers (rows 0..31, 32 lanes each) -> one register whose lane i is
// row i's max. Level k halves the lanes per row and doubles the rows per register.
inline __m512i fold1(__m512i a, __m512i b) {  // -> [a's 16 | b's 16]
  return _mm512_max_epu16(_mm512_shuffle_i64x2(a, b, 0x44), _mm512_shuffle_i64x2(a, b, 0xEE));
}
inline __m512i fold2(__m512i a, __m512i b) {  // [a|b], [c|d] -> one 128-bit lane per row
  return _mm512_max_epu16(_mm512_shuffle_i64x2(a, b, 0x88), _mm512_shuffle_i64x2(a, b, 0xDD));
}
inline __m512i fold3(__m512i a, __m512i b) {  // -> per 128-bit lane: [a's row: 4 | b's row: 4]
  return _mm512_max_epu16(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}
inline __m512i fold4(__m512i a, __m512i b) {  // -> one 32-bit lane per row
  const __m512 fa = _mm512_castsi512_ps(a), fb = _mm512_castsi512_ps(b);
  return _mm512_max_epu16(_mm512_castps_si512(_mm512_shuffle_ps(fa, fb, 0x88)),
                          _mm512_castps_si512(_mm512_shuffle_ps(fa, fb, 0xDD)));
}
inline __m512i fold5(__m512i a, __m512i b) {  // -> one 16-bit lane per row
  const __m512i lo = _mm512_max_epu16(a, _mm512_srli_epi32(a, 16));
  const __m512i hi = _mm512_max_epu16(b, _mm512_slli_epi32(b, 16));
  return _mm512_mask_blend_epi16(0xAAAAAAAAu, lo, hi);
}

// Reduces 8 rows (v[0..7]) to one register (fold3's layout).
inline __m512i tree8(const __m512i* v) {
  return fold3(fold2(fold1(v[0], v[1]), fold1(v[2], v[3])),
               fold2(fold1(v[4], v[5]), fold1(v[6], v[7])));
}
inline __m512i tree32_from8(const __m512i* t8) {
  return fold5(fold4(t8[0], t8[1]), fold4(t8[2], t8[3]));
}

// The permutation that puts the tree's result in row order (lane i = row i), found once by
// running the tree on rows that hold their own index.
struct TreeOrder {
  __m512i idx;
  TreeOrder() {
    alignas(64) __m512i rows[32];
    for (int r = 0; r < 32; ++r) rows[r] = set16(r);
    __m512i t8[4];
    for (int g = 0; g < 4; ++g) t8[g] = tree8(rows + 8 * g);
    alignas(64) uint16_t lane_row[32], idx16[32];
    _mm512_store_si512(lane_row, tree32_from8(t8));
    for (int lane = 0; lane < 32; ++lane) idx16[lane_row[lane]] = static_cast<uint16_t>(lane);
    idx = _mm512_load_si512(idx16);
  }
};
inline const __m512i& tree_order() {
  static const TreeOrder order;
  return order.idx;
}

// Max of the 32 lanes of v.
inline uint16_t hmax32(__m512i v) {
  const __m256i m = _mm256_max_epu16(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
  return avx2_path::hmax16(m);
}

// ---- scales ----------------------------------------------------------------------------------
// E8M0 bytes (in 16-bit lanes) of 32 amax keys (mx::scale_byte_from_amax_key on bf16 keys);
// `nan` gets the lanes of NaN/Inf blocks (byte 0xFF).
template <ElemFormat F>
inline __m512i scale_bytes(__m512i k, ScaleMode mode, __mmask32* nan) {
  using E = zrw::mx::Elem<F>;
  const __m512i exp = _mm512_srli_epi16(k, 7);
  __m512i e = _mm512_sub_epi16(exp, set16(127 + E::kEmax));
  if (mode == ScaleMode::RCeil) {
    const __mmask32 up = _mm512_cmpgt_epi16_mask(_mm512_and_si512(k, set16(0x7F)), set16(0x60));
    e = _mm512_mask_add_epi16(e, up, e, set16(1));
  }
  e = _mm512_max_epi16(_mm512_min_epi16(e, set16(127)), set16(-127));
  __m512i byte = _mm512_maskz_mov_epi16(_mm512_test_epi16_mask(exp, exp),
                                        _mm512_add_epi16(e, set16(127)));
  *nan = _mm512_cmpeq_epi16_mask(exp, set16(0xFF));
  return _mm512_mask_mov_epi16(byte, *nan, set16(0xFF));
}

// The code offset of each scale byte: code = base(x) - offset (see mx_cpu_quant_avx2.h).
template <ElemFormat F>
inline __m512i code_offsets(__m512i byte) {
  using E = zrw::mx::Elem<F>;
  return _mm512_slli_epi16(_mm512_sub_epi16(byte, set16(E::kBias)), E::kMantBits);
}

// ---- elements --------------------------------------------------------------------------------
// The shared part of 32 elements' codes: base(x) (the rounded bf16 exponent|mantissa), the
// sign bits moved to bit 7, the nonzero lanes and the nonzero bf16 subnormals (exact path).
struct Elems {
  __m512i base, sign_hi;  // sign_hi: x >> 8 (bit 7 = sign)
  __mmask32 nz, sub;
};

template <ElemFormat F>
inline Elems elems_of(__m512i x) {
  using C = Bf16Encode<F>;
  Elems e;
  const __m512i xa = _mm512_and_si512(x, set16(0x7FFF));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi16(xa, C::kShift), set16(1));
  e.base = _mm512_srli_epi16(_mm512_add_epi16(_mm512_add_epi16(xa, set16(C::kHalfMinusOne)), lsb),
                             C::kShift);
  e.sign_hi = _mm512_srli_epi16(x, 8);
  e.nz = _mm512_test_epi16_mask(x, set16(0x7FFF));
  e.sub = _mm512_mask_cmplt_epu16_mask(e.nz, xa, set16(0x80));
  return e;
}

// Codes for one offset (a broadcast block offset or a per-column vector); `bad` gets the nonzero
// lanes below the element format's normal range (exact path).
template <ElemFormat F>
inline __m512i codes(const Elems& e, __m512i off, __mmask32* bad) {
  using C = Bf16Encode<F>;
  const __m512i c = _mm512_sub_epi16(e.base, off);
  *bad |= _mm512_mask_cmplt_epi16_mask(e.nz, c, set16(C::kMinNormalCode));
  const __m512i m = _mm512_maskz_min_epi16(e.nz, c, set16(C::kMaxCode));
  return _mm512_ternarylogic_epi32(m, e.sign_hi, set16(0x80), 0xF8);  // m | (sign_hi & 0x80)
}

// The exact path for a run of n (<= 32) elements (bf16 bits) of one row: mx::encode_elem_lane
// on x * 2^-e as the portable kernel computes it, then kElemNaN for NaN/Inf blocks and columns.
template <ElemFormat F>
inline void encode_run_exact(const uint16_t* x, int n, uint8_t byte, const uint8_t* col_bytes,
                             uint8_t* out) {
  for (int j = 0; j < n; ++j) {
    const uint8_t b = col_bytes ? col_bytes[j] : byte;
    const float v = zrw::mx::bits_f32(static_cast<uint32_t>(x[j]) << 16);
    out[j] = b == zrw::mx::kScaleNaN
                 ? zrw::mx::kElemNaN
                 : static_cast<uint8_t>(
                       zrw::mx::encode_elem_lane<F>(v * zrw::mx::inv_scale_from_byte(b)));
  }
}

// Two blocks' codes (32 lanes each) -> 64 bytes in order.
inline __m512i pack2(__m512i c0, __m512i c1) {
  return _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7),
                                  _mm512_packus_epi16(c0, c1));
}

// Stores the codes of NB (1 or 2) blocks of one row: the last block holds `last` elements, an
// earlier one 32. Runs in `bad` (one mask per block) are redone by the exact path from x (the
// row's bf16 elements), with the block's scale byte bytes[b * byte_stride] (or the per-column
// bytes `col_bytes`, 32 per block, when non-null).
template <ElemFormat F, int NB>
inline void store_row(uint8_t* out, const __m512i* c, int last, const __mmask32* bad, bool nt,
                      const uint16_t* x, const uint8_t* bytes, int byte_stride,
                      const uint8_t* col_bytes) {
  const bool any_bad = (bad[0] | bad[NB - 1]) != 0;
  if (NB == 2 && last == 32 && !any_bad) {
    const __m512i v = pack2(c[0], c[NB - 1]);
    if (nt) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(out), v);
    } else {
      _mm512_storeu_si512(out, v);
    }
    return;
  }
  if constexpr (NB == 2) {
    _mm512_mask_storeu_epi8(out, last == 32 ? ~__mmask64{0} : (__mmask64{1} << (32 + last)) - 1,
                            pack2(c[0], c[1]));
  } else {
    _mm512_mask_cvtepi16_storeu_epi8(out, lanes_mask(last), c[0]);
  }
  if (!any_bad) return;
  for (int b = 0; b < NB; ++b) {
    if (!bad[b]) continue;
    encode_run_exact<F>(x + 32 * b, b == NB - 1 ? last : 32, bytes ? bytes[b * byte_stride] : 0,
                        col_bytes ? col_bytes + 32 * b : nullptr, out + 32 * b);
  }
}

// ---- sources ---------------------------------------------------------------------------------
// bf16 (as uint16_t bits), or an FP32 master rounded to bf16 (RNE, NaN kept quiet: the vector
// form of mx::f32_to_bf16_bits_rne) as it is loaded.
inline __m512i round_bf16_16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_mask_mov_epi32(rounded, nan, quiet);
}

// 32 elements at p (the first n) as bf16 bits; zeros past n.
inline __m512i load_bf16(const uint16_t* p, int n) {
  return n >= 32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(lanes_mask(n), p);
}
inline __m512i load_bf16(const float* p, int n) {
  const __m512i order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
  if (n >= 32) {
    return _mm512_permutexvar_epi64(order,
                                    _mm512_packus_epi32(round_bf16_16(_mm512_loadu_ps(p)),
                                                        round_bf16_16(_mm512_loadu_ps(p + 16))));
  }
  const __mmask16 m0 = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u);
  const __mmask16 m1 = n >= 32 ? __mmask16(0xFFFF)
                               : (n <= 16 ? __mmask16(0) : __mmask16((1u << (n - 16)) - 1u));
  const __m512i lo = round_bf16_16(_mm512_maskz_loadu_ps(m0, p));
  const __m512i hi = round_bf16_16(_mm512_maskz_loadu_ps(m1, p + 16));
  return _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7),
                                  _mm512_packus_epi32(lo, hi));
}

template <typename T>
inline void prefetch(const T* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}

// Per-thread scratch of the row-only path: a group's bf16 elements (staged fp32 masters; also
// read by the exact path) and scale bytes.
struct Scratch {
  alignas(64) uint16_t stage[32][64];
  alignas(64) uint16_t col_byte16[64];
  alignas(64) uint8_t col_byte[64];
  alignas(64) uint16_t row_byte16[2][32];
  alignas(64) uint8_t row_byte[2][32];
  alignas(64) int16_t row_off[2][32];
};

// The kernel's tuning, chosen with `python -m zrw.bench quant` on a 2-core AMD EPYC (4096x4096,
// 1 and 2 threads) by sweeping each value: non-temporal stores from 4 MiB planes (below that
// the output stays in the caches for its next reader), and the row-only stream prefetched 2048
// elements ahead. (The strips prefetch the next row of the chunk, see strip_chunk.)
struct Tuning {
  static constexpr int64_t nt_min_bytes = 4 << 20;  // planes this large get non-temporal stores
  static constexpr int64_t row_pf = 2048;           // elements ahead the row-only stream is fetched
};
constexpr Tuning tuning() { return Tuning{}; }

// ---- blocks along rows only: the rows streamed in order --------------------------------------
// `nvec` (<= 32) consecutive blocks of one row (or of a flat run of rows of whole blocks) at
// src, the last with `last` elements, into data/scale. FULL: 32 blocks of 32 (the shapes are
// compile-time constants, so the 32 registers stay registers).
template <ElemFormat F, bool FULL, typename T>
inline void row_blocks_group(const T* src, int nvec, int last, ScaleMode mode, uint8_t* data,
                             uint8_t* scale, bool nt, Scratch& s) {
  constexpr bool kStage = !std::is_same_v<T, uint16_t>;
  if constexpr (FULL) {
    nvec = 32;
    last = 32;
  }
  const __m512i key_mask = set16(0x7FFF);
  __m512i t8[4];
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g) {
    __m512i v[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const int i = 8 * g + j;
      if (FULL || i < nvec) {
        if constexpr (FULL) {
          // The stream's lines pf elements ahead (tuning().row_pf).
#pragma GCC unroll 2
          for (int j = 0; j < 32; j += 64 / static_cast<int>(sizeof(T))) {
            prefetch(src + 32 * i + j + tuning().row_pf);
          }
        }
        const __m512i x = load_bf16(src + 32 * i, FULL || i != nvec - 1 ? 32 : last);
        if constexpr (kStage) _mm512_store_si512(&s.stage[i / 2][32 * (i % 2)], x);
        v[j] = _mm512_and_si512(x, key_mask);
      } else {
        v[j] = _mm512_setzero_si512();
      }
    }
    t8[g] = tree8(v);
  }
  const uint16_t* xs;
  if constexpr (kStage) {
    xs = &s.stage[0][0];
  } else {
    xs = reinterpret_cast<const uint16_t*>(src);
  }
  const __m512i keys = _mm512_permutexvar_epi16(tree_order(), tree32_from8(t8));
  __mmask32 nan;
  const __m512i bytes = scale_bytes<F>(keys, mode, &nan);
  _mm512_mask_cvtepi16_storeu_epi8(scale, lanes_mask(nvec), bytes);
  _mm512_store_si512(s.row_off[0], code_offsets<F>(bytes));
  _mm512_mask_cvtepi16_storeu_epi8(s.row_byte[0], ~__mmask32{0}, bytes);
  auto pair = [&](int i, auto nb_tag) {
    constexpr int NB = decltype(nb_tag)::value;
    const int nlast = i + NB == nvec ? last : 32;
    __m512i c[NB];
    __mmask32 bad[NB];
#pragma GCC unroll 2
    for (int b = 0; b < NB; ++b) {
      const int blk = i + b;
      bad[b] = 0;
      const Elems e = elems_of<F>(load_bf16(xs + 32 * blk, b == NB - 1 ? nlast : 32));
      if ((nan >> blk) & 1u) {
        c[b] = set16(zrw::mx::kElemNaN);
      } else {
        c[b] = codes<F>(e, _mm512_set1_epi16(s.row_off[0][blk]), &bad[b]);
        bad[b] |= e.sub;
      }
    }
    store_row<F, NB>(data + 32 * i, c, nlast, bad, nt, xs + 32 * i, s.row_byte[0] + i, 1,
                     nullptr);
  };
#pragma GCC unroll 2
  for (int i = 0; i + 2 <= nvec; i += 2) pair(i, std::integral_constant<int, 2>{});
  if (!FULL && nvec % 2) pair(nvec - 1, std::integral_constant<int, 1>{});
}

// ---- strips: blocks down the columns, 32x32 tiles, dual-axis --------------------------------
// A strip of 32 rows is quantized in chunks of up to kChunkCols columns. Pass 1 reads the chunk
// row by row, each row segment one sequential stream (4 KiB of bf16: what the memory system
// serves best), and computes the row blocks' amaxes (the reduction tree over 32 consecutive
// blocks) and the columns' running amaxes; FP32 masters are rounded to bf16 into a stage buffer
// on the way. Pass 2 encodes the chunk from L2, 64 columns x 32 rows at a time, both planes
// from one load.
constexpr int kChunkCols = 2048;
constexpr int kChunkBlocks = kChunkCols / 32;

struct StripScratch {
  alignas(64) uint16_t stage[32 * kChunkCols];  // FP32 masters: the chunk rounded to bf16
  alignas(64) uint16_t col_key[kChunkCols];
  alignas(64) int16_t col_off[kChunkCols];
  alignas(64) uint8_t col_byte[kChunkCols];
  alignas(64) int16_t row_off[32][kChunkBlocks];
  alignas(64) uint8_t row_byte[32][kChunkBlocks];
};

// Pass 1 over one row segment: `nblk` blocks (the last with `last` elements) at p. Row block
// scale bytes go to scale (one per block) and s.row_byte/row_off[r]; column keys are maxed into
// s.col_key; staged elements (FP32 masters) into stage. Returns whether a row block is NaN/Inf.
template <ElemFormat F, bool ROW, bool COLKEYS, bool FULL, typename T>
inline bool row_segment(const T* p, int nblk, int last, ScaleMode mode, uint8_t* scale,
                        int16_t* row_off, uint8_t* row_byte, uint16_t* col_key, uint16_t* stage,
                        int64_t pf) {
  constexpr bool kStage = !std::is_same_v<T, uint16_t>;
  if constexpr (FULL) {
    nblk = 32;
    last = 32;
  }
  const __m512i key_mask = set16(0x7FFF);
  __m512i t8[4];
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g) {
    __m512i v[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const int i = 8 * g + j;
      if (FULL || i < nblk) {
        if (FULL && pf) {
#pragma GCC unroll 2
          for (int q = 0; q < 32; q += 64 / static_cast<int>(sizeof(T))) {
            prefetch(p + 32 * i + q + pf);
          }
        }
        const __m512i x = load_bf16(p + 32 * i, FULL || i != nblk - 1 ? 32 : last);
        if constexpr (kStage) _mm512_store_si512(stage + 32 * i, x);
        v[j] = _mm512_and_si512(x, key_mask);
        if constexpr (COLKEYS) {
          __m512i* ck = reinterpret_cast<__m512i*>(col_key + 32 * i);
          _mm512_store_si512(ck, _mm512_max_epu16(_mm512_load_si512(ck), v[j]));
        }
      } else {
        v[j] = _mm512_setzero_si512();
      }
    }
    if constexpr (ROW) t8[g] = tree8(v);
  }
  if constexpr (!ROW) {
    return false;
  } else {
    const __m512i keys = _mm512_permutexvar_epi16(tree_order(), tree32_from8(t8));
    __mmask32 nan;
    const __m512i bytes = scale_bytes<F>(keys, mode, &nan);
    _mm512_mask_cvtepi16_storeu_epi8(scale, lanes_mask(nblk), bytes);
    _mm512_mask_cvtepi16_storeu_epi8(row_byte, lanes_mask(nblk), bytes);
    // NaN/Inf blocks get an offset that keeps their (overwritten) codes off the exact path.
    _mm512_mask_storeu_epi16(row_off, lanes_mask(nblk),
                             _mm512_mask_mov_epi16(code_offsets<F>(bytes), nan, set16(-0x4000)));
    return (nan & lanes_mask(nblk)) != 0;
  }
}

// One chunk of one strip: rows [0, nrows) (row stride ld), columns [0, W) of the chunk.
template <ElemFormat F, BlockKind BK, bool COL, typename T>
void strip_chunk(const T* src, int64_t ld, int nrows, int W, ScaleMode mode, uint8_t* blk_data,
                 uint8_t* blk_scale, int64_t KB, uint8_t* col_data, uint8_t* col_scale, bool nt,
                 bool pf_ok, StripScratch& s) {
  using C = Bf16Encode<F>;
  constexpr bool kStage = !std::is_same_v<T, uint16_t>;
  constexpr bool kRow = BK == BlockKind::Row;
  constexpr bool kColKeys = COL || BK == BlockKind::Tile;
  const int nbw = (W + 31) / 32;
  const int wlast = W - 32 * (nbw - 1);
  // The same columns of the next row: one row segment ahead.
  const int64_t pf = pf_ok ? ld : 0;
  if constexpr (kColKeys) std::memset(s.col_key, 0, sizeof(uint16_t) * 32 * nbw);

  // Pass 1.
  bool any_nan = false;
  for (int r = 0; r < nrows; ++r) {
    for (int b0 = 0; b0 < nbw; b0 += 32) {
      const int n = std::min(32, nbw - b0);
      const int last = b0 + n == nbw ? wlast : 32;
      const T* p = src + r * ld + 32 * b0;
      uint8_t* sc = kRow ? blk_scale + r * KB + b0 : nullptr;
      uint16_t* st = kStage ? s.stage + r * kChunkCols + 32 * b0 : nullptr;
      if (n == 32 && last == 32) {
        any_nan |= row_segment<F, kRow, kColKeys, true>(p, 32, 32, mode, sc,
                                                        &s.row_off[r][b0], &s.row_byte[r][b0],
                                                        s.col_key + 32 * b0, st, pf);
      } else {
        any_nan |= row_segment<F, kRow, kColKeys, false>(p, n, last, mode, sc,
                                                         &s.row_off[r][b0], &s.row_byte[r][b0],
                                                         s.col_key + 32 * b0, st, 0);
      }
    }
  }

  // Column and tile scales.
  int16_t tile_off[kChunkBlocks];
  for (int b = 0; b < nbw; ++b) {
    const int ncols = b == nbw - 1 ? wlast : 32;
    const __m512i ck = _mm512_load_si512(s.col_key + 32 * b);
    if constexpr (COL) {
      __mmask32 nan;
      const __m512i bytes = scale_bytes<F>(ck, mode, &nan);
      _mm512_mask_cvtepi16_storeu_epi8(col_scale + 32 * b, lanes_mask(ncols), bytes);
      _mm512_mask_cvtepi16_storeu_epi8(s.col_byte + 32 * b, ~__mmask32{0}, bytes);
      _mm512_store_si512(s.col_off + 32 * b,
                         _mm512_mask_mov_epi16(code_offsets<F>(bytes), nan, set16(-0x4000)));
      any_nan |= (nan & lanes_mask(ncols)) != 0;
    }
    if constexpr (BK == BlockKind::Tile) {
      const uint16_t key = hmax32(ck);
      __mmask32 nan;
      const __m512i bytes =
          scale_bytes<F>(_mm512_set1_epi16(static_cast<int16_t>(key)), mode, &nan);
      const uint8_t byte =
          static_cast<uint8_t>(_mm_extract_epi16(_mm512_castsi512_si128(bytes), 0));
      blk_scale[b] = byte;
      for (int r = 0; r < 32; ++r) s.row_byte[r][b] = byte;
      tile_off[b] = (nan & 1u) ? int16_t{-0x4000}
                               : static_cast<int16_t>(_mm_extract_epi16(
                                     _mm512_castsi512_si128(code_offsets<F>(bytes)), 0));
      any_nan |= (nan & 1u) != 0;
    }
  }

  // Pass 2.
  const uint16_t* xs;
  int64_t ldx;
  if constexpr (kStage) {
    xs = s.stage;
    ldx = kChunkCols;
  } else {
    xs = reinterpret_cast<const uint16_t*>(src);
    ldx = ld;
  }
  const __m512i sub_shift = set16(C::kMinNormalCode - 0x80);
  auto group = [&](int b0, auto nb_tag) {
    constexpr int NB = decltype(nb_tag)::value;
    const int last = b0 + NB == nbw ? wlast : 32;
    __m512i coff[NB];
#pragma GCC unroll 2
    for (int b = 0; b < NB; ++b) {
      coff[b] = COL ? _mm512_load_si512(s.col_off + 32 * (b0 + b)) : _mm512_setzero_si512();
    }
    for (int r = 0; r < nrows; ++r) {
      const uint16_t* x = xs + r * ldx + 32 * b0;
      __m512i bc[NB], cc[NB];
      __mmask32 bad[NB];
#pragma GCC unroll 2
      for (int b = 0; b < NB; ++b) {
        const __m512i xv = load_bf16(x + 32 * b, b == NB - 1 ? last : 32);
        const Elems e = elems_of<F>(xv);
        // One test for every lane that needs the exact path: a nonzero bf16 subnormal, or a
        // code below the format's normal range in either plane.
        __m512i low = _mm512_add_epi16(_mm512_and_si512(xv, set16(0x7FFF)), sub_shift);
        bc[b] = cc[b] = _mm512_setzero_si512();
        if constexpr (BK != BlockKind::None) {
          const int16_t off = kRow ? s.row_off[r][b0 + b] : tile_off[b0 + b];
          const __m512i c = _mm512_sub_epi16(e.base, _mm512_set1_epi16(off));
          low = _mm512_min_epi16(low, c);
          bc[b] = _mm512_ternarylogic_epi32(_mm512_maskz_min_epi16(e.nz, c, set16(C::kMaxCode)),
                                            e.sign_hi, set16(0x80), 0xF8);
        }
        if constexpr (COL) {
          const __m512i c = _mm512_sub_epi16(e.base, coff[b]);
          low = _mm512_min_epi16(low, c);
          cc[b] = _mm512_ternarylogic_epi32(_mm512_maskz_min_epi16(e.nz, c, set16(C::kMaxCode)),
                                            e.sign_hi, set16(0x80), 0xF8);
        }
        bad[b] = _mm512_mask_cmplt_epi16_mask(e.nz, low, set16(C::kMinNormalCode));
        if (__builtin_expect(any_nan, 0)) {
          // NaN/Inf blocks and columns: element bytes kElemNaN.
          if (BK != BlockKind::None && s.row_byte[r][b0 + b] == zrw::mx::kScaleNaN) {
            bc[b] = set16(zrw::mx::kElemNaN);
          }
          if constexpr (COL) {
            const __mmask32 cn = _mm512_cmpeq_epi16_mask(
                _mm512_cvtepu8_epi16(_mm256_loadu_si256(
                    reinterpret_cast<const __m256i*>(s.col_byte + 32 * (b0 + b)))),
                set16(0xFF));
            cc[b] = _mm512_mask_mov_epi16(cc[b], cn, set16(zrw::mx::kElemNaN));
          }
        }
      }
      if constexpr (BK != BlockKind::None) {
        store_row<F, NB>(blk_data + r * ld + 32 * b0, bc, last, bad, nt, x,
                         &s.row_byte[r][b0], 1, nullptr);
      }
      if constexpr (COL) {
        store_row<F, NB>(col_data + r * ld + 32 * b0, cc, last, bad, nt, x, nullptr, 0,
                         s.col_byte + 32 * b0);
      }
    }
  };
  int b0 = 0;
  for (; b0 + 2 <= nbw; b0 += 2) group(b0, std::integral_constant<int, 2>{});
  if (b0 < nbw) group(b0, std::integral_constant<int, 1>{});
}

// ---- drivers ---------------------------------------------------------------------------------

// Blocks along rows only: `nmat` x (N, K) as rows of K.
template <ElemFormat F, typename T>
void quantize_rows(const T* src, int64_t rows, int64_t K, ScaleMode mode, uint8_t* data,
                   uint8_t* scale) {
  const int64_t KB = zrw::mx::ceil_div(K, kBlock);
  const bool nt = rows * K >= tuning().nt_min_bytes &&
                  reinterpret_cast<uintptr_t>(data) % 64 == 0;
  if (K % kBlock == 0) {
    // Whole blocks: the rows are one flat run of blocks.
    const int64_t nblocks = rows * KB, ngroups = zrw::mx::ceil_div(nblocks, 32);
    at::parallel_for(0, ngroups, 32, [&](int64_t g0, int64_t g1) {
      Scratch s;
      for (int64_t g = g0; g < g1; ++g) {
        const int nvec = static_cast<int>(std::min<int64_t>(32, nblocks - 32 * g));
        if (nvec == 32) {
          row_blocks_group<F, true>(src + 1024 * g, 32, 32, mode, data + 1024 * g,
                                    scale + 32 * g, nt, s);
        } else {
          row_blocks_group<F, false>(src + 1024 * g, nvec, 32, mode, data + 1024 * g,
                                     scale + 32 * g, nt, s);
        }
      }
      if (nt) _mm_sfence();
    });
    return;
  }
  const int last = static_cast<int>(K - (KB - 1) * kBlock);
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / K), [&](int64_t r0, int64_t r1) {
    Scratch s;
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t b0 = 0; b0 < KB; b0 += 32) {
        const int nvec = static_cast<int>(std::min<int64_t>(32, KB - b0));
        row_blocks_group<F, false>(src + r * K + 32 * b0, nvec, b0 + nvec == KB ? last : 32, mode,
                            data + r * K + 32 * b0, scale + r * KB + b0, false, s);
      }
    }
  });
}

// Strips of 32 rows: blocks down the columns, 32x32 tiles, both axes.
template <ElemFormat F, BlockKind BK, bool COL, typename T>
void quantize_strips(const T* src, int64_t nmat, int64_t N, int64_t K, ScaleMode mode,
                     uint8_t* blk_data, uint8_t* blk_scale, uint8_t* col_data,
                     uint8_t* col_scale) {
  const int64_t KB = zrw::mx::ceil_div(K, kBlock), NB = zrw::mx::ceil_div(N, kBlock);
  const int64_t total = nmat * NB;
  const bool aligned = K % 64 == 0 && reinterpret_cast<uintptr_t>(blk_data) % 64 == 0 &&
                       reinterpret_cast<uintptr_t>(col_data) % 64 == 0;
  const bool nt = aligned && nmat * N * K >= tuning().nt_min_bytes;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, kBlock * K));
  at::parallel_for(0, total, grain, [&](int64_t i0, int64_t i1) {
    auto s = std::make_unique<StripScratch>();
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / NB, strip = i % NB, r0 = strip * kBlock;
      const int nrows = static_cast<int>(std::min<int64_t>(kBlock, N - r0));
      const int64_t off = m * N * K + r0 * K;
      for (int64_t c0 = 0; c0 < K; c0 += kChunkCols) {
        const int W = static_cast<int>(std::min<int64_t>(kChunkCols, K - c0));
        uint8_t* bd = BK != BlockKind::None ? blk_data + off + c0 : nullptr;
        uint8_t* bs = nullptr;
        if constexpr (BK == BlockKind::Row) bs = blk_scale + m * N * KB + r0 * KB + c0 / kBlock;
        if constexpr (BK == BlockKind::Tile) bs = blk_scale + m * NB * KB + strip * KB + c0 / kBlock;
        uint8_t* cd = COL ? col_data + off + c0 : nullptr;
        uint8_t* cs = COL ? col_scale + m * NB * K + strip * K + c0 : nullptr;
        strip_chunk<F, BK, COL>(src + off + c0, K, nrows, W, mode, bd, bs, KB, cd, cs, nt,
                                /*pf_ok=*/true, *s);
      }
    }
    if (nt) _mm_sfence();
  });
}

}  // namespace zrw::cpu::ZRW_CPU_ISA::avx512_path

#pragma GCC diagnostic pop
